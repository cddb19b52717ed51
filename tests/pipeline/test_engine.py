"""The central promise: pipelined training equals plain training, for any K, M, schedule and remat mode."""

import itertools
import re
import time

import pytest
import torch
from torch import nn

from gpipe_cli.models import losses
from gpipe_cli.pipeline import topology
from gpipe_cli.pipeline.config import PipelineConfig
from gpipe_cli.pipeline.engine import Pipeline
from gpipe_cli.pipeline.layers import build_layers
from tests.multiproc import results, run_ranks
from tests.pipeline import loopback, ranks, toy
from tests.pipeline.together import several, shared_jobs

MODES = ["always", "except_last", "never"]
CONFIGS = list(itertools.product([1, 3, 4, 8], ["gpipe", "1f1b"], MODES)) + \
    list(itertools.product([3, 8], ["zero-bubble"], MODES))
BALANCES = {1: {"bn": [6], "ln": [5]}, 2: {"bn": [3, 3], "ln": [2, 3]}, 4: {"bn": [1, 2, 1, 2], "ln": [1, 1, 2, 1]}}
# K=2 x V=2 chunks, chunk c on stage c mod 2: interleaved 1F1B, in the same spawned jobs as K=2
CHUNKS = {"bn": (2, 1, 2, 1), "ln": (1, 1, 2, 1)}
TOLERANCE = 1e-5
CLIP = 0.05  # below the toy models' gradient norms: every step clips


def merged_states(per_rank: list[dict]) -> dict:
    merged: dict = {}
    for part in per_rank:
        for config, state in part.items():
            merged.setdefault(config, {}).update(state)
    return merged


def check(states: dict, model: str) -> None:
    references = {m: toy.reference(model, m) for m in {c[0] for c in states}}
    failures = []
    for config, state in states.items():
        ref = references[config[0]]
        assert set(state) == set(ref), f"{config}: state keys differ"
        errors = toy.relative_errors(state, ref)
        worst = max(errors, key=errors.get)
        if errors[worst] > TOLERANCE:
            failures.append(f"{config}: {worst} differs by {errors[worst]:.2e}")
    assert not failures, "\n".join(failures)


# The tied model too: its copies' gradients are summed over the stages of every replica.
DATA_PARALLEL = (("ln", [2, 3], "1f1b"), ("bn", [3, 3], "zero-bubble"), ("bn", [2, 1, 2, 1], "interleaved"),
                 ("tied", [2, 2], "1f1b"))
TIED_CONFIGS = [(3, "gpipe", "except_last"), (2, "1f1b", "always"), (3, "zero-bubble", "except_last")]


def grid_configs(stages: int, model: str) -> list[tuple]:
    return CONFIGS + ([(m, "interleaved", mode, CHUNKS[model]) for m in (2, 4) for mode in MODES]
                      if stages == 2 else [])


def tied_configs(balance: list[int]) -> list[tuple]:
    return TIED_CONFIGS + ([(2, "interleaved", "except_last", (1, 1, 1, 1))] if len(balance) == 2 else [])


# Every multi-rank run of this module, by world size: the runs of one size share one job's rank processes.
JOBS: dict[int, dict] = {
    2: {**{("grid", model): (ranks.grid, (model, 2, BALANCES[2][model], grid_configs(2, model)))
           for model in ("bn", "ln")},
        ("tied", 2): (ranks.grid, ("tied", 2, [2, 2], tied_configs([2, 2]))),
        ("clipped", "tied"): (ranks.clipped, ("tied", 2, [2, 2], 3, CLIP)),
        ("evaluate", 10): (ranks.evaluate, ("bn", 2, [3, 3], 10, 4)),
        ("evaluate", 3): (ranks.evaluate, ("bn", 2, [3, 3], 3, 4)),
        ("evaluate", "ring"): (ranks.evaluate, ("bn", 2, [2, 1, 2, 1], 3, 4, "interleaved")),
        ("shapes", 2): (ranks.varying_shapes, ([1, 2],))},
    3: {("shapes", 3): (ranks.varying_shapes, ([1, 1, 1],))},
    4: {**{("grid", model): (ranks.grid, (model, 4, BALANCES[4][model], grid_configs(4, model)))
           for model in ("bn", "ln")},
        ("tied", 4): (ranks.grid, ("tied", 4, [1, 1, 1, 1], tied_configs([1, 1, 1, 1]))),
        **{("data-parallel", i): (ranks.data_parallel, (model, 2, 2, balance, 2, schedule))
           for i, (model, balance, schedule) in enumerate(DATA_PARALLEL)}},
}


@pytest.fixture(scope="module")
def ran():
    """(world, key) -> each rank's result of that run of JOBS (each world's runs made once, in one job)."""
    return shared_jobs(lambda world, calls: results(run_ranks(several, world, calls, timeout=540)), JOBS)


