"""Reads known library kernels in a Dynamo graph as the torch math they compute, so the lm_head pass can fuse them.

TRL 1.x (``trl.kernels.logprob_entropy``) sends ``selective_log_softmax``, ``entropy_from_logits`` and
``selective_log_softmax_and_entropy`` on CUDA to its own Triton kernel, an autograd.Function. For logits z [..., V],
labels y, temperature T (a Python number) and an optional row mask m, per row, in fp32:
logp = z_y/T − logsumexp(z/T), H = logsumexp(z/T) − Σ softmax(z/T)·z/T, both 0 where m == 0; its backward is
the exact gradient of those (0 on masked rows). Dynamo records it as an ``autograd_function_apply`` whose forward
body launches ``_forward_kernel`` (under grad), or as that launch writing into empty buffers (under no_grad).

Find: such a call, known by the kernel's module and name and read through its parameter names. Expand: the same
math in torch ops (``log_softmax`` / ``gather``, ``−Σ softmax·log_softmax``, ``where`` for the row mask) in
the kernel's place. The kernel itself reads the whole [..., V] logits but stores only per-row values, so the plain
math is worse unless the lm_head pass fuses it: ``passes/lm_head/__init__.py`` keeps an expansion only when it does.
Megatron-Core's vocab-parallel cross-entropy is read the same way (its section below).

Also here, for ``passes/canonical.py``: autograd.Functions read as a linear or the identity (``read_function``,
``expand_functions``), which, unlike the kernels, are always replaced: the plain linear is as good as the function.
"""

from __future__ import annotations

import dataclasses
import operator
import re
from typing import Any

import torch
import torch.fx as fx

from tilecompile import graph as fxgraph

TRL_MODULE = "trl.kernels.logprob_entropy"
_TRL_FORWARD = "_forward_kernel"
_PARAMS = ("logits_ptr", "index_ptr", "row_mask_ptr", "logprobs_ptr", "entropy_ptr")
_CONSTANTS = ("TEMPERATURE", "HAS_MASK")


@dataclasses.dataclass
class KernelCall:
    """One call of TRL's log-prob / entropy kernel: what it reads, and the nodes that stand for its two outputs."""

    node: fx.Node  # the autograd_function_apply, or the kernel launch itself (no_grad)
    logits: fx.Node
    index: fx.Node
    row_mask: fx.Node | None
    temperature: float
    outputs: dict[str, list[fx.Node]]  # "logp" / "entropy" -> the nodes whose uses read that output ("dead": unread)


def _trl_forward_launch(node: fx.Node) -> dict[str, Any] | None:
    """The kwargs and constants of a launch of TRL's forward kernel, or None."""
    if node.op != "call_function" or getattr(node.target, "__name__", None) != "triton_kernel_wrapper_mutation":
        return None
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    try:
        kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
        constants = kernel_side_table.get_constant_args(node.kwargs["constant_args_idx"])
    except (KeyError, IndexError, AssertionError):
        return None
    fn = getattr(kernel, "fn", None)  # a JITFunction's Python function (an Autotuner wraps one more level)
    fn = getattr(fn, "fn", fn)
    if getattr(fn, "__module__", None) != TRL_MODULE or getattr(fn, "__name__", None) != _TRL_FORWARD:
        return None
    kwargs = node.kwargs.get("kwargs", {})
    if not all(p in kwargs for p in _PARAMS) or not all(c in constants for c in _CONSTANTS):
        return None  # another version of the kernel, whose parameters we do not know
    return {**kwargs, **{c: constants[c] for c in _CONSTANTS}}


def _getitems(node: fx.Node) -> dict[int, list[fx.Node]]:
    out: dict[int, list[fx.Node]] = {}
    for user in node.users:
        if user.op == "call_function" and user.target is operator.getitem and isinstance(user.args[1], int):
            out.setdefault(user.args[1], []).append(user)
    return out


