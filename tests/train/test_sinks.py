"""Metric sinks: flat tags, failures that cost one line, TensorBoard and W&B files that hold the records."""

import copy
import importlib.util
import json
import os
import subprocess
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpipe_cli.recipe.schema import Metrics, Wandb
from gpipe_cli.train.sinks import Sinks, open_sinks, scalars
from gpipe_cli.train.view import MetricsFile
from tests.train.recipes import TINY_AMOEBANET, write
from tests.train.test_train_e2e import records
from tests.train.test_view import train_record


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


def test_a_tensorboard_folder_that_cannot_be_written_is_one_line_and_no_thread_traceback(tmp_path, monkeypatch,
                                                                                          capfd):
    # The promised line came with some 40 lines of the event writer's thread failing in its own traceback.
    def refused(*_: object, **__: object) -> None:
        raise PermissionError(1, "Operation not permitted", "tmpfile")

    monkeypatch.setattr("gpipe_cli.train.sinks.tempfile.TemporaryFile", refused)
    lines: list[str] = []
    sinks = open_sinks(Metrics(tensorboard=True), tmp_path, 0, {}, lines.append)
    assert sinks.sinks == [] and lines == [
        f"metrics.tensorboard: could not start (PermissionError: [Errno 1] Operation not permitted: "
        f"'{tmp_path / 'tensorboard'}'); writing metrics.jsonl only"]
    assert list((tmp_path / "tensorboard").iterdir()) == [] and capfd.readouterr().err == ""


class Started:
    """A W&B sink that starts without the package or a network."""

    name, writes = "metrics.wandb", "W&B"

    def __init__(self, *args):
        pass

    def close(self):
        pass


def test_a_missing_package_says_what_the_run_still_writes(tmp_path, monkeypatch):
    # With TensorBoard running, a missing wandb said "writing metrics.jsonl only".
    monkeypatch.setitem(sys.modules, "wandb", None)
    lines: list[str] = []
    sinks = open_sinks(Metrics(tensorboard=True, wandb=Wandb(project="p", mode="offline")), tmp_path, 0, {},
                       lines.append)
    sinks.close()
    assert len(lines) == 1 and lines[0].startswith("metrics.wandb: wandb is not installed")
    assert lines[0].endswith("; writing metrics.jsonl and TensorBoard"), lines
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)
    monkeypatch.setattr("gpipe_cli.train.sinks.WandbSink", Started)
    lines.clear()
    sinks = open_sinks(Metrics(tensorboard=True, wandb=Wandb(project="p")), tmp_path, 0, {}, lines.append)
    assert len(sinks.sinks) == 1 and len(lines) == 1 and lines[0].startswith("metrics.tensorboard: ")
    assert lines[0].endswith("; writing metrics.jsonl and W&B"), lines
    lines.clear()
    open_sinks(Metrics(tensorboard=True), tmp_path, 0, {}, lines.append)
    assert len(lines) == 1 and lines[0].endswith("; writing metrics.jsonl only"), lines


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
def test_tensorboard_event_files_hold_the_same_values_as_metrics_jsonl(sunk):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = sunk.out
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