@pytest.mark.parametrize("model", ["bn", "ln"])
@pytest.mark.parametrize("stages", [1, 2, 4])
def test_parameters_equal_plain_training(stages, model, ran):
    """K in {1,2,4} x M in {1,3,4,8} x every schedule x all remat modes, uneven and final smaller batches.

    The BatchNorm model also checks the running statistics (deferred BatchNorm); the LayerNorm model is
    compared with whole-batch training, which shows the result does not depend on M at all.
    """
    if stages == 1:
        states = ranks.grid(model, 1, BALANCES[1][model], CONFIGS)
    else:
        states = merged_states(ran(stages, ("grid", model)))
    check(states, model)


def test_data_parallel_times_pipeline_equals_concatenated_batch(ran):
    for i, (model, _, _) in enumerate(DATA_PARALLEL):
        outcome = ran(4, ("data-parallel", i))
        ref, losses, _ = toy.trained(model, microbatches=2, replicas=2)
        for part in outcome:
            errors = toy.relative_errors(part["state"], ref)
            assert max(errors.values()) <= TOLERANCE, (model, part["stage"], part["replica"], errors)
            if part["stage"] == part["replica"] == 0:  # rank 0's loss is the mini-batch's, over every replica
                assert part["losses"] == pytest.approx(losses, rel=TOLERANCE), model
        # replicas hold identical parameters and BatchNorm statistics
        by_stage: dict = {}
        for part in outcome:
            by_stage.setdefault(part["stage"], []).append(part["state"])
        for a, b in by_stage.values():
            assert all(torch.equal(a[k], b[k]) for k in a)
        assert outcome[0]["losses"][0] is not None


@pytest.mark.parametrize("microbatches", [1, 3, 8])
def test_the_step_loss_is_the_mini_batch_loss_of_plain_training(microbatches):
    # Only the gradients were compared: a loss reported as the mean over micro-batches, M times too small, passed.
    pipe = ranks.make_pipeline("ln", topology.init(1), BALANCES[1]["ln"], microbatches=microbatches)
    losses = ranks.train(pipe, "ln", microbatches)
    pipe.close()
    assert losses == pytest.approx(toy.trained("ln", microbatches)[1], rel=TOLERANCE)


def test_tied_parameters_across_stages_stay_equal_and_match_one_process(ran):
    ref = toy.reference("tied", 1)
    for balance in ([2, 2], [1, 1, 1, 1]):
        states = merged_states(ran(len(balance), ("tied", len(balance))))
        assert set(states) == set(tied_configs(balance))
        for config, state in states.items():
            assert torch.equal(state["0.embed.weight"], state["3.proj.weight"]), config
            errors = toy.relative_errors(state, ref)
            assert max(errors.values()) <= TOLERANCE, (balance, config, errors)


def test_a_tied_weight_counts_once_in_the_clipped_global_norm(ran):
    # Counted by both stages that hold it, the reported norm was too large and clipping too strong.
    ref, _, norms = toy.trained("tied", 3, max_grad_norm=CLIP)
    assert min(norms) > CLIP
    for part in ran(2, ("clipped", "tied")):
        assert part["norms"] == pytest.approx(norms, rel=TOLERANCE)
        errors = toy.relative_errors(part["state"], ref)
        assert max(errors.values()) <= TOLERANCE, errors


def test_tied_parameters_within_one_stage_are_one_tensor():
    factories = toy.tied_model()
    pipe = Pipeline(build_layers(factories, range(4), toy.SEED), topology.local(), PipelineConfig(balance=(4,)),
                    toy.token_loss, tied=toy.TIED)
    assert pipe.module.get_parameter("0.embed.weight") is pipe.module.get_parameter("3.proj.weight")
    assert len(pipe.parameters()) == sum(1 for _ in pipe.module.parameters())
    # the optimizer sees the shared tensor once, though two layers name it
    assert len(pipe.parameters()) == len(list(pipe.module.named_parameters(remove_duplicate=False))) - 1


def test_every_rank_opens_the_same_communicators_in_the_same_order(monkeypatch):
    """torch.distributed.new_group pairs the ranks' calls by their order: K=3 x D=2 with a tie across stages."""
    import torch.distributed as dist

    opened: dict[int, list[list[int] | None]] = {}
    monkeypatch.setenv("WORLD_SIZE", "6")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "broadcast", lambda *args, **kwargs: None)
    for rank in range(6):
        calls = opened[rank] = []
        monkeypatch.setattr(dist, "get_rank", lambda rank=rank: rank)
        monkeypatch.setattr(dist, "new_group", lambda ranks=None, calls=calls, **kw: calls.append(ranks) or ranks)
        ranks.make_pipeline("tied", topology.init(3, 2, backend="gloo", device="cpu"), [2, 1, 1])
    assert all(calls == opened[0] for calls in opened.values()), opened
    assert [0, 2] in opened[0] and [3, 5] in opened[0]


