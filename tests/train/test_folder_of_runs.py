"""A folder of runs (outputs/, outputs/NAME) given where one run is wanted: one line naming its newest run."""

from __future__ import annotations

import os

import pytest

from gpipe_cli.cli import run


@pytest.mark.parametrize("command", [["export"], ["report"], ["train", "--plain", "--resume"]])
@pytest.mark.parametrize("depth", [1, 2])
def test_a_folder_of_runs_is_answered_with_its_newest_run(tmp_path, monkeypatch, capsys, command, depth):
    monkeypatch.setattr("gpipe_cli.train.run.launch", lambda *args, **kwargs: pytest.fail("a rank started"))
    outputs = tmp_path / "outputs"
    for stamp, when in (("20261204-100000", 1_000), ("20261204-110000", 2_000)):
        folder = outputs / "quickstart" / stamp
        folder.mkdir(parents=True)
        (folder / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')
        os.utime(folder / "metrics.jsonl", (when, when))
        os.utime(folder, (when, when))
    (outputs / "empty").mkdir()  # a folder without records is no run to point to
    given = outputs if depth == 2 else outputs / "quickstart"
    before = sorted(tmp_path.rglob("*"))
    assert run([*command, str(given)]) == 2
    captured = capsys.readouterr()
    newest = outputs / "quickstart" / "20261204-110000"
    prefix = "--resume " if "--resume" in command else ""
    assert captured.err == (f"error: {prefix}{given}: not a run directory but a folder of runs; give one, such as the "
                            f"newest: {newest}\n")
    assert sorted(tmp_path.rglob("*")) == before


def test_the_newest_run_is_the_one_that_trained_last_not_the_last_written_in(tmp_path):
    # A report.png written into the older run moved its folder's time, and it was called the newest.
    from pathlib import Path

    from gpipe_cli.runs import newest_run_in

    for name, trained, touched in (("k1", 2_000, 2_000), ("k2", 1_000, 3_000)):
        folder = Path(tmp_path, name)
        folder.mkdir()
        (folder / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')
        os.utime(folder / "metrics.jsonl", (trained, trained))
        os.utime(folder, (touched, touched))
    assert newest_run_in(tmp_path) == tmp_path / "k1"
