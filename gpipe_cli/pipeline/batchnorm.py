"""Deferred BatchNorm: running statistics over the whole mini-batch, whatever the micro-batch count.

As in the GPipe paper, training normalises each micro-batch by its own statistics; the running
averages used for evaluation are updated once per mini-batch from statistics accumulated over all of
its micro-batches (and over data-parallel replicas), so they do not depend on M.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from gpipe_cli.pipeline import context

Reduce = Callable[[torch.Tensor], torch.Tensor]


class DeferredBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm over any input rank (N, C, ...) whose running statistics are committed per mini-batch."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, device: torch.device | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats=True,
                         device=device, dtype=dtype)
        self.register_buffer("sum", torch.zeros(num_features, device=device, dtype=torch.float64),
                             persistent=False)
        self.register_buffer("sum_squares", torch.zeros_like(self.sum), persistent=False)
        self.register_buffer("count", torch.zeros((), device=device, dtype=torch.float64), persistent=False)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias,
                                False, 0.0, self.eps)
        if not context.is_recomputing():
            self._accumulate(input.detach())
        return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)

    def _accumulate(self, x: torch.Tensor) -> None:
        dims = [0, *range(2, x.dim())]
        x = x.double()
        self.sum += x.sum(dims)
        self.sum_squares += x.square().sum(dims)
        self.count += x.numel() // x.shape[1]

    def pending(self) -> bool:
        """Whether statistics were accumulated since the last commit."""
        return bool(self.count.item() > 0)

    def statistics(self) -> torch.Tensor:
        """The accumulated sufficient statistics as one flat tensor (for all-reduce across replicas)."""
        return torch.cat([self.sum, self.sum_squares, self.count.reshape(1)])

    def commit(self, reduced: torch.Tensor | None = None) -> None:
        """Fold this mini-batch's statistics into the running averages and reset the accumulators."""
        stats = self.statistics() if reduced is None else reduced
        c = self.num_features
        total_sum, total_squares, n = stats[:c], stats[c:2 * c], float(stats[-1])
        if n > 0:
            mean = total_sum / n
            var = (total_squares / n - mean.square()).clamp_min(0.0)
            unbiased = var * (n / max(n - 1.0, 1.0))
            self.num_batches_tracked += 1
            momentum = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                        else self.momentum)
            self.running_mean.mul_(1 - momentum).add_(mean.to(self.running_mean.dtype), alpha=momentum)
            self.running_var.mul_(1 - momentum).add_(unbiased.to(self.running_var.dtype), alpha=momentum)
        self.sum.zero_()
        self.sum_squares.zero_()
        self.count.zero_()

    @classmethod
    def convert(cls, module: nn.Module) -> nn.Module:
        """Replace every BatchNorm in `module` by a DeferredBatchNorm with the same state."""
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, cls):
            bn = cls(module.num_features, module.eps, module.momentum, module.affine,
                     device=module.running_mean.device if module.running_mean is not None else None)
            if module.affine:
                bn.weight = module.weight
                bn.bias = module.bias
            if module.running_mean is not None:
                bn.running_mean.copy_(module.running_mean)
                bn.running_var.copy_(module.running_var)
                bn.num_batches_tracked.copy_(module.num_batches_tracked)
            bn.train(module.training)
            return bn
        for name, child in module.named_children():
            replacement = cls.convert(child)
            if replacement is not child:
                setattr(module, name, replacement)
        return module


def deferred_batchnorms(module: nn.Module) -> list[DeferredBatchNorm]:
    """All deferred BatchNorm layers inside `module`, in a fixed order."""
    return [m for m in module.modules() if isinstance(m, DeferredBatchNorm)]
