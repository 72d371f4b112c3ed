"""Rewrites gated MLPs into sequence-chunked recompute regions (``tilecompile::tiled_gated_mlp``).

    down(act(gate(x)) * up(x))  ->  tiled_gated_mlp(x, Wg, bg, Wu, bu, Wd, bd, act)   (act: silu, gelu, gelu_tanh, relu)

The op runs the MLP chunk by chunk over the tokens of ``x`` and saves only ``x`` for backward, so the [N, I]
intermediates never exist all at once. Matched by meaning through ``tilecompile.graph``: linears in any spelling
(``F.linear``, ``x @ w.t()``, a separate bias add), SiLU as ``F.silu`` / ``nn.SiLU`` / ``x * sigmoid(x)``, either
order of the gate multiply, an up projection plus a literal zero (Megatron-Core's ``up + glu_linear_offset``), and
fused ``gate_up`` weights whose output is cut in two along the last dim
(``chunk``, ``split``, slicing); their gate and up weights are passed as row slices of the fused weight (views:
autograd sums both halves' grads into the one parameter).

Checks, each a reason when it says no: the same ``x`` feeds gate and up; every weight is a graph input; shapes
chain without broadcasting; the intermediates are used only inside the MLP; one dtype inside the region (under
autocast the op is handed ``x`` and the weights cast to the compute dtype, as ``F.linear`` would); no autocast
edge inside the region; at least ``mlp_min_tokens`` tokens (a symbolic count is compared under a guard).

MoE experts over stacked [E, ...] weights, run as grouped matmuls (HF transformers 5's default for Mixtral,
Qwen3-MoE, ...) or as batched matmuls of per-row gathered weights (HF's ``batched_mm``), are this pass's too:
``passes/mlp/experts.py`` rewrites them into ``tilecompile::tiled_grouped_mlp`` (switched by ``mlp_experts``), or
gives each a reason.

Not matched (left to Inductor): GELU spelled out as tanh arithmetic (HF ``gelu_new``), LoRA-style adapters added
to a projection (a reason that names the adapter), dropout inside the MLP, expert weights indexed out of a stacked
parameter one expert at a time (HF's per-expert loop: the gate/up weight is computed in the graph, a reason).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import operator

import torch
import torch.fx as fx

import tilecompile.ops.tiled_mlp  # noqa: F401 - registers torch.ops.tilecompile.tiled_gated_mlp
from tilecompile import graph as fxgraph
from tilecompile import reporting
from tilecompile.config import Settings
from tilecompile.pass_api import PassContext, PassResult, expect
from tilecompile.passes.mlp import common

NAME, ACTIVATIONS = common.NAME, common.ACTIVATIONS


@dataclasses.dataclass(frozen=True)
class Projection:
    """``gate(x)`` or ``up(x)``: a linear, or rows ``[start, stop)`` of a fused linear's output features."""

    node: fx.Node  # what the gate multiply (or activation) reads
    linear: fxgraph.Linear
    start: int | None = None
    stop: int | None = None

    @property
    def sliced(self) -> bool:
        return self.start is not None

    @property
    def matmul(self) -> fxgraph.Linear:
        return self.linear


@dataclasses.dataclass(frozen=True)
class GatedMLP(common.Gated):
    """A dense gated MLP: ``down`` a ``fxgraph.Linear``, ``gate`` and ``up`` ``Projection``s."""


# ------------------------------------------------------------------------------------------------------ find


def as_projection(node: object) -> Projection | None:
    if not isinstance(node, fx.Node):
        return None
    node = common.plus_zero(node)
    lin = fxgraph.as_affine(node)
    if lin is not None:
        return Projection(node, lin)
    part = fxgraph.as_last_dim_slice(node)
    lin = fxgraph.as_affine(part.source) if part is not None else None
    if lin is not None:
        return Projection(node, lin, part.start, part.stop)
    return None


