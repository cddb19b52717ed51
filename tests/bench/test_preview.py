"""`gpipe bench` before it measures: which `--set` keeps the sizing to this machine, and a run that cannot fit
is refused in one line, before any rank starts."""

import pytest

from gpipe_cli import sizing
from gpipe_cli.bench import preview
from gpipe_cli.bench.options import RANK_BYTES, BenchOptions
from gpipe_cli.cli import run as gpipe
from gpipe_cli.errors import UserError
from gpipe_cli.units import human_bytes

MIB = 2**20
GIB = 2**30
# A decoder-only Transformer small enough to price in a moment.
SMALL = dict(layers=4, d_model=256, ff=1024, heads=4, seq_len=64, vocab_size=1000, batch_size=64)


def machine(memory: float) -> sizing.Machine:
    return sizing.Machine("cpu", 2, memory, 3e10, 1e-4)


@pytest.mark.parametrize("settings,kept", [
    (["model.dropout=0"], True), (["dropout=0.3", "label_smoothing=0"], True),
    (["arch=decoder-only"], True),  # what the Transformer-L is already
    (["positions=learned"], False), (["tie_embeddings=true"], False), (["arch=encoder-decoder"], False),
])
def test_a_set_that_leaves_the_size_alone_keeps_the_sizing(settings, kept):
    assert preview.sizable(BenchOptions(set=settings)) is kept


def test_a_bad_set_is_one_line_whichever_way_the_model_is_sized():
    with pytest.raises(UserError, match="colour"):
        preview.sizable(BenchOptions(set=["colour=red"]))
    with pytest.raises(UserError, match="dropout"):
        preview.sizable(BenchOptions(set=["dropout=2"]))


def test_dropout_0_measures_the_member_sized_to_this_machine_with_dropout_0():
    # The machine of the report: 23 GiB free, where the paper's 2.55B-parameter model does not fit.
    options = BenchOptions(set=["model.dropout=0"])
    chosen = preview.choose_subject(options, machine(23 * GIB))
    assert chosen.sized and chosen.note.startswith("measuring ") and chosen.subject.params["dropout"] == 0
    assert chosen.subject.params["layers"] < 48
    assert sizing.candidate(chosen.subject.kind, chosen.subject.params).parameters < 1e9


def test_a_run_that_cannot_fit_is_refused_naming_what_it_needs_and_what_is_free():
    options = BenchOptions(set=["arch=decoder-only"], **SMALL)
    need = max(n for *_, n in preview.choose_subject(options, machine(64 * GIB)).memory.needs)
    # Sizing's rough guess passed this model on a machine the memory model's figure did not fit, and the plan then
    # printed that figure: one figure decides now, the plan's.
    with pytest.raises(UserError) as refused:
        preview.choose_subject(options, machine(0.95 * need))
    line = str(refused.value)
    assert "\n" not in line and line.startswith("the model does not fit: Transformer-L with 4 layers")
    assert f"needs about {human_bytes(need)} in its K=2 run (est.)" in line and "is free on this machine" in line
    assert "--layers, --d-model" in line and "leave the size flags and --set out" in line


def test_the_papers_model_is_said_to_need_what_bench_says_it_needs_when_asked_for_by_size():
    # Sized, it was said to need 22.8 GiB; asked for with --layers 48, 28.3 GiB: two figures for one model.
    options = BenchOptions(partitions=2, microbatches=8)
    sized = preview.choose_subject(options, machine(23 * GIB))
    assert sized.sized and sized.note.startswith("measuring ")
    kind, paper = sizing.ladder("transformer")[0]
    with pytest.raises(UserError) as refused:
        preview.choose_subject(BenchOptions(partitions=2, microbatches=8, layers=paper["layers"],
                                            d_model=paper["d_model"], ff=paper["ff"], heads=paper["heads"]),
                               machine(23 * GIB))
    need = human_bytes(preview.need_bytes(sizing.candidate(kind, paper), machine(23 * GIB), options))
    assert f"the paper's 48-layer model needs {need}," in sized.note
    assert f"needs about {need} in its K=2 run" in str(refused.value)


