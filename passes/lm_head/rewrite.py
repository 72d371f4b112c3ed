"""The lm_head pass's rewrite: one region of ``passes/lm_head/algebra.py`` -> calls of the fused op.

``rewrite(gm, region, escapes, ...)`` inserts before the first outside use of the region: h (cast to the linear's
output dtype, as autocast does) with the logits' views and slices replayed on it (``logits[:, :-1]`` becomes
``h[:, :-1]``) and a tensor temperature folded in, one ``tilecompile::fused_linear_logprob`` call per (logits view,
labels, ignore_index) (``fused_linear_logprob_loss`` in the loss-aware mode, ``vocab_parallel_logprob`` for a
vocab-parallel lm_head), and each escaping value rebuilt from logp / entropy and cast back to the dtype it had.
Mean CE is ``−Σ logp / count(labels != ignore_index)`` (0/0 = nan, as ``F.cross_entropy``). Then the region is
erased.

It runs in four steps: ``plan`` takes every decision (the calls, each one's op variant, the loss mode, what moves
above the anchor) and every rejection, before the graph changes; ``_emit`` moves the planned pure nodes up and
inserts the calls; ``_rebuild`` rebuilds the escaping values and erases the region; ``_describe`` words the report.
A rejection (``algebra.Reject``) therefore leaves the graph as it was, with nothing to roll back; an error after the
plan is a bug, and the pipeline's snapshot undoes the whole pass.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import operator
from typing import Any

import torch
import torch.fx as fx

from tilecompile import graph as fxgraph
from tilecompile import reporting
from tilecompile.pass_api import expect
from tilecompile.passes.lm_head import algebra, loss_aware

NAME = "fused_linear_ce"  # the pass's name in its records (passes/lm_head/__init__.py)

# the ignore_index a lone gather gets (tilecompile/ops/fused_linear_ce.py's NO_IGNORE): no label equals it, so a
# negative label is the op's out-of-range error (eager's gather raises) instead of a silent log-prob of 0
_NO_IGNORE = -(2**63)
_SPELLING_OPS = frozenset(
    {"log_softmax", "softmax", "logsumexp", "exp", "gather", "take_along_dim", "cross_entropy", "nll_loss"}
)


# --------------------------------------------------------------------------------------------------- rewrite


def _replay(b: fxgraph.NodeBuilder, h: fx.Node, node: fx.Node, d: int) -> fx.Node:
    """Apply the view/slice ``node`` (of [..., V] logits) to ``h`` ([..., D])."""
    name = fxgraph.op(node)
    if name in ("view", "reshape"):
        sizes = algebra.view_sizes(node)
        sizes = [*sizes[:-1], sizes[-1] if sizes[-1] == -1 else d]
        return b.call(name, h, *sizes, method=True)
    args = (h, *node.args[1:])
    if node.op == "call_method":
        return b.call(node.target, *args, method=True, **node.kwargs)
    return b.call(node.target, *args, **node.kwargs)


def temperature_of(chain: algebra.Chain) -> float:
    return 1.0 / chain.scale


@dataclasses.dataclass
class Call:
    """One fused call: the logits view ``base``, its labels ``key`` ((labels, ignore_index); None: the statistics
    only), the op ``variant`` and which optional outputs it returns."""

    base: fx.Node
    key: tuple | None
    variant: str  # "plain", "ext" (bias, softcap, lse, Σz, argmax), "vocab_parallel", "loss" (loss-aware)
    entropy: bool = False
    lse: bool = False
    zsum: bool = False
    argmax: bool = False


@dataclasses.dataclass
class Plan:
    """Everything the rewrite decided before it inserts a node (``plan``); ``emit`` follows it without a check."""

    anchor: fx.Node  # the first use of the region's values outside it: the calls go before it
    escapes: list[fx.Node]  # the region's values read outside it, rebuilt from the calls' outputs
    pinned_sizes: list[fx.Node]  # sizes of the logits read outside, replaced by ints
    calls: list[Call]
    aliases: dict[fx.Node, dict[tuple, tuple]]  # per base: a gather's labels key -> the CE call on the same labels
    loss: loss_aware.LossPlan | None  # the loss-aware mode's loss, or None
    mode: str  # the mode's words for the report ("" when nothing needs grads)
    hoist: list[fx.Node]  # pure nodes defined after the anchor that the calls read, in the order they move
    modes: dict[fx.Node, bool | None]  # each node's grad mode (``_grad_modes``)
    no_grad: set[fx.Node]  # escaping values eager computed without grad
    switch: bool  # grad mode switched on around the calls
    fake_mode: Any
    compute: torch.dtype  # the linear's output dtype: h's, or autocast's
    in_body: bool


def rewrite(
    gm: fx.GraphModule,
    r: algebra.Region,
    escapes: list[fx.Node],
    settings: Any,
    op: Any,
    tainted: set[fx.Node],
    in_body: bool = False,
) -> reporting.Rewrite:
    """Plan the rewrite (every check; ``algebra.Reject`` leaves the graph as it was), then emit the fused calls, rebuild
    each escaping value from their outputs, erase the region, and describe what was done."""
    p = plan(gm, r, escapes, settings, tainted, in_body)
    emitted = _emit(gm, r, p, settings, op)
    _rebuild(gm, r, p, emitted)
    return _describe(r, p, emitted.rows)


def plan(
    gm: fx.GraphModule, r: algebra.Region, escapes: list[fx.Node], settings: Any, tainted: set[fx.Node], in_body: bool
) -> Plan:
    """Decide the calls, each call's op variant, the loss mode and what moves; raises ``algebra.Reject`` before any
    change to the graph."""
    graph = gm.graph
    position = {n: i for i, n in enumerate(graph.nodes)}
    inside = set(r.values)
    pinned_sizes = [n for n in escapes if isinstance(r.values[n], algebra.Size)]  # of the logits, ints in every call
    escapes = [n for n in escapes if n not in pinned_sizes]
    users = [u for n in escapes for u in n.users if u not in inside]
    anchor = min(users, key=lambda u: position[u])
    # torch.no_grad() inside the graph: the calls run in the anchor's grad mode, switched on around the rewrite
    # when the anchor is under no_grad but some value needs grad; a value eager computed without grad is detached
    modes = _grad_modes(graph)
    no_grad = {n for n in escapes if modes[n] is False}
    switch = modes[anchor] is False and len(no_grad) < len(escapes)
    fake_mode = getattr(fxgraph.example_value(r.linear.input), "fake_mode", None)  # the graph's mode, not the tracer's
    if fake_mode is None:
        raise algebra.Reject("no fake tensors on the graph to build the rewrite with")

    # which (labels, ignore) calls each base needs, and which statistics
    keyed_by_base: dict[fx.Node, list[tuple]] = {}
    needs: dict[str, set[fx.Node]] = {"entropy": set(), "lse": set(), "zsum": set(), "argmax": set()}
    for node in escapes:
        v = r.values[node]
        keys = []
        if isinstance(v, algebra.Argmax):
            needs["argmax"].add(v.base)
        elif isinstance(v, algebra.Reduced):
            keys.append((v.labels, v.ignore))
            if v.smoothing:
                needs["lse"].add(v.base)
                needs["zsum"].add(v.base)
        else:
            if abs(lse_coefficient(v)) > 1e-12:
                needs["lse"].add(v.base)
            for k, _ in v.terms:
                if k == "spz":
                    needs["entropy"].add(v.base)
                elif k == "zsum":
                    needs["zsum"].add(v.base)
                elif _is_term(k, "zy"):
                    keys.append((k[1], algebra.ANY_NEGATIVE))
                elif isinstance(k, tuple) and k[0] in ("ce", "wce", "smooth"):
                    keys.append((k[1], k[2]))
                    if k[0] == "smooth":
                        needs["lse"].add(v.base)
                        needs["zsum"].add(v.base)
        for key in keys:
            keyed_by_base.setdefault(v.base, [])
            if key not in keyed_by_base[v.base]:
                keyed_by_base[v.base].append(key)
    for base in set().union(*needs.values()):
        keyed_by_base.setdefault(base, [])

    # a gather's labels (any negative ignore_index) share a CE call on the same labels with a negative one
    aliases: dict[fx.Node, dict[tuple, tuple]] = {}
    for base, keys in keyed_by_base.items():
        for labels, ignore in keys:
            if ignore == algebra.ANY_NEGATIVE:
                twin = next((k for k in keys if k[0] is labels and k[1] != algebra.ANY_NEGATIVE and k[1] < 0), None)
                if twin is not None:
                    aliases.setdefault(base, {})[(labels, ignore)] = twin

    vp = r.vocab_parallel
    extras = needs["lse"] | needs["zsum"] | needs["argmax"]
    if vp is not None:
        for base, keys in keyed_by_base.items():
            chain = r.chain(base)
            if chain.bias is not None or chain.softcap or base in extras:
                raise algebra.Reject(
                    "a vocab-parallel lm_head with a bias, a softcap or lse on its own (the vocab-parallel op has none)"
                )
            for _, ignore in keys:
                if ignore != algebra.ANY_NEGATIVE and int(ignore) >= 0:
                    raise algebra.Reject(
                        f"ignore_index={ignore}: the vocab-parallel op needs a negative one (logits gathered)"
                    )

    # the loss-aware mode (grads in the forward) when the escaping values reduce to one scalar loss
    todo = {base: [k for k in keys if k not in aliases.get(base, {})] or [None] for base, keys in keyed_by_base.items()}
    loss, mode = _loss_mode(r, escapes, todo, settings, modes, switch, tainted, gm if in_body else None, anchor)

    calls = []
    for base in keyed_by_base:
        chain = r.chain(base)
        if loss is not None:
            variant = "loss"
        elif vp is not None:
            variant = "vocab_parallel"
        elif chain.bias is not None or chain.softcap or base in extras:
            variant = "ext"
        else:
            variant = "plain"
        for i, key in enumerate(todo[base]):  # None: the statistics only; the base's first call returns them
            first = i == 0
            calls.append(Call(base, key, variant, *(first and base in needs[s] for s in needs)))

    # everything the calls read must exist before the anchor: the pure label computations defined later move up
    moved: dict[fx.Node, None] = {}
    for base, keys in keyed_by_base.items():
        chain = r.chain(base)
        for n in (*(t for _, t in chain.tensor_scales), *(k[0] for k in keys), chain.bias):
            _plan_hoist(n, anchor, position, moved)
    for n in loss.externals if loss is not None else ():
        _plan_hoist(n, anchor, position, moved)
    for node in escapes:  # class weights
        v = r.values[node]
        if isinstance(v, algebra.Argmax):
            continue
        weights = [v.weight] if isinstance(v, algebra.Reduced) else [k[3] for k, _ in v.terms if _is_term(k, "wce")]
        for w in weights:
            _plan_hoist(w, anchor, position, moved)
    return Plan(anchor, escapes, pinned_sizes, calls, aliases, loss, mode, list(moved), modes, no_grad, switch,
                fake_mode, fxgraph.dtype(r.linear.node), in_body)  # fmt: skip


def _plan_hoist(node: Any, anchor: fx.Node, position: dict[fx.Node, int], moved: dict[fx.Node, None]) -> None:
    """Add ``node`` (after its inputs) to ``moved`` when it is defined after ``anchor``. Only a pure node moves,
    and only when nothing between the anchor and it writes in place into what it reads (or a view of it)."""
    if not isinstance(node, fx.Node) or node in moved or position[node] < position[anchor]:
        return
    if node.op not in ("call_function", "call_method") or fxgraph.is_inplace(node) or node.is_impure():
        raise algebra.Reject(f"{node.name} is computed after the log-probs are first used and cannot be moved")
    between = list(node.graph.nodes)[position[anchor] : position[node]]
    written = {_storage_root(m): u for u in between for m in fxgraph.mutated_args(u)}
    for a in node.all_input_nodes:
        if _storage_root(a) in written:
            raise algebra.Reject(
                f"{node.name} reads {a.name}, which {written[_storage_root(a)].name} changes in place after the "
                "log-probs are first used: it cannot be moved above that"
            )
        _plan_hoist(a, anchor, position, moved)
    moved[node] = None


def _storage_root(node: fx.Node) -> fx.Node:
    """The node whose tensor ``node`` views (through view ops), or ``node`` itself."""
    while fxgraph.is_view_like(node) and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


@dataclasses.dataclass
class _Emitted:
    results: dict[fx.Node, dict[Any, Any]]  # per base: each key's (logp, labels, ignore) and the statistics
    builder: fxgraph.NodeBuilder
    loss_call: dict[str, Any] | None
    rows: list[int]


def _emit(gm: fx.GraphModule, r: algebra.Region, p: Plan, settings: Any, op: Any) -> _Emitted:
    """Move the planned nodes up and insert the calls before the anchor."""
    graph = gm.graph
    for node in p.hoist:
        p.anchor.prepend(node)
    if p.switch:
        with graph.inserting_before(p.anchor):
            graph.call_function(torch._C._set_grad_enabled, (True,))
    lin = r.linear
    h, weight = lin.input, lin.weight
    b = fxgraph.NodeBuilder(graph, p.anchor, p.fake_mode, lin.node)
    d = int(fxgraph.shape(weight)[1])
    if fxgraph.dtype(weight) != p.compute:
        weight = b.call("to", weight, p.compute, method=True)
    device = fxgraph.example_value(h).device
    vp = r.vocab_parallel

    results: dict[fx.Node, dict[Any, Any]] = {}
    h_of: dict[fx.Node, tuple[fx.Node, Any]] = {}
    rows: list[int] = []
    loss_call = None
    for call in p.calls:
        chain = r.chain(call.base)
        if call.base not in h_of:  # h as the base's logits view reads it: views replayed, a tensor temperature folded
            hb = h if fxgraph.dtype(h) == p.compute else b.call("to", h, p.compute, method=True)
            for view in chain.replay:
                hb = _replay(b, hb, view, d)
            bias = chain.bias
            for kind, t in chain.tensor_scales:
                hb = b.call(operator.truediv if kind == "div" else operator.mul, hb, t)
                if bias is not None:  # (h·Wᵀ + b) / t = (h / t)·Wᵀ + b / t: the bias is scaled with h
                    bias = b.call(operator.truediv if kind == "div" else operator.mul, bias, t)
            if chain.tensor_scales:
                hb = b.call("to", hb, p.compute, method=True)
                if bias is not None and fxgraph.dtype(bias) != fxgraph.dtype(chain.bias):
                    bias = b.call("to", bias, fxgraph.dtype(chain.bias), method=True)
            h_of[call.base] = hb, bias
            rows.append(math.prod(fxgraph.hint(s) or 0 for s in fxgraph.shape(hb)[:-1]))
            results[call.base] = {"entropy": None, "lse": None, "zsum": None, "argmax": None}
        hb, bias = h_of[call.base]
        out = results[call.base]
        if call.key is None:
            first = b.call(operator.getitem, hb, (Ellipsis, 0))
            labels, ignore = (
                b.call(torch.full_like, first, algebra.DEFAULT_IGNORE, dtype=torch.int64),
                algebra.DEFAULT_IGNORE,
            )
        else:
            labels, ignore = call.key
            ignore = _NO_IGNORE if ignore == algebra.ANY_NEGATIVE else ignore
            lead = fxgraph.shape(hb)[:-1]
            if not algebra.same_written_shape(fxgraph.shape(labels), lead):
                if algebra.is_static(fxgraph.shape(labels)) and algebra.is_static(
                    lead
                ):  # labels of a reshaped view of these rows
                    labels = b.call("reshape", labels, [fxgraph.static_size(s) for s in lead], method=True)
                elif algebra.ndim_of(labels) == len(lead) + 1:  # a gather index [..., 1]
                    labels = b.call(torch.squeeze, labels, -1)
        ls = fxgraph.shape(labels)
        # the chunk setting of this compile (options= included), not the op's default read from the env
        args = [hb, weight, labels, float(temperature_of(chain)), int(ignore), call.entropy, settings.check_inputs,
                int(settings.ce_vocab_chunk)]  # fmt: skip
        with p.fake_mode:
            expected = (
                torch.empty(ls, dtype=torch.float32, device=device),
                torch.empty(ls if call.entropy else (0,), dtype=torch.float32, device=device),
            )
        if call.variant == "ext":  # the op with options: a bias, a softcap, lse, Σz, argmax
            fused = b.call(_ext_op(), *args, bias, float(chain.softcap), call.lse, call.zsum, call.argmax)
            with p.fake_mode:
                rows_if = [torch.empty(ls if on else (0,), dtype=dt, device=device)
                           for on, dt in ((call.lse, torch.float32), (call.zsum, torch.float32),
                                          (call.argmax, torch.int64))]  # fmt: skip
                expected = (*expected, *rows_if)
        elif call.variant == "vocab_parallel":  # the local weight's statistics, reduced across the group
            fused = b.call(_vocab_parallel_op(), *args[:6], int(settings.ce_vocab_chunk), vp.group, vp.world, vp.rank)
        elif call.variant == "loss":  # the loss function and its externals are set once it is extracted (_rebuild)
            detached = [b.call("detach", x, method=True) for x in (hb, weight)]
            fused = b.call(_loss_op(), *detached, *args[2:7], [], 0, int(settings.ce_loss_block_rows),
                           _grad_backend(settings, device), float(chain.softcap))  # fmt: skip
            with p.fake_mode:
                expected = (
                    *expected,
                    torch.empty_like(fxgraph.example_value(hb)),
                    torch.empty_like(fxgraph.example_value(weight)),
                )
        else:
            fused = b.call(op, *args)
        expect(fused, expected)
        logp = b.call(operator.getitem, fused, 0)
        expect(logp, expected[0])
        if call.key is not None:
            out[call.key] = (logp, labels, ignore)
        # the op's outputs after the log-prob, in its order: each one the region reads gets its getitem
        wanted = (("entropy", call.entropy), ("lse", call.lse), ("zsum", call.zsum), ("argmax", call.argmax))
        for index, (name, read) in enumerate(wanted, start=1):
            if read:
                out[name] = b.call(operator.getitem, fused, index)
                expect(out[name], expected[index])
        if call.variant == "loss":
            grads = [b.call(operator.getitem, fused, i) for i in (2, 3)]
            for i, g in zip((2, 3), grads):
                expect(g, expected[i])
            loss_call = {"fused": fused, "h": hb, "weight": weight, "logp": logp, "entropy": out["entropy"],
                         "grads": grads}  # fmt: skip
    for base, twins in p.aliases.items():
        for key, twin in twins.items():
            results[base][key] = results[base][twin]
    return _Emitted(results, b, loss_call, rows)


def _rebuild(gm: fx.GraphModule, r: algebra.Region, p: Plan, e: _Emitted) -> None:
    """Rebuild each escaping value from the calls' outputs, finish the loss-aware call, erase the region."""
    graph, b = gm.graph, e.builder
    replaced: dict[fx.Node, fx.Node] = {}
    for node in p.escapes:
        v = r.values[node]
        out = e.results[v.base]
        if isinstance(v, algebra.Reduced):
            value = _reduced_value(b, v, out, r.vocab)
        elif isinstance(v, algebra.Argmax):
            value = b.call(torch.unsqueeze, out["argmax"], -1) if v.keepdim else out["argmax"]
        else:
            value = _row_value(b, v, out, r.vocab)
        want = fxgraph.example_value(node)
        if not algebra.same_written_shape(
            fxgraph.shape(value), tuple(want.shape)
        ):  # a row value of a reshaped view of the base
            shape = [
                s if fxgraph.static_size(s) is None else fxgraph.static_size(s) for s in want.shape
            ]  # pinned: as ints
            value = b.call("reshape", value, _traceable(shape), method=True)
        if node in p.no_grad and (p.modes[p.anchor] is not False or p.switch):
            value = b.call("detach", value, method=True)
        if fxgraph.dtype(value) != want.dtype:
            value = b.call("to", value, want.dtype, method=True)
        expect(value, want)
        node.replace_all_uses_with(value)
        replaced[node] = value
    if p.loss is not None:
        p.mode = _finish_loss_aware(graph, p.loss, replaced, e.loss_call, p.fake_mode, r.linear.node)
        if p.in_body:  # a checkpoint body: keep the op's outputs instead of running the 3 GEMMs again in backward
            gm.meta[_CONTEXT_FN] = _saves_loss_aware_op()
            p.mode += "; its outputs are saved, not recomputed, by the activation checkpoint around it"

    if p.switch:
        with graph.inserting_before(p.anchor):
            graph.call_function(torch._C._set_grad_enabled, (False,))

    for node in p.pinned_sizes:  # every use, the views replayed on h included, gets the int
        pinned = functools.partial(lambda n, item, a: item if a is n else a, node, r.values[node].item)
        for user in list(node.users):
            user.args, user.kwargs = fx.node.map_arg((user.args, user.kwargs), pinned)

    local = r.linear.node.args[0] if r.vocab_parallel is not None else None  # the gather (first node) reads it
    for node in reversed(r.order):
        if node.users:
            raise RuntimeError(f"fused_linear_ce: {node.name} still has users {list(node.users)} after the rewrite")
        graph.erase_node(node)
    if local is not None and not local.users:
        graph.erase_node(local)


