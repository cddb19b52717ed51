"""Corpus BLEU on detokenised strings, as reported for translation (sacrebleu, 13a tokenisation)."""

from __future__ import annotations

from collections.abc import Sequence


def corpus_bleu(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    """BLEU (0-100) of `hypotheses` against one reference each."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    if not hypotheses:
        return 0.0
    import sacrebleu  # imported lazily: only evaluation of translation needs it

    return float(sacrebleu.corpus_bleu(list(hypotheses), [list(references)]).score)
