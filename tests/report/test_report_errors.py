"""`gpipe report` on inputs and outputs it cannot use: one line, a non-zero exit, nothing written."""

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpipe_cli.cli import run as cli
from gpipe_cli.train.claim import LOCK
from tests.report.test_report import make_run

# As root, permission bits block nothing: drop the capabilities that pass them by.
UNPRIVILEGED = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner"]


def files(folder: Path) -> set[Path]:
    return set(folder.rglob("*"))


def one_line(err: str) -> bool:
    return err.count("\n") == 1 and "Traceback" not in err


def gpipe_unprivileged(*args: str) -> subprocess.CompletedProcess:
    """`gpipe ARGS` as a user whom permission bits stop (root without its overriding capabilities)."""
    prefix: list[str] = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root passes permission bits, and setpriv is not here to drop that")
        prefix = UNPRIVILEGED
    return subprocess.run([*prefix, sys.executable, "-m", "gpipe_cli.cli", *args], capture_output=True, text=True,
                          timeout=120)


@pytest.fixture
def locked(tmp_path):
    """A read-only folder (writable again afterwards, so that pytest can remove it)."""
    folder = tmp_path / "locked"
    folder.mkdir()
    yield folder
    folder.chmod(0o755)


def test_a_read_only_run_still_shows_its_tables_and_one_line_says_to_give_output(locked):
    run = make_run(locked / "run", 2)
    run.chmod(0o555)
    before = files(locked)
    try:
        done = gpipe_unprivileged("report", str(run))
    finally:
        run.chmod(0o755)
    assert done.returncode == 2 and one_line(done.stderr)
    assert str(run / "report.png") in done.stderr and "--output" in done.stderr
    assert "K=2 M=4 1f1b" in done.stdout
    assert files(locked) == before


def test_an_output_in_a_read_only_folder_is_one_line_and_shows_nothing(locked, tmp_path):
    run = make_run(tmp_path / "run", 2)
    locked.chmod(0o555)
    before = files(tmp_path)
    done = gpipe_unprivileged("report", str(run), "--output", str(locked / "sub" / "x.png"))
    assert done.returncode == 2 and one_line(done.stderr) and "x.png" in done.stderr
    assert done.stdout == ""
    assert files(tmp_path) == before


@pytest.mark.parametrize("where", ["a directory", "under a file", "a symbolic link", "the default place, a directory"])
def test_an_output_that_cannot_be_a_file_is_one_line(tmp_path, capsys, where):
    run = make_run(tmp_path / "run", 2)
    (tmp_path / "somedir").mkdir()
    (tmp_path / "file").write_text("")
    (tmp_path / "link.png").symlink_to("file")  # the rename would replace the link, not write where it points
    (run / "report.png").mkdir()
    target = {"a directory": tmp_path / "somedir", "under a file": tmp_path / "file" / "x.png",
              "a symbolic link": tmp_path / "link.png", "the default place, a directory": None}[where]
    before = files(tmp_path)
    assert cli(["report", str(run), *(["--output", str(target)] if target else [])]) == 2
    captured = capsys.readouterr()
    assert one_line(captured.err) and str(target or run / "report.png") in captured.err
    # A bad --output is refused before the tables; the default place after them, saying what to do instead.
    assert ("K=2 M=4 1f1b" in captured.out) == (target is None)
    assert ("--output: cannot write" in captured.err) == (target is not None)
    assert ("give --output FILE" in captured.err) == (target is None)
    assert files(tmp_path) == before and (tmp_path / "link.png").is_symlink()


