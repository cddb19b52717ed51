"""Checkpoint files: whole or refused, fallback to the previous one, safe loading."""

import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from gpipe_cli.errors import UserError
from gpipe_cli.runs import run_dir_of
from gpipe_cli.train import checkpoint
from gpipe_cli.train.resume import trim_metrics


def save_one(run_dir: Path, step: int, value: float = 1.0, keep: int = 5) -> nn.Module:
    module = nn.Linear(3, 2)
    with torch.no_grad():
        module.weight.fill_(value)
    state = checkpoint.state_of(module, None, {"train": {"step": torch.tensor(step)}})
    run_dir.mkdir(parents=True, exist_ok=True)  # a run's folder is made before its first checkpoint
    checkpoint.save(checkpoint.path_for(run_dir, step), state, {"step": step}, keep, rank=0, group=None)
    return module


def test_save_is_whole_and_newest_is_found(tmp_path):
    save_one(tmp_path, 3)
    save_one(tmp_path, 10, value=2.0)
    found, refused = checkpoint.newest_whole(tmp_path)
    assert found is not None and found.step == 10 and refused == []
    assert checkpoint.inspect(found.path)[1] is None
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
    assert "no manifest" in checkpoint.inspect(checkpoint.path_for(tmp_path, 5))[1]
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


def test_a_checkpoint_of_other_layers_is_named_so_not_called_corrupt(tmp_path):
    save_one(tmp_path, 2)
    found, _ = checkpoint.newest_whole(tmp_path)
    with pytest.raises(UserError) as info:  # the same model with its layers built otherwise
        checkpoint.load(found, nn.Sequential(nn.Linear(3, 2)), None, {"train": {"step": torch.tensor(0)}})
    why = str(info.value).removeprefix(f"cannot load checkpoint {found.path}: ")
    assert why == f"{checkpoint.OTHER_MODEL} (parameter 0.weight is missing)"
    assert checkpoint.refusal(found.path, why).startswith(f"checkpoint {found.path} is not of this model: ")


def test_trim_metrics_drops_records_after_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"kind": "train", "step": s}) + "\n" for s in range(1, 8)))
    trim_metrics(path, 4)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4]


def test_run_dir_of_accepts_runs_and_checkpoints(tmp_path):
    assert run_dir_of(str(tmp_path)) == tmp_path
    assert run_dir_of(str(tmp_path / "checkpoints" / "step-00000003")) == tmp_path
    assert run_dir_of(str(tmp_path / "checkpoints")) == tmp_path
    # A course a resume from an earlier step set aside, and one of its checkpoints: the run's recipe.yaml was not
    # found (the folder was taken for a run), and its ranks wrote checkpoints/ and a tokenizer into it.
    aside = tmp_path / "checkpoints" / "superseded-20261205-133256-at-step-2"
    assert run_dir_of(str(aside)) == tmp_path and run_dir_of(str(aside / "step-00000005")) == tmp_path


def test_run_dir_of_a_checkpoint_typed_from_inside_its_run_is_that_run(tmp_path, monkeypatch):
    # From inside checkpoints/, `step-00000002` was a run in '.': export wrote model.safetensors among the
    # checkpoints and said the run had no recipe.yaml; `superseded-.../step-...` was an IndexError traceback.
    aside = "superseded-20261205-133256-at-step-2"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run" / "checkpoints" / aside).mkdir(parents=True)
    assert run_dir_of("run/checkpoints/step-00000002") == Path("run")  # as typed, where it says enough
    monkeypatch.chdir(tmp_path / "run" / "checkpoints")
    for typed in ("step-00000002", aside, f"{aside}/step-00000005", "../checkpoints/step-00000002"):
        assert run_dir_of(typed).resolve() == tmp_path / "run", typed
    monkeypatch.chdir(tmp_path / "run")
    assert run_dir_of("checkpoints") == run_dir_of("checkpoints/step-00000002") == tmp_path / "run"
    assert run_dir_of(".") == Path(".")