def _describe(r: algebra.Region, p: Plan, rows: list[int]) -> reporting.Rewrite:
    lin, h = r.linear, r.linear.input
    bases = list(dict.fromkeys(c.base for c in p.calls))
    d = int(fxgraph.shape(lin.weight)[1])
    n_rows = max(rows) if rows else 0
    temps = sorted({f"{temperature_of(r.chain(bn)):g}" for bn in bases})
    tensor_t = any(r.chain(bn).tensor_scales for bn in bases)
    spelled = dict.fromkeys(fxgraph.op(n) for n in r.order if fxgraph.op(n) in _SPELLING_OPS)
    joins = ", ".join(f"{k}" if n == 1 else f"{k} (x{n})" for k, n in collections.Counter(r.joins).items())
    autocast = f"; autocast to {str(p.compute).replace('torch.', '')}" if p.compute != fxgraph.dtype(h) else ""
    biases = sorted({r.chain(bn).bias.name for bn in bases if r.chain(bn).bias is not None})
    caps = sorted({f"{r.chain(bn).softcap:g}" for bn in bases if r.chain(bn).softcap})
    autocast += f"; bias {'/'.join(biases)}" if biases else ""
    autocast += f"; softcap {'/'.join(caps)}" if caps else ""
    vp = r.vocab_parallel
    detail = (
        f"{', '.join(dict.fromkeys(_output_name(r.values[n]) for n in p.escapes))} "
        f"(via {', '.join(spelled)}); temperature {'/'.join(temps)}"
        f"{' (tensor, folded into h)' if tensor_t else ''}{autocast}"
        f"{f'; rows joined from parts by {joins}' if joins else ''}; {len(p.calls)} fused call(s)"
        f"{f'; vocab-parallel over {vp.world} ranks (all_reduce max + sum of the row statistics)' if vp else ''}"
        f"{f'; {p.mode}' if p.mode else ''}"
    )
    return reporting.Rewrite(
        NAME,
        fxgraph.module_path(lin.node),
        shapes={"h": (n_rows, d), "weight": tuple(fxgraph.shape(lin.weight)), "N/D/V": (n_rows, d, r.vocab)},
        dtypes={
            "h": str(fxgraph.dtype(h)),
            "weight": str(fxgraph.dtype(lin.weight)),
            "logits": str(fxgraph.dtype(lin.node)),
        },
        detail=detail,
    )


