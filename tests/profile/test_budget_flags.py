"""`gpipe profile-memory --budget` end to end: a huge budget ends, says its bound; --set is honoured or refused."""

import json

import pytest

from gpipe_cli.cli import run as gpipe

TINY = ["--model", "transformer", "--d-model", "32", "--ff", "64", "--heads", "2", "--seq-len", "8",
        "--vocab-size", "64"]


def test_a_huge_budget_ends_at_the_bound_and_says_the_bound_stopped_it(capsys, tmp_path):
    out = tmp_path / "budget.json"
    assert gpipe(["profile-memory", *TINY, "--budget", "100000TiB", "--partitions", "2", "--json", str(out)]) == 0
    text = " ".join(capsys.readouterr().out.split())  # the terminal's width wraps the lines
    assert "Traceback" not in text
    assert "the search stopped at its bound (10000 layers, the most a recipe may have), not at the budget" in text
    # In the largest unit it is under 1024 of: '100000.0 TiB' read as many digits as it has.
    assert "gpipe profile-memory --budget 97.7 PiB per device" in text and "larger models fit 97.7 PiB too" in text
    # The model as every header names one: its fixed sizes in words, the searched depth as the table's L.
    assert ("per device · Transformer-L with L layers, d_model 32 (feed-forward 64, 2 heads, sequence 8, "
            "vocabulary 64) · batch") in text and "{" not in text, text[:1000]
    rows = json.loads(out.read_text())["rows"]
    assert [r["model"] for r in rows] == ["10000"] * 6 and all(r["bound"] for r in rows)
    # The K=2 rows on two devices: each named one stage of every layer, the fullest device that of pipeline-1.
    assert [len(r["balance"]) for r in rows] == [1, 1, 2, 2, 2, 4]
    assert rows[2]["device_peak_bytes"] < rows[1]["device_peak_bytes"]
    assert all(r["measured_device_peak_bytes"] is None for r in rows)  # far too slow to run here


def test_each_row_names_the_largest_model_with_its_predicted_and_measured_peak(capsys, tmp_path):
    out = tmp_path / "budget.json"
    assert gpipe(["profile-memory", *TINY, "--budget", "1MiB", "--partitions", "2", "--batch-size", "8",
                  "--microbatches", "4", "--optimizer", "sgd", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["scenarios"] == ["naive-1", "pipeline-1", "pipeline-2", "K=2 never", "K=2 offload", "K=2 v-half"]
    rows = dict(zip(summary["scenarios"], summary["rows"]))
    assert (rows["K=2 offload"]["offload"], rows["K=2 v-half"]["schedule"]) == ("activations", "v-half")
    assert len(rows["K=2 v-half"]["balance"]) == 4  # two chunks per device
    # Rematerialization fits more than keeping every graph; offloading and V-Half at least as much again.
    assert int(rows["K=2 never"]["model"]) < int(rows["pipeline-2"]["model"]) <= int(rows["K=2 offload"]["model"])
    for name, row in rows.items():
        assert row["device_peak_bytes"] <= 2**20
        assert row["device_peak_bytes"] == pytest.approx(row["measured_device_peak_bytes"], rel=0.10), name
    text = " ".join(capsys.readouterr().out.split())
    assert "fullest device (measured)" in text and "Traceback" not in text
    # The last line's "(estimated ...)" compares with an estimate said first (none was printed).
    assert text.startswith("budget · the largest transformer model within 1.0 MiB per device, for 6 rows · "
                           "estimate: about "), text[:300]


@pytest.mark.parametrize("flags,message", [
    (["--set", "model.colour=red"], "error: --set model.colour: unknown key; allowed keys in the transformer family "
                                    "of --budget: "),
    (["--set", "model.layers=3"], "error: --budget searches the layers and filters: drop --set model.layers"),
    (["--heads", "3"], "error: --budget: d_model (32) must be divisible by heads (3)"),
    (["--d-model", "99999999999"], "error: --d-model: must be >= 1 and <= 1048576 (got 99999999999)"),
])
def test_a_bad_model_flag_of_the_budget_search_is_one_line_and_writes_nothing(capsys, tmp_path, flags, message):
    # --set was dropped without a word: the search ran on the paper's model, not the one asked for.
    out = tmp_path / "budget.json"
    assert gpipe(["profile-memory", *TINY, *flags, "--budget", "8GiB", "--json", str(out)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(message) and "Traceback" not in captured.out, captured
    assert not out.exists()


def test_set_reaches_the_searched_family(capsys, tmp_path):
    out = tmp_path / "budget.json"
    assert gpipe(["profile-memory", *TINY, "--set", "model.dropout=0", "--budget", "8MiB", "--partitions", "2",
                  "--json", str(out)]) == 0
    assert json.loads(out.read_text())["fixed"]["dropout"] == 0


def test_a_column_where_nothing_fits_says_so_in_the_measured_row_too():
    # Its cell was left blank while every other row of the column said "does not fit".
    from gpipe_cli.profile import tables

    assert tables._measured(None) == "does not fit"
