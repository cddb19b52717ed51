"""What every command knows of a model family, stated once per family: names, sizes, data and costs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from gpipe_cli.units import counted

Task = Literal["image", "translation", "lm"]


# Plain data without torch, so that flag and recipe checks can read it.
@dataclass(frozen=True)
class Family:
    """One model family's facts."""

    kind: str
    paper_preset: str           # the model of the paper's speed table (Table 2), measured when it fits
    paper_title: str            # that model as the paper names it
    paper_batch: int            # the paper's mini-batch in its memory table (Table 1)
    paper_table2: dict[int, dict[int, float]]  # Table 2's normalised throughput by M (rows) and K (columns)
    smaller: list[dict[str, Any]]  # the same architecture scaled down, largest first (each over the paper's)
    probe_depths: tuple[int, int]  # two depths whose figures price any deeper member linearly
    plan_probe_layers: int      # the depth plan times a member at (the rest is linear from it)
    depth_step: int             # layers added at a time to keep the architecture's shape
    cpu_efficiency: float       # share of a bare matrix product's rate its layers reach on a CPU rank
    shrink_flags: str           # the size flags that shrink it
    title: Callable[[dict[str, Any], bool], str]  # how it is named to the user (`full`: every size)
    short: Callable[[dict[str, Any]], str]         # a few words naming one member
    task: Callable[[Any], Task]                    # the data task of a recipe's model section
    data_sizes: tuple[str, ...] = ()  # the model-section keys the data must agree with
    least_examples: int = 1     # the smallest micro-batch it trains on (BatchNorm needs two)
    least_why: str = ""         # why, in words
    device_probe_depths: tuple[int, int] = (1, 2)  # the shallow members that fit a device's memory correction


def _amoebanet_title(params: dict[str, Any], full: bool) -> str:
    name = f"AmoebaNet-{str(params.get('variant', 'd')).upper()} ({params.get('layers')}, {params.get('filters')})"
    return name + f" at {params.get('image_size', 224)} px" + (
        f", {params.get('num_classes', 1000)} classes" if full else "")


def _transformer_title(params: dict[str, Any], full: bool) -> str:
    arch = params.get("arch", "decoder-only")
    name = (f"{'Transformer-L' if arch == 'decoder-only' else f'Transformer {arch}'} with "
            f"{counted(params.get('layers', 0), 'layer')}, d_model {params.get('d_model')}")
    return name + (f" (feed-forward {params.get('ff')}, {params.get('heads')} heads, sequence "
                   f"{params.get('max_len', 256)}, vocabulary {params.get('vocab_size')})" if full else "")


# GPipe (Huang et al., 2019) throughout: Table 1 (memory) and Table 2 (speed, TPUs, normalised to K=2, M=1).
AMOEBANET = Family(
    kind="amoebanet", paper_preset="amoebanet-d-18-256", paper_title="AmoebaNet-D (18, 256)", paper_batch=128,
    paper_table2={1: {2: 1.0, 4: 1.13, 8: 1.38}, 4: {2: 1.07, 4: 1.26, 8: 1.72}, 32: {2: 1.21, 4: 1.84, 8: 3.48}},
    smaller=[dict(layers=18, filters=128, image_size=224, num_classes=1000),
             dict(layers=12, filters=64, image_size=128, num_classes=1000),
             dict(layers=6, filters=32, image_size=64, num_classes=100),
             dict(layers=6, filters=16, image_size=32, num_classes=10),
             dict(layers=6, filters=8, image_size=32, num_classes=10)],
    # Each depth adds the same cells to each of three stacks; nine: the first two of a stack differ from the rest.
    probe_depths=(3, 6), plan_probe_layers=9, depth_step=3,
    # Separable convolutions: a twentieth of the matrix product's rate (2-core CPU, one thread per rank).
    cpu_efficiency=0.06,
    shrink_flags="--layers, --filters, --image-size",
    title=_amoebanet_title, short=lambda p: f"AmoebaNet-D ({p.get('layers')}, {p.get('filters')})",
    task=lambda model: "image", data_sizes=("image_size", "num_classes"), least_examples=2,
    least_why="AmoebaNet's batch normalisation needs two to train on", device_probe_depths=(6, 12))

TRANSFORMER = Family(
    kind="transformer", paper_preset="transformer-l-48", paper_title="Transformer-48", paper_batch=32,
    paper_table2={1: {2: 1.0, 4: 1.07, 8: 1.3}, 4: {2: 1.7, 4: 3.2, 8: 4.8}, 32: {2: 1.8, 4: 3.4, 8: 6.3}},
    smaller=[dict(layers=24, d_model=1024, ff=4096, heads=16, vocab_size=32000, max_len=256),
             dict(layers=12, d_model=768, ff=3072, heads=12, vocab_size=32000, max_len=256),
             dict(layers=8, d_model=512, ff=2048, heads=8, vocab_size=16000, max_len=128),
             dict(layers=8, d_model=256, ff=1024, heads=4, vocab_size=8000, max_len=64),
             dict(layers=8, d_model=128, ff=512, heads=4, vocab_size=2000, max_len=32),
             dict(layers=8, d_model=64, ff=256, heads=2, vocab_size=512, max_len=16),
             dict(layers=8, d_model=32, ff=128, heads=2, vocab_size=256, max_len=8)],
    # Layers are alike: one and two price any depth.
    probe_depths=(1, 2), plan_probe_layers=2, depth_step=1,
    # Large products at about the measured rate (0.5 at d_model 128 to 1.6 at 512; 2-core CPU).
    cpu_efficiency=0.8,
    shrink_flags="--layers, --d-model, --ff, --seq-len, --vocab-size",
    title=_transformer_title, short=lambda p: f"{p.get('layers')}-layer model",
    task=lambda model: "translation" if model.arch == "encoder-decoder" else "lm",
    data_sizes=("vocab_size", "max_len"))

FAMILIES: dict[str, Family] = {f.kind: f for f in (AMOEBANET, TRANSFORMER)}


def of(kind: str) -> Family:
    """The facts of family `kind`."""
    if kind not in FAMILIES:
        raise ValueError(f"unknown model kind {kind!r}; allowed kinds: {', '.join(FAMILIES)}")
    return FAMILIES[kind]
