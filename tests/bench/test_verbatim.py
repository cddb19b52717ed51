"""`gpipe bench --partitions 8 --microbatches 32` exactly as a user types it: sized to this machine, it finishes."""

import os
import subprocess
import sys

import pytest

from gpipe_cli.sizing import usable_cores


@pytest.mark.slow
def test_bench_k8_m32_verbatim_measures_k1_and_k8_and_warns_first():
    proc = subprocess.run([sys.executable, "-m", "gpipe_cli.cli", "bench", "--partitions", "8", "--microbatches", "32"],
                          capture_output=True, text=True, timeout=900, env={**os.environ, "COLUMNS": "200"})
    out = proc.stdout
    assert proc.returncode == 0, (out + proc.stderr)[-3000:]
    first_measurement = out.index("measuring K=1")
    assert out.index("plan ·") < out.index("estimate: about") < first_measurement
    if usable_cores() < 8:
        assert out.index("oversubscribed") < first_measurement
        # The simulator's figure is not taken for this machine's: it says its ranks each had a core.
        assert "the prediction gives every rank its own core or GPU, which they share here" in " ".join(out.split())
    for figure in ("│ K=1 ", "│ K=8 ", "efficiency = ", "bubble: measured ", "theory (K-1)/(M+K-1) = "):
        assert figure in out, figure
