"""`--resume` of places that hold nothing to resume, and of a run whose last metrics line was torn by a kill."""

from __future__ import annotations

import json
import shutil

from gpipe_cli.cli import app
from gpipe_cli.train import checkpoint
from gpipe_cli.train.resume import trim_metrics
from tests.train.test_existing_run import error_line, hashes, make_run, no_ranks, runner, train  # noqa: F401 (a fixture)


def test_a_run_directory_without_checkpoints_is_refused_before_any_rank_starts(tmp_path, no_ranks):  # noqa: F811
    path, _ = make_run(tmp_path, steps=(2,))
    empty = tmp_path / "empty"
    empty.mkdir()
    result = train(path, empty, "--resume", str(empty))  # --output-dir is where a resume writes: the run itself
    assert result.exit_code == 2, result.output
    assert error_line(result) == f"error: --resume {empty}: no usable checkpoint (there are no checkpoints there)"
    assert list(empty.iterdir()) == [] and not no_ranks


def test_a_run_whose_every_checkpoint_is_unfinished_is_refused_before_any_rank_starts(tmp_path, no_ranks):  # noqa: F811
    path, run = make_run(tmp_path, steps=(2, 4))
    for step in (2, 4):
        (checkpoint.path_for(run, step) / "manifest.json").unlink()
    before = hashes(run)
    result = train(path, run, "--resume", "latest")
    assert result.exit_code == 2, result.output
    line = error_line(result)
    assert line.startswith(f"error: --resume {run}: no usable checkpoint (step-00000004: it has no manifest")
    assert "step-00000002: it has no manifest" in line
    assert hashes(run) == before and not no_ranks
    # The refusal said no way on, and a new run in the folder was told to --resume it (round and round).
    aside = tmp_path / "aside"
    assert line.endswith(f"move its checkpoints/ aside, then gpipe train --resume --output-dir {run}")
    from gpipe_cli.train.existing import no_usable

    course = str(run / "checkpoints" / "superseded-20261205-133256-at-step-2")
    assert str(no_usable(course, ["step-00000004: it has no manifest"])).endswith("(step-00000004: it has no manifest)")
    (run / "checkpoints").rename(aside)
    result = runner.invoke(app, ["train", "--resume", "latest", "--output-dir", str(run), "--plain"])  # a bare one
    assert result.exit_code == 0, result.output
    assert "the run starts there again from step 0" in result.stdout and no_ranks == [1]


def test_a_name_the_run_writes_taken_by_the_other_kind_is_refused_before_any_rank_starts(tmp_path, no_ranks):  # noqa: F811
    # A file named checkpoints, or a folder named metrics.jsonl: a rank's FileExistsError traceback after set-up.
    path, run = make_run(tmp_path, steps=(2,))
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "checkpoints").write_text("")
    result = train(path, tmp_path / "new")
    assert result.exit_code == 2, result.output
    assert error_line(result) == (f"error: --output-dir {tmp_path / 'new'}: its checkpoints is not a folder, where the "
                                  "run keeps a folder of checkpoints; move it, or give another --output-dir")
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").mkdir()
    result = runner.invoke(app, ["train", "--resume", str(run), "--plain"])
    assert result.exit_code == 2, result.output
    assert error_line(result) == (f"error: --resume {run}: its metrics.jsonl is a folder, where the run keeps its "
                                  "records' file; move it aside to continue the run")
    assert not no_ranks


def test_a_resume_with_one_whole_checkpoint_still_starts_the_ranks(tmp_path, no_ranks):  # noqa: F811
    path, run = make_run(tmp_path, steps=(2, 4))
    (checkpoint.path_for(run, 4) / "manifest.json").unlink()  # the ranks fall back to step 2, saying so
    result = train(path, run, "--resume", "latest", "--set", "train.steps=9")
    assert result.exit_code == 0, result.output
    assert no_ranks == [1]


