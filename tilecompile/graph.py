"""Canonical views of torch-level FX nodes, so passes match meanings rather than spellings.

A Dynamo graph spells the same math many ways: ``F.linear`` or ``torch._C._nn.linear`` or ``x @ w.t()``;
``F.silu`` or ``x * torch.sigmoid(x)``; ``t.float()`` or ``t.to(torch.float32)``; ``torch.gather(t, ...)`` or
``t.gather(...)``. ``op(node)`` names the operation of a node whatever its spelling (``call_function`` or
``call_method``), ``arg(node, i, name)`` reads an argument by position or keyword (with ``self`` of a method as
argument 0), and the ``as_*`` views recognise linears, activations and casts.
"""

from __future__ import annotations

import dataclasses
import operator
import re
import warnings
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

# callables (call_function targets) -> canonical op names
_FUNCTIONS: dict[Any, str] = {
    F.linear: "linear",
    torch._C._nn.linear: "linear",
    torch.matmul: "matmul",
    operator.matmul: "matmul",
    torch.mm: "matmul",
    torch.bmm: "matmul",
    F.silu: "silu",
    torch._C._nn.silu: "silu",
    torch.sigmoid: "sigmoid",
    F.sigmoid: "sigmoid",
    F.gelu: "gelu",
    torch._C._nn.gelu: "gelu",
    F.relu: "relu",
    torch.relu: "relu",
    torch.exp: "exp",
    torch.log: "log",
    torch.neg: "neg",
    operator.neg: "neg",
    operator.mul: "mul",
    torch.mul: "mul",
    operator.truediv: "div",
    torch.div: "div",
    torch.true_divide: "div",
    operator.add: "add",
    torch.add: "add",
    operator.sub: "sub",
    torch.sub: "sub",
    operator.getitem: "getitem",
    F.softmax: "softmax",
    torch.softmax: "softmax",
    F.log_softmax: "log_softmax",
    torch.log_softmax: "log_softmax",
    torch.logsumexp: "logsumexp",
    torch.gather: "gather",
    torch.take_along_dim: "take_along_dim",
    torch.sum: "sum",
    torch.mean: "mean",
    torch.squeeze: "squeeze",
    torch.unsqueeze: "unsqueeze",
    torch.reshape: "reshape",
    torch.flatten: "flatten",
    torch.transpose: "transpose",
    torch.t: "t",
    torch.permute: "permute",
    torch.chunk: "chunk",
    torch.split: "split",
    torch.tensor_split: "tensor_split",
    F.cross_entropy: "cross_entropy",
    F.nll_loss: "nll_loss",
    torch.argmax: "argmax",
    torch.multinomial: "multinomial",
}

# method names -> canonical op names (methods not listed keep their own name)
_METHODS = {
    "__matmul__": "matmul",
    "__mul__": "mul",
    "__truediv__": "div",
    "__add__": "add",
    "__sub__": "sub",
    "__neg__": "neg",
    "__getitem__": "getitem",
    "mm": "matmul",
    "bmm": "matmul",
    "view_as": "view",
    "reshape_as": "reshape",
}

