"""Deferred BatchNorm: running statistics over the whole mini-batch, whatever the micro-batch count."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpipe_cli.pipeline import context


class DeferredBatchNorm(nn.Module):
    """BatchNorm over inputs (N, C, ...) whose running statistics are committed once per mini-batch."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True) -> None:
        super().__init__()
        self.num_features, self.eps, self.momentum, self.affine = num_features, eps, momentum, affine
        self.weight = nn.Parameter(torch.ones(num_features)) if affine else None
        self.bias = nn.Parameter(torch.zeros(num_features)) if affine else None
        self.running_mean: torch.Tensor
        self.running_var: torch.Tensor
        self.num_batches_tracked: torch.Tensor
        # The state dict has nn.BatchNorm*d's keys, so checkpoints move freely between the two.
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))
        self.register_buffer("num_batches_tracked", torch.zeros((), dtype=torch.long))
        # Sufficient statistics of the mini-batch so far; never saved.
        self.sum: torch.Tensor
        self.sum_squares: torch.Tensor
        self.count: torch.Tensor
        self.register_buffer("sum", torch.zeros(num_features, dtype=torch.float64), persistent=False)
        self.register_buffer("sum_squares", torch.zeros(num_features, dtype=torch.float64), persistent=False)
        self.register_buffer("count", torch.zeros((), dtype=torch.float64), persistent=False)

    def extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}"

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")
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

    def statistics(self) -> torch.Tensor:
        """The accumulated sufficient statistics as one flat tensor (for all-reduce across replicas)."""
        return torch.cat([self.sum, self.sum_squares, self.count.reshape(1)])

    @torch.no_grad()
    def commit(self, reduced: torch.Tensor | None = None) -> None:
        """Fold this mini-batch's statistics into the running averages and reset the accumulators."""
        stats = self.statistics() if reduced is None else reduced
        c = self.num_features
        total_sum, total_squares, n = stats[:c], stats[c:2 * c], stats[-1]
        seen = n > 0
        count = n.clamp_min(1.0)
        mean = total_sum / count
        var = (total_squares / count - mean.square()).clamp_min(0.0)
        unbiased = var * (count / (count - 1.0).clamp_min(1.0))
        self.num_batches_tracked.add_(seen.to(self.num_batches_tracked.dtype))
        momentum = (1.0 / self.num_batches_tracked.clamp_min(1).to(torch.float64) if self.momentum is None
                    else torch.full((), self.momentum, dtype=torch.float64, device=n.device))
        # A mini-batch that saw no example leaves the averages as they are: the host never reads the count.
        rate = torch.where(seen, momentum, torch.zeros_like(momentum))
        self.running_mean.lerp_(mean.to(self.running_mean.dtype), rate.to(self.running_mean.dtype))
        self.running_var.lerp_(unbiased.to(self.running_var.dtype), rate.to(self.running_var.dtype))
        self.sum.zero_()
        self.sum_squares.zero_()
        self.count.zero_()

    @classmethod
    def convert(cls, module: nn.Module) -> nn.Module:
        """Replace every BatchNorm in `module` by a DeferredBatchNorm with the same state."""
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            if module.running_mean is None or module.running_var is None:
                return module  # no running statistics to defer
            bn = cls(module.num_features, module.eps, module.momentum, module.affine)
            if module.affine:
                bn.weight, bn.bias = module.weight, module.bias
            bn.to(module.running_mean.device)
            bn.running_mean.copy_(module.running_mean)
            bn.running_var.copy_(module.running_var)
            if module.num_batches_tracked is not None:
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
