"""Ctrl-C on the launching side while the ranks set up: every rank ends, even one that missed the signal."""

import signal
import subprocess
import sys

import pytest

from gpipe_cli.launch.launcher import _Stops
from gpipe_cli.pipeline import stopping
from gpipe_cli.train.signals import ECHO_S, StopRequest

# A rank that loses the first SIGTERM, as one does when it arrives while the rank is being started
# (forked, its program not yet running), and ends on the next.
MISSES_ONE = """
import signal, sys, time
seen = []
def handle(signum, frame):
    seen.append(signum)
    if len(seen) > 1:
        sys.exit(128 + signum)
signal.signal(signal.SIGTERM, handle)
print("ready", flush=True)
time.sleep(120)
"""


def test_a_rank_that_missed_the_stop_is_sent_it_again_until_the_launch_returns():
    stops = _Stops(None)  # no marker: nothing to save, the ranks get SIGTERM
    rank = subprocess.Popen([sys.executable, "-c", MISSES_ONE], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)  # as torchrun starts a rank
    try:
        assert rank.stdout is not None and rank.stdout.readline().strip() == "ready"
        stops.forward_interrupt(signal.SIGINT, None)
        # Sent once, as before, the rank would sleep out its two minutes.
        assert rank.wait(timeout=30) == 128 + signal.SIGTERM
        assert stops.interrupted
    finally:
        stops.over.set()
        stops.stood_down.set()  # this process outlives the stop
        rank.kill()


def test_a_process_still_there_long_after_a_stop_with_nothing_to_save_ends_with_its_ranks(tmp_path):
    # Whatever holds it (a rank that never ends, a thread that never returns), the command ends, as a second
    # Ctrl-C would end it.
    script = tmp_path / "stuck.py"
    script.write_text(
        "import signal, subprocess, sys, time\n"
        "from gpipe_cli.launch import launcher\n"
        "launcher.FORCE_S = 2.0\n"
        "rank = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(120)'], stdout=subprocess.PIPE, "
        "start_new_session=True)\n"
        "rank.stdout.readline()\n"
        "launcher._Stops(None).forward_interrupt(signal.SIGINT, None)\n"
        "time.sleep(120)\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 128 + signal.SIGINT, proc.stderr
    assert "still running 2 s after the stop; ended it and its ranks" in proc.stderr


def test_once_a_rank_has_a_step_to_save_the_stop_is_left_to_the_ranks(tmp_path, monkeypatch):
    # The marker appears just after the stop (a rank finished its first step): its checkpoint may take
    # longer than any limit, and must not be cut short by repeated signals or the forced end.
    import time

    from gpipe_cli.launch import launcher

    monkeypatch.setattr(launcher, "FORCE_S", 1.5)
    marker = tmp_path / "training"
    stops = _Stops(marker)
    rank = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                             "signal.SIG_IGN); print(flush=True); time.sleep(120)"], stdout=subprocess.PIPE,
                            start_new_session=True)
    try:
        assert rank.stdout is not None and rank.stdout.readline() == b"\n"
        stops.forward_interrupt(signal.SIGINT, None)
        marker.touch()
        time.sleep(3)
        assert rank.poll() is None  # neither killed nor (this process) ended
    finally:
        stops.stood_down.set()
        rank.kill()


