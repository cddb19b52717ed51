"""Ranks fork from one server that imported torch once; each runs as `python -u -m` would and ends as it chose."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from multiprocessing import forkserver
from pathlib import Path

import pytest

from gpipe_cli.launch import forked, launcher
from gpipe_cli.launch.launcher import LaunchOptions, launch

pytestmark = pytest.mark.skipif(not forked.available(), reason="no fork server on this platform")
PROBE = "tests.launch.forked_probe"


def _launch(folder: Path, mode: str, monkeypatch: pytest.MonkeyPatch, value: str, go: bool = True) -> int:
    for name in ("OMP_NUM_THREADS", "GPIPE_THREADS"):  # the launch sets them for its ranks
        monkeypatch.setenv(name, os.environ.get(name, "1"))
    monkeypatch.setenv("GPIPE_PROBE", value)
    if go:
        (folder / "go").touch()
    return launch(PROBE, [str(folder), mode], 2, LaunchOptions(threads=1))


def _facts(folder: Path) -> list[dict]:
    return [json.loads((folder / f"rank-{rank}.json").read_text()) for rank in range(2)]


def test_ranks_fork_preloaded_in_sessions_of_their_own_with_the_launch_environment(tmp_path: Path,
                                                                                  monkeypatch: pytest.MonkeyPatch):
    found: dict[int, str] = {}

    def watch(folder: Path) -> None:  # while the ranks wait for "go", they are what the launcher would signal
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not all((folder / f"rank-{r}.json").exists() for r in range(2)):
            time.sleep(0.05)
        found.update({pid: Path(f"/proc/{pid}/comm").read_text().strip() for pid in launcher._ranks()})
        for signum in (signal.SIGINT, signal.SIGTERM):  # meant for the job's process group: the server stays
            os.kill(forkserver._forkserver._forkserver_pid, signum)  # type: ignore[attr-defined]
        (folder / "go").touch()

    for value in ("first", "second"):  # a server left from an earlier launch would hold the earlier environment
        folder = tmp_path / value
        folder.mkdir()
        thread = threading.Thread(target=watch, args=(folder,))
        thread.start()
        assert _launch(folder, "ok", monkeypatch, value, go=False) == 0
        thread.join()
        facts = _facts(folder)
        for rank, rank_facts in enumerate(facts):
            assert rank_facts["torch_before_main"] and rank_facts["session_leader"] and rank_facts["world"] == 2
            assert rank_facts["parent"] != os.getpid()  # forked by the server, not by this process
            assert rank_facts["probe_env"] == value
            assert rank_facts["blocked"] == [] and rank_facts["sigterm_default"]  # the server's are not its own
            assert found[rank_facts["pid"]] == f"gpipe rank {rank}"
        assert sorted(found) == sorted(f["pid"] for f in facts)  # the server between is not a rank
        assert {f["parent"] for f in facts}.isdisjoint(found)
        found.clear()


@pytest.mark.parametrize("fork", [True, False], ids=["forked", "python -m"])
def test_a_rank_that_exits_with_a_code_ends_the_job_with_it_and_its_output_whole(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch,
                                                                               capfd: pytest.CaptureFixture[str],
                                                                               fork: bool):
    if not fork:  # where there is no fork server, or its socket's path would be too long
        monkeypatch.setattr(forked, "available", lambda: False)
    assert _launch(tmp_path, "fail", monkeypatch, "x") == 5
    out, err = capfd.readouterr()
    assert "rank 1 fails on purpose" in out
    assert "gpipe: rank 1 exited with code 5; see its message above" in err


def test_a_forked_rank_killed_by_a_signal_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capfd: pytest.CaptureFixture[str]):
    assert _launch(tmp_path, "kill", monkeypatch, "x") == 128 + signal.SIGKILL
    assert "gpipe: rank 1 was killed by SIGKILL" in capfd.readouterr().err


def _server() -> int | None:
    return forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]


def test_the_server_started_while_jobs_are_planned_forks_their_ranks_and_ends_with_the_block(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    threads = ("OMP_NUM_THREADS", "GPIPE_THREADS")
    for name in threads:  # the caller's own: `warming` and a launch set them for the ranks, and restore them
        monkeypatch.setenv(name, "7")
    monkeypatch.setenv("GPIPE_PROBE", "warm")
    runs = [tmp_path / "first", tmp_path / "second"]
    with launcher.warming(LaunchOptions(threads=1), 2):
        early = _server()
        assert early is not None and [os.environ[name] for name in threads] == ["1", "1"]
        for folder in runs:  # as bench runs K=1, then K ranks
            folder.mkdir()
            (folder / "go").touch()
            assert launch(PROBE, [str(folder), "ok"], 2, LaunchOptions(threads=1)) == 0
    for folder in runs:  # not a server started at the launch
        assert {facts["parent"] for facts in _facts(folder)} == {early}
        assert all(facts["torch_before_main"] and facts["probe_env"] == "warm" for facts in _facts(folder))
    assert _server() is None and not Path(f"/proc/{early}").exists()

    with launcher.warming(LaunchOptions(threads=1), 2):  # a plan refused, a Ctrl-C: no launch comes
        unused = _server()
        assert unused is not None
    assert _server() is None and not Path(f"/proc/{unused}").exists()

    with launcher.warming(LaunchOptions(threads=1), 2):
        other = tmp_path / "other threads"
        other.mkdir()
        (other / "go").touch()
        assert launch(PROBE, [str(other), "ok"], 2, LaunchOptions(threads=2)) == 0
        assert _server() is None  # the launch had a server of its own, started with its threads, and ended it
        assert [os.environ[name] for name in threads] == ["1", "1"]
    assert [os.environ[name] for name in threads] == ["7", "7"]
    assert {facts["parent"] for facts in _facts(other)}.isdisjoint({early, unused})


@pytest.mark.parametrize("given, started", [(None, "ERROR"), ("INFO", "INFO")])
def test_the_server_imports_torch_with_c10d_warnings_off_unless_the_user_sets_their_level(
        monkeypatch: pytest.MonkeyPatch, given: str | None, started: str):
    # A job whose launcher was killed printed four pages of C++ frames from c10d's warnings before its one line.
    if given is None:
        monkeypatch.delenv("TORCH_CPP_LOG_LEVEL", raising=False)
    else:
        monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", given)
    seen: list[str | None] = []
    monkeypatch.setattr(forked, "stop", lambda: None)
    monkeypatch.setattr(forkserver, "ensure_running", lambda: seen.append(os.environ.get("TORCH_CPP_LOG_LEVEL")))
    forked.prepare()
    assert seen == [started] and os.environ.get("TORCH_CPP_LOG_LEVEL") == given  # put back after the start


def test_a_caller_learns_when_the_server_holds_what_ranks_import_and_waits_for_no_server():
    # plan held Ctrl-C while its first children started, and a start waits for the server's seconds of imports.
    forked.prepare()
    try:
        forked.wait_preloaded(300)
        server = _server()
        assert server is not None and os.path.exists(forked._preloaded(server))
    finally:
        forked.stop()
    assert not forked.running()
    start = time.monotonic()
    forked.wait_preloaded(300)
    assert time.monotonic() - start < 60  # nothing to wait for (generous: a loaded machine)


def _nothing() -> None:
    pass


def test_a_server_started_elsewhere_in_the_process_is_replaced_by_one_that_says_it_preloaded():
    # The multi-rank tests start one with their own preload: plan's children waited 300 s apiece for its word.
    ctx = multiprocessing.get_context(forked.START_METHOD)
    ctx.set_forkserver_preload(["os"])
    child = ctx.Process(target=_nothing)
    child.start()
    child.join(120)
    elsewhere = _server()
    assert elsewhere is not None and child.exitcode == 0
    start = time.monotonic()
    forked.wait_preloaded(300)
    assert time.monotonic() - start < 60  # it would never say: no wait (generous: a loaded machine)
    try:
        forked.prepare(fresh=False)
        ours = _server()
        assert ours not in (None, elsewhere) and not Path(f"/proc/{elsewhere}").exists()
        forked.wait_preloaded(300)
        assert ours is not None and os.path.exists(forked._preloaded(ours))
        forked.prepare(fresh=False)  # its own is kept
        assert _server() == ours
    finally:
        forked.stop()
    assert not os.path.exists(forked._preloaded(ours))


def test_a_server_whose_command_has_gone_loads_without_a_traceback(tmp_path: Path):
    # A SIGHUP to `gpipe plan` while its server loaded: the command's folder was gone when the server marked itself
    # loaded, and a FileNotFoundError's traceback followed the one line of the stop.
    gone = tmp_path / "gone" / "gpipe-preloaded"
    proc = subprocess.run([sys.executable, "-c", "import gpipe_cli.launch.preloaded"], capture_output=True, text=True,
                          env={**os.environ, "GPIPE_PRELOADED": str(gone)}, timeout=120)
    assert (proc.returncode, proc.stderr) == (0, "")


def test_a_stop_signal_while_the_server_starts_reaches_the_command(monkeypatch: pytest.MonkeyPatch):
    # Ignored by the whole process while the server started, a SIGTERM that another of its threads took was lost:
    # `gpipe bench` stopped right then ran to its end and exited 0.
    got: list[int] = []
    blocked: list[bool] = []
    idle = threading.Event()
    other = threading.Thread(target=idle.wait)  # a thread that takes what the starting one holds
    other.start()

    def start() -> None:
        blocked.append(set(forked.JOB_SIGNALS) <= signal.pthread_sigmask(signal.SIG_BLOCK, []))  # the server's too
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)

    monkeypatch.setattr(forked, "stop", lambda: None)
    monkeypatch.setattr("multiprocessing.resource_tracker.ensure_running", lambda: None)
    monkeypatch.setattr(forkserver, "ensure_running", start)
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    try:
        forked.prepare()
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        signal.signal(signal.SIGTERM, previous)
        idle.set()
        other.join()
    assert blocked == [True] and got == [signal.SIGTERM]


def test_the_resource_tracker_outlives_a_sighup_to_the_job_s_process_group():
    # A closed terminal signals the whole group: the tracker, which keeps only SIGINT and SIGTERM blocked, died on
    # SIGHUP and the command's last line was followed by a warning and eight KeyError tracebacks.
    code = ("from multiprocessing import resource_tracker\n"
            "from gpipe_cli.launch import forked\n"
            "forked.prepare()\n"
            "pid = resource_tracker._resource_tracker._pid\n"
            "status = open(f'/proc/{pid}/status').read().split()\n"
            "blocked = int(status[status.index('SigBlk:') + 1], 16)\n"
            "forked.stop()\n"
            "print(bool(blocked & 1))\n")  # SIGHUP is signal 1: bit 0 of the mask
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "True", out.stderr[-2000:]


def test_the_server_ends_with_a_launcher_killed_outright(tmp_path: Path):
    # A launcher's SIGKILL left its server (its ranks hold the pipe whose end would end it) and so its ranks running:
    # an orphan rank trained on, then waited for good. The server ends with it now, and torch stops its ranks.
    code = ("import sys, torch.multiprocessing as mp\n"
            "from gpipe_cli.launch import forked\n"
            "from tests.launch.forked_probe import sleeping_rank\n"
            "forked.prepare()\n"
            "forked.wait_preloaded(120)\n"
            f"mp.start_processes(sleeping_rank, args=({str(tmp_path)!r},), nprocs=1, join=False,\n"
            "                   start_method='forkserver')\n"
            "print(forked._server(), flush=True)\n"
            "import time; time.sleep(120)\n")
    # Its server's folder stays when it is killed: in the test's own.
    launcher = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "TMPDIR": str(tmp_path)})
    assert launcher.stdout is not None
    server = int(launcher.stdout.readline())
    deadline = time.monotonic() + 60
    while not (tmp_path / "rank.pid").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    rank = int((tmp_path / "rank.pid").read_text())
    try:
        launcher.kill()
        launcher.wait(30)
        deadline = time.monotonic() + 20
        while any(os.path.exists(f"/proc/{pid}") for pid in (server, rank)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{server}") and not os.path.exists(f"/proc/{rank}")
    finally:
        for pid in (rank, server):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
