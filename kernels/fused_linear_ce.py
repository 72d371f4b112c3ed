"""Fused linear log-prob + entropy: cuBLAS GEMMs over vocabulary chunks with Triton epilogues.

Math (h [N, D], W [V, D], labels y [N], temperature t):
    z = h·Wᵀ / t,  lse = logsumexp(z),  logp = z_y − lse,  H = lse − Σ_j p_j z_j   (p = softmax(z))
    dz_j = [g_lp (1[j=y] − p_j) − g_H p_j (log p_j + H)] / t,   dh = dz·W,   dW = dzᵀ·h
Options (each a ``HAS_*`` / flag of the kernels, off by default): a bias b [V] and a final-logit softcap c,
    z = softcap(h·Wᵀ + b) / t,  softcap(u) = c·tanh(u / c),  ∂z/∂u = (1 − tanh²(u / c)) / t,
and per-row extras of the same pass over the vocabulary: Σ_j z_j (label smoothing's mean log-prob is
Σ_j z_j / V − lse) and argmax_j z_j (token accuracy; the first index of the largest logit). lse is an output of the
op too (z-loss): its gradient adds g_lse·p_j to dz_j, and Σ_j z_j's adds g_Σ. The bias's gradient is Σ_rows dz.
Saved for backward: h, W, labels, stats [N, 2] = (m, log Σ_j e^{z_j − m}) with m the row max (so lse = m + log Σe),
and H [N], all fp32. log p_j is formed as (z_j − m) − log Σe, never as z_j − lse: for the largest logits z_j − lse
is a small difference of two numbers near lse and loses their absolute rounding (~ulp(lse)), which is the whole of
log p_j when the distribution is peaked; eager's log_softmax subtracts the max first in the same way.
No [N, V] tensor is ever allocated.

Forward, for each vocabulary chunk W_c (C rows): z_c = h @ W_cᵀ (one GEMM, fp32 accumulation, written in the GEMM
dtype), then ``_fused_linear_ce_fwd_kernel`` folds z_c into per-row online statistics (max m, Σe = Σ exp(x − m),
Σe·(x − m)) and picks up the target logit when the label falls in this chunk.
Backward, for each chunk: recompute z_c, ``_fused_linear_ce_bwd_kernel`` turns it into dz_c in place, then
dW_c = dz_cᵀ @ h (one GEMM, complete for that chunk, fp32 accumulation inside cuBLAS) and
dh_acc (fp32) += dz_c @ W_c; dh_acc is the only sum across chunks, kept in fp32 and cast once at the end.
Workspace: one [N, C] chunk plus the fp32 dh accumulator; C comes from ``chunk_size``.

``torch_fwd_epilogue`` / ``torch_bwd_epilogue`` (``kernels/fused_linear_ce_reference.py``, beside this module) are
the same epilogues in plain PyTorch (the CPU path), and ``reference_logprob_entropy`` there is the unfused formula
(tests and benchmarks only: it builds [N, V]).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from tilecompile.kernels.fused_linear_ce_reference import (  # noqa: F401 - the reference, re-exported
    reference_logprob_entropy,
    torch_bwd_epilogue,
    torch_fwd_epilogue,
)

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only installs without Triton use the PyTorch epilogues
    HAS_TRITON = False

# Bytes one [N, C] chunk of logits may take before C is cut (automatic chunking). The backward gets more: each
# chunk's dh GEMM reads and writes the fp32 [N, D] accumulator, so fewer chunks save that traffic.
FWD_CHUNK_BUDGET_BYTES = 128 * 2**20
BWD_CHUNK_BUDGET_BYTES = 256 * 2**20
_MIN_CHUNK = 256
_MAX_CHUNK = 32768

if HAS_TRITON:

    @triton.jit
    def _online_update(x, m, s, a):
        """Fold one tile x (fp32, masked entries -inf) into the running (max m, Σe, Σe·(x - m)) of a row."""
        m_new = tl.maximum(m, tl.max(x, axis=0))
        # A row that has seen nothing yet keeps m = -inf; shift by 0 instead (avoids -inf - -inf = nan).
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_ref)
        shift = tl.where(m == float("-inf"), 0.0, m - m_ref)
        # Σe·(x - m) is kept relative to the running max, so rescaling it needs the shift times Σe.
        a = alpha * (a + shift * s)
        s = alpha * s
        e = tl.exp(x - m_ref)
        s += tl.sum(e, axis=0)
        a += tl.sum(tl.where(e > 0.0, e * (x - m_ref), 0.0), axis=0)
        return m_new, s, a

    @triton.jit
    def _logits(z, cols, mask, bias_ptr, softcap, inv_t, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
        """(x, tanh) for a tile of GEMM output z: x = softcap(z + b) / t in fp32 (-inf where masked), and the
        softcap's tanh (for its derivative; 0 without a softcap)."""
        u = z.to(tl.float32)
        if HAS_BIAS:
            u += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            # tanh through exp (the interpreter has no libdevice): exp overflows to inf, and 2 / inf = 0, at the ends
            th = 1.0 - 2.0 / (tl.exp(2.0 * (u / softcap)) + 1.0)
            u = softcap * th
        else:
            th = u * 0.0
        return tl.where(mask, u * inv_t, float("-inf")), th

    @triton.jit
    def _fused_linear_ce_fwd_kernel(
        z_ptr,
        labels_ptr,
        m_ptr,
        s_ptr,
        a_ptr,
        zy_ptr,
        logp_ptr,
        ent_ptr,
        stats_ptr,
        bias_ptr,
        zsum_ptr,
        amax_ptr,
        n_rows,
        n_cols,
        v_start,
        stride_zn,
        inv_t,
        softcap,
        ignore_index,
        HAS_ENTROPY: tl.constexpr,
        IS_LAST: tl.constexpr,
        SINGLE_TILE: tl.constexpr,
        BLOCK_C: tl.constexpr,
        NUM_STAGES: tl.constexpr,
        HAS_BIAS: tl.constexpr = False,
        HAS_SOFTCAP: tl.constexpr = False,
        HAS_ZSUM: tl.constexpr = False,
        HAS_ARGMAX: tl.constexpr = False,
        ALL_ROWS: tl.constexpr = False,
    ):
        # Persistent over rows, the row loop software-pipelined so the next row's load can be in flight while
        # this row is reduced.
        offs = tl.arange(0, BLOCK_C)
        for row_i in tl.range(tl.program_id(0), n_rows, tl.num_programs(0), num_stages=NUM_STAGES):
            row = tl.cast(row_i, tl.int64)
            label = tl.load(labels_ptr + row).to(tl.int64)
            active = label != ignore_index
            # Without entropy (or another per-row output) an ignored row needs nothing: all its loads are masked
            # off (no traffic, no sync).
            if HAS_ENTROPY or ALL_ROWS:
                row_on = label == label
            else:
                row_on = active
            n_load = tl.where(row_on, n_cols, 0)
            m = tl.load(m_ptr + row)
            s = tl.load(s_ptr + row)
            a = tl.load(a_ptr + row)
            if HAS_ZSUM:
                zs = tl.load(zsum_ptr + row)
            if HAS_ARGMAX:
                best = tl.load(amax_ptr + row)
            z_row = z_ptr + row * stride_zn
            # The vocabulary tail is masked to -inf so it adds exp(-inf) = 0 to every sum.
            for c0 in range(0, n_cols, BLOCK_C):
                cols = c0 + offs
                mask = cols < n_load
                z = tl.load(z_row + cols, mask=mask, other=0.0)
                x, _th = _logits(z, v_start + cols, mask, bias_ptr, softcap, inv_t, HAS_BIAS, HAS_SOFTCAP)
                if HAS_ARGMAX:
                    # strictly greater than the running max: the first index of the largest logit, as torch.argmax
                    # (a NaN logit is not followed as torch's argmax follows it: the CPU path does)
                    tile_max = tl.max(x, axis=0)
                    tile_arg = tl.argmax(x, axis=0)
                    best = tl.where(tile_max > m, (v_start + c0 + tile_arg).to(tl.int64), best)
                if HAS_ZSUM:
                    zs += tl.sum(tl.where(mask, x, 0.0), axis=0)
                m, s, a = _online_update(x, m, s, a)
            if HAS_ZSUM:
                tl.store(zsum_ptr + row, zs)
            if HAS_ARGMAX:
                tl.store(amax_ptr + row, best)
            y_local = label - v_start
            hit = active & (y_local >= 0) & (y_local < n_cols)
            zy_raw = tl.load(z_row + y_local, mask=hit, other=0.0)
            zy_new, _thy = _logits(zy_raw, label, hit, bias_ptr, softcap, inv_t, HAS_BIAS, HAS_SOFTCAP)
            zy = tl.where(hit, zy_new, tl.load(zy_ptr + row))
            if IS_LAST:
                log_s = tl.log(s)
                tl.store(logp_ptr + row, tl.where(active, (zy - m) - log_s, 0.0))
                tl.store(stats_ptr + 2 * row, tl.where(row_on, m, 0.0))
                tl.store(stats_ptr + 2 * row + 1, tl.where(row_on, log_s, 0.0))
                if HAS_ENTROPY:
                    # H = lse - Σ p·x = log Σe - Σe·(x - m) / Σe
                    tl.store(ent_ptr + row, log_s - a / s)
            else:
                tl.store(m_ptr + row, m)
                tl.store(s_ptr + row, s)
                tl.store(a_ptr + row, a)
                tl.store(zy_ptr + row, zy)

    @triton.jit
    def _fused_linear_ce_bwd_kernel(
        z_ptr,
        labels_ptr,
        stats_ptr,
        ent_ptr,
        glp_ptr,
        gent_ptr,
        bias_ptr,
        glse_ptr,
        gzs_ptr,
        n_cols,
        cols_per_prog,
        v_start,
        stride_zn,
        inv_t,
        softcap,
        ignore_index,
        HAS_GLP: tl.constexpr,
        HAS_GENT: tl.constexpr,
        BLOCK_C: tl.constexpr,
        HAS_BIAS: tl.constexpr = False,
        HAS_SOFTCAP: tl.constexpr = False,
        HAS_GLSE: tl.constexpr = False,
        HAS_GZS: tl.constexpr = False,
    ):
        # One program per (row, column range of cols_per_prog): a block of few long rows is split across more
        # programs than rows, so the grid fills the GPU evenly.
        row = tl.program_id(0).to(tl.int64)
        c_lo = tl.program_id(1) * cols_per_prog
        c_hi = tl.minimum(c_lo + cols_per_prog, n_cols)
        label = tl.load(labels_ptr + row).to(tl.int64)
        active = label != ignore_index
        m = tl.load(stats_ptr + 2 * row)
        log_s = tl.load(stats_ptr + 2 * row + 1)
        # Ignored rows get no gradient through logp (logp is the constant 0 there).
        if HAS_GLP:
            glp = tl.where(active, tl.load(glp_ptr + row), 0.0)
        else:
            glp = 0.0
        if HAS_GENT:
            gent = tl.load(gent_ptr + row)
            ent = tl.load(ent_ptr + row)
        else:
            gent = 0.0
            ent = 0.0
        glse = tl.load(glse_ptr + row) if HAS_GLSE else 0.0
        gzs = tl.load(gzs_ptr + row) if HAS_GZS else 0.0
        if HAS_GENT or HAS_GLSE or HAS_GZS:
            row_on = label == label
        elif HAS_GLP:
            row_on = active
        else:
            row_on = label != label
        y_local = label - v_start
        z_row = z_ptr + row * stride_zn
        offs = tl.arange(0, BLOCK_C)
        n_load = tl.where(row_on, n_cols, 0)
        for c0 in range(c_lo, c_hi, BLOCK_C):
            cols = c0 + offs
            cmask = cols < c_hi
            lmask = cmask & (cols < n_load)
            z = tl.load(z_row + cols, mask=lmask, other=0.0)
            x, th = _logits(z, v_start + cols, lmask, bias_ptr, softcap, inv_t, HAS_BIAS, HAS_SOFTCAP)
            log_p = (x - m) - log_s
            p = tl.exp(log_p)
            dz = tl.where(cols == y_local, glp, 0.0) - glp * p
            if HAS_GENT:
                # p = 0 where x = -inf: keep 0 * -inf out of the sum.
                dz -= gent * tl.where(p > 0.0, p * (log_p + ent), 0.0)
            if HAS_GLSE:
                dz += glse * p
            if HAS_GZS:
                dz += gzs
            dz = dz * inv_t
            if HAS_SOFTCAP:
                dz = dz * (1.0 - th * th)
            dz = tl.where(row_on & lmask, dz, 0.0)
            # The chunk buffer is rewritten in place: z_c becomes dz_c, in the GEMM dtype.
            tl.store(z_row + cols, dz.to(z_ptr.dtype.element_ty), mask=cmask)


