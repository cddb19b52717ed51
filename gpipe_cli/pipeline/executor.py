"""Run one stage's action list: one small function per action kind, for training and evaluation alike.

The list (pipeline/schedule.py) already says everything: which forward keeps no graph, where the
recompute goes, whether a backward is whole or split into input (Bi) and weight (W) gradients. The
executor holds the step's in-flight tensors between actions and derives nothing from the schedule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gpipe_cli.pipeline.comm import Inbound, Outbound
from gpipe_cli.pipeline.schedule import Action, Kind
from gpipe_cli.pipeline.stage import Stage, as_tensors
from gpipe_cli.pipeline.stats import Timeline

Tensors = list[torch.Tensor | None]
Message = tuple[Tensors, bool, int]  # tensors, whether the value was a bare tensor, example offset


@dataclass
class Channels:
    """This stage's point-to-point channels (None at the ends of the pipeline)."""

    fwd_in: Inbound | None
    fwd_out: Outbound | None
    bwd_in: Inbound | None
    bwd_out: Outbound | None


@dataclass
class Executor:
    """The state of one step on one stage while its actions run.

    `feed` holds the first stage's micro-batches; `targets` and `weights` the last stage's (training);
    `on_output` receives the last stage's outputs (evaluation). `received` may hold messages taken
    before the run (evaluation learns M from its first message).
    """

    stage: Stage
    channels: Channels
    first: bool
    last: bool
    chunks: int
    training: bool
    timeline: Timeline | None = None
    feed: Sequence[Message] = ()
    targets: Sequence[torch.Tensor] = ()
    weights: Sequence[float] = ()
    on_output: Callable[[int, Any], None] | None = None
    received: dict[int, Message] = field(default_factory=dict)
    losses: list[torch.Tensor] = field(default_factory=list)
    _outgoing: dict[int, Message] = field(default_factory=dict)
    _grads_in: dict[int, Tensors] = field(default_factory=dict)
    _grads_out: dict[int, Tensors] = field(default_factory=dict)

    def run(self, actions: Sequence[Action]) -> None:
        """Execute the actions in order (receives are timed as waiting, sends as communication)."""
        handlers: dict[Kind, Callable[[Action], None]] = {
            Kind.RECV_FWD: self._recv_fwd, Kind.FWD: self._forward, Kind.SEND_FWD: self._send_fwd,
            Kind.RECOMPUTE: self._recompute, Kind.RECV_BWD: self._recv_bwd, Kind.BWD: self._backward,
            Kind.BWD_INPUT: self._backward_input, Kind.BWD_WEIGHT: self._backward_weight,
            Kind.SEND_BWD: self._send_bwd,
        }
        for action in actions:
            if self.timeline is not None:
                self.timeline.begin(action)
            handlers[action.kind](action)
            if self.timeline is not None:
                self.timeline.end()

    def _recv_fwd(self, action: Action) -> None:
        mb = action.microbatch
        if mb in self.received:
            return
        assert self.channels.fwd_in is not None
        header, tensors = self.channels.fwd_in.take(mb)
        if header.chunks != self.chunks:
            raise RuntimeError(f"this stage runs {self.chunks} micro-batches but the previous stage runs "
                               f"{header.chunks}")
        self.received[mb] = (tensors, header.bare, header.offset)

    def _forward(self, action: Action) -> None:
        mb = action.microbatch
        tensors, bare, offset = self.feed[mb] if self.first else self.received.pop(mb)
        if not self.training:
            out = self.stage.evaluate(tensors, bare, offset)
            if self.last:
                assert self.on_output is not None
                self.on_output(mb, out)
            else:
                self._outgoing[mb] = (*as_tensors(out), offset)
            return
        sent, sent_bare = self.stage.forward(mb, tensors, bare, offset, action.remat,
                                             self.targets[mb] if self.last else None,
                                             self.weights[mb] if self.last else 0.0)
        if self.last:
            self.losses.append(sent[0])  # type: ignore[arg-type]
        else:
            self._outgoing[mb] = (sent, sent_bare, offset)

    def _send_fwd(self, action: Action) -> None:
        assert self.channels.fwd_out is not None
        tensors, bare, offset = self._outgoing.pop(action.microbatch)
        self.channels.fwd_out.send(action.microbatch, self.chunks, offset, tensors, bare,
                                   differentiable=self.training)

    def _recompute(self, action: Action) -> None:
        self.stage.recompute(action.microbatch)

    def _recv_bwd(self, action: Action) -> None:
        assert self.channels.bwd_in is not None
        self._grads_in[action.microbatch] = self.channels.bwd_in.take(action.microbatch)[1]

    def _gradient_in(self, mb: int) -> Tensors | None:
        return None if self.last else self._grads_in.pop(mb)

    def _keep_gradient_out(self, mb: int, grads: Tensors) -> None:
        if not self.first:
            self._grads_out[mb] = grads

    def _backward(self, action: Action) -> None:
        mb = action.microbatch
        self._keep_gradient_out(mb, self.stage.backward(mb, self._gradient_in(mb)))

    def _backward_input(self, action: Action) -> None:
        mb = action.microbatch
        self._keep_gradient_out(mb, self.stage.backward_input(mb, self._gradient_in(mb)))

    def _backward_weight(self, action: Action) -> None:
        self.stage.backward_weight(action.microbatch)

    def _send_bwd(self, action: Action) -> None:
        assert self.channels.bwd_out is not None
        self.channels.bwd_out.send(action.microbatch, self.chunks, 0, self._grads_out.pop(action.microbatch))
