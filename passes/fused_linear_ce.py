"""Rewrites lm_head linear -> (temperature) -> log-prob / entropy / cross-entropy into one fused op.

With z = h·Wᵀ / t: logp = z_y − logsumexp(z), H = logsumexp(z) − Σ softmax(z)·z, CE = −logp (masked, reduced),
all from ``tilecompile::fused_linear_logprob(h, W, labels, t, ignore_index, with_entropy)``, which never builds z.

Find: every linear (``graph.as_linear``) is followed forward through its *chain* (casts, temperature, views and
leading-dim slices of the [..., V] logits) into an abstract algebra over the vocabulary: a value is the logits
chain, a vocab-sized linear form ``a·z + b·lse + c`` (log_softmax is ``z − lse``), the same times ``softmax(z)``,
or a per-row combination of lse, z_y (gather), Σp·z (sum of p times a form) and masked CE terms. Any spelling
that reduces to these forms matches: ``log_softmax(z).gather(y)``, ``z.gather(y) − logsumexp(z)``,
``-F.cross_entropy(z, y, reduction="none")``, ``logsumexp(z) − Σ softmax(z)·z``, ``−Σ softmax(z)·log_softmax(z)``,
``−Σ exp(logp)·logp``, ``F.cross_entropy(..., reduction="mean"|"sum", ignore_index=k)`` and ``F.nll_loss``.
Row parts: the same math on parts of the rows (``z[i]``, ``z[a:b]``, ``split``/``chunk``/``unbind``/``narrow`` along a
leading dim) joined back by ``torch.cat`` / ``torch.stack``, or written into a fresh buffer (``buf[a:b] = f(...)``,
``buf[a:b].copy_(...)``) whose every row is written once before it is read, is that math on all the rows: TRL's
row-by-row selective_log_softmax and chunked entropy_from_logits, OpenRLHF's chunked logsumexp. Parts that do not
partition the rows (a row twice, a row left out, out of order, read before written) are skipped with the reason.
Check: a per-row value that leaves the region must be ``α·logp + β·H (+ const)`` (its lse coefficients cancel);
logits or vocab-sized values must not leave it (returned, argmax, sampling, ...). Each check returns a reason.
Rewrite: views/slices on the logits are replayed on h (``logits[:, :-1]`` becomes ``h[:, :-1]``), one op call per
(logits view, labels, ignore_index), and each escaping value is rebuilt from logp / entropy and cast back to the
dtype it had. Mean CE is ``−Σ logp / count(labels != ignore_index)`` (0/0 = nan, as ``F.cross_entropy``).

Temperature: a Python number goes to the op's ``temperature``. A tensor (or symbolic) temperature scales h instead,
``(h / t).to(h.dtype)``, and the op gets 1.0: exact in fp32, one extra rounding of h in bf16 (its grad flows to t).
In-place scaling (verl's ``logits.div_(t)``) is understood when the scaled logits have no other aliases in use.
Autocast: h and W are cast to the linear's output dtype, as autocast does. ``torch.no_grad()`` inside the graph:
values eager computed without grad are detached. A loss checkpointed with its lm_head is rewritten inside the
checkpoint's body; logits passed into a checkpoint (or any higher-order op) are skipped with a reason.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import heapq
import math
import operator
from typing import Any

import torch
import torch.fx as fx
from tilecompile.passes import library_kernels as LK
from tilecompile.passes import loss_aware as LA

from tilecompile import graph as G
from tilecompile import reporting as R
from tilecompile.pipeline import PassContext, PassResult, expect, snapshot_graph

# meta key the tensor_parallel pass sets on the gather of a vocab-parallel lm_head's logits (its ShardSpec)
_VOCAB_GATHER = "tilecompile_tp_vocab"

NAME = "fused_linear_ce"

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_OP_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what the fused op takes for h and W
_LABEL_DTYPES = (torch.int32, torch.int64)
# a gather-based log-prob has no ignored rows (gather on a negative label fails in eager): any negative index will do
_ANY_NEGATIVE = "any-negative"
_DEFAULT_IGNORE = -100
# the ignore_index a lone gather gets: no label equals it, so a negative label is the op's out-of-range error (as
# eager's gather raises) instead of a silent log-prob of 0
_NO_IGNORE = -(2**63)
_SPELLING_OPS = frozenset(
    {"log_softmax", "softmax", "logsumexp", "exp", "gather", "take_along_dim", "cross_entropy", "nll_loss"}
)

_ADVICE = (
    "compile the function that computes the loss from the model's outputs (so the logits stay inside the graph "
    "and have no other use), not only the model, and keep graph breaks out of the way between the two"
)


# ------------------------------------------------------------------------------------------- abstract values


@dataclasses.dataclass(frozen=True)
class Chain:
    """The logits (or a view, slice, cast or temperature-scaled version of them): ``z`` of this node."""

    replay: tuple[fx.Node, ...]  # views/slices from the linear output to here, to replay on h
    scale: float = 1.0  # product of Python-number multipliers (1 / temperature)
    tensor_scales: tuple[tuple[str, Any], ...] = ()  # ("div" | "mul", tensor or symbolic scalar)


@dataclasses.dataclass(frozen=True)
class Vocab:
    """A [..., V] value ``form`` = {"z": a, "lse": b, "one": c} over the chain node ``base``; times softmax(z) when
    ``soft``."""

    base: fx.Node
    form: tuple[tuple[str, float], ...]
    soft: bool


@dataclasses.dataclass(frozen=True)
class Row:
    """A per-row value: Σ coef · term with terms "lse", "spz" (Σ p·z), "one", ("zy", labels) and ("ce", labels,
    ignore_index) (the unreduced CE, −logp masked); [..., 1] when ``keepdim``."""

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
_LOGP = _form(z=1, lse=-1)


class _Reject(Exception):
    """A matched region that cannot be rewritten; the message is the reason for the report."""


# --------------------------------------------------------------------------------------------------- region


@dataclasses.dataclass
class _Region:
    linear: G.Linear
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
        return int(G.hint(G.shape(self.linear.node)[-1]))

    @property
    def vocab_parallel(self) -> Any:
        """The ShardSpec of a vocab-parallel lm_head (``linear.node`` is then the gather of its logits)."""
        return self.linear.node.meta.get(_VOCAB_GATHER)


def _dim_is_last(dim: Any, ndim: int) -> bool:
    if isinstance(dim, list | tuple):
        return len(dim) == 1 and _dim_is_last(dim[0], ndim)
    return G.normalize_dim(dim, ndim) == ndim - 1


def _ndim(node: Any) -> int:
    return len(G.shape(node) or ())


def _scalar(x: Any) -> float | None:
    if isinstance(x, bool):
        return None
    return float(x) if isinstance(x, int | float) else None


def _same_shape(a: tuple | None, b: tuple | None) -> bool:
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


class _Analysis:
    """Walks forward from one linear, giving each node it understands an abstract value."""

    def __init__(self, gm: fx.GraphModule, linear: G.Linear, position: dict[fx.Node, int]) -> None:
        self.gm = gm
        self.r = _Region(linear)
        self.position = position
        self.bases: dict[tuple, fx.Node] = {}
        # preallocated buffers written with parts of region values: buffer -> [(rows, value, buffer's user, node)]
        self.buffers: dict[fx.Node, list[tuple[G.DimSlice | None, Any, fx.Node, fx.Node]]] = {}
        self.wake: list[fx.Node] = []  # nodes to visit that are not users of the node just classified

    # --- entry
    def run(self) -> _Region:
        r = self.r
        lin = r.linear.node
        r.values[lin] = Chain(())
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
            except _Reject as exc:
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
        name = G.op(node)
        x = G.arg(node, 0, "input")
        for a in node.all_input_nodes:
            if a in self.buffers and a not in r.values and not _is_write(node, a):
                if _writes_through(node):
                    return None  # the slice a later copy_ writes into; classified with the copy_
                self.read_buffer(a, node)
        xv = r.values.get(x) if isinstance(x, fx.Node) else None

        if node.op == "call_function" and node.target is operator.setitem and len(node.args) == 3:
            return self.write(node, node.args[0], node.args[2], node.args[1])
        if name == "copy_" and len(node.args) == 2 and not node.kwargs and isinstance(x, fx.Node):
            dest = G.as_dim_slice(x)
            if dest is not None and _writes_through(x):
                return self.write(node, dest.source, node.args[1], dest)
            return self.write(node, x, node.args[1], None)
        if isinstance(xv, Parts) and name == "getitem":
            pc = r.values[xv.parent]
            return Chain((*pc.replay, x, node), pc.scale, pc.tensor_scales)

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
            dim = G.arg(node, 1, "dim")
            if not _dim_is_last(dim, _ndim(x)) or not self._float_dtype_arg(node):
                return None
            form = self.vocab_form(x)
            if form is None or form[1] != _Z:
                if form is not None and name == "log_softmax" and form[1] == _LOGP and not form[2]:
                    return Vocab(form[0], _LOGP, False)
                return None
            r.softmax_family = True
            return Vocab(form[0], _LOGP, False) if name == "log_softmax" else Vocab(form[0], _form(one=1), True)
        if name == "logsumexp" and xv is not None:
            dim, keepdim = G.arg(node, 1, "dim"), G.arg(node, 2, "keepdim", False)
            form = self.vocab_form(x)
            if form is None or form[1] != _Z or form[2] or not _dim_is_last(dim, _ndim(x)):
                return None
            r.softmax_family = True
            return Row(form[0], _form(lse=1), bool(keepdim))
        if name == "exp" and isinstance(xv, Vocab) and not xv.soft and xv.form == _LOGP:
            return Vocab(xv.base, _form(one=1), True)
        if name in ("gather", "take_along_dim") and xv is not None:
            return self.gather(node, name, x)
        if name in ("cross_entropy", "nll_loss") and xv is not None:
            return self.cross_entropy(node, name, x)
        if name == "sum" and xv is not None:
            return self.vocab_sum(node, x, xv)
        if name in ("mul", "div", "add", "sub", "neg"):
            return self.arith(node, name)
        if name in ("squeeze", "unsqueeze") and isinstance(xv, Row):
            out = self.row_dims(node, name, x, xv)
            if out is not None:
                return out
        if name in _RESHAPES and isinstance(xv, Row) and _static(G.shape(node)) and _static(G.shape(x)):
            # per-row values of a reshaped view of the same rows (materialised with a static reshape)
            return Row(xv.base, xv.terms, False)
        if name == "contiguous" and isinstance(xv, Vocab | Row):
            return xv
        if (
            name in _RESHAPES
            and isinstance(xv, Vocab)
            and _static(G.shape(node))
            and _static(G.shape(x))
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
        items, dim = G.arg(node, 0, "tensors"), G.arg(node, 1, "dim", 0)
        if not isinstance(items, list | tuple) or not items or not all(isinstance(i, fx.Node) for i in items):
            return None
        values = [r.values.get(i) for i in items]
        if not all(isinstance(v, Row | Vocab) for v in values):
            return None
        if name == "cat" and len(items) == 1:
            return values[0]  # a copy
        c = G.normalize_dim(dim, _ndim(node))
        if c is None:
            return None
        where, offset = [], 0
        for k, item in enumerate(items):
            if name == "stack":
                where.append((c, k, k + 1, False))
                continue
            size = G.shape(item)[c] if c < _ndim(item) else None
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
        if not isinstance(v, Row | Vocab) or not isinstance(buffer, fx.Node) or G.op(buffer) not in _ALLOCS:
            return None
        if node.users:
            return None
        if isinstance(index, G.DimSlice):  # a copy_ through the slice index.node
            rows, user = index, index.node
        elif node.op == "call_function" and node.target is operator.setitem:
            rows, user = G.index_slice(node, buffer, index), node
            if rows is None:
                return None
        else:
            rows, user = None, node
        want = list(G.shape(buffer) or ())
        if rows is not None:
            want[rows.dim : rows.dim + 1] = [rows.stop - rows.start] if rows.keep else []
        if not _equal_sizes(G.shape(value), tuple(want)):
            return None  # a broadcasting write: not one value per row
        if G.dtype(buffer) != G.dtype(value):
            raise _Reject(
                f"{node.name} writes {G.dtype(value)} values into buffer {buffer.name} of {G.dtype(buffer)}, which "
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
        before, and never after; _Reject otherwise."""
        r = self.r
        writes = self.buffers[buffer]
        written = {user for _, _, user, _ in writes}
        at = self.position[reader]
        for u in buffer.users:
            if u in written:
                if self.position[u] > at:
                    raise _Reject(f"buffer {buffer.name} is read by {reader.name} before {u.name} writes into it")
            elif self.position[u] < at:
                what = "written with values not computed from these logits" if _is_write(u, buffer) else "read"
                raise _Reject(f"buffer {buffer.name} is {what} by {u.name} before all its rows are written")
            elif _is_write(u, buffer) or (G.is_inplace(u) and u.args[0] is buffer):
                raise _Reject(f"buffer {buffer.name} is read by {reader.name} before {u.name} writes into it")
        first = writes[0][0]
        if len(writes) == 1 and (first is None or (first.keep, first.start, first.stop) == (True, 0, _extent(first))):
            value, rows = writes[0][1], G.shape(writes[0][3])  # the whole buffer at once
            r.joins.append("buffer")
        else:
            if any(rows is None for rows, _, _, _ in writes):
                raise _Reject(f"buffer {buffer.name} is written whole and in parts")
            items = [((rows.dim, rows.start, rows.stop, rows.keep), v) for rows, v, _, _ in writes]
            value = self.join(buffer, "buffer", items)
            if value is None:
                raise _Reject(f"buffer {buffer.name} is written with values that are not parts of the logits' rows")
            lead = G.shape(self.part(writes[0][1]).source)
            rows = lead if isinstance(value, Vocab) else (*lead[:-1], *((1,) if value.keepdim else ()))
        if not _equal_sizes(G.shape(buffer), tuple(rows)):
            raise _Reject(f"buffer {buffer.name} of shape {G.shape(buffer)} is not the shape {tuple(rows)} of its rows")
        r.values[buffer] = value
        first = min((r.order.index(user) for _, _, user, _ in writes), default=len(r.order))
        r.order.insert(first, buffer)

    def part(self, v: Any) -> G.DimSlice | None:
        """The rows of a chain node (``cut.source``) that the Row or Vocab value ``v`` is computed from: a slice
        along a leading dim, however spelled (``z[i]``, ``z[a:b]``, ``z.split(k)[i]``, ``narrow``, ...)."""
        r = self.r
        chain = r.chain(v.base) if isinstance(v, Row | Vocab) else None
        core = _core(chain.replay) if chain is not None else ()
        cut = G.as_dim_slice(core[-1]) if core else None
        parent = r.values.get(cut.source) if cut is not None else None
        if not isinstance(parent, Chain) or cut.dim >= _ndim(cut.source) - 1:
            return None
        split = G.op(core[-1]) == "getitem" and G.op(core[-1].args[0]) in G.SPLIT_OPS
        if core[: len(core) - 1 - split] != parent.replay:
            return None
        if (chain.scale, chain.tensor_scales) != (parent.scale, parent.tensor_scales):
            return None
        return cut

    def join(self, node: fx.Node, what: str, items: list[tuple[tuple, Any]]) -> Row | Vocab | None:
        """One value from parts ``(where, value)``, ``where`` = (dim, start, stop, keep) the rows the part lands on:
        the same math on a partition of one chain node's rows is that math on all of them. None when the values
        are not all computed from rows of the logits; _Reject when they are but do not partition them."""
        cuts = [self.part(v) for _, v in items]
        if any(c is None for c in cuts):
            return None
        where = f"{what} {node.name}"
        parent = cuts[0].source
        if any(c.source is not parent for c in cuts):
            raise _Reject(f"{where} joins rows of different views of the logits")
        if len({(c.dim, c.keep) for c in cuts}) != 1:
            raise _Reject(f"{where} joins parts of {parent.name} cut along different dims")
        extent = G.shape(parent)[cuts[0].dim]
        covered = 0
        for start, stop in sorted((c.start, c.stop) for c in cuts):
            if start < covered:
                raise _Reject(f"{where} has rows {start}:{min(stop, covered)} of {parent.name} more than once")
            if start > covered:
                raise _Reject(f"{where} leaves rows {covered}:{start} of {parent.name} out")
            covered = stop
        if covered != extent:
            raise _Reject(f"{where} leaves rows {covered}:{extent} of {parent.name} out")
        for (lands, _), c in zip(items, cuts):
            if lands != (c.dim, c.start, c.stop, c.keep):
                raise _Reject(
                    f"{where} puts rows {c.start}:{c.stop} (dim {c.dim}) of {parent.name} at {lands[1]}:{lands[2]} "
                    f"(dim {lands[0]}): only the rows in their own order are understood"
                )
        merged = None
        for (_, v), c in zip(items, cuts):
            whole = self.whole(v, c)
            if whole is None:
                raise _Reject(f"{where}: the labels of a part are not the same rows of one labels tensor")
            key = (type(whole), whole.base, dict(whole.terms if isinstance(whole, Row) else whole.form))
            flags = whole.keepdim if isinstance(whole, Row) else whole.soft
            if merged is not None and (key, flags) != merged[1]:
                raise _Reject(f"{where} joins parts that compute different things")
            merged = (whole, (key, flags))
        self.r.joins.append(what)
        return merged[0]

    def whole(self, v: Row | Vocab, cut: G.DimSlice) -> Row | Vocab | None:
        """``v`` (computed from the rows ``cut`` of a chain node) as the value over all the rows: the same
        coefficients, the labels of its log-prob terms replaced by the labels tensor they are the same rows of."""
        base = self.base_of(cut.source)
        if isinstance(v, Vocab):
            return Vocab(base, v.form, v.soft)
        lead = G.shape(cut.source)[:-1]
        terms = []
        for k, coef in v.terms:
            if isinstance(k, tuple):
                lc = G.as_dim_slice(k[1])
                if lc is None or (lc.dim, lc.start, lc.stop, lc.keep) != (cut.dim, cut.start, cut.stop, cut.keep):
                    return None
                labels = _canonical_labels(_labels_of(lc.source) or lc.source)
                if not _equal_sizes(G.shape(labels), lead):
                    return None
                k = (k[0], labels, *k[2:])
            terms.append((k, coef))
        return Row(base, tuple(terms), v.keepdim)

    def _float_dtype_arg(self, node: fx.Node) -> bool:
        dtypes = [a for a in (*node.args[2:], node.kwargs.get("dtype")) if isinstance(a, torch.dtype)]
        return all(dt in _FLOAT_DTYPES for dt in dtypes)

    def base_of(self, node: fx.Node) -> fx.Node:
        """One representative per distinct set of logits rows: ``z.float()`` twice, or ``z`` and ``z.view(-1, V)``
        (trailing reshapes keep the rows in order; static shapes only) share one base, so one fused call."""
        v: Chain = self.r.values[node]
        static = _static(G.shape(node))
        replay = _core(v.replay) if static else v.replay
        return self.bases.setdefault((_rows_key(replay), v.scale, v.tensor_scales, static), node)

    def reshaped_base(self, node: fx.Node, base: fx.Node) -> fx.Node:
        c = self.r.chain(base)
        chain = Chain((*c.replay, node), c.scale, c.tensor_scales)
        new = self.bases.setdefault((_rows_key(chain.replay), chain.scale, chain.tensor_scales, False), node)
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
        target = G.cast_target(node)
        if target is not None:
            return xv if target in _FLOAT_DTYPES else None
        if name == "contiguous":
            return xv
        if node.target in ("div_", "mul_", operator.itruediv, operator.imul):
            return self.inplace_scale(node, x, xv)
        if name in G.VIEW_OPS or name in ("getitem", "unflatten", "narrow", "select"):
            if self.leading_only(node, name, x):
                return Chain((*xv.replay, node), xv.scale, xv.tensor_scales)
        if name in G.SPLIT_OPS and x is node.args[0]:
            dim = G.normalize_dim(G.arg(node, 1 if name == "unbind" else 2, "dim", 0), _ndim(x))
            if dim is not None and 0 <= dim < _ndim(x) - 1:
                return Parts(x)
        return None

    def scaled(self, xv: Chain, name: str, other: Any) -> Chain | None:
        s = _scalar(other)
        if s is not None:
            scale = xv.scale * (s if name == "mul" else 1.0 / s) if s != 0 else 0.0
            if not math.isfinite(scale) or scale <= 0:
                return None
            return Chain(xv.replay, scale, xv.tensor_scales)
        if isinstance(other, fx.Node):
            value = G.example_value(other)
            if isinstance(value, torch.Tensor) and value.dim() != 0:
                # keep following the logits, so that the reason is reported if they reach a softmax
                self.r.rejected = self.r.rejected or (
                    f"temperature {other.name} is a tensor of shape {tuple(value.shape)}; only a number or a 0-dim "
                    "tensor can be folded into the fused op"
                )
                return xv
            if isinstance(value, torch.Tensor) and not value.is_floating_point():
                return None
            return Chain(xv.replay, xv.scale, (*xv.tensor_scales, (name, other)))
        return None

    def inplace_scale(self, node: fx.Node, x: fx.Node, xv: Chain) -> str:
        r = self.r
        scaled = self.scaled(
            xv, "mul" if node.target in ("mul_", operator.imul) else "div", node.args[1] if len(node.args) > 1 else None
        )
        if scaled is None or len(node.args) != 2 or node.kwargs:
            raise _Reject(f"in-place {node.target} on the logits ({node.name}) is not a temperature")
        # the mutation is visible through every alias: allow it only where x's ancestors have no other use,
        # and where x itself was not read before it (those readers saw the unscaled logits)
        if any(u in r.values for u in x.users):
            raise _Reject(f"the logits {x.name} are used both before and after the in-place temperature {node.name}")
        cur = x
        while cur is not r.linear.node:
            parent = cur.args[0]
            if len(parent.users) != 1:
                raise _Reject(f"in-place temperature {node.name} mutates logits that have other aliases in use")
            cur = parent
        self.bases = {k: b for k, b in self.bases.items() if b is not x}
        r.values[x] = scaled
        r.values[node] = scaled
        r.order.append(node)
        return "inplace"

    def leading_only(self, node: fx.Node, name: str | None, x: fx.Node) -> bool:
        """``node`` is a view/slice of ``x`` that leaves the last (vocabulary) dim alone."""
        v = self.r.vocab
        xs, ys = G.shape(x), G.shape(node)
        if not xs or not ys or G.hint(xs[-1]) != v or G.hint(ys[-1]) != v:
            return False
        nd = len(xs)
        if name in ("view", "reshape"):
            sizes = _view_sizes(node)
            return sizes is not None and len(sizes) >= 1
        if name == "flatten":
            end = G.arg(node, 2, "end_dim", -1)
            return G.normalize_dim(end, nd) is not None and G.normalize_dim(end, nd) < nd - 1
        if name == "unflatten":
            return (
                G.normalize_dim(G.arg(node, 1, "dim"), nd) is not None
                and G.normalize_dim(G.arg(node, 1, "dim"), nd) < nd - 1
            )
        if name in ("squeeze", "unsqueeze"):
            dim = G.arg(node, 1, "dim")
            if dim is None:
                return name == "squeeze" and all(G.hint(s) not in (None, 1) for s in xs[:-1]) and len(ys) == nd
            nd_ref = nd + 1 if name == "unsqueeze" else nd
            d = G.normalize_dim(dim, nd_ref)
            return d is not None and d < nd_ref - 1
        if name == "contiguous":
            return True
        if name in ("transpose",):
            dims = [G.normalize_dim(G.arg(node, 1, "dim0"), nd), G.normalize_dim(G.arg(node, 2, "dim1"), nd)]
            return all(d is not None and d < nd - 1 for d in dims)
        if name == "permute":
            dims = node.args[1:] if len(node.args) > 2 else G.arg(node, 1, "dims")
            return bool(dims) and G.normalize_dim(list(dims)[-1], nd) == nd - 1
        if name == "getitem":
            return _leading_index(node.args[1], nd)
        if name in ("narrow", "select"):
            cut = G.as_dim_slice(node)
            return cut is not None and cut.dim < nd - 1
        return False

    # --- consumers
    def gather(self, node: fx.Node, name: str, x: fx.Node) -> Row | None:
        r = self.r
        form = self.vocab_form(x)
        if form is None or form[2]:
            return None
        if name == "gather":
            dim, index = G.arg(node, 1, "dim"), G.arg(node, 2, "index")
        else:
            index, dim = G.arg(node, 1, "indices"), G.arg(node, 2, "dim")
        if not isinstance(index, fx.Node) or index in r.values or not _dim_is_last(dim, _ndim(x)):
            return None
        xs, ishape = G.shape(x), G.shape(index)
        if not ishape or G.hint(ishape[-1]) != 1 or not _equal_sizes(ishape[:-1], xs[:-1]):
            raise _Reject(
                f"{node.name} gathers index of shape {ishape} from logits of shape {xs}: only one label per row is "
                "supported"
            )
        if G.dtype(index) not in _LABEL_DTYPES:
            raise _Reject(f"{node.name}: label dtype {G.dtype(index)} is not int32/int64")
        index = _canonical_labels(_labels_of(index) or index)
        a = dict(form[1])
        terms = _combine(_form(lse=a.get("lse", 0), one=a.get("one", 0)), ((("zy", index), a.get("z", 0.0)),))
        return Row(form[0], terms, True)

    def cross_entropy(self, node: fx.Node, name: str, x: fx.Node) -> Any:
        r = self.r
        form = self.vocab_form(x)
        if form is None or form[2] or form[1] != (_Z if name == "cross_entropy" else _LOGP):
            return None
        r.softmax_family = True
        labels = G.arg(node, 1, "target")
        weight = G.arg(node, 2, "weight")
        size_average, reduce = G.arg(node, 3, "size_average"), G.arg(node, 5, "reduce")
        ignore = G.arg(node, 4, "ignore_index", _DEFAULT_IGNORE)
        reduction = G.arg(node, 6, "reduction", "mean")
        smoothing = G.arg(node, 7, "label_smoothing", 0.0) if name == "cross_entropy" else 0.0
        where = f"{name} {node.name}"
        if weight is not None:
            raise _Reject(f"{where} has class weights (the fused op has none)")
        if size_average is not None or reduce is not None:
            raise _Reject(f"{where} uses the legacy size_average/reduce arguments")
        if smoothing:
            raise _Reject(f"{where} has label_smoothing={smoothing} (the fused op has none)")
        if not isinstance(ignore, int) or reduction not in ("none", "mean", "sum"):
            raise _Reject(f"{where}: ignore_index={ignore!r} / reduction={reduction!r} are not constants it knows")
        if not isinstance(labels, fx.Node) or labels in r.values:
            return None
        ldt = G.dtype(labels)
        if ldt is not None and ldt.is_floating_point:
            raise _Reject(f"{where} has floating-point targets {labels.name} (class probabilities), not labels")
        if ldt not in _LABEL_DTYPES:
            raise _Reject(f"{where}: label dtype {ldt} is not int32/int64")
        xs = G.shape(x)
        if len(xs or ()) != 2 or not _equal_sizes(G.shape(labels), xs[:-1]):
            raise _Reject(
                f"{where}: logits of shape {xs} with labels of shape {G.shape(labels)} (needs [N, V] and [N])"
            )
        labels = _canonical_labels(labels)
        if reduction == "none":
            return Row(form[0], ((("ce", labels, ignore), 1.0),), False)
        return Reduced(form[0], labels, ignore, reduction)

    def vocab_sum(self, node: fx.Node, x: fx.Node, xv: Any) -> Row | None:
        if not isinstance(xv, Vocab) or not xv.soft:
            return None
        dim = G.arg(node, 1, "dim")
        keepdim = G.arg(node, 2, "keepdim", False)
        if dim is None or not _dim_is_last(dim, _ndim(x)) or node.kwargs.get("dtype") not in (None, *_FLOAT_DTYPES):
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
                if not _same_shape(G.shape(a), G.shape(b)):
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
            if va.base is not vb.base or va.keepdim != vb.keepdim or not _same_shape(G.shape(a), G.shape(b)):
                return None
            return Row(va.base, _combine(va.terms, vb.terms, sign), va.keepdim)
        # a vocab-sized form plus a keepdim row of lse: z - logsumexp(z, -1, keepdim=True)
        fa, fb = self._vocab_of(a, va), self._vocab_of(b, vb)
        if not _same_shape(G.shape(a)[:-1], G.shape(b)[:-1]):
            return None
        for f, row, s_f, s_row in ((fa, vb, 1.0, sign), (fb, va, sign, 1.0)):
            if f is None or not isinstance(row, Row) or f.soft or not row.keepdim or row.base is not f.base:
                continue
            if {k for k, _ in row.terms} - {"lse", "one"}:
                return None
            return Vocab(f.base, _combine(_scaled(f.form, s_f), row.terms, s_row), False)
        if fa is not None and fb is not None and fa.base is fb.base and fa.soft == fb.soft:
            if not _same_shape(G.shape(a), G.shape(b)):
                return None
            return Vocab(fa.base, _combine(fa.form, fb.form, sign), fa.soft)
        return None

    def _vocab_of(self, node: Any, v: Any) -> Vocab | None:
        if isinstance(v, Chain):
            return Vocab(self.base_of(node), _Z, False)
        return v if isinstance(v, Vocab) else None

    def row_dims(self, node: fx.Node, name: str, x: fx.Node, xv: Row) -> Row | None:
        dim = G.arg(node, 1, "dim")
        nd = _ndim(x)
        if name == "squeeze" and xv.keepdim:
            if dim is None:
                xs = G.shape(x)
                ok = all(G.hint(s) not in (None, 1) for s in xs[:-1])
            else:
                ok = _dim_is_last(dim, nd)
            return Row(xv.base, xv.terms, False) if ok else None
        if name == "unsqueeze" and not xv.keepdim and G.normalize_dim(dim, nd + 1) == nd:
            return Row(xv.base, xv.terms, True)
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


