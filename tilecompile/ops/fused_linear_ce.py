"""Custom ops for the fused lm_head -> log-prob / entropy / cross-entropy (kernels in tilecompile.kernels).

``torch.ops.tilecompile.fused_linear_logprob(h, weight, labels, temperature=1.0, ignore_index=-100,
with_entropy=True, check_inputs=False, vocab_chunk=-1) -> (logp, entropy)``: per token, z = h·Wᵀ / t,
logp = z_y − logsumexp(z) (0 where labels == ignore_index), entropy = lse − Σ softmax(z)·z (every row, ignored
or not), both fp32 with labels' shape; ``entropy`` is an empty [0] tensor when with_entropy=False.
Differentiable in h and weight.
``vocab_chunk``: vocabulary columns per chunk (0: automatic; -1: the TILECOMPILE_CE_VOCAB_CHUNK setting).

``torch.ops.tilecompile.fused_linear_logprob_ext(..., vocab_chunk, bias=None, softcap=0.0, with_lse=False,
with_zsum=False, with_argmax=False) -> (logp, entropy, lse, zsum, argmax)``: the same with z = softcap(h·Wᵀ + b) / t
(softcap(u) = c·tanh(u / c); 0: none) and per-row extras of the same pass (each an empty [0] tensor unless asked):
lse = logsumexp(z) (z-loss), zsum = Σ_j z_j (label smoothing), argmax_j z_j (int64; token accuracy; not
differentiable). Differentiable in h, weight and bias.

How it is built: the public op is a CompositeImplicitAutograd op with exactly that schema that validates shapes,
dtypes and temperature (all static, so it traces) and calls ``tilecompile::_fused_linear_logprob_forward``, a
``torch.library.custom_op`` that also returns per-row statistics of the logits (max and log Σ e^(z - max), whose
sum is the logsumexp). That third output is what the backward needs besides h, W, labels and entropy, and a custom
op's autograd can only save its inputs and outputs: without it the backward would have to redo the whole forward
GEMM. The backward is ``tilecompile::fused_linear_logprob_backward``,
a custom op too, so AOTAutograd and Inductor treat both halves as opaque. Both have fake impls.

Label range: on CPU a label outside [0, V) that is not ignore_index is always an error (``LabelOutOfRange``, a
ValueError, raised as eager's type: RuntimeError for ``ignore_index=NO_IGNORE`` as gather, IndexError as
cross_entropy otherwise); on CUDA it is checked only with check_inputs=True, which costs one reduction over the
labels and a host sync (so it breaks CUDA graph capture); unchecked, such a row gets a meaningless logp but no
out-of-bounds access.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import types
import warnings
from typing import Any

import torch

from tilecompile import config
from tilecompile.kernels import fused_linear_ce as lm_head_kernels
from tilecompile.ops import define_op, own_autograd

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LABEL_DTYPES = (torch.int32, torch.int64)

_lib = torch.library.Library("tilecompile", "FRAGMENT")
_lib.define(
    "fused_linear_logprob(Tensor h, Tensor weight, Tensor labels, float temperature=1.0, int ignore_index=-100, "
    "bool with_entropy=True, bool check_inputs=False, int vocab_chunk=-1) -> (Tensor logp, Tensor entropy)"
)


def _check_static(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float) -> None:
    """Shape, dtype, device and temperature checks: everything that needs no tensor data (so it runs on fakes)."""
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool):
        raise ValueError(f"temperature must be a Python float, got {type(temperature).__name__}")
    if not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"temperature must be finite and > 0, got {temperature}")
    if h.dim() < 1:
        raise ValueError("h must have at least one dimension ([..., D])")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [V, D], got shape {tuple(weight.shape)}")
    if h.shape[-1] != weight.shape[1]:
        raise ValueError(f"h's last dim ({h.shape[-1]}) != weight's dim 1 ({weight.shape[1]})")
    if tuple(labels.shape) != tuple(h.shape[:-1]):
        raise ValueError(f"labels shape {tuple(labels.shape)} != h.shape[:-1] {tuple(h.shape[:-1])}")
    if h.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"h dtype {h.dtype} not supported (float16, bfloat16, float32)")
    if weight.dtype != h.dtype:
        raise ValueError(f"weight dtype {weight.dtype} != h dtype {h.dtype}")
    if labels.dtype not in _LABEL_DTYPES:
        raise ValueError(f"labels dtype {labels.dtype} not supported (int32, int64)")
    if h.device != weight.device or h.device != labels.device:
        raise ValueError(f"h, weight, labels on different devices: {h.device}, {weight.device}, {labels.device}")


# ignore_index for labels that have none (a gathered log-prob): no label equals it, so every label outside [0, V) is
# an error, as eager's gather raises. passes/lm_head/rewrite.py gives it to a gather's labels.
NO_IGNORE = -(2**63)


class LabelOutOfRange(ValueError):
    """A label outside [0, V) that is not ignore_index. Raised as the type eager PyTorch raises for the same label
    (its subclasses), and a ValueError as every other bad argument of these ops."""


class GatherIndexOutOfRange(LabelOutOfRange, RuntimeError):
    """A gathered log-prob's label (the op called with ``NO_IGNORE``): eager's ``gather`` raises RuntimeError."""


class TargetOutOfRange(LabelOutOfRange, IndexError):
    """A cross-entropy / nll_loss target: eager's ``F.cross_entropy`` raises IndexError."""


