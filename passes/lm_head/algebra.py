"""The lm_head pass's vocabulary algebra: what the nodes after an lm_head linear compute, by abstract interpretation.

``Analysis(gm, linear, position).run()`` follows the linear's output forward through its *chain* (casts,
temperature, views and leading-dim slices of the [..., V] logits) and gives each node it understands an abstract
value (``Region.values``):

- ``Chain``: the logits z themselves (the views to replay on h, the temperature);
- ``Vocab``: a vocab-sized linear form ``a·z + b·lse + c`` (log_softmax is ``z − lse``), or the same times
  ``softmax(z)`` (``soft``);
- ``Row``: a per-row combination of lse, z_y (gather), Σp·z (sum of p times a form) and masked CE terms;
- ``Reduced``: ``F.cross_entropy(..., reduction="mean" | "sum", ignore_index=k)``, a scalar;
- ``Parts`` / ``Write``: a split of the logits' rows, and a write of region values into rows of a fresh buffer.

Parts of the rows (``z[i]``, ``z[a:b]``, ``split``/``chunk``/``unbind``/``narrow`` along a leading dim) joined back
by ``torch.cat`` / ``torch.stack``, or written into a fresh buffer whose every row is written once before it is
read, are that math on all the rows; parts that do not partition the rows raise ``Reject`` with the reason. What
this module does not understand it leaves without a value: it is then outside the region (``passes/lm_head/__init__.py``
checks what leaves the region and rewrites it).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import operator
from typing import Any

import torch
import torch.fx as fx

from tilecompile import graph as fxgraph
from tilecompile.pass_api import VOCAB_GATHER

# meta key the tensor_parallel pass sets on the gather of a vocab-parallel lm_head's logits (its ShardSpec)

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_LABEL_DTYPES = (torch.int32, torch.int64)
# a gather-based log-prob has no ignored rows (gather on a negative label fails in eager): any negative index will do
ANY_NEGATIVE = "any-negative"
DEFAULT_IGNORE = -100


# ------------------------------------------------------------------------------------------- abstract values


@dataclasses.dataclass(frozen=True)
class Chain:
    """The logits (or a view, slice, cast or temperature-scaled version of them): ``z`` of this node."""

    replay: tuple[fx.Node, ...]  # views/slices from the linear output to here, to replay on h
    scale: float = 1.0  # product of Python-number multipliers (1 / temperature)
    tensor_scales: tuple[tuple[str, Any], ...] = ()  # ("div" | "mul", tensor or symbolic scalar)
    # z = scale · softcap(h·Wᵀ + bias) (times the tensor scales), softcap(u) = c·tanh(u / c), none when c is 0
    bias: fx.Node | None = None  # a [V] vector added to the product (F.linear's, ``+ b``, ``+= b``)
    softcap: float = 0.0

    @property
    def transform(self) -> tuple:
        """What the chain does to the product besides views: equal for chains that are the same logits."""
        return (self.scale, self.tensor_scales, self.bias, self.softcap)


@dataclasses.dataclass(frozen=True)
class Vocab:
    """A [..., V] value ``form`` = {"z": a, "lse": b, "one": c} over the chain node ``base``; times softmax(z) when
    ``soft``."""

    base: fx.Node
    form: tuple[tuple[str, float], ...]
    soft: bool


@dataclasses.dataclass(frozen=True)
class Row:
    """A per-row value: Σ coef · term with terms "lse", "spz" (Σ p·z), "zsum" (Σ_j z_j), "one", ("zy", labels),
    ("ce", labels, ignore_index) (the unreduced CE, −logp masked), ("wce", labels, ignore_index, weight) (the
    same times weight[labels]) and ("smooth", labels, ignore_index) (label smoothing's lse − Σ_j z_j / V, masked);
    [..., 1] when ``keepdim``."""

    base: fx.Node
    terms: tuple[tuple[Any, float], ...]
    keepdim: bool


@dataclasses.dataclass(frozen=True)
class Reduced:
    """``F.cross_entropy(z, labels, reduction="sum" | "mean", ignore_index=k)``: a scalar."""

    base: fx.Node
    labels: fx.Node
    ignore: int
    reduction: str
    smoothing: float = 0.0  # label_smoothing=
    weight: fx.Node | None = None  # class weights [V] (weight=)


@dataclasses.dataclass(frozen=True)
class Argmax:
    """``argmax(z, -1)`` (of the logits, their log-softmax or softmax: the same index), an output of the op."""

    base: fx.Node
    keepdim: bool


@dataclasses.dataclass(frozen=True)
class Parts:
    """The tuple of a ``split`` / ``chunk`` / ``unbind`` of the chain node ``parent`` along a leading dim: each item
    (a getitem) is a chain node of its own, whose rows are a slice of the parent's."""

    parent: fx.Node


@dataclasses.dataclass(frozen=True)
class Write:
    """A write of a region value into rows of the preallocated ``buffer`` (``buf[i:j] = v``, ``buf[i:j].copy_(v)``),
    or the slice of the buffer such a ``copy_`` writes through."""

    buffer: fx.Node


@dataclasses.dataclass(frozen=True)
class Size:
    """``z.size()`` of a chain node, or one of its sizes (``item``) that is the same int in every call
    (``fxgraph.static_size``: a dim Dynamo pinned by a loop over it, ``for i in range(z.shape[0])``): the rewrite puts
    that int where it is used."""

    item: int | None = None


def _combine(x: tuple, y: tuple, sy: float = 1.0) -> tuple:
    out: dict[Any, float] = dict(x)
    for k, v in y:
        out[k] = out.get(k, 0.0) + sy * v
    return tuple((k, v) for k, v in out.items() if v != 0.0)


def _scaled(x: tuple, s: float) -> tuple:
    return tuple((k, v * s) for k, v in x if v * s != 0.0)


def _form(**terms: float) -> tuple:
    return tuple((k, float(v)) for k, v in terms.items() if v != 0)


_Z = _form(z=1)
LOGP = _form(z=1, lse=-1)
SOFTMAX = _form(one=1)  # softmax(z) itself: soft, with the form 1


class Reject(Exception):
    """A matched region that cannot be rewritten; the message is the reason for the report."""


# ---------------------------------------------------------------------------------------------------- region


@dataclasses.dataclass
class Region:
    linear: fxgraph.Linear
    weight_cast: torch.dtype | None = None  # the dtype the graph casts the weight to (``W.t().float()``), if any
    values: dict[fx.Node, Any] = dataclasses.field(default_factory=dict)
    order: list[fx.Node] = dataclasses.field(default_factory=list)  # region nodes in graph order
    softmax_family: bool = False
    rejected: str | None = None
    # bases that are not chain nodes: a dynamic reshape of a log-softmax, whose rows are the chain's rows reshaped
    chains: dict[fx.Node, Chain] = dataclasses.field(default_factory=dict)
    joins: list[str] = dataclasses.field(default_factory=list)  # "cat", "stack", "setitem": rows joined from parts

    def chain(self, base: fx.Node) -> Chain | None:
        v = self.values.get(base)
        return v if isinstance(v, Chain) else self.chains.get(base)

    @property
    def vocab(self) -> int:
        # the logits' width: the weight's rows, or all ranks' rows for a vocab-parallel lm_head's gathered logits
        return int(fxgraph.hint(fxgraph.shape(self.linear.node)[-1]))

    @property
    def vocab_parallel(self) -> Any:
        """The ShardSpec of a vocab-parallel lm_head (``linear.node`` is then the gather of its logits)."""
        return self.linear.node.meta.get(VOCAB_GATHER)


def _dim_is_last(dim: Any, ndim: int) -> bool:
    if isinstance(dim, list | tuple):
        return len(dim) == 1 and _dim_is_last(dim[0], ndim)
    return fxgraph.normalize_dim(dim, ndim) == ndim - 1


def ndim_of(node: Any) -> int:
    return len(fxgraph.shape(node) or ())


def _scalar(x: Any) -> float | None:
    if isinstance(x, bool):
        return None
    return float(x) if isinstance(x, int | float) else None


def same_written_shape(a: tuple | None, b: tuple | None) -> bool:
    """The same sizes, written alike (symbolic sizes by their expression): no guard, unlike ``graph.same_shape``,
    which proves equal sizes that are written differently."""
    return a is not None and b is not None and [str(s) for s in a] == [str(s) for s in b]


def _equal_sizes(a: tuple | None, b: tuple | None) -> bool:
    """Equal shapes; symbolic sizes that are equal now but not provably (``s0`` and ``s1 - 1``) are made so by a
    guard, so a later call where they differ recompiles (and skips) instead of running this rewrite."""
    if a is None or b is None or len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, int) and isinstance(y, int):
            if x != y:
                return False
        elif str(x) != str(y):
            try:
                if not bool(x == y):  # a SymBool: evaluating it installs the guard
                    return False
            except Exception:  # noqa: BLE001 - unbacked or otherwise undecidable: not equal for us
                return False
    return True


