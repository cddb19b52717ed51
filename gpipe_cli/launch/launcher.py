"""Start the ranks of a job with torchrun's elastic agent (in this process) and report how they ended."""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpipe_cli import interrupts
from gpipe_cli.errors import NONFINITE_EXIT_CODE, UserError
from gpipe_cli.launch import forked
from gpipe_cli.launch.preflight import NODE_FLAGS, Rendezvous, node_flags, reach, rendezvous, threads_per_rank
from gpipe_cli.launch.slurm import SlurmStep, check_one_task_per_node, slurm_step
from gpipe_cli.pipeline.stopping import abrupt_exit, ask, say_stopping_now

_STOPPED = (128 + signal.SIGINT, 128 + signal.SIGTERM, 128 + signal.SIGPIPE)  # SIGPIPE: the output closed
FORCE_S = 20.0  # after a stop with nothing to save, the most a command may take to end
JOIN_TELL_S = 10.0  # a launch of several nodes still without ranks here after this says what it waits for
HANDLER_GRACE_S = 2.0  # how long a stop signal's handler has to act before the launch takes it as blocked
NO_RANKS_S = 2.0  # a blocked launch stopped with no rank of its own for this long ends at once
SHUTDOWN_S = 120  # seconds ranks get to finish a step and checkpoint on Ctrl-C/SIGTERM


def under_torchrun() -> bool:
    """Whether this process is already a rank started by torchrun (or an equivalent launcher)."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


@dataclass
class LaunchOptions:
    """How to start the ranks: nodes, rendezvous, threads per rank."""

    nnodes: str = "1"
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_backend: str | None = None
    rdzv_id: str | None = None
    threads: int | None = None  # intra-op threads per rank; default: cores / local ranks
    slurm: SlurmStep | None = None  # the srun step the defaults came from, if any
    # The options Slurm gave (nnodes, node_rank, rdzv_endpoint): a line about one names its variable, not a flag.
    from_slurm: frozenset[str] = frozenset()


def launch_options(nnodes: str | None = None, node_rank: int | None = None, rdzv_endpoint: str | None = None,
                   rdzv_backend: str | None = None, rdzv_id: str | None = None, threads: int | None = None,
                   environ: Mapping[str, str] | None = None) -> LaunchOptions:
    """The options as given; inside a multi-node srun step, what is not given comes from Slurm (unless --nnodes is)."""
    step = None if nnodes is not None or under_torchrun() else slurm_step(environ)
    if step is None:
        return LaunchOptions(nnodes="1" if nnodes is None else nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint,
                             rdzv_backend=rdzv_backend, rdzv_id=rdzv_id, threads=threads)
    check_one_task_per_node(step)
    static = rdzv_backend in (None, "static")  # c10d ranks nodes itself
    given = {"nnodes", *(["node_rank"] if node_rank is None and static else []),
             *(["rdzv_endpoint"] if not rdzv_endpoint else [])}
    return LaunchOptions(nnodes=str(step.nodes), node_rank=node_rank if node_rank is not None or not static
                         else step.node_rank, rdzv_endpoint=rdzv_endpoint or f"{step.first_host}:{step.port}",
                         rdzv_backend=rdzv_backend, rdzv_id=rdzv_id or f"slurm-{step.job_id}", threads=threads,
                         slurm=step, from_slurm=frozenset(given))


_THREADS = ("OMP_NUM_THREADS", "GPIPE_THREADS")  # what the ranks' intra-op threads are read from


def _giving_ranks(threads: int, options: LaunchOptions) -> contextlib.AbstractContextManager[None]:
    """Within the block, the environment this node's ranks start in holds their threads and launch flags; restored."""
    # Restored: a caller that goes on (a test, a command run in-process) would hand them to every process it starts.
    return forked.environment({**dict.fromkeys(_THREADS, str(threads)), NODE_FLAGS: node_flags(options)})


_warm: int | None = None  # the threads of the ranks that a server `warming` started is for


@contextlib.contextmanager
def warming(options: LaunchOptions, local: int) -> Iterator[None]:
    """Within the block the ranks' server imports torch while this process plans; launches in it fork from it."""
    global _warm
    if not forked.available() or under_torchrun():
        yield
        return
    threads = threads_per_rank(options, local)
    with _giving_ranks(threads, options):
        try:
            forked.prepare()
            _warm = threads
            yield
        finally:
            _warm = None
            forked.stop()  # also where nothing was launched (bad input, Ctrl-C): it would import torch for nobody


class NothingStarted(KeyboardInterrupt):  # noqa: N818 (a stop, named for what it left)
    """A stop while this node waited for the job's rendezvous: it started no rank, and so wrote nothing."""


