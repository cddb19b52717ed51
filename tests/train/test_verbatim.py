"""`gpipe train` exactly as the quick start types it: the built-in recipe trains, evaluates and summarises."""

import json

import pytest


@pytest.mark.slow
def test_gpipe_train_verbatim_runs_the_quick_start_to_its_summary(quickstart):
    proc = quickstart.proc
    out = proc.stdout
    assert proc.returncode == 0, (out + proc.stderr)[-3000:]
    assert out.splitlines()[0].startswith("gpipe train quickstart: ")
    assert "summary: 200 of 200 steps" in out and "Traceback" not in proc.stderr
    runs = list((quickstart.cwd / "outputs" / "quickstart").iterdir())
    assert len(runs) == 1 and (runs[0] / "checkpoints" / "step-00000200" / "manifest.json").is_file()
    records = [json.loads(line) for line in (runs[0] / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]
    assert evals and evals[-1]["step"] == 200 and evals[-1]["loss"] < evals[0]["loss"]
    assert not list(runs[0].rglob("*.lock")), "no lock file is left in the run directory"
