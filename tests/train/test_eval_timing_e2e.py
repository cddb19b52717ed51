"""An evaluation between steps: the step after it is timed as any step, and a Ctrl-C during it says what it stops."""

import copy
import json

import pytest

from tests.train.as_ranks import gpipe_train
from tests.train.recipes import TINY_TRANSLATION, write

pytestmark = pytest.mark.slow
SLOW_S = 4.0  # what rank 0 spends showing the mid-run eval here: a step of 2 ranks on 2 busy cores takes under half


def _slow_eval_view() -> None:
    """Rank 0 takes SLOW_S to show the eval record of step 2, as a long BLEU or a slow terminal would."""
    import time

    from gpipe_cli.train import view

    real = view.TerminalView.show

    def show(self, record, *args, **kwargs):
        if record.get("kind") == "eval" and record.get("step") == 2:
            time.sleep(SLOW_S)
        return real(self, record, *args, **kwargs)

    view.TerminalView.show = show


def _four_steps_evaluated_every_two(tmp_path, before):
    """Train 4 steps with an evaluation after step 2, each rank first calling `before`: how it ended, and its run."""
    recipe = copy.deepcopy(TINY_TRANSLATION)
    recipe["train"] = {"steps": 4}
    recipe["eval"] = {"every": 2, "batches": 1}
    out = tmp_path / "run"
    return gpipe_train(2, str(write(tmp_path, recipe)), "--output-dir", str(out), "--threads", "1",
                       before=before), out


def test_the_step_after_an_eval_does_not_count_rank_0s_eval_work_as_waiting(tmp_path):
    # Stage 1 started the step while rank 0 still wrote the eval: its wait, and the step, took that time too.
    ranks, out = _four_steps_evaluated_every_two(tmp_path, _slow_eval_view)
    assert ranks.code == 0, ranks.output
    records = {r["step"]: r for line in (out / "metrics.jsonl").read_text().splitlines()
               if (r := json.loads(line))["kind"] == "train"}
    after = records[3]
    assert max(after["time_s"]["wait"]) < SLOW_S / 2 and after["step_time_s"] < SLOW_S / 2, after
    # Every 2 steps of 4: after step 2, and once at the end (not a mid-run one at step 4 besides the final one).
    assert [r["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
            if (r := json.loads(line))["kind"] == "eval"] == [2, 4]


def _ctrl_c_in_first_eval() -> None:
    """Rank 0 gets a Ctrl-C as the evaluation at step 2 begins, as a person pressing it then would send."""
    import os
    import signal

    from gpipe_cli.train import loop

    real = loop.Trainer.evaluate

    def evaluate(self, step, final=False):
        if os.environ["RANK"] == "0" and not final:
            os.kill(os.getpid(), signal.SIGINT)
        return real(self, step, final)

    loop.Trainer.evaluate = evaluate


def test_a_ctrl_c_during_an_evaluation_says_it_cuts_that_evaluation_short_and_saves_its_step(tmp_path):
    # It said "stopping after this step", of a step already done.
    ranks, out = _four_steps_evaluated_every_two(tmp_path, _ctrl_c_in_first_eval)
    assert ranks.code == 130, ranks.output
    assert ("[gpipe] SIGINT: stopping the evaluation at step 2; step 2 is saved before the run stops (Ctrl-C again "
            "to abort at once)") in ranks.stderr, ranks.output
    assert (out / "checkpoints" / "step-00000002").is_dir()
    # The resume evaluates step 2 first: the stop had left the run without that record for good.
    resumed = gpipe_train(2, "--resume", str(out), "--threads", "1")
    assert resumed.code == 0, resumed.output
    assert "evaluating step 2 first: the run's records hold no evaluation of it" in resumed.stdout
    evals = [r["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if (r := json.loads(line))["kind"] == "eval"]
    assert evals == [2, 4], evals
    again = gpipe_train(2, "--resume", str(out), "--threads", "1")  # complete, every evaluation recorded
    assert again.code == 0 and "already complete at step 4" in again.stdout, again.output
    # A checkpoint before the newest, at the end of a shorter run, with no record of its evaluation: its course
    # went on past it, and an evaluation of step 2 after step 4's would be out of place.
    metrics = out / "metrics.jsonl"
    metrics.write_text("".join(line + "\n" for line in metrics.read_text().splitlines()
                               if (r := json.loads(line))["kind"] != "eval" or r["step"] != 2))
    earlier = gpipe_train(2, "--resume", str(out / "checkpoints" / "step-00000002"), "--set", "train.steps=2",
                          "--threads", "1")
    assert earlier.code == 0 and "the end already; nothing to do" in earlier.stdout, earlier.output
    assert [r["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
            if (r := json.loads(line))["kind"] == "eval"] == [4]
