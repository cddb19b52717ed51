"""What the commands write (JSON figures, traces, PNGs) appears whole or not at all."""

import contextlib
import errno
import json
import os
from pathlib import Path

import pytest

from gpipe_cli import plots
from gpipe_cli.bench import trace
from gpipe_cli.errors import UserError
from gpipe_cli.files import atomic_write, atomic_write_text, check_not_input, check_output, hidden_prefix, writing
from gpipe_cli.recipe.load import default_recipe_text


def test_text_is_written_whole_with_no_temporary_file_left(tmp_path: Path):
    target = tmp_path / "sub" / "figures.json"
    atomic_write_text(target, '{"a": 1}')
    assert target.read_text() == '{"a": 1}' and os.listdir(target.parent) == ["figures.json"]


def test_a_write_that_fails_midway_leaves_the_old_file_and_no_partial_one(tmp_path: Path):
    target = tmp_path / "figures.json"
    target.write_text("old")

    def half_then_full_disk(f):
        f.write(b"{\"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space left on device"):
        atomic_write(target, half_then_full_disk)
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["figures.json"]
    # The folders a failed write made go with it (a full disk left a/b/); one that holds another file stays.
    with pytest.raises(OSError, match="No space left on device"):
        atomic_write(tmp_path / "a" / "b" / "figures.json", half_then_full_disk)
    assert sorted(os.listdir(tmp_path)) == ["figures.json"]
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "kept").write_text("")
    with pytest.raises(OSError, match="No space left on device"):
        atomic_write(tmp_path / "a" / "b" / "figures.json", half_then_full_disk)
    assert os.listdir(tmp_path / "a") == ["kept"]
    with pytest.raises(OSError):  # a folder it cannot make (a name too long): those made before it go too
        atomic_write(tmp_path / "new" / ("b" * 300) / "figures.json", half_then_full_disk)
    assert sorted(os.listdir(tmp_path)) == ["a", "figures.json"]


class _FailingFigure:
    """A figure whose PNG encoder fails after writing part of the file."""

    def tight_layout(self):
        pass

    def savefig(self, f, **kwargs):
        f.write(b"\x89PNG partial")
        raise KeyboardInterrupt  # Ctrl-C while the PNG is being written


class _Pyplot:
    def __init__(self):
        self.closed = []

    def close(self, fig):
        self.closed.append(fig)


def test_a_png_interrupted_while_written_is_not_left_behind(tmp_path: Path):
    plt, fig = _Pyplot(), _FailingFigure()
    with pytest.raises(KeyboardInterrupt):
        plots.save(plt, fig, tmp_path / "report.png")
    assert os.listdir(tmp_path) == [] and plt.closed == [fig]


def test_a_png_is_written_whole(tmp_path: Path):
    plt = pytest.importorskip("matplotlib.pyplot")
    fig, _ = plots.figure(plt, 200, 100, 1, 1, "title")
    path = plots.save(plt, fig, tmp_path / "out" / "report.png")
    assert path.read_bytes().startswith(b"\x89PNG") and os.listdir(path.parent) == ["report.png"]


def test_the_chrome_trace_is_whole_json(tmp_path: Path):
    events = [{"stage": 0, "microbatch": 0, "kind": "fwd", "start": 0.0, "end": 0.001}]
    trace.write(tmp_path / "trace.json", events, "title")
    assert json.loads((tmp_path / "trace.json").read_text())["traceEvents"]


# Every output flag is checked by `check_output` before any measuring: one line, nothing created.
def test_no_output_asked_is_nothing_to_check():
    check_output(None, "--json")


