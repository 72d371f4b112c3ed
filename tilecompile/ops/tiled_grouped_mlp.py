"""Tiled grouped (MoE expert) gated MLP: per expert, ``y = act(x Wg[e]) * (x Wu[e]) Wd[e]`` over token chunks.

The rows of ``x`` [S, D] are grouped by expert, as ``grouped_mm`` takes them: ``offsets`` [E] holds the cumulative
row counts (``offsets[e]`` ends expert ``e``'s rows; an expert with no rows has ``offsets[e] == offsets[e - 1]``).
The weights are in ``grouped_mm``'s layout, ``[E, in, out]`` (``x @ W[e]``): gate and up [E, D, I], down
[E, I, D_out]. With ``up_weight`` None, ``gate_weight`` is the stacked [E, D, 2I] weight ``[gate | up]`` (HF's
``gate_up_proj``, as its experts pass it to ``grouped_mm``), taken by one GEMM and its grad returned whole, in the
stacked weight's own layout, where two views of it would get two grads that autograd sums into the parameter by a
copy. Rows at or past ``offsets[-1]`` belong to no expert: their output (and their dx) is zero
(``grouped_mm`` leaves them undefined; HF's fallback zeros them).

``row_mask`` (optional, bool [S, 1] or [S]) is ``masked_fill(proj, row_mask, 0)`` between the gate/up projection
and the activation, as HF's grouped_mm experts write it for expert-parallel sentinel rows (transformers 5.17
always, 5.18+ under expert parallelism): the op zeroes a masked row's ``g`` and ``u`` after the GEMMs, so its
``h = act(0) * 0`` and its output are what eager computes, and in backward zeroes its ``dg`` and ``du`` (the
masked_fill's backward) before they reach ``dx`` and the gate/up weight grads. Any row may be masked, inside an
expert's group or past ``offsets[-1]``; no host sync (elementwise fills of slices).

``row_weight`` (optional, [S, 1] or [S], x's dtype) scales each row's output: ``y = (h Wd[e]) * w``, the routing
weight multiply HF writes after the down projection (``proj_out * sample_weights_g.unsqueeze(-1)``), in eager's
rounding order (the product rounded, then scaled). Inside the op, its backward needs only what the op saves; left
outside, the multiply's backward needs the op's output ([S, D] saved per layer), and under activation checkpointing
the recompute has to run the whole op forward again to make it. Its grad is ``dw = Σ_j dy·(h Wd) = Σ_k (dy Wdᵀ)·h``
per row (the second form needs no GEMM: ``dy Wdᵀ`` is the backward's ``dh`` before scaling), summed in fp32.

Forward, for each expert and each chunk of its rows: ``g = xc Wg[e]``, ``u = xc Wu[e]`` (masked rows zeroed),
``h = act(g) * u``, ``y = h Wd[e]`` (times the row weight). Saved for backward: ``x``, ``offsets``, the weights,
the row mask and the row weight, never an [S, I] tensor.

Backward (``tilecompile::tiled_grouped_mlp_backward``), per expert and chunk: recompute ``g`` and ``u`` (masked
rows zeroed), then

    dh = dy Wd[e]ᵀ                 dWd[e] += hᵀ dy
    du = dh * act(g)               dWu[e] += xcᵀ du
    dg = dh * u * act'(g)          dWg[e] += xcᵀ dg
    dx = du Wu[e]ᵀ + dg Wg[e]ᵀ

with ``du`` and ``dg`` zero on masked rows; with a row weight, ``dw = Σ_k dh·h`` first, then ``dh *= w`` and
``dWd[e] += (h * w)ᵀ dy``.

Weight grads accumulate across chunks in fp32 (``grad_accum="fp32"``; fp64 stays fp64) or in the parameter dtype
(``"param"``) and are returned from the backward op, one per weight input (a stacked gate_up's whole; gate and up
given as two views of one stacked parameter get one each, which autograd sums into it), so ``AccumulateGrad`` sees
ordinary grads.

Live memory per chunk: four [chunk, I] tensors in the compute dtype, as the dense op (tilecompile/ops/tiled_mlp.py,
whose ``chunk_size_for`` sizes the chunk from ``budget_mb``).

Dtypes: like ``grouped_mm`` (which is not an autocast op), the op computes in its inputs' one dtype and has no
autocast kernel; HF casts ``x`` to the weights' dtype before each ``grouped_mm``, and the graph keeps that cast.

Two paths, the same math:

- the grouped path (``grouped_mm`` over token chunks, no host sync), where ``torch._grouped_mm`` takes the operands:
  bf16 on CUDA (fp32, bf16 and fp16 on CPU), every row and weight stride a multiple of 16 bytes. The rows are cut
  into fixed chunks of ``chunk`` rows (their number is known from ``x``'s shape, not from the offsets; from the
  budget, as few as its chunk allows, split evenly: ``_grouped_chunk``); a chunk's
  offsets are ``clamp(offsets - start, 0, rows)``, computed on the device, so an expert whose rows cross a chunk
  edge is split between the two chunks' grouped GEMMs and no row count is read on the host. Per chunk, forward:
  ``gu = grouped_mm(xc, [Wg | Wu])`` [rows, 2I] (one GEMM when gate and up are the two halves of one stacked
  weight, HF's ``gate_up_proj``), ``h = act(g) * u`` (one Triton kernel on CUDA, kernels/tiled_grouped_mlp.py),
  ``y = grouped_mm(h, Wd)``. Backward: ``gu`` again, ``dh = grouped_mm(dy, Wdᵀ)``, one kernel for ``h``, ``dg``,
  ``du``, then ``dx = grouped_mm([dg | du], [Wg | Wu]ᵀ)`` and the weight grads ``grouped_mm(xcᵀ, dg)`` ... (the
  grouped GEMM that reduces over each expert's rows, [E, K, N]; for a stacked gate_up one, ``xcᵀ [dg | du]``).
  Each chunk's ``y`` (times the row weight) and ``dx`` go into the op's rows with the rows past ``offsets[-1]``
  zeroed on the device (a ``where``, or the ``rows_out`` kernel under ``USE_ROWS_KERNEL``). Live per chunk:
  [rows, 2I] + [rows, I] in the compute dtype and, where the grouped_wgrad kernel does not run
  (``wgrad_kernel_runs``), one [E, K, N] weight grad of the chunk.
  Weight grads: with one chunk, ``grouped_mm``'s own (it accumulates in fp32 inside the GEMM, as unchunked); with
  several, each chunk's [E, K, N] grad (rounded to the compute dtype by ``grouped_mm``, which has no fp32 output
  on CUDA) goes straight into the grad, in the parameter's dtype, by one Triton kernel on CUDA that touches only
  the experts with rows in the chunk. The rows are grouped by expert, so only the expert crossing a chunk edge
  needs a sum over chunks. It is carried from chunk to chunk in two [K, N] slots, in fp32 with
  ``grad_accum="fp32"`` and in the parameter's dtype with ``"param"``. There is no [E, K, N] accumulator, and no
  zeroing or final cast of one. The grads are what such an accumulator gives, bit for bit. An expert whose rows lie
  in one chunk gets exactly ``grouped_mm``'s grad; an expert cut by chunk edges gets its parts summed in chunk
  order and rounded once.
  ``offsets`` are not validated on this path (that needs the host); ``grouped_mm`` trusts them too.
- the loop path (per expert, per chunk, ``torch.mm``) for everything else (fp64, odd strides): it reads the expert
  boundaries with ``offsets.tolist()``, one host sync per call on CUDA (HF's ``grouped_mm_fallback`` does the
  same), and validates them.

FLOPs (forward + backward, S routed rows): 2·S·D·I·(3 forward + 2 recompute + 6 backward) = 22·S·D·I against
18·S·D·I for ``grouped_mm`` unchunked (which saves [S, 2I] and [S, I] activations instead of recomputing them).
Under activation checkpointing the unchunked experts' forward runs twice (24·S·D·I); the op's need not, where
nothing but the op's backward reads what it saves (so ``row_weight``: the routing-weight multiply's backward would
need the output), and stays at 22.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tilecompile.kernels import tiled_grouped_mlp as grouped_kernels
from tilecompile.kernels import tiled_mlp_reference as mlp_reference
from tilecompile.ops import define_op
from tilecompile.ops.tiled_mlp import _acc_dtype, _accumulate_mm, _finish_grad, check_options, chunk_size_for

__all__ = ["tiled_grouped_mlp"]


def _check(x, offsets, gate_weight, up_weight, down_weight, activation, chunk_tokens=0, budget_mb=256,
           grad_accum="fp32", row_mask=None, row_weight=None):  # fmt: skip
    """The forward's operands as the schema (``_OPERANDS``) takes them, its defaults too (the dispatcher leaves off
    trailing arguments equal to their defaults): a ValueError naming what is wrong."""
    name = "tiled_grouped_mlp"
    check_options(name, activation, chunk_tokens, budget_mb, grad_accum)
    up_dims = 3 if up_weight is None else up_weight.dim()
    if x.dim() != 2 or gate_weight.dim() != 3 or up_dims != 3 or down_weight.dim() != 3:
        raise ValueError(f"{name}: x must be [S, D] and the weights [E, in, out]")
    if offsets.dim() != 1 or offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: offsets must be a 1-D int32/int64 tensor, got {offsets.dtype} {offsets.shape}")
    if up_weight is None and gate_weight.shape[2] % 2:
        raise ValueError(
            f"{name}: with up_weight None, gate_weight is the stacked [E, D, 2I] [gate | up] weight; its last dim "
            f"must be even, got {tuple(gate_weight.shape)}"
        )
    gate_weight, up_weight, _ = _weights(gate_weight, up_weight)
    e, d, i = gate_weight.shape
    if (
        tuple(up_weight.shape) != (e, d, i)
        or down_weight.shape[:2] != (e, i)
        or x.shape[1] != d
        or offsets.shape[0] != e
    ):
        raise ValueError(
            f"{name}: shapes do not chain: x {tuple(x.shape)}, offsets {tuple(offsets.shape)}, gate "
            f"{tuple(gate_weight.shape)}, up {tuple(up_weight.shape)}, down {tuple(down_weight.shape)}"
        )
    if len({t.dtype for t in (x, gate_weight, up_weight, down_weight)}) != 1:
        raise ValueError(
            f"{name}: x and the weights must share one dtype (as grouped_mm's operands), got "
            f"{[t.dtype for t in (x, gate_weight, up_weight, down_weight)]}"
        )
    if row_mask is not None and (
        row_mask.dtype != torch.bool or tuple(row_mask.shape) not in ((x.shape[0], 1), (x.shape[0],))
    ):
        raise ValueError(
            f"{name}: row_mask must be a bool [S, 1] or [S] mask of x's rows, got {row_mask.dtype} "
            f"{tuple(row_mask.shape)} for x {tuple(x.shape)}"
        )
    if row_weight is not None and (
        row_weight.dtype != x.dtype or tuple(row_weight.shape) not in ((x.shape[0], 1), (x.shape[0],))
    ):
        raise ValueError(
            f"{name}: row_weight must be an [S, 1] or [S] weight per row of x in x's dtype, got {row_weight.dtype} "
            f"{tuple(row_weight.shape)} for x {x.dtype} {tuple(x.shape)}"
        )


def _weights(gate_weight: Tensor, up_weight: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
    """(gate [E, D, I], up [E, D, I], the stacked [E, D, 2I] weight or None): with ``up_weight`` None, gate and up
    are the two halves of ``gate_weight``."""
    if up_weight is None:
        i = gate_weight.shape[2] // 2
        return gate_weight[..., :i], gate_weight[..., i:], gate_weight
    return gate_weight, up_weight, None


def _rows(t: Tensor | None) -> Tensor | None:
    """A row mask or row weight as [S, 1], a view that broadcasts over a chunk's columns."""
    return None if t is None else t.reshape(-1, 1)


