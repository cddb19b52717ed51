"""Data through `gpipe train`: BLEU that rises, local images, the offline hub, the tokenizer kept with the run."""

import copy
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.data.datagen import make_imagefolder
from tests.train.recipes import TINY_AMOEBANET, write

pytestmark = pytest.mark.slow


def gpipe(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpipe_cli.cli", *args, "--plain"], capture_output=True,
                          text=True, timeout=timeout)


def evals(run: Path) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "eval"]


def translation(steps: int) -> dict:
    """The quick-start task, number words English -> French, on 2 stages."""
    from gpipe_cli.recipe.load import load_recipe

    recipe = load_recipe(None).model_dump(mode="json")
    recipe["train"]["steps"] = steps
    recipe["eval"] = {"batches": 2}
    return recipe


def test_bleu_on_held_out_sentences_rises_well_above_chance(tmp_path):
    untrained = gpipe("train", str(write(tmp_path, translation(1), "untrained.yaml")),
                      "--output-dir", str(tmp_path / "untrained"))
    assert untrained.returncode == 0, untrained.stderr[-3000:]
    trained = gpipe("train", str(write(tmp_path, translation(160), "trained.yaml")),
                    "--output-dir", str(tmp_path / "trained"))
    assert trained.returncode == 0, trained.stderr[-3000:]
    before, after = evals(tmp_path / "untrained")[-1]["bleu"], evals(tmp_path / "trained")[-1]["bleu"]
    assert before < 5.0
    assert after > 30.0, f"BLEU {after:.1f} after 160 steps (untrained: {before:.1f})"


def test_an_imagefolder_of_pngs_trains(tmp_path):
    root = make_imagefolder(tmp_path / "images", classes=3, per_class=16, size=40)
    recipe = copy.deepcopy(TINY_AMOEBANET)
    recipe["model"]["num_classes"] = 3
    recipe["data"] = {"source": "imagefolder", "path": str(root), "batch_size": 8}
    recipe["pipeline"]["microbatches"] = 2
    proc = gpipe("train", str(write(tmp_path, recipe)), "--output-dir", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = evals(tmp_path / "run")[-1]
    assert 0.0 <= final["accuracy"] <= 1.0 and final["loss"] > 0


def test_an_unreachable_hub_dataset_is_one_line_and_writes_nothing(tmp_path):
    recipe = copy.deepcopy(TINY_AMOEBANET)
    recipe["data"] = {"source": "hub", "name": "cifar10", "batch_size": 16}
    recipe["pipeline"]["partitions"] = 3
    proc = gpipe("train", str(write(tmp_path, recipe)), "--output-dir", str(tmp_path / "run"), timeout=120)
    assert proc.returncode == 2
    # stdout holds the run's progress lines (what started, reading data); the error is one line on stderr.
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: cannot download dataset 'cifar10'"), lines
    assert "error" not in proc.stdout and "Traceback" not in proc.stdout
    assert not (tmp_path / "run").exists()


def test_the_tokenizer_is_stored_with_the_run_and_reused_on_resume(tmp_path):
    recipe = translation(4)
    recipe["checkpoint"] = {"every": 2}
    path = write(tmp_path, recipe)
    run = tmp_path / "run"
    assert gpipe("train", str(path), "--output-dir", str(run)).returncode == 0
    tokenizer = run / "tokenizer.model"
    digest = hashlib.sha256(tokenizer.read_bytes()).hexdigest()
    stamp = tokenizer.stat().st_mtime_ns
    resumed = gpipe("train", str(path), "--output-dir", str(run), "--resume", "--set", "train.steps=6")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert tokenizer.stat().st_mtime_ns == stamp and hashlib.sha256(tokenizer.read_bytes()).hexdigest() == digest
