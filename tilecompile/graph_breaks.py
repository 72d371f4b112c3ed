"""Regions a graph break split before the passes could see them whole, named in the report with what to do.

A pass can only rewrite what one graph holds. When Dynamo ends a graph between the lm_head and its log-softmax
(FSDP2's hooks are ``torch._dynamo.disable``d, so a whole-step compile breaks at every wrapped module; a
``print``; a library's autograd.Function), the [tokens, vocab] logits are built and cross the break; when the
attention mask is built in an earlier graph, each layer's graph gets the [B, 1, N, N] mask as an input and runs
dense masked attention. ``notes(gm)`` looks for the ends of such regions in one graph, after the passes:

- a linear whose output is (a view, cast or scaling of) a graph output, looks like an lm_head (module named
  ``lm_head`` / ``output`` / ``embed_out``, or out_features >= 8 x in_features) and feeds no softmax here (where
  one does, ``passes/lm_head/__init__.py`` judges it): the logits leave the graph;
- a graph input read by log_softmax / logsumexp / softmax / cross-entropy over its last dim: logits enter it;
- an SDPA whose ``attn_mask`` is a graph input: the mask was built in an earlier graph.

Each becomes a ``Skip`` of the pass that would have rewritten the region, with Dynamo's reason for ending the
graph where it has one (``gm.compile_subgraph_reason``).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from tilecompile import graph as fxgraph
from tilecompile import reporting

_HEAD_NAMES = ("lm_head", "output", "embed_out")
_THROUGH = frozenset({"getitem", "div", "mul", "float", "to", "contiguous", "view", "reshape", "flatten"})
_SOFTMAX = frozenset({"log_softmax", "logsumexp", "softmax", "cross_entropy"})
_SDPA = (torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention)
_FIX_HEAD = (
    "put the lm_head and the loss in one function with no break between them: under FSDP2 wrap the model in "
    "tilecompile.LossHead(model, loss_fn) and compile that (README, 'FSDP2 and DDP'); elsewhere remove the break "
    "(TORCH_LOGS=graph_breaks shows it)"
)


# Hugging Face's ``enable_input_require_grads`` (turned on with activation checkpointing for models fed input_ids)
# registers a forward hook on the input embeddings that calls ``output.requires_grad_(True)``. With frozen embeddings
# (PEFT / LoRA, or embeddings frozen by hand) that changes a tensor's requires_grad inside the step, which Dynamo
# does not trace: it breaks the graph there, in every step (torch 2.13 records "requires_grad_() intermediate leaked
# as output" or "Unsupported Tensor.requires_grad_() call"), and each frame around the call becomes a graph of its
# own. The hook exists for reentrant checkpointing; the non-reentrant one (transformers 5's default) needs none.
_REQUIRES_GRAD_BREAK = "requires_grad_()"
_FIX_REQUIRES_GRAD = (
    "Dynamo broke a graph at a requires_grad_() call since tilecompile.reset(): Hugging Face's "
    "enable_input_require_grads hook on the input embeddings does that when they are frozen (PEFT, LoRA); with "
    "non-reentrant activation checkpointing it is not needed: call model.disable_input_require_grads() after "
    "enabling checkpointing (tilecompile.integrations.compile_trainer does this for Trainer and TRL)"
)


# a break at a function Dynamo was told not to trace: FSDP2's hooks (each ``torch._dynamo.disable``d) are the usual one
_DISABLED_BREAK = ("disable", "fsdp")
_FIX_NO_LOSS = (
    "no graph break split the step: compile the function that computes the loss from the logits (the model "
    "forward, the log-probs and the loss in one torch.compile; README, Quickstart)"
)


def _fix_head() -> str:
    """What to do about the lm_head's logits leaving its graph, from what Dynamo recorded since
    ``tilecompile.reset()``: no break at all (the user compiled the model without its loss), a break this project
    knows (HF's input-grad hook, FSDP2's disabled hooks), or another break, named."""
    new = reporting.new_breaks()
    if not new:
        return _FIX_NO_LOSS
    if any(_REQUIRES_GRAD_BREAK in reason for reason in new):
        return _FIX_REQUIRES_GRAD
    if any(word in reason.lower() for reason in new for word in _DISABLED_BREAK):
        return _FIX_HEAD
    first = next(iter(new)).splitlines()[0][:160]
    return (
        "put the lm_head and the loss in one function with no break between them; Dynamo broke the graph since "
        f"tilecompile.reset() at: {first} (TORCH_LOGS=graph_breaks shows where)"
    )


def _returned_unbroken(gm: fx.GraphModule) -> bool:
    """The graph ends where its function returns, and Dynamo broke no graph since ``tilecompile.reset()``: the
    function torch.compile was given returns this graph's outputs."""
    reason = getattr(getattr(gm, "compile_subgraph_reason", None), "reason", None)
    return str(reason).startswith("return_value") and not reporting.new_breaks()


