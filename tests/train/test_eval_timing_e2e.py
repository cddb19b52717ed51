"""The step after an evaluation is timed as any step: rank 0's scoring and writing are not another stage's wait."""

import copy
import json

import pytest

from tests.train.as_ranks import gpipe_train
from tests.train.recipes import TINY_TRANSLATION, write

pytestmark = pytest.mark.slow
SLOW_S = 1.5  # what rank 0 spends showing each eval here


def _slow_eval_view() -> None:
    """Rank 0 takes SLOW_S to show an eval record, as a long BLEU or a slow terminal would."""
    import time

    from gpipe_cli.train import view

    real = view.TerminalView.show

    def show(self, record, *args, **kwargs):
        if record.get("kind") == "eval":
            time.sleep(SLOW_S)
        return real(self, record, *args, **kwargs)

    view.TerminalView.show = show


def test_the_step_after_an_eval_does_not_count_rank_0s_eval_work_as_waiting(tmp_path):
    # Stage 1 started the step while rank 0 still wrote the eval: its wait, and the step, took that time too.
    recipe = copy.deepcopy(TINY_TRANSLATION)
    recipe["train"] = {"steps": 4}
    recipe["eval"] = {"every": 2, "batches": 1}
    out = tmp_path / "run"
    ranks = gpipe_train(2, str(write(tmp_path, recipe)), "--output-dir", str(out), "--threads", "1",
                        before=_slow_eval_view)
    assert ranks.code == 0, ranks.output
    records = {r["step"]: r for line in (out / "metrics.jsonl").read_text().splitlines()
               if (r := json.loads(line))["kind"] == "train"}
    after = records[3]
    assert max(after["time_s"]["wait"]) < SLOW_S / 2 and after["step_time_s"] < SLOW_S / 2, after
