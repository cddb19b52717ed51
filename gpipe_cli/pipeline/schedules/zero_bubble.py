"""Zero-bubble (ZB-H1, Qi et al., 2024): 1F1B with each backward split into B and a deferred W.

Each backward becomes Bi (the input gradient, which the previous stage waits for) and W (the weight
gradient, which nobody waits for), and stage s runs each W s backwards later: the Bs travel up twice
as fast and the Ws fill the waits. Stage s holds K - s micro-batches under 1F1B, so s pending Ws keep
every stage at stage 0's peak; stage 0 keeps whole backwards. K=4, M=4:

    stage 0  F0 F1 F2 F3 B0 B1 B2 B3
    stage 1  F0 F1 F2 Bi0 F3 Bi1 W0 Bi2 W1 Bi3 W2 W3
    stage 2  F0 F1 Bi0 F2 Bi1 F3 Bi2 W0 Bi3 W1 W2 W3
    stage 3  F0 Bi0 F1 Bi1 F2 Bi2 F3 Bi3 W0 W1 W2 W3
"""

from __future__ import annotations

from collections.abc import Sequence

from gpipe_cli.pipeline.actions import Kind, Step
from gpipe_cli.pipeline.schedules.base import Schedule, one_f_one_b


class ZeroBubble(Schedule):
    """ZB-H1: 1F1B's memory, about a third of its bubble (B and W one forward's time each)."""

    name = "zero-bubble"
    torch_counterpart = "ScheduleInterleavedZeroBubble"

    def order(self, stage: int, stages: int, microbatches: int, virtual: int) -> list[Step]:
        """1F1B's order with each W deferred by `stage` backwards."""
        return defer_weights(one_f_one_b(stage, stages, microbatches), stage)


def defer_weights(order: Sequence[Step], lag: int) -> list[Step]:
    """Each backward becomes its B, and its W goes right after the B `lag` backwards later.

    The last `lag` Ws end the list, where the stage would otherwise wait for the step to end. With no
    lag the backward stays whole (one autograd pass, same order).
    """
    if lag == 0:
        return list(order)
    out: list[Step] = []
    done: list[tuple[int, int]] = []  # (micro-batch, chunk) of each B, in order
    for kind, mb, chunk in order:
        if kind != Kind.BWD:
            out.append((kind, mb, chunk))
            continue
        out.append((Kind.BWD_INPUT, mb, chunk))
        done.append((mb, chunk))
        if len(done) > lag:
            out.append((Kind.BWD_WEIGHT, *done[-lag - 1]))
    return out + [(Kind.BWD_WEIGHT, *key) for key in done[max(0, len(done) - lag):]]
