"""profile-memory's tables on a narrow terminal: every figure whole, a table split rather than cut."""

import pytest
from rich.console import Console

from gpipe_cli.profile import tables


def _summary(names: list[str]) -> dict:
    scenario = {"params": 10_410_000, "param_memory_bytes": 166_600_000, "peak_activation_bytes": 70_450_000,
                "device_peak_bytes": 51_800_000, "measured": True}
    return {"model": {"name": "lm-8-1024-4"}, "scenarios": [
        {**scenario, "name": name, "balance": [1] * (2 ** i)} for i, name in enumerate(names)]}


@pytest.mark.parametrize("width", [60, 80, 100])
def test_table_1_at_a_narrow_width_cuts_no_cut_and_no_figure(width):
    # At 80 columns pipeline-8's "layers per stage" read `1,1,1,1,1,1…`.
    names = ["naive-1", "pipeline-1", "pipeline-2", "pipeline-4", "pipeline-8"]
    console = Console(width=width, record=True, force_terminal=False, color_system=None)
    tables.print_table(console, tables._table1(_summary(names)), tables.KEYS)
    text = console.export_text()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= width
    for name in names:
        assert name in text
    assert "1,1,1,1,1,1,1,1" in text


def test_a_prediction_within_half_a_percent_reads_plus_minus_nought():
    from gpipe_cli.profile.tables import _measured

    assert _measured({"measured_device_peak_bytes": 1000, "device_peak_bytes": 997}).endswith("(pred. ±0%)")
    assert _measured({"measured_device_peak_bytes": 1000, "device_peak_bytes": 1020}).endswith("(pred. +2%)")


def test_parameter_memory_that_grows_with_the_cut_is_explained_below_table_1():
    # The quick start's 991.74K parameters read 15.1 MiB at K=1 and 16.1 MiB at K=2, without a word.
    same = _summary(["naive-1", "pipeline-2"])
    assert tables._table1(same).caption is None
    tied = _summary(["naive-1", "pipeline-2"])
    tied["scenarios"][1]["param_memory_bytes"] += 1_000_000
    assert "tied weight" in str(tables._table1(tied).caption)
    tied["scenarios"][1]["params"] += 1000  # an extrapolated row of more layers: more of both, and no tie
    assert tables._table1(tied).caption is None


@pytest.mark.parametrize("tied", [True, False])
def test_more_parameter_bytes_for_the_same_parameters_is_put_down_to_a_tied_weight_only_where_one_is(tied):
    # An AmoebaNet, which ties nothing, was captioned "parameter memory counts a tied weight (the embedding and
    # softmax) on every stage that holds one".
    rows = [{"name": name, "params": 1000, "param_memory_bytes": size, "peak_activation_bytes": 1,
             "device_peak_bytes": 1, "balance": [1], "measured": True} for name, size in (("a", 16000), ("b", 17000))]
    table = tables._table1({"model": {"name": "m", "tied": tied}, "scenarios": rows})
    assert ("counts a tied weight" in str(table.caption or "")) == tied
