"""Masked attention without an [N, N] mask: the mask is evaluated per query block from per-token tensors.

The mask family (what ``passes/attention/mask_algebra.py`` proves a graph's mask to be), for batch b, query i, key j:

    allowed(b, i, j) = lo <= c(b, i) - c(b, j) <= hi        c = pos[b, ·] when given, else the index itself
                       and doc[b, i] == doc[b, j]           when doc is given
                       and valid[b, j]                      when valid is given

with ``lo`` / ``hi`` absent meaning unbounded (causal: lo = 0; a sliding window of W adds hi = W - 1).
Attention is softmax(q·kᵀ·scale masked to -inf)·v, GQA by heads (query head h reads key head h // (H / Hkv)).
A query row with no allowed key gets output 0 and no gradient, as PyTorch's SDPA gives with a boolean mask.

Forward saves lse = log Σ_j e^(s_ij) per row (+inf for a fully masked row, so the backward's recomputed
probabilities e^(s - lse) are 0 there). Backward, per query block, from q, k, v, out, lse:
p = e^(s - lse), dv += pᵀ·do, dp = do·vᵀ, ds = p ⊙ (dp - rowsum(do ⊙ out)), dq = ds·k·scale, dk += dsᵀ·q·scale.

Two implementations of the same math:
- ``chunked_fwd`` / ``chunked_bwd`` (``kernels/attention_reference.py``, beside this module): plain PyTorch over
  query blocks, fp32 accumulation (fp64 for fp64 inputs);
  memory O(block · N). The CPU path, and the CUDA path for masks no flash kernel takes.
- ``plan_tensors`` + ``packed_fwd`` / ``packed_bwd`` (CUDA): the tokens gathered into one packed order, grouped by
  (row, document) with the valid tokens first, through PyTorch's flash-attention varlen kernels
  (``aten::_flash_attention_forward``) at flash speed: call 1 runs every group's valid queries causally (or in
  their window) over the group's valid keys; call 2 runs the pad queries that are allowed every valid key of their
  group (right padding) over those keys, non-causally; pad queries with no allowed key (left padding) get 0. Exact
  whenever the plan says so (any padding on either side, documents in any row, in any order; windows and
  position-defined order where coordinates advance by one inside a group); the plan's one host sync reads that.
  Where every group's tokens lie together (padding on either side, documents in order: what collators make), the
  same calls run on the tokens where they lie (``_natural_segments``): pad runs become segments of no key or no
  query, and only the right-pad query rows are gathered, not every row of q, k, v, out and the gradients.
"""

from __future__ import annotations

import warnings

import torch

from tilecompile.kernels.attention_reference import (  # noqa: F401 - the plain-PyTorch path, re-exported
    CHUNK_BUDGET_BYTES,
    block_mask,
    chunked_bwd,
    chunked_fwd,
    reference,
    token_major,
)

# ------------------------------------------------------------------------------- CUDA: flash varlen on packed tokens

# How many host syncs the packed plan has made in this process (one per ``plan`` call): benchmarks read it.
HOST_SYNCS = [0]


def flash_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether PyTorch's flash varlen kernel takes these inputs (device, dtype, head dims)."""
    return (
        q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and q.shape[-1] == k.shape[-1] == v.shape[-1]
        and q.shape[-1] % 8 == 0
        and q.shape[-1] <= 256
        and k.shape[2] == q.shape[2]
    )


