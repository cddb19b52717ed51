"""Run one stage's action list: one small function per action kind, for training and evaluation alike."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from gpipe_cli.pipeline import microbatch
from gpipe_cli.pipeline import schedule as sched
from gpipe_cli.pipeline.comm import Header
from gpipe_cli.pipeline.device import to_device
from gpipe_cli.pipeline.schedule import Action, Kind
from gpipe_cli.pipeline.stage import Stage, as_tensors
from gpipe_cli.pipeline.stats import Timeline

Tensors = list[torch.Tensor | None]
Message = tuple[Tensors, bool, int]  # tensors, whether the value was a bare tensor, example offset


def feed_messages(inputs: Any, chunks: int, device: torch.device, example_offset: int = 0) -> list[Message]:
    """The first stage's micro-batches as messages: tensors, bareness and global example offset."""
    # The mini-batch moves whole, then splits into views: the first chunk's stage holds all of it anyway.
    offsets = microbatch.offsets(microbatch.sizes(microbatch.batch_size(inputs), chunks), example_offset)
    return [(*as_tensors(mb), off) for mb, off in zip(microbatch.scatter(to_device(inputs, device), chunks), offsets)]


class Source(Protocol):
    """Where messages come from (comm.Inbound; in-process stand-ins for measuring one stage alone)."""

    def take(self, microbatch: int) -> tuple[Header, list[torch.Tensor | None]]:
        """The next message, which must carry number `microbatch`."""
        ...


class Sink(Protocol):
    """Where messages go (comm.Outbound, or an in-process stand-in)."""

    def send(self, microbatch: int, chunks: int, offset: int, tensors: Sequence[torch.Tensor | None],
             bare: bool = False, differentiable: bool = False) -> None:
        """Post one message."""
        ...


@dataclass
class Channels:
    """This stage's point-to-point channels: one for all its chunks, or one per chunk (keyed by the acting chunk)."""

    # None, or no entry, where no message goes (the ends of the pipeline, a turn of a V).
    fwd_in: Source | Mapping[int, Source] | None
    fwd_out: Sink | Mapping[int, Sink] | None
    bwd_in: Source | Mapping[int, Source] | None
    bwd_out: Sink | Mapping[int, Sink] | None


def _of(channel: Any, chunk: int) -> Any:
    """The channel `chunk` uses."""
    found = channel.get(chunk) if isinstance(channel, Mapping) else channel
    assert found is not None, f"chunk {chunk} has no channel for this message"
    return found