VIEW_OPS = frozenset(
    {"view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "contiguous", "transpose", "t", "permute"}
)
CAST_METHODS = frozenset({"float", "half", "bfloat16", "double", "to", "type_as", "type"})


def op(node: fx.Node) -> str | None:
    """The canonical name of what ``node`` computes, or None for placeholders, outputs and unknown calls."""
    if node.op == "call_function":
        name = _FUNCTIONS.get(node.target)
        if name is not None:
            return name
        if isinstance(node.target, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
            return None
        return getattr(node.target, "__name__", None) if _is_torch_callable(node.target) else None
    if node.op == "call_method":
        return _METHODS.get(node.target, node.target)
    return None


def _is_torch_callable(fn: Any) -> bool:
    module = getattr(fn, "__module__", "") or ""
    return module.startswith("torch") and not module.startswith("torch._ops")


def arg(node: fx.Node, index: int, name: str | None = None, default: Any = None) -> Any:
    """Argument ``index`` (positional, ``self`` of a method counting as 0) or keyword ``name``."""
    if index < len(node.args):
        return node.args[index]
    if name is not None and name in node.kwargs:
        return node.kwargs[name]
    return default


def tensor_args(node: fx.Node) -> list[fx.Node]:
    return [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, fx.Node)]


def example_value(node: Any) -> Any:
    """The fake tensor (or tuple of them) Dynamo recorded for ``node``; None when unknown or not a node."""
    if not isinstance(node, fx.Node):
        return None
    value = node.meta.get("example_value")
    return node.meta.get("val") if value is None else value


def shape(node: Any) -> tuple | None:
    value = example_value(node)
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def dtype(node: Any) -> torch.dtype | None:
    value = example_value(node)
    return value.dtype if isinstance(value, torch.Tensor) else None


def hint(size: Any) -> int | None:
    """A concrete int for a (possibly symbolic) size: its hint under dynamic shapes."""
    if isinstance(size, int):
        return size
    from torch.fx.experimental import symbolic_shapes

    # hint_int was renamed optimization_hint (torch 2.13); torch 2.11's hint_int warns (FutureWarning) on each call
    get = getattr(symbolic_shapes, "optimization_hint", None)
    try:
        if get is not None:
            return int(get(size))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return int(symbolic_shapes.hint_int(size))
    except Exception:
        return None


def static_size(size: Any) -> int | None:
    """``size`` as an int: an int, or a symbolic size that a guard has pinned to one value (Dynamo specialises the
    dim of a tensor it iterates over, ``for row in logits``; another size recompiles). None for a size that can
    still vary."""
    if isinstance(size, int):
        return size
    node = getattr(size, "node", None)
    try:
        value = node.maybe_as_int() if node is not None else None
        if value is None and node is not None:  # pinned without a replacement: ``s0*s1 == 24`` from a loop's range
            from torch.fx.experimental.symbolic_shapes import statically_known_true

            at = hint(size)
            value = at if at is not None and statically_known_true(size == at) else None
        return value
    except Exception:  # noqa: BLE001 - not a SymNode this torch knows: not static for us
        return None


def normalize_dim(dim: Any, ndim: int) -> int | None:
    if not isinstance(dim, int):
        return None
    return dim + ndim if dim < 0 else dim


# ---------------------------------------------------------------------------------------------- module paths

_BRACKET = re.compile(r"\[['\"]?([^'\"\]]+)['\"]?\]")


def module_path(node: fx.Node) -> str:
    """The dotted path (``model.layers.0.mlp``) of the innermost module that produced ``node``. A module reached
    from another root than the outermost module's (``G['...'].apply_rotary_pos_emb`` inside ``L['model']``:
    transformers >= 5.25 wraps such functions in modules of their own, reached through a global) is not part of the
    model's tree: the innermost module of that tree stands for it."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    paths = [entry[0] for entry in stack.values()]
    root = _root(paths[0])
    return clean_path([p for p in paths if _root(p) == root][-1])


def _root(path: str) -> str:
    """``L['model']`` of ``L['model'].model.layers[0]``; Dynamo's sources begin with ``L[...]`` or ``G[...]``."""
    return path.split("]", 1)[0] if path[:2] in ("L[", "G[") else path.split(".", 1)[0]


def common_module_path(nodes: Iterable[fx.Node]) -> str:
    """The longest module path shared by ``nodes`` (for a region spanning several submodules)."""
    paths = [module_path(n).split(".") for n in nodes if module_path(n)]
    if not paths:
        return ""
    common: list[str] = []
    for parts in zip(*paths):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return ".".join(common)


def clean_path(path: str) -> str:
    """``L['self'].model.layers[0]`` or ``L['self']._modules['model']`` -> ``model.layers.0``; PEFT's models reach
    their submodules through ``__dict__['_modules']``: ``L['m'].__dict__['_modules']['base_model']`` ->
    ``base_model``."""
    path = re.sub(r"^L\[['\"][^'\"]*['\"]\](\[\d+\])*\.?", "", path)
    path = re.sub(r"\.?__dict__\[['\"]_modules['\"]\]", "._modules", path)
    path = path.replace("._modules", "").replace("_modules", "")
    path = _BRACKET.sub(r".\1", path)
    return re.sub(r"\.+", ".", path).strip(".")


# ----------------------------------------------------------------------------------------------- views


@dataclasses.dataclass(frozen=True)
class Linear:
    """``x @ weight.T + bias``, however it was spelled. ``weight`` is [out, in]."""

    node: fx.Node
    input: fx.Node
    weight: fx.Node
    bias: fx.Node | None


def transposed_of(node: Any) -> fx.Node | None:
    """``w`` when ``node`` is ``w.t()``, ``w.T``, ``w.transpose(0, 1)``/``(-1, -2)`` or ``w.permute(1, 0)`` of 2-D w."""
    if not isinstance(node, fx.Node):
        return None
    name = op(node)
    src = arg(node, 0, "input")
    if not isinstance(src, fx.Node) or len(shape(src) or ()) != 2:
        return None
    if name == "t":
        return src
    if name == "transpose":
        dims = {normalize_dim(arg(node, 1, "dim0"), 2), normalize_dim(arg(node, 2, "dim1"), 2)}
        return src if dims == {0, 1} else None
    if name == "permute":
        dims = node.args[1:] if len(node.args) > 2 else arg(node, 1, "dims")
        return src if tuple(dims or ()) == (1, 0) else None
    if node.op == "call_function" and node.target is getattr and node.args[1] in ("T", "mT", "H"):
        return src
    return None


def as_linear(node: fx.Node) -> Linear | None:
    """A linear layer in any spelling: ``F.linear(x, w, b)``, ``x @ w.t()``, ``torch.matmul(x, w.T)``."""
    name = op(node)
    if name == "linear":
        x, w, b = arg(node, 0, "input"), arg(node, 1, "weight"), arg(node, 2, "bias")
        if isinstance(x, fx.Node) and isinstance(w, fx.Node) and len(shape(w) or ()) == 2:
            return Linear(node, x, w, b if isinstance(b, fx.Node) else None)
        return None
    if name == "matmul":
        x, rhs = arg(node, 0, "input"), arg(node, 1, "other")
        w = transposed_of(rhs)
        if isinstance(x, fx.Node) and w is not None and len(shape(x) or ()) >= 2:
            return Linear(node, x, w, None)
    return None


@dataclasses.dataclass(frozen=True)
class Activation:
    """An elementwise activation: ``kind`` is one of silu, gelu (exact), gelu_tanh, relu."""

    node: fx.Node
    kind: str
    input: fx.Node


def as_activation(node: fx.Node) -> Activation | None:
    name = op(node)
    if name in ("silu", "relu"):
        x = arg(node, 0, "input")
        return Activation(node, name, x) if isinstance(x, fx.Node) else None
    if name == "gelu":
        x = arg(node, 0, "input")
        approx = arg(node, 1, "approximate", "none")
        if isinstance(x, fx.Node) and approx in ("none", "tanh"):
            return Activation(node, "gelu" if approx == "none" else "gelu_tanh", x)
        return None
    if name == "mul":
        a, b = arg(node, 0), arg(node, 1)
        for x, s in ((a, b), (b, a)):
            if isinstance(s, fx.Node) and op(s) == "sigmoid" and arg(s, 0, "input") is x and isinstance(x, fx.Node):
                return Activation(node, "silu", x)
    return None


def cast_target(node: fx.Node) -> torch.dtype | None:
    """The dtype ``node`` casts to when it is a pure dtype cast (``.float()``, ``.to(dtype)``, ``.type_as(t)``)."""
    if node.op != "call_method" or node.target not in CAST_METHODS:
        return None
    simple = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16, "double": torch.float64}
    if node.target in simple:
        return simple[node.target] if len(node.args) == 1 and not node.kwargs else None
    if node.target == "type_as":
        return dtype(arg(node, 1))
    if node.target in ("to", "type"):
        # only .to(dtype) / .to(dtype=...) is a pure cast; .to(device) etc. is left alone
        extra = [a for a in node.args[1:]] + [v for k, v in node.kwargs.items() if k not in ("copy",)]
        if len(extra) == 1 and isinstance(extra[0], torch.dtype):
            return extra[0]
    return None