def plan_tensors(pos, doc, valid, lo, hi, b: int, n: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The packing of the mask's tokens for flash varlen, worked out on the device with static shapes, then read
    back once (the only host sync): ``(order, inv, region, cu1, cu2, info, ncu, gather)``.

    Tokens t = (row, index) are grouped by (row, doc); inside a group the valid tokens come first, in index order.
    Packed order: every group's valid tokens (call 1's segments, one per group that has any: causal / windowed
    flash exactly, when the group's coordinates advance as flash's indices do), then the pad queries that are
    allowed *every* valid key of their group (a right-pad row: call 2, non-causal over the group's keys), then pad
    queries allowed no key (left pad: output 0). A pad query allowed some keys of its group but not all (a pad
    inside a window, a hole between valid tokens under causal order) makes the plan inexact (``info[0]``).

    order [T] (packed position -> flat token), inv [T], region [T] int8 (0, 1, 2 as above), cu1 / cu2 [T + 2] int32
    (the first S + 1 entries: call 1's query-and-key offsets; call 2's query offsets, its keys being call 1's),
    info [14] int64 on the CPU: inexact, S, tokens of call 1, of call 2, longest of each, order is the identity,
    then the natural order's (``_natural_segments``): whether it serves, its segments in each call, longest
    segment of call 1, longest query and key segment of call 2, call 2's keys. ncu [4, 3T + 3] int32: the natural
    order's offsets; gather [2, T]: the region-1 tokens first, then call 2's keys first, each in token order (the
    rows natural call 2 gathers).
    """
    t = b * n
    ar = torch.arange(t, device=device)
    row = ar // n
    idx = ar - row * n
    ok = valid.expand(b, n).reshape(t).bool() if valid is not None else torch.ones(t, dtype=torch.bool, device=device)
    d = doc.expand(b, n).reshape(t) if doc is not None else torch.zeros(t, dtype=torch.long, device=device)
    windowed = lo is not None or hi is not None
    c = pos.expand(b, n).reshape(t).long() if pos is not None and windowed else idx
    # lexicographic (row, doc, valid first, index) by stable sorts from the least significant key
    o = torch.argsort((~ok).to(torch.int8), stable=True)
    o = o[torch.argsort(d[o], stable=True)]
    o = o[torch.argsort(row[o], stable=True)]
    ro, do_, vo, co = row[o], d[o], ok[o], c[o]
    start = torch.ones(t, dtype=torch.bool, device=device)
    start[1:] = (ro[1:] != ro[:-1]) | (do_[1:] != do_[:-1])
    gid = torch.cumsum(start.long(), 0) - 1
    big = torch.iinfo(torch.long).max // 4
    nvalid = torch.zeros(t, dtype=torch.long, device=device).scatter_add_(0, gid, vo.long())
    cmin = torch.full((t,), big, device=device).scatter_reduce_(0, gid, torch.where(vo, co, big), "amin")
    cmax = torch.full((t,), -big, device=device).scatter_reduce_(0, gid, torch.where(vo, co, -big), "amax")
    # call 1 is exact when, inside a group, consecutive valid tokens advance as flash's indices do
    inexact = torch.zeros((), dtype=torch.bool, device=device)
    if t > 1 and (hi is not None or lo is not None):
        same = ~start[1:] & vo[1:] & vo[:-1]
        step = co[1:] - co[:-1]
        inexact = (same & ((step != 1) if hi is not None else (step < 1))).any()
    # pad queries: every key of their group allowed, or none
    g_n, g_min, g_max = nvalid[gid], cmin[gid], cmax[gid]
    every = g_n > 0
    none = g_n == 0
    if lo is not None:
        every = every & (co - g_max >= lo)
        none = none | (co - g_min < lo)
    if hi is not None:
        every = every & (co - g_min <= hi)
        none = none | (co - g_max > hi)
    inexact = inexact | (~vo & ~every & ~none).any()
    region_o = torch.where(vo, 0, torch.where(every, 1, 2)).to(torch.int8)
    perm = torch.argsort(region_o, stable=True)
    order, region = o[perm], region_o[perm]
    nall = torch.zeros(t, dtype=torch.long, device=device).scatter_add_(0, gid, (region_o == 1).long())
    has = nvalid > 0
    seg = torch.cumsum(has.long(), 0) - 1
    slot = torch.where(has, seg + 1, t + 1)
    cu1 = torch.zeros(t + 2, dtype=torch.long, device=device).scatter_add_(0, slot, nvalid).cumsum(0)
    cu2 = torch.zeros(t + 2, dtype=torch.long, device=device).scatter_add_(0, slot, nall).cumsum(0)
    t1 = ok.sum()
    cu2 = cu2 + t1
    inv = torch.empty_like(order).scatter_(0, order, ar)
    ncu, gather, natural = _natural_segments(ar, ok, o, gid, region_o, nall, start, inexact, b)
    info = torch.stack(
        [inexact.long(), has.sum(), t1, nall.sum(), nvalid.max(), nall.max(), (order == ar).all().long(), *natural]
    )
    HOST_SYNCS[0] += 1
    return order, inv, region, cu1.to(torch.int32), cu2.to(torch.int32), info.cpu(), ncu.to(torch.int32), gather


def _natural_segments(ar, ok, o, gid, region_o, nall, start, inexact, b: int):
    """The same two flash calls over the tokens where they lie (flat index order), so that no valid row is
    gathered: ``(ncu [4, 3T + 3], gather [2, T], [natural, S1, S2, max1, max2q, max2k, K2])``, ``ncu`` holding call 1's
    query and key offsets and call 2's (the first S1 + 1 / S2 + 1 entries).

    Call 1: each group's valid run is one segment, causal (or windowed) over itself; a run of pad tokens between
    them is two segments, its queries over no key, then its keys under no query: flash computes nothing there
    (the caller fills those rows). Call 2: the region-1 (right-pad) queries, gathered in token order
    (``gather[0]``), each group's run of them over the group's valid run, whose K2 keys are gathered too, in token
    order (``gather[1]``), so flash's per-row work (its dO·O and dQ passes) and per-key work (GQA's dK / dV group
    sum over the query heads, the zeros of keys no query reads) stay off the other tokens (measured on the H200: a
    gain where those groups are a part of the batch, e.g. the last document of each row; about even where they are
    most of it, one group a row; benchmarks/RESULTS.md, "call 2 on its own keys"). Natural
    order serves when the plan is exact, every group's tokens are contiguous, each group has one valid run and at
    most one run of region-1 pads, and call 1's pad segments stay few (at most two pad runs a row beside one a
    group: flash's backward sizes a buffer by 128 rows a segment)."""
    t = ar.numel()
    device = ar.device
    big = torch.iinfo(torch.long).max // 4
    gid_n = torch.empty_like(gid).scatter_(0, o, gid)
    reg_n = torch.empty_like(region_o).scatter_(0, o, region_o)
    first = ar == 0
    prev = torch.cat([ar[:1], ar[:-1]])  # the token before (itself for the first)
    gstart = first | (gid_n != gid_n[prev])
    contiguous = gstart.sum() == start.sum()
    # call 1's runs: a group's valid tokens, or consecutive pad tokens of any groups
    rstart = first | (ok != ok[prev]) | (ok & (gid_n != gid_n[prev]))
    runs_of = torch.zeros(t, dtype=torch.long, device=device)
    valid_runs = runs_of.scatter_add(0, gid_n, (rstart & ok).long())
    r1 = reg_n == 1
    r1_runs = runs_of.scatter_add(0, gid_n, (r1 & (first | ~r1[prev] | gstart)).long())
    pad_runs = (rstart & ~ok).sum()
    groups = start.sum()
    rend = torch.cat([rstart[1:], torch.ones(1, dtype=torch.bool, device=device)])
    s = torch.cummax(torch.where(rstart, ar, 0), 0).values
    e = ar + 1
    cnt = torch.where(rend, torch.where(ok, 1, 2), 0)
    slot = torch.cumsum(cnt, 0) - cnt + 1
    size = 3 * t + 3
    dump = size - 1
    ncu = torch.zeros(4, size, dtype=torch.long, device=device)
    at = torch.where(rend, slot, dump)
    ncu[0].scatter_(0, at, e)
    ncu[1].scatter_(0, at, torch.where(ok, e, s))
    at = torch.where(rend & ~ok, slot + 1, dump)
    ncu[0].scatter_(0, at, e)
    ncu[1].scatter_(0, at, e)
    s1 = cnt.sum()
    max1 = torch.where(rend, e - s, 0).max()
    # call 2: each group's run of region-1 queries over the group's valid run, both gathered in token order (the
    # groups are contiguous, so ordering them by their region-1 run orders their valid runs too)
    vs = torch.full((t,), big, device=device).scatter_reduce_(0, gid_n, torch.where(ok, ar, big), "amin")
    ve = torch.full((t,), -1, device=device).scatter_reduce_(0, gid_n, torch.where(ok, ar, -1), "amax") + 1
    rs = torch.full((t,), big, device=device).scatter_reduce_(0, gid_n, torch.where(r1, ar, big), "amin")
    re = torch.full((t,), -1, device=device).scatter_reduce_(0, gid_n, torch.where(r1, ar, -1), "amax") + 1
    has1 = nall > 0
    g1 = has1.sum()
    by = torch.argsort(torch.where(has1, rs, big))
    real = ar < g1
    qlen = torch.where(real, (re - rs)[by], 0)
    klen = torch.where(real, (ve - vs)[by], 0)
    ncu[2, 1 : t + 1] = torch.cumsum(qlen, 0)
    ncu[3, 1 : t + 1] = torch.cumsum(klen, 0)
    keys2 = ok & has1[gid_n]
    gather = torch.stack(
        [torch.argsort((~r1).to(torch.int8), stable=True), torch.argsort((~keys2).to(torch.int8), stable=True)]
    )  # the region-1 tokens first, in token order; then call 2's keys first, in token order
    natural = ~inexact & contiguous & (valid_runs <= 1).all() & (r1_runs <= 1).all() & (pad_runs <= groups + 2 * b)
    return ncu, gather, [natural.long(), s1, g1, max1, qlen.max(), klen.max(), keys2.sum()]


def packed(plan: list[torch.Tensor] | tuple[torch.Tensor, ...], b: int, n: int) -> dict | None:
    """The plan as flash varlen's arguments (no host sync: ``info`` is on the CPU), or None where it is inexact or
    was made for another token count."""
    order, inv, region, cu1, cu2, info, ncu, gather = plan
    if order.numel() != b * n:
        return None
    inexact, s, t1, t2, max1, max2, identity, natural, s1n, s2n, max1n, max2q, max2k, k2 = info.tolist()
    if inexact:
        return None
    pk = {
        "order": None if identity else order,
        "inv": None if identity else inv,
        "region": region,
        "t1": t1,
        "t2": t2,
        "rows": bool(identity) and s == b and t1 == b * n and max1 == n,  # each row one whole segment
        "cu1": cu1[: s + 1],
        "cu2": cu2[: s + 1] if t2 else None,
        "max1": max(1, max1),
        "max2": max(1, max2),
        "natural": None,
    }
    if natural and not identity:  # where the order is the identity, the packed path gathers nothing either
        pk["natural"] = {
            "cu1": (ncu[0, : s1n + 1], ncu[1, : s1n + 1]),
            "max1": max(1, max1n),
            "cu2": (ncu[2, : s2n + 1], ncu[3, : s2n + 1]) if t2 else None,
            "max2": (max(1, max2q), max(1, max2k)),
            "right": gather[0, :t2],  # region 1: the right-pad queries call 2 computes, in token order
            "keys2": gather[1, :k2],  # the valid tokens of their groups: call 2's keys, in token order
            "none": order[t1 + t2 :],  # region 2: queries with no key (output 0)
            "pads": order[t1:],  # every pad token: no key's gradient
        }
    return pk


def _windows(lo, hi):
    left = -1 if hi is None else int(hi)  # keys at most `hi` positions back
    right = 0 if lo == 0 else -1
    return left, right


def _pack(t: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """[B, heads, N, D] -> [T, heads, D] in packed order: one row gather (``index_select`` of whole token rows, the
    fast gather; measured 1.8 ms a layer's fwd+bwd slower with elementwise advanced indexing at 8 x 4096). A view
    of token-major ``t`` (HF's q, k, v) is reshaped without a copy."""
    b, heads, n, d = t.shape
    flat = t.transpose(1, 2).reshape(b * n, heads, d)
    return flat.contiguous() if order is None else flat.index_select(0, order)


def _unpack(t: torch.Tensor, inv: torch.Tensor | None, b: int, n: int) -> torch.Tensor:
    """[T, heads, D] in packed order -> [B, heads, N, D], token-major (see ``token_major``)."""
    flat = t if inv is None else t.index_select(0, inv)
    return flat.view(b, n, t.shape[1], t.shape[2]).transpose(1, 2)


def flash_fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, left, right, scale):
    """Flash varlen forward over packed [T, heads, D]: (out [T, H, D], lse [H, T] fp32). Rows outside every query
    segment are left as the kernel leaves them (the caller selects)."""
    # max_q >= 2: with max_q == 1 (every segment one query: right pads one a row) and GQA, FA2 reshapes q as one
    # query per segment ([segments, Hkv, H / Hkv, D]), which packed rows outside every segment break. max_q only
    # sizes the grid; the segments bound the work.
    res = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max(2, max_q), max_k, 0.0, causal, False,
        scale=scale, window_size_left=left, window_size_right=right,
    )  # fmt: skip
    return res[0], res[1]


