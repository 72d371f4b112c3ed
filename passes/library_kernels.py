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
math is worse unless the lm_head pass fuses it: ``passes/fused_linear_ce.py`` keeps an expansion only when it does.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.fx as fx

from tilecompile import graph as G

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
    outputs: dict[str, list[fx.Node]]  # "logp" / "entropy" -> the nodes whose uses read that output


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
    # TRL's function returns (logprobs, entropy)
    items = _getitems(node)
    if any(i not in (0, 1) for i in items) or sum(map(len, items.values())) != len(node.users):
        return None
    outputs = {"logp": items.get(0, []), "entropy": items.get(1, [])}
    return KernelCall(node, logits, index, mask, float(launch["TEMPERATURE"]), outputs)


def _from_launch(node: fx.Node) -> KernelCall | None:
    """TRL's forward kernel launched in this graph (under no_grad): its outputs are fresh empty buffers."""
    launch = _trl_forward_launch(node)
    if launch is None:
        return None
    position = {n: i for i, n in enumerate(node.graph.nodes)}
    outputs: dict[str, list[fx.Node]] = {}
    for key, param in (("logp", "logprobs_ptr"), ("entropy", "entropy_ptr")):
        buffer = launch[param]
        if not isinstance(buffer, fx.Node) or G.op(buffer) not in ("empty", "empty_like"):
            return None
        later = [u for u in buffer.users if position[u] > position[node]]
        if any(G.is_view_like(u) or G.mutated_args(u) for u in later):
            return None  # the buffer is written again or aliased afterwards: not a plain value
        outputs[key] = [buffer]
    mask = launch["row_mask_ptr"] if launch["HAS_MASK"] else None
    return KernelCall(node, launch["logits_ptr"], launch["index_ptr"], mask, float(launch["TEMPERATURE"]), outputs)


def find(gm: fx.GraphModule) -> list[KernelCall]:
    """Every call of TRL's log-prob / entropy kernel in ``gm``'s graph on logits a linear of this graph computes
    (the launch inside an autograd.Function's own body reads a placeholder: nothing to fuse there)."""
    calls = []
    for node in gm.graph.nodes:
        call = _from_apply(node, gm) or _from_launch(node)
        if call is not None and all(isinstance(n, fx.Node) for n in (call.logits, call.index)):
            if _after_linear(call.logits):
                calls.append(call)
    return calls


def _after_linear(node: fx.Node, budget: int = 64) -> bool:
    seen, todo = {node}, [node]
    while todo and len(seen) <= budget:
        n = todo.pop(0)
        if G.as_linear(n) is not None:
            return True
        for a in n.all_input_nodes:
            if a not in seen:
                seen.add(a)
                todo.append(a)
    return False


def describe(call: KernelCall) -> str:
    return f"TRL's Triton log-prob/entropy kernel ({TRL_MODULE}) at {call.node.name}"


def expand(call: KernelCall, b: Any) -> list[fx.Node]:
    """Insert the kernel's math in torch ops (with builder ``b``, placed before the call), route the call's uses to
    it and erase the call; returns the vocabulary-sized nodes inserted (the fused pass must consume them all)."""
    graph = call.node.graph
    position = {n: i for i, n in enumerate(graph.nodes)}
    z = call.logits
    if G.dtype(z) != torch.float32:
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
            index = call.index if G.dtype(call.index) == torch.int64 else b.call("long", call.index, method=True)
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
    for out in [o for key in ("logp", "entropy") for o in call.outputs[key]]:
        if out.op == "call_function" and out.target is operator.getitem and not out.users:
            graph.erase_node(out)
    if not call.node.users:
        graph.erase_node(call.node)
    return wide
