"""Zero-bubble (ZB-H1, Qi et al., 2024): 1F1B with each backward split into B and a deferred W."""

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
    """Each backward becomes its B, and its W goes right after the B `lag` backwards later."""
    if lag == 0:  # the backward stays whole: one autograd pass, same order
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
    # The last `lag` Ws end the list, where the stage would otherwise wait for the step to end.
    return out + [(Kind.BWD_WEIGHT, *key) for key in done[max(0, len(done) - lag):]]
