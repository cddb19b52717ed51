"""A backward in two halves: B, the gradient of the stage's input, now; W, the weight gradients, later."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


@dataclass
class Pending:
    """What W needs: the nodes to restart from and the gradients that arrived there during B."""

    nodes: list[tuple[Node, tuple[torch.Tensor | None, ...], list[GradientEdge]]] = field(default_factory=list)
    whole: list[tuple[GradientEdge, torch.Tensor]] = field(default_factory=list)  # restart towards all params


def _towards_inputs(roots: Sequence[Node], inputs: Sequence[torch.Tensor]) -> set[Node]:
    """The nodes from which some input can be reached (iteratively: graphs are deep)."""
    wanted = {id(t) for t in inputs}
    reaches: dict[Node, bool] = {}
    stack: list[tuple[Node, bool]] = [(r, False) for r in roots]
    while stack:
        node, expanded = stack.pop()
        if node in reaches and not expanded:
            continue
        children = [c for c, _ in node.next_functions if c is not None]
        if not expanded:
            variable = getattr(node, "variable", None)  # AccumulateGrad nodes hold their leaf tensor
            if variable is not None:
                reaches[node] = id(variable) in wanted
                continue
            reaches.setdefault(node, False)
            stack.append((node, True))
            stack.extend((c, False) for c in children if c not in reaches)
        else:
            reaches[node] = any(reaches.get(c, False) for c in children)
    return {n for n, ok in reaches.items() if ok}


def _parents(roots: Sequence[Node]) -> dict[Node, int]:
    """How many edges point at each node of the graph."""
    count: Counter[Node] = Counter()
    seen: set[Node] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            children = [c for c, _ in node.next_functions if c is not None]
            count.update(children)
            stack.extend(children)
    return count


def backward_input(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                   inputs: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor | None], Pending]:
    """The gradients of `inputs` (B), and what `backward_weight` needs to finish the parameters (W)."""
    pending = Pending()
    filled = [g if g is not None else torch.ones_like(o) for o, g in zip(outputs, grads)]
    whole = [(get_gradient_edge(o), g) for o, g in zip(outputs, filled)]
    if not outputs:
        return [None] * len(inputs), pending
    if not inputs:
        pending.whole = whole
        return [], pending
    roots = [o.grad_fn for o in outputs if o.grad_fn is not None]
    path = _towards_inputs(roots, inputs)
    parents = _parents(roots)
    off = {n: [c for c, _ in n.next_functions if c is not None and c not in path] for n in path}
    # B records the gradient arriving at each boundary node (on the input's path, with an edge off it); W
    # restarts there along the off-path edges, so nothing is computed twice. An off-path node with two users
    # (a weight used twice) would be counted twice from two boundaries: W then runs one whole backward instead.
    boundary = [n for n, children in off.items() if children]
    shared = any(parents.get(c, 0) > 1 for n in boundary for c in off[n])
    roots_off_path = any(o.grad_fn is None or o.grad_fn not in path for o in outputs)
    captured: dict[Node, tuple[torch.Tensor | None, ...]] = {}

    def keep(node: Node) -> Any:
        def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
            captured[node] = grad_outputs
        return hook

    handles = [] if shared or roots_off_path else [n.register_prehook(keep(n)) for n in boundary]
    try:
        found = torch.autograd.grad(list(outputs), list(inputs), filled, retain_graph=True, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    if shared or roots_off_path:
        pending.whole = whole
    else:
        pending.nodes = [(node, grad_outputs, [GradientEdge(c, nr) for c, nr in node.next_functions
                                               if c is not None and c not in path])
                         for node, grad_outputs in captured.items()]
    return list(found), pending


def backward_weight(pending: Pending, params: Sequence[torch.Tensor]) -> None:
    """Accumulate the parameters' gradients from what B recorded (W); frees the graph."""
    if not params:
        return
    if pending.whole:
        found = torch.autograd.grad([e for e, _ in pending.whole], list(params), [g for _, g in pending.whole],
                                    allow_unused=True)
        _accumulate(params, found)
        return
    edges: list[GradientEdge] = []
    edge_grads: list[torch.Tensor] = []
    for node, grad_outputs, slots in pending.nodes:
        live = [(GradientEdge(node, i), g) for i, g in enumerate(grad_outputs) if g is not None]
        if not slots or not live:
            continue
        # Only this node's off-path slots: its input-path slot is pruned, as nothing asked for it.
        got = torch.autograd.grad([e for e, _ in live], slots, [g for _, g in live], retain_graph=True,
                                  allow_unused=True)
        edges += [e for e, g in zip(slots, got) if g is not None]
        edge_grads += [g for g in got if g is not None]
    if edges:
        found = torch.autograd.grad(edges, list(params), edge_grads, allow_unused=True)
        _accumulate(params, found)


def _accumulate(params: Sequence[torch.Tensor], found: Sequence[torch.Tensor | None]) -> None:
    for param, grad in zip(params, found):
        if grad is not None:
            param.grad = grad if param.grad is None else param.grad.add_(grad)
