"""Gradient helpers: the global norm with its flag, and the first non-finite gradient."""

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
    norm, flag = grads.global_norm(params, set(), None, False, torch.device("cpu"), flag=1.0)
    assert norm == 5.0 and flag == 1.0
    norm, _ = grads.global_norm(params, {id(params[1])}, None, False, torch.device("cpu"))
    assert norm == 3.0


def test_a_nan_makes_the_norm_nan():
    norm, flag = grads.global_norm(with_grads([1.0, math.nan]), set(), None, False, torch.device("cpu"))
    assert math.isnan(norm) and flag == 0.0


def test_the_first_non_finite_gradient_in_the_given_order():
    params = with_grads([1.0, 1.0], [math.inf, 0.0], [math.nan, 0.0])
    named = [(f"{i}.weight", p) for i, p in enumerate(params)]
    assert grads.first_nonfinite(named) == "1.weight"
    assert grads.first_nonfinite(reversed(named)) == "2.weight"
    assert grads.first_nonfinite(named[:1]) is None
