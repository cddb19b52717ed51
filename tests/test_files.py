"""What the commands write (JSON figures, traces, PNGs) appears whole or not at all."""

import errno
import json
import os
from pathlib import Path

import pytest

from gpipe_cli import plots
from gpipe_cli.bench.trace import write_chrome
from gpipe_cli.files import atomic_write, atomic_write_text


def test_text_is_written_whole_with_no_temporary_file_left(tmp_path: Path):
    target = tmp_path / "sub" / "figures.json"
    atomic_write_text(target, '{"a": 1}')
    assert target.read_text() == '{"a": 1}' and os.listdir(target.parent) == ["figures.json"]


def test_a_write_that_fails_midway_leaves_the_old_file_and_no_partial_one(tmp_path: Path):
    target = tmp_path / "figures.json"
    target.write_text("old")

    def half_then_full_disk(f):
        f.write(b"{\"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError):
        atomic_write(target, half_then_full_disk)
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["figures.json"]


class _FailingFigure:
    """A figure whose PNG encoder fails after writing part of the file."""

    def tight_layout(self):
        pass

    def savefig(self, f, **kwargs):
        f.write(b"\x89PNG partial")
        raise KeyboardInterrupt  # Ctrl-C while the PNG is being written


class _Pyplot:
    def __init__(self):
        self.closed = []

    def close(self, fig):
        self.closed.append(fig)


def test_a_png_interrupted_while_written_is_not_left_behind(tmp_path: Path):
    plt, fig = _Pyplot(), _FailingFigure()
    with pytest.raises(KeyboardInterrupt):
        plots.save(plt, fig, tmp_path / "report.png")
    assert os.listdir(tmp_path) == [] and plt.closed == [fig]


def test_a_png_is_written_whole(tmp_path: Path):
    plt = pytest.importorskip("matplotlib.pyplot")
    fig, _ = plots.figure(plt, 200, 100, 1, 1, "title")
    path = plots.save(plt, fig, tmp_path / "out" / "report.png")
    assert path.read_bytes().startswith(b"\x89PNG") and os.listdir(path.parent) == ["report.png"]


def test_the_chrome_trace_is_whole_json(tmp_path: Path):
    events = [{"stage": 0, "microbatch": 0, "kind": "fwd", "start": 0.0, "end": 0.001}]
    write_chrome(tmp_path / "trace.json", events, "title")
    assert json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
