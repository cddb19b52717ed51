"""Corpus BLEU on detokenised strings, as reported for translation (sacrebleu; its tokenisation by the script)."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

# Scripts written without spaces between words: 13a would make each sentence one word, and BLEU 0 even for a
# perfect translation. Kana mark Japanese (MeCab's words where it is installed, else characters); Han alone,
# Chinese (sacrebleu's zh, one word per character), as sacrebleu's own defaults for those languages do.
_KANA = ((0x3040, 0x30FF), (0x31F0, 0x31FF), (0xFF66, 0xFF9F))
_HAN = ((0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xF900, 0xFAFF), (0x20000, 0x2FA1F))
# Thai, Lao, Myanmar and Khmer are written without spaces between words too, and sacrebleu has no word
# tokeniser for them: characters.
_UNSPACED = ((0x0E00, 0x0E7F), (0x0E80, 0x0EFF), (0x1000, 0x109F), (0x1780, 0x17FF))
_SHARE = 0.1  # of the references' letters, in a sample of them


def bleu_tokenizer(references: Sequence[str]) -> str:
    """The sacrebleu tokenisation for references in this script: 13a, or zh, ja-mecab or char for text written
    without spaces between words."""
    letters = [c for text in references[:2000] for c in text if c.isalpha()]

    def share(ranges: tuple[tuple[int, int], ...]) -> float:
        return sum(any(lo <= ord(c) <= hi for lo, hi in ranges) for c in letters) / max(len(letters), 1)

    if share(_KANA) >= _SHARE:
        return "ja-mecab" if importlib.util.find_spec("MeCab") is not None else "char"
    if share(_UNSPACED) >= _SHARE:
        return "char"
    return "zh" if share(_HAN) >= _SHARE else "13a"


def corpus_bleu(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    """BLEU (0-100) of `hypotheses` against one reference each."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    if not hypotheses:
        return 0.0
    import sacrebleu  # imported lazily: only evaluation of translation needs it

    return float(sacrebleu.corpus_bleu(list(hypotheses), [list(references)],
                                       tokenize=bleu_tokenizer(references)).score)
