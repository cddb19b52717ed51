"""`gpipe predict`: one line of output per input for each model family; bad input is one line, exit code 2."""

from __future__ import annotations

import errno
import io
import itertools
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import save_file

from gpipe_cli.cli import run
from gpipe_cli.errors import shown_path
from tests.predict.exports import SIZES, write_export
from tests.train.test_checkpoint import save_one
from tests.train.test_export_inputs import one_error_line


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("exports")
    return {family: write_export(folder, family) for family in ("translation", "lm", "image")}


@pytest.fixture(scope="module")
def picture(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("images") / "picture.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (20, 30, 3), dtype=np.uint8)).save(path)
    return path


def test_a_translation_model_answers_each_sentence_on_its_own_line(exports, monkeypatch, capsys):
    assert run(["predict", str(exports["translation"]), "one two three", "seven"]) == 0
    assert len(capsys.readouterr().out.split("\n")) == 3  # two lines
    # An empty sentence is refused as an argument (below); a blank line of stdin is answered with a blank line.
    monkeypatch.setattr("sys.stdin", io.StringIO("one two three\nseven\n\n"))
    assert run(["predict", str(exports["translation"])]) == 0
    assert len(capsys.readouterr().out.split("\n")) == 4  # three lines, the empty sentence's empty


def test_an_image_model_answers_a_blank_line_of_stdin_with_a_blank_line(exports, picture, monkeypatch, capsys):
    # It stopped at the blank line ("INPUT: an empty path names no file", exit 2), leaving the next unanswered.
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{picture}\n\n{picture}\n"))
    assert run(["predict", str(exports["image"])]) == 0
    captured = capsys.readouterr()
    lines = captured.out.split("\n")
    assert len(lines) == 4 and lines[1] == "" and lines[0].startswith(f"{picture}\t") and lines[2] == lines[0]
    assert captured.err == ""


def test_an_answer_the_model_leaves_empty_keeps_its_line_and_is_said_on_stderr(exports, monkeypatch, capsys):
    # An undertrained translation model answered with an empty line and no word of why.
    monkeypatch.setattr("gpipe_cli.predict.tasks.translate", lambda *args, **kwargs: [[]])
    assert run(["predict", str(exports["translation"]), "one", "two"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "\n\n"  # one line per input still
    assert captured.err == ("[gpipe] input 1: the model produced no tokens (it may need more training)\n"
                            "[gpipe] input 2: the model produced no tokens (it may need more training)\n")


def test_a_sentence_the_tokenizer_reads_nothing_of_is_said_so_not_blamed_on_training(exports, capsys):
    # A zero-width space alone was answered with a blank line and "the model produced no tokens (it may need more
    # training)": the model never ran.
    assert run(["predict", str(exports["translation"]), "\u200b\u200b", "one"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("\n") and captured.out.count("\n") == 2
    assert captured.err == "[gpipe] input 1: nothing to translate: the model's tokenizer drops every character of it\n"


def test_a_continuation_that_ends_the_document_at_once_is_said_so(exports, monkeypatch, capsys):
    # The prompt came back alone, with no word: it read as if nothing had run.
    monkeypatch.setattr("gpipe_cli.predict.tasks.continue_text", lambda *args: iter(()))
    assert run(["predict", str(exports["lm"]), "one two", "three"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "one two\nthree\n"
    said = "the model ended the document right after the prompt, adding nothing (it may need more training)"
    assert captured.err == f"[gpipe] input 1: {said}\n[gpipe] input 2: {said}\n"


@pytest.mark.parametrize(("family", "args", "line"), [
    ("translation", [""], "error: INPUT: empty; give a sentence to translate"),
    ("translation", ["one", " \t"], "error: INPUT 2 of 2: only whitespace; give a sentence to translate"),
    ("lm", ["   ", "--max-tokens", "5"], "error: INPUT: only whitespace; give a prompt to continue"),
    ("lm", ["one", "", "two"], "error: INPUT 2 of 3: empty; give a prompt to continue"),
    # Named as the empty one is: it was "an input is not UTF-8 text", after the inputs before it were answered.
    ("translation", ["caf\udce9"], "error: INPUT: not UTF-8 text (byte 0xe9 at character 4); give a sentence to "
                                    "translate in UTF-8"),
    ("lm", ["one", "caf\udce9", "two"], "error: INPUT 2 of 3: not UTF-8 text (byte 0xe9 at character 4); give a "
                                         "prompt to continue in UTF-8"),
], ids=["empty sentence", "blank sentence", "blank prompt", "empty prompt of three", "not UTF-8",
        "not UTF-8 of three"])
def test_an_empty_blank_or_not_utf8_input_argument_is_refused_in_one_line(exports, capsys, family, args, line):
    # It was answered with a blank line and exit code 0, as if something had been asked.
    code = run(["predict", str(exports[family]), *args])
    captured = capsys.readouterr()
    assert one_error_line(code, captured.err, captured.out) == line
    assert captured.out == ""  # refused before any input is answered


@pytest.mark.parametrize(("family", "blank_answers"), [("translation", ["", ""]), ("lm", ["", "   "])])
def test_blank_lines_of_stdin_are_answered_with_blank_lines(exports, monkeypatch, capsys, family, blank_answers):
    # They keep the answers beside their lines; a language model began a new document on one.
    monkeypatch.setattr("sys.stdin", io.StringIO("one two\n\n   \nthree\n"))
    assert run(["predict", str(exports[family]), *(["--max-tokens", "3"] if family == "lm" else [])]) == 0
    lines = capsys.readouterr().out.split("\n")
    assert len(lines) == 5 and lines[1:3] == blank_answers and lines[4] == ""
    if family == "lm":  # the prompt as typed, then its continuation
        assert lines[0].startswith("one two") and lines[3].startswith("three")


@pytest.mark.parametrize("family", ["translation", "lm"])
def test_an_input_the_tokenizer_knows_none_of_is_said_on_stderr_and_still_answered(exports, capsys, family):
    # It was answered as any other, though the model read nothing of it.
    args = ["日本語 ☃ 🙂", "one 日本"] + (["--max-tokens", "3"] if family == "lm" else [])
    assert run(["predict", str(exports[family]), *args]) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [  # the second is partly known: its unknown characters are named
        "[gpipe] the model's tokenizer knows none of the characters of '日本語 ☃ 🙂': the model reads it as unknown "
        "pieces only, so its answer cannot follow from it",
        "[gpipe] the model's tokenizer knows no piece for '日', '本' of 'one 日本': the model reads them as unknown, "
        "so its answer may not follow from the input"]
    assert captured.out.count("\n") == 2


def test_a_language_model_continues_the_prompt_by_at_most_max_tokens(exports, capsys):
    assert run(["predict", str(exports["lm"]), "one two", "--max-tokens", "3"]) == 0
    line = capsys.readouterr().out.rstrip("\n")
    assert line.startswith("one two") and "\n" not in line
    assert len(line) <= len("one two") + 3 * max(len(w) for w in ("hundred", "thousand")) + 3


def test_a_language_model_answer_starts_with_the_prompt_as_typed(exports, capsys):
    prompt = "  one  two\tünïcode"  # the tokenizer folds the spaces and knows none of those letters
    assert run(["predict", str(exports["lm"]), prompt, "--max-tokens", "2"]) == 0
    assert capsys.readouterr().out.startswith(prompt)


def test_a_ctrl_c_after_some_answers_says_how_many_were_printed(exports, monkeypatch, capsys):
    class Typed(io.StringIO):
        def __iter__(self):
            yield "one two\n"
            raise KeyboardInterrupt  # while the next line is awaited

    monkeypatch.setattr("sys.stdin", Typed())
    assert run(["predict", str(exports["translation"])]) == 130
    captured = capsys.readouterr()
    assert captured.out.count("\n") == 1 and captured.err == "gpipe predict: interrupted after 1 answer\n"


def test_a_ctrl_c_before_any_answer_says_only_that_predict_was_interrupted(exports, monkeypatch, capsys):
    # It said "interrupted; nothing was written", of a command that never writes a file.
    class Waiting(io.StringIO):
        def __iter__(self):
            raise KeyboardInterrupt  # while the first line is awaited

    monkeypatch.setattr("sys.stdin", Waiting())
    assert run(["predict", str(exports["translation"])]) == 130
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == "gpipe predict: interrupted\n"


class Screen(io.StringIO):
    """A stdout whose reader acts once `after` pieces of an answer have been written: Ctrl-C, or it goes."""

    def __init__(self, after: int, stop: type[BaseException]) -> None:
        super().__init__()
        self.after, self.stop, self.pieces = after, stop, 0

    def write(self, text: str) -> int:
        if text != "\n":
            self.pieces += 1
            if self.pieces > self.after:
                raise self.stop
        return super().write(text)


def endless(model, prompt, max_tokens, window, vocab):
    """A continuation that never reaches the end of a document: the prompt's tokens over and over."""
    return itertools.islice(itertools.cycle(list(prompt)), max_tokens)


def test_a_continuation_is_written_as_it_grows_and_a_ctrl_c_ends_its_line(exports, monkeypatch, capsys):
    monkeypatch.setattr("gpipe_cli.predict.tasks.continue_text", endless)
    screen = Screen(after=2, stop=KeyboardInterrupt)  # the prompt and the first new text, then Ctrl-C
    monkeypatch.setattr("sys.stdout", screen)
    assert run(["predict", str(exports["lm"]), "one two", "--max-tokens", "100000"]) == 130
    assert screen.getvalue().startswith("one two") and screen.getvalue().count("\n") == 1
    assert screen.getvalue().endswith("\n") and len(screen.getvalue()) > len("one two\n")
    assert capsys.readouterr().err == "gpipe predict: interrupted during answer 1, its line cut short\n"


def test_a_continuation_whose_reader_has_gone_ends_at_once_with_141(exports, monkeypatch):
    monkeypatch.setattr("gpipe_cli.predict.tasks.continue_text", endless)
    monkeypatch.setattr("sys.stdout", Screen(after=3, stop=BrokenPipeError))  # `| head -c 10`
    assert run(["predict", str(exports["lm"]), "one two", "--max-tokens", "100000"]) == 141


def test_the_pieces_of_a_continuation_make_the_line_decoding_all_of_it_gives(exports, capsys):
    from gpipe_cli.models.transformer.decode import continue_text
    from gpipe_cli.predict import tasks

    exported = tasks.load_export(str(exports["lm"]))
    model, tok = exported.build(), tasks._tokenizer(exported)
    ids = tok.encode("one two")
    new = list(continue_text(model, ids, 6, int(exported.spec.config["max_len"]), tok.vocab_size))
    assert run(["predict", str(exports["lm"]), "one two", "--max-tokens", "6"]) == 0
    assert capsys.readouterr().out == "one two" + tok.decode(ids + new)[len(tok.decode(ids)):] + "\n"


def test_a_language_model_prompt_longer_than_its_positions_still_continues(exports, capsys):
    # 40 words are more tokens than the model's 12 learned positions: it reads the last 12.
    prompt = " ".join(["twelve"] * 40)
    assert run(["predict", str(exports["lm"]), prompt, "--max-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith(prompt) and len(out.rstrip("\n")) > len(prompt)  # continued


def test_an_image_model_names_the_top_classes_of_each_file(exports, picture, capsys):
    assert run(["predict", str(exports["image"]), str(picture), "--top", "2"]) == 0
    path, classes = capsys.readouterr().out.rstrip("\n").split("\t")
    assert path == str(picture) and classes.count("class ") == 2 and classes.count("%") == 2


def test_the_top_classes_are_a_distribution_over_every_class(exports, picture, capsys):
    # A softmax over the wrong dimension printed "100.0%" for every class, and the order by it meant nothing.
    import re

    assert run(["predict", str(exports["image"]), str(picture), "--top", "3"]) == 0
    shares = [float(x) for x in re.findall(r"\(([\d.]+)%\)", capsys.readouterr().out)]
    assert len(shares) == 3 and sum(shares) == pytest.approx(100.0, abs=0.5) and shares == sorted(shares, reverse=True)


def test_a_run_directory_stands_for_the_model_gpipe_export_wrote_into_it(exports, tmp_path, capsys):
    (tmp_path / "model.safetensors").write_bytes(exports["translation"].read_bytes())
    assert run(["predict", str(tmp_path), "seven"]) == 0
    assert capsys.readouterr().out.count("\n") == 1


def _run_with_checkpoints(folder: Path, exported_step: int, *steps: int) -> Path:
    """A run directory whose model.safetensors is of `exported_step` and whose checkpoints are `steps`."""
    write_export(folder, "translation", step=str(exported_step)).rename(folder / "model.safetensors")
    for step in steps:
        (folder / "checkpoints" / f"step-{step:08d}").mkdir(parents=True)
        (folder / "checkpoints" / f"step-{step:08d}" / "manifest.json").write_text(json.dumps({"step": step}))
    (folder / "checkpoints" / "step-00000009").mkdir()  # a save that never finished: no manifest, not the newest
    return folder


def test_an_export_behind_the_runs_newest_checkpoint_is_said_in_one_line_and_still_answers(tmp_path, capsys):
    run_dir = _run_with_checkpoints(tmp_path, 3, 3, 5)
    assert run(["predict", str(run_dir), "seven"]) == 0
    out, err = capsys.readouterr()
    assert out.count("\n") == 1
    lines = [line for line in err.splitlines() if "newest checkpoint" in line]
    assert len(lines) == 1 and "export of step 3" in lines[0] and "newest checkpoint is step 5" in lines[0], err
    assert lines[0].endswith(f"gpipe export {run_dir}"), lines
    # The file named directly is the run's export all the same.
    assert run(["predict", str(run_dir / "model.safetensors"), "seven"]) == 0
    assert "newest checkpoint is step 5" in capsys.readouterr().err


def test_an_export_of_the_runs_newest_checkpoint_says_nothing_of_it(tmp_path, capsys):
    run_dir = _run_with_checkpoints(tmp_path, 5, 3, 5)
    assert run(["predict", str(run_dir), "seven"]) == 0
    assert "checkpoint" not in capsys.readouterr().err


def test_without_inputs_it_reads_the_lines_of_stdin(exports, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("one two\nthree\n\nfive\n"))
    assert run(["predict", str(exports["translation"])]) == 0
    assert capsys.readouterr().out.count("\n") == 4


def test_a_stdin_line_that_is_not_utf8_stops_in_one_line_after_the_lines_before_it(exports, monkeypatch, capsys):
    stdin = io.TextIOWrapper(io.BytesIO(b"one two\n\xff three\n"), encoding="utf-8", errors="surrogateescape")
    monkeypatch.setattr("sys.stdin", stdin)
    code = run(["predict", str(exports["lm"])])
    captured = capsys.readouterr()
    assert captured.out.count("\n") == 1  # the first line's answer
    assert "an input is not UTF-8 text (byte 0xff at character 1)" in one_error_line(code, captured.err, "")
    assert "on line 2 of stdin" in captured.err  # which line: the answers before it do not say


def not_an_export(folder: Path) -> Path:
    path = folder / "plain.safetensors"
    save_file({}, str(path), metadata={"format": "pt"})
    return path


def damaged(folder: Path) -> Path:
    return write_export(folder, "lm", model='{"kind": "transformer", "layers": "many"}')


def misfit(folder: Path) -> Path:  # a model description whose d_model is not the weights'
    config = {**SIZES["lm"], "d_model": 32}
    return write_export(folder, "lm", model=json.dumps(config))


def no_tokenizer(folder: Path) -> Path:
    return write_export(folder, "lm", tokenizer=None)


def speech(folder: Path) -> Path:  # predict treated it as the translation its model is
    return write_export(folder, "translation", task="speech")


def text_file(folder: Path) -> Path:
    path = folder / "notes.txt"
    path.write_text("not a model\n")
    return path


@pytest.mark.parametrize(("model", "args", "fragment"), [
    (lambda tmp, exports: tmp / "missing.safetensors", ["x"], "no such model file"),
    (lambda tmp, exports: tmp, ["x"], "is a directory without model.safetensors; write one with: gpipe export"),
    (lambda tmp, exports: text_file(tmp), ["x"], "is not a safetensors file"),
    (lambda tmp, exports: not_an_export(tmp), ["x"], "is not a gpipe export: it has no gpipe model description"),
    (lambda tmp, exports: damaged(tmp), ["x"], "is not a gpipe export: its model description is damaged"),
    (lambda tmp, exports: no_tokenizer(tmp), ["x"], "the export holds no tokenizer"),
    (lambda tmp, exports: speech(tmp), ["x"], "is not a gpipe export: its task 'speech' is none that this "
                                              "gpipe-cli runs (image, translation, lm)"),
    (lambda tmp, exports: write_export(tmp, "translation", task="lm"), ["x"],
     "is not a gpipe export: its model description is damaged (task 'lm', but its model's is 'translation')"),
    (lambda tmp, exports: write_export(tmp, "image", task=None), ["x"], "is not a gpipe export: it names no task"),
    (lambda tmp, exports: misfit(tmp), ["x"], "its weights do not fit its model (0.embed.weight has shape (64, 16) "
                                              "where the model has (64, 32))"),
    (lambda tmp, exports: exports["lm"], ["PICTURE"], "is an image file, but this is a language model"),
    (lambda tmp, exports: exports["translation"], ["PICTURE"], "is an image file, but this is a translation"),
    (lambda tmp, exports: exports["image"], ["one two"], "'one two': no such file; an image model classifies"),
    (lambda tmp, exports: exports["image"], [str(Path(__file__))], "is not an image PIL can read"),
    (lambda tmp, exports: exports["image"], ["FLOATS"], "cannot be classified: a 32-bit float image is read as "
                                                      "values in [0, 1]; this one holds values from 0 to 599"),
    # Python 3.11's pathlib raised "File name too long" from exists().
    (lambda tmp, exports: tmp / ("m" * 300), ["x"], "has a name of 300 bytes; a name may have at most 255"),
    (lambda tmp, exports: exports["image"], ["p" * 300 + ".png"], "has a name of 304 bytes"),
    (lambda tmp, exports: exports["image"], ["PICTURE", "--top", "4"],
     "--top: must be >= 1 and <= 3, the model's classes (got 4)"),
    (lambda tmp, exports: exports["translation"], ["x", "--max-tokens", "3"], "--max-tokens continues a language"),
    (lambda tmp, exports: exports["lm"], ["x", "--max-tokens", "0"], "--max-tokens: must be >= 1 and <= 100,000"),
    # Unbounded, a typo of more digits generated until killed.
    (lambda tmp, exports: exports["lm"], ["x", "--max-tokens", "99999999999999999999"],
     "--max-tokens: must be >= 1 and <= 100,000 (got 99999999999999999999)"),
    (lambda tmp, exports: exports["lm"], ["x", "--top", "2"], "--top ranks an image classifier's classes; "),
    # Bytes that are not UTF-8 reach Python as lone surrogates, which the tokenizer cannot take (a traceback).
    (lambda tmp, exports: exports["translation"], ["caf\udce9"], "INPUT: not UTF-8 text (byte 0xe9 at character 4)"),
], ids=["missing", "directory", "text file", "plain safetensors", "damaged", "no tokenizer", "unknown task",
        "task of another model", "no task", "weights of another shape",
        "image to lm",
        "image to translation", "text to image model", "non-image file", "float image", "model name too long",
        "image name too long", "top", "max-tokens of translation",
        "max-tokens 0", "max-tokens huge", "top of a text model", "not UTF-8"])
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, exports, picture, capsys, model, args, fragment):
    if "FLOATS" in args:
        Image.fromarray(np.arange(600, dtype=np.float32).reshape(20, 30), mode="F").save(tmp_path / "floats.tif")
    args = [str(picture) if a == "PICTURE" else str(tmp_path / "floats.tif") if a == "FLOATS" else a for a in args]
    code = run(["predict", str(model(tmp_path, exports)), *args])
    captured = capsys.readouterr()
    assert fragment in one_error_line(code, captured.err, captured.out)


def test_an_export_without_a_tokenizer_says_why_gpipe_export_left_it_out(tmp_path, capsys):
    # It said only "gpipe export said why", to a user who may never have seen that line.
    path = write_export(tmp_path, "lm", tokenizer=None, no_tokenizer="tokenizer file '/runs/a/tokenizer.model' does "
                                                                      "not exist")
    code = run(["predict", str(path), "one"])
    captured = capsys.readouterr()
    assert one_error_line(code, captured.err, captured.out) == (
        "error: the export holds no tokenizer, so gpipe predict cannot run it (at export, tokenizer file "
        "'/runs/a/tokenizer.model' does not exist); export the run again once its tokenizer file loads")


def test_a_weights_only_export_says_so_without_sending_the_user_back_to_gpipe_export(tmp_path, capsys):
    # A run without recipe.yaml exports its weights alone; predict called that file "not a gpipe export" and
    # advised `gpipe export RUN`, the command that had just written it.
    save_one(tmp_path / "run", 2, value=1.0)
    assert run(["export", str(tmp_path / "run")]) == 0
    assert "the export holds the weights only" in capsys.readouterr().err
    code = run(["predict", str(tmp_path / "run"), "one"])
    captured = capsys.readouterr()
    line = one_error_line(code, captured.err, captured.out)
    assert line == (f"error: {str(tmp_path / 'run')!r} cannot be run: it holds the weights alone, without the model "
                    "they belong to (its run had no recipe.yaml when it was exported)"), line


def test_an_export_of_a_newer_format_says_to_upgrade(tmp_path, capsys):
    path = write_export(tmp_path, "lm", gpipe_export="99")
    code = run(["predict", str(path), "one"])
    captured = capsys.readouterr()
    line = one_error_line(code, captured.err, captured.out)
    assert line == (f"error: {str(path)!r} cannot be read: it was written by a newer gpipe-cli (export format 99; "
                    "this one reads 1); upgrade gpipe-cli to use it"), line


@pytest.mark.parametrize("where", ["in the header", "in the data", "one byte short"])
def test_a_truncated_export_is_said_to_end_early_not_to_be_no_safetensors_file(tmp_path, exports, capsys, where):
    # A copy cut short was "not a safetensors file (Error while deserializing header: invalid header length)".
    whole = exports["image"].read_bytes()
    header_end = 8 + int.from_bytes(whole[:8], "little")
    keep = {"in the header": header_end // 2, "in the data": (header_end + len(whole)) // 2,
            "one byte short": len(whole) - 1}[where]
    path = tmp_path / "cut.safetensors"
    path.write_bytes(whole[:keep])
    code = run(["predict", str(path), "x"])
    captured = capsys.readouterr()
    says = (f"inside its header, which alone is {header_end:,} bytes" if where == "in the header"
            else f"where its header says {len(whole):,}")
    assert one_error_line(code, captured.err, captured.out) == (
        f"error: {shown_path(path)} is incomplete: it ends after {keep:,} bytes, {says}; copy it again whole, or "
        "write it again with: gpipe export RUN")


def test_an_empty_model_file_is_said_to_be_empty(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a short name: a long path is cut in the line
    Path("run").mkdir()
    Path("run", "model.safetensors").touch()
    code = run(["predict", "run", "x"])
    captured = capsys.readouterr()
    assert one_error_line(code, captured.err, captured.out).endswith(
        "model.safetensors' is empty (0 bytes); copy it again whole, or write it again with: gpipe export RUN")


def rewritten(path: Path, change) -> Path:
    """A copy of the export at `path` whose tensors `change` has edited in place (a dict of name -> tensor)."""
    with safe_open(str(path), framework="pt") as f:
        metadata, tensors = f.metadata(), {name: f.get_tensor(name).clone() for name in f.keys()}  # noqa: SIM118
    change(tensors)
    copy = path.with_name(f"changed-{path.name}")
    save_file(tensors, str(copy), metadata=metadata)
    return copy


@pytest.mark.parametrize(("family", "value", "what"), [("image", math.nan, "is NaN"), ("translation", math.inf,
                                                                                        "is infinite"),
                                                       ("lm", -math.inf, "is infinite")])
def test_an_export_whose_weights_are_not_finite_is_refused_naming_the_tensor(tmp_path, exports, picture, capsys,
                                                                            family, value, what):
    # Its answers followed from NaN: "class 2 (nan%)" and exit code 0, or an empty translation.
    first = {}

    def spoil(tensors):
        name = next(n for n, t in tensors.items() if t.is_floating_point())
        tensors[name].view(-1)[0] = value
        first.update(name=name, size=tensors[name].numel())

    path = rewritten(write_export(tmp_path, family), spoil)
    code = run(["predict", str(path), str(picture) if family == "image" else "one two"])
    captured = capsys.readouterr()
    assert one_error_line(code, captured.err, captured.out) == (
        f"error: {shown_path(path)} cannot be run: its weights are not all finite ({first['name']}: 1 of its "
        f"{first['size']:,} values {what})")
    assert captured.out == ""


def test_non_finite_weights_of_a_float16_export_say_which_dtype_holds_them(tmp_path, capsys):
    # float16 holds at most 65,504: a larger weight exported in it is infinite.
    def overflow(tensors):
        for name, tensor in tensors.items():
            tensors[name] = (tensor * 1e5).half() if tensor.is_floating_point() else tensor

    path = rewritten(write_export(tmp_path, "lm", dtype="float16"), overflow)
    code = run(["predict", str(path), "one"])
    captured = capsys.readouterr()
    line = one_error_line(code, captured.err, captured.out)
    assert "its weights are not all finite (" in line and "tensors hold such values" in line
    assert line.endswith("; export the run again with --dtype bfloat16 or float32"), line


@pytest.mark.parametrize("family", ["image", "lm", "translation"])
def test_outputs_that_are_not_finite_from_finite_weights_are_refused_in_one_line(tmp_path, exports, picture,
                                                                                 capsys, family):
    # Weights near float32's largest overflow on the way to the output: an answer would be picked from NaN.
    def huge(tensors):
        for name, tensor in tensors.items():
            if tensor.is_floating_point() and tensor.dim() == 2:
                tensors[name] = torch.where(tensor < 0, -3e38, 3e38)

    path = rewritten(write_export(tmp_path, family), huge)
    given = str(picture) if family == "image" else "one two"
    code = run(["predict", str(path), given])
    captured = capsys.readouterr()
    assert one_error_line(code, captured.err, captured.out) == (
        f"error: the model's outputs for {given!r} are not finite (NaN or infinite), though its weights are: it has "
        "no answer to give")


def test_a_model_file_that_cannot_be_read_is_said_so_not_called_missing(exports, monkeypatch, capsys):
    # safetensors said "No such file or directory" of a file this process may not read.
    def refused(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr("gpipe_cli.predict.open", refused, raising=False)
    code = run(["predict", str(exports["lm"]), "one"])
    captured = capsys.readouterr()
    assert one_error_line(code, captured.err, captured.out) == (f"error: cannot read '{exports['lm']}' (Permission "
                                                                "denied)")


def test_a_sentence_longer_than_the_model_reads_is_said_to_be_cut(exports, monkeypatch, capsys):
    # Its first max_len tokens were translated with no word, the rest of the sentence dropped.
    # Words the test's small tokenizer holds whole ("seven" has an 's' it has no piece for, which is said too).
    from gpipe_cli.predict import tasks

    sources = []

    def translate(model, src, *args):  # type: ignore[no-untyped-def]
        sources.append(src)
        return real(model, src, *args)

    real = tasks.translate
    monkeypatch.setattr("gpipe_cli.predict.tasks.translate", translate)
    assert run(["predict", str(exports["translation"]), " ".join(["one"] * 40), "one"]) == 0
    tok = tasks._tokenizer(tasks.load_export(str(exports["translation"])))
    assert sources[0].tolist() == [tok.encode(" ".join(["one"] * 40))[:24]]  # the very tokens it says it reads
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("[gpipe] a sentence of ") and lines[0].endswith(
        "tokens: its first 24 are translated (the model reads at most model.max_len = 24)")
    assert len(captured.out.split("\n")) == 3  # both sentences answered


def test_a_closed_standard_output_is_one_line(exports, monkeypatch, capsys):
    # `gpipe predict M one >&-` was an AttributeError traceback.
    monkeypatch.setattr("sys.stdout", None)
    code = run(["predict", str(exports["lm"]), "one"])
    captured = capsys.readouterr()
    assert code == 2 and captured.err == ("error: standard output is closed: predict prints its answers there; give "
                                          "it a file or a pipe\n")


def test_a_closed_standard_input_without_inputs_is_one_line(exports, monkeypatch, capsys):
    # `gpipe predict M <&-` was an AttributeError traceback (sys.stdin.isatty of None).
    monkeypatch.setattr("sys.stdin", None)
    code = run(["predict", str(exports["lm"])])
    captured = capsys.readouterr()
    assert code == 2 and captured.err == ("error: standard input is closed and no input was given: give the inputs "
                                          "as arguments, or one per line on stdin\n") and captured.out == ""
    assert run(["predict", str(exports["lm"]), "one"]) == 0  # inputs as arguments need no stdin


class FullDisk(io.StringIO):
    """A stdout on a full disk (`> /dev/full`): every write is refused."""

    def write(self, text: str) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")


def test_standard_output_on_a_full_disk_is_one_line(exports, monkeypatch, capsys):
    # print's refusal left no trace of standard output in its traceback: a traceback, exit 1.
    monkeypatch.setattr("sys.stdout", FullDisk())
    code = run(["predict", str(exports["translation"]), "one two"])
    assert code == 1 and capsys.readouterr().err == ("error: cannot write to standard output (No space left on "
                                                     "device); what it should have shown is lost\n")


def test_a_run_directory_without_an_export_is_told_the_command_that_writes_it(tmp_path, capsys):
    # It said "write one with: gpipe export RUN", leaving the user to fill in the folder they had just typed.
    run_dir = tmp_path / "my run"
    (run_dir / "checkpoints" / "step-00000004").mkdir(parents=True)
    code = run(["predict", str(run_dir), "five"])
    captured = capsys.readouterr()
    assert one_error_line(code, captured.err, captured.out).endswith(f"write one with: gpipe export '{run_dir}'")
    code = run(["predict", str(run_dir / "model.safetensors"), "five"])  # the file it would have written there
    captured = capsys.readouterr()
    assert one_error_line(code, captured.err, captured.out).endswith(f"write one with: gpipe export '{run_dir}'")


def test_a_checkpoint_folder_is_answered_with_the_export_to_write_and_the_file_to_give(tmp_path, capsys,
                                                                                     monkeypatch):
    # It said "write one with: gpipe export RUN", a literal RUN, and the export of the checkpoint went in its run.
    monkeypatch.chdir(tmp_path)
    folder = Path("run", "checkpoints", "step-00000002")
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text("{}")
    code = run(["predict", str(folder), "x"])
    captured = capsys.readouterr()
    assert one_error_line(code, captured.err, captured.out) == (
        f"error: '{folder}' is a checkpoint, and predict reads an export: write one with: gpipe export {folder}, "
        "then give predict run/model.safetensors")
    # A course a resume set aside: its export is named after it (the advice was to export it, over and over).
    course = Path("run", "checkpoints", "superseded-20261207-004601-at-step-560")
    (course / "step-00000600").mkdir(parents=True)
    (course / "step-00000600" / "manifest.json").write_text("{}")
    written = "run/model-superseded-20261207-004601-at-step-560.safetensors"
    for given in (course, course / "step-00000600"):
        code = run(["predict", str(given), "x"])
        captured = capsys.readouterr()
        assert one_error_line(code, captured.err, captured.out).endswith(
            f"predict reads an export: write one with: gpipe export {given}, then give predict {written}")
    Path(written).write_bytes(b"")  # once written, the course's folder names it
    from gpipe_cli.predict import export_file

    assert export_file(str(course)) == Path(written)


def test_greedy_decoding_never_answers_padding_unknown_or_bos():
    # Greedy picked unk ("⁇" in the answer), and pad or bos, which print nothing yet use up --max-tokens.
    from gpipe_cli.models.transformer.decode import continue_text, greedy_step

    logits = torch.tensor([[[9.0, 8.0, 7.0, 1.0, 2.0, 0.5]]])  # pad > unk > bos > word 4 > eos
    prefix, finished = greedy_step(logits, torch.zeros((1, 1), dtype=torch.long), torch.zeros(1, dtype=torch.bool))
    assert prefix.tolist() == [[0, 4]] and not finished.any()
    ranked = torch.tensor([[[9.0, 8.0, 7.0, 3.0, 2.0]]])  # eos next: the answer ends
    assert list(continue_text(lambda tokens: ranked.expand(1, tokens.shape[1], 5), [4], 5, 8)) == []


def test_a_continuation_reads_the_last_window_of_tokens_at_every_step():
    from gpipe_cli.models.transformer.decode import continue_text

    widths = []

    def forward(tokens):  # type: ignore[no-untyped-def]
        widths.append(tokens.shape[1])
        return torch.tensor([9.0 if v == 7 else 0.0 for v in range(10)]).expand(1, tokens.shape[1], 10)

    assert list(continue_text(forward, [4, 5], 6, 4)) == [7] * 6
    assert widths == [2, 3, 4, 4, 4, 4]  # the prompt, then each step's window of 4, never fewer


def test_a_sentence_typed_in_utf_8_is_read_so_under_a_c_locale(exports, capsys):
    # Under LC_ALL=C Python hands "zéro" over as the escaped bytes c3 a9, which predict refused: "not UTF-8 text".
    assert run(["predict", str(exports["translation"]), "z\udcc3\udca9ro", "one"]) == 0
    escaped = capsys.readouterr().out
    assert run(["predict", str(exports["translation"]), "zéro", "one"]) == 0
    assert escaped == capsys.readouterr().out and escaped.count("\n") == 2  # read as the text typed


def test_answers_are_written_in_utf_8_as_inputs_are_read_whatever_the_locale(exports, monkeypatch):
    # Under a C locale the answer "zéro" was printed as z\xe9ro, which predict then refused as an input.
    raw = io.BytesIO()
    ascii_out = io.TextIOWrapper(raw, encoding="ascii", errors="backslashreplace")
    monkeypatch.setattr("sys.stdout", ascii_out)
    assert run(["predict", str(exports["translation"]), "zéro"]) == 0
    assert sys.stdout.encoding == "utf-8"
    sys.stdout.flush()
    assert raw.getvalue().decode("utf-8").count("\n") == 1