def test_a_new_file_in_a_writable_folder_passes_and_nothing_is_created(tmp_path: Path):
    check_output(tmp_path / "figures.json", "--json")
    check_output(tmp_path / "new" / "deeper" / "figures.json", "--json")  # atomic_write makes the folders
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("place,words", [
    ("folder", "it is a directory; name a file, e.g. "),
    ("under-a-file", "is not a directory"),
    ("/proc/x.json", "'/proc'"),
    ("/dev/null", "it exists and is not a regular file"),
    # The rename replaced /dev/stdout itself with a regular file, when stdout was redirected to one.
    ("/dev/stdout", "it is a symbolic link"),
    ("link.json", "it is a symbolic link"),
])
def test_a_place_no_file_can_be_written_is_one_line_naming_the_flag_and_value(tmp_path: Path, monkeypatch, place,
                                                                             words):
    if place == "/dev/stdout" and not os.path.islink(place):
        pytest.skip("/dev/stdout is no link here")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "folder").mkdir()
    (tmp_path / "a-file").write_text("")
    (tmp_path / "link.json").symlink_to("a-file")
    target = Path({"under-a-file": "a-file/x.json"}.get(place, place))
    with pytest.raises(UserError) as caught:
        check_output(target, "--json", "bench.json")
    message = str(caught.value)
    assert message.startswith(f"--json: cannot write {str(target)!r}") and words in message, message
    assert "\n" not in message
    assert sorted(os.listdir(tmp_path)) == ["a-file", "folder", "link.json"] and os.listdir(tmp_path / "folder") == []
    assert (tmp_path / "link.json").is_symlink() and os.path.islink(target) == (place in ("/dev/stdout", "link.json"))


def _refused(capsys, code: int) -> str:
    """The single error line of a refused command, checked for what every refusal must be."""
    captured = capsys.readouterr()
    assert code == 2, captured
    assert captured.err.startswith("error: ") and len(captured.err.splitlines()) == 1, captured.err
    assert "Traceback" not in captured.err + captured.out
    return captured.err


@pytest.mark.parametrize("where", ["folder", "/proc/j.json"])
def test_profile_memory_refuses_a_json_it_cannot_write_before_measuring(tmp_path, capsys, monkeypatch, where):
    from gpipe_cli.cli import run
    from gpipe_cli.profile import runner

    def measured(*args):
        raise AssertionError("measured before checking --json")

    monkeypatch.setattr(runner, "_run", measured)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "folder").mkdir()
    target = where
    err = _refused(capsys, run(["profile-memory", "--layers", "2", "--d-model", "32", "--ff", "64", "--heads", "2",
                                "--seq-len", "8", "--vocab-size", "64", "--partitions", "2", "--json", target]))
    assert f"--json: cannot write {target!r}" in err
    assert os.listdir(tmp_path) == ["folder"] and os.listdir(tmp_path / "folder") == []


# A legal name of 246 to 255 bytes made a temporary name `.NAME.XXXXXXXX` over the 255 a file system allows.
@pytest.mark.parametrize("name", ["c" * 250 + ".json", "é" * 126 + ".j", "x.json"])
def test_a_name_the_file_system_allows_is_written_however_long(tmp_path: Path, name):
    atomic_write_text(tmp_path / name, "{}")
    assert os.listdir(tmp_path) == [name] and (tmp_path / name).read_text() == "{}"


def test_a_temporary_name_keeps_to_the_limits_of_its_folder_and_suffix(tmp_path: Path):
    assert len(os.fsencode(hidden_prefix(tmp_path / ("n" * 255), ".gz"))) + 8 + 3 == 255
    assert hidden_prefix(tmp_path / "n.json") == ".n.json."
    # A folder path near PATH_MAX leaves the name fewer bytes: the temporary path fits where the file's does.
    folder = Path("/" + "/".join(["f" * 200] * 20))
    assert len(os.fsencode(str(folder / hidden_prefix(folder / ("n" * 70))))) + 8 == 4095


def test_a_folder_thousands_deep_is_made(tmp_path: Path):
    # pathlib's and os.makedirs's mkdir -p recurse once a level: a RecursionError past ~990 levels.
    target = tmp_path.joinpath(*["a"] * 1500, "x.json")
    try:
        atomic_write_text(target, "{}")
        assert target.read_text() == "{}"
    finally:  # shutil.rmtree, which pytest cleans up with, recurses too
        target.unlink(missing_ok=True)
        for folder in target.parents:
            if folder == tmp_path:
                break
            with contextlib.suppress(FileNotFoundError):
                folder.rmdir()