def _say(line: str) -> None:
    print(f"[gpipe] {line}", file=sys.stderr, flush=True)


def tell_waiting(rdzv: Rendezvous, over: threading.Event, said: Callable[[str], None],
                 after: float = JOIN_TELL_S, stopped: Callable[[], bool] = lambda: False) -> None:
    """Once, `after` s into a launch of several nodes that has started no rank here, say what it waits for."""
    # torch waits up to 15 minutes for the other nodes without a word: node 0 looked hung.
    if rdzv.max_nodes > 1 and not over.wait(after) and not _ranks() and not stopped():
        said(f"waiting for the job's other nodes to join at {rdzv.endpoint} ({rdzv.max_nodes} nodes in all; "
             "Ctrl-C stops)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(world: int, options: LaunchOptions, start_method: str, log_dir: str) -> object:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

    rdzv = rendezvous(world, options)
    configs: dict[str, object] = {"rank": rdzv.node_rank} if rdzv.backend == "static" else {}
    fields: dict[str, Any] = {
        "min_nodes": rdzv.min_nodes, "max_nodes": rdzv.max_nodes, "nproc_per_node": rdzv.ranks_per_node,
        "run_id": rdzv.run_id or uuid.uuid4().hex[:12],
        "rdzv_endpoint": rdzv.endpoint or f"127.0.0.1:{_free_port()}", "rdzv_backend": rdzv.backend,
        "rdzv_configs": configs, "max_restarts": 0, "monitor_interval": 0.1, "start_method": start_method,
        "shutdown_timeout": SHUTDOWN_S,
        # Ctrl-C is forwarded to the ranks by this process (see _Stops.forward_interrupt); the agent must not
        # also turn it into SIGTERM-then-kill, which would cut the final checkpoint short. It still
        # forwards SIGTERM.
        # SIGHUP too, unless this command was started with it ignored (`nohup`): then the job outlives its terminal.
        "signals_to_handle": "SIGTERM,SIGQUIT" + ("" if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
                                                  else ",SIGHUP"),
        # The agent's folders for each rank's error file, in one the launch removes (by default a new
        # torchelastic_* folder in the temporary folder is left behind by every launch).
        "logs_specs": DefaultLogsSpecs(log_dir=log_dir),
    }
    accepted = inspect.signature(LaunchConfig).parameters
    return LaunchConfig(**{k: v for k, v in fields.items() if k in accepted})


def _ranks() -> list[int]:
    """This node's ranks: processes in sessions of their own whose parent is this process or a child of it."""
    # torchrun starts each rank in a session of its own; a forked rank (see forked.run) is a grandchild, the
    # fork server between, which must not be signalled: it reports the ranks' exit codes.
    me, table = os.getpid(), forked.processes()
    children = {pid for pid, (parent, _) in table.items() if parent == me}
    return sorted(pid for pid, (parent, session) in table.items()
                  if session == pid and (parent == me or parent in children))


def _send(pids: list[int], signum: int, wake: bool = True) -> None:
    """Send `signum` to each of `pids` that is still there; `wake`: continue one that is stopped, to take it."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)
            # A stopped rank holds every signal but SIGKILL: a second Ctrl-C, "aborted at once", took 30 s more.
            if wake and signum != signal.SIGKILL:
                os.kill(pid, signal.SIGCONT)


class _Stops:
    """Ctrl-C on the launching side: passed on to the ranks, and told here while they set up (no rank will)."""

    def __init__(self, started: Path | None, forking: bool = False) -> None:
        self.started = started
        self.interrupted = False  # a Ctrl-C stops the job: its ranks' ends are no news, and it exits with 130
        self.told = False
        self.over = threading.Event()  # set when the launch has returned
        self.finishing = False
        self._lock = threading.Lock()  # the handler and the thread that watches for blocked stops both finish
        self.forking = forking  # the ranks fork from a server that imports torch first: none appear for seconds
        self.stood_down = threading.Event()  # a caller that outlives the launch cancels the forced end
        self.first = 0  # the first stop signal: the one the ranks act on and name, whatever follows it
        self.tell: Callable[[], None] | None = None  # tells the other nodes of a stop before the first step
        self.blocked = False  # the stop's handler could not run: the launch waits inside torch (for other nodes)

    def training(self) -> bool:
        """Whether the ranks have a step to finish and save (else a stop ends them at once)."""
        return self.started is not None and self.started.exists()

    def setting_up(self, signum: int) -> None:
        """Say once, while no rank has a step to finish, that the job stops before its first step."""
        if self.started is not None and not self.training() and not self.told:
            self.told = True
            say_stopping_now(signal.Signals(signum).name)
            interrupts.told()
            if self.tell is not None:
                self.tell()

    def forward_interrupt(self, signum: int, frame: object) -> None:
        """Pass Ctrl-C on to the ranks, which torchrun starts in sessions of their own, out of the terminal's reach."""
        # Left first, for the ranks that reach their first step unseen: a rank that has not yet looked finds it, one
        # that has is listed below as training and is sent the signal.
        if self.started is not None:
            ask(self.started, signum)
        training, children, proc = self.training(), _ranks(), os.path.isdir("/proc")
        if proc and not training:
            self.finish(signum)
        if proc and not children and not self.forking:
            raise KeyboardInterrupt  # no rank runs yet: the command stops here, as before the launch
        again, self.interrupted = self.interrupted, True
        self.setting_up(signal.SIGINT)
        # SIGTERM ends even a starting Python quietly. A rank stopped by its user (SIGSTOP, a debugger) is left so
        # by the first Ctrl-C, which it takes when continued; the second, which aborts, continues it.
        _send(children, signal.SIGINT if training else signal.SIGTERM, wake=again)
        if not children:  # none to find (no /proc, or the fork server still imports torch): the agent turns
            interrupts.term_self()  # SIGTERM into a graceful stop of every rank

    def finish(self, signum: int) -> None:
        """Once: see a stop with nothing to save through (`_finish`, in a thread of its own)."""
        with self._lock:
            if self.finishing:
                return
            self.finishing = True
        threading.Thread(target=self._finish, args=(signum,), daemon=True).start()

    @contextlib.contextmanager
    def blocked_stops(self) -> Iterator[None]:
        """Within it a stop signal before the first step is seen through even while Python cannot run its handler."""
        # Node 0's main thread waits inside torch's store for the other nodes (for 15 minutes), and Python runs a
        # handler only between its bytecodes: the signal also goes to a pipe (from C), read by a thread.
        read, write = os.pipe()
        os.set_blocking(write, False)
        previous = signal.set_wakeup_fd(write)

        def watch() -> None:
            while data := os.read(read, 1):
                if data[0] in (signal.SIGINT, *interrupts.TERMINATING):
                    self.first = self.first or data[0]
                # Left alone where a handler acted: the launch returned, or Ctrl-C's handler is seeing it through.
                if data[0] in (signal.SIGINT, *interrupts.TERMINATING) and not self.training() \
                        and not self.over.wait(HANDLER_GRACE_S) and not self.finishing:
                    self.setting_up(data[0])
                    self.blocked = True
                    self.finish(data[0])
            os.close(read)

        threading.Thread(target=watch, name="launch-stops", daemon=True).start()
        try:
            yield
        finally:
            signal.set_wakeup_fd(previous)
            os.close(write)  # the thread reads the end of the pipe and returns

    def _finish(self, signum: int) -> None:
        """See a stop with nothing to save through; a process still here `FORCE_S` after it is stuck, and ends."""
        deadline = time.monotonic() + FORCE_S
        seen = time.monotonic()  # when a rank of this node last ran
        while time.monotonic() < deadline:
            if self.training():
                return  # a rank reached its first step meanwhile: the ranks finish it and save, however long
            ranks = _ranks()
            if ranks:
                seen = time.monotonic()
            elif self.blocked and time.monotonic() - seen >= NO_RANKS_S:
                # Waiting for the other nodes, and no rank here: nothing to see through, its stop already said.
                abrupt_exit(128 + signum)
            if not self.over.is_set():  # again each second: a rank forked at the first's instant can lose it
                _send(ranks, signal.SIGTERM)
            if self.stood_down.wait(1.0):
                return
        _send(_ranks(), signal.SIGKILL)
        print(f"gpipe: still running {FORCE_S:.0f} s after the stop; ended it and its ranks", file=sys.stderr,
              flush=True)
        abrupt_exit(128 + signum)

    def see_ranks_out(self) -> None:
        """Give ranks told to stop their `SHUTDOWN_S` to save, whatever stop comes meanwhile; then end them."""
        # The agent tells the ranks, then waits for them; a SIGTERM again (`kill` twice) ended its wait, and
        # leaving now would end ranks writing their checkpoint. Telling them again would change nothing.
        for signum in interrupts.TERMINATING:
            signal.signal(signum, lambda signum, frame: None)
        deadline = time.monotonic() + SHUTDOWN_S
        while _ranks() and time.monotonic() < deadline:
            time.sleep(0.1)
        _send(_ranks(), signal.SIGKILL)

    def quiet(self, failures: dict[int, Any]) -> bool:
        """Whether every rank just ended as this Ctrl-C asked (nothing for the launcher to explain)."""
        ends = {128 + signal.SIGINT, 128 + signal.SIGTERM, -signal.SIGINT, -signal.SIGTERM}
        return self.interrupted and all(f.exitcode in ends for f in failures.values())


def _name(rank: int, stages: int | None) -> str:
    return f"rank {rank} (stage {rank % stages})" if stages else f"rank {rank}"


def _killed(rank: int, code: int, stages: int | None) -> tuple[int, str]:
    """The exit code and the line for a rank that a signal (-`code`) killed."""
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return 128 - code, f"gpipe: {_name(rank, stages)} was killed by {name}"


def _told(logs: str) -> bool:
    """Whether a rank of this launch told the job's failure in one line (it left a mark among the ranks' logs)."""
    from gpipe_cli.pipeline.failure import TOLD

    return any(Path(logs).rglob(TOLD))


OPEN_FILES = 65536  # the soft limit the ranks are given, where the hard one allows it
LEAST_OPEN_FILES = 64  # below this, a rank of two fails opening its sockets


def open_files_as_allowed() -> None:
    """Raise this process's soft limit of open files (the ranks inherit it) towards its hard limit."""
    # gloo and the store open sockets per peer: under `ulimit -n 40` a rank failed in a traceback of
    # "epoll_create: Too many open files". Only the soft limit, which any process may raise to the hard one.
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, ValueError, OSError):
        return
    want = OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES)
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
    if soft != resource.RLIM_INFINITY and soft < LEAST_OPEN_FILES:
        raise UserError(f"this shell allows {soft} open files (ulimit -n), and the ranks need at least "
                        f"{LEAST_OPEN_FILES} for their connections: raise it (ulimit -n 1024) and start again")


