"""AmoebaNet-D(L, D) and AmoebaNet-B(N, F) as flat sequences of independently built layers."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gpipe_cli.errors import shown
from gpipe_cli.limits import AMOEBANET_STEPS, choices
from gpipe_cli.models.amoebanet.cells import COMBINATIONS, Combination, Preprocess, PrevMode, live_states, state_widths
from gpipe_cli.models.amoebanet.genotype import GENOTYPES, CellGenotype
from gpipe_cli.models.amoebanet.heads import AuxHead, Classifier, Stem, he_built
from gpipe_cli.models.base import LayerSpec, ModelSpec, is_fraction, is_int, require

# Layout (as in the TensorFlow TPU reference ImageNet model): a 32-filter stride-2 stem convolution,
# two reduction cells at D/4 and D/2 filters, then three stacks of L/3 normal cells at D, 2D and 4D
# filters with a reduction cell before the second and third stacks, then ReLU, global average
# pooling, dropout and the classifier. Each cell is six pipeline layers (its inputs' preprocessing and one
# per combination, see `cells`), as torchgpipe flattened AmoebaNet's cells, so that a cut can fall inside a
# cell: at 224 pixels whole cells differ too much in cost for any cut of them to balance the stages.
# AmoebaNet-D(L, D) has 6 (L + 4) + 2 layers: 44 for L = 3.
#
# Parameter counts (1000 classes) against the GPipe paper: D(18, 208) 81.14M (82M), D(18, 416)
# 317.5M (318M), D(18, 544) 540.2M (542M), D(36, 544) 1.0533B (1.05B), B(18, 512) 557.3M (557M).
# D(72, 512) has 1.8426B against the published "1.8B": that figure has two significant digits and
# 1.8426B rounds to it; the per-cell growth implied by the (36, 544) entry predicts the same 1.84B.
#
# Auxiliary head (optional, after the last cell of the second stack, as in the reference): its
# logits ride along the tuple to the classifier, which then returns (logits, aux_logits); the loss
# adds 0.4 times the auxiliary cross-entropy. With the head off the model returns plain logits.
# `image_size` is the nominal size: it sets the example batch and the auxiliary head's last kernel;
# any image of at least 32 pixels runs.

STEM_FILTERS = 32  # the reference's stem convolution width, independent of D
AUX_WEIGHT = 0.4  # the reference's weight of the auxiliary loss
MIN_IMAGE_SIZE = 32


@dataclass(frozen=True)
class CellPlan:
    """Everything needed to build one cell alone."""

    # Not compared: cells alike in all else build alike layers, which shape pricing then traces once.
    name: str = field(compare=False)
    reduction: bool
    in_channels: int
    prev_channels: int
    channels: int
    prev_mode: PrevMode
    out_channels: int
    spatial: int  # side of the cell's output map at the nominal image size


def plan_cells(genotype_name: str, layers: int, filters: int, image_size: int) -> list[CellPlan]:
    """The cells of AmoebaNet-<variant>(layers, filters), in order, with their widths and shapes."""
    genotype = GENOTYPES[genotype_name]
    plans: list[CellPlan] = []
    current = (STEM_FILTERS, (image_size - 3) // 2 + 1)
    previous: tuple[int, int] | None = None

    def add(name: str, cell: CellGenotype, channels: int, reduction: bool) -> None:
        nonlocal current, previous
        mode: PrevMode
        if previous is None:
            mode, prev_channels = "raw", current[0]
        else:
            prev_channels = previous[0]
            mode = ("reduce" if previous[1] != current[1]
                    else "project" if previous[0] != channels else "identity")
        spatial = -(-current[1] // 2) if reduction else current[1]
        out = channels * len(cell.concat)
        plans.append(CellPlan(name, reduction, current[0], prev_channels, channels, mode, out, spatial))
        previous, current = current, (out, spatial)

    add("stem_reduction_1", genotype.reduction, filters // 4, True)
    add("stem_reduction_2", genotype.reduction, filters // 2, True)
    per_stack = layers // 3
    for stack in range(3):
        channels = filters * 2 ** stack
        if stack:
            add(f"reduction_{stack}", genotype.reduction, channels, True)
        for i in range(per_stack):
            add(f"cell_{stack + 1}_{i + 1}", genotype.normal, channels, False)
    return plans


def _build_piece(genotype_name: str, plan: CellPlan, piece: int) -> nn.Module:
    """Layer `piece` of a cell: 0 its preprocessing, k its k-th combination."""
    genotype = GENOTYPES[genotype_name]
    cell = genotype.reduction if plan.reduction else genotype.normal
    widths = state_widths(cell, plan.in_channels, plan.channels, plan.reduction, plan.prev_mode)
    if piece == 0:
        return he_built(Preprocess, plan.in_channels, plan.prev_channels, plan.channels, plan.prev_mode,
                        live_states(cell, plan.prev_mode)[0])
    return he_built(Combination, cell, piece - 1, widths, plan.channels, plan.reduction, plan.prev_mode)


def amoebanet_loss(output: Any, targets: torch.Tensor, label_smoothing: float = 0.1,
                   aux_weight: float = AUX_WEIGHT) -> torch.Tensor:
    """Label-smoothed cross-entropy, plus the weighted auxiliary loss when the output carries one."""
    logits, *auxiliary = (output,) if isinstance(output, torch.Tensor) else output
    loss = F.cross_entropy(logits.float(), targets, label_smoothing=label_smoothing)
    for aux in auxiliary:
        loss = loss + aux_weight * F.cross_entropy(aux.float(), targets, label_smoothing=label_smoothing)
    return loss


def image_batch(n: int, device: torch.device | str, image_size: int,
                num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random images [n, 3, S, S] and class labels [n]."""
    return (torch.randn(n, 3, image_size, image_size, device=device),
            torch.randint(0, num_classes, (n,), device=device))


