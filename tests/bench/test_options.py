from pathlib import Path

import pytest

from gpipe_cli.bench.options import FLAGS, BenchOptions, bench_options, parse_balance, validate
from gpipe_cli.bench.setup import oversubscription
from gpipe_cli.cli_help import tidy
from gpipe_cli.errors import UserError


def test_every_field_has_help_for_the_cli():
    from gpipe_cli.recipe.aliases import ALIASES

    fields = {name for name, f in BenchOptions.__dataclass_fields__.items() if f.metadata.get("flag", True)}
    assert fields <= set(FLAGS) | set(ALIASES) and not set(FLAGS) & set(ALIASES)  # each flag's help in one place


def test_default_batch_gives_four_examples_per_microbatch():
    assert BenchOptions(microbatches=8).batch == 32
    assert BenchOptions(microbatches=8, sweep=True).batch == 128


@pytest.mark.parametrize("options,message", [
    (BenchOptions(batch_size=4, microbatches=8), "smaller than M=8"),
    (BenchOptions(batch_size=10, microbatches=4, compare=True), "divisible"),
    (BenchOptions(schedule="zigzag"), "--schedule"),
    (BenchOptions(checkpoint="sometimes"), "--checkpoint"),
    (BenchOptions(offload="weights"), "--offload: must be 'none' or 'activations'"),
    (BenchOptions(devices=4), "--devices needs --simulate"),
    (BenchOptions(sweep=True, compare=True), "cannot be combined"),
    (BenchOptions(simulate=True, compare=True), "--simulate and --compare cannot be combined"),
    (BenchOptions(partitions=1, compare=True), "--compare runs torch's schedules across ranks: it needs --partitions"),
    (BenchOptions(oversubscribe=True), "--oversubscribe goes with --sweep"),
    (BenchOptions(steps=0), "--steps"),
    (BenchOptions(schedule="1f1b", virtual_stages=2), "needs schedule 'interleaved'"),
    (BenchOptions(schedule="interleaved", virtual_stages=2, microbatches=3, batch_size=12), "multiple of partitions"),
    (BenchOptions(schedule="interleaved", virtual_stages=2, sweep=True), "cannot be combined"),
    # One rank per stage on this machine: a typo of many digits is refused at once (it tried to size a
    # model that deep, for ever).
    (BenchOptions(partitions=60_000, microbatches=1, batch_size=1), "a bench starts one rank per stage"),
    (BenchOptions(partitions=10**20, microbatches=1, batch_size=1), "--partitions: must be >= 1 and <= 65536"),
    (BenchOptions(threads=100000), "--threads: must be >= 1 and <= 1024"),
    # As a recipe's seed: it ran with --seed -1.
    (BenchOptions(seed=-1), r"--seed: must be >= 0 and <= 4294967295 \(got -1\)"),
    (BenchOptions(seed=2**32), r"--seed: must be >= 0 and <= 4294967295 \(got 4294967296\)"),
    # As plan refuses them: an infinite link prices every message at no time or at no speed.
    (BenchOptions(simulate=True, latency_us=float("inf")), r"--latency-us: must be a finite number >= 0 \(got inf\)"),
    (BenchOptions(simulate=True, bandwidth=float("inf")), r"--bandwidth: must be a finite number > 0 GB/s \(got inf\)"),
    (BenchOptions(simulate=True, bandwidth=float("nan")), r"--bandwidth: must be a finite number > 0 GB/s \(got nan\)"),
    (BenchOptions(simulate=True, bandwidth=0.0), r"--bandwidth: must be a finite number > 0 GB/s \(got 0\)"),
])
def test_bad_options_are_refused(options, message):
    with pytest.raises(UserError, match=message):
        validate(options)


def test_balance_parsing():
    assert parse_balance("3,5", 2) == [3, 5]
    assert parse_balance(None, 2) is None
    with pytest.raises(UserError, match="has 2 entries but the pipeline has 3"):
        parse_balance("3,5", 3)
    with pytest.raises(UserError, match="commas"):
        parse_balance("3;5", 2)


def test_more_ranks_than_cores_is_oversubscribed():
    import os

    cores = len(os.sched_getaffinity(0))
    assert oversubscription(cores + 1, 1)[0]
    assert not oversubscription(1, 1)[0]


