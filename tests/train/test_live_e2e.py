"""What `gpipe train` tells the user, end to end in plain mode: first lines, steps, summary, non-finite stops."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gpipe_cli.data.tokenizer import Tokenizer
from gpipe_cli.pipeline.stats import PARTS
from gpipe_cli.train.checkpoint import newest_whole
from tests.train.recipes import TINY_TRANSLATION, write

pytestmark = pytest.mark.slow


def gpipe(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpipe_cli.cli", "train", *args, "--plain", "--threads", "1"],
                          capture_output=True, text=True, timeout=400)


def refuse(token: str) -> None:
    raise ValueError(f"not strict JSON: {token}")


def strict_records(run: Path) -> list[dict]:
    return [json.loads(line, parse_constant=refuse) for line in (run / "metrics.jsonl").read_text().splitlines()]


def fact(stdout: str, name: str) -> str:
    return next(line.split(":", 1)[1].strip() for line in stdout.splitlines() if line.startswith(f"  {name}:"))


def recipe(**train: object) -> dict:
    r = copy.deepcopy(TINY_TRANSLATION)
    r["data"]["batch_size"] = 12  # leaves a partial batch out of every epoch
    r["train"].update(train)
    return r


def test_a_run_says_what_it_does_from_the_first_line_to_the_summary(tmp_path):
    r = recipe(steps=3)
    r["eval"] = {"every": 2, "batches": 1}
    r["model"]["max_len"] = 12  # some synthetic pairs are longer, and the data line says how many
    out = tmp_path / "run"
    proc = gpipe(str(write(tmp_path, r)), "--output-dir", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("gpipe train tiny-translation: Transformer encoder-decoder")
    assert all(part in lines[0] for part in ("K=2 stages", "D=1", "= 2 ranks", "M=3 micro-batches"))
    data = next(line for line in lines if "] data: " in line)
    examples, per_epoch = (int(re.search(rf"([\d,]+) {what}", data).group(1).replace(",", ""))
                           for what in ("training examples", "steps per epoch"))
    dropped = examples - per_epoch * 12
    assert dropped > 0 and f"data.drop_last leaves out {dropped} of {examples} training examples per epoch" in data
    assert any("and training the tokenizer (vocabulary 512)" in line for line in lines)
    pieces = Tokenizer.load(out / "tokenizer.model").vocab_size  # 200 synthetic pairs hold fewer than 512
    assert pieces < 512 and f"the tokenizer has {pieces} pieces, fewer than the 512 asked" in data
    pairs, longer = (int(n) for n in re.search(r"; (\d+) of (\d+) training pairs are longer than model.max_len "
                                                r"\(12 tokens\): left out", data).group(2, 1))
    assert 0 < longer < pairs and examples == pairs - longer
    stage_lines = [line for line in lines if line.startswith("  stage ")]
    assert len(stage_lines) == 2 * 3 and all("activations " in line and "RSS peak " in line for line in stage_lines)
    assert all("(step 1)" in line for line in stage_lines[2:])  # later steps show the last count, and its step

    records = strict_records(out)
    train = [rec for rec in records if rec["kind"] == "train"]
    assert [rec["step"] for rec in train] == [1, 2, 3]
    for rec in train:
        assert set(rec["time_s"]) == set(PARTS) and all(len(rec["time_s"][p]) == 2 for p in PARTS)
        for s in range(2):
            parts = [rec["time_s"][p][s] for p in PARTS]
            assert min(parts) >= 0 and sum(parts) >= rec["step_time_s"] * (1 - 1e-9)
        assert rec["bubble"] == pytest.approx(sum(rec["time_s"]["wait"]) / 2 / rec["step_time_s"])
        if rec["step"] == 1:  # stored activations are counted on the first step and every train.memory_every-th
            assert all(rss > act > 0 for rss, act in zip(rec["rss_peak_bytes"], rec["activation_peak_bytes"]))
        else:
            assert "activation_peak_bytes" not in rec
    evals = [rec for rec in records if rec["kind"] == "eval"]
    best = min(evals, key=lambda rec: rec["loss"])
    assert fact(proc.stdout, "best eval").startswith(f"step {best['step']}: loss {best['loss']:.4g}")
    assert next(line for line in lines if line.startswith("summary:")).startswith("summary: 3 of 3 steps in ")
    assert fact(proc.stdout, "skipped steps") == "0"
    assert fact(proc.stdout, "checkpoint") == str(out / "checkpoints" / "step-00000003")
    assert fact(proc.stdout, "run directory") == str(out)
    assert "Traceback" not in proc.stderr


def test_a_non_finite_gradient_stops_the_run_and_the_last_good_checkpoint_stays_newest(tmp_path):
    r = recipe(steps=6)
    r["optimizer"]["lr"] = 1e6  # step 1 is finite and wrecks the weights; step 2 is not finite
    r["checkpoint"] = {"every": 1}
    r["eval"] = {}
    path, out = write(tmp_path, r), tmp_path / "run"
    proc = gpipe(str(path), "--output-dir", str(out))
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-3000:]
    stops = [line for line in proc.stderr.splitlines() if "stopped at step" in line]
    assert len(stops) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert re.search(r"stopped at step 2 \(train.on_nonfinite: stop\): non-finite .*stage \d, layer \d+ '", stops[0])
    assert newest_whole(out)[0].step == 1
    train = [rec for rec in strict_records(out) if rec["kind"] == "train"]
    assert train[-1]["step"] == 2 and train[-1]["skipped"] and "grad_norm" in train[-1]["nonfinite"]
    assert train[-1]["grad_norm"] is None

    # The same run, resumed from its last good checkpoint, skipping: each skip shown, two in a row stop it.
    proc = gpipe(str(path), "--output-dir", str(out), "--resume", "--set", "train.on_nonfinite=skip",
                 "--set", "train.max_skipped=2")
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "step 2/6 skipped: non-finite" in proc.stdout and "1 in a row, 1 in all" in proc.stdout
    stops = [line for line in proc.stderr.splitlines() if "stopped at step" in line]
    assert len(stops) == 1 and "stopped at step 3 (2 steps in a row skipped, train.max_skipped: 2)" in stops[0]
    assert fact(proc.stdout, "skipped steps") == "2"
    # The skipped step 2 left the weights as they were and was checkpointed as usual; the stopping step was not.
    assert newest_whole(out)[0].step == 2
    assert [rec["step"] for rec in strict_records(out) if rec["kind"] == "train"] == [1, 2, 3]
