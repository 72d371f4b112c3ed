"""What an attention mask computed in the graph is, found by abstract interpretation of the nodes that build it.

An SDPA mask built from positions is a pure function of (batch b, query i, key j) and per-token [B, N] tensors.
``analyze(mask_node, n)`` walks the nodes that compute it and gives each an abstract value:

- ``Num``: an integer linear form Σ coef·base + const over bases ``Idx(axis)`` (the index along a tensor axis,
  as an arange broadcast there gives) and ``Tok(node, axis, batch_axis)`` (a per-token tensor ``node`` [B, N]
  read at the index along ``axis``, and the batch index along ``batch_axis``);
- ``Bool``: a formula of comparisons of such forms, truth values of boolean per-token tensors, and/or/not.

Axes are counted from the right in the frame of the node's own shape, so broadcasting keeps them and views
(``[:, None]``, ``unsqueeze``, ``expand``) remap them; a slice ``[a:b]`` reads the index from a on (a slice that
provably keeps its whole axis, as transformers 4.57's ``mask[:, :, :, : key.shape[-2]]``, is the tensor itself; one
that would cut a per-token tensor is a reason). Per-token tensors whose values cannot be folded (an input's
``position_ids``, a padding mask, document ids computed from them) stay opaque and become the rewrite's inputs;
those that can be folded (``arange + 0``, ``cumsum(diff(arange) != 1)`` = 0) are folded, which is how HF's
packed-sequence detection over an in-graph arange is proven to be no constraint at all.

The formula is then read as a conjunction of the supported atoms, in the final mask frame [..., N_q, N_kv]:
``lo <= c_q - c_kv <= hi`` (c: the index, or one per-token position tensor), ``doc_q == doc_kv``, ``valid_kv``,
and chunks: ``(i_q + R) // k == (i_kv + R) // k`` (``FloorDiv`` values; R a constant plus per-row [B] tensors read
at the batch index, ``Row``: HF's chunked_overlay less each row's left padding), documents the pass builds.
Anything else (a disjunction, a head-dependent mask, a key offset, ...) is a reason, not a guess.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any

import torch
import torch.fx as fx

from tilecompile import graph as fxgraph

# ------------------------------------------------------------------------------------------------ abstract values


@dataclasses.dataclass(frozen=True)
class Idx:
    axis: int  # negative: counted from the right


@dataclasses.dataclass(frozen=True)
class Tok:
    node: fx.Node
    axis: int  # token axis
    batch_axis: int | None  # None: the tensor has no batch dimension (or it is read at batch 0 of a size-1 one)


@dataclasses.dataclass(frozen=True)
class Row:
    node: fx.Node  # a per-row [B] integer tensor (HF's left-padding counts), read at the batch index along ``axis``
    axis: int


Base = Idx | Tok | Row


@dataclasses.dataclass(frozen=True)
class Num:
    terms: tuple[tuple[Base, int], ...]  # sorted, no zero coefficients
    const: int

    @staticmethod
    def of(terms: dict, const: int) -> Num:
        return Num(tuple(sorted(((b, c) for b, c in terms.items() if c), key=repr)), const)

    @property
    def is_const(self) -> bool:
        return not self.terms

    def add(self, other: Num, sign: int = 1) -> Num:
        terms = dict(self.terms)
        for b, c in other.terms:
            terms[b] = terms.get(b, 0) + sign * c
        return Num.of(terms, self.const + sign * other.const)

    def scale(self, k: int) -> Num:
        return Num.of({b: c * k for b, c in self.terms}, self.const * k)


@dataclasses.dataclass(frozen=True)
class FloorDiv:
    """``num // k`` for a literal k > 0: only ever compared for equality between query and key (HF's
    ``chunked_overlay``: ``(kv - left_pad[b]) // C == (q - left_pad[b]) // C``)."""

    num: Num
    k: int


@dataclasses.dataclass(frozen=True)
class Bool:
    kind: str  # "const", "cmp", "truth", "chunk" (FloorDiv equality: num_a, num_b, k), "and", "or", "not"
    args: tuple = ()

    @staticmethod
    def const(v: bool) -> Bool:
        return Bool("const", (bool(v),))


TRUE, FALSE = Bool.const(True), Bool.const(False)


