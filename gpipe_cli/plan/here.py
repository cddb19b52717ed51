"""What N ranks on this machine add to one process's measurements: shared cores, caches and memory, and links."""

from __future__ import annotations

import contextlib
import functools
import multiprocessing as mp
import os
import queue
import signal
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.synchronize import Event
from typing import Any

import torch
import torch.distributed as dist

from gpipe_cli import contention
from gpipe_cli.contention import usable_cores
from gpipe_cli.estimate.simulate import Link
from gpipe_cli.launch import forked
from gpipe_cli.units import counted

# The recipe's optimizer over some parameters (a picklable factory: it is built in each rank).
OptimizerOf = Callable[[list[torch.nn.Parameter]], "torch.optim.Optimizer | None"]


class Unavailable(RuntimeError):
    """Processes beside this one could not be run or measured here (the plan then does without)."""


START_TIMEOUT_S = 300.0  # a sibling imports torch and builds the model first; a loaded machine is slow
SMALL, LARGE = 64 << 10, 4 << 20  # bytes of the two message sizes timed
REPEATS = 30


@contextlib.contextmanager
def _sigint_held() -> Iterator[None]:
    """Start children with SIGINT blocked, and hold a Ctrl-C to this process until the body is done."""
    # The mask survives exec, so Ctrl-C stays the parent's alone to handle. It covers this thread only: the
    # signal can land on another one (a torch worker) and interrupt `start` between the child's launch and
    # the write of its arguments, and that child then dies on an empty pipe with a traceback. Hence the handler.
    held: list[int] = []
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum)) if main else None
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if main:
            signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)
    if held and previous != signal.SIG_IGN:
        if callable(previous):
            previous(signal.SIGINT, None)  # the caller's own handler decides what a Ctrl-C does
        raise KeyboardInterrupt


_forking = False  # within `siblings`: children fork from one server that imported torch once


@contextlib.contextmanager
def siblings() -> Iterator[None]:
    """Within the block, the processes started here fork from one server that imports torch once; ended after."""
    global _forking
    _forking = forked.available()
    try:
        yield
    finally:
        if _forking:
            forked.stop()
        _forking = False


def _context() -> Any:
    """Forked from the server (started at the first use) within `siblings`, else spawned: each imports torch."""
    if not _forking:
        return mp.get_context("spawn")
    forked.prepare(fresh=False)
    return mp.get_context(forked.START_METHOD)


@contextlib.contextmanager
def _children(target: Callable[..., None], args_of: Callable[[int], tuple[Any, ...]],
              count: int) -> Iterator[list[Any]]:
    """Run `count` children of `target` through the body; they are joined after it, or stopped at once on an error."""
    ctx = _context()
    if _forking:
        forked.wait_preloaded(START_TIMEOUT_S)  # its seconds of imports under Ctrl-C's hand, not under `_sigint_held`
    procs: list[Any] = []
    try:
        with _sigint_held():
            for i in range(count):
                proc = ctx.Process(target=target, args=args_of(i), daemon=True)
                proc.start()
                procs.append(proc)
        yield procs
    except BaseException:
        _stop(procs, wait=0.0)
        raise
    _stop(procs, wait=10.0)


def _stop(procs: list[Any], wait: float) -> None:
    for p in procs:
        p.join(timeout=wait)
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)


def _reported(target: Callable[..., None], out: Any, *args: Any) -> None:
    """Run `target(out, *args)` in a child; a failure goes to the parent as one line, never as a traceback."""
    # Forked from the server, which ignores the job's signals: SIGTERM must end it (`_stop`); Ctrl-C stays the parent's.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    try:
        target(out, *args)
    except Exception as exc:  # the parent says what failed and plans on without it
        out.put(f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}")


