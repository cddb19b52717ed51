"""How the launcher explains the ranks that failed (pure: torchrun's failure records faked)."""

import signal
from types import SimpleNamespace

from gpipe_cli.launch.launcher import explain
from gpipe_cli.pipeline.failure import ANNOUNCED


def failed(code: int, timestamp: int = 100) -> SimpleNamespace:
    return SimpleNamespace(exitcode=code, timestamp=timestamp)


def test_a_rank_killed_by_a_signal_is_named_not_the_survivor_that_lost_it():
    code, line = explain({0: failed(1), 1: failed(-signal.SIGKILL)}, stages=2)
    assert code == 128 + signal.SIGKILL
    assert line == "gpipe: rank 1 (stage 1) was killed by SIGKILL"


def test_the_tear_down_sigterm_is_not_the_cause():
    code, line = explain({0: failed(-signal.SIGTERM, 99), 3: failed(-signal.SIGSEGV)}, stages=2)
    assert line == "gpipe: rank 3 (stage 1) was killed by SIGSEGV" and code == 128 + signal.SIGSEGV


def test_ranks_that_said_why_get_no_second_line():
    assert explain({0: failed(ANNOUNCED), 1: failed(-signal.SIGKILL)}, stages=2) == (1, None)
    assert explain({0: failed(2), 1: failed(1)}, stages=2) == (2, None)
    assert explain({0: failed(128 + signal.SIGTERM)}) == (128 + signal.SIGTERM, None)


def test_a_plain_failure_points_at_the_rank_message():
    code, line = explain({2: failed(1)}, stages=2)
    assert code == 1 and line == "gpipe: rank 2 (stage 0) exited with code 1; see its message above"


def test_a_rank_that_raised_is_the_cause_not_the_peer_the_tear_down_ended():
    code, line = explain({0: failed(1, 100), 1: failed(-signal.SIGTERM, 100)}, stages=2)
    assert code == 1 and line == "gpipe: rank 0 (stage 0) exited with code 1; see its message above"
    code, line = explain({0: failed(1, 100), 1: failed(-signal.SIGTERM, 101)}, stages=2)
    assert code == 1 and line == "gpipe: rank 0 (stage 0) exited with code 1; see its message above"


def test_a_rank_ended_by_sigterm_before_its_peer_gave_up_is_the_cause():
    code, line = explain({0: failed(1, 106), 1: failed(-signal.SIGTERM, 100)}, stages=2)
    assert code == 128 + signal.SIGTERM and line == "gpipe: rank 1 (stage 1) was killed by SIGTERM"
