"""The sentencepiece tokenizer: trained on first use, stored in run_dir, reused afterwards."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
from datagen import data, pairs, write_jsonl

from gpipe_cli.data import BOS, EOS, PAD, UNK, DataError, Tokenizer, build_data
from gpipe_cli.data import tokenizer as tokenizer_mod
from gpipe_cli.data.tokenizer import train_tokenizer
from gpipe_cli.runs import TOKENIZER_FILE


def _corpus(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "train.jsonl", [{"source": s, "target": t} for s, t in pairs(200)])


def test_trained_once_stored_and_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    d = data(source="jsonl", path=str(_corpus(tmp_path)))
    first = build_data(d, "translation", seed=0, vocab_size=32000, max_len=64, run_dir=run)
    stored = run / TOKENIZER_FILE
    assert stored.is_file() and first.tokenizer is not None and first.tokenizer.path == stored
    # A small corpus gets a small vocabulary (not the requested 32k), and the real size is reported.
    assert 20 < first.tokenizer.vocab_size < 200
    before = stored.stat().st_mtime_ns

    def no_training(*a: object, **k: object) -> Tokenizer:
        raise AssertionError("retrained")

    monkeypatch.setattr(tokenizer_mod, "train_tokenizer", no_training)
    second = build_data(d, "translation", seed=1, vocab_size=32000, max_len=64, run_dir=run)
    assert second.tokenizer is not None and second.tokenizer.vocab_size == first.tokenizer.vocab_size
    assert stored.stat().st_mtime_ns == before
    b1, b2 = next(first.eval_batches()), next(second.eval_batches())
    assert b1.targets.tolist() == b2.targets.tolist()


def test_explicit_tokenizer_path(tmp_path: Path) -> None:
    tok = train_tokenizer([s for p in pairs(100) for s in p], 64)
    path = tok.save(tmp_path / "my.model")
    d = data(source="jsonl", path=str(_corpus(tmp_path)), tokenizer=str(path))
    ds = build_data(d, "translation", seed=0, vocab_size=64, max_len=64, run_dir=tmp_path / "run")
    assert ds.tokenizer is not None and ds.tokenizer.path == path and ds.tokenizer.vocab_size == 64
    # The run keeps a copy of the one it started with, which a resume checks the file against.
    assert (tmp_path / "run" / TOKENIZER_FILE).read_bytes() == path.read_bytes()
    with pytest.raises(DataError, match="model.vocab_size"):
        build_data(d, "translation", seed=0, vocab_size=32, max_len=64)
    with pytest.raises(DataError, match="does not exist"):
        build_data(data(source="jsonl", path=str(_corpus(tmp_path)), tokenizer=str(tmp_path / "nope.model")),
                   "translation", seed=0)
    junk = tmp_path / "junk.model"
    junk.write_bytes(b"not a model")
    with pytest.raises(DataError, match="not a sentencepiece model") as refused:
        Tokenizer.load(junk)
    assert "its bytes do not parse" in str(refused.value) and ".cc(" not in str(refused.value)  # not its C++ line
    junk.write_bytes(b"")  # an empty file was taken, then refused for special ids (-1, -1, -1, -1)
    with pytest.raises(DataError, match=r"junk\.model' is empty \(0 bytes\), not a sentencepiece model"):
        Tokenizer.load(junk)


def test_special_ids_encode_decode_and_pickle() -> None:
    tok = train_tokenizer(["hello world", "hello there", "world peace"] * 20, 40)
    assert (PAD, UNK, BOS, EOS) == (0, 1, 2, 3)
    ids = tok.encode("hello world")
    assert ids and min(ids) > EOS
    assert tok.decode([BOS, *ids, EOS, PAD, *ids]) == "hello world"  # stops at eos, skips bos
    assert "".join(tok.pieces("hello")).replace("\u2581", "") == "hello"
    assert pickle.loads(pickle.dumps(tok)).encode("hello world") == ids


def test_vocab_larger_than_model_is_an_error(tmp_path: Path) -> None:
    d = data(source="jsonl", path=str(_corpus(tmp_path)), vocab_size=100)
    with pytest.raises(DataError, match="exceeds model.vocab_size"):
        build_data(d, "translation", seed=0, vocab_size=64)


def test_a_tokenizer_that_cannot_be_saved_is_one_line_saying_the_space_left(tmp_path: Path, monkeypatch) -> None:
    # A full disk while the run saved its tokenizer was a rank's traceback.
    import errno
    import os

    from gpipe_cli.errors import UserError

    def full(path, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(tokenizer_mod, "atomic_write_bytes", full)
    tok = train_tokenizer(["one two three four five six seven"] * 50, 30)
    with pytest.raises(UserError) as caught:
        tok.save(tmp_path / TOKENIZER_FILE)
    assert str(caught.value).startswith(f"cannot write '{tmp_path / TOKENIZER_FILE}' (No space left on device); ")
    assert str(caught.value).endswith(f" free on {tmp_path}")


def test_a_tokenizer_file_that_cannot_be_read_is_said_so(tmp_path: Path, monkeypatch) -> None:
    # It was called "not a sentencepiece model".
    path = tmp_path / TOKENIZER_FILE
    path.write_bytes(b"x")

    def refused(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_bytes", refused)
    with pytest.raises(DataError, match=r"^cannot read tokenizer file '.*' \(Permission denied\)$"):
        Tokenizer.load(path)


def test_a_vocabulary_below_the_texts_characters_names_its_key_and_the_least_that_works() -> None:
    # sentencepiece's own line ("8 vs 31 ... decrease character_coverage with --character_coverage option") named
    # an option gpipe does not have. Its count: 'a', 'b', 'c' and the space, plus pad, unk, bos and eos.
    text = ["abc cab bca"] * 20
    with pytest.raises(DataError) as caught:
        train_tokenizer(text, 7)
    assert str(caught.value) == ("model.vocab_size (7) is smaller than the 4 distinct characters of the training text "
                                 "plus the tokenizer's 4 special pieces (pad, unk, bos, eos): give at least 8")
    assert train_tokenizer(text, 8).vocab_size == 8  # the least that works, as said


def test_a_text_whose_every_line_is_over_64_kib_says_so_and_to_split_it() -> None:
    # sentencepiece's own line: "INTERNAL: src/trainer_interface.cc(467) [!sentences_.empty()]".
    words = " ".join(["pipeline stage"] * 5000)  # 74,999 one-byte characters
    wide = "é" * 40_000  # 40,000 characters, 80,000 UTF-8 bytes: over the limit, which counts bytes
    for text in ([words], [words, wide]):
        with pytest.raises(DataError) as caught:
            train_tokenizer(text, 30)
        assert str(caught.value) == ("every line of the training text is longer than 64 KiB, and the tokenizer "
                                     "leaves lines over 64 KiB out of its training: split the text into shorter "
                                     "lines, e.g. one paragraph a line")
    assert train_tokenizer([words, "pipeline stage " * 20], 30).vocab_size > 4  # a short line is enough


def test_lines_the_tokenizer_passes_over_are_said_on_the_runs_data_line(tmp_path: Path) -> None:
    # sentencepiece leaves a line over 64 KiB out of its training without a word; the model still trains on it.
    text = tmp_path / "t.txt"
    text.write_text("\n".join(["pipeline stage " * 20] * 30 + [" ".join(["pipeline stage"] * 5000)]) + "\n")
    said = "1 of 31 lines of the training text are over 64 KiB: the tokenizer's training left them out"
    ds = build_data(data(source="text", path=str(text), seq_len=16, eval_fraction=0.0), "lm", seed=0, vocab_size=40)
    assert ds.train.left_out == said
    given = build_data(data(source="text", path=str(text), seq_len=16, eval_fraction=0.0, tokenizer=str(
        _stored(ds.tokenizer, tmp_path))), "lm", seed=0, vocab_size=40)
    assert given.train.left_out is None  # a tokenizer of the user's: not trained on this text


def _stored(tok: Tokenizer, folder: Path) -> Path:
    tok.save(folder / "tok.model")
    return folder / "tok.model"


def test_a_too_small_data_vocab_size_is_named_and_model_vocab_size_too_when_it_must_grow(tmp_path: Path) -> None:
    # 'a' to 'j' and the space: 11 characters, 15 pieces with the special ones.
    corpus = write_jsonl(tmp_path / "train.jsonl", [{"source": "abcd efg", "target": "hij"}] * 20)
    small = data(source="jsonl", path=str(corpus), vocab_size=8)
    chars = ("the 11 distinct characters of the training text plus the tokenizer's 4 special pieces "
             "(pad, unk, bos, eos)")
    with pytest.raises(DataError) as caught:
        build_data(small, "translation", seed=0, vocab_size=64, max_len=16)
    assert str(caught.value) == f"data.vocab_size (8) is smaller than {chars}: give at least 15"
    with pytest.raises(DataError) as caught:  # data.vocab_size may not exceed model.vocab_size: both must grow
        build_data(small, "translation", seed=0, vocab_size=12, max_len=16)
    assert str(caught.value) == f"data.vocab_size (8) is smaller than {chars}: give it and model.vocab_size at least 15"
    with pytest.raises(DataError) as caught:  # data.vocab_size unset: the model's is the tokenizer's
        build_data(data(source="jsonl", path=str(corpus)), "translation", seed=0, vocab_size=8, max_len=16)
    assert str(caught.value) == f"model.vocab_size (8) is smaller than {chars}: give at least 15"
