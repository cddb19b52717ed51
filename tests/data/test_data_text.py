"""Local text sources: jsonl and tsv parallel text, plain text and parquet for language modelling."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from datagen import data, pairs, write_jsonl

from gpipe_cli.data import PAD, DataError, build_data


def _translation(d, tmp_path: Path, **kw):  # type: ignore[no-untyped-def]
    return build_data(d, "translation", seed=0, vocab_size=kw.pop("vocab_size", 200),
                      max_len=kw.pop("max_len", 64), run_dir=tmp_path / "run",
                      cache_dir=tmp_path / "hf-cache", **kw)


def _decoded_pairs(ds) -> set[tuple[str, str]]:  # type: ignore[no-untyped-def]
    out = set()
    for b in ds.train_batches(epoch=0):
        for s, t in zip(b.inputs[0], b.targets, strict=True):
            out.add((ds.tokenizer.decode(s), ds.tokenizer.decode(t)))
    return out


def test_jsonl_flat_fields(tmp_path: Path) -> None:
    p = pairs(60)
    f = write_jsonl(tmp_path / "train.jsonl", [{"en": s, "de": t} for s, t in p])
    ds = _translation(data(source="jsonl", path=str(f), source_field="en", target_field="de", drop_last=False,
                           eval_fraction=0.1), tmp_path)
    assert ds.train_size == 54 and ds.eval_size == 6
    assert _decoded_pairs(ds) <= set(p) and len(_decoded_pairs(ds)) == 54


def test_jsonl_nested_translation_and_split_files(tmp_path: Path) -> None:
    p = pairs(50)
    write_jsonl(tmp_path / "corpus" / "train.jsonl", [{"translation": {"en": s, "de": t}} for s, t in p[:40]])
    write_jsonl(tmp_path / "corpus" / "valid.jsonl", [{"translation": {"en": s, "de": t}} for s, t in p[40:]])
    d = data(source="jsonl", path=str(tmp_path / "corpus"), source_field="en", target_field="de")
    ds = _translation(d, tmp_path)
    assert ds.train_size == 40 and ds.eval_size == 10
    refs = [r for b in ds.eval_batches() for r in b.references]
    assert refs == [t for _, t in p[40:]]


def test_an_eval_split_named_in_the_recipe_picks_the_files_with_that_name(tmp_path: Path) -> None:
    p = pairs(50)
    corpus = tmp_path / "corpus"
    write_jsonl(corpus / "train.jsonl", [{"en": s, "de": t} for s, t in p[:30]])
    write_jsonl(corpus / "valid.jsonl", [{"en": s, "de": t} for s, t in p[30:40]])  # the default would take it
    write_jsonl(corpus / "heldout.jsonl", [{"en": s, "de": t} for s, t in p[40:]])
    d = data(source="jsonl", path=str(corpus), source_field="en", target_field="de", eval_split="heldout")
    ds = _translation(d, tmp_path)
    assert ds.eval_size == 10 and [r for b in ds.eval_batches() for r in b.references] == [t for _, t in p[40:]]
    assert ds.train_size == 30  # the files named as data.train_split: valid.jsonl is neither split
    with pytest.raises(DataError, match=f"^no file under '{corpus}' has data.eval_split 'test' in its name$"):
        _translation(d.model_copy(update={"eval_split": "test"}), tmp_path)


def test_split_names_are_words_of_the_file_name_and_the_held_out_files_are_named(tmp_path: Path) -> None:
    # 'latest.txt' holds "test": half the data was held out without a word.
    from gpipe_cli.data.sources import held_out_files

    p = pairs(60)
    corpus = tmp_path / "news"
    write_jsonl(corpus / "archive.jsonl", [{"en": s, "de": t} for s, t in p[:30]])
    write_jsonl(corpus / "latest.jsonl", [{"en": s, "de": t} for s, t in p[30:50]])
    d = data(source="jsonl", path=str(corpus), source_field="en", target_field="de")
    assert _translation(d, tmp_path).train_size + _translation(d, tmp_path).eval_size == 50
    assert held_out_files(d) is None  # data.eval_fraction holds out rows of both files
    write_jsonl(corpus / "news.test.jsonl", [{"en": s, "de": t} for s, t in p[50:]])
    ds = _translation(d, tmp_path)
    assert ds.train_size == 50 and ds.eval_size == 10
    assert held_out_files(d) == "from news.test.jsonl"
    assert held_out_files(d.model_copy(update={"path": str(corpus / "latest.jsonl")})) is None


def test_a_second_held_out_file_and_hidden_files_are_not_trained_on(tmp_path: Path) -> None:
    # Beside valid.txt, test.txt was trained on without a word; Jupyter's .ipynb_checkpoints/ copies doubled the
    # data, and a macOS ._a.txt stopped the run as not UTF-8.
    from gpipe_cli.data.sources import held_out_files

    corpus = tmp_path / "corpus"
    (corpus / ".ipynb_checkpoints").mkdir(parents=True)
    words = [f"line {i} of the corpus says {'hello ' * (i % 5)}world ." for i in range(300)]
    for name, lines in (("a.txt", words[:200]), ("valid.txt", words[200:250]), ("test.txt", words[250:]),
                        (".ipynb_checkpoints/a-checkpoint.txt", words[:200])):
        (corpus / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    (corpus / "._a.txt").write_bytes(b"\x00\x05\x16\x07\xff")
    d = data(source="text", path=str(corpus), seq_len=16)
    ds = build_data(d, "lm", seed=0, vocab_size=100, max_len=32, run_dir=None)
    only_a = build_data(d.model_copy(update={"path": str(corpus / "a.txt"), "eval_fraction": 0.0}), "lm", seed=0,
                        vocab_size=100, max_len=32, run_dir=None)
    assert ds.train_size == only_a.train_size
    assert ds.eval is not None and not ds.eval.by_content  # given as a file: the same whatever the version
    assert held_out_files(d) == ("from valid.txt; test.txt not read: another held-out split, which data.eval_split "
                                 "may pick")
    assert held_out_files(d.model_copy(update={"eval_split": "test"})).startswith("from test.txt; valid.txt not read")
    (corpus / "train.txt").write_text("\n".join(words[:10]) + "\n", encoding="utf-8")  # named: a.txt is not
    assert held_out_files(d).endswith("; a.txt not read: not named data.train_split 'train'")
    (corpus / "train.txt").unlink()
    hidden = tmp_path / "hidden"
    (hidden / ".data").mkdir(parents=True)
    (hidden / ".data" / "a.txt").write_text("one\n")
    with pytest.raises(DataError, match=r"^no \.txt/\.text/\.raw files under '.*hidden' \(hidden files and __MACOSX/ "
                                        r"are passed over\)$"):
        build_data(d.model_copy(update={"path": str(hidden)}), "lm", seed=0, vocab_size=100, max_len=32)


def test_a_split_that_picks_nothing_is_refused_not_ignored(tmp_path: Path) -> None:
    p = pairs(20)
    corpus = tmp_path / "corpus"
    write_jsonl(corpus / "train.jsonl", [{"en": s, "de": t} for s, t in p[:15]])
    write_jsonl(corpus / "test.jsonl", [{"en": s, "de": t} for s, t in p[15:]])
    d = data(source="jsonl", path=str(corpus), source_field="en", target_field="de")
    with pytest.raises(DataError, match=f"^no file under '{corpus}' has data.train_split 'nope' in its name$"):
        _translation(d.model_copy(update={"train_split": "nope"}), tmp_path)
    with pytest.raises(DataError, match=r"data.train_split 'test' in its name \(besides the held-out ones\)$"):
        _translation(d.model_copy(update={"train_split": "test", "eval_split": "test"}), tmp_path)
    one = corpus / "train.jsonl"  # a single file has no splits to pick: each key is refused, the default read
    assert _translation(d.model_copy(update={"path": str(one)}), tmp_path).train_size > 0
    for key, value in [("eval_split", "test"), ("train_split", "nope")]:
        with pytest.raises(DataError, match=f"^data.{key} picks files of a folder by name, and data.path '{one}' "
                                            f"is one file: leave data.{key} out or --set data.{key}="):
            _translation(d.model_copy(update={"path": str(one), key: value}), tmp_path)


def test_a_folder_whose_every_file_is_held_out_has_no_training_data(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    write_jsonl(corpus / "dev.jsonl", [{"en": s, "de": t} for s, t in pairs(10)])
    d = data(source="jsonl", path=str(corpus), source_field="en", target_field="de", eval_split="dev")
    with pytest.raises(DataError, match=r"^no training files under '.*corpus' \(every file looks like an eval split"):
        _translation(d, tmp_path)


def test_jsonl_wrong_language_names_the_choice(tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "t.jsonl", [{"translation": {"en": "one", "fr": "un"}}])
    with pytest.raises(DataError, match="languages en, fr"):
        _translation(data(source="jsonl", path=str(f), source_field="en", target_field="de"), tmp_path)


# utf-8-sig: a file saved with a byte order mark, as Windows editors do; its header became a training pair, and
# so did a header after a blank first line.
@pytest.mark.parametrize("header,encoding,blank", [(False, "utf-8", False), (True, "utf-8", False),
                                                   (True, "utf-8-sig", False), (True, "utf-8", True)])
def test_tsv(tmp_path: Path, header: bool, encoding: str, blank: bool) -> None:
    p = pairs(40)
    lines = ([""] if blank else []) + (["target\tsource"] if header else []) + [
        (f"{t}\t{s}" if header else f"{s}\t{t}") for s, t in p]
    f = tmp_path / "train.tsv"
    f.write_text("\n".join(lines) + "\n", encoding=encoding)
    ds = _translation(data(source="tsv", path=str(f), eval_fraction=0.0, drop_last=False), tmp_path)
    assert ds.train_size == 40 and ds.eval_size == 0 and list(ds.eval_batches()) == []
    assert _decoded_pairs(ds) == set(p)


def test_long_pairs_are_dropped_from_training(tmp_path: Path) -> None:
    p = pairs(30) + [("one " * 80, "eins " * 80)]
    f = tmp_path / "train.tsv"
    f.write_text("".join(f"{s}\t{t}\n" for s, t in p), encoding="utf-8")
    ds = _translation(data(source="tsv", path=str(f), eval_fraction=0.0), tmp_path, max_len=16)
    assert ds.train_size == 30
    assert all(b.targets.shape[1] <= 16 for b in ds.train_batches())
    # ... and the run's data line says so: they used to go without a word.
    assert ds.train.left_out == "1 of 31 training pairs are longer than model.max_len (16 tokens): left out"


def test_pairs_with_an_empty_side_are_counted_where_they_are_left_out(tmp_path: Path) -> None:
    p = pairs(30)
    f = tmp_path / "train.tsv"
    f.write_text("".join(f"{s}\t{t}\n" for s, t in p) + "\tun\ntwo\t \n", encoding="utf-8")
    ds = _translation(data(source="tsv", path=str(f), eval_fraction=0.0), tmp_path)
    assert ds.train_size == 30
    assert ds.train.left_out.startswith("2 of 32 training pairs have an empty side: left out")


def test_plain_text_lm(tmp_path: Path) -> None:
    lines = [f"line {i} says {' '.join(['hello'] * (i % 7))} world ." for i in range(200)]
    f = tmp_path / "corpus.txt"
    f.write_text("\n".join(lines) + "\n\n", encoding="utf-8")
    ds = build_data(data(source="text", path=str(f), seq_len=16, drop_last=False), "lm", seed=0,
                    vocab_size=100, max_len=32, run_dir=None)
    assert ds.eval.by_content  # its checkpoints say so: older versions held other lines out
    batches = list(ds.train_batches())
    total = sum(b.tokens for b in batches) + sum(b.tokens for b in ds.eval_batches())
    stream = len(ds.train.stream) + len(ds.eval.stream)
    assert total == stream - 2  # every token but the first of each split is a target once
    assert all(b.inputs.shape[1] <= 16 for b in batches)
    # The one short window is padded with 0 in inputs and targets alike; elsewhere targets are shifted inputs.
    for b in batches:
        assert torch.equal(b.inputs != PAD, b.targets != PAD)
        full = (b.inputs != PAD).all(1)
        assert torch.equal(b.inputs[full, 1:], b.targets[full, :-1])
    assert any(not (b.inputs != PAD).all() for b in batches)


def test_a_one_line_text_says_that_no_fraction_can_hold_a_line_out(tmp_path: Path) -> None:
    # The run advised raising data.eval_fraction, which holds out whole lines: of one line, never any.
    f = tmp_path / "one.txt"
    f.write_text(" ".join(f"word{i % 13}" for i in range(400)) + "\n", encoding="utf-8")
    ds = build_data(data(source="text", path=str(f), seq_len=16, eval_fraction=0.5), "lm", seed=0, vocab_size=60,
                    max_len=32, run_dir=None)
    assert ds.eval_steps() == 0
    assert ds.train.held_none == (f"data.eval_fraction (0.5) holds out whole lines, and '{f}' has 1 line, which "
                                  "training keeps; give it more lines")
    f.write_text(f.read_text() + f.read_text().replace("word1 ", "word2 "), encoding="utf-8")  # two: one held out
    for fraction in (0.5, 0.0):
        ds = build_data(data(source="text", path=str(f), seq_len=16, eval_fraction=fraction), "lm", seed=0,
                        vocab_size=60, max_len=32, run_dir=None)
        assert ds.train.held_none is None and (ds.eval_steps() > 0) == (fraction > 0)


def test_jsonl_and_tsv_lm(tmp_path: Path) -> None:
    docs = [f"document {i} has some words in it ." for i in range(80)]
    f = write_jsonl(tmp_path / "d.jsonl", [{"body": d} for d in docs])
    ds = build_data(data(source="jsonl", path=str(f), text_field="body", seq_len=8), "lm", seed=0,
                    vocab_size=100, max_len=8)
    assert ds.steps_per_epoch() > 0 and next(ds.train_batches()).inputs.shape == (8, 8)
    t = tmp_path / "d.tsv"
    t.write_text("id\tbody\n" + "".join(f"{i}\t{d}\n" for i, d in enumerate(docs)), encoding="utf-8")
    ds2 = build_data(data(source="tsv", path=str(t), text_field="body", seq_len=8), "lm", seed=0,
                     vocab_size=100, max_len=8)
    assert ds2.tokenizer.decode(ds2.train.stream[:12].tolist()).startswith("document 0 has")  # type: ignore[union-attr]


def test_parquet_text(tmp_path: Path) -> None:
    p = pairs(40)
    f = tmp_path / "train.parquet"
    pq.write_table(pa.table({"source": [s for s, _ in p], "target": [t for _, t in p]}), f)
    ds = _translation(data(source="parquet", path=str(f), eval_fraction=0.25), tmp_path)
    assert (ds.train_size, ds.eval_size) == (30, 10)
    nested = tmp_path / "nested.parquet"
    pq.write_table(pa.table({"translation": [{"de": t, "en": s} for s, t in p]}), nested)
    d2 = data(source="parquet", path=str(nested), source_field="en", target_field="de")
    ds2 = _translation(d2, tmp_path)
    assert ds2.train_size + ds2.eval_size == 40
    lm = tmp_path / "lm.parquet"
    pq.write_table(pa.table({"text": [s for s, _ in p]}), lm)
    ds3 = build_data(data(source="parquet", path=str(lm), seq_len=8), "lm", seed=0, vocab_size=100, max_len=8,
                     cache_dir=tmp_path / "hf-cache")
    assert ds3.train_size > 0


def test_a_target_fits_with_its_bos_or_eos_and_a_held_out_one_is_cut_to_leave_room_for_it() -> None:
    # A target of max_len tokens trained as its first max_len - 1 and eos (it learned to stop a word early), and
    # a held-out one cut to max_len made tgt_in one longer than the model's positions.
    from types import SimpleNamespace

    from gpipe_cli.data.text import TranslationExamples

    words = SimpleNamespace(encode_batch=lambda texts: [[5] * len(t.split()) for t in texts])
    pairs = [("a b", "w x y"), ("a b", "w x y z")]
    train = TranslationExamples.build(pairs, words, 4, train=True)  # type: ignore[arg-type]
    assert len(train) == 1 and train.left_out is not None and train.left_out.startswith("1 of 2 training pairs")
    held = TranslationExamples.build([("a", "u v w x y z")], words, 4, train=False)  # type: ignore[arg-type]
    assert max(held.tgt.lengths) + 1 <= 4


def test_a_line_added_to_a_text_moves_at_most_one_other_between_training_and_held_out(tmp_path: Path) -> None:
    # Held out by a permutation of the line count: one line appended before a resume dealt the split anew (92 of
    # 100 held-out lines went to training), and the copies of a line could fall on both sides.
    from gpipe_cli.data.sources import hold_out

    lines = [f"sentence {i} of the text" for i in range(300)] + ["a repeated line"] * 4
    keys = list(lines)
    _, held = hold_out(len(keys), 0.1, keys)
    _, held_more = hold_out(len(keys) + 1, 0.1, [*keys, "a line added since"])
    before, after = {keys[i] for i in held}, {[*keys, "a line added since"][i] for i in held_more}
    assert len(before - after) <= 1 and len(before) == 30
    assert len({i for i in held if lines[i] == "a repeated line"}) in (0, 4)
    # A cut at a fixed count split a group of copies: a line both trained on and held out.
    for keys, fraction in ((["a"] * 50 + ["b"] * 50, 0.3), ([f"l{i % 7}" for i in range(100)], 0.1)):
        train, held_out = hold_out(len(keys), fraction, keys)
        assert not {keys[i] for i in train} & {keys[i] for i in held_out} and len(held_out) > 0
    assert len(hold_out(10, 0.1, ["same"] * 10)[1]) == 0  # one line alone: none can be held out without it
    f = tmp_path / "same.txt"
    f.write_text("the same line again\n" * 20, encoding="utf-8")
    ds = build_data(data(source="text", path=str(f), seq_len=4, eval_fraction=0.1), "lm", seed=0, vocab_size=30,
                    max_len=32, run_dir=None)
    assert ds.eval_steps() == 0 and ds.train.held_none == (
        f"data.eval_fraction (0.1) holds out whole lines with their copies, and every line of '{f}' is the same, "
        "which training keeps; give it other lines")
    f = tmp_path / "corpus.txt"
    f.write_text("\n".join(lines) + "\n", encoding="utf-8")
    ds = build_data(data(source="text", path=str(f), seq_len=16, eval_fraction=0.1), "lm", seed=0, vocab_size=100,
                    max_len=32, run_dir=None)
    from gpipe_cli.data.tokenizer import EOS

    stream = ds.eval.stream.tolist()  # type: ignore[union-attr]
    docs, start = [], 0
    for i, token in enumerate(stream):
        if token == EOS:
            docs.append(ds.tokenizer.decode(stream[start:i]))  # type: ignore[union-attr]
            start = i + 1
    assert sorted(docs) == sorted(lines[i] for i in held)  # training holds out the very lines hold_out keys
    assert ds.eval.origin is None  # type: ignore[union-attr]  # the share asked for, or near it: nothing to say


def test_a_share_held_out_far_from_the_fraction_asked_is_said_on_the_data_line(tmp_path: Path) -> None:
    # 600 copies of two lines and 20 others, at 0.1: 2 lines held out without a word where 62 were asked.
    f = tmp_path / "repeated.txt"
    f.write_text("alpha beta gamma\n" * 300 + "one two three\n" * 300 + "".join(f"line {i} here\n" for i in range(20)),
                 encoding="utf-8")
    ds = build_data(data(source="text", path=str(f), seq_len=4, eval_fraction=0.1), "lm", seed=0, vocab_size=40,
                    max_len=32, run_dir=None)
    assert ds.eval is not None and ds.eval.origin is not None
    held = int(ds.eval.origin.split(" of the ")[0])
    assert held not in range(31, 125) and ds.eval.origin == (
        f"{held} of the 620 lines, where data.eval_fraction 0.1 asks 62: the copies of a line stay on one side")


def test_a_file_named_val_is_held_out_as_image_folders_hold_it(tmp_path: Path) -> None:
    # val.tsv beside data.tsv was trained on (only validation, valid, dev, test and eval were held-out names).
    from gpipe_cli.data.sources import held_out_files, split_files

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ("data.tsv", "val.tsv"):
        (corpus / name).write_text("one\tun\n", encoding="utf-8")
    d = data(source="tsv", path=str(corpus))
    assert split_files(corpus, (".tsv",), d) == ([corpus / "data.tsv"], [corpus / "val.tsv"])
    assert held_out_files(d) == "from val.tsv"


def test_a_file_named_both_train_and_test_is_not_trained_on(tmp_path: Path) -> None:
    # train.test.txt beside train.txt was trained on, as a file named train.
    from gpipe_cli.data.sources import held_out_files, split_files

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ("train.txt", "train.test.txt", "valid.txt"):
        (corpus / name).write_text("one two\n", encoding="utf-8")
    d = data(source="text", path=str(corpus))
    assert split_files(corpus, (".txt",), d) == ([corpus / "train.txt"], [corpus / "valid.txt"])
    assert held_out_files(d) == ("from valid.txt; train.test.txt not read: another held-out split, which "
                                 "data.eval_split may pick")
    (corpus / "train.test.txt").unlink()  # every training file so named: the words are a folder's, not a split's
    (corpus / "test_run").mkdir()
    (corpus / "train.txt").rename(corpus / "test_run" / "train.txt")
    d = data(source="text", path=str(corpus), eval_split="valid")
    assert split_files(corpus, (".txt",), d) == ([corpus / "test_run" / "train.txt"], [corpus / "valid.txt"])
    (corpus / "test_run" / "train.txt").rename(corpus / "train.test.txt")  # a test set alone is never trained on
    with pytest.raises(DataError, match="no training files under"):
        split_files(corpus, (".txt",), data(source="text", path=str(corpus)))
