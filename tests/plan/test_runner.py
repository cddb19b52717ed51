import re
import shlex
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest

from gpipe_cli.cli import run
from gpipe_cli.recipe.load import load_recipe
from tests.interrupt import interrupt
from tests.train.recipes import write

# A decoder-only Transformer of 4 pipeline layers: measured in a second or two.
TINY = {
    "name": "tiny-lm", "seed": 0,
    "model": {"kind": "transformer", "arch": "decoder-only", "layers": 2, "d_model": 16, "ff": 32, "heads": 2,
              "vocab_size": 64, "max_len": 8, "dropout": 0.0},
    "pipeline": {"partitions": 1, "microbatches": 1},
    "data": {"source": "synthetic", "batch_size": 8, "synthetic_size": 64},
    "train": {"steps": 2},
    "optimizer": {"name": "adam", "lr": 0.001},
}
HEAVY = "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')))\n"


def refused_before_torch(tmp_path, args: list[str], timeout: int = 120) -> str:
    """`gpipe plan ARGS` in a fresh interpreter: exit 2, torch never loaded, nothing written; its stderr."""
    code = ("import sys\n"
            "from gpipe_cli.cli import run\n"
            f"assert run({['plan', *args]!r}) == 2\n" + HEAVY)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
    assert list(tmp_path.iterdir()) == []
    return proc.stderr


def set_lines(out: str) -> list[str]:
    """The `--set` items of the printed `gpipe train` command."""
    command = next(line for line in out.splitlines() if line.strip().startswith("gpipe train"))
    words = shlex.split(command)
    return [words[i + 1] for i, w in enumerate(words) if w == "--set"]


def test_one_device_measures_the_engine_on_one_stage_in_this_process(tmp_path, capsys):
    recipe = write(tmp_path, TINY)
    assert run(["plan", str(recipe), "--devices", "1", "--timing", "measure", "--plain"]) == 0
    out = capsys.readouterr().out
    assert "measuring the engine's own cost per layer call and per step (one stage, this process)" in out
    timing = next(line for line in out.splitlines() if line.strip().startswith("per-layer seconds:"))
    engine = re.search(r"the engine adds ([0-9.]+) ms per layer call and ([0-9.]+) ms per step, its optimizer's "
                       r"update included \(measured\)", timing)
    assert engine is not None, timing
    # Never negative; zero is a measurement too: on a loaded machine the layers' own timing can leave no gap.
    assert float(engine.group(1)) >= 0 and float(engine.group(2)) >= 0
    assert "on 1 replica" not in timing and "as 1 stage" not in timing  # no ranks: no replicated or staged ratios
    assert {"pipeline.partitions=1", "pipeline.data_parallel=1"} <= set(set_lines(out))


def test_a_model_too_slow_to_time_keeps_the_links_measured_here(tmp_path, capsys, monkeypatch):
    from gpipe_cli.plan import inputs
    from gpipe_cli.sizing import usable_cores

    monkeypatch.setattr(inputs, "MEASURE_BUDGET_S", -1.0)  # every model is too slow: --timing auto estimates
    recipe = write(tmp_path, TINY)
    assert run(["plan", str(recipe), "--devices", "2", "--plain"]) == 0
    out = capsys.readouterr().out
    assert "per-layer seconds: estimated from FLOPs at this machine's measured" in out
    # The plan is still for this machine's ranks, so the links measured between them describe its devices.
    links = next(line for line in out.splitlines() if line.strip().startswith("links:"))
    assert ("measured between 2 ranks here" if usable_cores() > 1 else "(assumed)") in links, links