@pytest.mark.parametrize("target,words", [
    ("n" * 256 + ".json", "it has a name of 261 bytes; a name may have at most 255 bytes, a path at most 4095 bytes"),
    ("/".join(["f" * 200] * 21) + "/x.json", "it is 4227 bytes long; a name may have at most 255 bytes"),
    ("/".join(["f" * 200] * 20) + "/" + "g" * 70 + "/x",
     "its folder's path leaves no room for the temporary file it is written to first"),
], ids=["name", "path", "no room beside"])
def test_a_path_no_file_system_holds_is_one_line_naming_the_flag_and_what_is_allowed(tmp_path: Path, monkeypatch,
                                                                                  target, words):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as caught:
        check_output(Path(target), "--json")
    message = str(caught.value)
    assert message.startswith("--json: cannot write '") and words in message and "\n" not in message, message
    assert os.listdir(tmp_path) == []


def test_a_write_that_fails_is_one_line_naming_the_flag_and_the_reason(tmp_path: Path):
    target = tmp_path / "figures.json"

    def full_disk(f):
        f.write(b"{\"half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(UserError) as caught, writing(target, "--json"):
        atomic_write(target, full_disk)
    assert str(caught.value) == f"--json: cannot write {str(target)!r} (No space left on device)"
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------- an output that is the command's own input

def test_an_output_that_is_an_input_by_any_name_is_refused_and_another_is_not(tmp_path: Path):
    source = tmp_path / "r.yaml"
    source.write_text("name: r\n")
    (tmp_path / "link.yaml").symlink_to(source.name)
    os.link(source, tmp_path / "hard.yaml")
    for spelling in (source, tmp_path / "." / "r.yaml", tmp_path / "link.yaml", tmp_path / "hard.yaml"):
        with pytest.raises(UserError) as caught:
            check_not_input(spelling, "--json", [(None, "nothing"), (source, "the recipe itself")], "name another file")
        assert str(caught.value) == (f"--json {str(spelling)!r} is the recipe itself: writing there would replace it; "
                                     "name another file")
    check_not_input(tmp_path / "other.json", "--json", [(source, "the recipe itself")], "")  # a new file
    check_not_input(None, "--json", [(source, "the recipe itself")], "")
    assert source.read_text() == "name: r\n"


def _recipe(folder: Path) -> Path:
    """A small recipe file, as a user keeps one beside the outputs they ask for."""
    path = folder / "r.yaml"
    path.write_text(default_recipe_text())
    return path


# Each command with an output flag naming the recipe it reads (the refusal comes before any work: nothing that
# measures or loads torch for the model runs).
@pytest.mark.parametrize("args,flag,instead", [
    (["validate", "r.yaml", "--json", "r.yaml"], "--json", "r.plan.json"),
    (["validate", "link.yaml", "--json", "./r.yaml"], "--json", "r.plan.json"),
    (["bench", "r.yaml", "--steps", "1", "--warmup", "0", "--json", "r.yaml"], "--json", "r.bench.json"),
    (["bench", "r.yaml", "--steps", "1", "--warmup", "0", "--trace", "r.yaml"], "--trace", "r.trace.json"),
    (["profile-memory", "r.yaml", "--json", "r.yaml"], "--json", "r.memory.json"),
    (["plan", "link.yaml", "--devices", "2", "--output", "r.yaml"], "--output", "r.planned.yaml"),
], ids=["validate", "validate link", "bench json", "bench trace", "profile-memory", "plan"])
def test_an_output_that_is_the_recipe_read_is_refused_before_any_work(tmp_path, capsys, monkeypatch, args, flag,
                                                                      instead):
    from gpipe_cli.cli import run

    def worked(*args, **kwargs):
        raise AssertionError("the command worked before refusing its output")

    for where in ("gpipe_cli.train.plan.checked_plan", "gpipe_cli.bench.runner.run", "gpipe_cli.profile.runner.run",
                  "gpipe_cli.plan.runner._plan"):
        monkeypatch.setattr(where, worked)
    monkeypatch.chdir(tmp_path)
    recipe = _recipe(tmp_path)
    (tmp_path / "link.yaml").symlink_to(recipe.name)
    err = _refused(capsys, run(args))
    named = str(Path(args[args.index(flag) + 1]))
    assert err == (f"error: {flag} {named!r} is the recipe itself: writing there would replace it; name another "
                   f"file, e.g. {str(Path(named).with_name(instead))!r}\n")
    assert recipe.read_text() == default_recipe_text()
    assert sorted(os.listdir(tmp_path)) == ["link.yaml", "r.yaml"]


def test_validate_without_a_recipe_never_writes_over_the_built_in_one(capsys, monkeypatch):
    from gpipe_cli.cli import run
    from gpipe_cli.recipe.load import recipe_read

    built_in, what = recipe_read(None)
    assert isinstance(built_in, Path) and what == "the built-in recipe"
    monkeypatch.setattr("gpipe_cli.train.plan.checked_plan", lambda *a, **k: pytest.fail("planned first"))
    err = _refused(capsys, run(["validate", "--json", str(built_in)]))
    assert err.startswith(f"error: --json {str(built_in)!r} is the built-in recipe: writing there would replace it")
    assert built_in.read_text() == default_recipe_text()


def test_prepare_data_refuses_an_output_that_is_its_recipe(tmp_path, capsys, monkeypatch):
    from gpipe_cli.cli import run

    monkeypatch.setattr("gpipe_cli.data.prepare.prepare_data", lambda *a, **k: pytest.fail("prepared first"))
    monkeypatch.chdir(tmp_path)
    recipe = _recipe(tmp_path)
    (tmp_path / "link.yaml").symlink_to(recipe.name)
    err = _refused(capsys, run(["prepare-data", "link.yaml", "--output", "r.yaml"]))
    assert err == ("error: --output 'r.yaml' is the recipe itself: writing there would replace it; name a new "
                   "folder\n")
    assert recipe.read_text() == default_recipe_text() and sorted(os.listdir(tmp_path)) == ["link.yaml", "r.yaml"]


@pytest.mark.parametrize("command", [["validate"], ["bench", "--partitions", "2"], ["profile-memory"]])
def test_a_json_output_named_as_a_yaml_recipe_is_refused_and_the_recipe_kept(tmp_path: Path, command):
    """`gpipe bench --json recipes/quickstart.yaml` wrote its figures over the checkout's copy of the recipe."""
    from typer.testing import CliRunner

    from gpipe_cli.cli import app

    recipe = tmp_path / "quickstart.YML"
    recipe.write_text(default_recipe_text())
    got = CliRunner().invoke(app, [*command, "--json", str(recipe)])
    assert got.exit_code == 2 and "has a recipe's YAML name" in got.output, got.output
    assert f"name a .json file, e.g. {str(tmp_path / 'quickstart.json')!r}" in got.output
    assert recipe.read_text() == default_recipe_text()


@pytest.mark.parametrize("name,kind", [("report.png", "an image's"), ("curves.SVG", "an SVG"),
                                       ("model.safetensors", "a safetensors")])
def test_a_json_output_named_as_a_page_or_weights_is_refused(tmp_path: Path, monkeypatch, name, kind):
    """`gpipe validate --json report.png` wrote JSON into the run's page of curves."""
    from typer.testing import CliRunner

    from gpipe_cli.cli import app

    monkeypatch.chdir(tmp_path)
    got = CliRunner().invoke(app, ["validate", "--json", name])
    assert got.exit_code == 2, got.output
    assert f"--json {name!r} has {kind} name, and --json writes JSON; name a .json file" in got.output
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args,name,writes", [
    (["validate", "--json"], "README.md", "JSON"),  # the checkout's README became the plan's JSON
    (["bench", "--steps", "1", "--warmup", "0", "--json"], "pyproject.toml", "JSON"),
    (["bench", "--steps", "1", "--warmup", "0", "--trace"], "notes", "JSON"),
    (["profile-memory", "--json"], "figures", "JSON"),
    (["export", "run", "--output"], "README.md", "safetensors"),
])
def test_an_existing_file_of_another_kind_is_kept_not_replaced(tmp_path: Path, monkeypatch, capsys, args, name,
                                                                writes):
    from gpipe_cli.cli import run

    monkeypatch.chdir(tmp_path)
    Path(name).write_text("# mine\n")
    assert run([*args, name]) == 2
    flag = args[-1]
    assert capsys.readouterr().err == (
        f"error: {flag} {name!r} is a file that holds no {writes}, which {flag} would replace; name a "
        f"{'.safetensors' if writes == 'safetensors' else '.json'} file, e.g. "
        f"{Path(name).stem + ('.safetensors' if writes == 'safetensors' else '.json')!r}, or remove that file first\n")
    assert Path(name).read_text() == "# mine\n" and [p.name for p in tmp_path.iterdir()] == [name]