@dataclass
class Executor:
    """The state of one step on one stage while its actions run."""

    stages: dict[int, Stage]  # this rank's chunks by global index (of `chunk_count`)
    channels: Channels
    chunk_count: int
    chunks: int
    training: bool
    timeline: Timeline | None = None
    feed: Sequence[Message] = ()  # the first chunk's micro-batches
    targets: Sequence[torch.Tensor] = ()  # the last chunk's, as are `weights`
    weights: Sequence[float | torch.Tensor] = ()
    on_output: Callable[[int, Any], None] | None = None  # takes the last chunk's outputs (evaluation)
    received: dict[int, Message] = field(default_factory=dict)  # may hold messages taken before the run
    before: Callable[[Action], None] | None = None  # called before each action (memory accounting reads here)
    losses: list[torch.Tensor] = field(default_factory=list)
    _outgoing: dict[int, Message] = field(default_factory=dict)
    _grads_in: dict[int, Tensors] = field(default_factory=dict)
    _grads_out: dict[int, Tensors] = field(default_factory=dict)
    _next_restore: dict[int, Action] = field(default_factory=dict)

    def key(self, chunk: int, mb: int) -> int:
        """A message's number on its channel: its receiving chunk and micro-batch (chunk alone for mb 0)."""
        # Keyed by the receiving chunk too, so chunks sharing a channel never take each other's messages.
        return mb * self.chunk_count + chunk

    def run(self, actions: Sequence[Action]) -> None:
        """Execute the actions in order (receives are timed as waiting, sends as communication)."""
        handlers: dict[Kind, Callable[[Action], None]] = {
            Kind.RECV_FWD: self._recv_fwd, Kind.FWD: self._forward, Kind.SEND_FWD: self._send_fwd,
            Kind.RECOMPUTE: lambda action: self.stages[action.chunk].recompute(action.microbatch),
            Kind.RECV_BWD: self._recv_bwd, Kind.BWD: self._backward, Kind.BWD_INPUT: self._backward,
            Kind.BWD_WEIGHT: lambda action: self.stages[action.chunk].backward_weight(action.microbatch),
            Kind.SEND_BWD: self._send_bwd,
        }
        # Each micro-batch's recompute or backward brings the next one's offloaded activations back, so the
        # copy overlaps this one's backward.
        offloading = any(stage.offloader is not None for stage in self.stages.values())
        restores = sched.restores(list(actions)) if offloading else []
        self._next_restore = {id(a): b for a, b in zip(restores, restores[1:])}
        before, timeline, next_restore = self.before, self.timeline, self._next_restore
        for action in actions:
            if before is not None:
                before(action)
            if timeline is not None:
                timeline.begin(action)
            handlers[action.kind](action)
            after = next_restore.get(id(action)) if next_restore else None
            if after is not None:
                self.stages[after.chunk].prefetch(after.microbatch)
            if timeline is not None:
                timeline.end()

    def _recv_fwd(self, action: Action) -> None:
        key = self.key(action.chunk, action.microbatch)
        if key in self.received:
            return
        header, tensors = _of(self.channels.fwd_in, action.chunk).take(key)
        if header.chunks != self.chunks:
            raise RuntimeError(f"this stage runs {self.chunks} micro-batches but the previous stage runs "
                               f"{header.chunks}")
        self.received[key] = (tensors, header.bare, header.offset)

    def _forward(self, action: Action) -> None:
        mb, stage, last = action.microbatch, self.stages[action.chunk], action.chunk == self.chunk_count - 1
        key = self.key(action.chunk, mb)
        tensors, bare, offset = self.feed[mb] if action.chunk == 0 else self.received.pop(key)
        if not self.training:
            out = stage.evaluate(tensors, bare, offset)
            if last:
                assert self.on_output is not None
                self.on_output(mb, out)
            elif action.chunk + 1 in self.stages:
                self.received[self.key(action.chunk + 1, mb)] = (*as_tensors(out), offset)
            else:
                self._outgoing[key] = (*as_tensors(out), offset)
            return
        sent, sent_bare = stage.forward(mb, tensors, bare, offset, action.remat,
                                        self.targets[mb] if last else None, self.weights[mb] if last else 0.0)
        if last:
            self.losses.append(sent[0])  # type: ignore[arg-type]
        elif action.chunk + 1 in self.stages:  # the next chunk is here: hand over as a message would arrive
            self.received[self.key(action.chunk + 1, mb)] = (
                [None if t is None else t.detach().requires_grad_(t.is_floating_point()) for t in sent],
                sent_bare, offset)
        else:
            self._outgoing[key] = (sent, sent_bare, offset)

    def _send_fwd(self, action: Action) -> None:
        tensors, bare, offset = self._outgoing.pop(self.key(action.chunk, action.microbatch))
        _of(self.channels.fwd_out, action.chunk).send(self.key(action.chunk + 1, action.microbatch), self.chunks,
                                                      offset, tensors, bare, differentiable=self.training)

    def _recv_bwd(self, action: Action) -> None:
        key = self.key(action.chunk, action.microbatch)
        self._grads_in[key] = _of(self.channels.bwd_in, action.chunk).take(key)[1]

    def _backward(self, action: Action) -> None:
        chunk, mb, stage = action.chunk, action.microbatch, self.stages[action.chunk]
        grads_in = None if chunk == self.chunk_count - 1 else self._grads_in.pop(self.key(chunk, mb))
        grads = (stage.backward if action.kind == Kind.BWD else stage.backward_input)(mb, grads_in)
        if chunk == 0:
            return
        if chunk - 1 in self.stages:  # the previous chunk is here: it takes the gradient directly
            self._grads_in[self.key(chunk - 1, mb)] = grads
        else:
            self._grads_out[self.key(chunk, mb)] = grads

    def _send_bwd(self, action: Action) -> None:
        grads = self._grads_out.pop(self.key(action.chunk, action.microbatch))
        _of(self.channels.bwd_out, action.chunk).send(self.key(action.chunk - 1, action.microbatch), self.chunks, 0,
                                                      grads)
