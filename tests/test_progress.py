"""Phases said with their estimates, the last line's took/estimated, and a run's ETA from its steady steps."""

import pytest

from gpipe_cli.progress import Progress, StepMean, eta_text, phase_line, said_if_slow, took_line
from gpipe_cli.units import clock


def test_a_phase_worth_waiting_on_says_about_how_long():
    assert phase_line("measuring K=2 (balance [5, 5])", 12.4) == "measuring K=2 (balance [5, 5]) (about 12 s)..."
    assert phase_line("measuring naive-1", 0.7) == "measuring naive-1..."  # nobody waits on it
    assert phase_line("measuring the engine", 150) == "measuring the engine (about 2 min)..."


def test_the_last_line_puts_what_it_took_beside_the_estimate():
    assert took_line(35.2, 30.0) == "took 35 s (estimated 30 s)"
    assert took_line(120.0, 80.0) == "took 2.0 min (estimated 1.3 min)"  # one unit, not "2 min (estimated 80 s)"
    assert took_line(700.0, 300.0) == "took 12 min (estimated 5 min)"


def test_progress_adds_the_phases_it_is_told_to_and_times_from_its_start():
    said, now = [], [100.0]
    progress = Progress(said.append, estimated=5.0, clock_s=lambda: now[0])
    progress.phase("reading", 1.0)            # part of the estimate given at the start
    now[0] = 101.0                            # as estimated
    progress.phase("measuring", 20.0, add=True)
    now[0] = 131.0
    assert said == ["reading...", "measuring (about 20 s)..."]
    assert progress.estimated == 25.0 and progress.took() == "took 31 s (estimated 25 s)"


def test_later_phases_are_scaled_by_how_the_finished_ones_ran():
    said, now = [], [0.0]
    progress = Progress(said.append, clock_s=lambda: now[0])
    progress.phase("K=1", 10.0)
    now[0] = 30.0                             # a busy machine: three times the estimate
    progress.phase("K=2", 10.0)
    now[0] = 1000.0                           # far slower still: the scale is bounded
    progress.phase("K=4", 10.0)
    assert said == ["K=1 (about 10 s)...", "K=2 (about 30 s)...", "K=4 (about 80 s)..."]
    assert progress.pace() == 8.0


def test_a_phase_added_to_the_total_counts_as_its_line_said_it():
    said, now = [], [0.0]
    progress = Progress(said.append, clock_s=lambda: now[0])
    progress.phase("links", 6.0, add=True)
    now[0] = 9.0                              # half as long again as estimated
    progress.phase("layers", 4.0, add=True)
    now[0] = 15.0
    assert said == ["links (about 6 s)...", "layers (about 6 s)..."]
    assert progress.estimated == 12.0 and progress.took() == "took 15 s (estimated 12 s)"


def test_a_wait_is_said_only_once_it_runs_long():
    import threading
    import time

    said: list[str] = []
    with said_if_slow(said.append, "choosing", after=0.05):
        pass  # quick: nothing said, and nothing said later either
    time.sleep(0.2)
    assert said == []
    fired = threading.Event()
    with said_if_slow(lambda line: (said.append(line), fired.set()), "choosing", after=0.01):
        assert fired.wait(30)  # the block is still running when its line is said
    assert said == ["choosing..."]


def test_the_run_eta_is_the_mean_steady_step_times_the_steps_left():
    steady = StepMean()
    assert steady.eta(1, 10) is None  # nothing steady seen yet
    for seconds in (1.0, 3.0):
        steady.add(seconds)
    assert steady.eta(3, 10) == pytest.approx(7 * 2.0) and steady.eta(10, 10) == 0.0


@pytest.mark.parametrize("seconds, text", [(0.4, "0s"), (42, "42s"), (83, "1m23s"), (3600 + 5 * 60, "1h05m")])
def test_a_countdown_stays_short(seconds, text):
    assert clock(seconds) == text
    assert eta_text(seconds) == f"eta {text}"
    assert eta_text(None) == ""


def test_every_family_budget_probe_and_search_is_estimated():
    import torch

    from gpipe_cli import sizing
    from gpipe_cli.profile import budget
    from gpipe_cli.profile.runner import budget_probe_seconds

    machine = sizing.this_machine(torch.get_num_threads())
    fixed = {"arch": "decoder-only", "d_model": 64, "ff": 256, "heads": 4, "vocab_size": 512, "max_len": 32}
    small = budget_probe_seconds("transformer", fixed, machine)
    large = budget_probe_seconds("transformer", {**fixed, "d_model": 1024, "ff": 4096, "max_len": 1024}, machine)
    assert 0 < small < large  # from its members' arithmetic
    # AmoebaNet's probe is bound by Python: counted in fixed layer calls of this machine.
    assert budget_probe_seconds("amoebanet", budget.AmoebaNetD.PAPER, machine) == pytest.approx(
        budget.AmoebaNetD.PROBE_CALLS * machine.call_seconds)
    rows = [("naive-1", 1, 1, "never"), ("pipeline-8", 8, 8, "except_last")]
    for kind in ("transformer", "amoebanet"):
        loop = budget.search_calls(kind, rows, "gpipe")
        assert 0 < budget.search_calls(kind, rows[:1], "gpipe") < loop
        # A V's row searches its cuts as well: it costs no less than the loop's at the same K.
        assert budget.search_calls(kind, [rows[0], (*rows[1], "v-half", "none")], "gpipe") >= loop