def _check_labels(labels: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """A label outside [0, V) that is not ignore_index is an error (data-dependent: a host sync on CUDA)."""
    bad = ((labels < 0) | (labels >= vocab)) & (labels != ignore_index)
    if bool(bad.any()):
        first, count = labels[bad][0].item(), int(bad.sum())
        if ignore_index == NO_IGNORE:
            raise GatherIndexOutOfRange(
                f"label {first} out of range [0, {vocab}) (log-prob of gathered labels: there is no ignore_index); "
                f"{count} such label(s)"
            )
        raise TargetOutOfRange(
            f"label {first} out of range [0, {vocab}) and != ignore_index ({ignore_index}); {count} such label(s)"
        )


def _vocab_chunk(vocab_chunk: int) -> int:
    """Columns per vocabulary chunk: the op's argument, or with -1 the ``ce_vocab_chunk`` setting (0: automatic).

    The pass passes its compile's setting (so ``options={"ce_vocab_chunk": N}`` reaches the op); direct calls
    default to -1 and read TILECOMPILE_CE_VOCAB_CHUNK.
    """
    if vocab_chunk < -1:
        raise ValueError(f"vocab_chunk must be -1 (from the setting), 0 (automatic) or > 0, got {vocab_chunk}")
    return config.load().ce_vocab_chunk if vocab_chunk == -1 else vocab_chunk


def _flat(h: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d = h.shape[-1]
    return h.reshape(-1, d).contiguous(), labels.reshape(-1).contiguous()


def _active_rows(labels1: torch.Tensor, ignore_index: int) -> torch.Tensor | None:
    """CPU only: indices of non-ignored rows when some are ignored (so those rows cost nothing), else None."""
    keep = labels1 != ignore_index
    if bool(keep.all()):
        return None
    return keep.nonzero().squeeze(1)


def _check_options(weight: torch.Tensor, bias: torch.Tensor | None, softcap: float) -> None:
    if not isinstance(softcap, (int, float)) or isinstance(softcap, bool) or not math.isfinite(softcap):
        raise ValueError(f"softcap must be a finite Python float (0: none), got {softcap!r}")
    if softcap < 0:
        raise ValueError(f"softcap must be > 0 (or 0: none), got {softcap}")
    if bias is not None:
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias must be [V] = [{weight.shape[0]}], got shape {tuple(bias.shape)}")
        if bias.dtype not in _FLOAT_DTYPES or bias.device != weight.device:
            raise ValueError(
                f"bias dtype/device {bias.dtype}/{bias.device} not float16/bfloat16/float32 on the weight's"
            )


# The two op families (``fused_linear_logprob`` and ``fused_linear_logprob_ext``: bias, softcap, extras) share their
# implementation below; each keeps its own schema, so graphs and caches that name one stay valid.


def _forward(
    h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float, ignore_index: int,
    with_entropy: bool, check_inputs: bool, vocab_chunk: int = -1, bias: torch.Tensor | None = None,
    softcap: float = 0.0,
    with_lse: bool = False, with_zsum: bool = False, with_argmax: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(logp, entropy, stats, lse, zsum, argmax) with labels' shape (stats + [2]); an empty [0] tensor for each of
    entropy, lse, zsum, argmax not asked for."""
    _check_static(h, weight, labels, temperature)
    _check_options(weight, bias, softcap)
    if not h.is_cuda or check_inputs:
        _check_labels(labels, weight.shape[0], ignore_index)
    h2, labels1 = _flat(h, labels)
    shape = labels.shape
    options = dict(chunk=_vocab_chunk(vocab_chunk), bias=bias, softcap=float(softcap))
    all_rows = with_lse or with_zsum or with_argmax
    rows = None if (h.is_cuda or with_entropy or all_rows) else _active_rows(labels1, ignore_index)
    inv_t = 1.0 / float(temperature)
    if rows is None:
        logp, ent, stats, extras = lm_head_kernels.fused_linear_logprob_fwd(
            h2, weight, labels1, inv_t, ignore_index, with_entropy, all_rows=with_lse, with_zsum=with_zsum,
            with_argmax=with_argmax, **options,
        )  # fmt: skip
    else:  # the active rows alone; the ignored ones get logp 0 and stats 0 (never needed)
        n = labels1.shape[0]
        logp = torch.zeros(n, dtype=torch.float32, device=h.device)
        stats = torch.zeros(n, 2, dtype=torch.float32, device=h.device)
        logp[rows], _, stats[rows], extras = lm_head_kernels.fused_linear_logprob_fwd(
            h2[rows], weight, labels1[rows], inv_t, ignore_index, False, **options
        )
        ent = None
    empty = h.new_empty(0, dtype=torch.float32)
    lse = (stats[:, 0] + stats[:, 1]).reshape(shape) if with_lse else empty
    zsum = extras.zsum.reshape(shape) if with_zsum else empty.clone()
    amax = extras.argmax.reshape(shape) if with_argmax else h.new_empty(0, dtype=torch.int64)
    ent_out = ent.reshape(shape) if ent is not None else empty.clone()
    return logp.reshape(shape), ent_out, stats.reshape(*shape, 2), lse, zsum, amax


def _fake_forward(h, weight, labels, temperature, with_entropy, bias=None, softcap=0.0, with_lse=False,
                  with_zsum=False, with_argmax=False) -> tuple[torch.Tensor, ...]:  # fmt: skip
    _check_static(h, weight, labels, temperature)
    _check_options(weight, bias, softcap)

    def rows(on: bool, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return labels.new_empty(labels.shape if on else (0,), dtype=dtype)

    stats = labels.new_empty((*labels.shape, 2), dtype=torch.float32)
    return rows(True), rows(with_entropy), stats, rows(with_lse), rows(with_zsum), rows(with_argmax, torch.int64)


def _backward_grads(
    h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, stats: torch.Tensor, entropy: torch.Tensor,
    grad_logp: torch.Tensor | None, grad_entropy: torch.Tensor | None, temperature: float, ignore_index: int,
    need_grad_h: bool = True, need_grad_weight: bool = True, vocab_chunk: int = -1, bias: torch.Tensor | None = None,
    softcap: float = 0.0, grad_lse: torch.Tensor | None = None, grad_zsum: torch.Tensor | None = None,
    need_grad_bias: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(grad_h with h's shape, grad_weight [V, D], grad_bias [V]) in the input dtypes; an empty [0] tensor for a
    grad not needed. None grads count as zero; entropy is needed only with grad_entropy."""

    def flat(g: torch.Tensor | None) -> torch.Tensor | None:
        return g.reshape(-1).float().contiguous() if g is not None else None

    h2, labels1 = _flat(h, labels)
    stats1 = stats.reshape(-1, 2).contiguous()
    glp, gent, glse, gzs = flat(grad_logp), flat(grad_entropy), flat(grad_lse), flat(grad_zsum)
    ent1 = entropy.reshape(-1).contiguous() if gent is not None else None
    options = dict(chunk=_vocab_chunk(vocab_chunk), bias=bias, softcap=float(softcap), need_db=need_grad_bias)
    every_row = gent is not None or glse is not None or gzs is not None
    rows = None if (h.is_cuda or every_row) else _active_rows(labels1, ignore_index)
    inv_t = 1.0 / float(temperature)
    if rows is None:
        dh, dw, db = lm_head_kernels.fused_linear_logprob_bwd(
            h2, weight, labels1, stats1, ent1, glp, None if gent is None else gent, inv_t, ignore_index, need_grad_h,
            need_grad_weight, grad_lse=glse, grad_zsum=gzs, **options,
        )  # fmt: skip
    else:  # the ignored rows' dz is 0: their dh is 0 and they add nothing to dW and db
        dh_a, dw, db = lm_head_kernels.fused_linear_logprob_bwd(
            h2[rows], weight, labels1[rows], stats1[rows], None, glp[rows] if glp is not None else None, None,
            inv_t, ignore_index, need_grad_h, need_grad_weight, **options,
        )  # fmt: skip
        dh = None
        if dh_a is not None:
            dh = torch.zeros_like(h2)
            dh[rows] = dh_a
    dh_out = dh.reshape(h.shape) if dh is not None else h.new_empty(0)
    dw_out = dw if dw is not None else weight.new_empty(0)
    db_out = db if db is not None else weight.new_empty(0)
    return dh_out, dw_out, db_out


def _fake_grads(h, weight, bias, need_grad_h, need_grad_weight, need_grad_bias) -> tuple[torch.Tensor, ...]:
    dh = h.new_empty(h.shape) if need_grad_h else h.new_empty(0)
    dw = weight.new_empty(weight.shape) if need_grad_weight else weight.new_empty(0)
    db = bias.new_empty(bias.shape) if (need_grad_bias and bias is not None) else weight.new_empty(0)
    return dh, dw, db


# The ops' arguments, in their schemas' order: the base family's, then the options of the ``_ext`` family.
_ARGS = (
    "Tensor h, Tensor weight, Tensor labels, float temperature, int ignore_index, bool with_entropy, "
    "bool check_inputs, int vocab_chunk"
)
_OPTIONS = "Tensor? bias, float softcap, bool with_lse, bool with_zsum, bool with_argmax"
_GRAD_ARGS = (
    "Tensor h, Tensor weight, Tensor labels, Tensor stats, Tensor entropy, Tensor? grad_logp, Tensor? grad_entropy, "
    "float temperature, int ignore_index, bool need_grad_h, bool need_grad_weight, int vocab_chunk"
)


# (logp, entropy or empty [0], stats) in fp32; stats is labels' shape + [2]: each row's max logit m and log Σ e^(z - m)
# (lse = m + log Σe; 0 at rows that never needed them), what the backward needs of the forward. Was
# ``_fused_linear_logprob_fwd`` while its third output was lse [...]; renamed with the new output. Graphs that
# Inductor cached for the old op are not reused: the backend adds a digest of this source to the cache keys.
_fused_linear_logprob_forward = define_op(
    "_fused_linear_logprob_forward",
    "(" + _ARGS.replace("int vocab_chunk", "int vocab_chunk=-1") + ") -> (Tensor, Tensor, Tensor)",
    lambda *args: _forward(*args)[:3],
    lambda h, weight, labels, temperature, ignore_index, with_entropy, *_: _fake_forward(
        h, weight, labels, temperature, with_entropy
    )[:3],
)

# (grad_h with h's shape, grad_weight [V, D]) in the input dtype; an empty [0] tensor for a grad not needed. stats
# and entropy are the forward's (entropy is needed only with grad_entropy); None grads count as zero.
fused_linear_logprob_backward = define_op(
    "fused_linear_logprob_backward",
    "("
    + _GRAD_ARGS.replace(
        "h, bool need_grad_weight, int vocab_chunk", "h=True, bool need_grad_weight=True, int vocab_chunk=-1"
    )
    + ") -> (Tensor, Tensor)",
    lambda *args: _backward_grads(*args)[:2],
    lambda h, weight, labels, stats, entropy, glp, gent, t, ignore, need_h=True, need_w=True, *_: _fake_grads(
        h, weight, None, need_h, need_w, False
    )[:2],
)

# (logp, entropy, stats, lse, zsum, argmax): the three above and the extras asked for (an empty [0] tensor each one
# not asked for); lse, zsum fp32 and argmax int64 with labels' shape.
_fused_linear_logprob_forward_ext = define_op(
    "_fused_linear_logprob_forward_ext",
    f"({_ARGS}, {_OPTIONS}) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    _forward,
    lambda h, weight, labels, temperature, ignore_index, with_entropy, check, chunk, *options: _fake_forward(
        h, weight, labels, temperature, with_entropy, *options
    ),
)

# (grad_h, grad_weight, grad_bias) of ``fused_linear_logprob_ext``; an empty [0] tensor for a grad not needed.
fused_linear_logprob_backward_ext = define_op(
    "fused_linear_logprob_backward_ext",
    f"({_GRAD_ARGS}, Tensor? bias, float softcap, Tensor? grad_lse, Tensor? grad_zsum, bool need_grad_bias) "
    "-> (Tensor, Tensor, Tensor)",
    _backward_grads,
    lambda h, weight, *rest: _fake_grads(h, weight, rest[10], rest[7], rest[8], rest[14]),
)


def _setup_context(ctx, inputs, output):
    h, weight, labels, temperature, ignore_index, with_entropy, _check, vocab_chunk, *options = inputs
    bias, softcap, with_lse, with_zsum, _ = options or (None, 0.0, False, False, False)
    ent, stats = output[1], output[2]
    ctx.mark_non_differentiable(*output[2:3], *output[5:])  # stats, and argmax
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(h, weight, labels, stats, ent, bias)
    ctx.ext = bool(options)
    ctx.args = (float(temperature), int(ignore_index), float(softcap), int(vocab_chunk), bool(with_entropy))
    ctx.with_lse, ctx.with_zsum = with_lse, with_zsum


def _backward(ctx, grad_logp, grad_ent, _grad_stats, grad_lse=None, grad_zsum=None, _grad_argmax=None):
    h, weight, labels, stats, ent, bias = ctx.saved_tensors
    temperature, ignore_index, softcap, vocab_chunk, with_entropy = ctx.args
    need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_b = bias is not None and ctx.needs_input_grad[8]
    none = (None,) * (13 if ctx.ext else 8)
    if not (need_h or need_w or need_b):
        return none
    common = (h, weight, labels, stats, ent, grad_logp, grad_ent if with_entropy else None, temperature, ignore_index,
              need_h, need_w, vocab_chunk)  # fmt: skip
    if not ctx.ext:
        dh, dw = fused_linear_logprob_backward(*common)
        return (dh if need_h else None), (dw if need_w else None), *none[2:]
    dh, dw, db = fused_linear_logprob_backward_ext(
        *common, bias, softcap, grad_lse if ctx.with_lse else None, grad_zsum if ctx.with_zsum else None, need_b
    )
    return (dh if need_h else None), (dw if need_w else None), *none[:6], (db if need_b else None), *none[:4]


_fused_linear_logprob_forward.register_autograd(_backward, setup_context=_setup_context)
_fused_linear_logprob_forward_ext.register_autograd(_backward, setup_context=_setup_context)


_lib.define(
    "fused_linear_logprob_ext(Tensor h, Tensor weight, Tensor labels, float temperature=1.0, int ignore_index=-100, "
    "bool with_entropy=True, bool check_inputs=False, int vocab_chunk=-1, Tensor? bias=None, float softcap=0.0, "
    "bool with_lse=False, bool with_zsum=False, bool with_argmax=False) "
    "-> (Tensor logp, Tensor entropy, Tensor lse, Tensor zsum, Tensor argmax)"
)


def _public(
    h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, ignore_index: int = -100,
    with_entropy: bool = True, check_inputs: bool = False, vocab_chunk: int = -1, bias: torch.Tensor | None = None,
    softcap: float = 0.0, with_lse: bool = False, with_zsum: bool = False, with_argmax: bool = False, *, ext: bool,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """``fused_linear_logprob`` (``ext=False``: (logp, entropy)) and ``fused_linear_logprob_ext`` ((logp, entropy,
    lse, zsum, argmax)): the static checks (they trace), then the custom op."""
    _check_static(h, weight, labels, temperature)
    args = (h, weight, labels, float(temperature), int(ignore_index), bool(with_entropy), bool(check_inputs),
            int(vocab_chunk))  # fmt: skip
    if not ext:
        logp, ent, _stats = torch.ops.tilecompile._fused_linear_logprob_forward(*args)
        return logp, ent
    _check_options(weight, bias, softcap)
    logp, ent, _stats, lse, zsum, amax = torch.ops.tilecompile._fused_linear_logprob_forward_ext(
        *args, bias, float(softcap), bool(with_lse), bool(with_zsum), bool(with_argmax)
    )
    return logp, ent, lse, zsum, amax


_lib.impl("fused_linear_logprob", functools.partial(_public, ext=False), "CompositeImplicitAutograd")
_lib.impl("fused_linear_logprob_ext", functools.partial(_public, ext=True), "CompositeImplicitAutograd")


# ------------------------------------------------------------------------------------------- loss-aware mode

# loss key -> the traced loss function F(logp, entropy, *extras) -> scalar loss S (passes/lm_head/loss_aware.py builds
# it from the graph). A custom op cannot take a callable; it takes the key. Keys are digests of F's code, so a graph
# compiled in another process (Inductor's cache) finds the same F once the pass has run there too.
_LOSS_FNS: dict[int, Any] = {}


def register_loss(fn: Any, code: str) -> int:
    """Keep ``fn`` (an FX GraphModule) for the loss-aware op; returns its key (a digest of ``code``)."""
    key = int(hashlib.sha256(code.encode()).hexdigest()[:15], 16)
    _LOSS_FNS.setdefault(key, fn)
    return key


_MIN_SEGMENT = 512


def _row_segments(h: torch.Tensor) -> list[torch.Tensor]:
    """h's rows as 2-D [n_i, D] views with unit column stride, in order, without a copy where that keeps the GEMMs
    big: a shifted ``h[:, :-1]`` (rows strided per sequence) becomes one segment per sequence."""
    d = h.shape[-1]
    if h.stride(-1) == 1 and h.dim() >= 2:
        try:
            return [h.view(-1, d)]
        except RuntimeError:
            pass
        if h.dim() == 3 and h.shape[1] >= _MIN_SEGMENT and h.stride(1) == d:
            return list(h.unbind(0))
    return [h.reshape(-1, d).contiguous()]


def _per_token_grads(
    fn: Any, key: int, extras: list[torch.Tensor], shape: torch.Size, with_entropy: bool, backend: str
) -> Any:
    """``grad_of(logp, ent, r0, r1)`` for the kernel: ∂S/∂logp and ∂S/∂H of rows [r0, r1), from F evaluated on the
    kernel's [N] buffers (viewed in labels' shape).

    The pass proved that each token's gradient depends on that token's values alone, so F on buffers whose later
    rows are still 0 gives the exact gradient of the rows already done. F and its backward run once per row block
    over all N rows: in eager that is dozens of tiny kernels each time; ``backend`` (a torch.compile backend, or
    "eager") compiles them into a few (``_compiled_grads``)."""
    compiled = _compiled_grads(fn, key, with_entropy, backend) if backend != "eager" else None

    def grad_of(logp: torch.Tensor, ent: torch.Tensor | None, r0: int, r1: int):
        lp = logp.view(shape)
        e = ent.view(shape) if with_entropy else logp.new_zeros(0)
        grads = compiled(lp, e, extras) if compiled is not None else None
        if grads is None:
            with _autograd_inside_op():
                grads = _eager_grads(fn, with_entropy, lp, e, extras)
        grads = (*grads, None)[:2]
        return tuple(None if g is None else g.reshape(-1)[r0:r1].float().contiguous() for g in grads)

    return grad_of


def _eager_grads(fn: Any, with_entropy: bool, lp: torch.Tensor, ent: torch.Tensor, extras: list[torch.Tensor]):
    lp = lp.detach().requires_grad_()
    inputs = (lp, ent.detach().requires_grad_()) if with_entropy else (lp,)
    loss = fn(*inputs, *(() if with_entropy else (ent,)), *extras)
    return torch.autograd.grad(loss.sum(), inputs, allow_unused=True)


# (loss key, with_entropy, backend) -> F's gradient under torch.compile, or None once compiling it failed
_COMPILED: dict[tuple[int, bool, str], Any] = {}


def _compiled_grads(fn: Any, key: int, with_entropy: bool, backend: str) -> Any:
    """``run(lp, ent, extras) -> grads or None``: F's per-token gradient (``torch.func.grad``) compiled with
    ``backend``, one compiled function per loss key (Dynamo caches per code object, so each key gets its own copy of
    the code: keys never share, or exhaust, one code object's recompile limit). Shapes follow torch.compile's
    automatic dynamic (a second length recompiles once, symbolic). If compiling fails, the key falls back to eager
    autograd with a warning (None): a training step is never lost to it."""
    k = (key, with_entropy, backend)

    def build():
        argnums = (0, 1) if with_entropy else 0

        def loss_grads(lp, ent, extras):
            return torch.func.grad(lambda a, b: fn(a, b, *extras).sum(), argnums=argnums)(lp, ent)

        code = loss_grads.__code__.replace(co_name=f"loss_grads_{key:x}")
        own = types.FunctionType(code, loss_grads.__globals__, code.co_name, None, loss_grads.__closure__)
        return torch.compile(own, backend=backend, fullgraph=True)

    def run(lp, ent, extras):
        if _COMPILED.get(k, True) is None:
            return None
        try:
            # grad mode fixed (no recompile for the mode the op happens to run in); the user's saved-tensors hooks
            # set aside (the compiled gradient saves nothing for autograd)
            with _outside_op(all_keys=True), _without_saved_tensors_hooks(), torch.enable_grad():
                if k not in _COMPILED:
                    _COMPILED[k] = build()
                g = _COMPILED[k](lp, ent, extras)
        except Exception as e:  # noqa: BLE001 - any failure of the compiled gradient: eager autograd does the step
            _COMPILED[k] = None
            warnings.warn(
                f"tilecompile: compiling the loss-aware gradient with backend {backend!r} failed "
                f"({type(e).__name__}: {e}); eager autograd computes it instead",
                stacklevel=2,
            )
            return None
        return g if with_entropy else (g,)

    return run


@contextlib.contextmanager
def _without_saved_tensors_hooks():
    """The user's saved-tensors hooks (activation offloading, a checkpoint's) set aside, and whether hooks are
    enabled put back as it was, whatever happens inside: ``torch.func.grad`` refuses to run under hooks, and Dynamo,
    tracing that refusal, leaves hooks disabled for the whole thread (the user's next ``save_on_cpu`` raised)."""
    hooks = torch._C._autograd
    popped = []
    while (top := hooks._top_saved_tensors_default_hooks(True)) is not None:
        popped.append(top)
        hooks._pop_saved_tensors_default_hooks()
    message = hooks._saved_tensors_hooks_get_disabled_error_message()
    try:
        yield
    finally:
        if message is None:
            hooks._saved_tensors_hooks_enable()
        else:
            hooks._saved_tensors_hooks_disable(message)
        for pack, unpack in reversed(popped):
            hooks._push_saved_tensors_default_hooks(pack, unpack)


_AUTOGRAD_KEYS = (
    torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradFunctionality)
    | torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradOther)
    | torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradNestedTensor)
)


def _keys(prefix: str) -> Any:
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.Undefined)
    for name, key in torch._C.DispatchKey.__members__.items():
        if name.startswith(prefix):
            keys = keys | torch._C.DispatchKeySet(key)
    return keys


