"""What ranks sharing this machine add, measured with real processes: links, load, the engine's steps."""

import contextlib
import functools
import inspect
import io
import json
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.util
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from gpipe_cli.cli import run
from gpipe_cli.launch import forked
from gpipe_cli.models.registry import build_model
from gpipe_cli.plan import calibrate, here, inputs
from gpipe_cli.recipe.load import load_recipe
from gpipe_cli.sizing import usable_cores
from tests.plan.test_runner import TINY, set_lines
from tests.train.recipes import write

PARAMS = {k: v for k, v in TINY["model"].items() if k != "kind"}


@dataclass
class Planned:
    """One `gpipe plan --timing measure` for 2 devices, and what its ranks here were asked and measured."""

    recipe: Path
    output: Path
    out: str
    links: list[tuple[int, tuple[here.Link, here.Link]]] = field(default_factory=list)  # (ranks, links)
    siblings: list[tuple[list[int], bool]] = field(default_factory=list)  # (pids at the body, all gone after it)
    engine: list[tuple[dict[str, Any], here.Steps]] = field(default_factory=list)  # (arguments, steps)


def _record_pid_then(path: str, work: Any) -> None:
    _record_pid(path)
    work()


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> Planned:
    """The plan's run, measured once for this module: its links, siblings and engine steps are the ones tested here.

    Each of those starts ranks (seconds of importing torch each): the tests below check what the plan's own calls
    measured rather than start their own, and start them only where the plan does not (a single core).
    """
    folder = tmp_path_factory.mktemp("plan")
    # A gradient clip: the ranks' steps clip before the update, as a recipe with one trains.
    recipe = write(folder, {**TINY, "train": {**TINY["train"], "grad_clip": 1.0}})
    found = Planned(recipe, folder / "planned.yaml", "")
    links, loaded, engine_steps = here.links, here.loaded, here.engine_steps
    signature = inspect.signature(engine_steps)
    pids = folder / "siblings"

    def recorded_links(ranks: int) -> tuple[here.Link, here.Link]:
        result = links(ranks)
        found.links.append((ranks, result))
        return result

    @contextlib.contextmanager
    def recorded_loaded(work: Any, count: int, threads: int) -> Any:
        pids.mkdir(exist_ok=True)
        with loaded(functools.partial(_record_pid_then, str(pids), work), count, threads):
            started = [int(p) for p in os.listdir(pids)]
            yield
        gone = []
        for pid in started:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                gone.append(pid)
        found.siblings.append((started, gone == started))

    def recorded_engine_steps(*args: Any, **kwargs: Any) -> here.Steps:
        steps = engine_steps(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        found.engine.append((dict(bound.arguments), steps))
        return steps

    printed = io.StringIO()
    saved = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed):
        patch.setattr(here, "links", recorded_links)
        patch.setattr(here, "loaded", recorded_loaded)
        patch.setattr(here, "engine_steps", recorded_engine_steps)
        code = run(["plan", str(recipe), "--devices", "2", "--timing", "measure", "--output", str(found.output),
                    "--plain", "--top", "3"])
    signal.signal(signal.SIGINT, saved[0])
    signal.signal(signal.SIGTERM, saved[1])
    assert code == 0, printed.getvalue()[-3000:]
    found.out = printed.getvalue()
    return found


# Slow: the plan run starts ranks five times; marked, this module is handed out with the suite's other long ones.
@pytest.mark.slow
def test_the_plan_is_printed_and_written_as_a_recipe_that_validates(planned):
    recipe, output, out = planned.recipe, planned.output, planned.out
    assert "predicted" in out and "prediction" in out
    # Each phase of measuring is said before it starts (with its estimate when more than 2 s), and the end
    # judges the phases' estimates.
    assert re.search(r"^measuring per-layer seconds of 4 pipeline layers .*\)( \(about \d+ s\))?\.\.\.$", out,
                     re.M), out
    assert re.search(r"^measuring the engine.*( \(about \d+ s\))?\.\.\.$", out, re.M), out
    assert re.search(r"^took \d+ (s|min) \(estimated \d+ (s|min)\)$", out, re.M), out
    if usable_cores() > 1:  # two ranks here: each shape is priced from the engine's steps measured on it
        timing = next(line for line in out.splitlines() if line.strip().startswith("per-layer seconds:"))
        assert "on 2 replicas and x" in timing and "as 2 stages and x" in timing and "of 2 chunks" in timing
    rows = [line for line in out.splitlines() if re.match(r"^[* ] K=\d+ D=\d+ M=\d+ ", line)]
    assert rows and rows[0].startswith("*") and len([r for r in rows if r.startswith("*")]) == 1
    assert all("| " in r for r in rows[1:]), "every runner-up says why it loses"
    written = load_recipe(output)
    # The printed --set lines and the written recipe describe the same pipeline.
    assert load_recipe(recipe, set_lines(out)).pipeline == written.pipeline
    assert written.pipeline.partitions * written.pipeline.data_parallel == 2
    assert written.model == load_recipe(recipe).model and written.data == load_recipe(recipe).data
    assert run(["validate", str(output)]) == 0


