"""`gpipe report` on a narrow terminal: every figure and run name whole, the tables split rather than cut."""

import json
import re
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from gpipe_cli.cli import run as cli
from gpipe_cli.console import fit_table
from gpipe_cli.report import KEYS, resume_table, stage_table, summary_table
from gpipe_cli.report.runs import read_runs
from tests.train.test_view import train_record
from tests.widths import problems

HEADERS = "run pipeline steps loss best eval samples/s bubble theory wait memory warm-up s stage compute wait comm " \
          "optimizer other ms peak"


def make_long_run(folder: Path, partitions: int, schedule: str, resumed_at: int = 0) -> Path:
    """A run of 1,300 steps with figures as long as a real one's: thousands of samples/s and ms, GiB peaks."""
    folder.mkdir(parents=True)
    recipe = {"name": "r", "pipeline": {"partitions": partitions, "microbatches": 32, "schedule": schedule,
                                        "data_parallel": 2}}
    (folder / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    lines = []
    for step in range(1, 1301, 25):
        record = train_record(step=step, stages=partitions, loss=6.3417892 / (1 + step / 5000))
        record["samples_per_s"] = 13245.678 + step
        record["mem_peak_bytes"] = [int(13.7 * (s + 1) * (1 << 30)) for s in range(partitions)]
        record["time_s"] = {part: [12.3456 * (k + 1) + s for s in range(partitions)]
                            for k, part in enumerate(record["time_s"])}
        if step == resumed_at:
            record.update(resumed=True, warmup=True)
        lines.append(json.dumps(record))
        if step % 200 == 1:
            lines.append(json.dumps({"kind": "eval", "step": step, "loss": 5.91234 / (1 + step / 4000),
                                     "accuracy": 0.81234}))
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def _cells(runs) -> set[str]:
    """Every run name and figure the tables hold, as a wide terminal shows them."""
    tables = [t for t in (summary_table(runs), resume_table(runs), stage_table(runs)) if t is not None]
    return {str(cell) for table in tables for column in table.columns for cell in column._cells if str(cell)}


@pytest.mark.parametrize("width", [60, 80, 100])
def test_every_figure_and_run_name_is_shown_whole_at_any_width(tmp_path, monkeypatch, capsys, width):
    a = make_long_run(tmp_path / "a", 8, "zero-bubble-v", resumed_at=651)
    b = make_long_run(tmp_path / "b", 4, "interleaved")
    monkeypatch.setenv("COLUMNS", str(width))
    monkeypatch.setattr(Console, "is_terminal", property(lambda self: True))
    assert cli(["report", str(a), str(b), "--output", str(tmp_path / "page.png")]) == 0
    text = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().out)  # a terminal's styles
    tables = text[:text.index("wrote ")]  # the page's path stays one line, ready to copy
    assert not problems(tables, width, HEADERS), text
    lines = text.splitlines()
    cells = _cells(read_runs([a, b]))
    assert "K=8 M=32 zero-bubble-v D=2" in cells and "109.6 GiB" in cells  # the figures are the long ones
    for cell in cells:
        # A cell of several figures ("4.547 @1201, acc 0.812") may break after its comma; each figure stays whole.
        for piece in re.split(r"(?<=,) ", cell):
            assert any(piece in line for line in lines), f"{piece!r} of {cell!r} is not shown whole:\n{text}"


def test_a_table_that_fits_is_left_as_it_is_and_one_that_does_not_repeats_its_run_column(tmp_path):
    runs = read_runs([make_long_run(tmp_path / "a", 4, "1f1b")])
    table = stage_table(runs)
    assert fit_table(table, 400, KEYS) == [table]
    parts = fit_table(table, 60, KEYS)
    assert len(parts) > 1
    for part in parts:
        assert [str(c.header) for c in part.columns][:2] == ["run", "stage"]
        console = Console(width=60, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
        console.print(part)
        assert "…" not in console.export_text()


def test_a_terminal_too_narrow_for_the_run_and_one_figure_shows_one_table_per_row(tmp_path):
    runs = read_runs([make_long_run(tmp_path / "a", 2, "zero-bubble-v")])
    console = Console(width=36, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    for part in fit_table(stage_table(runs), 36, KEYS):
        console.print(part)
    text = console.export_text()
    assert "…" not in text and "stage 1" in text and "memory peak" in text