def _extent(cut: G.DimSlice) -> int:
    return G.shape(cut.source)[cut.dim]


def _is_write(node: fx.Node, buffer: fx.Node) -> bool:
    """``buffer[i] = v`` or ``buffer[i].copy_(v)``."""
    if node.op == "call_function" and node.target is operator.setitem and node.args[0] is buffer:
        return True
    return bool(node.args) and node.args[0] is buffer and _writes_through(node)


def _writes_through(node: fx.Node) -> bool:
    """``node`` is a slice that a ``copy_`` writes into (its only use)."""
    if G.op(node) != "getitem" or len(node.users) != 1:
        return False
    user = next(iter(node.users))
    return G.op(user) == "copy_" and user.args[0] is node


def _view_sizes(node: fx.Node) -> list | None:
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
            value = G.example_value(i)
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


# ------------------------------------------------------------------------------------------------- checks


def _check_linear(r: _Region) -> str | None:
    lin = r.linear
    if lin.bias is not None:
        return f"the linear has a bias ({lin.bias.name}); the fused op has none"
    if G.graph_input(lin.weight) is None:
        return f"its weight {lin.weight.name} is computed in the graph, not a graph input (parameter)"
    hd, wd, od = G.dtype(lin.input), G.dtype(lin.weight), G.dtype(lin.node)
    if od not in _OP_DTYPES:
        return f"logits dtype {od} is not supported by the fused op (float16, bfloat16, float32)"
    if hd != od or wd != od:
        # autocast: the linear casts h and W to the logits' dtype; the rewrite casts them the same way
        if not (hd == wd and hd in _FLOAT_DTYPES and od in (torch.float16, torch.bfloat16)):
            return f"h/weight/logits dtypes differ ({hd}, {wd}, {od}) in a way autocast does not explain"
    return None


