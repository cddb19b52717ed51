"""Metric sinks: flat tags, failures that cost one line, TensorBoard and W&B files that hold the records."""

import copy
import importlib.util
import json
import sys

import pytest

from gpipe_cli.recipe.schema import Metrics, Wandb
from gpipe_cli.train.report import MetricsFile
from gpipe_cli.train.sinks import Sinks, open_sinks, scalars
from tests.train.recipes import TINY_AMOEBANET, write
from tests.train.test_report import train_record
from tests.train.test_train_e2e import gpipe, records


def test_every_number_of_a_record_becomes_one_tag_per_stage():
    record = train_record(stages=3)
    values = scalars(record)
    assert values["train/loss"] == record["loss"]
    for part, per_stage in record["time_s"].items():
        assert [values[f"train/time_s/{part}/stage{s}"] for s in range(3)] == per_stage
    assert [values[f"train/activation_peak_bytes/stage{s}"] for s in range(3)] == record["activation_peak_bytes"]
    assert "train/step" not in values and "train/kind" not in values
    assert scalars({"kind": "eval", "step": 2, "loss": None, "accuracy": 0.5}) == {"eval/accuracy": 0.5}


class Broken:
    name = "metrics.broken"

    def __init__(self):
        self.calls = 0

    def log(self, values, step):
        self.calls += 1
        raise ConnectionError("no route to host")

    def close(self):
        raise AssertionError("a dropped sink is not closed again")


def test_a_sink_that_fails_mid_run_is_dropped_with_one_line(tmp_path):
    lines: list[str] = []
    broken = Broken()
    metrics = MetricsFile(tmp_path / "metrics.jsonl", Sinks([broken], lines.append))
    for step in (1, 2, 3):
        metrics.write(train_record(step=step))
    metrics.close()
    assert broken.calls == 1 and len(lines) == 1 and "metrics.broken" in lines[0]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


def test_a_missing_package_is_one_line_at_start(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard now raises ImportError
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)
    monkeypatch.setitem(sys.modules, "wandb", None)
    lines: list[str] = []
    sinks = open_sinks(Metrics(tensorboard=True, wandb=Wandb(project="p")), tmp_path, 0, {}, lines.append)
    assert sinks.sinks == [] and len(lines) == 2
    assert "metrics.tensorboard" in lines[0] and "not installed" in lines[0] and "gpipe-cli[tensorboard]" in lines[0]
    assert "metrics.wandb" in lines[1] and "gpipe-cli[wandb]" in lines[1]


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed")
def test_wandb_offline_writes_its_run_folder_without_network(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "")
    lines: list[str] = []
    metrics = MetricsFile(tmp_path / "metrics.jsonl",
                          open_sinks(Metrics(wandb=Wandb(project="gpipe-test")), tmp_path, 0, {"seed": 1},
                                     lines.append))
    assert lines == [] and len(metrics.sinks.sinks) == 1
    metrics.write(train_record(step=1))
    metrics.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


@pytest.mark.slow
def test_tensorboard_event_files_hold_the_same_values_as_metrics_jsonl(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    recipe = copy.deepcopy(TINY_AMOEBANET)
    recipe["train"]["steps"] = 3
    recipe["metrics"] = {"tensorboard": True}
    out = tmp_path / "run"
    proc = gpipe("train", str(write(tmp_path, recipe)), "--output-dir", str(out), "--plain")
    assert proc.returncode == 0, proc.stderr[-4000:]
    expected: dict[str, dict[int, float]] = {}
    for record in records(out):
        for tag, value in scalars(record).items():
            expected.setdefault(tag, {})[record["step"]] = value
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert set(events.Tags()["scalars"]) == set(expected)
    assert {"train/bubble", "train/time_s/wait/stage1", "train/rss_peak_bytes/stage0", "eval/loss"} <= set(expected)
    for tag, by_step in expected.items():
        got = {e.step: e.value for e in events.Scalars(tag)}
        assert got == pytest.approx(by_step, rel=1e-6), tag
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["step"] == 1


def test_a_resumed_run_drops_the_tensorboard_steps_after_its_checkpoint(tmp_path):
    """As metrics.jsonl drops their lines: steps after the checkpoint are gone even before they are rerun."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from gpipe_cli.train.sinks import TensorBoardSink

    first = TensorBoardSink(tmp_path, first_step=0)
    for step in (1, 2, 3, 4):
        first.log({"train/loss": float(step)}, step)
    first.close()
    TensorBoardSink(tmp_path, first_step=2).close()  # resumed from step 2's checkpoint, stopped at once
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert {e.step: e.value for e in events.Scalars("train/loss")} == {1: 1.0, 2: 2.0}
