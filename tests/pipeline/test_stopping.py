"""Ctrl-C or SIGTERM before a rank's first step ends it quietly, even while its main thread waits inside torch."""

import signal
import subprocess
import sys
import textwrap
import time

import pytest

from gpipe_cli.pipeline import stopping

PRELUDE = """
import sys, time
from pathlib import Path
from gpipe_cli.pipeline import stopping
stopping.until_started(announce=True, marker=Path(sys.argv[1]))
try:
"""
AFTER = """
except stopping.StoppedEarly as stop:
    print("unwound", stop.signum, flush=True)
    raise SystemExit(128 + stop.signum)
"""


def _run(body: str, marker, signum: int = signal.SIGINT) -> tuple[int, str, str, float]:
    """Run the body under the set-up handler; signal it once it prints 'ready'; (code, out, err, seconds)."""
    script = PRELUDE + textwrap.indent(textwrap.dedent(body), "    ") + AFTER
    proc = subprocess.Popen([sys.executable, "-c", script, str(marker)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.2)
    sent = time.monotonic()
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err, time.monotonic() - sent


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_during_set_up_unwinds_and_exits_with_128_plus_the_signal(tmp_path, signum):
    code, out, err, _ = _run("""
        try:
            print("ready", flush=True)
            time.sleep(60)
        finally:
            print("cleaned up", flush=True)
    """, tmp_path / "started", signum)
    assert code == 128 + signum
    assert out.splitlines() == ["cleaned up", f"unwound {int(signum)}"]
    assert "Traceback" not in err
    # Only Ctrl-C is announced: a SIGTERM may be a tear-down that another rank explains.
    assert err.count("stopping now, before the first step is done") == (1 if signum == signal.SIGINT else 0)
    assert not (tmp_path / "started").exists()


def test_a_main_thread_waiting_inside_torch_is_ended_after_the_grace_period(tmp_path):
    # A store wait on a key nobody sets returns only at its timeout, and Python's handler cannot run
    # before it returns: the rank must not hang there for a minute (or be killed by the launcher).
    code, out, err, seconds = _run("""
        from datetime import timedelta
        import torch.distributed as dist
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        print("ready", flush=True)
        store.wait(["never set"], timedelta(seconds=60))
    """, tmp_path / "started")
    assert code == 128 + signal.SIGINT, err
    assert stopping.GRACE_S <= seconds < 30
    assert err.count("stopping now, before the first step is done") == 1
    assert "Traceback" not in err


def test_after_the_first_step_the_training_loops_handler_decides_and_the_marker_tells_the_launcher(tmp_path):
    code, out, err, seconds = _run("""
        import signal
        got = []
        signal.signal(signal.SIGINT, lambda s, f: got.append(s))  # the loop's handler: finish the step
        stopping.started()
        print("ready", flush=True)
        time.sleep(stopping.GRACE_S + 1)
        print("finished the step after", got, flush=True)
    """, tmp_path / "started")
    assert code == 0, err
    assert out.splitlines() == [f"finished the step after [{int(signal.SIGINT)}]"]
    assert (tmp_path / "started").exists()


def test_a_stop_that_a_library_turned_into_its_own_error_still_ends_the_rank_quietly(tmp_path):
    # sentencepiece's trainer, stopped inside its Python callback, raises "INTERNAL: StoppedEarly: ...".
    code, out, err, _ = _run("""
        from gpipe_cli.pipeline import failure

        def work():
            try:
                print("ready", flush=True)
                time.sleep(60)
            except BaseException as exc:
                raise RuntimeError(f"INTERNAL: {exc!r}") from None

        failure.run_guarded(work, "stage 0 (rank 0)")
    """, tmp_path / "started")
    assert code == 128 + signal.SIGINT, err
    assert out.splitlines() == [f"unwound {int(signal.SIGINT)}"]
    assert "failed" not in err and "Traceback" not in err


def test_a_stop_inside_a_deferred_block_raises_when_the_block_ends(tmp_path):
    # torch's import runs Python that C++ called: an exception raised there aborts the rank (SIGABRT).
    code, out, err, _ = _run("""
        with stopping.deferred():
            print("ready", flush=True)
            time.sleep(1)
            print("block done", flush=True)
        print("not reached", flush=True)
    """, tmp_path / "started")
    assert code == 128 + signal.SIGINT, err
    assert out.splitlines() == ["block done", f"unwound {int(signal.SIGINT)}"]
    assert "Traceback" not in err


def test_a_stop_line_into_a_file_is_that_line_alone(capsys):
    # It began with an empty line (past a terminal's ^C echo), so a log held the stop as two lines.
    stopping.say_stopping_now("SIGINT")
    assert capsys.readouterr().err == \
        "[gpipe] SIGINT: stopping now, before the first step is done (nothing to save yet)\n"