def _break_reason(gm: fx.GraphModule) -> str:
    reason = getattr(getattr(gm, "compile_subgraph_reason", None), "reason", None)
    if not reason:
        return ""
    if str(reason).startswith("return_value"):
        # a frame compiled on its own: a graph break in a caller (FSDP2's hooks around a call) ended the caller's
        # graph, so each function's code up to its return is a graph of its own
        return (
            " (the graph ends where its function returns: a graph break around the call left the caller's code, "
            "where the loss is, in another graph)"
        )
    return f" (Dynamo ended the graph: {str(reason).splitlines()[0][:160]})"


def _source(node: fx.Node, limit: int = 8) -> fx.Node:
    """Back through slices, casts, views and scalings to what made ``node``."""
    while limit and node.op in ("call_function", "call_method") and fxgraph.op(node) in _THROUGH:
        args = [a for a in node.args if isinstance(a, fx.Node)]
        if len(args) != 1:
            break
        node, limit = args[0], limit - 1
    return node


def _reaches_softmax(node: fx.Node) -> bool:
    """A softmax-family op reads ``node`` in this graph: the lm_head pass then judges it (and says why it skips)."""
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        for user in n.users:
            if user not in seen:
                if fxgraph.op(user) in _SOFTMAX:
                    return True
                seen.add(user)
                todo.append(user)
    return False


def _is_head(linear: fxgraph.Linear) -> bool:
    if fxgraph.module_path(linear.node).rsplit(".", 1)[-1] in _HEAD_NAMES:
        return True
    w = fxgraph.shape(linear.weight)
    out_f, in_f = (fxgraph.hint(w[0]), fxgraph.hint(w[1])) if w and len(w) == 2 else (None, None)
    return bool(out_f and in_f and out_f >= 8 * in_f)


def notes(gm: fx.GraphModule) -> list[reporting.Skip]:
    out: list[reporting.Skip] = []
    output = next((n for n in gm.graph.nodes if n.op == "output"), None)
    returned = [a for a in torch.utils._pytree.tree_leaves(output.args) if isinstance(a, fx.Node)] if output else []
    seen: set[fx.Node] = set()
    for node in returned:
        src = _source(node)
        linear = fxgraph.as_linear(src) if src.op != "placeholder" else None
        if linear is None or src in seen or not _is_head(linear) or _reaches_softmax(src):
            continue
        seen.add(src)
        logits = f"the logits {list(fxgraph.shape(src) or ())}"
        if _returned_unbroken(gm):
            reason = (
                f"{logits} are what the compiled function returns: the loss that reads them runs outside the "
                f"compile, so they are built whole; {_FIX_NO_LOSS}"
            )
        else:
            reason = (
                f"{logits} leave this graph as an output{_break_reason(gm)}: the log-softmax / loss that reads "
                f"them is in another graph, so they are built whole; {_fix_head()}"
            )
        out.append(reporting.Skip("fused_linear_ce", "lm_head", fxgraph.module_path(src), reason))  # fmt: skip
    for node in gm.graph.nodes:
        if fxgraph.op(node) in _SOFTMAX and node.args:
            src = fxgraph.graph_input(_source(node.args[0])) if isinstance(node.args[0], fx.Node) else None
            if src is None or src.op != "placeholder" or src in seen:
                continue
            value = getattr(src.meta.get("grapharg"), "example", None)
            if isinstance(value, torch.nn.Parameter) or len(fxgraph.shape(src) or ()) < 2:
                continue
            seen.add(src)
            out.append(reporting.Skip(
                "fused_linear_ce", f"{fxgraph.op(node)} of an input", fxgraph.module_path(node),
                f"its logits {list(fxgraph.shape(src))} are an input of this graph (made by an lm_head in an earlier "
                f"graph, before a graph break), so no lm_head is here to fuse; {_fix_head()}",
            ))  # fmt: skip
        elif node.op == "call_function" and node.target in _SDPA:
            mask = fxgraph.arg(node, 3, "attn_mask")
            src = fxgraph.graph_input(mask) if isinstance(mask, fx.Node) else None
            if src is None or src.op != "placeholder":
                continue
            out.append(reporting.Skip(
                "attention", "sdpa", fxgraph.module_path(node),
                f"its attn_mask {list(fxgraph.shape(src) or ())} is an input of this graph (made by the caller, "
                "or in an earlier graph before a graph break), so its construction cannot be read and the attention "
                "stays dense; let the graph that attends build the mask (compile the step whole, or per block with "
                "the mask built inside the block)",
            ))  # fmt: skip
    return out


__all__ = ["notes"]
