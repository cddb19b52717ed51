"""`gpipe export` writes the newest verified checkpoint as a file `gpipe predict` can use on its own."""

import base64
import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from gpipe_cli.errors import UserError
from gpipe_cli.train import checkpoint
from gpipe_cli.train import export as export_module
from gpipe_cli.train.export import export
from tests.train.as_ranks import gpipe_train
from tests.train.recipes import TINY_TRANSLATION, write
from tests.train.test_checkpoint import flip, save_one


def test_export_skips_a_checkpoint_with_flipped_bytes(tmp_path, capsys):
    save_one(tmp_path, 5, value=1.0)
    save_one(tmp_path, 6, value=2.0)
    newest = checkpoint.path_for(tmp_path, 6)
    flip(next(p for p in newest.iterdir() if p.suffix == ".distcp"))
    path = export(str(tmp_path), str(tmp_path / "model.safetensors"))
    weights = load_file(str(path))
    assert torch.all(weights["weight"] == 1.0), "the weights come from step 5, the newest verified checkpoint"
    err = capsys.readouterr().err
    assert "step-00000006" in err and "does not match its checksum" in err


def test_an_export_of_an_earlier_checkpoint_into_the_run_says_it_now_holds_older_weights(tmp_path, capsys):
    # It replaced the run's export of step 6 with step 5's without a word; predict said so only later.
    save_one(tmp_path, 5, value=1.0)
    save_one(tmp_path, 6, value=2.0)
    assert export(str(checkpoint.path_for(tmp_path, 5))) == tmp_path / "model.safetensors"
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"[gpipe] '{tmp_path / 'model.safetensors'}' now holds step 5, not the run's newest checkpoint (step 6): "
        f"gpipe export {tmp_path} writes that one")
    export(str(tmp_path))  # the run's newest: nothing to say of it
    assert "now holds" not in capsys.readouterr().err


def test_a_checkpoint_the_training_prunes_while_it_is_read_gives_way_to_the_newest_then(tmp_path, monkeypatch):
    # With checkpoint.keep: 1, an export while the run trained failed in 6 of 14 tries with a FileNotFoundError
    # traceback: the folder it read was removed for the next checkpoint.
    import shutil

    save_one(tmp_path, 5, value=1.0)
    save_one(tmp_path, 6, value=2.0)
    real, reads = export_module._read, []

    def pruned_midway(found, dtype):  # type: ignore[no-untyped-def]
        reads.append(found.step)
        if len(reads) == 1:
            shutil.rmtree(found.path)
            raise FileNotFoundError(2, "No such file or directory", str(found.path / "recipe.yaml"))
        return real(found, dtype)

    monkeypatch.setattr(export_module, "_read", pruned_midway)
    path = export(str(tmp_path), str(tmp_path / "model.safetensors"))
    assert reads == [6, 5] and torch.all(load_file(str(path))["weight"] == 1.0)


def test_a_checkpoint_pruned_after_its_tensors_are_read_is_not_exported_as_weights_alone(tmp_path, monkeypatch):
    # Pruned between its tensors and its recipe.yaml, it was written without the recipe (exit 0), unusable.
    import shutil

    save_one(tmp_path, 5, value=1.0)
    save_one(tmp_path, 6, value=2.0)
    newest = checkpoint.path_for(tmp_path, 6)
    (newest / "recipe.yaml").write_text("name: pruned\n")
    real = export_module.dcp.load

    def pruned_after(*args, **kwargs):  # type: ignore[no-untyped-def]
        real(*args, **kwargs)
        if newest.exists():
            shutil.rmtree(newest)

    monkeypatch.setattr(export_module.dcp, "load", pruned_after)
    path = export(str(tmp_path), str(tmp_path / "model.safetensors"))
    assert torch.all(load_file(str(path))["weight"] == 1.0)  # step 5, the newest once step 6 was gone


