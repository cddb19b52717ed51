"""Transformer: Transformer-L parameter counts, shapes, padding, cuts, tying, clipping and training."""

from __future__ import annotations

import math

import pytest
import torch
from models_testkit import build_layers, build_preset, check_every_cut, run

from gpipe_cli.models.describe import count_parameters
from gpipe_cli.models.registry import build_model

TINY = dict(layers=2, d_model=32, ff=64, heads=4, vocab_size=50, max_len=16, dropout=0.1)


def tiny(arch: str = "encoder-decoder", **overrides: object):
    return build_model("transformer", arch=arch, **{**TINY, **overrides})


@pytest.mark.parametrize(("preset", "published"), [
    ("transformer-l-3", 282.2e6), ("transformer-l-13", 785.8e6), ("transformer-l-103", 5.3e9)])
def test_transformer_l_parameter_counts(preset: str, published: float) -> None:
    count = count_parameters(build_preset(preset))
    assert abs(count - published) <= 0.01 * published, f"{count / 1e6:.1f}M vs {published / 1e6:.1f}M"



def test_the_papers_translation_models_share_a_64k_vocabulary() -> None:
    from gpipe_cli.models.presets import presets

    # The T(L, H, A) presets had a 32k vocabulary: T(6, 8192, 16) came to 343M parameters, not the paper's 400M.
    for name, preset in presets().items():
        if name.startswith("t-"):
            assert preset.params["vocab_size"] == 64000 and preset.params["d_model"] == 1024, name
    count = count_parameters(build_preset("t-6-8192-16"))
    assert abs(count - 400e6) <= 0.05 * 400e6, f"{count / 1e6:.1f}M vs 400M"

def test_tied_parameters_are_counted_once() -> None:
    untied, tied = tiny(), tiny(tie_embeddings=True)
    assert count_parameters(untied) - count_parameters(tied) == 50 * 32


