"""A small `gpipe profile-memory` end to end, measured and with --budget."""

import json

import pytest

from gpipe_cli import memory_model as mm
from gpipe_cli.errors import UserError
from gpipe_cli.estimate.subject import resolve
from gpipe_cli.profile import FLAGS, ProfileOptions, parse_partitions, run
from tests.bench import tiny


def test_every_field_has_help_for_the_cli():
    from gpipe_cli.recipe.aliases import ALIASES

    fields = {name for name, f in ProfileOptions.__dataclass_fields__.items() if f.metadata.get("flag", True)}
    assert fields <= set(FLAGS) | set(ALIASES)
    # each flag's help in one place: profile-memory's --partitions takes a list of K, not the recipe's one K
    assert set(FLAGS) & set(ALIASES) == {"partitions"}


def test_measured_profile_has_every_scenario_and_stage(tmp_path):
    out = tmp_path / "profile.json"
    assert run(ProfileOptions(**tiny.TRANSFORMER, partitions=[2, 3], microbatches=4, json=out)) == 0
    figures = json.loads(out.read_text())
    assert figures["method"] == "exact saved-tensor accounting (CPU)"
    names = [s["name"] for s in figures["scenarios"]]
    assert names == ["naive-1", "pipeline-1", "pipeline-2", "pipeline-3"]
    by_name = {s["name"]: s for s in figures["scenarios"]}
    for s in figures["scenarios"]:
        assert len(s["stages"]) == s["partitions"] == len(s["balance"])
        for stage in s["stages"]:
            for key in ("params_bytes", "grads_bytes", "optimizer_bytes", "stored_bytes", "peak_bytes", "total_bytes"):
                assert stage[key] >= 0, key
            assert stage["stored_bytes"] <= stage["peak_bytes"]
    # Rematerialization and more stages lower the fullest device's peak.
    assert (by_name["naive-1"]["device_peak_bytes"] > by_name["pipeline-1"]["device_peak_bytes"]
            > by_name["pipeline-2"]["device_peak_bytes"])


def test_offloaded_bytes_are_shown_under_every_remat_mode_and_the_title_says_offload(tmp_path, capsys):
    # Under `never` the column was left out, though the JSON held the bytes and the stored activations had dropped.
    out = tmp_path / "profile.json"
    assert run(ProfileOptions(**tiny.TRANSFORMER, partitions=[2], microbatches=4, offload="activations",
                              checkpoint="never", json=out)) == 0
    text = capsys.readouterr().out
    assert "· offload activations" in text.splitlines()[next(i for i, line in enumerate(text.splitlines())
                                                             if line.startswith("gpipe profile-memory ·"))]
    assert text.count("offloaded to host") == 3  # naive-1, pipeline-1 and pipeline-2
    held = [st["host_bytes"] for sc in json.loads(out.read_text())["scenarios"] for st in sc["stages"]]
    assert any(held)


def test_budget_search_reports_the_papers_table_layout(tmp_path):
    out = tmp_path / "budget.json"
    options = ProfileOptions(model="transformer", d_model=32, ff=64, heads=2, vocab_size=64, seq_len=8,
                             budget="8MiB", partitions=[2, 4], json=out)
    assert run(options) == 0
    figures = json.loads(out.read_text())
    assert figures["family"] == "Transformer-L" and figures["budget_bytes"] == 8 * 2**20
    # The largest K again without rematerialization, with offloaded activations and as V-Half.
    assert figures["scenarios"] == ["naive-1", "pipeline-1", "pipeline-2", "pipeline-4", "K=4 never", "K=4 offload",
                                    "K=4 v-half"]
    assert all(r["device_peak_bytes"] <= 8 * 2**20 for r in figures["rows"])
    assert figures["paper"]["rows"]["pipeline-8"][0] == "103"


@pytest.mark.parametrize("options,message", [
    (ProfileOptions(budget="8GiB", layers=4), "--budget searches"),
    (ProfileOptions(partitions=[2, 4], balance="3,3"), "single K"),
    (ProfileOptions(optimizer="lion"), "--optimizer"),
    (ProfileOptions(partitions=[0]), "--partitions"),
])
def test_bad_options_are_refused(options, message):
    with pytest.raises(UserError, match=message):
        run(options)


def test_rows_beyond_the_layers_are_extrapolated_and_the_measured_rows_kept(tmp_path):
    out = tmp_path / "profile.json"
    assert run(ProfileOptions(**tiny.TRANSFORMER, partitions=[2, 8], microbatches=4, json=out)) == 0
    rows = {s["name"]: s for s in json.loads(out.read_text())["scenarios"]}
    assert list(rows) == ["naive-1", "pipeline-1", "pipeline-2", "pipeline-8"]
    assert all(rows[name]["measured"] for name in ("naive-1", "pipeline-1", "pipeline-2"))
    eight = rows["pipeline-8"]
    assert not eight["measured"] and "K=8 > the 6 pipeline layers measured" in eight["why"]
    assert "(2 more priced as copies of a measured " in eight["why"]  # it read "2 more 'layer' layers repeated"
    assert len(eight["stages"]) == 8 and all(s["layers"] >= 1 for s in eight["stages"])
    assert eight["device_peak_bytes"] < rows["pipeline-2"]["device_peak_bytes"]