def _loss_mode(r, escapes, calls, settings, modes, switch, tainted, body, at) -> tuple[loss_aware.LossPlan | None, str]:
    """(the loss plan, "") for the loss-aware mode, or (None, "recompute mode: <why>") when the region needs grads
    but cannot have it; (None, "") when nothing needs grads (the op then runs its forward only). ``calls``: each
    base's call keys; ``body``: the higher-order op body (activation checkpoint) the region is in, or None; ``at``:
    where the op will run."""
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
    elif any(isinstance(r.values[n], algebra.Argmax) for n in escapes):
        why = "the loss-aware op has no argmax output"
    elif any(isinstance(r.values[n], algebra.Row) and abs(lse_coefficient(r.values[n])) > 1e-12 for n in escapes):
        why = "the loss-aware op has no lse output (z-loss)"
    elif any(_smoothed_or_weighted(r.values[n]) for n in escapes):
        why = "the loss-aware op has no label smoothing (Σz) or class weights"
    elif len(calls) != 1 or len(next(iter(calls.values()))) > 1:
        why = "more than one fused call (several label sets or views of the logits)"
    elif switch:
        why = "the log-probs are first used under torch.no_grad()"
    elif body is not None and _CONTEXT_FN in body.meta:
        why = "the checkpoint around it has its own context_fn (selective checkpointing) that would recompute the op"
    else:
        roots = {n: _loss_root(n, r.values[n]) for n in escapes}
        found = loss_aware.find_loss(roots, modes, tainted - set(escapes), r.linear.node.graph)
        if isinstance(found, loss_aware.LossPlan):
            why = loss_aware.check_externals(found, at, modes)
            if why is None:
                return found, ""
        else:
            why = found
    return None, f"recompute mode (4 GEMMs): {why}"