def match(node: fx.Node) -> GatedMLP | str | None:
    """A gated MLP ending in ``node`` (its down projection); a reason when it looks like an MLP but is not one
    this pass can tile; None when ``node`` is not an MLP's down projection at all."""
    down = fxgraph.as_affine(node)
    if down is None or _bias_added_later(down):
        return None
    h = down.input
    act = fxgraph.as_activation(h)
    if act is not None and as_projection(act.input) is not None:
        return f"not gated: down({act.kind}(linear(x))) has no gate multiply (nothing to tile)"
    if fxgraph.op(h) != "mul" or len(h.args) != 2 or h.kwargs:
        return None
    a, b = h.args
    if not all(isinstance(t, fx.Node) for t in (a, b)):
        factor = a if isinstance(a, fx.Node) else b
        act = fxgraph.as_activation(factor) if isinstance(factor, fx.Node) else None
        if act is not None and as_projection(act.input) is not None:
            return f"not gated: down({act.kind}(linear(x)) * a constant) has no gate multiply (nothing to tile)"
        return None
    acts = [(fxgraph.as_activation(p), q) for p, q in ((a, b), (b, a))]
    if not any(act for act, _ in acts) and not any(as_projection(t) for t in (a, b)):
        return None  # e.g. an RMSNorm's weight * hidden feeding a linear
    reasons = []
    for act, other in acts:
        if act is None:
            continue
        gate, up = as_projection(act.input), as_projection(other)
        if gate is None:
            reasons.append(_adapted(act.input, "gate") or f"the activation's input {act.input.name} is not a linear "
                           "(gate projection)")  # fmt: skip
        elif up is None:
            reasons.append(_adapted(other, "up") or f"the factor {other.name} beside {act.kind}(gate) is not a linear "
                           "(up projection)")  # fmt: skip
        else:
            return GatedMLP(down, h, act, gate, up, _region(node, down, gate, up))
    if reasons:
        return reasons[0]
    kinds = ", ".join(str(fxgraph.op(t) or t.op) for t in (a, b))
    return f"gate multiply of ({kinds}): neither factor is {'/'.join(ACTIVATIONS)} of a linear"


def _adapted(node: fx.Node, role: str) -> str | None:
    """The reason when ``node`` is a projection plus a low-rank adapter, ``linear(x) + linear(linear(x)) [* s]`` with
    both reading the same ``x`` (the adapter maybe through dropout) and the adapter's rank below the projection's
    input width (PEFT's LoRA: ``base_layer(x) + lora_B(lora_A(dropout(x))) * scaling``, then cast back to the
    base's dtype); None otherwise."""
    node = fxgraph.strip_casts(node)
    if fxgraph.op(node) != "add" or len(node.args) != 2 or not all(isinstance(a, fx.Node) for a in node.args):
        return None
    for base, extra in (node.args, node.args[::-1]):
        if fxgraph.op(extra) == "mul" and len(extra.args) == 2:  # the scaling: a constant, or a 0-d tensor
            extra = max((a for a in extra.args if isinstance(a, fx.Node)), key=lambda a: len(fxgraph.shape(a) or ()),
                        default=extra)  # fmt: skip
        outer = fxgraph.as_affine(fxgraph.strip_casts(extra))
        inner = fxgraph.as_affine(fxgraph.strip_casts(outer.input)) if outer is not None else None
        projection = as_projection(fxgraph.strip_casts(base))
        if projection is None or inner is None:
            continue
        rank, width = (
            (fxgraph.shape(inner.weight) or (None, None))[0],
            (fxgraph.shape(projection.linear.weight) or (None,))[-1],
        )
        low_rank = (
            fxgraph.hint(rank) is not None
            and fxgraph.hint(width) is not None
            and fxgraph.hint(rank) < fxgraph.hint(width)
        )
        if low_rank and _input_of(inner.input) is _input_of(projection.linear.input):
            return (
                f"the {role} projection has a low-rank adapter added to it ({node.name} = linear(x) + "
                "linear(linear(x)) * s: LoRA): the op tiles plain projections only, so this MLP is left as it is"
            )
    return None


def _input_of(node: fx.Node) -> fx.Node:
    """``node`` back through casts and dropout (an adapter reads ``dropout(x)``, the projection ``x``)."""
    node = fxgraph.strip_casts(node)
    while isinstance(node, fx.Node) and fxgraph.op(node) == "dropout" and node.args:
        node = fxgraph.strip_casts(node.args[0])
    return node


def _bias_added_later(lin: fxgraph.Linear) -> bool:
    """``lin`` is the matmul of ``x @ w.t() + b``: the add is the down projection, not this node."""
    if lin.bias is not None or len(lin.node.users) != 1:
        return False
    (user,) = lin.node.users
    outer = fxgraph.as_affine(user)
    return outer is not None and outer.weight is lin.weight


def _region(end: fx.Node, down: fxgraph.Linear, gate: Projection, up: Projection) -> frozenset[fx.Node]:
    """The nodes between the MLP's inputs (x, weights, biases) and ``end``."""
    leaves = {gate.linear.input, up.linear.input}
    for lin in (gate.linear, up.linear, down):
        leaves |= {lin.weight} | ({lin.bias} if lin.bias is not None else set())
    return common.region(end, leaves)


# ----------------------------------------------------------------------------------------------------- check


