"""A Ctrl-C swallowed on the way is still honoured between measurements."""

import signal

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
