"""bf16 and fp16 autocast through the engine, fp16 with loss scaling."""

import pytest
import torch
from torch import nn

from gpipe_cli.pipeline import topology
from gpipe_cli.pipeline.config import PipelineConfig
from gpipe_cli.pipeline.engine import Pipeline
from gpipe_cli.pipeline.layers import build_layers
from gpipe_cli.recipe.load import validate
from gpipe_cli.recipe_model import build_optimizer


def factories():
    return [lambda: nn.Linear(8, 32), nn.GELU, lambda: nn.Linear(32, 4)]


def gradients(precision: str) -> tuple[float, list[torch.Tensor], Pipeline]:
    pipe = Pipeline(build_layers(factories(), range(3), 0), topology.local(), PipelineConfig(balance=(3,)),
                    nn.CrossEntropyLoss(), precision=precision)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(12, 8, generator=g), torch.randint(0, 4, (12,), generator=g)
    result = pipe.train_step(x, y, microbatches=3, step=0)
    assert not result.skipped
    return result.loss, [p.grad.clone() for p in pipe.parameters()], pipe


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_autocast_trains_close_to_fp32(precision):
    loss32, grads32, _ = gradients("fp32")
    loss, grads, pipe = gradients(precision)
    assert loss == pytest.approx(loss32, rel=0.05)
    for g, g32 in zip(grads, grads32):
        assert g.dtype == torch.float32  # master weights and gradients stay fp32
        assert float((g - g32).norm() / g32.norm()) < 0.05
    if precision == "fp16":  # gradients were unscaled after the scaled backward
        assert pipe.loss_scale.enabled and pipe.loss_scale.value == 2.0 ** 16


def test_fp16_overflow_skips_the_step_and_halves_the_scale():
    pipe = Pipeline(build_layers(factories(), range(3), 0), topology.local(), PipelineConfig(balance=(3,)),
                    nn.CrossEntropyLoss(), precision="fp16")
    x, y = torch.full((4, 8), 1e30), torch.zeros(4, dtype=torch.long)
    result = pipe.train_step(x, y, microbatches=2, step=0)
    assert result.skipped and pipe.loss_scale.value == 2.0 ** 15
    assert result.loss_scale == 2.0 ** 15  # what the skipped step's line says the scale is now


def check_a_skipped_first_step_leaves_no_trace(name: str, device: str) -> None:
    """Train 2 steps after a first step skipped for an fp16 overflow, and 2 without it: the same parameters."""
    recipe = validate({"optimizer": {"name": name, "lr": 0.1, "momentum": 0.9}}, "r.yaml")
    x, y = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 2, 3])
    trained = []
    for overflow_first in (True, False):
        torch.manual_seed(0)
        pipe = Pipeline(build_layers(factories(), range(3), 0, torch.device(device)), topology.local(device),
                        PipelineConfig(balance=(3,)), nn.CrossEntropyLoss(), precision="fp16")
        optimizer = build_optimizer(list(pipe.parameters()), recipe)
        if overflow_first:
            assert pipe.train_step(torch.full((4, 8), 1e30), y, microbatches=2, step=0, optimizer=optimizer).skipped
            pipe.loss_scale.load(torch.tensor([2.0 ** 16, 0.0]))
        for step in range(2):
            pipe.zero_grad()
            assert not pipe.train_step(x, y, microbatches=2, step=step + 1, optimizer=optimizer).skipped
        trained.append([p.detach().cpu().clone() for p in pipe.parameters()])
    for skipped_first, plain in zip(*trained):
        assert torch.isfinite(skipped_first).all() and torch.equal(skipped_first, plain)


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_a_first_step_skipped_on_the_device_leaves_the_optimizer_as_if_it_never_ran(name):
    # torch's fused SGD left its momentum uninitialised after skipping its first step: the weights went NaN.
    check_a_skipped_first_step_leaves_no_trace(name, "cpu")


def test_a_step_skipped_for_an_fp16_forward_overflow_leaves_the_batchnorm_averages_as_they_were():
    # Its statistics were folded in: inf and NaN averages, and every later evaluation NaN.
    layers = [lambda: nn.Linear(8, 32), lambda: nn.BatchNorm1d(32), nn.GELU, lambda: nn.Linear(32, 4)]
    pipe = Pipeline(build_layers(layers, range(4), 0), topology.local(), PipelineConfig(balance=(4,)),
                    nn.CrossEntropyLoss(), precision="fp16")
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    (bn,) = pipe.batchnorms
    before = [t.clone() for t in (bn.running_mean, bn.running_var, bn.num_batches_tracked)]
    y = torch.zeros(4, dtype=torch.long)
    assert pipe.train_step(torch.full((4, 8), 1e30), y, microbatches=2, step=0, optimizer=optimizer).skipped
    assert all(torch.equal(a, b) for a, b in zip(before, (bn.running_mean, bn.running_var, bn.num_batches_tracked)))
    pipe.zero_grad()
    assert not pipe.train_step(torch.randn(4, 8), y, microbatches=2, step=1, optimizer=optimizer).skipped
    assert int(bn.num_batches_tracked) == 1 and not torch.equal(bn.running_mean, before[0])


def test_fp16_reports_and_clips_by_the_unscaled_gradient_norm():
    # The norm is of the gradients after unscaling: taken before, it came out 2^16 times fp32's, and clipping by it
    # shrank every update to almost nothing without a word.
    def step(precision: str, max_grad_norm: float | None) -> tuple[float, list[torch.Tensor]]:
        pipe = Pipeline(build_layers(factories(), range(3), 0), topology.local(), PipelineConfig(balance=(3,)),
                        nn.CrossEntropyLoss(), precision=precision)
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(12, 8, generator=g), torch.randint(0, 4, (12,), generator=g)
        result = pipe.train_step(x, y, microbatches=3, step=0, max_grad_norm=max_grad_norm)
        assert not result.skipped
        return result.grad_norm, [p.grad.clone() for p in pipe.parameters()]

    norm32, _ = step("fp32", None)
    norm16, _ = step("fp16", None)
    assert norm16 == pytest.approx(norm32, rel=0.05)
    _, clipped32 = step("fp32", norm32 / 2)
    _, clipped16 = step("fp16", norm32 / 2)
    for g, g32 in zip(clipped16, clipped32):
        assert float((g - g32).norm() / g32.norm()) < 0.05