class Analysis:
    """Walks forward from one linear, giving each node it understands an abstract value."""

    def __init__(
        self,
        gm: fx.GraphModule,
        linear: fxgraph.Linear,
        position: dict[fx.Node, int],
        weight_cast: torch.dtype | None = None,
    ) -> None:
        self.gm = gm
        self.r = Region(linear, weight_cast)
        self.position = position
        self.bases: dict[tuple, fx.Node] = {}
        # preallocated buffers written with parts of region values: buffer -> [(rows, value, buffer's user, node)]
        self.buffers: dict[fx.Node, list[tuple[fxgraph.DimSlice | None, Any, fx.Node, fx.Node]]] = {}
        self.wake: list[fx.Node] = []  # nodes to visit that are not users of the node just classified

    # --- entry
    def run(self) -> Region:
        r = self.r
        lin = r.linear.node
        bias = r.linear.bias
        if bias is not None and (len(fxgraph.shape(bias) or ()) != 1 or fxgraph.dtype(bias) not in FLOAT_DTYPES[:3]):
            r.rejected = f"the linear's bias {bias.name} is not a [V] float16/bfloat16/float32 vector"
        r.values[lin] = Chain((), bias=bias)
        r.order.append(lin)
        # visit the users of region nodes in graph order (a heap of positions): every region input of a node is
        # decided before the node, and nodes the logits never reach are never looked at
        todo = [(self.position[u], u) for u in lin.users]
        heapq.heapify(todo)
        seen = set(lin.users)
        while todo:
            _, node = heapq.heappop(todo)
            if node in r.values:  # the slice a copy_ writes through, classified with the copy_
                continue
            try:
                value = self.classify(node)
            except Reject as exc:
                r.rejected = r.rejected or str(exc)
                value = None
            if value is None:
                continue
            if value != "inplace":
                r.values[node] = value
                r.order.append(node)
            for u in (*node.users, *self.wake):
                if u not in seen:
                    seen.add(u)
                    heapq.heappush(todo, (self.position[u], u))
            self.wake.clear()
        return r

    # --- classification of one node whose inputs include region values
    def classify(self, node: fx.Node) -> Any:
        r = self.r
        name = fxgraph.op(node)
        x = fxgraph.arg(node, 0, "input")
        for a in node.all_input_nodes:
            if a in self.buffers and a not in r.values and not _is_write(node, a):
                if _writes_through(node):
                    return None  # the slice a later copy_ writes into; classified with the copy_
                self.read_buffer(a, node)
        xv = r.values.get(x) if isinstance(x, fx.Node) else None

        if node.op == "call_function" and node.target is operator.setitem and len(node.args) == 3:
            return self.write(node, node.args[0], node.args[2], node.args[1])
        if name == "copy_" and len(node.args) == 2 and not node.kwargs and isinstance(x, fx.Node):
            dest = fxgraph.as_dim_slice(x)
            if dest is not None and _writes_through(x):
                return self.write(node, dest.source, node.args[1], dest)
            return self.write(node, x, node.args[1], None)
        if isinstance(xv, Size) and xv.item is None and name == "getitem" and isinstance(node.args[1], int):
            item = fxgraph.static_size(fxgraph.example_value(node))
            return Size(item) if item is not None else None
        if isinstance(xv, Parts) and name == "getitem":
            pc = r.values[xv.parent]
            return dataclasses.replace(pc, replay=(*pc.replay, x, node))
        if name == "add" and len(node.args) == 2 and not node.kwargs:
            for c, other in (node.args, node.args[::-1]):
                cv = r.values.get(c) if isinstance(c, fx.Node) else None
                if isinstance(cv, Chain) and isinstance(other, fx.Node) and other not in r.values:
                    return self.biased(cv, other, node)
        if name == "tanh" and isinstance(xv, Chain):
            return self.softcapped(xv, node)

        if name in ("mul", "div") and len(node.args) == 2 and not node.kwargs:
            a, b = node.args
            va, vb = (r.values.get(n) if isinstance(n, fx.Node) else None for n in (a, b))
            if isinstance(va, Chain) and vb is None and b is not a:
                return self.scaled(va, name, b)
            if name == "mul" and isinstance(vb, Chain) and va is None and b is not a:
                return self.scaled(vb, name, a)
        if isinstance(xv, Chain):
            out = self.chain_step(node, name, x, xv)
            if out is not None:
                return out
        if name in ("log_softmax", "softmax") and xv is not None:
            dim = fxgraph.arg(node, 1, "dim")
            if not _dim_is_last(dim, ndim_of(x)) or not self._float_dtype_arg(node):
                return None
            form = self.vocab_form(x)
            if form is None or form[1] != _Z:
                if form is not None and name == "log_softmax" and form[1] == LOGP and not form[2]:
                    return Vocab(form[0], LOGP, False)
                return None
            r.softmax_family = True
            return Vocab(form[0], LOGP, False) if name == "log_softmax" else Vocab(form[0], _form(one=1), True)
        if name == "logsumexp" and xv is not None:
            dim, keepdim = fxgraph.arg(node, 1, "dim"), fxgraph.arg(node, 2, "keepdim", False)
            form = self.vocab_form(x)
            if form is None or form[1] != _Z or form[2] or not _dim_is_last(dim, ndim_of(x)):
                return None
            r.softmax_family = True
            return Row(form[0], _form(lse=1), bool(keepdim))
        if name == "exp" and isinstance(xv, Vocab) and not xv.soft and xv.form == LOGP:
            return Vocab(xv.base, _form(one=1), True)
        if name == "argmax" and xv is not None:
            return self.argmax(node, x)
        if name in ("gather", "take_along_dim") and xv is not None:
            return self.gather(node, name, x)
        if name in ("cross_entropy", "nll_loss") and xv is not None:
            return self.cross_entropy(node, name, x)
        if name in ("sum", "mean") and xv is not None:
            return self.vocab_sum(node, x, xv, name == "mean")
        if name in ("mul", "div", "add", "sub", "neg"):
            return self.arith(node, name)
        if name in ("squeeze", "unsqueeze") and isinstance(xv, Row):
            out = self.row_dims(node, name, x, xv)
            if out is not None:
                return out
        if name in _RESHAPES and isinstance(xv, Row) and is_static(fxgraph.shape(node)) and is_static(fxgraph.shape(x)):
            # per-row values of a reshaped view of the same rows (materialised with a static reshape)
            return Row(xv.base, xv.terms, False)
        if name in ("view", "reshape", "unflatten") and isinstance(xv, Row):
            out = self.unflattened_row(node, xv)
            if out is not None:
                return out
        if name == "contiguous" and isinstance(xv, Vocab | Row):
            return xv
        if (
            name in _RESHAPES
            and isinstance(xv, Vocab)
            and is_static(fxgraph.shape(node))
            and is_static(fxgraph.shape(x))
            and self.leading_only(node, name, x)
        ):
            # a reshaped view of the same rows: log_softmax(z).reshape(-1, V) (outputs are reshaped back)
            return xv
        if name in ("view", "reshape", "flatten") and isinstance(xv, Vocab) and self.leading_only(node, name, x):
            # the same under dynamic shapes, where sizes cannot be compared: the reshape joins the base's chain
            # (replayed on h), so that the rows of the new base are the rows of this view
            return Vocab(self.reshaped_base(node, xv.base), xv.form, xv.soft)
        if name in _JOINS:
            return self.joined(node, _JOINS[name])
        return None

    # --- rows joined from parts: split / chunk / slices of the logits along a leading dim -> cat / stack / buffer
    def joined(self, node: fx.Node, name: str) -> Row | Vocab | None:
        """``torch.cat`` / ``torch.stack`` of per-part values: ``cat([f(z[0:5]), f(z[5:9])])`` is ``f(z)``."""
        r = self.r
        items, dim = fxgraph.arg(node, 0, "tensors"), fxgraph.arg(node, 1, "dim", 0)
        if not isinstance(items, list | tuple) or not items or not all(isinstance(i, fx.Node) for i in items):
            return None
        values = [r.values.get(i) for i in items]
        if not all(isinstance(v, Row | Vocab) for v in values):
            return None
        if name == "cat" and len(items) == 1:
            return values[0]  # a copy
        c = fxgraph.normalize_dim(dim, ndim_of(node))
        if c is None:
            return None
        where, offset = [], 0
        for k, item in enumerate(items):
            if name == "stack":
                where.append((c, k, k + 1, False))
                continue
            size = fxgraph.static_size(fxgraph.shape(item)[c]) if c < ndim_of(item) else None
            if not isinstance(size, int):
                return None
            where.append((c, offset, offset + size, True))
            offset += size
        return self.join(node, name, list(zip(where, values)))

    def write(self, node: fx.Node, buffer: Any, value: Any, index: Any) -> Write | None:
        """``buffer[index] = value`` or ``buffer[index].copy_(value)`` (``index`` a DimSlice, or None for the whole
        buffer) of a region value into a freshly allocated buffer; it becomes a region value when first read."""
        r = self.r
        v = r.values.get(value) if isinstance(value, fx.Node) else None
        if not isinstance(v, Row | Vocab) or not isinstance(buffer, fx.Node) or fxgraph.op(buffer) not in _ALLOCS:
            return None
        if node.users:
            return None
        if isinstance(index, fxgraph.DimSlice):  # a copy_ through the slice index.node
            rows, user = index, index.node
        elif node.op == "call_function" and node.target is operator.setitem:
            rows, user = fxgraph.index_slice(node, buffer, index), node
            if rows is None:
                return None
        else:
            rows, user = None, node
        want = list(fxgraph.shape(buffer) or ())
        if rows is not None:
            want[rows.dim : rows.dim + 1] = [rows.stop - rows.start] if rows.keep else []
        if not _equal_sizes(fxgraph.shape(value), tuple(want)):
            return None  # a broadcasting write: not one value per row
        if fxgraph.dtype(buffer) != fxgraph.dtype(value):
            raise Reject(
                f"{node.name} writes {fxgraph.dtype(value)} values into buffer {buffer.name} of "
                f"{fxgraph.dtype(buffer)}, which "
                "rounds them (the fused op's values would not be rounded)"
            )
        if user is not node:  # the slice the copy_ writes through goes with it
            r.values[user] = Write(buffer)
            r.order.append(user)
        self.buffers.setdefault(buffer, []).append((rows, v, user, value))
        self.wake.extend(buffer.users)
        return Write(buffer)

    def read_buffer(self, buffer: fx.Node, reader: fx.Node) -> None:
        """The first read of a buffer written with parts: its value when every row was written exactly once
        before, and never after; Reject otherwise."""
        r = self.r
        writes = self.buffers[buffer]
        written = {user for _, _, user, _ in writes}
        at = self.position[reader]
        for u in buffer.users:
            if u in written:
                if self.position[u] > at:
                    raise Reject(f"buffer {buffer.name} is read by {reader.name} before {u.name} writes into it")
            elif self.position[u] < at:
                what = "written with values not computed from these logits" if _is_write(u, buffer) else "read"
                raise Reject(f"buffer {buffer.name} is {what} by {u.name} before all its rows are written")
            elif _is_write(u, buffer) or (fxgraph.is_inplace(u) and u.args[0] is buffer):
                raise Reject(f"buffer {buffer.name} is read by {reader.name} before {u.name} writes into it")
        first = writes[0][0]
        if len(writes) == 1 and (first is None or (first.keep, first.start, first.stop) == (True, 0, _extent(first))):
            value, rows = writes[0][1], fxgraph.shape(writes[0][3])  # the whole buffer at once
            r.joins.append("buffer")
        else:
            if any(rows is None for rows, _, _, _ in writes):
                raise Reject(f"buffer {buffer.name} is written whole and in parts")
            items = [((rows.dim, rows.start, rows.stop, rows.keep), v) for rows, v, _, _ in writes]
            value = self.join(buffer, "buffer", items)
            if value is None:
                raise Reject(f"buffer {buffer.name} is written with values that are not parts of the logits' rows")
            lead = fxgraph.shape(self.part(writes[0][1]).source)
            rows = lead if isinstance(value, Vocab) else (*lead[:-1], *((1,) if value.keepdim else ()))
        if not _equal_sizes(fxgraph.shape(buffer), tuple(rows)):
            raise Reject(
                f"buffer {buffer.name} of shape {fxgraph.shape(buffer)} is not the shape {tuple(rows)} of its rows"
            )
        r.values[buffer] = value
        first = min((r.order.index(user) for _, _, user, _ in writes), default=len(r.order))
        r.order.insert(first, buffer)

    def part(self, v: Any) -> fxgraph.DimSlice | None:
        """The rows of a chain node (``cut.source``) that the Row or Vocab value ``v`` is computed from: a slice
        along a leading dim, however spelled (``z[i]``, ``z[a:b]``, ``z.split(k)[i]``, ``narrow``, ...)."""
        r = self.r
        chain = r.chain(v.base) if isinstance(v, Row | Vocab) else None
        core = _core(chain.replay) if chain is not None else ()
        cut = fxgraph.as_dim_slice(core[-1]) if core else None
        parent = r.values.get(cut.source) if cut is not None else None
        if not isinstance(parent, Chain) or cut.dim >= ndim_of(cut.source) - 1:
            return None
        split = fxgraph.op(core[-1]) == "getitem" and fxgraph.op(core[-1].args[0]) in fxgraph.SPLIT_OPS
        if core[: len(core) - 1 - split] != parent.replay:
            return None
        if chain.transform != parent.transform:
            return None
        return cut

    def join(self, node: fx.Node, what: str, items: list[tuple[tuple, Any]]) -> Row | Vocab | None:
        """One value from parts ``(where, value)``, ``where`` = (dim, start, stop, keep) the rows the part lands on:
        the same math on a partition of one chain node's rows is that math on all of them. None when the values
        are not all computed from rows of the logits; Reject when they are but do not partition them."""
        cuts = [self.part(v) for _, v in items]
        if any(c is None for c in cuts):
            return None
        where = f"{what} {node.name}"
        parent = cuts[0].source
        if any(c.source is not parent for c in cuts):
            raise Reject(f"{where} joins rows of different views of the logits")
        if len({(c.dim, c.keep) for c in cuts}) != 1:
            raise Reject(f"{where} joins parts of {parent.name} cut along different dims")
        extent = fxgraph.static_size(fxgraph.shape(parent)[cuts[0].dim])
        covered = 0
        for start, stop in sorted((c.start, c.stop) for c in cuts):
            if start < covered:
                raise Reject(f"{where} has rows {start}:{min(stop, covered)} of {parent.name} more than once")
            if start > covered:
                raise Reject(f"{where} leaves rows {covered}:{start} of {parent.name} out")
            covered = stop
        if covered != extent:
            raise Reject(f"{where} leaves rows {covered}:{extent} of {parent.name} out")
        for (lands, _), c in zip(items, cuts):
            if lands != (c.dim, c.start, c.stop, c.keep):
                raise Reject(
                    f"{where} puts rows {c.start}:{c.stop} (dim {c.dim}) of {parent.name} at {lands[1]}:{lands[2]} "
                    f"(dim {lands[0]}): only the rows in their own order are understood"
                )
        merged = None
        for (_, v), c in zip(items, cuts):
            whole = self.whole(v, c)
            if whole is None:
                raise Reject(f"{where}: the labels of a part are not the same rows of one labels tensor")
            key = (type(whole), whole.base, dict(whole.terms if isinstance(whole, Row) else whole.form))
            flags = whole.keepdim if isinstance(whole, Row) else whole.soft
            if merged is not None and (key, flags) != merged[1]:
                raise Reject(f"{where} joins parts that compute different things")
            merged = (whole, (key, flags))
        self.r.joins.append(what)
        return merged[0]

    def whole(self, v: Row | Vocab, cut: fxgraph.DimSlice) -> Row | Vocab | None:
        """``v`` (computed from the rows ``cut`` of a chain node) as the value over all the rows: the same
        coefficients, the labels of its log-prob terms replaced by the labels tensor they are the same rows of."""
        base = self.base_of(cut.source)
        if isinstance(v, Vocab):
            return Vocab(base, v.form, v.soft)
        lead = fxgraph.shape(cut.source)[:-1]
        terms = []
        for k, coef in v.terms:
            if isinstance(k, tuple):
                lc = fxgraph.as_dim_slice(k[1])
                if lc is None or (lc.dim, lc.start, lc.stop, lc.keep) != (cut.dim, cut.start, cut.stop, cut.keep):
                    return None
                labels = _canonical_labels(_labels_of(lc.source) or lc.source)
                if not _equal_sizes(fxgraph.shape(labels), lead):
                    return None
                k = (k[0], labels, *k[2:])
            terms.append((k, coef))
        return Row(base, tuple(terms), v.keepdim)

    def _float_dtype_arg(self, node: fx.Node) -> bool:
        dtypes = [a for a in (*node.args[2:], node.kwargs.get("dtype")) if isinstance(a, torch.dtype)]
        return all(dt in FLOAT_DTYPES for dt in dtypes)

    def base_of(self, node: fx.Node) -> fx.Node:
        """One representative per distinct set of logits rows: ``z.float()`` twice, or ``z`` and ``z.view(-1, V)``
        (trailing reshapes keep the rows in order; static shapes only) share one base, so one fused call."""
        v: Chain = self.r.values[node]
        static = is_static(fxgraph.shape(node))
        replay = _core(v.replay) if static else v.replay
        return self.bases.setdefault((_rows_key(replay), v.transform, static), node)

    def reshaped_base(self, node: fx.Node, base: fx.Node) -> fx.Node:
        c = self.r.chain(base)
        chain = dataclasses.replace(c, replay=(*c.replay, node))
        new = self.bases.setdefault((_rows_key(chain.replay), chain.transform, False), node)
        self.r.chains.setdefault(new, chain)
        return new

    def vocab_form(self, x: fx.Node) -> tuple[fx.Node, tuple, bool] | None:
        """(base chain node, form, soft) of a region value usable as a vocab-sized tensor."""
        v = self.r.values.get(x)
        if isinstance(v, Chain):
            return self.base_of(x), _Z, False
        if isinstance(v, Vocab):
            return v.base, v.form, v.soft
        return None

    # --- the logits chain: casts, temperature, views, leading-dim slices
    def chain_step(self, node: fx.Node, name: str | None, x: fx.Node, xv: Chain) -> Any:
        target = fxgraph.cast_target(node)
        if target is not None:
            return xv if target in FLOAT_DTYPES else None
        if name == "contiguous":
            return xv
        if name == "size" and node.op == "call_method" and len(node.args) == 1 and not node.kwargs:
            return Size()
        if node.target in ("div_", "mul_", "add_", operator.itruediv, operator.imul, operator.iadd):
            return self.inplace_scale(node, x, xv)
        if name in fxgraph.VIEW_OPS or name in ("getitem", "unflatten", "narrow", "select"):
            if self.leading_only(node, name, x):
                return dataclasses.replace(xv, replay=(*xv.replay, node))
        if name in fxgraph.SPLIT_OPS and x is node.args[0]:
            dim = fxgraph.normalize_dim(fxgraph.arg(node, 1 if name == "unbind" else 2, "dim", 0), ndim_of(x))
            if dim is not None and 0 <= dim < ndim_of(x) - 1:
                return Parts(x)
        return None

    def scaled(self, xv: Chain, name: str, other: Any) -> Chain | None:
        s = _scalar(other)
        if s is not None:
            scale = xv.scale * (s if name == "mul" else 1.0 / s) if s != 0 else 0.0
            if not math.isfinite(scale) or scale <= 0:
                # keep following the logits, so that the reason is reported if they reach a softmax
                how = f"{'multiplied' if name == 'mul' else 'divided'} by {s:g}"
                self.r.rejected = self.r.rejected or (
                    f"the logits are {how}: a temperature that is not finite and > 0 (the fused op's must be)"
                )
                return xv
            return dataclasses.replace(xv, scale=scale)
        if isinstance(other, fx.Node):
            value = fxgraph.example_value(other)
            if isinstance(value, torch.Tensor) and value.dim() != 0:
                # keep following the logits, so that the reason is reported if they reach a softmax
                self.r.rejected = self.r.rejected or (
                    f"temperature {other.name} is a tensor of shape {tuple(value.shape)}; only a number or a 0-dim "
                    "tensor can be folded into the fused op"
                )
                return xv
            if isinstance(value, torch.Tensor) and not value.is_floating_point():
                return None
            if xv.softcap:
                pinned = _pinned_number(other)  # a symbolic float (dynamic=True): the number it is, under a guard
                if pinned is None or pinned <= 0 or not math.isfinite(pinned):
                    raise Reject(f"the logits are scaled by {other.name} after the softcap: only by a number")
                return self.scaled(xv, name, pinned)
            return dataclasses.replace(xv, tensor_scales=(*xv.tensor_scales, (name, other)))
        return None

    def biased(self, xv: Chain, bias: fx.Node, node: fx.Node) -> Chain | None:
        """``z + b`` with b a [V] vector: the bias of the product, when nothing but views came between."""
        if (
            fxgraph.shape(bias) is None
            or len(fxgraph.shape(bias)) != 1
            or fxgraph.hint(fxgraph.shape(bias)[0]) != self.r.vocab
        ):
            return None
        if fxgraph.dtype(bias) not in FLOAT_DTYPES:
            return None
        if xv.scale != 1.0 or xv.tensor_scales or xv.softcap or xv.bias is not None:
            raise Reject(
                f"{node.name} adds {bias.name} to logits that are already scaled, softcapped or biased: only a bias "
                "of the product itself (h·Wᵀ + b) is fused"
            )
        if fxgraph.dtype(bias) == torch.float64:
            raise Reject(f"the bias {bias.name} is float64 (the fused op takes float16, bfloat16 or float32)")
        return dataclasses.replace(xv, bias=bias)

    def softcapped(self, xv: Chain, node: fx.Node) -> Chain:
        """``tanh(s·u)`` of the chain ``s·u`` is ``s·softcap(u)`` with the cap c = 1/s: Gemma's
        ``c·tanh(z / c)`` is the chain with scale 1 and softcap c once the ``· c`` follows."""
        scale = xv.scale
        for kind, t in xv.tensor_scales:  # symbolic floats (dynamic=True) are pinned to their numbers
            pinned = _pinned_number(t)
            if pinned is None or pinned <= 0 or not math.isfinite(pinned):
                scale = float("nan")
                break
            scale = scale * pinned if kind == "mul" else scale / pinned
        xv = dataclasses.replace(xv, scale=scale, tensor_scales=()) if math.isfinite(scale) else xv
        if xv.softcap or xv.tensor_scales or not xv.scale > 0 or not math.isfinite(1.0 / xv.scale):
            raise Reject(
                f"tanh {node.name} of logits that are already softcapped or scaled by a tensor: only one softcap "
                "c·tanh(z / c) with a number c is fused"
            )
        return dataclasses.replace(xv, softcap=1.0 / xv.scale)

    def inplace_scale(self, node: fx.Node, x: fx.Node, xv: Chain) -> str:
        r = self.r
        other = node.args[1] if len(node.args) > 1 else None
        if node.target in ("add_", operator.iadd):
            scaled = self.biased(xv, other, node) if isinstance(other, fx.Node) and other not in r.values else None
        else:
            scaled = self.scaled(xv, "mul" if node.target in ("mul_", operator.imul) else "div", other)
        if scaled is None or len(node.args) != 2 or node.kwargs:
            raise Reject(f"in-place {node.target} on the logits ({node.name}) is not a temperature or a bias")
        # the mutation is visible through every alias: allow it only where x's ancestors have no other use,
        # and where x itself was not read before it (those readers saw the unscaled logits)
        if any(u in r.values for u in x.users):
            raise Reject(f"the logits {x.name} are used both before and after the in-place temperature {node.name}")
        cur = x
        while cur is not r.linear.node:
            parent = cur.args[0]
            if len(parent.users) != 1:
                raise Reject(f"in-place temperature {node.name} mutates logits that have other aliases in use")
            cur = parent
        self.bases = {k: b for k, b in self.bases.items() if b is not x}
        r.values[x] = scaled
        r.values[node] = scaled
        r.order.append(node)
        return "inplace"

    def leading_only(self, node: fx.Node, name: str | None, x: fx.Node) -> bool:
        """``node`` is a view/slice of ``x`` that leaves the last (vocabulary) dim alone."""
        v = self.r.vocab
        xs, ys = fxgraph.shape(x), fxgraph.shape(node)
        if not xs or not ys or fxgraph.hint(xs[-1]) != v or fxgraph.hint(ys[-1]) != v:
            return False
        nd = len(xs)
        if name in ("view", "reshape"):
            sizes = view_sizes(node)
            return sizes is not None and len(sizes) >= 1
        if name == "flatten":
            end = fxgraph.arg(node, 2, "end_dim", -1)
            return fxgraph.normalize_dim(end, nd) is not None and fxgraph.normalize_dim(end, nd) < nd - 1
        if name == "unflatten":
            return (
                fxgraph.normalize_dim(fxgraph.arg(node, 1, "dim"), nd) is not None
                and fxgraph.normalize_dim(fxgraph.arg(node, 1, "dim"), nd) < nd - 1
            )
        if name in ("squeeze", "unsqueeze"):
            dim = fxgraph.arg(node, 1, "dim")
            if dim is None:
                return name == "squeeze" and all(fxgraph.hint(s) not in (None, 1) for s in xs[:-1]) and len(ys) == nd
            nd_ref = nd + 1 if name == "unsqueeze" else nd
            d = fxgraph.normalize_dim(dim, nd_ref)
            return d is not None and d < nd_ref - 1
        if name == "contiguous":
            return True
        if name in ("transpose",):
            dims = [
                fxgraph.normalize_dim(fxgraph.arg(node, 1, "dim0"), nd),
                fxgraph.normalize_dim(fxgraph.arg(node, 2, "dim1"), nd),
            ]
            return all(d is not None and d < nd - 1 for d in dims)
        if name == "permute":
            dims = node.args[1:] if len(node.args) > 2 else fxgraph.arg(node, 1, "dims")
            return bool(dims) and fxgraph.normalize_dim(list(dims)[-1], nd) == nd - 1
        if name == "getitem":
            return _leading_index(node.args[1], nd)
        if name in ("narrow", "select"):
            cut = fxgraph.as_dim_slice(node)
            return cut is not None and cut.dim < nd - 1
        return False

    # --- consumers
    def gather(self, node: fx.Node, name: str, x: fx.Node) -> Row | None:
        r = self.r
        form = self.vocab_form(x)
        if form is None or form[2]:
            return None
        if name == "gather":
            dim, index = fxgraph.arg(node, 1, "dim"), fxgraph.arg(node, 2, "index")
        else:
            index, dim = fxgraph.arg(node, 1, "indices"), fxgraph.arg(node, 2, "dim")
        if not isinstance(index, fx.Node) or index in r.values or not _dim_is_last(dim, ndim_of(x)):
            return None
        xs, ishape = fxgraph.shape(x), fxgraph.shape(index)
        if not ishape or fxgraph.hint(ishape[-1]) != 1 or not _equal_sizes(ishape[:-1], xs[:-1]):
            raise Reject(
                f"{node.name} gathers index of shape {ishape} from logits of shape {xs}: only one label per row is "
                "supported"
            )
        if fxgraph.dtype(index) not in _LABEL_DTYPES:
            raise Reject(f"{node.name}: label dtype {fxgraph.dtype(index)} is not int32/int64")
        index = _canonical_labels(_labels_of(index) or index)
        a = dict(form[1])
        terms = _combine(_form(lse=a.get("lse", 0), one=a.get("one", 0)), ((("zy", index), a.get("z", 0.0)),))
        return Row(form[0], terms, True)

    def cross_entropy(self, node: fx.Node, name: str, x: fx.Node) -> Any:
        r = self.r
        form = self.vocab_form(x)
        if form is None or form[2] or form[1] != (_Z if name == "cross_entropy" else LOGP):
            return None
        r.softmax_family = True
        labels = fxgraph.arg(node, 1, "target")
        weight = fxgraph.arg(node, 2, "weight")
        size_average, reduce = fxgraph.arg(node, 3, "size_average"), fxgraph.arg(node, 5, "reduce")
        ignore = fxgraph.arg(node, 4, "ignore_index", DEFAULT_IGNORE)
        reduction = fxgraph.arg(node, 6, "reduction", "mean")
        smoothing = fxgraph.arg(node, 7, "label_smoothing", 0.0) if name == "cross_entropy" else 0.0
        where = f"{name} {node.name}"
        if size_average is not None or reduce is not None:
            raise Reject(f"{where} uses the legacy size_average/reduce arguments")
        if weight is not None:
            ws = fxgraph.shape(weight) if isinstance(weight, fx.Node) else None
            if ws is None or len(ws) != 1 or fxgraph.hint(ws[0]) != r.vocab or weight in r.values:
                raise Reject(f"{where} has class weights that are not a [V] tensor")
            if fxgraph.dtype(weight) not in FLOAT_DTYPES:
                raise Reject(f"{where} has class weights of dtype {fxgraph.dtype(weight)}")
        if not isinstance(smoothing, int | float) or isinstance(smoothing, bool) or not 0.0 <= smoothing <= 1.0:
            raise Reject(f"{where} has label_smoothing={smoothing!r}, not a number in [0, 1]")
        if smoothing and weight is not None:
            raise Reject(
                f"{where} has class weights and label_smoothing={smoothing} together (its smoothing term is a "
                "weighted sum over the vocabulary, which the fused op does not compute)"
            )
        smoothing = float(smoothing)
        ignore, reduction = _pinned(ignore), _pinned(reduction)
        if not isinstance(ignore, int) or reduction not in ("none", "mean", "sum"):
            raise Reject(f"{where}: ignore_index={ignore!r} / reduction={reduction!r} are not constants it knows")
        if not isinstance(labels, fx.Node) or labels in r.values:
            return None
        ldt = fxgraph.dtype(labels)
        if ldt is not None and ldt.is_floating_point:
            raise Reject(f"{where} has floating-point targets {labels.name} (class probabilities), not labels")
        if ldt not in _LABEL_DTYPES:
            raise Reject(f"{where}: label dtype {ldt} is not int32/int64")
        xs = fxgraph.shape(x)
        if len(xs or ()) != 2 or not _equal_sizes(fxgraph.shape(labels), xs[:-1]):
            raise Reject(
                f"{where}: logits of shape {xs} with labels of shape {fxgraph.shape(labels)} (needs [N, V] and [N])"
            )
        labels = _canonical_labels(labels)
        if reduction == "none":
            if weight is not None:
                return Row(form[0], ((("wce", labels, ignore, weight), 1.0),), False)
            terms = _combine(((("ce", labels, ignore), 1.0 - smoothing),), ((("smooth", labels, ignore), smoothing),))
            return Row(form[0], terms, False)
        return Reduced(form[0], labels, ignore, reduction, smoothing, weight)

    def argmax(self, node: fx.Node, x: fx.Node) -> Argmax | None:
        """The index of the largest logit: the same for every increasing form of z (log-softmax, softmax)."""
        form = self.vocab_form(x)
        dim, keepdim = fxgraph.arg(node, 1, "dim"), fxgraph.arg(node, 2, "keepdim", False)
        if form is None or dim is None or not _dim_is_last(dim, ndim_of(x)):
            return None
        coef = dict(form[1])
        if (form[2] and form[1] != SOFTMAX) or (not form[2] and coef.get("z", 0.0) <= 0):
            return None
        return Argmax(form[0], bool(keepdim))

    def vocab_sum(self, node: fx.Node, x: fx.Node, xv: Any, mean: bool = False) -> Row | None:
        dim = fxgraph.arg(node, 1, "dim")
        keepdim = fxgraph.arg(node, 2, "keepdim", False)
        if dim is None or not _dim_is_last(dim, ndim_of(x)) or node.kwargs.get("dtype") not in (None, *FLOAT_DTYPES):
            return None
        form = self.vocab_form(x)
        if form is not None and not form[2]:
            # Σ_j (a z_j + b lse + c) = a Σz + V (b lse + c): label smoothing's mean log-prob, a linear form
            a, n = dict(form[1]), self.r.vocab
            terms = _form(zsum=a.get("z", 0), lse=a.get("lse", 0) * n, one=a.get("one", 0) * n)
            return Row(form[0], _scaled(terms, 1.0 / n) if mean else terms, bool(keepdim))
        if not isinstance(xv, Vocab) or not xv.soft or mean:
            return None
        a = dict(xv.form)
        # Σ_j p_j (a z_j + b lse + c) = a Σ p z + b lse + c
        return Row(xv.base, _form(spz=a.get("z", 0), lse=a.get("lse", 0), one=a.get("one", 0)), bool(keepdim))

    def arith(self, node: fx.Node, name: str) -> Any:
        r = self.r
        if node.kwargs or (name != "neg" and len(node.args) != 2):
            return None
        if name == "neg":
            v = r.values.get(node.args[0])
            return _scale_value(v, -1.0)
        a, b = node.args
        va, vb = (
            r.values.get(a) if isinstance(a, fx.Node) else None,
            r.values.get(b) if isinstance(b, fx.Node) else None,
        )
        if name in ("mul", "div"):
            if va is not None and vb is None and _scalar(b) is not None:
                s = _scalar(b)
                if name == "div" and s == 0:
                    return None
                return _scale_value(va, s if name == "mul" else 1.0 / s)
            if name == "mul" and vb is not None and va is None and _scalar(a) is not None:
                return _scale_value(vb, _scalar(a))
            if name == "mul" and va is not None and vb is not None:
                fa, fb = self._vocab_of(a, va), self._vocab_of(b, vb)
                if fa is None or fb is None or fa.base is not fb.base or fa.soft == fb.soft:
                    return None
                if not same_written_shape(fxgraph.shape(a), fxgraph.shape(b)):
                    return None
                soft, plain = (fa, fb) if fa.soft else (fb, fa)
                coef = dict(soft.form)
                if set(coef) != {"one"}:
                    return None
                return Vocab(soft.base, _scaled(plain.form, coef["one"]), True)
            return None
        sign = 1.0 if name == "add" else -1.0
        if va is None or vb is None:
            # a constant added to a row value
            if va is not None and _scalar(b) is not None and isinstance(va, Row):
                return Row(va.base, _combine(va.terms, _form(one=_scalar(b)), sign), va.keepdim)
            if vb is not None and _scalar(a) is not None and isinstance(vb, Row):
                return Row(vb.base, _combine(_scaled(vb.terms, sign), _form(one=_scalar(a))), vb.keepdim)
            return None
        if isinstance(va, Row) and isinstance(vb, Row):
            if (
                va.base is not vb.base
                or va.keepdim != vb.keepdim
                or not same_written_shape(fxgraph.shape(a), fxgraph.shape(b))
            ):
                return None
            return Row(va.base, _combine(va.terms, vb.terms, sign), va.keepdim)
        # a vocab-sized form plus a keepdim row of lse: z - logsumexp(z, -1, keepdim=True)
        fa, fb = self._vocab_of(a, va), self._vocab_of(b, vb)
        if not same_written_shape(fxgraph.shape(a)[:-1], fxgraph.shape(b)[:-1]):
            return None
        for f, row, s_f, s_row in ((fa, vb, 1.0, sign), (fb, va, sign, 1.0)):
            if f is None or not isinstance(row, Row) or f.soft or not row.keepdim or row.base is not f.base:
                continue
            if {k for k, _ in row.terms} - {"lse", "one"}:
                return None
            return Vocab(f.base, _combine(_scaled(f.form, s_f), row.terms, s_row), False)
        if fa is not None and fb is not None and fa.base is fb.base and fa.soft == fb.soft:
            if not same_written_shape(fxgraph.shape(a), fxgraph.shape(b)):
                return None
            return Vocab(fa.base, _combine(fa.form, fb.form, sign), fa.soft)
        return None

    def _vocab_of(self, node: Any, v: Any) -> Vocab | None:
        if isinstance(v, Chain):
            return Vocab(self.base_of(node), _Z, False)
        return v if isinstance(v, Vocab) else None

    def unflattened_row(self, node: fx.Node, xv: Row) -> Row | None:
        """Per-row values of a flattened view of the logits, reshaped back to the rows it was flattened from:
        ``z.view(-1, V).logsumexp(-1).view(z.shape[:-1])`` is the logsumexp of z's rows under dynamic shapes too
        (reshapes keep the rows' row-major order; sizes equal only at their hints, as the labels' own symbols, are
        made equal by a guard). Values without labels only: the labels of a flattened view are flat."""
        chain = self.r.chain(xv.base)
        if xv.keepdim or chain is None or not chain.replay or any(isinstance(k, tuple) for k, _ in xv.terms):
            return None
        flat = chain.replay[-1]
        parent = flat.args[0] if fxgraph.op(flat) in ("view", "reshape", "flatten") and flat.args else None
        pv = self.r.values.get(parent) if isinstance(parent, fx.Node) else None
        if not isinstance(pv, Chain) or pv.replay != chain.replay[:-1]:
            return None
        if pv.transform != chain.transform:
            return None
        if not _equal_sizes(fxgraph.shape(node), fxgraph.shape(parent)[:-1]):
            return None
        return Row(self.base_of(parent), xv.terms, False)

    def row_dims(self, node: fx.Node, name: str, x: fx.Node, xv: Row) -> Row | None:
        dim = fxgraph.arg(node, 1, "dim")
        nd = ndim_of(x)
        if name == "squeeze" and xv.keepdim:
            if dim is None:
                xs = fxgraph.shape(x)
                ok = all(fxgraph.hint(s) not in (None, 1) for s in xs[:-1])
            else:
                ok = _dim_is_last(dim, nd)
            return Row(xv.base, xv.terms, False) if ok else None
        if name == "unsqueeze" and not xv.keepdim and fxgraph.normalize_dim(dim, nd + 1) == nd:
            return Row(xv.base, xv.terms, True)
        return None


