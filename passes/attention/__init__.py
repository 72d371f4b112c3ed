"""Rewrites SDPA calls fed an [N, N] mask computed from positions into attention that never builds the mask.

    sdpa(q, k, v, attn_mask=f(aranges, per-token tensors))  ->  sdpa(q, k, v, is_causal=True)         (f causal)
                                                            ->  masked_attention(q, k, v, pos, doc, valid, lo, hi)

Under torch.compile (torch < 2.14) Hugging Face builds a [B, 1, N, N] boolean mask from aranges, position ids and
the padding mask, and SDPA then runs its dense masked kernel: O(N²) memory and no flash. This pass reads what the
mask computes (``passes/attention/mask_algebra.py``): a mask proven purely causal becomes ``is_causal=True`` with no
mask (the flash kernel); packed documents, padding and sliding windows become ``tilecompile::masked_attention``, whose
inputs are the per-token tensors the mask was built from (flash varlen on CUDA where exact, chunked otherwise).

The mask is usually built once and used by every layer, inside activation-checkpoint bodies: the pass follows
it into a higher-order op's body, hands the body the per-token tensors instead (new operands and placeholders),
and rewrites the SDPA calls there; a slice of the mask that keeps all of it (transformers 4.57 slices it to the
key length in each layer, ``mask[:, :, :, : key.shape[-2]]``) is read through as the mask itself. Checks, each a
reason when it says no: the mask is index arithmetic over per-token tensors; every use of it is an SDPA mask
(directly, through a body, or through such a slice); q, k, v are 4-D with equal query and key lengths; dropout is 0
and ``is_causal`` False; GQA only with ``enable_gqa=True``. Keys and values repeated per query head in GQA's order
(HF's ``repeat_kv``, which it runs whenever SDPA gets a mask) are read through: the rewritten attention takes the
key heads themselves (``unrepeated``).
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.fx as fx

import tilecompile.ops.attention as attention_ops  # registers torch.ops.tilecompile.masked_attention
from tilecompile import graph as fxgraph
from tilecompile import reporting
from tilecompile.pass_api import PassContext, PassResult, expect
from tilecompile.passes.attention import mask_algebra

NAME = "attention"
_SDPA = {torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention}


def is_sdpa(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in _SDPA


def _mask_arg(node: fx.Node) -> Any:
    return fxgraph.arg(node, 3, "attn_mask")


def _body(gm: fx.GraphModule, hop: fx.Node) -> fx.GraphModule | None:
    """The body of a higher-order op call whose operands map one to one onto the body's placeholders."""
    if hop.op != "call_function" or not isinstance(hop.target, torch._ops.HigherOrderOperator):
        return None
    if hop.target.name() not in ("tag_activation_checkpoint", "wrap"):
        return None
    first = hop.args[0] if hop.args else None
    if not isinstance(first, fx.Node) or first.op != "get_attr":
        return None
    body = getattr(gm, first.target, None)
    return body if isinstance(body, fx.GraphModule) else None


def _mask_source(node: Any) -> Any:
    """The mask an SDPA reads, through views that keep all of it (transformers 4.57 slices the mask to the key
    length in its sdpa path, ``mask[:, :, :, : key.shape[-2]]``, which is the whole mask when it is that long)."""
    while isinstance(node, fx.Node) and (src := mask_algebra.whole_view(node)) is not None:
        node = src
    return node


def _placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


# ------------------------------------------------------------------------------------------------------ check


