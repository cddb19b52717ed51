"""User mistakes in data give one clear DataError line, never a traceback."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from datagen import data, write_jsonl

from gpipe_cli.data import DataError, build_data


def _fails(d, task: str, match: str, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(DataError, match=match) as err:
        build_data(d, task, seed=0, image_size=32, num_classes=4, vocab_size=200, max_len=32,  # type: ignore[arg-type]
                   cache_dir=tmp_path / "cache")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("source,task", [("imagefolder", "image"), ("parquet", "image"),
                                         ("jsonl", "translation"), ("tsv", "translation"), ("text", "lm"),
                                         ("parquet", "lm")])
def test_missing_path(source: str, task: str, tmp_path: Path) -> None:
    _fails(data(source=source, path=str(tmp_path / "nowhere")), task, "does not exist", tmp_path)


def test_empty_folders(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    (empty / "train" / "cat").mkdir(parents=True)
    _fails(data(source="imagefolder", path=str(empty)), "image", "no images", tmp_path)
    _fails(data(source="jsonl", path=str(empty)), "translation", "no .jsonl", tmp_path)
    (tmp_path / "e.txt").write_text("\n\n", encoding="utf-8")
    _fails(data(source="text", path=str(tmp_path / "e.txt")), "lm", r"e\.txt'\) has no text", tmp_path)


def test_single_class_folder_has_no_labels(imagefolder: Callable[..., Path], tmp_path: Path) -> None:
    root = imagefolder(classes=1, test=False)
    _fails(data(source="imagefolder", path=str(root)), "image", r"are all in one folder \('\w+'\); imagefolder "
                                                                 r"takes each folder as a class", tmp_path)


def test_malformed_files(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"source": "a", "target": "b"}\n{"source": "a", \n', encoding="utf-8")
    _fails(data(source="jsonl", path=str(bad)), "translation", r"bad.jsonl:2: not valid JSON", tmp_path)
    arr = write_jsonl(tmp_path / "arr.jsonl", [[1, 2]])  # type: ignore[list-item]
    _fails(data(source="jsonl", path=str(arr)), "translation", "expected a JSON object", tmp_path)
    fields = write_jsonl(tmp_path / "f.jsonl", [{"src": "a", "tgt": "b"}])
    _fails(data(source="jsonl", path=str(fields)), "translation", "no fields 'source' and 'target'", tmp_path)
    tsv = tmp_path / "one.tsv"
    tsv.write_text("a\tb\nonly one column\n", encoding="utf-8")
    _fails(data(source="tsv", path=str(tsv)), "translation", "one.tsv:2: expected two tab-separated",
           tmp_path)
    # Without a header, a tab inside a sentence would silently cut it short.
    tsv.write_text("a\tb\nc\td\te\n", encoding="utf-8")
    _fails(data(source="tsv", path=str(tsv)), "translation", r"one.tsv:2: expected two tab-separated columns "
           r"\(source, target\), got 3; a first line naming data.source_field \('source'\)", tmp_path)
    _fails(data(source="tsv", path=str(tsv)), "lm", r"one.tsv:1: expected one column \(the text\), got 2 "
           r"tab-separated; a first line naming data.text_field \('text'\) picks a column", tmp_path)
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\xff\xfe\x00\x81" * 10)
    _fails(data(source="text", path=str(binary)), "lm", "not UTF-8", tmp_path)
    # Named by its line and byte, as predict names its inputs' (it said only "is not UTF-8 text").
    latin = tmp_path / "latin.txt"
    latin.write_bytes("one line\ntwo lines\ncaf\u00e9\n".encode("latin-1"))
    _fails(data(source="text", path=str(latin)), "lm", r"latin.txt':3: not UTF-8 text \(byte 0xe9\)", tmp_path)
    wide = tmp_path / "wide.txt"  # as Windows editors save "Unicode"
    wide.write_text("one two three\n" * 30, encoding="utf-16")
    _fails(data(source="text", path=str(wide)), "lm", r"wide.txt' is not UTF-8 text \(it starts with a UTF-16 byte "
           r"order mark: save it as UTF-8\); data files are UTF-8$", tmp_path)
    # A field present is not said missing: "no fields 'source' and 'target' (fields: source)".
    half = write_jsonl(tmp_path / "half.jsonl", [{"source": "a"}])
    _fails(data(source="jsonl", path=str(half)), "translation", r"no field 'target' \(fields: source\)", tmp_path)
    # A .json file of one array is told what jsonl reads.
    array = tmp_path / "array.json"
    array.write_text('[{"source": "a", "target": "b"}]\n', encoding="utf-8")
    _fails(data(source="jsonl", path=str(array)), "translation", "got list; data.source jsonl reads one object per "
           "line", tmp_path)
    pq = tmp_path / "bad.parquet"
    pq.write_bytes(b"PAR1 this is not parquet")
    _fails(data(source="parquet", path=str(pq)), "image", r"^'.*bad.parquet' is not a parquet file \(", tmp_path)


def test_a_parquet_file_without_rows_is_named(tmp_path: Path) -> None:
    # The loader said "An error occurred while generating the dataset", naming neither the file nor the cause.
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "pq"
    folder.mkdir()
    pq.write_table(pa.table({"text": ["a b c"] * 20}), folder / "train-0.parquet")
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), folder / "train-1.parquet")
    _fails(data(source="parquet", path=str(folder)), "lm", r"^'.*train-1.parquet' holds no rows; remove it", tmp_path)


@pytest.mark.parametrize("values,kind", [(list(range(1, 40)), "int"), ([[1, 2]] * 39, "list")])
def test_a_parquet_column_of_other_values_than_text_is_one_line(tmp_path: Path, values: list, kind: str) -> None:
    # It was a traceback from a rank ('int' object has no attribute 'strip'), exit code 1.
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": values}), tmp_path / "ints.parquet")
    _fails(data(source="parquet", path=str(tmp_path / "ints.parquet")), "lm",
           rf"^.*: row 1: column 'text' holds {kind} values, not text$", tmp_path)
    pq.write_table(pa.table({"source": ["un"] * 39, "target": [1.5] * 39}), tmp_path / "pairs.parquet")
    _fails(data(source="parquet", path=str(tmp_path / "pairs.parquet")), "translation",
           r"^.*: row 1: column 'target' holds float values, not text$", tmp_path)


def test_a_json_escape_of_half_a_surrogate_pair_is_one_line_naming_its_line(tmp_path: Path) -> None:
    # json.loads takes it; sentencepiece then failed with a traceback, or a C++ cast error naming no file.
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"source": "un", "target": "one"}\n' * 30 + '{"source": "bad \\ud83d here", "target": "x"}\n')
    _fails(data(source="jsonl", path=str(path)), "translation",
           r"pairs.jsonl:31: invalid Unicode \(a lone surrogate \\ud83d\); data is UTF-8 text$", tmp_path)


def test_corrupt_image_is_reported_when_decoded(imagefolder: Callable[..., Path], tmp_path: Path) -> None:
    root = imagefolder(classes=2, test=False)
    (root / "train" / "class0" / "0.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    with pytest.raises(DataError, match="cannot decode image") as err:
        ds = build_data(data(source="imagefolder", path=str(root), eval_fraction=0.0), "image", seed=0,
                        image_size=32, num_classes=2, cache_dir=tmp_path / "cache")
        list(ds.train_batches())
    assert "\n" not in str(err.value) and " object at 0x" not in str(err.value), err.value
    # An image folder has files, not columns: it said "of column 'image'", parquet's words.
    assert "of the image folder: " in str(err.value) and "column" not in str(err.value)


def test_data_unreadable_past_the_first_step_says_where_the_run_stopped_and_how_it_goes_on(tmp_path: Path) -> None:
    # The run stopped at step 3 with the decoder's line alone: no word of the checkpoints it kept, or of --resume.
    from types import SimpleNamespace

    from gpipe_cli.train.loop import Trainer

    def batches():
        yield None
        yield None
        raise DataError("cannot decode image 40 of the image folder: cannot identify image file 'x.png'")

    (tmp_path / "checkpoints" / "step-00000002").mkdir(parents=True)
    trainer = SimpleNamespace(start_step=0, run_dir=tmp_path)
    with pytest.raises(DataError) as err:
        list(Trainer._read(trainer, batches()))  # type: ignore[arg-type]
    assert str(err.value) == ("cannot decode image 40 of the image folder: cannot identify image file 'x.png'; the "
                              "run stopped at step 3, whose batch holds it: replace or remove the file, then continue "
                              f"with gpipe train --resume {tmp_path}")
    def first():
        raise DataError("cannot decode image 0 of the image folder: cannot identify image file 'x.png'")
        yield

    with pytest.raises(DataError, match=r"'x.png'$"):  # at the first step: the data line is all there is to say
        list(Trainer._read(trainer, first()))  # type: ignore[arg-type]


def test_data_unreadable_before_any_checkpoint_points_at_no_run_to_resume(tmp_path: Path) -> None:
    # The run's directory goes as a run with nothing kept ends: `--resume --output-dir` of it trained the quick start.
    from types import SimpleNamespace

    from gpipe_cli.train.loop import Trainer

    def batches():
        yield None
        raise DataError("cannot decode image 'train/a/1.png' of the image folder: image file is truncated")

    trainer = SimpleNamespace(start_step=0, run_dir=tmp_path)
    with pytest.raises(DataError) as err:
        list(Trainer._read(trainer, batches()))  # type: ignore[arg-type]
    assert str(err.value).endswith("the run stopped at step 2, whose batch holds it: replace or remove the file, then "
                                   "start the run again (it kept no checkpoint)")


def test_tokens_per_batch_is_for_text(tmp_path: Path) -> None:
    # A source of the wrong kind for the model is refused with the recipe (tests/recipe/test_load.py).
    _fails(data(tokens_per_batch=100), "image", "tokens_per_batch", tmp_path)


def test_too_few_examples_for_one_batch(tmp_path: Path) -> None:
    _fails(data(synthetic_size=10, batch_size=16), "image", "too few for one batch", tmp_path)
    ds = build_data(data(synthetic_size=10, batch_size=16, drop_last=False), "image", seed=0, image_size=32,
                    num_classes=3)
    assert ds.steps_per_epoch() == 1


def test_too_few_examples_for_the_micro_batches_of_a_step(tmp_path: Path) -> None:
    # With drop_last: false a 1-example split reached a rank, which failed splitting it into 2 micro-batches.
    with pytest.raises(DataError, match=r"the training split has \d+ examples?, fewer than the 64 micro-batches of a "
                                        r"step \(pipeline.microbatches x pipeline.data_parallel\)") as err:
        build_data(data(synthetic_size=10, batch_size=16, drop_last=False), "image", seed=0, image_size=32,
                   num_classes=3, min_batch=64)
    assert "\n" not in str(err.value)
    # With data.drop_last too: its advice (data.drop_last: false) led to this error, a second one.
    with pytest.raises(DataError, match=r"fewer than the 64 micro-batches of a step"):
        build_data(data(synthetic_size=10, batch_size=16), "image", seed=0, image_size=32, num_classes=3, min_batch=64)


def test_a_short_last_batch_joins_the_one_before_where_a_micro_batch_of_it_would_hold_one_image(tmp_path: Path) -> None:
    # AmoebaNet with drop_last: false: a last batch of 6 cut into 4 micro-batches gave BatchNorm one image, and a
    # traceback ("Expected more than 1 value per channel").
    from gpipe_cli.data.build import build_data_for
    from gpipe_cli.recipe.load import load_recipe
    from tests.train.recipes import TINY_AMOEBANET, write

    recipe = load_recipe(write(tmp_path, TINY_AMOEBANET), ["data.synthetic_size=70", "data.drop_last=false"])
    ds = build_data_for(recipe)
    sizes = [len(batch.targets) for batch in ds.train_batches(epoch=0)]
    assert sum(sizes) == ds.train_size and min(sizes) >= 8, sizes