def strip_casts(node: Any) -> Any:
    """Follow pure dtype casts back to their source."""
    while isinstance(node, fx.Node) and cast_target(node) is not None:
        node = node.args[0]
    return node


def is_view_like(node: fx.Node) -> bool:
    return op(node) in VIEW_OPS


def users_outside(node: fx.Node, region: set[fx.Node]) -> list[fx.Node]:
    """Users of ``node`` that are not in ``region``."""
    return [u for u in node.users if u not in region]


def graph_input(node: Any) -> fx.Node | None:
    """The placeholder or get_attr behind ``node`` (through views and casts), if it is a graph input."""
    seen = 0
    while isinstance(node, fx.Node) and seen < 16:
        if node.op in ("placeholder", "get_attr"):
            return node
        if is_view_like(node) or cast_target(node) is not None:
            node = node.args[0]
            seen += 1
            continue
        return None
    return None


def graph_modules(gm: fx.GraphModule) -> list[tuple[str, fx.GraphModule]]:
    """``gm`` and every nested GraphModule (bodies of higher-order ops such as activation checkpointing)."""
    return [(name or "<root>", m) for name, m in gm.named_modules() if isinstance(m, fx.GraphModule)]


# ------------------------------------------------------------------------------------- additions: tiled_mlp


def as_affine(node: fx.Node) -> Linear | None:
    """``as_linear``, plus a bias added separately: ``x @ w.t() + b`` or ``b + F.linear(x, w)`` (b 1-D [out])."""
    lin = as_linear(node)
    if lin is not None or op(node) != "add" or "alpha" in node.kwargs or len(node.args) != 2:
        return lin
    a, b = node.args
    for inner, bias in ((a, b), (b, a)):
        lin = as_linear(inner) if isinstance(inner, fx.Node) else None
        if lin is None or lin.bias is not None or not isinstance(bias, fx.Node):
            continue
        out = (shape(lin.weight) or (None,))[0]
        if shape(bias) == (out,) and shape(node) == shape(inner):
            return Linear(node, lin.input, lin.weight, bias)
    return None


