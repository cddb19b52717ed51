"""`train.profile`: a torch.profiler schedule over chosen steps, gzip'd traces per rank, and a quiet terminal."""

import copy
import gzip
import json
import re

import pytest
import torch

from gpipe_cli.errors import UserError
from gpipe_cli.recipe.load import load_recipe
from gpipe_cli.recipe.schema import Profile
from gpipe_cli.train.profiling import StepProfiler, trace_path
from tests.train.as_ranks import gpipe_train
from tests.train.recipes import TINY_AMOEBANET, write

# What torch.profiler's C++ side (Kineto) and its Python warnings print when left alone.
CHATTER = re.compile(r"STAGE:|USDT|profiler_start|profiler_stop|Kineto|won't be using warmup")


def steps_traced(path):
    """The N of every ProfilerStep#N range in a gzip'd Chrome trace, and every event name."""
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    names = {e.get("name", "") for e in events}
    return {int(n.split("#")[1]) for n in names if n.startswith("ProfilerStep#")}, names


def test_profile_steps_must_be_in_order(tmp_path):
    recipe = copy.deepcopy(TINY_AMOEBANET)
    recipe["train"]["profile"] = {"steps": [3, 2]}
    with pytest.raises(UserError, match="start <= end"):
        load_recipe(str(write(tmp_path, recipe)), [])


@pytest.mark.parametrize("section, match", [
    ({"steps": [2, 3], "active": 2}, "not both"),
    ({"wait": 1}, "give steps"),
    ({"active": 0}, "active"),
    ({"active": 1, "with_stack": "yes"}, "with_stack"),
])
def test_a_profile_is_steps_or_a_schedule(tmp_path, section, match):
    recipe = copy.deepcopy(TINY_AMOEBANET)
    recipe["train"]["profile"] = section
    with pytest.raises(UserError, match=match):
        load_recipe(str(write(tmp_path, recipe)), [])


@pytest.mark.parametrize("steps, cycle", [
    ((1, 1), (0, 0, 0, 1, 1)),  # no room for a warm-up step
    ((2, 2), (0, 0, 1, 1, 1)),
    ((5, 7), (0, 3, 1, 3, 1)),
])
def test_steps_become_one_cycle_whose_active_steps_are_exactly_those(steps, cycle):
    assert Profile(steps=steps).cycle() == cycle


def run_steps(profiler, first, last):
    """Step a profiler as the training loop does, a little work per step; the traces written, by step."""
    layer = torch.nn.Linear(4, 4)
    written = {}
    for step in range(first, last + 1):
        profiler.before(step)
        layer(torch.ones(2, 4)).sum().backward()
        path = profiler.after(step)
        if path is not None:
            written[step] = path
    closed = profiler.close()
    if closed is not None:
        written[last] = closed
    return written


def test_a_schedule_traces_each_cycle_with_its_steps_only(tmp_path, capfd):
    config = Profile(wait=1, warmup=1, active=2, repeat=2, record_shapes=True)
    written = run_steps(StepProfiler(config, tmp_path, 0, torch.device("cpu")), 1, 10)
    # Cycles of 4 steps from step 1: wait 1, warm-up 2, active 3-4; then wait 5, warm-up 6, active 7-8.
    assert written == {4: trace_path(tmp_path, 0, 3, 4), 8: trace_path(tmp_path, 0, 7, 8)}
    assert steps_traced(written[4])[0] == {3, 4} and steps_traced(written[8])[0] == {7, 8}
    assert not list(tmp_path.rglob(".*"))  # no partial file left beside them
    out, err = capfd.readouterr()
    assert not CHATTER.search(out + err), out + err


def test_the_profiler_is_let_go_once_its_last_cycle_is_written(tmp_path):
    # It held the memory of its last cycle, and was stepped, to the end of the run.
    profiler = StepProfiler(Profile(steps=(2, 3)), tmp_path, 0, torch.device("cpu"), total_steps=100)
    written = {}
    for step in range(1, 6):
        profiler.before(step)
        written[step] = profiler.after(step)
        assert (profiler._profiler is None) == (step >= 3)
    assert written == {1: None, 2: None, 3: trace_path(tmp_path, 0, 2, 3), 4: None, 5: None}
    assert steps_traced(written[3])[0] == {2, 3} and profiler.close() is None