def explain(failures: dict[int, Any], stages: int | None = None, told: bool = False) -> tuple[int, str | None]:
    """The job's exit code for the failed ranks (rank -> ProcessFailure), and the line why (None: a rank said it)."""
    from gpipe_cli.pipeline.failure import ANNOUNCED

    codes = {rank: f.exitcode for rank, f in failures.items()}
    if UserError.exit_code in codes.values():  # bad input: the rank that found it said so
        return UserError.exit_code, None
    if NONFINITE_EXIT_CODE in codes.values():  # rank 0 said at which step, stage and layer
        return NONFINITE_EXIT_CODE, None
    # A rank told the cause (a stall) in one line and ended the job; the stopped rank it killed may be the one
    # failure heard of.
    if told or ANNOUNCED in codes.values():
        return 1, None
    # A rank killed by a signal is the cause; the others failed because it vanished, or stopped on the
    # tear-down's SIGTERM. Timestamps only have whole seconds: the first failure by time is no guide.
    killed = sorted((codes[r] == -signal.SIGTERM, failures[r].timestamp, r)
                    for r, c in codes.items() if isinstance(c, int) and c < 0)
    if killed and not killed[0][0]:
        return _killed(killed[0][2], codes[killed[0][2]], stages)
    for code in _STOPPED:
        if code in codes.values():  # Ctrl-C or SIGTERM: the ranks said what they did
            return code, None
    failed = [r for r, c in codes.items() if isinstance(c, int) and c > 0]
    # A rank that raised exits at once and the agent then ends the others with SIGTERM, in the same second
    # or the next; a rank that only lost a killed peer waits seconds for that tear-down before it exits.
    first = min(failed, key=lambda r: failures[r].timestamp) if failed else None
    if killed and (first is None or failures[first].timestamp > min(t for _, t, _ in killed)):
        return _killed(killed[0][2], codes[killed[0][2]], stages)
    rank = first if first is not None else min(codes, key=lambda r: failures[r].timestamp)
    code = codes[rank]
    return (code if isinstance(code, int) and code > 0 else 1,
            f"gpipe: {_name(rank, stages)} exited with code {code}; see its message above")


