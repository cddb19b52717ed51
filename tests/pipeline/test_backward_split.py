import pytest
import torch
from torch import nn

from gpipe_cli.pipeline import backward_split


class Block(nn.Module):
    """Matrix products, a normalisation, a scale; optionally a weight used twice and an output without x."""

    def __init__(self, shared: bool = False) -> None:
        super().__init__()
        self.shared = shared
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 6)
        self.norm = nn.LayerNorm(8)
        self.scale = nn.Parameter(torch.randn(6))
        self.bias_only = nn.Parameter(torch.randn(3))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.norm(self.a(x)))
        y = self.b(h) * self.scale
        if self.shared:
            y = y + x * self.scale
        return y + x, self.bias_only * 2.0  # the second output does not depend on x


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("repeat", [1, 2])
@pytest.mark.parametrize("shared", [False, True])
def test_input_then_weight_gradients_equal_one_backward(shared, repeat):
    torch.manual_seed(0)
    model = Block(shared)
    x = torch.randn(5, 6, requires_grad=True)
    gy, gb = torch.randn(5, 6), torch.randn(3)
    for _ in range(repeat):  # gradients accumulate across micro-batches as a full backward's do
        y, b = model(x)
        torch.autograd.backward([y, b], [gy, gb])
    whole, whole_x = grads_of(model), x.grad.clone()
    model.zero_grad()
    for _ in range(repeat):
        y, b = model(x)
        found, pending = backward_split.backward_input([y, b], [gy, gb], [x])
        backward_split.backward_weight(pending, list(model.parameters()))
    assert torch.allclose(found[0] * repeat, whole_x, atol=1e-6)
    split_grads = grads_of(model)
    assert set(split_grads) == set(whole)
    for name, g in whole.items():
        assert torch.allclose(split_grads[name], g, atol=1e-6), name


def test_the_input_half_leaves_weights_alone_and_the_weight_half_skips_the_input():
    torch.manual_seed(1)
    model = Block()
    x = torch.randn(4, 6, requires_grad=True)
    y = model(x)[0]
    found, pending = backward_split.backward_input([y], [torch.ones_like(y)], [x])
    assert found[0] is not None and all(p.grad is None for p in model.parameters())
    assert pending.nodes and not pending.whole  # W restarts from the boundary nodes, not from the output
    backward_split.backward_weight(pending, list(model.parameters()))
    assert all(p.grad is not None for n, p in model.named_parameters() if n != "bias_only") and x.grad is None


def test_a_weight_used_twice_falls_back_to_one_backward_towards_the_parameters():
    model = Block(shared=True)
    x = torch.randn(4, 6, requires_grad=True)
    y = model(x)[0]
    _, pending = backward_split.backward_input([y], [torch.ones_like(y)], [x])
    assert pending.whole and not pending.nodes


def test_the_graph_is_released_after_the_weight_half():
    # The input path's buffers are never freed by a backward pass: only dropping the graph frees them,
    # so nothing may hold it once W is done.
    from gpipe_cli.pipeline.memory import ActivationMeter

    model = Block()
    meter = ActivationMeter(list(model.parameters()))
    for _ in range(3):
        x = torch.randn(4, 6, requires_grad=True)
        with meter.saved_tensors():
            y = model(x)[0]
        assert meter.current > 0
        _, pending = backward_split.backward_input([y], [torch.ones_like(y)], [x])
        backward_split.backward_weight(pending, list(model.parameters()))
        del y, pending
        assert meter.current == 0
