"""Tiled grouped (MoE expert) MLP, the elementwise part of a token chunk and the weight-grad accumulation.

Math, per row r of a chunk of routed rows (``gu`` = [g | u], the chunk's fused gate/up projection [rows, 2I];
``dh`` the grad of ``h`` [rows, I]; ``m[r]`` the optional row mask, HF's ``masked_fill(gu, mask, 0)``):
    forward:  h = act(g) * u                          (0 on a masked row: act(0) * 0)
    backward: h = act(g) * u,  du = act(g) * dh,  dg = dh * u * act'(g)   (all 0 on a masked row)
Nothing is saved: the op (tilecompile/ops/tiled_grouped_mlp.py) recomputes ``gu`` per chunk with ``grouped_mm``.

``_tiled_grouped_mlp_fwd_kernel`` reads ``gu`` once and writes ``h``; ``_tiled_grouped_mlp_bwd_kernel`` reads
``gu`` and ``dh`` once and writes ``dg | du`` over ``gu`` and ``h`` over ``dh`` (in place: the chunk needs two
buffers, [rows, 2I] and [rows, I], each way). Both compute in fp32 and round once to the buffers' dtype.

``_grouped_grad_carry_kernel``: a chunk's weight grad ``part`` [E, K, N] (``grouped_mm``'s, zero for the experts
without rows in the chunk) goes into the grad itself, in the parameter's dtype, with no accumulator over all
experts. The rows are grouped by expert, so at most one expert's rows cross each chunk edge: the expert whose rows
began in an earlier chunk adds the fp32 carry that chunk left, the one whose rows go on past the chunk leaves its sum
in the carry for the next, every other expert with rows in the chunk writes its grad, and the last chunk writes zero
for the experts with no rows. Two carry slots [2, K, N] take turns (chunk ``c`` reads slot ``(c + 1) % 2`` and
writes slot ``c % 2``), so an expert that crosses both edges reads and writes different memory. An expert's grad is
the chunks' parts summed in chunk order in the carry's dtype and rounded once: what an [E, K, N] accumulator gives,
bit for bit, in 2·K·N elements instead of E·K·N.

``_grouped_wgrad_kernel`` is the same scheme with the chunk's weight-grad GEMM in it: for each expert with rows
in the chunk, ``aᵀ b`` over those rows (a [rows, K], b [rows, N], the chunk's), summed in fp32 in registers, the
carry added and the result stored as above. No [E, K, N] part is written: a chunk costs the GEMM of the experts it
has, where ``grouped_mm`` writes every expert's grad (zeros for the rest) for the carry to read back. It is
persistent (one program an SM takes the (expert, tile) items in turn): a chunk holds a few of the experts, and a
block launched for each absent expert's tiles cost 0.9 ms of the op's 20.0 at Qwen3-30B-A3B's shape on the H100.
With ``TMA`` it loads the row tiles through tensor descriptors (TMA on Hopper), one per item spanning its expert's
rows, so the copy engine zero-fills past them instead of a mask per element. That runs under ``USE_TMA``, off until
a GPU run measures it (``bash benchmarks/gpu_moe.sh OUT tma``); the interpreter test checks its grads. ``HALVES``
(1 by default) = 2 keeps the tile's columns in two accumulators, each added to the carry and stored on its own,
for the epilogue's registers; ``bench_moe_op.py --wgrad-sweep`` times it.

``_tiled_grouped_mlp_bwd_weighted_kernel`` is the backward kernel with HF's routing weight ``w[r]`` (the op's
``row_weight``, ``y = (h Wd) * w``) in it: ``dh`` comes in as the grad of ``h Wd`` unscaled (``grouped_mm(dy,
Wdᵀ)``), and per row, in fp32, ``du = act(g) * (dh * w)``, ``dg = (dh * w) * u * act'(g)``, the weight's grad
``dw[r] = Σ_k dh·h`` (zero for the rows past ``offsets[-1]``), and ``h * w`` over ``dh`` for the down weight's grad
(``dWd = (h * w)ᵀ dy``). Each program takes whole rows (column blocks in a loop), so the row sum needs no atomics;
it replaces three elementwise passes over [rows, I] and a reduction per chunk.

``_rows_out_kernel`` puts a chunk's ``grouped_mm`` output into the op's [rows, N] result: row r of the chunk
(the op's row ``start + r``) is ``y[r]``, times the row's weight if there is one (rounded once, as eager's
``y.mul_(w)``), or zero where ``start + r`` is past ``offsets[-1]`` (rows of no expert, which ``grouped_mm`` leaves
undefined). One read and one write, vectorized along the row, where a broadcast ``torch.where`` ran at about half
the bandwidth (RESULTS.md, the op's kernels, 2026-12-07).

The same math in plain PyTorch (the CPU implementation and the kernels' reference) is in
``kernels/tiled_mlp_reference.py``; tests/test_moe_grouped.py compares the two under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from tilecompile.kernels import tiled_mlp as mlp_kernels

HAS_TRITON = mlp_kernels.HAS_TRITON
if HAS_TRITON:
    import triton
    import triton.language as tl

    from tilecompile.kernels.tiled_mlp import _gated_act

__all__ = ["HAS_TRITON", "act_backward", "act_backward_weighted", "act_mul", "carry_accumulate", "grouped_wgrad",
           "rows_out"]  # fmt: skip

_BLOCK = 1024
_ACC_BLOCK = 4096


# ----------------------------------------------------------------------------------------------------------------
# Triton kernels

if HAS_TRITON:

    @triton.jit
    def _tiled_grouped_mlp_fwd_kernel(
        gu_ptr, h_ptr, mask_ptr, n_elements, inter, HAS_MASK: tl.constexpr, ACT: tl.constexpr, BLOCK: tl.constexpr
    ):
        # int64 offsets: a chunk's [rows, 2I] can pass 2**31 elements
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        valid = offs < n_elements
        row, col = offs // inter, offs % inter
        g = tl.load(gu_ptr + row * 2 * inter + col, mask=valid, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * 2 * inter + inter + col, mask=valid, other=0.0).to(tl.float32)
        a, _ = _gated_act(g, ACT)
        h = a * u
        if HAS_MASK:  # a masked row's g and u are zero: h = act(0) * 0 = 0 for every activation here
            masked = tl.load(mask_ptr + row, mask=valid, other=0) != 0
            h = tl.where(masked, 0.0, h)
        tl.store(h_ptr + offs, h.to(h_ptr.dtype.element_ty), mask=valid)

    @triton.jit
    def _tiled_grouped_mlp_bwd_kernel(
        gu_ptr, dh_ptr, mask_ptr, n_elements, inter, HAS_MASK: tl.constexpr, ACT: tl.constexpr, BLOCK: tl.constexpr
    ):
        # every element is read and then overwritten by the same program: the in-place stores are race-free
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        valid = offs < n_elements
        row, col = offs // inter, offs % inter
        g_at, u_at = gu_ptr + row * 2 * inter + col, gu_ptr + row * 2 * inter + inter + col
        g = tl.load(g_at, mask=valid, other=0.0).to(tl.float32)
        u = tl.load(u_at, mask=valid, other=0.0).to(tl.float32)
        dh = tl.load(dh_ptr + offs, mask=valid, other=0.0).to(tl.float32)
        a, da = _gated_act(g, ACT)
        h, du, dg = a * u, a * dh, dh * u * da
        if HAS_MASK:  # the forward's zero fill: h = 0, and its backward: no grad reaches g or u
            masked = tl.load(mask_ptr + row, mask=valid, other=0) != 0
            h, du, dg = tl.where(masked, 0.0, h), tl.where(masked, 0.0, du), tl.where(masked, 0.0, dg)
        tl.store(g_at, dg.to(gu_ptr.dtype.element_ty), mask=valid)
        tl.store(u_at, du.to(gu_ptr.dtype.element_ty), mask=valid)
        tl.store(dh_ptr + offs, h.to(dh_ptr.dtype.element_ty), mask=valid)

    @triton.jit
    def _tiled_grouped_mlp_bwd_weighted_kernel(
        gu_ptr, dh_ptr, mask_ptr, w_ptr, dw_ptr, offs_ptr, experts, rows, inter, stride_w, stride_dw, start,
        HAS_MASK: tl.constexpr, NEED_DW: tl.constexpr, STORE_H: tl.constexpr, ACT: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    ):  # fmt: skip
        # grid (row blocks,); every element is read and then overwritten by the same program (race-free in place)
        rs = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        in_rows = rs < rows
        w = tl.load(w_ptr + rs * stride_w, mask=in_rows, other=0.0).to(tl.float32)
        if HAS_MASK:
            masked = tl.load(mask_ptr + rs, mask=in_rows, other=0) != 0
        dw = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for c in range(0, inter, BLOCK_C):
            cs = c + tl.arange(0, BLOCK_C)
            inside = in_rows[:, None] & (cs[None, :] < inter)
            g_at = gu_ptr + rs[:, None] * 2 * inter + cs[None, :]
            u_at = g_at + inter
            dh_at = dh_ptr + rs[:, None] * inter + cs[None, :]
            g = tl.load(g_at, mask=inside, other=0.0).to(tl.float32)
            u = tl.load(u_at, mask=inside, other=0.0).to(tl.float32)
            raw = tl.load(dh_at, mask=inside, other=0.0).to(tl.float32)
            a, da = _gated_act(g, ACT)
            h, scaled = a * u, raw * w[:, None]
            du, dg = a * scaled, scaled * u * da
            if HAS_MASK:  # the forward's zero fill: h = 0, and its backward: no grad reaches g or u
                h = tl.where(masked[:, None], 0.0, h)
                du, dg = tl.where(masked[:, None], 0.0, du), tl.where(masked[:, None], 0.0, dg)
            if NEED_DW:
                dw += tl.sum(raw * h, axis=1)
            tl.store(g_at, dg.to(gu_ptr.dtype.element_ty), mask=inside)
            tl.store(u_at, du.to(gu_ptr.dtype.element_ty), mask=inside)
            if STORE_H:
                tl.store(dh_at, (h * w[:, None]).to(dh_ptr.dtype.element_ty), mask=inside)
        if NEED_DW:  # rows past offsets[-1] are no expert's: zero
            end = tl.load(offs_ptr + experts - 1).to(tl.int64) - start
            dw = tl.where(rs < end, dw, 0.0)
            tl.store(dw_ptr + rs * stride_dw, dw.to(dw_ptr.dtype.element_ty), mask=in_rows)

    @triton.jit
    def _rows_out_kernel(
        out_ptr, y_ptr, w_ptr, offs_ptr, experts, rows, cols, stride_y, stride_w, start, HAS_W: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    ):  # fmt: skip
        # grid (row blocks, column blocks); out is [rows, cols] contiguous
        end = tl.load(offs_ptr + experts - 1).to(tl.int64) - start  # the chunk's rows from here on are no expert's
        rs = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        cs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        inside = (rs[:, None] < rows) & (cs[None, :] < cols)
        keep = rs < end
        y = tl.load(y_ptr + rs[:, None] * stride_y + cs[None, :], mask=inside & keep[:, None], other=0.0)
        if HAS_W:
            w = tl.load(w_ptr + rs * stride_w, mask=(rs < rows) & keep, other=0.0).to(tl.float32)
            y = y.to(tl.float32) * w[:, None]
        tl.store(out_ptr + rs[:, None] * cols + cs[None, :], y.to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _carry_store(val, grad_ptr, carry_ptr, e, per_expert, at, mask, slot_in, slot_out, begun, goes_on):
        # expert e's fp32 sum of this chunk (``at``: offsets within one expert's [K, N]), the two carries' rule
        if begun:  # its rows began in an earlier chunk: that chunk's carry
            val += tl.load(carry_ptr + slot_in * per_expert + at, mask=mask, other=0.0).to(tl.float32)
        if goes_on:  # its rows go on in the next chunk
            tl.store(carry_ptr + slot_out * per_expert + at, val.to(carry_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(grad_ptr + e.to(tl.int64) * per_expert + at, val.to(grad_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _grouped_grad_carry_kernel(
        grad_ptr, carry_ptr, part_ptr, offs_ptr, per_expert, start, stop, rows, slot_in, slot_out,
        LAST: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        # grid (blocks per expert, experts): an expert without rows in the chunk costs two loads of its offsets
        e = tl.program_id(1)
        hi = tl.minimum(tl.load(offs_ptr + e).to(tl.int64), rows)
        lo = tl.minimum(tl.where(e > 0, tl.load(offs_ptr + tl.maximum(e - 1, 0)).to(tl.int64), 0), rows)
        present = tl.maximum(lo, start) < tl.minimum(hi, stop)
        empty = hi <= lo
        if present | (LAST & empty):
            offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            valid = offs < per_expert
            val = tl.load(part_ptr + e.to(tl.int64) * per_expert + offs, mask=valid, other=0.0).to(tl.float32)
            if empty:
                val = tl.zeros((BLOCK,), dtype=tl.float32)
            _carry_store(val, grad_ptr, carry_ptr, e, per_expert, offs, valid, slot_in, slot_out,
                         present & (lo < start), present & (hi > stop))  # fmt: skip

    @triton.jit
    def _grouped_wgrad_kernel(
        a_ptr, b_ptr, grad_ptr, carry_ptr, offs_ptr, K, N, per_expert, stride_a, stride_b, start, stop, rows, slot_in,
        slot_out, experts, LAST: tl.constexpr, TMA: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_R: tl.constexpr, HALVES: tl.constexpr,
    ):  # fmt: skip
        # persistent: program p takes the (expert, [K, N] tile) items p, p + P, ... (P programs, about one an SM). A
        # chunk holds a few experts' rows; the other experts' items cost two loads each here, where a grid of
        # (tiles, experts) launched a block for each of them; a and b hold the chunk's rows only (row start..stop-1
        # is a's row 0..). TMA: the row tiles through tensor descriptors (TMA on Hopper), an item's spanning its
        # expert's rows only, so the copy engine zero-fills the rows past them (the next expert's) where the pointer
        # loads take a mask per element. HALVES (1 or 2): 2 keeps the tile's columns as two accumulators of
        # BLOCK_N / 2, each through the carry and stored on its own, so that the epilogue holds one half's carry
        # beside the sums, not the whole tile's (at 128 x 256 and 8 warps the fp32 sums are 128 registers a thread,
        # and a whole tile's fp32 carry 128 more)
        tiles_n = tl.cdiv(N, BLOCK_N)
        tiles = tl.cdiv(K, BLOCK_K) * tiles_n
        for item in range(tl.program_id(0), experts * tiles, tl.num_programs(0)):
            e = item // tiles
            pk, pn = (item % tiles) // tiles_n, (item % tiles) % tiles_n
            hi = tl.minimum(tl.load(offs_ptr + e), rows)
            lo = tl.minimum(tl.where(e > 0, tl.load(offs_ptr + tl.maximum(e - 1, 0)), 0), rows)
            r0, r1 = tl.maximum(lo, start) - start, tl.minimum(hi, stop) - start
            present = r0 < r1
            empty = hi <= lo
            if present | (LAST & empty):
                ks = pk * BLOCK_K + tl.arange(0, BLOCK_K)
                n0 = pn * BLOCK_N
                ns = n0 + tl.arange(0, BLOCK_N // HALVES)  # the first half's columns (all of them without HALVES)
                acc = tl.zeros((BLOCK_K, BLOCK_N // HALVES), dtype=tl.float32)
                acc2 = tl.zeros((BLOCK_K, BLOCK_N // HALVES), dtype=tl.float32)  # the second half's (HALVES == 2)
                # an empty expert's loop runs no step (r0 >= r1): its grad is the zeros
                if TMA:
                    count = tl.maximum(r1 - r0, 1)  # an empty expert's descriptors are made, never read
                    first = r0.to(tl.int64)
                    a_rows = tl.make_tensor_descriptor(
                        a_ptr + first * stride_a,
                        shape=[count, K],
                        strides=[stride_a, 1],
                        block_shape=[BLOCK_R, BLOCK_K],
                    )
                    b_rows = tl.make_tensor_descriptor(
                        b_ptr + first * stride_b,
                        shape=[count, N],
                        strides=[stride_b, 1],
                        block_shape=[BLOCK_R, BLOCK_N // HALVES],
                    )
                    for r in range(0, r1 - r0, BLOCK_R):
                        a_t = tl.trans(a_rows.load([r, pk * BLOCK_K]))
                        acc += tl.dot(a_t, b_rows.load([r, n0]))
                        if HALVES == 2:
                            acc2 += tl.dot(a_t, b_rows.load([r, n0 + BLOCK_N // 2]))
                else:
                    for r in range(r0, r1, BLOCK_R):
                        rs = r + tl.arange(0, BLOCK_R)
                        in_rows = rs < r1  # the expert's last rows: the next expert's are not its own
                        a = tl.load(a_ptr + rs.to(tl.int64)[:, None] * stride_a + ks[None, :],
                                    mask=in_rows[:, None] & (ks[None, :] < K), other=0.0)  # fmt: skip
                        b_at = b_ptr + rs.to(tl.int64)[:, None] * stride_b + ns[None, :]
                        b = tl.load(b_at, mask=in_rows[:, None] & (ns[None, :] < N), other=0.0)
                        a_t = tl.trans(a)
                        acc += tl.dot(a_t, b)
                        if HALVES == 2:
                            b2 = tl.load(b_at + BLOCK_N // 2, mask=in_rows[:, None] & (ns[None, :] + BLOCK_N // 2 < N),
                                         other=0.0)  # fmt: skip
                            acc2 += tl.dot(a_t, b2)
                begun, goes_on = present & (lo < start), present & (hi > stop)
                tile = ks.to(tl.int64)[:, None] * N + ns[None, :]
                inside = (ks[:, None] < K) & (ns[None, :] < N)
                _carry_store(acc, grad_ptr, carry_ptr, e, per_expert, tile, inside, slot_in, slot_out, begun, goes_on)
                if HALVES == 2:
                    inside2 = (ks[:, None] < K) & (ns[None, :] + BLOCK_N // 2 < N)
                    _carry_store(acc2, grad_ptr, carry_ptr, e, per_expert, tile + BLOCK_N // 2, inside2, slot_in,
                                 slot_out, begun, goes_on)  # fmt: skip

# ----------------------------------------------------------------------------------------------------------------
# launchers


def _mask_bytes(mask: Tensor | None, gu: Tensor) -> Tensor:
    return gu if mask is None else mask.reshape(-1).view(torch.uint8)


def act_mul(gu: Tensor, mask: Tensor | None, activation: str) -> Tensor:
    """h = act(g) * u of the contiguous [rows, 2I] ``gu`` (0 on the rows of ``mask``), a new [rows, I] tensor."""
    rows, inter = gu.shape[0], gu.shape[1] // 2
    if not gu.is_contiguous():
        raise ValueError("tiled_grouped_mlp kernels: gu must be contiguous")
    h = gu.new_empty((rows, inter))
    n = rows * inter
    if n:
        _tiled_grouped_mlp_fwd_kernel[(triton.cdiv(n, _BLOCK),)](
            gu, h, _mask_bytes(mask, gu), n, inter, HAS_MASK=mask is not None,
            ACT=mlp_kernels.ACT_CODE[activation], BLOCK=_BLOCK, num_warps=4,
        )  # fmt: skip
    return h


def act_backward(gu: Tensor, dh: Tensor, mask: Tensor | None, activation: str) -> None:
    """In place: ``gu`` [rows, 2I] <- [dg | du], ``dh`` [rows, I] <- h (both contiguous)."""
    rows, inter = gu.shape[0], gu.shape[1] // 2
    if not (gu.is_contiguous() and dh.is_contiguous()) or tuple(dh.shape) != (rows, inter) or dh.dtype != gu.dtype:
        raise ValueError("tiled_grouped_mlp kernels: gu [rows, 2I] and dh [rows, I] must be contiguous, one dtype")
    n = rows * inter
    if n:
        _tiled_grouped_mlp_bwd_kernel[(triton.cdiv(n, _BLOCK),)](
            gu, dh, _mask_bytes(mask, gu), n, inter, HAS_MASK=mask is not None,
            ACT=mlp_kernels.ACT_CODE[activation], BLOCK=_BLOCK, num_warps=4,
        )  # fmt: skip


def act_backward_weighted(gu: Tensor, dh: Tensor, mask: Tensor | None, weight: Tensor, dw: Tensor | None,
                          offsets: Tensor, start: int, activation: str, store_h: bool) -> None:  # fmt: skip
    """In place, with the row weight ``weight`` [rows, 1]: ``gu`` [rows, 2I] <- [dg | du] of ``dh * weight``, and
    ``dh`` [rows, I] (the unscaled grad of ``h Wd``) <- ``h * weight`` if ``store_h`` (else left undefined);
    ``dw`` [rows, 1] (if given) <- ``Σ dh·h`` per row, zero for the rows ``start + r >= offsets[-1]`` (``offsets``
    [E] int32)."""
    rows, inter = gu.shape[0], gu.shape[1] // 2
    if not (gu.is_contiguous() and dh.is_contiguous()) or tuple(dh.shape) != (rows, inter) or dh.dtype != gu.dtype:
        raise ValueError("tiled_grouped_mlp kernels: gu [rows, 2I] and dh [rows, I] must be contiguous, one dtype")
    if weight.dim() != 2 or tuple(weight.shape) != (rows, 1) or (dw is not None and tuple(dw.shape) != (rows, 1)):
        raise ValueError("tiled_grouped_mlp kernels: weight and dw must be [rows, 1]")
    if offsets.dim() != 1 or offsets.dtype != torch.int32 or not len(offsets):
        raise ValueError("tiled_grouped_mlp kernels: offsets must be [E] int32")
    if rows:
        _tiled_grouped_mlp_bwd_weighted_kernel[(triton.cdiv(rows, _WEIGHTED_R),)](
            gu, dh, _mask_bytes(mask, gu), weight, weight if dw is None else dw, offsets, len(offsets), rows, inter,
            weight.stride(0), 0 if dw is None else dw.stride(0), start, HAS_MASK=mask is not None,
            NEED_DW=dw is not None, STORE_H=store_h, ACT=mlp_kernels.ACT_CODE[activation], BLOCK_R=_WEIGHTED_R,
            BLOCK_C=_WEIGHTED_C, num_warps=4,
        )  # fmt: skip


_WEIGHTED_R, _WEIGHTED_C = 8, 256


def rows_out(out: Tensor, y: Tensor, weight: Tensor | None, offsets: Tensor, start: int) -> None:
    """``out`` [rows, N] (contiguous) <- ``y`` [rows, N] (unit column stride), each row times ``weight`` [rows, 1]
    if given, and zero for the rows ``start + r >= offsets[-1]``; ``offsets`` [E] int32, cumulative."""
    rows, cols = out.shape
    if not out.is_contiguous() or y.shape != out.shape or (rows and cols and y.stride(1) != 1):
        raise ValueError("tiled_grouped_mlp kernels: out [rows, N] contiguous and y of its shape, unit column stride")
    if offsets.dim() != 1 or offsets.dtype != torch.int32 or not len(offsets):
        raise ValueError("tiled_grouped_mlp kernels: offsets must be [E] int32")
    if weight is not None and (weight.dim() != 2 or tuple(weight.shape) != (rows, 1)):
        raise ValueError("tiled_grouped_mlp kernels: weight must be [rows, 1]")
    if rows and cols:
        grid = (triton.cdiv(rows, _ROWS_R), triton.cdiv(cols, _ROWS_C))
        _rows_out_kernel[grid](
            out, y, y if weight is None else weight, offsets, len(offsets), rows, cols, y.stride(0),
            0 if weight is None else weight.stride(0), start, HAS_W=weight is not None, BLOCK_R=_ROWS_R,
            BLOCK_C=_ROWS_C, num_warps=4,
        )  # fmt: skip


_ROWS_R, _ROWS_C = 8, 512


def carry_accumulate(grad: Tensor, carry: Tensor, part: Tensor, offsets: Tensor, start: int, stop: int, rows: int,
                     index: int, last: bool) -> None:  # fmt: skip
    """Chunk ``index`` (rows ``start:stop`` of ``rows``) of a weight grad: ``part`` [E, K, N] into ``grad`` [E, K, N]
    (the parameter's dtype) and the carry [2, K, N] (see the module docstring); ``offsets`` [E] int32, cumulative."""
    experts = grad.shape[0]
    if not (grad.is_contiguous() and carry.is_contiguous() and part.is_contiguous()) or part.shape != grad.shape:
        raise ValueError("tiled_grouped_mlp kernels: grad, carry and part must be contiguous, grad and part one shape")
    if tuple(carry.shape) != (2, *grad.shape[1:]) or offsets.shape != (experts,) or offsets.dtype != torch.int32:
        raise ValueError("tiled_grouped_mlp kernels: carry must be [2, K, N] and offsets [E] int32")
    per_expert = grad[0].numel() if experts else 0
    if per_expert:
        grid = (triton.cdiv(per_expert, _ACC_BLOCK), experts)
        _grouped_grad_carry_kernel[grid](
            grad, carry, part, offsets, per_expert, start, stop, rows, (index + 1) % 2, index % 2, LAST=last,
            BLOCK=_ACC_BLOCK,
        )  # fmt: skip


# one config for Hopper-class GPUs (bf16 tensor cores; measured in benchmarks/bench_moe_op.py)
@functools.cache
def _programs(device: torch.device) -> int:
    """grouped_wgrad's persistent programs: one an SM (its blocks' shared memory fits one at a time); 3 under the
    interpreter, so that its tests see programs take several items."""
    if device.type != "cuda":
        return 3
    return torch.cuda.get_device_properties(device).multi_processor_count


_WGRAD = dict(BLOCK_K=128, BLOCK_N=256, BLOCK_R=64, HALVES=1, num_warps=8, num_stages=3)
# the row tiles through tensor descriptors (_grouped_wgrad_kernel's TMA) where the GPU has TMA (sm_90+) and Triton
# makes descriptors on the device; off until its GPU run (benchmarks/bench_moe_op.py --wgrad-sweep)
USE_TMA = False


def tma_runs(device: torch.device) -> bool:
    """Whether grouped_wgrad loads through tensor descriptors on ``device`` (always under the interpreter)."""
    return USE_TMA and _has_tma(device)


@functools.cache
def _has_tma(device: torch.device) -> bool:
    """Triton makes descriptors on the device, and the GPU has TMA (sm_90+); asked once a device, not each launch."""
    if not (hasattr(tl, "make_tensor_descriptor") and hasattr(triton, "set_allocator")):
        return False
    return device.type != "cuda" or torch.cuda.get_device_capability(device)[0] >= 9


def _tma_aligned(t: Tensor) -> bool:
    """A descriptor's start and row stride must be multiples of 16 bytes; each expert's starts at a row of ``t``."""
    return t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0


class _Scratch:
    """Triton's allocator for the descriptors a kernel makes on the device: a torch buffer on ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __call__(self, size: int, alignment: int, stream) -> Tensor:
        return torch.empty(size, dtype=torch.int8, device=self.device)


def _ensure_allocator(device: torch.device) -> None:
    """An allocator for the descriptors' scratch on ``device``, set at each launch as Inductor's launcher does (the
    allocator is a context variable, and autograd runs the backward in threads of its own); one the user set in this
    context is left in place (any allocator of device memory serves), ours for another device is replaced."""
    allocation = getattr(triton.runtime, "_allocation", None)
    current = getattr(allocation, "_allocator", None)
    null = getattr(allocation, "NullAllocator", None)
    if current is not None and null is not None:
        now = current.get()
        if isinstance(now, _Scratch) and now.device == device:
            return
        if not isinstance(now, (null, _Scratch)):
            return
    triton.set_allocator(_Scratch(device))


def grouped_wgrad(grad: Tensor, carry: Tensor, a: Tensor, b: Tensor, offsets: Tensor, start: int, stop: int,
                  rows: int, index: int, last: bool) -> None:  # fmt: skip
    """Chunk ``index`` (rows ``start:stop`` of ``rows``) of a weight grad, ``aᵀ b`` per expert over the chunk's
    rows (``a`` [stop - start, K], ``b`` [stop - start, N], each with unit column stride), into ``grad`` [E, K, N]
    and the carry [2, K, N], as ``carry_accumulate`` does with ``grouped_mm``'s part; ``offsets`` [E] int32."""
    experts, k, n = grad.shape
    if a.shape != (stop - start, k) or b.shape != (stop - start, n) or a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError("tiled_grouped_mlp kernels: a [rows, K] and b [rows, N] of the chunk, unit column stride")
    if not (grad.is_contiguous() and carry.is_contiguous()) or tuple(carry.shape) != (2, k, n):
        raise ValueError("tiled_grouped_mlp kernels: grad [E, K, N] and carry [2, K, N] must be contiguous")
    if offsets.shape != (experts,) or offsets.dtype != torch.int32 or a.dtype != b.dtype:
        raise ValueError("tiled_grouped_mlp kernels: offsets must be [E] int32, a and b one dtype")
    if experts and k and n:
        cfg = _WGRAD
        if cfg["HALVES"] not in (1, 2):
            raise ValueError(f"tiled_grouped_mlp kernels: grouped_wgrad's HALVES must be 1 or 2, got {cfg['HALVES']}")
        items = triton.cdiv(k, cfg["BLOCK_K"]) * triton.cdiv(n, cfg["BLOCK_N"]) * experts
        tma = tma_runs(a.device) and all(_tma_aligned(t) for t in (a, b))
        if tma:
            _ensure_allocator(a.device)
        _grouped_wgrad_kernel[(min(items, _programs(a.device)),)](
            a, b, grad, carry, offsets, k, n, k * n, a.stride(0), b.stride(0), start, stop, rows, (index + 1) % 2,
            index % 2, experts, LAST=last, TMA=tma, **cfg,
        )  # fmt: skip