def test_a_stop_again_while_the_ranks_save_leaves_them_to_finish():
    # `kill` twice: the second SIGTERM ended the agent's wait for its ranks, and the launch returned and ended
    # ranks that were writing their checkpoint: none was left.
    import os
    import threading

    saving = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); "
              "time.sleep(1.5); sys.exit(128 + signal.SIGTERM)")
    rank = subprocess.Popen([sys.executable, "-c", saving], stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert rank.stdout is not None and rank.stdout.readline() == b"\n"
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
        _Stops(None).see_ranks_out()
        assert rank.wait(timeout=5) == 128 + signal.SIGTERM  # it ended on its own, not killed
    finally:
        rank.kill()


BLOCKED = (
    "import os, signal, subprocess, sys, time\n"
    "from gpipe_cli.launch import launcher\n"
    "launcher.FORCE_S = {force}\n"
    "if {stuck_rank}:  # a rank that ignores the stop\n"
    "    rank = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
    "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(120)'], stdout=subprocess.PIPE, "
    "start_new_session=True)\n"
    "    rank.stdout.readline()\n"
    "with launcher._Stops(None).blocked_stops():\n"
    "    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # as if it never got to run\n"
    "    os.kill(os.getpid(), signal.SIGTERM)\n"
    "    time.sleep(120)\n")


def test_a_stop_whose_handler_never_runs_still_ends_the_launch(tmp_path):
    # Node 0 waits inside torch's store for the other nodes, where Python runs no handler: only the byte the
    # signal leaves on the wake-up pipe tells.
    script = tmp_path / "blocked.py"
    script.write_text(BLOCKED.format(force=2.0, stuck_rank=True))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert "still running 2 s after the stop; ended it and its ranks" in proc.stderr


def test_a_launch_waiting_for_the_other_nodes_with_no_rank_ends_soon_after_its_stop(tmp_path):
    # A node stopped while it waited for a third took the whole 20 s of the forced end, and said it was stuck.
    import time

    script = tmp_path / "waiting.py"
    script.write_text(BLOCKED.format(force=60.0, stuck_rank=False))
    began = time.monotonic()
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert time.monotonic() - began < 30 and "still running" not in proc.stderr


def test_a_node_meets_its_rendezvous_only_once_its_host_is_known_and_node_0_answers():
    import pytest

    from gpipe_cli.errors import UserError
    from gpipe_cli.launch.launcher import LaunchOptions
    from gpipe_cli.launch.preflight import reach, rendezvous
    from tests.multiproc import free_port

    lines = []
    with pytest.raises(UserError, match=r"^--rdzv-endpoint host0\.invalid:29500: host0\.invalid is not a host name"):
        reach(rendezvous(2, LaunchOptions(nnodes="2", node_rank=1, rdzv_endpoint="host0.invalid:29500")), lines.append)
    endpoint = f"127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(UserError, match="node 0's rendezvous did not answer in 1 s"):
        reach(rendezvous(2, LaunchOptions(nnodes="2", node_rank=1, rdzv_endpoint=endpoint)), lines.append, 1.0)
    assert lines == [f"waiting for node 0's rendezvous at {endpoint} (Ctrl-C stops)"]
    reach(rendezvous(2, LaunchOptions(nnodes="2", node_rank=0, rdzv_endpoint=endpoint)), lines.append, 1.0)
    assert len(lines) == 1  # node 0 hosts the store: nothing to wait for


def test_a_node_whose_ranks_wait_for_the_other_nodes_says_so_once(monkeypatch):
    # Node 0 of two, node 1 never started: nothing after "starting 1 rank of 2 on this node" for 15 minutes.
    import threading

    from gpipe_cli.launch import launcher
    from gpipe_cli.launch.launcher import LaunchOptions, tell_waiting
    from gpipe_cli.launch.preflight import rendezvous

    two = rendezvous(2, LaunchOptions(nnodes="2", node_rank=0, rdzv_endpoint="127.0.0.1:29500"))
    lines: list[str] = []
    monkeypatch.setattr(launcher, "_ranks", lambda: [])
    tell_waiting(two, threading.Event(), lines.append, after=0.01)
    assert lines == ["waiting for the job's other nodes to join at 127.0.0.1:29500 (2 nodes in all; Ctrl-C stops)"]
    over = threading.Event()
    over.set()
    tell_waiting(two, over, lines.append, after=0.01)  # the launch has returned
    tell_waiting(rendezvous(2, LaunchOptions()), threading.Event(), lines.append, after=0.01)  # one node
    monkeypatch.setattr(launcher, "_ranks", lambda: [4321])  # its ranks have started: the job met
    tell_waiting(two, threading.Event(), lines.append, after=0.01)
    monkeypatch.setattr(launcher, "_ranks", lambda: [])
    tell_waiting(two, threading.Event(), lines.append, after=0.01, stopped=lambda: True)  # stopped meanwhile
    assert len(lines) == 1


def test_an_unknown_rendezvous_host_is_refused_before_the_plan_is_measured(tmp_path, monkeypatch, capsys):
    # It was said after the plan's seconds of measuring and a line saying that a rank was starting.
    from gpipe_cli.cli import run

    monkeypatch.setattr("gpipe_cli.train.plan.make_plan", lambda *a, **k: (_ for _ in ()).throw(AssertionError))
    monkeypatch.chdir(tmp_path)
    args = ["train", "--plain", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "host0.invalid:29500"]
    assert run(args) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: --rdzv-endpoint host0.invalid:29500: host0.invalid is not a host name")
    assert "starting" not in captured.out and list(tmp_path.iterdir()) == []


def test_a_ctrl_c_passed_on_before_the_agent_listens_ends_as_ctrl_c_in_one_line(tmp_path):
    # The launcher passes a Ctrl-C on as its own SIGTERM; caught by the command's handler (the agent not yet
    # listening), it ended with SIGTERM's 143 and two lines: "stopping now" and "interrupted; nothing was written".
    script = tmp_path / "early.py"
    script.write_text(
        "import signal, sys, time\n"
        "from pathlib import Path\n"
        "from gpipe_cli import interrupts\n"
        "from gpipe_cli.launch import launcher\n"
        "interrupts.stop_on_signals()\n"
        f"stops = launcher._Stops(Path({str(tmp_path / 'started')!r}), forking=True)\n"
        "try:\n"
        "    stops.forward_interrupt(signal.SIGINT, None)\n"
        "    time.sleep(30)\n"
        "except KeyboardInterrupt:\n"
        "    interrupts.say_stopped('gpipe train')\n"
        "    sys.exit(interrupts.exit_code(128 + signal.SIGINT))\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 128 + signal.SIGINT, proc.stderr
    assert proc.stderr == "[gpipe] SIGINT: stopping now, before the first step is done (nothing to save yet)\n"


def test_a_rank_whose_launcher_went_away_before_handing_it_work_ends_without_a_traceback(capsys):
    # Ctrl-C while the ranks start: the forked rank read its work from a closed pipe, and printed
    # "EOFError: Ran out of input" from multiprocessing's spawn._main under the stop's one line.
    import os

    from gpipe_cli.launch.preloaded import quiet_orphans

    def raised(where: str) -> BaseException:
        space: dict = {}
        exec(compile("def _main():\n    raise EOFError('Ran out of input')\n", where, "exec"), space)
        try:
            space["_main"]()
        except EOFError as exc:
            return exc
        raise AssertionError("no EOFError")

    printed = []
    hook = quiet_orphans(lambda kind, value, tb: printed.append(value))
    orphan = raised(os.path.join("lib", "multiprocessing", "spawn.py"))
    hook(EOFError, orphan, orphan.__traceback__)
    assert printed == []
    other = raised("mine.py")  # any other EOFError is told as before
    hook(EOFError, other, other.__traceback__)
    assert printed == [other]


def test_a_rank_the_stop_never_reached_stops_after_its_first_step_and_takes_the_signal_as_the_same_stop(
        tmp_path, monkeypatch, handlers, capsys):
    # Forked just after the launcher last looked for ranks, a rank reached its first step before the launcher
    # looked again: no signal reached it, and the run trained every step after the Ctrl-C.
    from gpipe_cli.launch import launcher
    marker = tmp_path / "training"
    monkeypatch.setattr(launcher, "_ranks", lambda: [])  # none yet
    stops = _Stops(marker)
    try:
        with pytest.raises(KeyboardInterrupt):  # no rank: the command stops where it is, as before the launch
            stops.forward_interrupt(signal.SIGINT, None)
    finally:
        stops.over.set()
        stops.stood_down.set()
    hangup = signal.getsignal(signal.SIGHUP)
    monkeypatch.setattr(stopping, "_marker", marker)
    monkeypatch.setattr(stopping, "_received", 0)
    exits: list[int] = []
    monkeypatch.setattr("gpipe_cli.train.signals.os._exit", exits.append)
    try:
        request = StopRequest(announce=True)
        request.arm()
        assert request.signum == signal.SIGINT and marker.exists()  # it stops after this step, and saves
        request._handle(signal.SIGINT, None)  # the launcher's signal, come late: the same stop
        assert exits == []
        monkeypatch.setattr("gpipe_cli.train.signals.time.monotonic", lambda: request.since + ECHO_S)
        request._handle(signal.SIGINT, None)  # a Ctrl-C again, pressed a second later
        assert exits == [128 + signal.SIGINT]
    finally:
        signal.signal(signal.SIGHUP, hangup)
    assert capsys.readouterr().err.splitlines()[-2:] == [
        "[gpipe] SIGINT: stopping after the steps in flight (Ctrl-C again to abort at once)",
        "[gpipe] SIGINT again: aborted at once; a checkpoint it cut short is removed on resume"]
    # Without a stop, the rank arms as before.
    (tmp_path / stopping.STOP_ASKED).unlink()
    try:
        request = StopRequest(announce=True)
        request.arm()
        assert request.signum == 0
    finally:
        signal.signal(signal.SIGHUP, hangup)


def test_a_ctrl_c_that_torch_s_own_code_fails_on_ends_the_launch_as_ctrl_c(monkeypatch):
    # torch's timing wrapper reads a variable a Ctrl-C left unset: "gpipe: could not start the job:
    # UnboundLocalError: cannot access local variable 'start'", exit 1, where a Ctrl-C ends quietly with 130.
    import torch.distributed.launcher.api as api

    from gpipe_cli.launch import forked, launcher

    def elastic_launch(config, entrypoint):
        def run(*args):
            try:
                raise KeyboardInterrupt
            finally:
                raise UnboundLocalError("cannot access local variable 'start' where it is not associated with a value")
        return run

    monkeypatch.setattr(api, "elastic_launch", elastic_launch)
    monkeypatch.setattr(forked, "available", lambda: False)
    with pytest.raises(KeyboardInterrupt):
        launcher.launch("gpipe_cli.nothing", [], 1)
