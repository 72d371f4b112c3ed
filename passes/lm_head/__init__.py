"""Rewrites lm_head linear -> (temperature) -> log-prob / entropy / cross-entropy into one fused op.

With z = h·Wᵀ / t: logp = z_y − logsumexp(z), H = logsumexp(z) − Σ softmax(z)·z, CE = −logp (masked, reduced),
all from ``tilecompile::fused_linear_logprob(h, W, labels, t, ignore_index, with_entropy)``, which never builds z.

Find: every linear (``graph.as_linear``) is followed forward through its *chain* (casts, temperature, views and
leading-dim slices of the [..., V] logits) into an abstract algebra over the vocabulary (``passes/lm_head/algebra.py``):
a value is the logits chain, a vocab-sized linear form ``a·z + b·lse + c`` (log_softmax is ``z − lse``), the same times
``softmax(z)``, or a per-row combination of lse, z_y (gather), Σp·z (sum of p times a form) and masked CE terms. Any
spelling that reduces to these forms matches: ``log_softmax(z).gather(y)``, ``z.gather(y) − logsumexp(z)``,
``-F.cross_entropy(z, y, reduction="none")``, ``logsumexp(z) − Σ softmax(z)·z``, ``−Σ softmax(z)·log_softmax(z)``,
``−Σ exp(logp)·logp``, ``F.cross_entropy(..., reduction="mean"|"sum", ignore_index=k)`` and ``F.nll_loss``.
Row parts: the same math on parts of the rows (``z[i]``, ``z[a:b]``, ``split``/``chunk``/``unbind``/``narrow`` along a
leading dim) joined back by ``torch.cat`` / ``torch.stack``, or written into a fresh buffer (``buf[a:b] = f(...)``,
``buf[a:b].copy_(...)``) whose every row is written once before it is read, is that math on all the rows: TRL's
row-by-row selective_log_softmax and chunked entropy_from_logits, OpenRLHF's chunked logsumexp. Parts that do not
partition the rows (a row twice, a row left out, out of order, read before written) are skipped with the reason.
Check: a per-row value that leaves the region must be ``α·logp + β·H + γ·lse (+ const)`` (lse, for a z-loss, is an
output of the op);
logits or vocab-sized values must not leave it (returned, argmax, sampling, ...). Each check returns a reason.
Rewrite (``passes/lm_head/rewrite.py``): views/slices on the logits are replayed on h (``logits[:, :-1]``
becomes ``h[:, :-1]``), one op call per (logits view, labels, ignore_index), and each escaping value is rebuilt from
logp / entropy and cast back to the dtype it had. Mean CE is ``−Σ logp / count(labels != ignore_index)`` (0/0 = nan, as
``F.cross_entropy``).

Options (``tilecompile::fused_linear_logprob_ext``): a bias of the product (``F.linear(h, W, b)``, ``h @ W.t() + b``,
``z += b``), a final-logit softcap (``tanh`` of the scaled logits: Gemma's ``c * tanh(z / c)``, then a temperature),
lse on its own (a z-loss ``lse**2``, lse returned), label smoothing (``label_smoothing=ε``, or by hand: the mean of
the log-probs over the vocabulary is ``Σ_j z_j / V − lse``, a linear form), class weights (CE / nll ``weight=``: a
weighted gather, normalised by Σ w_y as torch does) and ``argmax`` of the logits (or of their log-softmax / softmax:
token accuracy) all come out of the same pass over the vocabulary. The linear may be spelled with casts and
transposes in any order (verl's ``torch.matmul(h.float(), W.transpose(0, 1).float())``); a product with a weight
that it does not read as ``h·Wᵀ`` (einsum, a weight stored [D, V]) and that reaches a softmax is skipped with a reason.

Temperature: a Python number goes to the op's ``temperature``. A tensor (or symbolic) temperature scales h instead,
``(h / t).to(h.dtype)``, and the op gets 1.0: exact in fp32, one extra rounding of h in bf16 (its grad flows to t).
In-place scaling (verl's ``logits.div_(t)``) is understood when the scaled logits have no other aliases in use.
Autocast: h and W are cast to the linear's output dtype, as autocast does. ``torch.no_grad()`` inside the graph:
values eager computed without grad are detached. A loss checkpointed with its lm_head is rewritten inside the
checkpoint's body; logits passed into a checkpoint (or any higher-order op) are skipped with a reason.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from tilecompile import graph as fxgraph
from tilecompile import reporting
from tilecompile.pass_api import VOCAB_GATHER, PassContext, PassResult, snapshot_graph
from tilecompile.passes.lm_head import algebra, library_kernels, loss_aware, rewrite

# tests import these from the pass: the loss-aware op's backend choice and its checkpoint policy
from tilecompile.passes.lm_head.rewrite import _grad_backend, _saves_loss_aware_op  # noqa: F401

NAME = rewrite.NAME

_OP_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what the fused op takes for h and W

_ADVICE = (
    "compile the function that computes the loss from the model's outputs (so the logits stay inside the graph "
    "and have no other use), not only the model, and keep graph breaks out of the way between the two"
)


# ------------------------------------------------------------------------------------------------------ find


def find(gm: fx.GraphModule) -> list[algebra.Region]:
    """Every candidate: a linear from which a softmax, logsumexp or cross-entropy is reachable without another
    linear (or matmul) in between, with its analysed region. A candidate the algebra does not follow to that op has
    the reason in ``rejected``."""
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    regions = []
    for node in gm.graph.nodes:
        lin, weight_cast = fxgraph.as_linear(node) or _gathered_linear(node), None
        if lin is None:
            lin, weight_cast = _cast_linear(node)
        if lin is None:
            unread = _unread_matmul(node)
            if unread is not None and _softmax_reached(node) is not None:
                regions.append(algebra.Region(unread[0], rejected=unread[1]))
            continue
        if len(fxgraph.shape(lin.weight) or ()) != 2 or fxgraph.hint(fxgraph.shape(lin.weight)[0]) is None:
            continue
        target = _softmax_reached(lin.node)
        if target is None:
            continue  # a plain linear (an MLP's, a projection's): not a candidate
        r = algebra.Analysis(gm, lin, position, weight_cast).run()
        if not r.softmax_family:
            r.rejected = r.rejected or _not_followed(r, target, position)
        regions.append(r)
    return regions


_SOFTMAX_FAMILY = frozenset({"log_softmax", "softmax", "logsumexp", "cross_entropy", "nll_loss"})
_MATMULS = frozenset({"matmul", "mm", "bmm", "einsum", "linear", "baddbmm", "addmm"})


def _forward(start: fx.Node, stop: Any) -> Any:
    """Walk the users of ``start`` (not through linears / matmuls, higher-order ops or the output); yields nodes."""
    seen, todo = {start}, list(start.users)
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        yield node
        if stop(node) or node.op == "output" or isinstance(node.target, torch._ops.HigherOrderOperator):
            continue
        if fxgraph.as_linear(node) is not None or fxgraph.op(node) in _MATMULS or node.target is operator.matmul:
            continue
        todo += list(node.users)


def _softmax_reached(start: fx.Node) -> fx.Node | None:
    """The first (in graph order) softmax-family node reachable from ``start``, or None."""
    reached = [
        n for n in _forward(start, lambda n: fxgraph.op(n) in _SOFTMAX_FAMILY) if fxgraph.op(n) in _SOFTMAX_FAMILY
    ]
    order = {n: i for i, n in enumerate(start.graph.nodes)} if len(reached) > 1 else {}
    return min(reached, key=lambda n: order.get(n, 0)) if reached else None


def _not_followed(r: algebra.Region, target: fx.Node, position: dict[fx.Node, int]) -> str:
    """Why a candidate has no region: the first node between the logits and ``target`` the algebra did not read."""
    inside = set(r.values)
    outside = {u for n in inside for u in n.users if u not in inside}
    on_path = [u for u in outside if u is target or any(n is target for n in _forward(u, lambda n: n is target))]
    first = min(on_path, key=lambda u: position.get(u, 0)) if on_path else target
    return (
        f"the logits reach {fxgraph.op(target)} {target.name} through {fxgraph.op(first) or first.op} {first.name}, "
        "which is not "
        "log-prob / entropy / cross-entropy math the pass reads (a temperature, a view, a slice of rows, ...)"
    )


def _cast_linear(node: fx.Node) -> tuple[fxgraph.Linear | None, torch.dtype | None]:
    """``torch.matmul(h.float(), W.transpose(0, 1).float())`` (verl's spelling): a linear whose weight operand is
    the weight transposed and cast, in any order, to the product's dtype; (the linear, that dtype) or (None, None).
    The rewrite casts the weight as the graph did."""
    if fxgraph.op(node) != "matmul" or len(node.args) != 2 or node.kwargs or len(fxgraph.shape(node.args[0]) or ()) < 2:
        return None, None
    cur, casts, transposes = node.args[1], set(), 0
    while isinstance(cur, fx.Node):
        if (to := fxgraph.cast_target(cur)) is not None:
            casts.add(to)
            cur = cur.args[0]
        elif (src := fxgraph.transposed_of(cur)) is not None:
            transposes += 1
            cur = src
        else:
            break
    if transposes != 1 or casts != {fxgraph.dtype(node)} or fxgraph.graph_input(cur) is not cur:
        return None, None
    if fxgraph.dtype(cur) not in algebra.FLOAT_DTYPES:
        return None, None
    return fxgraph.Linear(node, node.args[0], cur, None), fxgraph.dtype(node)


def _unread_matmul(node: fx.Node) -> tuple[fxgraph.Linear, str] | None:
    """A product with a 2-D graph input (a weight) whose output's last dim is one of that weight's sizes, in a form
    the pass does not read as ``h·Wᵀ``: (a stand-in linear for the report, the reason), else None. It is reported
    when it reaches a softmax, so that no lm_head is left without a word."""
    name = fxgraph.op(node)
    if node.op not in ("call_function", "call_method"):
        return None
    if name not in _MATMULS and node.target is not operator.matmul and name != "linear":
        return None
    width = fxgraph.hint((fxgraph.shape(node) or (None,))[-1])
    for operand in node.all_input_nodes:
        cur = operand
        while isinstance(cur, fx.Node) and (fxgraph.cast_target(cur) is not None or fxgraph.is_view_like(cur)):
            cur = cur.args[0]
        src = fxgraph.graph_input(cur)
        shape = fxgraph.shape(src) if src is not None else None
        if shape is None or len(shape) != 2 or width is None or width not in [fxgraph.hint(s) for s in shape]:
            continue
        lhs = next((a for a in node.all_input_nodes if a is not operand), operand)
        reason = (
            f"{name} {node.name} multiplies by the weight {src.name} {tuple(shape)} in a form the pass does not read "
            "as an lm_head h·Wᵀ with W [V, D] (F.linear, h @ W.t(), torch.matmul(h, W.transpose(0, 1)), with casts)"
        )
        return fxgraph.Linear(node, lhs, src, None), reason
    return None


def _gathered_linear(node: fx.Node) -> fxgraph.Linear | None:
    """The logits of a vocab-parallel lm_head, as ``passes/tensor_parallel.py`` leaves them: all-gathered along the
    vocabulary right after the local linear. Seen as one linear of the whole vocabulary; the rewrite calls the
    vocab-parallel op on the local weight and drops the gather."""
    if VOCAB_GATHER not in node.meta or not isinstance(node.args[0], fx.Node):
        return None
    lin = fxgraph.as_linear(node.args[0])
    if lin is None or len(lin.node.users) != 1:
        return None
    return fxgraph.Linear(node, lin.input, lin.weight, lin.bias)


# ----------------------------------------------------------------------------------------------------- check


def check(r: algebra.Region) -> tuple[list[fx.Node], str | None]:
    """(the region's nodes whose values are used outside it, None), or ([], the reason it cannot be rewritten)."""
    for reason in (r.rejected, _check_linear(r)):
        if reason:
            return [], reason
    escapes, reason = _escapes(r)
    if reason:
        return [], reason
    if not any(not isinstance(r.values[n], algebra.Size) for n in escapes):
        return [], "nothing computed from the logits is used"
    return escapes, None


def _check_linear(r: algebra.Region) -> str | None:
    lin = r.linear
    if lin.bias is not None and r.vocab_parallel is not None:
        return f"the vocab-parallel linear has a bias ({lin.bias.name}); the vocab-parallel op has none"
    if fxgraph.graph_input(lin.weight) is None:
        return f"its weight {lin.weight.name} is computed in the graph, not a graph input (parameter)"
    hd, wd, od = fxgraph.dtype(lin.input), fxgraph.dtype(lin.weight), fxgraph.dtype(lin.node)
    wd = r.weight_cast or wd  # the weight cast to the product's dtype in the graph: the rewrite casts it too
    if od not in _OP_DTYPES:
        return f"logits dtype {od} is not supported by the fused op (float16, bfloat16, float32)"
    if hd != od or wd != od:
        # autocast: the linear casts h and W to the logits' dtype; the rewrite casts them the same way
        if not (hd == wd and hd in algebra.FLOAT_DTYPES and od in (torch.float16, torch.bfloat16)):
            return f"h/weight/logits dtypes differ ({hd}, {wd}, {od}) in a way autocast does not explain"
    return None


def _escapes(r: algebra.Region) -> tuple[list[fx.Node], str | None]:
    """Region nodes whose value is used outside the region (to rebuild), or the reason the region cannot be."""
    out: list[fx.Node] = []
    inside = set(r.values)
    for node in r.order:
        v = r.values[node]
        outside = [u for u in node.users if u not in inside]
        if not outside:
            continue
        user = outside[0]
        if isinstance(v, algebra.Size):
            if v.item is None:
                return out, f"the logits' size {node.name} is {_describe_use(user)}, not only read for one size"
            out.append(node)
            continue
        if isinstance(v, algebra.Write):
            return out, f"{node.name}, a write into buffer {v.buffer.name}, is also {_describe_use(user)}"
        if isinstance(v, algebra.Chain | algebra.Vocab | algebra.Parts):
            what = f"{_vocab_name(v)} {node.name} of the logits" if isinstance(v, algebra.Vocab) else "the logits"
            if isinstance(user.target, torch._ops.HigherOrderOperator):
                return out, (
                    f"{what} are passed into {user.target.name()} {user.name} (e.g. torch.utils.checkpoint around "
                    "the log-prob or entropy); the fused op saves only 8 bytes a token, so call those without the "
                    "checkpoint, or checkpoint the lm_head together with them"
                )
            return out, f"{what} are also {_describe_use(user)}; the fused op never builds the logits: {_ADVICE}"
        if any(fxgraph.is_inplace(u) and u.args and u.args[0] is node for u in outside):
            return out, f"{node.name} is mutated in place outside the matched region"
        if isinstance(v, algebra.Row):
            reason = _row_reason(node, v)
            if reason:
                return out, reason
        out.append(node)
    return out, None


def _vocab_name(v: algebra.Vocab) -> str:
    if v.soft:
        return "the softmax" if v.form == algebra.SOFTMAX else "a softmax-weighted value"
    return "the log-softmax" if v.form == algebra.LOGP else "a vocabulary-sized value"


def _describe_use(user: fx.Node) -> str:
    """ "returned from the graph" or "used by argmax argmax_1", looking through views, casts and detach."""
    via = []
    while user.op != "output" and (
        fxgraph.is_view_like(user) or fxgraph.op(user) == "detach" or fxgraph.cast_target(user)
    ):
        if len(user.users) != 1:
            break
        via.append(fxgraph.op(user) or str(user.target))
        user = next(iter(user.users))
    through = f" (through {', '.join(via)})" if via else ""
    if user.op == "output":
        return f"returned from the graph{through}"
    return f"used by {fxgraph.op(user) or user.op} {user.name}{through}"


def _row_reason(node: fx.Node, v: algebra.Row) -> str | None:
    t = dict(v.terms)
    # lse on its own (a z-loss term, lse returned) is an output of the op; only a constant is no use
    if not any(k != "one" for k in t):
        return f"{node.name} is a constant of the logits' softmax"
    return None


# ------------------------------------------------------------------------------------------------------- run


def run(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Rewrite every lm_head region of ``gm`` that passes the checks; report the others with their reasons.

    Known library kernels of the same math (TRL's Triton log-prob / entropy, ``passes/lm_head/library_kernels.py``) are
    first read as their torch math; that expansion is kept only if every one of them is fused, otherwise the graph
    goes back to the kernels (better than the plain math) and the pass runs again without expanding them."""
    kernels = library_kernels.find(gm)
    if not kernels:
        return _run(gm, ctx)
    saved, meta = snapshot_graph(gm.graph), dict(gm.meta)
    wide = []
    for call in kernels:
        fake_mode = getattr(fxgraph.example_value(call.logits), "fake_mode", None)
        if fake_mode is None:
            break
        wide.append(library_kernels.expand(call, fxgraph.NodeBuilder(gm.graph, call.node, fake_mode)))
    fxgraph.eliminate_dead_code(gm.graph)  # what only the launches read (their strides, under dynamic shapes) is no use
    result = _run(gm, ctx) if len(wide) == len(kernels) else None
    live = set(gm.graph.nodes)
    if result is not None and not any(n in live for nodes in wide for n in nodes):
        for done in result.rewrites:
            done.detail += f"; read from {library_kernels.summary(kernels)} (graph-wide)"
        return result
    why = "; ".join(dict.fromkeys(s.reason for s in result.skipped)) if result else "no fake tensors on its logits"
    why = why or "its logits' linear is not an lm_head candidate"
    gm.graph, gm.meta = saved, meta
    gm.recompile()
    result = _run(gm, ctx)
    for call in kernels:
        reason = f"left as is: the lm_head pass did not fuse the math it computes ({why})"
        result.skipped.append(
            reporting.Skip(NAME, library_kernels.describe(call), fxgraph.module_path(call.node), reason)
        )
    return result


def _run(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    result = PassResult()
    regions = find(gm)
    if not regions:
        return result
    op, unavailable = rewrite.fused_op()
    tainted = loss_aware.descendants([r.linear.node for r in regions])
    for r in regions:
        where = fxgraph.module_path(r.linear.node)
        candidate = f"linear {r.linear.node.name} -> log-prob/entropy/CE"
        result.consider(r.linear.node, candidate)
        escapes, reason = check(r)
        reason = reason or unavailable
        if reason is None:
            try:
                in_body = ctx.graph_name != "<root>"
                result.rewrote(r.linear.node, rewrite.rewrite(gm, r, escapes, ctx.settings, op, tainted, in_body))
                continue
            except algebra.Reject as exc:  # rewrite.plan rejected it: the graph is untouched
                reason = str(exc)
        result.skip(r.linear.node, reporting.Skip(NAME, candidate, where, reason))
    return result