def test_a_torn_last_metrics_line_is_dropped_when_a_run_resumes(tmp_path):
    path = tmp_path / "metrics.jsonl"
    records = [{"kind": "train", "step": s, "loss": 1.0} for s in (1, 2, 3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"kind": "train", "step": 4, "lo')
    trim_metrics(path, 2)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]


def test_metrics_lines_that_are_not_records_are_dropped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"kind": "train", "step": 1}\n[1, 2]\n"text"\n{"step": "two"}\n\xff\xfe\n'
                     b'{"kind": "eval", "step": 1}\n{"kind": "train", "step": 5}\n')
    trim_metrics(path, 3)
    assert path.read_text() == '{"kind": "train", "step": 1}\n{"kind": "eval", "step": 1}\n'


def test_a_run_that_saved_no_checkpoint_is_told_how_to_start_again(tmp_path, no_ranks):  # noqa: F811
    # Stopped before its first checkpoint: a new run was told to --resume it, and that resume was refused.
    path, run = make_run(tmp_path, steps=(2,))
    shutil.rmtree(checkpoint.path_for(run, 2))
    again = f"start it again from step 0 with: gpipe train --resume --output-dir {run}"
    result = train(path, run)
    assert result.exit_code == 2, result.output
    assert error_line(result) == (f"error: --output-dir {run} already holds a run (its last step is 2) but no "
                                  f"checkpoint; {again}, or give another --output-dir for a new run")
    result = runner.invoke(app, ["train", "--resume", str(run), "--plain"])
    assert result.exit_code == 2, result.output
    assert error_line(result) == (f"error: --resume {run}: no usable checkpoint (there are no checkpoints there); "
                                  f"{again}")
    assert result.stdout == ""  # refused before the line that says what starts
    result = train(path, run, "--resume", "latest")  # as it says (a bare --resume is latest): it starts again
    assert result.exit_code == 0, result.output
    assert no_ranks == [1]


def test_a_bare_resume_with_no_run_of_its_name_is_refused_before_torch_loads(tmp_path, monkeypatch, no_ranks):  # noqa: F811
    # It planned the run first (seconds, torch imported) to say there was nothing to resume.
    import sys

    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "gpipe_cli.train.checkpoint", raising=False)
    result = runner.invoke(app, ["train", "--resume", "latest", "--set", "name=nosuch", "--plain"])
    assert result.exit_code == 2, result.output
    assert error_line(result) == ("error: --resume: no run of 'nosuch' with a complete checkpoint under "
                                  f"outputs/nosuch/ in {tmp_path}")
    assert "gpipe_cli.train.checkpoint" not in sys.modules and not no_ranks
    path, _ = make_run(tmp_path, steps=(2,))  # a recipe given: its name is looked for
    result = runner.invoke(app, ["train", str(path), "--resume", "latest", "--plain"])
    assert result.exit_code == 2, result.output
    assert error_line(result).startswith("error: --resume: no run of 'tiny-translation' with a complete checkpoint")
    assert "gpipe_cli.train.checkpoint" not in sys.modules and not no_ranks


def test_a_dry_run_of_a_resume_says_which_run_it_continues_and_from_which_step(tmp_path, no_ranks):  # noqa: F811
    # It said only the torchrun command: a bare --resume picks the newest run, which it did not name.
    path, run = make_run(tmp_path, steps=(2,))
    result = runner.invoke(app, ["train", "--resume", str(run), "--set", "train.steps=8", "--dry-run", "--plain"])
    assert result.exit_code == 0, result.output
    assert f"resuming {run} at step 2 with train.steps 3 -> 8 (--set)" in result.stdout and not no_ranks
    result = runner.invoke(app, ["train", "--resume", str(run), "--set", "train.steps=2", "--dry-run", "--plain"])
    assert result.exit_code == 0, result.output
    assert f"the run in {run} is already complete at step 2" in result.stdout and not no_ranks