def test_links_between_two_ranks_are_read_as_latency_and_bandwidth(planned):
    # The plan's own measurement of them (a single core plans without: measured here then).
    measured = planned.links or [(2, here.links(2))]
    assert [ranks for ranks, _ in measured] == [2]
    p2p, reduce = measured[0][1]
    for link in (p2p, reduce):
        assert 1e6 < link.bandwidth < 1e13 and 0.0 <= link.latency < 0.1  # a real, finite link


def test_timings_noise_left_unordered_give_a_finite_link():
    # On a loaded machine the large message once timed faster than the small one: a link of 1e15 bytes/s.
    link = here._line(small=2e-4, large=1.5e-4)
    assert link.bandwidth == pytest.approx(here.LARGE / 1.5e-4)
    assert link.latency == pytest.approx(2e-4 - here.SMALL * 1.5e-4 / here.LARGE)
    ordered = here._line(small=1e-4, large=1e-4 + (here.LARGE - here.SMALL) / 2e9)
    assert ordered.bandwidth == pytest.approx(2e9) and ordered.latency == pytest.approx(1e-4 - here.SMALL / 2e9)


def _record_pid(path: str) -> None:
    with open(os.path.join(path, str(os.getpid())), "w"):
        pass


def test_siblings_work_while_the_body_runs_and_are_gone_after_it(planned, tmp_path):
    if planned.siblings:  # the plan's sibling, which computed while it timed the layers
        assert len(planned.siblings) == 1
        pids, gone = planned.siblings[0]
        assert len(pids) == 1 and pids[0] != os.getpid()  # the first run is done before the body
        assert gone
        return
    with here.loaded(functools.partial(_record_pid, str(tmp_path)), 1, 1):
        pids = [int(p) for p in os.listdir(tmp_path)]
        assert len(pids) == 1 and pids[0] != os.getpid()  # the first run is done before the body
    with pytest.raises(ProcessLookupError):
        os.kill(pids[0], 0)


def _ctrl_c_from_another_thread() -> None:
    # As Ctrl-C does when it lands on a torch worker thread rather than on the main one.
    sender = threading.Thread(target=os.kill, args=(os.getpid(), signal.SIGINT))
    sender.start()
    sender.join()


def test_ctrl_c_while_children_start_waits_for_all_of_them_and_leaves_no_traceback(tmp_path, monkeypatch, capfd):
    spawned: list[int] = []
    launch = multiprocessing.util.spawnv_passfds

    def launch_then_ctrl_c(path, args, passfds):
        pid = launch(path, args, passfds)
        if "--multiprocessing-fork" not in args:
            return pid  # the resource tracker
        spawned.append(pid)
        if len(spawned) == 1:  # between a child's launch and the write of its arguments: the worst moment
            _ctrl_c_from_another_thread()
        return spawned[-1]

    monkeypatch.setattr(multiprocessing.util, "spawnv_passfds", launch_then_ctrl_c)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt), here._children(_record_pid, lambda i: (str(tmp_path),), 2):
            pytest.fail("the body ran after a Ctrl-C")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert len(spawned) == 2  # the Ctrl-C waited until every child had started
    deadline = time.monotonic() + 60
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not multiprocessing.active_children()
    assert "Traceback" not in capfd.readouterr().err


