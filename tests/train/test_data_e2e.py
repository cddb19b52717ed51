"""Data through `gpipe train`: BLEU that rises, local images, the offline hub, the tokenizer kept with the run."""

import copy
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.data.datagen import make_imagefolder
from tests.train.as_ranks import gpipe_train
from tests.train.recipes import TINY_AMOEBANET, write

pytestmark = pytest.mark.slow


def gpipe(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpipe_cli.cli", *args, "--plain"], capture_output=True,
                          text=True, timeout=timeout)


def evals(run: Path) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "eval"]


def translation(steps: int) -> dict:
    """The quick-start task, number words English -> French, on 1 stage (the cut changes no number it learns)."""
    from gpipe_cli.recipe.load import load_recipe

    recipe = load_recipe(None).model_dump(mode="json")
    recipe["train"]["steps"] = steps
    recipe["pipeline"]["partitions"] = 1
    recipe["eval"] = {"batches": 2}
    return recipe


@pytest.fixture(scope="module")
def short_run(tmp_path_factory) -> tuple[Path, Path]:
    """The quick-start task trained for 2 of its 40 warm-up steps, as torchrun's one rank would: (recipe, run)."""
    folder = tmp_path_factory.mktemp("short")
    recipe = translation(2)
    path, run = write(folder, recipe), folder / "run"
    ranks = gpipe_train(1, str(path), "--output-dir", str(run))
    assert ranks.code == 0, ranks.output[-3000:]
    return path, run


def test_bleu_on_held_out_sentences_rises_well_above_chance(short_run, quickstart):
    """Near 0 for a model that has hardly trained, far above it once the quick start has run its 200 steps."""
    assert quickstart.proc.returncode == 0, quickstart.proc.stderr[-3000:]
    (trained,) = (quickstart.cwd / "outputs" / "quickstart").iterdir()
    before, after = evals(short_run[1])[-1]["bleu"], evals(trained)[-1]["bleu"]
    assert before < 5.0
    assert after > 30.0, f"BLEU {after:.1f} after the quick start (after 2 steps: {before:.1f})"


def test_an_imagefolder_of_pngs_trains(tmp_path):
    root = make_imagefolder(tmp_path / "images", classes=3, per_class=16, size=40)
    recipe = copy.deepcopy(TINY_AMOEBANET)
    recipe["model"]["num_classes"] = 3
    recipe["data"] = {"source": "imagefolder", "path": str(root), "batch_size": 8}
    recipe["pipeline"].update(partitions=1, microbatches=2)  # the stages see what the data gave: one will do
    recipe["train"]["steps"] = 2
    ranks = gpipe_train(1, str(write(tmp_path, recipe)), "--output-dir", str(tmp_path / "run"))
    assert ranks.code == 0, ranks.output[-3000:]
    final = evals(tmp_path / "run")[-1]
    assert 0.0 <= final["accuracy"] <= 1.0 and final["loss"] > 0
    # The class names as trained on, kept for export; every class of the model has data: no word of it.
    names = sorted(p.name for p in (root / "train").iterdir())
    assert json.loads((tmp_path / "run" / "classes.json").read_text()) == names
    assert "model.num_classes" not in ranks.output


def test_a_model_with_more_classes_than_its_data_says_so_in_the_data_line():
    # A 3-class model on a 2-class folder trained without a word; predict then named "class 2", which no image was.
    from types import SimpleNamespace

    import numpy as np

    from gpipe_cli.recipe.load import load_recipe
    from gpipe_cli.train.loop import Trainer

    recipe = load_recipe(None, ["model.kind=amoebanet", "model.num_classes=3", "data.source=imagefolder",
                                "data.path=/nowhere"], check_data=False)
    for labels, said in ((np.array([0, 1, 1, 0]), "holds 2 of the model's 3 classes (model.num_classes): it never "
                                                  "learns to answer the other"), (np.array([0, 1, 2, 0]), None)):
        train = SimpleNamespace(labels=labels, left_out="")
        data = SimpleNamespace(plan=lambda epoch: [[0, 1], [2, 3]], train_size=4, eval_size=0, tokenizer=None,
                               train=train, eval=None, joined=0)
        line = Trainer._data_summary(SimpleNamespace(recipe=recipe, steps_per_epoch=2), data)  # type: ignore[arg-type]
        assert (said in line) if said else "model.num_classes" not in line, line


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