def test_weights_written_before_under_another_name_are_replaced_and_json_there_is_kept(tmp_path: Path):
    import torch
    from safetensors.torch import save_file

    from gpipe_cli.files import check_output_kind

    # A safetensors file begins with its header's length, then the header's JSON: read from its first byte, an earlier
    # export's weights were refused as no safetensors and a JSON file was taken for one.
    weights, notes = tmp_path / "weights", tmp_path / "notes"
    save_file({"w": torch.zeros(2)}, str(weights))
    notes.write_text('{"mine": 1}')
    check_output_kind(weights, "--output", "safetensors", ".safetensors", (".safetensors",))
    with pytest.raises(UserError, match="notes' is a file that holds no safetensors"):
        check_output_kind(notes, "--output", "safetensors", ".safetensors", (".safetensors",))

def test_a_json_file_of_any_name_written_before_is_written_again(tmp_path: Path, monkeypatch):
    from gpipe_cli.cli import run

    monkeypatch.chdir(tmp_path)
    for content in ("", '{"old": 1}', "  [1]"):  # empty, or JSON: what an earlier --json left
        Path("plan").write_text(content)
        assert run(["validate", "--json", "plan"]) == 0
        assert json.loads(Path("plan").read_text())["fits"] in (True, False)


# `validate --json -` wrote the plan into a file named '-' (export printed `wrote -`): to many commands '-' is stdout.
@pytest.mark.parametrize("args", [
    ["validate", "--json", "-"],
    ["bench", "--steps", "1", "--warmup", "0", "--json", "-"],
    ["bench", "--steps", "1", "--warmup", "0", "--trace", "-"],
    ["profile-memory", "--json", "-"],
    ["report", "run", "--output", "-"],
    ["export", "run", "--output", "-"],
], ids=["validate", "bench json", "bench trace", "profile-memory", "report", "export"])
def test_an_output_named_dash_is_refused_not_written_as_a_file(tmp_path, capsys, monkeypatch, args):
    from gpipe_cli.cli import run

    def worked(*args, **kwargs):
        raise AssertionError("the command worked before refusing its output")

    for where in ("gpipe_cli.train.plan.checked_plan", "gpipe_cli.bench.runner.run", "gpipe_cli.profile.runner.run",
                  "gpipe_cli.report.read_runs", "gpipe_cli.train.checkpoint.newest_whole"):
        monkeypatch.setattr(where, worked)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run").mkdir()
    err = _refused(capsys, run(args))
    flag = args[-2]
    assert err.startswith(f"error: {flag}: cannot write '-': outputs are written to files, never to stdout; name a "
                          "file, e.g. "), err
    assert os.listdir(tmp_path) == ["run"] and os.listdir(tmp_path / "run") == []