def check_sdpa(node: fx.Node) -> str | None:
    q, k, v = (fxgraph.arg(node, i, name) for i, name in enumerate(("query", "key", "value")))
    qs, ks, vs = fxgraph.shape(q), fxgraph.shape(k), fxgraph.shape(v)
    if qs is None or ks is None or vs is None:
        return "missing example values (shapes unknown)"
    if len(qs) != 4 or len(ks) != 4 or len(vs) != 4:
        return f"q {list(qs)}, k {list(ks)}, v {list(vs)} are not 4-D [B, H, N, D]"
    if not fxgraph.same_size(qs[2], ks[2]):
        return f"query length {qs[2]} != key length {ks[2]} (not self-attention over one sequence)"
    dropout = fxgraph.arg(node, 4, "dropout_p", 0.0)
    if not _is_zero(dropout):
        return f"dropout_p={dropout!r} (only 0 is rewritten)"
    if fxgraph.arg(node, 5, "is_causal", False) is not False:
        return "is_causal is already set together with a mask"
    if not fxgraph.same_size(qs[1], ks[1]) and not fxgraph.arg(node, 7, "enable_gqa", False):
        return f"{qs[1]} query heads and {ks[1]} key heads without enable_gqa"
    if fxgraph.dtype(q) not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        return f"dtype {fxgraph.dtype(q)}"
    return None


def _is_zero(value: Any) -> bool:
    """A literal 0, or a symbolic float (dynamic=True makes config floats symbolic) that is 0 under a guard."""
    if isinstance(value, fx.Node):
        value = fxgraph.example_value(value)
    if isinstance(value, torch.SymFloat | torch.SymInt):
        try:
            return bool(value == 0)  # guards on it: a call with another dropout recompiles
        except Exception:  # noqa: BLE001 - an unbacked value cannot be decided here
            return False
    return isinstance(value, int | float) and value == 0


def check_uses(gm: fx.GraphModule, mask: fx.Node) -> str | None:
    """Every use of ``mask`` is an SDPA mask that passes ``check_sdpa``, here or inside a body."""
    for user in mask.users:
        if is_sdpa(user) and _mask_arg(user) is mask and mask not in user.args[:3]:
            reason = check_sdpa(user)
            if reason:
                return f"{user.name}: {reason}"
            continue
        if mask_algebra.whole_view(user) is mask:  # the whole mask, sliced to the key length: its uses are the mask's
            reason = check_uses(gm, user)
            if reason:
                return reason
            continue
        body = _body(gm, user)
        if body is not None and len(user.args[0].users) > 1:
            return f"the body {user.args[0].target} of {user.name} is shared by several calls"
        if body is not None and mask not in user.kwargs.values():
            for i, a in enumerate(user.args[1:]):
                if a is mask:
                    reason = check_uses(body, _placeholders(body)[i])
                    if reason:
                        return reason
            continue
        return f"the mask is also used by {user.name} ({fxgraph.op(user) or user.target}), which would keep it alive"
    return None


# ---------------------------------------------------------------------------------------------------- rewrite


def _token_input(gm: fx.GraphModule, node: fx.Node, before: fx.Node) -> fx.Node:
    """``node`` as [B or 1, N] (a rank-1 per-token tensor gets a leading 1)."""
    if len(fxgraph.shape(node)) == 2:
        return node
    with gm.graph.inserting_before(before):
        new = gm.graph.call_method("unsqueeze", (node, 0))
    new.meta["example_value"] = fxgraph.example_value(node).unsqueeze(0)
    return new


def rewrite_uses(
    gm: fx.GraphModule, mask: fx.Node, spec: mask_algebra.MaskSpec, tokens: dict[str, fx.Node], out: list
) -> None:
    for user in list(mask.users):
        if is_sdpa(user):
            out.append(_rewrite_sdpa(gm, user, spec, tokens))
            continue
        if mask_algebra.whole_view(user) is mask:
            rewrite_uses(gm, user, spec, tokens, out)
            if not user.users:  # a body is not swept by the pass's dead-code elimination
                gm.graph.erase_node(user)
            continue
        body = _body(gm, user)
        phs = _placeholders(body)
        indices = [i for i, a in enumerate(user.args[1:]) if a is mask]
        new_tokens = {}
        for key, node in tokens.items():
            last = _placeholders(body)[-1]
            with body.graph.inserting_after(last):
                ph = body.graph.placeholder(f"{node.name}_{key}")
            ph.meta["example_value"] = fxgraph.example_value(node)
            user.args = (*user.args, node)
            new_tokens[key] = ph
        for i in indices:
            rewrite_uses(body, phs[i], spec, new_tokens, out)
        for i in sorted(indices, reverse=True):
            if not phs[i].users:
                body.graph.erase_node(phs[i])
                args = list(user.args)
                del args[1 + i]
                user.args = tuple(args)
        body.recompile()


