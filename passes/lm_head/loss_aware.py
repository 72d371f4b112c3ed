"""Finds the scalar loss that an lm_head region's per-token outputs reduce to: the fused op's loss-aware mode.

When the per-token outputs of a region (log-prob, entropy, unreduced CE) reach one scalar S only through per-token
math (elementwise ops with tensors that do not depend on the logits) and then linear reductions (sums, means,
masked means, scaling by logits-free tensors), ∂S/∂logp_i and ∂S/∂H_i depend on token i's values alone. The fused
op can then form each token's gradient as soon as its row of logits is known and compute dh and dW in the forward:
3 GEMMs instead of 4 (``tilecompile::fused_linear_logprob_loss``). The op gets that gradient as a traced function
F(logp, entropy, *externals) -> S, kept under a key (a custom op cannot take a callable, and a closed form of the
loss would limit it to the losses someone listed): F is the graph's own loss math, so any loss of this shape works.

Find: a walk forward from the region's escaping values gives each node it understands an abstract value,
``Tok`` (per-token: every element depends on one token's log-prob / entropy; ``path`` names the views taken since
the region, so that two per-token values are combined only element by element) or ``Lin`` (a linear function of
per-token values, with logits-free coefficients). ``grad`` says whether the value carries a gradient (comparisons
and integer casts do not). Detached values and values computed under no_grad are sinks: they take no gradient.
Check: exactly one grad-carrying value is used outside the algebra (that is S), it is a scalar, and what F reads
besides the log-prob and entropy does not depend on any lm_head's logits. Each check returns a reason.
(The rewrite, in ``passes/lm_head/__init__.py``, extracts F from the rewritten graph and adds the op's zero-valued
anchor to S: S's gradient then flows into the op's saved dh and dW.)
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.fx as fx

from tilecompile import graph as fxgraph

_OPERATORS = {
    operator.gt: "gt", operator.lt: "lt", operator.ge: "ge", operator.le: "le", operator.eq: "eq", operator.ne: "ne",
    operator.pow: "pow", operator.abs: "abs", operator.and_: "logical_and", operator.or_: "logical_or",
    operator.invert: "logical_not", operator.floordiv: "floor_divide",
}  # fmt: skip
_METHOD_NAMES = {
    "__gt__": "gt", "__lt__": "lt", "__ge__": "ge", "__le__": "le", "__eq__": "eq", "__ne__": "ne",
    "__pow__": "pow", "__rsub__": "rsub", "__radd__": "add", "__rmul__": "mul", "__rtruediv__": "rdiv",
    "__abs__": "abs", "__and__": "logical_and", "__or__": "logical_or", "__invert__": "logical_not",
    "clip": "clamp", "clip_": None, "greater": "gt", "less": "lt", "greater_equal": "ge", "less_equal": "le",
    "not_equal": "ne", "true_divide": "div", "subtract": "sub", "multiply": "mul", "negative": "neg",
}  # fmt: skip

# elementwise ops that carry a gradient (per-token math: any of them, any nesting)
_SMOOTH = frozenset({
    "add", "sub", "rsub", "mul", "div", "rdiv", "neg", "pow", "exp", "exp2", "expm1", "log", "log2", "log10", "log1p",
    "sqrt", "rsqrt", "reciprocal", "square", "abs", "sigmoid", "tanh", "relu", "softplus", "clamp", "clamp_min",
    "clamp_max", "maximum", "minimum", "fmax", "fmin", "where", "masked_fill", "nan_to_num", "logsigmoid",
    "float_power",
})  # fmt: skip
# elementwise ops whose result carries no gradient
_FLAT = frozenset({
    "gt", "lt", "ge", "le", "eq", "ne", "logical_and", "logical_or", "logical_not", "logical_xor", "sign", "isnan",
    "isinf", "isfinite", "floor", "ceil", "round", "trunc", "floor_divide", "zeros_like", "ones_like",
})  # fmt: skip
_REDUCTIONS = frozenset({"sum", "mean"})
_VIEWS = frozenset({*fxgraph.VIEW_OPS, "getitem", "expand", "expand_as", "clone", "view_as", "reshape_as", "squeeze",
                    "unsqueeze"})  # fmt: skip
_CASTS = frozenset({"to", "float", "double", "half", "bfloat16", "type", "type_as"})


@dataclasses.dataclass(frozen=True)
class Tok:
    """Per-token: element k depends on one token's log-prob / entropy (which one: ``path`` from the region)."""

    path: tuple
    grad: bool


@dataclasses.dataclass(frozen=True)
class Lin:
    """Linear in per-token values, with coefficients that do not depend on the logits."""

    grad: bool


@dataclasses.dataclass
class LossPlan:
    """S (``loss``), the loss math from the region's escaping values to S, and what else that math reads."""

    loss: fx.Node
    nodes: set[fx.Node]
    externals: list[fx.Node]


