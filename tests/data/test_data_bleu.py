"""Corpus BLEU on detokenised strings."""

from __future__ import annotations

import pytest

from gpipe_cli.data import corpus_bleu


def test_identical_corpora_score_100_and_unrelated_ones_near_0() -> None:
    refs = ["the cat sat on the mat .", "a quick brown fox jumps over the lazy dog",
            "deux cent quarante-deux"]
    assert corpus_bleu(refs, refs) == pytest.approx(100.0)
    other = ["completely different words here", "nothing in common at all really", "zzz yyy xxx www"]
    assert corpus_bleu(other, refs) < 5.0
    partial = ["the cat sat on a mat .", "a quick brown fox jumps over the dog", "deux cent quarante"]
    assert 5.0 < corpus_bleu(partial, refs) < 100.0
    assert corpus_bleu([], []) == 0.0
    with pytest.raises(ValueError):
        corpus_bleu(["a"], [])