def start_failure(exc: Exception, rdzv: Rendezvous) -> str:
    """Why the job could not start, in words: torch's rendezvous errors as what to do about them."""
    text = str(exc).strip()
    again = "start gpipe train on every node with the same --nnodes and --rdzv-endpoint"
    if rdzv.max_nodes > 1 and "clients joined" in text:  # torch's store on node 0: "1/2 clients joined"
        return f"the other nodes did not join at {rdzv.endpoint} in time ({text}); {again}"
    if rdzv.max_nodes > 1 and type(exc).__name__ == "RendezvousTimeoutError":  # c10d's, which says nothing
        return f"the other nodes did not join at {rdzv.endpoint} in time (c10d's rendezvous timeout); {again}"
    if "EADDRINUSE" in text:  # the store's port, which another program holds
        where = f"{rdzv.endpoint}'s port" if rdzv.endpoint else "the port the job chose"
        return (f"{where} is in use on this node by another program"
                + ("; give --rdzv-endpoint a free port, the same on every node" if rdzv.endpoint else "; try again"))
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# In this process rather than a `torchrun` child, so that a failure is one line (the failed rank printed its own
# error) and a rank killed by a signal, which cannot say so, is named here. `stages` (ranks per pipeline) names a
# rank's stage; `started` is the file the ranks create once they have work to finish: a stop before it is told here.
def launch(module: str, args: list[str], world: int, options: LaunchOptions | None = None,
           stages: int | None = None, started: Path | None = None) -> int:
    """Run `python -m module *args` on `world` ranks (this node's share of them); return an exit code."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    interrupts.check()  # a Ctrl-C swallowed while the command loaded: no rank starts
    options = options or LaunchOptions()
    open_files_as_allowed()
    rdzv = rendezvous(world, options)
    try:
        reach(rdzv, _say)
    except KeyboardInterrupt:
        raise NothingStarted from None
    fork = forked.available()
    logs = tempfile.TemporaryDirectory(prefix="gpipe-launch-", ignore_cleanup_errors=True)  # gone at exit too
    config = _config(world, options, forked.START_METHOD if fork else "spawn", logs.name)
    local = config.nproc_per_node  # type: ignore[attr-defined]
    threads = threads_per_rank(options, local)
    warm = fork and _warm == threads  # a server started for ranks like these: it serves this launch, and the next
    for name in list(logging.root.manager.loggerDict):
        # The ranks report their own failures, and a stop is told in one line; the agent's log lines
        # (each of its modules sets its own level) would only repeat them.
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    stops = _Stops(started, forking=fork)
    clear: Callable[[], None] = lambda: None  # takes back this node's stop of an earlier start
    if rdzv.max_nodes > 1 and rdzv.endpoint:
        from gpipe_cli.pipeline.failure import clear_stopped, tell_stopped

        run_id = config.run_id  # type: ignore[attr-defined]
        node = f"node {rdzv.node_rank} ({socket.gethostname()})" if rdzv.node_rank is not None else socket.gethostname()
        if rdzv.node_rank != 0:  # node 0 holds the store: started again, it starts a new one
            clear = functools.partial(clear_stopped, str(rdzv.endpoint), run_id, node)
        stops.tell = lambda: tell_stopped(str(rdzv.endpoint), run_id, node)
    previous = interrupts.take_signal(stops.forward_interrupt)
    # The agent installs its own for these and leaves them behind.
    previous_stops = {signum: signal.getsignal(signum) for signum in interrupts.TERMINATING}
    threading.Thread(target=tell_waiting, args=(rdzv, stops.over, _say, JOIN_TELL_S, lambda: stops.told),
                     name="launch-wait", daemon=True).start()
    try:
        with _giving_ranks(threads, options), stops.blocked_stops():
            clear()  # under the stops' watch: a store that never answers must not outlast a Ctrl-C
            if fork:
                forked.prepare(fresh=not warm)
                elastic_launch(config, forked.run)(module, list(args))  # type: ignore[arg-type]
            else:
                elastic_launch(config, sys.executable)("-u", "-m", module, *args)  # type: ignore[arg-type]
    except ChildFailedError as exc:
        if stops.quiet(exc.failures):
            return 128 + signal.SIGINT
        code, line = explain(exc.failures, stages, _told(logs.name))
        if line:
            print(line, file=sys.stderr, flush=True)
        return code
    except SignalException as exc:
        # A second signal raises again in the agent: the code is the first's, which the ranks name.
        signum = signal.SIGINT if stops.interrupted else stops.first or signal.Signals(int(exc.sigval))
        stops.setting_up(signum)
        stops.see_ranks_out()
        return 128 + signum
    except Exception as exc:  # rendezvous failures: unreachable endpoint, timeout
        if isinstance(exc.__context__, KeyboardInterrupt):  # a Ctrl-C raised in torch's code, which then failed:
            raise exc.__context__ from None  # its timing wrapper read a variable the interrupt left unset
        print(f"gpipe: could not start the job: {start_failure(exc, rdzv)}", file=sys.stderr)
        return 1
    finally:
        stops.over.set()
        if fork:
            forked.stop(server=not warm)
        signal.signal(signal.SIGINT, previous)  # type: ignore[arg-type]
        for signum, handler in previous_stops.items():
            signal.signal(signum, handler)
        logs.cleanup()
    return 0
