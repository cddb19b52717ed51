"""Model TFLOP/s and MFU: the peak a step is measured against, the model FLOPs of a step, and where they show."""

import io

import pytest
from rich.console import Console

from gpipe_cli.train.step_figures import ModelFlops, Peak, find_peak, table_peak
from gpipe_cli.train.step_figures import utilization_of as figures
from gpipe_cli.train.summary import RunSummary
from gpipe_cli.train.view import TerminalView, train_lines
from gpipe_cli.units import flop_rate
from tests.train.test_view import train_record


@pytest.mark.parametrize(("name", "precision", "tflops"), [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.0), ("NVIDIA H100 80GB HBM3", "fp32", 67.0),
    ("NVIDIA H100 PCIe", "bf16", 756.0), ("NVIDIA H200", "fp16", 989.0),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312.0), ("NVIDIA A100-PCIE-40GB", "fp32", 19.5),
    ("NVIDIA A10", "bf16", 125.0), ("NVIDIA L4", "bf16", 121.0), ("NVIDIA L40S", "bf16", 362.0),
    ("Tesla V100-SXM2-16GB", "bf16", None), ("Some Future GPU", "bf16", None)])
def test_the_data_sheet_peak_is_found_by_device_name_and_precision(name, precision, tflops):
    assert table_peak(name, precision) == tflops


def never() -> float:
    raise AssertionError("not asked for")


def test_the_recipe_peak_wins_a_gpu_uses_its_data_sheet_and_a_cpu_its_measured_rate():
    given = find_peak(100.0, "cuda", "bf16", never, never)
    assert given.flops_per_s == 100e12 and "train.peak_tflops" in given.source
    gpu = find_peak(None, "cuda", "bf16", lambda: "NVIDIA H100 80GB HBM3", never)
    assert gpu.flops_per_s == 989e12 and "data-sheet bf16" in gpu.source
    cpu = find_peak(None, "cpu", "fp32", never, lambda: 25e9)
    assert cpu.flops_per_s == 25e9 and "measured" in cpu.source
    unknown = find_peak(None, "cuda", "fp32", lambda: "Mystery", never)
    assert unknown.flops_per_s is None and "train.peak_tflops" in unknown.source


def test_a_step_is_three_forwards_of_its_examples_or_of_its_tokens():
    assert ModelFlops(2e9, None).of_step(examples=8, units=None) == 3 * 2e9 * 8
    # Text: the forward was counted for 40 tokens; a step of 120 tokens is 3 such examples' worth.
    assert ModelFlops(4e9, 40).of_step(examples=10, units=120) == pytest.approx(3 * 4e9 * 3)


def test_mfu_is_achieved_flops_over_the_peak_of_all_ranks():
    out = figures(flops=6e12, seconds=2.0, peak_per_rank=1e12, ranks=4)
    assert out["tflops"] == pytest.approx(3.0) and out["mfu"] == pytest.approx(0.75)
    assert "mfu" not in figures(6e12, 2.0, None, 4)
    assert figures(6e12, 0.0, 1e12, 4) == {} and figures(0.0, 1.0, 1e12, 4) == {}
    assert flop_rate(312.4e12) == "312 TFLOP/s" and flop_rate(0.667e9) == "0.667 GFLOP/s"


def test_the_step_line_and_the_summary_show_them():
    record = {**train_record(step=1), "tflops": 0.002, "mfu": 0.04}
    assert "2 GFLOP/s (MFU 4.0%)" in train_lines(record, total=2)[0]
    assert "MFU" not in train_lines(train_record(step=1), total=2)[0]  # a model without a FLOP count
    # A small model on a GPU (the quick start on an H200 read "MFU 0.0%"): two significant digits.
    assert "(MFU 0.023%)" in train_lines({**record, "mfu": 0.000227}, total=2)[0]
    summary = RunSummary(total_steps=3, started=0.0, peak=Peak(25e9, "a measured rate"), ranks=2)
    for step, tflops in ((1, 0.001), (2, 0.002), (3, 0.003)):  # the first warms up and is left out
        summary.add({**train_record(step=step), "tflops": tflops, "mfu": tflops * 1e12 / 50e9}, 10, None)
    line = next(x for x in summary.lines(5.0, None, "r", False) if "model FLOPs" in x)
    assert "2.5 GFLOP/s (all ranks), MFU 5.0% against 2 ranks x a measured rate" in line


def test_the_live_frame_shows_them():
    view = TerminalView("tiny", plain=False, started=0.0)
    view.show({**train_record(step=2), "tflops": 400.0, "mfu": 0.4})
    console = Console(file=io.StringIO(), width=200)
    console.print(view.frame())
    assert "400 TFLOP/s (MFU 40.0%)" in console.file.getvalue()
