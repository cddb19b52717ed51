"""What a run does when a loss or gradient is not finite: stop (the default) or skip the step."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Decision = Literal["ok", "skip", "stop"]


@dataclass
class NonFinitePolicy:
    """Counts skipped steps and decides, identically on every rank, whether to go on."""

    mode: Literal["stop", "skip"] = "stop"
    max_skipped: int = 10
    loss_scaling: bool = False  # fp16: non-finite steps are overflows to skip, whatever the mode
    consecutive: int = 0
    total: int = 0

    def decide(self, finite: bool) -> Decision:
        """The decision after a step whose loss and gradients were (not) all finite."""
        if finite:
            self.consecutive = 0
            return "ok"
        self.consecutive += 1
        self.total += 1
        if (self.mode == "stop" and not self.loss_scaling) or self.consecutive >= self.max_skipped:
            return "stop"
        return "skip"


def what_went_wrong(loss: float | None, grad_norm: float, where: tuple[int, int] | None,
                    layer_names: list[str]) -> str:
    """The non-finite values of a step and the first layer, in backward order, whose gradient is not finite."""
    bad = [f"{name} {v}" for name, v in (("loss", loss), ("gradient norm", grad_norm))
           if v is not None and not math.isfinite(v)]
    text = f"non-finite {' and '.join(bad) if bad else 'values'}"
    if where is None:
        return text + " (every gradient is finite)"
    stage, layer = where
    name = f" '{layer_names[layer]}'" if 0 <= layer < len(layer_names) else ""
    return text + f", first non-finite gradient in backward order at stage {stage}, layer {layer}{name}"


def skipped_line(step: int, total: int, what: str, policy: NonFinitePolicy, loss_scale: float | None) -> str:
    """The line shown for a skipped step."""
    scale = f"; loss scale now {loss_scale:g}" if loss_scale is not None else ""
    return (f"step {step}/{total} skipped: {what}{scale} ({policy.consecutive} in a row, {policy.total} in all; "
            f"{policy.max_skipped} in a row stop the run)")


def stop_line(step: int, what: str, policy: NonFinitePolicy, checkpoint: str | None,
              loss_scale: float | None = None) -> str:
    """The one line that ends a run on non-finite values."""
    if policy.mode == "stop" and not policy.loss_scaling:
        why = "train.on_nonfinite: stop"
    else:
        steps = "1 step" if policy.consecutive == 1 else f"{policy.consecutive} steps"
        why = f"{steps} in a row skipped, train.max_skipped: {policy.max_skipped}"
    kept = f"the newest checkpoint, {checkpoint}, is from before it" if checkpoint else "no checkpoint was written"
    # fp16's first steps overflow while the scale comes down from 65536: a scale still high says it was that.
    scale = f"; loss scale now {loss_scale:g}, halved at each skip" if loss_scale is not None else ""
    return f"stopped at step {step} ({why}): {what}{scale}; {kept}"