def test_an_export_with_standard_output_closed_is_written_without_a_word(tmp_path, monkeypatch, capsys):
    # `gpipe export RUN >&-` wrote the file, then ended in an AttributeError traceback saying where.
    from gpipe_cli.cli import run

    save_one(tmp_path, 5, value=1.0)
    monkeypatch.setattr("sys.stdout", None)
    assert run(["export", str(tmp_path), "--output", str(tmp_path / "m.safetensors")]) == 0
    assert "Traceback" not in capsys.readouterr().err
    assert torch.all(load_file(str(tmp_path / "m.safetensors"))["weight"] == 1.0)


# A fresh process that runs `gpipe predict` and, on its way out, writes the gpipe_cli modules it loaded.
_RECORDING = """
import atexit, json, runpy, sys
record = sys.argv.pop(1)
atexit.register(lambda: open(record, "w").write(json.dumps(sorted(sys.modules))))
sys.argv[0] = "gpipe"
runpy.run_module("gpipe_cli.cli", run_name="__main__")
"""
_LOADS_ANYWAY = "import json, sys, gpipe_cli.cli, gpipe_cli.models.registry; print(json.dumps(sorted(sys.modules)))"


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """The tiny translation recipe trained for 3 steps in one process, as torchrun's one rank: its run directory."""
    folder = tmp_path_factory.mktemp("trained")
    recipe = copy.deepcopy(TINY_TRANSLATION)
    recipe["pipeline"]["partitions"] = 1  # the checkpoint holds both names of the tied weight all the same
    ranks = gpipe_train(1, str(write(folder, recipe)), "--output-dir", str(folder / "run"), "--threads", "1")
    assert ranks.code == 0, ranks.output[-4000:]
    return folder / "run"


@pytest.mark.slow
def test_an_export_holds_its_recipe_tie_map_and_tokenizer_with_tied_weights_once(trained, tmp_path):
    path = export(str(trained), str(tmp_path / "model.safetensors"))
    with safe_open(str(path), framework="pt") as f:
        meta, names = f.metadata(), set(f.keys())
    assert meta["recipe"] == (trained / "recipe.yaml").read_text()
    assert base64.b64decode(meta["tokenizer"]) == (trained / "tokenizer.model").read_bytes()
    tied = json.loads(meta["tied"])
    assert tied == {"5.proj.weight": "0.embed.weight"}, "2 encoder and 2 decoder layers: the softmax is layer 5"
    assert "0.embed.weight" in names and "5.proj.weight" not in names
    assert meta["dtype"] == "float32" and meta["task"] == "translation"
    half = export(str(trained), str(tmp_path / "half.safetensors"), dtype="bfloat16")
    weights = load_file(str(half))
    assert {v.dtype for v in weights.values() if v.is_floating_point()} == {torch.bfloat16}
    assert safe_open(str(half), framework="pt").metadata()["dtype"] == "bfloat16"
    assert sorted(tmp_path.iterdir()) == [half, path], "no temporary file is left behind"


