"""The lm_head pass's rewrite: one region of ``passes/lm_head/algebra.py`` -> calls of the fused op.

``rewrite(gm, region, escapes, ...)`` inserts before the first outside use of the region: h (cast to the linear's
output dtype, as autocast does) with the logits' views and slices replayed on it (``logits[:, :-1]`` becomes
``h[:, :-1]``) and a tensor temperature folded in, one ``tilecompile::fused_linear_logprob`` call per (logits view,
labels, ignore_index) (``fused_linear_logprob_loss`` in the loss-aware mode, ``vocab_parallel_logprob`` for a
vocab-parallel lm_head), and each escaping value rebuilt from logp / entropy and cast back to the dtype it had.
Mean CE is ``−Σ logp / count(labels != ignore_index)`` (0/0 = nan, as ``F.cross_entropy``). Then the region is
erased. On ``Reject`` nothing it inserted is left behind (hoisting only moves pure nodes).
"""

from __future__ import annotations

import collections
import functools
import math
import operator
from typing import Any

import torch
import torch.fx as fx

from tilecompile import graph as G
from tilecompile import reporting as R
from tilecompile.pass_api import expect
from tilecompile.passes.lm_head import algebra as A
from tilecompile.passes.lm_head import loss_aware as LA

NAME = "fused_linear_ce"  # the pass's name in its records (passes/lm_head/__init__.py)

# the ignore_index a lone gather gets (tilecompile/ops/fused_linear_ce.py's NO_IGNORE): no label equals it, so a
# negative label is the op's out-of-range error (eager's gather raises) instead of a silent log-prob of 0
_NO_IGNORE = -(2**63)
_SPELLING_OPS = frozenset(
    {"log_softmax", "softmax", "logsumexp", "exp", "gather", "take_along_dim", "cross_entropy", "nll_loss"}
)


# --------------------------------------------------------------------------------------------------- rewrite


class Builder:
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
        raise A.Reject(f"{node.name} is computed after the log-probs are first used and cannot be moved")
    for a in node.all_input_nodes:
        _hoist(a, anchor, position)
    anchor.prepend(node)
    position[node] = position[anchor] - 0.5


def _replay(b: Builder, h: fx.Node, node: fx.Node, d: int) -> fx.Node:
    """Apply the view/slice ``node`` (of [..., V] logits) to ``h`` ([..., D])."""
    name = G.op(node)
    if name in ("view", "reshape"):
        sizes = A.view_sizes(node)
        sizes = [*sizes[:-1], sizes[-1] if sizes[-1] == -1 else d]
        return b.call(name, h, *sizes, method=True)
    args = (h, *node.args[1:])
    if node.op == "call_method":
        return b.call(node.target, *args, method=True, **node.kwargs)
    return b.call(node.target, *args, **node.kwargs)


def temperature_of(chain: A.Chain) -> float:
    return 1.0 / chain.scale