TINY = ["--layers", "2", "--d-model", "32", "--ff", "64", "--heads", "2", "--seq-len", "8", "--vocab-size", "64"]


@pytest.mark.parametrize("flags", [["--json", "recipes"], ["--trace", "recipes"], ["--json", "/proc/x.json"],
                                   ["--trace", "/proc/t.json"], ["--json", "a-file/x.json"],
                                   ["--sweep", "--json", "plot.json"],
                                   ["--json", "same.json", "--trace", "same.png"]])
def test_an_output_that_cannot_be_written_is_refused_in_one_line_before_measuring(tmp_path, capsys, monkeypatch,
                                                                                  flags):
    from gpipe_cli import sizing
    from gpipe_cli.cli import run

    def measured(*args):
        raise AssertionError("sized or measured before the outputs were checked")

    monkeypatch.setattr(sizing, "this_machine", measured)
    monkeypatch.chdir(tmp_path)
    for folder in ("recipes", "plot.png"):
        (tmp_path / folder).mkdir()
    (tmp_path / "a-file").write_text("")
    code = run(["bench", *TINY, *flags])
    captured = capsys.readouterr()
    assert code == 2, captured
    assert captured.err.startswith("error: --") and len(captured.err.splitlines()) == 1, captured.err
    assert "Traceback" not in captured.err + captured.out and captured.out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "plot.png", "recipes"]
    assert not list((tmp_path / "recipes").iterdir()) and not list((tmp_path / "plot.png").iterdir())