def test_a_budget_nothing_fits_is_one_line_naming_the_memory_that_does(tmp_path, capsys):
    recipe = write(tmp_path, TINY)
    assert run(["plan", str(recipe), "--devices", "2", "--device-memory", "1KiB", "--timing", "estimate"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("error: nothing fits"), err
    needed = re.search(r"give --device-memory (\S+) or more", err)
    assert needed, err
    # Said as every other size is, with a space (one formatter); the flag to type, as a flag is typed.
    figure, unit = re.fullmatch(r"([\d.]+)(\w+)", needed.group(1)).groups()
    assert f"needs {figure} {unit} per device (predicted)" in err, err
    assert run(["plan", str(recipe), "--devices", "2", "--device-memory", needed.group(1), "--timing",
                "estimate"]) == 0
    assert list(tmp_path.iterdir()) == [recipe]


def test_a_memory_the_weights_alone_exceed_is_refused_before_anything_is_measured(tmp_path, capsys, monkeypatch):
    # `--device-memory 80` (bytes, meant as GiB) was refused after a minute of measuring links, layers and steps.
    from gpipe_cli.plan import runner

    def measured(*args, **kwargs):
        raise AssertionError("measured before the memory was checked")

    monkeypatch.setattr(runner, "_sample", measured)
    monkeypatch.setattr(runner, "_links", measured)
    recipe = write(tmp_path, TINY)
    assert run(["plan", str(recipe), "--devices", "2", "--device-memory", "80"]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(r"error: nothing fits 80 B per device on 2 devices \(a number without a unit is bytes\): the "
                        r"weights, gradients and optimizer state alone need more than [\d.]+ [KMGTPEZY]?i?B per "
                        r"device, however the model is cut; give a --device-memory above that \(activations need "
                        r"more\), with its unit, e.g. 80GiB, or more --devices\n", err), err
    # Given with its unit, the example was of a size thousands of times the floor just named.
    assert run(["plan", str(recipe), "--devices", "2", "--device-memory", "1KiB"]) == 2
    assert capsys.readouterr().err.endswith("give a --device-memory above that (activations need more), or more "
                                            "--devices\n")


def test_a_set_item_that_replaces_a_flag_is_said_and_leaves_it_out_of_the_plan(tmp_path, capsys):
    # `--layers 4 --set model.layers=3` planned 3 layers in silence and printed both in the train command.
    recipe = write(tmp_path, TINY)
    assert run(["plan", str(recipe), "--devices", "1", "--tflops", "10", "--layers", "4", "--set", "model.layers=3",
                "--plain"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "note: --set model.layers=3 replaces --layers 4"
    assert "--set model.layers=3" in out and "model.layers=4" not in out


def test_devices_no_pipeline_can_use_are_one_line(tmp_path, capsys):
    recipe = write(tmp_path, TINY)  # 4 layers, batch 8: K <= 4 leaves D = 64 / K > 8
    assert run(["plan", str(recipe), "--devices", "64", "--timing", "estimate"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "--devices 64" in err, err


@pytest.mark.parametrize("args", [["--devices", "0"], ["--devices", "4", "--nodes", "3"],
                                  ["--devices", "2", "--nodes", "0"],
                                  ["--devices", "2", "--device-memory", "lots"], ["--devices", "2", "--top", "0"],
                                  ["--devices", "2", "--timing", "guess"], ["--devices", "2", "--bandwidth", "0"],
                                  ["--devices", "2", "--set", "pipeline.partitons=2"],
                                  ["--devices", "2", "--layers", "0"],
                                  ["--devices", "2", "--output", "plan.txt"]])
def test_bad_flags_are_refused_in_one_line_before_torch_loads(tmp_path, args):
    err = refused_before_torch(tmp_path, args)
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    if "--layers" in args:  # a value typed as a flag is named by it, as bench and profile-memory name it
        assert err.startswith("error: --layers: must be >= 1"), err


def test_a_size_flag_is_its_recipe_key_and_travels_to_the_train_command(tmp_path, capsys):
    recipe = write(tmp_path, TINY)
    output = tmp_path / "planned.yaml"
    assert run(["plan", str(recipe), "--devices", "2", "--tflops", "100", "--plain", "--layers", "3",
                "--output", str(output)]) == 0
    lines = set_lines(capsys.readouterr().out)
    assert "model.layers=3" in lines
    planned = load_recipe(output)
    assert planned.model.layers == 3 and load_recipe(recipe, lines) == planned


def test_a_plan_for_devices_not_here_says_what_it_does_and_ends_with_its_estimate(tmp_path, capsys):
    # With --tflops nothing is measured: the paper's Transformer on 8 devices was silent for 24 s, the time of the
    # search, and its last line said only 'took 24 s'.
    recipe = write(tmp_path, TINY)
    assert run(["plan", str(recipe), "--devices", "2", "--tflops", "100", "--plain"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("gpipe plan · "))
    said = lines[:header]
    assert said[0] == "pricing the 4 pipeline layers from their shapes and FLOPs (meta device)...", said
    assert re.fullmatch(r"searching every K, D, M, schedule, V, remat, offload and balance for the fastest that "
                        r"fits( \(about \d+ s\))?\.\.\.", said[-1]), said
    assert re.fullmatch(r"took \d+ s \(estimated \d+ s\)", lines[-1]), lines[-1]


def test_a_token_budget_is_planned_as_the_batch_training_prices(tmp_path, capsys):
    # The plan read data.batch_size (8) where training builds its batch from the token budget: 24 tokens of
    # examples 8 long, 3 examples. Its memory and its M were those of a batch training never uses.
    recipe = write(tmp_path, {**TINY, "data": {**TINY["data"], "tokens_per_batch": 24}})
    assert run(["plan", str(recipe), "--devices", "1", "--tflops", "100", "--plain"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("gpipe plan · "))
    assert header.endswith("· data.tokens_per_batch 24 (3 examples of 8 tokens)"), header
    ms = {int(m) for m in re.findall(r"\bK=\d+ D=\d+ M=(\d+)", out)}
    assert ms and max(ms) <= 3 < TINY["data"]["batch_size"]
    planned = load_recipe(recipe, set_lines(out))
    assert planned.pipeline.microbatches <= 3


@pytest.mark.slow
@pytest.mark.parametrize("preset,batch", [("amoebanet-d-18-256", 128), ("transformer-l-48", 32)])
def test_paper_models_are_planned_for_eight_80gib_devices_without_building_them(tmp_path, capsys, preset, batch):
    recipe = write(tmp_path, {"name": "paper", "model": {"preset": preset}, "pipeline": {"partitions": 1},
                              "data": {"source": "synthetic", "batch_size": batch}, "train": {"steps": 1},
                              "optimizer": {"name": "rmsprop"}})
    assert run(["plan", str(recipe), "--devices", "8", "--device-memory", "80GiB", "--tflops", "100",
                "--plain"]) == 0
    out = capsys.readouterr().out
    assert "predictions" in out and "extrapolated" in out and "assumed 100 TFLOP/s" in out
    planned = load_recipe(recipe, set_lines(out))
    assert planned.pipeline.partitions * planned.pipeline.data_parallel == 8


@pytest.mark.slow
def test_ctrl_c_while_measuring_exits_130_and_writes_nothing(tmp_path):
    output = tmp_path / "planned.yaml"
    # --bandwidth: the links are assumed, not measured between two ranks started first (seconds each, before the
    # moment this test is about). --timing measure: on a loaded machine `auto` may only estimate, never measuring.
    code, text, err = interrupt(["plan", "--devices", "2", "--bandwidth", "10", "--timing", "measure", "--output",
                                 str(output)], tmp_path, lambda tmp, out: "measuring per-layer seconds" in out)
    assert code == 130, (text + err)[-3000:]
    assert "Traceback" not in text + err and err == "gpipe plan: interrupted; nothing was written\n", err
    assert not output.exists()



def test_an_output_that_is_a_directory_is_refused_in_one_line_before_measuring(tmp_path, capsys, monkeypatch):
    from gpipe_cli.plan import runner

    def measured(*args):
        raise AssertionError("measured before --output was checked")

    monkeypatch.setattr(runner, "_plan", measured)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d.yaml").mkdir()
    for output in ("d.yaml", "/proc/p.yaml"):
        code = run(["plan", "--devices", "2", "--tflops", "100", "--output", output])
        err = capsys.readouterr().err
        assert code == 2 and len(err.splitlines()) == 1, err
        assert err.startswith(f"error: --output: cannot write {output!r}") and "Traceback" not in err, err
    assert [p.name for p in tmp_path.iterdir()] == ["d.yaml"] and not list((tmp_path / "d.yaml").iterdir())


def test_once_planned_the_recipe_is_written_with_ctrl_c_and_sigterm_waiting(monkeypatch, handlers):
    """Outside `remembered`, which would put the Ctrl-C handler back between the write and the exit."""
    from gpipe_cli.plan import runner

    states = []

    def planned(*args):
        return lambda: states.append((signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))) or 0

    monkeypatch.setattr(runner, "_plan", planned)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    assert run(["plan", "--devices", "2", "--tflops", "100"]) == 0
    assert states == [(signal.SIG_IGN, signal.SIG_IGN)]


@pytest.mark.parametrize("settings,why", [
    (["pipeline.partitions=99"], "(K=99 D=1 M=4 gpipe except_last) is not compared: it uses K x D = 99 x 1 = 99 "
                                 "devices, not the 2 planned for"),
    (["pipeline.partitions=1", "pipeline.data_parallel=2", "data.batch_size=9"],
     "is not compared: data.batch_size 9 is not a multiple of D=2"),
])
def test_recipe_settings_that_cannot_be_predicted_say_why_in_one_line(settings, why):
    from gpipe_cli.plan.runner import as_written_line

    recipe = load_recipe(None, settings, check_data=False)
    model, hw = SimpleNamespace(batch=recipe.data.batch_size, layers=6), SimpleNamespace(devices=2)
    line = as_written_line(model, hw, recipe, None, 0.0)
    assert line.startswith("the recipe as written (") and why in line and "\n" not in line


def test_recipe_settings_the_layers_cannot_take_say_so(tmp_path, capsys):
    recipe = write(tmp_path, {**TINY, "pipeline": {"partitions": 2, "microbatches": 1, "balance": [1, 1]}})
    assert run(["plan", str(recipe), "--devices", "2", "--tflops", "100", "--plain"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("the recipe as written"))
    assert ("(K=2 D=1 M=1 gpipe except_last) is not compared: balance [1, 1] sums to 2 but the model has 4 pipeline "
            "layers") in line


COMMENTED = """\
# A tiny language model, planned by the tests.
name: tiny-lm   # the run's folder
seed: 0
model:
  kind: transformer
  arch: decoder-only
  layers: 2        # two decoder layers
  d_model: 16
  ff: 32
  heads: 2
  vocab_size: 64
  max_len: 8
  dropout: 0.0
data:
  source: synthetic
  batch_size: 8    # examples per step
  synthetic_size: 64
train:
  steps: 2
optimizer:
  name: adam
  lr: 1.0e-3       # written as the user likes it
"""


def test_the_written_recipe_keeps_the_users_comments_and_order_and_replanning_replaces_its_first_line(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(COMMENTED)
    output, again = tmp_path / "planned.yaml", tmp_path / "again.yaml"
    assert run(["plan", str(recipe), "--devices", "2", "--tflops", "100", "--output", str(output), "--plain",
                "--set", "train.steps=5"]) == 0
    written = output.read_text()
    lines = written.splitlines()
    assert lines[0].startswith("# written by gpipe plan for 2 devices")
    assert "\n".join(lines[1:5]) == "\n".join(COMMENTED.splitlines()[:4])  # the user's comments, as written
    for kept in ("  layers: 2        # two decoder layers", "  batch_size: 8    # examples per step",
                 "  lr: 1.0e-3       # written as the user likes it", "  steps: 5"):
        assert kept in lines, kept
    sections = [line.rstrip(":") for line in lines if re.match(r"^[a-z_]+:$", line)]
    assert sections == ["model", "pipeline", "data", "train", "optimizer"]  # the plan's section after the model
    planned = load_recipe(output)
    assert planned.train.steps == 5 and planned.pipeline.partitions * planned.pipeline.data_parallel == 2
    assert run(["plan", str(output), "--devices", "2", "--tflops", "100", "--output", str(again), "--plain"]) == 0
    replanned = again.read_text().splitlines()
    assert replanned[0].startswith("# written by gpipe plan") and not replanned[1].startswith("# written by")
    assert replanned[1:] == lines[1:]


def test_a_recipe_with_more_chunks_than_layers_names_its_chunks_k_and_v(tmp_path, capsys):
    pipeline = {"partitions": 4, "microbatches": 4, "schedule": "interleaved", "virtual_stages": 2}
    recipe = write(tmp_path, {**TINY, "pipeline": pipeline})
    assert run(["plan", str(recipe), "--devices", "4", "--tflops", "100", "--plain"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("the recipe as written"))
    assert line.endswith("is not compared: cannot cut 4 pipeline layers into 8 chunks (pipeline.partitions 4 x "
                         "pipeline.virtual_stages 2): at most 4"), line


def test_more_ranks_per_node_than_this_machines_cores_is_warned_of(tmp_path, capsys, monkeypatch):
    # Trained here they take turns on the cores; the plan said nothing and predicted each with a core of its own.
    monkeypatch.setattr("gpipe_cli.contention.usable_cores", lambda: 2)
    recipe = write(tmp_path, {**TINY, "train": {"steps": 2, "device": "cpu"}})  # a GPU host's ranks: one GPU each
    assert run(["plan", str(recipe), "--devices", "4", "--timing", "estimate"]) == 0
    out = capsys.readouterr().out
    assert "warning: 4 ranks per node on this machine's 2 CPU cores would take turns on them (oversubscribed)" in out
    for devices in (["--devices", "2"], ["--devices", "4", "--tflops", "100"]):  # devices priced, not timed here
        assert run(["plan", str(recipe), *devices, "--timing", "estimate"]) == 0
        assert "oversubscribed" not in capsys.readouterr().out
