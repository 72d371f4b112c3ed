"""Tiled gated MLP, elementwise part: ``h = act(g) * u`` and its backward, fused into one Triton kernel each way.

Math, per element of a [chunk, I] tile (g = gate projection, u = up projection, dh = grad of h):
    forward:  h = act(g) * u
    backward: du = act(g) * dh,   dg = dh * u * act'(g)   (and h again, for the down projection's weight grad)
Nothing is saved: the op (tilecompile/ops/tiled_mlp.py) recomputes g and u per chunk from x and the weights.

``_tiled_mlp_fwd_kernel`` overwrites g with h (reads 2 tensors, writes 1, instead of PyTorch's 5 passes);
``_tiled_mlp_bwd_kernel`` overwrites g with h, u with du and dh with dg, each only where asked (reads 3, writes 3
instead of 16 passes, and needs three [chunk, I] buffers instead of four). Both compute in fp32 and round once
to the buffers' dtype. The same math in plain PyTorch (the CPU implementation and the kernels' reference) is in
``kernels/tiled_mlp_reference.py``; tests/test_tiled_mlp_op.py compares the two under TRITON_INTERPRET=1.
"""

from __future__ import annotations

from torch import Tensor

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only installs without Triton use the PyTorch reference everywhere
    HAS_TRITON = False

__all__ = ["ACT_CODE", "HAS_TRITON", "fused_act_backward_", "fused_act_mul_"]

ACT_CODE = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "relu": 3}
_BLOCK = 2048


# ----------------------------------------------------------------------------------------------------------------
# Triton kernels

if HAS_TRITON:

    @triton.jit
    def _gated_act(g, ACT: tl.constexpr):
        """(act(g), act'(g)) in fp32."""
        if ACT == 0:  # silu
            s = tl.sigmoid(g)
            a = g * s
            da = s * (1.0 + g * (1.0 - s))
        elif ACT == 1:  # gelu, exact erf
            cdf = 0.5 * (1.0 + tl.erf(g * 0.7071067811865476))
            a = g * cdf
            da = cdf + g * 0.3989422804014327 * tl.exp(-0.5 * g * g)
        elif ACT == 2:  # gelu, tanh approximation; tanh(z) = 2 sigmoid(2z) - 1
            z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            t = 2.0 * tl.sigmoid(2.0 * z) - 1.0
            a = 0.5 * g * (1.0 + t)
            da = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * g * g)
        else:  # relu; act'(0) = 0 as in PyTorch
            a = tl.maximum(g, 0.0)
            da = tl.where(g > 0.0, 1.0, 0.0)
        return a, da

    @triton.jit
    def _tiled_mlp_fwd_kernel(g_ptr, u_ptr, n_elements, ACT: tl.constexpr, BLOCK: tl.constexpr):
        # int64 offsets: a [chunk, I] tile can pass 2**31 elements
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n_elements
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        a, _ = _gated_act(g, ACT)
        tl.store(g_ptr + offs, (a * u).to(g_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _tiled_mlp_bwd_kernel(
        g_ptr,
        u_ptr,
        dh_ptr,
        n_elements,
        ACT: tl.constexpr,
        STORE_H: tl.constexpr,
        STORE_DU: tl.constexpr,
        STORE_DG: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # every element is read and then overwritten by the same program: the in-place stores are race-free
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n_elements
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        a, da = _gated_act(g, ACT)
        if STORE_H or STORE_DG:
            u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if STORE_DU or STORE_DG:
            dh = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if STORE_H:
            tl.store(g_ptr + offs, (a * u).to(g_ptr.dtype.element_ty), mask=mask)
        if STORE_DU:
            tl.store(u_ptr + offs, (a * dh).to(u_ptr.dtype.element_ty), mask=mask)
        if STORE_DG:
            tl.store(dh_ptr + offs, (dh * u * da).to(dh_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------------------------
# launchers (in place, on contiguous buffers of one shape)


def _check_buffers(*bufs: Tensor) -> None:
    first = bufs[0]
    for b in bufs:
        if not b.is_contiguous() or b.shape != first.shape or b.dtype != first.dtype:
            raise ValueError("tiled_mlp kernels: buffers must be contiguous and share one shape and dtype")


def fused_act_mul_(g: Tensor, u: Tensor, activation: str) -> Tensor:
    """g <- act(g) * u, in place."""
    _check_buffers(g, u)
    n = g.numel()
    _tiled_mlp_fwd_kernel[(triton.cdiv(n, _BLOCK),)](g, u, n, ACT=ACT_CODE[activation], BLOCK=_BLOCK, num_warps=8)
    return g


def fused_act_backward_(
    g: Tensor, u: Tensor, dh: Tensor | None, activation: str, store_h: bool, store_du: bool, store_dg: bool
) -> None:
    """g <- act(g) * u, u <- act(g) * dh, dh <- dh * u * act'(g), each only where asked, in place."""
    _check_buffers(g, u, *(() if dh is None else (dh,)))
    n = g.numel()
    _tiled_mlp_bwd_kernel[(triton.cdiv(n, _BLOCK),)](
        g, u, dh if dh is not None else g, n, ACT=ACT_CODE[activation],
        STORE_H=store_h, STORE_DU=store_du, STORE_DG=store_dg, BLOCK=_BLOCK, num_warps=8,
    )  # fmt: skip
