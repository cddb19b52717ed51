"""Malformed and hostile recipes and arguments: each is one line on stderr, exit code 2, nothing written.

Most cases run in this process through `gpipe_cli.cli.run`, the function the `gpipe` command calls; a
few go through a real subprocess, where a hang or a memory blow-up would show.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpipe_cli.cli import run
from tests.train.recipes import TINY_AMOEBANET

BIG = 10**30
LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]\n" for i in range(8))
Setup = Callable[[Path], str]  # writes a recipe (or other path) under a folder and returns its path


def recipe_text(text: str) -> Setup:
    def setup(folder: Path) -> str:
        path = folder / "recipe.yaml"
        path.write_text(text)
        return str(path)
    return setup


def recipe_with(**changes: Any) -> Setup:
    """The tiny recipe with dotted keys replaced (None removes nothing: it sets null)."""
    recipe = copy.deepcopy(TINY_AMOEBANET)
    for key, value in changes.items():
        *sections, leaf = key.split("__")
        node = recipe
        for section in sections:
            node = node.setdefault(section, {})
        node[leaf] = value
    return recipe_text(yaml.safe_dump(recipe, sort_keys=False))


GOOD = recipe_with()


def fifo(folder: Path) -> str:
    path = folder / "recipe.yaml"
    os.mkfifo(path)
    return str(path)


def oversized(folder: Path) -> str:
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(TINY_AMOEBANET) + f"# {'x' * (1 << 20)}\n")
    return str(path)


def directory(folder: Path) -> str:
    (folder / "recipes").mkdir()
    return str(folder / "recipes")


def not_utf8(folder: Path) -> str:
    path = folder / "recipe.yaml"
    path.write_bytes(b"name: \xff\xfe\n")
    return str(path)


def utf16(folder: Path) -> str:
    path = folder / "recipe.yaml"
    path.write_text("name: café\n", encoding="utf-16")
    return str(path)


def long_value(folder: Path) -> str:
    recipe = copy.deepcopy(TINY_AMOEBANET)
    recipe["data"]["path"] = "p" * 900_000
    recipe["data"]["source"] = "imagefolder"
    return recipe_text(yaml.safe_dump(recipe))(folder)


def nested(depth: int) -> str:
    return "model: " + "[" * depth + "]" * depth + "\n"


# name: (recipe, extra arguments, a fragment the one line must contain)
CASES: dict[str, tuple[Setup, list[str], str]] = {
    # the file itself
    "missing file": (lambda folder: str(folder / "nope.yaml"), [], "no such recipe file"),
    "blank recipe path": (lambda folder: "   ", [], "the recipe path is only spaces; give a YAML file"),
    "recipe path with a space": (lambda folder: " nope.yaml", [], "' nope.yaml': no such recipe file"),
    "directory": (directory, [], "is a directory"),
    "fifo": (fifo, [], "is not a regular file"),
    "device file": (lambda folder: "/dev/zero", [], "is not a regular file"),
    "over 1 MiB": (oversized, [], "at most 1048576"),
    "not utf-8": (not_utf8, [], "not UTF-8 text (byte 0xff on line 1); a recipe is UTF-8 text"),
    "utf-16": (utf16, [], "not UTF-8 text but UTF-16 (it starts with a UTF-16 byte order mark); a recipe is UTF-8 "
                          "text: save it as UTF-8"),
    "empty": (recipe_text(""), [], "the recipe is empty"),
    "only a comment": (recipe_text("# nothing\n"), [], "the recipe is empty"),
    "a list": (recipe_text("- a\n- b\n"), [], "must be a mapping of sections"),
    "a scalar": (recipe_text("42\n"), [], "must be a mapping of sections"),
    "unclosed bracket": (recipe_text("model: [unclosed\n"), [], "not valid YAML at line"),
    "a negative number too long to read": (recipe_text("name: long\noptimizer:\n  lr: -" + "9" * 5000 + "\n"), [],
                                           "optimizer.lr: must be a number > 0.0"),
    # The misspelt key made a required one missing, and the line named only the missing one.
    "required key misspelt": (recipe_text("metrics:\n  wandb:\n    projct: x\n"), [],
                              "metrics.wandb.projct: unknown key (did you mean metrics.wandb.project?)"),
    "tab indentation": (recipe_text("model:\n\tkind: amoebanet\n"), [], "not valid YAML"),
    "two documents": (recipe_text("name: a\n---\nname: b\n"), [], "not valid YAML"),
    "billion laughs": (recipe_text(LAUGHS), [], "aliases are expanded"),
    "self alias": (recipe_text("model: &m [*m]\n"), [], "an alias refers to itself"),
    "deep nesting": (recipe_text(nested(100)), [], "levels deep"),
    "very deep nesting": (recipe_text(nested(5000)), [], "levels deep"),
    "duplicate top key": (recipe_text("name: a\ntrain: {steps: 1}\nname: b\n"), [], "line 3: duplicate key 'name'"),
    "duplicate nested key": (recipe_text("train:\n  steps: 1\n  steps: 2\n"), [], "duplicate key 'steps'"),
    # More digits than Python reads as text: it said "unreadable value (Exceeds the limit (4300 digits) ...", no key.
    "huge integer literal": (recipe_text(f"seed: {'9' * 5000}\ntrain: {{steps: 1}}\n"), [],
                             "seed: must be >= 0 and <= 4294967295 (got a number of 5000 digits)"),
    "undefined alias": (recipe_text("name: *nothing\n"), [], "not valid YAML"),
    "900 KB value": (long_value, [], "more characters"),
    # keys
    "unknown top key": (recipe_with(colour="blue"), [], "colour: unknown key"),
    "misspelt section": (recipe_with(pipline={"partitions": 2}), [], "pipline: unknown key"),
    "misspelt key": (recipe_with(pipeline__microbatchs=4), [], "pipeline.microbatchs: unknown key"),
    "section as scalar": (recipe_with(pipeline=3), [], "pipeline: must be a mapping"),
    "section as list": (recipe_with(train=[1, 2]), [], "train: must be a mapping"),
    "model kind": (recipe_with(model__kind="resnet"), [], "model.kind: must be"),
    "model preset": (recipe_with(model={"preset": "nope"}), [], "unknown model preset"),
    "model preset by --set": (GOOD, ["--set", "model.preset=nope"], "--set model.preset: unknown model preset 'nope'"),
    "preset of another kind": (recipe_with(model={"kind": "transformer", "preset": "amoebanet-d-18-256"}), [],
                               "is a model of kind 'amoebanet'; leave model.kind out or set it to 'amoebanet'"),
    # numbers: strict, finite, in range
    "steps true": (GOOD, ["--set", "train.steps=true"], "train.steps: must be a number, not true or false"),
    "steps zero": (GOOD, ["--set", "train.steps=0"], "train.steps: must be >= 1 and <= 1000000000"),
    "steps negative": (GOOD, ["--set", "train.steps=-1"], "train.steps: must be >= 1"),
    "steps 1e20": (GOOD, ["--set", "train.steps=1e20"], "train.steps: must be >= 1 and <= 1000000000"),
    "steps huge int": (GOOD, ["--set", f"train.steps={BIG}"], "train.steps: must be >= 1 and <= 1000000000"),
    "steps fraction": (GOOD, ["--set", "train.steps=1.5"], "train.steps: must be an integer"),
    "steps text": (GOOD, ["--set", "train.steps=many"], "train.steps: must be an integer"),
    "epochs zero": (GOOD, ["--set", "train.epochs=0"], "train.epochs: must be >= 1"),
    "no length": (GOOD, ["--set", "train.steps=null"], "give train.steps or train.epochs"),
    "batch 1e20": (GOOD, ["--set", "data.batch_size=1e20"], "data.batch_size: must be >= 1 and <= 1048576"),
    "batch true": (GOOD, ["--set", "data.batch_size=true"], "data.batch_size: must be a number"),
    "batch zero": (GOOD, ["--set", "data.batch_size=0"], "data.batch_size: must be >= 1"),
    "lr inf": (GOOD, ["--set", "optimizer.lr=.inf"], "optimizer.lr: must be a finite number"),
    "lr minus inf": (GOOD, ["--set", "optimizer.lr=-.inf"], "optimizer.lr: must be a finite number"),
    "lr nan": (GOOD, ["--set", "optimizer.lr=.nan"], "optimizer.lr: must be a finite number"),
    "lr nan text": (GOOD, ["--set", "optimizer.lr=nan"], "optimizer.lr: must be a finite number"),
    "lr zero": (GOOD, ["--set", "optimizer.lr=0"], "optimizer.lr: must be > 0.0"),
    "lr 1e20": (GOOD, ["--set", "optimizer.lr=1e20"], "optimizer.lr: must be > 0.0 and <= 1000000000.0"),
    "lr true": (GOOD, ["--set", "optimizer.lr=true"], "optimizer.lr: must be a number"),
    "lr in file inf": (recipe_with(optimizer__lr=float("inf")), [], "optimizer.lr: must be a finite number"),
    "betas above one": (GOOD, ["--set", "optimizer.betas=[2, 3]"], "optimizer.betas.0: must be < 1.0"),
    "betas one": (GOOD, ["--set", "optimizer.betas=[0.9, 1.0]"], "optimizer.betas.1: must be < 1.0"),
    "betas negative": (GOOD, ["--set", "optimizer.betas=[-0.1, 0.9]"], "optimizer.betas.0: must be >= 0.0"),
    "betas nan": (GOOD, ["--set", "optimizer.betas=[.nan, 0.9]"], "optimizer.betas.0: must be a finite number"),
    "betas one value": (GOOD, ["--set", "optimizer.betas=[0.9]"], "optimizer.betas"),
    "betas text": (GOOD, ["--set", "optimizer.betas=fast"], "optimizer.betas: must be a list"),
    "momentum one": (GOOD, ["--set", "optimizer.momentum=1"], "optimizer.momentum: must be >= 0.0 and < 1.0"),
    "weight decay negative": (GOOD, ["--set", "optimizer.weight_decay=-1"], "optimizer.weight_decay: must be >= 0"),
    "eps zero": (GOOD, ["--set", "optimizer.eps=0"], "optimizer.eps: must be > 0.0"),
    "decay one": (GOOD, ["--set", "optimizer.decay=1"], "optimizer.decay: must be > 0.0 and < 1.0"),
    "optimizer name": (GOOD, ["--set", "optimizer.name=lion"], "optimizer.name: must be"),
    "grad clip zero": (GOOD, ["--set", "train.grad_clip=0"], "train.grad_clip: must be > 0.0"),
    "grad clip inf": (GOOD, ["--set", "train.grad_clip=.inf"], "train.grad_clip: must be a finite number"),
    "log every zero": (GOOD, ["--set", "train.log_every=0"], "train.log_every: must be >= 1"),
    "precision": (GOOD, ["--set", "train.precision=fp8"], "train.precision: must be"),
    "train device": (GOOD, ["--set", "train.device=tpu"], "train.device: must be"),
    "dropout one": (GOOD, ["--set", "model.dropout=1"], "model.dropout: must be >= 0.0 and < 1.0"),
    "dropout nan": (GOOD, ["--set", "model.dropout=.nan"], "model.dropout: must be a finite number"),
    "label smoothing": (GOOD, ["--set", "model.label_smoothing=-0.5"], "model.label_smoothing: must be >= 0.0"),
    "layers zero": (GOOD, ["--set", "model.layers=0"], "model.layers: must be >= 1 and <= 10000"),
    "layers 1e9": (GOOD, ["--set", "model.layers=1e9"], "model.layers: must be >= 1 and <= 10000"),
    "filters 1e20": (GOOD, ["--set", "model.filters=1e20"], "model.filters: must be >= 1 and <= 1048576"),
    "image size small": (GOOD, ["--set", "model.image_size=16"], "model.image_size: must be >= 32"),
    "classes one": (GOOD, ["--set", "model.num_classes=1"], "model.num_classes: must be >= 2"),
    "aux head number": (GOOD, ["--set", "model.aux_head=3"], "model.aux_head: must be true or false"),
    "partitions zero": (GOOD, ["--set", "pipeline.partitions=0"], "pipeline.partitions: must be >= 1 and <= 65536"),
    "partitions 1e6": (GOOD, ["--set", "pipeline.partitions=1e6"], "pipeline.partitions: must be >= 1 and <= 65536"),
    "partitions true": (GOOD, ["--set", "pipeline.partitions=true"], "pipeline.partitions: must be a number"),
    "partitions over layers": (GOOD, ["--set", "pipeline.partitions=45"], "cannot cut 44 pipeline layers into 45"),
    "microbatches zero": (GOOD, ["--set", "pipeline.microbatches=0"], "pipeline.microbatches: must be >= 1"),
    "microbatches over batch": (GOOD, ["--set", "pipeline.microbatches=32"], "must be <= data.batch_size"),
    # A micro-batch of one image ended in BatchNorm's traceback ("Expected more than 1 value per channel").
    "one image per micro-batch": (GOOD, ["--set", "pipeline.microbatches=16"], "pipeline.microbatches (16) must be "
                                  "<= data.batch_size (16) / 2: every micro-batch needs 2 examples (AmoebaNet's batch "
                                  "normalisation needs two to train on)"),
    "one image per replica's micro-batch": (GOOD, ["--set", "pipeline.data_parallel=3"], "pipeline.microbatches x "
                                            "pipeline.data_parallel (4 x 3) must be <= data.batch_size (16) / 2"),
    "data parallel zero": (GOOD, ["--set", "pipeline.data_parallel=0"], "pipeline.data_parallel: must be >= 1"),
    "replicas over batch": (GOOD, ["--set", "pipeline.data_parallel=5"], "pipeline.microbatches x "
                            "pipeline.data_parallel (4 x 5) must be <= data.batch_size (16): the smallest share of "
                            "the 5 replicas is 3 of the mini-batch's examples"),
    "replicas over examples": (GOOD, ["--set", "pipeline.data_parallel=64"],
                               "the smallest share of the 64 replicas is 0"),
    "balance zero entry": (GOOD, ["--set", "pipeline.balance=[9, 0]"], "pipeline.balance: every entry"),
    "balance bool entry": (GOOD, ["--set", "pipeline.balance=[true, 8]"], "pipeline.balance: every entry must be a "
                           "number of layers from 1 to 10000 (got true in [true, 8])"),  # YAML's words, not Python's
    "balance huge entry": (GOOD, ["--set", f"pipeline.balance=[{BIG}, 1]"], "pipeline.balance: every entry"),
    "balance word": (GOOD, ["--set", "pipeline.balance=fast"], "pipeline.balance: must be 'auto'"),
    "balance length": (GOOD, ["--set", "pipeline.balance=[3, 3, 3]"], "pipeline.balance has 3 entries"),
    "schedule": (GOOD, ["--set", "pipeline.schedule=zb"], "pipeline.schedule: must be"),
    "schedule null": (GOOD, ["--set", "pipeline.schedule=null"], "'zero-bubble-v' or 'v-half' (got null)"),
    "remat": (GOOD, ["--set", "pipeline.checkpoint=sometimes"], "pipeline.checkpoint: must be"),
    "backend": (GOOD, ["--set", "pipeline.backend=mpi"], "pipeline.backend: must be"),
    "data source": (GOOD, ["--set", "data.source=s3"], "data.source: must be"),
    "data path missing": (GOOD, ["--set", "data.source=jsonl"], "data.path is required"),
    "data path absent": (GOOD, ["--set", "data.source=imagefolder", "--set", "data.path=/no/such"], "no such file"),
    "eval fraction one": (GOOD, ["--set", "data.eval_fraction=1"], "data.eval_fraction: must be >= 0.0 and < 1.0"),
    "seq len zero": (GOOD, ["--set", "data.seq_len=0"], "data.seq_len: must be >= 1"),
    "synthetic negative": (GOOD, ["--set", "data.synthetic_size=-5"], "data.synthetic_size: must be >= 1"),
    "shuffle number": (GOOD, ["--set", "data.shuffle=3"], "data.shuffle: must be true or false"),
    "drop last word": (GOOD, ["--set", "data.drop_last=maybe"], "data.drop_last: must be true or false"),
    "tokenizer missing": (GOOD, ["--set", "data.tokenizer=/no/such.model"], "data.tokenizer: no such"),
    "steps quoted": (GOOD, ["--set", 'train.steps="5"'], "train.steps: must be a number, not a string"),
    "lr quoted": (GOOD, ["--set", "optimizer.lr='0.1'"], "optimizer.lr: must be a number, not a string"),
    "betas short": (GOOD, ["--set", "optimizer.betas=[0.9]"], "optimizer.betas: must be a list of 2 numbers"),
    "number key": (GOOD, ["--set", "train={1: 2}"], "train.1: a key must be a name, not a number (got 1)"),
    "profile steps short": (GOOD, ["--set", "train.profile.steps=[1]"], "train.profile.steps: must be a list of 2"),
    "tokenizer directory": (GOOD, ["--set", "data.tokenizer=/"], "data.tokenizer: '/' is a directory"),
    "warmup negative": (GOOD, ["--set", "schedule.warmup_steps=-1"], "schedule.warmup_steps: must be >= 0"),
    "decay rate zero": (GOOD, ["--set", "schedule.decay_rate=0"], "schedule.decay_rate: must be > 0.0"),
    "min lr inf": (GOOD, ["--set", "schedule.min_lr=.inf"], "schedule.min_lr: must be a finite number"),
    "schedule name": (GOOD, ["--set", "schedule.name=linear"], "schedule.name: must be"),
    "checkpoint every zero": (GOOD, ["--set", "checkpoint.every=0"], "checkpoint.every: must be >= 1"),
    "checkpoint keep zero": (GOOD, ["--set", "checkpoint.keep=0"], "checkpoint.keep: must be >= 1"),
    "eval every zero": (GOOD, ["--set", "eval.every=0"], "eval.every: must be >= 1"),
    "eval batches negative": (GOOD, ["--set", "eval.batches=-1"], "eval.batches: must be >= 1"),
    "seed negative": (GOOD, ["--set", "seed=-1"], "seed: must be >= 0 and <= 4294967295"),
    "seed huge": (GOOD, ["--set", f"seed={BIG}"], "seed: must be >= 0 and <= 4294967295"),
    "name space": (GOOD, ["--set", "name=has space"], "name: may contain only"),
    "name path": (GOOD, ["--set", "name=../escape"], "name: may contain only"),
    "name empty": (GOOD, ["--set", "name="], "name: must be a string"),
    "name long": (GOOD, ["--set", f"name={'n' * 300}"], "name: must be at most 128 characters"),
    "50 KB set value": (GOOD, ["--set", f"data.source={'s' * 50_000}"], "more characters"),
    # --set syntax
    "set no equals": (GOOD, ["--set", "pipeline.partitions"], "--set expects KEY=VALUE"),
    "set no key": (GOOD, ["--set", "=3"], "--set expects KEY=VALUE"),
    "set empty part": (GOOD, ["--set", "a..b=1"], "--set expects KEY=VALUE"),
    "set leading dot": (GOOD, ["--set", ".a=1"], "--set expects KEY=VALUE"),
    "set below a value": (GOOD, ["--set", "train.steps.max=3"], "is a value, not a section"),
    "set self alias": (GOOD, ["--set", "pipeline.balance=&a [*a]"], "an alias refers to itself"),
    "set duplicate keys": (GOOD, ["--set", "train={steps: 1, steps: 2}"], "duplicate key 'steps'"),
    "set laughs": (GOOD, ["--set", "model.x=" + "[" * 70 + "]" * 70], "levels deep"),
    # bytes that are not UTF-8, as Python hands them over (PEP 383): the recipe file's rule, on the command line
    "set not utf-8": (GOOD, ["--set", "name=caf\udce9"], "not UTF-8 text (byte 0xe9 at character 9)"),
    # arguments
    "threads zero": (GOOD, ["--threads", "0"], "--threads: must be >= 1"),
    "threads negative": (GOOD, ["--threads", "-3"], "--threads"),
    "threads word": (GOOD, ["--threads", "many"], "--threads"),
    "threads decimal": (GOOD, ["--threads", "2.0"], "--threads: must be a whole number written in digits, e.g. 4 "
                        "(got '2.0') (see 'gpipe train --help')"),
    "threads beyond any machine": (GOOD, ["--threads", "100000"], "--threads: must be >= 1 and <= 1024 (got 100000)"),
    "nnodes zero": (GOOD, ["--nnodes", "0"], "--nnodes: must be >= 1 and <= 65536 (got 0)"),
    "nnodes reversed": (GOOD, ["--nnodes", "2:1"], "--nnodes: must satisfy"),
    "nnodes word": (GOOD, ["--nnodes", "two"], "--nnodes: must be N or MIN:MAX"),
    "nnodes without max": (GOOD, ["--nnodes", "1:", "--rdzv-endpoint", "h:1"], "--nnodes: must be N or MIN:MAX"),
    "nnodes empty": (GOOD, ["--nnodes", ""], "--nnodes: must be N or MIN:MAX (got '')"),
    # Started on MIN nodes, the job would have too few ranks for its pipeline.
    "nnodes range": (GOOD, ["--nnodes", "1:2", "--rdzv-endpoint", "h:1"], "--nnodes 1:2: the job needs all of its "),
    # It advised --nnodes 3, which 2 ranks do not divide over.
    "nnodes range past the ranks": (GOOD, ["--nnodes", "2:3", "--rdzv-endpoint", "h:1"],
                                    "give one number of nodes that divides them, e.g. --nnodes 2"),
    # Every node would be node 0.
    "static without node rank": (GOOD, ["--rdzv-backend", "static", "--nnodes", "2", "--rdzv-endpoint", "h:1"],
                                 "--rdzv-backend static: give each of the 2 nodes its --node-rank (0 to 1)"),
    "empty rendezvous id": (GOOD, ["--rdzv-id", "", "--nnodes", "2", "--rdzv-endpoint", "h:1"],
                            "--rdzv-id: an empty id names no job"),
    "node rank word": (GOOD, ["--node-rank", "first"], "--node-rank"),
    "unknown option": (GOOD, ["--fast"], "No such option: --fast"),
    "nodes without endpoint": (GOOD, ["--nnodes", "2"], "needs --rdzv-endpoint HOST:PORT"),
    "endpoint without port": (GOOD, ["--nnodes", "2", "--rdzv-endpoint", "host"], "--rdzv-endpoint: must be"),
    "endpoint port zero": (GOOD, ["--rdzv-endpoint", "host:0"], "--rdzv-endpoint: must be"),
    "node rank out of range": (GOOD, ["--node-rank", "3"], "--node-rank: must be >= 0 and < the number of nodes"),
    "rendezvous backend": (GOOD, ["--rdzv-backend", "etcd"], "--rdzv-backend: must be 'static' or 'c10d'"),
    # It was dropped without a word: c10d ranks the nodes itself.
    "node rank under c10d": (GOOD, ["--nnodes", "2", "--node-rank", "0", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                                    "h:1"], "--node-rank: c10d ranks the nodes as they join; leave --node-rank out"),
    "ranks over nodes": (GOOD, ["--nnodes", "3", "--rdzv-endpoint", "h:1"], "does not divide over 3 nodes"),
    "resume missing": (GOOD, ["--resume", "/no/such/run"], "--resume: no such run directory"),
    "empty recipe path": (lambda folder: "", [], "the recipe path is empty"),
    # control characters, which YAML refuses while reading the text
    "nul byte": (recipe_text("name: a\0b\ntrain: {steps: 1}\n"), [], "line 1, column 8: control character U+0000"),
    "escape in file": (recipe_text("train: {steps: 1}\nname: \x1b[31m\n"), [], "line 2, column 7: control character"),
    "set control character": (GOOD, ["--set", "name=a\x01"], "name: may contain only"),
    # seconds: as strict as any other number
    "stall timeout quoted": (GOOD, ["--set", 'train.stall_timeout="5"'], "train.stall_timeout: must be a number, "
                             "not a string"),
    "stall timeout true": (GOOD, ["--set", "train.stall_timeout=true"], "train.stall_timeout: must be a number"),
    "stall timeout huge": (GOOD, ["--set", "train.stall_timeout=1e300"], "train.stall_timeout: must be >= 10.0 "
                           "and <= 1000000000.0"),
    "stall timeout zero": (GOOD, ["--set", "train.stall_timeout=0"], "train.stall_timeout: must be >= 10.0"),
}


def output_cases() -> dict[str, tuple[Setup, Callable[[Path], str], str]]:
    """Output directories that cannot be written: (recipe, output dir, fragment)."""
    def file_dir(folder: Path) -> str:
        (folder / "taken").write_text("a file")
        return str(folder / "taken")

    def under_file(folder: Path) -> str:
        (folder / "taken").write_text("a file")
        return str(folder / "taken" / "run")

    def broken_link(folder: Path) -> str:
        (folder / "link").symlink_to(folder / "nowhere" / "deeper")
        return str(folder / "link" / "run")

    cases = {"output is a file": (GOOD, file_dir, "exists and is not a directory"),
             "output under a file": (GOOD, under_file, "is not a directory"),
             "output through a broken link": (GOOD, broken_link, "broken link")}
    if Path("/proc/self").is_dir():
        cases["output on a read-only file system"] = (GOOD, lambda folder: "/proc/gpipe-run", "cannot write to")
    if os.geteuid() != 0:  # root writes through permission bits
        def read_only(folder: Path) -> str:
            (folder / "locked").mkdir(mode=0o555)
            return str(folder / "locked" / "run")
        cases["output in a read-only folder"] = (GOOD, read_only, "not writable")
    return cases


def cuda_cases() -> dict[str, tuple[Setup, list[str], str]]:
    """Devices this machine cannot run (only where it has no GPU)."""
    import torch

    if torch.cuda.is_available():
        return {}
    return {"nccl without a GPU": (GOOD, ["--set", "pipeline.backend=nccl"],
                                   "--set pipeline.backend: nccl needs a CUDA GPU and this machine has none visible"),
            "cuda without a GPU": (GOOD, ["--set", "train.device=cuda"],
                                   "--set train.device: cuda needs a CUDA GPU and this machine has none visible")}


def assert_one_line(code: int, err: str, out: str, fragment: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (code, err[-2000:], out[-2000:])
    assert len(lines) == 1, err[-2000:]
    assert lines[0].startswith("error: ") and fragment in lines[0], lines[0][:1000]
    assert len(lines[0]) <= 500, len(lines[0])
    assert "Traceback" not in err + out


def test_there_are_at_least_80_cases():
    assert len(CASES) + len(output_cases()) >= 80


@pytest.fixture
def unmeasured(monkeypatch):
    """The plan's measuring of the model fails the test: what it guards is refused before those seconds."""
    from gpipe_cli import memory_model
    from gpipe_cli.estimate import kept

    def measure(*args, **kwargs):
        raise AssertionError("the model was measured before the refusal")

    monkeypatch.setattr(memory_model, "measure", measure)
    for name in ("summary", "figures"):  # nor its figures read from an earlier launch
        monkeypatch.setattr(kept, name, measure)