def test_a_file_of_the_users_where_the_page_goes_by_default_is_kept_and_named(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runs = [str(make_run(tmp_path / name, 2)) for name in ("a", "b")]
    (tmp_path / "report.png").write_text("my notes\n")
    assert cli(["report", *runs]) == 2
    out, err = capsys.readouterr()
    assert one_line(err) and "would write its page to 'report.png', a file that holds no PNG image" in err
    assert out == ""  # said before the tables (it came after all of them)
    assert (tmp_path / "report.png").read_text() == "my notes\n"
    (tmp_path / "report.png").write_bytes(b"")  # an empty file, or a page written before, is replaced
    assert cli(["report", *runs]) == 0 and (tmp_path / "report.png").read_bytes().startswith(b"\x89PNG")


def test_a_disk_that_fills_while_the_page_is_written_is_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    run = make_run(tmp_path / "run", 2)
    before = files(tmp_path)

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    assert cli(["report", str(run)]) == 2
    err = capsys.readouterr().err
    assert one_line(err) and "report.png" in err and os.strerror(errno.ENOSPC) in err
    assert files(tmp_path) == before


@pytest.mark.parametrize("args, says", [
    (["RUN"], "error: RUN_DIR: '"),  # the argument's name in --help and the docs (it said RUN)
    (["run", "--output", "RUN.png"], "error: --output: cannot write '"),
], ids=["run", "output"])
def test_a_name_too_long_is_one_line_naming_the_argument_and_what_is_allowed(tmp_path, capsys, monkeypatch, args,
                                                                             says):
    # Python 3.11's pathlib raised "File name too long" from exists(): a traceback.
    make_run(tmp_path / "run", 2)
    monkeypatch.chdir(tmp_path)
    before = files(tmp_path)
    long = "a" * 300
    assert cli(["report", *[a.replace("RUN", long) for a in args]]) == 2
    captured = capsys.readouterr()
    assert one_line(captured.err) and captured.err.startswith(says + "aaa"), captured.err
    assert f"has a name of {len(long) + 4 * ('--output' in args)} bytes; a name may have at most 255 bytes, a " \
           "path at most 4095 bytes" in captured.err
    assert files(tmp_path) == before


@pytest.mark.parametrize("name, content, says", [
    ("recipe.yaml", b": : :\n", "not valid YAML"),
    ("recipe.yaml", b"\xff\xfe\x00binary", "not UTF-8"),
    ("metrics.jsonl", bytes(range(256)) * 20, "no usable train record"),
    ("metrics.jsonl", b'{"kind":"train","step":4}\n', "no usable train record (1 malformed line (line 1))"),
], ids=["recipe not YAML", "recipe not text", "metrics binary", "metrics record without its figures"])
def test_an_input_file_that_cannot_be_read_is_one_line(tmp_path, capsys, name, content, says):
    run = make_run(tmp_path / "run", 2)
    (run / name).write_bytes(content)
    before = files(tmp_path)
    assert cli(["report", str(run)]) == 2
    captured = capsys.readouterr()
    assert one_line(captured.err) and str(run / name) in captured.err and says in captured.err
    assert captured.out == "" and files(tmp_path) == before


def test_malformed_records_are_skipped_with_one_warning_naming_the_first(tmp_path, capsys):
    run = make_run(tmp_path / "run", 2)
    lines = (run / "metrics.jsonl").read_text().split("\n")
    lines[2:2] = ['{"kind":"train","step":4}', "not json", '{"kind":"train","step":"x","time_s":{}}']
    (run / "metrics.jsonl").write_text("\n".join(lines))
    assert cli(["report", str(run)]) == 0
    captured = capsys.readouterr()
    assert captured.err == f"warning: {run / 'metrics.jsonl'}: skipped 3 malformed lines, the first on line 3\n"
    assert "K=2 M=4 1f1b" in captured.out and (run / "report.png").is_file()



def test_a_train_record_that_timed_no_stage_is_skipped_as_malformed(tmp_path, capsys):
    from gpipe_cli.records import usable

    # A record whose compute times name no stage was read as a usable step, with no warning.
    run = make_run(tmp_path / "run", 2)
    lines = (run / "metrics.jsonl").read_text().split("\n")
    record = json.loads(lines[0])
    assert usable(record)
    record["time_s"]["compute"] = []
    assert not usable(record)
    lines[0] = json.dumps(record)
    (run / "metrics.jsonl").write_text("\n".join(lines))
    assert cli(["report", str(run)]) == 0
    captured = capsys.readouterr()
    assert captured.err == f"warning: {run / 'metrics.jsonl'}: skipped 1 malformed line (line 1)\n"

def test_a_last_line_cut_short_is_left_out_with_a_warning(tmp_path, capsys):
    run = make_run(tmp_path / "run", 2, cut=True)  # its metrics.jsonl ends in a line cut short, as a crash leaves it
    text = (run / "metrics.jsonl").read_text()
    assert not text.endswith("\n")
    assert cli(["report", str(run)]) == 0
    last = text.count("\n") + 1
    assert capsys.readouterr().err == (f"warning: {run / 'metrics.jsonl'}: skipped the last line ({last}), "
                                       "unfinished: still being written or cut short\n")


def test_a_run_not_started_is_left_out_of_several_with_a_warning_and_alone_is_one_line(tmp_path, capsys,
                                                                                       monkeypatch):
    """`gpipe report outputs/x/*` stopped at a run that had no step yet, and no report was made for the others."""
    monkeypatch.chdir(tmp_path)  # where the page of several runs goes
    run = make_run(tmp_path / "run", 2)
    starting = tmp_path / "starting"
    starting.mkdir()
    (starting / "metrics.jsonl").write_text("")
    assert cli(["report", str(run), str(starting)]) == 0
    captured = capsys.readouterr()
    assert captured.err == f"warning: {starting / 'metrics.jsonl'}: holds no train records yet; left out\n"
    assert "K=2 M=4 1f1b" in captured.out and (tmp_path / "report.png").is_file()
    before = files(tmp_path)
    assert cli(["report", str(starting)]) == 2
    captured = capsys.readouterr()
    assert one_line(captured.err) and "holds no train records yet" in captured.err and files(tmp_path) == before


def test_a_run_whose_launch_was_killed_before_its_ranks_is_left_out_of_several(tmp_path, capsys, monkeypatch):
    # Its folder holds the train lock alone: `gpipe report outputs/x/*` made no report for the others.
    monkeypatch.chdir(tmp_path)
    run = make_run(tmp_path / "run", 2)
    killed = tmp_path / "killed"
    killed.mkdir()
    (killed / LOCK).write_text("12345 host\n")
    assert cli(["report", str(run), str(killed)]) == 0
    captured = capsys.readouterr()
    assert captured.err == (f"warning: {killed}: no metrics.jsonl yet (a run starting, or stopped before its first "
                            "step); left out\n")
    assert "K=2 M=4 1f1b" in captured.out and (tmp_path / "report.png").is_file()
    assert cli(["report", str(killed)]) == 2 and one_line(capsys.readouterr().err)


@pytest.mark.filterwarnings("ignore:Tight layout not applied")  # the page's long title: not this test's subject
def test_piped_tables_cut_no_number(tmp_path, capsys):
    long = "a-run-folder-with-a-name-long-enough-to-crowd-the-table-" * 2
    runs = [make_run(tmp_path / f"{long}{i}", 2, cut=True) for i in range(2)]
    assert cli(["report", *map(str, runs), "--output", str(tmp_path / "page.png")]) == 0
    out = capsys.readouterr().out
    assert "…" not in out
    first = json.loads((runs[0] / "metrics.jsonl").read_text().splitlines()[-2])
    for text in (f"{first['loss']:.4f}", "samples/s", "bubble", "memory peak", f"K=2 M=4 1f1b ({runs[1].name})"):
        assert text in out


@pytest.mark.parametrize("name", ["page.txt", "page"])
@pytest.mark.parametrize("cut", [False, True])
def test_an_output_of_another_format_is_refused_before_the_tables(tmp_path, capsys, name, cut):
    # `cut`: a run whose last record was cut short was warned of before the refusal.
    run = make_run(tmp_path / "run", 2, cut=cut)
    before = files(tmp_path)
    assert cli(["report", str(run), "--output", str(tmp_path / name)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and one_line(captured.err)
    assert "--output: the page is written as PNG, PDF or SVG: name a file ending in .png, .pdf or .svg" in captured.err
    assert files(tmp_path) == before


@pytest.mark.parametrize("name", ["metrics.jsonl", "recipe.yaml"])
def test_an_output_that_is_a_runs_own_file_is_refused_and_kept(tmp_path, capsys, name):
    run = make_run(tmp_path / "run", 2)
    before = {path: path.read_bytes() for path in files(run) if path.is_file()}
    code = cli(["report", str(run), "--output", str(run / name)])
    err = capsys.readouterr().err
    assert code == 2 and one_line(err), err
    assert err.startswith(f"error: --output {str(run / name)!r} is a run's {name}: writing there would replace it; "
                          "name another file, e.g. report.png"), err
    assert {path: path.read_bytes() for path in files(run) if path.is_file()} == before


def test_a_runs_checkpoints_folder_is_refused_naming_the_run(tmp_path, capsys, monkeypatch):
    # It was "a folder of runs", pointing to a course set aside there, whose page was then refused after the tables.
    monkeypatch.chdir(tmp_path)
    run = make_run(Path("run"), partitions=2)
    (run / "checkpoints" / "step-00000004").mkdir(parents=True)
    before = files(tmp_path)
    assert cli(["report", "run/checkpoints"]) == 2
    captured = capsys.readouterr()
    assert captured.err == "error: run/checkpoints: checkpoints of a run, not a run directory; give the run: run\n"
    assert files(tmp_path) == before


def test_a_course_set_aside_is_reported_with_its_page_in_the_run(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = make_run(Path("run"), partitions=2)
    aside = run / "checkpoints" / "superseded-20261205-073247-at-step-3"
    aside.mkdir(parents=True)
    (run / "checkpoints" / "step-00000003").mkdir()
    (aside / "step-00000004").mkdir()
    (aside / "metrics.jsonl").write_text((run / "metrics.jsonl").read_text())
    assert cli(["report", str(aside)]) == 0, capsys.readouterr().err
    page = run / f"report-{aside.name}.png"
    assert page.is_file() and f"wrote {page}" in capsys.readouterr().out
    assert not (aside / "report.png").exists()
