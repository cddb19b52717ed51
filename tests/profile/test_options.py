"""`gpipe profile-memory`'s flags: what is refused at once, in one line, before anything is measured."""

import time

import pytest

from gpipe_cli.cli import run as gpipe
from gpipe_cli.errors import UserError
from gpipe_cli.pipeline import schedules
from gpipe_cli.pipeline.schedule import SCHEDULES
from gpipe_cli.profile import FLAGS, ProfileOptions
from gpipe_cli.profile.options import MAX_PARTITIONS, validate

TINY = ["--layers", "2", "--d-model", "32", "--ff", "64", "--heads", "2", "--seq-len", "8", "--vocab-size", "64"]
# Generous, so that a loaded machine does not fail it: a refusal should take well under a second.
QUICK_S = 3.0


@pytest.fixture
def nothing_runs(monkeypatch):
    """Fail the test should the command get past its checks (sizing, measuring or searching)."""
    def ran(*args, **kwargs):
        raise AssertionError("the command ran before refusing its flags")

    monkeypatch.setattr("gpipe_cli.profile.runner._run", ran)


def refused(capsys, *args: str) -> str:
    """The one line `gpipe profile-memory ARGS` prints, once checked that it exits 2 quickly and prints nothing else."""
    start = time.monotonic()
    code = gpipe(["profile-memory", *args])
    out = capsys.readouterr()
    lines = out.err.splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and out.out == "", out
    assert time.monotonic() - start < QUICK_S
    return lines[0]


@pytest.mark.parametrize("partitions,bad", [("10000", "10000"), ("99999999999999999999", "99999999999999999999"),
                                            ("2,4,129", "129"), ("0", "0"), (",", "none")])
def test_partitions_outside_the_bound_are_one_line(capsys, tmp_path, nothing_runs, partitions, bad):
    out = tmp_path / "profile.json"
    line = refused(capsys, *TINY, "--partitions", partitions, "--json", str(out))
    assert f"--partitions: must list K values >= 1 and <= {MAX_PARTITIONS}" in line and f"(got {bad})" in line
    assert not out.exists()


@pytest.mark.parametrize("partitions,entry", [("2,,4", 2), ("2,4,", 3), (",2", 1)])
def test_an_empty_entry_of_partitions_is_refused(capsys, nothing_runs, partitions, entry):
    # It was read as the K values around it: `2,,4` profiled K=2 and K=4 without a word.
    assert refused(capsys, "--partitions", partitions) == (
        f"error: --partitions: entry {entry} is empty; give K values separated by commas, e.g. 2,4,8 "
        f"(got '{partitions}')")


@pytest.mark.parametrize("seed", ["-1", "4294967296"])
def test_a_seed_a_recipe_could_not_hold_is_refused(capsys, nothing_runs, seed):
    assert refused(capsys, "--seed", seed) == f"error: --seed: must be >= 0 and <= 4294967295 (got {seed})"


def test_the_largest_k_is_accepted_and_the_help_says_it():
    validate(ProfileOptions(partitions=[2, MAX_PARTITIONS]))
    assert f"each 1 to {MAX_PARTITIONS}" in FLAGS["partitions"]


@pytest.mark.parametrize("budget", ["0", "0GiB", "0.4", "0KiB"])
def test_a_budget_of_no_bytes_is_refused(capsys, nothing_runs, budget):
    line = refused(capsys, "--budget", budget)
    assert f"--budget: must be more than 0 bytes, e.g. 8GiB (got '{budget}')" in line
    assert line.endswith("a size counts whole bytes") == (budget == "0.4")  # 0.4 bytes is not 0 as typed


def test_a_negative_budget_is_refused(capsys, nothing_runs):
    assert "--budget expects a size such as 8GiB" in refused(capsys, "--budget=-1GiB")


def test_a_small_budget_is_a_valid_question():
    validate(ProfileOptions(budget="1KiB"))  # answered by a table where nothing fits


def test_every_schedule_is_accepted_the_v_shaped_ones_too():
    assert {n for n in SCHEDULES if schedules.get(n).placement == "v"} == {"v-half", "zero-bubble-v"}
    for name in SCHEDULES:
        validate(ProfileOptions(schedule=name, virtual_stages=2 if name in ("v-half", "zero-bubble-v") else 1))
    with pytest.raises(UserError, match="--schedule: must be 'gpipe', "):
        validate(ProfileOptions(schedule="v-full"))


def test_the_optimizer_names_checked_before_torch_are_the_ones_the_memory_model_builds():
    from gpipe_cli.memory_model import OPTIMIZERS
    from gpipe_cli.profile.options import OPTIMIZER_NAMES

    assert tuple(OPTIMIZERS) == OPTIMIZER_NAMES


