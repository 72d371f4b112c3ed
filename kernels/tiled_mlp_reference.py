"""The plain-PyTorch side of ``kernels/tiled_mlp.py`` and ``kernels/tiled_grouped_mlp.py`` (their module docstrings
have the math): the CPU implementation of both tiled MLP ops, and what their Triton kernels are checked against
under ``TRITON_INTERPRET=1`` (tests/test_tiled_mlp_op.py, tests/test_moe_grouped.py).

``act_into`` / ``act_backward_into`` write ``act(x)`` and ``grad * act'(x)`` into a given buffer (which may be one
of the inputs); ``act_mul_reference`` / ``act_backward_reference`` are the grouped op's chunk step on a fused
``gu`` = [g | u] with its optional row mask; ``carry_accumulate_reference`` its weight-grad accumulation.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "act_backward_into",
    "act_backward_reference",
    "act_backward_weighted_reference",
    "act_into",
    "act_mul_reference",
    "carry_accumulate_reference",
]


# ----------------------------------------------------------------------------------------------------------------
# the dense op's activation steps


def act_into(src: Tensor, out: Tensor, activation: str) -> Tensor:
    """out = act(src)."""
    if activation == "silu":
        return torch.ops.aten.silu.out(src, out=out)
    if activation == "gelu":
        return torch.ops.aten.gelu.out(src, approximate="none", out=out)
    if activation == "gelu_tanh":
        return torch.ops.aten.gelu.out(src, approximate="tanh", out=out)
    return torch.clamp_min(src, 0, out=out)


def act_backward_into(grad: Tensor, pre: Tensor, out: Tensor, activation: str) -> Tensor:
    """out = grad * act'(pre)."""
    if activation == "silu":
        return torch.ops.aten.silu_backward.grad_input(grad, pre, grad_input=out)
    if activation == "gelu":
        return torch.ops.aten.gelu_backward.grad_input(grad, pre, approximate="none", grad_input=out)
    if activation == "gelu_tanh":
        return torch.ops.aten.gelu_backward.grad_input(grad, pre, approximate="tanh", grad_input=out)
    return torch.ops.aten.threshold_backward.grad_input(grad, pre, 0, grad_input=out)


# ----------------------------------------------------------------------------------------------------------------
# the grouped op's chunk steps


def act_mul_reference(gu: Tensor, mask: Tensor | None, activation: str) -> Tensor:
    """h = act(g) * u of ``gu`` = [g | u] (zero-filled first on the rows of ``mask`` [rows, 1]); ``gu`` is left as
    it is unless masked rows are zeroed in it."""
    inter = gu.shape[1] // 2
    if mask is not None:
        gu.masked_fill_(mask, 0)
    h = act_into(gu[:, :inter], torch.empty_like(gu[:, :inter]), activation)
    return h.mul_(gu[:, inter:])


def act_backward_reference(gu: Tensor, dh: Tensor, mask: Tensor | None, activation: str) -> None:
    """In place: ``gu`` <- [dg | du], ``dh`` <- h; dg and du zero on the rows of ``mask`` (masked_fill's backward)."""
    inter = gu.shape[1] // 2
    if mask is not None:
        gu.masked_fill_(mask, 0)
    g, u = gu[:, :inter], gu[:, inter:]
    a = act_into(g, torch.empty_like(g), activation)
    du = a * dh
    dg = act_backward_into(dh * u, g, torch.empty_like(g), activation)
    torch.mul(a, u, out=dh)
    g.copy_(dg)
    u.copy_(du)
    if mask is not None:
        gu.masked_fill_(mask, 0)


def act_backward_weighted_reference(gu: Tensor, dh: Tensor, mask: Tensor | None, weight: Tensor, dw: Tensor | None,
                                    offsets: Tensor, start: int, activation: str, store_h: bool) -> None:  # fmt: skip
    """kernels/tiled_grouped_mlp.py's ``act_backward_weighted``: ``dh`` (the unscaled grad of ``h Wd``) times the
    row weight, ``act_backward_reference``, ``dw = Σ dh·h`` per row in fp32 (zero past ``offsets[-1]``), then
    ``dh <- h * weight`` if ``store_h``. Each product rounded to the compute dtype, as eager's elementwise ops."""
    raw = dh.clone()
    dh.mul_(weight)
    act_backward_reference(gu, dh, mask, activation)  # dh <- h
    if dw is not None:
        rows = torch.arange(start, start + dh.shape[0], device=dh.device, dtype=torch.int64)
        valid = (rows < offsets[-1:].to(torch.int64)).unsqueeze(1)
        dw.copy_(torch.where(valid, (raw * dh).sum(1, keepdim=True, dtype=torch.float32), 0.0))
    if store_h:
        dh.mul_(weight)


def carry_accumulate_reference(grad: Tensor, carry: Tensor, part: Tensor, offsets: Tensor, start: int, stop: int,
                               rows: int, index: int, last: bool) -> None:  # fmt: skip
    """Chunk ``index`` (rows ``start:stop``) of a weight grad into ``grad`` and the two carry slots, as
    kernels/tiled_grouped_mlp.py's ``carry_accumulate`` (whose docstring has the scheme); on the device, no sync."""
    hi = offsets.to(torch.int64).clamp(max=rows)
    lo = torch.cat((hi.new_zeros(1), hi[:-1]))
    present = lo.clamp(min=start) < hi.clamp(max=stop)
    starts, ends = present & (lo < start), present & (hi > stop)
    val = part.to(carry.dtype)
    val = torch.where(starts[:, None, None], val + carry[(index + 1) % 2], val)
    carry[index % 2] = torch.where(ends[:, None, None], val, 0).sum(0)  # at most one expert ends past the chunk
    finish = present & ~ends
    if last:  # the experts with no rows get zero
        finish = finish | (hi <= lo)
        val = torch.where((hi <= lo)[:, None, None], 0, val)
    grad.copy_(torch.where(finish[:, None, None], val.to(grad.dtype), grad))


def grouped_wgrad_reference(grad: Tensor, carry: Tensor, a: Tensor, b: Tensor, offsets: Tensor, start: int,
                            stop: int, rows: int, index: int, last: bool) -> None:  # fmt: skip
    """kernels/tiled_grouped_mlp.py's ``grouped_wgrad``: the chunk's per-expert ``aᵀ b`` (rows ``start:stop``) in
    fp32, into ``grad`` and the carry as ``carry_accumulate_reference`` puts a part."""
    at = torch.arange(start, stop, device=a.device)
    hi = offsets.to(torch.int64).clamp(max=rows)
    lo = torch.cat((hi.new_zeros(1), hi[:-1]))
    member = ((lo[:, None] <= at) & (at < hi[:, None])).float()  # [E, chunk rows]: the row is the expert's
    part = torch.einsum("er,rk,rn->ekn", member, a.float(), b.float())
    carry_accumulate_reference(grad, carry, part, offsets, start, stop, rows, index, last)


def rows_out_reference(out: Tensor, y: Tensor, weight: Tensor | None, offsets: Tensor, start: int) -> None:
    """kernels/tiled_grouped_mlp.py's ``rows_out``: ``out`` <- ``y`` (times ``weight``, as eager's ``y.mul_(w)``,
    in place: ``y`` is the caller's temporary), zero on the rows ``start + r >= offsets[-1]``; on the device, no
    sync."""
    valid = (torch.arange(start, start + out.shape[0], device=out.device) < offsets[-1]).unsqueeze(1)
    if weight is not None:
        y.mul_(weight)
    torch.where(valid, y, out.new_zeros(()), out=out)
