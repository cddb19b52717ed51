"""A rank that loses its peer or its job's store ends by itself, in one line that says so."""

import os
import subprocess
import sys
import textwrap

import pytest

from gpipe_cli.pipeline import failure
from tests.multiproc import free_port

STORE = """
import sys, time
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, is_master=True, wait_for_workers=False)
print("up", flush=True)
time.sleep(120)
"""


def _python(code: str, *args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


def test_a_rank_whose_job_store_is_gone_ends_saying_so():
    port = str(free_port())
    store = _python(STORE, port)
    try:
        assert store.stdout is not None and store.stdout.readline().strip() == "up"
        rank = _python("""
            import time
            from gpipe_cli.pipeline import failure
            watch = failure.AbortWatch("stage 1 (rank 1)")
            print("watching", flush=True)
            time.sleep(120)
            """, env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
        assert rank.stdout is not None and rank.stdout.readline().strip() == "watching"
    finally:
        store.kill()  # the launcher (or rank 0, which held the store) is gone
        store.wait()
    _, err = rank.communicate(timeout=60)
    assert rank.returncode == failure.EXIT_CODE
    assert err.strip().splitlines()[-1] == "[gpipe] stage 1 (rank 1) stopped: lost contact with the job", err


def test_a_rank_whose_peer_vanished_waits_for_the_launcher_then_names_the_cause_itself():
    code = """
        from gpipe_cli.pipeline import failure
        failure.PEER_GRACE_S = 0.1  # no launcher here to end it meanwhile

        def work():
            raise RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4567. This "
                               "is typically caused by a remote worker crashing ... GLHF!")

        failure.run_guarded(work, "stage 0 (rank 0)")
        """
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == failure.EXIT_CODE
    assert proc.stderr.strip().splitlines() == [
        "[gpipe] stage 0 (rank 0) lost contact with another rank: RuntimeError: [../gloo/transport/tcp/pair.cc:534] "
        "Connection closed by peer [127.0.0.1]:4567"], proc.stderr


def test_a_rank_that_gave_up_waiting_for_a_frozen_peer_says_so_in_one_line(tmp_path):
    # It led with gloo's source path, reported a failure that the other rank repeated as the cause, and the
    # launcher added a third line.
    code = """
        from gpipe_cli.pipeline import failure

        def work():
            raise RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 600000ms for send "
                               "operation to complete")

        failure.run_guarded(work, "stage 0 (rank 0)")
        """
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "TORCHELASTIC_ERROR_FILE": str(tmp_path / "error.json")})
    assert proc.returncode == failure.EXIT_CODE
    assert proc.stderr.strip().splitlines() == [
        "[gpipe] stage 0 (rank 0) gave up waiting for another rank, which is stopped, frozen or unreachable: "
        "RuntimeError: Timed out waiting 600000ms for send operation to complete"], proc.stderr
    assert (tmp_path / failure.TOLD).exists()  # the launcher adds no line of its own


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_rank_whose_output_disk_is_full_says_so_in_one_line(tmp_path, monkeypatch):
    # The launcher added a line of its own (`rank 0 (stage 0) exited with code 1; see its message above`): the
    # rank leaves the mark that it told the job's failure.
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    # A log on a full disk was a rank's traceback, then the same error again from its last flush.
    code = """
        import sys
        from gpipe_cli.pipeline import failure
        from gpipe_cli.train import output

        output.guard_output()

        def work():
            print("step 1", flush=True)

        failure.run_guarded(work, "stage 0 (rank 0)")
        """
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], stdout=full, stderr=subprocess.PIPE,
                              text=True, timeout=60)
    assert proc.returncode == failure.EXIT_CODE
    assert proc.stderr.strip().splitlines() == [
        "[gpipe] stage 0 (rank 0) stopped: cannot write to standard output (No space left on device); the run ends "
        "at its last checkpoint"], proc.stderr
    assert (tmp_path / failure.TOLD).exists()


def test_a_node_stopped_while_its_ranks_start_ends_the_ranks_waiting_for_it_on_the_others():
    # They waited inside torch for its ranks to connect, without a word, for the 10-minute connection timeout.
    port = str(free_port())
    store = _python(STORE, port)
    try:
        assert store.stdout is not None and store.stdout.readline().strip() == "up"
        ranks = [_python("""
            import time
            from gpipe_cli.pipeline import failure
            watch = failure.AbortWatch("stage 0 (rank 0)")
            print("watching", flush=True)
            time.sleep(120)
            """, env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "LOCAL_RANK": str(local),
                      "TORCHELASTIC_RUN_ID": "job7"}) for local in (0, 1)]
        for rank in ranks:
            assert rank.stdout is not None and rank.stdout.readline().strip() == "watching"
        failure.tell_stopped(f"127.0.0.1:{port}", "job7", "node 1 (host1)")  # that node's launcher, on its stop
        outcomes = [rank.communicate(timeout=60) for rank in ranks]
    finally:
        store.kill()
        store.wait()
    assert [rank.returncode for rank in ranks] == [failure.EXIT_CODE] * 2
    # Each node says it once: its first local rank.
    assert outcomes[0][1].strip() == "[gpipe] stage 0 (rank 0) stopped: node 1 (host1) was stopped before the " \
                                     "first step" and outcomes[1][1].strip() == ""