def _pinned(x: Any) -> Any:
    """A symbolic int that names an index or a mode (``ignore_index`` passed into the compiled function, under
    dynamic shapes) as the int it is in this call, under a guard: a call with another value recompiles (and is
    fused for its own value). Anything else unchanged."""
    value = fxgraph.example_value(x) if isinstance(x, fx.Node) else x
    if not isinstance(value, torch.SymInt):
        return x
    from torch.fx.experimental.symbolic_shapes import guard_int

    try:
        return guard_int(value)
    except Exception:  # noqa: BLE001 - unbacked (data-dependent): no value to pin, left as it is
        return x


def _pinned_number(x: Any) -> float | None:
    """A symbolic scalar (a Python float Dynamo made an input under dynamic shapes) as the number it is in this
    call, under a guard (a call with another value recompiles); None for a tensor or what cannot be pinned."""
    value = fxgraph.example_value(x) if isinstance(x, fx.Node) else x
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, torch.SymFloat | torch.SymInt):
        return None
    from torch.fx.experimental.symbolic_shapes import guard_float, guard_int

    try:
        return float(guard_float(value) if isinstance(value, torch.SymFloat) else guard_int(value))
    except Exception:  # noqa: BLE001 - unbacked (data-dependent): no number to pin
        return None


def _scale_value(v: Any, s: float | None) -> Any:
    if s is None or v is None:
        return None
    if isinstance(v, Row):
        return Row(v.base, _scaled(v.terms, s), v.keepdim)
    if isinstance(v, Vocab):
        return Vocab(v.base, _scaled(v.form, s), v.soft)
    return None