@pytest.mark.slow
def test_predict_translates_as_the_training_decoder_in_a_process_without_the_engine(trained, tmp_path):
    from gpipe_cli.data.tokenizer import Tokenizer
    from gpipe_cli.models.transformer.decode import translation_limit
    from gpipe_cli.models.weights import parse
    from gpipe_cli.pipeline import topology
    from gpipe_cli.pipeline.config import PipelineConfig
    from gpipe_cli.pipeline.engine import Pipeline
    from gpipe_cli.train.evaluation import greedy_decode

    path = export(str(trained), str(tmp_path / "model.safetensors"))
    sentences = ["three hundred twelve", "seven"]
    loaded = tmp_path / "modules.json"
    proc = subprocess.run([sys.executable, "-c", _RECORDING, str(loaded), "predict", str(path), *sentences],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    baseline = subprocess.run([sys.executable, "-c", _LOADS_ANYWAY], capture_output=True, text=True, timeout=120)
    # The command line's flag checks and the models' layers (dropout, batchnorm) load a few torch-light modules
    # of the pipeline package; predict must load none beyond them: no engine, stage, transport or topology.
    engine = {m for m in json.loads(loaded.read_text()) if m.startswith("gpipe_cli.pipeline")}
    assert engine <= set(json.loads(baseline.stdout)), engine - set(json.loads(baseline.stdout))
    assert not engine & {"gpipe_cli.pipeline.engine", "gpipe_cli.pipeline.stage", "gpipe_cli.pipeline.comm",
                         "gpipe_cli.pipeline.topology"}

    # The training's decoder, through a one-stage pipeline, on the same weights and the same sentences.
    with safe_open(str(path), framework="pt") as f:
        exported = parse({name: f.get_tensor(name) for name in f.keys()}, f.metadata())  # noqa: SIM118
    layers = list(exported.build())
    topo = topology.local()
    pipe = Pipeline(layers, topo, PipelineConfig(balance=(len(layers),)), exported.spec.loss,
                    tied=exported.spec.tied)
    tok = Tokenizer(exported.tokenizer or b"")
    max_len = exported.spec.config["max_len"]
    expected = []
    for sentence in sentences:
        ids = tok.encode(sentence)[:max_len]
        out = greedy_decode(pipe, topo, torch.tensor([ids]), 1, translation_limit(len(ids), max_len),
                            tok.vocab_size)
        expected.append(tok.decode(out[0]))
    assert proc.stdout.split("\n")[:-1] == expected


def older_run(trained: Path, tmp_path: Path) -> tuple[Path, dict]:
    """A copy of the run whose checkpoint, as an older version's, keeps no recipe (export reads the run's): the run,
    and its recipe to edit."""
    import shutil

    import yaml

    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    older = checkpoint.newest_whole(run_dir)[0].path
    (older / "recipe.yaml").unlink()
    manifest = json.loads((older / "manifest.json").read_text())
    for key in ("files", "checksums"):
        del manifest[key]["recipe.yaml"]
    (older / "manifest.json").write_text(json.dumps(manifest))
    return run_dir, yaml.safe_load((run_dir / "recipe.yaml").read_text())


@pytest.mark.slow
def test_a_run_whose_recipe_was_edited_to_another_model_is_refused_at_export(trained, tmp_path):
    import yaml

    from gpipe_cli.errors import UserError

    run_dir, recipe = older_run(trained, tmp_path)
    recipe["model"]["d_model"] *= 2
    (run_dir / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    with pytest.raises(UserError, match=r"recipe.yaml does not describe the checkpoint's model: \S+ has shape"):
        export(str(run_dir), str(tmp_path / "model.safetensors"))
    assert not (tmp_path / "model.safetensors").exists()


def test_a_recipe_a_later_version_refuses_outside_the_model_and_data_is_still_exported(trained, tmp_path, capsys):
    # train.stall_timeout 5, allowed when the run was made, blocked the export of its model for good.
    import yaml

    run_dir, recipe = older_run(trained, tmp_path)
    recipe["train"]["stall_timeout"] = 5
    (run_dir / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    capsys.readouterr()
    exported = export(str(run_dir), str(tmp_path / "model.safetensors"))
    assert safe_open(str(exported), framework="pt").metadata()["recipe"] == (run_dir / "recipe.yaml").read_text()
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "stall_timeout" in x]
    assert line.startswith(f"[gpipe] {run_dir / 'recipe.yaml'}: train.stall_timeout: must be >= ") and \
        line.endswith(": the export reads only its model and data settings, which are valid")
    recipe["model"]["heads"] = 0  # its model refused: that error, as before
    (run_dir / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    with pytest.raises(UserError, match=r"model.heads: must be >= 1 .*\(and 1 more problem\)$"):
        export(str(run_dir), str(tmp_path / "again.safetensors"))


def test_a_checkpoint_is_exported_with_its_own_recipe_not_the_run_s_newer_one(trained, tmp_path, capsys):
    # A resume with model.logit_clip 0.5 rewrote the run's recipe.yaml; an export of an earlier checkpoint then
    # described a model that step never was (its translations differed); one copied out of its run read the
    # recipe two folders above it, or none.
    import shutil

    import yaml

    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    own = checkpoint.newest_whole(run_dir)[0].path
    recipe = yaml.safe_load((run_dir / "recipe.yaml").read_text())
    recipe["model"]["logit_clip"] = 0.5
    (run_dir / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    exported = export(str(own), str(tmp_path / "own.safetensors"))
    assert safe_open(str(exported), framework="pt").metadata()["recipe"] == (own / "recipe.yaml").read_text()
    copied = tmp_path / "elsewhere" / own.name
    shutil.copytree(own, copied)
    (tmp_path / "tokenizer.model").write_bytes(b"another run's")  # two folders above: no run of this checkpoint
    capsys.readouterr()
    exported = export(str(copied), str(tmp_path / "copied.safetensors"))
    meta = safe_open(str(exported), framework="pt").metadata()
    assert meta["recipe"] == (own / "recipe.yaml").read_text() and meta["task"] == "translation"
    assert "tokenizer" not in meta and capsys.readouterr().err == (
        f"[gpipe] {tmp_path / 'elsewhere' / own.name} lies outside its run, whose tokenizer.model it does not hold: "
        "the export holds no tokenizer, so gpipe predict cannot run it (its weights and recipe still load in Python)\n")
    from gpipe_cli.cli import run
    from tests.train.test_export_inputs import one_error_line

    code = run(["predict", str(exported), "one"])  # its advice was to export "the run" again: it has none
    captured = capsys.readouterr()
    assert one_error_line(code, captured.err, captured.out).endswith(
        "does not hold); export the checkpoint from its run's checkpoints/ folder, beside the run's tokenizer")


def unseeded() -> None:
    """A rank's torch generator as a process started afresh has it (a forked one has its server's): at random."""
    torch.seed()


@pytest.mark.slow
def test_one_recipe_trained_twice_writes_the_same_checkpoint_and_export_bytes(trained, tmp_path):
    # Torch's own generator, which nothing draws from, was saved unseeded: every shard's checksum differed; and
    # safetensors wrote the export's metadata in a hash map's order, another file each time.
    import hashlib

    again = tmp_path / "again"
    recipe = copy.deepcopy(TINY_TRANSLATION)
    recipe["pipeline"]["partitions"] = 1
    ranks = gpipe_train(1, str(write(tmp_path, recipe)), "--output-dir", str(again), "--threads", "1",
                        before=unseeded)
    assert ranks.code == 0, ranks.output[-4000:]
    first, second = (checkpoint.newest_whole(run)[0] for run in (trained, again))
    assert first is not None and second is not None
    shards = [{k: v for k, v in found.manifest["checksums"].items() if k != ".metadata"} for found in (first, second)]
    assert shards[0] == shards[1] and shards[0]  # .metadata names its folder
    digests = {hashlib.sha256(export(str(trained), str(tmp_path / f"{n}.safetensors")).read_bytes()).hexdigest()
               for n in range(3)}
    assert len(digests) == 1


def test_a_checkpoint_folder_renamed_is_known_by_its_manifest(trained, tmp_path, capsys):
    # `cp -r checkpoints/step-00000004 best` then `gpipe export best` was "not a run directory".
    import shutil

    own = checkpoint.newest_whole(trained)[0].path
    exported = load_file(str(export(str(own), str(tmp_path / "own.safetensors"))))
    for renamed in (tmp_path / "best", tmp_path / "run" / "checkpoints" / "good"):
        shutil.copytree(own, renamed)
        again = load_file(str(export(str(renamed), str(tmp_path / f"{renamed.name}.safetensors"))))
        assert again.keys() == exported.keys() and all(torch.equal(again[k], exported[k]) for k in exported)
    run = shutil.copytree(trained, tmp_path / "renamed-run")
    for found in (run / "checkpoints").iterdir():  # every step-* moved aside by hand: named, each still reads
        found.rename(found.with_name(f"kept-{found.name.removeprefix('step-')}"))
    with pytest.raises(UserError, match=r"holds 'kept-\d+', not named step-\*: export one by its path$"):
        export(str(run), str(tmp_path / "none.safetensors"))
    shutil.copytree(tmp_path / "best", tmp_path / "not-one")
    (tmp_path / "not-one" / "manifest.json").unlink()  # an unfinished save, or any folder: not a checkpoint
    with pytest.raises(UserError, match="not a run directory"):
        export(str(tmp_path / "not-one"), str(tmp_path / "no.safetensors"))


@pytest.mark.slow
def test_a_damaged_tokenizer_is_said_at_export_and_left_out(trained, tmp_path, capsys):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    (run_dir / "tokenizer.model").write_bytes(b"")
    path = export(str(run_dir), str(tmp_path / "model.safetensors"))
    err = capsys.readouterr().err
    assert "tokenizer.model' is empty (0 bytes), not a sentencepiece model" in err
    assert "the export holds no tokenizer" in err
    with safe_open(str(path), framework="pt") as f:
        assert "tokenizer" not in f.metadata()


@pytest.mark.slow
def test_a_tokenizer_that_cannot_be_read_refuses_the_export(trained, tmp_path, monkeypatch):
    # It was called "not a sentencepiece model" and left out, and the export that predict refuses exited 0.
    def refused(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr("gpipe_cli.train.export.open", refused, raising=False)
    with pytest.raises(UserError, match=r"^cannot read the run's tokenizer '.*tokenizer\.model' \(Permission denied\); "
                                        "the export holds it for gpipe predict$"):
        export(str(trained), str(tmp_path / "model.safetensors"))
    assert not (tmp_path / "model.safetensors").exists()


@pytest.mark.slow
def test_an_export_of_a_run_without_its_tokenizer_is_written_and_predict_says_why_it_cannot_run_it(
        trained, tmp_path, capsys, monkeypatch):
    # Its weights and recipe still load in Python; the tokenizer was left out with a warning, and predict said only
    # "gpipe export said why".
    import shutil

    from gpipe_cli.cli import run
    from tests.train.test_export_inputs import one_error_line

    shutil.copytree(trained, tmp_path / "run")
    (tmp_path / "run" / "tokenizer.model").unlink()
    monkeypatch.chdir(tmp_path)
    assert run(["export", "run"]) == 0
    missing = f"tokenizer file {str(tmp_path / 'run' / 'tokenizer.model')!r} does not exist"
    err = capsys.readouterr().err
    assert f"[gpipe] {missing}: the export holds no tokenizer, so gpipe predict cannot run it" in err, err
    with safe_open(str(tmp_path / "run" / "model.safetensors"), framework="pt") as f:
        assert f.metadata()["no_tokenizer"] == missing
    monkeypatch.chdir(tmp_path / "run")  # named whole: from another folder too
    code = run(["predict", ".", "seven"])
    captured = capsys.readouterr()
    assert one_error_line(code, captured.err, captured.out) == (
        f"error: the export holds no tokenizer, so gpipe predict cannot run it (at export, {missing}); export the run "
        "again once its tokenizer file loads")


def test_a_cast_that_overflows_is_refused_and_weights_not_finite_are_said(tmp_path, capsys):
    # --dtype float16 of a weight past 65504 wrote infinity, and gpipe predict then refused the export.
    big = {"0.weight": torch.tensor([1.0, 1e6]), "0.steps": torch.tensor([3])}
    with pytest.raises(UserError, match=r"^--dtype float16: the checkpoint's weights do not all fit its range "
                                        r"\(0\.weight: 1 of its 2 values is infinite once cast\); give --dtype "
                                        r"bfloat16 or float32$"):
        export_module._described(big, tmp_path, tmp_path / "recipe.yaml", 1, "float16")
    stored, _ = export_module._described(big, tmp_path, tmp_path / "recipe.yaml", 1, "bfloat16")
    assert stored["0.weight"].dtype == torch.bfloat16 and bool(torch.isfinite(stored["0.weight"]).all())
    capsys.readouterr()
    # Weights that are not finite already are the checkpoint's own: written, and said.
    export_module._described({"0.weight": torch.tensor([float("nan"), 1.0])}, tmp_path, tmp_path / "recipe.yaml", 1,
                              "float16")
    assert "the checkpoint's weights are not all finite (0.weight: 1 of its 2 values is NaN): gpipe predict " \
           "refuses the export" in capsys.readouterr().err


def test_an_export_of_the_runs_newest_checkpoint_named_by_its_folder_says_nothing_of_older_weights(tmp_path, capsys):
    save_one(tmp_path, 5, value=1.0)
    save_one(tmp_path, 6, value=2.0)
    assert export(str(checkpoint.path_for(tmp_path, 6))) == tmp_path / "model.safetensors"
    assert "now holds" not in capsys.readouterr().err
