"""Custom ops for attention under a mask given by per-token tensors (kernels in tilecompile.kernels.attention).

``torch.ops.tilecompile.masked_attention(q, k, v, pos, doc, valid, lo, hi, scale, plan) -> (out, lse)``:
q [B, H, N, D], k / v [B, Hkv, N, D] (H % Hkv == 0: GQA), pos / doc / valid optional per-token tensors
[B or 1, N]; the mask is ``lo <= c_i - c_j <= hi`` (c = pos, or the token index without pos), ``doc_i == doc_j``
and ``valid_j`` (see kernels/attention.py). ``out`` has q's shape and dtype; ``lse`` is [B, H, N] in fp32 (fp64
for fp64 inputs), +inf on a row with no allowed key, whose output is 0. Differentiable in q, k and v; the backward is
``tilecompile::masked_attention_backward``, a custom op too, so AOTAutograd and Inductor keep both opaque and
no [N, N] tensor ever exists.

``torch.ops.tilecompile.attention_plan(pos, doc, valid, lo, hi) -> plan``: how the mask's tokens pack for flash
varlen (``kernels/attention.py: plan_tensors``), worked out once on the device with one host sync. The attention
pass puts one call beside the mask, which every layer shares, and hands its tensors to every layer's
``masked_attention(..., plan)``: no layer syncs with the host, in its forward, its recompute or its backward.

CUDA takes PyTorch's flash varlen kernel on the packed tokens when the plan is exact (padding of any side, packed
documents in any row, windows; see ``plan_tensors``); otherwise, and for dtypes or head dims flash does not take,
the chunked path. CPU always takes the chunked path. ``PATHS`` counts the calls of each path.
"""

from __future__ import annotations

import torch

from tilecompile.kernels import attention as attention_kernels
from tilecompile.ops import define_op

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# Calls of each path since the process started (forward and backward): ``flash`` or ``chunked``.
PATHS: dict[str, int] = {"flash": 0, "chunked": 0}


def _token_batch(pos, doc, valid) -> tuple[int, int, torch.device]:
    tokens = [t for t in (pos, doc, valid) if t is not None]
    if not tokens:
        raise ValueError("attention_plan needs at least one of pos, doc, valid")
    n = tokens[0].shape[-1]
    for t in tokens:
        if t.dim() != 2 or t.shape[-1] != n or t.device != tokens[0].device:
            raise ValueError(
                f"pos, doc, valid must be [B or 1, N] on one device; got {[tuple(x.shape) for x in tokens]}"
            )
    return max(t.shape[0] for t in tokens), n, tokens[0].device


@torch.library.custom_op("tilecompile::attention_plan", mutates_args=())
def attention_plan(
    pos: torch.Tensor | None, doc: torch.Tensor | None, valid: torch.Tensor | None, lo: int | None, hi: int | None
) -> list[torch.Tensor]:
    b, n, device = _token_batch(pos, doc, valid)
    return list(attention_kernels.plan_tensors(pos, doc, valid, lo, hi, b, n, device))


def plan_fakes(like: torch.Tensor, t) -> list[torch.Tensor]:
    """Empty tensors of the plan's shapes for ``t`` tokens, made from ``like`` (a fake tensor in fake mode)."""
    return [
        like.new_empty(t, dtype=torch.long),
        like.new_empty(t, dtype=torch.long),
        like.new_empty(t, dtype=torch.int8),
        like.new_empty(t + 2, dtype=torch.int32),
        like.new_empty(t + 2, dtype=torch.int32),
        like.new_empty(14, dtype=torch.long, device="cpu"),
        like.new_empty((4, 3 * t + 3), dtype=torch.int32),
        like.new_empty((2, t), dtype=torch.long),
    ]


@attention_plan.register_fake
def _(pos, doc, valid, lo, hi):
    b, n, _ = _token_batch(pos, doc, valid)
    return plan_fakes(next(x for x in (pos, doc, valid) if x is not None), b * n)


