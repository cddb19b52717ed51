"""A resume goes on with everything a run never stopped would have: the optimizer settings its `--set` gives,
a loss scale of its own when it turns to fp16, and the skipped steps in a row before it; through the ranks."""

import copy
import json
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.train.as_ranks import gpipe_train
from tests.train.recipes import TINY_TRANSLATION, write

pytestmark = pytest.mark.slow


def recipe(folder: Path, **sections) -> Path:
    raw = copy.deepcopy(TINY_TRANSLATION)
    raw.update(checkpoint={"every": 1, "keep": 5}, eval={}, **sections)
    return write(folder, raw)


def saved(step_folder: Path) -> dict:
    dcp_to_torch_save(step_folder, step_folder.parent / "whole.pt")
    return torch.load(step_folder.parent / "whole.pt", weights_only=False)


def test_a_resume_takes_its_set_optimizer_settings_and_starts_its_own_loss_scale(tmp_path):
    # The checkpoint's optimizer settings undid the --set the resume announced; an fp32 run's scale of 1 came
    # back as fp16's, to grow only after 2,000 clean steps; torch warned of its scheduler on each rank.
    run = tmp_path / "run"
    path = recipe(tmp_path, train={"steps": 2}, optimizer={"name": "sgd", "lr": 0.01, "momentum": 0.9})
    assert gpipe_train(2, str(path), "--output-dir", str(run), "--threads", "1").codes == [0, 0]
    resumed = gpipe_train(2, "--resume", str(run), "--threads", "1", "--set", "train.steps=3", "--set",
                          "optimizer.momentum=0.5", "--set", "optimizer.weight_decay=0.01", "--set",
                          "train.precision=fp16")
    assert resumed.codes == [0, 0], resumed.stderr[-3000:]
    assert "optimizer.momentum 0.9 -> 0.5" in resumed.stdout and "Warning" not in resumed.stderr
    state = saved(run / "checkpoints" / "step-00000003")
    groups = {key.rsplit(".", 1)[1]: value for key, value in state["optim"].items() if key.startswith("param_groups")
              and key.endswith((".momentum", ".weight_decay"))}
    assert groups == {"momentum": 0.5, "weight_decay": 0.01}
    assert state["train"]["loss_scale"][0] >= 2.0 ** 14  # 2 ** 16, halved at most twice in a step
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    scales = [r.get("loss_scale") for r in records if r["kind"] == "train"]
    assert scales == [None, None, state["train"]["loss_scale"][0]]  # recorded for the fp16 step alone


def test_a_resume_counts_the_steps_skipped_in_a_row_before_it(tmp_path):
    # The count began again at 0: with train.max_skipped 3, steps 2 and 3 skipped before the resume and step 4
    # after it trained on.
    run = tmp_path / "run"
    path = recipe(tmp_path, train={"steps": 3, "on_nonfinite": "skip", "max_skipped": 3},
                  optimizer={"name": "sgd", "lr": 1e6, "momentum": 0.9})
    first = gpipe_train(2, str(path), "--output-dir", str(run), "--threads", "1")
    assert first.codes == [0, 0] and "(2 in a row, 2 in all; 3 in a row stop the run)" in first.stdout
    resumed = gpipe_train(2, "--resume", str(run), "--threads", "1", "--set", "train.steps=6")
    assert resumed.code == 3
    assert "stopped at step 4 (3 steps in a row skipped, train.max_skipped: 3)" in resumed.output