def flash_bwd(g, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, left, right, scale):
    unused = torch.zeros((), dtype=torch.int64, device=q.device)  # philox seed/offset: no dropout
    return torch.ops.aten._flash_attention_backward(
        g, q, k, v, out, lse, cu_q, cu_k, max(2, max_q), max_k, 0.0, causal, unused, unused,
        scale=scale, window_size_left=left, window_size_right=right,
    )  # fmt: skip


# Whether the non-varlen flash kernel has worked here (False after it raised once: the varlen one serves instead).
_DENSE_OK = [True]


def flash_dense_fwd(q4, k4, v4, causal, left, right, scale):
    """Flash forward over whole rows, [B, N, heads, D] views: (out [B, N, H, D], lse [B, H, N] fp32): the kernel
    SDPA's ``is_causal`` path runs. Not the varlen kernel with one segment a row: that was about 1.7x slower a row
    (benchmarks/RESULTS.md, "The sweeps behind the kernels' settings")."""
    b, n, h, _ = q4.shape
    res = torch.ops.aten._flash_attention_forward(
        q4, k4, v4, None, None, n, n, 0.0, causal, False, scale=scale, window_size_left=left, window_size_right=right
    )
    if tuple(res[1].shape) != (b, h, n):  # a kernel that lays lse out otherwise: the varlen one serves
        raise RuntimeError(f"whole-row flash returned lse of shape {tuple(res[1].shape)}, expected {(b, h, n)}")
    return res[0], res[1]