def test_the_command_refuses_before_any_rank_starts(monkeypatch, capsys):
    def measured(*args, **kwargs):
        raise AssertionError("a rank started")

    monkeypatch.setattr("gpipe_cli.bench.setup.launch_job", measured)
    monkeypatch.setattr(sizing, "this_machine", lambda threads=1: machine(300 * MIB))
    args = ["bench", "--set", "model.arch=decoder-only", *[f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items()]]
    assert gpipe(args) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith("error: the model does not fit") and len(out.err.splitlines()) == 1


def test_compare_is_priced_as_torch_running_the_k_stage_steps_again():
    plain, compared = (preview.choose_subject(BenchOptions(compare=c, **SMALL), machine(64 * GIB)) for c in (0, 1))
    assert compared.phases[1] == plain.phases[1]
    # Its warm-up and measured steps again, and one more step that learns torch's order of work.
    assert plain.phases[2] < compared.phases[2] < 3 * plain.phases[2]
    assert compared.seconds - plain.seconds == pytest.approx(compared.phases[2] - plain.phases[2])


@pytest.mark.parametrize("command", ["bench", "profile-memory"])
@pytest.mark.parametrize("key", ["train.precision=bf16", "optimizer.name=sgd", "data.seq_len=64", "train.steps=3"])
def test_a_set_key_the_command_does_not_read_is_refused_not_dropped(capsys, command, key):
    # train.precision was told "give train.steps or train.epochs"; optimizer.name and data.seq_len changed nothing.
    assert gpipe([command, "--set", key]) == 2
    err = capsys.readouterr().err
    if command == "profile-memory" and key.startswith("optimizer.name="):  # read, through a flag of its own
        assert err == ("error: --set optimizer.name: gpipe profile-memory takes it as --optimizer, e.g. --optimizer "
                       "sgd\n")
        return
    assert err.startswith(f"error: --set {key.partition('=')[0]}: gpipe {command} does not read it; of a recipe it "
                          "reads the model section, data.batch_size and the pipeline's partitions, ") and \
        err.count("\n") == 1


@pytest.mark.parametrize("command", ["bench", "profile-memory"])
@pytest.mark.parametrize("key, says", [("pipeline.partitons=2", "pipeline.partitons: unknown key (did you mean "
                                                                 "pipeline.partitions?); gpipe {command} reads of "
                                                                 "pipeline: partitions, microbatches, schedule, "
                                                                 "virtual_stages, checkpoint, offload, balance"),
                                       ("pipline.partitions=2", "pipline.partitions: unknown key (did you mean "
                                                                 "pipeline.partitions?)")])
def test_a_misspelled_set_key_is_called_one_as_train_calls_it(capsys, command, key, says):
    # It was told that the command does not read it, as though the key were right.
    assert gpipe([command, "--set", key]) == 2
    assert capsys.readouterr().err == f"error: --set {says.format(command=command)}\n"


@pytest.mark.parametrize("command", ["bench", "profile-memory"])
def test_a_set_key_near_nothing_is_told_what_the_command_reads(capsys, command):
    # It was "--set a.b: unknown key" and no more, where train lists the keys allowed.
    assert gpipe([command, "--set", "a.b=1"]) == 2
    assert capsys.readouterr().err == ("error: --set a.b: unknown key; of a recipe it reads the model section, "
                                       "data.batch_size and the pipeline's partitions, microbatches, schedule, "
                                       "virtual_stages, checkpoint, offload and balance\n")