def test_translation_shapes_with_variable_lengths_and_padding() -> None:
    spec = tiny()
    assert spec.task == "translation"
    layers = build_layers(spec)
    for src_len, tgt_len in [(7, 5), (3, 9), (16, 1)]:
        source = torch.randint(4, 50, (3, src_len))
        target = torch.randint(4, 50, (3, tgt_len))
        source[0, src_len // 2:] = 0
        target[1, max(tgt_len - 2, 1):] = 0
        logits = run(layers, (source, target))
        assert logits.shape == (3, tgt_len, 50)
        assert torch.isfinite(logits).all()


def test_language_model_shapes() -> None:
    spec = tiny("decoder-only")
    assert spec.task == "lm" and spec.layer_names == ["embed", "layer_1", "layer_2", "softmax"]
    tokens = torch.randint(4, 50, (2, 11))
    tokens[1, 6:] = 0
    logits = run(build_layers(spec), tokens)
    assert logits.shape == (2, 11, 50) and torch.isfinite(logits).all()


def test_source_padding_is_invisible() -> None:
    layers = build_layers(tiny(dropout=0.0))
    source = torch.randint(4, 50, (2, 5))
    target = torch.randint(4, 50, (2, 4))
    padded = torch.cat([source, torch.zeros(2, 3, dtype=torch.long)], dim=1)
    torch.testing.assert_close(run(layers, (source, target)), run(layers, (padded, target)))


def test_decoder_is_causal() -> None:
    layers = build_layers(tiny("decoder-only", dropout=0.0))
    tokens = torch.randint(4, 50, (1, 8))
    changed = tokens.clone()
    changed[0, 5] = 4 if tokens[0, 5] != 4 else 5
    a, b = run(layers, tokens), run(layers, changed)
    torch.testing.assert_close(a[:, :5], b[:, :5])
    assert not torch.allclose(a[:, 5:], b[:, 5:])


def test_all_padding_example_stays_finite() -> None:
    layers = build_layers(tiny())
    source = torch.zeros(2, 4, dtype=torch.long)
    target = torch.zeros(2, 3, dtype=torch.long)
    source[0, :2] = 7
    target[0, :2] = 9
    assert torch.isfinite(run(layers, (source, target))).all()


@pytest.mark.parametrize("arch", ["encoder-decoder", "decoder-only"])
@pytest.mark.parametrize("positions", ["sinusoidal", "learned"])
def test_every_cut_and_micro_batch_split_agree(arch: str, positions: str) -> None:
    spec = tiny(arch, positions=positions, tie_embeddings=True)
    inputs, _ = spec.example_batch(4, "cpu")
    check_every_cut(spec, inputs, micro_batches=[3, 1])


def test_tied_embedding_and_softmax_are_declared_across_layers() -> None:
    spec = tiny(tie_embeddings=True)
    last = len(spec.layers) - 1
    assert spec.tied == [("0.embed.weight", f"{last}.proj.weight")]
    first, final = spec.layers[0].build(), spec.layers[last].build()
    assert (dict(first.named_parameters())["embed.weight"].shape
            == dict(final.named_parameters())["proj.weight"].shape)


def test_loss_ignores_padding_and_units_count_tokens() -> None:
    spec = tiny("decoder-only", label_smoothing=0.0)
    logits = torch.randn(2, 3, 50)
    targets = torch.tensor([[5, 6, 0], [7, 0, 0]])
    assert spec.units is not None and int(spec.units(targets)) == 3
    expected = torch.nn.functional.cross_entropy(logits[targets != 0], targets[targets != 0])
    torch.testing.assert_close(spec.loss(logits, targets), expected)
    assert spec.loss(logits, torch.zeros_like(targets)) == 0


def test_logit_clipping_and_scaled_init() -> None:
    layers = build_layers(tiny("decoder-only", logit_clip=0.5))
    assert run(layers, torch.randint(4, 50, (2, 6))).abs().max() <= 0.5
    torch.manual_seed(0)
    plain = tiny("decoder-only", layers=16).layers[1].build()
    torch.manual_seed(0)
    scaled = tiny("decoder-only", layers=16, scaled_init=True).layers[1].build()
    ratio = scaled.ffn.inner.weight.detach().std() / plain.ffn.inner.weight.detach().std()
    assert abs(float(ratio) - 0.25) < 1e-3



def test_sinusoidal_positions_span_the_timescales_from_one_to_ten_thousand() -> None:
    from gpipe_cli.models.transformer.attention import sinusoidal_positions

    # The frequencies were spaced over `half` steps, not `half - 1`: the slowest timescale fell short of 10,000.
    table = sinusoidal_positions(3, 8, torch.device("cpu"))
    assert table.shape == (3, 8)
    assert table[1, :4].tolist() == pytest.approx([math.sin(1.0), math.sin(10000 ** (-1 / 3)),
                                                   math.sin(10000 ** (-2 / 3)), math.sin(1e-4)], rel=1e-5)
    assert table[2, 4:].tolist() == pytest.approx([math.cos(2.0), math.cos(2 * 10000 ** (-1 / 3)),
                                                   math.cos(2 * 10000 ** (-2 / 3)), math.cos(2e-4)], rel=1e-5)
    assert table[0].tolist() == [0.0] * 4 + [1.0] * 4

def test_learned_positions_reject_sequences_beyond_max_len() -> None:
    layers = build_layers(tiny("decoder-only", positions="learned", max_len=8))
    with pytest.raises(ValueError, match="max_len"):
        run(layers, torch.randint(4, 50, (1, 9)))


def test_example_batch_on_meta() -> None:
    (source, target_in), target_out = tiny().example_batch(3, "meta")
    assert source.is_meta and source.dtype == torch.int64 and source.shape == (3, 16)
    assert target_in.shape == target_out.shape == (3, 16)


def test_example_batches_pair_each_token_with_the_next() -> None:
    """The stand-in batches of profile, estimate and bench are next-token pairs, like the real data."""
    tokens, next_tokens = tiny("decoder-only").example_batch(3, "cpu")
    assert tokens.shape == next_tokens.shape and torch.equal(tokens[:, 1:], next_tokens[:, :-1])
    (_, target_in), target_out = tiny().example_batch(3, "cpu")
    assert target_in.shape == target_out.shape and torch.equal(target_in[:, 1:], target_out[:, :-1])


@pytest.mark.parametrize(("key", "value"), [
    ("arch", "encoder-only"), ("heads", 5), ("positions", "rotary"), ("dropout", -0.1),
    ("logit_clip", 0), ("tie_embeddings", "yes"), ("layers", 0)])
def test_bad_values_raise_value_error(key: str, value: object) -> None:
    with pytest.raises(ValueError, match=key.split("_")[0]):
        tiny(**{key: value})


@pytest.mark.parametrize("arch", ["encoder-decoder", "decoder-only"])
def test_sgd_reduces_loss(arch: str) -> None:
    torch.manual_seed(0)
    spec = tiny(arch, dropout=0.0, label_smoothing=0.0)
    layers = build_layers(spec)
    params = list({id(p): p for layer in layers for p in layer.parameters()}.values())
    optimizer = torch.optim.SGD(params, lr=0.3, momentum=0.9)
    inputs, _ = spec.example_batch(8, "cpu")
    # A learnable task: predict the current input token (the decoder input in translation).
    targets = inputs[1] if arch == "encoder-decoder" else inputs
    losses = []
    for _ in range(12):
        loss = spec.loss(run(layers, inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0] and losses[-1] < math.log(50), losses