def name_of(node: fx.Node) -> str | None:
    if node.op == "call_function" and node.target in _OPERATORS:
        return _OPERATORS[node.target]
    if node.op == "call_method" and node.target in _METHOD_NAMES:
        return _METHOD_NAMES[node.target]
    name = fxgraph.op(node)
    if name is not None and name.endswith("_") and not name.startswith("_"):
        return None  # in-place variants mutate what others may read: not per-token math we can move
    return name


def _is_sink(node: fx.Node, modes: dict[fx.Node, bool | None]) -> bool:
    """A use that takes no gradient: a detach, a node under no_grad, or one that yields no floating tensor."""
    if modes.get(node) is False or name_of(node) == "detach":
        return True
    value = fxgraph.example_value(node)
    if isinstance(value, torch.Tensor):
        return not value.is_floating_point()
    return False


def _classify(node: fx.Node, vals: dict[fx.Node, Any]) -> Any:
    """The abstract value of ``node`` given its classified inputs, or None (not per-token / linear math)."""
    name = name_of(node)
    ins = [a for a in _operands(node) if a in vals]  # once per occurrence: x * x has two (not linear in x)
    if not ins or name is None:
        return None
    grad = any(vals[a].grad for a in ins)
    first = node.args[0] if node.args else None
    if name in _VIEWS or name in _CASTS:
        if ins != [first] or name in ("type_as", "expand_as", "view_as", "reshape_as") and len(ins) != 1:
            return None
        v = vals[first]
        out_dtype = fxgraph.dtype(node)
        keeps_grad = v.grad and out_dtype is not None and out_dtype.is_floating_point
        if isinstance(v, Lin):
            return Lin(keeps_grad)
        step = (name, *(_hashable(a) for a in node.args[1:]))
        step += tuple(sorted((k, repr(x)) for k, x in node.kwargs.items()))
        return Tok(v.path if name in _CASTS or name in ("contiguous", "clone") else (*v.path, step), keeps_grad)
    if name in _REDUCTIONS:
        if ins != [first]:
            return None
        return Lin(vals[first].grad)
    if name not in _SMOOTH and name not in _FLAT:
        return None
    kinds = {type(vals[a]) for a in ins}
    if kinds == {Tok}:
        paths = {vals[a].path for a in ins}
        shape = fxgraph.shape(node)
        if len(paths) != 1 or any(not fxgraph.same_shape(fxgraph.shape(a), shape) for a in ins):
            return None  # two tokens' values in one element, or a per-token value broadcast over more elements
        return Tok(paths.pop(), grad and name in _SMOOTH)
    if kinds == {Lin} and name in _SMOOTH and _linear(node, name, ins):
        return Lin(grad)
    return None


def _operands(node: fx.Node) -> list[fx.Node]:
    """The fx.Node operands of ``node`` (args, then kwargs, nested lists included), repeats kept."""
    out: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), out.append)
    return out


def _hashable(a: Any) -> Any:
    """A hashable stand-in for a view's argument (slices are unhashable before Python 3.12)."""
    if isinstance(a, fx.Node):
        return ("node", a)
    if isinstance(a, slice):
        return ("slice", _hashable(a.start), _hashable(a.stop), _hashable(a.step))
    if isinstance(a, tuple | list):
        return (type(a).__name__, *map(_hashable, a))
    try:
        hash(a)
    except TypeError:
        return ("repr", repr(a))
    return a


def _linear(node: fx.Node, name: str, ins: list[fx.Node]) -> bool:
    """``node`` is linear in its classified inputs (``ins``), with the other operands logits-free."""
    if name in ("add", "sub", "neg", "rsub"):
        return name != "add" or len(node.args) == 2 and not node.kwargs
    if name == "mul":
        return len(ins) == 1
    if name == "div":
        return ins == [node.args[0]] and len(node.args) == 2
    return False