def _engine_calls(planned: Planned, pipeline: bool) -> list[tuple[dict[str, Any], here.Steps]]:
    """The plan's engine steps on 2 ranks: those on replicas, or those as pipelines."""
    return [(args, steps) for args, steps in planned.engine if (args["balance"] is not None) == pipeline]


def test_the_engine_steps_on_real_replicas_and_its_costs_fit_the_gap_they_leave(planned):
    spec = build_model("transformer", **PARAMS)
    examples = inputs.generated(spec, 0)
    adam = functools.partial(torch.optim.Adam, lr=1e-3)
    # The plan's own steps on 2 replicas of 4 examples each (a single core plans without: measured here then).
    calls = _engine_calls(planned, pipeline=False) or [
        (dict(ranks=2, counts=[1, 2, 4], grad_clip=1.0, inputs=examples(4)[0]),
         here.engine_steps("transformer", PARAMS, *examples(4), 0, 2, 1, [1, 2, 4], adam, 1.0))]
    assert len(calls) == 1
    args, steps = calls[0]
    assert args["ranks"] == 2 and args["counts"] == [1, 2, 4] and args["grad_clip"] == 1.0
    assert args["inputs"].shape[0] == 4
    assert sorted(steps.per_count) == [1, 2, 4]
    # the update is timed within the step
    assert all(0 < update < step < 60 for step, update in steps.per_count.values())
    assert -1.0 < steps.drift < 10.0  # the first count timed again: a ratio, not a duration
    costs = inputs.measured_costs(spec, (1, 4), 0, 1, examples)
    extra = calibrate.overhead(len(spec.layers), costs, 4, {m: step for m, (step, _) in steps.per_count.items()})
    assert extra.action >= 0 and extra.step >= 0


def test_the_measured_steps_run_and_time_the_optimizer_update_as_training_does():
    from gpipe_cli.estimate.measure import build_pipeline, measure_engine
    from gpipe_cli.pipeline import topology
    from gpipe_cli.pipeline.config import PipelineConfig
    spec = build_model("transformer", **PARAMS)
    inputs_, targets = inputs.generated(spec, 0)(4)
    config = PipelineConfig(checkpoint="never", balance=(len(spec.layers),))
    pipe = build_pipeline(spec, topology.local("cpu"), config, 0)
    before = [p.detach().clone() for p in pipe.parameters()]
    plain = measure_engine(pipe, inputs_, targets, 4, 2, 2, 0)
    assert plain is not None and plain.optimizer_times == [0.0, 0.0]
    assert all(torch.equal(a, b) for a, b in zip(before, pipe.parameters()))
    adam = torch.optim.Adam(pipe.parameters(), lr=1e-3)
    trained = measure_engine(pipe, inputs_, targets, 4, 2, 2, 0, optimizer=adam, max_grad_norm=1.0)
    assert trained is not None and all(0 < u < t for u, t in zip(trained.optimizer_times, trained.step_times))
    assert not all(torch.equal(a, b) for a, b in zip(before, pipe.parameters()))  # the update really ran
    pipe.close()