def _escapes(r: _Region) -> tuple[list[fx.Node], str | None]:
    """Region nodes whose value is used outside the region (to rebuild), or the reason the region cannot be."""
    out: list[fx.Node] = []
    inside = set(r.values)
    for node in r.order:
        v = r.values[node]
        outside = [u for u in node.users if u not in inside]
        if not outside:
            continue
        user = outside[0]
        if isinstance(v, Write):
            return out, f"{node.name}, a write into buffer {v.buffer.name}, is also {_describe_use(user)}"
        if isinstance(v, Chain | Vocab | Parts):
            what = f"{_vocab_name(v)} {node.name} of the logits" if isinstance(v, Vocab) else "the logits"
            if isinstance(user.target, torch._ops.HigherOrderOperator):
                return out, (
                    f"{what} are passed into {user.target.name()} {user.name} (e.g. torch.utils.checkpoint around "
                    "the log-prob or entropy); the fused op saves only 8 bytes a token, so call those without the "
                    "checkpoint, or checkpoint the lm_head together with them"
                )
            return out, f"{what} are also {_describe_use(user)}; the fused op never builds the logits: {_ADVICE}"
        if any(G.is_inplace(u) and u.args and u.args[0] is node for u in outside):
            return out, f"{node.name} is mutated in place outside the matched region"
        if isinstance(v, Row):
            reason = _row_reason(node, v)
            if reason:
                return out, reason
        out.append(node)
    return out, None


