"""The terminal view's lines (plain mode and the live frame) and strict JSON in metrics.jsonl."""

import errno
import io
import json
import math
import os
import shutil
import time
from collections.abc import Callable

import pytest
from rich.console import Console

from gpipe_cli.pipeline.stats import PARTS
from gpipe_cli.train.view import MetricsFile, RecordWriteError, TerminalView, eval_line, finite_json, train_lines
from tests.widths import problems


def refuse(token):
    raise ValueError(f"not strict JSON: {token}")


def train_record(step=4, stages=2, cuda=False, loss=2.5, grad_norm=1.0):
    parts = {part: [0.01 * (i + 1) * (k + 1) for i in range(stages)] for k, part in enumerate(PARTS[:-1])}
    step_time = 0.5
    parts["other"] = [step_time - sum(p[i] for p in parts.values()) for i in range(stages)]  # as the loop does
    record = {"kind": "train", "step": step, "epoch": 1, "loss": loss, "lr": 0.001, "samples_per_s": 100.0,
              "tokens_per_s": 900.0, "step_time_s": step_time, "bubble": 0.2, "bubble_theory": 0.2, "idle": 0.5,
              "time_s": parts, "mem_peak_bytes": [3 << 20] * stages, "activation_peak_bytes": [3 << 20] * stages,
              "rss_peak_bytes": [370 << 20] * stages, "grad_norm": grad_norm}
    if cuda:
        record["cuda_peak_bytes"] = [5 << 30] * stages
    return record


def test_non_finite_numbers_become_null_and_are_named(tmp_path):
    record = train_record(loss=math.nan, grad_norm=math.inf)
    record["time_s"]["wait"][1] = -math.inf
    metrics = MetricsFile(tmp_path / "metrics.jsonl")
    metrics.write(record)
    metrics.write({"kind": "eval", "step": 4, "loss": math.nan})
    metrics.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    train, evl = (json.loads(line, parse_constant=refuse) for line in lines)
    assert train["loss"] is None and train["grad_norm"] is None and train["time_s"]["wait"][1] is None
    assert train["nonfinite"] == ["grad_norm", "loss", "time_s.wait"]
    assert evl["loss"] is None and evl["nonfinite"] == ["loss"]
    assert train["samples_per_s"] == record["samples_per_s"]  # finite values are untouched


def test_finite_records_gain_no_flag():
    record = train_record()
    assert finite_json(record) == record


@pytest.mark.parametrize("cuda", [False, True])
def test_a_step_shows_each_stage_time_and_labelled_memory(cuda):
    record = train_record(stages=3, cuda=cuda)
    head, *stages = train_lines(record, total=10)
    assert head.startswith("step 4/10 |") and "bubble 0.200 (theory 0.200)" in head and "ms/step" in head
    assert len(stages) == 3
    for s, line in enumerate(stages):
        assert line.strip().startswith(f"stage {s}:")
        for part in PARTS:
            assert f"{part} " in line
        shares = [int(token.rstrip("%")) for token in line.split() if token.endswith("%")]
        assert len(shares) == len(PARTS) and abs(sum(shares) - 100) <= len(PARTS)  # rounding of each share
        assert "activations 3.0 MiB" in line and "RSS peak 370.0 MiB" in line
        assert ("CUDA peak 5.0 GiB" in line) == cuda


def test_an_eval_line_shows_whatever_the_record_holds():
    line = eval_line({"kind": "eval", "step": 6, "loss": 1.25, "accuracy": 0.5, "perplexity": 3.49}, total=10)
    assert line.startswith("eval  step 6/10") and "loss 1.25" in line and "perplexity 3.49" in line


def test_plain_mode_prints_logged_steps_the_last_step_and_every_eval(capsys):
    view = TerminalView("tiny", plain=True, started=0.0)
    view.start(total=5)
    for step in range(1, 6):
        view.show(train_record(step=step), log_every=2)
        if step == 4:
            view.show({"kind": "eval", "step": 4, "loss": 1.5})
    view.show({"kind": "eval", "step": 5, "loss": 1.0})  # the run's final eval: the summary gives it
    lines = capsys.readouterr().out.splitlines()
    assert "training tiny: steps 1 to 5" in lines[0]
    assert [line.split("|")[0].strip() for line in lines if line.startswith("step ")] == \
        ["step 2/5", "step 4/5", "step 5/5"]
    assert [line for line in lines if line.startswith("eval")] == ["eval  step 4/5 | loss 1.5"]


def test_the_live_frame_shows_each_stage_time_and_labelled_memory_and_no_eval():
    view = TerminalView("tiny", plain=False, started=0.0)
    view.show(train_record(step=2))
    view.show({"kind": "eval", "step": 2, "loss": 3.0})
    view.show(train_record(step=4))
    console = Console(file=io.StringIO(), width=160)
    console.print(view.frame())
    text = console.file.getvalue()
    assert "eval" not in text  # an eval prints once, as a line above the view
    for label in ("wait", "compute", "comm", "optim", "other", "activations", "(step 4)", "RSS peak"):
        assert label in text
    assert "CUDA peak" not in text


