"""A launched training step, and what it returns once the host reads its figures."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from gpipe_cli.pipeline import device as dev
from gpipe_cli.pipeline import schedule as sched
from gpipe_cli.pipeline import stats
from gpipe_cli.pipeline.fabric import Fabric
from gpipe_cli.pipeline.stats import StageStats
from gpipe_cli.pipeline.topology import Layout

_LOSS, _NORM, _BAD, _SCALE, _NORMS = range(5)  # the step's device figures; per-parameter norms from _NORMS on


@dataclass
class StepResult:
    """What one training step returns on every rank."""

    loss: float | None            # the mini-batch's mean loss (last stages and rank 0)
    grad_norm: float              # global gradient norm before clipping
    skipped: bool                 # a non-finite loss or gradient on some stage: the update was not applied
    stats: stats.StepStats | None  # every stage's figures, on rank 0
    loss_scale: float | None = None  # fp16: the loss scale after this step
    own: StageStats | None = None  # this rank's own figures


def figures(loss: torch.Tensor, norm: torch.Tensor, bad: torch.Tensor, scale: torch.Tensor,
            norms: torch.Tensor | None) -> torch.Tensor:
    """A step's device figures as one float64 vector (one copy to the host), this stage's gradient norms last."""
    head = torch.stack([loss, norm, bad, scale.to(torch.float64)])
    return head if norms is None else torch.cat([head, norms])


def finite(values: list[float]) -> bool:
    """Whether a step's figures say every loss and gradient was finite."""
    return values[_BAD] == 0 and math.isfinite(values[_NORM])


def fused(optimizer: torch.optim.Optimizer | None) -> bool:
    """Whether an optimizer skips a non-finite step on the device (torch's fused kernels take `found_inf`)."""
    return optimizer is not None and bool(optimizer.defaults.get("fused"))


@dataclass
class PendingStep:
    """A launched training step whose figures the host has not read yet; every rank reads them in step order."""

    layout: Layout
    fabric: Fabric | None
    times: stats.StepTimes
    figures: dev.HostCopy
    examples: float
    units: float
    memory: StageStats  # this rank's memory peaks; its times are read with the figures
    bubble_theory: float
    trace: bool
    bad_layer: Callable[[Sequence[float]], int]  # per-parameter gradient norms -> the first bad layer backward
    loss_scaling: bool

    def result(self) -> StepResult:
        """The step's figures, gathered on rank 0 (waits for the device once, if it is not there yet)."""
        dev.wait_for(self.times.end)
        values = self.figures.read().tolist()
        layout = self.layout
        events = self.times.events()
        wait, comm, optimizer = self.times.parts(events)
        skipped = not finite(values)
        loss = values[_LOSS] if layout.is_last else None
        mine = dataclasses.replace(self.memory, step_time=self.times.step_time, busy=sched.seconds(events),
                                   wait=wait, comm=comm, optimizer=optimizer,
                                   shared=self.times.seconds_in(stats.SHARED),
                                   nonfinite_layer=self.bad_layer(values[_NORMS:]) if skipped else -1)
        gathered = stats.gather(mine, loss or 0.0, int(self.examples), self.units, values[_NORM],
                                self.bubble_theory, self.fabric, events if self.trace else None)
        if gathered is not None:  # rank 0: the sum over every replica's last stage, its own among them
            if gathered.units <= 0:  # its shares were NaN: the step was skipped
                raise ValueError("the mini-batch has no units to train on (every target is padding)")
            loss = gathered.loss
        return StepResult(loss=loss, grad_norm=values[_NORM], skipped=skipped, stats=gathered,
                          loss_scale=values[_SCALE] if self.loss_scaling else None, own=mine)