@pytest.mark.parametrize("command", ["bench", "profile-memory"])
def test_a_misspelled_set_key_is_not_pointed_at_a_key_the_command_does_not_read_either(capsys, command):
    # "--set train.lr: unknown key (did you mean optimizer.lr?)", then "--set optimizer.lr: ... does not read it".
    assert gpipe([command, "--set", "train.lr=1"]) == 2
    assert capsys.readouterr().err.startswith(f"error: --set train.lr: gpipe {command} does not read it; of a recipe ")


def test_a_recipe_that_cannot_fit_is_not_told_that_bench_would_size_it():
    # bench sizes only a family to the machine; a recipe's model is measured as it is written.
    options = BenchOptions(model="recipes/amoebanet-b-imagenet.yaml")
    with pytest.raises(UserError) as refused:
        preview.choose_subject(options, machine(4 * GIB))
    line = str(refused.value)
    assert line.startswith("the model does not fit: ") and line.endswith("or lower --batch-size")
    assert "size it to this machine" not in line


def test_pricing_the_memory_of_many_micro_batches_is_said_first_with_its_estimate(monkeypatch):
    # Each stage's schedule is walked action by action: a million micro-batches were minutes of silence.
    tiny = dict(layers=2, d_model=16, ff=32, heads=2, seq_len=8, vocab_size=64)
    said: list[str] = []
    roomy = machine(64 * GIB)
    monkeypatch.setattr(preview, "_WALKED", set())
    for m in (8, 64):
        options = BenchOptions(set=["arch=decoder-only"], partitions=2, microbatches=m, batch_size=m, **tiny)
        preview.choose_subject(options, roomy, said.append)
    assert said == []
    monkeypatch.setattr(preview, "WALK_S", 1.0)  # as slow as a walk of millions, without its minutes
    monkeypatch.setattr(preview, "_WALKED", set())
    chosen = preview.choose_subject(options, roomy, said.append)
    # K=1 and K=2 at M=64: 3 stages of 64 micro-batches each.
    assert said == ["pricing each stage's memory, action by action of 64 micro-batches (about 3 min)..."]
    # The walks are kept: another model on the same schedule (sizing's next candidate) is priced without a word.
    wider = preview.resolve("transformer", {**tiny, "d_model": 32}, ["arch=decoder-only"])
    assert preview.memory(wider, options, roomy, said.append).stages[2] > chosen.memory.stages[2]
    assert len(said) == 1


def test_the_plan_prices_the_offload_the_runs_use():
    # The plan priced every run as though nothing were offloaded.
    roomy = machine(64 * GIB)
    kept, moved = (preview.choose_subject(BenchOptions(set=["arch=decoder-only"], offload=offload, **SMALL),
                                          roomy).memory for offload in ("none", "activations"))
    assert moved.stages[1][0] < kept.stages[1][0]


def test_on_a_cpu_what_the_stages_offload_counts_against_the_same_ram():
    # Offloading let a model that did not fit start measuring: its activations only moved within the same RAM.
    roomy = machine(64 * GIB)
    for offload in ("none", "activations"):
        memory = preview.choose_subject(BenchOptions(set=["arch=decoder-only"], offload=offload, **SMALL),
                                        roomy).memory
        # Beyond the stages' device bytes and each rank's runtime: the bytes in host memory, none without offload.
        beyond = [need - sum(memory.stages[k]) - k * RANK_BYTES for k, _, need in memory.needs]
        assert all(b > 1e6 for b in beyond) if offload != "none" else beyond == [0, 0]


def test_a_model_sized_to_the_machine_is_deep_enough_for_every_chunk():
    # K=12 was deepened for, but K=4 x V=3 was refused: "cannot cut 10 pipeline layers into 12 chunks", of a model
    # never asked.
    from gpipe_cli.models.registry import build_model

    options = BenchOptions(partitions=4, schedule="interleaved", virtual_stages=3)
    chosen = preview.choose_subject(options, machine(23 * GIB))
    assert chosen.sized and len(build_model(chosen.subject.kind, **chosen.subject.params).layers) >= 12


