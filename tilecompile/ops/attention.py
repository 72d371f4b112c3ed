"""Custom ops for attention under a mask given by per-token tensors (kernels in tilecompile.kernels.attention).

``torch.ops.tilecompile.masked_attention(q, k, v, pos, doc, valid, lo, hi, scale) -> (out, lse)``:
q [B, H, N, D], k / v [B, Hkv, N, D] (H % Hkv == 0: GQA), pos / doc / valid optional per-token tensors
[B or 1, N]; the mask is ``lo <= c_i - c_j <= hi`` (c = pos, or the token index without pos), ``doc_i == doc_j``
and ``valid_j`` (see kernels/attention.py). ``out`` has q's shape and dtype; ``lse`` is [B, H, N] in fp32 (fp64
for fp64 inputs), +inf on a row with no allowed key, whose output is 0. Differentiable in q, k and v; the backward is
``tilecompile::masked_attention_backward``, a custom op too, so AOTAutograd and Inductor keep both opaque and
no [N, N] tensor ever exists.

CUDA takes PyTorch's flash varlen kernel when the data allow it exactly (packed documents; see
``varlen_plan``), and the chunked path otherwise; CPU always takes the chunked path.
"""

from __future__ import annotations

import torch

from tilecompile.kernels import attention as K

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_static(q, k, v, pos, doc, valid) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D [B, H, N, D]; got {q.dim()}, {k.dim()}, {v.dim()} dims")
    if q.dtype not in _FLOAT_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one float dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    b, h, n, d = q.shape
    if k.shape[0] != b or v.shape[0] != b or k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} do not fit q {tuple(q.shape)}")
    if h % k.shape[1] != 0:
        raise ValueError(f"query heads ({h}) must be a multiple of key heads ({k.shape[1]})")
    if k.shape[-1] != d:
        raise ValueError(f"k's head dim {k.shape[-1]} != q's {d}")
    for name, t in (("pos", pos), ("doc", doc), ("valid", valid)):
        if t is None:
            continue
        if t.dim() != 2 or t.shape[-1] != k.shape[2] or t.shape[0] not in (1, b):
            raise ValueError(f"{name} must be [B or 1, N] = [{b} or 1, {k.shape[2]}], got {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")


@torch.library.custom_op("tilecompile::masked_attention", mutates_args=())
def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pos: torch.Tensor | None,
    doc: torch.Tensor | None,
    valid: torch.Tensor | None,
    lo: int | None,
    hi: int | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_static(q, k, v, pos, doc, valid)
    plan = K.varlen_plan(q, k, pos, doc, valid, lo, hi)
    if plan is not None:
        return K.varlen_fwd(q, k, v, plan, lo, hi, float(scale))
    return K.chunked_fwd(q, k, v, pos, doc, valid, lo, hi, float(scale))


@masked_attention.register_fake
def _(q, k, v, pos, doc, valid, lo, hi, scale):
    _check_static(q, k, v, pos, doc, valid)
    b, h, n, _ = q.shape
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty((b, h, n, v.shape[-1])), q.new_empty((b, h, n), dtype=lse_dtype)


@torch.library.custom_op("tilecompile::masked_attention_backward", mutates_args=())
def masked_attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    pos: torch.Tensor | None,
    doc: torch.Tensor | None,
    valid: torch.Tensor | None,
    lo: int | None,
    hi: int | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    plan = K.varlen_plan(q, k, pos, doc, valid, lo, hi)
    if plan is not None:
        return K.varlen_bwd(grad_out, q, k, v, out, lse, plan, lo, hi, float(scale))
    return K.chunked_bwd(grad_out, q, k, v, out, lse, pos, doc, valid, lo, hi, float(scale))


@masked_attention_backward.register_fake
def _(grad_out, q, k, v, out, lse, pos, doc, valid, lo, hi, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # contiguous, as the kernels return


def _setup_context(ctx, inputs, output):
    q, k, v, pos, doc, valid, lo, hi, scale = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, pos, doc, valid)
    ctx.lo, ctx.hi, ctx.scale = lo, hi, scale


def _backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, pos, doc, valid = ctx.saved_tensors
    if grad_out is None or not any(ctx.needs_input_grad[:3]):
        return (None,) * 9
    dq, dk, dv = torch.ops.tilecompile.masked_attention_backward(
        grad_out.contiguous(), q, k, v, out, lse, pos, doc, valid, ctx.lo, ctx.hi, ctx.scale
    )
    needs = ctx.needs_input_grad
    return (dq if needs[0] else None), (dk if needs[1] else None), (dv if needs[2] else None), *(None,) * 6


masked_attention.register_autograd(_backward, setup_context=_setup_context)
