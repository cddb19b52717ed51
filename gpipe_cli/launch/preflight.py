"""A launch worked out and checked before any rank starts, so that a job that cannot run is one line."""

from __future__ import annotations

import shlex
import socket
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpipe_cli.errors import UserError, shown
from gpipe_cli.limits import MAX_RANKS, MAX_THREADS, choices, outside, refuse

if TYPE_CHECKING:  # the launcher imports this module
    from gpipe_cli.launch.launcher import LaunchOptions


RDZV_WAIT_S = 900.0  # how long a node waits for node 0's rendezvous to answer, as torch's store would


def parse_nodes(nnodes: str) -> tuple[int, int]:
    """`--nnodes N` or `MIN:MAX` as (MIN, MAX)."""
    try:
        low, sep, high = nnodes.partition(":")
        lo, hi = int(low), int(high if sep else low)  # `1:` names no MAX: refused, not read as 1
    except ValueError:
        raise UserError(f"--nnodes: must be N or MIN:MAX (got {shown(nnodes)})") from None
    if not sep:  # one number: worded as every other count's bounds
        refuse([outside("--nnodes", lo, 1, MAX_RANKS)])
    if not 0 < lo <= hi <= MAX_RANKS:
        raise UserError(f"--nnodes: must satisfy 0 < MIN <= MAX <= {MAX_RANKS} (got {shown(nnodes)})")
    return lo, hi


def check_launch(options: LaunchOptions, world: int) -> int:
    """Check the launch arguments against a job of `world` ranks; returns the ranks on this node."""
    if options.threads is not None and not 1 <= options.threads <= MAX_THREADS:
        raise UserError(outside("--threads", options.threads, 1, MAX_THREADS) or "")
    min_nodes, max_nodes = parse_nodes(options.nnodes)
    if min_nodes < max_nodes:  # torchrun would start the job on MIN nodes, with too few ranks for the pipeline
        dividing = [n for n in range(1, max_nodes + 1) if world % n == 0]  # 1 always
        fits = max((n for n in dividing if n >= min_nodes), default=dividing[-1])
        raise UserError(f"--nnodes {options.nnodes}: the job needs all of its {world} ranks at once, which a range "
                        f"of nodes does not promise; give one number of nodes that divides them, e.g. --nnodes {fits}")
    slurm_nodes = "nnodes" in options.from_slurm  # a number the user never typed: named by its variable
    if world % max_nodes:
        if slurm_nodes:
            fits = max(n for n in range(1, max_nodes + 1) if world % n == 0)
            raise UserError(f"the job needs {world} processes, which does not divide over {max_nodes} nodes "
                            f"(SLURM_STEP_NUM_NODES, this srun step's); run the step on a number of nodes that "
                            f"divides {world}, e.g. srun --nodes {fits}")
        raise UserError(f"the job needs {world} processes, which does not divide over {max_nodes} nodes")
    if options.node_rank is not None and not 0 <= options.node_rank < max_nodes:
        nodes = f"{max_nodes}{' from SLURM_STEP_NUM_NODES' if slurm_nodes else ''}"
        if "node_rank" in options.from_slurm:
            raise UserError(f"SLURM_NODEID {options.node_rank}: must be >= 0 and < the number of nodes, {nodes}")
        raise UserError(f"--node-rank: must be >= 0 and < the number of nodes, {nodes} (got {options.node_rank})")
    if options.rdzv_backend not in (None, "static", "c10d"):
        raise UserError(f"--rdzv-backend: must be {choices(('static', 'c10d'))} (got {shown(options.rdzv_backend)})")
    if options.rdzv_backend == "c10d" and options.node_rank is not None and "node_rank" not in options.from_slurm:
        raise UserError("--node-rank: c10d ranks the nodes as they join; leave --node-rank out, or give "
                        "--rdzv-backend static to rank them yourself")
    if options.rdzv_backend == "static" and max_nodes > 1 and options.node_rank is None:  # all would be node 0
        raise UserError(f"--rdzv-backend static: give each of the {max_nodes} nodes its --node-rank (0 to "
                        f"{max_nodes - 1}), or leave the backend out to let c10d rank the nodes")
    if options.rdzv_id is not None and not options.rdzv_id.strip():
        raise UserError("--rdzv-id: an empty id names no job; give the same word on every node, or leave it out")
    if options.rdzv_endpoint is not None:
        host, sep, port = options.rdzv_endpoint.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise UserError(f"{endpoint_name(None, endpoint_source(options))}: must be HOST:PORT with a port from 1 "
                            f"to 65535 (got {shown(options.rdzv_endpoint)})")
    elif max_nodes > 1:
        raise UserError("a multi-node job needs --rdzv-endpoint HOST:PORT (the same on every node)")
    return world // max_nodes