@pytest.mark.parametrize("width", [80, 120, 50, 40])
@pytest.mark.parametrize("cuda", [False, True])
def test_the_live_view_reads_whole_at_any_width(width, cuda):
    view = TerminalView("tiny-translation", plain=False, started=0.0)
    view.start(total=200)
    try:
        for step in (1, 2, 3):
            record = train_record(step=step, stages=4, cuda=cuda, grad_norm=1.8642)
            record["rss_peak_bytes"] = [1023 << 20] * 4
            if step > 1:  # stored activations are counted on the first step only here
                del record["activation_peak_bytes"]
            view.show(record)
    finally:
        view.stop()
    console = Console(file=io.StringIO(), width=width)
    console.print(view.frame())  # at 40 columns the progress line cut its times: `0:00:…`
    text = console.file.getvalue()
    assert "200 0:00:00 ETA" in text  # the counts and times, whole
    labels = "loss lr grad norm skipped step samples/s tokens/s bubble theory stage compute wait comm optim other " \
             "activations RSS peak CUDA peak MiB GiB ms"
    assert not problems(text, width, labels), text
    assert "grad norm 1.86" in text and "(step 1)" in text  # a figure stays with its label
    for figure in ("1023.0 MiB", *(("5.0 GiB",) if cuda else ())):
        assert figure in text


def test_plain_step_lines_carry_the_runs_eta_from_steps_past_the_warm_up(capsys):
    view = TerminalView("tiny", plain=True, started=0.0)
    view.start(total=4)
    for step, seconds in ((1, 9.0), (2, 1.0), (3, 3.0), (4, 2.0)):
        record = train_record(step=step)
        record["step_time_s"] = seconds
        if step == 1:
            record["warmup"] = True  # one-time costs: not in the mean
        view.show(record)
    heads = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert "eta" not in heads[0]
    assert heads[1].endswith("| eta 2s") and heads[2].endswith("| eta 2s")  # 2 steps x 1 s, then 1 step x 2 s
    assert "eta" not in heads[3]  # the last step: nothing left


def test_a_profiled_step_is_marked_and_left_out_of_the_eta_while_others_give_it(capsys):
    # A step that wrote the profiler's trace took 3 s where the others took 0.1 s: the ETA tripled.
    view = TerminalView("tiny", plain=True, started=0.0)
    view.start(total=5)
    for step, seconds, profiled in ((1, 9.0, False), (2, 5.0, True), (3, 1.0, False), (4, 9.0, True)):
        record = {**train_record(step=step), "step_time_s": seconds, "warmup": step == 1}
        if profiled:
            record["profiled"] = True
        view.show(record)
    heads = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert heads[1].endswith("| profiled step (the profiler's work in it) | eta 15s")  # none else yet: 3 x 5 s
    assert heads[2].endswith("| eta 2s") and heads[3].endswith("| eta 1s")  # 2 x 1 s, then 1 x 1 s
    assert "profiled" not in heads[0] + heads[2]


def test_the_live_views_last_frame_into_a_file_ends_its_line_before_the_lines_after_training(monkeypatch):
    # `gpipe train --live > f`: the summary's first line ran on from the frame's last row.
    stream = io.StringIO()
    monkeypatch.setattr("sys.stdout", stream)
    view = TerminalView("tiny", plain=False, started=0.0)
    view.start(4)
    view.show(train_record(step=4))
    view.stop()
    assert stream.getvalue().endswith("\n")
    # It wrote the checkpoint and evaluation lines, then the last step's frame.
    stream.seek(0)
    stream.truncate(0)
    view = TerminalView("tiny", plain=False, started=0.0)
    view.start(4)
    view.show(train_record(step=4))
    view.message("checkpoint: run/checkpoints/step-00000004")
    view.stop()
    text = stream.getvalue()
    assert text.index("4/4") < text.index("checkpoint: run/") and text.endswith("step-00000004\n")


def test_a_record_the_disk_cannot_take_leaves_the_earlier_ones_whole_and_stops_in_one_line(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    (tmp_path / "checkpoints" / "step-00000002").mkdir(parents=True)  # a resume continues from it
    metrics = MetricsFile(path)
    metrics.write({"kind": "eval", "step": 1, "loss": 2.0})
    real_write = os.write

    def full_disk(fd, data):  # as a filling disk does: part of the line goes down, then nothing more
        if len(data) > 8:
            return real_write(fd, data[:8])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", full_disk)
    with pytest.raises(RecordWriteError) as caught:
        metrics.write(train_record())
    monkeypatch.undo()
    message = str(caught.value)
    assert "\n" not in message and message.startswith("cannot write metrics.jsonl at step 4 (ENOSPC: ")
    assert f"gpipe train --resume {tmp_path}" in message
    metrics.write({"kind": "eval", "step": 4, "loss": 1.0})  # room again: the file goes on from a whole line
    metrics.close()
    metrics.close()  # closing twice is harmless
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 4]


