"""The steps a stage's schedule is made of: what each action does, to which micro-batch, on which chunk."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Kind(str, Enum):
    """What an action does."""

    RECV_FWD = "recv_fwd"      # wait for the input activation from the previous stage
    FWD = "fwd"                # forward (on the last stage, with the loss)
    SEND_FWD = "send_fwd"      # post the output activation to the next stage
    RECOMPUTE = "recompute"    # rematerialise the activations from the stored boundary input
    RECV_BWD = "recv_bwd"      # wait for the output gradient from the next stage
    BWD = "bwd"                # full backward: input and weight gradients
    BWD_INPUT = "bwd_input"    # backward for the input gradient only; the graph stays for the W
    BWD_WEIGHT = "bwd_weight"  # backward for the weight gradients, freeing the graph
    SEND_BWD = "send_bwd"      # post the input gradient to the previous stage


COMPUTE = frozenset({Kind.FWD, Kind.RECOMPUTE, Kind.BWD, Kind.BWD_INPUT, Kind.BWD_WEIGHT})
GRADIENT = frozenset({Kind.BWD, Kind.BWD_INPUT})      # consume the output gradient, make the input's
RELEASE = frozenset({Kind.BWD, Kind.BWD_WEIGHT})      # the micro-batch's graph is gone afterwards
SHORT = {Kind.RECV_FWD: "rf", Kind.FWD: "F", Kind.SEND_FWD: "sf", Kind.RECOMPUTE: "R", Kind.RECV_BWD: "rb",
         Kind.BWD: "B", Kind.BWD_INPUT: "Bi", Kind.BWD_WEIGHT: "W", Kind.SEND_BWD: "sb"}


@dataclass(frozen=True)
class Action:
    """One step of a stage's schedule: what to do, to which micro-batch, on which chunk of layers."""

    kind: Kind
    microbatch: int
    chunk: int = 0       # the virtual stage it runs (the stage itself while every rank holds one chunk)
    remat: bool = False  # a forward that keeps no graph: its micro-batch is recomputed before its backward

    def __str__(self) -> str:
        return f"{SHORT[self.kind]}{self.microbatch}"


Step = tuple[Kind, int, int]  # kind, micro-batch, chunk: a compute step of a schedule's order