def test_a_model_too_large_for_this_machine_is_extrapolated_not_refused(tmp_path, monkeypatch):
    monkeypatch.setattr("gpipe_cli.memory_model.available_bytes", lambda device: 2**20)
    out = tmp_path / "profile.json"
    assert run(ProfileOptions(**tiny.TRANSFORMER, partitions=[2], microbatches=4, json=out)) == 0
    naive = json.loads(out.read_text())["scenarios"][0]
    assert naive["name"] == "naive-1" and not naive["measured"]
    assert "too large for this machine's memory" in naive["why"]


def test_interleaved_chunks_are_counted_where_each_stage_holds_them_as_the_model_predicts(tmp_path):
    # It was counted as 1F1B with one chunk per stage, and a recipe's K x V balance was refused.
    out = tmp_path / "profile.json"
    options = dict(tiny.TRANSFORMER, layers=6)
    assert run(ProfileOptions(**options, partitions=[2], microbatches=4, schedule="interleaved",
                              virtual_stages=2, balance="2,2,2,2", json=out)) == 0
    found = json.loads(out.read_text())
    rows = {s["name"]: s for s in found["scenarios"]}
    piped = rows["pipeline-2"]
    assert piped["measured"] and piped["virtual"] == 2 and piped["balance"] == [2, 2, 2, 2]
    assert [s["chunks"] for s in piped["stages"]] == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    assert rows["pipeline-1"]["virtual"] == 1  # one stage: nothing to interleave over
    spec = resolve("transformer", tiny.sizes(options), tiny.TRANSFORMER["set"]).build()
    predicted = mm.footprints(mm.measure(spec, device="meta"), [2, 2, 2, 2], found["batch_size"], 4, "interleaved",
                              "except_last", mm.bytes_per_parameter("rmsprop"), 2)
    for stage, fp in zip(piped["stages"], predicted):
        assert stage["total_bytes"] == pytest.approx(fp.total_bytes, rel=0.01)


def test_a_v_schedule_takes_a_cut_of_2k_chunks(tmp_path, capsys):
    # --balance 1,1,1,1 was put to pipeline-1 too, which has 2 chunks under a V, and refused.
    from gpipe_cli.cli import run as gpipe

    out = tmp_path / "profile.json"
    assert gpipe(["profile-memory", "--layers", "2", "--d-model", "32", "--ff", "64", "--heads", "2", "--seq-len", "8",
                  "--vocab-size", "64", "--partitions", "2", "--schedule", "v-half", "--virtual-stages", "2",
                  "--balance", "1,1,1,1", "--json", str(out)]) == 0, capsys.readouterr().err
    rows = {s["name"]: s for s in json.loads(out.read_text())["scenarios"]}
    assert rows["pipeline-2"]["balance"] == [1, 1, 1, 1] and rows["pipeline-2"]["virtual"] == 2
    assert rows["pipeline-1"]["balance"] == [2, 2] and rows["naive-1"]["balance"] == [4]


def test_a_tied_weight_is_counted_once(tmp_path):
    # The plan line counted it once and the table twice.
    counts = {}
    for tied in ("false", "true"):
        out = tmp_path / f"{tied}.json"
        options = dict(tiny.TRANSFORMER, set=["arch=decoder-only", f"tie_embeddings={tied}"])
        assert run(ProfileOptions(**options, partitions=[2, 8], microbatches=4, json=out)) == 0
        counts[tied] = {s["name"]: (s["params"], s["measured"]) for s in json.loads(out.read_text())["scenarios"]}
    table = tiny.TRANSFORMER["vocab_size"] * tiny.TRANSFORMER["d_model"]
    assert not counts["true"]["pipeline-8"][1]  # an extrapolated row too
    for name, (params, _) in counts["false"].items():
        assert counts["true"][name][0] == params - table, name


def test_partitions_parse():
    assert parse_partitions("2,4,8") == [2, 4, 8] and parse_partitions(" 2, +4") == [2, 4]
    # Python's int() reads `1_0` as 10 and other scripts' digits: a count flag takes ASCII digits only.
    for text in ("two", "1_0", "2.0", "2,\u0663"):
        with pytest.raises(UserError, match="each K must be a whole number written in digits"):
            parse_partitions(text)


def test_a_model_sized_by_the_quick_rate_is_sized_again_by_the_rate_its_layers_reach(tmp_path, monkeypatch, capsys):
    # On a busy machine the quick matrix-product rate chose a member its layers then ran for minutes, not about one.
    import dataclasses

    from gpipe_cli import sizing
    from gpipe_cli.profile import runner

    quick = sizing.this_machine(1)
    monkeypatch.setattr(sizing, "this_machine", lambda threads=1: dataclasses.replace(quick, flops_per_s=1e13))
    paced: list[float] = []

    def slow(machine, *args):  # the layers reach a millionth of the quick rate
        paced.append(machine.flops_per_s)
        return dataclasses.replace(machine, flops_per_s=1e7)
    monkeypatch.setattr(runner, "paced", slow)
    out = tmp_path / "profile.json"
    assert run(ProfileOptions(partitions=[2], json=out)) == 0
    assert paced == [1e13, 1e7]  # sized once more, at the rate the layers reached
    text = " ".join(capsys.readouterr().out.split())
    assert "the smallest member" in text, text[:600]