class NotIndexArithmetic(Exception):
    """The mask (or a node it is built from) is not something this module can read; the message says which."""


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Chunks as documents: doc(b, t) = (t + Σ coef · row[b] + const) // k, t the index, built by the pass from
    ``index`` (an arange of the mask's graph, starting at ``start``) and the per-row [B] tensors of ``rows``."""

    index: fx.Node
    start: int
    rows: tuple[tuple[fx.Node, int], ...]
    const: int
    k: int

    def describe(self) -> str:
        terms = "".join(f" {'+' if c > 0 else '-'} {abs(c) if abs(c) != 1 else ''}{n.name}[b]" for n, c in self.rows)
        const = f" {'+' if self.const > 0 else '-'} {abs(self.const)}" if self.const else ""
        return f"same chunk (index{terms}{const}) // {self.k}"


@dataclasses.dataclass(frozen=True)
class MaskSpec:
    """``lo <= c_q - c_kv <= hi`` (None: unbounded; c = ``pos`` or the index), ``doc_q == doc_kv``, ``valid_kv``.

    pos / doc / valid are per-token nodes of the mask's graph ([B, N], [1, N] or [N]).
    """

    lo: int | None = None
    hi: int | None = None
    pos: fx.Node | None = None
    doc: fx.Node | None = None
    valid: fx.Node | None = None
    valid_test: tuple[str, int] | None = (
        None  # valid_kv is ``valid (op) k`` (``pad != 0``, ``pad == 1``), not its truth
    )
    chunk: Chunk | None = None  # the document equality, as chunks of the index the pass builds ``doc`` from

    @property
    def is_causal(self) -> bool:
        return self.lo == 0 and self.hi is None and self.pos is None and self.is_full_beyond_order

    @property
    def is_full(self) -> bool:
        return self.lo is None and self.hi is None and self.is_full_beyond_order

    @property
    def is_full_beyond_order(self) -> bool:
        return self.doc is None and self.valid is None and self.chunk is None

    def describe(self) -> str:
        c = f"{self.pos.name}" if self.pos is not None else "index"
        parts = []
        if self.lo is not None or self.hi is not None:
            parts.append(
                f"{self.lo if self.lo is not None else '-inf'} <= Δ{c} <= {self.hi if self.hi is not None else 'inf'}"
            )
        if self.doc is not None:
            parts.append(f"same {self.doc.name}")
        if self.chunk is not None:
            parts.append(self.chunk.describe())
        if self.valid is not None:
            test = f" {self.valid_test[0]} {self.valid_test[1]}" if self.valid_test else ""
            parts.append(f"key valid in {self.valid.name}{test}")
        return " and ".join(parts) or "all allowed"


# ----------------------------------------------------------------------------------------------- axis remapping


def _map_value(value: Any, fn) -> Any:
    """Apply ``fn(axis) -> axis`` to every axis inside ``value``."""

    def base(b):
        if isinstance(b, Idx):
            return Idx(fn(b.axis)), 0
        if isinstance(b, Row):
            return Row(b.node, fn(b.axis)), 0
        return Tok(b.node, fn(b.axis), None if b.batch_axis is None else fn(b.batch_axis)), 0

    return _rebase(value, base)


def _index_view_map(in_rank: int, index: tuple) -> dict[int, int] | None:
    """Input dim -> output dim (from the left) for an index of None / full slices / Ellipsis; None otherwise."""
    n_real = sum(1 for i in index if i is not None and i is not Ellipsis)
    if n_real > in_rank or sum(1 for i in index if i is Ellipsis) > 1:
        return None
    mapping, src, dst = {}, 0, 0
    for item in index:
        if item is None:
            dst += 1
        elif item is Ellipsis:
            for _ in range(in_rank - n_real):
                mapping[src] = dst
                src, dst = src + 1, dst + 1
        elif isinstance(item, slice) and item == slice(None, None, None):
            mapping[src] = dst
            src, dst = src + 1, dst + 1
        else:
            return None
    while src < in_rank:
        mapping[src] = dst
        src, dst = src + 1, dst + 1
    return mapping


def _remap(value: Any, in_rank: int, out_rank: int, mapping: dict[int, int]) -> Any:
    def fn(axis):
        return mapping[in_rank + axis] - out_rank if isinstance(axis, int) else axis  # vmap levels stay

    return _map_value(value, fn)


# ------------------------------------------------------------------------------------------------ interpretation

_CMP = {
    operator.lt: "lt", operator.le: "le", operator.gt: "gt", operator.ge: "ge", operator.eq: "eq", operator.ne: "ne",
    torch.lt: "lt", torch.le: "le", torch.gt: "gt", torch.ge: "ge", torch.eq: "eq", torch.ne: "ne",
    torch.less: "lt", torch.less_equal: "le", torch.greater: "gt", torch.greater_equal: "ge",
}  # fmt: skip
_CMP_METHODS = {"lt": "lt", "le": "le", "gt": "gt", "ge": "ge", "eq": "eq", "ne": "ne", "__lt__": "lt",
                "__le__": "le", "__gt__": "gt", "__ge__": "ge", "__eq__": "eq", "__ne__": "ne"}  # fmt: skip
_AND = {operator.and_, torch.logical_and, torch.bitwise_and}
_OR = {operator.or_, torch.logical_or, torch.bitwise_or}
_NOT = {operator.invert, torch.logical_not, torch.bitwise_not}
_AND_M, _OR_M, _NOT_M = {"__and__", "logical_and", "bitwise_and"}, {"__or__", "logical_or", "bitwise_or"}, {
    "__invert__", "logical_not", "bitwise_not"}  # fmt: skip
_IDENTITY_METHODS = {"contiguous", "clone", "detach"}
_INPLACE = {operator.iadd: "add", operator.isub: "sub", "add_": "add", "sub_": "sub"}  # x += k (4.57's kv_arange)
_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _cmp_name(node: fx.Node) -> str | None:
    if node.op == "call_function":
        return _CMP.get(node.target)
    if node.op == "call_method":
        return _CMP_METHODS.get(node.target)
    return None


def _logic_name(node: fx.Node) -> str | None:
    if node.op == "call_function":
        t = node.target
        return "and" if t in _AND else "or" if t in _OR else "not" if t in _NOT else None
    if node.op == "call_method":
        t = node.target
        return "and" if t in _AND_M else "or" if t in _OR_M else "not" if t in _NOT_M else None
    return None


def _fold_cmp(op: str, a: Num, b: Num) -> Bool:
    d = a.add(b, -1)
    if d.is_const:
        v = d.const
        return Bool.const({"lt": v < 0, "le": v <= 0, "gt": v > 0, "ge": v >= 0, "eq": v == 0, "ne": v != 0}[op])
    return Bool("cmp", (op, a, b))


def _is_floordiv(node: fx.Node) -> bool:
    if node.op == "call_function" and node.target in (operator.floordiv, torch.floor_divide):
        return True
    if node.op == "call_method" and node.target in ("floor_divide", "__floordiv__"):
        return True
    return fxgraph.op(node) == "div" and fxgraph.arg(node, 2, "rounding_mode") == "floor"


def _chunk_cmp(node: fx.Node | None, op: str, a: Any, b: Any) -> Bool:
    """``a == b`` of two floor divisions by one k: a "chunk" atom (read by ``_read_atom``), or a reason."""
    where = f"{node.name}: " if node is not None else ""
    if not (isinstance(a, FloorDiv) and isinstance(b, FloorDiv)) or a.k != b.k or op != "eq":
        raise NotIndexArithmetic(f"{where}a floor division compared by {op} with other than one of the same divisor")
    if a.num.is_const and b.num.is_const:
        return Bool.const(a.num.const // a.k == b.num.const // a.k)
    if a.num == b.num:
        return TRUE
    return Bool("chunk", (a.num, b.num, a.k))


def _join(kind: str, a: Bool, b: Bool, absorbing: Bool, identity: Bool) -> Bool:
    """``a and b`` (absorbing FALSE, identity TRUE) or ``a or b`` (absorbing TRUE, identity FALSE), constants folded."""
    if a == absorbing or b == absorbing:
        return absorbing
    if a == identity:
        return b
    if b == identity:
        return a
    return Bool(kind, (a, b))


def _and(a: Bool, b: Bool) -> Bool:
    return _join("and", a, b, FALSE, TRUE)


def _or(a: Bool, b: Bool) -> Bool:
    return _join("or", a, b, TRUE, FALSE)


def _not(a: Bool) -> Bool:
    if a.kind == "const":
        return Bool.const(not a.args[0])
    if a.kind == "not":
        return a.args[0]
    return Bool("not", (a,))


class Interpreter:
    """Abstract values of the nodes a mask is built from; ``seq`` is the sequence length (q and kv)."""

    def __init__(self, seq: Any) -> None:
        self.seq = seq
        self.memo: dict[fx.Node, Any] = {}
        self.levels: dict[fx.Node, frozenset] = {}
        self.has_vmap: bool | None = None
        self.aranges: list[tuple[fx.Node, int]] = []  # (node, start) of each arange read: where chunks are built from

    # A per-token tensor: [N], [1, N] or [B, N], not built from anything of the mask's [.., N, N] frame.
    def is_token_level(self, node: fx.Node) -> bool:
        shp = fxgraph.shape(node)
        if shp is None or len(shp) not in (1, 2) or not fxgraph.same_size(shp[-1], self.seq):
            return False
        # inside vmap a node's shape is per example: a batched [N] is not a per-token tensor of the graph
        return fxgraph.dtype(node) in (*_INT_DTYPES, torch.bool) and not self.vmap_levels(node)

    def vmap_levels(self, node: fx.Node) -> frozenset:
        """The vmap levels ``node`` is batched over (empty outside vmap)."""
        if node in self.levels:
            return self.levels[node]
        if self.has_vmap is None:
            self.has_vmap = any(getattr(n.target, "__name__", "") == "_add_batch_dim" for n in node.graph.nodes)
        if not self.has_vmap:
            return frozenset()
        name = getattr(node.target, "__name__", "") if node.op == "call_function" else ""
        inputs = frozenset().union(*(self.vmap_levels(a) for a in fxgraph.tensor_args(node)))
        if name == "_add_batch_dim":
            inputs |= {node.args[2]}
        elif name == "_remove_batch_dim":
            inputs -= {node.args[1]}
        self.levels[node] = inputs
        return inputs

    def opaque(self, node: fx.Node) -> Any:
        rank = len(fxgraph.shape(node))
        base = Tok(node, -1, -2 if rank == 2 else None)
        return Bool("truth", (base,)) if fxgraph.dtype(node) == torch.bool else Num.of({base: 1}, 0)

    def value(self, node: Any) -> Any:
        if not isinstance(node, fx.Node):
            if isinstance(node, bool):
                return Bool.const(node)
            if isinstance(node, int):
                return Num.of({}, node)
            if isinstance(node, torch.SymInt):
                raise NotIndexArithmetic(f"symbolic scalar {node} in the mask")
            raise NotIndexArithmetic(f"constant {node!r} of type {type(node).__name__} in the mask")
        if node in self.memo:
            return self.memo[node]
        try:
            v = self._eval(node)
            if isinstance(v, FloorDiv) and node.op != "placeholder" and self.is_token_level(node):
                v = self.opaque(node)  # a per-token tensor of chunk ids (arange(N) // C) is read as it stands
        except NotIndexArithmetic:
            if node.op != "placeholder" and self.is_token_level(node):
                v = self.opaque(node)
            else:
                raise
        self.memo[node] = v
        return v

    def _eval(self, node: fx.Node) -> Any:
        name = fxgraph.op(node)
        rank = len(fxgraph.shape(node) or ())
        if node.op in ("placeholder", "get_attr"):
            if self.is_token_level(node):
                return self.opaque(node)
            raise NotIndexArithmetic(
                f"{node.name} is a graph input of shape {fxgraph.shape(node)}, not per-token [B, N]"
            )
        if node.op == "call_function" and node.target is torch.arange:
            return self._arange(node)
        vmap = getattr(node.target, "__name__", "") if node.op == "call_function" else ""
        if vmap == "_add_batch_dim":
            return self._add_batch_dim(node)
        if vmap == "_remove_batch_dim":
            return self._remove_batch_dim(node)
        if node.op == "call_function" and node.target in (torch.ops.aten.index.Tensor, torch.ops.aten.index):
            src, indices = node.args[0], node.args[1]
            return self._gather(node, src, tuple(indices))
        cmp = _cmp_name(node)
        if cmp is not None:
            xa, xb = fxgraph.arg(node, 0, "input"), fxgraph.arg(node, 1, "other")
            va, vb = self.value(xa), self.value(xb)
            if isinstance(va, FloorDiv) or isinstance(vb, FloorDiv):
                return _chunk_cmp(node, cmp, va, vb)
            a, b = self._num(xa), self._num(xb)
            return _fold_cmp(cmp, a, b)
        if _is_floordiv(node):
            return self._floordiv(node)
        logic = _logic_name(node)
        if logic == "not":
            return _not(self._bool(fxgraph.arg(node, 0, "input")))
        if logic is not None:
            a, b = (self._bool(x) for x in (fxgraph.arg(node, 0, "input"), fxgraph.arg(node, 1, "other")))
            return _and(a, b) if logic == "and" else _or(a, b)
        if node.op in ("call_function", "call_method") and _INPLACE.get(node.target) is not None:
            return self._inplace(node, _INPLACE[node.target])
        if name in ("add", "sub"):
            a, b = self._num(fxgraph.arg(node, 0, "input")), self._num(fxgraph.arg(node, 1, "other"))
            alpha = fxgraph.arg(node, 2, "alpha", 1)
            if not isinstance(alpha, int):
                raise NotIndexArithmetic(f"{node.name}: non-integer alpha")
            return a.add(b.scale(alpha), 1 if name == "add" else -1)
        if name == "mul":
            a, b = self.value(fxgraph.arg(node, 0, "input")), self.value(fxgraph.arg(node, 1, "other"))
            if isinstance(a, Bool) and isinstance(b, Bool):
                return _and(a, b)
            a, b = self._num(fxgraph.arg(node, 0, "input")), self._num(fxgraph.arg(node, 1, "other"))
            if a.is_const:
                return b.scale(a.const)
            if b.is_const:
                return a.scale(b.const)
            raise NotIndexArithmetic(f"{node.name}: product of two index terms")
        if name == "neg":
            return self._num(fxgraph.arg(node, 0, "input")).scale(-1)
        if name == "getitem":
            return self._getitem(node, rank)
        if name in ("unsqueeze",):
            src = fxgraph.arg(node, 0, "input")
            d = fxgraph.normalize_dim(fxgraph.arg(node, 1, "dim"), rank)
            in_rank = rank - 1
            mapping = {i: (i if i < d else i + 1) for i in range(in_rank)}
            return _remap(self.value(src), in_rank, rank, mapping)
        if name in ("expand", "expand_as", "broadcast_to") or name in _IDENTITY_METHODS:
            return self.value(fxgraph.arg(node, 0, "input"))
        if name in ("to", "type", "bool", "long", "int", "type_as"):
            return self._cast(node)
        if name in ("new_ones", "ones_like", "new_zeros", "zeros_like", "ones", "zeros", "new_full", "full_like",
                    "full"):  # fmt: skip
            return self._filled(node, name)
        if name == "where":
            return self._where(node)
        if name == "diff":
            return self._diff(node)
        if name == "cumsum":
            return self._cumsum(node)
        raise NotIndexArithmetic(f"{node.name} ({name or node.target}) is not index arithmetic")

    # -- helpers

    def _floordiv(self, node: fx.Node) -> Any:
        a, k = self._num(fxgraph.arg(node, 0, "input")), fxgraph.arg(node, 1, "other")
        if isinstance(k, fx.Node) and isinstance(fxgraph.example_value(k), torch.SymInt):
            # a chunk size passed into the compiled function, under dynamic shapes: pinned to this call's value
            # under a guard (another value recompiles)
            from torch.fx.experimental.symbolic_shapes import guard_int

            try:
                k = guard_int(fxgraph.example_value(k))
            except Exception:  # noqa: BLE001 - unbacked (data-dependent): no value to read, a reason below
                pass
        if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
            raise NotIndexArithmetic(f"{node.name}: floor division by {k!r}, not a literal positive integer")
        return Num.of({}, a.const // k) if a.is_const else FloorDiv(a, k)

    def _inplace(self, node: fx.Node, name: str) -> Num:
        """``x += k`` (transformers 4.57: ``kv_arange += kv_offset``): x's new value, read only when nothing else
        reads x (a reader of x would see the old or the new value depending on where it is)."""
        src, other = fxgraph.arg(node, 0, "input"), fxgraph.arg(node, 1, "other")
        if not isinstance(src, fx.Node) or len(src.users) != 1 or fxgraph.arg(node, 2, "alpha", 1) != 1:
            raise NotIndexArithmetic(f"{node.name}: in-place {name} into {getattr(src, 'name', src)}, read elsewhere")
        v = self._num(src).add(self._num(other), 1 if name == "add" else -1)
        # an arange chunks are built from is read after the mask's nodes: the mutated one no longer starts where it did
        self.aranges = [(n, start) for n, start in self.aranges if n is not src]
        if len(fxgraph.shape(node) or ()) == 1 and v.terms == ((Idx(-1), 1),):
            self.aranges.append((node, v.const))
        return v

    def _num(self, x: Any) -> Num:
        v = self.value(x)
        if isinstance(v, Bool) and v.kind == "const":
            return Num.of({}, int(v.args[0]))
        if not isinstance(v, Num):
            raise NotIndexArithmetic(f"{getattr(x, 'name', x)}: a boolean where a number is expected")
        return v

    def _bool(self, x: Any) -> Bool:
        v = self.value(x)
        if isinstance(v, Num):
            if v.is_const:
                return Bool.const(v.const != 0)
            if len(v.terms) == 1 and isinstance(v.terms[0][0], Tok) and v.terms[0][1] == 1 and v.const == 0:
                return Bool("truth", (v.terms[0][0],))  # an integer per-token tensor read as nonzero
            return Bool("cmp", ("ne", v, Num.of({}, 0)))
        return v

    def _arange(self, node: fx.Node) -> Num:
        args = [a for a in node.args]
        if len(args) == 1:
            start, end, step = 0, args[0], 1
        elif len(args) == 2:
            (start, end), step = args, 1
        else:
            start, end, step = args[:3]
        step = node.kwargs.get("step", step)
        start = node.kwargs.get("start", start)
        if not isinstance(start, int) or step != 1 or isinstance(start, bool):
            raise NotIndexArithmetic(f"{node.name}: arange with a non-literal start or a step other than 1")
        self.aranges.append((node, start))
        return Num.of({Idx(-1): 1}, start)

    def _cast(self, node: fx.Node) -> Any:
        src = fxgraph.arg(node, 0, "input")
        v = self.value(src)
        target = fxgraph.dtype(node)
        if target == torch.bool:
            return self._bool(src)
        if target in _INT_DTYPES:
            if isinstance(v, Bool):
                if v.kind == "const":
                    return Num.of({}, int(v.args[0]))
                raise NotIndexArithmetic(f"{node.name}: a boolean formula cast to integers")
            return v
        if fxgraph.dtype(src) == target:
            return v
        raise NotIndexArithmetic(f"{node.name}: cast to {target}")

    def _filled(self, node: fx.Node, name: str) -> Any:
        if name in ("new_full", "full_like", "full"):
            fill = fxgraph.arg(node, 2 if name in ("new_full",) else 1, "fill_value")
        else:
            fill = 1 if "ones" in name else 0
        if fxgraph.dtype(node) == torch.bool:
            return Bool.const(bool(fill))
        if isinstance(fill, bool) or not isinstance(fill, int):
            raise NotIndexArithmetic(f"{node.name}: filled with {fill!r}")
        return Num.of({}, fill)

    def _where(self, node: fx.Node) -> Any:
        cond = self._bool(fxgraph.arg(node, 0, "condition"))
        a, b = self.value(fxgraph.arg(node, 1, "input")), self.value(fxgraph.arg(node, 2, "other"))
        if isinstance(a, Bool) and isinstance(b, Bool) and a.kind == "const" and b.kind == "const":
            if a.args[0] and not b.args[0]:
                return cond
            if b.args[0] and not a.args[0]:
                return _not(cond)
        raise NotIndexArithmetic(f"{node.name}: where() choosing other than True/False")

    def _getitem(self, node: fx.Node, rank: int) -> Any:
        src, index = node.args
        index = index if isinstance(index, tuple) else (index,)
        in_rank = len(fxgraph.shape(src) or ())
        if any(isinstance(i, fx.Node) for i in index):
            return self._gather(node, src, index)
        index = _whole_items(index, fxgraph.shape(src) or ())
        mapping = _index_view_map(in_rank, index)
        if mapping is not None:
            return _remap(self.value(src), in_rank, rank, mapping)
        return self._slice(node, src, index, in_rank, rank)

    def _slice(self, node, src, index, in_rank, rank) -> Any:
        """x[..., a:b] of a form indexed along that axis (a slice that keeps the whole axis never gets here): the
        index read from a on, ``Idx + a``, or the constant a where the slice is one wide (a size-1 axis broadcasts);
        ``None`` and ``...`` among the slices are views as elsewhere. A per-token or per-row tensor cut so is a
        reason: its tokens (rows) would no longer be the mask's."""
        items = list(index) if Ellipsis in index else [*index, Ellipsis]  # the dims left out are whole
        if not all(i is None or i is Ellipsis or isinstance(i, slice) for i in items):
            raise NotIndexArithmetic(f"{node.name}: indexing {index!r}")
        mapping = _index_view_map(in_rank, tuple(slice(None) if isinstance(i, slice) else i for i in items))
        out_shape = fxgraph.shape(node)
        if mapping is None or out_shape is None:
            raise NotIndexArithmetic(f"{node.name}: indexing {index!r}")
        n_real = sum(1 for i in items if isinstance(i, slice))
        starts: dict[int, int] = {}
        fixed: set[int] = set()
        dim = 0
        for item in items:
            if item is Ellipsis:
                dim += in_rank - n_real
                continue
            if item is None:
                continue
            if item != slice(None):
                if item.step not in (None, 1):
                    raise NotIndexArithmetic(f"{node.name}: slice {item} of an index form, with a step")
                start = _slice_start(item.start, fxgraph.shape(src)[dim])
                if start is None:
                    raise NotIndexArithmetic(f"{node.name}: slice {item} of an index form, from a start not known here")
                starts[dim - in_rank] = start
                if fxgraph.static_size(out_shape[mapping[dim]]) == 1:
                    fixed.add(dim - in_rank)
            dim += 1
        return _remap(_sliced(self.value(src), starts, fixed, node), in_rank, rank, mapping)

    def _gather(self, node: fx.Node, src: fx.Node, index: tuple) -> Any:
        """``t[b_idx, t_idx]`` of a per-token tensor t with index forms: t read in the mask's frame; ``r[b_idx]`` of a
        per-row [B] integer tensor r (HF's left-padding counts): a ``Row`` base."""
        if (
            not self.is_token_level(src)
            and len(index) == 1
            and len(fxgraph.shape(src) or ()) == 1
            and fxgraph.dtype(src) in _INT_DTYPES
            and not self.vmap_levels(src)
        ):
            i = self._num(index[0])
            if len(i.terms) != 1 or not isinstance(i.terms[0][0], Idx) or i.terms[0][1] != 1 or i.const:
                raise NotIndexArithmetic(f"{node.name}: per-row {src.name} read at other than an index")
            return Num.of({Row(src, i.terms[0][0].axis): 1}, 0)
        if not self.is_token_level(src):
            raise NotIndexArithmetic(f"{node.name}: tensor-indexed {src.name} is not a per-token tensor")
        in_rank = len(fxgraph.shape(src))
        if len(index) != in_rank:
            raise NotIndexArithmetic(f"{node.name}: {len(index)} indices into a rank-{in_rank} tensor")
        idx = [self._num(i) for i in index]
        tok = idx[-1]
        bat = idx[0] if in_rank == 2 else None
        if len(tok.terms) != 1 or not isinstance(tok.terms[0][0], Idx) or tok.terms[0][1] != 1:
            raise NotIndexArithmetic(f"{node.name}: token index is not an index along one axis")
        if (
            bat is not None
            and not bat.is_const
            and (len(bat.terms) != 1 or not isinstance(bat.terms[0][0], Idx) or bat.terms[0][1] != 1 or bat.const)
        ):
            raise NotIndexArithmetic(f"{node.name}: batch index is not the batch index")
        t_axis, t_off = tok.terms[0][0].axis, tok.const
        b_axis = None if bat is None or bat.is_const else bat.terms[0][0].axis
        if bat is not None and bat.is_const and (bat.const != 0 or fxgraph.hint(fxgraph.shape(src)[0]) != 1):
            raise NotIndexArithmetic(f"{node.name}: one fixed row of {src.name} for every batch row")
        v = self.value(src)

        def move(b):
            if isinstance(b, Idx):
                if b.axis == -1:
                    return Idx(t_axis), t_off
                raise NotIndexArithmetic(f"{node.name}: index along the batch axis of {src.name}")
            if isinstance(b, Row):
                raise NotIndexArithmetic(f"{node.name}: {src.name} is built from per-row {b.node.name}")
            if t_off:
                raise NotIndexArithmetic(f"{node.name}: {src.name} read at an offset token index")
            return Tok(b.node, t_axis, b_axis if b.batch_axis is not None else None), 0

        return _rebase(v, move)

    # vmap (HF builds custom masks so): a batched dimension is an axis named by its vmap level until
    # _remove_batch_dim puts it back among the tensor's dims.

    def _add_batch_dim(self, node: fx.Node) -> Any:
        src, in_dim, level = node.args[:3]
        in_rank = len(fxgraph.shape(src) or ())
        gone = fxgraph.normalize_dim(in_dim, in_rank) - in_rank

        def fn(axis):
            if axis == gone:
                return ("vmap", level)
            return axis + 1 if isinstance(axis, int) and axis < gone else axis

        return _map_value(self.value(src), fn)

    def _remove_batch_dim(self, node: fx.Node) -> Any:
        src, level, _size, out_dim = node.args[:4]
        r, big = len(fxgraph.shape(src) or ()), len(fxgraph.shape(node) or ())

        def fn(axis):
            if axis == ("vmap", level):
                return out_dim - big
            if isinstance(axis, int):
                p = r + axis
                return p + (1 if p >= out_dim else 0) - big
            return axis

        return _map_value(self.value(src), fn)

    def _diff(self, node: fx.Node) -> Any:
        """diff(x, prepend=p, dim=-1) of x = c·index + k with p = k - c: the constant c everywhere."""
        x = self._num(fxgraph.arg(node, 0, "input"))
        dim, n = fxgraph.arg(node, 2, "dim", -1), fxgraph.arg(node, 1, "n", 1)
        prepend, append = fxgraph.arg(node, 3, "prepend"), fxgraph.arg(node, 4, "append")
        if n != 1 or append is not None or prepend is None or dim not in (-1, len(fxgraph.shape(node)) - 1):
            raise NotIndexArithmetic(f"{node.name}: diff form not folded")
        p = self._num(prepend)
        slope = dict(x.terms).get(Idx(-1), 0)
        rest = Num.of({b: c for b, c in x.terms if b != Idx(-1)}, x.const)
        if len(x.terms) == (1 if slope else 0) and p.is_const and p.const == rest.const - slope:
            return Num.of({}, slope)
        raise NotIndexArithmetic(f"{node.name}: diff of a non-affine per-token tensor")

    def _cumsum(self, node: fx.Node) -> Any:
        x = self.value(fxgraph.arg(node, 0, "input"))
        dim = fxgraph.arg(node, 1, "dim")
        if dim not in (-1, len(fxgraph.shape(node)) - 1):
            raise NotIndexArithmetic(f"{node.name}: cumsum not along the token axis")
        c = (
            int(x.args[0])
            if isinstance(x, Bool) and x.kind == "const"
            else x.const
            if isinstance(x, Num) and x.is_const
            else None
        )
        if c is None:
            raise NotIndexArithmetic(f"{node.name}: cumsum of a non-constant")
        return Num.of({Idx(-1): c} if c else {}, c)


def _rebase(value: Any, move) -> Any:
    """``value`` with every base b replaced: ``move(b) -> (b', off)`` reads b as b' + off, or as the constant off
    when b' is None."""
    if isinstance(value, Num):
        terms, const = {}, value.const
        for b, c in value.terms:
            nb, off = move(b)
            if nb is not None:
                terms[nb] = terms.get(nb, 0) + c
            const += c * off
        return Num.of(terms, const)
    if isinstance(value, FloorDiv):
        return FloorDiv(_rebase(value.num, move), value.k)
    if isinstance(value, Bool):
        if value.kind == "cmp":
            op, a, b = value.args
            return _fold_cmp(op, _rebase(a, move), _rebase(b, move))
        if value.kind == "chunk":
            a, b, k = value.args
            return _chunk_cmp(None, "eq", FloorDiv(_rebase(a, move), k), FloorDiv(_rebase(b, move), k))
        if value.kind == "truth":
            nb, off = move(value.args[0])
            if off or nb is None:
                raise NotIndexArithmetic("a boolean per-token tensor read at an offset")
            return Bool("truth", (nb,))
        if value.kind in ("and", "or", "not"):
            args = [_rebase(a, move) for a in value.args]
            return _not(args[0]) if value.kind == "not" else (_and if value.kind == "and" else _or)(*args)
    return value


def _sliced(value: Any, starts: dict[int, int], fixed: set[int], node: fx.Node) -> Any:
    """``value`` read from ``starts[axis]`` on along each axis in ``starts`` (a slice): the index along it is
    ``Idx + start``, or the constant start along an axis in ``fixed`` (one wide: it broadcasts later)."""

    def move(b):
        if isinstance(b, Idx) and b.axis in starts:
            return (None if b.axis in fixed else b), starts[b.axis]
        if isinstance(b, Tok) and (b.axis in starts or b.batch_axis in starts):
            raise NotIndexArithmetic(f"{node.name}: a slice of per-token tensor {b.node.name}")
        if isinstance(b, Row) and b.axis in starts:
            raise NotIndexArithmetic(f"{node.name}: a slice of per-row tensor {b.node.name}")
        return b, 0

    return _rebase(value, move)


def _size_of(x: Any) -> Any:
    """A slice bound as a size: an int, or the SymInt an fx node (``key.shape[-2]`` under dynamic shapes) holds."""
    return fxgraph.example_value(x) if isinstance(x, fx.Node) else x


def _known_ge(a: Any, b: Any) -> bool:
    """``a >= b`` for every value the symbols of two (possibly symbolic) sizes may take; no guard is added."""
    if isinstance(a, int) and isinstance(b, int):
        return a >= b
    if not isinstance(a, int | torch.SymInt) or not isinstance(b, int | torch.SymInt):
        return False
    try:
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        return bool(statically_known_true(a >= b))
    except Exception:  # noqa: BLE001 - sizes this torch cannot compare: not known
        return False


def _slice_start(start: Any, size: Any) -> int | None:
    """The literal first index a slice reads along a dim of ``size`` (a negative start counted from a static end);
    None when it is not known here (symbolic)."""
    start = _size_of(start)
    if start is None:
        return 0
    if isinstance(start, bool) or not isinstance(start, int):
        return None
    if start >= 0:
        return start
    n = fxgraph.static_size(size)
    return None if n is None else max(0, n + start)


def _covers(item: Any, size: Any) -> bool:
    """``item`` is a slice that keeps a whole dim of ``size``: step 1, from 0, to an end provably at or past the
    size (``: key.shape[-2]`` of a mask whose key dim is that length, symbolic or not)."""
    if not isinstance(item, slice) or item.step not in (None, 1) or _slice_start(item.start, size) != 0:
        return False
    return item.stop is None or _known_ge(_size_of(item.stop), size)


def _whole_items(index: tuple, shape: tuple) -> tuple:
    """``index`` with each slice that keeps its whole dim written ``:`` (transformers 4.57's sdpa path slices the
    mask to the key length, ``mask[:, :, :, : key.shape[-2]]``, which is the mask itself)."""
    n_real = sum(1 for i in index if i is not None and i is not Ellipsis)
    out, dim = [], 0
    for item in index:
        if item is Ellipsis:
            dim += len(shape) - n_real
        elif item is not None:
            if dim < len(shape) and _covers(item, shape[dim]):
                item = slice(None)
            dim += 1
        out.append(item)
    return tuple(out)


def whole_view(node: fx.Node) -> fx.Node | None:
    """The source of ``node`` when ``node`` is ``source[index]`` keeping every element of it (``:``, ``...``, or
    slices that provably cover their dims), so the same tensor as it stands; None otherwise."""
    if fxgraph.op(node) != "getitem" or len(node.args) != 2 or not isinstance(node.args[0], fx.Node):
        return None
    src, index = node.args
    index = index if isinstance(index, tuple) else (index,)
    shape = fxgraph.shape(src)
    if shape is None or not all(isinstance(i, slice) or i is Ellipsis for i in index):
        return None
    mapping = _index_view_map(len(shape), _whole_items(index, shape))
    if mapping is None or not fxgraph.same_shape(fxgraph.shape(node) or (), shape):
        return None
    return src


# -------------------------------------------------------------------------------------------------- the mask spec


def _conjuncts(f: Bool) -> list[Bool]:
    if f.kind == "and":
        return [c for a in f.args for c in _conjuncts(a)]
    if f.kind == "not" and f.args[0].kind == "cmp":
        op, a, b = f.args[0].args
        flip = {"lt": "ge", "le": "gt", "gt": "le", "ge": "lt", "eq": "ne", "ne": "eq"}[op]
        return [Bool("cmp", (flip, a, b))]
    if f.kind == "not" and f.args[0].kind == "or":
        return [c for a in f.args[0].args for c in _conjuncts(_not(a))]
    return [f]


def analyze(mask: fx.Node, seq: Any) -> MaskSpec:
    """The spec of ``mask`` (a [.., N, N] bool, or 0 / -inf float, tensor node), or NotIndexArithmetic."""
    shp = fxgraph.shape(mask)
    if shp is None or len(shp) < 2 or len(shp) > 4:
        raise NotIndexArithmetic(f"mask {mask.name} of shape {shp}")
    if not (fxgraph.same_size(shp[-1], seq) and fxgraph.same_size(shp[-2], seq)):
        raise NotIndexArithmetic(f"mask {mask.name} {list(shp)} is not [.., {seq}, {seq}]")
    if len(shp) >= 3 and fxgraph.hint(shp[-3]) != 1:
        raise NotIndexArithmetic(f"mask {mask.name} {list(shp)} differs per head")
    interp = Interpreter(seq)
    if fxgraph.dtype(mask) == torch.bool:
        formula = interp._bool(mask)
    elif fxgraph.dtype(mask) in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        formula = _additive(interp, mask)
    else:
        raise NotIndexArithmetic(f"mask {mask.name} of dtype {fxgraph.dtype(mask)}")
    rank = len(shp)
    q_axis, kv_axis, b_axis = -2, -1, (-4 if rank == 4 else None)
    spec: dict[str, Any] = {}
    for atom in _conjuncts(formula):
        _read_atom(atom, spec, q_axis, kv_axis, b_axis)
    lo, hi = spec.get("lo"), spec.get("hi")
    if lo is not None and hi is not None and lo > hi:
        raise NotIndexArithmetic("the mask allows no key at all")
    chunk = None
    if "chunk" in spec:
        if spec.get("doc") is not None:
            raise NotIndexArithmetic("documents and chunks together (one document equality is rewritten, not two)")
        rows, const, k = spec["chunk"]
        index = [(n, s) for n, s in interp.aranges if fxgraph.same_size((fxgraph.shape(n) or (None,))[-1], seq)]
        if not index:
            raise NotIndexArithmetic("chunks of an index with no arange of the sequence's length to build them from")
        chunk = Chunk(index[0][0], index[0][1], rows, const, k)
    return MaskSpec(lo, hi, spec.get("pos"), spec.get("doc"), spec.get("valid"), spec.get("valid_test"), chunk)


def _additive(interp: Interpreter, mask: fx.Node) -> Bool:
    """A float mask that is 0 where allowed and -inf elsewhere: ``where(cond, 0, -inf)`` (or the reverse), or
    ``base.masked_fill(cond, -inf)`` of such a mask or of zeros. (``finfo.min`` is not -inf: a row with no allowed
    key then attends every key uniformly, so it is not read as a mask.)"""
    if fxgraph.op(mask) == "masked_fill":
        base, cond, fill = fxgraph.arg(mask, 0, "input"), fxgraph.arg(mask, 1, "mask"), fxgraph.arg(mask, 2, "value")
        if fill != -math.inf:
            raise NotIndexArithmetic(f"float mask {mask.name} fills {fill!r}, not -inf")
        if isinstance(base, fx.Node) and fxgraph.op(base) in ("where", "masked_fill"):
            allowed = _additive(interp, base)
        elif isinstance(base, fx.Node) and interp.value(base) == Num.of({}, 0):
            allowed = Bool.const(True)
        else:
            raise NotIndexArithmetic(f"float mask {mask.name} fills -inf into {getattr(base, 'name', base)}, not zeros")
        return _and(allowed, _not(interp._bool(cond)))
    if fxgraph.op(mask) != "where":
        raise NotIndexArithmetic(f"float mask {mask.name} is not where(cond, 0, -inf)")
    a, b = fxgraph.arg(mask, 1, "input"), fxgraph.arg(mask, 2, "other")
    cond = interp._bool(fxgraph.arg(mask, 0, "condition"))
    if a == 0 and b == -math.inf:
        return cond
    if a == -math.inf and b == 0:
        return _not(cond)
    raise NotIndexArithmetic(f"float mask {mask.name} chooses {a!r} / {b!r}, not 0 / -inf")


def _read_atom(atom: Bool, spec: dict, q_axis: int, kv_axis: int, b_axis: int | None) -> None:
    if atom.kind == "const":
        if not atom.args[0]:
            raise NotIndexArithmetic("the mask is all False")
        return
    if atom.kind == "truth":
        (b,) = atom.args
        if isinstance(b, Tok) and b.axis == kv_axis and b.batch_axis in (b_axis, None):
            if "valid_test" in spec and spec.get("valid") is b.node:
                raise NotIndexArithmetic(f"{b.node.name} read as padding in two ways")
            _put(spec, "valid", b.node)
            return
        raise NotIndexArithmetic(f"a boolean per-token tensor read along axis {b.axis}, not the key axis")
    if atom.kind == "chunk":
        _read_chunk(atom, spec, q_axis, kv_axis, b_axis)
        return
    if atom.kind != "cmp":
        raise NotIndexArithmetic(f"a {atom.kind} of conditions (only conjunctions are rewritten)")
    op, a, b = atom.args
    d = a.add(b, -1)  # d (op) 0
    terms = dict(d.terms)
    coords = _coordinate(terms, q_axis, kv_axis, b_axis)
    if coords is None and len(terms) == 1:  # one per-token tensor on the key axis against a constant: padding
        ((base, coef),) = terms.items()
        if isinstance(base, Tok) and base.axis == kv_axis and base.batch_axis in (b_axis, None) and abs(coef) == 1:
            # coef * T + k (op) 0  <=>  T (op') -coef * k
            flip = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq", "ne": "ne"}
            test = (op if coef == 1 else flip[op], -coef * d.const)
            old = spec.get("valid_test", test)
            if old != test or (spec.get("valid") is not None and "valid_test" not in spec):
                raise NotIndexArithmetic(f"{base.node.name} read as padding in two ways")
            _put(spec, "valid", base.node)
            spec["valid_test"] = test
            return
    if coords is None:
        raise NotIndexArithmetic(f"a comparison of {_describe_terms(terms)}")
    kind, node, sign = coords  # d = sign * (c_q - c_kv) + const
    if kind == "pos" and op == "eq" and d.const == 0:  # the same document (segment, sequence id) as the query
        _put(spec, "doc", node)
        return
    if kind == "pos" and fxgraph.dtype(node) == torch.bool:
        raise NotIndexArithmetic(f"a comparison {op} of boolean per-token {node.name} between query and key")
    if kind == "pos":
        _put(spec, "pos", node)
    else:
        _put(spec, "pos", None)
    k = d.const
    # sign*t + k (op) 0, with t = c_q - c_kv
    if op in ("lt", "gt"):
        op, k = ("le", k + 1) if op == "lt" else ("ge", k - 1)
    if op == "ne":
        raise NotIndexArithmetic("a != comparison of positions")
    bounds = []
    if op in ("le", "eq"):  # sign*t <= -k
        bounds.append(("hi", -k) if sign > 0 else ("lo", k))
    if op in ("ge", "eq"):  # sign*t >= -k
        bounds.append(("lo", -k) if sign > 0 else ("hi", k))
    for key, val in bounds:
        old = spec.get(key)
        spec[key] = val if old is None else (max(old, val) if key == "lo" else min(old, val))


def _read_chunk(atom: Bool, spec: dict, q_axis: int, kv_axis: int, b_axis: int | None) -> None:
    """(q + R) // k == (kv + R) // k, R a sum of per-row terms and a constant: the same chunk of the index."""
    a, b, k = atom.args
    coords = _coordinate(dict(a.add(b, -1).terms), q_axis, kv_axis, b_axis)
    if coords is None or coords[0] != "index" or a.const != b.const:
        raise NotIndexArithmetic(f"a floor division by {k} compared between other than the query's and key's index")
    rows = []
    for base, coef in a.terms:
        if isinstance(base, Idx):
            if coef != 1 or base.axis not in (q_axis, kv_axis):
                raise NotIndexArithmetic(f"chunks of {coef} times the index along axis {base.axis}")
        elif isinstance(base, (Row, Tok)) and b_axis is not None and base.axis == b_axis:
            # a tensor laid along the batch axis is per-row, however it was read (a [1] one at B = N = 1: a Tok)
            if isinstance(base, Tok) and (base.batch_axis is not None or fxgraph.example_value(base.node).dim() != 1):
                raise NotIndexArithmetic(f"chunks offset by {_describe_terms({base: coef})}, not a per-row tensor")
            rows.append((base.node, coef))
        else:
            raise NotIndexArithmetic(f"chunks offset by {_describe_terms({base: coef})}, not a per-row tensor")
    chunk = (tuple(sorted(rows, key=lambda r: r[0].name)), a.const, k)
    if spec.get("chunk", chunk) != chunk:
        raise NotIndexArithmetic("two different chunkings")
    spec["chunk"] = chunk


def _coordinate(terms: dict, q_axis: int, kv_axis: int, b_axis: int | None):
    """("index", None, s) for s*(q - kv); ("pos", P, s) for s*(P_q - P_kv) of one per-token tensor P."""
    if len(terms) != 2:
        return None
    (b1, c1), (b2, c2) = terms.items()
    if c1 != -c2 or abs(c1) != 1:
        return None
    if isinstance(b1, Idx) and isinstance(b2, Idx):
        axes = {b1.axis: c1, b2.axis: c2}
        if set(axes) == {q_axis, kv_axis}:
            return "index", None, axes[q_axis]
        return None
    if isinstance(b1, Tok) and isinstance(b2, Tok) and b1.node is b2.node:
        if {b1.batch_axis, b2.batch_axis} - {b_axis, None}:
            return None
        axes = {b1.axis: c1, b2.axis: c2}
        if set(axes) != {q_axis, kv_axis}:
            return None
        return "pos", b1.node, axes[q_axis]
    return None


def _put(spec: dict, key: str, node: fx.Node | None) -> None:
    if key == "pos":
        old = spec.get("coord", "unset")
        if old != "unset" and old is not node:
            raise NotIndexArithmetic("positions and indices both order the mask")
        spec["coord"] = node
        if node is not None:
            spec["pos"] = node
        return
    old = spec.get(key)
    if old is not None and old is not node:
        raise NotIndexArithmetic(f"two different per-token tensors act as {key}")
    spec[key] = node


def _describe_terms(terms: dict) -> str:
    def name(b):
        return f"index[{b.axis}]" if isinstance(b, Idx) else f"{b.node.name}[{b.axis}]"  # Tok, Row: a tensor

    return " + ".join(f"{c}*{name(b)}" for b, c in terms.items()) or "constants"