def flash_dense_bwd(g4, q4, k4, v4, out4, lse, causal, left, right, scale):
    n = q4.shape[1]
    unused = torch.zeros((), dtype=torch.int64, device=q4.device)
    return torch.ops.aten._flash_attention_backward(
        g4, q4, k4, v4, out4, lse, None, None, n, n, 0.0, causal, unused, unused,
        scale=scale, window_size_left=left, window_size_right=right,
    )  # fmt: skip


def _rows4(t: torch.Tensor) -> torch.Tensor:
    """[B, heads, N, D] -> [B, N, heads, D] contiguous (free for token-major ``t``, HF's q; one copy for head-major,
    e.g. ``repeat_kv``'s k, v): the kernels allocate out and grads ``empty_like`` their inputs, and those must come
    back token-major, as the fake kernels say."""
    return t.transpose(1, 2).contiguous()


def _guarded(ok: list[bool], what: str, instead: str, fn, *args):
    """``fn(*args)``, or None where ``ok[0]`` is False or ``fn`` raises (then ``ok[0] = False``, after one warning:
    ``what`` failed, ``instead`` serves). Running out of memory is raised: that is not a kernel that cannot run."""
    if not ok[0]:
        return None
    try:
        return fn(*args)
    except torch.OutOfMemoryError:
        raise
    except RuntimeError as exc:
        ok[0] = False
        warnings.warn(f"tilecompile: {what} failed ({exc}); {instead} serves instead", stacklevel=3)
        return None


