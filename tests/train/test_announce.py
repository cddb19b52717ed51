"""The first lines of `gpipe train`: what starts, and whether the ranks oversubscribe the machine."""

import copy

from gpipe_cli.recipe.schema import Recipe
from gpipe_cli.train.run import first_line, local_ranks, oversubscription
from tests.train.recipes import TINY_TRANSLATION


def test_the_first_line_names_the_recipe_and_the_cut():
    raw = copy.deepcopy(TINY_TRANSLATION)
    raw["pipeline"].update(partitions=2, microbatches=3, data_parallel=2)
    line = first_line(Recipe.model_validate(raw))
    assert line.startswith("gpipe train tiny-translation: Transformer encoder-decoder")
    for part in ("K=2 stages", "D=2", "= 4 ranks", "M=3 micro-batches", "batch 10", "3 steps", "fp32"):
        assert part in line, part


def test_the_first_line_counts_one_of_each_in_the_singular():
    raw = copy.deepcopy(TINY_TRANSLATION)
    raw["pipeline"].update(partitions=1, microbatches=1)
    raw["train"].update(steps=1, epochs=1)
    line = first_line(Recipe.model_validate(raw))
    assert "K=1 stage x D=1 = 1 rank, M=1 micro-batch, batch 10, 1 step and 1 epoch, fp32" in line, line


def test_the_first_line_names_the_model_that_is_built():
    from gpipe_cli.recipe.load import load_recipe

    wmt = "recipes/transformer-wmt-en-de.yaml"
    assert ": t-6-8192-16, K=" in first_line(load_recipe(wmt, check_data=False))
    # A preset resized by the recipe is not that preset; a token budget, not batch_size, sets the batch.
    line = first_line(load_recipe(wmt, ["model.layers=2", "model.d_model=128", "data.tokens_per_batch=1024"],
                                  check_data=False))
    assert ": Transformer encoder-decoder with 2 layers, d_model 128, K=" in line and "batch 1,024 tokens" in line


def test_oversubscription_is_flagged_for_cores_and_for_gpus():
    assert oversubscription(ranks=2, threads=1, cores=2, gpus=0) is None
    cpu = oversubscription(ranks=4, threads=1, cores=2, gpus=0)
    assert cpu is not None and cpu.startswith("warning: 4 ranks x 1 thread on 2 CPU cores (oversubscribed)")
    assert oversubscription(ranks=2, threads=2, cores=2, gpus=0) is not None
    assert oversubscription(ranks=8, threads=1, cores=2, gpus=8) is None  # one GPU each: cores do not matter
    gpu = oversubscription(ranks=4, threads=1, cores=64, gpus=1)
    assert gpu is not None and "4 ranks share 1 GPU " in gpu


def test_local_ranks_are_the_job_share_of_this_node(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert local_ranks(8, "1") == 8 and local_ranks(8, "2") == 4 and local_ranks(8, "1:2") == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert local_ranks(8, "1") == 3