# `train --output-dir - --dry-run` printed a torchrun line that trains into a folder named '-'.
@pytest.mark.parametrize("args,instead", [
    (["train", "--output-dir", "-", "--dry-run"], "directory, e.g. runs/NAME, or leave the flag out for outputs/"),
    (["train", "--output-dir", "-"], "directory, e.g. runs/NAME, or leave the flag out for outputs/"),
    (["prepare-data", "recipe.yaml", "--output", "-"], "new folder, e.g. data/NAME"),
], ids=["train dry run", "train", "prepare-data"])
def test_an_output_folder_named_dash_is_refused_before_any_work(tmp_path, capsys, monkeypatch, args, instead):
    from gpipe_cli.cli import run

    def worked(*args, **kwargs):
        raise AssertionError("the command worked before refusing its output")

    for where in ("gpipe_cli.train.run.train_recipe", "gpipe_cli.recipe.load.load_recipe"):
        monkeypatch.setattr(where, worked)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipe.yaml").write_text("data: {source: hub, name: cifar10}\n")
    err = _refused(capsys, run(args))
    assert err.startswith(f"error: {args[args.index('-') - 1]}: cannot write '-': outputs are "
                          f"written to files, never to stdout; name a {instead}"), err
    assert os.listdir(tmp_path) == ["recipe.yaml"]