def build_amoebanet(variant: str = "d", layers: int = 18, filters: int = 256, num_classes: int = 1000,
                    image_size: int = 224, dropout: float = 0.5, aux_head: bool = False,
                    label_smoothing: float = 0.1) -> ModelSpec:
    """AmoebaNet-<variant>(layers, filters) for `num_classes` classes at `image_size` pixels."""
    require(variant in GENOTYPES, f"AmoebaNet variant must be {choices(sorted(GENOTYPES))} (got {shown(variant)})")
    for name, value in (("layers", layers), ("filters", filters)):
        step = AMOEBANET_STEPS[name]
        require(is_int(value) and value >= step and value % step == 0,
                f"AmoebaNet {name} must be a positive multiple of {step} (got {shown(value)})")
    for name, value, least in (("num_classes", num_classes, 2), ("image_size", image_size, MIN_IMAGE_SIZE)):
        require(is_int(value) and value >= least, f"{name} must be an integer >= {least} (got {shown(value)})")
    for name, share in (("dropout", dropout), ("label_smoothing", label_smoothing)):
        require(is_fraction(share), f"{name} must be a number in [0, 1) (got {shown(share)})")
    require(isinstance(aux_head, bool), f"aux_head must be true or false (got {shown(aux_head)})")

    plans = plan_cells(variant, layers, filters, image_size)
    specs = [LayerSpec("stem", functools.partial(he_built, Stem, STEM_FILTERS))]
    aux_after = f"cell_2_{layers // 3}"
    pieces = ["preprocess", *(f"combine_{k}" for k in range(1, COMBINATIONS + 1))]  # the last concatenates
    for plan in plans:
        specs += [LayerSpec(f"{plan.name}.{name}", functools.partial(_build_piece, variant, plan, piece))
                  for piece, name in enumerate(pieces)]
        if aux_head and plan.name == aux_after:
            specs.append(LayerSpec("aux_head", functools.partial(
                he_built, AuxHead, plan.out_channels, num_classes, plan.spatial)))
    specs.append(LayerSpec("classifier", functools.partial(Classifier, plans[-1].out_channels, num_classes, dropout)))

    return ModelSpec(
        name=f"amoebanet-{variant}-{layers}-{filters}", task="image", layers=specs,
        loss=functools.partial(amoebanet_loss, label_smoothing=label_smoothing),
        example_batch=functools.partial(image_batch, image_size=image_size, num_classes=num_classes),
        config=dict(kind="amoebanet", variant=variant, layers=layers, filters=filters, num_classes=num_classes,
                    image_size=image_size, dropout=dropout, aux_head=aux_head, label_smoothing=label_smoothing))
