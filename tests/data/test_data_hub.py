"""The hub source: one clear DataError line when offline, and real processing of what the hub returns."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import datasets
import pytest
from datagen import COLOURS, data, pairs, png_bytes

from gpipe_cli.data import DataError, build_data
from gpipe_cli.data import sources as sources_mod
from gpipe_cli.data.offline import hub_problem

UNREACHABLE = "http://127.0.0.1:9"  # the discard port: connection refused at once


@pytest.mark.parametrize("task", ["image", "translation", "lm"])
def test_unreachable_hub_is_one_clear_line(task: str, monkeypatch: pytest.MonkeyPatch,
                                            tmp_path: Path) -> None:
    monkeypatch.setenv("HF_ENDPOINT", UNREACHABLE)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    t0 = time.monotonic()
    with pytest.raises(DataError) as err:
        build_data(data(source="hub", name="cifar10"), task, seed=0, cache_dir=tmp_path / "cache")  # type: ignore[arg-type]
    assert time.monotonic() - t0 < 20
    msg = str(err.value)
    assert "\n" not in msg and "'cifar10'" in msg and "no network connection" in msg and "data.source" in msg


def test_offline_mode_is_respected(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError, match="offline mode") as err:
        build_data(data(source="hub", name="wmt14", config="de-en"), "translation", seed=0,
                   cache_dir=tmp_path / "cache")
    assert "\n" not in str(err.value) and "config 'de-en'" in str(err.value)


def test_probe_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", UNREACHABLE)
    t0 = time.monotonic()
    assert hub_problem() is not None
    assert time.monotonic() - t0 < 4


def test_probe_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", UNREACHABLE)
    assert hub_problem() == f"{UNREACHABLE} cannot be reached (Connection refused)"
    with socket.socket() as silent:  # listens, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
        assert hub_problem() == f"no answer from {endpoint} within 2 s"


def _fake_hub(monkeypatch: pytest.MonkeyPatch, splits: datasets.DatasetDict) -> list[tuple]:
    calls: list[tuple] = []

    def load_dataset(name: str, config: str | None = None, **kw: object) -> datasets.DatasetDict:
        calls.append((name, config))
        return splits

    monkeypatch.setattr(sources_mod, "hub_problem", lambda *a, **k: None)  # the hub answers
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


def test_hub_images_find_cifar_style_columns(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    feats = datasets.Features({"img": datasets.Image(),
                               "fine_label": datasets.ClassLabel(names=["a", "b", "c"])})

    def split(n: int) -> datasets.Dataset:
        images = [{"bytes": png_bytes(COLOURS[i % 3], 32), "path": None} for i in range(n)]
        return datasets.Dataset.from_dict({"img": images, "fine_label": [i % 3 for i in range(n)]},
                                          features=feats)

    calls = _fake_hub(monkeypatch, datasets.DatasetDict({"train": split(12), "test": split(3)}))
    ds = build_data(data(source="hub", name="cifar100", batch_size=4), "image", seed=0, image_size=32,
                    num_classes=3)
    assert calls == [("cifar100", None)]
    assert (ds.train_size, ds.eval_size) == (12, 3)
    assert next(ds.train_batches()).inputs.shape == (4, 3, 32, 32)


def test_hub_translation_nested_dict(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    p = pairs(40)

    def split(rows: list[tuple[str, str]]) -> datasets.Dataset:
        return datasets.Dataset.from_dict({"translation": [{"de": t, "en": s} for s, t in rows]})

    _fake_hub(monkeypatch, datasets.DatasetDict({"train": split(p[:30]), "validation": split(p[30:]),
                                                 "test": split(p[:5])}))
    d = data(source="hub", name="wmt14", config="de-en", source_field="en", target_field="de")
    ds = build_data(d, "translation", seed=0, vocab_size=200, max_len=32, run_dir=tmp_path / "run")
    assert (ds.train_size, ds.eval_size) == (30, 10)  # validation preferred over test
    with pytest.raises(DataError, match="no split 'dev'"):
        build_data(d.model_copy(update={"eval_split": "dev"}), "translation", seed=0, vocab_size=200)