def _bounds(offsets: Tensor, rows: int) -> list[tuple[int, int]]:
    """(start, stop) rows of each expert, read from the cumulative ``offsets``."""
    ends = [int(v) for v in offsets.tolist()]
    starts = [0, *ends[:-1]]
    if any(b < a for a, b in zip(starts, ends)) or (ends and (ends[0] < 0 or ends[-1] > rows)):
        raise ValueError(f"tiled_grouped_mlp: offsets must be non-decreasing in [0, {rows}], got {ends}")
    return list(zip(starts, ends))


def _chunk(rows: int, intermediate: int, dtype: torch.dtype, chunk_tokens: int, budget_mb: int) -> int:
    return chunk_tokens if chunk_tokens > 0 else chunk_size_for(rows, intermediate, dtype, budget_mb)


def _grouped_chunk(rows: int, intermediate: int, dtype: torch.dtype, chunk_tokens: int, budget_mb: int) -> int:
    """The grouped path's rows per chunk: ``chunk_tokens`` as given, else the fewest chunks that the budget's chunk
    allows, split evenly (a multiple of 64, never above the budget's). The budget's chunk with the rest in a last
    chunk leaves a sliver: 262,144 rows (32k tokens, top 8, I 768) made six chunks of 43,648 and one of 256, which
    cost a whole chunk's launches and weight-grad passes for 0.1% of the rows."""
    if chunk_tokens > 0:
        return chunk_tokens
    most = chunk_size_for(rows, intermediate, dtype, budget_mb)
    count = max(1, -(-rows // most))
    return min(most, max(64, -(-rows // (count * 64)) * 64))


# ----------------------------------------------------------------------------------------------------------------
# the grouped path: grouped_mm over fixed token chunks, no host sync

USE_GROUPED = True  # module switch (benchmarks and tests compare both paths)
USE_TRITON = True  # the grouped path's elementwise kernels on CUDA (else their PyTorch reference)
_TRITON_ON_CPU = False  # tests flip this under TRITON_INTERPRET=1 to run the kernels on CPU tensors
# over several chunks, on CUDA: the weight grads by grouped_wgrad (else grouped_mm's [E, K, N] part, then the carry).
# On since its H100 run of 2026-12-07 (bench_moe_op.py: the same grads as the old way, 24.0 ms against 24.7)
USE_WGRAD_KERNEL = True
# on CUDA: a chunk's y and dx into the op's rows by the rows_out kernel (else a broadcast torch.where: 2.9 ms of the
# op's 22.8 on the H100). On since its H100 run of 2026-12-07: benchmarks/check_moe_rows.py's max rel err 7.7e-3
# against grouped_mm in bf16, the tail rows zero; in the op's profile 1.45 ms against the where's 2.9
USE_ROWS_KERNEL = True
_GROUPED_DTYPES = {"cuda": (torch.bfloat16,), "cpu": (torch.float32, torch.bfloat16, torch.float16)}


def _aligned(t: Tensor) -> bool:
    """Row- or column-major in the last two dims, the other stride and the start a multiple of 16 bytes (as
    ``grouped_mm`` requires)."""
    if t.dim() < 2 or t.data_ptr() % 16:
        return False
    per = 16 // t.element_size()
    rows, cols = t.stride()[-2], t.stride()[-1]
    return (cols == 1 and rows % per == 0) or (rows == 1 and cols % per == 0)


def _fused_gate_up(gate_weight: Tensor, up_weight: Tensor) -> Tensor | None:
    """The [E, D, 2I] view of which gate and up are the two halves (HF's stacked ``gate_up_proj``), or None."""
    e, d, i = gate_weight.shape
    if gate_weight.stride() != up_weight.stride() or gate_weight.dtype != up_weight.dtype or i == 0:
        return None
    if not torch._C._is_alias_of(up_weight, gate_weight):  # not views of one storage
        return None
    if up_weight.storage_offset() != gate_weight.storage_offset() + i * gate_weight.stride(2):
        return None
    return gate_weight.as_strided((e, d, 2 * i), gate_weight.stride())


def _grouped_ok(x: Tensor, gate_weight: Tensor, up_weight: Tensor, down_weight: Tensor) -> bool:
    """Whether the grouped path takes these operands (``grouped_mm``'s dtypes and alignment, x's rows included)."""
    if not USE_GROUPED or not hasattr(torch, "_grouped_mm") or x.dtype not in _GROUPED_DTYPES.get(x.device.type, ()):
        return False
    per = 16 // x.element_size()
    sizes_ok = all(n % per == 0 for n in (x.shape[1], gate_weight.shape[2], down_weight.shape[2]))
    return sizes_ok and x.stride(1) == 1 and all(_aligned(t) for t in (x, gate_weight, up_weight, down_weight))


def _use_triton(t: Tensor) -> bool:
    return grouped_kernels.HAS_TRITON and USE_TRITON and (t.is_cuda or _TRITON_ON_CPU)


def wgrad_kernel_runs(device: torch.device) -> bool:
    """Whether the grouped path's weight grads over several chunks come from the grouped_wgrad kernel on ``device``
    (no [E, K, N] part of the chunk from ``grouped_mm``); the experts pass's ``op_bytes`` asks too."""
    on_device = device.type == "cuda" or _TRITON_ON_CPU
    return grouped_kernels.HAS_TRITON and USE_TRITON and USE_WGRAD_KERNEL and on_device


def _act_mul(gu: Tensor, mask: Tensor | None, activation: str) -> Tensor:
    if _use_triton(gu) and gu.is_contiguous():  # grouped_mm may pad its output's rows: then the reference
        return grouped_kernels.act_mul(gu, mask, activation)
    return mlp_reference.act_mul_reference(gu, mask, activation)


def _act_backward(gu: Tensor, dh: Tensor, mask: Tensor | None, activation: str) -> None:
    if _use_triton(gu) and gu.is_contiguous() and dh.is_contiguous():
        grouped_kernels.act_backward(gu, dh, mask, activation)
    else:
        mlp_reference.act_backward_reference(gu, dh, mask, activation)


def _act_backward_weighted(gu: Tensor, dh: Tensor, mask: Tensor | None, weight: Tensor, dw: Tensor | None,
                           offsets: Tensor, start: int, activation: str, store_h: bool) -> None:  # fmt: skip
    """With the row weight: ``gu`` <- [dg | du] of ``dh * weight``, ``dw`` <- ``Σ dh·h`` per row, ``dh`` <- ``h *
    weight`` (``dh`` the unscaled grad of ``h Wd``); one kernel on CUDA."""
    args = (gu, dh, mask, weight, dw, offsets, start, activation, store_h)
    dtypes_ok = weight.dtype in (torch.float32, torch.bfloat16, torch.float16)
    if _use_triton(gu) and gu.is_contiguous() and dh.is_contiguous() and dtypes_ok:
        grouped_kernels.act_backward_weighted(*args)
    else:
        mlp_reference.act_backward_weighted_reference(*args)


def _carry_accumulate(grad: Tensor, carry: Tensor, part: Tensor, offsets: Tensor, start: int, stop: int, rows: int,
                      index: int, last: bool) -> None:  # fmt: skip
    args = (grad, carry, part, offsets, start, stop, rows, index, last)
    if _use_triton(grad) and grad.is_contiguous() and part.is_contiguous():
        grouped_kernels.carry_accumulate(*args)
    else:
        mlp_reference.carry_accumulate_reference(*args)


def _rows_out(out: Tensor, y: Tensor, weight: Tensor | None, offsets: Tensor, start: int) -> None:
    """A chunk's grouped_mm output into the op's rows, times the row weight, zero past offsets[-1]."""
    fp32_product = weight is None or weight.dtype in (torch.float32, torch.bfloat16, torch.float16)
    kernel = (USE_ROWS_KERNEL or not y.is_cuda) and _use_triton(y)  # on a CPU: the interpreter's tests
    if kernel and out.is_contiguous() and y.stride(1) == 1 and fp32_product:  # eager's product: in fp32
        grouped_kernels.rows_out(out, y, weight, offsets, start)
    else:
        mlp_reference.rows_out_reference(out, y, weight, offsets, start)


def _transposed(w: Tensor) -> bool:
    """Whether ``w`` [E, K, N] is column-major in its last two dims (HF passes its [E, N, K] parameters transposed):
    its grad is then made in that layout too, so that autograd's transpose back to the parameter is a view, not an
    [E, K, N] copy (two per layer at Qwen3-30B-A3B's shape took 18 ms of a 550 ms step on the H100)."""
    return w.stride(-2) == 1 and w.stride(-1) != 1


def _empty_grad(w: Tensor, dtype: torch.dtype, zero: bool = False) -> Tensor:
    """A weight grad buffer [E, K, N] with ``w``'s layout (``_transposed``), in ``dtype``."""
    e, k, n = w.shape
    make = torch.zeros if zero else torch.empty
    if _transposed(w):
        return make((e, n, k), device=w.device, dtype=dtype).transpose(-2, -1)
    return make((e, k, n), device=w.device, dtype=dtype)


def _chunks(offsets: Tensor, n: int, chunk: int):
    """(start, stop, the chunk's offsets clamped to its rows) per chunk of ``chunk`` rows; the offsets int32 on the
    device."""
    offs = offsets.to(torch.int32)
    for s in range(0, n, chunk):
        t = min(s + chunk, n)
        yield s, t, (offs - s).clamp_(0, t - s)


def _gate_up(xc: Tensor, local: Tensor, fused: Tensor | None, gate_weight: Tensor, up_weight: Tensor) -> Tensor:
    """[g | u] of a chunk, [rows, 2I] contiguous."""
    if fused is not None:
        return torch._grouped_mm(xc, fused, local)
    return torch.cat((torch._grouped_mm(xc, gate_weight, local), torch._grouped_mm(xc, up_weight, local)), dim=1)


def _grouped_forward(x, offsets, gate_weight, up_weight, down_weight, activation, chunk, mask, weight) -> Tensor:
    n, d_out = x.shape[0], down_weight.shape[2]
    out = x.new_empty((n, d_out))
    fused = _fused_gate_up(gate_weight, up_weight)
    offs = offsets.to(torch.int32)
    for s, t, local in _chunks(offs, n, chunk):
        gu = _gate_up(x[s:t], local, fused, gate_weight, up_weight)
        h = _act_mul(gu, None if mask is None else mask[s:t], activation)
        del gu
        y = torch._grouped_mm(h, down_weight, local)
        # eager's order: the product rounded, then scaled; grouped_mm leaves rows past offsets[-1] undefined, the
        # op's are zero
        _rows_out(out[s:t], y, None if weight is None else weight[s:t], offs, s)
    return out


def _grouped_backward(grad_out, x, offsets, gate_weight, up_weight, down_weight, activation, chunk, grad_accum,
                      needs, mask, weight, stacked):  # fmt: skip
    """With ``stacked`` (the [E, D, 2I] weight of which gate and up are the halves, ``_weights``), its grad comes
    whole in the gate's place, from one weight-grad GEMM per chunk over [dg | du], and the up's is not made."""
    need_x, need_wg, need_wu, need_wd, need_w = needs
    n, i = x.shape[0], gate_weight.shape[2]
    fused = _fused_gate_up(gate_weight, up_weight)
    chunks = -(-n // chunk)
    dx = x.new_empty(x.shape) if need_x else None
    dw = weight.new_empty(weight.shape) if need_w else None
    # one chunk: grouped_mm's weight grads are the grads (accumulated in fp32 inside the GEMM, as unchunked);
    # several: each chunk's grad goes into the grad, in the parameter's dtype, through a carry of two [K, N] slots
    # in the accumulation dtype for the experts cut by chunk edges (kernels/tiled_grouped_mlp.py). A grad in the
    # transposed layout (``_transposed``) is made as the transposed problem, [E, N, K] = bᵀ a per expert, contiguous.
    if stacked is not None:
        wanted = {"gu": (need_wg, stacked), "d": (need_wd, down_weight)}
    else:
        wanted = {"g": (need_wg, gate_weight), "u": (need_wu, up_weight), "d": (need_wd, down_weight)}
    flip = {k: _transposed(w) for k, (_, w) in wanted.items()}
    grads: dict[str, Tensor | None] = {k: None for k in wanted}  # contiguous, [E, N, K] where flipped
    carries: dict[str, Tensor] = {}
    offs = offsets.to(torch.int32)
    if chunks != 1:
        for k, (need, w) in wanted.items():
            if need:
                e, rows_k, cols_n = w.shape  # the problem's own [E, K, N], or [E, N, K] where flipped
                grads[k] = w.new_empty((e, cols_n, rows_k) if flip[k] else (e, rows_k, cols_n))
                carries[k] = grads[k].new_empty((2, *grads[k].shape[1:]), dtype=_acc_dtype(w, grad_accum))

    def add_grad(key: str, a: Tensor, b: Tensor, local: Tensor, index: int, s: int, t: int) -> None:
        """The chunk's weight grad aᵀ b per expert (bᵀ a where flipped), into the grad."""
        if flip[key]:
            a, b = b, a
        if chunks != 1 and wgrad_kernel_runs(a.device):  # the GEMM and the carry in one kernel
            grouped_kernels.grouped_wgrad(grads[key], carries[key], a, b, offs, s, t, n, index, index == chunks - 1)
            return
        part = torch._grouped_mm(a.t(), b, local)
        if chunks == 1:
            grads[key] = part
        else:
            _carry_accumulate(grads[key], carries[key], part, offs, s, t, n, index, index == chunks - 1)

    need_dgu = need_x or need_wg or need_wu
    for index, (s, t, local) in enumerate(_chunks(offs, n, chunk)):
        xc, dyc = x[s:t], grad_out[s:t]
        gu = _gate_up(xc, local, fused, gate_weight, up_weight)
        dh = torch._grouped_mm(dyc, down_weight.transpose(-2, -1), local)
        mc = None if mask is None else mask[s:t]
        if weight is None:
            _act_backward(gu, dh, mc, activation)  # gu <- [dg | du], dh <- h
        else:  # y = (h Wd) * w: d(h Wd) = dy * w, so [dg | du] from (dy Wdᵀ) * w; dw = Σ_j dy·(h Wd) = Σ_k (dy Wdᵀ)·h
            # (zero past offsets[-1]); dWd = hᵀ (dy * w) = (h * w)ᵀ dy
            dwc = dw[s:t] if need_w else None
            _act_backward_weighted(gu, dh, mc, weight[s:t], dwc, offs, s, activation, need_wd)
        if need_wd:
            add_grad("d", dh, dyc, local, index, s, t)
        del dh
        if stacked is not None and need_wg:
            add_grad("gu", xc, gu, local, index, s, t)
        if stacked is None and need_wg:
            add_grad("g", xc, gu[:, :i], local, index, s, t)
        if stacked is None and need_wu:
            add_grad("u", xc, gu[:, i:], local, index, s, t)
        if need_x and need_dgu:
            if fused is not None:
                dxc = torch._grouped_mm(gu, fused.transpose(-2, -1), local)
            else:
                dxc = torch._grouped_mm(gu[:, :i], gate_weight.transpose(-2, -1), local)
                dxc += torch._grouped_mm(gu[:, i:], up_weight.transpose(-2, -1), local)
            _rows_out(dx[s:t], dxc, None, offs, s)
        del gu
    for k in grads:
        if grads[k] is not None and flip[k]:
            grads[k] = grads[k].transpose(-2, -1)
    if stacked is not None:
        g_wg = _finish_grad(grads["gu"], stacked, x) if need_wg else x.new_empty((0,))
    else:
        g_wg = _finish_grad(grads["g"], gate_weight, x) if need_wg else x.new_empty((0,))
    g_wu = _finish_grad(grads["u"], up_weight, x) if need_wu and stacked is None else x.new_empty((0,))
    g_wd = _finish_grad(grads["d"], down_weight, x) if need_wd else x.new_empty((0,))
    return (dx if dx is not None else x.new_empty((0,))), g_wg, g_wu, g_wd, (dw if need_w else x.new_empty((0,)))


# ----------------------------------------------------------------------------------------------------------------
# forward op


# x [S, D] routed rows sorted by expert, offsets [E] their cumulative counts, weights [E, in, out] (grouped_mm's
# layout; up_weight None: gate_weight is the stacked [E, D, 2I] [gate | up]); chunk_tokens 0: from budget_mb;
# row_mask [S, 1] or [S]: rows whose gate and up count as zero; row_weight [S, 1] or [S]: each row's output scaled
# by it (the routing weight).
_OPERANDS = (
    "Tensor x, Tensor offsets, Tensor gate_weight, Tensor? up_weight, Tensor down_weight, str activation, "
    "SymInt chunk_tokens=0, SymInt budget_mb=256, str grad_accum='fp32', Tensor? row_mask=None, "
    "Tensor? row_weight=None"
)


def _forward(x, offsets, gate_weight, up_weight, down_weight, activation, chunk_tokens=0, budget_mb=256,
             grad_accum="fp32", row_mask=None, row_weight=None):  # fmt: skip
    _check(*(x, offsets, gate_weight, up_weight, down_weight, activation), chunk_tokens, budget_mb, grad_accum,
           row_mask, row_weight)  # fmt: skip
    mask, weight = _rows(row_mask), _rows(row_weight)
    gate_weight, up_weight, _ = _weights(gate_weight, up_weight)  # two views of a stacked weight: one GEMM
    n, i, d_out = x.shape[0], gate_weight.shape[2], down_weight.shape[2]
    if _grouped_ok(x, gate_weight, up_weight, down_weight):
        chunk = _grouped_chunk(n, i, x.dtype, chunk_tokens, budget_mb)
        return _grouped_forward(x, offsets, gate_weight, up_weight, down_weight, activation, chunk, mask, weight)
    out = x.new_zeros((n, d_out))  # rows past offsets[-1] belong to no expert: zero
    bounds = _bounds(offsets, n)
    chunk = _chunk(n, i, x.dtype, chunk_tokens, budget_mb)
    g_buf = x.new_empty((min(chunk, n), i))
    u_buf = x.new_empty((min(chunk, n), i))
    for e, (lo, hi) in enumerate(bounds):
        wg, wu, wd = gate_weight[e], up_weight[e], down_weight[e]
        for s in range(lo, hi, chunk):
            t = min(s + chunk, hi)
            xc, g, u = x[s:t], g_buf[: t - s], u_buf[: t - s]
            torch.mm(xc, wg, out=g)
            torch.mm(xc, wu, out=u)
            if mask is not None:  # masked_fill(proj, mask, 0): h = act(0) * 0 on a masked row
                g.masked_fill_(mask[s:t], 0)
                u.masked_fill_(mask[s:t], 0)
            mlp_reference.act_into(g, g, activation).mul_(u)
            torch.mm(g, wd, out=out[s:t])
            if weight is not None:
                out[s:t].mul_(weight[s:t])
    return out


def _fake_forward(*operands):
    _check(*operands)
    x, down_weight = operands[0], operands[4]
    return x.new_empty((x.shape[0], down_weight.shape[2]))


_tiled_grouped_mlp_op = define_op("tiled_grouped_mlp", f"({_OPERANDS}) -> Tensor", _forward, _fake_forward)


# ----------------------------------------------------------------------------------------------------------------
# backward op. needs_grad = [x, gate_weight, up_weight, down_weight, row_weight]; a grad not needed comes back as
# an empty placeholder tensor, turned into None by the autograd wiring.


_GRAD_OPERANDS = (
    "Tensor grad_out, Tensor x, Tensor offsets, Tensor gate_weight, Tensor? up_weight, Tensor down_weight, "
    "str activation, SymInt chunk_tokens, SymInt budget_mb, str grad_accum, bool[] needs_grad, Tensor? row_mask=None, "
    "Tensor? row_weight=None"
)


def _needs(needs_grad, up_weight, row_weight) -> list[bool]:
    needs = ([bool(v) for v in needs_grad] + [False] * 5)[:5]
    needs[2] = needs[2] and up_weight is not None  # a stacked gate_up's grad comes whole in the gate's place
    needs[4] = needs[4] and row_weight is not None
    return needs


def _backward_grads(grad_out, x, offsets, gate_weight, up_weight, down_weight, activation, chunk_tokens, budget_mb,
                    grad_accum, needs_grad, row_mask=None, row_weight=None):  # fmt: skip
    needs = _needs(needs_grad, up_weight, row_weight)
    need_x, need_wg, need_wu, need_wd, need_w = needs
    gate_weight, up_weight, stacked = _weights(gate_weight, up_weight)
    n, i = x.shape[0], gate_weight.shape[2]
    mask, weight = _rows(row_mask), _rows(row_weight)
    if _grouped_ok(x, gate_weight, up_weight, down_weight) and _aligned(grad_out):
        chunk = _grouped_chunk(n, i, x.dtype, chunk_tokens, budget_mb)
        *grads, dw = _grouped_backward(
            grad_out, x, offsets, gate_weight, up_weight, down_weight, activation, chunk, grad_accum, needs, mask,
            weight, stacked,
        )  # fmt: skip
        return (*grads, dw.reshape(row_weight.shape) if need_w else dw)

    def acc_for(p: Tensor, wanted: bool) -> Tensor | None:
        return _empty_grad(p, _acc_dtype(p, grad_accum), zero=True) if wanted else None

    if stacked is not None:  # both halves' grads, put together at the end
        need_wu = need_wg
    acc_wg, acc_wu, acc_wd = acc_for(gate_weight, need_wg), acc_for(up_weight, need_wu), acc_for(down_weight, need_wd)
    dx = x.new_zeros(x.shape) if need_x else None  # rows past offsets[-1] get no gradient
    dw = weight.new_zeros(weight.shape) if need_w else None
    need_du = need_x or need_wu
    need_dg = need_x or need_wg
    if n > 0 and (need_wd or need_du or need_dg or need_w):
        bounds = _bounds(offsets, n)
        chunk = _chunk(n, i, x.dtype, chunk_tokens, budget_mb)
        rows = min(chunk, n)
        g_buf, u_buf, dh_buf, t_buf = (x.new_empty((rows, i)) for _ in range(4))
        for e, (lo, hi) in enumerate(bounds):
            wg, wu, wd = gate_weight[e], up_weight[e], down_weight[e]
            for s in range(lo, hi, chunk):
                t = min(s + chunk, hi)
                xc, dyc = x[s:t], grad_out[s:t]
                g, u, dh, tmp = (b[: t - s] for b in (g_buf, u_buf, dh_buf, t_buf))
                torch.mm(xc, wg, out=g)
                torch.mm(xc, wu, out=u)
                mc = None if mask is None else mask[s:t]
                if mc is not None:  # the forward's g and u
                    g.masked_fill_(mc, 0)
                    u.masked_fill_(mc, 0)
                torch.mm(dyc, wd.t(), out=dh)
                wc = None if weight is None else weight[s:t]
                if wc is not None or need_wd:
                    h = mlp_reference.act_into(g, tmp, activation).mul_(u)
                if wc is not None:  # y = (h Wd) * w: dh = (dy Wdᵀ) * w, dw = Σ (dy Wdᵀ)·h, dWd = (h * w)ᵀ dy
                    if need_w:
                        dw[s:t] = (dh * h).sum(1, keepdim=True, dtype=_acc_dtype(dw, "fp32"))
                    dh.mul_(wc)
                    if need_wd:
                        h.mul_(wc)
                if need_wd:
                    _accumulate_mm(acc_wd[e], h.t(), dyc)
                if need_du:
                    du = mlp_reference.act_into(g, tmp, activation).mul_(dh)
                    if mc is not None:  # masked_fill's backward
                        du.masked_fill_(mc, 0)
                    if need_wu:
                        _accumulate_mm(acc_wu[e], xc.t(), du)
                    if need_x:
                        torch.mm(du, wu.t(), out=dx[s:t])
                if need_dg:
                    dg = mlp_reference.act_backward_into(u.mul_(dh), g, u, activation)
                    if mc is not None:
                        dg.masked_fill_(mc, 0)
                    if need_wg:
                        _accumulate_mm(acc_wg[e], xc.t(), dg)
                    if need_x:
                        dx[s:t].addmm_(dg, wg.t())
        del g_buf, u_buf, dh_buf, t_buf

    g_wd, acc_wd = _finish_grad(acc_wd, down_weight, x), None
    if stacked is not None and need_wg:  # the stacked weight's grad, in its layout, in its dtype
        g_wg, g_wu = _empty_grad(stacked, stacked.dtype), x.new_empty((0,))
        g_wg[..., :i].copy_(acc_wg)
        g_wg[..., i:].copy_(acc_wu)
        acc_wg = acc_wu = None
    else:
        g_wu, acc_wu = _finish_grad(acc_wu, up_weight, x) if stacked is None else x.new_empty((0,)), None
        g_wg, acc_wg = _finish_grad(acc_wg, gate_weight, x), None
    g_w = dw.reshape(row_weight.shape) if need_w else x.new_empty((0,))
    return (dx if dx is not None else x.new_empty((0,))), g_wg, g_wu, g_wd, g_w


def _fake_grads(grad_out, x, offsets, gate_weight, up_weight, down_weight, activation, chunk_tokens, budget_mb,
                grad_accum, needs_grad, row_mask=None, row_weight=None):  # fmt: skip
    needs = _needs(needs_grad, up_weight, row_weight)
    weights = (gate_weight, up_weight, down_weight)  # a stacked gate_up (up None): its grad whole in the gate's place
    return (  # a placeholder of its own per grad not needed: the op's outputs never alias one another
        x.new_empty(x.shape) if needs[0] else x.new_empty((0,)),
        *(_empty_grad(w, w.dtype) if need else x.new_empty((0,)) for need, w in zip(needs[1:4], weights)),
        row_weight.new_empty(row_weight.shape) if needs[4] else x.new_empty((0,)),
    )


_tiled_grouped_mlp_backward_op = define_op(
    "tiled_grouped_mlp_backward",
    f"({_GRAD_OPERANDS}) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    _backward_grads,
    _fake_grads,
)


# ----------------------------------------------------------------------------------------------------------------
# autograd wiring


def _setup_context(ctx, inputs, output):
    # the dispatcher may leave off trailing arguments equal to their defaults (None)
    x, offsets, gate_weight, up_weight, down_weight, activation, chunk_tokens, budget_mb, grad_accum = inputs[:9]
    row_mask, row_weight = (*inputs[9:], None, None)[:2]
    ctx.save_for_backward(x, offsets, gate_weight, up_weight, down_weight, row_mask, row_weight)
    ctx.settings = (activation, chunk_tokens, budget_mb, grad_accum)


def _backward(ctx, grad_out):
    x, offsets, gate_weight, up_weight, down_weight, row_mask, row_weight = ctx.saved_tensors
    n = ctx.needs_input_grad
    needs = [n[0], n[2], n[3], n[4], row_weight is not None and n[10]]  # a weight given is never left off
    if not any(needs):
        return (None,) * len(n)
    grads = torch.ops.tilecompile.tiled_grouped_mlp_backward(
        grad_out.contiguous(), x, offsets, gate_weight, up_weight, down_weight, *ctx.settings, needs, row_mask,
        row_weight,
    )  # fmt: skip
    gx, gwg, gwu, gwd, gw = (g if need else None for g, need in zip(grads, needs))
    return (gx, None, gwg, gwu, gwd, None, None, None, None, None, gw)[: len(n)]


_tiled_grouped_mlp_op.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------------------------
# public Python entry


def tiled_grouped_mlp(
    x: Tensor,
    offsets: Tensor,
    gate_weight: Tensor,
    up_weight: Tensor,
    down_weight: Tensor,
    *,
    activation: str = "silu",
    chunk_tokens: int = 0,
    budget_mb: int = 256,
    grad_accum: str = "fp32",
    row_mask: Tensor | None = None,
    row_weight: Tensor | None = None,
) -> Tensor:
    """Per expert ``e``, rows ``offsets[e-1]:offsets[e]`` of ``x`` [S, D] through ``act(x Wg[e]) * (x Wu[e]) @ Wd[e]``
    in token chunks; weights [E, in, out] as ``grouped_mm`` takes them; rows flagged in ``row_mask`` as if their
    gate and up projections were zero; each row's output times its ``row_weight``. See the module docstring."""
    return torch.ops.tilecompile.tiled_grouped_mlp(
        x, offsets, gate_weight, up_weight, down_weight, activation, chunk_tokens, budget_mb, grad_accum, row_mask,
        row_weight,
    )  # fmt: skip