def _result(out: Any, what: str) -> Any:
    try:
        found = out.get(timeout=START_TIMEOUT_S)
    except queue.Empty:
        raise Unavailable(f"{what}: no answer in {START_TIMEOUT_S:.0f} s") from None
    if isinstance(found, str):
        raise Unavailable(f"{what} failed ({found})")
    return found


def _busy(ready: Any, work: Callable[[], None], threads: int, stop: Event) -> None:
    torch.set_num_threads(threads)
    work()
    ready.put(os.getpid())
    while not stop.is_set():
        work()


# `work` is pickled: a module-level function or a partial of one.
@contextlib.contextmanager
def loaded(work: Callable[[], None], count: int, threads: int) -> Iterator[None]:
    """Run `work` over and over in `count` sibling processes while the body runs, their first run done before it."""
    if count <= 0:
        yield
        return
    ctx = _context()
    stop, ready = ctx.Event(), ctx.Queue()
    with _children(_reported, lambda i: (_busy, ready, work, threads, stop), count) as procs:
        try:
            for _ in procs:
                _result(ready, "starting the ranks that compute beside this one")
            yield
        finally:
            stop.set()


def _timed(fn: Callable[[], Any]) -> float:
    dist.barrier()
    for _ in range(5):
        fn()
    times = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    # A low quantile: a message's own cost; the stalls a loaded machine adds are in the engine's measured steps.
    return statistics.quantiles(times, n=10)[2]


def _ping(rank: int, buf: torch.Tensor) -> None:
    if rank == 0:
        dist.send(buf, 1)
        dist.recv(buf, 1)
    elif rank == 1:
        dist.recv(buf, 0)
        dist.send(buf, 0)


def _ranked(out: Any, rank: int, world: int, store_path: str, threads: int, target: Callable[..., Any],
            *args: Any) -> None:
    """One rank of a gloo group of `world` running `target(rank, world, *args)`; rank 0 sends its answer."""
    torch.set_num_threads(threads)
    os.environ["WORLD_SIZE"] = str(world)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        found = target(rank, world, *args)
        if rank == 0:
            out.put(found)
    finally:
        dist.destroy_process_group()


def _on_ranks(ranks: int, threads: int, what: str, target: Callable[..., Any], *args: Any) -> Any:
    """Run `target(rank, ranks, *args)` on `ranks` processes here, each with `threads` threads; rank 0's answer."""
    out = _context().Queue()
    with tempfile.TemporaryDirectory(prefix="gpipe-ranks-") as tmp:
        store = os.path.join(tmp, "store")
        with _children(_reported, lambda i: (_ranked, out, i, ranks, store, threads, target, *args), ranks):
            return _result(out, what)


