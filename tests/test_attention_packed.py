"""The CUDA flash path of ``tilecompile::masked_attention`` (tokens packed by ``attention_plan``), checked on CPU.

The packing, the two flash varlen calls, and putting the rows back are plain PyTorch; only the flash kernels
are CUDA. Here they are replaced by ``emulated_flash_fwd`` / ``_bwd``: the same varlen semantics (segments from
``cu_seqlens``, causal and windows aligned to a segment's bottom right, 0 and lse = +inf for a row with no key in
its segment, rows outside every segment and the rows of a segment of no key left as garbage: NaN; the keys of a
segment of no query get 0, as the kernel writes), computed densely in float64. So every mask family's packing is held to
the float64 reference at every position, values and gradients, pad rows included. The GPU tests run the real
kernels (tests/test_pass_attention.py, ``-m gpu``).
"""

from __future__ import annotations

import pytest
import torch

import tilecompile.ops.attention as OA
from tilecompile.kernels import attention as K


def _allowed(lq, lk, causal, left, right):
    a = torch.arange(lq)[:, None] + (lk - lq)
    j = torch.arange(lk)[None, :]
    ok = torch.ones(lq, lk, dtype=torch.bool)
    if causal:
        ok &= j <= a
    if left >= 0:
        ok &= j >= a - left
    if right >= 0 and not causal:
        ok &= j <= a + right
    return ok


def _emulate(q, k, v, cu_q, cu_k, causal, left, right, scale):
    """(out [T, H, D] float64, lse [H, T] float64) with NaN outside every query segment."""
    t, h, d = q.shape
    rep = h // k.shape[1]
    out = torch.full((t, h, v.shape[-1]), float("nan"), dtype=torch.float64)
    lse = torch.full((h, t), float("nan"), dtype=torch.float64)
    out, lse = out.clone(), lse.clone()
    outs, lses = [], []
    for s in range(cu_q.numel() - 1):
        q0, q1, k0, k1 = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
        if q1 == q0 or k1 == k0:  # a segment of no key: its rows stay NaN (the op must not read them)
            continue
        qs = q[q0:q1].double().transpose(0, 1)  # [H, lq, D]
        ks = k[k0:k1].double().repeat_interleave(rep, 1).transpose(0, 1)
        vs = v[k0:k1].double().repeat_interleave(rep, 1).transpose(0, 1)
        sc = (qs @ ks.transpose(-1, -2)) * scale
        sc = sc.masked_fill(~_allowed(q1 - q0, k1 - k0, causal, left, right), float("-inf"))
        row_lse = torch.logsumexp(sc, -1) if k1 > k0 else torch.full((h, q1 - q0), float("-inf"), dtype=torch.float64)
        p = torch.exp(sc - torch.where(torch.isfinite(row_lse), row_lse, 0)[..., None])
        o = p @ vs if k1 > k0 else qs.new_zeros(h, q1 - q0, v.shape[-1])
        outs.append((q0, q1, o.transpose(0, 1)))
        lses.append((q0, q1, torch.where(torch.isfinite(row_lse), row_lse, float("inf"))))
    for q0, q1, o in outs:
        out = torch.cat([out[:q0], o, out[q1:]])
    for q0, q1, lv in lses:
        lse = torch.cat([lse[:, :q0], lv, lse[:, q1:]], 1)
    return out, lse


def emulated_flash_fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, left, right, scale):
    assert max_q >= int((cu_q[1:] - cu_q[:-1]).max()) and max_k >= int((cu_k[1:] - cu_k[:-1]).max())
    out, lse = _emulate(q, k, v, cu_q, cu_k, causal, left, right, scale)
    return out.to(q.dtype), lse.float()


