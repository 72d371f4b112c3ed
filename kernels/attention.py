"""Masked attention without an [N, N] mask: the mask is evaluated per query block from per-token tensors.

The mask family (what ``passes/attention_mask.py`` proves a graph's mask to be), for batch b, query i, key j:

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
- ``chunked_fwd`` / ``chunked_bwd``: plain PyTorch over query blocks, fp32 accumulation (fp64 for fp64 inputs);
  memory O(block · N). The CPU path, and the CUDA path for masks no flash kernel takes.
- ``varlen_plan`` + ``varlen_fwd`` / ``varlen_bwd`` (CUDA): packed documents, optionally with a window, through
  PyTorch's flash-attention varlen kernels (``aten::_flash_attention_forward``), at flash speed. Taken only when
  the data make it exact: batch 1 (or documents that never cross a row), each document contiguous, positions that
  advance by one inside a document when they define the causal order, no padding mask.
"""

from __future__ import annotations

import torch

# Bytes of fp32 scores one query block of the chunked path may hold (scores and probabilities: about 3x this).
CHUNK_BUDGET_BYTES = 64 * 2**20


def block_mask(
    qi: torch.Tensor,
    n_kv: int,
    pos: torch.Tensor | None,
    doc: torch.Tensor | None,
    valid: torch.Tensor | None,
    lo: int | None,
    hi: int | None,
) -> torch.Tensor | None:
    """The allowed mask of query rows ``qi`` against all keys: [B or 1, 1, len(qi), n_kv] bool (None: all allowed)."""
    mask = None

    def conj(m: torch.Tensor) -> None:
        nonlocal mask
        mask = m if mask is None else mask & m

    if lo is not None or hi is not None:
        if pos is not None:
            diff = pos[:, qi][:, :, None] - pos[:, None, :]
        else:
            kj = torch.arange(n_kv, device=qi.device)
            diff = (qi[:, None] - kj[None, :])[None]
        if lo is not None:
            conj(diff >= lo)
        if hi is not None:
            conj(diff <= hi)
    if doc is not None:
        conj(doc[:, qi][:, :, None] == doc[:, None, :])
    if valid is not None:
        conj(valid[:, None, :].bool())
    return None if mask is None else mask[:, None]


def _block_rows(b: int, h: int, n_kv: int) -> int:
    rows = CHUNK_BUDGET_BYTES // max(1, b * h * n_kv * 4)
    return int(max(16, min(rows, 4096)))


