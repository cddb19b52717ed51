"""Launch defaults from Slurm: inside an `srun` step (one task per node) the same command works on every node."""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
import zlib
from collections.abc import Mapping
from dataclasses import dataclass

from gpipe_cli.errors import UserError

# Rendezvous ports derived from job ids: unprivileged, and below Linux's ephemeral range (32768-60999), so no
# outgoing connection of the node can be holding one. Jobs whose ids are less than PORT_SPAN apart never share one.
PORT_BASE, PORT_SPAN = 20000, 10000


def job_port(job_id: str) -> int:
    """The rendezvous port of Slurm job `job_id`: the same on every node of the job, another for the next job."""
    number = int(job_id) if job_id.isdigit() else zlib.crc32(job_id.encode())  # crc32: stable across processes
    return PORT_BASE + number % PORT_SPAN


@dataclass(frozen=True)
class SlurmStep:
    """What a multi-node srun step says about this task."""

    nodes: int
    node_rank: int
    first_host: str
    job_id: str
    tasks: int
    port: int
    port_from: str  # the variable the port comes from: MASTER_PORT, or SLURM_JOB_ID through `job_port`
    nodelist: str
    nodelist_from: str = "SLURM_STEP_NODELIST"  # the variable the node list, and so the host, comes from

    @property
    def endpoint_from(self) -> str:
        """Where the rendezvous endpoint it gives comes from, e.g. "host from SLURM_STEP_NODELIST, port from ..."."""
        return f"host from {self.nodelist_from}, port from {self.port_from}"


def _range(spec: str) -> list[str]:
    """`01-04,07` -> 01 02 03 04 07 (zero padding kept, as Slurm writes it)."""
    out = []
    for item in spec.split(","):
        low, sep, high = item.partition("-")
        if not sep:
            out.append(low)
            continue
        if not (low.isdigit() and high.isdigit()) or int(high) < int(low):
            raise ValueError(item)
        out += [str(n).zfill(len(low)) for n in range(int(low), int(high) + 1)]
    return out


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compressed host list as host names: `node[01-02,07],gpu[1-2]-a` -> node01 node02 node07 ..."""
    hosts: list[str] = []
    # Split at the commas outside brackets: `a[1-2,4],b` -> `a[1-2,4]`, `b`.
    for part in filter(None, re.split(r",(?![^\[]*\])", nodelist.strip())):
        pieces = re.split(r"(\[[^\]]*\])", part)
        choices = [_range(p[1:-1]) if p.startswith("[") else [p] for p in pieces if p]
        if any("[" in c or "]" in c for options in choices for c in options):
            raise ValueError(part)
        hosts += ["".join(combo) for combo in itertools.product(*choices)]
    return hosts


def first_host(nodelist: str) -> str:
    """The first host of a node list: from `scontrol show hostnames` where installed, else parsed here."""
    scontrol = shutil.which("scontrol")
    if scontrol:
        try:
            shown = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True,
                                   timeout=30, check=True).stdout.split()
            if shown:
                return shown[0]
        except (OSError, subprocess.SubprocessError):
            pass  # the parser below reads the same syntax
    try:
        hosts = expand_nodelist(nodelist)
    except ValueError:
        hosts = []
    if not hosts:
        raise UserError(f"cannot read the Slurm node list {nodelist!r}; give --rdzv-endpoint HOST:PORT")
    return hosts[0]


def _integer(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise UserError(f"the Slurm variable {name} is not a number ({environ[name]!r})") from None


def _master_port(environ: Mapping[str, str]) -> int:
    """$MASTER_PORT as a port: the job script's variable, not Slurm's, and named as such."""
    text = environ["MASTER_PORT"]
    port = int(text) if text.strip().isdigit() else None
    if port is None or not 0 < port < 65536:
        what = "is not a number" if port is None else "is not a port"
        raise UserError(f"MASTER_PORT {what} ({text!r}): set it to a port from 1 to 65535, or unset it for one "
                        f"derived from SLURM_JOB_ID")
    return port


def slurm_step(environ: Mapping[str, str] | None = None) -> SlurmStep | None:
    """This task's srun step when it spans several nodes; None outside Slurm, in a batch script or on one node."""
    env = os.environ if environ is None else environ
    # Outside a step nothing is read: a job that waits for nodes that never come is worse than a one-node run.
    if not env.get("SLURM_STEP_NUM_NODES") or not env.get("SLURM_JOB_ID") or not env.get("SLURM_NODEID"):
        return None
    nodes = _integer(env, "SLURM_STEP_NUM_NODES")
    if nodes <= 1:
        return None
    nodelist_from = next((n for n in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST") if env.get(n)),
                         None)
    if nodelist_from is None:
        raise UserError("this srun step names no nodes (SLURM_STEP_NODELIST); give --rdzv-endpoint HOST:PORT")
    named = next((n for n in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS") if env.get(n)), None)
    tasks = _integer(env, named) if named else nodes
    port_from = "MASTER_PORT" if env.get("MASTER_PORT") else "SLURM_JOB_ID"
    port = _master_port(env) if env.get("MASTER_PORT") else job_port(env["SLURM_JOB_ID"])
    nodelist = env[nodelist_from]
    return SlurmStep(nodes=nodes, node_rank=_integer(env, "SLURM_NODEID"), first_host=first_host(nodelist),
                     job_id=env["SLURM_JOB_ID"], tasks=tasks, port=port, port_from=port_from, nodelist=nodelist,
                     nodelist_from=nodelist_from)


def check_one_task_per_node(step: SlurmStep) -> None:
    """gpipe starts its node's ranks itself, so each node must run it once."""
    if step.tasks != step.nodes:
        raise UserError(f"this srun step runs {step.tasks} tasks on {step.nodes} nodes; gpipe train starts the "
                        f"ranks of its node itself: run one task per node (srun --ntasks-per-node=1)")
