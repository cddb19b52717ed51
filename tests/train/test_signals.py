"""A rank's stop request: the first Ctrl-C finishes the step, a second aborts at once, each said in one line."""

import signal

import pytest

from gpipe_cli.pipeline import stopping
from gpipe_cli.train import signals
from gpipe_cli.train.existing import way_on


@pytest.fixture(autouse=True)
def no_signal_remembered(monkeypatch):
    monkeypatch.setattr(stopping, "_received", 0)  # the handler notes the signal for the process: put back after


@pytest.fixture(autouse=True)
def a_person_presses_again_later(monkeypatch):
    # A second Ctrl-C pressed by hand comes a while after the first: each reading of the clock is a second on.
    clock = iter(range(0, 10_000, max(int(signals.ECHO_S), 1)))
    monkeypatch.setattr(signals.time, "monotonic", lambda: float(next(clock)))


def test_a_second_ctrl_c_aborts_at_once_with_one_line(monkeypatch, capsys):
    # It ended the job with exit 130 and no word after "Ctrl-C again to abort at once".
    def exit_now(code):
        raise SystemExit(code)

    monkeypatch.setattr(signals.os, "_exit", exit_now)
    request = signals.StopRequest(announce=True)
    request._handle(signal.SIGINT, None)
    assert request.signum == signal.SIGINT
    with pytest.raises(SystemExit) as ended:
        request._handle(signal.SIGINT, None)
    assert ended.value.code == 128 + signal.SIGINT
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["[gpipe] SIGINT: stopping after the steps in flight (Ctrl-C again to abort at once)",
                     "[gpipe] SIGINT again: aborted at once; a checkpoint it cut short is removed on resume"]


def test_an_abort_says_how_the_run_goes_on(monkeypatch, capsys, tmp_path):
    # It said that a cut-short checkpoint is removed on resume, but not the resume that continues the run.
    monkeypatch.setattr(signals.os, "_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    request = signals.StopRequest(announce=True)
    request.way_on = lambda: way_on(tmp_path)
    (tmp_path / "checkpoints" / "step-00000004").mkdir(parents=True)
    request._handle(signal.SIGINT, None)
    with pytest.raises(SystemExit):
        request._handle(signal.SIGINT, None)
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "[gpipe] SIGINT again: aborted at once; a checkpoint it cut short is removed on resume; continue with "
        f"gpipe train --resume {tmp_path}")


def test_the_same_ctrl_c_come_twice_at_once_is_one_stop(monkeypatch, capsys):
    # Under `timeout` (or any wrapper that passes signals on) the terminal's Ctrl-C reached the launcher twice, once
    # from the terminal and once from the wrapper; the ranks took the second for "again" and saved nothing.
    monkeypatch.setattr(signals.time, "monotonic", lambda: 100.0)
    exits: list[int] = []
    monkeypatch.setattr(signals.os, "_exit", exits.append)
    request = signals.StopRequest(announce=True)
    request._handle(signal.SIGINT, None)
    request._handle(signal.SIGINT, None)
    assert exits == [] and request.signum == signal.SIGINT  # it still stops after the steps in flight, and saves
    assert capsys.readouterr().err.strip().splitlines() == [
        "[gpipe] SIGINT: stopping after the steps in flight (Ctrl-C again to abort at once)"]


def test_a_sigint_sent_because_the_launcher_ended_says_so(monkeypatch, capsys):
    # Killed, the launcher left its ranks a SIGINT from the system, which they announced as a Ctrl-C.
    request = signals.StopRequest(announce=True)
    monkeypatch.setattr(signals.os, "getppid", lambda: request.parent + 1)  # adopted by another process
    request._handle(signal.SIGINT, None)
    assert capsys.readouterr().err.strip() == "[gpipe] the launcher ended (SIGINT): stopping after the steps in flight"


def test_only_the_rank_that_speaks_says_it(monkeypatch, capsys):
    monkeypatch.setattr(signals.os, "_exit", lambda code: None)
    request = signals.StopRequest(announce=False)
    request._handle(signal.SIGINT, None)
    request._handle(signal.SIGINT, None)
    assert capsys.readouterr().err == ""


def test_a_ctrl_c_line_into_a_file_is_that_line_alone(capsys):
    # It began with an empty line (which moves past the ^C a terminal echoes), so a log held two lines.
    signals.StopRequest(announce=True)._handle(signal.SIGINT, None)
    assert capsys.readouterr().err == ("[gpipe] SIGINT: stopping after the steps in flight (Ctrl-C again to abort at "
                                       "once)\n")


def test_once_the_work_is_done_a_stop_ends_the_rank_at_once():
    # A rank that had returned waited for its launcher to read it, and a stop only noted (two minutes of tear-down).
    # A run that stopped otherwise keeps its code: the tear-down's SIGTERM after a peer ended is no news.
    import os
    import subprocess
    import sys

    code = ("import os, signal, time\n"
            "from gpipe_cli.train.signals import StopRequest\n"
            "request = StopRequest(announce=False)\n"
            "request.arm()\n"
            "request.disarm(int(os.environ['CODE']))\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "time.sleep(60)\n")
    for run_code, exit_code in ((0, 128 + signal.SIGTERM), (128 + signal.SIGPIPE, 128 + signal.SIGPIPE)):
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50,
                              env={**os.environ, "CODE": str(run_code)})
        assert proc.returncode == exit_code, proc.stderr


@pytest.mark.parametrize(("rank", "local", "answers"), [(0, "0", True), (2, "0", True), (1, "1", False),
                                                         (3, None, False)])
def test_the_first_rank_of_every_node_answers_a_stop(monkeypatch, rank, local, answers):
    # A Ctrl-C on node 1 of a job was met with silence there: only rank 0, on node 0, spoke.
    if local is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local)
    assert signals.answers_stops(rank) is answers


def test_the_sigint_of_a_launcher_that_ended_is_said_as_its_end_not_as_a_ctrl_c(monkeypatch, capsys):
    # A launcher killed with -9 sends its ranks SIGINT: they saved and stopped, and said "stopped by SIGINT".
    request = signals.StopRequest(announce=True)
    monkeypatch.setattr(signals.os, "getppid", lambda: request.parent + 1)  # the rank's parent is gone
    request._handle(signal.SIGINT, None)
    assert request.orphaned and request.cause(signal.SIGINT) == "the launcher ended"
    assert request.agreed(None, distributed=False) == signal.SIGINT
    assert capsys.readouterr().err.strip().splitlines() == [
        "[gpipe] the launcher ended (SIGINT): stopping after the steps in flight",
        "[gpipe] the launcher ended: writing a checkpoint, then stopping"]
    typed = signals.StopRequest(announce=False)
    typed._handle(signal.SIGINT, None)
    assert not typed.orphaned and typed.cause(signal.SIGINT) == "SIGINT"


def test_a_stop_answered_into_a_closed_output_does_not_hold_up_the_signal_thread(monkeypatch):
    # `gpipe train 2>&1 | tee log` and Ctrl-C: tee gone, the answer's write stopped the run through the handler,
    # which waited for the lock the signal thread held while answering: rank 0 hung until the stall timeout.
    import os
    import threading

    from gpipe_cli.pipeline import stopping

    request = signals.StopRequest(announce=True)
    monkeypatch.setattr(stopping, "say_stop", lambda text: request._direct(signal.SIGPIPE, None))  # output.stop_run
    read, write = os.pipe()
    os.write(write, bytes([signal.SIGINT]))
    os.close(write)
    thread = threading.Thread(target=request._read, args=(read,), daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive() and request.signum == signal.SIGINT
    os.close(read)
