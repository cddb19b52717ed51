"""The simulator's prediction against a real K=2 measurement on this CPU (a measurement: slow)."""

import json
import os
import time

import pytest

from gpipe_cli.bench import BenchOptions, run
from gpipe_cli.contention import contended, machine_cpu

# Micro-batches of 8 examples: tens of milliseconds of compute per stage and micro-batch, so the CPU
# cost of each message (about 0.5 ms on this kind of host, which the simulator does not model) stays small.
MODEL = dict(model="transformer", layers=4, d_model=256, ff=1024, heads=4, vocab_size=1024, seq_len=32,
             set=["arch=decoder-only"])


def others_busy(seconds: float = 1.0) -> bool:
    """Whether other processes use the CPU now, by the benchmark's own measure, sampled while this one sleeps."""
    before = machine_cpu()
    time.sleep(seconds)
    after = machine_cpu()
    if before is None or after is None:
        return False
    capacity = seconds * (os.cpu_count() or 1)
    return contended({"others_share": (after[0] - before[0]) / capacity,
                      "stolen_share": (after[1] - before[1]) / capacity})


def wait_until_quiet(limit: float = 300.0) -> bool:
    """Wait (up to `limit` seconds) until no other process uses the CPU; whether it became quiet."""
    deadline = time.monotonic() + limit
    while others_busy():
        if time.monotonic() > deadline:
            return False
    return True


# The schedule (order, dependencies, messages), given each stage's measured compute: within a few percent when
# measured (0.0 and 2.4% on 2026-11-28).
REPLAYED = 0.10
# From K=1 alone: this host's speed drifts between the K=1 and K=2 runs of one bench (calibration x0.63 to x1.08
# over the benches of 2026-11-28), and in the CI's four benches of that day the K=2 measurement was 0.75 to
# 0.82 of the prediction; a wrong model misses by more.
FROM_K1 = 0.35


def _within(figures: dict) -> bool:
    measured, prediction = figures["samples_per_s"], figures["prediction"]
    return (_off(prediction["from_stage_busy"]["samples_per_s"], measured) <= REPLAYED
            and _off(prediction["samples_per_s"], measured) <= FROM_K1)


def _off(predicted: float, measured: float) -> float:
    return abs(predicted - measured) / measured


@pytest.mark.slow
@pytest.mark.alone
def test_the_simulator_predicts_the_measured_k2_throughput(tmp_path):
    figures = None
    for attempt in range(5):
        # A busy machine would make the measurement contended: wait for the other tests to finish.
        if not wait_until_quiet(300.0 if attempt == 0 else 30.0):
            continue
        out = tmp_path / f"bench-{attempt}.json"
        options = BenchOptions(**MODEL, partitions=2, microbatches=8, batch_size=64, steps=8, warmup=3, json=out)
        assert run(options) == 0
        found = json.loads(out.read_text())
        if found["contended"]:
            continue
        figures = found
        if _within(figures):  # a miss is measured again (a real error misses every time)
            break
    if figures is None:
        pytest.skip("other processes used the CPU during every attempt: no reliable measurement")
    assert _within(figures), figures["prediction"]