@dataclasses.dataclass(frozen=True)
class DimSlice:
    """``source`` restricted to ``start:stop`` along ``dim`` (normalised), however it was spelled: basic indexing
    with every other dim whole, ``narrow``, ``select``, an item of ``split``/``chunk``/``tensor_split``/``unbind``.
    ``keep`` is False when the dim is dropped (an int index, ``select``, ``unbind``; then ``stop == start + 1``)."""

    node: fx.Node
    source: fx.Node
    dim: int
    start: int
    stop: int
    keep: bool = True


# the static parts of a tensor along one dim: torch.split and its spellings (a tuple; getitem takes one part)
SPLIT_OPS = frozenset({"split", "split_with_sizes", "chunk", "tensor_split", "unbind"})


def as_dim_slice(node: fx.Node) -> DimSlice | None:
    """``node`` as a slice of one dim of another tensor (static sizes only), or None."""
    name = op(node)
    if name == "narrow":
        src, dim, start, length = (arg(node, i, k) for i, k in enumerate(("input", "dim", "start", "length")))
        if not isinstance(length, int):
            return None
        return _dim_slice(node, src, dim, start, start + length if isinstance(start, int) else None)
    if name == "select":
        src, dim, index = arg(node, 0, "input"), arg(node, 1, "dim"), arg(node, 2, "index")
        return _dim_slice(node, src, dim, index, index + 1 if isinstance(index, int) else None, keep=False)
    if name != "getitem" or not isinstance(node.args[0], fx.Node):
        return None
    parent, index = node.args[0], node.args[1]
    if op(parent) in SPLIT_OPS:
        return _split_item(node, parent, index)
    return index_slice(node, parent, index)