def unrepeated(node: Any) -> fx.Node | None:
    """The [B, Hkv, N, D] source of a key or value that repeats each key head ``rep`` times in a row, or None:
    HF's ``repeat_kv`` (``x[:, :, None].expand(B, Hkv, rep, N, D).reshape(B, Hkv * rep, N, D)``, which it runs
    whenever SDPA gets a mask; ``flatten(1, 2)`` alike) or ``x.repeat_interleave(rep, dim=1)``. Query head h then
    reads key head h // rep, GQA's order, so attention can take the source itself: no [B, H, N, D] copies of k and
    v to gather, save and read back."""
    if not isinstance(node, fx.Node):
        return None
    shape = fxgraph.shape(node)
    if shape is None or len(shape) != 4:
        return None
    if fxgraph.op(node) == "repeat_interleave":
        src, dim = fxgraph.arg(node, 0, "input"), fxgraph.arg(node, 2, "dim")
        rep = fxgraph.arg(node, 1, "repeats")
        ok = isinstance(rep, int) and rep >= 1 and dim in (1, -3) and fxgraph.arg(node, 3, "output_size") is None
        return src if ok and isinstance(src, fx.Node) and len(fxgraph.shape(src) or ()) == 4 else None
    merged = fxgraph.op(node) in ("reshape", "view") or (
        fxgraph.op(node) == "flatten"
        and (fxgraph.arg(node, 1, "start_dim"), fxgraph.arg(node, 2, "end_dim")) in ((1, 2), (1, -3))
    )
    if not merged or not isinstance(node.args[0], fx.Node):
        return None
    expanded = node.args[0]
    es = fxgraph.shape(expanded)
    if fxgraph.op(expanded) != "expand" or es is None or len(es) != 5 or not isinstance(expanded.args[0], fx.Node):
        return None
    inserted = expanded.args[0]
    src = _unsqueezed_at_2(inserted)
    ss = fxgraph.shape(src) if src is not None else None
    if ss is None or len(ss) != 4 or not fxgraph.same_shape((ss[0], ss[1], 1, ss[2], ss[3]), fxgraph.shape(inserted)):
        return None
    rep, hkv = fxgraph.static_size(es[2]), fxgraph.static_size(ss[1])
    if rep is None or hkv is None or fxgraph.static_size(shape[1]) != hkv * rep:
        return None
    if not (
        fxgraph.same_shape(es, (ss[0], ss[1], es[2], ss[2], ss[3]))
        and fxgraph.same_shape(shape, (ss[0], shape[1], *ss[2:]))
    ):
        return None
    return src


def _unsqueezed_at_2(node: fx.Node) -> fx.Node | None:
    """``x`` where ``node`` is ``x.unsqueeze(2)`` or ``x[:, :, None]`` (a 4-D x)."""
    if fxgraph.op(node) == "unsqueeze" and fxgraph.arg(node, 1, "dim") == 2:
        return node.args[0] if isinstance(node.args[0], fx.Node) else None
    if fxgraph.op(node) == "getitem" and isinstance(node.args[0], fx.Node) and isinstance(node.args[1], tuple):
        full = slice(None, None, None)
        index = node.args[1]
        if index[:3] == (full, full, None) and all(i == full or i is Ellipsis for i in index[3:]):
            return node.args[0]
    return None


