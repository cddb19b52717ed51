"""data.source pydoc: real English text on every Python, a held-out split, and the unigram baseline."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from datagen import data

from gpipe_cli.data import build_data
from gpipe_cli.data.pydoc import pydoc_documents
from gpipe_cli.data.text import LMExamples, unigram_perplexity


def test_pydoc_paragraphs_are_english_documentation() -> None:
    docs = pydoc_documents()
    assert len(docs) > 500 and all(d.strip() for d in docs)
    words = " ".join(docs).split()
    assert words.count("the") > 1000 and any("assert" in d for d in docs)


def test_pydoc_builds_a_held_out_split_and_its_unigram_perplexity(tmp_path: Path) -> None:
    d = data(source="pydoc", seq_len=32, vocab_size=300, eval_fraction=0.1, batch_size=8)
    loader = build_data(d, "lm", seed=0, vocab_size=300, max_len=32, run_dir=tmp_path / "run")
    train, held = loader.train, loader.eval
    assert isinstance(train, LMExamples) and isinstance(held, LMExamples)
    assert 0.05 < len(held.stream) / (len(train.stream) + len(held.stream)) < 0.2
    unigram = loader.eval_baselines()["unigram_perplexity"]
    assert 1 < unigram < 300  # better than uniform over the vocabulary, worse than certainty
    again = build_data(d, "lm", seed=7, vocab_size=300, max_len=32, run_dir=tmp_path / "run")
    assert np.array_equal(again.eval.stream, held.stream)  # type: ignore[union-attr]  # fixed for any seed
    # pydoc for a translation model is refused with the recipe (tests/recipe/test_load.py).


def test_unigram_perplexity_matches_its_definition() -> None:
    train = LMExamples(np.array([4, 4, 4, 5, 6, 4]), seq_len=4)
    held = LMExamples(np.array([5, 4, 6, 7]), seq_len=4)
    vocab = 8
    counts = np.bincount(train.stream, minlength=vocab)
    p = (counts + 1) / (counts.sum() + vocab)
    expected = math.exp(-np.mean(np.log(p[[4, 6, 7]])))  # the targets: every token after the first
    assert math.isclose(unigram_perplexity(train, held, vocab), expected)
    # Over some windows: theirs alone (window 2 of [5, 4 | 6, 7 | 4, 5] predicts the last token, 5).
    windowed = LMExamples(np.array([5, 4, 6, 7, 4, 5]), seq_len=2)
    assert math.isclose(unigram_perplexity(train, windowed, vocab, np.array([2])), 1 / p[5])
    uniform = LMExamples(np.arange(8), seq_len=4)
    assert math.isclose(unigram_perplexity(uniform, uniform, vocab), vocab, rel_tol=1e-9)
