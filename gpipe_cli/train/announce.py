"""The first lines of `gpipe train`: what runs, and on what, before anything slow starts.

Nothing here imports torch at module level. On a terminal the first line shows as soon as the recipe
is read, as a transient status while the plan is checked (an error then stands alone, as one line);
it stays once the checks pass.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import TextIO

from gpipe_cli.console import say
from gpipe_cli.models import families
from gpipe_cli.recipe.schema import Recipe


def describe_model(recipe: Recipe) -> str:
    """The recipe's model in a few words."""
    m = recipe.model
    return m.preset or families.of(m.kind).title(m.model_dump(), False)


def first_line(recipe: Recipe) -> str:
    """What is starting: recipe, model, K, M, D and the number of ranks."""
    p, t = recipe.pipeline, recipe.train
    length = " and ".join(_count(n, unit) for n, unit in ((t.steps, "step"), (t.epochs, "epoch")) if n)
    return (f"gpipe train {recipe.name}: {describe_model(recipe)}, K={_count(p.partitions, 'stage')} x "
            f"D={p.data_parallel} = {_count(p.partitions * p.data_parallel, 'rank')}, "
            f"M={_count(p.microbatches, 'micro-batch', 'micro-batches')}, batch {recipe.data.batch_size}, {length}, "
            f"{t.precision}")


def _count(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"


@contextlib.contextmanager
def checking(recipe: Recipe, terminal: bool) -> Iterator[None]:
    """While the block runs, the first line as a transient status on a terminal (nothing elsewhere)."""
    if not terminal:
        yield
        return
    from rich.console import Console

    with Console().status(f"{first_line(recipe)}: checking the plan", spinner="dots"):
        yield


def oversubscription(ranks: int, threads: int, cores: int, gpus: int) -> str | None:
    """A warning when this node's ranks outnumber its GPUs (gpus > 0) or their threads its cores."""
    if gpus > 0:
        if ranks <= gpus:
            return None
        return (f"warning: {ranks} ranks share {gpus} GPU{'s' if gpus != 1 else ''} on this node (oversubscribed): "
                f"they take turns on the devices and exchange tensors through host memory, so steps are slower "
                f"and the measured bubble larger than with a GPU per rank")
    if ranks * threads <= cores:
        return None
    return (f"warning: {ranks} ranks x {threads} thread{'s' if threads != 1 else ''} on {cores} CPU "
            f"core{'s' if cores != 1 else ''} (oversubscribed): the ranks take turns on the cores, so steps are "
            f"slower and the measured bubble larger than with a core per rank")


def local_ranks(world: int, nnodes: str) -> int:
    """Ranks this node runs: the job's share per node, or torchrun's count when already under it."""
    if "LOCAL_WORLD_SIZE" in os.environ:
        return int(os.environ["LOCAL_WORLD_SIZE"])
    try:
        nodes = int(nnodes.partition(":")[2] or nnodes.partition(":")[0])
    except ValueError:  # the launcher reports a bad --nnodes
        nodes = 1
    return max(world // max(nodes, 1), 1)


def announce(recipe: Recipe, nnodes: str, threads: int | None, stream: TextIO, said: bool = False) -> None:
    """Print the first line (unless `said`), then (after looking for GPUs) any oversubscription warning."""
    if not said:
        say(first_line(recipe), stream)
    ranks = local_ranks(recipe.pipeline.partitions * recipe.pipeline.data_parallel, nnodes)
    import torch  # only now: the first line is already on the screen

    from gpipe_cli.sizing import usable_cores

    gpus = torch.cuda.device_count() if recipe.train.device != "cpu" and torch.cuda.is_available() else 0
    cores = usable_cores()
    warning = oversubscription(ranks, threads or max(cores // ranks, 1), cores, gpus)
    if warning:
        say(warning, stream)
