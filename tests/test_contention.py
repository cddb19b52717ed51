"""A speed measured while others took the CPU is said to be unreliable, in the same words by every command."""

import pytest
from rich.console import Console
from rich.text import Text

from gpipe_cli import contention
from gpipe_cli.cli import run as gpipe
from tests.bench.test_tables_width import summary
from tests.plan.test_runner import TINY
from tests.train.recipes import write

BUSY = {"window_s": 0.3, "others_share": 0.62, "stolen_share": 0.0}
QUIET = {"window_s": 0.3, "others_share": 0.01, "stolen_share": 0.0}
WORDS = ("CONTENDED: while measuring, the machine's CPU went elsewhere (this machine's rate: 62% to other processes, "
         "0% stolen): the speed figures below are unreliable")
PROFILE = ["profile-memory", "--layers", "2", "--d-model", "32", "--ff", "64", "--heads", "2", "--seq-len", "8",
           "--vocab-size", "64", "--partitions", "2"]


def test_a_load_is_contended_past_a_twentieth_taken_by_others_or_stolen():
    assert contention.contended(BUSY) and not contention.contended(QUIET) and not contention.contended({})
    assert contention.contended({"others_share": 0.0, "stolen_share": 0.2})
    assert contention.worst([QUIET, BUSY, {}]) == BUSY and contention.worst([]) == {}



def test_the_measured_processes_own_cpu_is_not_counted_as_others(monkeypatch):
    from types import SimpleNamespace

    # A window the measured process kept busy alone was called contended: its own CPU counted as others'.
    # The machine's busy and stolen seconds before and after a 2 s window, of which 2.5 s of CPU were ours.
    monkeypatch.setattr(contention, "machine_cpu", iter([(100.0, 0.0), (103.0, 0.5)]).__next__)
    monkeypatch.setattr(contention, "time", SimpleNamespace(perf_counter=iter([10.0, 12.0]).__next__,
                                                            process_time=iter([5.0, 7.5]).__next__))
    monkeypatch.setattr(contention, "os", SimpleNamespace(cpu_count=lambda: 2))
    load = contention.Load().finish()
    assert load == {"window_s": 2.0, "ranks_cpu_s": 2.5, "machine_busy_s": 3.0,
                    "others_share": pytest.approx(0.5 / 4), "stolen_share": pytest.approx(0.5 / 4)}

def test_bench_says_it_in_the_one_note():
    console = Console(width=300, record=True, color_system=None)
    from gpipe_cli.bench import tables

    tables.show(summary(contended=True, load={"k1": BUSY, "k": QUIET}), console)
    expected = Text.from_markup(contention.note({"K=1": BUSY, "K=2": QUIET})).plain
    assert expected.startswith("CONTENDED: while measuring, the machine's CPU went elsewhere (K=1: 62% to other "
                               "processes, 0% stolen; K=2: 1% to other processes, 0% stolen): the speed figures below")
    assert expected in console.export_text()


@pytest.mark.parametrize("load", [BUSY, QUIET])
def test_profile_memory_says_so_above_the_rate_it_measured(monkeypatch, capsys, load):
    # Its quick rate read 9 GFLOP/s beside two busy loops (200 here alone), and it said nothing.
    monkeypatch.setattr(contention.Load, "finish", lambda self: dict(load))
    assert gpipe(PROFILE) == 0
    lines = capsys.readouterr().out.splitlines()
    plan = next(i for i, line in enumerate(lines) if line.startswith("plan · "))
    assert (WORDS in lines[:plan]) == (load is BUSY), lines[:plan]
    assert sum("CONTENDED" in line for line in lines) == (load is BUSY)


def _busy(name: str) -> str:
    return f"{name}: 62% to other processes, 0% stolen"


@pytest.mark.parametrize("flags,windows", [
    (["--devices", "2", "--timing", "estimate", "--bandwidth", "12"], [_busy("this machine's rate")]),
    (["--devices", "1", "--timing", "measure"], [_busy("per-layer seconds"), _busy("the engine's steps")]),
    (["--devices", "2", "--tflops", "100"], []),  # nothing measured: an assumed rate is no busier for it
])
def test_plan_says_so_above_what_it_measured(tmp_path, monkeypatch, capsys, flags, windows):
    monkeypatch.setattr(contention.Load, "finish", lambda self: dict(BUSY))
    recipe = write(tmp_path, TINY)
    assert gpipe(["plan", str(recipe), "--plain", *flags]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("gpipe plan · "))
    said = [line for line in lines if "CONTENDED" in line]
    if windows:
        assert said == [f"CONTENDED: while measuring, the machine's CPU went elsewhere ({'; '.join(windows)}): the "
                        "speed figures below are unreliable"] and said[0] in lines[:header], lines[:header]
    else:
        assert said == []