def test_a_writer_s_own_temporary_files_go_in_a_folder_that_the_next_write_removes_once_its_process_is_gone(tmp_path):
    # kill -9 during gpipe export left .tmpXXXXXX (the model's size) beside the run's files, for good.
    import subprocess

    from gpipe_cli.files import atomic_path_of_a_writer

    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = tmp_path / f".model.safetensors.{gone.pid}.d"
    stale.mkdir()
    (stale / ".tmpABCDEF").write_bytes(b"x" * 1000)
    alive = tmp_path / f".model.safetensors.{os.getppid()}.d"  # another process's, writing now
    alive.mkdir()
    target = tmp_path / "model.safetensors"
    with atomic_path_of_a_writer(target) as tmp:
        assert tmp.parent.name == f".model.safetensors.{os.getpid()}.d" and not stale.exists()
        (tmp.parent / ".tmpXYZ").write_bytes(b"y")  # as safetensors writes, then renames
        tmp.write_bytes(b"weights")
    assert target.read_bytes() == b"weights" and sorted(p.name for p in tmp_path.iterdir()) == [
        alive.name, "model.safetensors"]
    with pytest.raises(RuntimeError), atomic_path_of_a_writer(target) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError
    assert target.read_bytes() == b"weights" and sorted(p.name for p in tmp_path.iterdir()) == [
        alive.name, "model.safetensors"]


def test_a_name_of_256_bytes_is_refused_up_front_and_one_of_255_is_not():
    from gpipe_cli.files import path_problem

    # One byte past Linux's NAME_MAX went on to the file system, which refused it with its own error mid-command.
    assert path_problem("out/" + "n" * 255) is None
    assert path_problem("out/" + "n" * 256) == (
        "has a name of 256 bytes; a name may have at most 255 bytes, a path at most 4095 bytes")


def test_a_run_folder_too_deep_for_its_checkpoint_files_is_refused_before_any_step(tmp_path, capsys):
    # A legal 4,060-byte path trained every step, then failed at the first checkpoint: "File name too long".
    from gpipe_cli.cli import run

    deep = tmp_path.joinpath(*["d" * 200] * 20)
    assert run(["train", "--output-dir", str(deep), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --output-dir: ") and "bytes long as a full path, and the run's checkpoint files " \
        "lie up to 100 bytes below it; a path may have at most 4095 bytes: give a shorter one" in err
    assert run(["train", "--output-dir", str(tmp_path.joinpath(*["d" * 200] * 18)), "--dry-run"]) == 0


@pytest.mark.parametrize("name", ["plain run", "new\nline", "tab\there", "it's", "back\\slash", "-run", "é",
                                  os.fsdecode(b"latin-\xe9"), "bell\x07"])
def test_a_path_is_one_line_of_output_and_one_word_the_shell_reads_back(name):
    # A run folder with a newline split the `checkpoint:`, `run directory:` and `wrote` lines in two.
    import shutil
    import subprocess

    from gpipe_cli.errors import path_line, shell_path

    assert "\n" not in path_line(name) and "\n" not in shell_path(name)
    if name.isprintable():
        assert path_line(name) == name  # as typed, whatever it holds, when it prints as it is
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash to read the words back")
    words = {shell_path(name): f"./{name}" if name.startswith("-") else name}  # advice runs as printed
    if not name.isprintable():
        words[path_line(name)] = name
    for word, meant in words.items():
        read = subprocess.run([bash, "-c", f"printf %s {word}"], capture_output=True, check=True).stdout
        assert read == os.fsencode(meant), word
