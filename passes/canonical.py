"""Rewrites spellings that hide a value into the value itself, before every other pass reads the graph.

    x + 0  ->  x     x - 0  ->  x     x * 1  ->  x     x / 1  ->  x        (0 + x, 1 * x too; 0 and 1 literals)
    torch.min(a, b) / torch.max(a, b) of two tensors  ->  torch.minimum(a, b) / torch.maximum(a, b)
    an autograd.Function that computes a linear (or the identity) with its exact gradient  ->  F.linear (or its input)

The passes match meanings, but a few spellings are not meanings at all: Megatron-Core's GLU computes
``act(gate) * (up + config.glu_linear_offset)`` with the offset 0.0 by default, TRL's GRPO loss clips with
``torch.min(a, b)``, and Megatron-Core's Column/RowParallelLinear and its tensor-parallel region copies are
``torch.autograd.Function`` s (``autograd_function_apply`` in the graph) whose forward, at tensor-parallel world size 1,
is ``x @ w.t()`` or ``x`` itself. After this pass the MLP pass sees the up projection, the loss-aware lm_head sees
``minimum``, and every pass sees the linears (``passes/lm_head/library_kernels.py`` reads the functions and proves each
backward is its forward's gradient; any other is left alone, and one met where a linear would be gets a reason).

Checks for the literal identities, each keeping the node when it says no: the result has the operand's dtype
(``int + 0.0`` is a float), shape, strides and requires_grad (``x + 0`` under ``no_grad`` detaches); neither the
result nor the operand (nor a view of either) is written in place anywhere in the graph or handed to a higher-order
op (whose body may write into it), and the result is not returned from the graph: the operand itself takes the place
of a fresh tensor. ``x + 0.0`` turns ``-0.0`` into ``0.0``; nothing else changes, and its gradient is the identity.
``torch.div`` with a ``rounding_mode`` is left alone.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from tilecompile import graph as fxgraph
from tilecompile.pass_api import PassContext, PassResult
from tilecompile.passes.lm_head import library_kernels

NAME = "canonical"

# op -> (the literal that makes it the identity, whether the literal may stand first)
_NEUTRAL = {"add": (0, True), "sub": (0, False), "mul": (1, True), "div": (1, False)}
_MIN_MAX = {"min": torch.minimum, "max": torch.maximum}
# ops whose result may share storage with their first argument (a write into one shows in the other)
_ALIASING = frozenset({
    *fxgraph.VIEW_OPS, "getitem", "expand", "expand_as", "narrow", "select", "detach", "split", "chunk", "unbind",
    "tensor_split", "split_with_sizes", "diagonal", "movedim", "swapaxes", "swapdims", "unfold", "as_strided",
    "view_as", "reshape_as", "alias", "real", "imag", "view_as_real", "view_as_complex", "T", "mT", "H", "mH",
})  # fmt: skip


def _literal(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def neutral_operand(node: fx.Node) -> fx.Node | None:
    """The tensor ``node`` adds 0 to, subtracts 0 from, multiplies or divides by 1, or None."""
    name = fxgraph.op(node)
    if name not in _NEUTRAL or len(node.args) != 2 or node.kwargs:
        return None
    neutral, may_lead = _NEUTRAL[name]
    a, b = node.args
    if isinstance(a, fx.Node) and _literal(b) and b == neutral:
        return a
    if may_lead and isinstance(b, fx.Node) and _literal(a) and a == neutral:
        return b
    return None


def _same_value(node: fx.Node, x: fx.Node) -> bool:
    """``node`` would be ``x`` itself: same dtype, device, shape, strides and requires_grad."""
    v, u = fxgraph.example_value(node), fxgraph.example_value(x)
    if not isinstance(v, torch.Tensor) or not isinstance(u, torch.Tensor):
        return False
    if (v.dtype, v.device, v.requires_grad) != (u.dtype, u.device, u.requires_grad):
        return False
    try:
        return fxgraph.same_shape(tuple(v.shape), tuple(u.shape)) and fxgraph.same_shape(
            tuple(v.stride()), tuple(u.stride())
        )
    except Exception:  # noqa: BLE001 - a sparse or opaque tensor has no strides: keep the node
        return False


def _alias_root(node: Any) -> Any:
    """The tensor ``node`` is a view of (itself when it is not a view)."""
    for _ in range(64):
        if not isinstance(node, fx.Node) or not node.args or not isinstance(node.args[0], fx.Node):
            return node
        is_attr = node.op == "call_function" and node.target is getattr
        if not (is_attr or fxgraph.op(node) in _ALIASING or fxgraph.cast_target(node) is not None):
            return node  # a cast may return its input itself (``.float()`` of a float tensor): an alias too
        node = node.args[0]
    return node


def _written_roots(graph: fx.Graph) -> set[fx.Node]:
    """Every tensor some node of ``graph`` writes into (through views), as its alias root. A higher-order op's
    operands count as written: its body may write into them (Megatron-Core's cross-entropy subtracts the row max from
    its logits in place)."""
    roots = set()
    for node in graph.nodes:
        targets = list(fxgraph.mutated_args(node))
        if isinstance(node.target, torch._ops.HigherOrderOperator):
            targets += node.all_input_nodes
        for target in targets:
            roots.add(_alias_root(target))
    return roots


def _returned(node: fx.Node) -> bool:
    """``node`` (or a view of it) is an output of the graph."""
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        for user in n.users:
            if user.op == "output":
                return True
            if _alias_root(user) is n:
                todo.append(user)
    return False


def as_min_max(node: fx.Node) -> Any:
    """``torch.minimum`` / ``torch.maximum`` when ``node`` is ``torch.min(a, b)`` / ``torch.max(a, b)`` (or the method
    ``a.min(b)``) of two tensors; None for the reductions (``torch.min(a)``, ``torch.min(a, dim)``)."""
    name = fxgraph.op(node)
    if name not in _MIN_MAX or set(node.kwargs) - {"other"}:
        return None
    other = fxgraph.arg(node, 1, "other")
    if len(node.args) + len(node.kwargs) != 2 or not isinstance(fxgraph.arg(node, 0), fx.Node):
        return None
    if not isinstance(other, fx.Node) or not isinstance(fxgraph.example_value(other), torch.Tensor):
        return None
    return _MIN_MAX[name]


def run(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    result = PassResult()
    graph = gm.graph
    changed = library_kernels.expand_functions(gm, result)
    written = _written_roots(graph)
    for node in list(graph.nodes):
        fn = as_min_max(node)
        if fn is not None:
            with graph.inserting_before(node):
                new = graph.call_function(fn, (fxgraph.arg(node, 0), fxgraph.arg(node, 1, "other")))
            new.meta = dict(node.meta)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            changed = True
            continue
        x = neutral_operand(node)
        if x is None or not _same_value(node, x) or _returned(node):
            continue
        if _alias_root(x) in written or node in written:
            continue
        node.replace_all_uses_with(x)
        graph.erase_node(node)
        changed = True
    if changed:
        gm.recompile()
    return result
