"""Ctrl-C on the launching side while the ranks set up: every rank ends, even one that missed the signal."""

import signal
import subprocess
import sys

from gpipe_cli.launch.launcher import _Stops

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