_JOINS = {"cat": "cat", "concat": "cat", "concatenate": "cat", "stack": "stack"}
# fresh allocations: a buffer whose every row is written before it is read may start as any of them
_ALLOCS = frozenset(
    {"zeros", "empty", "ones", "full", "new_zeros", "new_empty", "new_ones", "new_full", "zeros_like", "empty_like"}
)


def _extent(cut: fxgraph.DimSlice) -> int | None:
    return fxgraph.static_size(fxgraph.shape(cut.source)[cut.dim])


def _is_write(node: fx.Node, buffer: fx.Node) -> bool:
    """``buffer[i] = v`` or ``buffer[i].copy_(v)``."""
    if node.op == "call_function" and node.target is operator.setitem and node.args[0] is buffer:
        return True
    return bool(node.args) and node.args[0] is buffer and _writes_through(node)


def _writes_through(node: fx.Node) -> bool:
    """``node`` is a slice that a ``copy_`` writes into (its only use)."""
    if fxgraph.op(node) != "getitem" or len(node.users) != 1:
        return False
    user = next(iter(node.users))
    return fxgraph.op(user) == "copy_" and user.args[0] is node


def view_sizes(node: fx.Node) -> list | None:
    if node.kwargs and set(node.kwargs) - {"shape", "size"}:
        return None
    if node.kwargs:
        sizes = next(iter(node.kwargs.values()))
        return list(sizes) if isinstance(sizes, list | tuple) else None
    rest = node.args[1:]
    if len(rest) == 1 and isinstance(rest[0], list | tuple | torch.Size):
        return list(rest[0])
    if any(isinstance(s, torch.dtype) for s in rest):
        return None
    return list(rest)


