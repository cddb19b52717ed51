"""Shapes-only figures kept from one launch to the next: equal to working them out, per model and code, and skipped
for a model built by hand; a launch that finds them loads nothing of torch's compiler."""

import json
import os
import subprocess
import sys

import pytest

from gpipe_cli import memory_model as mm
from gpipe_cli.estimate import cost_cache, kept
from gpipe_cli.models.base import LayerSpec, ModelSpec
from gpipe_cli.models.describe import describe
from gpipe_cli.models.registry import build_model

SMALL = dict(arch="decoder-only", layers=2, d_model=16, ff=32, heads=2, vocab_size=64, max_len=8)


@pytest.fixture
def worked(monkeypatch):
    """Count how often figures are worked out, not read."""
    calls: list[str] = []
    monkeypatch.setattr(kept, "describe", lambda *a: calls.append("summary") or describe(*a))
    measure = mm.measure
    monkeypatch.setattr(mm, "measure", lambda *a, **k: calls.append("figures") or measure(*a, **k))
    bytes_per_parameter = mm.bytes_per_parameter
    monkeypatch.setattr(mm, "bytes_per_parameter", lambda *a: calls.append("optimizer") or bytes_per_parameter(*a))
    kept.bytes_per_parameter.cache_clear()  # as a new launch finds it: only on disk
    return calls


def test_figures_kept_are_the_figures_worked_out_and_are_read_the_next_time(cache, worked):
    spec = build_model("transformer", **SMALL)
    first = (kept.summary(spec, 3), kept.figures(spec), kept.bytes_per_parameter("adam"))
    again = (kept.summary(spec, 3), kept.figures(spec), kept.bytes_per_parameter("adam"))
    assert worked == ["summary", "figures", "optimizer"]
    # Another micro-batch, model or optimizer is worked out anew.
    kept.summary(spec, 4)
    kept.figures(build_model("transformer", **{**SMALL, "d_model": 32}))
    kept.bytes_per_parameter("sgd")
    assert worked == ["summary", "figures", "optimizer"] * 2
    assert first == again == (describe(spec, 3), mm.measure(spec, device="meta"), mm.bytes_per_parameter("adam"))


def test_figures_of_other_code_or_a_damaged_file_are_worked_out_again(cache, worked, monkeypatch):
    spec = build_model("transformer", **SMALL)
    kept.summary(spec, 2)
    (path,) = cache.iterdir()
    data = json.loads(path.read_text())
    data["key"]["code"] = "another"  # the same name, another key: as if written by another version
    path.write_text(json.dumps(data))
    assert kept.summary(spec, 2) == describe(spec, 2)
    path.write_text("{not json")
    assert kept.summary(spec, 2) == describe(spec, 2)
    assert worked == ["summary"] * 3
    assert json.loads(path.read_text())["key"]["code"] == kept.code_digest()  # whole again


def test_a_model_built_by_hand_is_never_kept(cache, worked):
    real = build_model("transformer", **SMALL)
    spec = ModelSpec(name="hand", task="lm", layers=[LayerSpec(layer.name, layer.build) for layer in real.layers],
                     loss=real.loss, example_batch=real.example_batch)
    kept.summary(spec, 2)
    kept.figures(spec)
    assert worked == ["summary", "figures"] and not cache.exists()


def test_a_launch_that_finds_the_figures_loads_nothing_of_torchs_compiler(cache):
    # Importing it took 1.5 s of CPU in each launcher, tracing the model on the meta device another second.
    check = ("import sys\nfrom gpipe_cli.recipe.load import load_recipe\n"
             "from gpipe_cli.train.plan import checked_plan\n"
             "checked_plan(load_recipe(None, ['train.steps=1']), 'quickstart')\nprint('torch._dynamo' in sys.modules)")
    env = {**os.environ, cost_cache.CACHE_ENV: str(cache)}
    runs = [subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300, env=env)
            for _ in range(2)]
    assert [run.stdout.strip() for run in runs] == ["True", "False"], [run.stderr[-2000:] for run in runs]


def test_figures_kept_by_another_version_of_the_code_are_deleted_when_this_one_keeps_its_own(cache, monkeypatch):
    # They were never pruned: one file a model, micro-batch size and version of the code, for ever.
    spec = build_model("transformer", **SMALL)
    kept.summary(spec, 2)
    costs = cache / "0123456789abcdef.json"  # measured layer costs share the folder
    costs.write_text("{}")
    (older,) = cache.glob("kept-*.json")
    monkeypatch.setattr(kept, "code_digest", lambda: "another version")
    kept.summary(spec, 2)
    (newer,) = cache.glob("kept-*.json")
    assert newer != older and newer.name.startswith("kept-another ver") and costs.exists()