def _loss_root(node: fx.Node, v: Any) -> Any:
    if isinstance(v, algebra.Reduced):
        return loss_aware.Lin(True)
    return loss_aware.Tok(("row", str(fxgraph.shape(node))), True)


def _finish_loss_aware(graph, plan: loss_aware.LossPlan, replaced, call: dict, fake_mode, meta_from: fx.Node) -> str:
    """Give the loss-aware call its loss function F and route the gradient of S through the op's anchor."""
    from tilecompile.ops.fused_linear_ce import register_loss

    loss = replaced.get(plan.loss, plan.loss)
    fn, externals = loss_aware.extract(graph, (call["logp"], call["entropy"]), loss)
    fused = call["fused"]
    position, moved = {n: i for i, n in enumerate(graph.nodes)}, {}
    for n in externals:  # what the rebuilt values read (labels' count for a mean CE) must precede the call: the
        try:  # plan moved the graph's own above the anchor; these are new and pure
            _plan_hoist(n, fused, position, moved)
        except algebra.Reject as exc:
            raise RuntimeError(f"fused_linear_ce: after the plan was accepted: {exc}") from exc
    for n in moved:
        fused.prepend(n)
    # the op has no autograd: it reads detached values (an external's own gradient, a value head's or a learnable
    # coefficient's, flows through the loss math, which stays in the graph)
    before = fxgraph.NodeBuilder(graph, fused, fake_mode, meta_from)
    grad_free = [before.call("detach", n, method=True) if _needs_grad(n) else n for n in externals]
    fused.update_arg(7, grad_free)
    fused.update_arg(8, register_loss(fn, fn.code))
    b = fxgraph.NodeBuilder(graph, loss.next, fake_mode, meta_from)
    zero = b.call(_anchor_op(), call["h"], call["weight"], *call["grads"])
    dtype = fxgraph.dtype(loss)
    if dtype != torch.float32:  # the anchor is an fp32 zero: adding it must not promote a bf16 / fp16 loss
        zero = b.call("to", zero, dtype, method=True)
    with_anchor = b.call(operator.add, loss, zero)
    expect(with_anchor, fxgraph.example_value(loss))
    loss.replace_all_uses_with(with_anchor, delete_user_cb=lambda u: u is not with_anchor)
    return f"loss-aware mode (3 GEMMs: grads in the forward for the loss {plan.loss.name})"