def emulated_flash_bwd(g, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, left, right, scale):
    """The gradients of each segment's attention (float64, from its own recomputed probabilities); NaN for query
    rows outside every query segment and key rows outside every key segment (what the kernel leaves unwritten)."""
    t, h, _ = q.shape
    hkv = k.shape[1]
    rep = h // hkv
    nan = float("nan")
    dq = torch.full(q.shape, nan, dtype=torch.float64)
    dk, dv = torch.full(k.shape, nan, dtype=torch.float64), torch.full(v.shape, nan, dtype=torch.float64)
    for s in range(cu_q.numel() - 1):
        q0, q1, k0, k1 = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
        if k1 == k0:  # no key: the query rows' dq stays NaN (the op must not read them)
            continue
        qs, gs = q[q0:q1].double().transpose(0, 1), g[q0:q1].double().transpose(0, 1)  # [H, lq, D]
        ks = k[k0:k1].double().repeat_interleave(rep, 1).transpose(0, 1)
        vs = v[k0:k1].double().repeat_interleave(rep, 1).transpose(0, 1)
        sc = (qs @ ks.transpose(-1, -2)) * scale
        allowed = _allowed(q1 - q0, k1 - k0, causal, left, right)
        sc = sc.masked_fill(~allowed, float("-inf"))
        m = sc.amax(-1, keepdim=True)
        p = torch.exp(sc - torch.where(torch.isfinite(m), m, 0))
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-300)
        o = p @ vs
        dvs = p.transpose(-1, -2) @ gs
        ds = p * (gs @ vs.transpose(-1, -2) - (gs * o).sum(-1, keepdim=True))
        dq[q0:q1] = ((ds @ ks) * scale).transpose(0, 1)
        dks = (ds.transpose(-1, -2) @ qs) * scale  # [H, lk, D]
        dk[k0:k1] = dks.reshape(hkv, rep, k1 - k0, -1).sum(1).transpose(0, 1)
        dv[k0:k1] = dvs.reshape(hkv, rep, k1 - k0, -1).sum(1).transpose(0, 1)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _row_offsets(b: int, n: int) -> torch.Tensor:
    return torch.arange(0, b * n + 1, n)


def emulated_dense_fwd(q4, k4, v4, causal, left, right, scale):
    """The whole-row kernel ([B, N, heads, D] views) as the varlen emulation over one segment a row."""
    b, n = q4.shape[:2]
    cu = _row_offsets(b, n)
    flat = [t.reshape(b * n, *t.shape[2:]) for t in (q4, k4, v4)]
    out, lse = emulated_flash_fwd(*flat, cu, cu, n, n, causal, left, right, scale)
    # the kernel allocates out empty_like its q: the same strides as q4
    out = torch.empty_like(q4).copy_(out.view(b, n, *out.shape[1:]))
    return out, lse.view(-1, b, n).transpose(0, 1).contiguous()


def emulated_dense_bwd(g4, q4, k4, v4, out4, lse, causal, left, right, scale):
    b, n = q4.shape[:2]
    cu = _row_offsets(b, n)
    flat = [t.reshape(b * n, *t.shape[2:]) for t in (g4, q4, k4, v4, out4)]
    lse_f = lse.transpose(0, 1).reshape(lse.shape[1], b * n)
    grads = emulated_flash_bwd(*flat, lse_f, cu, cu, n, n, causal, left, right, scale)
    return tuple(torch.empty_like(t).copy_(x.view(b, n, *x.shape[1:])) for t, x in zip((q4, k4, v4), grads))


EMULATED = {
    "flash_fwd": emulated_flash_fwd,
    "flash_bwd": emulated_flash_bwd,
    "flash_dense_fwd": emulated_dense_fwd,
    "flash_dense_bwd": emulated_dense_bwd,
    "flash_supported": lambda q, k, v: True,
}


@pytest.fixture
def emulated_flash(monkeypatch):
    """Route the op's CUDA flash path through the CPU emulation, for fp32 / fp64 CPU tensors."""
    for name, fn in EMULATED.items():
        monkeypatch.setattr(K, name, fn)


def _rows(lengths, n, side):
    """[B, N] long padding mask: ``lengths[b]`` real tokens; side 'left', 'right' or a (left pad) list for both."""
    m = torch.zeros(len(lengths), n, dtype=torch.long)
    for b, length in enumerate(lengths):
        first = side[b] if isinstance(side, list) else {"left": n - length, "right": 0}[side]
        m[b, first : first + length] = 1
    return m


N = 29

