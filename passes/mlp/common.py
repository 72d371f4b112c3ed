"""What the tiled_mlp pass's two stages (``dense.py``, ``experts.py``) share: the pass's name, the activations the
ops take, reading ``v + 0`` as ``v``, the autocast-edge check, and the helpers that erase a replaced region and
name the module it came from."""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from tilecompile import graph as fxgraph
from tilecompile.passes import memory_plan

NAME = "tiled_mlp"
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu")


def plus_zero(node: fx.Node) -> fx.Node:
    """``v + 0.0`` (or ``0 + v``, ``v - 0``) is ``v`` itself: Megatron-Core's GLU adds ``glu_linear_offset`` (0.0
    by default) to the up projection. Adding a literal zero changes no value but the sign of a zero, and its
    gradient is the identity, so the tiled op (which leaves it out) computes the same function."""
    name = fxgraph.op(node)
    if name not in ("add", "sub") or len(node.args) != 2 or node.kwargs:
        return node
    a, b = node.args
    zero = [t for t in (a, b) if isinstance(t, int | float) and not isinstance(t, bool) and t == 0]
    tensor = [t for t in (a, b) if isinstance(t, fx.Node)]
    if len(zero) != 1 or len(tensor) != 1 or (name == "sub" and b is not zero[0]):
        return node
    return tensor[0]


def check_no_autocast_edge(m, order: dict[fx.Node, int], markers: list[int]) -> str | None:
    lo, hi = min(order[n] for n in m.region), order[m.down.node]
    if any(lo <= i <= hi for i in markers):
        return "an autocast block starts or ends inside the MLP (its linears would run in different dtypes)"
    return None


def erase_dead(graph: fx.Graph, nodes: frozenset[fx.Node]) -> None:
    for node in reversed(list(graph.nodes)):  # users before producers
        if node in nodes and not node.users:
            graph.erase_node(node)


def common_stack(nodes: frozenset[fx.Node]) -> list[tuple[str, object]]:
    stacks = [list(n.meta["nn_module_stack"].items()) for n in nodes if n.meta.get("nn_module_stack")]
    if not stacks:
        return []
    common = stacks[0]
    for other in stacks[1:]:
        k = 0
        while k < min(len(common), len(other)) and common[k][0] == other[k][0]:
            k += 1
        common = common[:k]
    return common


def size(s):
    h = fxgraph.hint(s)
    return s if h is None else h


def path(nodes) -> str:
    return fxgraph.common_module_path(n for n in nodes if isinstance(n, fx.Node))


def check_kept(m: Any) -> str | None:
    """A layer the memory plan keeps whole (passes/memory_plan.py) keeps its MLP whole too, dense or experts
    (``m.down.node`` marked ``KEPT``): memory allows it."""
    kept = m.down.node.meta.get(memory_plan.KEPT)
    if kept is not None:
        return f"the memory plan keeps {kept} whole (memory_budget allows): tiling would only cost time"
    return None
