"""The baselines' activation checkpointing: same gradients, same dropout, recomputed tensors on the meter."""

import pytest
import torch
from torch import nn

from gpipe_cli.bench.baseline import checkpoint
from gpipe_cli.pipeline.memory import ActivationMeter


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.5), nn.Tanh(), nn.Linear(32, 4))


def _grads(model: nn.Module, x: torch.Tensor, checkpointed: bool, split: bool = False):
    meter = ActivationMeter(model.parameters())
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # the dropout mask
    with meter.saved_tensors():
        y = checkpoint(model, (x,), meter) if checkpointed else model(x)
        kept = meter.current
        loss = y.square().sum()
        if split:  # input gradient first, weight gradients later from the same graph (zero-bubble)
            (gx,) = torch.autograd.grad(loss, [x], retain_graph=True)
            gw = torch.autograd.grad(loss, list(model.parameters()))
        else:
            loss.backward()
            gx, gw = x.grad, [p.grad for p in model.parameters()]
    del y, loss
    return gx.clone(), [g.clone() for g in gw], kept, meter


@pytest.mark.parametrize("split", [False, True])
def test_checkpointed_gradients_equal_plain_ones_with_the_same_dropout(split):
    model = _model()
    x = torch.randn(6, 8, requires_grad=True)
    plain_x, plain_w, _, _ = _grads(model, x, checkpointed=False, split=split)
    x.grad = None
    ckpt_x, ckpt_w, _, _ = _grads(model, x, checkpointed=True, split=split)
    assert torch.allclose(plain_x, ckpt_x)
    assert all(torch.allclose(a, b) for a, b in zip(plain_w, ckpt_w))


def test_the_meter_sees_the_recomputed_activations_and_their_release():
    model = _model()
    x = torch.randn(6, 8, requires_grad=True)
    _, _, plain_kept, plain = _grads(model, x, checkpointed=False)
    x.grad = None
    _, _, ckpt_kept, ckpt = _grads(model, x, checkpointed=True)
    assert ckpt_kept < plain_kept           # after the forward: only the input is kept
    assert ckpt.peak >= plain_kept          # the recomputation is counted when backward needs it
    assert ckpt.current == 0 and plain.current == 0  # and released with the graph