def test_evaluating_data_that_holds_nothing_out_is_refused_and_the_final_evaluation_said_skipped(tmp_path):
    # It evaluated to `loss nan, bleu 0` at every eval.every, and skipped the final evaluation without a word.
    recipe = translation(1)
    recipe["data"]["eval_fraction"] = 0
    recipe["eval"] = {"every": 1}
    path = write(tmp_path, recipe)
    proc = gpipe("train", str(path), "--output-dir", str(tmp_path / "run"), timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    # Said from the recipe before any rank starts (generated data holds out only data.eval_fraction), as validate does.
    assert proc.stderr == (f"error: {path}: eval.every (1): the data holds nothing out to evaluate on "
                           "(data.eval_fraction 0); raise data.eval_fraction, or set eval.every: null\n")
    assert not (tmp_path / "run").exists()
    recipe["eval"] = {"every": None}
    proc = gpipe("train", str(write(tmp_path, recipe)), "--output-dir", str(tmp_path / "run"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "no final evaluation: the data holds nothing out (data.eval_fraction 0)" in proc.stdout
    assert not evals(tmp_path / "run")


def test_evaluating_a_one_line_text_says_that_held_out_data_is_whole_lines(tmp_path):
    # It advised raising data.eval_fraction, which never holds out the only line.
    text = tmp_path / "one.txt"
    text.write_text(" ".join(f"word{i % 13}" for i in range(3000)) + "\n", encoding="utf-8")
    sets = ["data.source=text", f"data.path={text}", "data.vocab_size=64", "train.steps=2", "eval.every=2"]
    proc = gpipe("train", "recipes/lm-pydoc.yaml", *(a for item in sets for a in ("--set", item)), "--output-dir",
                 str(tmp_path / "run"), timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr == ("error: eval.every (2): the data holds nothing out to evaluate on: data.eval_fraction (0.1) "
                           f"holds out whole lines, and '{text}' has 1 line, which training keeps; give it more "
                           "lines, or set eval.every: null\n")
    assert not (tmp_path / "run").exists()


def test_a_rank_that_fails_after_reading_parquet_says_one_line_and_no_more(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.data.datagen import pairs

    folder = tmp_path / "pairs"
    folder.mkdir()
    pq.write_table(pa.table({"translation": [{"en": s, "de": t} for s, t in pairs(100)]}), folder / "train.parquet")
    recipe = translation(2)
    recipe["pipeline"]["partitions"] = 2
    recipe["data"] = {"source": "parquet", "path": str(folder), "batch_size": 8}  # fields 'source', 'target'
    proc = gpipe("train", str(write(tmp_path, recipe)), "--output-dir", str(tmp_path / "run"), timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr == (f"error: '{folder}': no fields 'source' and 'target' (fields: en, de); set "
                           "data.source_field and data.target_field\n"), proc.stderr[-3000:]
    # The ranks end with os._exit, leaving `datasets`' semaphores to multiprocessing's resource tracker, which
    # warned of them in two more lines.
    assert "leaked semaphore" not in proc.stderr and "Traceback" not in proc.stderr + proc.stdout


def test_the_tokenizer_is_stored_with_the_run_and_reused_on_resume(short_run, tmp_path):
    path, finished = short_run
    run = shutil.copytree(finished, tmp_path / "run")  # copy2 keeps the modification times
    tokenizer = run / "tokenizer.model"
    assert tokenizer.exists()
    digest = hashlib.sha256(tokenizer.read_bytes()).hexdigest()
    stamp = tokenizer.stat().st_mtime_ns
    resumed = gpipe_train(1, str(path), "--output-dir", str(run), "--resume", "--set", "train.steps=4")
    assert resumed.code == 0, resumed.output[-3000:]
    assert "resumed from" in resumed.stderr and max(r["step"] for r in evals(run)) == 4
    assert "the data changed" not in resumed.stderr
    assert tokenizer.stat().st_mtime_ns == stamp and hashlib.sha256(tokenizer.read_bytes()).hexdigest() == digest


def test_a_resume_says_how_the_data_changed_since_its_checkpoint(short_run, tmp_path):
    # A file of the data edited between a stop and its resume moved the epochs without a word.
    path, finished = short_run
    run = shutil.copytree(finished, tmp_path / "run")
    resumed = gpipe_train(1, str(path), "--output-dir", str(run), "--resume", "--set", "train.steps=3",
                          "--set", "data.synthetic_size=3000")
    assert resumed.code == 0, resumed.output[-3000:]
    (line,) = [line for line in resumed.stderr.splitlines() if "the data changed" in line]
    assert line == ("[gpipe] the data changed since step 2 was saved: training examples 4,096 then, 3,000 now and "
                    "held out 205 then, 150 now; the run goes on with the data as it is now")
