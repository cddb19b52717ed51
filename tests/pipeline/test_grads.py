"""Gradient helpers on the device: per-parameter norms, the global norm with its flag, the last bad layer."""

import math

import torch
from torch import nn

from gpipe_cli.pipeline import grads


def with_grads(*values):
    params = []
    for value in values:
        p = nn.Parameter(torch.zeros(2))
        p.grad = torch.tensor(value)
        params.append(p)
    return params


def test_the_norm_and_the_flag_come_back_together():
    params = with_grads([3.0, 0.0], [0.0, 4.0])
    found, positions = grads.norms([*params, nn.Parameter(torch.zeros(1))])
    assert positions == (0, 1) and found.tolist() == [3.0, 4.0]
    norm, flag = grads.global_norm(found.square().sum(), torch.tensor(1.0), None, ())
    assert norm.item() == 5.0 and flag.item() == 1.0
    counted = torch.tensor([1.0, 0.0], dtype=torch.float64)  # a tied copy counted on another stage
    norm, _ = grads.global_norm((found.square() * counted).sum(), torch.tensor(0.0), None, ())
    assert norm.item() == 3.0


def test_a_nan_makes_the_norm_nan():
    found, _ = grads.norms(with_grads([1.0, math.nan]))
    norm, flag = grads.global_norm(found.square().sum(), torch.tensor(0.0), None, ())
    assert math.isnan(norm.item()) and flag.item() == 0.0


def test_clipping_scales_by_a_clamped_factor_without_reading_the_norm():
    params = with_grads([3.0, 4.0])
    grads.clip_(params, torch.tensor(5.0, dtype=torch.float64), max_norm=1.0)
    assert torch.allclose(params[0].grad, torch.tensor([0.6, 0.8]), atol=1e-6)
    grads.clip_(params, torch.tensor(1.0, dtype=torch.float64), max_norm=10.0)  # under the limit: unchanged
    assert torch.allclose(params[0].grad, torch.tensor([0.6, 0.8]), atol=1e-6)


def test_the_loss_scale_halves_on_overflow_never_below_one_and_grows_after_clean_steps():
    scale = grads.LossScale(True, torch.device("cpu"), initial=4.0, growth_interval=2)
    scale.update(torch.tensor(1.0))
    assert scale.value.item() == 2.0
    scale.update(torch.tensor(0.0))
    scale.update(torch.tensor(0.0))
    assert scale.value.item() == 4.0
    for _ in range(5):
        scale.update(torch.tensor(1.0))
    assert scale.value.item() == 1.0
    restored = grads.LossScale(True, torch.device("cpu"))
    restored.load(scale.state())
    assert restored.value.item() == 1.0


def test_norms_of_several_dtypes_come_back_beside_the_parameters_they_are_of():
    # Grouped by dtype for one kernel each: the positions must follow the groups, or a norm names another parameter
    # (and a tied copy counted elsewhere would be left out in its place).
    values = [[3.0, 4.0], [1.0, 0.0], [0.0, 2.0], [6.0, 8.0]]
    dtypes = [torch.float32, torch.float64, torch.bfloat16, torch.float32]
    params = []
    for value, dtype in zip(values, dtypes, strict=True):
        p = nn.Parameter(torch.zeros(2, dtype=dtype))
        p.grad = torch.tensor(value, dtype=dtype)
        params.append(p)
    found, positions = grads.norms(params)
    assert sorted(positions) == [0, 1, 2, 3] and positions != (0, 1, 2, 3)  # grouped: not the parameters' order
    assert found.tolist() == [torch.linalg.vector_norm(torch.tensor(values[i])).item() for i in positions]
