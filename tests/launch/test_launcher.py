"""How the launcher explains the ranks that failed (pure: torchrun's failure records faked)."""

import os
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest

from gpipe_cli.launch.launcher import _send, _told, explain, start_failure
from gpipe_cli.launch.preflight import Rendezvous
from gpipe_cli.pipeline.failure import ANNOUNCED, AbortWatch


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


def test_the_stopped_rank_a_stall_report_killed_is_not_news(tmp_path, monkeypatch, capsys):
    # The launcher hears of the first rank to end only: here the killed one, before the rank that told why.
    error_file = tmp_path / "run_0" / "attempt_0" / "1" / "error.json"
    error_file.parent.mkdir(parents=True)
    assert not _told(str(tmp_path))
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.delenv("MASTER_ADDR", raising=False)  # no store: this rank reports first
    assert AbortWatch("stage 0").announce("rank 1 (stage 1) stopped responding")
    assert capsys.readouterr().err == "[gpipe] rank 1 (stage 1) stopped responding\n"
    assert _told(str(tmp_path))
    assert explain({1: failed(-signal.SIGKILL)}, stages=2, told=True) == (1, None)


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


def test_a_node_rank_equal_to_the_number_of_nodes_is_refused_before_any_rank_starts():
    from gpipe_cli.errors import UserError
    from gpipe_cli.launch.launcher import LaunchOptions
    from gpipe_cli.launch.preflight import check_launch

    # Node ranks run from 0 to N-1: `--nnodes 2 --node-rank 2` was let through to a rendezvous that never completes.
    def options(rank: int) -> LaunchOptions:
        return LaunchOptions(nnodes="2", node_rank=rank, rdzv_endpoint="head:29500", rdzv_backend="static")

    assert check_launch(options(1), world=4) == 2
    with pytest.raises(UserError) as caught:
        check_launch(options(2), world=4)
    assert str(caught.value) == "--node-rank: must be >= 0 and < the number of nodes, 2 (got 2)"


def test_the_ranks_get_the_open_files_the_hard_limit_allows_and_too_few_is_one_line(monkeypatch):
    # Under `ulimit -n 40` a rank failed in a gloo traceback, "epoll_create: Too many open files".
    import resource

    from gpipe_cli.errors import UserError
    from gpipe_cli.launch.launcher import open_files_as_allowed

    set_to = []
    monkeypatch.setattr(resource, "setrlimit", lambda which, limits: set_to.append(limits))
    monkeypatch.setattr(resource, "getrlimit", lambda which: (1024, 4096))
    open_files_as_allowed()
    assert set_to == [(4096, 4096)]
    monkeypatch.setattr(resource, "getrlimit", lambda which: (40, 40))
    with pytest.raises(UserError, match=r"^this shell allows 40 open files \(ulimit -n\), and the ranks need at least "
                                        r"64 for their connections: raise it \(ulimit -n 1024\) and start again$"):
        open_files_as_allowed()


NODES = Rendezvous(2, 2, 1, "static", "host0:29500", "gpipe", 0)


def test_a_job_that_could_not_start_is_said_as_what_to_do():
    # c10d's timeout said nothing after "RendezvousTimeoutError:"; a port in use was torch's own words.
    from torch.distributed import DistNetworkError
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

    again = "start gpipe train on every node with the same --nnodes and --rdzv-endpoint"
    assert start_failure(RendezvousTimeoutError(), NODES) == (
        f"the other nodes did not join at host0:29500 in time (c10d's rendezvous timeout); {again}")
    assert start_failure(RuntimeError("Timed out after 901 seconds waiting for clients. 1/2 clients joined."),
                         NODES) == ("the other nodes did not join at host0:29500 in time (Timed out after 901 seconds "
                                    f"waiting for clients. 1/2 clients joined.); {again}")
    in_use = DistNetworkError("The server socket has failed to listen on any local network address. port: 29500, "
                              "useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use")
    assert start_failure(in_use, NODES) == ("host0:29500's port is in use on this node by another program; give "
                                            "--rdzv-endpoint a free port, the same on every node")
    one = Rendezvous(1, 1, 2, "static", None, None, 0)
    assert start_failure(in_use, one) == "the port the job chose is in use on this node by another program; try again"
    assert start_failure(ValueError("odd"), NODES) == "ValueError: odd"


def test_a_stopped_rank_is_continued_to_take_the_signal_it_is_sent():
    # Ctrl-C twice with a rank under SIGSTOP: "aborted at once", then 30 s more while torch waited for it.
    code = ("import signal, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))  # a rank's handler: it runs only once continued\n"
            "print('ready', flush=True)\n"
            "time.sleep(60)\n")
    rank = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert rank.stdout is not None and rank.stdout.readline() == "ready\n"
        os.kill(rank.pid, signal.SIGSTOP)
        _send([rank.pid], signal.SIGTERM)
        assert rank.wait(10) == 3
    finally:
        rank.kill()
        rank.wait()
