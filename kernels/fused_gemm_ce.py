"""The log-prob forward as one Triton GEMM with the softmax statistics in its epilogue: z never reaches memory.

Each program computes one [BM, BN] tile of z = h·Wᵀ·(1/t) (fp32 accumulation over D) and reduces it at once to
per-row partial statistics of that vocabulary tile: max m, Σe = Σ exp(x − m), Σe·(x − m), and the label's logit
when the label falls in the tile. The partials ([rows, vocabulary tiles], fp32) are merged in PyTorch:
with M = max over tiles, S = Σ_t e^{m_t − M} Σe_t, A = Σ_t e^{m_t − M} (Σe·(x − m)_t + (m_t − M) Σe_t),
lse = M + log S and H = log S − A / S. Rows are processed in blocks so the partials stay under a byte budget.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

PARTIAL_BUDGET_BYTES = 64 * 2**20

# (BM, BN, BK, GROUP_M, num_warps, num_stages)
CONFIG = (128, 256, 64, 8, 8, 3)

if HAS_TRITON:

    @triton.jit
    def _gemm_stats_kernel(
        h_ptr,
        w_ptr,
        labels_ptr,
        pm_ptr,
        ps_ptr,
        pa_ptr,
        zy_ptr,
        n_rows,
        vocab,
        dim,
        stride_h,
        stride_w,
        n_vtiles,
        inv_t,
        HAS_ENTROPY: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        GROUP_M: tl.constexpr,
    ):
        pid = tl.program_id(0)
        num_m = tl.cdiv(n_rows, BM)
        # grouped order: GROUP_M row tiles walk the vocabulary together, so each W tile is read from L2 by them
        in_group = GROUP_M * n_vtiles
        first_m = (pid // in_group) * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % in_group) % size_m
        pid_n = (pid % in_group) // size_m
        rows = pid_m * BM + tl.arange(0, BM)
        cols = pid_n * BN + tl.arange(0, BN)
        ks = tl.arange(0, BK)
        row_ok = rows < n_rows
        col_ok = cols < vocab
        a_ptrs = h_ptr + rows[:, None].to(tl.int64) * stride_h + ks[None, :]
        b_ptrs = w_ptr + cols[None, :].to(tl.int64) * stride_w + ks[:, None]
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, dim, BK):
            a = tl.load(a_ptrs, mask=row_ok[:, None] & (ks[None, :] < dim - k0), other=0.0)
            b = tl.load(b_ptrs, mask=col_ok[None, :] & (ks[:, None] < dim - k0), other=0.0)
            acc = tl.dot(a, b, acc)
            a_ptrs += BK
            b_ptrs += BK
        x = tl.where(col_ok[None, :], acc * inv_t, float("-inf"))
        m = tl.max(x, axis=1)
        e = tl.exp(x - m[:, None])
        s = tl.sum(e, axis=1)
        out = rows.to(tl.int64) * n_vtiles + pid_n
        tl.store(pm_ptr + out, m, mask=row_ok)
        tl.store(ps_ptr + out, s, mask=row_ok)
        if HAS_ENTROPY:
            a_sum = tl.sum(tl.where(e > 0.0, e * (x - m[:, None]), 0.0), axis=1)
            tl.store(pa_ptr + out, a_sum, mask=row_ok)
        labels = tl.load(labels_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
        hit = labels[:, None] == cols[None, :]
        zy = tl.sum(tl.where(hit, x, 0.0), axis=1)
        has = tl.max(hit.to(tl.int32), axis=1) > 0
        tl.store(zy_ptr + rows, zy, mask=row_ok & has)


def logprob_fwd(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    inv_t: float,
    ignore_index: int,
    with_entropy: bool,
    config: tuple = CONFIG,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """h [N, D], weight [V, D] (same dtype, last dim contiguous), labels [N] -> (logp, entropy or None, lse), fp32."""
    bm, bn, bk, group_m, warps, stages = config
    n, d = h.shape
    v = weight.shape[0]
    dev = h.device
    n_vtiles = triton.cdiv(v, bn)
    logp = torch.empty(n, device=dev, dtype=torch.float32)
    lse = torch.empty(n, device=dev, dtype=torch.float32)
    ent = torch.empty(n, device=dev, dtype=torch.float32) if with_entropy else None
    zy = torch.zeros(n, device=dev, dtype=torch.float32)
    # rows per launch: a multiple of BM whose three partial arrays fit the budget
    per_row = 3 * 4 * n_vtiles
    block = max(bm, PARTIAL_BUDGET_BYTES // per_row // bm * bm)
    pm = torch.empty(min(n, block) * n_vtiles, device=dev, dtype=torch.float32)
    ps, pa = torch.empty_like(pm), torch.empty_like(pm)
    for r0 in range(0, n, block):
        r1 = min(n, r0 + block)
        rows = r1 - r0
        grid = (triton.cdiv(rows, bm) * n_vtiles,)
        _gemm_stats_kernel[grid](
            h[r0:r1], weight, labels[r0:r1], pm, ps, pa, zy[r0:r1], rows, v, d, h.stride(0), weight.stride(0),
            n_vtiles, inv_t, HAS_ENTROPY=with_entropy, BM=bm, BN=bn, BK=bk, GROUP_M=group_m, num_warps=warps,
            num_stages=stages,
        )  # fmt: skip
        m_t = pm[: rows * n_vtiles].view(rows, n_vtiles)
        s_t = ps[: rows * n_vtiles].view(rows, n_vtiles)
        big_m = m_t.amax(dim=1, keepdim=True)
        scale = torch.exp(m_t - big_m)
        big_s = (s_t * scale).sum(dim=1)
        log_s = torch.log(big_s)
        lse[r0:r1] = big_m.squeeze(1) + log_s
        if with_entropy:
            a_t = pa[: rows * n_vtiles].view(rows, n_vtiles)
            big_a = ((a_t + (m_t - big_m) * s_t) * scale).sum(dim=1)
            ent[r0:r1] = log_s - big_a / big_s
    active = labels != ignore_index
    logp.copy_(torch.where(active, zy - lse, 0.0))
    return logp, ent, lse