def test_evaluation_returns_loss_metrics_and_outputs_on_rank_zero(ran):
    single = ranks.evaluate("bn", 1, [6], 10, 4)
    for size in (10, 3):  # 3 < M: one example per micro-batch
        outcome = ran(2, ("evaluate", size))
        rank0 = next(o for o in outcome if o["rank"] == 0)
        ref = single if size == 10 else ranks.evaluate("bn", 1, [6], size, 4)
        assert rank0["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        assert rank0["units"] == size and rank0["metrics"]["correct"] == ref["metrics"]["correct"]
        assert torch.allclose(rank0["outputs"], ref["outputs"], rtol=1e-5, atol=1e-6)
        assert all(o["loss"] == pytest.approx(rank0["loss"]) for o in outcome)
    # interleaved chunks pass activations round the ring, also for a batch smaller than M
    ring = next(o for o in ran(2, ("evaluate", "ring")) if o["rank"] == 0)
    ref = ranks.evaluate("bn", 1, [6], 3, 4)
    assert ring["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert torch.allclose(ring["outputs"], ref["outputs"], rtol=1e-5, atol=1e-6)


def test_shapes_change_between_steps_and_microbatches(ran):
    """Sequence length changes every step and micro-batches are uneven: fresh buffers, right results."""
    single = ranks.varying_shapes([3])
    for stages in (2, 3):  # balances [1, 2] and [1, 1, 1]
        losses = ran(stages, ("shapes", stages))[-1]
        assert losses == pytest.approx(single, rel=1e-5)


def test_a_failing_stage_stops_every_rank_quickly_with_its_error():
    start = time.monotonic()
    outcome = run_ranks(ranks.failing, 3, 3, 1, timeout=60)
    elapsed = time.monotonic() - start
    assert elapsed < 30, f"ranks took {elapsed:.0f} s to stop"
    assert all(o.exitcode not in (0, None) for o in outcome), [o.exitcode for o in outcome]
    failing = outcome[1].output
    assert "stage 1 (rank 1) failed: ValueError: boom: this layer is broken" in failing
    for other in (outcome[0], outcome[2]):
        # Each other rank names the cause, or, when the store went down with the failed rank before it read
        # the cause, says it lost contact; either way it stopped, and the failing rank told why above.
        assert re.search(r"stopped: (stage 1 \(rank 1\) failed: ValueError: boom|lost contact with the job)",
                         other.output), other.output


def _float64_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy averaged over the non-padding tokens, in the logits' own type."""
    total = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=losses.PAD_ID,
                                        reduction="sum")
    return total / losses.count_tokens(targets).clamp_min(1)


def _replicas_step(replicas: int, padded: tuple[int, ...] = (), dtype: torch.dtype = torch.float32,
                   examples: int = 8) -> list[list[torch.Tensor]]:
    """Each rank's parameters after one step of the tied model on K=1 x D (the replicas `padded`: padding alone)."""
    world = loopback.World(replicas, "cpu")
    # Built here: rank threads building at once would draw their initial weights from one generator in turns.
    built = [[layer.to(dtype) for layer in build_layers(toy.tied_model(), range(4), 7)] for _ in range(replicas)]
    loss = losses.token_cross_entropy if dtype == torch.float32 else _float64_token_loss

    def rank(r: int) -> list[torch.Tensor]:
        topo = loopback.topology(world, r, 1, replicas)
        pipe = Pipeline(built[r], topo, PipelineConfig(1, 2, replicas, balance=(4,)), loss,
                        units=losses.count_tokens, tied=toy.TIED)
        x, y = (part[:examples].tensor_split(replicas)[r] for part in toy.batch("tied", 0, 8))
        y = torch.zeros_like(y) if r in padded else y
        pipe.train_step(x, y, step=0, optimizer=torch.optim.SGD(pipe.parameters(), lr=0.5))
        return [p.detach().clone() for p in pipe.parameters()]

    return world.run(rank)


def test_a_replica_all_padding_adds_nothing_and_no_units_anywhere_is_refused_for_any_d():
    alone = _replicas_step(1, examples=4)  # replica 0's examples alone
    together = _replicas_step(2, padded=(1,))
    for a, b in zip(alone[0], together[0], strict=True):
        assert torch.equal(a, b)  # the replica with no units weighs nothing: the step is replica 0's alone
    for replicas in (1, 2):
        with pytest.raises(RuntimeError, match="rank 0: ValueError: the mini-batch has no units to train on"):
            _replicas_step(replicas, padded=(0, 1))


def test_replicas_train_as_one_in_float64():
    # Each micro-batch's share of the units, summed over the replicas on the device, is the number the host divides.
    alone, together = _replicas_step(1, dtype=torch.float64), _replicas_step(2, dtype=torch.float64)
    for a, b in zip(alone[0], together[0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-15)
