"""`gpipe report`'s memory columns say what their figures are: a GPU's CUDA peak, or a CPU's stored activations."""

import json
from pathlib import Path

from gpipe_cli.report import stage_table, summary_table
from gpipe_cli.report.runs import read_runs
from tests.report.test_report import make_run


def on_a_gpu(folder: Path) -> Path:
    """The run's records as a GPU run writes them: its memory figures are CUDA allocator peaks."""
    metrics = folder / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    for record in records:
        if record["kind"] == "train":
            record["cuda_peak_bytes"] = record["mem_peak_bytes"]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def _labels(runs) -> tuple[str, str, str, str]:
    """The memory column's header and the caption's memory line, of the summary and of the stage table."""
    summary, stages = summary_table(runs), stage_table(runs)
    return (str(summary.columns[-1].header), next(line for line in str(summary.caption).splitlines()
                                                   if line.startswith("memory")),
            str(stages.columns[-1].header), str(stages.caption))


def test_a_cpu_runs_memory_is_labelled_as_its_stored_activations(tmp_path):
    # It was headed "memory" and "memory peak", which read as the device's peak memory.
    runs = read_runs([make_run(tmp_path / "cpu", 2)])
    assert _labels(runs) == (
        "memory\n(activations)", "memory: the most activations a stage stored at once (a CPU run: no device peak "
        "is read)", "memory peak\n(activations)", "memory peak: the most activations a stage stored at once (a "
        "CPU run: no device peak is read)")


def test_a_gpu_runs_memory_is_labelled_as_its_cuda_peak(tmp_path):
    runs = read_runs([on_a_gpu(make_run(tmp_path / "gpu", 2))])
    assert _labels(runs) == ("memory\n(CUDA peak)", "memory: a stage's CUDA allocator peak",
                             "memory peak\n(CUDA)", "memory peak: a stage's CUDA allocator peak")


def test_runs_on_both_kinds_of_device_are_each_named_with_what_their_memory_holds(tmp_path):
    runs = read_runs([on_a_gpu(make_run(tmp_path / "gpu", 2)), make_run(tmp_path / "cpu", 4)])
    summary, line, stages, caption = _labels(runs)
    assert (summary, stages) == ("memory", "memory peak")
    words = ("a stage's CUDA allocator peak on a GPU (K=2 M=4 1f1b), the most activations a stage stored at once "
             "on a CPU (K=4 M=4 1f1b)")
    assert line == f"memory: {words}" and caption == f"memory peak: {words}"