# (name, pos, doc, valid, lo, hi, exact): exact = the plan is expected to take the flash path
CASES = [
    ("all-ones", None, None, torch.ones(3, N, dtype=torch.long), 0, None, True),  # the whole-row kernel
    ("all-ones + window", None, None, torch.ones(2, N, dtype=torch.long), 0, 5, True),
    ("one document a row", None, torch.tensor([[3] * N, [5] * N]), None, None, None, True),
    ("left", None, None, _rows([29, 20, 5], N, "left"), 0, None, True),
    ("right", None, None, _rows([29, 20, 1], N, "right"), 0, None, True),
    ("both (TRL)", None, None, _rows([10, 20, 3], N, [4, 0, 13]), 0, None, True),
    ("all but one padded", None, None, _rows([29, 0, 0], N, "right"), 0, None, True),
    # a pad between valid tokens sees part of its row's keys: no flash call computes that row
    ("ragged holes", None, None, (torch.arange(N)[None] % torch.tensor([[2], [3], [5]]) != 0).long(), 0, None, False),
    ("pad as bool", None, None, _rows([7, 29, 12], N, [3, 0, 17]).bool(), 0, None, True),
    ("window + left", None, None, _rows([29, 20, 5], N, "left"), 0, 4, True),
    ("window + right", None, None, _rows([29, 20, 5], N, "right"), 0, 4, False),  # right pads see a part of the window
    ("window + holes", None, None, (torch.arange(N)[None] % 3 != 0).long().expand(2, N), 0, 4, False),
    ("docs B>1", None, (torch.arange(N)[None] // torch.tensor([[7], [11]])), None, 0, None, True),
    ("docs + padding", None, (torch.arange(N) // 9)[None].expand(2, N), _rows([25, 12], N, "right"), 0, None, True),
    ("docs + positions + window", (torch.arange(N) % 10)[None], (torch.arange(N) // 10)[None], None, 0, 3, True),
    (
        "docs bidirectional + padding",
        None,
        (torch.arange(N) // 8)[None].expand(2, N),
        _rows([29, 17], N, "left"),
        None,
        None,
        True,
    ),  # fmt: skip
    ("docs out of order", None, torch.tensor([[0] * 5 + [1] * 6 + [0] * 8 + [2] * 10]), None, 0, None, True),
    ("window, no tokens", None, None, None, 0, 6, True),
    ("every token padding", None, None, torch.zeros(2, N, dtype=torch.long), 0, None, True),
]


def _assert_matches_float64(what, q, k, v, g, pos, doc, valid, lo, hi, plan, path, tol):
    """The op forward and backward (output grad ``g``) against the float64 reference at every position, pad rows
    included: out and the grads of q, k, v finite and within ``tol`` of the largest reference value, lse +inf exactly
    on the rows with no allowed key (output 0 there), out and grads token-major as the fake kernels say, and
    ``path`` taken forward and backward."""
    b, h, n, _ = q.shape
    before = dict(OA.PATHS)
    out, lse = torch.ops.tilecompile.masked_attention(q, k, v, pos, doc, valid, lo, hi, 0.3, plan)
    grads = torch.autograd.grad(out, (q, k, v), g)
    for label, t, like in zip(("out", "dq", "dk", "dv"), (out, *grads), (q, q, k, v)):  # as the fake kernels say
        assert t.stride() == K.token_major(like, *like.shape).stride(), (what, label, t.stride())
    assert OA.PATHS[path] - before[path] == 2, (what, OA.PATHS, before)  # forward and backward
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = K.reference(*ref_in, pos, doc, valid, lo, hi, 0.3)
    ref_grads = torch.autograd.grad(ref, ref_in, g.double())
    for label, a, r in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads)):
        assert torch.isfinite(a).all(), (what, label)
        err = (a.double() - r).abs().max().item()
        assert err <= tol * max(1.0, r.abs().max().item()), (what, label, err)
    # lse: +inf exactly on the rows with no allowed key (their output is 0)
    mask = K.block_mask(torch.arange(n), n, pos, doc, valid, lo, hi)
    empty = ~mask.expand(b, 1, n, n).any(-1).expand(b, h, n) if mask is not None else torch.zeros(b, h, n, dtype=bool)
    assert torch.equal(torch.isinf(lse), empty), what
    assert (out[empty[..., None].expand_as(out)] == 0).all(), what


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_packed_path_matches_float64_at_every_position(case, dtype, emulated_flash):
    name, pos, doc, valid, lo, hi, exact = case
    torch.manual_seed(0)
    b = max([t.shape[0] for t in (pos, doc, valid) if t is not None] or [2])
    h, hkv, d = 4, 2, 8
    q, k, v = (torch.randn(b, heads, N, d, dtype=dtype, requires_grad=True) for heads in (h, hkv, hkv))
    g = torch.randn_like(q)
    plan = OA.attention_plan(pos, doc, valid, lo, hi) if (pos, doc, valid) != (None, None, None) else []
    tol = 1e-5 if dtype == torch.float32 else 1e-11
    _assert_matches_float64(name, q, k, v, g, pos, doc, valid, lo, hi, plan, "flash" if exact else "chunked", tol)


# the cases whose plan runs flash on the tokens where they lie (no row gathered): padding of either side, documents
# with padding; "docs out of order" (a document in two pieces) keeps the packed order, whole rows their own kernels
NATURAL = {
    "left", "right", "both (TRL)", "pad as bool", "window + left", "docs + padding", "docs bidirectional + padding"
}  # fmt: skip


@pytest.mark.parametrize("case", [c for c in CASES if c[6]], ids=[c[0] for c in CASES if c[6]])
def test_padding_runs_flash_where_the_tokens_lie(case, emulated_flash, monkeypatch):
    """Padded batches take the natural order: the flash calls read q, k, v, out and the output grad in place (no
    token row gathered, ``_pack`` with no order); the other exact plans keep theirs, and the natural plan refused
    (its flag cleared) gives the same values and grads through the packed order."""
    name, pos, doc, valid, lo, hi, _ = case
    if (pos, doc, valid) == (None, None, None):
        pytest.skip("no tokens: no plan")
    b = max(t.shape[0] for t in (pos, doc, valid) if t is not None)
    plan = OA.attention_plan(pos, doc, valid, lo, hi)
    assert (K.packed(plan, b, N)["natural"] is not None) == (name in NATURAL), name
    orders = []
    real_pack = K._pack
    monkeypatch.setattr(K, "_pack", lambda t, order: orders.append(order is not None) or real_pack(t, order))
    torch.manual_seed(1)
    q, k, v = (torch.randn(b, x, N, 8, dtype=torch.float64, requires_grad=True) for x in (4, 2, 2))
    g = torch.randn(b, 4, N, 8, dtype=torch.float64)
    results = []
    for p in (plan, plan[:5] + [plan[5].clone().index_fill_(0, torch.tensor([7]), 0)] + plan[6:]):
        orders.clear()
        out, lse = torch.ops.tilecompile.masked_attention(q, k, v, pos, doc, valid, lo, hi, 0.3, p)
        results.append((out, lse, *torch.autograd.grad(out, (q, k, v), g)))
        if p is plan and name in NATURAL:
            assert orders and not any(orders), (name, orders)
    for label, a, r in zip(("out", "lse", "dq", "dk", "dv"), *results):
        assert torch.allclose(a, r, rtol=1e-12, atol=1e-12), (name, label)


def _draw_padded_batch(gen: torch.Generator):
    """A random padded batch whose groups lie together, as collators make it: ``(lo, hi, valid, doc, hkv, token_major,
    what)``. B in 1..3, N in 1..40, each row 1, N or between real tokens; causal with the rest padded on the left, the
    right or both; a causal window with left padding only; or bidirectional, one side a row (the natural order takes
    one run of pads a group that see every key: a right pad, or a left one without order). 1 to 3 documents a row,
    distinct random ids in any order, the pads in the first and the last. Drawn again until a pad lies before a real
    token (else the packed order is the identity: the packed path gathers nothing either, natural is not taken)."""

    def draw(a: int, b: int) -> int:  # a <= x <= b
        return int(torch.randint(a, b + 1, (), generator=gen))

    def pick(*choices):
        return choices[draw(0, len(choices) - 1)]

    while True:
        b, n = draw(1, 3), draw(1, 40)
        lo, hi = pick((0, None), (0, draw(0, 7)), (None, None))
        sides = {(0, None): ("left", "right", "both"), (None, None): ("left", "right")}.get((lo, hi), ("left",))
        lengths, lefts, docs, runs = [], [], [], []
        for _ in range(b):
            length = pick(1, n, draw(1, n), draw(1, n))
            pad = n - length
            left = {"left": pad, "right": 0, "both": draw(0, pad)}[pick(*sides)]
            cuts = sorted((torch.randperm(length - 1, generator=gen)[: draw(0, min(2, length - 1))] + 1).tolist())
            sizes = [e - s for s, e in zip([0, *cuts], [*cuts, length])]
            ids = torch.randperm(10, generator=gen)[: len(sizes)].tolist()
            row = [ids[0]] * left + [i for i, m in zip(ids, sizes) for _ in range(m)]
            docs.append(row + [ids[-1]] * (n - len(row)))
            lengths.append(length)
            lefts.append(left)
            runs.append(list(zip(ids, sizes)))
        valid = _rows(lengths, n, lefts)
        flat = valid.flatten()
        if (flat[1:] > flat[:-1]).any():
            break
    doc = torch.tensor(docs) if pick(True, any(len(r) > 1 for r in runs)) else None
    hkv, token_major = pick(1, 2, 4), pick(False, True)
    what = f"B={b} N={n} Hkv={hkv} lo={lo} hi={hi} left={lefts} lengths={lengths}"
    what += f" docs (id, size)={runs if doc is not None else None}" + (" token-major" if token_major else "")
    return lo, hi, valid, doc, hkv, token_major, what


def _keys_seen_by_pads(n, pos, doc, valid, lo, hi) -> int:
    """The keys some pad query is allowed (a right-pad query sees its group's valid run), over every row."""
    mask = K.block_mask(torch.arange(n), n, pos, doc, valid, lo, hi)  # [B or 1, 1, N, N]
    pads = ~valid.bool()
    return int((mask[:, 0] & pads[:, :, None]).any(1).sum())


def _flash_rows(monkeypatch):
    """Record each flash call's (query rows, key rows): forward and backward."""
    rows = []
    for name in ("flash_fwd", "flash_bwd"):
        real = getattr(K, name)
        at = 0 if name == "flash_fwd" else 1

        def spy(*args, real=real, at=at):
            rows.append((args[at].shape[0], args[at + 1].shape[0]))
            return real(*args)

        monkeypatch.setattr(K, name, spy)
    return rows


def test_random_padded_batches_run_flash_where_the_tokens_lie(emulated_flash, monkeypatch):
    """40 random padded batches (``_draw_padded_batch``) take the natural order (their plan's ``natural`` set, so the
    flash calls run on the tokens where they lie), GQA and fp64: out, lse and the grads of q, k, v as float64's at
    every position, pad rows included (a row the emulated flash leaves unwritten is NaN). Call 1 reads every token in
    place; call 2 (where a pad query sees keys) reads the right-pad queries and only the keys they see."""
    gen = torch.Generator().manual_seed(0)
    rows = _flash_rows(monkeypatch)
    for _ in range(40):
        rows.clear()
        lo, hi, valid, doc, hkv, token_major, what = _draw_padded_batch(gen)
        b, n = valid.shape
        plan = OA.attention_plan(None, doc, valid, lo, hi)
        pk = K.packed(plan, b, n)
        assert pk is not None and pk["natural"] is not None, what
        shapes = [(b, n, x, 8) if token_major else (b, x, n, 8) for x in (4, hkv, hkv, 4)]
        q, k, v, g = (torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes)
        q, k, v, g = (t.transpose(1, 2) if token_major else t for t in (q, k, v, g))  # HF's layout, or head-major
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        _assert_matches_float64(what, q, k, v, g, None, doc, valid, lo, hi, plan, "flash", 1e-11)
        seen = _keys_seen_by_pads(n, None, doc, valid, lo, hi)
        call2 = [(pk["t2"], seen)] if seen else []  # forward, then backward: call 1, then call 2 where it runs
        assert rows == [(b * n, b * n), *call2] * 2, (what, rows, seen)


def test_natural_order_refused_beside_two_runs_of_pads(emulated_flash):
    """Where the natural order cannot serve, the packed order does, exact all the same: bidirectional rows padded on
    both sides have their pads (which see every key) in two runs a group, more than call 2's one segment a group
    takes (the random batches above draw one side a bidirectional row, so they never reach this gate)."""
    n, lengths, lefts = 16, [5, 9, 12], [3, 4, 2]
    valid = _rows(lengths, n, lefts)
    plan = OA.attention_plan(None, None, valid, None, None)
    pk = K.packed(plan, len(lengths), n)
    assert pk is not None and pk["natural"] is None
    gen = torch.Generator().manual_seed(1)
    q, k, v, g = (torch.randn(len(lengths), x, n, 8, generator=gen, dtype=torch.float64) for x in (4, 2, 2, 4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    _assert_matches_float64("both sides", q, k, v, g, None, None, valid, None, None, plan, "flash", 1e-11)


def test_plan_reads_back_once_and_layers_share_it(emulated_flash):
    """One plan, one host sync, however many layers use it: each layer's forward and backward read its CPU info."""
    valid = _rows([29, 20, 5], N, [0, 9, 2])
    syncs = K.HOST_SYNCS[0]
    plan = OA.attention_plan(None, None, valid, 0, None)
    assert K.HOST_SYNCS[0] == syncs + 1
    assert plan[5].device.type == "cpu"
    x = torch.randn(3, 2, N, 8, requires_grad=True)
    y = x
    for _ in range(3):
        y, _ = torch.ops.tilecompile.masked_attention(y, y, y, None, None, valid, 0, None, 0.3, plan)
    y.sum().backward()
    assert K.HOST_SYNCS[0] == syncs + 1


def test_plan_fake_and_opcheck():
    valid = _rows([9, 4], 13, "left")
    torch.library.opcheck(torch.ops.tilecompile.attention_plan.default, (None, None, valid, 0, None))
    q = torch.randn(2, 4, 13, 8, requires_grad=True)
    k, v = (torch.randn(2, 2, 13, 8, requires_grad=True) for _ in range(2))
    plan = OA.attention_plan(None, None, valid, 0, None)
    torch.library.opcheck(
        torch.ops.tilecompile.masked_attention.default, (q, k, v, None, None, valid, 0, None, 0.3, plan)
    )


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_cuda_flash_path_matches_float64(case):
    """The real flash varlen kernels, bf16 at 1024 tokens a row: every position's values and gradients within
    eager SDPA's own error (dense mask, bf16) of the float64 reference, rows with no key exactly 0."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    name, pos, doc, valid, lo, hi, exact = case
    n, rep = 1024, 1024 // N + 1
    dev = "cuda"

    def stretch(t):  # the 29-token pattern, each token repeated to fill 1024 (windows scaled alike)
        return None if t is None else t.repeat_interleave(rep, -1)[:, :n].to(dev)

    pos = None if pos is None else (torch.arange(n) % (10 * rep))[None].to(dev)
    doc, valid = stretch(doc), stretch(valid)
    hi = None if hi is None else hi * rep
    torch.manual_seed(0)
    b = max([t.shape[0] for t in (pos, doc, valid) if t is not None] or [2])
    h, hkv, d = 8, 2, 64
    q, k, v = (torch.randn(b, x, n, d, device=dev, dtype=torch.bfloat16, requires_grad=True) for x in (h, hkv, hkv))
    plan = OA.attention_plan(pos, doc, valid, lo, hi) if (pos, doc, valid) != (None, None, None) else []
    before = dict(OA.PATHS)
    out, lse = torch.ops.tilecompile.masked_attention(q, k, v, pos, doc, valid, lo, hi, d**-0.5, plan)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    flash = OA.PATHS["flash"] - before["flash"]
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = K.reference(*ref_in, pos, doc, valid, lo, hi, d**-0.5)
    ref_grads = torch.autograd.grad(ref, ref_in, g.double())
    e_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    eager = K.reference(*e_in, pos, doc, valid, lo, hi, d**-0.5)
    eager_grads = torch.autograd.grad(eager, e_in, g)
    for label, a, e, r in zip(("out", "dq", "dk", "dv"), (out, *grads), (eager, *eager_grads), (ref, *ref_grads)):
        ours, theirs = (a.double() - r).norm().item(), (e.double() - r).norm().item()
        assert torch.isfinite(a).all(), (name, label)
        assert ours <= 1.5 * theirs + 1e-6, (name, label, ours, theirs, flash)
    mask = K.block_mask(torch.arange(n, device=dev), n, pos, doc, valid, lo, hi)
    if mask is not None:
        empty = ~mask.expand(b, 1, n, n).any(-1).expand(b, h, n)
        assert torch.equal(torch.isinf(lse), empty), name
        assert (out[empty[..., None].expand_as(out)] == 0).all(), name
    assert flash == (2 if exact else 0), (name, flash)


def test_whole_rows_take_the_whole_row_kernel(emulated_flash, monkeypatch):
    """An all-ones mask (every row one segment) runs the kernel SDPA's is_causal runs, not the varlen one; where that
    kernel raises, the varlen one serves (once warned) and the result is the same."""
    calls = []
    monkeypatch.setattr(K, "flash_fwd", lambda *a, **k: calls.append("varlen") or emulated_flash_fwd(*a, **k))
    monkeypatch.setattr(K, "flash_dense_fwd", lambda *a, **k: calls.append("rows") or emulated_dense_fwd(*a, **k))
    valid = torch.ones(2, 17, dtype=torch.long)
    q = torch.randn(2, 4, 17, 8, dtype=torch.float64)
    plan = OA.attention_plan(None, None, valid, 0, None)
    ref = K.reference(q, q[:, :2], q[:, :2], None, None, valid, 0, None, 0.3)
    out, _ = torch.ops.tilecompile.masked_attention(q, q[:, :2], q[:, :2], None, None, valid, 0, None, 0.3, plan)
    assert calls == ["rows"] and torch.allclose(out, ref)

    def broken(*a, **k):
        raise RuntimeError("no kernel image")

    monkeypatch.setattr(K, "flash_dense_fwd", broken)
    monkeypatch.setattr(K, "_DENSE_OK", [True])
    with pytest.warns(UserWarning, match="varlen kernel serves instead"):
        out, _ = torch.ops.tilecompile.masked_attention(q, q[:, :2], q[:, :2], None, None, valid, 0, None, 0.3, plan)
    assert calls == ["rows", "varlen"] and torch.allclose(out, ref)


def test_whole_rows_fall_back_to_flash_where_cudnn_raises(emulated_flash, monkeypatch):
    """Where cuDNN's attention is taken (CUDA half precision, no window) and raises, flash over whole rows serves
    (once warned), forward and backward, with the same result; the next call does not try cuDNN again."""
    tried = []

    def broken(*a, **k):
        tried.append("cudnn")
        raise RuntimeError("cuDNN: no engine for this graph")

    monkeypatch.setattr(K, "_CUDNN_OK", [True])
    monkeypatch.setattr(K, "cudnn_rows_supported", lambda q, v, hi: K._CUDNN_OK[0] and hi is None)
    monkeypatch.setattr(K, "cudnn_rows_fwd", broken)
    monkeypatch.setattr(K, "cudnn_rows_bwd", broken)
    valid = torch.ones(2, 17, dtype=torch.long)
    q = torch.randn(2, 4, 17, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 17, 8, dtype=torch.float64, requires_grad=True) for _ in "kv")
    plan = OA.attention_plan(None, None, valid, 0, None)
    with pytest.warns(UserWarning, match="cuDNN attention failed .* flash serves instead"):
        out, _ = torch.ops.tilecompile.masked_attention(q, k, v, None, None, valid, 0, None, 0.3, plan)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert tried == ["cudnn"]
    ref_in = [t.detach().requires_grad_() for t in (q, k, v)]
    ref = K.reference(*ref_in, None, None, valid, 0, None, 0.3)
    ref_grads = torch.autograd.grad(ref, ref_in, torch.ones_like(ref))
    for a, r in zip((out, *grads), (ref, *ref_grads)):
        assert torch.allclose(a, r)


@pytest.mark.gpu
@pytest.mark.parametrize("hkv", [2, 8])
@pytest.mark.parametrize("lo", [0, None], ids=["causal", "bidirectional"])
def test_cuda_whole_rows_take_cudnn(hkv, lo, monkeypatch):
    """An all-ones mask on CUDA runs cuDNN's attention (what SDPA's is_causal runs on the H200), GQA's key heads
    repeated for it: out, lse and grads within eager SDPA's error of float64, out and grads token-major as the fake
    kernels say, and its lse equal to flash's (a cuDNN backward that fails falls back to flash's, reading it)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    calls = []
    for name in ("cudnn_rows_fwd", "cudnn_rows_bwd"):
        real = getattr(K, name)
        monkeypatch.setattr(K, name, lambda *a, _f=real, _n=name, **kw: calls.append(_n) or _f(*a, **kw))
    torch.manual_seed(0)
    b, n, h, d = 2, 1000, 8, 64
    q = torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    k, v = (
        torch.randn(b, n, hkv, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_() for _ in "kv"
    )
    valid = torch.ones(b, n, dtype=torch.long, device="cuda")
    plan = OA.attention_plan(None, None, valid, lo, None)
    out, lse = torch.ops.tilecompile.masked_attention(q, k, v, None, None, valid, lo, None, d**-0.5, plan)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    assert calls == ["cudnn_rows_fwd", "cudnn_rows_bwd"] and K._CUDNN_OK[0]
    for label, t, like in zip(("out", "dq", "dk", "dv"), (out, *grads), (q, q, k, v)):
        assert t.stride() == K.token_major(like, *like.shape).stride(), (label, t.stride())
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = K.reference(*ref_in, None, None, valid, lo, None, d**-0.5)
    ref_grads = torch.autograd.grad(ref, ref_in, g.double())
    e_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    eager = K.reference(*e_in, None, None, valid, lo, None, d**-0.5)
    eager_grads = torch.autograd.grad(eager, e_in, g)
    for label, a, e, r in zip(("out", "dq", "dk", "dv"), (out, *grads), (eager, *eager_grads), (ref, *ref_grads)):
        ours, theirs = (a.double() - r).norm().item(), (e.double() - r).norm().item()
        assert torch.isfinite(a).all() and ours <= 1.5 * theirs + 1e-6, (label, ours, theirs)
    rows = [K._rows4(x) for x in (q, k, v)]
    _, flash_lse = K.flash_dense_fwd(*rows, lo == 0, -1, 0 if lo == 0 else -1, d**-0.5)
    assert torch.allclose(lse, flash_lse, atol=1e-3, rtol=0), (lse - flash_lse).abs().max().item()


@pytest.mark.gpu
@pytest.mark.parametrize(
    "valid",
    [
        torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]),
        torch.zeros(2, 4, dtype=torch.long),
        torch.ones(2, 1, dtype=torch.long),
    ],
    ids=["one right pad a row (max_q 1, GQA)", "every token padding", "one token a row"],
)
@pytest.mark.filterwarnings("error:tilecompile:UserWarning")  # no kernel falls back: each shape is taken as it is
def test_cuda_flash_path_edge_cases(valid):
    """Shapes the kernels treat apart (found by reading FA2's launcher): one query per call-2 segment with GQA,
    no real token at all, one token a row; values and grads as float64's, at eager's error."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    valid = valid.cuda()
    b, n = valid.shape
    q = torch.randn(b, n, 4, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    k, v = (torch.randn(b, 2, n, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "kv")
    plan = OA.attention_plan(None, None, valid, 0, None)
    out, _ = torch.ops.tilecompile.masked_attention(q, k, v, None, None, valid, 0, None, 0.125, plan)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = K.reference(*ref_in, None, None, valid, 0, None, 0.125)
    ref_grads = torch.autograd.grad(ref, ref_in, torch.ones_like(ref))
    for a, r in zip((out, *grads), (ref, *ref_grads)):
        assert (a.double() - r).abs().max().item() <= 2e-2 * max(1.0, r.abs().max().item())
