"""What each rank runs when the model-zoo tests train real models through the pipeline."""

from __future__ import annotations

from typing import Any

import torch

from gpipe_cli.data import build_data
from gpipe_cli.models.registry import build_model
from gpipe_cli.pipeline import topology
from gpipe_cli.pipeline.config import PipelineConfig
from gpipe_cli.pipeline.engine import Pipeline
from gpipe_cli.pipeline.layers import build_layers
from gpipe_cli.pipeline.partition import balance_by_cost, stage_layers
from gpipe_cli.recipe.schema import Data

SEED = 7
FAMILIES: dict[str, dict[str, Any]] = {
    # 64 px: at 32 px the last cells are 1x1 and BatchNorm over a micro-batch turns rounding into noise.
    "amoebanet": dict(kind="amoebanet", layers=3, filters=8, image_size=64, num_classes=4, dropout=0.2),
    "transformer": dict(kind="transformer", layers=2, d_model=32, ff=64, heads=4, vocab_size=64, max_len=16,
                        dropout=0.1, tie_embeddings=True),
    "lm": dict(kind="transformer", arch="decoder-only", layers=3, d_model=32, ff=64, heads=4, vocab_size=64,
               max_len=16, dropout=0.1, tie_embeddings=True),
}

# Adam's learning rate on the generated tasks. AmoebaNet-D's at 3e-3 stays near chance for some 25 steps, and where
# 40 steps end depends on the CPU's convolution kernels (0.84 of its first losses on an AVX2 machine); at 1e-2, 0.44.
LEARNING_RATE = {"amoebanet": 1e-2}


def spec_of(family: str) -> Any:
    params = dict(FAMILIES[family])
    return build_model(params.pop("kind"), **params)


def random_batch(family: str, step: int, size: int = 12) -> tuple[Any, torch.Tensor]:
    """A fixed random batch per step (padding included for text)."""
    g = torch.Generator().manual_seed(100 + step)
    if family == "amoebanet":
        return torch.randn(size, 3, 64, 64, generator=g), torch.randint(0, 4, (size,), generator=g)
    ids = torch.randint(4, 64, (size, 10), generator=g)
    ids[: size // 3, 7:] = 0  # some padded examples
    if family == "lm":
        return ids[:, :-1], ids[:, 1:]
    return (ids, ids[:, :-1]), ids[:, 1:]


def train(family: str, stages: int, steps: int, microbatches: int = 4, learnable: bool = False,
          schedule: str = "gpipe", virtual: int = 1, double: bool = False) -> dict:
    """Train `steps` steps on this rank's stage (of V chunks); return the stage's parameters and the losses."""
    # `double`: weights and data in float64, where the order of floating-point sums no longer shows.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64 if double else torch.float32)
    try:
        return _train(family, stages, steps, microbatches, learnable, schedule, virtual)
    finally:
        torch.set_default_dtype(previous)  # the reference runs in the test's own process


def _train(family: str, stages: int, steps: int, microbatches: int, learnable: bool, schedule: str,
           virtual: int) -> dict:
    torch.set_num_threads(1)
    spec = spec_of(family)
    topo = topology.init(stages)
    balance = balance_by_cost([1.0] * len(spec.layers), stages * virtual)
    layers = build_layers(spec.factories(), stage_layers(balance, stages, topo.layout.stage), SEED)
    config = PipelineConfig(topo.layout.stages, microbatches, virtual=virtual, schedule=schedule,
                            balance=tuple(balance))
    pipe = Pipeline(layers, topo, config, spec.loss, units=spec.units, tied=spec.tied)
    params = pipe.parameters()
    opt = (torch.optim.Adam(params, lr=LEARNING_RATE.get(family, 3e-3)) if learnable
           else torch.optim.SGD(params, lr=0.05, momentum=0.9))
    batches = _learnable_batches(family, steps) if learnable else [random_batch(family, s) for s in range(steps)]
    losses = []
    for step, (x, y) in enumerate(batches):
        result = pipe.train_step(x, y, microbatches=microbatches, step=step)
        opt.step()
        pipe.zero_grad()
        losses.append(result.loss)
    pipe.close()
    return {"state": {k: v.clone() for k, v in pipe.state_dict().items()}, "losses": losses,
            "stage": topo.layout.stage}


def _learnable_batches(family: str, steps: int) -> list[tuple[Any, torch.Tensor]]:
    """Mini-batches of the data layer's generated tasks (class patterns, number-word translation)."""
    task = {"amoebanet": "image", "transformer": "translation", "lm": "lm"}[family]
    sizes = FAMILIES[family]
    data = build_data(Data(source="synthetic", batch_size=16, synthetic_size=256, seq_len=15), task, seed=SEED,
                      image_size=sizes.get("image_size", 32), num_classes=sizes.get("num_classes", 4),
                      vocab_size=sizes.get("vocab_size", 64), max_len=sizes.get("max_len", 16))
    out: list[tuple[Any, torch.Tensor]] = []
    epoch = 0
    while len(out) < steps:
        out += [(b.inputs, b.targets) for b in data.train_batches(epoch=epoch)]
        epoch += 1
    return out[:steps]