def check_device(backend: str, device: str, local_ranks: int, sets: Collection[str] = (), label: str = "") -> None:
    """Refuse a backend or device this machine cannot run (nccl or cuda without a GPU, nccl on shared GPUs)."""
    if backend != "nccl" and device != "cuda":
        return
    import torch

    def given(key: str) -> str:  # as every recipe error names a key: the recipe, and the --set that gave it
        return f"{label + ': ' if label else ''}{'--set ' if key in sets else ''}{key}"

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        key, value = ("pipeline.backend", "nccl") if backend == "nccl" else ("train.device", "cuda")
        raise UserError(f"{given(key)}: {value} needs a CUDA GPU and this machine has none visible; use "
                        f"{'backend gloo or auto' if backend == 'nccl' else 'device cpu or auto'}")
    if backend == "nccl" and local_ranks > gpus:
        raise UserError(f"{given('pipeline.backend')}: nccl needs one GPU per rank, but {local_ranks} ranks on this "
                        f"node share {gpus} GPU{'' if gpus == 1 else 's'}; use backend gloo or auto")


@dataclass(frozen=True)
class Rendezvous:
    """How this node's ranks meet the job's others."""

    min_nodes: int
    max_nodes: int
    ranks_per_node: int
    backend: str             # static or c10d
    endpoint: str | None     # HOST:PORT; None: one node, on a free local port chosen at launch
    run_id: str | None       # None: one node, a fresh id chosen at launch
    node_rank: int | None    # static: this node's rank; c10d: given as the nodes join
    endpoint_from: str | None = None  # where a Slurm-given endpoint comes from; None: --rdzv-endpoint, or none


def endpoint_source(options: LaunchOptions) -> str | None:
    """Where the endpoint of `options` comes from when Slurm gave it, e.g. "host from SLURM_STEP_NODELIST, ..."."""
    return options.slurm.endpoint_from if options.slurm and "rdzv_endpoint" in options.from_slurm else None


def endpoint_name(endpoint: str | None, source: str | None) -> str:
    """How a line names the endpoint: the flag the user typed, or the variables it was read from."""
    if source is None:
        return "--rdzv-endpoint" + (f" {endpoint}" if endpoint else "")
    return "the rendezvous endpoint" + (f" {endpoint}" if endpoint else "") + f" ({source})"


def rendezvous(world: int, options: LaunchOptions) -> Rendezvous:
    """The rendezvous of a job of `world` ranks launched with `options` (as `check_launch` has accepted them)."""
    min_nodes, max_nodes = parse_nodes(options.nnodes)
    backend = options.rdzv_backend or ("static" if options.node_rank is not None or max_nodes == 1 else "c10d")
    return Rendezvous(min_nodes=min_nodes, max_nodes=max_nodes, ranks_per_node=world // max_nodes, backend=backend,
                      endpoint=options.rdzv_endpoint or None,
                      run_id=options.rdzv_id or ("gpipe" if max_nodes > 1 else None),
                      node_rank=(options.node_rank or 0) if backend == "static" else None,
                      endpoint_from=endpoint_source(options))


def resolve(endpoint: str, source: str | None = None) -> tuple[str, int]:
    """`HOST:PORT` as (HOST, PORT), once this node knows HOST; UserError otherwise (`source`: see `endpoint_name`)."""
    host, _, port = endpoint.rpartition(":")
    try:
        socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except OSError as exc:
        fix = ("give the name or address of the node that hosts the rendezvous (node 0)" if source is None else
               "give --rdzv-endpoint HOST:PORT with node 0's name or address as this node knows it")
        raise UserError(f"{endpoint_name(endpoint, source)}: {host} is not a host name or address this node knows "
                        f"({exc.strerror or exc}); {fix}") from None
    return host, int(port)


def reach(rdzv: Rendezvous, said: Callable[[str], None], patience: float = RDZV_WAIT_S) -> None:
    """Resolve the rendezvous host; on a node that is not its store's, wait until the store answers (or `patience`)."""
    # torch's store retries for 15 minutes inside C++, where Ctrl-C and SIGTERM go unanswered: this wait is Python's.
    if rdzv.endpoint is None:
        return
    host, port = resolve(rdzv.endpoint, rdzv.endpoint_from)
    if rdzv.backend != "static" or not rdzv.node_rank:
        return  # node 0 hosts the store; with c10d the node at the endpoint does
    deadline, told = time.monotonic() + patience, False
    while True:
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() >= deadline:
                start = ("start node 0 with the same --rdzv-endpoint" if rdzv.endpoint_from is None else
                         "check that node 0 of this srun step started")
                raise UserError(f"{endpoint_name(rdzv.endpoint, rdzv.endpoint_from)}: node 0's rendezvous did not "
                                f"answer in {patience:.0f} s; {start}, or check that this node can reach it") from None
            if not told:
                said(f"waiting for node 0's rendezvous at {rdzv.endpoint} (Ctrl-C stops)")
                told = True
            time.sleep(1.0)