def _block_c(n_cols: int, cap: int) -> int:
    return max(16, min(cap, 1 << (max(n_cols, 1) - 1).bit_length()))


# Launch settings of the forward epilogue, which reduces each row of a chunk (max, Σe, Σe·x): tiles of up to
# ``cap`` columns, ``warps`` warps a program, ``grid_per_sm`` programs per multiprocessor looping over the rows
# (software-pipelined ``stages`` deep). Many small programs over moderate tiles keep enough loads in flight to
# stream a chunk's logits; one program per whole row does not (the sweeps: benchmarks/RESULTS.md, "The sweeps
# behind the kernels' settings").
_FWD_LAUNCH = {"cap": 2048, "warps": 4, "grid_per_sm": 16, "stages": 1}
# The loss-aware mode's blocks hold whole-vocabulary rows (e.g. [1536, 151936]): wide tiles and more warps a program,
# fewer programs, since each row is long.
_ROW_LAUNCH = {"cap": 16384, "warps": 16, "grid_per_sm": 8, "stages": 1}
# Their backward epilogue splits each row into column ranges, so a block of few long rows still fills every SM.
_ROW_BWD_LAUNCH = {"cap": 1024, "cols_per_prog": 16384}
# The backward epilogue is elementwise per row (no reductions), so a modest tile streams at full bandwidth; a
# chunk's many short rows take one program each (cols_per_prog 0: the whole row).
_BWD_LAUNCH = {"cap": 2048, "cols_per_prog": 0}


