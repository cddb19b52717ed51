"""The model and the optimizer a recipe describes, and the name the memory model prices its optimizer by."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from gpipe_cli.errors import UserError
from gpipe_cli.models.base import ModelSpec
from gpipe_cli.pipeline.config import PipelineConfig
from gpipe_cli.recipe.schema import Recipe


def model_spec(recipe: Recipe) -> ModelSpec:
    """The ModelSpec a recipe's model section describes."""
    from gpipe_cli.models.registry import build_model

    params = recipe.model.model_dump(exclude={"kind", "preset"})
    try:
        return build_model(recipe.model.kind, **params)
    except ValueError as exc:
        raise UserError(f"model: {exc}") from None


def optimizer_name(recipe: Recipe) -> str:
    """The memory model's name for the recipe's optimizer (whose state it prices)."""
    opt = recipe.optimizer
    if opt.name == "sgd":
        return "sgd" if opt.momentum else "plain-sgd"
    if opt.name == "rmsprop":
        return "rmsprop" if opt.momentum else "rmsprop-no-momentum"
    return "rmsprop" if opt.name == "amoebanet-rmsprop" else opt.name


def base_lr(recipe: Recipe) -> float:
    """The peak learning rate (see `Recipe.peak_lr`)."""
    return recipe.peak_lr()


def priced_batch(recipe: Recipe) -> int:
    """The examples of full length a mini-batch is priced at: data.batch_size, or what a token budget holds."""
    data = recipe.data
    if data.tokens_per_batch is None:
        return data.batch_size
    # A budget batch pads count x longest to at most tokens_per_batch: no more tokens, nor attention, than this many
    # examples of max_len (data.batch_size is not used).
    return max(math.ceil(data.tokens_per_batch / int(getattr(recipe.model, "max_len", 1))), 1)


def batch_key(recipe: Recipe) -> str:
    """The recipe key that sizes a mini-batch."""
    return "data.batch_size" if recipe.data.tokens_per_batch is None else "data.tokens_per_batch"


def batch_words(recipe: Recipe) -> str:
    """The key that sizes a mini-batch, with its value: 'data.tokens_per_batch 4096 (16 examples of 256 tokens)'."""
    data = recipe.data
    if data.tokens_per_batch is None:
        return f"{batch_key(recipe)} {data.batch_size}"
    return (f"{batch_key(recipe)} {data.tokens_per_batch} ({priced_batch(recipe)} examples of "
            f"{getattr(recipe.model, 'max_len', 1)} tokens)")


def pipeline_config(recipe: Recipe, balance: Sequence[int] = ()) -> PipelineConfig:
    """The recipe's pipeline as one value (cut by `balance` when given)."""
    p = recipe.pipeline
    return PipelineConfig(p.partitions, p.microbatches, p.data_parallel, p.virtual_stages, p.schedule, p.checkpoint,
                          tuple(balance), p.offload)


def build_optimizer(params: Sequence[nn.Parameter], recipe: Recipe) -> torch.optim.Optimizer | None:
    """The recipe's optimizer over a stage's parameters (None for a stage without any)."""
    if not params:
        return None
    opt, lr = recipe.optimizer, base_lr(recipe)
    # Fused kernels skip a step with a non-finite gradient on the device (`found_inf`), so the engine never
    # waits for the device to decide it; they run on CUDA and the CPU.
    fused = all(p.device.type in ("cuda", "cpu") for p in params)
    if opt.name == "sgd":
        sgd = torch.optim.SGD(params, lr=lr, momentum=opt.momentum, weight_decay=opt.weight_decay, fused=fused)
        if fused and opt.momentum:
            # torch's fused SGD makes its momentum buffers uninitialised on its first step, and leaves them so when
            # it skips that step (fp16's first steps overflow): the weights went NaN a step later. Zeros give the
            # same first update (momentum x 0 + gradient) and outlast a skip.
            for p in params:
                sgd.state[p]["momentum_buffer"] = torch.zeros_like(p)
        return sgd
    if opt.name in ("adam", "adamw"):
        adam = torch.optim.Adam if opt.name == "adam" else torch.optim.AdamW
        return adam(params, lr=lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay, fused=fused)
    # The paper's AmoebaNet optimizer: RMSProp with decay 0.9 and momentum 0.9.
    paper = opt.name == "amoebanet-rmsprop"
    return torch.optim.RMSprop(params, lr=lr, alpha=0.9 if paper else opt.decay, eps=opt.eps,
                               momentum=0.9 if paper else opt.momentum, weight_decay=opt.weight_decay)