def _rewrite_sdpa(
    gm: fx.GraphModule, node: fx.Node, spec: mask_algebra.MaskSpec, tokens: dict[str, fx.Node]
) -> reporting.Rewrite:
    q, k, v = (fxgraph.arg(node, i, name) for i, name in enumerate(("query", "key", "value")))
    scale = fxgraph.arg(node, 6, "scale")
    qs = fxgraph.shape(q)
    graph = gm.graph
    gqa = fxgraph.arg(node, 7, "enable_gqa", False)
    k0, v0 = unrepeated(k), unrepeated(v)
    if k0 is not None and v0 is not None and fxgraph.same_size(fxgraph.shape(k0)[1], fxgraph.shape(v0)[1]):
        k, v, gqa = k0, v0, True  # repeat_kv read through: attention takes GQA's key heads
    ks = fxgraph.shape(k)
    through = f"; GQA {qs[1]}/{ks[1]} heads, repeat_kv read through" if k is k0 and k0 is not None else ""
    if spec.is_causal or spec.is_full:
        dropout = fxgraph.arg(node, 4, "dropout_p", 0.0)  # 0, perhaps symbolic: kept as the graph had it
        kwargs = {"attn_mask": None, "dropout_p": dropout, "is_causal": spec.is_causal, "scale": scale}
        if gqa:
            kwargs["enable_gqa"] = True
        with graph.inserting_before(node):
            new = graph.call_function(node.target, (q, k, v), kwargs)
        detail = "is_causal=True, no mask (flash)" if spec.is_causal else "no mask (nothing masked)"
        expect(new, fxgraph.example_value(node))
        result = new
    else:
        if scale is None:
            scale = 1.0 / math.sqrt(fxgraph.hint(qs[-1]))
        elif isinstance(scale, fx.Node):  # a symbolic float under dynamic=True: specialised, under a guard
            scale = float(fxgraph.example_value(scale))
        # Under autocast SDPA computes in the autocast dtype whatever q, k, v are (RoPE's fp32 cos / sin make q and k
        # fp32 beside a bf16 v); the op does not autocast, so it gets the casts autocast would make.
        want = fxgraph.example_value(node).dtype
        with graph.inserting_before(node):
            q, k, v = (_cast(graph, t, want) for t in (q, k, v))
        plan = [tokens[f"plan{i}"] for i in range(PLAN_SIZE)] if "plan0" in tokens else []
        args = (
            q,
            k,
            v,
            tokens.get("pos"),
            tokens.get("doc"),
            tokens.get("valid"),
            spec.lo,
            spec.hi,
            float(scale),
            plan,
        )
        with graph.inserting_before(node):
            call = graph.call_function(torch.ops.tilecompile.masked_attention.default, args)
            result = graph.call_function(operator.getitem, (call, 0))
        ev = fxgraph.example_value(node)
        lse_dtype = torch.float64 if ev.dtype == torch.float64 else torch.float32
        expect(call, (ev, ev.new_empty(ev.shape[:-1], dtype=lse_dtype)))
        detail = f"masked_attention: {spec.describe()}"
        new = call
    for n in (new, result):
        n.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
        n.meta.setdefault("stack_trace", node.meta.get("stack_trace"))
    node.replace_all_uses_with(result)
    graph.erase_node(node)
    shapes = {"q": tuple(fxgraph.hint(s) for s in qs), "k": tuple(fxgraph.hint(s) for s in ks)}
    path = fxgraph.module_path(result) or fxgraph.module_path(new)
    return reporting.Rewrite(NAME, path, shapes, {"q": str(fxgraph.dtype(q)).replace("torch.", "")}, detail + through)


# ------------------------------------------------------------------------------------------------------- run