def check_same_input(m: GatedMLP) -> str | None:
    if m.gate.linear.input is not m.up.linear.input:
        return f"gate reads {m.gate.linear.input.name} but up reads {m.up.linear.input.name} (must be the same x)"
    return None


def check_inside_region(m: GatedMLP) -> str | None:
    return common.check_inside_region(m, "MLP", "x and the weights", weight_views=True)


def check_shapes(m: GatedMLP) -> str | None:
    x, g, u, h, y = (fxgraph.shape(n) for n in (m.x, m.gate.node, m.up.node, m.mul, m.down.node))
    wg, wu, wd = (fxgraph.shape(lin.weight) for lin in (m.gate.linear, m.up.linear, m.down))
    if None in (x, g, u, h, y, wg, wu, wd):
        return "missing example values (shapes unknown)"
    if not (_same(g, u) and _same(g, h)):
        return f"gate {list(g)} and up {list(u)} outputs differ from their product {list(h)} (broadcasting)"
    inter = _rows(m.gate)
    if not _same((_rows(m.up),), (inter,)) or not _same(wg[1:], wu[1:]) or not _same(wd[1:], (inter,)):
        return f"weights do not chain: gate {list(wg)}, up {list(wu)}, down {list(wd)}"
    if not _same(x[-1:], wg[1:]) or not _same(y[:-1], x[:-1]) or not _same(y[-1:], wd[:1]):
        return f"x {list(x)} -> out {list(y)} does not fit weights gate {list(wg)}, down {list(wd)}"
    return None


def check_dtypes(m: GatedMLP) -> str | None:
    # Every computed value in the region, not only the named steps: under autocast ``x @ w.t() + b`` is a bf16
    # matmul and an fp32 add, a precision chain the op (one compute dtype) would not reproduce. Views and casts
    # of the weights keep the weights' dtype and are left out.
    computed = [
        n for n in m.region if fxgraph.graph_input(n) is None and isinstance(fxgraph.example_value(n), torch.Tensor)
    ]
    inner = {fxgraph.dtype(n) for n in (m.gate.node, m.up.node, m.act.node, m.mul, m.down.node, *computed)}
    if len(inner) != 1 or None in inner:
        return f"mixed dtypes inside the MLP ({', '.join(sorted(str(d) for d in inner))}): casts the op would drop"
    compute = inner.pop()
    if not compute.is_floating_point:
        return f"compute dtype {compute} is not floating point"
    linears = (m.gate.linear, m.up.linear, m.down)
    inputs = [m.x] + [t for lin in linears for t in (lin.weight, lin.bias) if t is not None]
    if any(not (fxgraph.dtype(t) or torch.int64).is_floating_point for t in inputs):
        return "an input of the MLP is not a floating-point tensor"
    return None


def check_min_tokens(m: GatedMLP, min_tokens: int) -> str | None:
    if not min_tokens:
        return None
    shape = fxgraph.shape(m.x)
    sizes = shape[:-1] if shape else (None,)
    if any(s is None for s in sizes):  # an unknown size is not a reason to skip
        return None
    try:
        # a symbolic count is compared, not its hint: that adds a guard, so a later call on the other side of
        # the threshold recompiles (tiled above it, untiled below) instead of reusing this graph's choice
        below = bool(math.prod(sizes) < min_tokens)
    except Exception:  # noqa: BLE001 - an unbacked size: nothing to guard on, the hint decides (if there is one)
        hint = _tokens(m.x)
        below = hint is not None and hint < min_tokens
    if below:
        return f"{_tokens(m.x)} tokens < mlp_min_tokens={min_tokens}: tiling would only cost time (0 tiles everything)"
    return None


def _tokens(x: fx.Node) -> int | None:
    sizes = [fxgraph.hint(s) for s in (fxgraph.shape(x) or ())[:-1]]
    return None if None in sizes else math.prod(sizes)


def _rows(p: Projection):
    """The intermediate size I a projection produces: an int, or the weight's own (possibly symbolic) size."""
    if p.sliced:
        return p.stop - p.start
    return fxgraph.shape(p.linear.weight)[0]


def _same(a: tuple, b: tuple) -> bool:
    """Equal sizes: provably equal for every value the symbols may take (never merely equal hints)."""
    return fxgraph.same_shape(a, b)


# --------------------------------------------------------------------------------------------------- rewrite


