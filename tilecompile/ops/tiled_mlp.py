"""Tiled gated MLP: ``y = down(act(gate(x)) * up(x))`` run over token chunks, as a pair of custom ops.

Forward: for each chunk of tokens, ``g = x Wgᵀ + bg``, ``u = x Wuᵀ + bu``, ``h = act(g) * u``,
``y = h Wdᵀ + bd``. Saved for backward: ``x`` and the weights (and the gate/up biases), never an [N, I] tensor.

Backward (``tilecompile::tiled_gated_mlp_backward``), per chunk: recompute ``g`` and ``u`` (not ``y``), then

    dh = dy Wd                     dWd += dyᵀ h           dbd += Σ dy
    du = dh * act(g)               dWu += duᵀ x           dbu += Σ du
    dg = dh * u * act'(g)          dWg += dgᵀ x           dbg += Σ dg
    dx = du Wu + dg Wg

Weight and bias grads accumulate across chunks in fp32 (``grad_accum="fp32"``; fp64 stays fp64) or in the
parameter dtype (``grad_accum="param"``) and are returned from the backward op, one per weight, so autograd's
``AccumulateGrad`` (and with it DDP / FSDP / ZeRO) sees ordinary grads. Inputs that need no grad get no work.

Live memory per chunk: at most four [chunk, I] tensors in the compute dtype (gate out, up out, act/product, dh;
three with the fused CUDA kernels); the default chunk is the largest multiple of 64 tokens for which four fit
``budget_mb`` MiB (``chunk_size_for``), computed inside the op from the runtime shape so that varying sequence
lengths do not recompile.

CPU and CUDA share this code; cuBLAS/MKL do the matmuls. On CUDA the elementwise work of a chunk is one Triton
kernel each way (kernels/tiled_mlp.py, beside its PyTorch reference, the CPU path; ``USE_TRITON = False`` selects
the reference on CUDA too). fp32 accumulation of bf16/fp16 products uses
``torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)`` when this torch supports it (probed once per device),
else a per-chunk product in the compute dtype added into the fp32 buffer.

The backward tiles [parts * chunk tokens, I / parts] (up to 4 parts of at least 1024 columns): the same
intermediate bytes as [chunk, I], but each weight-grad accumulator is read and written once per tile row of
tokens, so `parts` times less often. dx sums its 2 * parts products per tile in fp32 with ``grad_accum="fp32"``
(an fp32 [tile, D] buffer), in the compute dtype with ``"param"``.

Cost (H200, SwiGLU N=65536, D=3584, I=18944, bf16; benchmarks/RESULTS.md): 11 GEMMs instead of 9, so about
1.25x Inductor's time, at 2.0 GiB (fp32 accumulation) or 1.4 GiB (param) peak extra instead of Inductor's 9.8 GiB.

Autocast: the op casts its floating inputs to the autocast dtype of the device (an Autocast{CPU,CUDA} kernel),
so it behaves like ``F.linear`` under ``torch.autocast``; outside autocast all inputs must share one dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tilecompile.kernels import tiled_mlp as mlp_kernels
from tilecompile.kernels import tiled_mlp_reference as mlp_reference
from tilecompile.ops import define_op

__all__ = ["ACTIVATIONS", "GRAD_ACCUM", "chunk_size_for", "tiled_gated_mlp"]

ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu")
GRAD_ACCUM = ("fp32", "param")
_INTERMEDIATES_PER_TOKEN = 4  # gate out, up out, act/product, dh: [chunk, I] each
_ALIGN = 64


def chunk_size_for(tokens: int, intermediate: int, dtype: torch.dtype, budget_mb: int) -> int:
    """Tokens per chunk: the largest multiple of 64 whose four [chunk, I] tensors fit ``budget_mb`` MiB.

    At least 64; never more than ``tokens`` rounded up to a multiple of 64.
    """
    per_token = _INTERMEDIATES_PER_TOKEN * max(int(intermediate), 1) * dtype.itemsize
    chunk = (max(int(budget_mb), 0) * 2**20) // per_token
    chunk = max(_ALIGN, chunk // _ALIGN * _ALIGN)
    return min(chunk, max(_ALIGN, -(-int(tokens) // _ALIGN) * _ALIGN))


# ----------------------------------------------------------------------------------------------------------------
# chunk pieces. The elementwise work of a chunk: on CUDA one Triton kernel each way (kernels/tiled_mlp.py), on CPU
# (and for fp64) the same file's plain-PyTorch reference.

USE_TRITON = True  # module switch (benchmarks compare both paths); applies to CUDA tensors
_TRITON_ON_CPU = False  # tests flip this under TRITON_INTERPRET=1 to run the fused path on CPU tensors


def _use_triton(t: Tensor) -> bool:
    fits = t.dtype in (torch.float32, torch.float16, torch.bfloat16)  # the kernels compute in fp32: not for fp64
    return mlp_kernels.HAS_TRITON and USE_TRITON and fits and (t.is_cuda or _TRITON_ON_CPU)


def _linear_into(x: Tensor, weight: Tensor, bias: Tensor | None, out: Tensor) -> Tensor:
    if bias is None:
        return torch.mm(x, weight.t(), out=out)
    return torch.addmm(bias, x, weight.t(), out=out)


# ----------------------------------------------------------------------------------------------------------------
# acc += a @ b with acc possibly wider than a and b

_OUT_DTYPE_ADDMM_OK: dict[str, bool] = {}


def _cuda_out_dtype_addmm_ok(device: torch.device) -> bool:
    """Whether ``torch.addmm(acc, a, b, out_dtype=fp32, out=acc)`` accumulates bf16 products into fp32 here."""
    key = str(device)
    if key not in _OUT_DTYPE_ADDMM_OK:
        if torch.cuda.is_current_stream_capturing():
            return False  # never probe (a host sync) inside a CUDA graph capture
        ok = False
        try:
            a = torch.full((3, 5), 0.5, device=device, dtype=torch.bfloat16)
            b = torch.full((5, 2), 2.0, device=device, dtype=torch.bfloat16)
            acc = torch.full((3, 2), 1.0 + 2.0**-12, device=device, dtype=torch.float32)
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            ok = bool((acc == 6.0 + 2.0**-12).all().item())
        except (RuntimeError, TypeError, NotImplementedError):
            ok = False
        _OUT_DTYPE_ADDMM_OK[key] = ok
    return _OUT_DTYPE_ADDMM_OK[key]


def _accumulate_mm(acc: Tensor, a: Tensor, b: Tensor) -> None:
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif acc.is_cuda and _cuda_out_dtype_addmm_ok(acc.device):
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    elif acc.is_cuda:
        acc.add_(torch.mm(a, b))
    else:
        # CPU with bf16/fp16 operands: upcast one chunk's operands (small) so the product itself is exact-ish
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


def _accumulate_sum(acc: Tensor, t: Tensor) -> None:
    acc.add_(t.sum(0, dtype=acc.dtype))


def acc_dtype(dtype: torch.dtype, grad_accum: str) -> torch.dtype:
    """The dtype a ``dtype`` parameter's grad accumulates in: its own with ``grad_accum="param"``, else at least
    fp32."""
    return dtype if grad_accum == "param" else torch.promote_types(torch.float32, dtype)


def _acc_dtype(p: Tensor, grad_accum: str) -> torch.dtype:
    return acc_dtype(p.dtype, grad_accum)


def _finish_grad(acc: Tensor | None, p: Tensor | None, x: Tensor) -> Tensor:
    """The accumulator as ``p``'s grad, in ``p``'s dtype; an empty placeholder (``x.new_empty((0,))``) without one."""
    if acc is None:
        return x.new_empty((0,))
    return acc if acc.dtype == p.dtype else acc.to(p.dtype)


# ----------------------------------------------------------------------------------------------------------------
# checks


def check_options(name: str, activation: str, chunk_tokens: int, budget_mb: int, grad_accum: str) -> None:
    """The options every tiled MLP op takes (the dense one and the experts'), checked alike: ``name`` heads the
    error."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"{name}: activation must be one of {ACTIVATIONS}, got {activation!r}")
    if grad_accum not in GRAD_ACCUM:
        raise ValueError(f"{name}: grad_accum must be one of {GRAD_ACCUM}, got {grad_accum!r}")
    if chunk_tokens < 0:
        raise ValueError(f"{name}: chunk_tokens must be >= 0, got {chunk_tokens}")
    if chunk_tokens == 0 and budget_mb <= 0:
        raise ValueError(f"{name}: budget_mb must be > 0 when chunk_tokens is 0, got {budget_mb}")


def _check_tensors(x: Tensor, *weights: Tensor | None) -> None:
    """The op's tensor checks (after ``check_options``), run by the op and its fake alike; ``weights``: gate_weight,
    gate_bias, up_weight, up_bias, down_weight, down_bias as the op takes them."""
    gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias = weights
    if x.dim() < 1:
        raise ValueError("tiled_gated_mlp: x must have at least one dimension [..., D]")
    d, i = x.shape[-1], gate_weight.shape[0]
    if gate_weight.dim() != 2 or up_weight.dim() != 2 or down_weight.dim() != 2:
        raise ValueError("tiled_gated_mlp: weights must be 2-D")
    if tuple(gate_weight.shape) != (i, d) or tuple(up_weight.shape) != (i, d) or down_weight.shape[1] != i:
        raise ValueError(
            f"tiled_gated_mlp: shapes do not chain: x [..., {d}], gate {tuple(gate_weight.shape)}, "
            f"up {tuple(up_weight.shape)}, down {tuple(down_weight.shape)}"
        )
    for name, bias, n in (("gate", gate_bias, i), ("up", up_bias, i), ("down", down_bias, down_weight.shape[0])):
        if bias is not None and tuple(bias.shape) != (n,):
            raise ValueError(f"tiled_gated_mlp: {name}_bias must have shape ({n},), got {tuple(bias.shape)}")
    tensors = [t for t in (x, gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias) if t is not None]
    if len({t.dtype for t in tensors}) != 1:
        raise ValueError(
            "tiled_gated_mlp: x, weights and biases must share one dtype (under torch.autocast the op casts them); "
            f"got {[t.dtype for t in tensors]}"
        )


def _chunk_for(x2: Tensor, intermediate: int, chunk_tokens: int, budget_mb: int) -> int:
    if chunk_tokens > 0:
        return chunk_tokens
    return chunk_size_for(x2.shape[0], intermediate, x2.dtype, budget_mb)


# ----------------------------------------------------------------------------------------------------------------
# forward op


@torch.library.custom_op("tilecompile::tiled_gated_mlp", mutates_args=())
def _tiled_gated_mlp_op(
    x: Tensor,
    gate_weight: Tensor,
    gate_bias: Tensor | None,
    up_weight: Tensor,
    up_bias: Tensor | None,
    down_weight: Tensor,
    down_bias: Tensor | None,
    activation: str,
    chunk_tokens: int = 0,
    budget_mb: int = 256,
    grad_accum: str = "fp32",
) -> Tensor:
    check_options("tiled_gated_mlp", activation, chunk_tokens, budget_mb, grad_accum)
    _check_tensors(x, gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias)
    d, i, d_out = x.shape[-1], gate_weight.shape[0], down_weight.shape[0]
    x2 = x.reshape(-1, d)
    n = x2.shape[0]
    out = x2.new_empty((n, d_out))
    if n > 0:
        chunk = min(_chunk_for(x2, i, chunk_tokens, budget_mb), n)
        fused = _use_triton(x2)
        g_buf = x2.new_empty((chunk, i))
        u_buf = x2.new_empty((chunk, i))
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            xc, g, u = x2[s:e], g_buf[: e - s], u_buf[: e - s]
            _linear_into(xc, gate_weight, gate_bias, g)
            _linear_into(xc, up_weight, up_bias, u)
            if fused:
                mlp_kernels.fused_act_mul_(g, u, activation)
            else:
                mlp_reference.act_into(g, g, activation)
                g.mul_(u)
            _linear_into(g, down_weight, down_bias, out[s:e])
    return out.view(*x.shape[:-1], d_out)


@_tiled_gated_mlp_op.register_fake
def _(x, gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias, activation, chunk_tokens=0, budget_mb=256,
      grad_accum="fp32"):  # fmt: skip
    check_options("tiled_gated_mlp", activation, chunk_tokens, budget_mb, grad_accum)
    _check_tensors(x, gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias)
    return x.new_empty((*x.shape[:-1], down_weight.shape[0]))


# ----------------------------------------------------------------------------------------------------------------
# backward tiling over the intermediate dimension

_MAX_I_PARTS = 4  # the backward splits I into at most this many parts ...
_MIN_I_PART = 1024  # ... each at least this wide, so the GEMMs stay large
_PART_ALIGN = 64  # ... and each starting at a multiple of this many columns (see _part_bounds)


def _intermediate_parts(tokens: int, intermediate: int, chunk: int) -> int:
    """How many parts of I the backward tiles over (1 when one chunk holds all tokens)."""
    return max(1, min(_MAX_I_PARTS, -(-tokens // chunk), intermediate // _MIN_I_PART))


def _part_bounds(intermediate: int, parts: int) -> list[tuple[int, int]]:
    """The backward's [lo, hi) column ranges of I: at most ``parts``, each a multiple of ``_PART_ALIGN`` wide but the
    last. I / parts itself (2987 for Qwen2.5-1.5B's I = 8960 in the 3 parts of 8k tokens) puts the weight slices and
    tiles off cuBLAS's 16-byte alignment, which slowed the backward by about 2x (benchmarks/RESULTS.md, "The sweeps
    behind the kernels' settings")."""
    width = -(-intermediate // parts)
    width = -(-width // _PART_ALIGN) * _PART_ALIGN
    return [(lo, min(lo + width, intermediate)) for lo in range(0, intermediate, width)]


def _tile(buf: Tensor | None, rows: int, cols: int) -> Tensor | None:
    """A contiguous [rows, cols] view at the start of a flat buffer."""
    return None if buf is None else buf[: rows * cols].view(rows, cols)


def _dx_add(dx_tile: Tensor, a: Tensor, w: Tensor, *, first: bool) -> None:
    """dx_tile (+)= a @ w; the first product of a tile overwrites."""
    if first and dx_tile.dtype == a.dtype:
        torch.mm(a, w, out=dx_tile)
        return
    if first:
        dx_tile.zero_()
    _accumulate_mm(dx_tile, a, w)


# ----------------------------------------------------------------------------------------------------------------
# backward op
#
# needs_grad = [x, gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias]; a grad that is not needed
# (or whose bias is None) comes back as an empty placeholder tensor, turned into None by the autograd wiring.


def _grad_shapes(x, gate_weight, up_weight, down_weight):
    i, d_out = gate_weight.shape[0], down_weight.shape[0]
    return [
        tuple(x.shape),
        tuple(gate_weight.shape),
        (i,),
        tuple(up_weight.shape),
        (i,),
        tuple(down_weight.shape),
        (d_out,),
    ]


def _normalise_needs(needs_grad, gate_bias, up_bias) -> list[bool]:
    needs = [bool(v) for v in needs_grad] + [False] * (7 - len(needs_grad))
    needs = needs[:7]
    if gate_bias is None:
        needs[2] = False
    if up_bias is None:
        needs[4] = False
    return needs


def _backward_grads(grad_out, x, gate_weight, gate_bias, up_weight, up_bias, down_weight, activation, chunk_tokens,
                    budget_mb, grad_accum, needs_grad):  # fmt: skip
    """(dx, dWg, dbg, dWu, dbu, dWd, dbd) of the tiled MLP; an empty [0] tensor for a grad not needed."""
    need_x, need_wg, need_bg, need_wu, need_bu, need_wd, need_bd = _normalise_needs(needs_grad, gate_bias, up_bias)
    d, i, d_out = x.shape[-1], gate_weight.shape[0], down_weight.shape[0]
    x2 = x.reshape(-1, d)
    dy2 = grad_out.reshape(-1, d_out)
    n = x2.shape[0]
    cdt = x2.dtype

    def acc_dtype(p: Tensor) -> torch.dtype:
        return _acc_dtype(p, grad_accum)

    def zeros_like_acc(p: Tensor) -> Tensor:
        return torch.zeros(p.shape, device=p.device, dtype=acc_dtype(p))

    acc_wg = zeros_like_acc(gate_weight) if need_wg else None
    acc_wu = zeros_like_acc(up_weight) if need_wu else None
    acc_wd = zeros_like_acc(down_weight) if need_wd else None
    acc_bg = zeros_like_acc(gate_bias) if need_bg else None
    acc_bu = zeros_like_acc(up_bias) if need_bu else None
    acc_bd = torch.zeros((d_out,), device=x.device, dtype=acc_dtype(down_weight)) if need_bd else None
    dx = torch.empty(x.shape, device=x.device, dtype=cdt) if need_x else None

    need_du = need_x or need_wu or need_bu
    need_dg = need_x or need_wg or need_bg
    need_dh = need_du or need_dg
    if n > 0 and (need_wd or need_dh or need_bd):
        dx2 = dx.view(-1, d) if dx is not None else None
        # Tiles of [parts * chunk tokens, I / parts]: the same intermediate bytes as [chunk, I], but the weight-grad
        # accumulators are read and written once per tile row of tokens, so `parts` times less often.
        chunk = min(_chunk_for(x2, i, chunk_tokens, budget_mb), n)
        parts = _intermediate_parts(n, i, chunk)
        chunk = min(chunk * parts, n)
        bounds = _part_bounds(i, parts)
        width = bounds[0][1] - bounds[0][0]
        recompute = need_wd or need_dh
        fused = _use_triton(x2)
        need_u = need_wd or need_dg  # the up projection itself

        def buffer(wanted: bool) -> Tensor | None:
            return x2.new_empty((chunk * width,)) if wanted else None

        g_buf = buffer(recompute)
        u_buf = buffer(need_u or (fused and need_du))
        t_buf = buffer(not fused and (need_wd or need_du))
        dh_buf = buffer(need_dh)
        # dx sums 2 * parts products per tile: in fp32 (unless grad_accum="param") when there is more than one part
        dx_acc = None
        if need_x and parts > 1 and grad_accum == "fp32" and cdt != acc_dtype(x):
            dx_acc = torch.empty((chunk, d), device=x.device, dtype=acc_dtype(x))

        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            rows = e - s
            xc, dyc = x2[s:e], dy2[s:e]
            if need_bd:
                _accumulate_sum(acc_bd, dyc)
            if not recompute:
                continue
            dx_tile = None if not need_x else (dx_acc[:rows] if dx_acc is not None else dx2[s:e])
            for k, (lo, hi) in enumerate(bounds):
                wg_k, wu_k = gate_weight[lo:hi], up_weight[lo:hi]
                g, u, dh, t = (_tile(b, rows, hi - lo) for b in (g_buf, u_buf, dh_buf, t_buf))
                _linear_into(xc, wg_k, gate_bias[lo:hi] if gate_bias is not None else None, g)
                if need_u:
                    _linear_into(xc, wu_k, up_bias[lo:hi] if up_bias is not None else None, u)
                if need_dh:
                    torch.mm(dyc, down_weight[:, lo:hi], out=dh)
                if fused:  # one kernel: g <- h, u <- du, dh <- dg
                    mlp_kernels.fused_act_backward_(g, u, dh, activation, need_wd, need_du, need_dg)
                    h, du, dg = g, u, dh
                if need_wd:
                    if not fused:
                        h = mlp_reference.act_into(g, t, activation).mul_(u)
                    _accumulate_mm(acc_wd[:, lo:hi], dyc.t(), h)
                if need_du:
                    if not fused:
                        du = mlp_reference.act_into(g, t, activation).mul_(dh)
                    if need_wu:
                        _accumulate_mm(acc_wu[lo:hi], du.t(), xc)
                    if need_bu:
                        _accumulate_sum(acc_bu[lo:hi], du)
                    if need_x:
                        _dx_add(dx_tile, du, wu_k, first=k == 0)
                if need_dg:
                    if not fused:
                        dg = mlp_reference.act_backward_into(u.mul_(dh), g, u, activation)
                    if need_wg:
                        _accumulate_mm(acc_wg[lo:hi], dg.t(), xc)
                    if need_bg:
                        _accumulate_sum(acc_bg[lo:hi], dg)
                    if need_x:  # need_x implies need_du: dx_tile already holds this part's du Wu
                        _dx_add(dx_tile, dg, wg_k, first=False)
            if dx_acc is not None:
                dx2[s:e].copy_(dx_tile)
        del g_buf, u_buf, t_buf, dh_buf, dx_acc

    # convert one accumulator at a time so the fp32 buffers are freed as the param-dtype grads appear
    g_wd, acc_wd = _finish_grad(acc_wd, down_weight, x), None
    g_wu, acc_wu = _finish_grad(acc_wu, up_weight, x), None
    g_wg, acc_wg = _finish_grad(acc_wg, gate_weight, x), None
    g_bd = _finish_grad(acc_bd, down_weight, x)
    g_bu = _finish_grad(acc_bu, up_bias, x)
    g_bg = _finish_grad(acc_bg, gate_bias, x)
    g_x = dx if dx is not None else x.new_empty((0,))
    return g_x, g_wg, g_bg, g_wu, g_bu, g_wd, g_bd


def _fake_grads(grad_out, x, gate_weight, gate_bias, up_weight, up_bias, down_weight, *settings_and_needs):
    needs = _normalise_needs(settings_and_needs[-1], gate_bias, up_bias)
    shapes = _grad_shapes(x, gate_weight, up_weight, down_weight)
    dtypes = [x.dtype, gate_weight.dtype, gate_weight.dtype, up_weight.dtype, up_weight.dtype, down_weight.dtype,
              down_weight.dtype]  # fmt: skip
    return tuple(
        x.new_empty(shape, dtype=dt) if need else x.new_empty((0,)) for need, shape, dt in zip(needs, shapes, dtypes)
    )


define_op(
    "tiled_gated_mlp_backward",
    "(Tensor grad_out, Tensor x, Tensor gate_weight, Tensor? gate_bias, Tensor up_weight, Tensor? up_bias, "
    "Tensor down_weight, str activation, SymInt chunk_tokens, SymInt budget_mb, str grad_accum, bool[] needs_grad) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    _backward_grads,
    _fake_grads,
)


# ----------------------------------------------------------------------------------------------------------------
# autograd wiring


def _setup_context(ctx, inputs, output):
    x, gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias, *settings = inputs
    ctx.save_for_backward(x, gate_weight, gate_bias, up_weight, up_bias, down_weight)
    ctx.settings = tuple(settings)  # activation, chunk_tokens, budget_mb, grad_accum
    ctx.has_bias = (gate_bias is not None, up_bias is not None, down_bias is not None)


def _backward(ctx, grad_out):
    x, gate_weight, gate_bias, up_weight, up_bias, down_weight = ctx.saved_tensors
    needs = list(ctx.needs_input_grad[:7])
    needs[2] = needs[2] and ctx.has_bias[0]
    needs[4] = needs[4] and ctx.has_bias[1]
    needs[6] = needs[6] and ctx.has_bias[2]
    if not any(needs):
        return (None,) * 11
    grads = torch.ops.tilecompile.tiled_gated_mlp_backward(
        grad_out, x, gate_weight, gate_bias, up_weight, up_bias, down_weight, *ctx.settings, needs
    )
    return (*(g if need else None for g, need in zip(grads, needs)), None, None, None, None)


_tiled_gated_mlp_op.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------------------------
# autocast: cast floating inputs on the autocast device to that device's autocast dtype, then run without autocast

_autocast_lib = torch.library.Library("tilecompile", "FRAGMENT")  # noqa: TOR901


def _register_autocast(device_type: str) -> None:
    key_name = "Autocast" + torch._C._dispatch_key_for_device(device_type)
    key = getattr(torch._C.DispatchKey, key_name)

    def cast(t):
        if (
            isinstance(t, Tensor)
            and t.is_floating_point()
            and t.device.type == device_type
            and t.dtype != torch.float64
        ):
            return t.to(torch.get_autocast_dtype(device_type))
        return t

    def kernel(_keyset, *args):
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(key)):
            return torch.ops.tilecompile.tiled_gated_mlp.default(*(cast(a) for a in args))

    _autocast_lib.impl("tiled_gated_mlp", kernel, key_name, with_keyset=True)


for _device_type in ("cpu", "cuda"):
    if torch._C._is_autocast_available(_device_type):
        _register_autocast(_device_type)


# ----------------------------------------------------------------------------------------------------------------
# public Python entry


def tiled_gated_mlp(
    x: Tensor,
    gate_weight: Tensor,
    up_weight: Tensor,
    down_weight: Tensor,
    *,
    gate_bias: Tensor | None = None,
    up_bias: Tensor | None = None,
    down_bias: Tensor | None = None,
    activation: str = "silu",
    chunk_tokens: int = 0,
    budget_mb: int = 256,
    grad_accum: str = "fp32",
) -> Tensor:
    """``down(act(gate(x)) * up(x))`` in token chunks; see the module docstring. x is [..., D]."""
    return torch.ops.tilecompile.tiled_gated_mlp(
        x,
        gate_weight,
        gate_bias,
        up_weight,
        up_bias,
        down_weight,
        down_bias,
        activation,
        chunk_tokens,
        budget_mb,
        grad_accum,
    )