def _leading_index(index: Any, ndim: int) -> bool:
    """A basic index (ints, slices, one Ellipsis) that leaves the last dim whole."""
    items = index if isinstance(index, tuple) else (index,)
    if not all(isinstance(i, slice | int | fx.Node) or i is Ellipsis for i in items):
        return False
    covered = 0
    for i in items:
        if isinstance(i, fx.Node):
            value = fxgraph.example_value(i)
            if isinstance(value, torch.Tensor):
                # advanced indexing of leading dims (a row mask or row indices) replays on h unchanged
                covered += value.dim() if value.dtype == torch.bool else 1
                continue
            if not isinstance(value, int | torch.SymInt):
                return False
        covered += i is not Ellipsis
    if sum(i is Ellipsis for i in items) > 1:
        return False
    if Ellipsis in items:
        after = items[items.index(Ellipsis) + 1 :]
        return not after or _full_slice(after[-1])
    return covered < ndim or (covered == ndim and _full_slice(items[-1]))


def _full_slice(i: Any) -> bool:
    return isinstance(i, slice) and i.start is None and i.stop is None and i.step in (None, 1)


# ------------------------------------------------------------------------------------------- rows and labels

_RESHAPES = frozenset({"view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "contiguous"})


def is_static(shape: tuple | None) -> bool:
    """Every size an int, or pinned to one by a guard (``fxgraph.static_size``): the same shape in every call."""
    return shape is not None and all(fxgraph.static_size(s) is not None for s in shape)


def _core(replay: tuple[fx.Node, ...]) -> tuple[fx.Node, ...]:
    """``replay`` without its trailing reshapes (which change the logits' leading shape, not their rows' order) and
    slices that keep every row (``z[:, :]``, the one chunk of ``split(k)`` when k covers them all)."""
    while replay:
        last = replay[-1]
        if fxgraph.op(last) in _RESHAPES and is_static(fxgraph.shape(last)):
            replay = replay[:-1]
            continue
        cut = fxgraph.as_dim_slice(last)
        if cut is None or not cut.keep or (cut.start, cut.stop) != (0, fxgraph.shape(cut.source)[cut.dim]):
            break
        replay = replay[:-1]
        if replay and replay[-1] is last.args[0] and fxgraph.op(replay[-1]) in fxgraph.SPLIT_OPS:
            replay = replay[:-1]
    return replay


def _rows_key(replay: tuple[fx.Node, ...]) -> tuple:
    """What ``replay`` computes, not which nodes: ``z[i]`` written twice is two getitem nodes of the same rows."""
    return tuple((n.op, n.target, str(n.args[1:]), str(n.kwargs)) for n in replay)


def _canonical_labels(labels: fx.Node) -> fx.Node:
    """The labels before reshapes and same-device ``.to(device)`` (static shapes): ``y.view(-1)`` is ``y``."""
    while is_static(fxgraph.shape(labels)) and isinstance(labels.args[0] if labels.args else None, fx.Node):
        src = labels.args[0]
        same_device = getattr(fxgraph.example_value(src), "device", None) == getattr(
            fxgraph.example_value(labels), "device", 0
        )
        pure_to = labels.op == "call_method" and labels.target == "to" and fxgraph.dtype(src) == fxgraph.dtype(labels)
        if not (fxgraph.op(labels) in _RESHAPES or (pure_to and same_device)) or not is_static(fxgraph.shape(src)):
            break
        if fxgraph.dtype(src) != fxgraph.dtype(labels):  # view(dtype) reinterprets bits
            break
        labels = src
    return labels


def _labels_of(index: fx.Node) -> fx.Node | None:
    """``y`` when ``index`` is ``y.unsqueeze(-1)`` (or ``y[..., None]``), else None (squeeze it)."""
    if (
        fxgraph.op(index) == "unsqueeze"
        and fxgraph.normalize_dim(fxgraph.arg(index, 1, "dim"), ndim_of(index)) == ndim_of(index) - 1
    ):
        return index.args[0]
    if (
        fxgraph.op(index) == "getitem"
        and index.args[1] in ((Ellipsis, None), (slice(None), None))
        and ndim_of(index) == 2
    ):
        return index.args[0]
    return None
