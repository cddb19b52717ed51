"""Parameters held by several stages (a tied embedding and softmax): one tensor per stage, gradients summed."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from gpipe_cli.pipeline.grads import SharedCopy
from gpipe_cli.pipeline.topology import Topology


def _stage_of(index: int, ranges: Sequence[range]) -> int:
    """The chunk holding layer `index`."""
    for s, r in enumerate(ranges):
        if index in r:
            return s
    raise ValueError(f"tied parameter names layer {index}, but the model has {ranges[-1].stop} layers")


def tie_within(module: nn.Module, names: Sequence[str]) -> None:
    """Make the named parameters of `module` the first one's tensor."""
    if not names:
        return
    first = module.get_parameter(names[0])
    for name in names[1:]:
        path, _, attr = name.rpartition(".")
        if module.get_parameter(name).shape != first.shape:
            raise ValueError(f"tied parameters {names[0]} and {name} have different shapes")
        setattr(module.get_submodule(path), attr, first)


# Names are "<global layer index>.<parameter>"; `ranges` are each chunk's layers, placed on stages as the topology's
# layout says. Every rank must call this with the same groups.
def tie_parameters(module: nn.Module, topology: Topology, ranges: Sequence[range],
                   tied: Sequence[Sequence[str]]) -> list[SharedCopy]:
    """Make tied parameters one tensor within this stage; returns the local ones whose copies live on other stages."""
    layout = topology.layout
    plans = []
    for group in tied:
        stage = {name: layout.owner(_stage_of(int(name.split(".", 1)[0]), ranges)) for name in group}
        owners = sorted(set(stage.values()))
        local = [name for name in group if stage[name] == layout.stage]
        tie_within(module, local)
        plans.append((owners, local))
    # Every rank opens every group, in the same order, even those it is not part of.
    fabric = topology.fabric
    if fabric is not None:
        fabric.open([], [tuple(layout.rank_of(s, r) for s in owners) for owners, _ in plans
                         for r in range(layout.replicas)])
    shared = []
    for owners, local in plans:
        if not local or len(owners) < 2:
            continue
        ranks = tuple(layout.rank_of(s) for s in owners)
        param = module.get_parameter(local[0])
        if fabric is not None:
            with torch.no_grad():  # start every copy from the first holder's values
                fabric.broadcast(param.data, ranks[0], ranks)
        shared.append(SharedCopy(param, ranks, counts_in_norm=layout.stage == owners[0]))
    return shared
