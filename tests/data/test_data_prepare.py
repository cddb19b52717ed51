"""prepare-data: a DatasetDict saved as parquet is read back by data.source parquet exactly as the hub gave it."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from datagen import COLOURS, data, pairs, png_bytes

from gpipe_cli import interrupts
from gpipe_cli.data import DataError, build_data
from gpipe_cli.data.prepare import prepare_data, save_splits


def _image_splits(folder: Path) -> datasets.DatasetDict:
    """cifar10-style splits ('img', ClassLabel 'label') whose images are files on disk, as hub caches hold them."""
    feats = datasets.Features({"img": datasets.Image(), "label": datasets.ClassLabel(names=["r", "g", "b"])})
    folder.mkdir()

    def split(name: str, n: int) -> datasets.Dataset:
        paths = []
        for i in range(n):
            p = folder / f"{name}{i}.png"
            p.write_bytes(png_bytes(COLOURS[i % 3], 16, seed=i))
            paths.append(str(p))
        return datasets.Dataset.from_dict({"img": paths, "label": [i % 3 for i in range(n)]}, features=feats)

    return datasets.DatasetDict({"train": split("train", 9), "test": split("test", 4)})


def test_saved_images_read_back_identical_without_the_original_files(tmp_path: Path) -> None:
    splits = _image_splits(tmp_path / "cache")
    recipe = data(source="hub", name="cifar10", batch_size=3, augment=False, shuffle=False)
    files = save_splits(splits, recipe, tmp_path / "prepared")
    assert {f.name.split("-")[0] for f in files} == {"train", "test"}
    for f in (tmp_path / "cache").iterdir():  # the parquet files must not point into a cache
        f.unlink()
    local = recipe.model_copy(update={"source": "parquet", "path": str(tmp_path / "prepared"), "name": None})
    got = build_data(local, "image", seed=0, image_size=16, num_classes=3, cache_dir=tmp_path / "hf")
    assert (got.train_size, got.eval_size) == (9, 4)
    assert np.array_equal(got.train.labels, np.arange(9) % 3)  # type: ignore[attr-defined]
    with pytest.raises(DataError, match="has 3 classes"):  # the class names travelled with the files
        build_data(local, "image", seed=0, image_size=16, num_classes=2, cache_dir=tmp_path / "hf")
    expected = [torch.from_numpy(np.asarray(im.convert("RGB"), dtype=np.float32) / 255).permute(2, 0, 1)
                for im in _image_splits(tmp_path / "again")["test"]["img"]]
    read = [got.eval.source.load(i) for i in range(4)]  # type: ignore[union-attr, attr-defined]
    assert all(torch.equal(a, b) for a, b in zip(read, expected, strict=True))


def test_saved_translation_pairs_read_back_with_the_eval_split_the_recipe_uses(tmp_path: Path) -> None:
    p = pairs(50)

    def split(rows: list[tuple[str, str]]) -> datasets.Dataset:
        return datasets.Dataset.from_dict({"translation": [{"de": t, "en": s} for s, t in rows]})

    splits = datasets.DatasetDict({"train": split(p[:30]), "validation": split(p[30:40]), "test": split(p[40:])})
    recipe = data(source="hub", name="wmt14", config="de-en", source_field="en", target_field="de")
    files = save_splits(splits, recipe, tmp_path / "wmt")
    assert sorted(f.name.split("-")[0] for f in files) == ["train", "validation"]  # not the unused test split
    local = recipe.model_copy(update={"source": "parquet", "path": str(tmp_path / "wmt")})
    got = build_data(local, "translation", seed=0, vocab_size=200, max_len=32, run_dir=tmp_path / "run",
                     cache_dir=tmp_path / "hf")
    assert (got.train_size, got.eval_size) == (30, 10)
    refs = [r for b in got.eval_batches() for r in b.references or []]
    assert refs == [t for _, t in p[30:40]]


def test_an_existing_folder_is_refused_and_nothing_is_left_half_written(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a b c"] * 4})})
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep")
    with pytest.raises(DataError, match="not an empty folder"):
        save_splits(splits, data(source="hub", name="x"), tmp_path / "full")

    def broken(self: datasets.Dataset, path: str) -> None:
        Path(path).write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(datasets.Dataset, "to_parquet", broken)
    with pytest.raises(DataError, match="disk full"):
        save_splits(splits, data(source="hub", name="x"), tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]


@pytest.mark.parametrize("source", [{"source": "synthetic"}, {"source": "synthetic", "name": "cifar10"}])
def test_prepare_of_a_recipe_that_reads_no_hub_data_says_so(tmp_path: Path, source: dict[str, str]) -> None:
    with pytest.raises(DataError, match="reads data.source 'synthetic', which needs no download; for a hub dataset "
                                        "set data.source=hub and data.name"):
        prepare_data(data(**source), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_output_that_cannot_be_written_is_refused_before_the_download(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from gpipe_cli.data import prepare as prepare_mod
    from gpipe_cli.errors import UserError

    def no_download(*args: object) -> None:
        raise AssertionError("downloaded before the output was checked")

    monkeypatch.setattr(prepare_mod, "load_hub", no_download)
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match=r"^--output: .* exists and is not a directory$"):
        prepare_data(data(source="hub", name="x"), tmp_path / "file" / "out")


def test_an_output_name_too_long_is_refused_before_the_download(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from gpipe_cli.data import prepare as prepare_mod
    from gpipe_cli.errors import UserError

    def no_download(*args: object) -> None:
        raise AssertionError("downloaded before the output was checked")

    monkeypatch.setattr(prepare_mod, "load_hub", no_download)
    with pytest.raises(UserError, match=r"^--output: '.* has a name of 300 bytes; a name may have at most 255 bytes"):
        prepare_data(data(source="hub", name="x"), tmp_path / ("a" * 300))
    assert list(tmp_path.iterdir()) == []


def test_a_folder_name_of_255_bytes_is_staged_beside_it_and_renamed(tmp_path: Path) -> None:
    # Its staging folder's name, `.NAME.XXXXXXXX`, was over the 255 bytes a name may have.
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a", "b"]})})
    out = tmp_path / ("p" * 255)
    assert [p.name for p in save_splits(splits, data(source="hub", name="x"), out)] == [
        "train-00000-of-00001.parquet"]
    assert [p.name for p in tmp_path.iterdir()] == [out.name]


def test_the_prepare_data_command_saves_what_the_printed_set_reads(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from gpipe_cli.cli import app
    from gpipe_cli.data import prepare as prepare_mod
    from gpipe_cli.recipe.load import load_recipe

    asked: list[tuple[str, str | None]] = []
    text = datasets.Dataset.from_dict({"text": [f"line {i} of the text" for i in range(40)]})

    def fake_hub(name: str, config: str | None, cache_dir: object, kind: str) -> datasets.DatasetDict:
        asked.append((name, config))
        return datasets.DatasetDict({"train": text})

    monkeypatch.setattr(prepare_mod, "load_hub", fake_hub)
    recipe = tmp_path / "lm.yaml"
    recipe.write_text("model: {kind: transformer, arch: decoder-only, layers: 1, d_model: 16, ff: 32, heads: 2, "
                      "vocab_size: 64, max_len: 16}\ndata: {source: hub, name: someone/wiki, batch_size: 4, "
                      "seq_len: 8}\ntrain: {steps: 1}\n")
    out = CliRunner().invoke(app, ["prepare-data", str(recipe), "--set", "data.config=small", "--output",
                                   str(tmp_path / "wiki")])
    assert out.exit_code == 0, out.output
    assert asked == [("someone/wiki", "small")]
    sets = out.output.split("train with", 1)[1].replace("--set", " ").split()
    local = load_recipe(recipe, sets)
    assert (local.data.source, local.data.path) == ("parquet", str(tmp_path / "wiki"))
    got = build_data(local.data, "lm", seed=0, vocab_size=64, max_len=16, run_dir=tmp_path / "run",
                     cache_dir=tmp_path / "hf")
    assert got.train_size > 0 and got.eval_size > 0  # the held-out part comes from data.eval_fraction


def test_every_shard_written_is_announced_first(tmp_path: Path) -> None:
    lines: list[str] = []
    files = save_splits(_image_splits(tmp_path / "cache"), data(source="hub", name="cifar10"), tmp_path / "out",
                        lines.append)
    assert len(lines) == len(files) and {line.split()[1] for line in lines} == {"train", "test"}
    assert all(line.startswith("writing ") and " shard 1 of 1 " in line for line in lines)


def test_the_folder_written_takes_the_umask_not_a_private_mode(tmp_path: Path) -> None:
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a b c"] * 4})})
    previous = os.umask(0o022)
    try:
        save_splits(splits, data(source="hub", name="x"), tmp_path / "out")
    finally:
        os.umask(previous)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o755  # others read what is prepared for them


def test_a_ctrl_c_while_a_shard_is_written_stops_after_it_and_leaves_nothing(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # pyarrow writes through Python file objects: a KeyboardInterrupt raised there became its own error or an abort.
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a b c"] * 4})})
    written, whole = datasets.Dataset.to_parquet, []

    def interrupted(self: datasets.Dataset, path: str) -> None:
        signal.raise_signal(signal.SIGINT)  # arrives while the shard is written: the write goes on
        written(self, path)
        whole.append(Path(path).stat().st_size)

    monkeypatch.setattr(datasets.Dataset, "to_parquet", interrupted)
    previous = signal.signal(signal.SIGINT, interrupts._on_interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            save_splits(splits, data(source="hub", name="x"), tmp_path / "out")
    finally:
        signal.signal(signal.SIGINT, previous)
        interrupts._interrupted = False
    assert len(whole) == 1 and whole[0] > 0
    assert list(tmp_path.iterdir()) == []


def test_a_reader_gone_is_not_taken_for_a_folder_that_cannot_be_written(tmp_path: Path) -> None:
    def closed(text: str) -> None:
        raise BrokenPipeError(32, "Broken pipe")

    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a b c"] * 4})})
    with pytest.raises(BrokenPipeError):  # the command line ends it with 141, as any command whose reader goes
        save_splits(splits, data(source="hub", name="x"), tmp_path / "out", closed)
    assert list(tmp_path.iterdir()) == []


def test_saving_draws_no_progress_bars_and_leaves_them_as_they_were(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    datasets.enable_progress_bars()
    save_splits(_image_splits(tmp_path / "cache"), data(source="hub", name="cifar10"), tmp_path / "out")
    err = capsys.readouterr().err
    assert "%|" not in err and "parquet" not in err.lower(), err
    assert datasets.is_progress_bar_enabled()


def test_prepare_data_offline_says_to_run_itself_where_there_is_network(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # Not the advice train gets (a local copy that prepare-data writes), which sent the user back to this command.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError) as err:
        prepare_data(data(source="hub", name="cifar10"), tmp_path / "out", cache_dir=tmp_path / "cache")
    assert str(err.value).endswith("no cached copy; run this command where there is network, and copy the folder "
                                   "it writes here")
    assert not (tmp_path / "out").exists()


def test_an_output_that_is_a_file_is_called_a_file(tmp_path: Path) -> None:
    (tmp_path / "taken.yaml").write_text("")
    with pytest.raises(DataError, match=r"taken.yaml' is a file; name a new folder$"):
        prepare_data(data(source="hub", name="x"), tmp_path / "taken.yaml")


def test_an_output_inside_a_runs_checkpoints_is_refused_before_the_download(tmp_path: Path, capsys) -> None:
    from gpipe_cli.cli import run

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"kind": "start", "step": 0}\n')
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "amoebanet-d-cifar10.yaml"
    assert run(["prepare-data", str(recipe), "--output", str(run_dir / "checkpoints" / "x")]) == 2
    assert "is inside the run's checkpoints/, which training prunes" in capsys.readouterr().err
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints", "metrics.jsonl"]


@pytest.mark.parametrize("typed", ["", "  "])
def test_an_empty_recipe_path_asks_for_a_recipe_not_to_leave_it_out(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                                    typed: str) -> None:
    # It advised leaving the recipe out, which prepare-data requires.
    from gpipe_cli.cli import run

    assert run(["prepare-data", typed, "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the recipe path is ") and "give the YAML file of a recipe with data.source hub" in err
    assert "leave it out" not in err and not (tmp_path / "out").exists()