def test_a_cut_the_model_cannot_take_is_refused_before_it_is_measured(tmp_path, monkeypatch, capsys, unmeasured):
    monkeypatch.chdir(tmp_path)
    for extra, fragment in ((["--set", "pipeline.partitions=45"], "cannot cut 44 pipeline layers into 45"),
                            (["--set", "pipeline.balance=[40,5]"], "sums to 45 but the model has 44")):
        code = run(["train", GOOD(tmp_path), "--plain", *extra])
        captured = capsys.readouterr()
        assert_one_line(code, captured.err, captured.out, fragment)


@pytest.mark.parametrize("nodes, line", [
    # One number was worded as a range: `must satisfy 0 < MIN <= MAX <= 65536 (got '0')`.
    ("0", "--nnodes: must be >= 1 and <= 65536 (got 0)"),
    ("65537", "--nnodes: must be >= 1 and <= 65536 (got 65537)"),
    ("2:1", "--nnodes: must satisfy 0 < MIN <= MAX <= 65536 (got '2:1')"),
])
def test_nodes_out_of_bounds_are_worded_as_typed_one_number_or_a_range(capsys, nodes, line):
    assert run(["train", "--nnodes", nodes, "--dry-run"]) == 2
    assert capsys.readouterr().err == f"error: {line}\n"


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, monkeypatch, capsys, case):
    setup, extra, fragment = CASES[case]
    monkeypatch.chdir(tmp_path)  # outputs/ would appear here
    recipe = setup(tmp_path)
    out_dir = tmp_path / "out"
    code = run(["train", recipe, "--output-dir", str(out_dir), "--plain", *extra])
    captured = capsys.readouterr()
    assert_one_line(code, captured.err, captured.out, fragment)
    assert not out_dir.exists() and not (tmp_path / "outputs").exists()