def rewrite(gm: fx.GraphModule, m: GatedMLP, ctx: PassContext) -> reporting.Rewrite:
    graph, end = gm.graph, m.down.node
    compute = fxgraph.dtype(end)
    fake_mode = getattr(fxgraph.example_value(end), "fake_mode", None) or contextlib.nullcontext()
    new_nodes: list[fx.Node] = []

    def add(target, *args, method: bool = False, **kwargs) -> fx.Node:
        node = (graph.call_method if method else graph.call_function)(target, args, kwargs)
        new_nodes.append(node)
        return node

    def operand(t: fx.Node | None, rows: tuple[int, int] | None = None) -> fx.Node | None:
        if t is None:
            return None
        value = fxgraph.example_value(t)
        with fake_mode:  # the graph's own mode (the tracing context may hold another)
            if rows is not None:
                t = add(operator.getitem, t, slice(*rows))
                value = value[slice(*rows)]
                expect(t, value)
            if value.dtype != compute:
                t = add("to", t, method=True, dtype=compute)
                value = value.to(compute)
                expect(t, value)
        return t

    with graph.inserting_before(end):
        x = operand(m.x)
        weights = []
        for p in (m.gate, m.up):
            rows = (p.start, p.stop) if p.sliced else None
            weights += [operand(p.linear.weight, rows), operand(p.linear.bias, rows)]
        weights += [operand(m.down.weight), operand(m.down.bias)]
        s = ctx.settings
        tiled = add(
            torch.ops.tilecompile.tiled_gated_mlp.default,
            x,
            *weights,
            m.act.kind,
            s.mlp_chunk_tokens,
            s.mlp_chunk_budget_mb,
            s.mlp_grad_accum,
        )
    common.replace(graph, m, new_nodes, tiled)
    return _record(m, compute, s)


def _record(m: GatedMLP, compute: torch.dtype, s: Settings) -> reporting.Rewrite:
    shapes = {"x": fxgraph.shape(m.x), "out": fxgraph.shape(m.down.node)}
    for role, p in (("gate", m.gate), ("up", m.up)):
        w = fxgraph.shape(p.linear.weight)
        shapes[f"{role}_weight"] = (p.stop - p.start, *w[1:]) if p.sliced else w
    shapes["down_weight"] = fxgraph.shape(m.down.weight)
    if m.fused:
        shapes["gate_up_weight"] = fxgraph.shape(m.gate.linear.weight)
    shapes = {k: tuple(common.size(i) for i in v) for k, v in shapes.items()}
    dtypes = {"x": str(fxgraph.dtype(m.x)), "weight": str(fxgraph.dtype(m.down.weight)), "compute": str(compute)}
    biases = [r for r, lin in (("gate", m.gate.linear), ("up", m.up.linear), ("down", m.down)) if lin.bias is not None]
    detail = (
        f"activation={m.act.kind} fused={'gate_up' if m.fused else 'no'} bias={','.join(biases) or 'none'} "
        f"chunk_tokens={s.mlp_chunk_tokens or 'auto'} budget_mb={s.mlp_chunk_budget_mb} grad_accum={s.mlp_grad_accum}"
    )
    if dtypes["x"] != dtypes["compute"] or dtypes["weight"] != dtypes["compute"]:
        detail += f" autocast: inputs cast to {compute}"
    return reporting.Rewrite(NAME, common.path(m.region), shapes, dtypes, detail)


# ------------------------------------------------------------------------------------------------------- run


def run_dense(gm: fx.GraphModule, ctx: PassContext, result: PassResult, order: dict, markers: list[int]) -> bool:
    """The dense stage: each gated MLP rewritten or skipped with its reason (into ``result``); True if the graph
    changed. ``order`` (node -> position, the experts stage's rewrites included) and ``markers`` (positions of
    autocast edges) are the pass's."""
    changed = False
    for node, m in common.matches(gm, order, match):
        reason = m if isinstance(m, str) else None
        if reason is None:
            checks = (
                check_same_input,
                common.check_weights_are_inputs,
                check_inside_region,
                check_shapes,
                check_dtypes,
                lambda m: common.check_no_autocast_edge(m, order, markers),
                lambda m: check_min_tokens(m, ctx.settings.mlp_min_tokens),
                common.check_kept,
            )
            reason = next((r for r in (c(m) for c in checks) if r), None)
        candidate = f"down projection {fxgraph.module_path(node) or node.name}"
        result.consider(node, candidate)
        if reason is not None:
            path = common.path(m.region) if isinstance(m, GatedMLP) else common.path([node, *node.args[:1]])
            result.skip(node, reporting.Skip(NAME, candidate, path, reason))
            continue
        result.rewrote(node, rewrite(gm, m, ctx))
        order.update({n: order[m.down.node] for n in gm.graph.nodes if n not in order})
        changed = True
    return changed
