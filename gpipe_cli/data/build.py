"""Building a task's Loader from a recipe's data section."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from gpipe_cli.data.loader import Baseline, Examples, Loader
from gpipe_cli.data.tokenizer import Tokenizer
from gpipe_cli.errors import DataError
from gpipe_cli.models import families
from gpipe_cli.models.families import Task
from gpipe_cli.recipe.schema import Data, Recipe
from gpipe_cli.units import counted


def build_data(data: Data, task: Task, *, seed: int, image_size: int = 224, num_classes: int = 1000,
               vocab_size: int = 32000, max_len: int = 256, run_dir: Path | None = None, min_batch: int = 1,
               workers: int = 0, cache_dir: Path | None = None, least: int = 1, least_why: str = "") -> Loader:
    """The Loader for `data` and `task`, built by `workers` background processes (0: inline)."""
    # `min_batch` (micro-batches x replicas x `least`) examples or more in every mini-batch: no shard's micro-batch
    # is empty, nor smaller than the `least` examples the model trains on (`least_why`: why, in words).
    train: Examples
    evl: Examples | None
    tok: Tokenizer | None = None
    baselines: dict[str, Baseline] = {}  # figures a trained model should beat on the held-out split
    if task == "image":
        if data.tokens_per_batch is not None:
            raise DataError("data.tokens_per_batch applies to text tasks; images use data.batch_size")
        from gpipe_cli.data.images import image_splits

        train, evl = image_splits(data, seed=seed, image_size=image_size, num_classes=num_classes,
                                  cache_dir=cache_dir, run_dir=run_dir)
    elif task in ("translation", "lm"):
        from gpipe_cli.data.text import LMExamples, text_splits, unigram_perplexity

        train, evl, tok = text_splits(data, task, seed=seed, vocab_size=vocab_size, max_len=max_len,
                                      run_dir=run_dir, cache_dir=cache_dir)
        if isinstance(train, LMExamples) and isinstance(evl, LMExamples) and len(evl):
            baselines["unigram_perplexity"] = functools.partial(unigram_perplexity, train, evl, tok.vocab_size)
    else:
        raise ValueError(f"unknown task {task!r}")
    loader = Loader(train=train, eval=evl, tokenizer=tok, batch_size=data.batch_size,
                    tokens_per_batch=data.tokens_per_batch, drop_last=data.drop_last, shuffle=data.shuffle,
                    seed=seed, min_batch=min_batch, workers=workers, baselines=baselines)
    # Too few for a step's micro-batches first: data.drop_last: false, which the other error advises, cannot help it.
    if loader.train_size < loader.min_batch:  # then every batch is smaller: some micro-batch would be empty
        count = f"{loader.min_batch // least} micro-batches" if least > 1 else f"{loader.min_batch} micro-batches"
        needs = f"{least} ({least_why})" if least > 1 else "one"
        raise DataError(f"the training split has {counted(loader.train_size, 'example')}, fewer than the "
                        f"{count} of a step (pipeline.microbatches x pipeline.data_parallel), each of which needs "
                        f"{needs}; lower them or give more data")
    if loader.steps_per_epoch() == 0:  # an epoch without a batch: training would never advance
        size = (f"data.tokens_per_batch ({data.tokens_per_batch})" if data.tokens_per_batch
                else f"data.batch_size ({data.batch_size})")
        raise DataError(f"the training split has {counted(loader.train_size, 'example')}, too few for one batch of "
                        f"{size} with data.drop_last; lower the batch size or set data.drop_last: false")
    return loader


def build_data_for(recipe: Recipe, *, run_dir: Path | None = None, **kwargs: Any) -> Loader:
    """build_data with the task and sizes taken from a whole recipe."""
    model, family = recipe.model, families.of(recipe.model.kind)
    sizes = {key: getattr(model, key) for key in family.data_sizes}
    # A last batch shorter than a step's least (an AmoebaNet micro-batch of one image, which BatchNorm cannot train
    # on, from data.drop_last: false) joins the one before it.
    kwargs.setdefault("min_batch", recipe.pipeline.microbatches * recipe.pipeline.data_parallel * family.least_examples)
    return build_data(recipe.data, family.task(model), seed=recipe.seed, run_dir=run_dir, least=family.least_examples,
                      least_why=family.least_why, **sizes, **kwargs)
