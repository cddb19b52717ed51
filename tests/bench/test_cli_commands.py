"""`gpipe bench` and `gpipe profile-memory` through the real command line, small enough for CI."""

import json
import re
import subprocess

import pytest

from gpipe_cli.cli import run

TINY = ["--model", "transformer", "--set", "model.arch=decoder-only", "--layers", "2", "--d-model", "32", "--ff", "64",
        "--heads", "4", "--seq-len", "16", "--vocab-size", "64"]


@pytest.fixture
def gpipe(capsys, handlers):
    """`gpipe ARGS` through the command line's own `run` in this process: its exit code, stdout and stderr."""
    # Not a process of its own, which would import torch again first (seconds): the exit code is `run`'s.
    def command(*args: str) -> subprocess.CompletedProcess:
        code = run(list(args))
        captured = capsys.readouterr()
        return subprocess.CompletedProcess(["gpipe", *args], code, captured.out, captured.err)
    return command


def test_bench_writes_the_figures_and_a_chrome_trace(tmp_path, gpipe):
    out, trace = tmp_path / "bench.json", tmp_path / "trace.json"
    proc = gpipe("bench", *TINY, "--partitions", "2", "--microbatches", "4", "--steps", "3", "--warmup", "1",
                 "--schedule", "zero-bubble", "--compare", "--trace", str(trace), "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    for key in ("partitions", "microbatches", "samples_per_s", "samples_per_s_k1", "normalized", "efficiency",
                "bubble", "bubble_theory", "oversubscribed"):
        assert key in figures, key
    entry = figures["compare"]["torch-zero-bubble"]
    if "skipped" not in entry:  # torch has ScheduleInterleavedZeroBubble
        assert {"samples_per_s", "peak_mem_bytes", "stage_idle", "throughput_ratio", "memory_ratio"} <= set(entry)
        assert "Against torch.distributed.pipelining" in proc.stdout
    events = json.loads(trace.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    assert any(e.get("ph") == "X" for e in events)
    assert "efficiency" in proc.stdout and "simulator vs measurement" in proc.stdout
    # Each job is said, the first with its estimate (it waits for the ranks' server to import torch, over 2 s); the
    # next, forked from that server, may take under the 2 s worth an estimate. The end judges the total.
    assert re.search(r"^measuring K=1 \(.*\) \(about \d+ s\)\.\.\.$", proc.stdout, re.M), proc.stdout
    assert re.search(r"^measuring K=2 \(balance .*\)( \(about \d+ s\))?\.\.\.$", proc.stdout, re.M), proc.stdout
    assert re.search(r"^took \d+ (s|min) \(estimated \d+ (s|min)\)$", proc.stdout, re.M), proc.stdout


def test_profile_memory_prints_every_scenario_and_writes_json(tmp_path, gpipe):
    out = tmp_path / "memory.json"
    proc = gpipe("profile-memory", *TINY, "--partitions", "2", "--microbatches", "4", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "saved-tensor accounting" in proc.stdout
    assert re.search(r"^measuring pipeline-2 \(balance \[\d+, \d+\]\)( \(about \d+ s\))?\.\.\.$", proc.stdout, re.M)
    assert re.search(r"^took \d+ (s|min) \(estimated \d+ (s|min)\)$", proc.stdout, re.M), proc.stdout
    figures = json.loads(out.read_text())
    assert [s["name"] for s in figures["scenarios"]] == ["naive-1", "pipeline-1", "pipeline-2"]
    naive, pipe1, pipe2 = figures["scenarios"]
    assert len(pipe2["stages"]) == 2
    for stage in pipe2["stages"]:
        assert {"params_bytes", "grads_bytes", "optimizer_bytes", "stored_bytes", "peak_bytes"} <= set(stage), stage
    # rematerialization: pipeline-1 holds fewer activations than naive training of the same model
    assert pipe1["stages"][0]["peak_bytes"] < naive["stages"][0]["peak_bytes"]


def test_bad_flags_are_one_line_with_exit_code_2(gpipe):
    proc = gpipe("bench", "--model", "no-such-model", "--steps", "1")
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
