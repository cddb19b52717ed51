"""Optimizers and learning-rate schedules named in recipes (the paper's settings included)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from gpipe_cli.recipe.schema import Recipe


def base_lr(recipe: Recipe) -> float:
    """The peak learning rate; with `lr_per_256` it scales with the batch size, as the paper's AmoebaNet."""
    lr = recipe.optimizer.lr
    return lr * recipe.data.batch_size / 256 if recipe.optimizer.lr_per_256 else lr


def build_optimizer(params: Sequence[nn.Parameter], recipe: Recipe) -> torch.optim.Optimizer | None:
    """The recipe's optimizer over a stage's parameters (None for a stage without any)."""
    if not params:
        return None
    opt, lr = recipe.optimizer, base_lr(recipe)
    if opt.name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=opt.momentum, weight_decay=opt.weight_decay)
    if opt.name == "adam":
        return torch.optim.Adam(params, lr=lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay)
    if opt.name == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay)
    if opt.name == "rmsprop":
        return torch.optim.RMSprop(params, lr=lr, alpha=opt.decay, eps=opt.eps, momentum=opt.momentum,
                                   weight_decay=opt.weight_decay)
    # The paper's AmoebaNet optimizer: RMSProp with decay 0.9 and momentum 0.9.
    return torch.optim.RMSprop(params, lr=lr, alpha=0.9, eps=opt.eps, momentum=0.9, weight_decay=opt.weight_decay)


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
        return lambda step: max(ramp(step) * sched.decay_rate ** math.floor(max(step - warmup, 0) / per), floor)

    def cosine(step: int) -> float:
        progress = min(max(step - warmup, 0) / max(total_steps - warmup, 1), 1.0)
        return ramp(step) * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))

    return cosine


def build_scheduler(optimizer: torch.optim.Optimizer | None, recipe: Recipe, steps_per_epoch: int,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR | None:
    """A per-step LambdaLR over the optimizer (None without an optimizer)."""
    if optimizer is None:
        return None
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(recipe, steps_per_epoch, total_steps))
