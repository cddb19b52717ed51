"""One stage's forward, recompute and backward: rematerialization keeps less and changes nothing."""

import pytest
import torch
from torch import nn

from gpipe_cli.pipeline import context
from gpipe_cli.pipeline.stage import Stage


class Recorder(nn.Module):
    """Passes its input through and remembers what it saw."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[torch.Tensor] = []
        self.recomputing: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.outputs.append(x.detach().clone())
        self.recomputing.append(context.is_recomputing())
        return x


def stage_with(*layers: nn.Module) -> Stage:
    return Stage(nn.Sequential(*layers), torch.device("cpu"))


def test_plain_dropout_mask_in_the_recompute_equals_the_first_forward():
    torch.manual_seed(0)
    recorder = Recorder()
    stage = stage_with(nn.Linear(8, 64), nn.Dropout(0.5), recorder, nn.Linear(64, 2))
    x = torch.randn(4, 8, requires_grad=True)
    stage.forward(0, [x], True, 0, remat=True)
    torch.rand(100)  # other work moves the global RNG on before the recompute
    stage.recompute(0)
    first, again = recorder.outputs
    assert torch.equal(first == 0, again == 0) and (first == 0).any()
    assert recorder.recomputing == [False, True]


def test_rematerialised_gradients_equal_stored_graph_gradients():
    torch.manual_seed(0)
    stage = stage_with(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    x = torch.randn(5, 8)
    grads = []
    for remat in (False, True):
        leaf = x.clone().requires_grad_(True)
        out, _ = stage.forward(0, [leaf], True, 0, remat=remat)
        if remat:
            stage.recompute(0)
        (input_grad,) = stage.backward(0, [torch.ones_like(out[0])])
        grads.append((input_grad.clone(), [p.grad.clone() for p in stage.module.parameters()]))
        stage.module.zero_grad()
    assert torch.allclose(grads[0][0], grads[1][0])
    assert all(torch.allclose(a, b) for a, b in zip(grads[0][1], grads[1][1]))


class Doubles(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(2.0)


def test_a_layer_that_changes_its_stage_s_input_in_place_is_refused_under_remat_not_recomputed_wrongly():
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="changed its stage's input in place.*checkpoint: never"):
        stage_with(Doubles(), nn.Linear(8, 2)).forward(0, [x.clone()], True, 0, remat=True)
    out, _ = stage_with(Doubles(), nn.Linear(8, 2)).forward(0, [x.clone()], True, 0, remat=False)
    assert out[0].shape == (4, 2)


def test_rematerialization_keeps_only_the_boundary_input():
    def peak(remat: bool) -> int:
        stage = stage_with(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(6)])
        for mb in range(4):
            stage.forward(mb, [torch.randn(16, 64, requires_grad=True)], True, 0, remat=remat)
        return stage.meter.peak

    stored, remat = peak(False), peak(True)
    assert remat == 4 * 16 * 64 * 4  # exactly the four boundary inputs
    assert stored > 6 * remat


def test_a_recompute_leaves_the_global_rng_where_it_found_it():
    # The recompute replays the forward's RNG state for its dropout masks; left there, the global generator would be
    # rewound, and every later draw (the next micro-batches' nn.Dropout masks, a data shuffle) would repeat old ones.
    torch.manual_seed(0)
    stage = stage_with(nn.Linear(8, 64), nn.Dropout(0.5), nn.Linear(64, 2))
    stage.forward(0, [torch.randn(4, 8, requires_grad=True)], True, 0, remat=True)
    torch.rand(100)  # other work moves the global RNG on before the recompute
    before = torch.get_rng_state()
    stage.recompute(0)
    assert torch.equal(torch.get_rng_state(), before)


def test_what_a_forward_hands_on_carries_no_graph():
    # The next stage's input must be a fresh leaf: a message with this stage's graph attached would let a later
    # backward run into this stage's layers a second time.
    stage = stage_with(nn.Linear(8, 16), nn.Tanh())
    out, bare = stage.forward(0, [torch.randn(3, 8, requires_grad=True)], True, 0, remat=False)
    assert bare and out[0].grad_fn is None and not out[0].requires_grad


def test_a_micro_batch_context_puts_back_what_it_replaced():
    outer, inner = context.microbatch(1, 0), context.microbatch(1, 4, recomputing=True)
    with outer:
        with inner:
            assert context.current() == inner.info and context.is_recomputing()
        assert context.current() == outer.info
        with pytest.raises(RuntimeError, match="entered once at a time"), outer:  # else set for good once left
            pass
        assert context.current() == outer.info
    assert context.current() is None
    with outer:  # once left, entered again
        assert context.current() == outer.info
    assert context.current() is None
