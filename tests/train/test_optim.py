import math

import pytest
import torch

from gpipe_cli.recipe.load import validate
from gpipe_cli.recipe_model import base_lr, build_optimizer
from gpipe_cli.train.optim import following, lr_factor, total_steps


def recipe(**sections):
    raw = {"train": {"steps": 100}, "data": {"batch_size": 512}}
    raw.update(sections)
    return validate(raw, "r.yaml")


def test_inverse_sqrt_warms_up_linearly_then_decays():
    f = lr_factor(recipe(schedule={"name": "inverse_sqrt", "warmup_steps": 100}), 10, 1000)
    assert f(0) == pytest.approx(0.01) and f(49) == pytest.approx(0.5) and f(99) == pytest.approx(1.0)
    assert f(399) == pytest.approx(0.5)  # sqrt(100 / 400)


def test_exponential_staircase_every_few_epochs_after_warmup():
    f = lr_factor(recipe(schedule={"name": "exponential", "decay_rate": 0.97, "decay_epochs": 2.0,
                                   "warmup_steps": 5}), steps_per_epoch=10, total_steps=1000)
    assert f(4) == 1.0 and f(24) == 1.0
    assert f(25) == pytest.approx(0.97) and f(45) == pytest.approx(0.97 ** 2)


def test_cosine_reaches_the_floor():
    f = lr_factor(recipe(optimizer={"lr": 0.1}, schedule={"name": "cosine", "min_lr": 0.01}), 10, 100)
    assert f(0) == pytest.approx(1.0) and f(99) == pytest.approx(0.1, abs=1e-3)
    assert f(50) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)), rel=1e-2)


def test_the_floor_is_under_the_decay_not_the_warm_up_in_both_floored_schedules():
    # Exponential held min_lr through its warm-up (0.04, 0.04, 0.04) where cosine ramped up from 0 under it.
    for name in ("exponential", "cosine"):
        f = lr_factor(recipe(optimizer={"lr": 0.05}, schedule={"name": name, "min_lr": 0.04, "warmup_steps": 4}),
                      10, 100)
        assert [f(step) for step in range(3)] == pytest.approx([0.25, 0.5, 0.75]), name


@pytest.mark.parametrize("optimizer, schedule, line", [
    ({"name": "amoebanet-rmsprop", "decay": 0.5}, {}, "optimizer.decay (0.5) is read only by optimizer.name rmsprop: "
                                                      "amoebanet-rmsprop (the paper's RMSProp: decay and momentum "
                                                      "0.9) trains without it"),
    ({"name": "adam", "momentum": 0.5}, {}, "optimizer.momentum (0.5) is read only by optimizer.name sgd or rmsprop: "
                                            "adam trains without it"),
    ({"name": "sgd", "betas": [0.8, 0.9]}, {}, "optimizer.betas ([0.8, 0.9]) is read only by optimizer.name adam or "
                                               "adamw: sgd trains without it"),
    ({}, {"name": "constant", "decay_rate": 0.5}, "schedule.decay_rate (0.5) is read only by schedule.name "
                                                  "exponential: constant trains without it"),
])
def test_a_setting_the_chosen_optimizer_or_schedule_does_not_read_is_said(optimizer, schedule, line):
    # The paper's RMSProp trained with decay and momentum 0.9 whatever the recipe said, and said nothing.
    from gpipe_cli.recipe.schema import unread_settings

    assert unread_settings(recipe(optimizer=optimizer, schedule=schedule)) == [line]
    defaults = {"momentum": 0.9, "decay": 0.9, "betas": [0.9, 0.98], "decay_rate": 0.97}
    # At its default, as a run's recipe.yaml holds every key: nothing to say.
    assert unread_settings(recipe(optimizer={k: defaults.get(k, v) for k, v in optimizer.items()},
                                  schedule={k: defaults.get(k, v) for k, v in schedule.items()})) == []


def test_learning_rate_proportional_to_batch_size():
    assert base_lr(recipe(optimizer={"lr": 0.016, "lr_per_256": True})) == pytest.approx(0.032)


@pytest.mark.parametrize("name,cls", [("sgd", torch.optim.SGD), ("adam", torch.optim.Adam),
                                      ("adamw", torch.optim.AdamW), ("rmsprop", torch.optim.RMSprop)])