@pytest.mark.parametrize("options,message", [
    (BenchOptions(trace=Path("t.json"), sweep=True), "--trace records"),
    (BenchOptions(trace=Path("t.json"), simulate=True), "--trace records"),
    (BenchOptions(json=Path("t.json"), trace=Path("t.png")), "--trace would write 't.json', which --json writes"),
    (BenchOptions(json=Path("x.png"), sweep=True), "--sweep plot\\) would write 'x.png', which --json writes"),
])
def test_outputs_that_would_be_lost_are_refused(tmp_path, monkeypatch, options, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=message):
        validate(options)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("flags,folder,message", [
    (["--trace", "t.json"], "t.png", "--trace would also write 't.png', which is a folder; name another --trace file"),
    (["--trace", "t.png"], "t.json", "--trace would also write 't.json', which is a folder; name another --trace file"),
    (["--sweep", "--json", "s.json"], "s.png", "--json (its --sweep plot) would also write 's.png', which is a folder"),
])
def test_a_folder_where_a_second_file_goes_is_named_with_the_flag_to_change(tmp_path, monkeypatch, capsys, flags,
                                                                            folder, message):
    from gpipe_cli.cli import run

    monkeypatch.chdir(tmp_path)
    (tmp_path / folder).mkdir()
    assert run(["bench", *TINY, *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and len(err.splitlines()) == 1, err
    assert [p.name for p in tmp_path.iterdir()] == [folder] and not any((tmp_path / folder).iterdir())


@pytest.mark.parametrize("flags,kept", [(["--trace", "t.json"], "t.png"), (["--trace", "t"], "t.png"),
                                         (["--sweep", "--json", "s.json"], "s.png")])
def test_a_file_of_the_users_where_a_chart_goes_beside_is_kept_and_named(tmp_path, monkeypatch, capsys, flags, kept):
    # `--trace t.json` wrote its chart over a text file at t.png without a word.
    from gpipe_cli.cli import run

    monkeypatch.chdir(tmp_path)
    (tmp_path / kept).write_text("my notes\n")
    assert run(["bench", *TINY, *flags]) == 2
    err = capsys.readouterr().err
    assert f"would also write '{kept}', a file that holds no PNG image" in err and len(err.splitlines()) == 1, err
    assert [p.name for p in tmp_path.iterdir()] == [kept] and (tmp_path / kept).read_text() == "my notes\n"


def test_a_trace_named_in_capitals_is_the_chart():
    from gpipe_cli.bench.trace import paths

    assert paths(Path("T.PNG")) == (Path("T.json"), Path("T.PNG"))


def test_the_trace_help_names_both_files_as_they_are_written():
    from gpipe_cli.bench.trace import paths

    assert paths(Path("x.json")) == (Path("x.json"), Path("x.png"))
    assert paths(Path("x.png")) == (Path("x.json"), Path("x.png"))
    assert paths(Path("x")) == (Path("x"), Path("x.png"))
    shown = tidy(FLAGS["trace"])  # as `gpipe bench --help` prints it
    assert "with.png" not in shown and "Chrome trace to FILE" in shown
    assert "FILE with '.png' in place of its suffix" in shown and "trace goes to FILE with '.json'" in shown
    assert "with.png" not in tidy(FLAGS["json"])


def test_the_names_checked_before_torch_loads_are_the_engines():
    from gpipe_cli.estimate.model_flags import REMAT_MODES, SCHEDULES
    from gpipe_cli.pipeline import schedule

    assert REMAT_MODES == schedule.REMAT_MODES and tuple(SCHEDULES) == tuple(schedule.SCHEDULES)


@pytest.mark.parametrize("command", ["bench", "profile-memory"])
@pytest.mark.parametrize("balance", ["0,10", "-1,11"])
def test_an_entry_below_one_is_told_the_same_signed_or_not(capsys, command, balance):
    # A negative entry was told the choices of --balance, as though it were no list.
    from gpipe_cli.cli import run

    assert run([command, "--partitions", "2", f"--balance={balance}"]) == 2
    assert capsys.readouterr().err.startswith("error: --balance: every entry must be a number of layers from 1 to ")


def test_a_balance_against_the_default_k_names_it_a_default(capsys):
    # "--partitions 2 has 2 stages" named a flag that was never typed (profile-memory's default is several K).
    from gpipe_cli.cli import run

    assert run(["bench", "--balance", "1,2,3"]) == 2
    assert capsys.readouterr().err.startswith("error: --balance 1,2,3 has 3 entries but --partitions (2, its "
                                              "default) has 2 stages")


@pytest.mark.parametrize("command", ["bench", "profile-memory"])
@pytest.mark.parametrize(("balance", "message"), [
    ("1,1", "balance [1, 1] sums to 2 but the model has 10 pipeline layers"),
    ("5,4,1", "--balance 5,4,1 has 3 entries but --partitions 2 has 2 stages: give one layer count per stage"),
])
def test_a_balance_the_model_cannot_take_is_one_line_naming_its_layers_once(capsys, command, balance, message):
    from gpipe_cli.cli import run

    assert run([command, "--partitions", "2", "--balance", balance]) == 2
    err = capsys.readouterr().err
    if balance == "5,4,1":
        assert err.splitlines() == [f"error: {message}"], err
        return
    # The model was sized to this machine, not chosen: which one it is, and what its layers are, is said.
    (line,) = err.splitlines()
    assert line.startswith(f"error: --partitions/--balance: {message} (of Transformer-L with "), err
    assert line.endswith(", the model sized to this machine; choose with --model/--layers)"), err


def test_a_balance_whose_sum_is_refused_names_no_partitions_flag_never_typed(capsys):
    # "--partitions/--balance: balance [1, 1] sums to 2 ...", though only --balance was typed.
    from gpipe_cli.cli import run

    assert run(["bench", "--layers", "2", "--d-model", "64", "--ff", "128", "--heads", "2", "--balance", "1,1"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: --balance: balance [1, 1] sums to 2 but the model has "), line


@pytest.mark.parametrize("command", ["bench", "profile-memory"])
def test_a_balance_given_by_set_is_named_so_when_the_model_cannot_take_it(capsys, command):
    # The refusal named "--partitions/--balance", a flag never typed.
    from gpipe_cli.cli import run

    assert run([command, "--set", "pipeline.partitions=2", "--set", "pipeline.balance=[1,1]"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: --set pipeline.partitions/--set pipeline.balance: balance [1, 1] sums to 2 but "
                           "the model has 10 pipeline layers (of "), line


@pytest.mark.parametrize("command", ["bench", "profile-memory"])
def test_a_set_value_refused_is_not_first_announced_as_replacing_its_flag(capsys, command):
    # "note: --set model.d_model=abc replaces --d-model 64" came before the line refusing that value.
    from gpipe_cli.cli import run

    assert run([command, "--d-model", "64", "--set", "model.d_model=abc"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.splitlines() == [
        "error: --set model.d_model: must be an integer >= 1 and <= 1048576 (got 'abc')"], captured


@pytest.mark.parametrize(("command", "cuts"), [("bench", "'auto', 'time'"), ("profile-memory", "'auto'")])
@pytest.mark.parametrize(("value", "mended"), [("2,4", "; did you mean --set 'pipeline.balance=[2,4]'?"),
                                               ("params", ""), ("memory", ""), ("evenly", "")])
def test_a_set_balance_word_is_told_the_cuts_this_command_makes(capsys, command, cuts, value, mended):
    # It was told the recipe's words, 'params' and 'memory' among them, which the command then refused.
    from gpipe_cli.cli import run

    assert run([command, "--set", f"pipeline.balance={value}"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: --set pipeline.balance: this command cuts by {cuts} or a list of layer counts per stage "
        f"(got '{value}'){mended}"]


@pytest.mark.parametrize("command", ["bench", "profile-memory"])
@pytest.mark.parametrize(("flags", "line"), [
    # YAML reads yes and null as true and None: the line showed a value never typed, or Python's None.
    (["--offload", "yes"], "error: --offload: must be 'none' or 'activations' (got 'yes')"),
    (["--schedule", "null"], "error: --schedule: must be 'gpipe', '1f1b', 'interleaved', 'zero-bubble', "
                             "'zero-bubble-v' or 'v-half' (got 'null')"),
    (["--checkpoint", ""], "error: --checkpoint: must be 'always', 'except_last' or 'never' (got '')"),
    # A model key is named as typed, not as --model (and never as Python's True or None).
    (["--set", "model.layers=true"], "error: --set model.layers: must be an integer >= 1 and <= 10000 (got true)"),
    (["--set", "model.d_model="], "error: --set model.d_model: must be an integer >= 1 and <= 1048576 (got null)"),
    (["--set", "model.dropout=true"], "error: --set model.dropout: must be a number in [0, 1) (got true)"),
])
def test_a_value_is_shown_as_typed_and_named_by_what_the_user_typed(capsys, command, flags, line):
    from gpipe_cli.cli import run

    assert run([command, *flags]) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [line], captured.err


@pytest.mark.parametrize("command", ["bench", "profile-memory"])
@pytest.mark.parametrize("schedule", ["v-half", "zero-bubble-v"])
def test_a_v_schedule_without_its_two_chunks_is_refused_naming_the_flag(capsys, command, schedule):
    # It named the recipe key pipeline.virtual_stages, which neither command line had typed.
    from gpipe_cli.cli import run

    assert run([command, "--partitions", "2", "--schedule", schedule]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: --schedule {schedule} runs 2 chunks per stage in a V: give --virtual-stages 2 (got 1)"]


@pytest.mark.parametrize("command", ["bench", "profile-memory"])
def test_a_v_balance_counts_partitions_times_virtual_stages(capsys, command):
    from gpipe_cli.cli import run

    assert run([command, "--partitions", "2", "--schedule", "v-half", "--virtual-stages", "2",
                "--balance", "5,5"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --balance 5,5 has 2 entries but --partitions 2 x --virtual-stages 2 is 4 chunks: give one layer "
        "count per chunk"]


@pytest.mark.parametrize("flag", ["--json", "--trace"])
def test_a_name_too_long_is_refused_in_one_line_before_measuring(tmp_path, capsys, monkeypatch, flag):
    # It was a traceback (File name too long) once the whole measurement was done.
    from gpipe_cli import sizing
    from gpipe_cli.cli import run

    def measured(*args):
        raise AssertionError("sized or measured before the outputs were checked")

    monkeypatch.setattr(sizing, "this_machine", measured)
    monkeypatch.chdir(tmp_path)
    code = run(["bench", *TINY, flag, "outputs/" + "a" * 300 + ".json", "--steps", "1", "--warmup", "0"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"error: {flag}: cannot write 'outputs/aaa") and err.endswith(
        ": it has a name of 305 bytes; a name may have at most 255 bytes, a path at most 4095 bytes\n"), err
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_after_measuring_is_one_line_naming_the_flag(tmp_path, monkeypatch, handlers):
    import errno
    import io

    from rich.console import Console

    from gpipe_cli import files
    from gpipe_cli.bench import runner, tables

    class FullDisk(io.BytesIO):
        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    real_open = open
    monkeypatch.setattr(files, "open", lambda path, mode="r": FullDisk() if "w" in mode else real_open(path, mode),
                        raising=False)
    monkeypatch.setattr(tables, "show", lambda summary, console: None)
    summary = {"measured": True, "sized": {"note": "", "estimate_s": 1.0, "elapsed_s": 1.0}}
    with pytest.raises(UserError) as caught:
        runner.results(BenchOptions(json=tmp_path / "figures.json"), summary, [], Console(file=io.StringIO()))
    assert str(caught.value) == f"--json: cannot write {str(tmp_path / 'figures.json')!r} (No space left on device)"
    assert list(tmp_path.iterdir()) == []


def test_a_trace_that_cannot_be_written_is_told_under_the_figures(tmp_path, monkeypatch, handlers):
    # It was told instead of the figures, which had taken minutes to measure.
    import errno
    import io

    from rich.console import Console

    from gpipe_cli.bench import runner, tables, trace

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    shown: list[dict] = []
    monkeypatch.setattr(trace, "write", full)
    monkeypatch.setattr(tables, "show", lambda summary, console: shown.append(summary))
    summary = {"measured": True, "partitions": 2, "model": {"name": "t"},
               "sized": {"note": "", "estimate_s": 1.0, "elapsed_s": 1.0}}
    with pytest.raises(UserError) as caught:
        runner.results(BenchOptions(trace=tmp_path / "t.json", json=tmp_path / "b.json"), summary, [],
                       Console(file=io.StringIO()))
    assert str(caught.value) == f"--trace: cannot write {str(tmp_path / 't.json')!r} (No space left on device)"
    assert shown == [summary] and "trace" not in summary and (tmp_path / "b.json").is_file()


def test_a_sweep_refuses_the_k_and_m_it_would_drop(capsys):
    from gpipe_cli.cli import run

    assert run(["bench", "--sweep", "--partitions", "4", "--balance", "2,2,1,1"]) == 2
    assert capsys.readouterr().err == ("error: --sweep measures its own K and M (the paper's Table 2): leave out "
                                       "--partitions, --balance\n")


def test_a_sweep_refuses_their_set_forms_too(capsys):
    from gpipe_cli.cli import run

    assert run(["bench", "--sweep", "--set", "pipeline.microbatches=2"]) == 2
    assert "leave out --set pipeline.microbatches" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["bench", "profile-memory"])
@pytest.mark.parametrize("model", ["", " "])
def test_an_empty_model_name_is_refused_not_read_as_the_default_model(capsys, monkeypatch, command, model):
    # `--model ""` measured the default transformer for a minute, as if the flag were not there.
    from gpipe_cli.cli import run

    monkeypatch.setattr("gpipe_cli.sizing.this_machine", lambda *args: pytest.fail("measured"))
    assert run([command, "--model", model]) == 2
    captured = capsys.readouterr()
    assert captured.err == ("error: --model: an empty name names no model; give a family (amoebanet, transformer), a "
                            "preset or a recipe file, or leave the flag out for a transformer\n") and captured.out == ""


@pytest.mark.parametrize("args,line", [
    (["profile-memory", "--device", ""], "error: --device: must be 'auto', 'cpu' or 'cuda' (got '')\n"),
    (["profile-memory", "--optimizer", ""], "error: --optimizer: must be 'sgd', "),
    (["plan", "--devices", "2", "--timing", ""], "error: --timing: must be '")])
def test_an_empty_choice_is_shown_as_two_quotes_not_as_nothing(capsys, args, line):
    # `(got )` read as a cut-off line.
    from gpipe_cli.cli import run

    assert run(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(line) and err.endswith(" (got '')\n") and len(err.splitlines()) == 1, err


def test_simulate_names_the_devices_it_predicts_for(capsys):
    # --devices 4 replaced --partitions 2 without a word, and a balance for it was blamed on --partitions.
    from gpipe_cli.cli import run

    assert run(["bench", *TINY, "--simulate", "--devices", "4", "--partitions", "2"]) == 2
    assert capsys.readouterr().err == ("error: --simulate predicts for --devices 4 stages: leave out --partitions, "
                                       "or --devices to predict for it\n")
    # With a --balance for --partitions, it was the balance's count that was told first, then this, in a circle.
    assert run(["bench", *TINY, "--simulate", "--devices", "4", "--partitions", "2", "--balance", "3,3,2,2"]) == 2
    assert capsys.readouterr().err.startswith("error: --simulate predicts for --devices 4 stages: leave out")
    # A count out of bounds is named by the flag, not as the recipe key it stands for.
    assert run(["bench", *TINY, "--simulate", "--devices", "0"]) == 2
    assert capsys.readouterr().err == "error: --devices: must be >= 1 and <= 65536 (got 0)\n"
    # The two agree: nothing is dropped.
    assert bench_options(None, {"partitions": 4}, [], simulate=True, devices=4).stages == 4
    assert run(["bench", *TINY, "--simulate", "--devices", "4", "--balance", "2,2"]) == 2
    assert capsys.readouterr().err.endswith("has 2 entries but the pipeline has 4 (--devices x --virtual-stages)\n")


def test_simulate_checks_the_schedule_at_the_devices_it_predicts_for(capsys):
    # Checked at bench's default K=2: M=3 for 3 devices was refused naming --partitions (2, its default), and M=6
    # for 4 devices ended in a traceback.
    from gpipe_cli.cli import run

    interleaved = ["--schedule", "interleaved", "--virtual-stages", "2", "--layers", "8"]
    options = bench_options(None, {"microbatches": 3, "schedule": "interleaved", "virtual_stages": 2}, [],
                            simulate=True, devices=3)
    assert options.stages == 3
    validate(options)
    for devices, m in (("4", "6"), ("3", "4")):
        assert run(["bench", *TINY, *interleaved, "--simulate", "--devices", devices, "--microbatches", m]) == 2
        assert capsys.readouterr().err == (f"error: --microbatches ({m}) must be a multiple of --devices ({devices}) "
                                           "for the interleaved schedule\n")


def test_simulate_checks_a_recipes_schedule_at_the_devices_it_predicts_for(tmp_path, capsys):
    # The recipe was read at its own K=2, then refused as "--schedule/--virtual-stages: ... (got M=4, K=3)".
    from gpipe_cli.cli import run

    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {kind: transformer, layers: 4, d_model: 16, heads: 2, ff: 32, vocab_size: 32}\n"
                      "pipeline: {partitions: 2, microbatches: 4, schedule: interleaved, virtual_stages: 2}\n")
    assert run(["bench", str(recipe), "--simulate", "--devices", "3"]) == 2
    assert capsys.readouterr().err == (f"error: {recipe}: pipeline.microbatches (4) must be a multiple of --devices "
                                       "(3) for the interleaved schedule\n")
    # With --balance too, the recipe was read at its own K: "--set pipeline.balance has 6 entries but the pipeline
    # has 4", of entries never given by --set, for a pipeline that --devices 3 makes 6 chunks.
    assert run(["bench", str(recipe), "--simulate", "--devices", "4", "--balance", "1,1,1"]) == 2
    assert capsys.readouterr().err == (f"error: {recipe}: --balance has 3 entries but the pipeline has 8; give one "
                                       "layer count per chunk (--devices x virtual_stages)\n")
    assert run(["bench", str(recipe), "--simulate", "--devices", "3", "--balance", "1,1,1,1,1,1"]) == 2
    assert capsys.readouterr().err == (f"error: {recipe}: pipeline.microbatches (4) must be a multiple of --devices "
                                       "(3) for the interleaved schedule\n")
    options = bench_options(str(recipe), {}, [], simulate=True, devices=4)
    assert (options.stages, options.microbatches, options.schedule) == (4, 4, "interleaved")
    validate(options)


def test_a_refusal_names_the_set_that_gave_the_value(capsys, monkeypatch):
    # `--set pipeline.partitions=200` was refused as "--partitions 200: ...", a flag never typed.
    from gpipe_cli.cli import run

    monkeypatch.setattr("gpipe_cli.bench.options.meminfo_available", lambda: 10 * 2**30)
    assert run(["bench", "--set", "pipeline.partitions=200"]) == 2
    assert capsys.readouterr().err.startswith("error: --set pipeline.partitions=200: a bench starts one rank per "
                                              "stage on this machine")
    assert run(["bench", "--partitions", "200"]) == 2
    assert capsys.readouterr().err.startswith("error: --partitions 200: a bench starts one rank per stage")
    assert run(["bench", "--set", "data.batch_size=7", "--microbatches", "2", "--compare"]) == 2
    assert capsys.readouterr().err.startswith("error: --compare needs --set data.batch_size divisible by "
                                              "--microbatches (7 % 2 != 0)")
