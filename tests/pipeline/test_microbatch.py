import pytest
import torch

from gpipe_cli.pipeline import microbatch


def test_uneven_split_sizes():
    assert microbatch.sizes(10, 4) == [3, 3, 2, 2]
    assert microbatch.sizes(8, 8) == [1] * 8


def test_fewer_examples_than_microbatches_is_a_clear_error():
    with pytest.raises(ValueError, match="3 examples cannot be split into 4 micro-batches"):
        microbatch.sizes(3, 4)


def test_scatter_gather_roundtrip_tensor_and_tuple():
    x = torch.arange(20.0).reshape(10, 2)
    mask = torch.arange(10) % 2 == 0
    parts = microbatch.scatter((x, mask), 3)
    assert [p[0].shape[0] for p in parts] == [4, 3, 3]
    assert torch.equal(microbatch.gather(parts)[0], x)
    assert torch.equal(microbatch.gather(parts)[1], mask)
    assert torch.equal(microbatch.gather(microbatch.scatter(x, 4)), x)


def test_offsets_are_global_example_indices():
    assert microbatch.offsets([3, 3, 2], start=10) == [10, 13, 16]
