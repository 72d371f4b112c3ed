"""The tiled gated-MLP custom op (tilecompile::tiled_gated_mlp and its backward op) against eager PyTorch.

Outputs and every grad (x, weights, biases) against eager and a float64 reference; chunk sizes that do not divide
the token count; [B, T, D] layout; frozen weights; opcheck; torch.compile; fp32 vs param-dtype accumulation;
bytes saved for backward; DDP over gloo; bf16 and autocast on the GPU.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, rel_err

from tilecompile.ops.tiled_mlp import ACTIVATIONS, chunk_size_for, tiled_gated_mlp

OP = torch.ops.tilecompile.tiled_gated_mlp.default
BWD_OP = torch.ops.tilecompile.tiled_gated_mlp_backward.default

_ACT = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "relu": F.relu,
}


def eager_mlp(x, wg, wu, wd, bg=None, bu=None, bd=None, activation="silu"):
    return F.linear(_ACT[activation](F.linear(x, wg, bg)) * F.linear(x, wu, bu), wd, bd)


def make_params(d, i, d_out=None, *, bias=False, dtype=torch.float32, device="cpu", scale=1.0):
    """[gate_w, up_w, down_w, gate_b, up_b, down_b] (biases None without bias), leaf tensors requiring grad."""
    d_out = d if d_out is None else d_out
    shapes = [(i, d), (i, d), (d_out, i)] + ([(i,), (i,), (d_out,)] if bias else [])
    fans = [d, d, i, 1, 1, 1]
    ps = [(torch.randn(s, dtype=torch.float64) * scale / f**0.5).to(dtype).to(device) for s, f in zip(shapes, fans)]
    ps = [p.requires_grad_() for p in ps]
    return ps + [None] * (6 - len(ps))


def run_both(x, params, activation, *, chunk_tokens=0, budget_mb=256, grad_accum="fp32", seed=1):
    """(out, grads) for the op and for eager, with the same upstream grad; grads ordered x, wg, wu, wd, bg, bu, bd."""
    wg, wu, wd, bg, bu, bd = params
    y = tiled_gated_mlp(
        x, wg, wu, wd, gate_bias=bg, up_bias=bu, down_bias=bd, activation=activation,
        chunk_tokens=chunk_tokens, budget_mb=budget_mb, grad_accum=grad_accum,
    )  # fmt: skip
    y_ref = eager_mlp(x, wg, wu, wd, bg, bu, bd, activation)
    gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(y)
    inputs = [t for t in (x, *params) if t is not None and t.requires_grad]
    grads = torch.autograd.grad(y, inputs, gy)
    grads_ref = torch.autograd.grad(y_ref, inputs, gy)
    return y, grads, y_ref, grads_ref


# ----------------------------------------------------------------------------------------------------------------
# numerics on CPU


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk_tokens", [64, 0])
def test_matches_eager_fp32(activation, bias, chunk_tokens):
    n, d, i = 257, 48, 136  # 257 = 4 * 64 + 1: the last chunk has one row
    x = torch.randn(n, d, requires_grad=True)
    params = make_params(d, i, bias=bias)
    y, grads, y_ref, grads_ref = run_both(x, params, activation, chunk_tokens=chunk_tokens)
    assert y.shape == y_ref.shape and y.dtype == y_ref.dtype
    assert_close(y, y_ref, rtol=1e-5, atol=1e-5, name="out")
    names = ["x", "gate_w", "up_w", "down_w", "gate_b", "up_b", "down_b"]
    for name, g, r in zip(names, grads, grads_ref):
        assert_close(g, r, rtol=1e-4, atol=1e-4, name=f"grad {name}")


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_float64_matches_eager_float64(activation):
    n, d, i = 130, 24, 72
    x = torch.randn(n, d, dtype=torch.float64, requires_grad=True)
    params = make_params(d, i, bias=True, dtype=torch.float64)
    y, grads, y_ref, grads_ref = run_both(x, params, activation, chunk_tokens=64)
    assert_close(y, y_ref, rtol=1e-12, atol=1e-12, name="out")
    for g, r in zip(grads, grads_ref):
        assert_close(g, r, rtol=1e-11, atol=1e-11, name="grad")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_error_vs_float64_no_worse_than_eager(dtype):
    """The op's error against a float64 reference is within a small margin of eager PyTorch's at the same dtype."""
    n, d, i = 300, 64, 176
    x64 = torch.randn(n, d, dtype=torch.float64, requires_grad=True)
    p64 = make_params(d, i, bias=True, dtype=torch.float64)
    _, _, y64, g64 = run_both(x64, p64, "silu", chunk_tokens=64)
    x = x64.detach().to(dtype).requires_grad_()
    p = [q.detach().to(dtype).requires_grad_() for q in p64]
    y, grads, y_ref, grads_ref = run_both(x, p, "silu", chunk_tokens=64)
    slack = 1e-6 if dtype == torch.float32 else 1e-3
    assert rel_err(y, y64) <= 1.5 * rel_err(y_ref, y64) + slack
    for g, r, g_ref in zip(grads, g64, grads_ref):
        assert rel_err(g, r) <= 1.5 * rel_err(g_ref, r) + slack


def test_random_shapes_float64():
    """hypothesis: any token count, widths, chunk size (0 = from the budget), activation and bias pattern."""
    hyp = pytest.importorskip("hypothesis")
    st = hyp.strategies

    @hyp.settings(max_examples=max(10, hyp.settings.default.max_examples // 2))
    @hyp.given(
        n=st.integers(0, 200),
        d=st.integers(1, 24),
        i=st.integers(1, 48),
        d_out=st.integers(1, 24),
        chunk=st.sampled_from([0, 13, 64, 150]),
        activation=st.sampled_from(ACTIVATIONS),
        biases=st.tuples(st.booleans(), st.booleans(), st.booleans()),
    )
    def check(n, d, i, d_out, chunk, activation, biases):
        x = torch.randn(n, d, dtype=torch.float64, requires_grad=True)
        wg, wu, wd, bg, bu, bd = make_params(d, i, d_out, bias=True, dtype=torch.float64)
        bg, bu, bd = (b if keep else None for b, keep in zip((bg, bu, bd), biases))
        y, grads, y_ref, grads_ref = run_both(x, [wg, wu, wd, bg, bu, bd], activation, chunk_tokens=chunk)
        assert_close(y, y_ref, rtol=1e-10, atol=1e-10, name="out")
        for g, r in zip(grads, grads_ref):
            assert_close(g, r, rtol=1e-10, atol=1e-10, name="grad")

    check()


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("grad_accum", ["fp32", "param"])
def test_backward_tiles_over_parts_of_intermediate(dtype, grad_accum, monkeypatch):
    """Several [parts * chunk, I / parts] tiles (I = 43 in 3 uneven parts on a grid of 8 columns), with every grad
    needed."""
    from tilecompile.ops import tiled_mlp

    monkeypatch.setattr(tiled_mlp, "_MIN_I_PART", 8)
    monkeypatch.setattr(tiled_mlp, "_PART_ALIGN", 8)
    n, d, i = 300, 24, 43
    assert tiled_mlp._intermediate_parts(n, i, 64) == 4
    assert tiled_mlp._part_bounds(i, 4) == [(0, 16), (16, 32), (32, 43)]
    x64 = torch.randn(n, d, dtype=torch.float64, requires_grad=True)
    p64 = make_params(d, i, bias=True, dtype=torch.float64)
    _, g64, _, _ = run_both(x64, p64, "silu", chunk_tokens=64, grad_accum=grad_accum)  # tiled, float64
    monkeypatch.setattr(tiled_mlp, "_MIN_I_PART", 1024)  # one part: the plain chunked backward
    _, g64_plain, _, g64_eager = run_both(x64, p64, "silu", chunk_tokens=64, grad_accum=grad_accum)
    for g, r, e in zip(g64, g64_plain, g64_eager):
        assert_close(g, r, rtol=1e-12, atol=1e-12)
        assert_close(g, e, rtol=1e-12, atol=1e-12)
    if dtype == torch.float64:
        return
    monkeypatch.setattr(tiled_mlp, "_MIN_I_PART", 8)
    x = x64.detach().to(dtype).requires_grad_()
    p = [q.detach().to(dtype).requires_grad_() for q in p64]
    _, grads, _, grads_ref = run_both(x, p, "silu", chunk_tokens=64, grad_accum=grad_accum)
    slack = 1e-3 if grad_accum == "fp32" else 2e-2
    for g, r, e in zip(grads, g64_eager, grads_ref):
        assert rel_err(g, r) <= 1.5 * rel_err(e, r) + slack


@pytest.mark.parametrize(
    "i, parts, count",
    [(8960, 3, 3), (8960, 4, 4), (14336, 3, 3), (18944, 3, 3), (11008, 4, 4), (2048, 2, 2), (8970, 3, 3), (1100, 1, 1),
     (50, 2, 1), (130, 2, 2)],
)  # fmt: skip
def test_backward_parts_start_aligned(i, parts, count):
    """The parts of I start at multiples of 64 columns (cuBLAS's aligned paths: Qwen2.5-1.5B's I = 8960 in 3 parts
    was 2987 columns each), tile I exactly, none wider than the first (the tile buffers are sized by it), and as
    many as asked for on real widths (fewer only where rounding up to 64 columns leaves nothing for the last)."""
    from tilecompile.ops import tiled_mlp

    bounds = tiled_mlp._part_bounds(i, parts)
    assert len(bounds) == count
    assert bounds[0][0] == 0 and bounds[-1][1] == i
    assert all(hi == lo2 for (_, hi), (lo2, _) in zip(bounds, bounds[1:]))
    assert all(lo % 64 == 0 and 0 < hi - lo <= bounds[0][1] for lo, hi in bounds)


def test_bsd_layout_and_other_out_dim():
    b, t, d, i, d_out = 3, 37, 32, 80, 20  # 111 tokens, chunk 64; down maps to a different width
    x = torch.randn(b, t, d, requires_grad=True)
    params = make_params(d, i, d_out, bias=True)
    y, grads, y_ref, grads_ref = run_both(x, params, "gelu", chunk_tokens=64)
    assert y.shape == (b, t, d_out)
    assert grads[0].shape == x.shape
    assert_close(y, y_ref, rtol=1e-5, atol=1e-5, name="out")
    for g, r in zip(grads, grads_ref):
        assert_close(g, r, rtol=1e-4, atol=1e-4, name="grad")


@pytest.mark.parametrize(
    "frozen",
    [("x",), ("gate_w",), ("up_w", "up_b"), ("down_w", "down_b"), ("gate_w", "up_w", "down_w"), ("x", "down_w")],
)
def test_frozen_inputs_get_no_grad(frozen):
    n, d, i = 100, 16, 40
    names = ["x", "gate_w", "up_w", "down_w", "gate_b", "up_b", "down_b"]
    x = torch.randn(n, d, requires_grad=True)
    params = make_params(d, i, bias=True)
    tensors = dict(zip(names, [x, *params]))
    for name in frozen:
        tensors[name].requires_grad_(False)
    ref = {k: v.detach().clone().requires_grad_(v.requires_grad) for k, v in tensors.items()}
    ops_args = [tensors[k] for k in ("x", "gate_w", "up_w", "down_w")]
    y = tiled_gated_mlp(
        *ops_args, gate_bias=tensors["gate_b"], up_bias=tensors["up_b"], down_bias=tensors["down_b"], chunk_tokens=64
    )
    y_ref = eager_mlp(*(ref[k] for k in ("x", "gate_w", "up_w", "down_w", "gate_b", "up_b", "down_b")))
    gy = torch.randn_like(y)
    y.backward(gy)
    y_ref.backward(gy)
    for name in names:
        if name in frozen:
            assert tensors[name].grad is None, name
        else:
            assert_close(tensors[name].grad, ref[name].grad, rtol=1e-4, atol=1e-4, name=name)


def test_nothing_needs_grad():
    x = torch.randn(70, 16)
    wg, wu, wd = (p.detach() for p in make_params(16, 40)[:3])
    y = tiled_gated_mlp(x, wg, wu, wd, chunk_tokens=64)
    assert y.grad_fn is None
    with torch.no_grad():
        assert_close(y, eager_mlp(x, wg, wu, wd), rtol=1e-5, atol=1e-5)


def test_backward_op_skips_unneeded_grads():
    n, d, i = 90, 16, 40
    x = torch.randn(n, d)
    wg, wu, wd, bg, bu, _ = (p.detach() if p is not None else None for p in make_params(d, i, bias=True))
    gy = torch.randn(n, d)
    out = BWD_OP(gy, x, wg, bg, wu, bu, wd, "silu", 64, 256, "fp32", [False, False, False, True, False, True, False])
    assert [t.numel() == 0 for t in out] == [True, True, True, False, True, False, True]
    # only dWd needs neither dh nor du/dg: compare it against eager
    xr = x.clone()
    wd_r = wd.clone().requires_grad_()
    eager_mlp(xr, wg, wu, wd_r, bg, bu).backward(gy)
    assert_close(out[5], wd_r.grad, rtol=1e-4, atol=1e-4)


def test_empty_tokens():
    x = torch.randn(0, 16, requires_grad=True)
    params = make_params(16, 40, bias=True)
    y, grads, y_ref, grads_ref = run_both(x, params, "silu")
    assert y.shape == (0, 16)
    for g, r in zip(grads, grads_ref):
        assert_close(g, r, rtol=0, atol=0)


def test_bad_arguments():
    x = torch.randn(10, 16)
    wg, wu, wd = (p.detach() for p in make_params(16, 40)[:3])
    with pytest.raises(ValueError, match="activation"):
        tiled_gated_mlp(x, wg, wu, wd, activation="swish")
    with pytest.raises(ValueError, match="grad_accum"):
        tiled_gated_mlp(x, wg, wu, wd, grad_accum="bf16")
    with pytest.raises(ValueError, match="dtype"):
        tiled_gated_mlp(x.double(), wg, wu, wd)
    with pytest.raises(ValueError, match="chain"):
        tiled_gated_mlp(x, wg, wu[:, :8], wd)


def test_chunk_size_for():
    mib = 2**20
    # four [chunk, I] bf16 tensors in 256 MiB, I = 18944: 1771 tokens -> 1728
    assert chunk_size_for(65536, 18944, torch.bfloat16, 256) == 1728
    assert chunk_size_for(65536, 18944, torch.float32, 256) == 832
    c = chunk_size_for(1 << 20, 1000, torch.float32, 64)
    assert c % 64 == 0 and 4 * c * 1000 * 4 <= 64 * mib < 4 * (c + 64) * 1000 * 4
    assert chunk_size_for(10**6, 10**6, torch.float32, 1) == 64  # at least 64
    assert chunk_size_for(100, 64, torch.float32, 256) == 128  # capped at tokens, rounded up to 64
    assert chunk_size_for(0, 64, torch.float32, 256) == 64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grad_accum_param_vs_fp32(dtype):
    n, d, i = 520, 32, 96
    x64 = torch.randn(n, d, dtype=torch.float64, requires_grad=True)
    p64 = make_params(d, i, bias=True, dtype=torch.float64)
    _, _, _, g64 = run_both(x64, p64, "silu", chunk_tokens=64)
    errs = {}
    for accum in ("fp32", "param"):
        x = x64.detach().to(dtype).requires_grad_()
        p = [q.detach().to(dtype).requires_grad_() for q in p64]
        _, grads, _, _ = run_both(x, p, "silu", chunk_tokens=64, grad_accum=accum)
        assert all(g.dtype == dtype for g in grads)
        errs[accum] = [rel_err(g, r) for g, r in zip(grads, g64)]
    if dtype == torch.float32:
        for a, b in zip(errs["fp32"], errs["param"]):
            assert a == pytest.approx(b, rel=1e-3, abs=1e-7)
    else:
        # weight/bias grads summed over 9 chunks: bf16 accumulation can only be worse (x's grad is per chunk)
        assert all(e < 2e-2 for e in errs["param"]), errs
        assert sum(errs["fp32"][1:]) <= sum(errs["param"][1:]), errs


# ----------------------------------------------------------------------------------------------------------------
# the fused Triton elementwise path (CUDA's), run on CPU tensors by Triton's interpreter in fp32

_TRITON_WORKER = textwrap.dedent(
    """
    import torch, torch.nn.functional as F
    from tilecompile.ops import tiled_mlp

    tiled_mlp._TRITON_ON_CPU = True
    tiled_mlp._MIN_I_PART = 16  # backward tiles over 2 parts of I
    torch.manual_seed(0)
    n, d, i = 130, 16, 40
    frozen = [False, True, True, False, False, True, False]
    cases = [(a, [True] * 7) for a in tiled_mlp.ACTIVATIONS] + [("silu", frozen)]
    for activation, needs in cases:
        x, gy = torch.randn(n, d), torch.randn(n, d)
        wg, wu, wd = torch.randn(i, d) / 4, torch.randn(i, d) / 4, torch.randn(d, i) / 6
        bg, bu = torch.randn(i), torch.randn(i)
        args = (x, wg, bg, wu, bu, wd, None, activation, 64, 256, "fp32")
        outs = []
        for use_triton in (True, False):
            tiled_mlp.USE_TRITON = use_triton
            y = torch.ops.tilecompile.tiled_gated_mlp(*args)
            grads = torch.ops.tilecompile.tiled_gated_mlp_backward(
                gy, x, wg, bg, wu, bu, wd, activation, 64, 256, "fp32", needs
            )
            outs.append((y, *grads))
        for a, b in zip(*outs):
            assert a.shape == b.shape, (activation, needs)
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-4), (activation, needs, (a - b).abs().max())
    print("ok")
    """
)


def test_triton_fused_elementwise_matches_pytorch_path_interpreted():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CI": "true"}
    res = subprocess.run([sys.executable, "-c", _TRITON_WORKER], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]


# ----------------------------------------------------------------------------------------------------------------
# registration: opcheck, torch.compile, dynamic shapes, autocast


def _op_args(n=70, d=16, i=40, bias=True, dtype=torch.float32):
    x = torch.randn(n, d, dtype=dtype, requires_grad=True)
    wg, wu, wd, bg, bu, bd = make_params(d, i, bias=bias, dtype=dtype)
    return (x, wg, bg, wu, bu, wd, bd)


@pytest.mark.parametrize("bias", [False, True])
def test_opcheck_forward(bias):
    args = _op_args(bias=bias)
    torch.library.opcheck(OP, (*args, "silu", 32, 256, "fp32"))
    x = torch.randn(2, 33, 16, requires_grad=True)
    torch.library.opcheck(OP, (x, *args[1:], "gelu_tanh", 0, 1, "param"))


def test_opcheck_backward():
    x, wg, bg, wu, bu, wd, _ = (t.detach() for t in _op_args())
    gy = torch.randn(70, 16)
    for needs in ([True] * 7, [False, True, False, False, True, True, False]):
        torch.library.opcheck(BWD_OP, (gy, x, wg, bg, wu, bu, wd, "relu", 32, 256, "fp32", needs))


def test_torch_compile_fullgraph_aot_eager():
    x, wg, bg, wu, bu, wd, bd = _op_args(n=100)

    def f(x, wg, bg, wu, bu, wd, bd):
        y = torch.ops.tilecompile.tiled_gated_mlp(x, wg, bg, wu, bu, wd, bd, "silu", 32, 256, "fp32")
        return (y * y).sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    inputs = [x, wg, bg, wu, bu, wd, bd]
    loss = compiled(*inputs)
    grads = torch.autograd.grad(loss, inputs)
    ref = [t.detach().clone().requires_grad_() for t in inputs]
    loss_ref = (eager_mlp(ref[0], ref[1], ref[3], ref[5], ref[2], ref[4], ref[6]) ** 2).sum()
    grads_ref = torch.autograd.grad(loss_ref, ref)
    assert_close(loss, loss_ref, rtol=1e-5, atol=1e-5, name="loss")
    for g, r in zip(grads, grads_ref):
        assert_close(g, r, rtol=1e-4, atol=1e-4, name="grad")


def test_varying_length_compiles_once():
    from torch._dynamo.testing import CompileCounterWithBackend

    wg, wu, wd = make_params(16, 40)[:3]
    counter = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(lambda x: tiled_gated_mlp(x, wg, wu, wd).sum(), backend=counter, dynamic=True)
    for n in (100, 157, 300):
        x = torch.randn(1, n, 16, requires_grad=True)
        fn(x).backward()
        ref = x.detach().clone().requires_grad_()
        eager_mlp(ref, wg.detach(), wu.detach(), wd.detach()).sum().backward()
        assert_close(x.grad, ref.grad, rtol=1e-4, atol=1e-4)
    assert counter.frame_count == 1


def test_cpu_autocast_casts_inputs():
    x = torch.randn(64, 32, requires_grad=True)
    params = make_params(32, 64, bias=True)
    wg, wu, wd, bg, bu, bd = params
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = tiled_gated_mlp(x, wg, wu, wd, gate_bias=bg, up_bias=bu, down_bias=bd)
        y_ref = eager_mlp(x, wg, wu, wd, bg, bu, bd)
    assert y.dtype == torch.bfloat16 == y_ref.dtype
    gy = torch.randn_like(y)
    inputs = [x, *params]
    grads = torch.autograd.grad(y, inputs, gy)
    grads_ref = torch.autograd.grad(y_ref, inputs, gy)
    assert all(g.dtype == torch.float32 for g in grads)
    assert rel_err(y, y_ref) < 2e-2
    for g, r in zip(grads, grads_ref):
        assert rel_err(g, r) < 3e-2


def test_cpu_autocast_under_torch_compile():
    wg, wu, wd = make_params(16, 40)[:3]

    def f(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = tiled_gated_mlp(x, wg, wu, wd, chunk_tokens=64)
        return y.float().pow(2).sum(), y.dtype

    x = torch.randn(100, 16, requires_grad=True)
    loss, dtype = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    grads = torch.autograd.grad(loss, [x, wg, wu, wd])
    loss_ref, dtype_ref = f(x)
    grads_ref = torch.autograd.grad(loss_ref, [x, wg, wu, wd])
    assert dtype == dtype_ref == torch.bfloat16
    assert_close(loss, loss_ref, rtol=1e-3, atol=1e-3)
    for g, r in zip(grads, grads_ref):
        assert g.dtype == torch.float32
        assert_close(g, r, rtol=1e-3, atol=1e-3)


# ----------------------------------------------------------------------------------------------------------------
# memory: bytes saved for backward


def _saved_bytes(fn) -> int:
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    total = sum(storages.values())
    del out
    return total


def test_saved_for_backward_is_small():
    n, d, i = 8192, 256, 688  # Llama-style ratio
    x = torch.randn(1, n, d, requires_grad=True)
    wg, wu, wd = make_params(d, i)[:3]
    eager = _saved_bytes(lambda: eager_mlp(x, wg, wu, wd))
    tiled = _saved_bytes(lambda: tiled_gated_mlp(x, wg, wu, wd))
    weights = sum(w.numel() * w.element_size() for w in (wg, wu, wd))
    assert tiled == x.numel() * x.element_size() + weights  # x and the weights, nothing of size [N, I]
    assert tiled <= eager / 4, (tiled, eager)


# ----------------------------------------------------------------------------------------------------------------
# DDP over gloo: grads of 2 ranks with different data equal one process on the concatenated data

_DDP_WORKER = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from tilecompile.ops.tiled_mlp import tiled_gated_mlp

    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Linear(24, 56)
            self.up = torch.nn.Linear(24, 56)
            self.down = torch.nn.Linear(56, 24, bias=False)

        def forward(self, x):
            return tiled_gated_mlp(x, self.gate.weight, self.up.weight, self.down.weight, gate_bias=self.gate.bias,
                                   up_bias=self.up.bias, chunk_tokens=64)

    model = DDP(MLP())
    data = torch.randn(world, 2, 75, 24, generator=torch.Generator().manual_seed(1))
    (model(data[rank]) ** 2).mean().backward()
    if rank == 0:
        torch.save({k: p.grad for k, p in model.module.named_parameters()}, out)
    # Both ranks reach the end before either tears down: a rank that destroyed the group (and its DDP reducer)
    # while the other still held a connection aborted once in CI ("terminate called without an active exception").
    dist.barrier()
    del model
    dist.destroy_process_group()
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.distributed
def test_ddp_gloo_matches_single_process(tmp_path):
    world = 2
    script = tmp_path / "worker.py"
    script.write_text(_DDP_WORKER)
    out = tmp_path / "grads.pt"
    port = str(_free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([sys.executable, str(script), str(r), str(world), port, str(out)], env=env)
        for r in range(world)
    ]
    codes = [p.wait(timeout=120) for p in procs]
    assert codes == [0] * world
    ddp_grads = torch.load(out)

    torch.manual_seed(0)
    gate, up = torch.nn.Linear(24, 56), torch.nn.Linear(24, 56)
    down = torch.nn.Linear(56, 24, bias=False)
    data = torch.randn(world, 2, 75, 24, generator=torch.Generator().manual_seed(1))
    y = eager_mlp(data.reshape(-1, 75, 24), gate.weight, up.weight, down.weight, gate.bias, up.bias)
    (y**2).mean().backward()  # mean over both ranks' data = DDP's average of per-rank means
    ref = {"gate.weight": gate.weight, "gate.bias": gate.bias, "up.weight": up.weight, "up.bias": up.bias,
           "down.weight": down.weight}  # fmt: skip
    assert set(ddp_grads) == set(ref)
    for k, p in ref.items():
        assert_close(ddp_grads[k], p.grad, rtol=1e-4, atol=1e-6, name=k)


# ----------------------------------------------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("grad_accum", ["fp32", "param"])
@pytest.mark.parametrize("use_triton", [True, False])
@pytest.mark.parametrize("min_i_part", [1024, 128])
def test_gpu_bf16_vs_float64(activation, grad_accum, use_triton, min_i_part, monkeypatch):
    from tilecompile.ops import tiled_mlp

    monkeypatch.setattr(tiled_mlp, "USE_TRITON", use_triton)
    monkeypatch.setattr(tiled_mlp, "_MIN_I_PART", min_i_part)  # 128: the backward tiles I in 4 parts
    n, d, i = 4099, 256, 704
    x64 = torch.randn(n, d, dtype=torch.float64, device="cuda", requires_grad=True)
    p64 = [
        None if p is None else p.detach().cuda().requires_grad_()
        for p in make_params(d, i, bias=True, dtype=torch.float64)
    ]
    _, _, y64, g64 = run_both(x64, p64, activation, chunk_tokens=512)
    x = x64.detach().bfloat16().requires_grad_()
    p = [q.detach().bfloat16().requires_grad_() for q in p64]
    y, grads, y_ref, grads_ref = run_both(x, p, activation, chunk_tokens=512, grad_accum=grad_accum)
    assert y.dtype == torch.bfloat16
    assert rel_err(y, y64) <= 1.5 * rel_err(y_ref, y64) + 1e-3
    names = ["x", "gate_w", "up_w", "down_w", "gate_b", "up_b", "down_b"]
    for name, g, r, g_ref in zip(names, grads, g64, grads_ref):
        slack = 1e-3 if grad_accum == "fp32" else 2e-2
        assert rel_err(g, r) <= 1.5 * rel_err(g_ref, r) + slack, name


@pytest.mark.gpu
def test_gpu_fp32_accumulation_uses_out_dtype_addmm_or_fallback():
    from tilecompile.ops import tiled_mlp

    acc = torch.ones(8, 4, device="cuda")
    a = torch.randn(8, 16, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(16, 4, device="cuda", dtype=torch.bfloat16)
    tiled_mlp._accumulate_mm(acc, a, b)
    assert_close(acc, 1 + a.double() @ b.double(), rtol=1e-5, atol=1e-5)
    print("addmm out_dtype accumulation:", tiled_mlp._cuda_out_dtype_addmm_ok(acc.device))


@pytest.mark.gpu
def test_gpu_autocast():
    n, d, i = 1000, 128, 352
    x = torch.randn(2, n // 2, d, device="cuda", requires_grad=True)
    params = [None if p is None else p.detach().cuda().requires_grad_() for p in make_params(d, i, bias=True)]
    wg, wu, wd, bg, bu, bd = params
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = tiled_gated_mlp(x, wg, wu, wd, gate_bias=bg, up_bias=bu, down_bias=bd, chunk_tokens=128)
        y_ref = eager_mlp(x, wg, wu, wd, bg, bu, bd)
    assert y.dtype == torch.bfloat16 == y_ref.dtype
    gy = torch.randn_like(y)
    inputs = [x, *params]
    grads = torch.autograd.grad(y, inputs, gy)
    grads_ref = torch.autograd.grad(y_ref, inputs, gy)
    assert rel_err(y, y_ref) < 1e-2
    for g, r in zip(grads, grads_ref):
        assert g.dtype == r.dtype == torch.float32
        assert rel_err(g, r) < 2e-2
