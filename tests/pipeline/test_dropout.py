import pytest
import torch

from gpipe_cli.pipeline import context
from gpipe_cli.pipeline.dropout import Dropout


def masks(drop, x, step, splits):
    out, at = [], 0
    for part in x.tensor_split(splits):
        with context.microbatch(step=step, offset=at):
            out.append(drop(part))
        at += part.shape[0]
    return torch.cat(out)


def test_masks_do_not_depend_on_the_split():
    drop = Dropout(0.5)
    drop.rng_key = 7
    x = torch.ones(10, 6)
    whole = masks(drop, x, step=3, splits=1)
    for splits in (2, 3, 10):
        assert torch.equal(masks(drop, x, step=3, splits=splits), whole)
    assert 0.2 < (whole == 0).float().mean() < 0.8
    assert set(whole.unique().tolist()) <= {0.0, 2.0}


def test_masks_change_with_step_and_layer_and_example():
    drop = Dropout(0.5)
    x = torch.ones(4, 64)
    a = masks(drop, x, step=0, splits=1)
    assert not torch.equal(a, masks(drop, x, step=1, splits=1))
    drop.rng_key = 1
    assert not torch.equal(a, masks(drop, x, step=0, splits=1))
    assert not torch.equal(a[0], a[1])


def test_recompute_gives_the_same_mask():
    drop = Dropout(0.3)
    x = torch.ones(3, 50)
    with context.microbatch(step=2, offset=5):
        first = drop(x)
    with context.microbatch(step=2, offset=5, recomputing=True):
        again = drop(x)
    assert torch.equal(first, again)


def test_plain_dropout_outside_the_engine_and_eval_is_identity():
    drop = Dropout(0.5)
    x = torch.ones(100)
    assert (drop(x) == 0).any()
    drop.eval()
    assert torch.equal(drop(x), x)
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        Dropout(1.0)


def test_engine_masks_drop_at_the_rate_and_keep_the_mean():
    drop = Dropout(0.1)
    x = torch.ones(64, 128, 129)  # rows of odd width
    with context.microbatch(step=0, offset=0):
        y = drop(x)
    assert abs((y == 0).float().mean().item() - 0.1) < 0.003
    assert abs(y.mean().item() - 1.0) < 0.005


def test_engine_dropout_gradient_is_the_scaled_mask():
    drop = Dropout(0.25)
    x = torch.randn(5, 3, 7, requires_grad=True)
    with context.microbatch(step=1, offset=2):
        y = drop(x)
    y.backward(torch.ones_like(y))
    assert torch.equal(x.grad, (y != 0).float() / 0.75)


def test_engine_dropout_keeps_the_dtype_and_one_mask_for_every_dtype():
    drop = Dropout(0.5)
    x = torch.ones(4, 33)
    with context.microbatch(step=0, offset=0):
        full = drop(x)
        half = drop(x.to(torch.bfloat16))
    assert half.dtype == torch.bfloat16
    assert torch.equal(half.float(), full)
