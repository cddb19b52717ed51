"""Corpus BLEU on detokenised strings."""

from __future__ import annotations

import pytest

from gpipe_cli.data import corpus_bleu
from gpipe_cli.data.bleu import bleu_tokenizer


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


def test_chinese_and_japanese_are_scored_by_their_words_not_as_one_word_a_sentence() -> None:
    # 13a split them at spaces only: a perfect Chinese translation scored 0.
    zh = ["六千八百九十，六百六十三", "我喜欢吃苹果和香蕉"]
    assert bleu_tokenizer(zh) == "zh" and corpus_bleu(zh, zh) == pytest.approx(100.0)
    assert 5.0 < corpus_bleu(["六千八百九十，六百", "我喜欢吃香蕉"], zh) < 100.0
    ja = ["私はりんごが好きです。", "これはペンです"]
    assert bleu_tokenizer(ja) in ("ja-mecab", "char") and corpus_bleu(ja, ja) == pytest.approx(100.0)
    assert 5.0 < corpus_bleu(["私はりんごが好き。", "これはペン"], ja) < 100.0
    assert bleu_tokenizer(["deux cent quarante-deux", "한국어 문장입니다", "hello 世界"]) == "13a"


@pytest.mark.parametrize("references", [["แมวสีแดงนั่งอยู่บนเสื่อ", "ฉันชอบกินกล้วย"],  # Thai
                                        ["ແມວສີແດງນັ່ງຢູ່", "ຂ້ອຍມັກກິນກ້ວຍ"],  # Lao
                                        ["ကြောင်နီသည်ဖျာပေါ်တွင်ထိုင်နေသည်", "ငှက်ပျောသီးစားရတာကြိုက်တယ်"],  # Myanmar
                                        ["ឆ្មាក្រហមអង្គុយលើកន្ទេល", "ខ្ញុំចូលចិត្តញ៉ាំចេក"]])  # Khmer
def test_scripts_written_without_spaces_between_words_are_scored_by_their_characters(references) -> None:
    # 13a made each sentence one word: a perfect Thai translation scored 0, and the best eval was picked by it.
    assert bleu_tokenizer(references) == "char" and corpus_bleu(references, references) == pytest.approx(100.0)
    assert 5.0 < corpus_bleu([references[0][:-3], references[1]], references) < 100.0


def test_the_hypotheses_are_scored_against_the_references_not_the_other_way() -> None:
    # Swapped, the brevity penalty falls on the wrong side: a short output scored 30.2 where it scores 0.
    assert corpus_bleu(["the cat sat on the mat"], ["the cat sat on the mat today"]) == pytest.approx(84.65, abs=0.01)
    assert corpus_bleu(["the cat sat"], ["the cat sat on the mat"]) == 0.0