def _from_apply(node: fx.Node, gm: fx.GraphModule) -> KernelCall | None:
    """An ``autograd_function_apply(fwd_body, bwd_body, *operands)`` whose forward body launches TRL's kernel."""
    if node.op != "call_function" or getattr(node.target, "__name__", None) != "autograd_function_apply":
        return None
    body_attr = node.args[0] if node.args else None
    if not isinstance(body_attr, fx.Node) or body_attr.op != "get_attr":
        return None
    body = getattr(gm, body_attr.target, None)
    if not isinstance(body, fx.GraphModule):
        return None
    launches = [(n, k) for n in body.graph.nodes if (k := _trl_forward_launch(n)) is not None]
    if len(launches) != 1:
        return None
    (_, launch) = launches[0]
    operands = list(node.args[2:])
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    if len(placeholders) == len(operands) + 1:  # a body that takes ctx first
        placeholders = placeholders[1:]
    if len(placeholders) != len(operands):
        return None
    outer = dict(zip(placeholders, operands))
    logits, index = outer.get(launch["logits_ptr"]), outer.get(launch["index_ptr"])
    mask = outer.get(launch["row_mask_ptr"]) if launch["HAS_MASK"] else None
    if logits is None or index is None or (launch["HAS_MASK"] and mask is None):
        return None
    # TRL's function returns (logprobs, entropy); torch 2.11 adds its forward's intermediates, unread (_dead_outputs)
    dead = _unread_items(node, (0, 1))
    if dead is None:
        return None
    items = _getitems(node)
    outputs = {"logp": items.get(0, []), "entropy": items.get(1, []), "dead": dead}
    return KernelCall(node, logits, index, mask, float(launch["TEMPERATURE"]), outputs)


def _unread_items(node: fx.Node, keep: tuple[int, ...]) -> list[fx.Node] | None:
    """The getitems of ``node``'s results other than ``keep`` when every use of ``node`` is a getitem and none of
    those others is read (torch 2.11's unread intermediates, ``_dead_outputs``); None otherwise."""
    items = _getitems(node)
    if sum(map(len, items.values())) != len(node.users):
        return None
    others = [item for i, found in items.items() if i not in keep for item in found]
    return None if any(item.users for item in others) else others


def _from_launch(node: fx.Node) -> KernelCall | None:
    """TRL's forward kernel launched in this graph (under no_grad): its outputs are fresh empty buffers."""
    launch = _trl_forward_launch(node)
    if launch is None:
        return None
    position = {n: i for i, n in enumerate(node.graph.nodes)}
    outputs: dict[str, list[fx.Node]] = {}
    for key, param in (("logp", "logprobs_ptr"), ("entropy", "entropy_ptr")):
        buffer = launch[param]
        if not isinstance(buffer, fx.Node) or fxgraph.op(buffer) not in ("empty", "empty_like"):
            return None
        later = [u for u in buffer.users if position[u] > position[node]]
        if any(fxgraph.is_view_like(u) or fxgraph.mutated_args(u) for u in later):
            return None  # the buffer is written again or aliased afterwards: not a plain value
        outputs[key] = [buffer]
    mask = launch["row_mask_ptr"] if launch["HAS_MASK"] else None
    return KernelCall(node, launch["logits_ptr"], launch["index_ptr"], mask, float(launch["TEMPERATURE"]), outputs)


def find(gm: fx.GraphModule) -> list[KernelCall | CrossEntropyCall]:
    """Every call of TRL's log-prob / entropy kernel (or of Megatron-Core's vocab-parallel cross-entropy at
    tensor-parallel world size 1) in ``gm``'s graph on logits a linear of this graph computes (the launch inside an
    autograd.Function's own body reads a placeholder: nothing to fuse there)."""
    calls: list[KernelCall | CrossEntropyCall] = []
    for node in gm.graph.nodes:
        ce = read_mcore_cross_entropy(node, gm)
        if isinstance(ce, CrossEntropyCall):
            if isinstance(ce.logits, fx.Node) and _after_linear(ce.logits):
                calls.append(ce)
            continue
        call = _from_apply(node, gm) or _from_launch(node)
        if call is not None and all(isinstance(n, fx.Node) for n in (call.logits, call.index)):
            if _after_linear(call.logits):
                calls.append(call)
    return calls


def _after_linear(node: fx.Node, budget: int = 64) -> bool:
    seen, todo = {node}, [node]
    while todo and len(seen) <= budget:
        n = todo.pop(0)
        if fxgraph.as_linear(n) is not None:
            return True
        for a in n.all_input_nodes:
            if a not in seen:
                seen.add(a)
                todo.append(a)
    return False


def describe(call: KernelCall | CrossEntropyCall) -> str:
    if isinstance(call, CrossEntropyCall):
        return f"Megatron-Core's vocab-parallel cross-entropy ({MCORE_CE}) at {call.node.name}"
    return f"TRL's Triton log-prob/entropy kernel ({TRL_MODULE}) at {call.node.name}"