def find_loss(
    escapes: dict[fx.Node, Any], modes: dict[fx.Node, bool | None], tainted: set[fx.Node], graph: fx.Graph
) -> LossPlan | str:
    """The loss the region's escaping values (node -> Tok / Lin) reduce to, or the reason there is none.

    ``tainted``: nodes that depend on some lm_head's logits (the loss math may read them only through ``escapes``).
    """
    for node in escapes:
        if modes.get(node) is False:
            return f"{node.name} is computed under no_grad"
    vals: dict[fx.Node, Any] = dict(escapes)
    order = {n: i for i, n in enumerate(graph.nodes)}
    first = min(order[n] for n in escapes)
    for node in list(graph.nodes)[first:]:
        if node in vals or not any(a in vals for a in node.all_input_nodes):
            continue
        if _is_sink(node, modes):
            continue
        value = _classify(node, vals)
        if value is not None:
            vals[node] = value
    frontier: dict[fx.Node, fx.Node] = {}
    for node, v in vals.items():
        if not v.grad:
            continue
        for user in node.users:
            if user not in vals and not _is_sink(user, modes):
                frontier.setdefault(node, user)
                break
    if not frontier:
        return "no value computed from the log-probs carries a gradient out of the graph"
    if len(frontier) > 1:
        parts = ", ".join(f"{n.name} (used by {_describe(u)})" for n, u in frontier.items())
        return (
            f"the log-probs / entropy reach {len(frontier)} values that leave the per-token math with a gradient: "
            f"{parts}; the loss-aware mode needs one scalar loss (return metrics detached)"
        )
    ((loss, user),) = frontier.items()
    if isinstance(vals[loss], Tok):
        return (
            f"the per-token value {loss.name} is used by {_describe(user)}, which is not per-token math or a sum / mean"
        )
    value = fxgraph.example_value(loss)
    if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.is_floating_point():
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        return f"{loss.name} (used by {_describe(user)}) is not a scalar loss: {shape}"
    nodes = _ancestors_within(loss, vals)
    externals: list[fx.Node] = []
    for node in sorted(nodes - set(escapes), key=order.__getitem__):
        for a in node.all_input_nodes:
            if a in nodes or a in escapes or a in externals:
                continue
            if a in tainted:
                return (
                    f"the loss math reads {a.name}, which depends on the logits outside the log-prob / entropy "
                    "(a detached copy, or another lm_head's)"
                )
            if not isinstance(fxgraph.example_value(a), torch.Tensor):
                kind = type(fxgraph.example_value(a)).__name__
                return f"the loss math reads {a.name}, a {kind} (a symbolic Python number, under dynamic shapes)"
            externals.append(a)
    return LossPlan(loss, nodes, externals)


def _reach(roots: list[fx.Node], step: Any) -> set[fx.Node]:
    """``roots`` and every node reached from them through ``step(node)`` (users or inputs)."""
    out, todo = set(roots), list(roots)
    while todo:
        for a in step(todo.pop()):
            if a not in out:
                out.add(a)
                todo.append(a)
    return out


def check_externals(plan: LossPlan, at: fx.Node, modes: dict[fx.Node, bool | None]) -> str | None:
    """The op runs just before ``at`` (the log-probs' first use) and evaluates F on the externals' values there,
    while the graph's loss math reads them later: they must be the same values. So what the externals are
    computed from must not change in place after ``at``, and what is computed after ``at`` (moved above it for
    the op) must be computed in ``at``'s grad mode. Returns the reason when not (None: fine)."""
    graph = at.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    needed = _reach(list(plan.externals), lambda n: n.all_input_nodes)
    for n in sorted(needed, key=order.__getitem__):
        if order[n] >= order[at] and modes.get(n) != modes.get(at):
            return f"the loss math reads {n.name}, computed after the log-probs' first use in another grad mode"
    roots = {_storage_root(n) for n in needed}
    for node in list(graph.nodes)[order[at] :]:
        for target in fxgraph.mutated_args(node):
            if _storage_root(target) in roots:
                return (
                    f"the loss math reads {target.name} (or a view of it), which {node.name} changes in place after "
                    "the log-probs are first used"
                )
    return None


def _storage_root(node: fx.Node) -> fx.Node:
    """The node whose storage ``node`` shares: back through views, slices and in-place results."""
    while node.args and isinstance(node.args[0], fx.Node):
        if not (
            fxgraph.is_view_like(node)
            or name_of(node) in _VIEWS
            or fxgraph.is_inplace(node)
            or fxgraph.op(node) == "detach"
        ):
            break
        node = node.args[0]
    return node


def _ancestors_within(node: fx.Node, vals: dict[fx.Node, Any]) -> set[fx.Node]:
    return _reach([node], lambda n: [a for a in n.all_input_nodes if a in vals])


def _describe(user: fx.Node) -> str:
    return "the graph's output" if user.op == "output" else f"{name_of(user) or user.op} {user.name}"


def descendants(roots: list[fx.Node]) -> set[fx.Node]:
    return _reach(roots, lambda n: n.users)


def extract(graph: fx.Graph, inputs: tuple[fx.Node, fx.Node | None], loss: fx.Node) -> tuple[fx.GraphModule, list]:
    """F(logp, entropy, *externals) -> loss as its own GraphModule: the nodes of ``graph`` between ``inputs`` (the
    op's log-prob and entropy) and ``loss``; returns it with the externals it reads, in placeholder order."""
    roots = [n for n in inputs if n is not None]
    between = descendants(roots) - set(roots)
    between &= _ancestors_of(loss)
    nodes = [n for n in graph.nodes if n in between]
    externals: list[fx.Node] = []
    for node in nodes:
        for a in node.all_input_nodes:
            if a not in between and a not in roots and a not in externals:
                externals.append(a)
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n, name in zip(inputs, ("logp", "entropy")):
        p = g.placeholder(name)
        if n is not None:
            env[n] = p
    for i, a in enumerate(externals):
        env[a] = g.placeholder(f"x{i}")
    for node in nodes:
        copy = g.node_copy(node, lambda a: env[a])
        copy.meta = {}
        env[node] = copy
    g.output(env[loss])
    return fx.GraphModule(torch.nn.Module(), g), externals


def _ancestors_of(node: fx.Node) -> set[fx.Node]:
    return _reach([node], lambda n: n.all_input_nodes)