def _packed(q, k, v, pos, doc, valid, lo, hi, plan):
    """flash varlen's arguments when it computes this mask exactly on these inputs, else None. Without a plan made
    for these tokens (the op called directly, or a plan over batch-1 tokens shared by B > 1 rows), the plan is made
    here, at one host sync."""
    if not attention_kernels.flash_supported(q, k, v) or (lo not in (0, None)) or (hi is not None and hi < 0):
        return None
    b, _, n, _ = q.shape
    if plan and plan[0].numel() == b * n:
        return attention_kernels.packed(plan, b, n)
    if pos is None and doc is None and valid is None:  # a window over the index alone: one segment a row
        return attention_kernels.packed(_static_plan(b, n, q.device), b, n)
    return attention_kernels.packed(attention_kernels.plan_tensors(pos, doc, valid, lo, hi, b, n, q.device), b, n)


def _static_plan(b: int, n: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    t = b * n
    ar = torch.arange(t, device=device)
    cu = torch.nn.functional.pad(torch.arange(0, t + 1, n, device=device, dtype=torch.int32), (0, t + 1 - b))
    region = torch.zeros(t, dtype=torch.int8, device=device)
    info = torch.tensor([0, b, t, 0, n, 0, 1] + [0] * 7)
    ncu = torch.zeros(4, 3 * t + 3, dtype=torch.int32, device=device)
    return ar, ar, region, cu, cu, info, ncu, ar.expand(2, t)


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
    plan: list[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_static(q, k, v, pos, doc, valid)
    pk = _packed(q, k, v, pos, doc, valid, lo, hi, plan)
    if pk is not None:
        PATHS["flash"] += 1
        return attention_kernels.packed_fwd(q, k, v, pk, lo, hi, float(scale))
    PATHS["chunked"] += 1
    return attention_kernels.chunked_fwd(q, k, v, pos, doc, valid, lo, hi, float(scale))


@masked_attention.register_fake
def _(q, k, v, pos, doc, valid, lo, hi, scale, plan):
    _check_static(q, k, v, pos, doc, valid)
    b, h, n, _ = q.shape
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return attention_kernels.token_major(q, b, h, n, v.shape[-1]), q.new_empty((b, h, n), dtype=lse_dtype)


def _attention_backward(grad_out, q, k, v, out, lse, pos, doc, valid, lo, hi, scale, plan):
    pk = _packed(q, k, v, pos, doc, valid, lo, hi, plan)
    if pk is not None:
        PATHS["flash"] += 1
        return attention_kernels.packed_bwd(grad_out, q, k, v, out, lse, pk, lo, hi, float(scale))
    PATHS["chunked"] += 1
    return attention_kernels.chunked_bwd(grad_out, q, k, v, out, lse, pos, doc, valid, lo, hi, float(scale))


# (dq, dk, dv) of masked_attention, in the layout every path returns
masked_attention_backward = define_op(
    "masked_attention_backward",
    "(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? pos, Tensor? doc, "
    "Tensor? valid, SymInt? lo, SymInt? hi, float scale, Tensor[] plan) -> (Tensor, Tensor, Tensor)",
    _attention_backward,
    lambda grad_out, q, k, v, *_: tuple(attention_kernels.token_major(t, *t.shape) for t in (q, k, v)),
)


def _setup_context(ctx, inputs, output):
    q, k, v, pos, doc, valid, lo, hi, scale, plan = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, pos, doc, valid, *plan)
    ctx.lo, ctx.hi, ctx.scale = lo, hi, scale


def _backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, pos, doc, valid, *plan = ctx.saved_tensors
    no_plan = [None] * len(plan)
    if grad_out is None or not any(ctx.needs_input_grad[:3]):
        return (None,) * 9 + (no_plan,)
    dq, dk, dv = torch.ops.tilecompile.masked_attention_backward(
        grad_out, q, k, v, out, lse, pos, doc, valid, ctx.lo, ctx.hi, ctx.scale, plan
    )
    needs = ctx.needs_input_grad
    return (dq if needs[0] else None), (dk if needs[1] else None), (dv if needs[2] else None), *(None,) * 6, no_plan


masked_attention.register_autograd(_backward, setup_context=_setup_context)