def index_slice(node: fx.Node, source: fx.Node, index: Any) -> DimSlice | None:
    """``source[index]`` (for ``node``: the getitem, or a ``setitem`` into ``source``) as a ``DimSlice``."""
    items = index if isinstance(index, tuple) else (index,)
    if any(isinstance(i, bool) for i in items) or sum(i is Ellipsis for i in items) > 1:
        return None
    if not all(isinstance(i, int | slice) or i is Ellipsis for i in items):
        return None
    ndim = len(shape(source) or ())
    if Ellipsis in items:
        at = items.index(Ellipsis)
        positions = [*range(at), *range(ndim - (len(items) - at - 1), ndim)]
        items = items[:at] + items[at + 1 :]
    else:
        positions = list(range(len(items)))
    if len(items) > ndim:
        return None
    cut = [(d, i) for d, i in zip(positions, items) if i != slice(None)]
    if len(cut) != 1:
        return None
    d, i = cut[0]
    if isinstance(i, int):
        return _dim_slice(node, source, d, i, i + 1 if i != -1 else None, keep=False)
    if i.step not in (None, 1):
        return None
    return _dim_slice(node, source, d, 0 if i.start is None else i.start, i.stop)


def _split_item(node: fx.Node, parent: fx.Node, index: Any) -> DimSlice | None:
    src = arg(parent, 0, "input", arg(parent, 0, "tensor", arg(parent, 0, "self")))
    name = op(parent)
    if name == "unbind":
        dim = arg(parent, 1, "dim", 0)
        return _dim_slice(node, src, dim, index, index + 1 if isinstance(index, int) else None, keep=False)
    dim = arg(parent, 2, "dim", 0)
    src_shape = shape(src) if isinstance(src, fx.Node) else None
    d = normalize_dim(dim, len(src_shape or ()))
    size = static_size(src_shape[d]) if src_shape and d is not None and 0 <= d < len(src_shape) else None
    if not isinstance(size, int) or not isinstance(index, int) or index < 0:
        return None
    if name == "chunk":
        chunks = arg(parent, 1, "chunks")
        if not isinstance(chunks, int) or chunks <= 0:
            return None
        width = -(-size // chunks)
        sizes = [width] * -(-size // width) if width else []
    elif name == "tensor_split":
        sections = arg(parent, 1, "indices_or_sections", arg(parent, 1, "sections", parent.kwargs.get("indices")))
        if not isinstance(sections, int) or sections <= 0:
            return None
        sizes = [size // sections + (1 if k < size % sections else 0) for k in range(sections)]
    else:
        sections = arg(parent, 1, "split_size_or_sections", parent.kwargs.get("split_size"))
        sections = parent.kwargs.get("split_sizes", sections)
        if isinstance(sections, int) and sections > 0:
            sizes = [sections] * -(-size // sections)
        elif isinstance(sections, list | tuple) and all(isinstance(s, int) for s in sections):
            sizes = list(sections)
        else:
            return None
    if index >= len(sizes):
        return None
    start = sum(sizes[:index])
    return _dim_slice(node, src, dim, start, min(start + sizes[index], size))


def _dim_slice(node: fx.Node, src: Any, dim: Any, start: Any, stop: Any, keep: bool = True) -> DimSlice | None:
    src_shape = shape(src) if isinstance(src, fx.Node) else None
    d = normalize_dim(dim, len(src_shape or ()))
    if d is None or not 0 <= d < len(src_shape):
        return None
    size = static_size(src_shape[d])  # a symbolic size: rows proven at its hint need not be those of a later call
    if not isinstance(size, int) or not isinstance(start, int) or not isinstance(stop, int | None):
        return None
    if not keep and not -size <= start < size:
        return None  # an int index out of range: eager raises
    stop = size if stop is None else stop
    start, stop = (max(0, min(size, i + size if i < 0 else i)) for i in (start, stop))
    return DimSlice(node, src, d, start, stop, keep) if start < stop else None


def as_last_dim_slice(node: fx.Node) -> DimSlice | None:
    """``source[..., start:stop]`` (a ``DimSlice`` of the last dim that keeps it)."""
    part = as_dim_slice(node)
    if part is None or not part.keep or part.dim != len(shape(part.source) or ()) - 1:
        return None
    return part


def is_autocast_marker(node: fx.Node) -> bool:
    """An ``_enter_autocast`` / ``_exit_autocast`` node: Dynamo's spelling of a ``torch.autocast`` block edge."""
    return node.op == "call_function" and getattr(node.target, "__name__", "") in ("_enter_autocast", "_exit_autocast")


# ------------------------------------------------------------------------------ additions: fused_linear_ce


_INPLACE_OPERATORS = frozenset(
    {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.ipow, operator.imod}
)


def is_inplace(node: fx.Node) -> bool:
    """``node`` mutates its first argument: ``x.div_(t)``, ``torch.relu_(x)``, ``x *= 2``, ``out.copy_(y)``."""
    if node.op == "call_method":
        name = str(node.target)
        return name.endswith("_") and not name.startswith("_")
    if node.op == "call_function":
        if node.target in _INPLACE_OPERATORS:
            return True
        name = getattr(node.target, "__name__", "") or ""
        return _is_torch_callable(node.target) and name.endswith("_") and not name.startswith("_")
    return False


def mutated_args(node: fx.Node) -> list[fx.Node]:
    """The tensors ``node`` writes into: an in-place op's self, ``x[i] = v``'s x, ``out=``, a Triton launch's
    arguments (Dynamo's ``triton_kernel_wrapper_mutation``: any of them may be written)."""
    out = []
    if (is_inplace(node) or node.target is operator.setitem) and node.args and isinstance(node.args[0], fx.Node):
        out.append(node.args[0])
    if isinstance(node.kwargs.get("out"), fx.Node):
        out.append(node.kwargs["out"])
    if getattr(node.target, "__name__", None) == "triton_kernel_wrapper_mutation":
        out += [a for a in node.kwargs.get("kwargs", {}).values() if isinstance(a, fx.Node)]
    return out


def eliminate_dead_code(graph: fx.Graph) -> bool:
    """``graph.eliminate_dead_code()`` that keeps calls made for their side effects: in-place calls with no users
    (FX would drop ``x.div_(t)``), and calls that return nothing, such as a user's Triton kernel, which Dynamo
    records as ``triton_kernel_wrapper_mutation`` writing into its arguments (FX does not count it as impure: a
    dropped call leaves its output buffer uninitialised, as TRL's CUDA log-prob kernel was).

    This graph only: FX's own version also cleans the bodies of higher-order ops (an autograd.Function's forward,
    a checkpoint) and does it there without the side-effect check, so it is not called."""
    changed = False
    for node in reversed(graph.nodes):
        if node.op in ("call_function", "call_method", "call_module") and not node.users:
            if not _has_side_effects(node):
                graph.erase_node(node)
                changed = True
    return changed


def _has_side_effects(node: fx.Node) -> bool:
    if node.is_impure() or is_inplace(node):
        return True
    if node.op not in ("call_function", "call_method"):
        return False
    if getattr(node.target, "__name__", None) == "triton_kernel_wrapper_mutation":
        return True
    return "example_value" in node.meta and node.meta["example_value"] is None


def same_size(a: Any, b: Any) -> bool:
    """Two (possibly symbolic) sizes are equal for every value their symbols may take; equal hints don't count.

    ``(s**2)//s`` and ``s`` are the same size; the shape environment proves it without adding a guard.
    """
    if str(a) == str(b):
        return True
    if isinstance(a, int) and isinstance(b, int):
        return False
    try:
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        return bool(statically_known_true(a == b))
    except Exception:
        return False


def same_shape(a: Any, b: Any) -> bool:
    return len(a) == len(b) and all(same_size(i, j) for i, j in zip(a, b))


class NodeBuilder:
    """Inserts nodes before ``anchor``, fake-running each (in ``fake_mode``) so its meta carries ``example_value``;
    each new node gets ``meta_from``'s module stack and stack trace. ``new`` lists what it inserted."""

    def __init__(self, graph: fx.Graph, anchor: fx.Node, fake_mode: Any, meta_from: fx.Node | None = None) -> None:
        self.graph, self.anchor, self.fake_mode = graph, anchor, fake_mode
        meta_from = anchor if meta_from is None else meta_from
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
        fa, fk = fx.node.map_arg((args, kwargs), example_value)
        with self.fake_mode:
            node.meta["example_value"] = getattr(fa[0], target)(*fa[1:], **fk) if method else target(*fa, **fk)
        self.new.append(node)
        return node
