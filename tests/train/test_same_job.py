"""Every node of a job must be started alike: the same recipe and --set values, and --resume on all or none."""

from types import SimpleNamespace

import pytest

from gpipe_cli.errors import UserError
from gpipe_cli.train.worker import check_same_recipe

RECIPE = {"model": {"name": "transformer", "layers": 2}, "data": {"path": "/data/a"}}


def ranks(*jobs: tuple[dict, bool]) -> list[SimpleNamespace]:
    """Stand-in topologies of one job whose ranks bring `jobs`: rank 0 gathers them, and shares what it decides."""
    said: list[object] = []

    def share(value: object) -> object:  # rank 0's value, which it brings first
        if not said:
            said.append(value)
        return said[0]

    return [SimpleNamespace(fabric=SimpleNamespace(gather_objects=lambda mine, r=r: list(jobs) if r == 0 else None),
                            share=share) for r in range(len(jobs))]


def verdicts(*jobs: tuple[dict, bool]) -> list[str | None]:
    out: list[str | None] = []
    for topo, (recipe, resuming) in zip(ranks(*jobs), jobs):
        try:
            check_same_recipe(recipe, topo, resuming)
            out.append(None)
        except UserError as exc:
            out.append(str(exc))
    return out


def test_nodes_started_alike_train():
    assert verdicts((RECIPE, True), (RECIPE, True)) == [None, None]
    assert verdicts((RECIPE, False), ({**RECIPE, "data": {"path": "/mnt/a"}}, False)) == [None, None]  # per node


@pytest.mark.parametrize("first", [True, False])
def test_a_node_resuming_beside_one_starting_afresh_is_refused_on_every_rank(first):
    # Rank 0 waited, silent, in its checkpoint's reading for peers that never read one.
    said = verdicts((RECIPE, first), (RECIPE, not first))
    own, other = ("resumes", "starts a new run") if first else ("starts a new run", "resumes")
    assert said == [f"rank 0 {own} and rank 1 {other}: start every node of the job with --resume, or none"] * 2


def test_nodes_given_other_recipes_are_refused_on_every_rank():
    other = {**RECIPE, "model": {"name": "transformer", "layers": 4}}
    said = verdicts((RECIPE, False), (other, False))
    assert said[0] == said[1] and said[0].startswith(
        "the nodes were given different recipes: model.layers is 4 on rank 1 and 2 on rank 0; start every node")