def rewrite(
    gm: fx.GraphModule,
    r: A.Region,
    escapes: list[fx.Node],
    settings: Any,
    op: Any,
    tainted: set[fx.Node],
    in_body: bool = False,
) -> R.Rewrite:
    """Insert the fused calls, rebuild each escaping value, erase the region; on A.Reject nothing is left behind."""
    new: list[fx.Node] = []
    try:
        return _rewrite_region(gm, r, escapes, settings, op, new, tainted, in_body)
    except A.Reject:
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
    pinned_sizes = [n for n in escapes if isinstance(r.values[n], A.Size)]  # of the logits, ints in every call
    escapes = [n for n in escapes if n not in pinned_sizes]
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
        raise A.Reject("no fake tensors on the graph to build the rewrite with")
    b = Builder(graph, anchor, fake_mode, lin.node)
    b.new = new
    d = int(G.shape(weight)[1])
    compute = G.dtype(lin.node)  # the linear's output dtype: h's, or autocast's
    if G.dtype(weight) != compute:
        weight = b.call("to", weight, compute, method=True)

    # which (base, labels, ignore) calls each escaping value needs
    calls: dict[fx.Node, dict[tuple, dict[str, Any]]] = {}
    needs_entropy: set[fx.Node] = set()
    needs_lse: set[fx.Node] = set()  # bases of row values with lse on its own (z-loss): the op returns lse
    needs_zsum: set[fx.Node] = set()  # bases of row values with Σ_j z_j (label smoothing): the op returns it
    needs_argmax: set[fx.Node] = set()  # bases whose argmax is used (token accuracy)
    for node in escapes:
        v = r.values[node]
        keys = []
        if isinstance(v, A.Argmax):
            needs_argmax.add(v.base)
        elif isinstance(v, A.Reduced):
            keys.append((v.labels, v.ignore))
            if v.smoothing:
                needs_lse.add(v.base)
                needs_zsum.add(v.base)
        else:
            if abs(lse_coefficient(v)) > 1e-12:
                needs_lse.add(v.base)
            for k, _ in v.terms:
                if k == "spz":
                    needs_entropy.add(v.base)
                elif k == "zsum":
                    needs_zsum.add(v.base)
                elif isinstance(k, tuple) and k[0] == "zy":
                    keys.append((k[1], A.ANY_NEGATIVE))
                elif isinstance(k, tuple) and k[0] in ("ce", "wce", "smooth"):
                    keys.append((k[1], k[2]))
                    if k[0] == "smooth":
                        needs_lse.add(v.base)
                        needs_zsum.add(v.base)
        for key in keys:
            calls.setdefault(v.base, {}).setdefault(key, {})
    for base in needs_entropy | needs_lse | needs_zsum | needs_argmax:
        calls.setdefault(base, {})

    # merge a gather's labels (any negative ignore_index) into a CE call on the same labels with a negative one
    for keyed in calls.values():
        for labels, ignore in list(keyed):
            if ignore != A.ANY_NEGATIVE:
                continue
            twin = next((k for k in keyed if k[0] is labels and k[1] != A.ANY_NEGATIVE and k[1] < 0), None)
            keyed[(labels, ignore)] = {"alias": twin} if twin else {}

    # the loss-aware mode (grads in the forward) when the escaping values reduce to one scalar loss
    plan, mode = _loss_mode(r, escapes, calls, settings, modes, switch, tainted, gm if in_body else None, anchor)

    # everything the calls read must exist before the anchor: move pure label computations up if needed
    for base, keyed in calls.items():
        chain = r.chain(base)
        for n in (*(t for _, t in chain.tensor_scales), *(k[0] for k in keyed), chain.bias):
            _hoist(n, anchor, position)
    for n in plan.externals if plan is not None else ():
        _hoist(n, anchor, position)
    for node in escapes:  # class weights
        v = r.values[node]
        if isinstance(v, A.Argmax):
            continue
        weights = [v.weight] if isinstance(v, A.Reduced) else [k[3] for k, _ in v.terms if _is_term(k, "wce")]
        for w in weights:
            _hoist(w, anchor, position)

    results: dict[fx.Node, dict[Any, Any]] = {}
    n_calls = 0
    rows: list[int] = []
    for base, keyed in calls.items():
        chain = r.chain(base)
        hb = h if G.dtype(h) == compute else b.call("to", h, compute, method=True)
        for view in chain.replay:
            hb = _replay(b, hb, view, d)
        bias = chain.bias
        for kind, t in chain.tensor_scales:
            hb = b.call(operator.truediv if kind == "div" else operator.mul, hb, t)
            if bias is not None:  # (h·Wᵀ + b) / t = (h / t)·Wᵀ + b / t: the bias is scaled with h
                bias = b.call(operator.truediv if kind == "div" else operator.mul, bias, t)
        if chain.tensor_scales:
            hb = b.call("to", hb, compute, method=True)
            if bias is not None and G.dtype(bias) != G.dtype(chain.bias):
                bias = b.call("to", bias, G.dtype(chain.bias), method=True)
        device = G.example_value(h).device
        rows.append(math.prod(G.hint(s) or 0 for s in G.shape(hb)[:-1]))
        out: dict[Any, Any] = {"entropy": None, "lse": None, "zsum": None, "argmax": None}
        todo = [k for k, spec in keyed.items() if "alias" not in spec] or [None]  # None: entropy only
        for key in todo:
            if key is None:
                first = b.call(operator.getitem, hb, (Ellipsis, 0))
                labels, ignore = b.call(torch.full_like, first, A.DEFAULT_IGNORE, dtype=torch.int64), A.DEFAULT_IGNORE
            else:
                labels, ignore = key
                ignore = _NO_IGNORE if ignore == A.ANY_NEGATIVE else ignore
                lead = G.shape(hb)[:-1]
                if not A.same_written_shape(G.shape(labels), lead):
                    if A.is_static(G.shape(labels)) and A.is_static(lead):  # labels of a reshaped view of these rows
                        labels = b.call("reshape", labels, [G.static_size(s) for s in lead], method=True)
                    elif A.ndim_of(labels) == len(lead) + 1:  # a gather index [..., 1]
                        labels = b.call(torch.squeeze, labels, -1)
            with_entropy = base in needs_entropy and out["entropy"] is None
            with_lse = base in needs_lse and out["lse"] is None
            with_zsum = base in needs_zsum and out["zsum"] is None
            with_argmax = base in needs_argmax and out["argmax"] is None
            ls = G.shape(labels)
            # the chunk setting of this compile (options= included), not the op's default read from the env
            args = [hb, weight, labels, float(temperature_of(chain)), int(ignore), with_entropy, settings.check_inputs,
                    int(settings.ce_vocab_chunk)]  # fmt: skip
            vp = r.vocab_parallel
            if vp is not None and int(ignore) >= 0:
                raise A.Reject(f"ignore_index={ignore}: the vocab-parallel op needs a negative one (logits gathered)")
            extras = needs_lse | needs_zsum | needs_argmax
            if vp is not None and (chain.bias is not None or chain.softcap or base in extras):
                raise A.Reject(
                    "a vocab-parallel lm_head with a bias, a softcap or lse on its own (the vocab-parallel op has none)"
                )
            with fake_mode:
                expected = (
                    torch.empty(ls, dtype=torch.float32, device=device),
                    torch.empty(ls if with_entropy else (0,), dtype=torch.float32, device=device),
                )
            ext = plan is None and vp is None
            ext = ext and (chain.bias is not None or bool(chain.softcap) or base in extras)  # loss-aware: a softcap
            if ext:  # the op with options: a bias, a softcap, lse, Σz, argmax
                args = [*args, bias, float(chain.softcap), with_lse, with_zsum, with_argmax]
                fused = b.call(_ext_op(), *args)
                with fake_mode:
                    rows_if = [torch.empty(ls if on else (0,), dtype=dt, device=device)
                               for on, dt in ((with_lse, torch.float32), (with_zsum, torch.float32),
                                              (with_argmax, torch.int64))]  # fmt: skip
                    expected = (*expected, *rows_if)
            elif vp is not None:  # the local weight's statistics, reduced across the group; no logits gathered
                args = [*args[:6], int(settings.ce_vocab_chunk), vp.group, vp.world, vp.rank]
                fused = b.call(_vocab_parallel_op(), *args)
            elif plan is not None:  # extras and key are set once the loss function is extracted (below)
                detached = [b.call("detach", x, method=True) for x in (hb, weight)]
                args = [*detached, *args[2:7], [], 0, int(settings.ce_loss_block_rows), _grad_backend(settings, device),
                        float(chain.softcap)]  # fmt: skip
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
            # the op's outputs after the log-prob, in its order: each one the region reads gets its getitem
            wanted = (("entropy", with_entropy), ("lse", with_lse), ("zsum", with_zsum), ("argmax", with_argmax))
            for index, (name, read) in enumerate(wanted, start=1):
                if read:
                    out[name] = b.call(operator.getitem, fused, index)
                    expect(out[name], expected[index])
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
        if isinstance(v, A.Reduced):
            value = _reduced_value(b, v, out, r.vocab)
        elif isinstance(v, A.Argmax):
            value = b.call(torch.unsqueeze, out["argmax"], -1) if v.keepdim else out["argmax"]
        else:
            value = _row_value(b, v, out, r.vocab)
        want = G.example_value(node)
        if not A.same_written_shape(G.shape(value), tuple(want.shape)):  # a row value of a reshaped view of the base
            shape = [s if G.static_size(s) is None else G.static_size(s) for s in want.shape]  # pinned: as ints
            value = b.call("reshape", value, _traceable(shape), method=True)
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

    for node in pinned_sizes:  # every use, the views replayed on h included, gets the int
        pinned = functools.partial(lambda n, item, a: item if a is n else a, node, r.values[node].item)
        for user in list(node.users):
            user.args, user.kwargs = fx.node.map_arg((user.args, user.kwargs), pinned)

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
    biases = sorted({r.chain(bn).bias.name for bn in calls if r.chain(bn).bias is not None})
    caps = sorted({f"{r.chain(bn).softcap:g}" for bn in calls if r.chain(bn).softcap})
    autocast += f"; bias {'/'.join(biases)}" if biases else ""
    autocast += f"; softcap {'/'.join(caps)}" if caps else ""
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
    elif any(r.chain(base).bias is not None for base in calls):
        why = "the loss-aware op has no bias"
    elif any(isinstance(r.values[n], A.Argmax) for n in escapes):
        why = "the loss-aware op has no argmax output"
    elif any(isinstance(r.values[n], A.Row) and abs(lse_coefficient(r.values[n])) > 1e-12 for n in escapes):
        why = "the loss-aware op has no lse output (z-loss)"
    elif any(_smoothed_or_weighted(r.values[n]) for n in escapes):
        why = "the loss-aware op has no label smoothing (Σz) or class weights"
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
    if isinstance(v, A.Reduced):
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
    before = Builder(graph, fused, fake_mode, meta_from)
    grad_free = [before.call("detach", n, method=True) if _needs_grad(n) else n for n in externals]
    fused.update_arg(7, grad_free)
    fused.update_arg(8, register_loss(fn, fn.code))
    b = Builder(graph, loss.next, fake_mode, meta_from)
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


