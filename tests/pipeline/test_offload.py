"""Offloaded activations: the same training, bitwise, with the stored inputs waiting in host memory."""

from __future__ import annotations

import threading

import pytest
import torch

from gpipe_cli.pipeline import topology
from gpipe_cli.pipeline.config import PipelineConfig
from gpipe_cli.pipeline.engine import Pipeline
from gpipe_cli.pipeline.layers import build_layers
from gpipe_cli.pipeline.memory import ActivationMeter
from gpipe_cli.pipeline.offload import Offloader
from gpipe_cli.pipeline.partition import stage_layers
from tests.multiproc import results, run_ranks
from tests.pipeline import loopback, ranks, toy

_building = threading.Lock()  # layers are initialised from the process's one CPU generator
SCHEDULES = [("gpipe", (3, 3)), ("1f1b", (3, 3)), ("zero-bubble", (3, 3)), ("interleaved", (2, 1, 2, 1))]
# Every schedule rematerialising every micro-batch; except_last (fewer inputs to move) on two of them.
CASES = [(*s, "always") for s in SCHEDULES] + [(*s, "except_last") for s in SCHEDULES[:2]]


def _train(rank: int, world: loopback.World, schedule: str, balance: tuple[int, ...], checkpoint: str,
           microbatches: int) -> dict:
    """Train the BatchNorm and dropout model without, then with offload; both final states and host peaks."""
    out = {}
    for offload in ("none", "activations"):
        topo = loopback.topology(world, rank, 2)
        with _building:
            layers = build_layers(toy.MODELS["bn"]["factories"](), stage_layers(list(balance), 2, rank), toy.SEED)
        config = PipelineConfig(2, microbatches, virtual=len(balance) // 2, schedule=schedule, checkpoint=checkpoint,
                                balance=balance, offload=offload)
        pipe = Pipeline(layers, topo, config, toy.MODELS["bn"]["loss"])
        ranks.train(pipe, "bn", microbatches)
        out[offload] = ({k: v.clone() for k, v in pipe.state_dict().items()}, pipe.stage.meter.host_peak)
    return out


@pytest.mark.parametrize(("schedule", "balance", "checkpoint"), CASES)
def test_offloaded_training_equals_training_bitwise(schedule, balance, checkpoint):
    world = loopback.World(2, "cpu")
    for rank, found in enumerate(world.run(_train, world, schedule, balance, checkpoint, 4)):
        (plain, no_host), (offloaded, host) = found["none"], found["activations"]
        assert plain.keys() == offloaded.keys()
        different = [k for k in plain if not torch.equal(plain[k], offloaded[k])]
        assert not different, f"rank {rank}: {different}"
        # The first chunk's inputs stay (they are the mini-batch); the last stage rematerialises under always.
        assert no_host == 0 and (host > 0 or rank == 0 or checkpoint != "always"), (rank, no_host, host)


def test_an_input_comes_back_with_its_values_and_its_gradient_flag():
    meter = ActivationMeter()
    offloader = Offloader(torch.device("cpu"), meter)
    x = torch.randn(4, 3, requires_grad=True)
    parked = offloader.park([x.detach().requires_grad_(), None, torch.ones(2)])
    assert meter.host_current == x.nbytes + 8 and meter.current == 0
    back = [getattr(h, "tensor", h) for h in offloader.take(parked)]
    assert torch.equal(back[0], x) and back[0].requires_grad and back[0].is_leaf
    assert back[1] is None and not back[2].requires_grad
    assert meter.host_current == 0 and meter.current == x.nbytes + 8 and meter.host_peak == x.nbytes + 8


def test_offload_without_rematerialization_is_refused_in_one_line():
    with pytest.raises(ValueError, match="needs checkpoint always or except_last"):
        PipelineConfig(2, 4, checkpoint="never", offload="activations")
    with pytest.raises(ValueError, match="unknown offload mode 'all': allowed are none, activations"):
        PipelineConfig(offload="all")


def _gloo() -> dict:
    topo = topology.init(2)
    out = {}
    for offload in ("none", "activations"):
        pipe = ranks.make_pipeline("ln", topo, [2, 3], schedule="1f1b", checkpoint="always", microbatches=3,
                                   offload=offload)
        ranks.train(pipe, "ln", 3)
        out[offload] = {k: v.clone() for k, v in pipe.state_dict().items()}
        out[f"{offload} host"] = pipe.stage.meter.host_peak
        pipe.close()
    return out


@pytest.mark.slow
def test_offloaded_training_over_two_gloo_ranks_equals_training():
    first, last = results(run_ranks(_gloo, 2))
    for found in (first, last):
        assert all(torch.equal(found["none"][k], found["activations"][k]) for k in found["none"])
    # Only the second stage moves its inputs (the first one's are the mini-batch).
    assert first["activations host"] == 0 and last["activations host"] > 0