def test_a_node_started_again_takes_back_the_stop_it_told_while_waiting_for_a_third():
    # Stopped while three nodes gathered, node 1 left its stop in the store on node 0: started again, it formed
    # the job and every rank ended at once, "node 1 was stopped before the first step".
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    endpoint, key = f"127.0.0.1:{store.port}", "gpipe/abort/job7/0"
    failure.tell_stopped(endpoint, "job7", "node 1 (host1)")
    failure.clear_stopped(endpoint, "job7", "node 2 (host2)")  # another node's report is not its own to take back
    assert store.get(key).decode().endswith("\nnode 1 (host1) was stopped before the first step")
    failure.clear_stopped(endpoint, "job7", "node 1 (host1)")
    assert store.get(key) == b""
    rank = _python("""
        import time
        from gpipe_cli.pipeline import failure
        watch = failure.AbortWatch("stage 0 (rank 0)")
        time.sleep(6 * failure.POLL_S)
        print("still watching", flush=True)
        watch.stop()
        time.sleep(2 * failure.POLL_S)  # its thread leaves the store before the interpreter ends
        """, env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
                  "TORCHELASTIC_RUN_ID": "job7"})
    out, err = rank.communicate(timeout=60)
    assert (rank.returncode, out.strip(), err.strip()) == (0, "still watching", "")  # the emptied key is no report
    failure.tell_stopped(endpoint, "job7", "node 2 (host2)")  # a stop told later still takes its place
    assert store.get(key).decode().endswith("\nnode 2 (host2) was stopped before the first step")
    failure.clear_stopped("127.0.0.1:1", "job7", "node 1 (host1)")  # no store there yet: nothing to do, no error


@pytest.mark.timeout(60)  # unbounded, it hangs: a failure in a minute rather than the suite's ten
def test_telling_or_taking_back_a_stop_with_another_program_on_the_port_is_bounded(monkeypatch):
    # A program that accepts and never answers held c10d's handshake, and the node, for good, Ctrl-C said but unheeded.
    import socket
    import time

    monkeypatch.setattr(failure, "STORE_TIMEOUT_S", 0.5)
    with socket.create_server(("127.0.0.1", 0)) as foreign:
        started = time.monotonic()
        failure.clear_stopped(f"127.0.0.1:{foreign.getsockname()[1]}", "job7", "node 1 (host1)")
        failure.tell_stopped(f"127.0.0.1:{foreign.getsockname()[1]}", "job7", "node 1 (host1)")  # a Ctrl-C's
        assert time.monotonic() - started < 10


def test_a_rank_finds_a_job_store_that_is_gone_at_once(monkeypatch):
    # Node 0 refused the job and ended: node 1's ranks tried its store for 30 s twice, logging C++ frames each time.
    import socket
    import time

    with socket.create_server(("127.0.0.1", 0)) as gone:
        port = gone.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    started = time.monotonic()
    assert failure.connect() is None and time.monotonic() - started < 10


@pytest.mark.parametrize(("host", "local_rank", "said"), [
    ("hostB", "0", ["error: the nodes were given different recipes: ..."]),  # another node's terminal: once there
    ("hostB", "1", []),  # that node's first rank says it
    (None, "0", []),  # this host's rank that reported it said it here
])
def test_bad_input_another_node_found_is_said_once_on_this_node_too(host, local_rank, said):
    # A node refused by rank 0's check (other recipe, --resume on one node) exited 2 without a word.
    code = f"""
        import socket
        from gpipe_cli.errors import UserError
        from gpipe_cli.pipeline import failure

        class Watch:
            def stop(self):
                pass

            def report(self, summary, kind):
                host = {host!r} or socket.gethostname()
                return False, summary, kind, f"123@{{host}}"

        def work():
            raise UserError("the nodes were given different recipes: ...")

        failure.run_guarded(work, "stage 1 (rank 1)", Watch(), quiet=(UserError,))
        """
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "LOCAL_RANK": local_rank})
    assert (proc.returncode, proc.stderr.strip().splitlines()) == (2, said), proc.stderr
