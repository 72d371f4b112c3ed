"""The plain-PyTorch implementation of ``kernels/attention.py``'s masked attention (its module docstring has the
math): ``chunked_fwd`` / ``chunked_bwd`` over query blocks with fp32 accumulation (fp64 for fp64 inputs), memory
O(block · N), the CPU path and the CUDA path for masks no flash kernel takes; ``block_mask`` evaluates the mask
family on a block of queries; ``reference`` is the same math with the whole [N, N] mask through SDPA, what the
tests compare against.
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


def token_major(like: torch.Tensor, b: int, heads: int, n: int, d: int) -> torch.Tensor:
    """An empty [B, heads, N, D] tensor stored token-major ([B, N, heads, D] memory), the layout attention's
    neighbours use (HF's ``view(B, N, heads, D).transpose(1, 2)`` and back): every path returns out and the grads
    so, and the fake kernels say so, so no layer copies them into another layout."""
    return like.new_empty((b, n, heads, d)).transpose(1, 2)


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
    out = token_major(q, b, h, n, v.shape[-1])
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
    dq = token_major(q, b, h, n, q.shape[-1])
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
    dk_out, dv_out = token_major(k, b, hkv, n_kv, k.shape[-1]), token_major(v, b, hkv, n_kv, v.shape[-1])
    return dq, dk_out.copy_(dk.sum(2)), dv_out.copy_(dv.sum(2))


def reference(q, k, v, pos, doc, valid, lo, hi, scale):
    """The same math with the whole [N, N] mask, through SDPA: what the tests compare against."""
    n = q.shape[2]
    m = block_mask(torch.arange(n, device=q.device), k.shape[2], pos, doc, valid, lo, hi)
    hkv = k.shape[1]
    rep = q.shape[1] // hkv
    kk, vv = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return torch.nn.functional.scaled_dot_product_attention(q, kk, vv, attn_mask=m, scale=scale)
