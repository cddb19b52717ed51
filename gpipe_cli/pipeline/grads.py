"""Gradients after the last backward: replicas summed, shared copies summed, one global norm and clip.

Micro-batch losses are already weighted by their share of the global mini-batch's units, so every
reduction here is a plain sum and the result equals the gradient of the whole mini-batch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from gpipe_cli.pipeline.batchnorm import DeferredBatchNorm


@dataclass
class SharedCopy:
    """A local parameter that other stages hold copies of (a tied embedding and softmax)."""

    parameter: nn.Parameter
    group: dist.ProcessGroup
    counts_in_norm: bool  # only the first holder counts it, so the global norm sees it once


def _all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None, staging: bool) -> None:
    if staging and tensor.device.type != "cpu":
        host = tensor.cpu()
        dist.all_reduce(host, group=group)
        tensor.copy_(host)
    else:
        dist.all_reduce(tensor, group=group)


def all_reduce_replicas(params: Sequence[nn.Parameter], group: dist.ProcessGroup | None, staging: bool,
                        flag: float = 0.0) -> float:
    """Sum gradients over the data-parallel replicas of a stage, in one flat buffer.

    `flag` (e.g. 1 for a non-finite loss) rides along in the same buffer; returns its sum over replicas.
    """
    if group is None:
        return flag
    for p in params:
        if p.grad is None:  # every replica must reduce the same buffer layout
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    marker = torch.tensor([flag], dtype=grads[0].dtype if grads else torch.float32, device=device)
    flat = _flatten_dense_tensors([*grads, marker])
    _all_reduce(flat, group, staging)
    for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(reduced)
    return float(flat[-1].item())


def sum_shared(shared: Sequence[SharedCopy], staging: bool) -> None:
    """Sum the gradients of parameters held by several stages, so every copy takes the same step."""
    for copy in shared:
        p = copy.parameter
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        _all_reduce(p.grad, copy.group, staging)


def global_norm(params: Sequence[nn.Parameter], exclude: set[int], group: dist.ProcessGroup | None,
                staging: bool, device: torch.device, flag: float = 0.0) -> tuple[float, float]:
    """The L2 norm of all gradients of all stages (each shared parameter counted once).

    Also returns `flag` summed over the stages (one collective for both): how a non-finite loss, known
    only to the last stage, reaches every stage in the same step.
    """
    grads = [p.grad for p in params if p.grad is not None and id(p) not in exclude]
    local = (torch.nn.utils.get_total_norm(grads, 2.0).double() if grads
             else torch.zeros((), dtype=torch.float64, device=device))
    values = torch.stack([local.square().to(device), torch.tensor(flag, dtype=torch.float64, device=device)])
    if group is not None:
        _all_reduce(values, group, staging)
    squares, flags = values.tolist()
    return math.sqrt(squares), flags


def first_nonfinite(named: Iterable[tuple[str, nn.Parameter]]) -> str | None:
    """The name of the first parameter, in the given order, whose gradient holds a NaN or an infinity."""
    for name, p in named:
        if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
            return name
    return None


def scale_(params: Sequence[nn.Parameter], factor: float) -> None:
    """Multiply every gradient in place."""
    grads = [p.grad for p in params if p.grad is not None]
    if grads and factor != 1.0:
        torch._foreach_mul_(grads, factor)


def commit_batchnorms(norms: Sequence[DeferredBatchNorm], group: dist.ProcessGroup | None, staging: bool) -> None:
    """Fold the mini-batch's BatchNorm statistics, summed over replicas, into the running averages."""
    if not norms:
        return
    if group is None:
        for bn in norms:
            bn.commit()
        return
    stats = [bn.statistics() for bn in norms]
    flat = torch.cat(stats)
    _all_reduce(flat, group, staging)
    at = 0
    for bn, s in zip(norms, stats):
        bn.commit(flat[at:at + s.numel()])
        at += s.numel()


class LossScale:
    """Dynamic loss scaling for fp16, identical on every rank because its input is the global norm."""

    def __init__(self, enabled: bool, initial: float = 2.0 ** 16, growth_interval: int = 2000) -> None:
        self.enabled = enabled
        self.value = initial if enabled else 1.0
        self.growth_interval = growth_interval
        self.good_steps = 0

    def update(self, finite: bool) -> None:
        """Halve after an overflow; double after `growth_interval` clean steps."""
        if not self.enabled:
            return
        if not finite:
            self.value = max(self.value / 2.0, 1.0)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.value *= 2.0
            self.good_steps = 0
