"""The loop's arithmetic of steps, without ranks: which steps save, evaluate and count memory, which batches a resume
reads, what epoch a step is in, and what a resume carries over (the loop driven with stand-ins for the engine)."""

from __future__ import annotations

import itertools
import json
import signal
from types import SimpleNamespace

import pytest

from gpipe_cli.pipeline import heartbeat
from gpipe_cli.recipe.load import load_recipe
from gpipe_cli.recipe_model import base_lr
from gpipe_cli.train import loop as loop_module
from gpipe_cli.train.loop import Trainer
from gpipe_cli.train.resume import skipped_until


@pytest.fixture(autouse=True)
def _this_process_never_trains(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop notes its first step for the heartbeat of a rank: this test process is none."""
    monkeypatch.setattr(heartbeat, "training_started", lambda: None)


def _driven(total: int, start: int = 0, stop_after: int | None = None, **sets: object) -> SimpleNamespace:
    """Trainer.run over `total` steps from `start`, the engine and files stood in for: what it asked for, and when."""
    recipe = load_recipe(None, [f"{key}={value}" for key, value in sets.items()], check_data=False)
    seen = SimpleNamespace(memory=[], saved=[], evaluated=[])
    trainer = Trainer.__new__(Trainer)
    done = itertools.count(start + 1)

    def launch_step(*_args: object, step: int, measure_memory: bool, **_kw: object) -> None:
        if measure_memory:
            seen.memory.append(step + 1)

    def save(step: int) -> None:
        seen.saved.append(step)
        trainer.checkpoints.last_saved = step

    def agreed(*_args: object) -> int:  # a stop signal on every rank once step `stop_after` is in
        return signal.SIGTERM if next(done) == stop_after else 0

    trainer.__dict__.update(
        recipe=recipe, start_step=start, total_steps=total, complete=False, missed_eval=False, view=None,
        data=None, steps_per_epoch=4, scheduler=None, eval_steps=1, held_none="", diverged=None, stopped_by=0,
        pipe=SimpleNamespace(launch_step=launch_step, zero_grad=lambda: None, close=lambda: None),
        profiler=SimpleNamespace(before=lambda step: None, after=lambda step: None),
        optimizer=None, checkpoints=SimpleNamespace(last_saved=start if start else -1),
        stop=SimpleNamespace(agreed=agreed, when="", signum=0, disarm=lambda code: None),
        topo=SimpleNamespace(transport=SimpleNamespace(control=None), distributed=False),
        _finish=lambda *args, **kw: "ok", _going_on=lambda: None, _save=save, _message=lambda text: None,
        evaluate=lambda step, final=False: seen.evaluated.append(step) or True, close=lambda: None)
    seen.code = trainer.run()
    return seen


def test_saves_evaluations_and_memory_counts_fall_on_their_steps():
    seen = _driven(7, **{"checkpoint.every": 3, "eval.every": 2, "train.memory_every": 3})
    assert seen.saved == [3, 6, 7]  # every 3rd step, and the last though 7 is not a multiple of 3
    assert seen.evaluated == [2, 4, 6, 7]  # every 2nd, the last once (its final evaluation)
    assert seen.memory == [1, 3, 6]  # the start's first step, then every 3rd
    assert seen.code == 0


def test_a_resumed_start_counts_memory_on_its_first_step_and_keeps_the_runs_multiples():
    seen = _driven(9, start=4, **{"checkpoint.every": 4, "eval.every": 3, "train.memory_every": 3})
    assert seen.memory == [5, 6, 9] and seen.saved == [8, 9] and seen.evaluated == [6, 9]


def test_a_stop_saves_the_step_it_came_after_and_ends_the_run():
    seen = _driven(10, stop_after=5, **{"checkpoint.every": 4, "eval.every": "null"})
    assert seen.saved == [4, 5] and seen.evaluated == [] and seen.code == 128 + signal.SIGTERM


def test_a_resume_reads_on_from_its_step_and_every_later_epoch_from_its_start():
    # 4 batches per epoch: step 6 is batch 2 of epoch 1 (0-based); epochs after it begin at their batch 0.
    asked: list[tuple[int, int]] = []

    def train_batches(epoch: int, start: int, **_kw: object):
        asked.append((epoch, start))
        return iter([(epoch, index) for index in range(start, 4)])

    trainer = SimpleNamespace(data=SimpleNamespace(train_batches=train_batches), steps_per_epoch=4, total_steps=13,
                              layout=SimpleNamespace(replica=0, replicas=1, is_first=True, is_last=True))
    batches = list(Trainer.batches(trainer, 6))  # type: ignore[arg-type]
    assert batches == [(1, 2), (1, 3), (2, 0), (2, 1), (2, 2), (2, 3), (3, 0)]
    assert asked == [(1, 2), (2, 0), (3, 0)]


def _record(monkeypatch: pytest.MonkeyPatch, step: int, start: int) -> dict:
    """The train record rank 0 writes for the 0-based `step` of a start at `start` (4 steps an epoch)."""
    monkeypatch.setattr(loop_module, "step_figures",
                        lambda stats, seconds: SimpleNamespace(seconds=1.0, bubble=0.0, idle=0.0, parts={}))
    written: list[dict] = []
    recipe = load_recipe(None, ["schedule.name=cosine", "schedule.warmup_steps=2", "train.steps=12"],
                         check_data=False)
    stage = SimpleNamespace(rss_peak=1, activation_peak=-1, memory_peak=-1, cuda_peak=0)
    stats = SimpleNamespace(of_replica=lambda replica: [stage], bubble_theory=0.0, units=10)
    result = SimpleNamespace(stats=stats, loss=1.0, grad_norm=1.0, skipped=False, loss_scale=None)
    trainer = SimpleNamespace(
        recipe=recipe, steps_per_epoch=4, start_step=start, lr=lambda s: 0.5 ** s, model_flops=None, peak=None,
        spec=SimpleNamespace(task="image"), layout=SimpleNamespace(world_size=1),
        profiler=SimpleNamespace(profiled=lambda step: False), metrics=SimpleNamespace(write=written.append),
        summary=SimpleNamespace(add=lambda *args: None), view=SimpleNamespace(show=lambda *args: None))
    Trainer._record_step(trainer, step, SimpleNamespace(global_size=8), result, 1.0, "ok")  # type: ignore[arg-type]
    return written[0]


def test_a_records_epoch_rate_and_marks_follow_its_step(monkeypatch):
    first = _record(monkeypatch, 0, start=0)
    assert first["warmup"] is True and "resumed" not in first  # a run's own first step is no resume's
    last_of_first = _record(monkeypatch, 3, start=0)
    assert last_of_first["step"] == 4 and last_of_first["epoch"] == 1 and "warmup" not in last_of_first
    first_of_second = _record(monkeypatch, 4, start=4)
    assert first_of_second["step"] == 5 and first_of_second["epoch"] == 2
    assert first_of_second["warmup"] is True and first_of_second["resumed"] is True
    recipe = load_recipe(None, ["schedule.name=cosine", "schedule.warmup_steps=2", "train.steps=12"], check_data=False)
    assert first_of_second["lr"] == pytest.approx(base_lr(recipe) * 0.5 ** 4)  # the rate of step 5 (0-based 4)


def test_a_checkpoint_is_of_the_epoch_its_last_step_trained_in():
    epochs: dict[int, int] = {}
    save = lambda step, epoch: f"step-{epochs.setdefault(step, epoch)}"  # noqa: E731
    trainer = SimpleNamespace(steps_per_epoch=4, _message=lambda text: None, checkpoints=SimpleNamespace(save=save))
    for step in (3, 4, 5, 8):
        Trainer._save(trainer, step)  # type: ignore[arg-type]
    assert epochs == {3: 1, 4: 1, 5: 2, 8: 2}


def test_the_unigram_baseline_is_of_the_batches_evaluated():
    # The perplexity beside it is of eval.batches batches: a baseline over the whole held-out split is another set.
    from tests.train.test_evaluation import _lm_spec

    written: list[dict] = []
    recipe = load_recipe(None, ["eval.batches=2"], check_data=False)
    limits: list[object] = []
    data = SimpleNamespace(eval_batches=lambda **kw: limits.append(kw["limit"]) or iter([None]),
                           eval_baselines=lambda limit: {"unigram_perplexity": 7.0 if limit == 2 else 99.0})
    trainer = SimpleNamespace(
        layout=SimpleNamespace(replica=0, replicas=1, is_first=True, is_last=True, rank=0), eval_steps=2,
        data=data, recipe=recipe, spec=_lm_spec(), _stop_agreed=lambda final: False,
        pipe=SimpleNamespace(evaluate=lambda *a, **kw: SimpleNamespace(loss=1.0, units=4.0,
                                                                         metrics={"correct": 1.0, "nll": 4.0})),
        metrics=SimpleNamespace(write=written.append), summary=SimpleNamespace(add=lambda *a: None),
        view=SimpleNamespace(show=lambda r: None), topo=SimpleNamespace(share=lambda x: x), stopped_by=None)
    assert Trainer.evaluate(trainer, 4)  # type: ignore[arg-type]
    assert limits == [2] and written[0]["unigram_perplexity"] == 7.0


def test_the_skips_before_a_resume_are_counted_in_a_row_and_in_all(tmp_path):
    skipped = {2: True, 4: True, 5: True}
    records = [{"kind": "train", "step": s, **({"skipped": True} if skipped.get(s) else {})} for s in range(1, 8)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert skipped_until(tmp_path, 5) == (2, 3)  # steps 4 and 5 in a row; 2, 4 and 5 in all (not 6 and 7: later)
    assert skipped_until(tmp_path, 3) == (0, 1)


def test_a_resume_carries_over_the_skips_in_all_and_the_best_evaluation_before_it(tmp_path, monkeypatch):
    # Trainer._build of a resume at step 4, the model, data and checkpoint stood in for: the skips counted before it
    # (1 in a row, 3 in all) and its earlier evaluations reach the policy and the summary, as if it never stopped.
    recipe = load_recipe(None, ["train.steps=8", "metrics.tensorboard=false"], check_data=False)
    records = [{"kind": "eval", "step": 2, "loss": 0.5}, {"kind": "eval", "step": 4, "loss": 0.9}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    data = SimpleNamespace(steps_per_epoch=lambda: 4, eval_steps=lambda batches: 1, train=SimpleNamespace(held_none=""),
                           train_size=40, eval_size=4, eval=None)
    monkeypatch.setattr(loop_module, "build_data_for", lambda recipe, run_dir: data)
    monkeypatch.setattr(loop_module, "build_optimizer", lambda params, recipe: None)
    trainer = Trainer.__new__(Trainer)

    def resume() -> int:
        trainer.skipped_before = (1, 3)
        return 4

    layout = SimpleNamespace(rank=0, is_first=True, is_last=True, world_size=1)
    trainer.__dict__.update(
        recipe=recipe, job=SimpleNamespace(resume=str(tmp_path), started=None), run_dir=tmp_path, layout=layout,
        topo=SimpleNamespace(share=lambda x: x, layout=layout, device=None), view=None,
        spec=SimpleNamespace(name="model"), plan=SimpleNamespace(total_params=1),
        _reading_data=lambda: "", _data_summary=lambda data: "", _cut_text=lambda: "", _check_cut=lambda: None,
        _pipeline=lambda: SimpleNamespace(parameters=lambda: []), _resume=resume, _missed_eval=lambda: False,
        _utilization=lambda: (None, None))
    trainer._build()
    try:
        assert trainer.start_step == 4
        assert (trainer.policy.consecutive, trainer.policy.total) == (1, 3)
        assert trainer.summary.best_eval is not None and trainer.summary.best_eval["step"] == 2
    finally:
        trainer.metrics.close()


def test_a_stage_without_data_steps_through_a_long_run_in_constant_memory():
    # A middle stage's batches were a list of train.steps Nones: 8 bytes a step, 8 GB at the limit of 10^9 steps.
    import tracemalloc

    tracemalloc.start()
    try:
        batches = Trainer.batches(SimpleNamespace(data=None, total_steps=10_000_000), 5)
        first = list(itertools.islice(batches, 3))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert first == [None] * 3 and peak < 1 << 20
    assert sum(1 for _ in batches) == 10_000_000 - 5 - 3