def summary(calls: list[KernelCall | CrossEntropyCall]) -> str:
    """``2 call(s) of TRL's ...`` for the report's detail of a rewrite that fused them."""
    mcore = sum(isinstance(c, CrossEntropyCall) for c in calls)
    parts = [f"{len(calls) - mcore} call(s) of TRL's Triton log-prob/entropy kernel"] if len(calls) > mcore else []
    parts += [f"{mcore} call(s) of Megatron-Core's vocab-parallel cross-entropy"] if mcore else []
    return " and ".join(parts)


def expand(call: KernelCall | CrossEntropyCall, b: Any) -> list[fx.Node]:
    """Insert the kernel's math in torch ops (with builder ``b``, placed before the call), route the call's uses to
    it and erase the call; returns the vocabulary-sized nodes inserted (the fused pass must consume them all)."""
    if isinstance(call, CrossEntropyCall):
        return _expand_cross_entropy(call, b)
    graph = call.node.graph
    position = {n: i for i, n in enumerate(graph.nodes)}
    z = call.logits
    if fxgraph.dtype(z) != torch.float32:
        z = b.call("float", z, method=True)
    if call.temperature != 1.0:
        z = b.call(operator.truediv, z, call.temperature)
    logp_all = b.call(torch.log_softmax, z, -1)
    wide = [n for n in (z, logp_all) if n is not call.logits]
    keep = None if call.row_mask is None else b.call(operator.ne, call.row_mask, 0)
    for key in ("logp", "entropy"):
        reads = [(out, u) for out in call.outputs[key] for u in out.users if position[u] > position[call.node]]
        if not reads:
            continue
        if key == "logp":
            index = call.index if fxgraph.dtype(call.index) == torch.int64 else b.call("long", call.index, method=True)
            if keep is not None:  # the kernel never reads a masked row's label (it may be out of range, -100 say)
                index = b.call(torch.where, keep, index, 0)
            picked = b.call(torch.gather, logp_all, -1, b.call("unsqueeze", index, -1, method=True))
            value = b.call("squeeze", picked, -1, method=True)
        else:
            p = b.call(torch.softmax, z, -1)
            wide.append(p)
            value = b.call(operator.neg, b.call("sum", b.call(operator.mul, p, logp_all), -1, method=True))
        if keep is not None:
            value = b.call(torch.where, keep, value, 0.0)
        for out, user in reads:  # a getitem of the function's outputs, or a buffer the launch wrote
            user.replace_input_with(out, value)
    for out in [o for key in ("logp", "entropy", "dead") for o in call.outputs.get(key, [])]:
        if out.op == "call_function" and out.target is operator.getitem and not out.users:
            graph.erase_node(out)
    if not call.node.users:
        graph.erase_node(call.node)
    return wide


# ------------------------------------------------------------------ autograd.Functions read as the math they compute
#
# Megatron-Core's ColumnParallelLinear / RowParallelLinear / output layer call
# ``LinearWithGradAccumulationAndAsyncCommunication`` (forward ``x @ w.t()`` (+ b), backward ``g @ w``, ``gᵀ x``,
# ``Σ g``, with collectives only under tensor or sequence parallelism), and its region copies
# (``_CopyToModelParallelRegion``, ``_ReduceFromModelParallelRegion``, ...) are the identity at tensor-parallel world
# size 1. Dynamo records each as ``autograd_function_apply(fwd_body, bwd_body, *operands)``; the class is not
# recorded, so a call is read by what its two bodies compute: a forward that is a linear of its operands (or returns
# its one operand) and a backward that is exactly that forward's gradient (nothing else: no collective, no side
# effect, no autocast). Such a call is ``F.linear(x, w, b)`` (or ``x``), whatever library it came from. Any other
# call that has a matmul or softmax-family
# math in its forward gets a reason: it is where a linear or a loss would be.

_MARKERS = ("_set_grad_enabled", "_enter_autocast", "_exit_autocast")
_SOFTMAXY = frozenset({"log_softmax", "softmax", "logsumexp", "cross_entropy", "nll_loss", "exp", "log"})
_MATMULS = frozenset({"matmul", "linear", "baddbmm", "addmm", "einsum"})


