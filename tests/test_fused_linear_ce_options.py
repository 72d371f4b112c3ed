"""``tilecompile::fused_linear_logprob_ext`` (bias, softcap, lse, Σz, argmax): the CPU chunked path against a
float64 reference with autograd (values and the grads of h, W and b), and the Triton epilogues (under
``TRITON_INTERPRET=1``, fp32 and fp16) against the CPU path."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import assert_close

import tilecompile.ops.fused_linear_ce as ops


def reference(h, w, y, temperature=1.0, ignore_index=-100, bias=None, softcap=0.0):
    """(logp, entropy, lse, zsum, argmax) of z = softcap(h·Wᵀ + b) / t, built unfused."""
    z = h @ w.t()
    if bias is not None:
        z = z + bias
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    lse = torch.logsumexp(z, -1)
    active = y != ignore_index
    zy = z.gather(-1, torch.where(active, y, 0).unsqueeze(-1)).squeeze(-1)
    logp = torch.where(active, zy - lse, 0.0)
    ent = lse - (z.softmax(-1) * z).sum(-1)
    return logp, ent, lse, z.sum(-1), z.argmax(-1)


def _inputs(n=11, d=16, v=53, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g, dtype=dtype)
    w = torch.randn(v, d, generator=g, dtype=dtype)
    b = torch.randn(v, generator=g, dtype=dtype)
    y = torch.randint(0, v, (n,), generator=g)
    y[::4] = -100
    return h, w, b, y


@pytest.mark.parametrize("softcap", [0.0, 3.0])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("chunk", [0, 20])
def test_op_values_and_grads_against_float64(softcap, with_bias, chunk):
    h64, w64, b64, y = _inputs()
    seeds = [torch.randn(h64.shape[0], dtype=torch.float64) for _ in range(4)]

    def run(h, w, b, fused):
        h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
        b = b.clone().requires_grad_() if with_bias else None
        if fused:
            outs = torch.ops.tilecompile.fused_linear_logprob_ext(
                h, w, y, 0.7, -100, True, False, chunk, b, softcap, True, True, True
            )
        else:
            outs = reference(h, w, y, 0.7, -100, b, softcap)
        loss = sum((o.double() * s).sum() for o, s in zip(outs[:4], seeds))
        loss.backward()
        return outs, [t.grad for t in (h, w, b) if t is not None]

    exact = run(h64, w64, b64, fused=False)
    got = run(h64.float(), w64.float(), b64.float(), fused=True)
    for name, a, e in zip(("logp", "entropy", "lse", "zsum"), got[0], exact[0]):
        assert a.dtype == torch.float32
        assert_close(a, e, rtol=1e-5, atol=1e-5, name=name)
    assert torch.equal(got[0][4], exact[0][4]), "argmax"
    for name, a, e in zip(("dh", "dW", "db"), got[1], exact[1]):
        assert a.dtype == torch.float32
        assert_close(a, e, rtol=1e-5, atol=1e-5, name=name)


def test_op_without_options_equals_the_plain_op():
    h, w, _, y = _inputs(dtype=torch.float32)
    plain = torch.ops.tilecompile.fused_linear_logprob(h, w, y, 0.9, -100, True)
    ext = torch.ops.tilecompile.fused_linear_logprob_ext(h, w, y, 0.9, -100, True)
    assert torch.equal(plain[0], ext[0]) and torch.equal(plain[1], ext[1])
    assert [t.numel() for t in ext[2:]] == [0, 0, 0]


def test_op_traces_and_its_options_are_checked():
    h, w, b, y = _inputs(dtype=torch.float32)
    op = torch.ops.tilecompile.fused_linear_logprob_ext
    fn = torch.compile(lambda h, w, b: op(h, w, y, 1.0, -100, False, False, -1, b, 2.0, True)[2], backend="aot_eager")
    assert_close(fn(h, w, b), reference(h, w, y, bias=b, softcap=2.0)[2], rtol=1e-5, atol=1e-5, name="lse")
    with pytest.raises(ValueError, match="softcap"):
        op(h, w, y, 1.0, -100, True, False, -1, None, -1.0)
    with pytest.raises(ValueError, match="bias must be"):
        op(h, w, y, 1.0, -100, True, False, -1, b[:-1])


def test_z_loss_wrapper_matches_eager():
    h, w, b, y = _inputs(dtype=torch.float32)
    loss, lse = ops.linear_cross_entropy_z_loss(h, w, y, bias=b, softcap=5.0, z_loss_scale=1e-2)
    z = 5.0 * torch.tanh((h @ w.t() + b) / 5.0)
    active = y != -100
    ref_lse = torch.logsumexp(z, -1)
    ref = torch.nn.functional.cross_entropy(z, y) + 1e-2 * (ref_lse[active] ** 2).mean()
    assert_close(loss, ref, rtol=1e-5, atol=1e-6, name="loss")
    assert_close(lse, ref_lse, rtol=1e-5, atol=1e-6, name="lse")


_INTERPRET_SCRIPT = textwrap.dedent(
    """
    import torch
    from tilecompile.kernels import fused_linear_ce as K
    torch.manual_seed(0)
    n, d, v = 9, 16, 150
    for dt in (torch.float32, torch.float16):
        h = torch.randn(n, d).to(dt)
        w = (torch.randn(v, d) / d**0.5 * 3).to(dt)
        b = torch.randn(v)
        y = torch.randint(0, v, (n,))
        y[::4] = -100
        y[1] = int((h[1].float() @ w.float().t() + b).argmax())
        grads = [torch.randn(n) for _ in range(4)]
        for softcap, bias, we in ((0.0, b, False), (2.5, None, True), (2.5, b.to(dt), True)):
            kw = dict(chunk=64, gemm_dtype=dt, bias=bias, softcap=softcap, all_rows=True, with_zsum=True,
                      with_argmax=True)
            got = K.fused_linear_logprob_fwd(h, w, y, 1 / 0.7, -100, we, use_triton=True, **kw)
            exp = K.fused_linear_logprob_fwd(h, w, y, 1 / 0.7, -100, we, use_triton=False, **kw)
            for a, e in zip((*got[:3], *got[3]), (*exp[:3], *exp[3])):
                assert (a is None) == (e is None)
                if a is not None:
                    torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-4)
            stats, ent = exp[2], exp[1]
            gk = dict(chunk=64, gemm_dtype=dt, bias=bias, softcap=softcap, grad_lse=grads[2], grad_zsum=grads[3],
                      need_db=bias is not None)
            args = (h, w, y, stats, ent, grads[0], grads[1] if we else None, 1 / 0.7, -100)
            got_g = K.fused_linear_logprob_bwd(*args, use_triton=True, **gk)
            exp_g = K.fused_linear_logprob_bwd(*args, use_triton=False, **gk)
            for a, e in zip(got_g, exp_g):
                assert (a is None) == (e is None)
                if a is not None:
                    tol = 1e-5 if dt == torch.float32 else 3e-3
                    torch.testing.assert_close(a.float(), e.float(), rtol=tol, atol=tol * e.float().abs().max().item())
    # the loss-aware forward with a softcap (its row-block epilogues)
    def grad_of(lp, ent, r0, r1):
        return (torch.sin(lp[r0:r1]) + 0.5).contiguous(), (0.1 * ent[r0:r1]).contiguous()

    h, w = torch.randn(n, d), torch.randn(v, d) / d**0.5 * 3
    args = ([h[:4], h[4:]], w, y, 1 / 0.7, -100, True, grad_of)
    got = K.fused_linear_logprob_loss_fwd(*args, block_rows=3, use_triton=True, softcap=2.0)
    exp = K.fused_linear_logprob_loss_fwd(*args, block_rows=3, use_triton=False, softcap=2.0)
    for a, e in zip(got, exp):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
    print("interpreter ok")
    """
)


def test_triton_epilogues_with_options_under_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-c", _INTERPRET_SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0 and "interpreter ok" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_options_vs_float64(dtype, monkeypatch):
    """The Triton epilogues with every option on CUDA: the op's error against float64 is at most a little more
    than eager's at the same dtype (the logits built in that dtype), values and grads."""
    monkeypatch.setenv("TILECOMPILE_CE_VOCAB_CHUNK", "1000")
    h64, w64, b64, y = _inputs(n=1000, d=256, v=5003)
    h64, w64, b64, y = (t.cuda() for t in (h64, w64 / 16**0.5, b64, y))
    seeds = [torch.randn(h64.shape[0], dtype=torch.float64, device="cuda") for _ in range(4)]

    def run(h, w, b, fused):
        h, w, b = (t.clone().requires_grad_() for t in (h, w, b))
        if fused:
            outs = torch.ops.tilecompile.fused_linear_logprob_ext(h, w, y, 0.9, -100, True, False, -1, b, 15.0,
                                                                  True, True, True)  # fmt: skip
        else:
            outs = reference(h, w, y, 0.9, -100, b, 15.0)
        sum((o.double() * s).sum() for o, s in zip(outs[:4], seeds)).backward()
        return [*outs[:4], h.grad, w.grad, b.grad]

    exact = run(h64, w64, b64, fused=False)
    eager = run(h64.to(dtype), w64.to(dtype), b64.to(dtype), fused=False)
    got = run(h64.to(dtype), w64.to(dtype), b64.to(dtype), fused=True)
    for name, a, e, x in zip(("logp", "entropy", "lse", "zsum", "dh", "dW", "db"), got, eager, exact):
        err, eager_err = (a.double() - x).abs().max().item(), (e.double() - x).abs().max().item()
        assert err <= 2 * eager_err + 1e-5 * x.abs().max().item(), (name, err, eager_err)
