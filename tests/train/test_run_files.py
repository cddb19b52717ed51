"""What a finished run leaves: files with the user's umask, no lock files, and an exported model that
loads and runs in plain PyTorch exactly as docs/runs.md shows."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.train.recipes import write

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
UMASK = 0o027
TINY_LM = {
    "name": "tiny-lm", "seed": 0,
    "model": {"kind": "transformer", "arch": "decoder-only", "layers": 2, "d_model": 32, "ff": 64, "heads": 4,
              "vocab_size": 300, "max_len": 32, "tie_embeddings": True},  # tied across the two stages
    "pipeline": {"partitions": 2, "microbatches": 2},
    "data": {"source": "text", "path": "corpus.txt", "batch_size": 4, "seq_len": 32, "vocab_size": 300},
    "train": {"steps": 2},
    "optimizer": {"name": "adam", "lr": 0.001},
    "eval": {"batches": 1},
}


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-stage language model trained for two steps on text, with its tokenizer trained by the run."""
    import pydoc_data.topics

    folder = tmp_path_factory.mktemp("lm")
    (folder / "corpus.txt").write_text("\n\n".join(list(pydoc_data.topics.topics.values())[:40]))
    recipe = write(folder, TINY_LM)
    command = [sys.executable, "-m", "gpipe_cli.cli", "train", str(recipe), "--output-dir", "run", "--plain",
               "--threads", "1"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=folder,
                          preexec_fn=lambda: os.umask(UMASK))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return folder / "run"


def test_files_get_the_users_umask(lm_run):
    files = [p for p in lm_run.rglob("*") if p.is_file()]
    assert {"recipe.yaml", "metrics.jsonl", "tokenizer.model", "manifest.json"} <= {p.name for p in files}
    modes = {str(p.relative_to(lm_run)): stat.S_IMODE(p.stat().st_mode) for p in files}
    assert all(mode == 0o666 & ~UMASK for mode in modes.values()), {k: oct(v) for k, v in modes.items()}


def test_no_lock_files_are_left(lm_run):
    assert not [p for p in lm_run.rglob("*") if "lock" in p.name.lower()]


def docs_code() -> str:
    """The Python example of the "Using a trained model" section of docs/runs.md."""
    text = (ROOT / "docs" / "runs.md").read_text()
    section = text.split("## Using a trained model", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    assert len(blocks) == 1
    return blocks[0]


def test_the_exported_model_runs_in_plain_pytorch_as_the_docs_show(lm_run):
    proc = subprocess.run([sys.executable, "-m", "gpipe_cli.cli", "export", str(lm_run)], capture_output=True,
                          text=True, timeout=120, preexec_fn=lambda: os.umask(UMASK))
    assert proc.returncode == 0, proc.stderr
    exported = lm_run / "model.safetensors"
    assert stat.S_IMODE(exported.stat().st_mode) == 0o666 & ~UMASK
    code = docs_code()
    placeholder = re.search(r'safe_open\("([^"]+)"', code)
    assert placeholder is not None
    namespace: dict = {}
    exec(compile(code.replace(placeholder.group(1), str(exported)), "docs/runs.md", "exec"), namespace)

    import torch
    from safetensors.torch import load_file

    model, logits, ids = namespace["model"], namespace["logits"], namespace["ids"]
    assert logits.shape == (1, ids.shape[1], TINY_LM["model"]["vocab_size"])
    assert torch.isfinite(logits).all()
    trained = load_file(str(exported))
    assert set(trained) <= set(model.state_dict()), "every stored tensor is in the model (tied ones once)"
    assert all(torch.equal(model.state_dict()[k], v) for k, v in trained.items())
    # A tied weight left untied by the docs' code would answer wrongly with every stored tensor right.
    from safetensors import safe_open

    tied = json.loads(safe_open(str(exported), framework="pt").metadata()["tied"])
    assert tied and set(model.state_dict()) == set(trained) | set(tied)
    assert all(torch.equal(model.state_dict()[alias], trained[name]) for alias, name in tied.items())


def test_every_record_has_the_keys_its_type_declares(lm_run):
    import json

    from gpipe_cli.records import EvalRecord, TrainRecord

    kinds = {"train": TrainRecord, "eval": EvalRecord}
    lines = (lm_run / "metrics.jsonl").read_text().splitlines()
    seen = set()
    for line in lines:
        record = json.loads(line)
        declared = kinds[record["kind"]]
        seen.add(record["kind"])
        keys = set(record) - {"nonfinite"}  # added on writing, where a figure was not finite
        assert declared.__required_keys__ <= keys, declared.__required_keys__ - keys
        assert keys <= declared.__required_keys__ | declared.__optional_keys__, keys - declared.__optional_keys__
    assert seen == {"train", "eval"}


def test_the_records_parts_are_the_engines():
    from gpipe_cli.pipeline.stats import PARTS
    from gpipe_cli.records import PARTS as RECORDED

    assert RECORDED == PARTS


def test_a_checkpoint_of_text_held_out_by_content_says_so(lm_run):
    # A resume from a checkpoint without it, of an older version, is told that the held-out split then was another.
    import json

    (checkpoint,) = (lm_run / "checkpoints").glob("step-*")
    data = json.loads((checkpoint / "manifest.json").read_text())["data"]
    assert data["held_out_by"] == "content" and data["held_out"] > 0 and data["train_examples"] > 0