@dataclasses.dataclass
class FunctionCall:
    """An ``autograd_function_apply`` read as ``F.linear(input, weight, bias)`` (kind "linear") or ``input``."""

    node: fx.Node
    kind: str
    input: fx.Node
    weight: fx.Node | None = None
    bias: fx.Node | None = None
    index: int = 0  # which of the call's results is the linear (the others are dead: ``_dead_outputs``)


def is_function_apply(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "__name__", None) == "autograd_function_apply"


def function_name(node: fx.Node) -> str:
    """``SomeFunction.apply`` as the call's source line names it (for the report; the reading never relies on it)."""
    found = re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\.apply\(", node.meta.get("stack_trace") or "")
    return f"autograd.Function {found[-1]}" if found else "an autograd.Function"


def _bodies(node: fx.Node, gm: fx.GraphModule) -> tuple[fx.GraphModule, fx.GraphModule] | None:
    if not is_function_apply(node) or len(node.args) < 2:
        return None
    bodies = [
        getattr(gm, a.target, None) if isinstance(a, fx.Node) and a.op == "get_attr" else None for a in node.args[:2]
    ]
    if not all(isinstance(b, fx.GraphModule) for b in bodies):
        return None
    return bodies[0], bodies[1]


def _is_marker(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "__name__", "") in _MARKERS


def _computed(body: fx.GraphModule) -> list[fx.Node]:
    return [n for n in body.graph.nodes if n.op not in ("placeholder", "output", "get_attr") and not _is_marker(n)]


def _autocast_on(body: fx.GraphModule) -> bool:
    """Some autocast block inside the body is enabled (``_enter_autocast(device, dtype, enabled, cache)``)."""
    for n in body.graph.nodes:
        if n.op == "call_function" and getattr(n.target, "__name__", "") == "_enter_autocast":
            if len(n.args) < 3 or n.args[2] is not False:
                return True
    return False


def _forward_outputs(body: fx.GraphModule) -> tuple[list[Any], list[Any]] | None:
    """(outputs, saved) of a forward body, which returns ``((outs...), (saved...))``."""
    (out,) = [n for n in body.graph.nodes if n.op == "output"]
    value = out.args[0]
    if not (isinstance(value, tuple | list) and len(value) == 2 and all(isinstance(v, tuple | list) for v in value)):
        return None
    return list(value[0]), list(value[1])


def _backward_outputs(body: fx.GraphModule) -> list[Any]:
    (out,) = [n for n in body.graph.nodes if n.op == "output"]
    value = out.args[0]
    return list(value) if isinstance(value, tuple | list) else [value]


def read_function(node: fx.Node, gm: fx.GraphModule) -> FunctionCall | str | None:
    """The call as a linear or the identity; a reason when it is neither but stands where a linear or a loss would
    (a matmul or softmax-family math in its forward); None for any other call, or when ``node`` is no such call.
    Megatron-Core's cross-entropy is left to the lm_head pass (None), or has its reason when it cannot be read."""
    bodies = _bodies(node, gm)
    if bodies is None:
        return None
    ce = read_mcore_cross_entropy(node, gm)
    if isinstance(ce, CrossEntropyCall) and not _after_linear(ce.logits):
        return f"{function_name(node)} not fused: its logits come from no linear of this graph (a graph break?)"
    if ce is not None:
        return ce if isinstance(ce, str) else None
    fwd, bwd = bodies
    operands = list(node.args[2:])
    fwd_in = [n for n in fwd.graph.nodes if n.op == "placeholder"]
    outs = _forward_outputs(fwd)
    computed = _computed(fwd)
    names = {fxgraph.op(n) for n in computed}
    where = bool(names & _MATMULS) or bool(names & _SOFTMAXY) or any(fxgraph.as_linear(n) for n in computed)
    if outs is None or len(fwd_in) != len(operands) or not all(isinstance(o, fx.Node) for o in operands):
        return _unread(node, "its bodies are not in the form this reader knows") if where else None
    outputs, saved = outs
    live = [i for i in range(len(outputs)) if i not in _dead_outputs(node, bwd, outputs)]
    if len(live) != 1 or not isinstance(outputs[live[0]], fx.Node):
        used = f" ({len(live)} read outside the function or by its backward)" if len(live) < len(outputs) else ""
        return _unread(node, f"its forward returns {len(outputs)} values{used}") if where else None
    outer = dict(zip(fwd_in, operands))
    if _autocast_on(fwd) or _autocast_on(bwd):
        return _unread(node, "it runs under autocast inside its forward or backward") if where else None
    index = live[0]
    out = outputs[index]
    ident = _read_identity(out, outer, computed, bwd)
    if ident is not None:
        return FunctionCall(node, "identity", ident)
    lin = fxgraph.as_affine(out)
    if lin is None:
        return _unread(node, "its forward is not one linear of its operands") if where else None
    if any(t is not None and t not in outer for t in (lin.input, lin.weight, lin.bias)):
        return _unread(node, "its forward's linear reads values computed inside the function")
    allowed = {out, lin.node}
    if lin.node is not out:
        allowed |= {a for a in lin.node.all_input_nodes if a.op != "placeholder"}
    allowed |= {a for a in out.all_input_nodes if a.op != "placeholder" and fxgraph.transposed_of(a) is not None}
    extra = [n for n in computed if n not in allowed]
    if extra:
        what = ", ".join(f"{fxgraph.op(n) or n.target} {n.name}" for n in extra[:3])
        return _unread(node, f"its forward computes more than the linear ({what})")
    reason = _check_linear_backward(bwd, lin, saved, outer, fwd_in, operands, len(outputs), index)
    if reason:
        return _unread(node, reason)
    return FunctionCall(node, "linear", outer[lin.input], outer[lin.weight], outer.get(lin.bias), index)


def _dead_outputs(node: fx.Node, bwd: fx.GraphModule, outputs: list[Any]) -> set[int]:
    """The forward's results that nothing reads: values computed in the body that the outer graph does not use and
    whose gradient the backward ignores. Dynamo of torch 2.11 returns every intermediate of an autograd.Function's
    forward as a result of its own (for side effects: mcore's linear comes back as ``(x @ w.t(), w.t())``), with an
    unused gradient placeholder for each; later releases return the outputs alone."""
    places = [n for n in bwd.graph.nodes if n.op == "placeholder"]
    items = _getitems(node)
    return {
        i
        for i, o in enumerate(outputs)
        if isinstance(o, fx.Node)
        and o.op != "placeholder"
        and i < len(places)
        and not places[i].users
        and not any(item.users for item in items.get(i, []))
    }


def _unread(node: fx.Node, why: str) -> str:
    return f"{function_name(node)} not read as a linear or a loss: {why}"


def _read_identity(out: fx.Node, outer: dict, computed: list[fx.Node], bwd: fx.GraphModule) -> fx.Node | None:
    """The operand when the forward returns it (or ``x.view_as(x)``) and the backward returns its gradient."""
    src = out
    if out.op != "placeholder":
        if out.target not in ("view_as", "alias") or computed != [out] or out.args[0].op != "placeholder":
            return None
        if out.target == "view_as" and out.args[1] is not out.args[0]:
            return None
        src = out.args[0]
    if len(outer) != 1 or src not in outer:
        return None
    grads = [n for n in bwd.graph.nodes if n.op == "placeholder"]
    if len(grads) != 1 or _computed(bwd) or _backward_outputs(bwd) != [grads[0]]:
        return None
    return outer[src]


def _check_linear_backward(
    bwd: fx.GraphModule,
    lin: fxgraph.Linear,
    saved: list[Any],
    outer: dict,
    fwd_in: list[fx.Node],
    operands: list[fx.Node],
    n_outputs: int,
    index: int,
) -> str | None:
    """None when the backward returns exactly the linear's gradients (for each operand, in order); else the reason.
    The backward takes a gradient for each of the forward's ``n_outputs`` results, then the saved tensors; the others'
    gradients are unread (``_dead_outputs``), the linear's is result ``index``'s."""
    places = [n for n in bwd.graph.nodes if n.op == "placeholder"]
    if len(places) != n_outputs + len(saved):
        return "its backward takes other inputs than the output's gradient and the saved tensors"
    x, w, b = lin.input, lin.weight, lin.bias
    forms: dict[fx.Node, tuple] = {places[index]: ("g", False)}
    for p, s in zip(places[n_outputs:], saved):
        if s is x:
            forms[p] = ("x", False)
        elif s is w:
            forms[p] = ("w",)
    xs, ws, gs = (fxgraph.shape(n) for n in (x, w, lin.node))
    if xs is None or ws is None or gs is None or len(ws) != 2:
        return "shapes unknown"
    for n in bwd.graph.nodes:
        if n.op in ("placeholder", "output") or _is_marker(n):
            continue
        form = _backward_form(n, forms, xs, ws, gs)
        if form is not None:
            forms[n] = form
    want = {x: ("dx",), w: ("dw",)} | ({b: ("db",)} if b is not None else {})
    grads = _backward_outputs(bwd)
    if len(grads) != len(operands):
        return f"its backward returns {len(grads)} gradients for {len(operands)} operands"
    for p, grad in zip(fwd_in, grads):
        if p not in want:
            return f"operand {outer[p].name} is not the linear's input, weight or bias"
        if grad is None:
            value = fxgraph.example_value(outer[p])
            if isinstance(value, torch.Tensor) and value.requires_grad:
                return f"its backward returns no gradient for {outer[p].name}, which requires grad"
            continue
        if forms.get(grad) != want[p]:
            return (
                f"its backward's gradient for {outer[p].name} is not the linear's ({grad.name}: "
                f"{fxgraph.op(grad) or grad.target}; e.g. a collective under tensor parallelism, or a fused wgrad "
                "buffer)"
            )
    return None


def _backward_form(n: fx.Node, forms: dict, xs: tuple, ws: tuple, gs: tuple) -> tuple | None:
    """The abstract value of a backward node: the output's gradient g ("g", flat), the input x ("x", flat), the
    weight ("w"), gᵀ of flat g ("gT"), and the gradients ("dx", "dw", "db")."""
    args = [a for a in n.args if isinstance(a, fx.Node)]
    name = fxgraph.op(n)
    first = forms.get(n.args[0]) if n.args and isinstance(n.args[0], fx.Node) else None
    if name in ("contiguous", "clone") and first is not None and len(args) == 1:
        return first
    if name in ("view", "reshape") and first is not None and first[0] in ("g", "x"):
        size = tuple(n.args[1]) if len(n.args) == 2 and isinstance(n.args[1], tuple | list) else tuple(n.args[1:])
        full = gs if first[0] == "g" else xs
        shape = fxgraph.shape(n)
        if (
            shape is not None
            and len(shape) == 2
            and fxgraph.same_size(shape[-1], full[-1])
            and all(isinstance(s, int) for s in size)
        ):
            return (first[0], True)
        return None
    if name in ("t", "transpose") and first is not None and first[0] == "g" and len(fxgraph.shape(n) or ()) == 2:
        flat = first[1] or len(gs) == 2
        return ("gT",) if flat and (name == "t" or {*n.args[1:]} in ({0, 1}, {0, -1}, {-2, -1})) else None
    if name == "matmul" and len(n.args) == 2 and len(args) == 2:
        fa, fb = forms.get(n.args[0]), forms.get(n.args[1])
        if fa is not None and fa[0] == "g" and fb == ("w",) and fxgraph.same_shape(fxgraph.shape(n) or (), xs):
            return ("dx",)
        flat_x = fb is not None and fb[0] == "x" and (fb[1] or len(xs) == 2)
        if fa == ("gT",) and flat_x and fxgraph.same_shape(fxgraph.shape(n) or (), ws):
            return ("dw",)
        return None
    if name == "sum" and first is not None and first[0] == "g":
        dims = fxgraph.arg(n, 1, "dim")
        lead = set(range(len(fxgraph.shape(n.args[0]) or ()) - 1))
        dims = {dims} if isinstance(dims, int) else set(dims or ())
        if (
            dims == lead
            and not fxgraph.arg(n, 2, "keepdim", False)
            and fxgraph.same_shape(fxgraph.shape(n) or (), ws[:1])
        ):
            return ("db",)
    return None


class _Inserter:
    """Inserts nodes before ``anchor`` with its module stack and a fake-run ``example_value``."""

    def __init__(self, anchor: fx.Node, fake_mode: Any) -> None:
        self.anchor, self.fake_mode = anchor, fake_mode

    def call(self, target: Any, *args: Any) -> fx.Node:
        graph = self.anchor.graph
        with graph.inserting_before(self.anchor):
            node = graph.call_function(target, args)
        for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
            if key in self.anchor.meta:
                node.meta[key] = self.anchor.meta[key]
        with self.fake_mode:
            node.meta["example_value"] = target(*fx.node.map_arg(args, fxgraph.example_value))
        return node


def expand_functions(gm: fx.GraphModule, result: Any) -> bool:
    """Replace every call of ``gm``'s graph that ``read_function`` reads by its math; a reason for the others that
    stand where a linear or a loss would. True when the graph changed."""
    from tilecompile import reporting as reporting

    changed = False
    for node in list(gm.graph.nodes):
        call = read_function(node, gm)
        if call is None:
            continue
        where = fxgraph.module_path(node)
        candidate = f"{function_name(node)} at {node.name}"
        items = _getitems(node)
        index = 0 if isinstance(call, str) else call.index
        dead = _unread_items(node, (index,))
        plain = dead is not None
        if not isinstance(call, str) and call.kind == "identity":
            if plain:  # the identity is not a region of its own: replaced without a line in the report
                for item in items.get(index, []):
                    item.replace_all_uses_with(call.input)
                    gm.graph.erase_node(item)
                for item in dead:
                    gm.graph.erase_node(item)
                gm.graph.erase_node(node)
                changed = True
            continue
        result.consider(node, candidate)
        if isinstance(call, str):
            result.skip(node, reporting.Skip("canonical", candidate, where, call))
            continue
        if not plain:
            result.skip(
                node, reporting.Skip("canonical", candidate, where, "its output is used other than by indexing")
            )
            continue
        fake_mode = getattr(fxgraph.example_value(call.input), "fake_mode", None)
        if fake_mode is None:
            result.skip(node, reporting.Skip("canonical", candidate, where, "no fake tensors on its operands"))
            continue
        value = _Inserter(node, fake_mode).call(torch.nn.functional.linear, call.input, call.weight, call.bias)
        for item in items.get(index, []):
            item.replace_all_uses_with(value)
            gm.graph.erase_node(item)
        for item in dead:
            gm.graph.erase_node(item)
        gm.graph.erase_node(node)
        shapes = {"input": fxgraph.shape(call.input)} | (
            {"weight": fxgraph.shape(call.weight)} if call.weight is not None else {}
        )
        shapes = {
            k: tuple(fxgraph.hint(s) if fxgraph.hint(s) is not None else s for s in v) for k, v in shapes.items() if v
        }
        detail = f"{function_name(node)} read as F.linear (its backward is the linear's gradient)"
        result.rewrote(node, reporting.Rewrite("canonical", where, shapes, {}, detail))
        changed = True
    _drop_unused_bodies(gm)
    return changed


def _drop_unused_bodies(gm: fx.GraphModule) -> None:
    """Erase get_attr nodes of bodies no call uses any more (the bodies stay as attributes; harmless)."""
    for node in list(gm.graph.nodes):
        if node.op == "get_attr" and not node.users and isinstance(getattr(gm, node.target, None), fx.GraphModule):
            gm.graph.erase_node(node)


# ------------------------------------------------------------------------ Megatron-Core's vocab-parallel cross-entropy
#
# ``megatron.core.tensor_parallel.vocab_parallel_cross_entropy(logits, target)`` (``_VocabParallelCrossEntropy``)
# computes, per row of fp32 logits z [..., V_local] and this rank's vocabulary range [start, end):
#     loss = log Σ_j exp(z_j − m) − (z_t − m)   with m the row max (all-reduced MAX), Σ and z_t all-reduced SUM,
# and z_t − m taken as 0 where t is outside [start, end) (another rank's token). On one rank holding the whole
# vocabulary that is loss = lse(z) − z_t = −log_softmax(z)_t for 0 <= t < V. A target outside [0, V) is bad input
# there (mcore returns lse − max z for it, with the gradient of lse alone): the fused op's label check says so (always
# on CPU, on CUDA with check_inputs), as for every gathered log-prob. Its forward body is read by the function's
# source name and checked: two operands (logits, target), one output of the target's shape, the output
# ``log(Σ) − z_t`` (no label smoothing), the vocabulary range (0, V), and every collective over a group of one rank.
# The expansion is ``−log_softmax(z.float()).gather(t)``, which the lm_head pass fuses.

MCORE_CE = "megatron.core.tensor_parallel.cross_entropy"
_MCORE_CE_NAME = "_VocabParallelCrossEntropy"


@dataclasses.dataclass
class CrossEntropyCall:
    node: fx.Node
    logits: fx.Node
    target: fx.Node
    index: int = 0  # which of the call's results is the loss (the others are unread: ``_dead_outputs``)


def _group_size(name: Any) -> int | None:
    try:
        from torch.distributed import distributed_c10d as c10d

        return int(c10d._resolve_process_group(name).size())
    except Exception:  # noqa: BLE001 - an unknown group (or no torch.distributed): not provably one rank
        return None


def read_mcore_cross_entropy(node: fx.Node, gm: fx.GraphModule) -> CrossEntropyCall | str | None:
    """The call of Megatron-Core's cross-entropy as ``CrossEntropyCall``; a reason when it is that function but not
    provably the math above; None for any other node."""
    if not is_function_apply(node) or function_name(node) != f"autograd.Function {_MCORE_CE_NAME}":
        return None
    bodies = _bodies(node, gm)
    if bodies is None:
        return None
    fwd, bwd = bodies
    what = "Megatron-Core's vocab-parallel cross-entropy not fused"
    operands = list(node.args[2:])
    places = [n for n in fwd.graph.nodes if n.op == "placeholder"]
    outs = _forward_outputs(fwd)
    live = []
    if outs is not None:  # torch 2.11's intermediates returned beside the loss (``_dead_outputs``) set aside
        dead = _dead_outputs(node, bwd, outs[0])
        live = [i for i in range(len(outs[0])) if i not in dead]
        outs = ([outs[0][i] for i in live], outs[1])
    if len(operands) != 2 or len(places) != 2 or outs is None or len(outs[0]) != 1:
        return f"{what}: its forward is not in the form of megatron-core 0.16 (logits, target) -> loss"
    logits, target = operands
    lv, tv = fxgraph.example_value(logits), fxgraph.example_value(target)
    if not (isinstance(lv, torch.Tensor) and isinstance(tv, torch.Tensor)) or tv.is_floating_point():
        return f"{what}: its operands are not float logits and integer targets"
    if not fxgraph.same_shape(tuple(lv.shape[:-1]), tuple(tv.shape)):
        return f"{what}: logits {tuple(lv.shape)} and target {tuple(tv.shape)} do not fit"
    for body in (fwd, bwd):
        for n in body.graph.nodes:
            if n.op == "call_function" and "_c10d_functional" in str(n.target) and "wait_tensor" not in str(n.target):
                group = n.args[2] if len(n.args) > 2 else None
                size = _group_size(group)
                if size != 1:
                    ranks = f"{size} ranks" if size else "an unknown group"
                    return (
                        f"{what}: its all-reduces run over a tensor-parallel group of {ranks} (the logits are a "
                        "vocabulary shard; the fused op's vocab-parallel path is for tilecompile.parallelize)"
                    )
    (loss,) = outs[0]
    log = loss.args[0] if fxgraph.op(loss) == "sub" and len(loss.args) == 2 else None
    if not isinstance(log, fx.Node) or fxgraph.op(log) != "log":
        return f"{what}: its loss is not log(Σ exp) − z_t (label smoothing?)"
    t = places[1]
    bounds = {}
    for n in t.users:
        if n.op == "call_function" and n.target in (operator.lt, operator.ge) and n.args[0] is t:
            bounds[n.target] = n.args[1]
    vocab = fxgraph.hint(lv.shape[-1])
    if bounds.get(operator.lt) != 0 or bounds.get(operator.ge) != vocab:
        return f"{what}: its vocabulary range is not (0, {vocab}) (this rank holds a shard of the vocabulary)"
    return CrossEntropyCall(node, logits, target, live[0])


def _expand_cross_entropy(call: CrossEntropyCall, b: Any) -> list[fx.Node]:
    z = call.logits
    if fxgraph.dtype(z) != torch.float32:
        z = b.call("float", z, method=True)
    t = call.target if fxgraph.dtype(call.target) == torch.int64 else b.call("long", call.target, method=True)
    logp_all = b.call(torch.log_softmax, z, -1)
    picked = b.call(torch.gather, logp_all, -1, b.call("unsqueeze", t, -1, method=True))
    loss = b.call(operator.neg, b.call("squeeze", picked, -1, method=True))
    for item in [u for u in call.node.users if fxgraph.op(u) == "getitem"]:
        if item.args[1] == call.index:
            item.replace_all_uses_with(loss)
        if not item.users:  # the loss's, and the unread results' (``_dead_outputs``)
            item.graph.erase_node(item)
    if not call.node.users:
        call.node.graph.erase_node(call.node)
    return [n for n in (z, logp_all) if n is not call.logits]
