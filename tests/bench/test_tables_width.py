"""bench's stage table on a narrow terminal: split into tables that each name the stages, no header cut."""

import pytest
from rich.console import Console

from gpipe_cli.bench import tables
from tests.widths import problems


def _stage(index: int) -> dict:
    return {"stage": index, "layers": 3, "busy_s": 0.0344, "step_s": 0.0623, "bubble": 0.408, "cuda_peak_bytes": 0,
            "activation_peak_bytes": 144_077, "offloaded_peak_bytes": 2**20}


def summary(offload: str = "none", **more) -> dict:
    """What `gpipe bench` of a tiny model on 2 stages gives its tables to print (a prediction: no compare)."""
    return {"model": {"name": "t-4-32-2", "parameters": 30_000, "layers": 6}, "partitions": 2, "microbatches": 4,
            "batch_size": 8, "schedule": "gpipe", "checkpoint": "except_last", "balance": [3, 3],
            "balance_by": "time", "oversubscribed": False, "steps": 10, "warmup": 3, "simulated": True,
            "samples_per_s_k1": 163.5, "tokens_per_s_k1": None, "step_time_k1_s": 0.098, "samples_per_s": 250.3,
            "tokens_per_s": None, "step_time_s": 0.0642, "normalized": 1.53, "ideal": 1.6, "efficiency": 0.957,
            "bubble": 0.502, "bubble_theory": 0.2, "memory_method": "saved-tensor accounting (stored activations)",
            "offload": offload, "stages": [_stage(0), _stage(1)],
            "prediction": {"partitions": 2, "bandwidth_gb_s": 12, "latency_us": 20, "calibration": 1.35}, **more}


@pytest.mark.parametrize("offload", ["none", "activations"])
@pytest.mark.parametrize("width", [40, 50])
def test_the_stage_table_at_a_narrow_width_cuts_no_header_and_no_figure(width, offload):
    # At 50 columns its headers read `laye…` and `acti…`, and `140.7` stood above its `KiB`.
    console = Console(width=width, record=True, force_terminal=False, color_system=None)
    tables.show(summary(offload), console)
    text = console.export_text()
    text = text[text.index("Stages"):text.index("each column")]
    headers = "stage layers busy (ms) step (ms) idle activation peak offloaded to host"
    assert not problems(text, width, headers), problems(text, width, headers)
    for value in ("layers", "activation", "140.7 KiB", "0.408", "34.4", "62.3"):
        assert value in text
    assert ("1.0 MiB" in text) == (offload != "none")


@pytest.mark.parametrize("offload", ["none", "activations"])
def test_a_comparison_says_when_only_our_side_offloads(offload):
    # Offloaded, our peaks left out what waited in host memory: a 0.28x beside torch's read as the engine's doing.
    torch_side = {"class": "ScheduleGPipe", "samples_per_s": 200.0, "bubble": 0.5, "stage_peak_bytes": [2**20, 2**20],
                  "stage_recomputed": [0, 0], "stage_recomputed_ours": [0, 0]}
    console = Console(width=200, record=True, force_terminal=False, color_system=None)
    console.print(tables._compare(summary(offload, compare={"gpipe": torch_side},
                                          stage_peak_bytes=[2**18, 2**18])))
    text = " ".join(console.export_text().split())
    said = "ours offloads stored activations to host memory (its peaks leave them out), torch's does not"
    assert (said in text) == (offload != "none"), text


def test_one_rank_holding_a_v_is_named_apart_from_k1():
    # Both rows read "K=1", and the efficiency above 1 looked like a fault.
    console = Console(width=200, record=True, force_terminal=False, color_system=None)
    tables.show(summary(partitions=1, virtual_stages=2, schedule="v-half"), console)
    text = console.export_text()
    assert "· K=1 V=2 M=4 ·" in text
    rows = [line.split("│")[1].strip() for line in text.splitlines() if line.startswith("│ K=")]
    assert rows == ["K=1", "K=1 V=2 (predicted)"]


def test_the_tables_give_milliseconds_and_a_gpu_s_own_peak():
    # A step of 0.0642 s reads 64.2 ms; a stage's CUDA allocator peak, where there is one, is its memory figure.
    throughput = tables._throughput(summary())
    assert list(throughput.columns[-1].cells) == ["98.0", "64.2"]
    stage = {**_stage(0), "cuda_peak_bytes": 5 * 2**30}
    assert list(tables._stages(summary(stages=[stage])).columns[5].cells) == ["5.0 GiB"]
