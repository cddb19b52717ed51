"""A run's output once its reader has gone: dropped, with one call to stop the run, and nothing raised."""

import errno
import io
import os
import signal
import sys

import pytest

from gpipe_cli.pipeline import stopping
from gpipe_cli.train import output


def test_a_closed_pipe_is_told_once_and_later_writes_go_nowhere(monkeypatch):
    read, write = os.pipe()
    stream = os.fdopen(write, "w")
    os.close(read)  # the reader has gone
    calls = []
    monkeypatch.setattr("sys.stdout", stream)
    monkeypatch.setattr("sys.stderr", sys.stderr)  # guarded too: put back after
    output.guard_output(lambda: calls.append(1))
    print("step 1", flush=True)
    print("step 2", flush=True)
    assert calls == [1]
    assert os.readlink(f"/proc/self/fd/{stream.fileno()}") == os.devnull
    output.guard_output(lambda: calls.append(2))  # guarded once: a second guard only changes what is called
    assert sys.stdout._stream is stream
    stream.close()


def test_a_terminal_that_hung_up_is_a_gone_reader_and_other_write_errors_still_raise(monkeypatch):
    main, child = os.openpty()
    terminal = os.fdopen(child, "w")
    os.close(main)  # the window closed, or the ssh session dropped: writes fail with EIO
    calls = []
    monkeypatch.setattr("sys.stdout", terminal)
    monkeypatch.setattr("sys.stderr", sys.stderr)  # guarded too: put back after
    output.guard_output(lambda: calls.append(1))
    print("[gpipe] SIGHUP: writing a checkpoint, then stopping", flush=True)
    assert calls == [1]
    terminal.close()

    class FullDisk(io.StringIO):
        def write(self, text):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("sys.stdout", FullDisk())
    output.guard_output(lambda: calls.append(2))
    with pytest.raises(OSError, match="No space left"):  # not a gone reader: the failure is said, not hidden
        print("a line")
    assert calls == [1]


def test_a_standard_error_that_refuses_writes_is_dropped_and_the_run_goes_on(monkeypatch, tmp_path):
    # `2>/dev/full`, or a descriptor open for reading: the stop's own line raised, and the rank died before its
    # checkpoint. Standard output's same failure is still said (above).
    calls = []
    with open(tmp_path / "read-only", "w"):
        pass
    for refusing in (open("/dev/full", "w"), open(tmp_path / "read-only")):  # noqa: SIM115 (closed below)
        monkeypatch.setattr("sys.stdout", sys.stdout)  # guarded too: put back after
        monkeypatch.setattr("sys.stderr", refusing)
        output.guard_output(lambda: calls.append(1))
        print("[gpipe] SIGTERM: writing a checkpoint, then stopping", file=sys.stderr, flush=True)
        print("a second line", file=sys.stderr, flush=True)
        assert os.readlink(f"/proc/self/fd/{refusing.fileno()}") == os.devnull
        refusing.close()
    assert calls == []  # not a gone reader: the run is not stopped


def test_a_closed_stderr_is_told_too_and_a_stream_closed_at_start_writes_nowhere(monkeypatch):
    # `2>&1 | head`: the stop's own line to stderr failed and the ranks ended before their checkpoint.
    # `>&-`: sys.stdout is None, and wrapping it made the first flush a traceback.
    read, write = os.pipe()
    stream = os.fdopen(write, "w")
    os.close(read)
    monkeypatch.setattr("sys.stdout", None)
    monkeypatch.setattr("sys.stderr", stream)
    calls = []
    output.guard_output(lambda: calls.append(1))
    print("gpipe train quickstart: ...", flush=True)  # was: AttributeError: 'NoneType' object has no attribute
    assert os.readlink(f"/proc/self/fd/{sys.stdout.fileno()}") == os.devnull
    print("[gpipe] stopping", file=sys.stderr, flush=True)
    assert calls == [1]
    os.close(sys.stdout.fileno())
    stream.close()


def test_a_closed_output_stops_as_the_sigterm_handler_in_place_would(monkeypatch):
    seen = []
    monkeypatch.setattr(output.signal, "getsignal", lambda signum: lambda s, frame: seen.append((signum, s)))
    output.stop_run()
    assert seen == [(signal.SIGTERM, signal.SIGPIPE)]


def test_a_stop_signal_inside_a_finaliser_comes_again_after_it(monkeypatch):
    # Raised inside a __del__, the set-up's StoppedEarly was printed as "Exception ignored in: ..." and dropped.
    class Held:
        def __del__(self):
            frames.append(sys._getframe())

    frames: list = []
    Held()
    assert stopping._finalizing(frames[0]) and not stopping._finalizing(None)
    later = []
    monkeypatch.setattr(stopping.threading, "Timer", lambda delay, fn, args: later.append(args) or _Started())
    monkeypatch.setattr(stopping, "_received", 0)
    handlers = {}
    monkeypatch.setattr(stopping.signal, "signal", lambda sig, handler: handlers.setdefault(sig, handler))
    monkeypatch.setattr(stopping, "_pipe", (0, 0))  # no deadline thread: only the handler is under test
    stopping.until_started(announce=False)
    handlers[signal.SIGTERM](signal.SIGTERM, frames[0])  # nothing raised, nothing noted: sent again shortly
    assert later == [(os.getpid(), signal.SIGTERM)] and stopping.received() == 0
    with pytest.raises(stopping.StoppedEarly):
        handlers[signal.SIGTERM](signal.SIGTERM, None)


class _Started:
    def start(self):
        pass


def test_a_closed_descriptor_becomes_dev_null_that_the_ranks_inherit():
    # `gpipe train >&-`: os.open's /dev/null on fd 1 was not inheritable, so every rank started without a stdout.
    fd = 250
    with pytest.raises(OSError):
        os.fstat(fd)
    try:
        assert output._null_on(fd) == fd
        assert os.readlink(f"/proc/self/fd/{fd}") == os.devnull and os.get_inheritable(fd)
    finally:
        os.close(fd)


def test_a_reader_gone_is_found_before_anything_more_is_printed(monkeypatch):
    # With the live view into a pipe (nothing printed between evals) the run trained on for 100 steps, unread.
    read, write = os.pipe()
    stream = os.fdopen(write, "w")
    monkeypatch.setattr("sys.stdout", stream)
    monkeypatch.setattr("sys.stderr", sys.stderr)
    calls = []
    output.guard_output(lambda: calls.append(1))
    output.check_readers()
    assert calls == []  # a reader still there
    os.close(read)
    output.check_readers()
    output.check_readers()
    assert calls == [1]
    stream.close()
