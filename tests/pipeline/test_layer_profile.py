"""The per-layer measurer charges each layer what a stage pays for it, so the cut by time balances stages.

Layers here advance a fake clock by a cost that depends on their input's size, like AmoebaNet's stem on
large maps and its cells on small ones: the figures are exact, and no test depends on this machine's speed.
"""

import functools
from types import SimpleNamespace

import torch
from torch import nn

from gpipe_cli.estimate import costs
from gpipe_cli.models.base import LayerSpec, ModelSpec
from gpipe_cli.pipeline import context, layer_profile, partition
from gpipe_cli.pipeline.stage import Stage

WIDTH = 64  # the model input's features; the first layer keeps one in four


class Clock:
    """Seconds that pass only when a fake layer works."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


CLOCK = Clock()


class _Charged(torch.autograd.Function):
    """y = x * w, whose backward costs `weight` seconds, plus `data` when the input's gradient is wanted."""

    @staticmethod
    def forward(ctx, x, w, weight, data):  # type: ignore[override]
        ctx.save_for_backward(x, w)
        ctx.weight, ctx.data = weight, data
        return x * w

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, w = ctx.saved_tensors
        CLOCK.now += ctx.weight + (ctx.data if ctx.needs_input_grad[0] else 0.0)
        return grad * w, (grad * x).sum(), None, None


class Work(nn.Module):
    """Per input element: `forward` seconds, `stats` more on a first forward (as deferred BatchNorm's
    statistics, skipped by a recompute), `weight` and `data` in the backward; `keep`: every keep-th feature out."""

    def __init__(self, forward: float, stats: float = 0.0, weight: float = 0.0, data: float = 0.0,
                 keep: int = 1) -> None:
        super().__init__()
        self.costs, self.keep = (forward, stats, weight, data), keep
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        forward, stats, weight, data = (c * x.numel() for c in self.costs)
        CLOCK.now += forward + (0.0 if context.is_recomputing() else stats)
        return _Charged.apply(x[:, ::self.keep], self.w, weight, data)


# A stem whose statistics and input gradient (on the large input) cost as much as its convolution, then six
# cells on the small maps it leaves.
LAYERS = [functools.partial(Work, 1.0, stats=2.0, weight=1.0, data=2.0, keep=4)] + \
         [functools.partial(Work, 1.25, weight=2.5)] * 6


def spec() -> ModelSpec:
    return ModelSpec(name="fake", task="image", layers=[LayerSpec(f"l{i}", f) for i, f in enumerate(LAYERS)],
                     loss=lambda output, targets: output.sum(),
                     example_batch=lambda n, device: (torch.ones(n, WIDTH, device=device), torch.zeros(n)))


def stage_seconds(start: int, stop: int, x: torch.Tensor) -> tuple[float, torch.Tensor]:
    """What a stage holding layers [start, stop) computes for one rematerialised micro-batch, by the clock."""
    stage = Stage(nn.Sequential(*[LAYERS[i]() for i in range(start, stop)]), torch.device("cpu"))
    received = x if start == 0 else x.detach().requires_grad_()  # data needs no gradient; a message does
    before = CLOCK.now
    (out,), _ = stage.forward(0, [received], True, 0, remat=True)
    stage.recompute(0)
    stage.backward(0, [torch.ones_like(out)])
    return CLOCK.now - before, out


def truth_of_cut(k: int, sample: torch.Tensor) -> list[float]:
    """Both stages' seconds when the first holds the first `k` layers."""
    first, boundary = stage_seconds(0, k, sample)
    return [first, stage_seconds(k, len(LAYERS), boundary)[0]]


def test_each_kind_of_compute_is_charged_as_a_stage_runs_it(monkeypatch):
    monkeypatch.setattr(layer_profile, "time", SimpleNamespace(perf_counter=CLOCK.perf_counter))
    sample, _ = spec().example_batch(2, "cpu")
    stem, cell = layer_profile.profile_layers(spec().factories()[:2], sample, repeats=2)
    n = sample.numel()
    assert stem.forward_nograd == stem.forward == 3.0 * n  # a first forward gathers the statistics
    assert stem.recompute == 1.0 * n                       # its recompute does not
    assert stem.backward == 1.0 * n                        # and no stage wants the gradient of its data
    assert cell.backward == 2.5 * n / 4                    # later layers' inputs need theirs: counted


def test_the_cut_by_measured_time_balances_the_stages_as_they_run(monkeypatch):
    monkeypatch.setattr(layer_profile, "time", SimpleNamespace(perf_counter=CLOCK.perf_counter))
    model = spec()
    sample, targets = model.example_batch(2, "cpu")
    measured = costs.profile(model, sample, targets, seed=0, repeats=2)
    predicted = measured.balance_costs("always")
    balance = measured.balance(2, "always")
    (first, second) = partition.stage_ranges(balance)
    truth = [truth_of_cut(k, sample) for k in range(1, len(LAYERS))]
    # The prediction is what the stages compute, so the cut is the best there is.
    assert [sum(predicted[first.start:first.stop]), sum(predicted[second.start:second.stop])] == truth[first.stop - 1]
    assert balance == [2, 5] and max(truth[1]) == min(max(t) for t in truth)
    # Charging the statistics twice and the data's gradient, as timing a lone forward and backward does,
    # would leave the stem alone on the first stage, which then computes half the second's time.
    naive = [t.forward + t.forward_nograd + t.backward + (2.0 * sample.numel() if i == 0 else 0.0)
             for i, t in enumerate(measured.layers)]
    assert partition.balance_by_cost(naive, 2) == [1, 6]
