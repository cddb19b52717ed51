import pytest
import torch

from gpipe_cli.pipeline.comm import CommError, TensorMeta, decode, encode


def test_header_roundtrip_with_absent_and_integer_tensors():
    x = torch.zeros(3, 5, 7)
    mask = torch.ones(3, 5, dtype=torch.bool)
    header = decode(encode(4, 8, 120, [x, None, mask], bare=False, differentiable=True))
    assert (header.microbatch, header.chunks, header.offset, header.bare) == (4, 8, 120, False)
    assert header.tensors == (TensorMeta(torch.float32, (3, 5, 7), True), None,
                              TensorMeta(torch.bool, (3, 5), False))


def test_gradients_are_not_marked_differentiable():
    header = decode(encode(0, 1, 0, [torch.zeros(2)], bare=True))
    assert header.bare and header.tensors[0].requires_grad is False


def test_scalar_and_bfloat16():
    header = decode(encode(0, 1, 0, [torch.zeros((), dtype=torch.bfloat16)], bare=True))
    assert header.tensors[0] == TensorMeta(torch.bfloat16, (), False)


def test_corrupt_header_is_detected():
    with pytest.raises(CommError, match="out of step"):
        decode(torch.zeros(64, dtype=torch.int64))


def test_too_many_tensors_for_the_header():
    with pytest.raises(CommError, match="too many"):
        encode(0, 1, 0, [torch.zeros(1, 2, 3, 4, 5, 6)] * 8)
