"""Gradients after the last backward: replicas summed, shared copies summed, one global norm and clip."""

# Micro-batch losses are already weighted by their share of the global mini-batch, so every reduction is a sum.
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from gpipe_cli.pipeline.batchnorm import DeferredBatchNorm
from gpipe_cli.pipeline.fabric import Fabric, Ranks


@dataclass
class SharedCopy:
    """A local parameter that other stages hold copies of (a tied embedding and softmax)."""

    parameter: nn.Parameter
    ranks: Ranks
    counts_in_norm: bool  # only the first holder counts it, so the global norm sees it once


def all_reduce_replicas(params: Sequence[nn.Parameter], fabric: Fabric | None, ranks: Ranks,
                        flag: torch.Tensor) -> torch.Tensor:
    """Sum gradients over a stage's replicas in one flat buffer, the 0-d count `flag` riding along; returns its sum."""
    if fabric is None or len(ranks) < 2:
        return flag
    for p in params:
        if p.grad is None:  # every replica must reduce the same buffer layout
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params if p.grad is not None]
    marker = flag.reshape(1).to(grads[0].dtype if grads else torch.float32)
    flat = _flatten_dense_tensors([*grads, marker])
    fabric.all_reduce(flat, ranks)
    if grads:
        torch._foreach_copy_(grads, _unflatten_dense_tensors(flat, grads))
    return flat[-1].to(flag.dtype)


def sum_shared(shared: Sequence[SharedCopy], fabric: Fabric | None) -> None:
    """Sum the gradients of parameters held by several stages, so every copy takes the same step."""
    for copy in shared:
        p = copy.parameter
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if fabric is not None:
            fabric.all_reduce(p.grad, copy.ranks)


def norms(params: Sequence[nn.Parameter]) -> tuple[torch.Tensor | None, tuple[int, ...]]:
    """The gradient L2 norms (float64) of the parameters that have a gradient, and their positions."""
    positions = tuple(i for i, p in enumerate(params) if p.grad is not None)
    if not positions:
        return None, ()
    grads = [params[i].grad for i in positions]
    groups = _by_dtype(tuple(g.dtype for g in grads))  # type: ignore[union-attr]
    parts = [torch.stack(torch._foreach_norm([grads[j] for j in group])).to(torch.float64)  # type: ignore[misc]
             for group in groups]
    # The usual case is one dtype: one foreach kernel, in the parameters' order, and no copy.
    return (parts[0] if len(parts) == 1 else torch.cat(parts)), tuple(positions[j] for group in groups for j in group)


@functools.lru_cache(maxsize=64)
def _by_dtype(dtypes: tuple[torch.dtype, ...]) -> list[list[int]]:
    """Indices grouped by dtype, in first-seen order (one foreach kernel per group)."""
    groups: dict[torch.dtype, list[int]] = {}
    for j, dtype in enumerate(dtypes):
        groups.setdefault(dtype, []).append(j)
    return list(groups.values())


def global_norm(local_squares: torch.Tensor, flag: torch.Tensor, fabric: Fabric | None,
                ranks: Ranks) -> tuple[torch.Tensor, torch.Tensor]:
    """The L2 norm over all stages' gradients, and `flag` summed over the stages, in one collective."""
    # One collective: a non-finite loss, known only to the last stage, reaches every stage in the same step.
    if fabric is None or len(ranks) < 2:
        return local_squares.sqrt(), flag
    values = torch.stack([local_squares.to(torch.float64), flag.to(torch.float64)])
    fabric.all_reduce(values, ranks)
    return values[0].sqrt(), values[1]


def clip_(params: Sequence[nn.Parameter], norm: torch.Tensor, max_norm: float) -> None:
    """Scale gradients so their global norm is at most `max_norm` (a clamped factor: no host decision)."""
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, (max_norm / (norm + 1e-6)).clamp(max=1.0).to(grads[0].dtype))


def scale_(params: Sequence[nn.Parameter], factor: torch.Tensor | float) -> None:
    """Multiply every gradient in place."""
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, factor)


def commit_batchnorms(norms_: Sequence[DeferredBatchNorm], fabric: Fabric | None, ranks: Ranks,
                      finite: torch.Tensor) -> None:
    """Fold the mini-batch's BatchNorm statistics, summed over replicas, into the running averages if `finite`."""
    if not norms_:
        return
    stats = [bn.statistics() for bn in norms_]
    flat = torch.cat(stats)
    if fabric is not None and len(ranks) > 1:
        fabric.all_reduce(flat, ranks)
    # A step skipped for a non-finite value (fp16's forward overflows) leaves the averages as they were: its
    # statistics, inf or NaN, would have made every later evaluation NaN. A count of 0 folds nothing in.
    flat = flat.masked_fill(~finite, 0.0)
    for bn, summed in zip(norms_, flat.split([s.numel() for s in stats])):
        bn.commit(summed)


class LossScale:
    """Dynamic fp16 loss scaling on the device, as torch.amp's GradScaler does, without the host reading anything."""

    def __init__(self, enabled: bool, device: torch.device, initial: float = 2.0 ** 16,
                 growth_interval: int = 2000) -> None:
        self.enabled = enabled
        self.growth_interval = growth_interval
        self.value = torch.full((), initial if enabled else 1.0, dtype=torch.float32, device=device)
        self._good = torch.zeros((), dtype=torch.int32, device=device)

    def state(self) -> torch.Tensor:
        """The scale and the clean steps since it last changed, for a checkpoint (host memory)."""
        return torch.stack([self.value.to(torch.float64), self._good.to(torch.float64)]).cpu()

    def load(self, state: torch.Tensor) -> None:
        """Continue from `state` (see `state`); a scale resumed without fp16 stays 1."""
        if not self.enabled:
            return
        value, good = state.tolist()
        self.value.fill_(value)
        self._good.fill_(int(good))

    def update(self, bad: torch.Tensor) -> None:
        """Fold in one step's outcome (`bad` > 0: some loss or gradient was not finite)."""
        if not self.enabled:
            return
        # The same on every rank (its input is global): halves after a non-finite step (never below 1), doubles
        # after `growth_interval` clean ones.
        found = (bad > 0).to(torch.float32)
        torch._amp_update_scale_(self.value, self._good, found, 2.0, 0.5, self.growth_interval)
        self.value.clamp_(min=1.0)