def test_tensorboard_holds_the_recipe_as_text_and_its_values_as_hyperparameters(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    from gpipe_cli.recipe.schema import Recipe
    from gpipe_cli.train.sinks import HPARAM_METRICS, TensorBoardSink

    config = Recipe.model_validate({"name": "tb", "train": {"steps": 3}, "optimizer": {"lr": 0.25}}).model_dump(
        mode="json")
    sink = TensorBoardSink(tmp_path, first_step=0, config=config)
    sink.log({"train/loss": 1.0}, 1)
    sink.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    text = events.Tensors("recipe/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "    name: tb" in text and "    optimizer:" in text and "      lr: 0.25" in text
    content = events.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    values = start.session_start_info.hparams
    assert values["optimizer.lr"].number_value == 0.25 and values["name"].string_value == "tb"
    assert values["train.steps"].number_value == 3 and values["train.epochs"].string_value == "null"
    assert values["metrics.tensorboard"].bool_value is False
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    assert {m.name.tag for m in experiment.metric_infos} == set(HPARAM_METRICS)


class FakeWandb(types.ModuleType):
    """Stands in for the wandb package: records what a run is started, logged and finished with."""

    def __init__(self):
        super().__init__("wandb")
        self.calls: list[tuple] = []
        fake = self

        class Run:
            id = "abc123"

            def log(self, values, step):
                fake.calls.append(("log", values, step))

            def log_artifact(self, artifact):
                fake.calls.append(("log_artifact", artifact.name, artifact.type, artifact.files))

            def finish(self):
                fake.calls.append(("finish",))

        class Artifact:
            def __init__(self, name, type):
                self.name, self.type, self.files = name, type, []

            def add_file(self, path):
                self.files.append(path)

        self.Artifact, self._run = Artifact, Run()

    def Settings(self, **kwargs):  # noqa: N802 - wandb's name
        return kwargs

    def init(self, **kwargs):
        self.calls.append(("init", kwargs))
        return self._run


def test_wandb_gets_the_recipes_name_tags_group_and_entity_and_the_model_file(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    options = Wandb(project="p", mode="online", name="first try", entity="team", group="sweep-1", tags=["k2", "cpu"])
    lines: list[str] = []
    sinks = open_sinks(Metrics(wandb=options), tmp_path, 0, {"seed": 1}, lines.append)
    assert lines == [] and sinks.takes_models()
    sinks.write(train_record(step=1))
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    sinks.log_model(tmp_path / "model.safetensors")
    sinks.close()
    (_, init), (_, values, step), artifact, finish = fake.calls
    assert {k: init[k] for k in ("project", "mode", "name", "entity", "group", "tags", "config")} == {
        "project": "p", "mode": "online", "name": "first try", "entity": "team", "group": "sweep-1",
        "tags": ["k2", "cpu"], "config": {"seed": 1}}
    assert init["dir"] == str(tmp_path) and step == 1 and values["train/loss"] == 2.5
    assert artifact == ("log_artifact", "model-abc123", "model", [str(tmp_path / "model.safetensors")])
    assert finish == ("finish",)
    fake.calls.clear()
    open_sinks(Metrics(wandb=Wandb(project="p")), tmp_path / "run-7", 0, {}, lines.append).close()
    assert fake.calls[0][1]["name"] == "run-7" and fake.calls[0][1]["tags"] is None  # the defaults


FAKE_WANDB = '''
import json, os

def _say(*call):
    with open(os.environ["FAKE_WANDB_LOG"], "a") as f:
        f.write(json.dumps(call) + "\\n")

class Settings:
    def __init__(self, **kwargs):
        pass

class Artifact:
    def __init__(self, name, type):
        self.name, self.type, self.files = name, type, []
    def add_file(self, path):
        self.files.append(path)

class _Run:
    id = "r1"
    def log(self, values, step):
        _say("log", step)
    def log_artifact(self, artifact):
        _say("log_artifact", artifact.name, artifact.type, artifact.files)
    def finish(self):
        _say("finish")

def init(**kwargs):
    _say("init", {k: kwargs[k] for k in ("project", "name", "entity", "group", "tags")})
    return _Run()
'''


@dataclass
class Sunk:
    """A finished run that wrote TensorBoard events and logged to the fake wandb: its folder, calls and process."""

    out: Path
    calls: list
    proc: subprocess.CompletedProcess


@pytest.fixture(scope="module")
def sunk(tmp_path_factory) -> Sunk:
    """One 2-stage run with both sinks on (each writes its own files): the TensorBoard and the W&B test read it."""
    folder = tmp_path_factory.mktemp("sunk")
    (folder / "fake" / "wandb").mkdir(parents=True)
    (folder / "fake" / "wandb" / "__init__.py").write_text(FAKE_WANDB)
    recipe = copy.deepcopy(TINY_AMOEBANET)
    recipe["train"]["steps"] = 2
    recipe["metrics"] = {"tensorboard": True,
                         "wandb": {"project": "p", "group": "g", "tags": ["a"], "artifact": True}}
    out, log = folder / "run", folder / "calls.jsonl"
    env = {**os.environ, "FAKE_WANDB_LOG": str(log),
           "PYTHONPATH": os.pathsep.join([str(folder / "fake"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "gpipe_cli.cli", "train", str(write(folder, recipe)),
                           "--output-dir", str(out), "--plain"], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return Sunk(out, [json.loads(line) for line in log.read_text().splitlines()], proc)


@pytest.mark.slow
def test_a_run_with_wandb_artifact_exports_its_final_model_and_logs_it(sunk):
    from safetensors.torch import load_file

    out, calls, proc = sunk.out, sunk.calls, sunk.proc
    assert calls[0] == ["init", {"project": "p", "name": "run", "entity": None, "group": "g", "tags": ["a"]}]
    assert [c[1] for c in calls if c[0] == "log"] == [1, 2, 2]  # the two steps, then the final evaluation
    model = out / "model.safetensors"
    assert calls[-2:] == [["log_artifact", "model-r1", "model", [str(model)]], ["finish"]]
    assert load_file(model) and f"exported {model}" in proc.stdout


def test_a_warm_up_steps_loss_stays_on_the_loss_curve_and_only_its_timing_moves_aside():
    record = {**train_record(stages=2), "warmup": True}
    values = scalars(record)
    assert values["train/loss"] == record["loss"] and values["train/lr"] == record["lr"]
    assert "train_warmup/loss" not in values and "train/step_time_s" not in values
    assert values["train_warmup/step_time_s"] == record["step_time_s"]
