"""The command line as a person meets it: quick one-line errors, --version, help without type placeholders."""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from gpipe_cli import __version__, cli
from gpipe_cli.cli import run
from tests.interrupt import as_from_a_terminal
from tests.train.recipes import TINY_AMOEBANET, write

COMMANDS = ["", "train", "validate", "bench", "profile-memory", "plan", "export", "predict"]
# What typer and click show for a value's type when no placeholder is given.
TYPE_PLACEHOLDER = re.compile(r"<(bool|str|int|float|path|list\[[^\]]*\])>|\b(TEXT|INTEGER|FLOAT|BOOLEAN)\b",
                              re.IGNORECASE)
STRAY_SPACE = re.compile(r"\w \.(?!\.)|\w ,|\w ;|\( ")
# Of CPU time, which a loaded machine (load 25) stretches less than wall time; the goal is well under a second.
QUICK_S = 6.0


def gpipe(*args: str, cwd: Path | None = None) -> tuple[subprocess.CompletedProcess, float]:
    """The command's outcome and the CPU seconds it used (as on a quiet machine, whatever the load here)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, "-m", "gpipe_cli.cli", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return proc, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


@pytest.mark.parametrize("case", ["missing recipe", "misspelt key", "bad --set value"])
def test_mistakes_are_one_line_exit_2_within_seconds(tmp_path, case):
    recipe = write(tmp_path, {**TINY_AMOEBANET, "pipeline": {"partitons": 2}})
    args = {"missing recipe": ["train", str(tmp_path / "nonexist.yaml")],
            "misspelt key": ["train", str(recipe)],
            "bad --set value": ["train", "--set", "pipeline.microbatches=many"]}[case]
    proc, elapsed = gpipe(*args, cwd=tmp_path)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert elapsed < QUICK_S, f"{case}: {elapsed:.1f} s"
    assert list(tmp_path.iterdir()) == [recipe]


HEAVY = "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'safetensors')))\n"


def test_loading_and_checking_a_recipe_imports_no_torch():
    code = ("import sys\n"
            "from gpipe_cli.recipe.load import load_recipe\n"
            "load_recipe(None, ['pipeline.microbatches=2'])\n"
            "load_recipe(None, ['model.preset=transformer-big', 'data.source=synthetic'])\n" + HEAVY)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


PAPER_RECIPE = str(Path(__file__).resolve().parents[1] / "recipes" / "amoebanet-d-cifar10.yaml")


@pytest.mark.parametrize("args", [["train", "missing.yaml"], ["train", "--set", "train.steps=true"],
                                  ["train", "--threads", "0"], ["validate", "--set", "colour=blue"],
                                  ["validate", PAPER_RECIPE, "--set", "pipeline.partitons=2"],
                                  ["validate", "--set", "model.preset=bogus"], ["export", "run", "--dtype", "half"],
                                  ["predict", "missing.safetensors"],
                                  ["predict", PAPER_RECIPE, "--max-tokens", "0"], ["bench", "--layers", "0"],
                                  ["bench", "--model", "t-6-8192-16", "--layers", "0"],
                                  ["profile-memory", "--model", "transformer-big", "--filters", "8"]])
def test_the_commands_refuse_bad_input_before_importing_torch(tmp_path, args):
    code = ("import sys\n"
            "from gpipe_cli.cli import run\n"
            f"assert run({args!r}) == 2\n" + HEAVY)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]" and proc.stderr.startswith("error: ")


def test_version(capsys):
    assert run(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"gpipe-cli {__version__}"


@pytest.mark.parametrize("columns", ["0", "5"])
def test_the_help_is_laid_out_on_a_terminal_too_narrow_for_it(capsys, monkeypatch, columns):
    monkeypatch.setenv("COLUMNS", columns)
    assert run(["--help"]) == 0
    out = capsys.readouterr().out
    assert "Usage: gpipe" in out and "train" in out  # not blank, nor a letter a line


def test_no_arguments_prints_the_help(capsys):
    assert run([]) == 0
    out = capsys.readouterr().out
    assert all(command in out for command in COMMANDS[1:])


@pytest.mark.parametrize("command", COMMANDS)
def test_help_shows_no_type_placeholders_or_stray_spaces(capsys, monkeypatch, command):
    monkeypatch.setenv("COLUMNS", "200")  # one line per option: wrapping cannot hide or create a match
    assert run([command, "--help"] if command else ["--help"]) == 0
    out = capsys.readouterr().out
    assert "--help" in out and "Show this message" in out
    assert not TYPE_PLACEHOLDER.search(out), TYPE_PLACEHOLDER.search(out)
    assert not STRAY_SPACE.search(out), STRAY_SPACE.search(out)
    usage = re.search(r"Usage: (.*)", out)
    assert usage and "{" not in usage.group(1)  # a required argument is not shown as a choice of values
    if command == "train":  # a placeholder that says what a value is
        assert re.search(r"--set\s+KEY=VALUE", out) and re.search(r"--threads\s+N\b", out)


@pytest.mark.parametrize("filename, says", [
    ("r" * 300, "error: 'rrr"),
    ("run/" + "r" * 250, "error: 'run/rrr"),  # a file system of shorter names than Linux's own
    (None, "error: a file name is too long; "),
])
def test_a_name_too_long_that_no_check_caught_is_one_line_and_exit_2(monkeypatch, capsys, filename, says):
    import errno

    def too_long(*args):
        raise OSError(errno.ENAMETOOLONG, os.strerror(errno.ENAMETOOLONG), filename)

    monkeypatch.setattr("gpipe_cli.report.report", too_long)
    assert run(["report", "run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(says) and len(err.splitlines()) == 1, err
    assert err.endswith("a name may have at most 255 bytes, a path at most 4095 bytes" +
                        (")\n" if filename == "run/" + "r" * 250 else "\n")), err


def test_usage_errors_are_one_line(capsys):
    assert run(["train", "--threads", "many"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "--threads" in err and "gpipe train --help" in err


@pytest.mark.parametrize("args, flag, value", [
    (["bench", "--partitions", "2.5"], "--partitions", "2.5"),
    (["bench", "--partitions", "2.0"], "--partitions", "2.0"),  # pydantic took it for 2
    (["bench", "--microbatches", "8.0"], "--microbatches", "8.0"),
    (["bench", "--steps", "1.5"], "--steps", "1.5"),
    (["bench", "--seed", "1e3"], "--seed", "1e3"),
    (["bench", "--layers", "1_0"], "--layers", "1_0"),
    (["profile-memory", "--microbatches", "2.5"], "--microbatches", "2.5"),
    (["plan", "--devices", "2.5"], "--devices", "2.5"),
    (["plan", "--devices", "2.0"], "--devices", "2.0"),
    (["plan", "--devices", "2", "--top", "abc"], "--top", "abc"),
    (["train", "--threads", "2.5"], "--threads", "2.5"),
    (["train", "--node-rank", "1.0"], "--node-rank", "1.0"),
    (["predict", "model.safetensors", "--top", "1.5"], "--top", "1.5"),
])
def test_an_integer_flag_takes_only_digits_and_says_so_naming_the_flag(capsys, args, flag, value):
    assert run(args) == 2
    captured = capsys.readouterr()
    assert captured.err == (f"error: {flag}: must be a whole number written in digits, e.g. 4 (got '{value}') "
                            f"(see 'gpipe {args[0]} --help')\n"), captured.err
    assert captured.out == ""


def test_an_integer_flag_of_more_digits_than_python_reads_is_one_line(capsys):
    assert run(["bench", "--steps", "9" * 5000]) == 2
    err = capsys.readouterr().err
    assert err == "error: --steps: 5000 digits is beyond any value it takes (see 'gpipe bench --help')\n", err


@pytest.mark.parametrize("local_rank", ["0", "1"])
@pytest.mark.parametrize("args", [["train", "--set", "pipeline.microbatches=0"], ["train", "--threads", "many"]])
def test_under_torchrun_each_node_says_an_error_once(monkeypatch, capsys, args, local_rank):
    # Every rank torchrun starts reads the same arguments and recipe, and fails alike before it joins the job.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    slept: list[tuple[float, str]] = []
    # What is waited and what was said before it, not how long a busy machine took.
    monkeypatch.setattr("gpipe_cli.cli.time.sleep", lambda s: slept.append((s, capsys.readouterr().err)))
    assert run(args) == 2
    assert len(capsys.readouterr().err.splitlines()) == 1
    # A sibling speaks only after the node's first rank could say it, and torchrun, seeing that rank end, stops the
    # sibling first: had the sibling ended first, torchrun would have stopped that rank, which then said only
    # "interrupted". A sibling still running found an error of its own, which it was silent about.
    assert slept == ([] if local_rank == "0" else [(cli.SIBLING_GRACE_S, "")])


def test_under_torchrun_a_process_count_other_than_the_recipes_is_said_before_anything_loads(monkeypatch, capsys):
    # Found after the plan's seconds, by every rank: a sibling's exit often had the first rank say "interrupted".
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr("gpipe_cli.train.run._plan_and_run", _never)
    assert run(["train", "--set", "train.steps=1"]) == 2
    assert capsys.readouterr().err == ("error: torchrun started 4 processes but the recipe needs partitions x "
                                       "data_parallel = 2\n")


def _never(*args, **kwargs):
    raise AssertionError("planned: the process count was checked too late")


def _interrupted(*args, **kwargs):
    raise KeyboardInterrupt


@pytest.mark.parametrize("command, patched", [
    (["validate"], "gpipe_cli.train.plan.checked_plan"),
    (["export", "RUN"], "gpipe_cli.train.export.export"),
    (["report", "RUN"], "gpipe_cli.report.report"),
    (["bench", "--steps", "2"], "gpipe_cli.bench.bench_options"),  # before the command's own guard
])
def test_ctrl_c_in_any_command_is_one_line_and_code_130(monkeypatch, capsys, tmp_path, command, patched):
    (tmp_path / "RUN").mkdir()  # export refuses a missing run before it loads the code patched here
    monkeypatch.chdir(tmp_path)
    module, name = patched.rsplit(".", 1)
    monkeypatch.setattr(__import__(module, fromlist=[name]), name, _interrupted)
    assert run(command) == 130
    err = capsys.readouterr().err
    assert err == f"gpipe {command[0]}: interrupted; nothing was written\n"


@pytest.mark.parametrize("local_rank, lines", [("0", 1), ("1", 0)])
def test_under_torchrun_each_node_says_a_stop_once(monkeypatch, capsys, local_rank, lines):
    # torchrun stops every rank alike, e.g. the others once one has refused the recipe: one line a node.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    monkeypatch.setattr(__import__("gpipe_cli.train.plan", fromlist=["checked_plan"]), "checked_plan", _interrupted)
    assert run(["validate"]) == 130
    assert len(capsys.readouterr().err.splitlines()) == lines


def test_ctrl_c_while_the_arguments_are_parsed_is_one_line_too(monkeypatch, capsys):
    # typer turns it into a silent exit code 130 before any command's function has begun.
    import typer.core

    def began(*args, **kwargs):
        raise AssertionError("the command ran: the interrupt was not raised while parsing")

    monkeypatch.setattr(typer.core.TyperCommand, "parse_args", _interrupted)
    monkeypatch.setattr(__import__("gpipe_cli.bench", fromlist=["BenchOptions"]), "BenchOptions", began)
    assert run(["bench", "--steps", "2"]) == 130
    assert capsys.readouterr().err == "gpipe: interrupted; nothing was written\n"


def test_a_command_that_ends_with_130_itself_gets_no_extra_line(capsys):
    # train returns 130 after a stop it has reported (checkpoint written): the parser's line must not follow.
    import typer

    from gpipe_cli import cli

    @cli.app.command("stopped-for-test")
    def stopped() -> None:
        raise typer.Exit(130)

    try:
        assert run(["stopped-for-test"]) == 130
    finally:
        cli.app.registered_commands.pop()
    assert capsys.readouterr().err == ""


def test_a_missing_argument_is_named_as_the_help_names_it(capsys):
    assert run(["report"]) == 2
    assert "Missing argument 'RUN_DIR'" in capsys.readouterr().err


def _turned_into_another_error(*args, **kwargs):
    # pydantic building a schema at that moment wraps the KeyboardInterrupt in its own SchemaError.
    from gpipe_cli import interrupts
    interrupts._interrupted = True
    raise RuntimeError("Error building validator")


class _Carried(BaseException):
    """As torch's CheckpointException, which carries a rank's KeyboardInterrupt: not an Exception."""


def _carried_in_a_base_exception(*args, **kwargs):
    from gpipe_cli import interrupts
    interrupts._interrupted = True
    raise _Carried("CheckpointException ranks:dict_keys([0])")


@pytest.mark.parametrize("turned", [_turned_into_another_error, _carried_in_a_base_exception])
def test_ctrl_c_that_a_loading_library_turns_into_its_own_error_is_still_one_line(monkeypatch, capsys, tmp_path,
                                                                                  turned):
    monkeypatch.setattr(__import__("gpipe_cli.train.export", fromlist=["export"]), "export", turned)
    assert run(["export", str(tmp_path)]) == 130
    assert capsys.readouterr().err == "gpipe export: interrupted; nothing was written\n"


def test_an_error_without_a_ctrl_c_is_not_taken_for_one(monkeypatch, tmp_path):
    def fails(*args, **kwargs):
        raise RuntimeError("a real failure")

    monkeypatch.setattr(__import__("gpipe_cli.train.export", fromlist=["export"]), "export", fails)
    with pytest.raises(RuntimeError, match="a real failure"):
        run(["export", str(tmp_path)])


def test_a_ctrl_c_swallowed_while_loading_starts_no_rank(monkeypatch):
    from gpipe_cli import interrupts
    from gpipe_cli.launch import launcher

    def never(*args, **kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(launcher, "_config", never)
    interrupts._interrupted = True  # the handler ran; the KeyboardInterrupt it raised was lost in a library
    with pytest.raises(KeyboardInterrupt):
        launcher.launch("gpipe_cli.train.worker", [], 1)


@pytest.mark.parametrize("command", ["export", "validate"])
def test_a_ctrl_c_lost_while_torch_loads_still_stops_the_command_before_it_writes(command, tmp_path, capsys):
    from gpipe_cli import interrupts

    out = tmp_path / ("model.safetensors" if command == "export" else "plan.json")
    args = (["export", str(tmp_path), "--output", str(out)] if command == "export"
            else ["validate", "recipes/quickstart.yaml", "--json", str(out)])
    interrupts._interrupted = True  # the handler ran; the KeyboardInterrupt it raised was lost in torch's import
    assert run(args) == 130
    assert capsys.readouterr().err.strip() == f"gpipe {command}: interrupted; nothing was written"
    assert not out.exists()


def test_an_option_missing_its_value_points_at_its_command_help(capsys):
    assert run(["train", "--set"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "'--set' requires an argument" in err and "gpipe train --help" in err


@pytest.mark.parametrize("args, line", [
    # It trained 200 steps into a folder named --dry-run; validate wrote a file named --set.
    (["train", "--output-dir", "--dry-run"], "--output-dir takes a value, and the next word is the option --dry-run: "
                                             "give --output-dir its value first (a name that begins with -- is "
                                             "written ./--dry-run)"),
    (["validate", "--json", "--set"], "--json takes a value, and the next word is the option --set: give --json its "
                                      "value first (a name that begins with -- is written ./--set)"),
])
def test_an_option_whose_value_would_be_the_next_option_is_one_line_before_anything_runs(tmp_path, monkeypatch,
                                                                                       capsys, args, line):
    monkeypatch.chdir(tmp_path)
    assert run(args) == 2
    assert capsys.readouterr().err == f"error: {line} (see 'gpipe {args[0]} --help')\n"
    assert list(tmp_path.iterdir()) == []


def test_an_option_given_twice_takes_its_last_value_and_a_bare_resume_stands_before_an_option(capsys, tmp_path,
                                                                                             monkeypatch):
    # As a shell alias that gives an option first expects (`alias v='gpipe validate --json a.json'`).
    monkeypatch.chdir(tmp_path)
    assert run(["validate", "--json", "a.json", "--json", "b.json"]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["b.json"]
    assert run(["train", "--resume", "--output-dir", str(tmp_path / "none"), "--dry-run"]) == 0
    capsys.readouterr()


def test_a_dry_run_gives_the_notes_the_launch_would(capsys, tmp_path, monkeypatch):
    # validate and the launch said that adam reads no momentum; the dry run, which a resume is checked with, did not.
    monkeypatch.chdir(tmp_path)
    assert run(["train", "--set", "optimizer.name=adam", "--set", "optimizer.momentum=0.5", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == ("note: optimizer.momentum (0.5) is read only by optimizer.name sgd or rmsprop: "
                                    "adam trains without it")
    assert not (tmp_path / "outputs").exists()


# Loaded first in the command's interpreter: Ctrl-C arrives while the command line's libraries load.
CTRL_C_WHILE_LOADING = '''
import builtins, os, signal

_import = builtins.__import__


def _loading(name, *args, **kwargs):
    if name == "typer":
        builtins.__import__ = _import
        os.kill(os.getpid(), signal.SIGINT)
    return _import(name, *args, **kwargs)


builtins.__import__ = _loading
'''


@pytest.mark.parametrize("module", ["gpipe_cli.cli", "gpipe_cli"])
def test_ctrl_c_while_python_m_loads_the_command_line_is_one_line(tmp_path, module):
    (tmp_path / "sitecustomize.py").write_text(CTRL_C_WHILE_LOADING)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", module, "validate"], capture_output=True, text=True, timeout=120,
                          env=env, preexec_fn=as_from_a_terminal)
    assert (done.returncode, done.stderr) == (130, "gpipe: interrupted; nothing was written\n")


@pytest.mark.parametrize("args", [["validate"], ["--help"], ["bench", "--help"]])
def test_a_reader_that_goes_ends_a_command_quietly_with_code_141(tmp_path, args):
    # `gpipe validate | head -1`: the shell's code for a closed pipe, not 1 (a failure) and no traceback.
    read, write = os.pipe()
    with subprocess.Popen([sys.executable, "-m", "gpipe_cli.cli", *args], stdout=write,
                          stderr=subprocess.PIPE, cwd=tmp_path) as process:
        os.close(write)
        os.close(read)  # before it prints: whatever the output's size, its first write finds the reader gone
        _, err = process.communicate(timeout=120)
    assert process.returncode == 141
    assert err == b""


@pytest.mark.parametrize("item, says", [("pipeline.partitions=100",
                                         "--set pipeline.partitions: cannot cut 6 pipeline layers"),
                                        ("pipeline.balance=[1,1]", "--set pipeline.balance: balance [1, 1] sums to 2")])
def test_a_cut_the_layers_cannot_take_names_the_set_that_asked_for_it(capsys, item, says):
    assert run(["validate", "--set", item]) == 2
    assert says in capsys.readouterr().err


INTERLEAVED = ["--set", "pipeline.microbatches=8", "--set", "pipeline.schedule=interleaved", "--set",
               "pipeline.virtual_stages=2"]


@pytest.mark.parametrize("args, line", [
    (["validate", "recipes/quickstart.yaml", "--set", "pipeline.partitions=4", *INTERLEAVED],
     "error: recipes/quickstart.yaml: cannot cut 6 pipeline layers into 8 chunks (pipeline.partitions 4 x "
     "pipeline.virtual_stages 2): at most 6"),
    (["bench", "--schedule", "interleaved", "--virtual-stages", "2", "--partitions", "4", "--layers", "2",
      "--microbatches", "8"],
     "error: cannot cut 4 pipeline layers into 8 chunks (--partitions 4 x --virtual-stages 2): at most 4"),
    (["bench", "--simulate", "--devices", "4", "--schedule", "interleaved", "--virtual-stages", "2", "--layers", "2",
      "--microbatches", "8"],
     "error: cannot cut 4 pipeline layers into 8 chunks (--devices 4 x --virtual-stages 2): at most 4"),
])
def test_too_many_chunks_are_called_chunks_made_of_k_and_v_never_partitions_the_user_did_not_set(capsys, args, line):
    # Partitions 4 with 2 chunks each read "cannot cut 6 pipeline layers into 8 partitions": 8 was never typed.
    assert run(args) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [line] and "partitions must be" not in err


@pytest.mark.parametrize("args, says", [
    (["bench", "--balance", "params"], "error: --balance: this command cuts by 'auto', 'time' or a list of layer"),
    (["profile-memory", "--balance", "time"], "error: --balance: this command cuts by 'auto' or a list of layer"),
    (["bench", "--set", "pipeline.balance=memory"], "error: --set pipeline.balance: this command cuts by 'auto'"),
    # Not the recipe key's every mode, which the command would then refuse in turn.
    (["bench", "--balance", "3,x"], "error: --balance: this command cuts by 'auto', 'time' or a list of layer "
                                    "counts per stage (got '3,x')")])
def test_a_cut_a_command_does_not_make_is_named_by_its_flag_and_its_help_lists_only_those_it_makes(capsys, args, says):
    assert run(args) == 2
    assert capsys.readouterr().err.startswith(says)
    run([args[0], "--help"])
    assert "params" not in capsys.readouterr().out.split("--balance")[1].split("--")[0]


@pytest.mark.parametrize("command", ["bench", "profile-memory"])
@pytest.mark.parametrize("args, says", [
    (["--virtual-stages", "2"], "error: --virtual-stages 2: gpipe runs one chunk per stage; give --schedule"),
    (["--batch-size", "7"], "error: --microbatches (8, its default) must be <= --batch-size (7)"),
    (["--batch-size", "2", "--microbatches", "4"], "error: --microbatches (4) must be <= --batch-size (2)"),
    (["--set", "data.batch_size=2"], "error: --microbatches (8, its default) must be <= --set data.batch_size (2)")])
def test_bench_and_profile_memory_word_a_mistake_alike_naming_the_flags_typed(capsys, command, args, says):
    assert run([command, *args]) == 2
    assert capsys.readouterr().err.startswith(says)


@pytest.mark.parametrize("command", [["bench"], ["plan", "--devices", "2"]])
def test_a_size_flag_of_another_family_is_worded_alike_by_bench_and_plan(capsys, command):
    # plan, planning the built-in recipe, listed the schema's keys ("--filters: unknown key (a key of model.kind
    # amoebanet); allowed keys here: kind, preset, ...").
    assert run([*command, "--filters", "16"]) == 2
    assert capsys.readouterr().err.startswith("error: --filters does not apply to transformer models (their size "
                                              "flags: --layers, --d-model")


def test_an_error_whose_reader_has_gone_keeps_its_exit_code(tmp_path):
    # `gpipe validate --set x=1 2>&1 | head -0`: click exited 1, as if the command itself had failed otherwise.
    read, write = os.pipe()
    with subprocess.Popen([sys.executable, "-m", "gpipe_cli.cli", "validate", "--set", "x=1"], stdout=write,
                          stderr=write, cwd=tmp_path) as process:
        os.close(write)
        os.close(read)
        process.wait(timeout=120)
    assert process.returncode == 2


@pytest.mark.parametrize("command", COMMANDS)
def test_h_is_help_as_most_commands_take_it(capsys, command):
    assert run([command, "-h"] if command else ["-h"]) == 0
    assert "Show this message and exit" in capsys.readouterr().out


@pytest.mark.parametrize("args, says", [
    (["train", "--partitions", "2"],
     "No such option: --partitions; gpipe train takes it as --set pipeline.partitions=2"),
    (["train", "--steps=5"], "No such option: --steps; gpipe train takes it as --set train.steps=5"),
    (["validate", "--seq-len"], "No such option: --seq-len; gpipe validate takes it as --set data.seq_len=VALUE"),
    (["train", "--name", "a b"], "No such option: --name; gpipe train takes it as --set 'name=a b'"),
    (["train", "--colour", "3"], "No such option: --colour (see"),  # no recipe key: click's own words
    # plan searches K: no --set, but the commands that take K
    (["plan", "--partitions", "2", "--devices", "2"],
     "No such option: --partitions; gpipe bench and gpipe profile-memory have it (see"),
])
def test_a_recipe_key_typed_as_a_flag_is_answered_with_its_set(capsys, args, says):
    # `gpipe train --partitions 2` was offered --plain.
    assert run(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {says}") and err.count("\n") == 1


# click offered any option with a few letters in common: `--step` got --help and --set, `--budget` got --set.
@pytest.mark.parametrize("args, says", [
    (["train", "--step", "20"], "No such option: --step; did you mean --set train.steps=20? (see 'gpipe train"),
    (["validate", "--microbatch=4"], "No such option: --microbatch; did you mean --set pipeline.microbatches=4? (see"),
    (["bench", "--budget", "8G"], "No such option: --budget; gpipe profile-memory has it (see 'gpipe bench --help')"),
    # One dash: click read `-resume` as the short options -r, -e, ... and said "No such option: -r".
    (["train", "-resume"], "No such option: -resume; did you mean --resume? (see 'gpipe train --help')"),
    (["bench", "-partitions", "2"], "No such option: -partitions; did you mean --partitions? (see"),
    (["export", "run", "--json", "x"],
     "No such option: --json; gpipe validate, gpipe bench and gpipe profile-memory have it (see"),
    (["train", "--plian"], "No such option: --plian; did you mean --plain? (see"),
    (["bench", "--stpes", "3"], "No such option: --stpes; did you mean --steps? (see"),
    (["validate", "--fast"], "No such option: --fast (see 'gpipe validate --help')"),
    (["bench", "--colour"], "No such option: --colour (see 'gpipe bench --help')"),
    # profile-memory's --device is cpu or cuda: plan's own --devices was meant
    (["plan", "--device", "2"], "No such option: --device (gpipe profile-memory has it); did you mean --devices? (see"),
])
def test_an_unknown_option_is_answered_with_a_near_key_another_command_or_a_near_option(capsys, args, says):
    assert run(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {says}") and err.count("\n") == 1, err


@pytest.mark.parametrize("args, line", [
    # Too short for difflib's likeness, `--out` got no suggestion.
    (["report", "RUN", "--out", "r.png"], "No such option: --out; did you mean --output? (see 'gpipe report --help')"),
    (["train", "--out", "runs/a"], "No such option: --out; did you mean --output-dir? (see 'gpipe train --help')"),
    (["plan", "--dev", "2"], "No such option: --dev; did you mean --device-memory or --devices? (see 'gpipe plan "
                             "--help')"),
    (["train", "--o", "3"], "No such option: --o (see 'gpipe train --help')"),  # one letter begins too many
    # Two letters swapped, which difflib's likeness leaves out of a short name.
    (["predict", "RUN", "one", "--tpo", "3"],
     "No such option: --tpo; did you mean --top? (see 'gpipe predict --help')"),
])
def test_an_option_typed_as_the_start_of_an_own_option_is_answered_with_it(capsys, args, line):
    assert run(args) == 2
    assert capsys.readouterr().err == f"error: {line}\n"


@pytest.mark.parametrize("args, line", [
    (["train", "recipes/quickstart.yaml", "train.steps=3"],
     "Got unexpected extra argument(s) (train.steps=3); to override a recipe key give --set train.steps=3 "
     "(see 'gpipe train --help')"),
    (["validate", "recipes/quickstart.yaml", "train.steps=3", "name=a b"],
     "Got unexpected extra argument(s) (train.steps=3 name=a b); to override a recipe key give --set train.steps=3 "
     "--set 'name=a b' (see 'gpipe validate --help')"),
    # Not KEY=VALUE, or a command without --set: click's own words.
    (["validate", "recipes/quickstart.yaml", "more"], "Got unexpected extra argument(s) (more) (see 'gpipe validate "
                                                      "--help')"),
    (["export", "RUN", "x=1"], "Got unexpected extra argument(s) (x=1) (see 'gpipe export --help')"),
])
def test_an_extra_argument_typed_as_key_value_is_answered_with_its_set(capsys, args, line):
    assert run(args) == 2
    assert capsys.readouterr().err == f"error: {line}\n"


def test_help_as_a_command_shows_the_help_asked_for(capsys):
    assert run(["help"]) == 0 and "Usage: gpipe [OPTIONS] COMMAND" in capsys.readouterr().out
    assert run(["help", "train"]) == 0 and "Usage: gpipe train [OPTIONS] [RECIPE]" in capsys.readouterr().out
    assert run(["help", "trian"]) == 2 and "No such command 'trian'. Did you mean 'train'?" in capsys.readouterr().err
    assert run(["help", "train", "bench"]) == 2
    assert capsys.readouterr().err == "error: help takes one command; got 2: train bench (see 'gpipe --help')\n"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("args", [["validate"], ["--help"], ["--version"], ["plan", "--devices", "2", "--tflops",
                                                                            "10", "--bandwidth", "10"]])
def test_standard_output_on_a_full_disk_is_one_line_not_a_traceback(tmp_path, args):
    # rich's write raised ENOSPC through every command: a traceback of 50 lines, exit 1.
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "gpipe_cli", *args], stdout=full, stderr=subprocess.PIPE,
                              text=True, cwd=tmp_path, timeout=300, env={**os.environ, "COLUMNS": "120"})
    assert proc.returncode == 1 and proc.stderr == ("error: cannot write to standard output (No space left on "
                                                    "device); what it should have shown is lost\n"), proc.stderr


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_bad_input_with_a_standard_error_that_refuses_writes_still_exits_2(tmp_path):
    # A shell's `2>&-` under a wrapper script left that script open for reading as standard error: exit 1.
    (tmp_path / "read-only").write_text("")
    for name, mode in (("/dev/full", "w"), (tmp_path / "read-only", "r")):
        with open(name, mode) as refusing:
            proc = subprocess.run([sys.executable, "-m", "gpipe_cli", "validate", "--set", "train.stepz=3"],
                                  stdout=subprocess.PIPE, stderr=refusing, text=True, cwd=tmp_path, timeout=300)
        assert proc.returncode == 2 and proc.stdout == ""


@pytest.mark.parametrize(("args", "line"), [
    (["plan", "--devices", "2", "--bandwidth", "12GB/s"],
     "error: --bandwidth: must be a number, e.g. 12 or 0.5 (got '12GB/s') (see 'gpipe plan --help')"),
    (["plan", "--devices", "2", "--tflops", "abc"],
     "error: --tflops: must be a number, e.g. 12 or 0.5 (got 'abc') (see 'gpipe plan --help')"),
    (["bench", "--simulate", "--devices", "4", "--latency-us", ""],
     "error: --latency-us: must be a number, e.g. 12 or 0.5 (got '') (see 'gpipe bench --help')"),
])
def test_a_number_flag_given_no_number_is_told_as_every_flag_is(capsys, args, line):
    # It was pydantic's "Invalid value for '--bandwidth': Input should be a valid number, unable to parse string".
    assert run(args) == 2
    assert capsys.readouterr().err == line + "\n"


def test_a_terminal_that_is_not_utf_8_gets_escapes_not_a_traceback(tmp_path):
    # Under latin-1 or a C locale without coercion, a spinner, a "·" or a translation's "…" was a UnicodeEncodeError.
    import os
    import subprocess
    import sys

    code = ("import sys, gpipe_cli.cli as cli\n"
            "cli.main = lambda: print('plan · K=2 … done')\n"
            "from gpipe_cli.entry import main\n"
            "main()\n")
    env = {**os.environ, "PYTHONIOENCODING": "ascii"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=120)
    assert (out.returncode, out.stdout, out.stderr) == (0, b"plan \\xb7 K=2 \\u2026 done\n", b"")



def test_a_flag_written_with_an_equals_sign_and_a_tilde_names_the_home_folder(tmp_path, monkeypatch, capsys):
    # The shell expands no ~ after `=`: `--output-dir=~/runs/x` made a folder named ~ here, which printed as the
    # home folder, and a text run's second rank looked for its tokenizer there.
    from gpipe_cli.cli import _home_expanded

    monkeypatch.setenv("HOME", str(tmp_path))
    assert _home_expanded(["train", "--output-dir=~/runs/x", "--set", "data.path=~/d", "--json=x~", "~/r"]) == [
        "train", f"--output-dir={tmp_path}/runs/x", "--set", "data.path=~/d", "--json=x~", "~/r"]
    monkeypatch.chdir(tmp_path)
    assert run(["train", "--output-dir=~/runs/x", "--dry-run"]) == 0
    assert f"--output-dir {tmp_path}/runs/x" in capsys.readouterr().out and not (tmp_path / "~").exists()


def test_a_current_directory_removed_under_the_shell_is_one_line(tmp_path, monkeypatch, capsys):
    # The ranks' start failed in a FileNotFoundError traceback from multiprocessing; other commands inside torch.
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    assert run(["validate"]) == 2
    assert capsys.readouterr().err == ("error: the current directory no longer exists; cd to one that does and run the "
                                       "command again\n")
