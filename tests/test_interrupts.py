"""A Ctrl-C swallowed on the way is still honoured between measurements."""

import signal
import sys

import pytest

from gpipe_cli import interrupts


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the swallowed Ctrl-C
def test_a_ctrl_c_swallowed_in_a_finalizer_is_still_honoured():
    class Meter:
        def __del__(self):  # the memory meter releases its records here; Python ignores what it raises
            interrupts._on_interrupt(signal.SIGINT, None)

    interrupts._interrupted = False
    try:
        Meter()
        with pytest.raises(KeyboardInterrupt):
            interrupts.check()
    finally:
        interrupts._interrupted = False


def test_the_same_ctrl_c_come_twice_at_once_is_raised_once(monkeypatch):
    # Under `timeout` the terminal's Ctrl-C came twice: the second, raised while the first unwound, cut its line
    # short (no line at all) or said it again ("gpipe report: interrupted", then "gpipe: interrupted").
    clock = [100.0]
    monkeypatch.setattr(interrupts.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(interrupts, "_interrupted", False)
    with pytest.raises(KeyboardInterrupt):
        interrupts._on_interrupt(signal.SIGINT, None)
    clock[0] += 0.2
    interrupts._on_interrupt(signal.SIGINT, None)  # the echo: remembered, not raised
    clock[0] += interrupts.ECHO_S
    with pytest.raises(KeyboardInterrupt):  # a person pressing again, later
        interrupts._on_interrupt(signal.SIGINT, None)


def test_a_command_started_with_ctrl_c_ignored_keeps_ignoring_it():
    # `nohup` or a script's background job: the terminal's Ctrl-C is for the foreground job.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        assert interrupts.take_signal(signal.default_int_handler) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        with interrupts.remembered():
            signal.raise_signal(signal.SIGINT)  # no KeyboardInterrupt
            interrupts.check()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_command_started_as_from_a_terminal_takes_ctrl_c_over():
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with interrupts.remembered():
            assert signal.getsignal(signal.SIGINT) is interrupts._on_interrupt
            with pytest.raises(KeyboardInterrupt):
                signal.raise_signal(signal.SIGINT)
            with pytest.raises(KeyboardInterrupt):
                interrupts.check()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        interrupts._interrupted = False
        signal.signal(signal.SIGINT, previous)


def test_a_ctrl_c_in_a_finalizer_prints_no_traceback_of_its_own(capfd):
    class Meter:
        def __del__(self):
            interrupts._on_interrupt(signal.SIGINT, None)

    with interrupts.remembered():
        Meter()
        with pytest.raises(KeyboardInterrupt):
            interrupts.check()
    assert "Traceback" not in capfd.readouterr().err


def test_python_m_gpipe_cli_is_the_gpipe_command():
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-m", "gpipe_cli", "--version"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("gpipe-cli ")


def test_a_command_started_under_nohup_outlives_its_terminal_and_sigterm_still_stops_it():
    from gpipe_cli.launch import launcher
    from gpipe_cli.launch.launcher import LaunchOptions

    previous = {signum: signal.signal(signum, signal.SIG_IGN) for signum in (signal.SIGHUP, signal.SIGTERM)}
    previous[signal.SIGINT], hook = signal.getsignal(signal.SIGINT), sys.unraisablehook
    try:
        interrupts.stop_on_signals()
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is interrupts._on_interrupt
        config = launcher._config(1, LaunchOptions(), "spawn", "logs")
        assert "SIGHUP" not in config.signals_to_handle and "SIGTERM" in config.signals_to_handle
        signal.signal(signal.SIGHUP, signal.SIG_DFL)  # from a terminal: its hang-up stops the job
        interrupts.stop_on_signals()
        assert signal.getsignal(signal.SIGHUP) is interrupts._on_interrupt
        assert "SIGHUP" in launcher._config(1, LaunchOptions(), "spawn", "logs").signals_to_handle
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        sys.unraisablehook = hook