def test_the_fit_recovers_the_per_call_and_per_step_costs_it_is_given():
    spec = build_model("transformer", **PARAMS)
    costs = inputs.measured_costs(spec, (1, 8), 0, 1, inputs.generated(spec, 0))
    layers, per_call, per_step = len(spec.layers), 2e-4, 3e-3
    from gpipe_cli.estimate import simulate
    measured = {m: simulate.simulate_step(costs(8 // m), [layers], 8, m, "gpipe", "never",
                                          simulate.Link(1e30, 0.0)).step_time + per_step
                + 2 * layers * m * per_call for m in (1, 2, 8)}
    extra = calibrate.overhead(layers, costs, 8, measured)
    assert extra.action == pytest.approx(per_call, rel=1e-6) and extra.step == pytest.approx(per_step, rel=1e-6)
    # The update timed within the steps is part of the per-step cost, not fitted: where the steps came out a little
    # faster than the layers and the update add up to (noise), the fit's intercept is below zero and was clamped,
    # and `gpipe plan --devices 1` said the engine's step, its update included, cost 0.0 ms.
    update = 2e-3
    noisy = {m: seconds - per_step + update - 5e-4 for m, seconds in measured.items()}
    extra = calibrate.overhead(layers, costs, 8, noisy, update)
    assert extra.step == pytest.approx(update, rel=1e-6) and extra.action == pytest.approx(per_call, rel=1e-6)
    assert calibrate.overhead(layers, costs, 8, measured, update).step == pytest.approx(per_step, rel=1e-6)


def test_the_factors_scale_the_layers_to_the_steps_measured_at_each_micro_batch_size():
    spec = build_model("transformer", **PARAMS)
    costs = inputs.measured_costs(spec, (1, 8), 0, 1, inputs.generated(spec, 0))
    from gpipe_cli.estimate import simulate
    layers, known, given = len(spec.layers), 1e-3, {1: 1.5, 2: 1.2, 8: 2.0}  # micro-batch count -> ratio

    def simulated(m: int) -> float:
        return simulate.simulate_step(costs(8 // m), [layers], 8, m, "gpipe", "never",
                                      simulate.Link(1e30, 0.0)).step_time
    ratios = calibrate.factors([layers], costs, 8, {m: r * simulated(m) + known for m, r in given.items()}, known)
    assert ratios == pytest.approx({8: 1.5, 4: 1.2, 1: 2.0})  # keyed by examples per micro-batch
    by = calibrate.by_size(ratios)
    assert by(4) == pytest.approx(1.2) and by(16) == pytest.approx(1.5) and by(1) == pytest.approx(2.0)
    assert by(2) == pytest.approx(1.6)  # halfway between sizes 1 and 4 in log(size)
    slower = costs(4).scaled(by(4))
    assert slower.layers[0].backward == pytest.approx(1.2 * costs(4).layers[0].backward)
    assert slower.layers[0].output_bytes == costs(4).layers[0].output_bytes
    # A single-stage configuration at a measured size is predicted as it was measured.
    assert simulate.simulate_step(slower, [layers], 8, 2, "gpipe", "never", simulate.Link(1e30, 0.0)
                                  ).step_time + known == pytest.approx(1.2 * simulated(2) + known)
    assert calibrate.by_size({})(7) == 1.0


def test_the_factors_of_a_pipeline_are_fitted_with_its_cut_its_messages_and_its_ranks_speeds():
    spec = build_model("transformer", **PARAMS)
    costs = inputs.measured_costs(spec, (1, 8), 0, 1, inputs.generated(spec, 0))
    from gpipe_cli.estimate import simulate
    balance, link, rate = [1, len(spec.layers) - 1], simulate.Link(1e8, 1e-4), simulate.rate_model(1.3, 2)
    given = {2: 1.4, 8: 1.7}

    def simulated(m: int, cut: list[int] = balance, virtual: int = 1) -> float:
        return simulate.simulate_step(costs(8 // m), cut, 8, m, "interleaved" if virtual > 1 else "gpipe", "never",
                                      link, 1.0, virtual, 0.0, rate).step_time
    measured = {m: r * simulated(m) for m, r in given.items()}
    assert calibrate.factors(balance, costs, 8, measured, 0.0, link, rate) == pytest.approx({4: 1.4, 1: 1.7})
    chunks = [1, 1, 1, len(spec.layers) - 3]
    interleaved = {m: r * simulated(m, chunks, 2) for m, r in given.items()}
    assert calibrate.factors(chunks, costs, 8, interleaved, 0.0, link, rate, 2) == pytest.approx({4: 1.4, 1: 1.7})
    # Fitted as one stage with free links instead, the ratios come out otherwise.
    assert calibrate.factors([len(spec.layers)], costs, 8, measured)[4] != pytest.approx(1.4, rel=0.01)


def test_a_shape_takes_the_ratio_measured_on_it_and_one_not_measured_the_largest():
    by = calibrate.by_shape({4: 1.6, 16: 1.4}, {1: {4: 1.2, 16: 1.1}, 2: {4: 1.5, 16: 1.7}})
    assert by(4, 1, 2) == pytest.approx(1.6) and by(16, 1, 4) == pytest.approx(1.4)  # replicas
    assert by(4, 2, 1) == pytest.approx(1.2) and by(16, 8, 1, 1, "1f1b") == pytest.approx(1.1)  # stages
    assert by(4, 2, 1, 2, "interleaved") == pytest.approx(1.5)  # two chunks per stage
    assert by(8, 2, 1) == pytest.approx(1.15)  # between the measured sizes, as `by_size`
    # Not measured: zero-bubble's split backward, four chunks, stages and replicas at once.
    assert by(4, 2, 1, 1, "zero-bubble") == pytest.approx(1.6) and by(16, 2, 1, 1, "zero-bubble") == pytest.approx(1.7)
    assert by(4, 2, 1, 4, "interleaved") == pytest.approx(1.6)
    assert by(4, 2, 2) == pytest.approx(1.6)
    # No pipeline measured (fewer layers than ranks, or it failed): every shape takes the replicas' ratio.
    assert calibrate.by_shape({4: 1.6}, {})(4, 2, 1) == pytest.approx(1.6)


def test_the_engine_steps_as_a_pipeline_of_the_ranks_here(planned):
    spec = build_model("transformer", **PARAMS)
    examples = inputs.generated(spec, 0)
    adam = functools.partial(torch.optim.Adam, lr=1e-3)
    # The plan's own pipelines of 2 stages on the whole batch: GPipe, and 2 chunks per stage (a single core plans
    # without: measured here then).
    calls = _engine_calls(planned, pipeline=True) or [
        (dict(balance=balance, virtual=virtual, counts=[2, 8]),
         here.engine_steps("transformer", PARAMS, *examples(8), 0, 2, 1, [2, 8], adam, 1.0, balance, virtual))
        for balance, virtual in (([1, len(spec.layers) - 1], 1), ([1, 1, 1, len(spec.layers) - 3], 2))]
    assert [(len(args["balance"]), args["virtual"]) for args, _ in calls] == [(2, 1), (4, 2)]
    for args, steps in calls:
        assert sum(args["balance"]) == len(spec.layers) and len(args["counts"]) > 1
        assert sorted(steps.per_count) == sorted(args["counts"])
        assert all(0 < update < step < 60 for step, update in steps.per_count.values())
    # The cut reaches the ranks: one that does not cover the model's layers fails there, in one line.
    with pytest.raises(here.Unavailable, match="as 2 stages x 1 replica,"):
        here.engine_steps("transformer", PARAMS, *examples(8), 0, 2, 1, [2], adam, 1.0, [1, 1])


def test_a_rank_that_fails_is_one_line_not_a_traceback(capfd):
    spec = build_model("transformer", **PARAMS)
    with pytest.raises(here.Unavailable, match="running the engine on 2 replicas failed"):
        here.engine_steps("transformer", {**PARAMS, "heads": 3}, *inputs.generated(spec, 0)(4), 0, 2, 1, [1])
    assert "Traceback" not in capfd.readouterr().err


def test_the_steadiness_line_warns_only_when_the_machine_moved():
    from gpipe_cli.plan.runner import steadiness
    assert steadiness(0.04).endswith("took 4% longer: steady while measuring")
    assert steadiness(-0.05).endswith("took 5% less: steady while measuring")
    moved = steadiness(0.25)
    assert "took 25% longer: this machine's speed moved while measuring" in moved and "gpipe bench" in moved


def _record_facts(path: str) -> None:
    facts = {"parent": os.getppid(), "torch": "torch" in sys.modules,
             "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
             "sigint_ignored": signal.getsignal(signal.SIGINT) == signal.SIG_IGN}
    Path(path, str(os.getpid())).write_text(json.dumps(facts))


@pytest.mark.skipif(not forked.available(), reason="no fork server on this platform")
def test_within_siblings_children_fork_from_one_server_and_it_ends_with_the_block(tmp_path):
    with here.siblings():
        for name in ("first", "second"):
            folder = tmp_path / name
            folder.mkdir()
            with here.loaded(functools.partial(_record_facts, str(folder)), 1, 1):
                pass  # the sibling is stopped (SIGTERM) after the body: it computes until then
        server = multiprocessing.forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
    facts = [json.loads(path.read_text()) for path in tmp_path.glob("*/*")]
    assert len(facts) == 2 and all(f["parent"] == server for f in facts)  # one server, not one per `loaded`
    assert all(f["torch"] and f["sigterm_default"] and f["sigint_ignored"] for f in facts)  # Ctrl-C is the plan's
    assert not forked.running() and not Path(f"/proc/{server}").exists()
