import pytest
import torch
from torch import nn

from gpipe_cli.pipeline import context
from gpipe_cli.pipeline.batchnorm import DeferredBatchNorm


def test_running_stats_equal_full_batch_for_any_microbatch_count():
    x = torch.randn(12, 3, 5, 5) * 2 + 1
    reference = nn.BatchNorm2d(3)
    reference(x)
    for chunks in (1, 3, 4, 12):
        bn = DeferredBatchNorm(3)
        for part in x.tensor_split(chunks):
            bn(part)
        bn.commit()
        assert torch.allclose(bn.running_mean, reference.running_mean, atol=1e-6)
        assert torch.allclose(bn.running_var, reference.running_var, atol=1e-6)
        assert int(bn.num_batches_tracked) == 1


@pytest.mark.parametrize("momentum", [0.3, None])  # None: torch's cumulative average over the steps
def test_running_stats_over_several_steps_follow_the_momentum_of_a_full_batch(momentum):
    reference = nn.BatchNorm2d(3, momentum=momentum)
    bn = DeferredBatchNorm(3, momentum=momentum)
    for step in range(4):
        x = torch.randn(12, 3, 5, 5) * (step + 1) + step
        reference(x)
        for part in x.tensor_split(3):
            bn(part)
        bn.commit()
    assert torch.allclose(bn.running_mean, reference.running_mean, atol=1e-5)
    assert torch.allclose(bn.running_var, reference.running_var, atol=1e-4)
    assert int(bn.num_batches_tracked) == 4


def test_training_normalises_each_microbatch_by_its_own_statistics():
    x = torch.randn(6, 4)
    bn = DeferredBatchNorm(4)
    out = bn(x)
    assert torch.allclose(out.mean(0), torch.zeros(4), atol=1e-6)


def test_recompute_does_not_count_twice():
    bn = DeferredBatchNorm(2)
    x = torch.randn(4, 2)
    bn(x)
    with context.microbatch(step=0, offset=0, recomputing=True):
        bn(x)
    assert float(bn.count) == 4


def test_eval_uses_running_statistics_and_convert_keeps_state():
    plain = nn.BatchNorm1d(3)
    plain(torch.randn(8, 3) + 5)
    model = DeferredBatchNorm.convert(nn.Sequential(plain))
    bn = model[0]
    assert isinstance(bn, DeferredBatchNorm)
    assert torch.equal(bn.running_mean, plain.running_mean)
    bn.eval()
    x = torch.randn(2, 3)
    plain.eval()
    assert torch.allclose(bn(x), plain(x))


def test_state_dict_matches_plain_batchnorm():
    assert set(DeferredBatchNorm(3).state_dict()) == set(nn.BatchNorm2d(3).state_dict())
