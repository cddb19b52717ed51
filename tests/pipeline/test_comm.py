import pytest
import torch

from gpipe_cli.pipeline.wire import CommError, TensorMeta, decode, encode, meta_of, pack, unpack


def metas(tensors, differentiable=False):
    return [meta_of(t, differentiable) for t in tensors]


def test_header_roundtrip_with_absent_and_integer_tensors():
    x = torch.zeros(3, 5, 7)
    mask = torch.ones(3, 5, dtype=torch.bool)
    header = decode(encode(4, 8, 120, metas([x, None, mask], differentiable=True), bare=False, ahead=96))
    assert (header.microbatch, header.chunks, header.offset, header.bare, header.ahead) == (4, 8, 120, False, 96)
    assert header.tensors == (TensorMeta(torch.float32, (3, 5, 7), True), None,
                              TensorMeta(torch.bool, (3, 5), False))


def test_gradients_are_not_marked_differentiable():
    header = decode(encode(0, 1, 0, metas([torch.zeros(2)]), bare=True))
    assert header.bare and header.tensors[0].requires_grad is False


def test_scalar_and_bfloat16():
    header = decode(encode(0, 1, 0, metas([torch.zeros((), dtype=torch.bfloat16)]), bare=True))
    assert header.tensors[0] == TensorMeta(torch.bfloat16, (), False)


def test_corrupt_header_is_detected():
    with pytest.raises(CommError, match="out of step"):
        decode(torch.zeros(64, dtype=torch.int64))


def test_too_many_tensors_for_the_header():
    with pytest.raises(CommError, match="too many"):
        encode(0, 1, 0, metas([torch.zeros(1, 2, 3, 4, 5, 6)] * 8))


def test_every_dtype_travels_as_aligned_bytes_in_one_buffer_padded_to_what_was_posted_ahead():
    tensors = [torch.arange(7, dtype=torch.int16), None, torch.tensor([True, False, True]),
               torch.randn(3, 2, dtype=torch.bfloat16), torch.randn(5, dtype=torch.float64)]
    header = decode(encode(0, 1, 0, metas(tensors)))
    buffer = pack(tensors, header.payload + 100, torch.device("cpu"))
    assert buffer.numel() == header.payload + 100 and header.payload % 1 == 0
    out = unpack(buffer, header)
    assert out[1] is None
    for sent, got in zip(tensors, out):
        if sent is not None:
            assert got.dtype == sent.dtype and torch.equal(got, sent)
            assert got.data_ptr() % 8 == 0
