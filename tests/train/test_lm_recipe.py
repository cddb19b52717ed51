"""The shipped language-model recipe, shortened: it trains offline to beat the unigram baseline on held-out text."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.train.as_ranks import gpipe_train

ROOT = Path(__file__).resolve().parents[2]
# 100 steps at a constant rate: the held-out perplexity passes the unigram figure near step 50 and is
# about a third of it by step 100, a margin that survives thread-count noise.
SHORT = ["train.steps=100", "eval.every=100", "model.layers=2", "schedule.name=constant",
         "schedule.warmup_steps=10", "optimizer.lr=0.005",
         "model.label_smoothing=0.1"]  # smoothing in the loss, none in the perplexity


@pytest.mark.slow
def test_lm_recipe_beats_the_unigram_perplexity_offline(tmp_path: Path) -> None:
    # What the ranks train is tested here: they start as torchrun's would, without the launcher.
    env = {"HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}
    args = [str(ROOT / "recipes" / "lm-pydoc.yaml"), "--output-dir", str(tmp_path / "run")]
    for value in SHORT:
        args += ["--set", value]
    out = gpipe_train(2, *args, env=env, timeout=600)  # the recipe's K=2
    assert out.code == 0, out.output[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if r["kind"] == "eval"][-1]
    assert last["step"] == 100
    assert 1 < last["perplexity"] < last["unigram_perplexity"]
    # The loss is label-smoothed, the perplexity is not: smoothing raises the loss above the plain likelihood.
    assert math.log(last["perplexity"]) < last["loss"]
    assert "perplexity" in out.stdout
