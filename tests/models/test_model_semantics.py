"""Layers against their definitions: positions, pre-norm residual blocks, the decoder reading the source, and
AmoebaNet's wiring and initialisation."""

from __future__ import annotations

import math

import pytest
import torch
from models_testkit import build_layers, run

from gpipe_cli.models.amoebanet.genotype import GENOTYPES
from gpipe_cli.models.registry import build_model
from gpipe_cli.models.transformer.attention import causal_mask, key_mask
from gpipe_cli.models.transformer.layers import DecoderLayer, Embedding, EncoderLayer

TINY = dict(layers=2, d_model=32, ff=64, heads=4, vocab_size=50, max_len=16, dropout=0.0)


def test_learned_positions_add_row_t_of_the_table_at_position_t_at_any_length() -> None:
    torch.manual_seed(0)
    embedding = Embedding(50, 8, 16, "learned", 0.0, two_streams=False).eval()
    ids = torch.randint(4, 50, (2, 16))
    whole, _ = embedding.stream(ids)
    for length in (5, 16):
        part, keep = embedding.stream(ids[:, :length])
        expected = embedding.embed(ids[:, :length]) * math.sqrt(8) + embedding.position.weight[:length]
        torch.testing.assert_close(part, expected)
        torch.testing.assert_close(part, whole[:, :length])
        assert keep.all()


def test_encoder_and_decoder_layers_are_pre_norm_residual_blocks() -> None:
    torch.manual_seed(0)
    x, memory, y = torch.randn(2, 5, 16), torch.randn(2, 5, 16), torch.randn(2, 4, 16)
    x_keep = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    y_keep = torch.tensor([[True] * 4, [True] * 2 + [False] * 2])
    enc = EncoderLayer(16, 32, 2, 0.0).eval()
    h = x + enc.attention(enc.norm1(x), enc.norm1(x), key_mask(x_keep))
    torch.testing.assert_close(enc((x, x_keep))[0], h + enc.ffn(enc.norm2(h)))
    dec = DecoderLayer(16, 32, 2, 0.0).eval()
    g = y + dec.self_attention(dec.norm1(y), dec.norm1(y), causal_mask(y_keep))
    g = g + dec.cross_attention(dec.cross_norm(g), memory, key_mask(x_keep))
    torch.testing.assert_close(dec((memory, x_keep, y, y_keep))[2], g + dec.ffn(dec.norm2(g)))


def test_the_translation_decoder_reads_the_source() -> None:
    layers = build_layers(build_model("transformer", arch="encoder-decoder", **TINY))
    target = torch.randint(4, 50, (2, 4))
    a = run(layers, (torch.randint(4, 50, (2, 5)), target))
    b = run(layers, (torch.randint(4, 50, (2, 5)), target))
    assert not torch.allclose(a, b)


def test_the_encoder_stack_ends_in_one_layer_norm() -> None:
    spec = build_model("transformer", arch="encoder-decoder", **TINY)
    layers = build_layers(spec)
    assert [layer.final_norm is not None for layer in layers[1:3]] == [False, True]
    memory = run(layers, (torch.randint(4, 50, (2, 5)), torch.randint(4, 50, (2, 4))), stop=3)[0]
    torch.testing.assert_close(memory.mean(-1), torch.zeros(2, 5), atol=1e-5, rtol=0)
    torch.testing.assert_close(memory.var(-1, unbiased=False), torch.ones(2, 5), atol=1e-3, rtol=0)


@pytest.mark.parametrize("variant", sorted(GENOTYPES))
def test_every_state_of_an_amoebanet_cell_is_read_or_concatenated(variant: str) -> None:
    for cell in (GENOTYPES[variant].normal, GENOTYPES[variant].reduction):
        for state in range(2, 7):  # a combination's output that nothing reads trains nothing
            assert state in cell.inputs[2 * (state - 1):] or state in cell.concat, (variant, cell, state)


def test_every_amoebanet_parameter_gets_a_gradient() -> None:
    spec = build_model("amoebanet", variant="d", layers=3, filters=8, num_classes=3, image_size=32)
    layers = build_layers(spec)
    images, labels = spec.example_batch(4, "cpu")
    spec.loss(run(layers, images), labels).backward()
    dead = [f"{spec.layers[i].name}.{name}" for i, layer in enumerate(layers)
            for name, p in layer.named_parameters() if p.grad is None or not p.grad.any()]
    assert dead == []


def test_amoebanet_convolutions_are_he_normal_by_fan_out_and_follow_the_torch_seed() -> None:
    spec = build_model("amoebanet", variant="d", layers=3, filters=8, num_classes=3, image_size=32)
    weights = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        weights.append(spec.layers[0].build().conv.weight.detach())  # the stem: 3 -> 32 channels, 3x3
    assert not torch.equal(weights[0], weights[1])
    fan_out = 32 * 3 * 3
    assert abs(float(torch.cat(weights).std()) / math.sqrt(2 / fan_out) - 1) < 0.1
    torch.manual_seed(1)
    first, second = (spec.layers[k].build() for k in (1, 1))  # one layer built twice in a row: new draws
    assert not all(torch.equal(p, q) for p, q in zip(first.parameters(), second.parameters(), strict=True)
                   if p.dim() > 1)
