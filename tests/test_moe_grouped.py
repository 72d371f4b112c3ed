"""tilecompile::tiled_grouped_mlp's grouped path (issue 42): token chunks through ``torch._grouped_mm`` with offsets
clamped on the device. Its values and grads equal a float64 per-expert reference (and the loop path's) for every
chunking, an expert cut by chunk edges, idle experts, rows past the last offset and masked rows; its Triton kernels
equal their PyTorch reference under TRITON_INTERPRET=1; and it makes no host sync (it runs under fake tensors,
where reading a value raises; on a GPU under ``torch.cuda.set_sync_debug_mode("error")``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, rel_err

from tilecompile.ops import tiled_grouped_mlp as grouped_op
from tilecompile.ops.tiled_grouped_mlp import tiled_grouped_mlp

ACTS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "relu": F.relu,
}


def _inputs(dtype=torch.float32, rows=100, d=16, inter=24, experts=5, device="cpu"):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, d, generator=g).to(device, dtype).requires_grad_()
    gate_up = (torch.randn(experts, 2 * inter, d, generator=g) / d**0.5).to(device, dtype).requires_grad_()
    down = (torch.randn(experts, d, inter, generator=g) / inter**0.5).to(device, dtype).requires_grad_()
    # an idle expert at the start and in the middle, a big expert that chunks of 7 or 32 rows cut, 6 rows past the end
    offsets = torch.tensor([0, 20, 20, 61, 94][:experts], dtype=torch.int32, device=device)
    return x, gate_up, down, offsets


def _reference(x, gate_up, down, offsets, activation="silu", row_mask=None, row_weight=None):
    """float64 per-expert loop; rows past offsets[-1] zero; ``row_mask`` [S, 1] zero-fills the gate_up output;
    ``row_weight`` [S, 1] multiplies the output after it (HF's routing weights)."""
    x, gate_up, down = (t.double() for t in (x, gate_up, down))
    out, lo = [], 0
    for e, hi in enumerate(offsets.tolist()):
        p = F.linear(x[lo:hi], gate_up[e])
        if row_mask is not None:
            p = p.masked_fill(row_mask[lo:hi], 0)
        g, u = p.chunk(2, dim=-1)
        out.append(F.linear(ACTS[activation](g) * u, down[e]))
        lo = hi
    out.append(x.new_zeros((x.shape[0] - lo, down.shape[1])))
    out = torch.cat(out)
    return out if row_weight is None else out * row_weight.double()


def _tiled(x, gate_up, down, offsets, form="views", **kw):
    """The op on HF's layout; gate and up as ``form``: "views" (two halves of the transposed gate_up), "separate"
    (two weights of their own, no fused [E, D, 2I] view) or "stacked" (the [E, D, 2I] weight whole, up None)."""
    w = gate_up.transpose(-2, -1)
    inter = w.shape[-1] // 2
    gate, up = w[..., :inter], w[..., inter:]
    if form == "separate":
        gate, up = gate.contiguous(), up.contiguous()
    if form == "stacked":
        gate, up = w, None
    return tiled_grouped_mlp(x, offsets, gate, up, down.transpose(-2, -1), **kw)


def _grads(out, inputs, dy):
    return torch.autograd.grad(out, inputs, dy)


@pytest.fixture
def grouped_only(monkeypatch):
    """The loop path raises: a test under this fixture runs the grouped path."""

    def no_loop(*_):
        raise AssertionError("the loop path ran (offsets read on the host)")

    monkeypatch.setattr(grouped_op, "_bounds", no_loop)


@pytest.mark.parametrize("chunk", [0, 7, 32, 1000])
@pytest.mark.parametrize("grad_accum", ["fp32", "param"])
@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "row_mask"])
@pytest.mark.parametrize("form", ["views", "separate", "stacked"])
def test_grouped_path_equals_float64_reference(grouped_only, chunk, grad_accum, masked, form):
    """fp32 on CPU: output and grads within fp32 rounding of the float64 reference; rows past the last offset and
    masked rows give zero output and zero dx; idle experts get zero weight grads."""
    x, gate_up, down, offsets = _inputs()
    mask = None
    if masked:
        mask = torch.zeros(x.shape[0], 1, dtype=torch.bool)
        mask[[0, 19, 20, 33, 60, 97]] = True  # group edges, inside a group, past the last offset
    out = _tiled(x, gate_up, down, offsets, form, chunk_tokens=chunk, grad_accum=grad_accum, row_mask=mask)
    ref_inputs = [t.detach().double().requires_grad_() for t in (x, gate_up, down)]
    expected = _reference(*ref_inputs, offsets, row_mask=mask)
    assert_close(out, expected, rtol=1e-5, atol=1e-5, name="out")
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    ours = _grads(out, (x, gate_up, down), dy)
    theirs = _grads(expected, ref_inputs, dy.double())
    for name, a, b in zip(("x", "gate_up", "down"), ours, theirs):
        assert_close(a, b, rtol=1e-4, atol=1e-4, name=f"grad of {name}")
    assert not out[94:].any() and not ours[0][94:].any()
    assert not ours[1][0].any() and not ours[1][2].any() and not ours[2][0].any()
    if masked:
        assert not out[mask.squeeze(1)].any() and not ours[0][mask.squeeze(1)].any()


