"""Learning-rate schedules named in recipes (the paper's settings included)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from gpipe_cli.recipe.schema import Recipe
from gpipe_cli.recipe_model import base_lr


def lr_factor(recipe: Recipe, steps_per_epoch: int, total_steps: int) -> Callable[[int], float]:
    """The multiplier of the peak learning rate at each optimizer step (0-based)."""
    sched = recipe.schedule
    warmup = sched.warmup_steps
    floor = sched.min_lr / base_lr(recipe)

    def ramp(step: int) -> float:
        return min((step + 1) / warmup, 1.0) if warmup else 1.0

    if sched.name == "constant":
        return ramp
    if sched.name == "inverse_sqrt":
        # Vaswani et al.: linear warm-up, then decay with the inverse square root of the step.
        return lambda step: ramp(step) * min(1.0, math.sqrt(max(warmup, 1) / (step + 1)))
    if sched.name == "exponential":
        # Staircase decay by `decay_rate` every `decay_epochs` epochs, after the warm-up.
        per = max(sched.decay_epochs * steps_per_epoch, 1.0)
        # The floor is under the decay, not the warm-up: it ramps up from 0 as cosine's does.
        return lambda step: ramp(step) * max(sched.decay_rate ** math.floor(max(step - warmup, 0) / per), floor)

    def cosine(step: int) -> float:
        progress = min(max(step - warmup, 0) / max(total_steps - warmup, 1), 1.0)
        return ramp(step) * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))

    return cosine


def following(optimizer: torch.optim.Optimizer | None,
              factor: Callable[[int], float]) -> torch.optim.lr_scheduler.LambdaLR | None:
    """A per-step LambdaLR of `factor` over the optimizer (None without an optimizer)."""
    return None if optimizer is None else torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def total_steps(steps: int | None, epochs: int | None, steps_per_epoch: int) -> int:
    """The steps a run trains: train.steps or train.epochs, whichever ends first."""
    return min(n for n in (steps, epochs and epochs * steps_per_epoch) if n)