def _probe(rank: int, world: int) -> dict[str, float]:
    results: dict[str, float] = {}
    for size in (SMALL, LARGE):
        buf = torch.zeros(size // 4)
        results[f"p2p{size}"] = _timed(functools.partial(_ping, rank, buf)) / 2
        results[f"allreduce{size}"] = _timed(functools.partial(dist.all_reduce, buf))
    return results


def _line(small: float, large: float) -> Link:
    """latency + bytes / bandwidth through the timings of the two sizes."""
    # All of the large one's seconds per byte when noise on a busy machine leaves it no slower than the small
    # one (else the link would be read as infinitely fast).
    rise = large - small
    slope = max(rise / (LARGE - SMALL) if rise > 0 else large / LARGE, 1e-15)
    return Link(1.0 / slope, max(small - SMALL * slope, 0.0))


def links(ranks: int) -> tuple[Link, Link]:
    """This machine's point-to-point link and all-reduce link (per ring hop) between `ranks` processes."""
    ranks = max(ranks, 2)
    results = _on_ranks(ranks, 1, f"measuring the links between {ranks} ranks", _probe)
    p2p = _line(results[f"p2p{SMALL}"], results[f"p2p{LARGE}"])
    hops = 2 * (ranks - 1)
    # A ring all-reduce moves 2 (D-1)/D of the bytes in 2 (D-1) steps (as `plan.search` charges it).
    whole = _line(results[f"allreduce{SMALL}"], results[f"allreduce{LARGE}"])
    return p2p, Link(whole.bandwidth * hops / ranks, whole.latency / hops)


STEPS = 10  # measured engine steps per micro-batch count (after one warm-up)


def start_seconds(ranks: int) -> float:
    """About how long `ranks` processes take to start here: each imports torch (or forks), builds its part and joins."""
    cores = max(min(usable_cores(), ranks), 1)
    if _forking:  # the server imports torch once, at the first start
        return (1.0 if forked.running() else 4.0) + 0.5 * ranks / cores
    return 2.0 + 3.0 * ranks / cores


@dataclass
class Steps:
    """The engine's measured training steps: (step, update) seconds per micro-batch count, and the drift."""

    per_count: dict[int, tuple[float, float]]
    drift: float  # the first count's step measured again last, relative to the first time (0.1: 10% slower)
    load: dict[str, float] = field(default_factory=dict)  # the most others took of the CPU while one count ran


def _engine_rank(rank: int, world: int, kind: str, params: dict[str, Any], balance: list[int], virtual: int,
                 inputs: Any, targets: torch.Tensor, seed: int, counts: list[int], optimizer: OptimizerOf | None,
                 grad_clip: float | None) -> Steps:
    from gpipe_cli.estimate.measure import build_pipeline, measure_engine
    from gpipe_cli.models.registry import build_model
    from gpipe_cli.pipeline import topology
    from gpipe_cli.pipeline.config import PipelineConfig

    spec = build_model(kind, **params)
    balance = balance or [len(spec.layers)]
    stages = len(balance) // virtual
    topo = topology.init(stages, world // stages, "gloo", device="cpu")
    config = PipelineConfig(stages, counts[0], world // stages, virtual, "interleaved" if virtual > 1 else "gpipe",
                            "never", tuple(balance))
    pipe = build_pipeline(spec, topo, config, seed)
    update = optimizer(pipe.parameters()) if optimizer is not None else None
    found = Steps({}, 0.0)
    # The first count again at the end: how far this machine's own speed moved while measuring.
    for index, m in enumerate([*counts, *counts[:1]]):
        figures = measure_engine(pipe, inputs, targets, int(targets.shape[0]), m, STEPS, 1,
                                 optimizer=update, max_grad_norm=grad_clip)
        if figures is None:
            continue
        # Means, as training averages: waits and stalls included.
        step, update_s = statistics.fmean(figures.step_times), statistics.fmean(figures.optimizer_times)
        found.load = contention.worst([found.load, figures.load])
        if index < len(counts):
            found.per_count[m] = (step, update_s)
        else:
            found.drift = step / found.per_count[m][0] - 1.0
    pipe.close()
    return found


# `balance` None: the whole model on each of `ranks` replicas (data parallel); else cut into those chunks,
# `virtual` per stage, ranks / stages replicas. Each replica is given `inputs`.
def engine_steps(kind: str, params: dict[str, Any], inputs: Any, targets: torch.Tensor, seed: int, ranks: int,
                 threads: int, counts: list[int], optimizer: OptimizerOf | None = None,
                 grad_clip: float | None = None, balance: list[int] | None = None, virtual: int = 1) -> Steps:
    """GPipe steps' seconds on `ranks` processes here per micro-batch count, the update's, and the first's drift."""
    stages = len(balance or [0]) // virtual
    what = (f"running the engine on {counted(ranks, 'replica')}" if balance is None else
            f"running the engine as {counted(stages, 'stage')} x {counted(ranks // stages, 'replica')}, "
            f"{counted(virtual, 'chunk')} per stage")
    return _on_ranks(ranks, threads, what, _engine_rank, kind, params, balance or [], virtual, inputs, targets, seed,
                     counts, optimizer, grad_clip)