def test_every_optimizer_name_accepted_is_in_the_help_and_the_docs():
    # plain-sgd and rmsprop-no-momentum were accepted, and listed when refusing another name, but named nowhere.
    import re
    from pathlib import Path

    from gpipe_cli.cli_help import tidy
    from gpipe_cli.profile.options import OPTIMIZER_NAMES

    docs = Path(__file__).resolve().parents[2] / "docs" / "commands.md"
    line = next(line for line in docs.read_text().splitlines() if line.startswith("| `--optimizer NAME`"))
    for name in OPTIMIZER_NAMES:
        word = re.compile(rf"(?<![\w-]){re.escape(name)}(?![\w-])")  # sgd is not plain-sgd
        assert word.search(tidy(FLAGS["optimizer"]) or "") and word.search(line), name


@pytest.mark.parametrize("args,line", [
    # The default K are several: it blamed pipeline.balance against a pipeline of 1 stage.
    (["--balance", "2,2"], "--balance 2,2 cuts a single K: give --partitions 2 (got 2,4,8, the default)"),
    (["--partitions", "2,4", "--balance", "3,3"], "--balance 3,3 cuts a single K: give --partitions 2 (got 2,4)"),
    (["--partitions", "2,4", "--schedule", "v-half", "--virtual-stages", "2", "--balance", "1,1,1,1"],
     "--balance 1,1,1,1 cuts a single K: give --partitions 2 (got 2,4)"),
    (["--partitions", "2", "--balance", "1,1,1"],
     "--balance 1,1,1 has 3 entries but --partitions 2 has 2 stages: give one layer count per stage"),
])
def test_a_balance_is_one_ks_cut_named_by_the_flags(capsys, nothing_runs, args, line):
    assert refused(capsys, *TINY, *args) == f"error: {line}"


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_virtual_stages_a_schedule_would_not_run_are_refused(capsys, nothing_runs, schedule):
    # A V of 2 would have been left out without a word.
    assert refused(capsys, *TINY, "--schedule", schedule, "--virtual-stages", "2") == (
        f"error: --virtual-stages 2: {schedule} runs one chunk per stage; give --schedule interleaved, or "
        f"zero-bubble-v or v-half with --virtual-stages 2")


def test_interleaved_chunks_need_m_a_multiple_of_each_k(capsys, nothing_runs):
    # The largest K is checked as a recipe's (bench says the same), named by the flags; the others here.
    assert refused(capsys, *TINY, "--schedule", "interleaved", "--virtual-stages", "2", "--microbatches", "6",
                   "--partitions", "2,4") == ("error: --microbatches (6) must be a multiple of --partitions (4) "
                                              "for the interleaved schedule")
    assert refused(capsys, *TINY, "--schedule", "interleaved", "--virtual-stages", "2", "--microbatches", "4",
                   "--partitions", "3,4") == (
        "error: --microbatches 4: interleaved needs a multiple of each K in --partitions (got K=3)")
    # Untyped, K was named "--partitions (8)", as though typed, and 6 is no multiple of 4 either.
    assert refused(capsys, *TINY, "--schedule", "interleaved", "--virtual-stages", "2", "--microbatches", "6") == (
        "error: --microbatches (6) must be a multiple of each K of --partitions (2, 4, 8, its default) for the "
        "interleaved schedule")


def test_interleaved_chunks_on_one_stage_are_named_by_the_flags(capsys, nothing_runs):
    # The schema's words named the recipe's keys (`pipeline.virtual_stages > 1 needs pipeline.partitions >= 2`).
    assert refused(capsys, *TINY, "--schedule", "interleaved", "--virtual-stages", "2", "--partitions", "1") == (
        "error: --virtual-stages (2) needs --partitions (1) to be 2 or more for interleaved, whose chunks loop over "
        "the stages (at K=1, zero-bubble-v and v-half run 2 in a V)")


def test_a_v_schedule_is_validated_with_its_two_chunks():
    validate(ProfileOptions(schedule="v-half", virtual_stages=2))
    with pytest.raises(UserError, match="give --virtual-stages 2"):
        validate(ProfileOptions(schedule="zero-bubble-v"))


def test_a_budget_refuses_a_cut_it_would_drop(capsys, nothing_runs):
    line = refused(capsys, "--budget", "8GiB", "--partitions", "2", "--balance", "2,2")
    assert "--budget cuts each model it tries itself (by memory): drop --balance" in line


def test_a_set_of_the_pipelines_k_is_the_k_profiled_and_named_when_refused(capsys, nothing_runs, tmp_path):
    # Without a recipe, `--set pipeline.partitions=4` profiled the default 2,4,8, and 200 was taken as well.
    from gpipe_cli.profile.options import profile_options

    assert profile_options(None, None, {}, ["pipeline.partitions=4"]).partitions == [4]
    assert profile_options(None, None, {}, []).partitions == [2, 4, 8]
    assert refused(capsys, *TINY, "--set", "pipeline.partitions=200") == (
        f"error: --set pipeline.partitions: must be >= 1 and <= {MAX_PARTITIONS} (the paper's largest pipeline; "
        "gpipe train takes up to 65536) (got 200)")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("pipeline: {partitions: 300}\n")
    assert refused(capsys, str(recipe)) == (
        f"error: {recipe}: pipeline.partitions: must be >= 1 and <= {MAX_PARTITIONS} (the paper's largest "
        "pipeline; gpipe train takes up to 65536) (got 300)")
