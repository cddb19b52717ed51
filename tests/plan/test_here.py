"""What ranks sharing this machine add, measured with real processes: links, load, the engine's steps."""

import functools
import os

import pytest

from gpipe_cli.models.registry import build_model
from gpipe_cli.plan import calibrate, here, inputs
from tests.plan.test_runner import TINY

PARAMS = {k: v for k, v in TINY["model"].items() if k != "kind"}


def test_links_between_two_ranks_are_read_as_latency_and_bandwidth():
    p2p, reduce = here.links(2)
    for link in (p2p, reduce):
        assert 1e6 < link.bandwidth < 1e13 and 0.0 <= link.latency < 0.1  # a real, finite link


def _record_pid(path: str) -> None:
    with open(os.path.join(path, str(os.getpid())), "w"):
        pass


def test_siblings_work_while_the_body_runs_and_are_gone_after_it(tmp_path):
    with here.loaded(functools.partial(_record_pid, str(tmp_path)), 1, 1):
        pids = [int(p) for p in os.listdir(tmp_path)]
        assert len(pids) == 1 and pids[0] != os.getpid()  # the first run is done before the body
    with pytest.raises(ProcessLookupError):
        os.kill(pids[0], 0)


def test_the_engine_steps_on_real_replicas_and_its_costs_fit_the_gap_they_leave():
    spec = build_model("transformer", **PARAMS)
    examples = inputs.generated(spec, 0)
    steps = here.engine_steps("transformer", PARAMS, *examples(4), 0, 2, 1, [1, 2, 4])
    assert sorted(steps) == [1, 2, 4] and all(0 < s < 60 for s in steps.values())
    costs = inputs.measured_costs(spec, (1, 4), 0, 1, examples)
    extra = calibrate.overhead(len(spec.layers), costs, 4, steps)
    assert extra.action >= 0 and extra.step >= 0


def test_the_fit_recovers_the_per_call_and_per_step_costs_it_is_given():
    spec = build_model("transformer", **PARAMS)
    costs = inputs.measured_costs(spec, (1, 8), 0, 1, inputs.generated(spec, 0))
    layers, per_call, per_step, known = len(spec.layers), 2e-4, 3e-3, 1e-3
    from gpipe_cli.estimate import simulate
    measured = {m: simulate.simulate_step(costs(8 // m), [layers], 8, m, "gpipe", "never",
                                          simulate.Link(1e30, 0.0)).step_time + known + per_step
                + 2 * layers * m * per_call for m in (1, 2, 8)}
    extra = calibrate.overhead(layers, costs, 8, measured, known)
    assert extra.action == pytest.approx(per_call, rel=1e-6) and extra.step == pytest.approx(per_step, rel=1e-6)


def test_the_factor_scales_the_layers_to_the_measured_steps():
    spec = build_model("transformer", **PARAMS)
    costs = inputs.measured_costs(spec, (1, 8), 0, 1, inputs.generated(spec, 0))
    from gpipe_cli.estimate import simulate
    layers, known = len(spec.layers), 1e-3
    measured = {m: 1.5 * simulate.simulate_step(costs(8 // m), [layers], 8, m, "gpipe", "never",
                                                simulate.Link(1e30, 0.0)).step_time + known for m in (1, 2, 8)}
    factor = calibrate.factor(layers, costs, 8, measured, known)
    assert factor == pytest.approx(1.5)
    slower = calibrate.scaled(costs, factor)(4)
    assert slower.layers[0].backward == pytest.approx(1.5 * costs(4).layers[0].backward)
    assert slower.layers[0].output_bytes == costs(4).layers[0].output_bytes


def test_a_rank_that_fails_is_one_line_not_a_traceback(capfd):
    spec = build_model("transformer", **PARAMS)
    with pytest.raises(here.Unavailable, match="running the engine on 2 replicas failed"):
        here.engine_steps("transformer", {**PARAMS, "heads": 3}, *inputs.generated(spec, 0)(4), 0, 2, 1, [1])
    assert "Traceback" not in capfd.readouterr().err