def _vocab_name(v: Vocab) -> str:
    if v.soft:
        return "the softmax" if v.form == _form(one=1) else "a softmax-weighted value"
    return "the log-softmax" if v.form == _LOGP else "a vocabulary-sized value"


def _describe_use(user: fx.Node) -> str:
    """ "returned from the graph" or "used by argmax argmax_1", looking through views, casts and detach."""
    via = []
    while user.op != "output" and (G.is_view_like(user) or G.op(user) == "detach" or G.cast_target(user)):
        if len(user.users) != 1:
            break
        via.append(G.op(user) or str(user.target))
        user = next(iter(user.users))
    through = f" (through {', '.join(via)})" if via else ""
    if user.op == "output":
        return f"returned from the graph{through}"
    return f"used by {G.op(user) or user.op} {user.name}{through}"


def _row_reason(node: fx.Node, v: Row) -> str | None:
    t = dict(v.terms)
    lse = t.get("lse", 0.0) + t.get("spz", 0.0) + sum(c for k, c in t.items() if isinstance(k, tuple) and k[0] == "zy")
    if abs(lse) > 1e-12:
        return f"{node.name} uses logsumexp(logits) on its own (not as part of a log-prob or entropy)"
    if not any(k != "one" for k in t):
        return f"{node.name} is a constant of the logits' softmax"
    return None