_AUTOCAST_KEYS = _keys("Autocast")


@contextlib.contextmanager
def _outside_op(all_keys: bool = False):
    """Code that runs inside the op's implementation as if called from outside: the op runs below the autograd
    dispatch keys (and, at run time, inside AOTAutograd's dispatch modes and below every key above the backend:
    torch.func, functionalization, ...). The modes are set aside; the autograd keys are put back, or with
    ``all_keys`` every key but autocast's (which stays as it was: off here), as a nested torch.compile needs."""
    include, exclude = torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set()
    keep = exclude & _AUTOCAST_KEYS if all_keys else exclude - _AUTOGRAD_KEYS
    with torch.utils._python_dispatch._disable_current_modes(), torch._C._ForceDispatchKeyGuard(include, keep):
        yield


@contextlib.contextmanager
def _autograd_inside_op():
    """Eager autograd for F's gradient inside the op's implementation, kept out of the user's saved-tensors hooks."""
    with _outside_op(), torch.enable_grad(), own_autograd():
        yield


@torch.library.custom_op("tilecompile::fused_linear_logprob_loss", mutates_args=())
def fused_linear_logprob_loss(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    ignore_index: int,
    with_entropy: bool,
    check_inputs: bool,
    extras: list[torch.Tensor],
    loss_key: int,
    block_rows: int = 0,
    grad_backend: str = "eager",
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The loss-aware mode: (logp, entropy or empty [0], grad_h, grad_weight), not differentiable.

    logp and entropy are ``fused_linear_logprob``'s. grad_h and grad_weight are the gradients of the scalar loss
    S = F(logp, entropy, *extras) (F registered under ``loss_key``), computed in the forward from the logits the
    forward has anyway (3 GEMMs). The pass calls it on detached h and weight and routes the gradient through
    ``loss_anchor``: S + loss_anchor(h, weight, grad_h, grad_weight) is S, and its backward is g·grad_h, g·grad_weight.
    ``grad_backend``: the torch.compile backend that compiles F's per-token gradient ("eager": none).
    ``softcap``: the logits are softcap·tanh(h·Wᵀ / softcap) / t (0: none), as for ``fused_linear_logprob_ext``.
    """
    _check_static(h, weight, labels, temperature)
    _check_options(weight, None, softcap)
    if loss_key not in _LOSS_FNS:
        raise RuntimeError(f"tilecompile: no loss function registered under key {loss_key} (compile in this process)")
    if not h.is_cuda or check_inputs:
        _check_labels(labels, weight.shape[0], ignore_index)
    labels1 = labels.reshape(-1).contiguous()
    grad_of = _per_token_grads(_LOSS_FNS[loss_key], loss_key, extras, labels.shape, with_entropy, grad_backend)
    logp, ent, _stats, dh, dw = lm_head_kernels.fused_linear_logprob_loss_fwd(
        _row_segments(h), weight, labels1, 1.0 / float(temperature), ignore_index, with_entropy, grad_of,
        block_rows=block_rows, softcap=float(softcap),
    )  # fmt: skip
    ent_out = ent.reshape(labels.shape) if ent is not None else h.new_empty(0, dtype=torch.float32)
    return logp.reshape(labels.shape), ent_out, dh.reshape(h.shape), dw


@fused_linear_logprob_loss.register_fake
def _(h, weight, labels, temperature, ignore_index, with_entropy, check_inputs, extras, loss_key, block_rows=0,
      grad_backend="eager", softcap=0.0):  # fmt: skip
    _check_static(h, weight, labels, temperature)
    _check_options(weight, None, softcap)
    logp = labels.new_empty(labels.shape, dtype=torch.float32)
    ent = labels.new_empty(labels.shape if with_entropy else (0,), dtype=torch.float32)
    # contiguous, as the op returns them (empty_like would keep a transposed h's strides)
    return logp, ent, h.new_empty(h.shape), weight.new_empty(weight.shape)


@torch.library.custom_op("tilecompile::loss_anchor", mutates_args=())
def loss_anchor(h: torch.Tensor, weight: torch.Tensor, grad_h: torch.Tensor, grad_weight: torch.Tensor) -> torch.Tensor:
    """A 0-dim fp32 zero whose gradient g (dOut/dS, once added to the loss S) gives h and weight g·grad_h and
    g·grad_weight: the loss-aware mode's way back into autograd."""
    return torch.zeros((), dtype=torch.float32, device=h.device)


@loss_anchor.register_fake
def _(h, weight, grad_h, grad_weight):
    return h.new_empty((), dtype=torch.float32)


def _anchor_setup_context(ctx, inputs, output):
    _h, _w, grad_h, grad_weight = inputs
    ctx.save_for_backward(grad_h, grad_weight)


def _anchor_backward(ctx, g):
    need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    grad_h, grad_weight = ctx.saved_tensors
    # plain aten multiplies: under Inductor the saved grads are donated buffers, so the scaling runs in place
    gh = grad_h * g if need_h else None
    gw = grad_weight * g if need_w else None
    return gh, gw, None, None


loss_anchor.register_autograd(_anchor_backward, setup_context=_anchor_setup_context)


# ------------------------------------------------------------------------------------- vocabulary parallel


def _local_labels(labels: torch.Tensor, lo: int, v_local: int, ignore_index: int) -> torch.Tensor:
    """Global labels -> this shard's columns; a row whose label is on another rank gets ``v_local`` (active, but
    matching no local column); ignored rows keep ignore_index (negative, so never a column)."""
    labels = labels.long()
    active = labels != ignore_index
    inside = active & (labels >= lo) & (labels < lo + v_local)
    return torch.where(inside, labels - lo, torch.where(active, v_local, ignore_index))


@torch.library.custom_op("tilecompile::_fused_linear_logprob_local_stats", mutates_args=())
def _fused_linear_logprob_local_stats(
    h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, lo: int, vocab: int, temperature: float,
    ignore_index: int, vocab_chunk: int = -1,
) -> torch.Tensor:  # fmt: skip
    """Softmax statistics of this rank's vocabulary shard (rows [lo, lo + V_local) of a [vocab, D] lm_head), fp32,
    labels' shape + [4]: (m, log Σe, Σe·(z − m)/Σe, z_y − m), with m the shard's row max and Σe = Σ_j e^(z_j − m)
    over the shard; z_y − m is 0 where the row's label is not in the shard. ``labels`` are global; on CPU one
    outside [0, vocab) that is not ignore_index is a ``LabelOutOfRange`` (as for ``fused_linear_logprob``)."""
    _check_static(h, weight, labels, temperature)
    if not h.is_cuda:
        _check_labels(labels, vocab, ignore_index)
    h2, labels1 = _flat(h, _local_labels(labels, lo, weight.shape[0], ignore_index))
    logp, ent, stats, _ = lm_head_kernels.fused_linear_logprob_fwd(
        h2, weight, labels1, 1.0 / float(temperature), ignore_index, True, chunk=_vocab_chunk(vocab_chunk)
    )
    m, log_s = stats[:, 0], stats[:, 1]
    local = (labels1 >= 0) & (labels1 < weight.shape[0])
    zym = torch.where(local, logp + log_s, 0.0)  # logp = (z_y − m) − log Σe where the label is local
    return torch.stack((m, log_s, log_s - ent, zym), dim=1).reshape(*labels.shape, 4)


@_fused_linear_logprob_local_stats.register_fake
def _(h, weight, labels, lo, vocab, temperature, ignore_index, vocab_chunk=-1):
    _check_static(h, weight, labels, temperature)
    return labels.new_empty((*labels.shape, 4), dtype=torch.float32)


class _VocabParallelLogprob(torch.autograd.Function):
    """log-prob and entropy of a vocabulary-parallel lm_head (passes/tensor_parallel.py): local statistics, an
    all_reduce MAX of the row max (no grad), one all_reduce SUM of the packed [Σe, Σe·(z − M), z_y − M] rescaled to
    the global max M; the backward is local (the partial dh is summed by the all_reduce of h's copy_to_tp)."""

    @staticmethod
    def forward(ctx, h, weight, labels, temperature, ignore_index, with_entropy, vocab_chunk, group, world, rank):
        from tilecompile.ops import collectives as collectives

        if ignore_index >= 0:
            raise ValueError(f"vocab-parallel log-prob needs a negative ignore_index, got {ignore_index}")
        v_local = weight.shape[0]
        lo = rank * v_local
        st = torch.ops.tilecompile._fused_linear_logprob_local_stats(
            h, weight, labels, lo, v_local * world, float(temperature), int(ignore_index), int(vocab_chunk)
        )
        local = _local_labels(labels, lo, v_local, ignore_index)  # what the backward op reads
        active = labels != ignore_index
        inside = (local >= 0) & (local < v_local)
        m, log_s, aos, zym = st.unbind(-1)
        big = collectives.all_reduce(m, "max", group)
        shift = m - big
        s = torch.exp(shift + log_s)
        packed = torch.stack((s, s * (aos + shift), torch.where(inside, zym + shift, 0.0)), dim=-1)
        total = collectives.all_reduce(packed, "sum", group)
        s_all, a_all, zy_all = total.unbind(-1)
        log_s_all = torch.log(s_all)
        logp = torch.where(active, zy_all - log_s_all, 0.0)
        ent = log_s_all - a_all / s_all
        stats = torch.stack((big, log_s_all), dim=-1)
        ctx.save_for_backward(h, weight, local, stats, ent)
        ctx.args = (float(temperature), int(ignore_index), bool(with_entropy), int(vocab_chunk))
        ctx.set_materialize_grads(False)
        return logp, (ent if with_entropy else ent.new_empty(0))

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        h, weight, local, stats, ent = ctx.saved_tensors
        temperature, ignore_index, with_entropy, vocab_chunk = ctx.args
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not with_entropy:
            grad_ent = None
        if not (need_h or need_w) or (grad_logp is None and grad_ent is None):
            return (None,) * 10
        dh, dw = torch.ops.tilecompile.fused_linear_logprob_backward(
            h, weight, local, stats, ent, grad_logp, grad_ent, temperature, ignore_index, need_h, need_w, vocab_chunk
        )
        return (dh if need_h else None), (dw if need_w else None), *(None,) * 8


def vocab_parallel_logprob(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    ignore_index: int,
    with_entropy: bool,
    vocab_chunk: int,
    group: str,
    world: int,
    rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fused_linear_logprob`` with ``weight`` this rank's rows [rank·V/world, (rank+1)·V/world) of the lm_head
    and ``labels`` global; (logp, entropy or an empty [0]) of the whole vocabulary, fp32, on every rank. The logits
    are never gathered. ``h`` must be replicated and its gradient all-reduced by the caller (the tensor_parallel
    pass's copy_to_tp): the gradient returned for ``h`` is this shard's part."""
    return _VocabParallelLogprob.apply(
        h, weight, labels, temperature, ignore_index, with_entropy, vocab_chunk, group, world, rank
    )


def linear_logprob_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    ignore_index: int = -100,
    with_entropy: bool = True,
    *,
    bias: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-prob of ``labels`` under softmax(h·Wᵀ / t), and the entropy (None if not asked), in fp32;
    with ``bias`` / ``softcap``, under softmax(softcap(h·Wᵀ + b) / t).

    Label checks on CUDA follow the ``check_inputs`` setting (TILECOMPILE_CHECK_INPUTS; a host sync per call).
    """
    if bias is not None or softcap:
        logp, ent, _, _, _ = torch.ops.tilecompile.fused_linear_logprob_ext(
            h, weight, labels, float(temperature), int(ignore_index), bool(with_entropy), config.load().check_inputs,
            -1, bias, float(softcap),
        )  # fmt: skip
        return logp, (ent if with_entropy else None)
    logp, ent = torch.ops.tilecompile.fused_linear_logprob(
        h, weight, labels, float(temperature), int(ignore_index), bool(with_entropy), config.load().check_inputs
    )
    return logp, (ent if with_entropy else None)


def linear_cross_entropy_z_loss(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    softcap: float = 0.0,
    z_loss_scale: float = 0.0,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy over the non-ignored tokens plus ``z_loss_scale`` · mean lse² over the same tokens (the
    z-loss), with z = softcap(h·Wᵀ + b): (loss, per-token lse), fp32, without the logits."""
    logp, _, lse, _, _ = torch.ops.tilecompile.fused_linear_logprob_ext(
        h, weight, labels, 1.0, int(ignore_index), False, config.load().check_inputs, -1, bias, float(softcap), True
    )
    active = labels != ignore_index
    count = active.sum()
    loss = -logp.sum() / count
    if z_loss_scale:
        loss = loss + z_loss_scale * torch.where(active, lse * lse, 0.0).sum() / count
    return loss, lse


def linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """``F.cross_entropy(h @ weight.T / t, labels, ignore_index=..., reduction=...)`` without the logits (fp32).

    mean: sum over non-ignored tokens / their count (all ignored: 0/0 = nan, as in torch); none: 0 at ignored.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    logp, _ = linear_logprob_entropy(h, weight, labels, temperature, ignore_index, with_entropy=False)
    nll = -logp
    if reduction == "none":
        return nll
    total = nll.sum()
    if reduction == "sum":
        return total
    return total / (labels != ignore_index).sum()


__all__ = [
    "fused_linear_logprob_backward",
    "fused_linear_logprob_backward_ext",
    "linear_cross_entropy",
    "linear_cross_entropy_z_loss",
    "linear_logprob_entropy",
    "vocab_parallel_logprob",
]