def _grad_backend(settings: Any, device: torch.device) -> str:
    """The torch.compile backend the loss-aware op compiles its per-token gradient with ("eager": none)."""
    choice = settings.ce_loss_grad_compile
    if choice == "auto":
        return "inductor" if device.type == "cuda" and settings.inner == "inductor" else "eager"
    return "eager" if choice == "off" else choice


def _needs_grad(node: fx.Node) -> bool:
    return bool(getattr(fxgraph.example_value(node), "requires_grad", False))


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
    if isinstance(v, algebra.Argmax):
        return "argmax"
    if isinstance(v, algebra.Reduced):
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


def lse_coefficient(v: algebra.Row) -> float:
    """The coefficient of lse in a row value once its terms are written in logp, H and lse: z_y = logp + lse and
    Σ p·z = lse − H each bring one (a log-prob or an entropy alone has none; a z-loss term does)."""
    t = dict(v.terms)
    return t.get("lse", 0.0) + t.get("spz", 0.0) + sum(c for k, c in t.items() if isinstance(k, tuple) and k[0] == "zy")


def _is_term(k: Any, kind: str) -> bool:
    return isinstance(k, tuple) and k[0] == kind


def _smoothed_or_weighted(v: Any) -> bool:
    if isinstance(v, algebra.Reduced):
        return bool(v.smoothing) or v.weight is not None
    return any(k == "zsum" or (isinstance(k, tuple) and k[0] in ("wce", "smooth")) for k, _ in v.terms)


