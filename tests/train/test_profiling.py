"""`train.profile`: chosen steps traced on every rank, with the pipeline's actions as named ranges."""

import copy
import json

import pytest

from gpipe_cli.errors import UserError
from gpipe_cli.recipe.load import load_recipe
from tests.train.recipes import TINY_AMOEBANET, write
from tests.train.test_train_e2e import gpipe


def test_profile_steps_must_be_in_order(tmp_path):
    recipe = copy.deepcopy(TINY_AMOEBANET)
    recipe["train"]["profile"] = {"steps": [3, 2]}
    with pytest.raises(UserError, match="start <= end"):
        load_recipe(str(write(tmp_path, recipe)), [])


@pytest.mark.slow
def test_a_profiled_run_writes_a_trace_per_rank_with_ops_and_pipeline_ranges(tmp_path):
    recipe = copy.deepcopy(TINY_AMOEBANET)
    recipe["train"] = {"steps": 3, "profile": {"steps": [2, 2]}}
    recipe["eval"] = {}
    out = tmp_path / "run"
    proc = gpipe("train", str(write(tmp_path, recipe)), "--output-dir", str(out), "--plain")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "profile: steps 2-2 traced" in proc.stdout
    for rank in (0, 1):
        names = {e.get("name", "") for e in json.loads((out / "profile" / f"rank{rank}.json").read_text())
                 ["traceEvents"]}
        assert any(n.startswith("aten::") for n in names), rank
        micro = recipe["pipeline"]["microbatches"]
        assert {f"fwd mb{m}" for m in range(micro)} <= names and {f"bwd mb{m}" for m in range(micro)} <= names
        sends = "send_fwd" if rank == 0 else "recv_fwd"
        assert f"{sends} mb0" in names
        assert "recompute mb0" in names  # except_last: all but the micro-batch whose backward follows at once