def test_metadata_naming_anything_but_checkpoint_classes_is_refused(tmp_path):
    import pickle

    save_one(tmp_path, 1)
    found, _ = checkpoint.newest_whole(tmp_path)
    (found.path / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(UserError, match="refers to tests.train.test_checkpoint.Payload._run, which a checkpoint never"):
        checkpoint.load(found, nn.Linear(3, 2), None, {"train": {"step": torch.tensor(0)}})
    assert not Payload.ran


def flip(path: Path, count: int = 512) -> None:
    """Invert `count` bytes in the middle of a file, keeping its size."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2 - count // 2
    data[middle:middle + count] = bytes(b ^ 0xFF for b in data[middle:middle + count])
    path.write_bytes(bytes(data))


def test_every_file_has_a_checksum_and_flipped_bytes_are_refused(tmp_path):
    save_one(tmp_path, 5)
    save_one(tmp_path, 6, value=2.0)
    newest = checkpoint.path_for(tmp_path, 6)
    manifest = json.loads((newest / checkpoint.MANIFEST).read_text())
    assert set(manifest["checksums"]) == set(manifest["files"]) and ".metadata" in manifest["files"]
    data = next(p for p in newest.iterdir() if p.suffix == ".distcp")
    flip(data)
    assert checkpoint.inspect(newest)[1] is None, "sizes alone cannot see flipped bytes"
    found, refused = checkpoint.newest_whole(tmp_path, verify=True)
    assert found is not None and found.step == 5
    assert len(refused) == 1 and f"file {data.name} does not match its checksum" in refused[0]


def test_a_file_that_cannot_be_read_is_named_and_the_checkpoint_before_it_used(tmp_path, monkeypatch):
    # A shard this process may not read was a PermissionError traceback in export and resume.
    save_one(tmp_path, 5)
    save_one(tmp_path, 6, value=2.0)
    newest = checkpoint.path_for(tmp_path, 6)
    data = next(p for p in newest.iterdir() if p.suffix == ".distcp")
    read = checkpoint.checksum

    def checksum(path: Path) -> str:
        if path == data:
            raise PermissionError(13, "Permission denied", str(path))
        return read(path)

    monkeypatch.setattr(checkpoint, "checksum", checksum)
    found, refused = checkpoint.newest_whole(tmp_path, verify=True)
    assert found is not None and found.step == 5
    assert refused == [f"checkpoint {newest} is incomplete or corrupt: file {data.name} cannot be read (Permission "
                       "denied); using the one before it"]


@pytest.mark.parametrize("step", ['"seven"', "-1", "true", "null", "1.5"])
def test_a_manifest_with_a_bad_step_is_refused(tmp_path, step):
    save_one(tmp_path, 2)
    path = checkpoint.path_for(tmp_path, 2)
    text = (path / checkpoint.MANIFEST).read_text()
    (path / checkpoint.MANIFEST).write_text(text.replace('"step": 2', f'"step": {step}'))
    assert "which is not a step count" in checkpoint.inspect(path)[1]
    assert checkpoint.newest_whole(tmp_path)[0] is None


def test_a_damaged_checkpoint_does_not_count_towards_keep(tmp_path):
    for step in (1, 2):
        save_one(tmp_path, step, keep=2)
    (checkpoint.path_for(tmp_path, 2) / checkpoint.MANIFEST).unlink()  # damaged after it was written
    save_one(tmp_path, 3, keep=2)
    names = [p.name for p in checkpoint.candidates(tmp_path)]
    assert names == ["step-00000003", "step-00000002", "step-00000001"], "the last good ones are kept"
    save_one(tmp_path, 4, keep=2)
    assert [p.name for p in checkpoint.candidates(tmp_path)] == ["step-00000004", "step-00000003"]


def test_a_failed_write_removes_its_partial_folder_and_says_how_much_space_is_left(tmp_path, monkeypatch):
    save_one(tmp_path, 1)
    monkeypatch.setenv(checkpoint.FAULT_ENV, "enospc@2")
    with pytest.raises(checkpoint.CheckpointWriteError) as failed:
        save_one(tmp_path, 2)
    message = str(failed.value)
    assert "\n" not in message
    assert "cannot write checkpoint step-00000002 (ENOSPC: No space left on device)" in message
    assert " free on " in message and "earlier checkpoints are intact" in message
    assert message.endswith(f"; once it can be written, continue with gpipe train --resume {tmp_path}")
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-00000001"]
    assert checkpoint.inspect(checkpoint.path_for(tmp_path, 1), verify=True)[1] is None


def test_a_short_write_reported_by_torch_says_what_it_means(tmp_path):
    # On a full disk torch's zip writer can fail before the file system says ENOSPC, in words of its own.
    torn = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    message = checkpoint._write_failure(checkpoint.path_for(tmp_path, 2), torn)
    assert "unexpected pos 704 vs 598; a write fell short, as on a full disk)" in message, message


def checkpointer(run_dir: Path):
    from types import SimpleNamespace

    from gpipe_cli.pipeline import topology
    from gpipe_cli.pipeline.config import PipelineConfig
    from gpipe_cli.pipeline.engine import Pipeline
    from gpipe_cli.pipeline.layers import build_layers
    from gpipe_cli.train.resume import Checkpointer

    topo = topology.local()
    pipe = Pipeline(build_layers([lambda: nn.Linear(3, 2)], [0], 0), topo, PipelineConfig(balance=(1,)), nn.MSELoss())
    optimizer = torch.optim.Adam(pipe.parameters())
    return Checkpointer(pipe, optimizer, None, topo, SimpleNamespace(balance=[1]), run_dir, keep=5)


def test_resume_skips_what_does_not_load_and_stops_in_one_line_when_nothing_does(tmp_path, capsys):
    saver = checkpointer(tmp_path)
    for step in (2, 4):
        saver.save(step, epoch=1)
    newest = checkpoint.path_for(tmp_path, 4)
    manifest = json.loads((newest / checkpoint.MANIFEST).read_text())
    manifest["step"] = 3  # disagrees with the step stored inside: not this checkpoint's manifest
    (newest / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    found = checkpointer(tmp_path).resume(str(tmp_path))
    assert found.step == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"checkpoint {newest} is incomplete or corrupt: it holds step 4" in err
    # One checkpoint named has none before it: the refusal alone says it (it also said "using the one before it").
    with pytest.raises(UserError, match="no usable checkpoint"):
        checkpointer(tmp_path).resume(str(newest))
    assert capsys.readouterr().err == ""
    flip(checkpoint.path_for(tmp_path, 2) / ".metadata", 16)
    with pytest.raises(UserError, match="no usable checkpoint") as stopped:
        checkpointer(tmp_path).resume(str(tmp_path))
    assert "\n" not in str(stopped.value)
    assert capsys.readouterr().err.count("using the one before it") == 1  # step 4's; step 2 had none before it


def test_a_tied_copy_resumes_its_optimizer_state_on_another_cut(tmp_path):
    # At K=1 an embedding and a softmax tied to it are one tensor, whose optimizer state torch saves under the first
    # name only; at K=2 the softmax's stage holds its own copy, with the same state, under the second name.
    tied = [("0.weight", "1.weight")]
    whole = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    whole[1].weight = whole[0].weight
    opt = torch.optim.Adam(whole.parameters())
    whole(torch.randn(2, 3)).sum().backward()
    opt.step()
    state = checkpoint.state_of(whole, opt, {"train": {"step": torch.tensor(1)}})
    assert "state.1.weight.exp_avg" not in state["optim"]
    checkpoint.save(checkpoint.path_for(tmp_path, 1), state, {"step": 1}, 5, rank=0, group=None)
    found, _ = checkpoint.newest_whole(tmp_path)
    second = nn.Sequential(nn.Identity(), nn.Linear(3, 3))  # the later stage: layer 1 alone
    second_opt = torch.optim.Adam(second.parameters())
    second(torch.randn(2, 3)).sum().backward()
    second_opt.step()  # state to be replaced by the checkpoint's
    checkpoint.load(found, second, second_opt, {"train": {"step": torch.tensor(0)}}, tied)
    assert torch.equal(second[1].weight, whole[0].weight)
    assert torch.equal(second_opt.state[second[1].weight]["exp_avg"], opt.state[whole[0].weight]["exp_avg"])
    assert torch.equal(second_opt.state[second[1].bias]["exp_avg"], opt.state[whole[1].bias]["exp_avg"])
    # Without the groups the copy's state is missing, as before: named as another model's.
    with pytest.raises(UserError, match="optim.state.1.weight"):
        checkpoint.load(found, second, second_opt, {"train": {"step": torch.tensor(0)}})


def test_a_file_grown_since_it_was_written_is_refused_by_its_size(tmp_path):
    save_one(tmp_path, 5)
    newest = checkpoint.path_for(tmp_path, 5)
    data = next(p for p in newest.iterdir() if p.suffix == ".distcp")
    size = data.stat().st_size
    with open(data, "ab") as f:
        f.write(b"\0" * 8)
    assert checkpoint.inspect(newest)[1] == f"file {data.name} has {size + 8} bytes where {size} were written"


def test_the_newest_checkpoint_is_the_highest_step_whatever_was_touched_last(tmp_path):
    # Picked by time, step 3 touched after step 10 was written (copied back, restored from a backup) would be resumed
    # and exported as the newest; its name's step decides.
    save_one(tmp_path, 3)
    save_one(tmp_path, 10, value=2.0)
    later = checkpoint.path_for(tmp_path, 10).stat().st_mtime + 60
    os.utime(checkpoint.path_for(tmp_path, 3), (later, later))
    found, _ = checkpoint.newest_whole(tmp_path)
    assert found is not None and found.step == 10
    assert [p.name for p in checkpoint.candidates(tmp_path)] == ["step-00000010", "step-00000003"]