@pytest.mark.parametrize("case", list(cuda_cases()) or ["(this machine has a GPU)"])
def test_a_device_this_machine_lacks_is_refused_before_any_rank(tmp_path, monkeypatch, capsys, case, unmeasured):
    cases = cuda_cases()
    if not cases:
        pytest.skip("a CUDA GPU is visible")
    setup, extra, fragment = cases[case]
    monkeypatch.chdir(tmp_path)
    code = run(["train", setup(tmp_path), *extra, "--plain"])
    captured = capsys.readouterr()
    assert_one_line(code, captured.err, captured.out, fragment)
    assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize("case", list(output_cases()))
def test_an_output_directory_that_cannot_be_written_is_refused_before_any_rank(tmp_path, monkeypatch, capsys,
                                                                                case, unmeasured):
    setup, target, fragment = output_cases()[case]
    monkeypatch.chdir(tmp_path)
    recipe = setup(tmp_path)
    output = target(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    code = run(["train", recipe, "--output-dir", output, "--plain"])
    captured = capsys.readouterr()
    assert_one_line(code, captured.err, captured.out, fragment)
    assert sorted(tmp_path.rglob("*")) == before


@pytest.mark.parametrize("case", ["fifo", "billion laughs", "device file", "threads zero", "set self alias"])
def test_through_the_installed_command(tmp_path, case):
    setup, extra, fragment = CASES[case]
    recipe = setup(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "gpipe_cli.cli", "train", recipe, "--output-dir",
                           str(tmp_path / "out"), "--plain", *extra], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert_one_line(proc.returncode, proc.stderr, proc.stdout, fragment)
    assert proc.stdout == ""
    assert not (tmp_path / "out").exists() and not (tmp_path / "outputs").exists()


@pytest.mark.parametrize("command", ["validate", "train"])
def test_validate_refuses_the_same_recipes(tmp_path, monkeypatch, capsys, command):
    monkeypatch.chdir(tmp_path)
    for case in ("billion laughs", "duplicate nested key", "lr nan"):
        setup, extra, fragment = CASES[case]
        code = run([command, setup(tmp_path), *extra])
        captured = capsys.readouterr()
        assert_one_line(code, captured.err, captured.out, fragment)


@pytest.mark.parametrize("args,fragment", [
    (["validate", "--json", "/proc/gpipe/plan.json"], "--json: cannot write"),
    (["validate", "--json", ""], "--json: an empty path names no file; name one"),  # it named '.', never typed
    (["validate", "--json", "."], "it is a directory; name a file"),
    (["export", "/no/such/run"], "no such run directory or checkpoint"),
    (["export", "/no/such/run", "--output", ""], "--output: an empty path names no file; name one"),
    (["export", "/no/such/run", "--output", "/proc/gpipe/model.safetensors"],
     "--output: cannot write '/proc/gpipe/model.safetensors': cannot write to '/proc' (it takes no new files)"),
    (["report", "/no/such/run", "--output", ""], "--output: an empty path names no file; name one"),
    (["prepare-data", "recipes/amoebanet-d-cifar10.yaml", "--output", ""], "--output: an empty path names no folder"),
    (["export", ""], "RUN: an empty path names no run; give the folder gpipe train wrote"),
    (["report", ""], "RUN_DIR: an empty path names no run; give the folder `gpipe train` wrote"),
    (["predict", ""], "MODEL: an empty path names no model; give the file gpipe export wrote"),
    (["train", "--resume", ""], "--resume: an empty path names no run; give the folder gpipe train wrote"),
    (["bench", "--trace", ""], "--trace: an empty path names no file; name one, or leave the flag out"),
    (["profile-memory", "--json", ""], "--json: an empty path names no file; name one, or leave the flag out"),
    # Path drops a trailing slash: `report --output x.png/` wrote x.png.
    (["report", "/no/such/run", "--output", "x.png/"],
     "--output: 'x.png/' names a folder (the trailing '/'), and --output names a file; give 'x.png'"),
    (["export", "/no/such/run", "--output", "m.safetensors/"], "--output: 'm.safetensors/' names a folder"),
    (["bench", "--json", "b.json/"], "--json: 'b.json/' names a folder (the trailing '/'), and --json names a file"),
    (["plan", "--devices", "2", "--output", "p.yaml/"], "--output: 'p.yaml/' names a folder"),
    (["report", "/no/such/run", "--output", "x.png/."],
     "--output: 'x.png/.' names a folder (the trailing '/.'), and --output names a file; give 'x.png'"),
], ids=["validate json", "validate json empty", "validate json directory", "export missing run",
        "export empty output", "export output", "report empty output", "prepare-data empty output",
        "export empty run", "report empty run", "predict empty model", "resume empty", "bench empty trace",
        "profile empty json", "report output slash", "export output slash", "bench json slash", "plan output slash",
        "report output slash dot"])
def test_path_arguments_are_refused_in_one_line(tmp_path, monkeypatch, capsys, args, fragment):
    if not Path("/proc/self").is_dir() and "/proc" in " ".join(args):
        pytest.skip("needs /proc: a folder no one can write")
    monkeypatch.chdir(tmp_path)
    code = run(args)
    captured = capsys.readouterr()
    assert_one_line(code, captured.err, "", fragment)
    assert list(tmp_path.iterdir()) == []


def test_a_value_is_cut_only_where_the_cut_saves_more_than_its_note():
    """`.../step-0000009... (2 more characters)` hid the very digits that were mistyped."""
    from gpipe_cli.errors import CUT_AT_LEAST, cut

    near = "x" * 50 + "step-00000099"
    assert cut(near, 50) == near
    far = "y" * (50 + CUT_AT_LEAST + 1)
    assert cut(far, 50) == "y" * 50 + f"... ({CUT_AT_LEAST + 1} more characters)"


def test_a_message_too_long_for_a_line_keeps_its_end_which_says_what_to_do():
    # Cut at its tail, a refusal of a run with long paths and many damaged checkpoints lost the command that goes on.
    from gpipe_cli.errors import LINE_CHARS, one_line

    message = "--resume run: no usable checkpoint (" + "; ".join(["step-1: unreadable"] * 40) + "); then gpipe train x"
    line = one_line(message)
    assert line.startswith("--resume run: no usable checkpoint (step-1") and line.endswith("); then gpipe train x")
    assert len(line) <= LINE_CHARS + 40 and f"({len(message) - LINE_CHARS} characters left out)" in line
    assert one_line("a\nshort\n  one") == "a short one"


def test_an_empty_set_value_is_named_as_such(capsys):
    """`--set name=` was told `must be a string (got )`."""
    assert run(["validate", "--set", "name="]) == 2
    assert capsys.readouterr().err.rstrip().endswith("--set name: must be a string (got an empty value)")


def test_an_export_of_nothing_is_refused_before_torchs_checkpoint_code_loads(tmp_path, monkeypatch, capsys):
    # It took about 3 s to say so: the export module imports torch first.
    import sys

    monkeypatch.delitem(sys.modules, "gpipe_cli.train.export", raising=False)
    assert run(["export", str(tmp_path / "none")]) == 2
    assert capsys.readouterr().err == f"error: no such run directory or checkpoint: '{tmp_path / 'none'}'\n"
    assert "gpipe_cli.train.export" not in sys.modules
