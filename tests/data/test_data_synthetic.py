"""Synthetic data for each task: shapes, conventions, held-out split, and that it can be learned."""

from __future__ import annotations

import pytest
import torch
from datagen import data
from torch import nn

from gpipe_cli.data import BOS, EOS, PAD, build_data
from gpipe_cli.data.synthetic import english, french, translation_pairs


def test_image_batches_have_the_model_conventions() -> None:
    ds = build_data(data(synthetic_size=64, batch_size=16), "image", seed=1, image_size=32, num_classes=10)
    assert ds.tokenizer is None and ds.steps_per_epoch() == 4 and ds.eval_size == 3
    b = next(ds.train_batches())
    assert b.inputs.shape == (16, 3, 32, 32) and b.inputs.dtype == torch.float32
    assert b.targets.shape == (16,) and b.targets.dtype == torch.int64 and int(b.targets.max()) < 10
    assert b.tokens is None and b.size == b.global_size == 16 and b.offset == 0
    assert abs(float(b.inputs.mean())) < 1.5  # normalised, not raw [0, 1] pixels
    e = list(ds.eval_batches())
    assert sum(x.size for x in e) == 3 and e[0].epoch is None


def test_translation_batches_have_the_model_conventions() -> None:
    ds = build_data(data(synthetic_size=200), "translation", seed=0, vocab_size=500, max_len=64)
    b = next(ds.train_batches())
    src, tgt_in = b.inputs
    assert src.dtype == tgt_in.dtype == b.targets.dtype == torch.int64
    assert tgt_in.shape == b.targets.shape and src.shape[0] == 8
    assert (tgt_in[:, 0] == BOS).all()
    # tgt_in = [bos] + tokens, tgt_out = tokens + [eos]
    for row_in, row_out in zip(tgt_in, b.targets, strict=True):
        n = int((row_out != PAD).sum())
        assert row_out[n - 1] == EOS and torch.equal(row_in[1:n], row_out[:n - 1])
    assert b.tokens == int((b.targets != PAD).sum())
    # Pads only to the longest sequence in the batch.
    assert (b.targets[:, -1] != PAD).any() and (src[:, -1] != PAD).any()
    assert ds.tokenizer is not None and ds.tokenizer.vocab_size <= 500
    ev = next(ds.eval_batches())
    assert ev.references is not None and len(ev.references) == ev.size
    assert ds.tokenizer.decode(ev.targets[0]) == ev.references[0]


def test_lm_batches_are_next_token_pairs() -> None:
    ds = build_data(data(synthetic_size=64, seq_len=32), "lm", seed=0, vocab_size=400, max_len=64)
    b = next(ds.train_batches())
    assert b.inputs.shape == b.targets.shape == (8, 32) and b.inputs.dtype == torch.int64
    assert torch.equal(b.inputs[:, 1:], b.targets[:, :-1])
    assert ds.eval_size > 0 and b.tokens == 8 * 32


def test_number_words() -> None:
    assert english(342) == "three hundred forty-two" and english(7000) == "seven thousand"
    cases = {0: "zéro", 17: "dix-sept", 21: "vingt et un", 71: "soixante et onze", 77: "soixante-dix-sept",
             80: "quatre-vingts", 81: "quatre-vingt-un", 91: "quatre-vingt-onze", 100: "cent",
             200: "deux cents", 201: "deux cent un", 1000: "mille", 80000: "quatre-vingt mille",
             2342: "deux mille trois cent quarante-deux"}
    for n, words in cases.items():
        assert french(n) == words
    first = translation_pairs(50, 3, "train")
    assert first == translation_pairs(50, 3, "train") != translation_pairs(50, 4, "train")


@pytest.fixture(autouse=True)
def _one_thread():  # type: ignore[no-untyped-def]
    """Tiny models train fastest on one thread, and do not fight other test processes for cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _fit(model: nn.Module, ds, loss_of, steps: int = 40) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """First and last-5-mean loss of a short Adam run over the synthetic batches."""
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses: list[float] = []
    epoch = 0
    while len(losses) < steps:
        for b in ds.train_batches(epoch=epoch):
            loss = loss_of(model, b)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if len(losses) == steps:
                break
        epoch += 1
    return losses[0], sum(losses[-5:]) / 5


def test_synthetic_images_are_learnable() -> None:
    ds = build_data(data(synthetic_size=512, batch_size=32), "image", seed=0, image_size=32, num_classes=10)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(),
                          nn.Linear(256, 10))
    first, last = _fit(model, ds, lambda m, b: nn.functional.cross_entropy(m(b.inputs), b.targets))
    assert last < 0.5 * first


@pytest.mark.parametrize("task", ["translation", "lm"])
def test_synthetic_text_is_learnable(task: str) -> None:
    ds = build_data(data(synthetic_size=256, batch_size=16, seq_len=32), task, seed=0, vocab_size=512,
                    max_len=48)  # type: ignore[arg-type]
    v = ds.tokenizer.vocab_size  # type: ignore[union-attr]
    torch.manual_seed(0)
    emb, rnn, head = nn.Embedding(v, 64), nn.GRU(64, 64, batch_first=True), nn.Linear(64, v)
    model = nn.ModuleList([emb, rnn, head])

    def loss_of(m: nn.ModuleList, b) -> torch.Tensor:  # type: ignore[no-untyped-def]
        # A decoder that sees the source first (concatenated) is enough to show the signal is learnable.
        x = torch.cat(b.inputs, 1) if task == "translation" else b.inputs
        h, _ = m[1](m[0](x))
        h = h[:, -b.targets.shape[1]:]
        return nn.functional.cross_entropy(m[2](h).flatten(0, 1), b.targets.flatten(), ignore_index=PAD)

    first, last = _fit(model, ds, loss_of)
    assert last < 0.6 * first
