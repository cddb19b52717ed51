"""`gpipe plan`'s flags are refused in one line naming the flag, never with a traceback."""

import pytest

from gpipe_cli.errors import UserError
from gpipe_cli.plan.options import PlanOptions, validate


@pytest.mark.parametrize("nodes", [0, -2])
def test_nodes_below_one_are_refused_like_any_other_count(nodes):
    # --nodes 0 divided --devices by zero: a ZeroDivisionError traceback.
    with pytest.raises(UserError, match=rf"^--nodes: must be >= 1 and <= 65536 \(got {nodes}\)$"):
        validate(PlanOptions(devices=2, nodes=nodes))
