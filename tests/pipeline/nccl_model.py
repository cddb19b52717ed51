"""NCCL's rules, simulated over what each rank posts, so a deadlock or a mismatch shows on the CPU."""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Post:
    """A payload or collective posted on communicator `comm` (p2p: with `peer`)."""

    op: int
    comm: Hashable
    role: str  # "send", "recv" or "collective"
    nbytes: int
    peer: int = -1
    label: str = ""


@dataclass(frozen=True)
class StreamWait:
    """The compute stream waits for operation `op`."""

    op: int


@dataclass(frozen=True)
class Sync:
    """The host waits until the compute stream ran everything queued so far."""


@dataclass(frozen=True)
class HostSend:
    """A host message (gloo: it never waits for its receiver)."""

    key: Hashable
    seq: int


@dataclass(frozen=True)
class HostRecv:
    """The host waits for the matching `HostSend`."""

    key: Hashable
    seq: int


@dataclass(frozen=True)
class HostMeet:
    """A host collective: every member's host waits for the others."""

    key: Hashable
    seq: int
    members: tuple[int, ...]


Op = Post | StreamWait | Sync | HostSend | HostRecv | HostMeet


class Deadlock(RuntimeError):
    """The ranks wait for each other in a cycle (or for something never posted)."""


class Mismatch(RuntimeError):
    """Two operations NCCL would match disagree (a swapped or mis-sized message)."""


@dataclass
class _Rank:
    program: Sequence[Op]
    pc: int = 0
    stream: list[int] = field(default_factory=list)  # the ops the compute stream waits for, in order
    passed: int = 0                                  # how many of them it got past


def run(programs: Mapping[int, Sequence[Op]]) -> None:
    """Play every rank's program under NCCL's rules until all finish; raise on a deadlock or mismatch."""
    ranks = {r: _Rank(p) for r, p in programs.items()}
    fifos: dict[tuple[int, Hashable], deque[tuple[Post, int]]] = {}
    done: set[int] = set()
    sent: set[tuple[Hashable, int]] = set()
    met: dict[tuple[Hashable, int], set[int]] = {}
    moved = True
    while moved:
        moved = False
        for r, rank in ranks.items():
            moved |= _host(r, rank, fifos, sent, met)
        for rank in ranks.values():
            while rank.passed < len(rank.stream) and rank.stream[rank.passed] in done:
                rank.passed += 1
                moved = True
        moved |= _match(ranks, fifos, done)
    stuck = [_describe(r, rank, fifos) for r, rank in ranks.items()
             if rank.pc < len(rank.program) or rank.passed < len(rank.stream)
             or any(queue for (owner, _), queue in fifos.items() if owner == r)]
    if stuck:
        raise Deadlock("; ".join(stuck))


def _host(r: int, rank: _Rank, fifos: dict, sent: set, met: dict) -> bool:
    """Advance one rank's host as far as it can go; whether it moved."""
    moved = False
    while rank.pc < len(rank.program):
        op = rank.program[rank.pc]
        if isinstance(op, Post):
            fifos.setdefault((r, op.comm), deque()).append((op, len(rank.stream)))
        elif isinstance(op, StreamWait):
            rank.stream.append(op.op)
        elif isinstance(op, Sync):
            if rank.passed < len(rank.stream):
                break
        elif isinstance(op, HostSend):
            sent.add((op.key, op.seq))
        elif isinstance(op, HostRecv):
            if (op.key, op.seq) not in sent:
                break
        else:
            arrived = met.setdefault((op.key, op.seq), set())
            arrived.add(r)
            if not arrived >= set(op.members):
                break
        rank.pc += 1
        moved = True
    return moved


def _ready(ranks: Mapping[int, _Rank], fifos: dict, r: int, comm: Hashable) -> Post | None:
    """The head of rank r's FIFO on `comm`, if the compute stream reached where it was posted."""
    queue = fifos.get((r, comm))
    if not queue:
        return None
    post, posted_at = queue[0]
    return post if ranks[r].passed >= posted_at else None


# NCCL matches by order, not tag: each communicator is a FIFO per rank, and an operation completes only with its
# match at the head of the peer's FIFO (or, for a collective, of every member's), the sizes agreeing. So a send
# blocks its stream until its receive is posted: true of large messages; small ones slip through NCCL's buffers,
# which is how such bugs hide in small tests.
def _match(ranks: Mapping[int, _Rank], fifos: dict, done: set[int]) -> bool:
    moved = False
    for (r, comm) in list(fifos):
        head = _ready(ranks, fifos, r, comm)
        if head is None:
            continue
        if head.role == "send":
            other = _ready(ranks, fifos, head.peer, comm)
            if other is None or other.role != "recv" or other.peer != r:
                continue
            if other.nbytes != head.nbytes:
                raise Mismatch(f"rank {r} sends {head.nbytes} bytes ({head.label}) to rank {head.peer} on {comm}, "
                               f"whose next receive there takes {other.nbytes} ({other.label})")
            pairs = [(r, head), (head.peer, other)]
        elif head.role == "collective":
            members = comm if isinstance(comm, tuple) else ()
            heads = [(m, _ready(ranks, fifos, m, comm)) for m in members]
            if any(h is None or h.role != "collective" for _, h in heads):
                continue
            if len({(h.nbytes, h.label) for _, h in heads if h is not None}) > 1:
                raise Mismatch(f"a collective on ranks {members} differs in size or kind: "
                               f"{[(m, h.nbytes, h.label) for m, h in heads if h is not None]}")
            pairs = [(m, h) for m, h in heads if h is not None]
        else:
            continue
        for member, post in pairs:
            fifos[(member, comm)].popleft()
            done.add(post.op)
        moved = True
    return moved


def _describe(r: int, rank: _Rank, fifos: dict) -> str:
    heads = [f"{post.role} {post.label or post.op} on {comm}" for (owner, comm), queue in fifos.items()
             if owner == r and queue for post, _ in [queue[0]]]
    where = (f"host at {rank.program[rank.pc]}" if rank.pc < len(rank.program) else "host done")
    stream = (f"stream waits for op {rank.stream[rank.passed]}" if rank.stream and rank.passed < len(rank.stream)
              else "stream idle")
    return f"rank {r}: {where}, {stream}, heads: {', '.join(heads) or 'none'}"
