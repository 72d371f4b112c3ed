"""Tiled grouped (MoE expert) MLP, the elementwise part of a token chunk and the weight-grad accumulation.

Math, per row r of a chunk of routed rows (``gu`` = [g | u], the chunk's fused gate/up projection [rows, 2I];
``dh`` the grad of ``h`` [rows, I]; ``m[r]`` the optional row mask, HF's ``masked_fill(gu, mask, 0)``):
    forward:  h = act(g) * u                          (0 on a masked row: act(0) * 0)
    backward: h = act(g) * u,  du = act(g) * dh,  dg = dh * u * act'(g)   (all 0 on a masked row)
Nothing is saved: the op (tilecompile/ops/tiled_grouped_mlp.py) recomputes ``gu`` per chunk with ``grouped_mm``.

``_tiled_grouped_mlp_fwd_kernel`` reads ``gu`` once and writes ``h``; ``_tiled_grouped_mlp_bwd_kernel`` reads
``gu`` and ``dh`` once and writes ``dg | du`` over ``gu`` and ``h`` over ``dh`` (in place: the chunk needs two
buffers, [rows, 2I] and [rows, I], each way). Both compute in fp32 and round once to the buffers' dtype.

``_grouped_grad_accum_kernel``: ``acc[e] += part[e]`` only for the experts ``e`` with rows in the chunk
(``present[e]``); a chunk's ``grouped_mm`` weight grad is zero for the others, so skipping them changes nothing and
saves reading and writing the whole [E, K, N] accumulator once per chunk (a chunk holds about E / chunks experts).

The same math in plain PyTorch (the CPU implementation and the kernels' reference) is in
``kernels/tiled_mlp_reference.py``; tests/test_moe_grouped.py compares the two under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tilecompile.kernels import tiled_mlp as mlp_kernels

HAS_TRITON = mlp_kernels.HAS_TRITON
if HAS_TRITON:
    import triton
    import triton.language as tl

    from tilecompile.kernels.tiled_mlp import _gated_act

__all__ = ["HAS_TRITON", "accumulate", "act_backward", "act_mul"]

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
    def _grouped_grad_accum_kernel(acc_ptr, part_ptr, present_ptr, per_expert, BLOCK: tl.constexpr):
        # grid (blocks per expert, experts): an expert without rows in the chunk costs one load of its flag
        e = tl.program_id(1)
        if tl.load(present_ptr + e) != 0:
            offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            valid = offs < per_expert
            base = e.to(tl.int64) * per_expert
            acc = tl.load(acc_ptr + base + offs, mask=valid, other=0.0).to(tl.float32)
            part = tl.load(part_ptr + base + offs, mask=valid, other=0.0).to(tl.float32)
            tl.store(acc_ptr + base + offs, (acc + part).to(acc_ptr.dtype.element_ty), mask=valid)


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


def accumulate(acc: Tensor, part: Tensor, present: Tensor) -> None:
    """``acc[e] += part[e]`` for the experts flagged in ``present`` [E] (bool); both [E, K, N] contiguous."""
    if not (acc.is_contiguous() and part.is_contiguous()) or acc.shape != part.shape:
        raise ValueError("tiled_grouped_mlp kernels: acc and part must be contiguous and of one shape")
    experts = acc.shape[0]
    per_expert = acc[0].numel() if experts else 0
    if per_expert:
        grid = (triton.cdiv(per_expert, _ACC_BLOCK), experts)
        _grouped_grad_accum_kernel[grid](acc, part, present.view(torch.uint8), per_expert, BLOCK=_ACC_BLOCK)