_SMS: dict = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs, each looping over rows
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _SMS:
        _SMS[key] = torch.cuda.get_device_properties(key).multi_processor_count
    return _SMS[key]


def _triton_fwd_epilogue(
    z, labels, state, logp, ent, stats, v_start, inv_t, ignore_index, with_entropy, is_last, launch=None, *,
    bias=None, softcap=0.0, zsum=None, argmax=None, all_rows=False,
):  # fmt: skip
    m, s, a, zy = state
    n = z.shape[0]
    if n == 0:
        return
    cfg = _FWD_LAUNCH if launch is None else launch
    block = _block_c(z.shape[1], cfg["cap"])
    grid = min(n, _num_sms(z.device) * cfg["grid_per_sm"])
    _fused_linear_ce_fwd_kernel[(grid,)](
        z, labels, m, s, a, zy, logp, ent if ent is not None else logp, stats,
        bias if bias is not None else logp, zsum if zsum is not None else logp,
        argmax if argmax is not None else labels,
        n, z.shape[1], v_start, z.stride(0), inv_t, float(softcap or 1.0), ignore_index,
        HAS_ENTROPY=with_entropy, IS_LAST=is_last, SINGLE_TILE=z.shape[1] <= block, BLOCK_C=block,
        NUM_STAGES=cfg["stages"], HAS_BIAS=bias is not None, HAS_SOFTCAP=bool(softcap), HAS_ZSUM=zsum is not None,
        HAS_ARGMAX=argmax is not None, ALL_ROWS=all_rows, num_warps=cfg["warps"],
    )  # fmt: skip