def test_a_trace_that_cannot_be_written_is_one_line_and_the_run_goes_on_untraced(tmp_path, monkeypatch):
    # A full disk at a trace's write ended the run in a traceback, losing the steps since its last checkpoint; then
    # its line was written while the profiler's transitions send stderr to /dev/null, and never seen.
    import contextlib
    import io

    from gpipe_cli.train import profiling

    silenced, said = [False], []
    real_quiet = profiling.quiet

    @contextlib.contextmanager
    def quiet():
        with real_quiet():
            silenced[0] = True
            try:
                yield
            finally:
                silenced[0] = False

    class Stderr(io.StringIO):
        def write(self, text: str) -> int:
            said.append((silenced[0], text))
            return len(text)

    monkeypatch.setattr(profiling, "quiet", quiet)
    monkeypatch.setattr(profiling.sys, "stderr", Stderr())
    (tmp_path / "profile").write_text("a file where the traces' folder goes")
    config = Profile(wait=1, warmup=1, active=2, repeat=2)
    assert run_steps(StepProfiler(config, tmp_path, 0, torch.device("cpu")), 1, 10) == {}
    lines = [text for hidden, text in said if text.strip()]
    assert len(lines) == 1 and not any(hidden for hidden, text in said if text.strip()), said
    assert lines[0].startswith(f"[gpipe] train.profile: cannot write {trace_path(tmp_path, 0, 3, 4)} (") and \
        lines[0].endswith("); the run goes on without more traces")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["profile"]


def test_a_resumed_run_numbers_steps_as_the_run_does_and_a_cut_cycle_is_kept(tmp_path):
    config = Profile(steps=(6, 9))
    written = run_steps(StepProfiler(config, tmp_path, 1, torch.device("cpu"), total_steps=7), 5, 7)  # resumed at 5
    assert written == {7: trace_path(tmp_path, 1, 6, 7)}
    assert steps_traced(written[7])[0] == {6, 7}


@pytest.mark.slow
def test_a_profiled_run_writes_gzip_traces_per_rank_with_steps_and_pipeline_ranges(tmp_path):
    recipe = copy.deepcopy(TINY_AMOEBANET)
    recipe["train"] = {"steps": 4, "profile": {"steps": [2, 3]}}
    recipe["pipeline"]["balance"] = [22, 22]  # the traces, not the cut: no layer timing
    recipe["eval"] = {}
    out = tmp_path / "run"
    # As torchrun's two ranks run it: what each prints (Kineto's chatter too) comes back as one text.
    ranks = gpipe_train(2, str(write(tmp_path, recipe)), "--output-dir", str(out))
    code, output = ranks.code, ranks.output
    assert code == 0, output[-4000:]
    assert "profile: steps 2-3 traced" in output
    # Said once step 3's figures are: the loop reads a step's figures after launching the next.
    assert "step 3/4" in output and output.index("step 3/4") < output.index("profile: steps 2-3 traced")
    assert not CHATTER.search(output), output[-4000:]
    for rank in (0, 1):
        steps, names = steps_traced(trace_path(out, rank, 2, 3))
        assert steps == {2, 3}, rank  # the active steps only: not the warm-up step 1, nor step 4
        assert any(n.startswith("aten::") for n in names), rank
        micro = recipe["pipeline"]["microbatches"]
        assert {f"fwd mb{m}" for m in range(micro)} <= names and {f"bwd mb{m}" for m in range(micro)} <= names
        sends = "send_fwd" if rank == 0 else "recv_fwd"
        assert f"{sends} mb0" in names
        assert "recompute mb0" in names  # except_last: all but the micro-batch whose backward follows at once


@pytest.mark.parametrize(("config", "total", "profiled"), [
    (Profile(steps=(3, 4)), 8, {1, 2, 3, 4}),  # step 1's time holds the start of step 2's warm-up
    (Profile(steps=(5, 6)), 10, {3, 4, 5, 6}),
    (Profile(steps=(6, 7)), 7, {4, 5, 6, 7}),  # the run ends inside the cycle
    (Profile(wait=1, warmup=1, active=2, repeat=2), 10, {1, 2, 3, 4, 5, 6, 7, 8}),
    (None, 8, set()),
])
def test_the_profiled_steps_are_those_whose_time_holds_the_profilers_work(tmp_path, config, total, profiled):
    profiler = StepProfiler(config, tmp_path, 0, torch.device("cpu"), total_steps=total)
    assert {step for step in range(1, total + 1) if profiler.profiled(step)} == profiled
    # Every trace is written inside a profiled step's time, and the marks stay once the profiler is closed.
    assert set(run_steps(profiler, 1, total)) <= profiled
    assert {step for step in range(1, total + 1) if profiler.profiled(step)} == profiled
