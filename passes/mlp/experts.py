"""The tiled_mlp pass's MoE stage: rewrites gated expert MLPs into ``tilecompile::tiled_grouped_mlp``.

    down = grouped_mm(act(gate) * up, Wd, offs),  gate | up = grouped_mm(x, Wgu, offs)[..., halves]
        ->  tiled_grouped_mlp(x, offs, Wgu, None, Wd, act)

(``Wgu`` whole where gate and up are its first and second halves, as HF's ``chunk(2, dim=-1)`` makes them: the op's
stacked operand, whose grad it returns whole; other column ranges go in as two slices ``Wgu[..., a:b]``.)

This is how HF transformers 5 runs Mixtral's and Qwen3-MoE's experts (``experts_implementation="grouped_mm"``, the
default): the routed rows sorted by expert, ``offs`` the cumulative row counts, stacked ``gate_up_proj`` [E, 2I, D]
and ``down_proj`` [E, D, I] passed transposed; ``grouped_mm`` is ``torch.nn.functional.grouped_mm``,
``torch._grouped_mm`` or (fp32 weights under Dynamo, CPU) HF's ``torch.ops.transformers.grouped_mm_fallback``. Gate
and up may also be two grouped matmuls of the same rows. The op runs each expert's rows in token chunks and saves
only ``x`` (the routed rows), the offsets and the weights for backward.

Expert-parallel sentinel rows (transformers 5.17 always, 5.18+ under expert parallelism): HF writes
``proj = grouped_mm(x, Wgu, offs).masked_fill(sentinel_mask, 0)`` before the gate, ``sentinel_mask =
(expert_ids_g >= num_experts).unsqueeze(-1)`` [S, 1] marking the rows routed to experts not on this rank (sorted to
the tail, past ``offs[-1]``). The pass reads through a ``masked_fill(·, mask, 0)`` of whole rows ([S, 1]) on the
gate and up projections (the same mask on both) and hands the mask to the op as ``row_mask``: the op zeroes those
rows' gate and up, and their gradients, as the masked_fill does (tilecompile/ops/tiled_grouped_mlp.py), whatever
rows the mask marks. HF's other two fills (of ``x`` in place before, of the output after) stay in the graph.

HF's ``experts_implementation="batched_mm"`` gathers each row's expert weights instead,
``bmm(W[ids], x.unsqueeze(-1)).squeeze(-1)`` ([S, 2I, D] of gathered weights, and their grads, per layer): the
same op, with the rows sorted into groups around it (``argsort(ids)``, offsets from the counts, the rows gathered
in that order, the op's output put back in row order).

The routing-weight multiply: HF scales the experts' output by each row's routing weight, ``proj_out *
sample_weights_g.unsqueeze(-1)`` (after the expert-parallel post-mask when there is one). Where that product is the
output's only reader (``routing_weight``: [S, 1] weights in the compute dtype, the post-mask the op's own row mask),
the op takes the weights in as ``row_weight`` and returns their grad itself. Left outside, the multiply's backward
needs the op's output for the weights' grad: without checkpointing that saves an [S, D] tensor per layer, and under
checkpointing the recompute has to run the whole op forward again only to make it (28 instead of 22 S·D·I FLOPs,
against 24 for the experts left alone and recomputed). The report's ``row_weight=`` says which happened.

What stays outside the op: the routing (top-k, sort, the gather of the rows) and the un-permute + sum back to
tokens. They are [S, D]-sized (no [S, I] intermediate), so tiling them saves nothing; the router's gradient up to
its weights is ordinary autograd.

Checks, each a reason when it says no: ``mlp_experts`` on; the same rows and the same offsets (or expert ids) feed
every projection; the weights are graph inputs; shapes chain ([S, D] rows, [E, D, I] gate and up, [E, I, D_out]
down, in the op's layout); the intermediates are used only inside the MLP; one dtype inside it (``grouped_mm`` is
not an autocast op, but batched_mm's ``bmm`` is: under autocast those experts keep a reason); no autocast edge; at
least ``mlp_min_tokens`` rows; tiling pays in memory (``check_pays``, below); and the memory plan does not keep the
layer whole (``common.check_kept``).

When tiling pays (issue 42). Left alone, the experts' autograd saves about four [S, I] tensors per layer (the [S, 2I]
gate/up output, act(g), h) from the forward to the backward: ``4·S·I·itemsize`` bytes. Tiled, the op saves none but
holds, during its backward, the chunk's buffers (``mlp_chunk_budget_mb``), a two-slot carry per weight
(``2·(2·D·I + I·D_out)`` elements in the accumulation dtype; no [E, K, N] accumulator) and, where its
``grouped_wgrad`` kernel does not run (no CUDA, no Triton), one chunk's [E, D, I] weight grad from ``grouped_mm``.
In the root graph (no checkpointing), every expert MLP of the graph holds its activations until its backward, so
their sum is compared with the op's bytes; inside a checkpoint body only one layer's activations are held at a time,
through that layer's recompute and backward, so that layer's. The experts are tiled where the activations are
larger. Speed does not argue against it there any more: the op recomputes the gate/up GEMM, but its forward is not
run again by the checkpoint's recompute (the routing weight taken in), and on the H100 at Qwen3-30B-A3B's shape,
4 layers checkpointed, tiled experts ran 1.006-1.042x at 8k and 1.000-1.009x at 32k tokens of leaving them alone
in two calls (benchmarks/RESULTS.md, 2026-12-07; 0.73x and 0.92x on the H200 on 2026-12-06, before the weight-grad
kernel, the grads in the weights' layout and the row-weight kernel, when a body needed 4x). Experts left alone get
both numbers as the reason; ``mlp_min_tokens=0`` tiles them anyway. Sizes are read at their hints (no guard): a
dynamic-shape graph keeps the choice made at its first length.

Every grouped matmul the pass does not take into a rewrite gets a reason too (no silent miss), and so does a down
projection of gathered weights in a form it does not read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import operator

import torch
import torch.fx as fx

import tilecompile.ops.tiled_grouped_mlp as grouped_op  # registers torch.ops.tilecompile.tiled_grouped_mlp
from tilecompile import graph as fxgraph
from tilecompile import reporting
from tilecompile.ops.tiled_mlp import acc_dtype
from tilecompile.pass_api import PassContext, PassResult, expect
from tilecompile.passes.mlp import common

NAME = common.NAME
_GROUPED_MM = ("grouped_mm", "_grouped_mm", "grouped_mm_fallback")


@dataclasses.dataclass(frozen=True)
class GroupedMM:
    """An expert projection of rows ``input`` [S, K] by stacked weights, in one of two forms:

    - ``grouped``: ``grouped_mm(input, weight, offs)``, rows grouped by expert, ``offs`` [E] their cumulative counts,
      ``weight`` [E, K, N] (``input[rows of e] @ weight[e]``);
    - ``gathered``: ``bmm(weight[offs], input.unsqueeze(-1)).squeeze(-1)``, ``offs`` [S] the expert of each row,
      ``weight`` [E, N, K] (HF's ``batched_mm`` experts; ``node`` is the squeeze).
    """

    node: fx.Node
    input: fx.Node
    weight: fx.Node
    offs: fx.Node
    form: str = "grouped"

    @property
    def out_features(self):
        return fxgraph.shape(self.weight)[2 if self.form == "grouped" else 1]

    @property
    def in_features(self):
        return fxgraph.shape(self.weight)[1 if self.form == "grouped" else 2]


@dataclasses.dataclass(frozen=True)
class GroupedProjection:
    """Gate or up: a grouped matmul, or columns ``[start, stop)`` of its output; ``mask`` when the rows it flags are
    filled with zero (``masked_fill(·, mask, 0)`` around the matmul or its slice)."""

    node: fx.Node  # what the activation or the gate multiply reads
    mm: GroupedMM
    start: int | None = None
    stop: int | None = None
    mask: fx.Node | None = None

    @property
    def sliced(self) -> bool:
        return self.start is not None

    @property
    def width(self):
        return self.stop - self.start if self.sliced else self.mm.out_features

    @property
    def matmul(self) -> GroupedMM:
        return self.mm


@dataclasses.dataclass(frozen=True)
class GroupedMLP(common.Gated):
    """Gated expert MLPs: ``down`` a ``GroupedMM``, ``gate`` and ``up`` ``GroupedProjection``s."""

    @property
    def mask(self) -> fx.Node | None:
        """The row mask of gate and up (``check_row_mask`` makes them one)."""
        return self.gate.mask


@dataclasses.dataclass(frozen=True)
class RoutingWeight:
    """``down * w`` after the experts (or ``masked_fill(down, row_mask, 0) * w``), ``w`` [S, 1] in the compute
    dtype: the op takes ``w`` as its ``row_weight`` and its output replaces ``mul``; ``nodes`` go with the region."""

    mul: fx.Node
    weight: fx.Node
    nodes: frozenset[fx.Node]


# ------------------------------------------------------------------------------------------------------ find


def is_grouped_mm_call(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    names = {str(node.target), str(getattr(node.target, "__name__", ""))}
    return any(n == t or n.endswith(("." + t, "::" + t)) for n in names for t in _GROUPED_MM)


def as_grouped_mm(node: object) -> GroupedMM | None:
    """A grouped matmul of 2-D rows by 3-D stacked weights with offsets, no bias, no output cast."""
    if not isinstance(node, fx.Node) or not is_grouped_mm_call(node):
        return None
    a = fxgraph.arg(node, 0, "mat_a", node.kwargs.get("input", node.kwargs.get("self")))
    b = fxgraph.arg(node, 1, "mat_b", node.kwargs.get("weight", node.kwargs.get("mat2")))
    offs = fxgraph.arg(node, 2, "offs")
    extra = {k: v for k, v in node.kwargs.items() if k not in ("mat_a", "mat_b", "input", "weight", "self", "mat2")}
    extra.pop("offs", None)
    if any(v is not None for v in (*node.args[3:], *extra.values())):
        return None  # a bias or an out_dtype
    if not all(isinstance(t, fx.Node) for t in (a, b, offs)):
        return None
    if len(fxgraph.shape(a) or ()) != 2 or len(fxgraph.shape(b) or ()) != 3 or len(fxgraph.shape(offs) or ()) != 1:
        return None
    return GroupedMM(node, a, b, offs)


def as_gathered_mm(node: object) -> GroupedMM | None:
    """``bmm(W[ids], x.unsqueeze(-1)).squeeze(-1)``: each row of x [S, K] times its expert's weight W[ids[s]]
    [N, K] (W a stacked [E, N, K] graph input, ids [S] integer), HF's ``batched_mm`` experts."""
    if not isinstance(node, fx.Node) or fxgraph.op(node) != "squeeze" or len(node.args) != 2 or node.kwargs:
        return None
    mm = node.args[0]
    if (
        not isinstance(mm, fx.Node)
        or fxgraph.op(mm) != "matmul"
        or len(mm.args) != 2
        or mm.kwargs
        or len(mm.users) != 1
    ):
        return None  # torch.bmm reads as matmul
    w, v = mm.args
    if not _gathered_expert_weight(w) or not isinstance(v, fx.Node) or fxgraph.op(v) != "unsqueeze" or len(v.args) != 2:
        return None
    x = v.args[0]
    s, x_shape = fxgraph.shape(node), fxgraph.shape(x)
    if not isinstance(x, fx.Node) or x_shape is None or len(x_shape) != 2 or s is None or len(s) != 2:
        return None
    if fxgraph.normalize_dim(node.args[1], 3) != 2 or fxgraph.normalize_dim(v.args[1], 3) != 2:
        return None
    return GroupedMM(node, x, w.args[0], w.args[1], form="gathered")


def as_expert_mm(node: object) -> GroupedMM | None:
    return as_grouped_mm(node) or as_gathered_mm(node)


def as_zero_fill(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """``masked_fill(source, mask, 0)`` (method or function; a literal +0 fill): ``(source, mask)``."""
    if fxgraph.op(node) != "masked_fill":
        return None
    source, mask = fxgraph.arg(node, 0, "input", node.kwargs.get("self")), fxgraph.arg(node, 1, "mask")
    value = fxgraph.arg(node, 2, "value")
    if len(node.args) + len(node.kwargs) != 3 or not all(isinstance(t, fx.Node) for t in (source, mask)):
        return None
    if not isinstance(value, int | float) or value != 0 or math.copysign(1.0, value) < 0:
        return None  # a tensor value, a nonzero fill, or -0.0 (the op fills +0)
    return source, mask


def as_grouped_projection(node: object) -> GroupedProjection | None:
    """An expert matmul, or columns of it, read through ``+ 0`` and one ``masked_fill(·, mask, 0)`` (before or after
    the slice)."""
    if not isinstance(node, fx.Node):
        return None
    node = common.plus_zero(node)
    read = node
    fill = as_zero_fill(node)
    node, mask = fill if fill is not None else (node, None)
    mm = as_expert_mm(node)
    if mm is not None:
        return GroupedProjection(read, mm, mask=mask)
    part = fxgraph.as_last_dim_slice(node)
    if part is None:
        return None
    source = part.source
    if mask is None and (fill := as_zero_fill(source)) is not None:
        source, mask = fill
    mm = as_expert_mm(source)
    if mm is not None:
        return GroupedProjection(read, mm, part.start, part.stop, mask)
    return None


def match(node: fx.Node) -> GroupedMLP | str | None:
    """A gated expert MLP ending in the grouped matmul ``node`` (its down projection); a reason when ``node`` is the
    down projection of experts this pass cannot tile; None when ``node`` is not a grouped matmul read as a down
    projection (e.g. the gate/up projection itself)."""
    down = as_expert_mm(node)
    if down is None and is_grouped_mm_call(node):
        return "grouped_mm with a bias, an out_dtype, or operands other than [S, K] rows, [E, K, N] weights, offs"
    if down is None:
        return None
    h = fxgraph.strip_casts(down.input)
    if as_grouped_projection(h) is not None:
        return None
    act = fxgraph.as_activation(h)
    if act is not None and as_grouped_projection(act.input) is not None:
        return f"experts not gated: down({act.kind}(grouped_mm(x))) has no gate multiply (nothing to tile)"
    if fxgraph.op(h) != "mul":
        return None  # not a down projection (a gate/up projection of the routed rows, or another grouped matmul)
    if len(h.args) != 2 or h.kwargs or not all(isinstance(t, fx.Node) for t in h.args):
        return f"the down grouped_mm's input {h.name} is a product with a constant, not act(gate) * up"
    a, b = h.args
    reasons = []
    for factor, other in ((a, b), (b, a)):
        act = fxgraph.as_activation(factor)
        if act is None:
            continue
        gate, up = as_grouped_projection(act.input), as_grouped_projection(other)
        if gate is None:
            reasons.append(f"the activation's input {act.input.name} is not a grouped_mm (gate projection)")
        elif up is None:
            reasons.append(f"the factor {other.name} beside {act.kind}(gate) is not a grouped_mm (up projection)")
        else:
            return GroupedMLP(down, h, act, gate, up, _region(node, down, gate, up))
    if reasons:
        return reasons[0]
    return f"gate multiply of the down grouped_mm: neither factor is {'/'.join(common.ACTIVATIONS)} of a grouped_mm"


def _region(end: fx.Node, down: GroupedMM, gate: GroupedProjection, up: GroupedProjection) -> frozenset[fx.Node]:
    """The nodes between the MLP's inputs (rows, offsets, weights) and ``end``."""
    leaves = {gate.mm.input, up.mm.input, gate.mm.weight, up.mm.weight, down.weight}
    leaves |= {gate.mm.offs, up.mm.offs, down.offs} | ({gate.mask, up.mask} - {None})
    return common.region(end, leaves)


def _projections_read_by(down: fx.Node) -> set[fx.Node]:
    """The expert matmuls that the down projection ``down`` reads as act(p), p, or the factors of a product."""
    mm = as_expert_mm(down)
    h = fxgraph.strip_casts(mm.input if mm is not None else fxgraph.arg(down, 0, "mat_a"))
    near = [h, *(h.args if isinstance(h, fx.Node) and fxgraph.op(h) == "mul" else ())]
    found = set()
    for t in near:
        act = fxgraph.as_activation(t) if isinstance(t, fx.Node) else None
        p = as_grouped_projection(act.input if act is not None else t)
        if p is not None:
            found |= {p.mm.node, *fxgraph.tensor_args(p.mm.node)} if p.mm.form == "gathered" else {p.mm.node}
    return found


def as_batched_expert_down(node: fx.Node) -> bool:
    """``bmm(W[ids], h.unsqueeze(-1))`` (or ``bmm(h.unsqueeze(1), W[ids])``) with ``W`` a stacked [E, ...] graph
    input gathered per row and ``h`` a product: the down projection of HF's ``batched_mm`` experts."""
    if fxgraph.op(node) != "matmul" or len(node.args) < 2:  # torch.bmm reads as matmul
        return False
    gathered = vector = None
    for w, v in (node.args[:2], node.args[1::-1]):
        if _gathered_expert_weight(w):
            gathered, vector = w, v
    if gathered is None or not isinstance(vector, fx.Node) or fxgraph.op(vector) != "unsqueeze":
        return False
    h = fxgraph.strip_casts(vector.args[0])
    return isinstance(h, fx.Node) and fxgraph.op(h) == "mul"


def _gathered_expert_weight(node: object) -> bool:
    if not isinstance(node, fx.Node) or fxgraph.op(node) != "getitem" or not isinstance(node.args[0], fx.Node):
        return False
    src, index = node.args
    return (
        fxgraph.graph_input(src) is not None
        and len(fxgraph.shape(src) or ()) == 3
        and isinstance(index, fx.Node)
        and not (fxgraph.dtype(index) or torch.float32).is_floating_point
    )


def routing_weight(m: GroupedMLP) -> RoutingWeight | None:
    """The routing-weight multiply that reads the experts' output and nothing else does (HF's ``proj_out *
    sample_weights_g.unsqueeze(-1)``, through the expert-parallel post-mask ``masked_fill(proj_out, sentinel_mask,
    0)`` when its mask is the op's row mask: the op's output is already zero on those rows), or None."""
    down = m.down.node
    if len(down.users) != 1:
        return None
    (user,) = down.users
    source, nodes = down, set()
    fill = as_zero_fill(user)
    if fill is not None:
        if fill[0] is not down or m.mask is None or fill[1] is not m.mask or len(user.users) != 1:
            return None
        source, nodes = user, {user}
        (user,) = user.users
    if fxgraph.op(user) != "mul" or len(user.args) != 2 or user.kwargs:
        return None
    a, b = user.args
    w = b if a is source else a if b is source else None
    if not isinstance(w, fx.Node) or w is source:
        return None
    rows, shape, dtype = (fxgraph.shape(m.x) or (None,))[0], fxgraph.shape(w), fxgraph.dtype(down)
    if rows is None or shape is None or len(shape) != 2 or not fxgraph.same_size(shape[0], rows):
        return None
    if not fxgraph.same_size(shape[1], 1) or fxgraph.dtype(w) != dtype or fxgraph.dtype(user) != dtype:
        return None  # another shape broadcasts differently; another dtype promotes the product
    if not fxgraph.same_shape(fxgraph.shape(user), fxgraph.shape(down)):
        return None
    return RoutingWeight(user, w, frozenset(nodes | {user}))


# ----------------------------------------------------------------------------------------------------- check


def check_enabled(m: GroupedMLP, on: bool) -> str | None:
    return None if on else "mlp_experts=0: MoE expert tiling is switched off (TILECOMPILE_MLP_EXPERTS)"


def check_same_rows(m: GroupedMLP) -> str | None:
    forms = {m.gate.mm.form, m.up.mm.form, m.down.form}
    if len(forms) != 1:
        return f"the projections mix grouped_mm and gathered-weight bmm ({', '.join(sorted(forms))})"
    if m.gate.mm.input is not m.up.mm.input:
        return f"gate reads {m.gate.mm.input.name} but up reads {m.up.mm.input.name} (must be the same rows)"
    offs = {m.gate.mm.offs, m.up.mm.offs, m.down.offs}
    if len(offs) != 1:
        return f"the projections read different offsets / expert ids ({', '.join(sorted(o.name for o in offs))})"
    return None


def check_row_mask(m: GroupedMLP) -> str | None:
    """A zero fill between the projections and the gate: one bool [S, 1] row mask on both gate and up."""
    if m.gate.mask is None and m.up.mask is None:
        return None
    if m.gate.mask is not m.up.mask:
        shown = {r: p.mask.name if p.mask is not None else "none" for r, p in (("gate", m.gate), ("up", m.up))}
        return f"gate and up are zero-filled by different masks (gate: {shown['gate']}, up: {shown['up']})"
    rows, shape = (fxgraph.shape(m.x) or (None,))[0], fxgraph.shape(m.mask)
    if fxgraph.dtype(m.mask) is not torch.bool or shape is None or rows is None:
        return f"the zero fill's mask {m.mask.name} is not a bool tensor of known shape"
    if len(shape) != 2 or not fxgraph.same_size(shape[1], 1) or not fxgraph.same_size(shape[0], rows):
        return (
            f"the zero fill's mask {m.mask.name} {list(shape)} is not a row mask [{fxgraph.hint(rows)}, 1] of the rows"
        )
    return None


def check_inside_region(m: GroupedMLP) -> str | None:
    return common.check_inside_region(m, "experts", "the rows, offsets and weights", weight_views=False)


def check_shapes(m: GroupedMLP) -> str | None:
    mms = (m.gate.mm, m.up.mm, m.down)
    x, y = fxgraph.shape(m.x), fxgraph.shape(m.down.node)
    g, u, h = (fxgraph.shape(n) for n in (m.gate.node, m.up.node, m.mul))
    ws = [fxgraph.shape(mm.weight) for mm in mms]
    if None in (x, y, g, u, h, *ws) or None in (fxgraph.shape(mm.offs) for mm in mms):
        return "missing example values (shapes unknown)"
    if not (fxgraph.same_shape(g, u) and fxgraph.same_shape(g, h)):
        return f"gate {list(g)} and up {list(u)} outputs differ from their product {list(h)} (broadcasting)"
    shown = f"rows {list(x)}, gate {list(ws[0])}, up {list(ws[1])}, down {list(ws[2])}"
    inter = m.gate.width
    if not all(fxgraph.same_size(w[0], ws[0][0]) for w in ws[1:]):
        return f"the projections have different numbers of experts: {shown}"
    if not all(fxgraph.same_size(mm.in_features, x[1]) for mm in mms[:2]) or not fxgraph.same_size(
        m.down.in_features, inter
    ):
        return f"shapes do not chain: {shown}"
    if not fxgraph.same_size(m.up.width, inter) or not fxgraph.same_shape(y, (x[0], m.down.out_features)):
        return f"shapes do not chain: {shown} -> out {list(y)}"
    per = ws[0][0] if m.down.form == "grouped" else x[0]  # offsets: one per expert; expert ids: one per row
    if not fxgraph.same_shape(fxgraph.shape(m.down.offs), (per,)):
        return (
            f"{'offsets' if m.down.form == 'grouped' else 'expert ids'} {list(fxgraph.shape(m.down.offs))} for {shown}"
        )
    return None


def check_dtypes(m: GroupedMLP) -> str | None:
    # grouped_mm is not an autocast op: every value in the region has the weights' dtype or the op would change it
    computed = [
        n for n in m.region if isinstance(fxgraph.example_value(n), torch.Tensor) and fxgraph.graph_input(n) is None
    ]
    weights = (m.gate.mm.weight, m.up.mm.weight, m.down.weight)
    inner = {fxgraph.dtype(n) for n in (m.x, *weights, *computed)}
    if len(inner) != 1 or None in inner:
        return f"mixed dtypes inside the experts ({', '.join(sorted(str(d) for d in inner))}): casts the op would drop"
    if not inner.pop().is_floating_point:
        return "the experts do not compute in a floating-point dtype"
    return None


def check_min_rows(m: GroupedMLP, min_tokens: int) -> str | None:
    if not min_tokens:
        return None
    rows = (fxgraph.shape(m.x) or (None,))[0]
    if rows is None:
        return None
    try:
        below = bool(rows < min_tokens)  # a symbolic count adds a guard, as the dense MLP's check does
    except Exception:  # noqa: BLE001 - an unbacked size: the hint decides (if there is one)
        hint = fxgraph.hint(rows)
        below = hint is not None and hint < min_tokens
    if below:
        return f"{fxgraph.hint(rows)} routed rows < mlp_min_tokens={min_tokens}: tiling would only cost time"
    return None


def saved_bytes(m: GroupedMLP) -> int | None:
    """What the experts' autograd saves left alone: four [S, I] tensors (the [S, 2I] gate/up output, act(g), h)."""
    rows, dtype = fxgraph.hint((fxgraph.shape(m.x) or (None,))[0]), fxgraph.dtype(m.down.node)
    inter = fxgraph.hint(m.gate.width)
    if rows is None or inter is None or dtype is None:
        return None
    return 4 * rows * inter * dtype.itemsize


def op_bytes(m: GroupedMLP, budget_mb: int, grad_accum: str) -> int | None:
    """What the tiled op holds in its backward beyond unchunked grouped_mm: the chunk's buffers, the weight grads'
    two-slot carry in the accumulation dtype, and one chunk's [E, D, I] weight grad where the grouped_wgrad kernel
    does not make the grads (off CUDA, or without Triton)."""
    e, d, i = (fxgraph.hint(v) for v in (fxgraph.shape(m.down.weight)[0], m.gate.mm.in_features, m.gate.width))
    d_out, dtype = fxgraph.hint(m.down.out_features), fxgraph.dtype(m.down.node)
    if None in (e, d, i, d_out) or dtype is None:
        return None
    carry = 2 * (2 * d * i + i * d_out) * acc_dtype(dtype, grad_accum).itemsize
    value = fxgraph.example_value(m.x)
    kernel = isinstance(value, torch.Tensor) and grouped_op.wgrad_kernel_runs(value.device)
    part = 0 if kernel else e * max(d, d_out) * i * dtype.itemsize
    return carry + part + budget_mb * 2**20


def check_pays(m: GroupedMLP, ctx: PassContext, graph_saved: int) -> str | None:
    """Tiling pays where the activations left alone would hold more than the op does: a checkpoint body's layer's,
    or the root graph's expert MLPs' together (module docstring)."""
    s = ctx.settings
    if not s.mlp_min_tokens:
        return None
    mine, cost = saved_bytes(m), op_bytes(m, s.mlp_chunk_budget_mb, s.mlp_grad_accum)
    if mine is None or cost is None:
        return None
    in_body = ctx.graph_name != "<root>"  # a checkpoint body: one layer's activations at a time
    held = mine if in_body else max(graph_saved, mine)
    if held > cost:
        return None
    mib = 2**20
    holds = (
        f"the tiled op would hold {cost / mib:.0f} MiB in its backward (the chunk's buffers, mlp_chunk_budget_mb, the "
        f"grad_accum={s.mlp_grad_accum} carry, a chunk's weight grad where its grouped_wgrad kernel does not run) and "
        f"recompute its gate/up GEMM"
    )
    if not in_body:
        return (f"tiling does not pay: left alone, the graph's expert MLPs together (no checkpointing) save "
                f"{held / mib:.0f} MiB of activations; {holds} (mlp_min_tokens=0 tiles anyway)")  # fmt: skip
    return (
        f"tiling does not pay: left alone, this checkpointed layer's experts save {held / mib:.0f} MiB of activations, "
        f"held only through its recompute and backward; {holds} (mlp_min_tokens=0 tiles anyway)"
    )


# --------------------------------------------------------------------------------------------------- rewrite


def rewrite(gm: fx.GraphModule, m: GroupedMLP, ctx: PassContext) -> reporting.Rewrite:
    graph, end = gm.graph, m.down.node
    fake_mode = getattr(fxgraph.example_value(end), "fake_mode", None) or contextlib.nullcontext()
    new_nodes: list[fx.Node] = []

    def add(target, *args, method: bool = False, **kwargs) -> fx.Node:
        """A new node, and its value from the example values of its operands (under the graph's fake mode)."""
        node = (graph.call_method if method else graph.call_function)(target, args, kwargs)
        new_nodes.append(node)
        values = [fxgraph.example_value(a) if isinstance(a, fx.Node) else a for a in args]
        kw = {k: fxgraph.example_value(v) if isinstance(v, fx.Node) else v for k, v in kwargs.items()}
        with fake_mode:
            value = getattr(values[0], target)(*values[1:], **kw) if method else target(*values, **kw)
        expect(node, value)
        node.meta["example_value"] = value
        return node

    def weight(p: GroupedProjection, whole: bool = False) -> fx.Node:
        w = p.mm.weight if p.mm.form == "grouped" else add("transpose", p.mm.weight, -2, -1, method=True)
        return add(operator.getitem, w, (Ellipsis, slice(p.start, p.stop))) if p.sliced and not whole else w

    s = ctx.settings
    fold = routing_weight(m)
    # after the multiply's operands: the weight's unsqueeze may come after the down projection
    with graph.inserting_before(fold.mul if fold is not None else end):
        # HF's stacked gate_up [gate | up]: the op takes it whole (up None) and returns its grad whole, where two
        # slices of it would get two grads that autograd sums into the parameter by a copy
        gate_w, up_w = (weight(m.gate, whole=True), None) if stacked_gate_up(m) else (weight(m.gate), weight(m.up))
        down_w = m.down.weight if m.down.form == "grouped" else add("transpose", m.down.weight, -2, -1, method=True)
        x, offsets = m.x, m.down.offs
        if m.down.form == "gathered":  # rows in expert order, their cumulative counts; back to row order after
            ids, experts = m.down.offs, common.size(fxgraph.shape(m.down.weight)[0])
            perm = add(torch.argsort, ids, stable=True)
            zeros, ones = add("new_zeros", ids, (experts,), method=True), add(torch.ones_like, ids)
            counts = add("scatter_add", zeros, 0, ids, ones, method=True)
            offsets = add(torch.cumsum, counts, 0)
            x = add(operator.getitem, m.x, perm)
        mask = m.mask
        if mask is not None and m.down.form == "gathered":
            mask = add(operator.getitem, mask, perm)
        row_weight = fold.weight if fold is not None else None
        if row_weight is not None and m.down.form == "gathered":
            row_weight = add(operator.getitem, row_weight, perm)
        args = (x, offsets, gate_w, up_w, down_w, m.act.kind, s.mlp_chunk_tokens, s.mlp_chunk_budget_mb)
        tiled = add(torch.ops.tilecompile.tiled_grouped_mlp.default, *args, s.mlp_grad_accum, mask, row_weight)
        out = tiled
        if m.down.form == "gathered":
            out = add(operator.getitem, tiled, add(torch.argsort, perm))
    if fold is None:
        common.replace(graph, m, new_nodes, out)
    else:
        common.replace(graph, m, new_nodes, out, end=fold.mul, also=fold.nodes)
    return _record(m, s, fold)


def _fused(m: GroupedMLP) -> str:
    if stacked_gate_up(m):
        return "gate_up (the stacked weight one operand, its grad whole)"
    return "gate_up (two slices of the stacked weight)" if m.fused else "no"


def stacked_gate_up(m: GroupedMLP) -> bool:
    """Gate and up are the first and second halves of one grouped matmul's output, all of it (HF's ``gate_up_proj``
    with ``chunk(2, dim=-1)``): the op can take the matmul's weight as one stacked operand."""
    g, u = m.gate, m.up
    if not (m.fused and g.sliced and u.sliced):
        return False
    return g.start == 0 and g.stop == u.start and u.stop == g.mm.out_features and g.stop - g.start == u.stop - u.start


def _record(m: GroupedMLP, s, fold: RoutingWeight | None) -> reporting.Rewrite:
    """Shapes of the op's operands ([E, in, out]), and of the stacked gate_up parameter as it is stored."""
    experts = fxgraph.shape(m.down.weight)[0]
    shapes = {"x": fxgraph.shape(m.x), "out": fxgraph.shape(m.down.node)}
    for role, p in (("gate", m.gate), ("up", m.up)):
        shapes[f"{role}_weight"] = (experts, p.mm.in_features, p.width)
    shapes["down_weight"] = (experts, m.down.in_features, m.down.out_features)
    if m.fused:
        shapes["gate_up_weight"] = fxgraph.shape(fxgraph.graph_input(m.gate.mm.weight))
    shapes = {k: tuple(common.size(i) for i in v) for k, v in shapes.items()}
    compute = str(fxgraph.dtype(m.down.node))
    dtypes = {"x": str(fxgraph.dtype(m.x)), "weight": str(fxgraph.dtype(m.down.weight)), "compute": compute}
    rows = (
        f"rows=grouped (offsets {m.down.offs.name})"
        if m.down.form == "grouped"
        else f"rows=gathered (expert ids {m.down.offs.name}, sorted into groups)"
    )
    detail = (
        f"experts={common.size(experts)} {rows} activation={m.act.kind} fused={_fused(m)} "
        f"chunk_tokens={s.mlp_chunk_tokens or 'auto'} budget_mb={s.mlp_chunk_budget_mb} grad_accum={s.mlp_grad_accum}"
    )
    if m.mask is not None:
        detail += f" row_mask={m.mask.name} (its rows' gate and up zero-filled in the op)"
    if fold is not None:
        detail += f" row_weight={fold.weight.name} (the routing-weight multiply {fold.mul.name} taken into the op)"
    else:
        detail += " row_weight=none (no routing-weight multiply of the output alone: it stays in the graph)"
    return reporting.Rewrite(NAME, common.path(m.region), shapes, dtypes, detail)


# ------------------------------------------------------------------------------------------------------- run


def run_experts(gm: fx.GraphModule, ctx: PassContext, result: PassResult, order: dict, markers: list[int]) -> bool:
    """The grouped expert MLPs of ``gm`` into tiled ops (or reasons) in ``result``; whether the graph changed."""
    changed = False
    covered: set[fx.Node] = set()
    found = [m for n in gm.graph.nodes if n in order and isinstance(m := match(n), GroupedMLP)]
    graph_saved = sum(b for m in found if (b := saved_bytes(m)) is not None)
    for node, m in common.matches(gm, order, match):
        candidate = f"expert down projection {fxgraph.module_path(node) or node.name}"
        result.consider(node, candidate)
        reason = m if isinstance(m, str) else None
        if reason is None:
            covered |= m.region
            checks = (
                lambda m: check_enabled(m, ctx.settings.mlp_experts),
                check_same_rows,
                check_row_mask,
                common.check_weights_are_inputs,
                check_inside_region,
                check_shapes,
                check_dtypes,
                lambda m: common.check_no_autocast_edge(m, order, markers),
                lambda m: check_min_rows(m, ctx.settings.mlp_min_tokens),
                lambda m: check_pays(m, ctx, graph_saved),
                common.check_kept,
            )
            reason = next((r for r in (c(m) for c in checks) if r), None)
        else:
            # one reason for the experts, not one per expert matmul
            covered |= {node, *fxgraph.tensor_args(node), *_projections_read_by(node)}
        if reason is not None:
            path = common.path(m.region) if isinstance(m, GroupedMLP) else common.path([node])
            result.skip(node, reporting.Skip(NAME, candidate, path, reason))
            continue
        result.rewrote(node, rewrite(gm, m, ctx))
        order.update({n: order[node] for n in gm.graph.nodes if n not in order})
        changed = True
    for node in list(gm.graph.nodes):  # expert matmuls no expert MLP took (or explained): a reason each
        if node in covered or node not in order:
            continue
        if is_grouped_mm_call(node):
            candidate = f"grouped_mm {fxgraph.module_path(node) or node.name}"
            reason = "grouped_mm not read as the gate/up or down projection of a gated expert MLP: not tiled"
        elif as_batched_expert_down(node):
            candidate = f"expert down projection {fxgraph.module_path(node) or node.name}"
            reason = (
                "MoE experts as batched matmuls of per-row gathered expert weights in a form not read "
                "(bmm(W[ids], h.unsqueeze(-1)).squeeze(-1) is): not tiled"
            )
        else:
            continue
        result.consider(node, candidate)
        result.skip(node, reporting.Skip(NAME, candidate, common.path([node]), reason))
    return changed