def test_grouped_chunks_split_evenly():
    """The budget's chunk count, split evenly: no sliver of a last chunk, never above the budget's chunk."""
    from tilecompile.ops.tiled_mlp import chunk_size_for

    # 32k tokens at top 8 (Qwen3-30B-A3B's I 768, bf16): six chunks of 43,648 and a seventh of 256 before
    assert chunk_size_for(262144, 768, torch.bfloat16, 256) == 43648
    assert grouped_op._grouped_chunk(262144, 768, torch.bfloat16, 0, 256) == 37504
    assert grouped_op._grouped_chunk(65536, 768, torch.bfloat16, 0, 256) == 32768
    assert grouped_op._grouped_chunk(262144, 768, torch.bfloat16, 5000, 256) == 5000  # chunk_tokens as given
    for rows in [0, 1, 63, 64, 65, 1000, 43648, 43649, 87297, 262144, 300001]:
        for inter, budget in ((768, 256), (768, 64), (4096, 16)):
            most = chunk_size_for(rows, inter, torch.bfloat16, budget)
            chunk = grouped_op._grouped_chunk(rows, inter, torch.bfloat16, 0, budget)
            assert chunk % 64 == 0 and 64 <= chunk <= most, (rows, inter, budget, chunk, most)
            assert -(-rows // chunk) == -(-rows // most), (rows, inter, budget)  # no more chunks than the budget's
            if rows > chunk:  # the last chunk within 64 rows a chunk of the others
                assert rows - (-(-rows // chunk) - 1) * chunk > chunk - 64 * -(-rows // chunk), (rows, chunk)


@pytest.mark.parametrize("chunk", [1, 3, 8, 40])
@pytest.mark.parametrize(
    "dtype,grad_accum",
    [(torch.float32, "fp32"), (torch.bfloat16, "fp32"), (torch.bfloat16, "param"), (torch.float16, "fp32")],
)
def test_weight_grad_carry_equals_a_full_accumulator(chunk, dtype, grad_accum):
    """The grouped path's weight grads over chunks: each chunk's part into the grad, with the carry of the experts
    cut by chunk edges, gives bit for bit what an [E, K, N] accumulator in the accumulation dtype gives (the parts
    summed in chunk order, rounded once); experts with no rows get zero, whatever the grad held before."""
    from tilecompile.kernels import tiled_mlp_reference as reference
    from tilecompile.ops.tiled_mlp import acc_dtype

    # idle experts first, in the middle and last; one expert of 19 rows (across several edges); 4 rows past the end
    offsets = torch.tensor([0, 0, 5, 24, 24, 25, 36, 36], dtype=torch.int32)
    rows, experts = 40, offsets.shape[0]
    accumulation = acc_dtype(dtype, grad_accum)
    g = torch.Generator().manual_seed(3)
    grad = torch.full((experts, 4, 6), float("nan"), dtype=dtype)
    carry = torch.full((2, 4, 6), float("nan"), dtype=accumulation)
    full = torch.zeros((experts, 4, 6), dtype=accumulation)
    bounds = list(zip([0, *offsets.tolist()[:-1]], offsets.tolist()))
    starts = list(range(0, rows, chunk))
    for index, s in enumerate(starts):
        t = min(s + chunk, rows)
        part = torch.randn(experts, 4, 6, generator=g).to(dtype)
        for e, (lo, hi) in enumerate(bounds):  # grouped_mm's grad is zero for an expert without rows in the chunk
            if max(lo, s) >= min(hi, t):
                part[e] = 0
        full += part.to(accumulation)
        reference.carry_accumulate_reference(grad, carry, part, offsets, s, t, rows, index, index == len(starts) - 1)
    assert torch.equal(grad, full.to(dtype))
    assert not grad[[0, 1, 4, 7]].any()


@pytest.mark.parametrize("path", ["grouped", "loop"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunk", [0, 7, 32])
@pytest.mark.parametrize("shape", ["S1", "S"])
@pytest.mark.parametrize("form", ["views", "stacked"])
def test_row_weight_equals_float64_reference(monkeypatch, path, dtype, chunk, shape, form):
    """``row_weight`` (the routing weights taken into the op): the output times each row's weight, and the weight's
    own grad, against the float64 reference, with a row mask; rows past the last offset and masked rows get zero
    weight grad. fp64 runs the loop path only (grouped_mm takes no fp64)."""
    if dtype is torch.float64 and path == "grouped":
        pytest.skip("grouped_mm has no float64")
    monkeypatch.setattr(grouped_op, "USE_GROUPED", path == "grouped")
    x, gate_up, down, offsets = (t.detach().to(dtype) if t.is_floating_point() else t for t in _inputs())
    for t in (x, gate_up, down):
        t.requires_grad_()
    g = torch.Generator().manual_seed(4)
    weight = torch.rand(x.shape[0], 1, generator=g).to(dtype).requires_grad_()
    mask = torch.zeros(x.shape[0], 1, dtype=torch.bool)
    mask[[0, 19, 33, 97]] = True
    passed = weight if shape == "S1" else weight.squeeze(1)
    out = _tiled(x, gate_up, down, offsets, form, chunk_tokens=chunk, row_mask=mask, row_weight=passed)
    ref_inputs = [t.detach().double().requires_grad_() for t in (x, gate_up, down, weight)]
    expected = _reference(*ref_inputs[:3], offsets, row_mask=mask, row_weight=ref_inputs[3])
    tol = 1e-12 if dtype is torch.float64 else 1e-5
    assert_close(out, expected, rtol=tol, atol=tol, name="out")
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    ours = _grads(out, (x, gate_up, down, weight), dy.to(dtype))
    theirs = _grads(expected, ref_inputs, dy.double())
    for name, a, b in zip(("x", "gate_up", "down", "row_weight"), ours, theirs):
        assert_close(a, b, rtol=10 * tol, atol=10 * tol, name=f"grad of {name}")
    dw = ours[3].squeeze(1)
    assert dw[mask.squeeze(1)].eq(0).all() and dw[94:].eq(0).all() and dw[1:19].ne(0).all()


def test_stacked_gate_up_opcheck_and_bad_shape():
    """``up_weight`` None: the stacked [E, D, 2I] gate_up as one operand passes opcheck (fake, autograd, schema);
    an odd last dim has no two halves and is named."""
    x, gate_up, down, offsets = _inputs()
    w, wd = gate_up.transpose(-2, -1), down.transpose(-2, -1)
    torch.library.opcheck(torch.ops.tilecompile.tiled_grouped_mlp.default, (x, offsets, w, None, wd, "silu", 16))
    with pytest.raises(ValueError, match="must be even"):
        tiled_grouped_mlp(x, offsets, w[..., :47], None, wd)
    with pytest.raises(ValueError, match="do not chain"):
        tiled_grouped_mlp(x, offsets, w[..., :46], None, wd)


def test_row_weight_opcheck_and_bad_weights():
    x, gate_up, down, offsets = _inputs()
    w = gate_up.transpose(-2, -1)
    args = (x, offsets, w[..., :24], w[..., 24:], down.transpose(-2, -1))
    weight = torch.rand(x.shape[0], 1, requires_grad=True)
    torch.library.opcheck(
        torch.ops.tilecompile.tiled_grouped_mlp.default, (*args, "silu", 16, 256, "fp32", None, weight)
    )
    for bad, said in ((weight.double(), "x's dtype"), (torch.rand(x.shape[0], 2), "[S, 1] or [S]")):
        with pytest.raises(ValueError, match=re.escape(said)):
            tiled_grouped_mlp(*args, row_weight=bad)


@pytest.mark.parametrize("path", ["grouped", "loop"])
@pytest.mark.parametrize("chunk", [0, 7])
@pytest.mark.parametrize("layout", ["hf", "contiguous"])
@pytest.mark.parametrize("form", ["views", "stacked"])
def test_weight_grads_come_in_the_weights_layout(monkeypatch, path, chunk, layout, form):
    """HF passes its [E, N, K] parameters transposed: the backward op's weight grads have the weights' own strides
    on every path (and in its fake), so autograd's transpose back to the parameter is a view, not a copy; with
    row-major weights, row-major grads. A stacked gate_up (up None) gets its grad whole, in the stacked weight's
    layout, in the gate's place. The values are the float64 reference's either way."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(grouped_op, "USE_GROUPED", path == "grouped")
    x, gate_up, down, offsets = _inputs()
    w, wd = gate_up.detach().transpose(-2, -1), down.detach().transpose(-2, -1)
    if layout == "contiguous":
        w, wd = w.contiguous(), wd.contiguous()
    gate, up = (w, None) if form == "stacked" else (w[..., :24], w[..., 24:])
    if layout == "contiguous" and form == "views":  # two row-major weights of their own
        gate, up = gate.contiguous(), up.contiguous()
    weight = torch.rand(x.shape[0], 1)
    dy = torch.randn(x.shape[0], 16, generator=torch.Generator().manual_seed(3))
    args = (dy, x.detach(), offsets, gate, up, wd, "silu", chunk, 256, "fp32", [True] * 5, None, weight)
    grads = torch.ops.tilecompile.tiled_grouped_mlp_backward(*args)
    if form == "stacked":
        assert grads[2].numel() == 0  # up's place: a placeholder
    for g, wt in zip(grads[1:4], (gate, up, wd)):  # gate's and up's expert stride is the stacked weight's
        if wt is None:
            continue
        dense = g.transpose(-2, -1) if layout == "hf" else g
        assert g.shape == wt.shape and g.stride()[1:] == wt.stride()[1:] and dense.is_contiguous(), g.stride()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        fake_grads = torch.ops.tilecompile.tiled_grouped_mlp_backward(*fake)
    assert [g.shape for g in fake_grads] == [g.shape for g in grads]
    assert [g.stride() for g in fake_grads] == [g.stride() for g in grads]
    # the fake's placeholders for grads not needed are tensors of their own (outputs never alias one another)
    few = (*args[:10], [False, True, False, False, False], None, None)
    torch.library.opcheck(torch.ops.tilecompile.tiled_grouped_mlp_backward.default, few)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        outs = torch.ops.tilecompile.tiled_grouped_mlp_backward(
            *[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in few]
        )
    assert len({id(o) for o in outs}) == 5
    ref = [t.detach().double().requires_grad_() for t in (gate_up, down)]
    expected = _reference(x.detach(), *ref, offsets, row_weight=weight)
    g_gate_up, g_down = (g.transpose(-2, -1) for g in torch.autograd.grad(expected, ref, dy.double()))
    wanted = (g_gate_up, None) if form == "stacked" else (g_gate_up[..., :24], g_gate_up[..., 24:])
    for name, a, b in zip(("gate", "up", "down"), grads[1:4], (*wanted, g_down)):
        if b is not None:
            assert_close(a, b, rtol=1e-4, atol=1e-4, name=f"grad of {name}")


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu"])
def test_grouped_path_activations(grouped_only, activation):
    x, gate_up, down, offsets = _inputs()
    out = _tiled(x, gate_up, down, offsets, activation=activation, chunk_tokens=16)
    ref_inputs = [t.detach().double().requires_grad_() for t in (x, gate_up, down)]
    expected = _reference(*ref_inputs, offsets, activation)
    assert_close(out, expected, rtol=1e-5, atol=1e-5, name="out")
    ours = _grads(out, (x, gate_up, down), torch.ones_like(out))
    theirs = _grads(expected, ref_inputs, torch.ones_like(expected))
    for name, a, b in zip(("x", "gate_up", "down"), ours, theirs):
        assert_close(a, b, rtol=1e-4, atol=1e-4, name=f"grad of {name}")


def test_grouped_path_bf16_error_within_eager_grouped_mm(grouped_only):
    """bf16, chunked (an expert cut by chunk edges, int64 offsets): the error against float64 of the output and of
    every grad is within a small margin of eager grouped_mm's own (rows past the last offset left out: eager leaves
    them undefined)."""
    x, gate_up, down, offsets = _inputs(torch.bfloat16, rows=200, d=32, inter=48, experts=5)
    offsets = torch.tensor([0, 40, 40, 150, 190])
    inputs = (x, gate_up, down)
    dy = torch.randn(200, 32, generator=torch.Generator().manual_seed(2)).bfloat16()
    dy[190:] = 0
    out = _tiled(x, gate_up, down, offsets, chunk_tokens=32)
    g, u = F.grouped_mm(x, gate_up.transpose(-2, -1), offs=offsets.int()).chunk(2, dim=-1)
    eager = F.grouped_mm(F.silu(g) * u, down.transpose(-2, -1), offs=offsets.int())
    ref_inputs = [t.detach().double().requires_grad_() for t in inputs]
    expected = _reference(*ref_inputs, offsets)
    assert rel_err(out[:190], expected[:190]) <= 1.5 * rel_err(eager[:190], expected[:190]) + 1e-3
    ours, theirs_eager = _grads(out, inputs, dy), _grads(eager, inputs, dy)
    theirs = _grads(expected, ref_inputs, dy.double())
    for name, a, e, r in zip(("x", "gate_up", "down"), ours, theirs_eager, theirs):
        a, e, r = (a[:190], e[:190], r[:190]) if name == "x" else (a, e, r)
        assert rel_err(a, r) <= 1.5 * rel_err(e, r) + 1e-3, (name, rel_err(a, r), rel_err(e, r))


def test_grouped_path_equals_loop_path():
    """The same op call through both paths (fp32): equal to fp32 rounding."""
    x, gate_up, down, offsets = _inputs()
    results = []
    for grouped in (True, False):
        grouped_op.USE_GROUPED = grouped
        try:
            out = _tiled(x, gate_up, down, offsets, chunk_tokens=7)
            results.append((out, *_grads(out, (x, gate_up, down), torch.ones_like(out))))
        finally:
            grouped_op.USE_GROUPED = True
    for a, b in zip(*results):
        assert_close(a, b, rtol=1e-5, atol=1e-5, name="grouped vs loop")


def test_grouped_path_is_taken_only_where_grouped_mm_fits():
    x, gate_up, down, _ = _inputs()
    w = gate_up.transpose(-2, -1)
    assert grouped_op._grouped_ok(x, w[..., :24], w[..., 24:], down.transpose(-2, -1))
    assert grouped_op._fused_gate_up(w[..., :24], w[..., 24:]) is not None
    assert grouped_op._fused_gate_up(w[..., :24].contiguous(), w[..., 24:].contiguous()) is None
    x64, gu64, down64, _ = _inputs(torch.float64)
    w64 = gu64.transpose(-2, -1)
    assert not grouped_op._grouped_ok(x64, w64[..., :24], w64[..., 24:], down64.transpose(-2, -1))
    x13, gu13, down13, _ = _inputs(d=13)  # 52-byte rows: not 16-byte aligned
    w13 = gu13.transpose(-2, -1)
    assert not grouped_op._grouped_ok(x13, w13[..., :24], w13[..., 24:], down13.transpose(-2, -1))


# ---------------------------------------------------------------------------------------------------- no sync


def test_grouped_path_makes_no_host_sync():
    """The grouped path's forward and backward run under fake tensors, where any read of a value on the host
    (``item``, ``tolist``, ``nonzero``, a data-dependent shape) raises; a chunked call with a row mask and a row
    weight."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(300, 32, dtype=torch.bfloat16)
        gate_up = torch.empty(6, 96, 32, dtype=torch.bfloat16)
        down = torch.empty(6, 32, 48, dtype=torch.bfloat16)
        offsets = torch.empty(6, dtype=torch.int64)
        mask = torch.empty(300, 1, dtype=torch.bool)
        row_weight = torch.empty(300, 1, dtype=torch.bfloat16)
        w = gate_up.transpose(-2, -1)
        gate, up, wd = w[..., :48], w[..., 48:], down.transpose(-2, -1)
        with pytest.raises(torch._subclasses.fake_tensor.DataDependentOutputException):
            offsets.tolist()  # what the loop path does: it would raise here
        out = grouped_op._grouped_forward(x, offsets, gate, up, wd, "silu", 64, mask, row_weight)
        needs = (True, True, True, True, True)
        args = (out, x, offsets, gate, up, wd, "silu", 64, "fp32", needs, mask, row_weight)
        grads = grouped_op._grouped_backward(*args, None)
        stacked_grads = grouped_op._grouped_backward(*args, w)  # the stacked gate_up's grad whole
    assert out.shape == (300, 32) and [tuple(g.shape) for g in grads] == [(300, 32), (6, 32, 48), (6, 32, 48),
                                                                          (6, 48, 32), (300, 1)]  # fmt: skip
    assert [tuple(g.shape) for g in stacked_grads] == [(300, 32), (6, 32, 96), (0,), (6, 48, 32), (300, 1)]


@pytest.mark.gpu
def test_grouped_path_makes_no_host_sync_on_cuda():
    x, gate_up, down, offsets = _inputs(torch.bfloat16, rows=4096, d=256, inter=128, experts=5, device="cuda")
    offsets = torch.tensor([0, 1000, 1000, 3000, 4000], dtype=torch.int32, device="cuda")
    _tiled(x, gate_up, down, offsets, chunk_tokens=512).backward(torch.ones(4096, 256, device="cuda").bfloat16())
    torch.cuda.synchronize()  # warm: Triton compiles and the addmm probe run before the check
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = _tiled(x, gate_up, down, offsets, chunk_tokens=512)
        out.backward(torch.ones_like(out))
    finally:
        torch.cuda.set_sync_debug_mode(0)


# ------------------------------------------------------------------------------------------------ the kernels

_TRITON_WORKER = textwrap.dedent(
    """
    import torch
    from tilecompile.kernels import tiled_grouped_mlp as K
    from tilecompile.kernels import tiled_mlp_reference as reference
    from tilecompile.ops import tiled_grouped_mlp as op

    torch.manual_seed(0)
    for act in ("silu", "gelu", "gelu_tanh", "relu"):
        for masked in (False, True):
            gu = torch.randn(37, 2 * 24)
            dh = torch.randn(37, 24)
            mask = (torch.rand(37, 1) < 0.3) if masked else None
            h = K.act_mul(gu.clone(), mask, act)
            h_ref = reference.act_mul_reference(gu.clone(), mask, act)
            assert torch.allclose(h, h_ref, rtol=1e-5, atol=1e-6), (act, masked, (h - h_ref).abs().max())
            a, b = gu.clone(), dh.clone()
            K.act_backward(a, b, mask, act)
            c, d = gu.clone(), dh.clone()
            reference.act_backward_reference(c, d, mask, act)
            assert torch.allclose(a, c, rtol=1e-5, atol=1e-6), (act, masked, (a - c).abs().max())
            assert torch.allclose(b, d, rtol=1e-5, atol=1e-6), (act, masked, (b - d).abs().max())
    # with the row weight: [dg | du] of dh * w, dw = Σ dh·h (zero past offsets[-1]), h * w over dh
    offs = torch.tensor([5, 20, 29], dtype=torch.int32)
    for act in ("silu", "gelu_tanh"):
        for dtype, masked, need_dw, store_h, start in ((torch.float32, False, True, True, 0),
                                                       (torch.float32, True, True, False, 16),
                                                       (torch.float16, True, False, True, 8),
                                                       (torch.float32, False, True, True, 40)):
            gu = torch.randn(37, 2 * 300).to(dtype)  # I = 300: two column blocks and a partial one
            dh = torch.randn(37, 300).to(dtype)
            w = torch.rand(37, 1).to(dtype)
            mask = (torch.rand(37, 1) < 0.3) if masked else None
            ours, theirs = [gu.clone(), dh.clone()], [gu.clone(), dh.clone()]
            dws = [torch.full((37, 1), float("nan"), dtype=dtype) if need_dw else None for _ in range(2)]
            K.act_backward_weighted(*ours, mask, w, dws[0], offs, start, act, store_h)
            reference.act_backward_weighted_reference(*theirs, mask, w, dws[1], offs, start, act, store_h)
            tol = 1e-5 if dtype == torch.float32 else 4e-3  # fp16: the reference rounds each product
            for x, y in zip(ours[: 1 + store_h] + dws[:1], theirs[: 1 + store_h] + dws[1:]):  # dh only if stored
                if x is not None:
                    assert torch.allclose(x.float(), y.float(), rtol=tol, atol=tol * 30), (act, dtype, start,
                                                                                          (x - y).abs().max())
            if need_dw:
                assert (dws[0][max(29 - start, 0):] == 0).all() and not dws[0].isnan().any(), (start, dws[0])
    # the weight-grad carry over 5 chunks of 8 rows (an expert across three edges, idle ones, rows past the end)
    offsets = torch.tensor([0, 3, 11, 11, 30, 31, 36], dtype=torch.int32)
    for dtype, carry_dtype in ((torch.float32, torch.float32), (torch.float16, torch.float32),
                               (torch.float16, torch.float16)):
        grads = [torch.full((7, 5, 6), float("nan"), dtype=dtype) for _ in range(2)]
        carries = [torch.full((2, 5, 6), float("nan"), dtype=carry_dtype) for _ in range(2)]
        for index, s in enumerate(range(0, 40, 8)):
            part = torch.randn(7, 5, 6).to(dtype)
            args = (part, offsets, s, s + 8, 40, index, index == 4)
            K.carry_accumulate(grads[0], carries[0], *args)
            reference.carry_accumulate_reference(grads[1], carries[1], *args)
        assert torch.equal(grads[0], grads[1]), (dtype, carry_dtype, (grads[0] - grads[1]).abs().max())
    # the weight-grad GEMM with the carry in it, on the same chunks (b a column slice, as gu[:, :I] is)
    bounds = [0, *offsets.tolist()]

    def check_wgrad(k, b_width, cols, dtype, carry_dtype, aligned=False):
        # grouped_wgrad over the 5 chunks (a [40, k], b the columns cols of [40, b_width]) against its reference and
        # float64; the arrays, both grads and carries, and the last chunk's arguments back
        a_all, b_all = torch.randn(40, k).to(dtype), torch.randn(40, b_width).to(dtype)
        width = cols.stop - cols.start
        grads = [torch.full((7, k, width), float("nan"), dtype=dtype) for _ in range(2)]
        carries = [torch.full((2, k, width), float("nan"), dtype=carry_dtype) for _ in range(2)]
        for index, s in enumerate(range(0, 40, 8)):
            args = (a_all[s:s + 8], b_all[s:s + 8, cols], offsets, s, s + 8, 40, index, index == 4)
            if aligned:  # the descriptors' starts and row strides
                assert all(K._tma_aligned(t) for t in args[:2])
            K.grouped_wgrad(grads[0], carries[0], *args)
            reference.grouped_wgrad_reference(grads[1], carries[1], *args)
        tol = 1e-5 if dtype == torch.float32 else 5e-3  # an fp16 carry: the reference rounds the part first
        assert torch.allclose(grads[0].float(), grads[1].float(), rtol=tol, atol=tol), (dtype, carry_dtype,
                                                                                  (grads[0] - grads[1]).abs().max())
        exact = torch.zeros(7, k, width, dtype=torch.float64)  # every expert's rows, in float64
        for e in range(7):
            rows = slice(bounds[e], bounds[e + 1])
            exact[e] = a_all[rows].double().t() @ b_all[rows, cols].double()
        worst = (grads[0].double() - exact).abs().max()
        assert torch.allclose(grads[0].double(), exact, rtol=4 * tol, atol=4 * tol), (dtype, carry_dtype, worst)
        return a_all, b_all, grads, carries, args

    for dtype, carry_dtype in ((torch.float32, torch.float32), (torch.float16, torch.float32),
                               (torch.float16, torch.float16)):
        check_wgrad(5, 13, slice(3, 9), dtype, carry_dtype)

    # the same through tensor descriptors (TMA's loads): each expert's rows in a descriptor of their own, zero-filled
    # past them; starts and row strides 16-byte aligned, as the op's operands are (b a column slice at 16 bytes)
    K.USE_TMA = True
    assert K.tma_runs(torch.device("cpu"))
    for dtype, carry_dtype in ((torch.float32, torch.float32), (torch.float16, torch.float32)):
        a_all, b_all, grads, carries, _ = check_wgrad(8, 24, slice(8, 16), dtype, carry_dtype, aligned=True)
    # the descriptors' allocator: a thread with none gets the launcher's; one the user set stays in place
    import threading

    import triton
    from triton.runtime import _allocation

    args = (a_all[:8], b_all[:8, 8:16], offsets, 0, 8, 40, 0, False)
    seen = []
    worker = threading.Thread(target=lambda: (K.grouped_wgrad(grads[0], carries[0], *args),
                                              seen.append(_allocation._allocator.get())))  # fmt: skip
    worker.start()
    worker.join()
    assert len(seen) == 1 and isinstance(seen[0], K._Scratch), seen

    def users(size, alignment, stream):
        return torch.empty(size, dtype=torch.int8)

    triton.set_allocator(users)
    K.grouped_wgrad(grads[0], carries[0], *args)
    assert _allocation._allocator.get() is users
    K.USE_TMA = False

    # the tile's columns in two accumulators (HALVES): blocks of 16 x 32 over [K 16, N 40], so a tile's second half
    # holds real columns in the first tile and a part in the last; pointer and descriptor loads
    default = K._WGRAD
    K._WGRAD = dict(BLOCK_K=16, BLOCK_N=32, BLOCK_R=16, HALVES=2, num_warps=4, num_stages=2)
    for tma in (False, True):
        K.USE_TMA = tma
        _, _, grads, carries, args = check_wgrad(16, 48, slice(4, 44), torch.float32, torch.float32, aligned=True)
    K._WGRAD = dict(K._WGRAD, HALVES=4)  # no kernel for quarters: an error, not three quarters of the columns dropped
    try:
        K.grouped_wgrad(grads[0], carries[0], *args)
        raise AssertionError("HALVES=4 ran")
    except ValueError as exc:
        assert "HALVES" in str(exc)
    K._WGRAD, K.USE_TMA = default, False

    # a chunk's rows into the op's: times the row weight (fp32 and fp16), zero past offsets[-1], y with padded rows
    offs = torch.tensor([3, 9, 21], dtype=torch.int32)
    for dtype, w_dtype in ((torch.float32, torch.float32), (torch.float16, torch.float32),
                           (torch.float16, torch.float16)):
        for start, weighted in ((0, False), (16, True), (16, False), (24, True)):
            y = torch.randn(11, 40).to(dtype)[:, 3:33]  # a row stride past the width
            w = torch.rand(11, 1).to(w_dtype) if weighted else None
            outs = [torch.full((11, 30), float("nan"), dtype=dtype) for _ in range(2)]
            K.rows_out(outs[0], y, w, offs, start)
            reference.rows_out_reference(outs[1], y.clone(), w, offs, start)  # it scales its y in place
            assert torch.equal(outs[0], outs[1]), (dtype, w_dtype, start, weighted)
            end = 21 - start
            assert (outs[0][max(end, 0):] == 0).all() and not outs[0][: max(end, 0)].isnan().any()
            expect = y.clone()
            if w is not None:
                expect.mul_(w)  # eager's order: the product rounded, then scaled
            assert torch.equal(outs[0][: max(end, 0)], expect[: max(end, 0)])

    # the whole op with the kernels (grouped_wgrad's weight grads too), against the op with their reference
    op._TRITON_ON_CPU = True
    op.USE_WGRAD_KERNEL = True
    g = torch.Generator().manual_seed(1)
    x = torch.randn(90, 16, generator=g, requires_grad=True)
    gate_up = torch.randn(4, 48, 16, generator=g, requires_grad=True)
    down = torch.randn(4, 16, 24, generator=g, requires_grad=True)
    offsets = torch.tensor([10, 10, 70, 84], dtype=torch.int32)
    mask = torch.zeros(90, 1, dtype=torch.bool)
    mask[[3, 40, 86]] = True
    row_weight = torch.rand(90, 1, generator=g, requires_grad=True)
    outs = []
    for stacked in (False, True):  # gate and up two views, or the stacked weight whole (its grad one wgrad GEMM)
        for triton_on, tma in ((True, False), (True, True), (False, False)):  # grouped_wgrad's two loads, reference
            op.USE_TRITON, K.USE_TMA = triton_on, tma
            w = gate_up.transpose(-2, -1)
            gate, up = (w, None) if stacked else (w[..., :24], w[..., 24:])
            y = op.tiled_grouped_mlp(x, offsets, gate, up, down.transpose(-2, -1), chunk_tokens=16, row_mask=mask,
                                     row_weight=row_weight)
            outs.append((y, *torch.autograd.grad(y, (x, gate_up, down, row_weight), torch.ones_like(y))))
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-4), (a - b).abs().max()
    print("ok")
    """
)


def test_triton_kernels_match_pytorch_reference_interpreted():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CI": "true"}
    res = subprocess.run([sys.executable, "-c", _TRITON_WORKER], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]