def _triton_bwd_epilogue(
    z, labels, stats, ent, glp, gent, v_start, inv_t, ignore_index, launch=None, *, bias=None, softcap=0.0,
    glse=None, gzs=None,
):  # fmt: skip
    n = z.shape[0]
    if n == 0:
        return
    cfg = _BWD_LAUNCH if launch is None else launch
    block = _block_c(z.shape[1], cfg["cap"])
    per_prog = max(z.shape[1], 1) if cfg["cols_per_prog"] <= 0 else max(block, cfg["cols_per_prog"] // block * block)
    grid = (n, triton.cdiv(max(z.shape[1], 1), per_prog))  # at least one program per row
    _fused_linear_ce_bwd_kernel[grid](
        z, labels, stats, ent if ent is not None else stats, glp if glp is not None else stats,
        gent if gent is not None else stats, bias if bias is not None else stats,
        glse if glse is not None else stats, gzs if gzs is not None else stats,
        z.shape[1], per_prog, v_start, z.stride(0), inv_t, float(softcap or 1.0), ignore_index,
        HAS_GLP=glp is not None, HAS_GENT=gent is not None, BLOCK_C=block, HAS_BIAS=bias is not None,
        HAS_SOFTCAP=bool(softcap), HAS_GLSE=glse is not None, HAS_GZS=gzs is not None,
        num_warps=8 if block >= 2048 else 4,
    )  # fmt: skip


def chunk_size(
    n_rows: int, vocab: int, elem_bytes: int, requested: int = 0, budget: int = FWD_CHUNK_BUDGET_BYTES
) -> int:
    """Vocabulary columns per chunk: ``requested`` if > 0, else what keeps one [N, C] chunk within ``budget``."""
    if requested > 0:
        return max(1, min(requested, vocab))
    c = budget // max(1, n_rows * elem_bytes)
    c = max(_MIN_CHUNK, min(_MAX_CHUNK, c // _MIN_CHUNK * _MIN_CHUNK))
    return max(1, min(c, vocab))


def _use_triton(t: torch.Tensor, use_triton: bool | None) -> bool:
    if use_triton is None:
        return HAS_TRITON and t.is_cuda
    if use_triton and not HAS_TRITON:
        raise RuntimeError("use_triton=True but Triton is not installed")
    return use_triton


def _gemm_dtype(h: torch.Tensor, gemm_dtype: torch.dtype | None) -> torch.dtype:
    # On CPU, reduced-precision GEMMs are slow and round the logits; fp32 there is both faster and exact-er.
    if gemm_dtype is not None:
        return gemm_dtype
    return h.dtype if h.is_cuda else torch.float32


def _chunk_logits(
    hg: torch.Tensor, weight: torch.Tensor, v0: int, c: int, buf: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_c, z_c): the chunk W[v0 : v0 + c] in ``hg``'s (the GEMM's) dtype and z_c = hg @ W_cᵀ, written into the
    flat chunk buffer ``buf`` (z_c is a view of it)."""
    n = hg.shape[0]
    w_c = weight[v0 : v0 + c]
    if w_c.dtype != hg.dtype:
        w_c = w_c.to(hg.dtype)
    z = buf[: n * w_c.shape[0]].view(n, w_c.shape[0])
    torch.mm(hg, w_c.t(), out=z)
    return w_c, z


class Extras(NamedTuple):
    """Per-row outputs of the forward besides logp, entropy and stats: Σ_j z_j (fp32) and argmax_j z_j (int64)."""

    zsum: torch.Tensor | None
    argmax: torch.Tensor | None


def fused_linear_logprob_fwd(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    inv_t: float,
    ignore_index: int,
    with_entropy: bool,
    *,
    chunk: int = 0,
    use_triton: bool | None = None,
    gemm_dtype: torch.dtype | None = None,
    bias: torch.Tensor | None = None,
    softcap: float = 0.0,
    all_rows: bool = False,
    with_zsum: bool = False,
    with_argmax: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, Extras]:
    """Forward over vocabulary chunks. h [N, D], weight [V, D], labels [N] -> (logp, entropy or None, stats,
    extras), fp32; stats [N, 2] = (row max m, log Σe) of z, so lse = m + log Σe (both 0 at rows that never needed
    them). ``bias`` [V] and ``softcap`` (> 0; 0 is none) as in the module docstring. ``Extras``: Σz and argmax when
    asked for (None otherwise). ``all_rows``: stats of every row, ignored or not (what lse as an output needs); Σz
    and argmax imply it.

    No checks here (the op layer validates); labels outside [0, V) that are not ignore_index give a wrong logp
    but never an out-of-bounds access.
    """
    all_rows = all_rows or with_zsum or with_argmax
    n, v = h.shape[0], weight.shape[0]
    dev = h.device
    gdt = _gemm_dtype(h, gemm_dtype)
    triton_path = _use_triton(h, use_triton)
    epilogue = _triton_fwd_epilogue if triton_path else torch_fwd_epilogue
    hg = h if h.dtype == gdt else h.to(gdt)
    c = chunk_size(n, v, torch.finfo(gdt).bits // 8, chunk, FWD_CHUNK_BUDGET_BYTES)
    logp = torch.empty(n, device=dev, dtype=torch.float32)
    stats = torch.empty(n, 2, device=dev, dtype=torch.float32)
    ent = torch.empty(n, device=dev, dtype=torch.float32) if with_entropy else None
    state = (
        torch.full((n,), float("-inf"), device=dev, dtype=torch.float32),
        torch.zeros(n, device=dev, dtype=torch.float32),
        torch.zeros(n, device=dev, dtype=torch.float32),
        torch.zeros(n, device=dev, dtype=torch.float32),
    )
    scalar_t = float(inv_t)
    zsum = torch.zeros(n, device=dev, dtype=torch.float32) if with_zsum else None
    amax = torch.zeros(n, device=dev, dtype=torch.int64) if with_argmax else None
    # One chunk buffer for the whole loop: each chunk's logits land in it and (backward) become dz in place.
    buf = torch.empty(n * c, dtype=gdt, device=dev)
    z = None
    for v0 in range(0, v, c):
        w_c, z = _chunk_logits(hg, weight, v0, c, buf)
        epilogue(z, labels, state, logp, ent, stats, v0, scalar_t, ignore_index, with_entropy, v0 + c >= v,
                 bias=bias, softcap=softcap, zsum=zsum, argmax=amax, all_rows=all_rows)  # fmt: skip
    del buf, z  # z is a view of buf: both must go before the caller allocates more
    if v == 0:  # an empty vocabulary: logsumexp of nothing is -inf
        stats[:, 0].fill_(float("-inf"))
        stats[:, 1].fill_(0.0)
        logp.fill_(float("nan"))
        if ent is not None:
            ent.fill_(float("nan"))
    return logp, ent, stats, Extras(zsum, amax)


_FP32_ADDMM: bool | None = None


def _addmm_fp32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc (fp32) += a @ b with fp32 accumulation, for a/b in fp32, fp16 or bf16."""
    global _FP32_ADDMM
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
        return
    if _FP32_ADDMM is None:
        _FP32_ADDMM = a.is_cuda and _probe_fp32_addmm(a.device, a.dtype)
    if _FP32_ADDMM and a.is_cuda:
        # cuBLAS reads acc as C (beta = 1) and writes fp32: no rounding of the partial product to bf16.
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.add_(torch.mm(a, b))


def _probe_fp32_addmm(device: torch.device, dtype: torch.dtype) -> bool:
    try:
        a = torch.ones(16, 16, device=device, dtype=dtype)
        acc = torch.ones(16, 16, device=device, dtype=torch.float32)
        torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
        return bool(acc[0, 0].item() == 17.0)
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def probe() -> bool:
    """Settle the one-time capability probe (the op does it on first use; call it before CUDA graph capture)."""
    global _FP32_ADDMM
    if _FP32_ADDMM is None and torch.cuda.is_available():
        _FP32_ADDMM = _probe_fp32_addmm(torch.device("cuda"), torch.bfloat16)
    return bool(_FP32_ADDMM)


def fused_linear_logprob_bwd(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    stats: torch.Tensor,
    ent: torch.Tensor | None,
    grad_logp: torch.Tensor | None,
    grad_ent: torch.Tensor | None,
    inv_t: float,
    ignore_index: int,
    need_dh: bool = True,
    need_dw: bool = True,
    *,
    chunk: int = 0,
    use_triton: bool | None = None,
    gemm_dtype: torch.dtype | None = None,
    bias: torch.Tensor | None = None,
    softcap: float = 0.0,
    grad_lse: torch.Tensor | None = None,
    grad_zsum: torch.Tensor | None = None,
    need_db: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Backward over vocabulary chunks: (dh [N, D] or None, dW [V, D] or None, db [V] or None) in the input dtypes.

    grad_logp / grad_ent / grad_lse / grad_zsum are [N] fp32 contiguous or None (None = zero); grad_ent needs ent,
    grad_lse and grad_zsum stats of every row. db (the bias's dtype) is Σ_rows dz, summed in fp32 from the dz the
    weight's GEMM reads.
    """
    n, d = h.shape
    v = weight.shape[0]
    dev = h.device
    gdt = _gemm_dtype(h, gemm_dtype)
    triton_path = _use_triton(h, use_triton)
    epilogue = _triton_bwd_epilogue if triton_path else torch_bwd_epilogue
    dw = torch.empty_like(weight, memory_format=torch.contiguous_format) if need_dw else None
    dh_acc = torch.zeros(n, d, device=dev, dtype=torch.float32) if need_dh else None
    db = torch.zeros(v, device=dev, dtype=torch.float32) if (need_db and bias is not None) else None
    if grad_logp is None and grad_ent is None and grad_lse is None and grad_zsum is None:
        if dw is not None:
            dw.zero_()
        db_out = db.to(bias.dtype) if db is not None else None
        return (dh_acc.to(h.dtype) if dh_acc is not None else None), dw, db_out
    hg = h if h.dtype == gdt else h.to(gdt)
    c = chunk_size(n, v, torch.finfo(gdt).bits // 8, chunk, BWD_CHUNK_BUDGET_BYTES)
    scalar_t = float(inv_t)
    # One chunk buffer for the whole loop: each chunk's logits land in it and (backward) become dz in place.
    buf = torch.empty(n * c, dtype=gdt, device=dev)
    z = None
    for v0 in range(0, v, c):
        w_c, z = _chunk_logits(hg, weight, v0, c, buf)
        epilogue(z, labels, stats, ent, grad_logp, grad_ent, v0, scalar_t, ignore_index, bias=bias,
                 softcap=softcap, glse=grad_lse, gzs=grad_zsum)  # fmt: skip
        if db is not None:
            db[v0 : v0 + c] = z.sum(dim=0, dtype=torch.float32)
        if dw is not None:
            if dw.dtype == gdt:
                torch.mm(z.t(), hg, out=dw[v0 : v0 + c])
            else:
                dw[v0 : v0 + c] = torch.mm(z.t(), hg)
        if dh_acc is not None:
            _addmm_fp32_(dh_acc, z, w_c)
    del buf, z  # z is a view of buf: both must go before the caller allocates more
    dh = dh_acc.to(h.dtype) if dh_acc is not None else None
    return dh, dw, (db.to(bias.dtype) if db is not None else None)


# Bytes one [R, V] row block of logits may take in the loss-aware forward (whole vocabulary per block): 1536 rows at
# V = 151936 in bf16, past which a larger block is no faster and the 8B shape's step would leave its memory budget
# (the sweep: benchmarks/RESULTS.md, "The sweeps behind the kernels' settings").
LOSS_BLOCK_BUDGET_BYTES = 448 * 2**20
_ROW_ALIGN = 128


def row_block(
    n_rows: int, vocab: int, elem_bytes: int, requested: int = 0, budget: int = LOSS_BLOCK_BUDGET_BYTES
) -> int:
    """Rows per block of the loss-aware forward: ``requested`` if > 0, else what keeps one [R, V] block within
    ``budget`` (a multiple of 128 rows when that fits, so the GEMMs tile evenly)."""
    if requested > 0:
        return max(1, min(requested, n_rows))
    r = budget // max(1, vocab * elem_bytes)
    if r >= _ROW_ALIGN:
        r = r // _ROW_ALIGN * _ROW_ALIGN
    return max(1, min(max(r, 16), n_rows))


def fused_linear_logprob_loss_fwd(
    h: torch.Tensor | list[torch.Tensor],
    weight: torch.Tensor,
    labels: torch.Tensor,
    inv_t: float,
    ignore_index: int,
    with_entropy: bool,
    grad_of: Any,
    *,
    block_rows: int = 0,
    use_triton: bool | None = None,
    gemm_dtype: torch.dtype | None = None,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Loss-aware forward: log-probs, entropy and the gradients of a scalar loss, in 3 GEMMs instead of 4.

    ``h`` is [N, D], or a list of [n_i, D] row segments (each with unit column stride) whose rows, in order, are
    the N rows: a shifted ``h[:, :-1]`` is passed as one segment per sequence instead of being copied (a block that
    spans two segments gathers its rows into one [R, D] buffer, so the blocks stay full).
    For row blocks R that hold the whole vocabulary: z_R = h_R·Wᵀ, the forward epilogue gives logp_R, H_R and the
    row statistics; ``grad_of(logp, entropy, r0, r1)`` then returns the loss's per-token gradients (g_lp, g_H) of
    those rows (fp32 [R] or None), from the [N] buffers filled up to r1 (later rows are still 0); the backward
    epilogue turns z_R into dz_R in place; dh_R = dz_R·W (complete: one GEMM over the whole vocabulary) and
    dW += dz_Rᵀ·h_R. Returns (logp, entropy or None, stats, dh [N, D], dW): fp32 and the input dtypes.

    dW is accumulated across row blocks in the GEMM dtype (bf16 on CUDA: cuBLAS adds the block's fp32 product to
    the bf16 running sum and rounds once per block); an fp32 [V, D] accumulator would not fit the memory this mode
    exists to save. Workspace: one [R, V] block (``row_block``).
    """
    segments = [h] if isinstance(h, torch.Tensor) else list(h)
    n = sum(seg.shape[0] for seg in segments)
    d, v = weight.shape[1], weight.shape[0]
    dev, dtype = weight.device, segments[0].dtype
    gdt = gemm_dtype if gemm_dtype is not None else (dtype if weight.is_cuda else torch.float32)
    triton_path = _use_triton(weight, use_triton)
    fwd_epilogue = _triton_fwd_epilogue if triton_path else torch_fwd_epilogue
    bwd_epilogue = _triton_bwd_epilogue if triton_path else torch_bwd_epilogue
    wg = weight if weight.dtype == gdt else weight.to(gdt)
    r = row_block(n, v, torch.finfo(gdt).bits // 8, block_rows)
    logp = torch.zeros(n, device=dev, dtype=torch.float32)
    stats = torch.zeros(n, 2, device=dev, dtype=torch.float32)
    ent = torch.zeros(n, device=dev, dtype=torch.float32) if with_entropy else None
    dh = torch.empty(n, d, device=dev, dtype=gdt)
    dw = torch.zeros(v, d, device=dev, dtype=gdt) if n == 0 else None
    scalar_t = float(inv_t)
    buf = torch.empty(min(r, max(n, 1)) * v, dtype=gdt, device=dev)
    hs = [seg if seg.dtype == gdt else seg.to(gdt) for seg in segments]
    stage = None  # a block's rows gathered from several segments (one [R, D] buffer, a few MiB)
    for r0 in range(0, n, r):
        r1 = min(n, r0 + r)
        rows, pieces = slice(r0, r1), _rows_of(hs, r0, r1)
        if len(pieces) == 1:
            h_r = pieces[0]
        else:
            if stage is None:
                stage = torch.empty(r, d, device=dev, dtype=gdt)
            h_r = torch.cat(pieces, out=stage[: r1 - r0])
        z = buf[: (r1 - r0) * v].view(r1 - r0, v)
        torch.mm(h_r, wg.t(), out=z)
        state = (
            torch.full((r1 - r0,), float("-inf"), device=dev, dtype=torch.float32),
            *(torch.zeros(r1 - r0, device=dev, dtype=torch.float32) for _ in range(3)),
        )
        ent_r = ent[rows] if ent is not None else None
        fwd_epilogue(z, labels[rows], state, logp[rows], ent_r, stats[rows], 0, scalar_t, ignore_index,
                     with_entropy, True, _ROW_LAUNCH, softcap=softcap)  # fmt: skip
        glp, gent = grad_of(logp, ent, r0, r1)
        bwd_epilogue(z, labels[rows], stats[rows], ent_r, glp, gent, 0, scalar_t, ignore_index, _ROW_BWD_LAUNCH,
                     softcap=softcap)  # fmt: skip
        torch.mm(z, wg, out=dh[rows])
        if dw is None:
            dw = torch.mm(z.t(), h_r)
        else:
            dw.addmm_(z.t(), h_r)
    del buf
    if v == 0:
        logp.fill_(float("nan"))
        if ent is not None:
            ent.fill_(float("nan"))
    return logp, ent, stats, dh.to(dtype), dw.to(weight.dtype)


def _rows_of(segments: list[torch.Tensor], r0: int, r1: int) -> list[torch.Tensor]:
    """Rows [r0, r1) of the segments' concatenation, as slices of the segments."""
    pieces, start = [], 0
    for seg in segments:
        lo, hi = max(r0, start), min(r1, start + seg.shape[0])
        if lo < hi:
            pieces.append(seg[lo - start : hi - start])
        start += seg.shape[0]
    return pieces


__all__ = [
    "BWD_CHUNK_BUDGET_BYTES",
    "FWD_CHUNK_BUDGET_BYTES",
    "HAS_TRITON",
    "LOSS_BLOCK_BUDGET_BYTES",
    "chunk_size",
    "Extras",
    "fused_linear_logprob_bwd",
    "fused_linear_logprob_fwd",
    "fused_linear_logprob_loss_fwd",
    "row_block",
    "probe",
    "reference_logprob_entropy",
]
