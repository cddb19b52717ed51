"""Checkpoint files: whole or refused, fallback to the previous one, safe loading."""

import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from gpipe_cli.errors import UserError
from gpipe_cli.train import checkpoint
from gpipe_cli.train.resume import run_dir_of, trim_metrics


def save_one(run_dir: Path, step: int, value: float = 1.0, keep: int = 5) -> nn.Module:
    module = nn.Linear(3, 2)
    with torch.no_grad():
        module.weight.fill_(value)
    state = checkpoint.state_of(module, None, {"train": {"step": torch.tensor(step)}})
    checkpoint.save(checkpoint.path_for(run_dir, step), state, {"step": step}, keep, rank=0, group=None)
    return module


def test_save_is_whole_and_newest_is_found(tmp_path):
    save_one(tmp_path, 3)
    save_one(tmp_path, 10, value=2.0)
    found, refused = checkpoint.newest_whole(tmp_path)
    assert found is not None and found.step == 10 and refused == []
    assert checkpoint.problem(found.path) is None
    assert not list((tmp_path / "checkpoints").glob(".*")), "no partial folder is left behind"
    module = nn.Linear(3, 2)
    extra = checkpoint.load(found, module, None, {"train": {"step": torch.tensor(0)}})
    assert int(extra["train"]["step"]) == 10 and torch.all(module.weight == 2.0)


def test_keep_prunes_old_checkpoints(tmp_path):
    for step in (1, 2, 3, 4):
        save_one(tmp_path, step, keep=2)
    assert [p.name for p in checkpoint.candidates(tmp_path)] == ["step-00000004", "step-00000003"]


def test_truncated_or_unfinished_checkpoints_are_refused_and_the_previous_used(tmp_path):
    save_one(tmp_path, 5)
    save_one(tmp_path, 6)
    newest = checkpoint.path_for(tmp_path, 6)
    data = next(p for p in newest.iterdir() if p.suffix == ".distcp")
    os.truncate(data, data.stat().st_size // 2)
    found, refused = checkpoint.newest_whole(tmp_path)
    assert found is not None and found.step == 5
    assert len(refused) == 1 and "incomplete or corrupt" in refused[0] and data.name in refused[0]
    (checkpoint.path_for(tmp_path, 5) / checkpoint.MANIFEST).unlink()
    assert "no manifest" in checkpoint.problem(checkpoint.path_for(tmp_path, 5))
    assert checkpoint.newest_whole(tmp_path)[0] is None


class Payload:
    """Unpickling this would run code; safe loading must refuse it."""

    ran = False

    def __reduce__(self):
        return (Payload._run, ())

    @staticmethod
    def _run():
        Payload.ran = True
        return 0


def test_loading_never_unpickles_arbitrary_objects(tmp_path):
    module = nn.Linear(3, 2)
    state = checkpoint.state_of(module, None, {"train": {"step": Payload()}})
    checkpoint.save(checkpoint.path_for(tmp_path, 1), state, {"step": 1}, 3, rank=0, group=None)
    found, _ = checkpoint.newest_whole(tmp_path)
    with pytest.raises(UserError, match="cannot load checkpoint .*: it holds an object that is not plain data"):
        checkpoint.load(found, nn.Linear(3, 2), None, {"train": {"step": 0}})
    assert not Payload.ran


def test_trim_metrics_drops_records_after_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"kind": "train", "step": s}) + "\n" for s in range(1, 8)))
    trim_metrics(path, 4)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4]


def test_run_dir_of_accepts_runs_and_checkpoints(tmp_path):
    assert run_dir_of(str(tmp_path)) == tmp_path
    assert run_dir_of(str(tmp_path / "checkpoints" / "step-00000003")) == tmp_path


def test_metadata_naming_anything_but_checkpoint_classes_is_refused(tmp_path):
    import pickle

    save_one(tmp_path, 1)
    found, _ = checkpoint.newest_whole(tmp_path)
    (found.path / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(UserError, match="refers to tests.train.test_checkpoint.Payload._run, which a checkpoint never"):
        checkpoint.load(found, nn.Linear(3, 2), None, {"train": {"step": torch.tensor(0)}})
    assert not Payload.ran