def test_optimizers_by_name(name, cls):
    opt = build_optimizer([torch.nn.Parameter(torch.zeros(2))], recipe(optimizer={"name": name, "lr": 0.01}))
    assert isinstance(opt, cls) and opt.param_groups[0]["lr"] == 0.01


def test_the_papers_amoebanet_rmsprop():
    opt = build_optimizer([torch.nn.Parameter(torch.zeros(2))], recipe(optimizer={"name": "amoebanet-rmsprop"}))
    group = opt.param_groups[0]
    assert isinstance(opt, torch.optim.RMSprop) and group["alpha"] == 0.9 and group["momentum"] == 0.9


def test_a_stage_without_parameters_has_no_optimizer():
    r = recipe()
    assert build_optimizer([], r) is None and following(None, lr_factor(r, 10, 100)) is None


def test_scheduler_follows_the_factor():
    r = recipe(optimizer={"name": "sgd", "lr": 1.0}, schedule={"name": "inverse_sqrt", "warmup_steps": 4})
    opt = build_optimizer([torch.nn.Parameter(torch.zeros(1))], r)
    sched = following(opt, lr_factor(r, 10, 100))
    seen = []
    for _ in range(6):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([lr_factor(r, 10, 100)(s) for s in range(6)])


def test_a_warm_up_longer_than_the_run_is_said():
    from gpipe_cli.recipe.schema import unread_settings

    assert unread_settings(recipe(schedule={"warmup_steps": 400})) == [
        "schedule.warmup_steps (400) is longer than the run (train.steps 100): the learning rate never reaches its "
        "peak, 0.25 of it at the last step"]
    assert unread_settings(recipe(schedule={"warmup_steps": 100})) == []


def test_a_sequence_length_set_for_a_translation_or_image_model_is_said_unread():
    # data.seq_len trained a translation model without a word, which reads whole pairs.
    from gpipe_cli.recipe.load import load_recipe
    from gpipe_cli.recipe.schema import unread_settings

    quickstart = "gpipe_cli/recipe/quickstart.yaml"
    assert unread_settings(load_recipe(quickstart, ["data.seq_len=40"])) == [
        "data.seq_len (40) is read only by a language model (model.arch decoder-only): a translation model reads "
        "whole pairs"]
    assert unread_settings(load_recipe(quickstart, ["data.seq_len=40", "model.arch=decoder-only"])) == []


def test_cosine_after_a_warm_up_decays_over_the_steps_after_it():
    # Spread over the whole run, the last of 100 steps after a warm-up of 50 trained at 0.516 of the peak.
    f = lr_factor(recipe(schedule={"name": "cosine", "warmup_steps": 50}), 10, 100)
    assert f(49) == 1.0 and f(99) == pytest.approx(0.0, abs=1e-2)
    assert f(74) == pytest.approx(0.5 * (1 + math.cos(math.pi * 24 / 50)))


def test_an_exponential_decay_of_less_than_an_epoch_counts_steps():
    f = lr_factor(recipe(schedule={"name": "exponential", "decay_rate": 0.5, "decay_epochs": 0.5}), 10, 1000)
    assert (f(4), f(5), f(10)) == (1.0, 0.5, 0.25)


@pytest.mark.parametrize("name,momentum", [("sgd", True), ("adam", False), ("adamw", False), ("rmsprop", True)])
def test_the_recipe_s_weight_decay_and_momentum_reach_the_optimizer(name, momentum):
    opt = build_optimizer([torch.nn.Parameter(torch.zeros(2))],
                          recipe(optimizer={"name": name, "weight_decay": 0.01, "momentum": 0.5}))
    group = opt.param_groups[0]
    assert group["weight_decay"] == 0.01
    assert group["momentum"] == 0.5 if momentum else "momentum" not in group


@pytest.mark.parametrize("steps,epochs,total", [(3, 5, 3), (100, 2, 20), (None, 2, 20), (7, None, 7)])
def test_a_run_trains_to_whichever_of_steps_and_epochs_ends_first(steps, epochs, total):
    assert total_steps(steps, epochs, 10) == total