def _grouped(q: torch.Tensor, hkv: int) -> torch.Tensor:
    """[B, H, n, D] -> [B, Hkv, G, n, D] (query heads grouped by the key head they read)."""
    b, h, n, d = q.shape
    return q.reshape(b, hkv, h // hkv, n, d)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _block_scores(q, kc, start, step, ct, scale, mask_args):
    """Scores of query rows [start, start + step) against every key, [B, Hkv, G, rows, N] in ``ct``, the rows in
    ``ct`` grouped by key head, and the block's allowed mask [B or 1, 1, rows, N] (None: all allowed)."""
    n = q.shape[2]
    qi = torch.arange(start, min(start + step, n), device=q.device)
    qb = _grouped(q[:, :, start : start + step].to(ct), kc.shape[1])
    s = (qb @ kc.transpose(-1, -2)) * scale
    return s, qb, block_mask(qi, kc.shape[-2], *mask_args)


def chunked_fwd(q, k, v, pos, doc, valid, lo, hi, scale):
    """(out [B, H, N, Dv] in q's dtype, lse [B, H, N] in fp32, fp64 for fp64 inputs)."""
    b, h, n, _ = q.shape
    ct = _compute_dtype(q.dtype)
    kc, vc = k.to(ct)[:, :, None], v.to(ct)[:, :, None]  # [B, Hkv, 1, N, D]
    out = q.new_empty((b, h, n, v.shape[-1]))
    lse = torch.empty((b, h, n), dtype=ct, device=q.device)
    step = _block_rows(b, h, k.shape[2])
    for start in range(0, n, step):
        s, _, m = _block_scores(q, kc, start, step, ct, scale, (pos, doc, valid, lo, hi))
        if m is not None:
            s = s.masked_fill(~m[:, :, None], float("-inf"))
        row_max = s.amax(-1, keepdim=True)
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        p = torch.exp(s - row_max)
        denom = p.sum(-1, keepdim=True)
        o = (p @ vc) / torch.where(denom > 0, denom, torch.ones_like(denom))
        row_lse = torch.where(denom > 0, row_max + torch.log(denom), torch.full_like(denom, float("inf")))
        out[:, :, start : start + step] = o.reshape(b, h, -1, v.shape[-1]).to(q.dtype)
        lse[:, :, start : start + step] = row_lse.reshape(b, h, -1)
    return out, lse


def chunked_bwd(grad_out, q, k, v, out, lse, pos, doc, valid, lo, hi, scale):
    """(dq, dk, dv) in the inputs' dtypes; dk, dv summed over the query heads that share a key head."""
    b, h, n, _ = q.shape
    hkv, n_kv = k.shape[1], k.shape[2]
    ct = _compute_dtype(q.dtype)
    kc, vc = k.to(ct)[:, :, None], v.to(ct)[:, :, None]
    dq = q.new_empty(q.shape)
    dk = torch.zeros((b, hkv, h // hkv, n_kv, k.shape[-1]), dtype=ct, device=q.device)
    dv = torch.zeros((b, hkv, h // hkv, n_kv, v.shape[-1]), dtype=ct, device=q.device)
    step = _block_rows(b, h, n_kv)
    for start in range(0, n, step):
        sl = slice(start, start + step)
        s, qb, m = _block_scores(q, kc, start, step, ct, scale, (pos, doc, valid, lo, hi))
        dob = _grouped(grad_out[:, :, sl].to(ct), hkv)
        ob = _grouped(out[:, :, sl].to(ct), hkv)
        lb = lse[:, :, sl].reshape(b, hkv, h // hkv, -1, 1).to(ct)
        p = torch.exp(s - lb)  # lse = +inf on fully masked rows: p = 0 there
        if m is not None:
            p = p.masked_fill(~m[:, :, None], 0.0)
        dv += p.transpose(-1, -2) @ dob
        dp = dob @ vc.transpose(-1, -2)
        delta = (dob * ob).sum(-1, keepdim=True)
        ds = p * (dp - delta)
        dq[:, :, sl] = ((ds @ kc) * scale).reshape(b, h, -1, q.shape[-1]).to(q.dtype)
        dk += (ds.transpose(-1, -2) @ qb) * scale
    return dq, dk.sum(2).to(k.dtype), dv.sum(2).to(v.dtype)


def reference(q, k, v, pos, doc, valid, lo, hi, scale):
    """The same math with the whole [N, N] mask, through SDPA: what the tests compare against."""
    n = q.shape[2]
    m = block_mask(torch.arange(n, device=q.device), k.shape[2], pos, doc, valid, lo, hi)
    hkv = k.shape[1]
    rep = q.shape[1] // hkv
    kk, vv = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return torch.nn.functional.scaled_dot_product_attention(q, kk, vv, attn_mask=m, scale=scale)


# ----------------------------------------------------------------------------------------- CUDA: varlen flash


def varlen_plan(q, k, pos, doc, valid, lo, hi):
    """(cumulative document lengths [docs + 1] int32, longest document) when the flash varlen kernel computes this
    mask exactly, else None. Two host syncs: the number of documents, then the data checks and the longest."""
    b, _, n, _ = q.shape
    if not q.is_cuda or valid is not None or k.shape[2] != n or q.dtype not in (torch.float16, torch.bfloat16):
        return None
    if q.shape[-1] % 8 or q.shape[-1] > 256 or lo not in (0, None) or (hi is not None and lo is None):
        return None
    if hi is not None and hi < 0:
        return None
    # Document ids over the flattened [B * N] tokens: a new document starts where doc changes, and at each row.
    d = doc.expand(b, n) if doc is not None else torch.zeros((b, n), dtype=torch.long, device=q.device)
    starts = torch.ones((b, n), dtype=torch.bool, device=q.device)
    starts[:, 1:] = d[:, 1:] != d[:, :-1]
    flat = starts.reshape(-1)
    # Exactness checks, read back with the document count: a document id that comes back after another one
    # (not contiguous), and positions that do not advance by one inside a document.
    seen_again = torch.zeros((), dtype=torch.bool, device=q.device)
    if doc is not None:
        first = torch.cummax(d, dim=1).values
        seen_again = (d != first).any() if n > 1 else seen_again
        # non-decreasing ids are contiguous; otherwise fall back (ids could repeat further on)
    bad_pos = torch.zeros((), dtype=torch.bool, device=q.device)
    if pos is not None and lo is not None:
        p = pos.expand(b, n)
        step_ok = (p[:, 1:] - p[:, :-1] == 1) | starts[:, 1:]
        bad_pos = ~step_ok.all()
    idx = flat.nonzero().squeeze(1).to(torch.int32)  # a host sync: the number of documents
    cu = torch.cat([idx, torch.full((1,), b * n, dtype=torch.int32, device=q.device)])
    longest = (cu[1:] - cu[:-1]).max()
    seen_again, bad_pos, longest = torch.stack([seen_again.long(), bad_pos.long(), longest.long()]).tolist()
    if seen_again or bad_pos:
        return None
    return cu, int(longest)


def _windows(lo, hi):
    left = -1 if hi is None else int(hi)  # keys at most `hi` positions back
    right = 0 if lo == 0 else -1
    return left, right


def varlen_fwd(q, k, v, plan, lo, hi, scale):
    """(out [B, H, N, D], lse [B, H, N] fp32) through the flash varlen kernel over documents ``cu``."""
    b, h, n, d = q.shape
    cu, longest = plan
    qf, kf, vf = (t.transpose(1, 2).reshape(b * n, t.shape[1], d) for t in (q, k, v))
    left, right = _windows(lo, hi)
    res = torch.ops.aten._flash_attention_forward(
        qf,
        kf,
        vf,
        cu,
        cu,
        longest,
        longest,
        0.0,
        lo == 0,
        False,
        scale=scale,
        window_size_left=left,
        window_size_right=right,
    )
    out, lse = res[0], res[1]
    if tuple(lse.shape) != (h, b * n):
        raise RuntimeError(f"flash varlen returned lse of shape {tuple(lse.shape)}, expected {(h, b * n)}")
    return out.reshape(b, n, h, d).transpose(1, 2).contiguous(), lse.reshape(h, b, n).transpose(0, 1).contiguous()


def varlen_bwd(grad_out, q, k, v, out, lse, plan, lo, hi, scale):
    b, h, n, d = q.shape
    qf, kf, vf, of, gf = (
        t.transpose(1, 2).reshape(b * n, t.shape[1], d).contiguous() for t in (q, k, v, out, grad_out)
    )
    cu, longest = plan
    lse_f = lse.transpose(0, 1).reshape(h, b * n).contiguous()
    left, right = _windows(lo, hi)
    unused = torch.zeros((), dtype=torch.int64, device=q.device)  # philox seed/offset: no dropout
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        gf, qf, kf, vf, of, lse_f, cu, cu, longest, longest, 0.0, lo == 0, unused, unused,
        scale=scale, window_size_left=left, window_size_right=right,
    )  # fmt: skip

    def back(t, heads):
        return t.reshape(b, n, heads, d).transpose(1, 2).contiguous()

    return back(dq, h), back(dk, k.shape[1]), back(dv, v.shape[1])