@pytest.mark.parametrize("flags, lines", [
    (dict(partitions=1), ["  runs: per-layer costs, then K=1, ", "  memory at K=1 (est.): "]),
    (dict(sweep=True), ["  runs: per-layer costs at K=1, then K=2 · M=1,4,32", "  memory at K=2 (est. at a cut by "
                                                                                  "estimated time): "]),
    # torch's run, which about doubles the K=2 phase, went unnamed.
    (dict(compare=True), ["  runs: per-layer costs, then K=1, K=2, torch.distributed.pipelining's at K=2 · "]),
    # torch has no v-half: its run was promised, then "not measured"; and one rank's V run was a second "K=1".
    (dict(compare=True, schedule="v-half", virtual_stages=2), ["  runs: per-layer costs, then K=1, K=2 · "]),
    (dict(partitions=1, schedule="v-half", virtual_stages=2), ["  runs: per-layer costs, then K=1, K=1 V=2, "]),
])
def test_the_plan_names_each_run_and_its_memory(flags, lines):
    # At K=1 the plan had no memory line; a sweep's K=1 run, which only times the layers, was listed as measured.
    from rich.console import Console

    options = BenchOptions(set=["arch=decoder-only"], **{**SMALL, **flags})
    console = Console(record=True, width=400)
    preview.show(preview.choose_subject(options, machine(64 * GIB)), options, machine(64 * GIB), console)
    printed = console.export_text().splitlines()
    assert all(any(line.startswith(start) for line in printed) for start in lines), printed


@pytest.mark.parametrize("command", [
    ["bench", "--model", "amoebanet", "--batch-size", "8", "--microbatches", "8"],
    ["bench", "--model", "amoebanet", "--batch-size", "8", "--set", "pipeline.microbatches=8"],
    ["profile-memory", "--model", "amoebanet", "--batch-size", "4", "--microbatches", "4"],
    ["profile-memory", "--model", "amoebanet", "--batch-size", "4", "--microbatches", "4", "--budget", "1GiB"],
])
def test_a_micro_batch_of_one_image_is_refused_before_anything_is_measured(monkeypatch, capsys, command):
    # bench measured for 13 s, then its ranks failed in BatchNorm ("Expected more than 1 value per channel").
    def measured(*args, **kwargs):
        raise AssertionError("the command measured")

    monkeypatch.setattr("gpipe_cli.bench.preview.choose_subject", measured)
    monkeypatch.setattr("gpipe_cli.profile.runner.measure", measured)
    monkeypatch.setattr("gpipe_cli.profile.runner.sizing.this_machine", measured)
    assert gpipe(command) == 2
    out = capsys.readouterr()
    typed = "--set pipeline.microbatches" if "--set" in command else "--microbatches"
    line = out.err.strip()
    assert out.out == ""
    assert len(line.splitlines()) == 1 and line.startswith(f"error: {typed} (")
    assert "--batch-size (" in line and "every micro-batch needs 2 examples (AmoebaNet's batch normalisation" in line


@pytest.mark.parametrize("command", [
    ["bench", "--microbatches", "8", "--batch-size", "8"],
    ["bench", "--model", "transformer", "--set", "pipeline.microbatches=8", "--batch-size", "8"],
    ["profile-memory", "--microbatches", "4", "--batch-size", "4"],
])
def test_a_micro_batch_of_one_sentence_is_measured(monkeypatch, capsys, command):
    # Without a recipe the flags were checked as a recipe's keys with its default model, an AmoebaNet: a Transformer
    # at M = batch was refused for "AmoebaNet's batch normalisation".
    class Measured(Exception):
        pass

    def measured(*args, **kwargs):
        raise Measured

    monkeypatch.setattr("gpipe_cli.bench.preview.choose_subject", measured)
    monkeypatch.setattr("gpipe_cli.profile.runner.measure", measured)
    with pytest.raises(Measured):
        gpipe(command)
    assert "error" not in capsys.readouterr().err