NODE_FLAGS = "GPIPE_NODE_FLAGS"  # how a rank names the flags that start its node's share of the job again


def node_flags(options: LaunchOptions) -> str:
    """The flags typed for this node of a job of several, for a command that continues the run ('' on one node)."""
    if parse_nodes(options.nnodes)[1] == 1:
        return ""
    step = options.slurm
    typed = {"--nnodes": options.nnodes, "--node-rank": options.node_rank, "--rdzv-backend": options.rdzv_backend,
             "--rdzv-endpoint": options.rdzv_endpoint,
             "--rdzv-id": None if step and options.rdzv_id == f"slurm-{step.job_id}" else options.rdzv_id}
    read = {"--" + key.replace("_", "-") for key in options.from_slurm}
    flags = [f"{flag} {shlex.quote(str(value))}" for flag, value in typed.items() if value is not None
             and flag not in read]
    each = "each node with its own --node-rank" if "--node-rank" not in read and options.node_rank is not None \
        else "on every node" + (" of an srun step" if step else "")
    return " ".join([*flags, f"({each})"])


def threads_per_rank(options: LaunchOptions, local: int) -> int:
    """Intra-op threads of each of this node's `local` ranks: --threads, else the cores shared out."""
    from gpipe_cli.contention import usable_cores

    return options.threads or max(usable_cores() // local, 1)


def torchrun_command(rdzv: Rendezvous, threads: int, train_args: Sequence[str]) -> str:
    """The `torchrun` command that starts the ranks of this node as the launch would, for a shell."""
    if rdzv.max_nodes == 1 and rdzv.endpoint is None:
        flags = ["--standalone", "--nproc-per-node", str(rdzv.ranks_per_node)]
    else:
        nodes = str(rdzv.max_nodes) if rdzv.min_nodes == rdzv.max_nodes else f"{rdzv.min_nodes}:{rdzv.max_nodes}"
        flags = ["--nnodes", nodes, "--nproc-per-node", str(rdzv.ranks_per_node)]
        if rdzv.node_rank is not None:
            flags += ["--node-rank", str(rdzv.node_rank)]
        flags += ["--rdzv-backend", rdzv.backend, "--rdzv-endpoint", str(rdzv.endpoint)]
        flags += ["--rdzv-id", rdzv.run_id] if rdzv.run_id else []  # one node's: torchrun's own
    # The launcher gives every rank its threads through these two; torchrun alone would give each one thread.
    env = [f"OMP_NUM_THREADS={threads}", f"GPIPE_THREADS={threads}"]
    return " ".join([*env, "torchrun", *flags, "-m", "gpipe_cli", "train", *map(shlex.quote, train_args)])


def dry_run_lines(options: LaunchOptions, world: int, shape: str, train_args: Sequence[str]) -> list[str]:
    """What `gpipe train --dry-run` prints: the settings' sources, the rendezvous, the equivalent torchrun command."""
    rdzv = rendezvous(world, options)
    threads = threads_per_rank(options, rdzv.ranks_per_node)
    step = options.slurm
    lines = ["gpipe train --dry-run: the launch on this node; nothing is started"]
    if step is not None:
        lines.append(f"  from Slurm:     job {step.job_id}, an srun step of {step.nodes} nodes ({step.nodelist}); this "
                     f"task's node index {step.node_rank} (flags given win)")
    if rdzv.endpoint is None:
        lines.append("  rendezvous:     this node alone, on 127.0.0.1 at a free port chosen at launch")
    else:
        host, _, port = rdzv.endpoint.rpartition(":")
        source = ""
        if step is not None and rdzv.endpoint == f"{step.first_host}:{step.port}":
            source = (" (from $MASTER_PORT)" if step.port_from == "MASTER_PORT"
                      else f" (from SLURM_JOB_ID {step.job_id}; $MASTER_PORT sets another)")
        run_id = rdzv.run_id or "a fresh one chosen at launch"
        lines.append(f"  rendezvous:     {rdzv.backend}, host {host}, port {port}{source}, id {run_id}")
    nodes = str(rdzv.max_nodes) if rdzv.min_nodes == rdzv.max_nodes else f"{rdzv.min_nodes} to {rdzv.max_nodes}"
    lines.append(f"  nodes:          {nodes}")
    lines.append(f"  ranks:          {world} ({shape}), {rdzv.ranks_per_node} per node, {threads} thread(s) each")
    if rdzv.node_rank is None:
        lines.append("  this node:      its rank is given as the nodes join (c10d)")
    else:
        first, last = rdzv.node_rank * rdzv.ranks_per_node, (rdzv.node_rank + 1) * rdzv.ranks_per_node - 1
        lines.append(f"  this node:      node rank {rdzv.node_rank}, ranks {first} to {last}")
    lines.append(f"  torchrun:       {torchrun_command(rdzv, threads, train_args)}")
    return lines