def _class_weight(b: fxgraph.NodeBuilder, weight: fx.Node, labels: fx.Node, ignore: int) -> fx.Node:
    """weight[labels] at active rows, 0 at ignored ones (fp32), as nll_loss weighs them."""
    active = b.call(operator.ne, labels, ignore)
    safe = b.call(torch.where, active, labels, 0)
    picked = b.call(torch.take, b.call("float", weight, method=True), b.call("long", safe, method=True))
    return b.call(torch.where, active, picked, 0.0)


def _smooth_term(b: fxgraph.NodeBuilder, out: dict[Any, Any], labels: fx.Node, ignore: int, vocab: int) -> fx.Node:
    """Label smoothing's −Σ_j log p_j / V = lse − Σ_j z_j / V at active rows, 0 at ignored ones."""
    per_row = b.call(operator.sub, out["lse"], b.call(operator.truediv, out["zsum"], float(vocab)))
    return b.call(torch.where, b.call(operator.ne, labels, ignore), per_row, 0.0)


def _reduced_value(b: fxgraph.NodeBuilder, v: algebra.Reduced, out: dict[Any, Any], vocab: int) -> fx.Node:
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


def _row_value(b: fxgraph.NodeBuilder, v: algebra.Row, out: dict[Any, Any], vocab: int) -> fx.Node:
    t = dict(v.terms)
    parts: list[tuple[fx.Node, float]] = []
    if abs(lse_coefficient(v)) > 1e-12:
        parts.append((out["lse"], lse_coefficient(v)))
    for k, c in t.items():
        if isinstance(k, tuple) and k[0] == "zy":
            parts.append((out[(k[1], algebra.ANY_NEGATIVE)][0], c))  # c · logp (its −c·lse is cancelled by the check)
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
