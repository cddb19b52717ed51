import random

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from gpipe_cli.pipeline import context
from gpipe_cli.pipeline.dropout import Dropout, mix64, mix64_


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


def test_the_finaliser_on_tensors_is_the_host_one():
    # SplitMix64 seeded with 0 starts with 0xE220A8397B1DCDAF; values at and above 2^63 are negative int64s,
    # which torch shifts arithmetically.
    assert mix64(0x9E3779B97F4A7C15) == 0xE220A8397B1DCDAF
    values = [random.Random(0).getrandbits(64) for _ in range(1000)] + [0, 1, (1 << 63) - 1, 1 << 63, (1 << 64) - 1]
    words = torch.tensor([v - (1 << 64) if v >> 63 else v for v in values])
    mix64_(words, torch.empty_like(words))
    assert [w % (1 << 64) for w in words.tolist()] == [mix64(v) for v in values]


def test_masks_are_independent_across_elements_rows_steps_and_layers():
    drop = Dropout(0.5)
    x = torch.ones(64, 1024)
    kept = masks(drop, x, step=0, splits=1) != 0
    for lane in range(4):  # one 64-bit word masks four neighbouring elements
        assert abs(kept[:, lane::4].float().mean().item() - 0.5) < 0.02
    # Two independent masks at rate 1/2 agree on half of the elements.
    assert abs((kept[:, 1:] == kept[:, :-1]).float().mean().item() - 0.5) < 0.01
    assert abs((kept[1:] == kept[:-1]).float().mean().item() - 0.5) < 0.01
    assert abs((masks(drop, x, step=1, splits=1) != 0).eq(kept).float().mean().item() - 0.5) < 0.01
    drop.rng_key = 1
    assert abs((masks(drop, x, step=0, splits=1) != 0).eq(kept).float().mean().item() - 0.5) < 0.01


def test_examples_far_apart_have_independent_masks():
    drop = Dropout(0.5)
    x = torch.ones(16, 2048)
    found = []
    for offset in (0, 10**9, 1 << 32):  # 2^32 apart must not wrap onto the same examples
        with context.microbatch(step=0, offset=offset):
            y = drop(x)
        assert set(y.unique().tolist()) == {0.0, 2.0}
        assert abs((y == 0).float().mean().item() - 0.5) < 0.02
        found.append(y != 0)
    for i, a in enumerate(found):
        for b in found[i + 1 :]:
            assert abs((a == b).float().mean().item() - 0.5) < 0.02


def test_mask_work_does_not_grow_with_the_examples():
    drop = Dropout(0.5)

    def ops(rows: int) -> dict[str, int]:
        with context.microbatch(step=0, offset=0), profile(activities=[ProfilerActivity.CPU]) as prof:
            drop(torch.ones(rows, 8))
        return {event.key: event.count for event in prof.key_averages()}

    few, many = ops(4), ops(4096)
    assert few == many  # no work per example, which on a GPU would be a kernel launch each
    # Nothing reads a value back to the host or copies one from it: on a GPU each would wait for the device.
    assert not {"aten::item", "aten::_local_scalar_dense", "aten::lift_fresh"} & set(many)