def _ext_op() -> Any:
    import tilecompile.ops.fused_linear_ce  # noqa: F401 - registers the op

    return torch.ops.tilecompile.fused_linear_logprob_ext.default


def _anchor_op() -> Any:
    import tilecompile.ops.fused_linear_ce  # noqa: F401 - registers the op

    return torch.ops.tilecompile.loss_anchor.default


def _output_name(v: Any) -> str:
    if isinstance(v, A.Argmax):
        return "argmax"
    if isinstance(v, A.Reduced):
        extra = f", label_smoothing={v.smoothing:g}" if v.smoothing else ""
        extra += ", class weights" if v.weight is not None else ""
        return f"cross_entropy {v.reduction} (ignore_index={v.ignore}{extra})"
    names = {"spz": "entropy", "zsum": "mean log-prob (label smoothing)"}
    kinds = {names.get(k, "log-prob") for k, _ in v.terms if k not in ("lse", "one")}
    kinds = sorted(kinds, reverse=True) + (["lse"] if abs(lse_coefficient(v)) > 1e-12 else [])
    return " + ".join(kinds)


def _grad_modes(graph: fx.Graph) -> dict[fx.Node, bool | None]:
    """Each node's grad mode as set by ``torch._C._set_grad_enabled`` nodes before it (None: the caller's)."""
    mode, modes = None, {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is torch._C._set_grad_enabled:
            mode = bool(node.args[0])
        modes[node] = mode
    return modes


def _traceable(shape: list) -> list:
    """``shape`` with a symbolic size that is an expression, not one of the graph's symbols (``(s0**2)//s0`` when
    duck sizing gave two dims one symbol), as -1: a size argument must be a graph input or an int to be traced."""
    exprs = [i for i, s in enumerate(shape) if isinstance(s, torch.SymInt) and not s.node.expr.is_Symbol]
    if len(exprs) == 1:
        shape = list(shape)
        shape[exprs[0]] = -1
    return shape


def lse_coefficient(v: A.Row) -> float:
    """The coefficient of lse in a row value once its terms are written in logp, H and lse: z_y = logp + lse and
    Σ p·z = lse − H each bring one (a log-prob or an entropy alone has none; a z-loss term does)."""
    t = dict(v.terms)
    return t.get("lse", 0.0) + t.get("spz", 0.0) + sum(c for k, c in t.items() if isinstance(k, tuple) and k[0] == "zy")


def _is_term(k: Any, kind: str) -> bool:
    return isinstance(k, tuple) and k[0] == kind


def _smoothed_or_weighted(v: Any) -> bool:
    if isinstance(v, A.Reduced):
        return bool(v.smoothing) or v.weight is not None
    return any(k == "zsum" or (isinstance(k, tuple) and k[0] in ("wce", "smooth")) for k, _ in v.terms)


def _class_weight(b: Builder, weight: fx.Node, labels: fx.Node, ignore: int) -> fx.Node:
    """weight[labels] at active rows, 0 at ignored ones (fp32), as nll_loss weighs them."""
    active = b.call(operator.ne, labels, ignore)
    safe = b.call(torch.where, active, labels, 0)
    picked = b.call(torch.take, b.call("float", weight, method=True), b.call("long", safe, method=True))
    return b.call(torch.where, active, picked, 0.0)


def _smooth_term(b: Builder, out: dict[Any, Any], labels: fx.Node, ignore: int, vocab: int) -> fx.Node:
    """Label smoothing's −Σ_j log p_j / V = lse − Σ_j z_j / V at active rows, 0 at ignored ones."""
    per_row = b.call(operator.sub, out["lse"], b.call(operator.truediv, out["zsum"], float(vocab)))
    return b.call(torch.where, b.call(operator.ne, labels, ignore), per_row, 0.0)


def _reduced_value(b: Builder, v: A.Reduced, out: dict[Any, Any], vocab: int) -> fx.Node:
    """``F.cross_entropy(..., reduction="sum" | "mean")``: Σ (1 − ε)·w_y·(−logp) + ε·smooth over the active rows,
    divided (mean) by Σ w_y (the active rows' count without weights), as torch computes it."""
    logp, labels, ignore = out[(v.labels, v.ignore)]
    nll = b.call(torch.neg, logp)
    if v.weight is not None:
        wy = _class_weight(b, v.weight, labels, ignore)
        nll = b.call(operator.mul, nll, wy)
    total = b.call(torch.sum, nll)
    if v.smoothing:
        smooth = b.call(torch.sum, _smooth_term(b, out, labels, ignore, vocab))
        total = b.call(operator.add, b.call(operator.mul, total, 1.0 - v.smoothing),
                       b.call(operator.mul, smooth, v.smoothing))  # fmt: skip
    if v.reduction == "mean":
        if v.weight is not None:
            count = b.call(torch.sum, wy)
        else:
            count = b.call(torch.sum, b.call(operator.ne, labels, ignore))
        total = b.call(operator.truediv, total, count)
    return total


def _row_value(b: Builder, v: A.Row, out: dict[Any, Any], vocab: int) -> fx.Node:
    t = dict(v.terms)
    parts: list[tuple[fx.Node, float]] = []
    if abs(lse_coefficient(v)) > 1e-12:
        parts.append((out["lse"], lse_coefficient(v)))
    for k, c in t.items():
        if isinstance(k, tuple) and k[0] == "zy":
            parts.append((out[(k[1], A.ANY_NEGATIVE)][0], c))  # c · logp (its −c·lse is cancelled by the check)
        elif isinstance(k, tuple) and k[0] == "ce":
            parts.append((out[(k[1], k[2])][0], -c))
        elif isinstance(k, tuple) and k[0] == "wce":
            logp, labels, ignore = out[(k[1], k[2])]
            parts.append((b.call(operator.mul, logp, _class_weight(b, k[3], labels, ignore)), -c))
        elif isinstance(k, tuple) and k[0] == "smooth":
            _, labels, ignore = out[(k[1], k[2])]
            parts.append((_smooth_term(b, out, labels, ignore, vocab), c))
        elif k == "zsum":
            parts.append((out["zsum"], c))
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


# --------------------------------------------------------------------------------------------------- the ops


def _vocab_parallel_op() -> Any:
    from tilecompile.ops.fused_linear_ce import vocab_parallel_logprob

    return vocab_parallel_logprob


def fused_op() -> tuple[Any, str | None]:
    try:
        import tilecompile.ops.fused_linear_ce  # noqa: F401 - registers the op
    except ImportError as exc:
        if not hasattr(torch.ops.tilecompile, "fused_linear_logprob"):
            return None, f"the fused op is unavailable ({exc})"
    try:
        return torch.ops.tilecompile.fused_linear_logprob.default, None
    except AttributeError as exc:
        return None, f"the fused op is unavailable ({exc})"
