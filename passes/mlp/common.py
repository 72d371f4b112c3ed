"""What the tiled_mlp pass's two stages (``dense.py``, ``experts.py``) share: the pass's name, the activations the
ops take, the shape of a matched MLP (``Gated``), reading ``v + 0`` as ``v``, the autocast-edge check, and the
helpers that erase a replaced region and name the module it came from."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch.fx as fx

from tilecompile import graph as fxgraph
from tilecompile.pass_api import expect
from tilecompile.passes import memory_plan

NAME = "tiled_mlp"
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu")


@dataclasses.dataclass(frozen=True)
class Gated:
    """``down(act(gate) * up)`` as a stage matched it: ``gate`` and ``up`` are projections whose ``matmul`` (a
    dense linear or an expert matmul) has ``node`` and ``input``; ``down`` is the down projection's matmul."""

    down: Any
    mul: fx.Node
    act: fxgraph.Activation
    gate: Any
    up: Any
    region: frozenset[fx.Node]  # every node the op replaces, ``down.node`` included

    @property
    def x(self) -> fx.Node:
        return self.gate.matmul.input

    @property
    def fused(self) -> bool:
        """Gate and up are two halves of one matmul's output (a fused ``gate_up`` weight)."""
        return self.gate.matmul.node is self.up.matmul.node


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


def matches(gm: fx.GraphModule, order: dict[fx.Node, int], match: Callable[[fx.Node], Any]):
    """``(node, match(node))`` for each node of the pass's ``order`` that ``match`` reads as an MLP (or a reason
    why not); over a copy of the node list, so the caller may rewrite as it goes."""
    for node in list(gm.graph.nodes):
        if node in order and (m := match(node)) is not None:
            yield node, m


def check_weights_are_inputs(m: Gated) -> str | None:
    for role, mm in (("gate", m.gate.matmul), ("up", m.up.matmul), ("down", m.down)):
        for kind in ("weight", "bias"):
            t = getattr(mm, kind, None)  # an expert matmul has no bias
            if t is not None and fxgraph.graph_input(t) is None:
                return f"{role} {kind} {t.name} is computed in the graph, not a graph input (parameter)"
    return None


def check_inside_region(m: Gated, what: str, inputs: str, weight_views: bool) -> str | None:
    """Every intermediate of the region is used only inside it; ``weight_views``: a view or cast of a graph input
    (``w.t()``) is not an intermediate, and may be shared."""
    for n in m.region - {m.down.node}:
        if n.op in ("placeholder", "get_attr"):
            return f"{n.name} reached through the {what} is an input other than {inputs}"
        if weight_views and fxgraph.graph_input(n) is not None:
            continue
        outside = fxgraph.users_outside(n, m.region)
        if outside:
            return f"intermediate {n.name} is also used outside the {what} (by {', '.join(u.name for u in outside)})"
    return None


def check_no_autocast_edge(m, order: dict[fx.Node, int], markers: list[int]) -> str | None:
    lo, hi = min(order[n] for n in m.region), order[m.down.node]
    if any(lo <= i <= hi for i in markers):
        return "an autocast block starts or ends inside the MLP (its linears would run in different dtypes)"
    return None


def region(end: fx.Node, leaves: set[fx.Node]) -> frozenset[fx.Node]:
    """The nodes between ``leaves`` (the MLP's inputs: x, weights, biases, offsets, masks) and ``end``."""
    found, todo = set(), [end]
    while todo:
        n = todo.pop()
        if n in found or n in leaves:
            continue
        found.add(n)
        if n.op not in ("placeholder", "get_attr"):
            todo += fxgraph.tensor_args(n)
    return frozenset(found)


def replace(graph: fx.Graph, m: Gated, new_nodes: list[fx.Node], out: fx.Node, end: fx.Node | None = None,
            also: frozenset[fx.Node] = frozenset()) -> None:  # fmt: skip
    """``out`` (the op's result) replaces the region's end, ``m.down.node`` (or ``end``, a node after it that the op
    took in, ``also`` the nodes between): the new nodes take the region's module stack and the end's stack trace,
    and the region's nodes go."""
    end, stack = end if end is not None else m.down.node, common_stack(m.region)
    for node in new_nodes:
        if stack:
            node.meta["nn_module_stack"] = dict(stack)
        if "stack_trace" in end.meta:
            node.meta["stack_trace"] = end.meta["stack_trace"]
    expect(out, fxgraph.example_value(end))
    end.replace_all_uses_with(out)
    erase_dead(graph, m.region | also)


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