_RESHAPES = frozenset({"view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "contiguous"})


def _static(shape: tuple | None) -> bool:
    return shape is not None and all(isinstance(s, int) for s in shape)


def _core(replay: tuple[fx.Node, ...]) -> tuple[fx.Node, ...]:
    """``replay`` without its trailing reshapes (which change the logits' leading shape, not their rows' order) and
    slices that keep every row (``z[:, :]``, the one chunk of ``split(k)`` when k covers them all)."""
    while replay:
        last = replay[-1]
        if G.op(last) in _RESHAPES and _static(G.shape(last)):
            replay = replay[:-1]
            continue
        cut = G.as_dim_slice(last)
        if cut is None or not cut.keep or (cut.start, cut.stop) != (0, G.shape(cut.source)[cut.dim]):
            break
        replay = replay[:-1]
        if replay and replay[-1] is last.args[0] and G.op(replay[-1]) in G.SPLIT_OPS:
            replay = replay[:-1]
    return replay


def _rows_key(replay: tuple[fx.Node, ...]) -> tuple:
    """What ``replay`` computes, not which nodes: ``z[i]`` written twice is two getitem nodes of the same rows."""
    return tuple((n.op, n.target, str(n.args[1:]), str(n.kwargs)) for n in replay)


def _canonical_labels(labels: fx.Node) -> fx.Node:
    """The labels before reshapes and same-device ``.to(device)`` (static shapes): ``y.view(-1)`` is ``y``."""
    while _static(G.shape(labels)) and isinstance(labels.args[0] if labels.args else None, fx.Node):
        src = labels.args[0]
        same_device = getattr(G.example_value(src), "device", None) == getattr(G.example_value(labels), "device", 0)
        pure_to = labels.op == "call_method" and labels.target == "to" and G.dtype(src) == G.dtype(labels)
        if not (G.op(labels) in _RESHAPES or (pure_to and same_device)) or not _static(G.shape(src)):
            break
        if G.dtype(src) != G.dtype(labels):  # view(dtype) reinterprets bits
            break
        labels = src
    return labels


def _labels_of(index: fx.Node) -> fx.Node | None:
    """``y`` when ``index`` is ``y.unsqueeze(-1)`` (or ``y[..., None]``), else None (squeeze it)."""
    if G.op(index) == "unsqueeze" and G.normalize_dim(G.arg(index, 1, "dim"), _ndim(index)) == _ndim(index) - 1:
        return index.args[0]
    if G.op(index) == "getitem" and index.args[1] in ((Ellipsis, None), (slice(None), None)) and _ndim(index) == 2:
        return index.args[0]
    return None


# ------------------------------------------------------------------------------------------------ rewrite


class _Builder:
    """Inserts nodes before ``anchor``, fake-running each so its meta carries ``example_value``."""

    def __init__(self, graph: fx.Graph, anchor: fx.Node, fake_mode: Any, meta_from: fx.Node) -> None:
        self.graph, self.anchor, self.fake_mode = graph, anchor, fake_mode
        self.stack = meta_from.meta.get("nn_module_stack")
        self.trace = meta_from.meta.get("stack_trace")
        self.new: list[fx.Node] = []

    def call(self, target: Any, *args: Any, method: bool = False, **kwargs: Any) -> fx.Node:
        with self.graph.inserting_before(self.anchor):
            node = (self.graph.call_method if method else self.graph.call_function)(target, args, kwargs)
        if self.stack is not None:
            node.meta["nn_module_stack"] = dict(self.stack)
        if self.trace is not None:
            node.meta["stack_trace"] = self.trace
        fa, fk = fx.node.map_arg((args, kwargs), G.example_value)
        with self.fake_mode:
            node.meta["example_value"] = getattr(fa[0], target)(*fa[1:], **fk) if method else target(*fa, **fk)
        self.new.append(node)
        return node


def _hoist(node: Any, anchor: fx.Node, position: dict[fx.Node, int]) -> None:
    """Move ``node`` (and what it needs) before ``anchor`` when it is defined later; only pure nodes move."""
    if not isinstance(node, fx.Node) or position.get(node, -1) < position[anchor]:
        return
    if node.op not in ("call_function", "call_method") or G.is_inplace(node) or node.is_impure():
        raise _Reject(f"{node.name} is computed after the log-probs are first used and cannot be moved")
    for a in node.all_input_nodes:
        _hoist(a, anchor, position)
    anchor.prepend(node)
    position[node] = position[anchor] - 0.5


def _replay(b: _Builder, h: fx.Node, node: fx.Node, d: int) -> fx.Node:
    """Apply the view/slice ``node`` (of [..., V] logits) to ``h`` ([..., D])."""
    name = G.op(node)
    if name in ("view", "reshape"):
        sizes = _view_sizes(node)
        sizes = [*sizes[:-1], sizes[-1] if sizes[-1] == -1 else d]
        return b.call(name, h, *sizes, method=True)
    args = (h, *node.args[1:])
    if node.op == "call_method":
        return b.call(node.target, *args, method=True, **node.kwargs)
    return b.call(node.target, *args, **node.kwargs)


def temperature_of(chain: Chain) -> float:
    return 1.0 / chain.scale


def _rewrite(
    gm: fx.GraphModule,
    r: _Region,
    escapes: list[fx.Node],
    settings: Any,
    op: Any,
    tainted: set[fx.Node],
    in_body: bool = False,
) -> R.Rewrite:
    """Insert the fused calls, rebuild each escaping value, erase the region; on _Reject nothing is left behind."""
    new: list[fx.Node] = []
    try:
        return _rewrite_region(gm, r, escapes, settings, op, new, tainted, in_body)
    except _Reject:
        for node in reversed(new):
            if not node.users:
                gm.graph.erase_node(node)
        raise


def _rewrite_region(
    gm, r, escapes, settings, op, new: list[fx.Node], tainted: set[fx.Node], in_body: bool
) -> R.Rewrite:
    graph = gm.graph
    position = {n: i for i, n in enumerate(graph.nodes)}
    inside = set(r.values)
    users = [u for n in escapes for u in n.users if u not in inside]
    anchor = min(users, key=lambda u: position[u])
    # torch.no_grad() inside the graph: the calls run in the anchor's grad mode, switched on around the rewrite
    # when the anchor is under no_grad but some value needs grad; a value eager computed without grad is detached
    modes = _grad_modes(graph)
    no_grad = {n for n in escapes if modes[n] is False}
    switch = modes[anchor] is False and len(no_grad) < len(escapes)
    if switch:
        with graph.inserting_before(anchor):
            new.append(graph.call_function(torch._C._set_grad_enabled, (True,)))
    lin = r.linear
    h, weight = lin.input, lin.weight
    fake_mode = getattr(G.example_value(h), "fake_mode", None)  # the graph's own mode, not the tracing context's
    if fake_mode is None:
        raise _Reject("no fake tensors on the graph to build the rewrite with")
    b = _Builder(graph, anchor, fake_mode, lin.node)
    b.new = new
    d = int(G.shape(weight)[1])
    compute = G.dtype(lin.node)  # the linear's output dtype: h's, or autocast's
    if G.dtype(weight) != compute:
        weight = b.call("to", weight, compute, method=True)

    # which (base, labels, ignore) calls each escaping value needs
    calls: dict[fx.Node, dict[tuple, dict[str, Any]]] = {}
    needs_entropy: set[fx.Node] = set()
    for node in escapes:
        v = r.values[node]
        keys = []
        if isinstance(v, Reduced):
            keys.append((v.labels, v.ignore))
        else:
            for k, _ in v.terms:
                if k == "spz":
                    needs_entropy.add(v.base)
                elif isinstance(k, tuple) and k[0] == "zy":
                    keys.append((k[1], _ANY_NEGATIVE))
                elif isinstance(k, tuple) and k[0] == "ce":
                    keys.append((k[1], k[2]))
        for key in keys:
            calls.setdefault(v.base, {}).setdefault(key, {})
    for base in needs_entropy:
        calls.setdefault(base, {})

    # merge a gather's labels (any negative ignore_index) into a CE call on the same labels with a negative one
    for keyed in calls.values():
        for labels, ignore in list(keyed):
            if ignore != _ANY_NEGATIVE:
                continue
            twin = next((k for k in keyed if k[0] is labels and k[1] != _ANY_NEGATIVE and k[1] < 0), None)
            keyed[(labels, ignore)] = {"alias": twin} if twin else {}

    # the loss-aware mode (grads in the forward) when the escaping values reduce to one scalar loss
    plan, mode = _loss_mode(r, escapes, calls, settings, modes, switch, tainted, gm if in_body else None, anchor)

    # everything the calls read must exist before the anchor: move pure label computations up if needed
    for base, keyed in calls.items():
        for n in (*(t for _, t in r.chain(base).tensor_scales), *(k[0] for k in keyed)):
            _hoist(n, anchor, position)
    for n in plan.externals if plan is not None else ():
        _hoist(n, anchor, position)

    results: dict[fx.Node, dict[Any, Any]] = {}
    n_calls = 0
    rows: list[int] = []
    for base, keyed in calls.items():
        chain = r.chain(base)
        hb = h if G.dtype(h) == compute else b.call("to", h, compute, method=True)
        for view in chain.replay:
            hb = _replay(b, hb, view, d)
        for kind, t in chain.tensor_scales:
            hb = b.call(operator.truediv if kind == "div" else operator.mul, hb, t)
        if chain.tensor_scales:
            hb = b.call("to", hb, compute, method=True)
        device = G.example_value(h).device
        rows.append(math.prod(G.hint(s) or 0 for s in G.shape(hb)[:-1]))
        out: dict[Any, Any] = {"entropy": None}
        todo = [k for k, spec in keyed.items() if "alias" not in spec] or [None]  # None: entropy only
        for key in todo:
            if key is None:
                first = b.call(operator.getitem, hb, (Ellipsis, 0))
                labels, ignore = b.call(torch.full_like, first, _DEFAULT_IGNORE, dtype=torch.int64), _DEFAULT_IGNORE
            else:
                labels, ignore = key
                ignore = _NO_IGNORE if ignore == _ANY_NEGATIVE else ignore
                lead = G.shape(hb)[:-1]
                if not _same_shape(G.shape(labels), lead):
                    if _static(G.shape(labels)) and _static(lead):  # labels of a reshaped view of these rows
                        labels = b.call("reshape", labels, list(lead), method=True)
                    elif _ndim(labels) == len(lead) + 1:  # a gather index [..., 1]
                        labels = b.call(torch.squeeze, labels, -1)
            with_entropy = base in needs_entropy and out["entropy"] is None
            ls = G.shape(labels)
            # the chunk setting of this compile (options= included), not the op's default read from the env
            args = [hb, weight, labels, float(temperature_of(chain)), int(ignore), with_entropy, settings.check_inputs,
                    int(settings.ce_vocab_chunk)]  # fmt: skip
            vp = r.vocab_parallel
            if vp is not None and int(ignore) >= 0:
                raise _Reject(f"ignore_index={ignore}: the vocab-parallel op needs a negative one (logits gathered)")
            with fake_mode:
                expected = (
                    torch.empty(ls, dtype=torch.float32, device=device),
                    torch.empty(ls if with_entropy else (0,), dtype=torch.float32, device=device),
                )
            if vp is not None:  # the local weight's statistics, reduced across the group; no logits gathered
                args = [*args[:6], int(settings.ce_vocab_chunk), vp.group, vp.world, vp.rank]
                fused = b.call(_vocab_parallel_op(), *args)
            elif plan is not None:  # extras and key are set once the loss function is extracted (below)
                detached = [b.call("detach", x, method=True) for x in (hb, weight)]
                args = [*detached, *args[2:7], [], 0, int(settings.ce_loss_block_rows), _grad_backend(settings, device)]
                fused = b.call(_loss_op(), *args)
                with fake_mode:
                    expected = (
                        *expected,
                        torch.empty_like(G.example_value(hb)),
                        torch.empty_like(G.example_value(weight)),
                    )
                loss_call = {"fused": fused, "h": hb, "weight": weight, "entropy": None}
            else:
                fused = b.call(op, *args)
            expect(fused, expected)
            logp = b.call(operator.getitem, fused, 0)
            expect(logp, expected[0])
            n_calls += 1
            if key is not None:
                out[key] = (logp, labels, ignore)
            if with_entropy:
                out["entropy"] = b.call(operator.getitem, fused, 1)
                expect(out["entropy"], expected[1])
            if plan is not None:
                loss_call.update(
                    logp=logp, entropy=out["entropy"], grads=[b.call(operator.getitem, fused, i) for i in (2, 3)]
                )
                for i, g in zip((2, 3), loss_call["grads"]):
                    expect(g, expected[i])
        for key, spec in keyed.items():
            if "alias" in spec:
                out[key] = out[spec["alias"]]
        results[base] = out

    replaced: dict[fx.Node, fx.Node] = {}
    for node in escapes:
        v = r.values[node]
        out = results[v.base]
        if isinstance(v, Reduced):
            logp, labels, ignore = out[(v.labels, v.ignore)]
            total = b.call(torch.neg, b.call(torch.sum, logp))
            if v.reduction == "mean":
                count = b.call(torch.sum, b.call(operator.ne, labels, ignore))
                total = b.call(operator.truediv, total, count)
            value = total
        else:
            value = _row_value(b, v, out)
        want = G.example_value(node)
        if not _same_shape(G.shape(value), tuple(want.shape)):  # a row value of a reshaped view of the base
            value = b.call("reshape", value, list(want.shape), method=True)
        if node in no_grad and (modes[anchor] is not False or switch):
            value = b.call("detach", value, method=True)
        if G.dtype(value) != want.dtype:
            value = b.call("to", value, want.dtype, method=True)
        expect(value, want)
        node.replace_all_uses_with(value)
        replaced[node] = value
    if plan is not None:
        mode = _finish_loss_aware(graph, plan, replaced, loss_call, fake_mode, lin.node)
        if in_body:  # a checkpoint body: keep the op's outputs instead of running the 3 GEMMs again in backward
            gm.meta[_CONTEXT_FN] = _saves_loss_aware_op()
            mode += "; its outputs are saved, not recomputed, by the activation checkpoint around it"

    if switch:
        with graph.inserting_before(anchor):
            new.append(graph.call_function(torch._C._set_grad_enabled, (False,)))

    vp = r.vocab_parallel
    local = lin.node.args[0] if vp is not None else None  # the gather (the region's first node) reads it
    for node in reversed(r.order):
        if node.users:
            raise RuntimeError(f"fused_linear_ce: {node.name} still has users {list(node.users)} after the rewrite")
        graph.erase_node(node)
    if local is not None and not local.users:
        graph.erase_node(local)

    n_rows = max(rows) if rows else 0
    temps = sorted({f"{temperature_of(r.chain(bn)):g}" for bn in calls})
    tensor_t = any(r.chain(bn).tensor_scales for bn in calls)
    spelled = dict.fromkeys(G.op(n) for n in r.order if G.op(n) in _SPELLING_OPS)
    joins = ", ".join(f"{k}" if n == 1 else f"{k} (x{n})" for k, n in collections.Counter(r.joins).items())
    autocast = f"; autocast to {str(compute).replace('torch.', '')}" if compute != G.dtype(h) else ""
    detail = (
        f"{', '.join(dict.fromkeys(_output_name(r.values[n]) for n in escapes))} "
        f"(via {', '.join(spelled)}); temperature {'/'.join(temps)}"
        f"{' (tensor, folded into h)' if tensor_t else ''}{autocast}"
        f"{f'; rows joined from parts by {joins}' if joins else ''}; {n_calls} fused call(s)"
        f"{f'; vocab-parallel over {vp.world} ranks (all_reduce max + sum of the row statistics)' if vp else ''}"
        f"{f'; {mode}' if mode else ''}"
    )
    return R.Rewrite(
        NAME,
        G.module_path(lin.node),
        shapes={"h": (n_rows, d), "weight": tuple(G.shape(lin.weight)), "N/D/V": (n_rows, d, r.vocab)},
        dtypes={"h": str(G.dtype(h)), "weight": str(G.dtype(lin.weight)), "logits": str(G.dtype(lin.node))},
        detail=detail,
    )


def _loss_mode(r, escapes, calls, settings, modes, switch, tainted, body, at) -> tuple[LA.LossPlan | None, str]:
    """(the loss plan, "") for the loss-aware mode, or (None, "recompute mode: <why>") when the region needs grads
    but cannot have it; (None, "") when nothing needs grads (the op then runs its forward only). ``body``: the
    higher-order op body (activation checkpoint) the region is in, or None; ``at``: where the op will run."""
    lin = r.linear
    if not _needs_grad(lin.node):  # no grad needed, or traced under no_grad
        return None, ""
    why = None
    if not settings.ce_loss_aware:
        why = "the loss-aware mode is off (ce_loss_aware=0)"
    elif r.vocab_parallel is not None:
        why = "a vocab-parallel lm_head has no loss-aware mode"
    elif len(calls) != 1 or sum(1 for spec in next(iter(calls.values())).values() if "alias" not in spec) > 1:
        why = "more than one fused call (several label sets or views of the logits)"
    elif switch:
        why = "the log-probs are first used under torch.no_grad()"
    elif body is not None and _CONTEXT_FN in body.meta:
        why = "the checkpoint around it has its own context_fn (selective checkpointing) that would recompute the op"
    else:
        roots = {n: _loss_root(n, r.values[n]) for n in escapes}
        found = LA.find_loss(roots, modes, tainted - set(escapes), r.linear.node.graph)
        if isinstance(found, LA.LossPlan):
            why = LA.check_externals(found, at, modes)
            if why is None:
                return found, ""
        else:
            why = found
    return None, f"recompute mode (4 GEMMs): {why}"


def _loss_root(node: fx.Node, v: Any) -> Any:
    if isinstance(v, Reduced):
        return LA.Lin(True)
    return LA.Tok(("row", str(G.shape(node))), True)


def _finish_loss_aware(graph, plan: LA.LossPlan, replaced, call: dict, fake_mode, meta_from: fx.Node) -> str:
    """Give the loss-aware call its loss function F and route the gradient of S through the op's anchor."""
    from tilecompile.ops.fused_linear_ce import register_loss

    loss = replaced.get(plan.loss, plan.loss)
    fn, externals = LA.extract(graph, (call["logp"], call["entropy"]), loss)
    fused = call["fused"]
    position = {n: i for i, n in enumerate(graph.nodes)}
    for n in externals:  # what the rebuilt values read (labels' count for a mean CE) must precede the call
        _hoist(n, fused, position)
    # the op has no autograd: it reads detached values (an external's own gradient, a value head's or a learnable
    # coefficient's, flows through the loss math, which stays in the graph)
    before = _Builder(graph, fused, fake_mode, meta_from)
    grad_free = [before.call("detach", n, method=True) if _needs_grad(n) else n for n in externals]
    fused.update_arg(7, grad_free)
    fused.update_arg(8, register_loss(fn, fn.code))
    b = _Builder(graph, loss.next, fake_mode, meta_from)
    zero = b.call(_anchor_op(), call["h"], call["weight"], *call["grads"])
    dtype = G.dtype(loss)
    if dtype != torch.float32:  # the anchor is an fp32 zero: adding it must not promote a bf16 / fp16 loss
        zero = b.call("to", zero, dtype, method=True)
    with_anchor = b.call(operator.add, loss, zero)
    expect(with_anchor, G.example_value(loss))
    loss.replace_all_uses_with(with_anchor, delete_user_cb=lambda u: u is not with_anchor)
    return f"loss-aware mode (3 GEMMs: grads in the forward for the loss {plan.loss.name})"


def _grad_backend(settings: Any, device: torch.device) -> str:
    """The torch.compile backend the loss-aware op compiles its per-token gradient with ("eager": none)."""
    choice = settings.ce_loss_grad_compile
    if choice == "auto":
        return "inductor" if device.type == "cuda" and settings.inner == "inductor" else "eager"
    return "eager" if choice == "off" else choice


def _needs_grad(node: fx.Node) -> bool:
    return bool(getattr(G.example_value(node), "requires_grad", False))


# where torch.compile's activation checkpointing looks for a selective-checkpoint policy of a checkpoint body
_CONTEXT_FN = "_checkpoint_context_fn"


def _saves_loss_aware_op() -> Any:
    """A selective-checkpoint context_fn: the loss-aware op's outputs (dh, dW: its 3 GEMMs) are saved, the rest of
    the body is recomputed as plain activation checkpointing does."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    context_fn = functools.partial(create_selective_checkpoint_contexts, _save_loss_aware_policy)
    # AOTAutograd's cache keys a selective checkpoint by its context_fn's cache_hash (without one it bypasses the
    # cache): the policy's source, so an edit of the policy is a new key
    context_fn.cache_hash = _policy_hash()
    return context_fn


@functools.cache
def _policy_hash() -> str:
    import hashlib
    import inspect

    return "tilecompile-" + hashlib.sha256(inspect.getsource(_save_loss_aware_policy).encode()).hexdigest()[:16]


def _save_loss_aware_policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    if op is torch.ops.tilecompile.fused_linear_logprob_loss.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _loss_op() -> Any:
    import tilecompile.ops.fused_linear_ce  # noqa: F401 - registers the op

    return torch.ops.tilecompile.fused_linear_logprob_loss.default


def _anchor_op() -> Any:
    import tilecompile.ops.fused_linear_ce  # noqa: F401 - registers the op

    return torch.ops.tilecompile.loss_anchor.default


def _output_name(v: Any) -> str:
    if isinstance(v, Reduced):
        return f"cross_entropy {v.reduction} (ignore_index={v.ignore})"
    kinds = {"entropy" if k == "spz" else "log-prob" for k, _ in v.terms if k not in ("lse", "one")}
    return " + ".join(sorted(kinds, reverse=True)) if len(kinds) > 1 else kinds.pop()


def _grad_modes(graph: fx.Graph) -> dict[fx.Node, bool | None]:
    """Each node's grad mode as set by ``torch._C._set_grad_enabled`` nodes before it (None: the caller's)."""
    mode, modes = None, {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is torch._C._set_grad_enabled:
            mode = bool(node.args[0])
        modes[node] = mode
    return modes


def _row_value(b: _Builder, v: Row, out: dict[Any, Any]) -> fx.Node:
    t = dict(v.terms)
    parts: list[tuple[fx.Node, float]] = []
    for k, c in t.items():
        if isinstance(k, tuple) and k[0] == "zy":
            parts.append((out[(k[1], _ANY_NEGATIVE)][0], c))  # c · logp (its −c·lse is cancelled by the check)
        elif isinstance(k, tuple) and k[0] == "ce":
            parts.append((out[(k[1], k[2])][0], -c))
        elif k == "spz":
            parts.append((out["entropy"], -c))  # Σ p z = lse − H; the lse parts cancel
    value = None
    for tensor, c in parts:
        term = tensor if c == 1 else b.call(torch.neg, tensor) if c == -1 else b.call(operator.mul, tensor, c)
        value = term if value is None else b.call(operator.add, value, term)
    if t.get("one", 0.0):
        value = b.call(operator.add, value, t["one"])
    if v.keepdim:
        value = b.call(torch.unsqueeze, value, -1)
    return value


# ----------------------------------------------------------------------------------------------------- pass


def _vocab_parallel_op() -> Any:
    from tilecompile.ops.fused_linear_ce import vocab_parallel_logprob

    return vocab_parallel_logprob


def _fused_op() -> tuple[Any, str | None]:
    try:
        import tilecompile.ops.fused_linear_ce  # noqa: F401 - registers the op
    except ImportError as exc:
        if not hasattr(torch.ops.tilecompile, "fused_linear_logprob"):
            return None, f"the fused op is unavailable ({exc})"
    try:
        return torch.ops.tilecompile.fused_linear_logprob.default, None
    except AttributeError as exc:
        return None, f"the fused op is unavailable ({exc})"


def find(gm: fx.GraphModule) -> list[_Region]:
    """Every linear whose output reaches a softmax, logsumexp or cross-entropy, with its analysed region."""
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    regions = []
    for node in gm.graph.nodes:
        lin = G.as_linear(node) or _gathered_linear(node)
        if lin is None or len(G.shape(lin.weight) or ()) != 2 or G.hint(G.shape(lin.weight)[0]) is None:
            continue
        r = _Analysis(gm, lin, position).run()
        if r.softmax_family:
            regions.append(r)
    return regions


def _gathered_linear(node: fx.Node) -> G.Linear | None:
    """The logits of a vocab-parallel lm_head, as ``passes/tensor_parallel.py`` leaves them: all-gathered along the
    vocabulary right after the local linear. Seen as one linear of the whole vocabulary; the rewrite calls the
    vocab-parallel op on the local weight and drops the gather."""
    if _VOCAB_GATHER not in node.meta or not isinstance(node.args[0], fx.Node):
        return None
    lin = G.as_linear(node.args[0])
    if lin is None or len(lin.node.users) != 1:
        return None
    return G.Linear(node, lin.input, lin.weight, lin.bias)


def check(r: _Region) -> tuple[list[fx.Node], str | None]:
    """(the region's nodes whose values are used outside it, None), or ([], the reason it cannot be rewritten)."""
    for reason in (r.rejected, _check_linear(r)):
        if reason:
            return [], reason
    escapes, reason = _escapes(r)
    if reason:
        return [], reason
    if not escapes:
        return [], "nothing computed from the logits is used"
    return escapes, None


def run(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Rewrite every lm_head region of ``gm`` that passes the checks; report the others with their reasons.

    Known library kernels of the same math (TRL's Triton log-prob / entropy, ``passes/library_kernels.py``) are
    first read as their torch math; that expansion is kept only if every one of them is fused, otherwise the graph
    goes back to the kernels (better than the plain math) and the pass runs again without expanding them."""
    kernels = LK.find(gm)
    if not kernels:
        return _run(gm, ctx)
    saved, meta = snapshot_graph(gm.graph), dict(gm.meta)
    wide = []
    for call in kernels:
        fake_mode = getattr(G.example_value(call.logits), "fake_mode", None)
        if fake_mode is None:
            break
        wide.append(LK.expand(call, _Builder(gm.graph, call.node, fake_mode, call.node)))
    G.eliminate_dead_code(gm.graph)  # what only the launches read (their strides, under dynamic shapes) is no use
    result = _run(gm, ctx) if len(wide) == len(kernels) else None
    live = set(gm.graph.nodes)
    if result is not None and not any(n in live for nodes in wide for n in nodes):
        for rewrite in result.rewrites:
            rewrite.detail += f"; read from {len(kernels)} call(s) of TRL's Triton log-prob/entropy kernel (graph-wide)"
        return result
    why = "; ".join(dict.fromkeys(s.reason for s in result.skipped)) if result else "no fake tensors on its logits"
    why = why or "its logits' linear is not an lm_head candidate"
    gm.graph, gm.meta = saved, meta
    gm.recompile()
    result = _run(gm, ctx)
    for call in kernels:
        reason = f"left as is: the lm_head pass did not fuse the math it computes ({why})"
        result.skipped.append(R.Skip(NAME, LK.describe(call), G.module_path(call.node), reason))
    return result


def _run(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    result = PassResult()
    regions = find(gm)
    if not regions:
        return result
    op, unavailable = _fused_op()
    tainted = LA.descendants([r.linear.node for r in regions])
    for r in regions:
        where = G.module_path(r.linear.node)
        candidate = f"linear {r.linear.node.name} -> log-prob/entropy/CE"
        escapes, reason = check(r)
        reason = reason or unavailable
        if reason is None:
            try:
                in_body = ctx.graph_name != "<root>"
                result.rewrites.append(_rewrite(gm, r, escapes, ctx.settings, op, tainted, in_body))
                continue
            except _Reject as exc:  # _rewrite removed what it had inserted (hoisting only moved pure nodes)
                reason = str(exc)
        result.skipped.append(R.Skip(NAME, candidate, where, reason))
    return result
