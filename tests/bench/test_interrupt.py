"""Ctrl-C during `gpipe bench` stops the ranks: exit 130, no traceback, no temporary files left."""

import io
import signal

import pytest

from tests.bench.test_cli_commands import TINY
from tests.interrupt import interrupt

STOPPED = "gpipe bench: interrupted; nothing was written\n"


@pytest.mark.slow
def test_ctrl_c_mid_measurement_exits_130_quietly_and_cleans_up(tmp_path):
    def measuring(tmp, output):
        # The K=1 ranks have written their per-layer costs: they are timing steps now.
        return any(tmp.glob("gpipe-bench-*/k1.out.json"))

    code, output, err = interrupt(["bench", *TINY, "--partitions", "2", "--microbatches", "4", "--steps", "100000"],
                                  tmp_path, measuring)
    assert code == 130, (output + err)[-3000:]
    # On stderr, in the words every command uses: the figures piped to a file stay figures.
    assert "Traceback" not in output + err and err == STOPPED, err
    assert "interrupted" not in output, output[-3000:]
    # Nothing of the command's is left (torch's compile cache, which it keeps by design, aside).
    assert not [p for p in tmp_path.iterdir() if not p.name.startswith("torchinductor_")]


@pytest.mark.slow
def test_ctrl_c_while_the_ranks_import_torch_is_quiet_too(tmp_path):
    def starting(tmp, output):
        return "measuring K=1" in output  # its rank is starting: importing torch takes it seconds

    code, output, err = interrupt(["bench", *TINY, "--partitions", "2", "--microbatches", "4", "--steps", "100000"],
                                  tmp_path, starting)
    assert code == 130, (output + err)[-3000:]
    for noise in ("Traceback", "KeyboardInterrupt", "killed"):
        assert noise not in output + err, (output + err)[-3000:]
    assert err == STOPPED, err
    assert not [p for p in tmp_path.iterdir() if not p.name.startswith("torchinductor_")]


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["sizing", "ranks"])
def test_sigterm_stops_it_as_ctrl_c_does_with_143(tmp_path, moment):
    # A `kill` or a scheduler's cancel: before, the process died where it stood (-15, no word, files left).
    def now(tmp, output):
        return "plan" in output if moment == "sizing" else any(tmp.glob("gpipe-bench-*"))

    code, output, err = interrupt(["bench", *TINY, "--partitions", "2", "--microbatches", "4", "--steps", "100000"],
                                  tmp_path, now, signum=signal.SIGTERM)
    assert code == 128 + signal.SIGTERM, (output + err)[-3000:]
    assert "Traceback" not in output + err and err == STOPPED, err
    assert not [p for p in tmp_path.iterdir() if not p.name.startswith("torchinductor_")]


@pytest.mark.slow
def test_sighup_while_the_ranks_measure_stops_it_as_sigterm_does_with_129(tmp_path):
    # A closed terminal: it said "the benchmark ranks failed (exit code 129); see above", with nothing above.
    code, output, err = interrupt(["bench", *TINY, "--partitions", "2", "--microbatches", "4", "--steps", "100000"],
                                  tmp_path, lambda tmp, output: any(tmp.glob("gpipe-bench-*/k1.out.json")),
                                  signum=signal.SIGHUP)
    assert code == 128 + signal.SIGHUP, (output + err)[-3000:]
    assert "Traceback" not in output + err and err == STOPPED and "failed" not in output, (output + err)[-3000:]
    assert not [p for p in tmp_path.iterdir() if not p.name.startswith("torchinductor_")]



def test_once_measured_the_results_are_written_with_ctrl_c_and_sigterm_waiting(tmp_path, monkeypatch, handlers):
    """A Ctrl-C as `figures written to F` printed said "nothing was written" (F was), then a raw traceback."""
    from rich.console import Console

    from gpipe_cli import files
    from gpipe_cli.bench import runner, tables
    from gpipe_cli.bench.options import BenchOptions

    signal.signal(signal.SIGINT, signal.default_int_handler)
    states = []

    def now(what):
        states.append((what, signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)))

    def write(path, text):
        now("written")
        path.write_text(text)

    monkeypatch.setattr(files, "atomic_write_text", write)
    monkeypatch.setattr(tables, "show", lambda summary, console: now("shown"))
    out = tmp_path / "figures.json"
    summary = {"measured": True, "sized": {"note": "", "estimate_s": 1.0, "elapsed_s": 1.0}}
    console = Console(file=io.StringIO(), width=1000)
    runner.results(BenchOptions(json=out), summary, [], console)
    ignored = (signal.SIG_IGN, signal.SIG_IGN)
    assert states == [("shown", *ignored), ("written", *ignored)] and out.exists()
    assert f"figures written to {out}" in console.file.getvalue()


@pytest.mark.parametrize("code", [130, 143, 129])
def test_a_stop_while_a_compare_baseline_measures_stops_the_command_not_just_the_baseline(code):
    # Ctrl-C once our figures were in, while torch's schedule measured: "a baseline failed (exit code 130); see
    # above", exit 1 and a JSON of half the figures, where a stop anywhere else writes nothing and exits 130.
    from types import SimpleNamespace

    from gpipe_cli.bench import runner, setup

    def stopped(*args, **kwargs):
        raise setup.JobFailed(code, {"runs": [{"ours": 1}]})

    def failed(*args, **kwargs):
        raise setup.JobFailed(1, {"runs": [1]})

    job = SimpleNamespace(compare=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(setup, "launch_job", stopped)
        with pytest.raises(setup.JobFailed) as raised:
            runner._launch(job, None, "k1", SimpleNamespace(threads=1))
        assert raised.value.code == code
        patch.setattr(setup, "launch_job", failed)
        kept = runner._launch(job, None, "k1", SimpleNamespace(threads=1))  # a baseline that failed: ours are kept
        assert kept["runs"] == [1] and "a baseline failed (exit code 1)" in kept["failed"]
