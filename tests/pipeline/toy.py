"""Small models and a plain single-process trainer: the reference every pipelined run must equal."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gpipe_cli.pipeline import context, microbatch
from gpipe_cli.pipeline.batchnorm import deferred_batchnorms
from gpipe_cli.pipeline.dropout import Dropout
from gpipe_cli.pipeline.layers import build_layers

SEED = 1234


def conv_bn(cin: int, cout: int, stride: int = 1, dropout: float = 0.0) -> nn.Module:
    layers = [nn.Conv2d(cin, cout, 3, stride=stride, padding=1), nn.BatchNorm2d(cout), nn.ReLU()]
    return nn.Sequential(*layers, *([Dropout(dropout)] if dropout else []))


def bn_model() -> list[Callable[[], nn.Module]]:
    """A convolutional classifier with BatchNorm and dropout (images 3x8x8, 4 classes)."""
    return [
        lambda: conv_bn(3, 8),
        lambda: conv_bn(8, 8, dropout=0.2),
        lambda: conv_bn(8, 8, stride=2),
        lambda: nn.Sequential(nn.Flatten(), nn.Linear(8 * 4 * 4, 32), nn.ReLU()),
        lambda: nn.Sequential(Dropout(0.3), nn.Linear(32, 32), nn.Tanh()),
        lambda: nn.Linear(32, 4),
    ]


class Fork(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 32)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.lin(x)
        return h, h * 0.5


class Branch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.norm, self.drop = nn.Linear(32, 32), nn.LayerNorm(32), Dropout(0.25)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = pair
        return self.drop(self.norm(self.lin(a))), b


class Join(nn.Module):
    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        a, b = pair
        return torch.nn.functional.gelu(a) + b


def ln_model() -> list[Callable[[], nn.Module]]:
    """An MLP with LayerNorm, dropout and tuple-carrying layers (inputs 16, 5 classes)."""
    return [Fork, Branch, Join, lambda: nn.Sequential(Dropout(0.2), nn.Linear(32, 32), nn.Tanh()),
            lambda: nn.Linear(32, 5)]


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids)


class Project(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 11, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def tied_model() -> list[Callable[[], nn.Module]]:
    """A token model whose embedding and softmax share one weight."""
    return [Embed, lambda: nn.Sequential(nn.Linear(16, 16), nn.Tanh()),
            lambda: nn.Sequential(nn.Linear(16, 16), nn.Tanh()), Project]


TIED = [("0.embed.weight", "3.proj.weight")]


def deep_model() -> list[Callable[[], nn.Module]]:
    """The tied token model with eight layers, one with dropout (enough for K=4 stages x 2 chunks)."""
    def hidden() -> nn.Module:
        return nn.Sequential(nn.Linear(16, 16), nn.Tanh())

    return [Embed, hidden, hidden, hidden, lambda: nn.Sequential(Dropout(0.2), nn.Linear(16, 16)), hidden, hidden,
            Project]


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


MODELS: dict[str, dict[str, Any]] = {
    "bn": dict(factories=bn_model, loss=nn.CrossEntropyLoss(), tied=[], per_microbatch_bn=True),
    "ln": dict(factories=ln_model, loss=nn.CrossEntropyLoss(), tied=[], per_microbatch_bn=False),
    "tied": dict(factories=tied_model, loss=token_loss, tied=TIED, per_microbatch_bn=False),
    "deep": dict(factories=deep_model, loss=token_loss, tied=[("0.embed.weight", "7.proj.weight")],
                 per_microbatch_bn=False),
}


def batch(model: str, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The deterministic mini-batch of a step."""
    g = torch.Generator().manual_seed(1000 + step)
    if model == "bn":
        return torch.randn(size, 3, 8, 8, generator=g), torch.randint(0, 4, (size,), generator=g)
    if model == "ln":
        return torch.randn(size, 16, generator=g), torch.randint(0, 5, (size,), generator=g)
    return torch.randint(0, 11, (size, 6), generator=g), torch.randint(0, 11, (size, 6), generator=g)


SIZES = [10, 10, 9]  # uneven for M in {3, 4, 8}, then a final smaller batch


def optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params or [nn.Parameter(torch.zeros(1))], lr=0.05, momentum=0.9, weight_decay=1e-4)


def reference(model: str, microbatches: int, replicas: int = 1, steps: int = 3) -> dict[str, torch.Tensor]:
    """Train without a pipeline in this process and return the final state (`trained` says more)."""
    return trained(model, microbatches, replicas, steps)[0]


def trained(model: str, microbatches: int, replicas: int = 1, steps: int = 3,
            max_grad_norm: float | None = None) -> tuple[dict[str, torch.Tensor], list[float], list[float]]:
    """Train without a pipeline in this process (clipping at `max_grad_norm`); return the final state, and each
    step's mini-batch loss and gradient norm (before clipping).

    BatchNorm normalises by micro-batch statistics in training (as in GPipe), so for the BatchNorm
    model the plain trainer accumulates gradients over the same micro-batches; every other model is
    trained on the whole mini-batch at once, which proves independence from M.
    """
    spec = MODELS[model]
    factories = spec["factories"]()
    net = nn.Sequential(*build_layers(factories, range(len(factories)), SEED))
    for group in spec["tied"]:
        first = net.get_parameter(group[0])
        for name in group[1:]:
            path, _, attr = name.rpartition(".")
            setattr(net.get_submodule(path), attr, first)
    opt = optimizer(list(net.parameters()))
    losses, norms = [], []
    for step in range(steps):
        x, y = batch(model, step, SIZES[step])
        chunks = [(x, y, 0)]
        if spec["per_microbatch_bn"]:
            chunks = []
            for shard_x, shard_y, start in shards(x, y, replicas):
                split = microbatch.sizes(shard_x.shape[0], microbatches)
                chunks += list(zip(shard_x.split(split), shard_y.split(split), microbatch.offsets(split, start)))
        total = 0.0
        for cx, cy, offset in chunks:
            with context.microbatch(step, offset):
                loss = spec["loss"](net(cx), cy) * cy.numel() / y.numel()
            loss.backward()
            total += loss.item()
        losses.append(total)
        norms.append(float(nn.utils.clip_grad_norm_(net.parameters(), max_grad_norm or float("inf"))))
        for bn in deferred_batchnorms(net):
            bn.commit()
        opt.step()
        opt.zero_grad()
    return net.state_dict(), losses, norms


def shards(x: torch.Tensor, y: torch.Tensor, replicas: int) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """Each data-parallel replica's contiguous slice of a global batch, with its global offset."""
    out, start = [], 0
    for sx, sy in zip(x.tensor_split(replicas), y.tensor_split(replicas)):
        out.append((sx, sy, start))
        start += sx.shape[0]
    return out


def relative_errors(state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """‖a − b‖ / ‖b‖ for every floating tensor of the reference found in `state`."""
    out = {}
    for key, value in ref.items():
        if key in state and value.is_floating_point():
            out[key] = float((state[key] - value).norm() / value.norm().clamp_min(1e-12))
    return out