def test_a_record_the_disk_cannot_take_before_any_checkpoint_says_how_to_start_again(tmp_path):
    # It advised `--resume RUN`, which found no checkpoint and was refused.
    message = MetricsFile(tmp_path / "metrics.jsonl")._failure(OSError(errno.ENOSPC, "No space left"), {"step": 3})
    assert message.endswith(f"once it can be written, start it again from step 0 with: gpipe train --resume "
                            f"--output-dir {tmp_path}")


@pytest.mark.parametrize("removed", [False, True])
def test_a_run_folder_moved_or_removed_as_it_trains_stops_the_run_in_one_line(tmp_path, removed):
    # The run went on without a word: its records followed the folder, its next checkpoints made it anew.
    run = tmp_path / "run"
    (run / "checkpoints" / "step-00000002").mkdir(parents=True)
    metrics = MetricsFile(run / "metrics.jsonl")
    metrics.write({"kind": "eval", "step": 1, "loss": 2.0})
    if removed:
        shutil.rmtree(run)
    else:
        run.rename(tmp_path / "moved")
    with pytest.raises(RecordWriteError) as caught:
        metrics.write(train_record())
    metrics.close()
    went = "its records and checkpoints went with it" if removed else \
        f"its records are in {tmp_path / 'moved'}; continue with gpipe train --resume {tmp_path / 'moved'}"
    assert str(caught.value) == (f"the run directory {run} was moved or removed while the run trained (found at "
                                 f"step 4); the run stops, so that nothing is written to two places: {went}")
    assert not run.exists()


@pytest.mark.parametrize("term, plain", [("dumb", True), ("xterm-256color", False)])
def test_a_dumb_terminal_gets_plain_lines(monkeypatch, term, plain):
    # It got the live view, which such a terminal (Emacs's shell) never redrew: nothing showed until the end.
    import io

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setenv("TERM", term)
    monkeypatch.setattr("sys.stdout", Terminal())
    assert TerminalView("tiny", started=0.0).plain is plain


def _drained(leader: int, done: Callable[[bytes], bool], timeout: float = 10.0) -> bytes:
    """What a pseudo-terminal has been given, read until it is `done` or `timeout` passes."""
    # The kernel hands a pty's writes to its reader asynchronously: one read can miss the last of them.
    import select

    shown, deadline = b"", time.monotonic() + timeout
    while not done(shown) and (left := deadline - time.monotonic()) > 0:
        if select.select([leader], [], [], left)[0]:
            shown += os.read(leader, 65536)
    return shown


def test_a_rank_that_ends_at_once_gives_the_terminal_its_cursor_back(monkeypatch):
    # A Ctrl-C during step 1 ended rank 0 with its live view running: the shell's cursor stayed hidden.
    from gpipe_cli.pipeline import stopping

    leader, follower = os.openpty()
    with os.fdopen(follower, "w") as terminal:
        monkeypatch.setattr("sys.stdout", terminal)
        monkeypatch.setattr(stopping, "_undo", [])
        monkeypatch.setattr(stopping.os, "_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
        view = TerminalView("tiny", plain=False, started=0.0)
        view.start(5)
        with pytest.raises(SystemExit):
            stopping.abrupt_exit(130)
        terminal.flush()
        def cursor_back(shown: bytes) -> bool:
            return shown.rfind(b"\x1b[?25h") > shown.rfind(b"\x1b[?25l") >= 0

        assert cursor_back(_drained(leader, cursor_back))
        view.stop()  # and a view stopped in order lets go of its claim on the exit
        assert stopping._undo == []
    os.close(leader)


def test_the_live_view_takes_the_terminals_width_not_an_exported_columns(monkeypatch):
    # COLUMNS=200 exported in an 80-column terminal stacked a copy of the bar per redraw.
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.setattr("os.get_terminal_size", lambda fd=0: os.terminal_size((80, 24)))
    assert TerminalView("tiny", plain=False, started=0.0)._console.width == 80
    assert TerminalView("tiny", plain=True, started=0.0)._console.width == 200  # lines into a log: as asked


def test_plain_step_lines_on_a_terminal_are_fitted_to_its_width(monkeypatch):
    # --plain on a terminal, or TERM=dumb: the step lines broke mid-word ("activati|ons"), the notes did not.
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    monkeypatch.setattr("sys.stdout", terminal)
    monkeypatch.setattr("shutil.get_terminal_size", lambda fallback=(80, 24): os.terminal_size((40, 24)))
    view = TerminalView("tiny", plain=True, started=0.0)
    view.start(total=2)
    view.show(train_record(step=2))
    lines = terminal.getvalue().splitlines()
    assert any(line.startswith("step 2/2") for line in lines)
    assert all(len(line) <= 40 or " " not in line.strip() for line in lines), lines