def _dense(fn, *args):
    """``fn(*args)`` through the whole-row flash kernel, or None (after a warning, once) where it raises."""
    return _guarded(_DENSE_OK, "flash over whole rows", "the varlen kernel", fn, *args)


# Whether cuDNN's attention has worked here (False after it raised once: flash serves instead).
_CUDNN_OK = [True]


def cudnn_rows_supported(q: torch.Tensor, v: torch.Tensor, hi) -> bool:
    """Whether whole rows (an all-ones padding mask) may take cuDNN's attention, the kernel SDPA's ``is_causal``
    picks on the H200 (torch 2.11), about half flash's time there (benchmarks/RESULTS.md, "The sweeps behind the
    kernels' settings"). CUDA fp16 / bf16, no window (the op takes none), one head dim
    for q, k and v, at most 128 and a multiple of 8; rows of two tokens or more (its backward takes no
    s_q = s_kv = 1: "not supported", measured)."""
    d = q.shape[-1]
    return (
        _CUDNN_OK[0]
        and q.is_cuda
        and q.shape[2] >= 2
        and q.dtype in (torch.float16, torch.bfloat16)
        and hi is None
        and v.shape[-1] == d
        and d <= 128
        and d % 8 == 0
    )


def _heads_of(t: torch.Tensor, h: int) -> torch.Tensor:
    """[B, Hkv, N, D] -> [B, H, N, D], token-major, each key head repeated for the query heads that read it (query
    head i reads key head i // (H / Hkv)): cuDNN's kernel takes no GQA. A transient copy, never saved."""
    rows = t.transpose(1, 2)
    rows = rows.contiguous() if t.shape[1] == h else rows.repeat_interleave(h // t.shape[1], dim=2)
    return rows.transpose(1, 2)


def _token_major_as(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` with ``like``'s token-major strides (the fake kernels' promise): ``t`` itself when it has them."""
    want = token_major(like, *t.shape)
    return t if t.stride() == want.stride() else want.copy_(t)


def cudnn_rows_fwd(q, k, v, causal: bool, scale: float):
    """cuDNN attention over whole rows: (out [B, H, N, D] token-major, lse [B, H, N] fp32, the natural-log
    log-sum-exp of the scaled scores, as flash's)."""
    b, h, n, _ = q.shape
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(
        _rows4(q).transpose(1, 2), _heads_of(k, h), _heads_of(v, h), None, True, 0.0, causal, False, scale=scale
    )
    out, lse = res[0], res[1]
    if lse.numel() != b * h * n or lse.dtype != torch.float32:
        raise RuntimeError(f"cuDNN attention returned lse of shape {tuple(lse.shape)} ({lse.dtype})")
    return _token_major_as(out, q), lse.reshape(b, h, n)


def cudnn_rows_bwd(g, q, k, v, out, lse, causal: bool, scale: float):
    """(dq, dk, dv) token-major; dk, dv summed in fp32 over the query heads that share a key head."""
    b, h, n, _ = q.shape
    hkv = k.shape[1]
    unused = torch.zeros((), dtype=torch.int64, device=q.device)  # philox seed / offset: no dropout
    rows = [_rows4(x).transpose(1, 2) for x in (g, q, out)]
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        rows[0], rows[1], _heads_of(k, h), _heads_of(v, h), rows[2], lse.reshape(b, h, n, 1), unused, unused,
        None, None, None, n, n, 0.0, causal, scale=scale,
    )  # fmt: skip

    def per_key_head(d: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        if hkv == h:
            return _token_major_as(d, like)
        summed = d.unflatten(1, (hkv, h // hkv)).sum(2, dtype=torch.float32)
        return token_major(like, *like.shape).copy_(summed)

    return _token_major_as(dq, q), per_key_head(dk, k), per_key_head(dv, v)


def packed_fwd(q, k, v, pk: dict, lo, hi, scale):
    """(out [B, H, N, D] token-major, lse [B, H, N] fp32: +inf on a row with no allowed key, whose output is 0).

    Packed rows: [0, t1) call 1's queries, [t1, t1 + t2) call 2's (right-pad rows), then rows with no key. Each call
    leaves the rows outside its segments unwritten; they are filled here by slices (the bounds are on the host)."""
    b, h, n, _ = q.shape
    t1, t = pk["t1"], b * n
    order = pk["order"]
    left, right = _windows(lo, hi)
    if t1 == 0:  # every token padding: no key anywhere (flash takes no empty batch)
        out = token_major(q, b, h, n, v.shape[-1]).zero_()
        return out, torch.full((b, h, n), float("inf"), dtype=torch.float32, device=q.device)
    if pk["rows"]:  # every row one whole segment (an all-ones padding mask): a whole-row kernel
        if cudnn_rows_supported(q, v, hi):
            res = _guarded(_CUDNN_OK, "cuDNN attention", "flash", cudnn_rows_fwd, q, k, v, lo == 0, scale)
            if res is not None:
                return res
        res = _dense(flash_dense_fwd, _rows4(q), _rows4(k), _rows4(v), lo == 0, left, right, scale)
        if res is not None:
            return res[0].transpose(1, 2), res[1].contiguous()
    if pk["natural"] is not None:
        return _natural_fwd(q, k, v, pk, lo, left, right, scale)
    qf, kf, vf = (_pack(x, order) for x in (q, k, v))
    out, lse = flash_fwd(qf, kf, vf, pk["cu1"], pk["cu1"], pk["max1"], pk["max1"], lo == 0, left, right, scale)
    if tuple(lse.shape) != (h, t):
        raise RuntimeError(f"flash varlen returned lse of shape {tuple(lse.shape)}, expected {(h, t)}")
    t2 = 0
    if pk["cu2"] is not None:
        out2, lse2 = flash_fwd(qf, kf, vf, pk["cu2"], pk["cu1"], pk["max2"], pk["max1"], False, -1, -1, scale)
        t2 = pk["t2"]
        out[t1 : t1 + t2] = out2[t1 : t1 + t2]
        lse[:, t1 : t1 + t2] = lse2[:, t1 : t1 + t2]
    out[t1 + t2 :] = 0
    lse[:, t1 + t2 :] = float("inf")
    inv = pk["inv"]
    lse_flat = lse if inv is None else lse.index_select(1, inv)
    return _unpack(out, inv, b, n), lse_flat.view(h, b, n).transpose(0, 1).contiguous()


def packed_bwd(grad_out, q, k, v, out, lse, pk: dict, lo, hi, scale):
    b, h, n, _ = q.shape
    t1, t2 = pk["t1"], pk["t2"] if pk["cu2"] is not None else 0
    order = pk["order"]
    left, right = _windows(lo, hi)
    if t1 == 0:
        return tuple(token_major(x, *x.shape).zero_() for x in (q, k, v))
    if pk["rows"]:
        if cudnn_rows_supported(q, v, hi):  # lse is flash's wherever it came from: either backward reads it
            res = _guarded(
                _CUDNN_OK, "cuDNN attention", "flash", cudnn_rows_bwd, grad_out, q, k, v, out, lse, lo == 0, scale
            )
            if res is not None:
                return res
        rows = (_rows4(x) for x in (grad_out, q, k, v, out))
        res = _dense(flash_dense_bwd, *rows, lse.contiguous(), lo == 0, left, right, scale)
        if res is not None:
            return tuple(x.transpose(1, 2) for x in res)
    if pk["natural"] is not None:
        return _natural_bwd(grad_out, q, k, v, out, lse, pk, lo, left, right, scale)
    qf, kf, vf, of, gf = (_pack(x, order) for x in (q, k, v, out, grad_out))
    lse_f = lse.transpose(0, 1).reshape(h, b * n)
    lse_f = lse_f.contiguous() if order is None else lse_f.index_select(1, order)
    args = (pk["cu1"], pk["cu1"], pk["max1"], pk["max1"], lo == 0, left, right)
    dq, dk, dv = flash_bwd(gf, qf, kf, vf, of, lse_f, *args, scale=scale)
    if t2:
        args2 = (pk["cu2"], pk["cu1"], pk["max2"], pk["max1"], False, -1, -1)
        dq2, dk2, dv2 = flash_bwd(gf, qf, kf, vf, of, lse_f, *args2, scale=scale)
        dq[t1 : t1 + t2] = dq2[t1 : t1 + t2]
        dk[:t1] += dk2[:t1]
        dv[:t1] += dv2[:t1]
    dq[t1 + t2 :] = 0
    dk[t1:] = 0  # only valid tokens are keys
    dv[t1:] = 0
    inv = pk["inv"]
    return _unpack(dq, inv, b, n), _unpack(dk, inv, b, n), _unpack(dv, inv, b, n)


def _natural_fwd(q, k, v, pk: dict, lo, left, right, scale):
    """``packed_fwd`` on the tokens where they lie (``_natural_segments``): q, k, v of HF's token-major layout are
    taken as [T, heads, D] without a copy, and out comes back as a view; only pad rows are gathered or written:
    the right-pad queries and their groups' keys for call 2, its results, the rows with no key set to 0 (lse +inf)."""
    b, h, n, _ = q.shape
    nat = pk["natural"]
    qf, kf, vf = (_pack(x, None) for x in (q, k, v))
    (cq, ck), m1 = nat["cu1"], nat["max1"]
    out, lse = flash_fwd(qf, kf, vf, cq, ck, m1, m1, lo == 0, left, right, scale)
    if tuple(lse.shape) != (h, b * n):
        raise RuntimeError(f"flash varlen returned lse of shape {tuple(lse.shape)}, expected {(h, b * n)}")
    if nat["cu2"] is not None:
        right_rows = nat["right"]
        (cq, ck), (mq, mk) = nat["cu2"], nat["max2"]
        k2, v2 = kf.index_select(0, nat["keys2"]), vf.index_select(0, nat["keys2"])
        out2, lse2 = flash_fwd(qf.index_select(0, right_rows), k2, v2, cq, ck, mq, mk, False, -1, -1, scale)
        out.index_copy_(0, right_rows, out2)
        lse.index_copy_(1, right_rows, lse2)
    out.index_fill_(0, nat["none"], 0)
    lse.index_fill_(1, nat["none"], float("inf"))
    return _unpack(out, None, b, n), lse.view(h, b, n).transpose(0, 1).contiguous()


def _natural_bwd(grad_out, q, k, v, out, lse, pk: dict, lo, left, right, scale):
    b, h, n, _ = q.shape
    nat = pk["natural"]
    qf, kf, vf, of, gf = (_pack(x, None) for x in (q, k, v, out, grad_out))
    lse_f = lse.transpose(0, 1).reshape(h, b * n)
    (cq, ck), m1 = nat["cu1"], nat["max1"]
    dq, dk, dv = flash_bwd(gf, qf, kf, vf, of, lse_f, cq, ck, m1, m1, lo == 0, left, right, scale)
    if nat["cu2"] is not None:
        right_rows = nat["right"]
        (cq, ck), (mq, mk) = nat["cu2"], nat["max2"]
        g2, q2, o2 = (x.index_select(0, right_rows) for x in (gf, qf, of))
        lse2 = lse_f.index_select(1, right_rows)
        keys = nat["keys2"]
        dq2, dk2, dv2 = flash_bwd(
            g2, q2, kf.index_select(0, keys), vf.index_select(0, keys), o2, lse2, cq, ck, mq, mk, False, -1, -1, scale
        )
        dq.index_copy_(0, right_rows, dq2)
        dk.index_copy_(0, keys, dk.index_select(0, keys) + dk2)  # call 1's share plus call 2's
        dv.index_copy_(0, keys, dv.index_select(0, keys) + dv2)
    dq.index_fill_(0, nat["none"], 0)
    dk.index_fill_(0, nat["pads"], 0)  # only valid tokens are keys
    dv.index_fill_(0, nat["pads"], 0)
    return _unpack(dq, None, b, n), _unpack(dk, None, b, n), _unpack(dv, None, b, n)