def run(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    result = PassResult()
    masks: dict[fx.Node, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if is_sdpa(node) and isinstance(_mask_arg(node), fx.Node):
            masks.setdefault(_mask_source(_mask_arg(node)), []).append(node)
        elif (body := _body(gm, node)) is not None:
            phs = _placeholders(body)
            for i, a in enumerate(node.args[1:]):
                if isinstance(a, fx.Node) and i < len(phs) and _reaches_sdpa_mask(body, phs[i]):
                    masks.setdefault(a, [])
    for mask, direct in masks.items():
        if mask.op == "placeholder" and (direct or ctx.graph_name != "<root>"):
            # a body's mask comes from its parent graph, which reads it there; an input of the root graph that
            # SDPA reads directly gets its reason from tilecompile/graph_breaks.py, which names the break
            continue
        seq = (fxgraph.shape(mask) or (None,))[-1]  # checked against q and k at each use
        candidate = f"mask {mask.name}"
        result.consider(mask, candidate)
        if mask.op == "placeholder":  # the root graph's input, read by SDPA inside a checkpointed layer's body
            path = next((p for u in mask.users if (p := fxgraph.module_path(u))), "")
            result.skip(mask, reporting.Skip(NAME, candidate, path, _INPUT_MASK_REASON))
            continue
        path = fxgraph.module_path(direct[0]) if direct else ""
        try:
            spec = mask_algebra.analyze(mask, seq) if seq is not None else None
        except mask_algebra.NotIndexArithmetic as exc:
            result.skip(mask, reporting.Skip(NAME, candidate, path, f"the mask is not index arithmetic: {exc}"))
            continue
        if spec is None:
            result.skip(mask, reporting.Skip(NAME, candidate, path, "sequence length unknown"))
            continue
        reason = check_uses(gm, mask)
        if reason:
            result.skip(mask, reporting.Skip(NAME, candidate, path, reason))
            continue
        tokens = {}
        first_user = min(mask.users, key=_order(gm))
        for key in ("pos", "doc", "valid"):
            node = getattr(spec, key)
            if node is not None:
                tokens[key] = _token_input(gm, node, first_user)
        if spec.valid_test is not None:  # pad != 0, pad == 1, ...: the boolean the mask reads, made once
            tokens["valid"] = _tested(gm, tokens["valid"], spec.valid_test, first_user)
        if spec.chunk is not None:  # chunked local attention: the chunk ids, made once, are the documents
            tokens["doc"] = _chunk_ids(gm, spec.chunk, first_user)
        if tokens and not (spec.is_causal or spec.is_full):
            tokens |= _plan(gm, spec, tokens, first_user)
        rewritten: list[reporting.Rewrite] = []
        rewrite_uses(gm, mask, spec, tokens, rewritten)
        for r in rewritten:
            result.rewrote(mask, r)
    for node in gm.graph.nodes:
        if _eager_attention(node):
            candidate = "matmul-softmax-matmul attention"
            result.consider(node, candidate)
            result.skip(node, reporting.Skip(NAME, candidate, fxgraph.module_path(node), _EAGER_REASON))
    if result.rewrites:
        fxgraph.eliminate_dead_code(gm.graph)
    return result


_INPUT_MASK_REASON = (
    "the mask is an input of the compiled graph (made by the caller, or in an earlier graph before a graph break) "
    "and reaches SDPA inside a layer's body: its construction cannot be read, so the attention stays dense; let "
    "the graph that attends build the mask (compile the step whole, or per block with the mask built inside it)"
)
_EAGER_REASON = (
    "attention spelled out as matmul, softmax and matmul (the model's eager attention implementation): its "
    "[B, H, N, N] scores are built, and saved for backward; this pass rewrites SDPA calls only. Load the model with "
    "attn_implementation='sdpa' where it has that path (Gemma 2's attention softcapping has none)"
)
_SCORE_STEPS = frozenset({"add", "sub", "mul", "div", "tanh", "float", "to", "type_as", "masked_fill", "contiguous"})


def _eager_attention(node: fx.Node) -> bool:
    """``node`` is the softmax of attention written out: its input, through a few elementwise steps (scale, mask,
    softcap, casts), is a matmul whose [..., N, M] output it normalises, and a matmul (after casts or dropout)
    reads its result."""
    if fxgraph.op(node) != "softmax" or len(fxgraph.shape(node) or ()) != 4:
        return False
    src, steps = node.args[0] if node.args else None, 8
    while isinstance(src, fx.Node) and steps and fxgraph.op(src) in _SCORE_STEPS:
        nodes = [
            a
            for a in src.args
            if isinstance(a, fx.Node) and fxgraph.same_shape(fxgraph.shape(a) or (), fxgraph.shape(node))
        ]
        src, steps = (nodes[0] if nodes else None), steps - 1
    if not isinstance(src, fx.Node) or fxgraph.op(src) != "matmul":
        return False
    todo, steps = list(node.users), 6
    while todo and steps:
        user, steps = todo.pop(), steps - 1
        if fxgraph.op(user) == "matmul" and user.args and user.args[0] is not None:
            return True
        if fxgraph.op(user) in ("dropout", "to", "float", "type_as", "contiguous"):
            todo += list(user.users)
    return False


PLAN_SIZE = 8  # the tensors of tilecompile::attention_plan (attention_ops.plan_fakes)


def _cast(graph: fx.Graph, t: fx.Node, dtype: torch.dtype) -> fx.Node:
    if fxgraph.dtype(t) == dtype:
        return t
    new = graph.call_method("to", (t, dtype))
    new.meta["example_value"] = fxgraph.example_value(t).to(dtype)
    return new


_TESTS = {"eq": torch.eq, "ne": torch.ne, "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge}


def _chunk_ids(gm: fx.GraphModule, chunk: mask_algebra.Chunk, before: fx.Node) -> fx.Node:
    """[B or 1, N] chunk ids (t + Σ coef · row[b] + const) // k, t = 0 .. N-1, from the mask's own arange."""
    graph = gm.graph

    def emit(fn, args):
        new = graph.call_function(fn, args)
        new.meta["example_value"] = fn(*(fxgraph.example_value(a) if isinstance(a, fx.Node) else a for a in args))
        return new

    with graph.inserting_before(before):
        ids = emit(torch.unsqueeze, (chunk.index, 0))
        for row, coef in chunk.rows:
            term = emit(torch.unsqueeze, (row, -1))
            ids = emit(operator.add, (ids, term if coef == 1 else emit(operator.mul, (term, coef))))
        if chunk.const - chunk.start:
            ids = emit(operator.add, (ids, chunk.const - chunk.start))
        return emit(operator.floordiv, (ids, chunk.k))


def _tested(gm: fx.GraphModule, node: fx.Node, test: tuple[str, int], before: fx.Node) -> fx.Node:
    op, k = test
    with gm.graph.inserting_before(before):
        new = gm.graph.call_function(_TESTS[op], (node, k))
    new.meta["example_value"] = _TESTS[op](fxgraph.example_value(node), k)
    return new


def _plan(
    gm: fx.GraphModule, spec: mask_algebra.MaskSpec, tokens: dict[str, fx.Node], before: fx.Node
) -> dict[str, fx.Node]:
    """One ``attention_plan`` call beside the mask: every layer's op reads the packing (and the one host sync's
    result) from it instead of working it out again."""
    args = (tokens.get("pos"), tokens.get("doc"), tokens.get("valid"), spec.lo, spec.hi)
    values = [fxgraph.example_value(tokens[key]) for key in ("pos", "doc", "valid") if key in tokens]
    fakes = attention_ops.plan_fakes(values[0], max(v.shape[0] for v in values) * values[0].shape[-1])
    with gm.graph.inserting_before(before):
        call = gm.graph.call_function(torch.ops.tilecompile.attention_plan.default, args)
        items = {}
        for i, fake in enumerate(fakes):
            item = gm.graph.call_function(operator.getitem, (call, i))
            item.meta["example_value"] = fake
            items[f"plan{i}"] = item
    expect(call, fakes)
    call.meta["nn_module_stack"] = before.meta.get("nn_module_stack", {})
    return items


def _order(gm: fx.GraphModule):
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    return lambda n: index[n]


def _reaches_sdpa_mask(body: fx.GraphModule, ph: fx.Node) -> bool:
    for user in ph.users:
        if is_sdpa(user) and _mask_arg(user) is ph:
            return True
        if mask_algebra.whole_view(user) is ph and _reaches_sdpa_mask(body, user):
            return True
        inner = _body(body, user)
        if inner is not None:
            phs = _placeholders(inner)
            if any(a is ph and _reaches_sdpa_mask(inner, phs[i]) for i, a in enumerate(user.args[1:])):
                return True
    return False
