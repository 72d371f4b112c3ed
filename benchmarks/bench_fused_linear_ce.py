"""Benchmark: hidden -> lm_head -> per-token log-prob + entropy, every method side by side in one process.

Methods: eager (verl's formulas: fp32 logits, log_softmax + gather, entropy = lse - Σ softmax·z), Inductor
(torch.compile of that function), tilecompile's op (``linear_logprob_entropy``, automatic chunk and any
``--chunks``), and, when importable, Liger's fused linear CE (log-prob only), Apple's Cut Cross-Entropy (log-prob
only) and verl's kernels (``VERL_SITE`` = an unpacked verl wheel, carried to the GPU machine as the peers' wheels
are).

Modes: ``fwdbwd`` = forward + backward of sum(logp·g_lp) + sum(H·g_H) with random upstream grads; ``fwd`` = the
no-grad forward (old / reference log-probs in RL). Time is the median of ``--reps`` CUDA-event timings after a
warm-up (which includes compilation); peak extra memory = torch.cuda.max_memory_allocated() minus what is
allocated with the inputs in place (grads cleared), so it counts the returned grads too.

FLOP floors, with the bf16 matmul rate R measured in the same run (8192³ products):
    forward = 2·N·D·V / R            (one GEMM: z = h·Wᵀ)
    fwd+bwd = 6·N·D·V / R            (z, dh = dz·W, dW = dzᵀ·h; a recomputing method does 8·N·D·V)

With ``--softcap C`` and / or ``--z-loss S`` every method computes instead the per-token loss of Gemma-style
softcapped logits with a z-loss, ℓ = −log p_y + S·lse², z = C·tanh(h·Wᵀ / C) (what Liger's fused linear CE
computes with ``softcap=C, lse_square_scale=S, reduction="none"``): eager, Inductor, tilecompile's
``fused_linear_logprob_ext`` (lse as an output) and Liger with the same options, when importable. The upstream
grad of ℓ is g_lp; the columns relerr_lp / relerr_dh / relerr_dw then compare ℓ and its grads with eager's.

usage: python benchmarks/bench_fused_linear_ce.py [--shapes 16384:4096:151936,...] [--modes fwdbwd,fwd]
           [--only eager,inductor,tilecompile] [--chunks 8192] [--reps 5] [--check] [--csv PATH]
           [--softcap 30] [--z-loss 1e-4]
"""

from __future__ import annotations

import argparse
import csv
import datetime
import gc
import os
import statistics
import sys
import traceback

import torch
import torch.nn.functional as F

CSV_FIELDS = [
    "date", "gpu", "torch", "triton", "N", "D", "V", "dtype", "mode", "method", "ms", "peak_extra_gib",
    "matmul_tflops", "floor_ms", "x_floor", "x_inductor", "relerr_lp", "relerr_ent", "relerr_dh", "relerr_dw", "error",
]  # fmt: skip


def eager_lp_ent(h, w, y, t=1.0):
    logits = (h @ w.t()).float() / t
    logp = F.log_softmax(logits, dim=-1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
    pd = F.softmax(logits, dim=-1)
    ent = torch.logsumexp(logits, dim=-1) - torch.sum(pd * logits, dim=-1)
    return logp, ent


def eager_softcap_z_loss(h, w, y, softcap, z_loss):
    """Per-token −log p_y + z_loss·lse² of z = softcap·tanh(h·Wᵀ / softcap) (softcap 0: none), fp32 logits."""
    z = (h @ w.t()).float()
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    lse = torch.logsumexp(z, dim=-1)
    return z.gather(-1, y.unsqueeze(-1)).squeeze(-1) * -1 + lse + z_loss * lse * lse, None


def build_loss_methods(only, softcap, z_loss):
    """The methods of the softcap / z-loss comparison: (h, w, y) -> (per-token loss, None)."""

    def eager(h, w, y):
        return eager_softcap_z_loss(h, w, y, softcap, z_loss)

    m = {"eager": eager, "inductor": torch.compile(eager)}
    try:
        from tilecompile.ops.fused_linear_ce import NO_IGNORE  # noqa: F401 - registers the ops

        def tilecompile_ext(h, w, y):
            logp, _, lse, _, _ = torch.ops.tilecompile.fused_linear_logprob_ext(
                h, w, y, 1.0, -100, False, False, 0, None, float(softcap), True
            )
            return -logp + z_loss * lse * lse, None

        m["tilecompile"] = tilecompile_ext
    except Exception as e:  # noqa: BLE001
        print("tilecompile unavailable:", e)
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        def liger(h, w, y):
            out = liger_fused_linear_cross_entropy(
                h, w, y, lse_square_scale=z_loss, reduction="none", softcap=softcap or None
            )
            out = getattr(out, "loss", out)
            return (out[0] if isinstance(out, tuple) else out), None

        m["liger"] = liger
    except Exception as e:  # noqa: BLE001
        print("liger unavailable:", e)
    if only:
        m = {k: v for k, v in m.items() if k in only}
    return m


def _with_chunk(fn, chunk):
    def run(*args):
        old = os.environ.get("TILECOMPILE_CE_VOCAB_CHUNK")
        os.environ["TILECOMPILE_CE_VOCAB_CHUNK"] = str(chunk)
        try:
            return fn(*args)
        finally:
            if old is None:
                del os.environ["TILECOMPILE_CE_VOCAB_CHUNK"]
            else:
                os.environ["TILECOMPILE_CE_VOCAB_CHUNK"] = old

    return run


def build_methods(only, chunks):
    m = {"eager": eager_lp_ent, "inductor": torch.compile(eager_lp_ent)}
    try:
        from tilecompile.ops.fused_linear_ce import linear_logprob_entropy

        m["tilecompile"] = _with_chunk(linear_logprob_entropy, 0)
        for c in chunks:
            m[f"tilecompile[chunk={c}]"] = _with_chunk(linear_logprob_entropy, c)
    except Exception as e:  # noqa: BLE001
        print("tilecompile unavailable:", e)
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction as Liger

        def liger(h, w, y):
            out = Liger.apply(h, w, y, None, None, -100, 0.0, 0.0, "none")
            return -(out[0] if isinstance(out, tuple) else out), None

        m["liger(lp)"] = liger
    except Exception as e:  # noqa: BLE001
        print("liger unavailable:", e)
    try:
        from cut_cross_entropy import linear_cross_entropy as cce

        m["cce(lp)"] = lambda h, w, y: (-cce(h, w, y, reduction="none"), None)
    except Exception as e:  # noqa: BLE001
        print("cce unavailable:", e)
    site = os.environ.get("VERL_SITE")
    if site:
        try:
            sys.path.insert(0, os.environ.get("VERL_SHIM_DIR", os.path.join(os.getcwd(), ".peer")))
            import verl_shim

            lce, tf = verl_shim.load(site)
            ppo = tf.FusedLinearForPPO(chunk_size=512)
            m["verl-chunked"] = lambda h, w, y: ppo(h, w, y, 1.0)
            m["verl-triton"] = lambda h, w, y: tuple(lce.linear_cross_entropy(h, w, y, 1.0, "none"))
        except Exception as e:  # noqa: BLE001
            print("verl unavailable:", e)
    if only:
        m = {k: v for k, v in m.items() if any(k == o or k.startswith(o + "[") or k.startswith(o + "(") for o in only)}
    return m


def run_one(fn, h, w, y, ga, ge, reps, fwd_only):
    def step():
        h.grad = None
        w.grad = None
        if fwd_only:
            with torch.no_grad():
                return fn(h, w, y)
        lp, ent = fn(h, w, y)
        loss = (lp * ga).sum()
        if ent is not None:
            loss = loss + (ent * ge).sum()
        loss.backward()
        return lp, ent

    lp, ent = step()  # warm-up, compiles
    torch.cuda.synchronize()
    outs = (lp.detach().float(), None if ent is None else ent.detach().float())
    grads = (None, None) if fwd_only else (h.grad, w.grad)
    h.grad = None
    w.grad = None
    del lp, ent
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    r = step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del r
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        r = step()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
        del r
    h.grad = None
    w.grad = None
    return statistics.median(times), peak, outs + grads


def rel(a, b):
    if a is None or b is None:
        return float("nan")
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def matmul_tflops():
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        x @ x
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        x @ x
    e.record()
    torch.cuda.synchronize()
    return 10 * 2 * 8192**3 / (s.elapsed_time(e) / 1e3) / 1e12


def bench_shape(n, d, v, modes, methods, reps, tflops, meta, writer, dtype=torch.bfloat16, label=""):
    """``label``: appended to each method's name in the CSV (the loss comparison's options)."""
    torch.manual_seed(0)
    h = torch.randn(n, d, device="cuda").to(dtype).requires_grad_()
    w = (torch.randn(v, d, device="cuda") / d**0.5).to(dtype).requires_grad_()
    y = torch.randint(0, v, (n,), device="cuda")
    ga = torch.randn(n, device="cuda")
    ge = torch.randn(n, device="cuda") * 0.01
    ndv = n * d * v
    for mode in modes:
        fwd_only = mode == "fwd"
        floor = (2 if fwd_only else 6) * ndv / (tflops * 1e12) * 1e3
        print(f"\n== N={n} D={d} V={v} {str(dtype)[6:]} {mode}: floor {floor:.2f} ms at {tflops:.0f} TFLOP/s")
        rows, refs = {}, {}
        for name, fn in methods.items():
            row = dict(meta, N=n, D=d, V=v, dtype=str(dtype)[6:], mode=mode, method=name + label)
            row["matmul_tflops"] = f"{tflops:.0f}"
            row["floor_ms"] = f"{floor:.3f}"
            try:
                need = n * v * (32 if not fwd_only else 16)  # eager holds ~8 fp32 [N, V] tensors in fwd+bwd
                if name == "eager" and need > 0.8 * torch.cuda.get_device_properties(0).total_memory:
                    raise MemoryError(f"skipped: eager would need ~{need / 2**30:.0f} GiB")
                ms, peak, ref = run_one(fn, h, w, y, ga, ge, reps, fwd_only)
                refs[name] = ref
                row.update(ms=f"{ms:.3f}", peak_extra_gib=f"{peak / 2**30:.3f}", x_floor=f"{ms / floor:.3f}")
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
                traceback.print_exc(limit=2)
            rows[name] = row
            gc.collect()
            torch.cuda.empty_cache()
        for count in (1,) if fwd_only else (3, 4):
            name = f"cublas-{count}-gemms-only"
            ms = gemms_only(h, w, count)
            torch.cuda.empty_cache()
            rows[name] = dict(meta, N=n, D=d, V=v, dtype=str(dtype)[6:], mode=mode, method=name,
                              matmul_tflops=f"{tflops:.0f}", floor_ms=f"{floor:.3f}", ms=f"{ms:.3f}",
                              x_floor=f"{ms / floor:.3f}")  # fmt: skip
        base = refs.get("eager")
        ind = rows.get("inductor", {}).get("ms")
        for name, row in rows.items():
            if base is not None and name in refs:
                for key, a, b in zip(("relerr_lp", "relerr_ent", "relerr_dh", "relerr_dw"), refs[name], base):
                    if a is not None and b is not None:
                        row[key] = f"{rel(a, b):.2e}"
            if ind and row.get("ms"):
                row["x_inductor"] = f"{float(row['ms']) / float(ind):.3f}"
            print(
                f"  {name:26s} {row.get('ms', '-'):>9s} ms  x_floor {row.get('x_floor', '-'):>6s}  "
                f"x_inductor {row.get('x_inductor', '-'):>6s}  peak {row.get('peak_extra_gib', '-'):>7s} GiB  "
                f"err lp/ent/dh/dW vs eager {row.get('relerr_lp', '-')}/{row.get('relerr_ent', '-')}/"
                f"{row.get('relerr_dh', '-')}/{row.get('relerr_dw', '-')} {row.get('error', '')}"
            )
            if writer is not None:
                writer.writerow(row)
        del refs, base
        gc.collect()
        torch.cuda.empty_cache()


def gemms_only(h, w, count, reps=3):
    """The unchunked GEMMs of 2·N·D·V as cuBLAS runs them here, nothing else: 1 (z), 3 (z, dh, dW: what Inductor
    issues) or 4 (z twice: a method that recomputes z in the backward). No such method can beat its row."""
    h, w = h.detach(), w.detach()
    z = torch.empty(h.shape[0], w.shape[0], device=h.device, dtype=h.dtype)

    def run():
        torch.mm(h, w.t(), out=z)
        if count > 1:
            if count == 4:
                torch.mm(h, w.t(), out=z)
            z @ w  # dh (z stands in for dz)
            z.t() @ h  # dW

    return _time(run, reps)  # z goes with this frame; the caller empties the cache


def check_numerics(n=4096, d=1024, v=32000, dtype=torch.bfloat16):
    """Relative errors of eager (at dtype) and tilecompile against float64, same inputs, fwd + bwd."""
    from tilecompile.ops.fused_linear_ce import linear_logprob_entropy

    torch.manual_seed(0)
    h0 = torch.randn(n, d, device="cuda").to(dtype)
    w0 = (torch.randn(v, d, device="cuda") / d**0.5 * 4).to(dtype)
    y = torch.randint(0, v, (n,), device="cuda")
    y[::3] = -100
    ga, ge = torch.randn(n, device="cuda", dtype=torch.float64), torch.randn(n, device="cuda", dtype=torch.float64)

    def run(fn, cast):
        h = h0.to(cast, copy=True).requires_grad_()
        w = w0.to(cast, copy=True).requires_grad_()
        lp, ent = fn(h, w, y)
        ((lp.double() * ga).sum() + (ent.double() * ge).sum()).backward()
        return lp.detach(), ent.detach(), h.grad, w.grad

    def eager(h, w, y):
        lp, ent = eager_lp_ent(h, w, torch.where(y == -100, 0, y))
        return torch.where(y == -100, 0.0, lp), ent

    def eager64(h, w, y):
        z = h @ w.t()
        lp = torch.log_softmax(z, -1).gather(-1, torch.where(y == -100, 0, y)[:, None]).squeeze(-1)
        ent = torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)
        return torch.where(y == -100, 0.0, lp), ent

    ref = run(eager64, torch.float64)
    out = {"eager": run(eager, dtype), "tilecompile": run(lambda h, w, y: linear_logprob_entropy(h, w, y), dtype)}
    print(f"\n== numerics vs float64, N={n} D={d} V={v} {dtype}, 1/3 of labels ignored: rel err lp / ent / dh / dW")
    for name, o in out.items():
        print(f"  {name:12s} " + " / ".join(f"{rel(a, b):.2e}" for a, b in zip(o, ref)))
    return out, ref


def _time(fn, reps=3):
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        out.append(s.elapsed_time(e))
    return statistics.median(out)


def breakdown(n, d, v, chunks, dtype=torch.bfloat16):
    """Where the op's time goes: each GEMM family and each epilogue timed alone, and the whole launcher, per chunk
    size. (A side-stream overlap of epilogues and GEMMs was tried here: no gain, the GEMMs hold every SM.)"""
    from tilecompile.kernels import fused_linear_ce as K

    torch.manual_seed(0)
    h = torch.randn(n, d, device="cuda").to(dtype)
    w = (torch.randn(v, d, device="cuda") / d**0.5).to(dtype)
    y = torch.randint(0, v, (n,), device="cuda")
    ga, ge = torch.randn(n, device="cuda"), torch.randn(n, device="cuda") * 0.01
    print(f"\n== breakdown N={n} D={d} V={v}; fp32-out addmm available: {K.probe()}")
    for c in chunks:
        _breakdown_chunk(K, h, w, y, ga, ge, K.chunk_size(n, v, 2, c))
        torch.cuda.empty_cache()


def _breakdown_chunk(K, h, w, y, ga, ge, c):
    n, d = h.shape
    v = w.shape[0]
    starts = list(range(0, v, c))
    z = torch.empty(n, c, device="cuda", dtype=h.dtype)
    acc = torch.zeros(n, d, device="cuda", dtype=torch.float32)
    dw = torch.empty_like(w)
    _, ent, lse, _ = K.fused_linear_logprob_fwd(h, w, y, 1.0, -100, True, chunk=c)
    state = tuple(torch.zeros(n, device="cuda") for _ in range(4))
    outs = tuple(torch.empty(n, device="cuda") for _ in range(3))

    def zc(v0):
        return z[:, : min(c, v - v0)]

    parts = {
        "gemm z (all chunks)": lambda: [torch.mm(h, w[v0 : v0 + c].t(), out=zc(v0)) for v0 in starts],
        "fwd epilogue": lambda: [
            K._triton_fwd_epilogue(zc(v0), y, state, *outs, v0, 1.0, -100, True, v0 + c >= v) for v0 in starts
        ],
        "bwd epilogue": lambda: [K._triton_bwd_epilogue(zc(v0), y, lse, ent, ga, ge, v0, 1.0, -100) for v0 in starts],
        "gemm dW": lambda: [torch.mm(zc(v0).t(), h, out=dw[v0 : v0 + c]) for v0 in starts],
        "gemm dh fp32 addmm": lambda: [K._addmm_fp32_(acc, zc(v0), w[v0 : v0 + c]) for v0 in starts],
        "gemm dh bf16 + add": lambda: [acc.add_(torch.mm(zc(v0), w[v0 : v0 + c])) for v0 in starts],
    }
    parts["op fwd (kernels launcher)"] = lambda: K.fused_linear_logprob_fwd(h, w, y, 1.0, -100, True, chunk=c)
    parts["op bwd (kernels launcher)"] = lambda: K.fused_linear_logprob_bwd(
        h, w, y, lse, ent, ga, ge, 1.0, -100, chunk=c
    )
    for name, fn in parts.items():
        print(f"  C={c:6d} {name:26s} {_time(fn):8.2f} ms")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="16384:4096:151936", help="comma list of N:D:V")
    ap.add_argument("--modes", default="fwdbwd,fwd")
    ap.add_argument("--only", default="", help="comma list of method names (prefix before '[' or '(')")
    ap.add_argument("--chunks", default="", help="extra tilecompile vocab-chunk sizes to time")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--check", action="store_true", help="also print errors against float64 on a mid shape")
    ap.add_argument("--breakdown", default="", help="chunk sizes (0 = auto) for a per-part timing of the op")
    ap.add_argument("--csv", default="benchmarks/results/fused_linear_ce.csv")
    ap.add_argument("--softcap", type=float, default=0.0, help="final-logit softcap C (the loss comparison)")
    ap.add_argument("--z-loss", type=float, default=0.0, help="z-loss scale S (the loss comparison)")
    a = ap.parse_args()
    import triton

    torch._dynamo.config.cache_size_limit = 64
    torch._dynamo.config.automatic_dynamic_shapes = False
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
    }
    print(meta)
    if a.check:
        check_numerics()
        gc.collect()
        torch.cuda.empty_cache()
    tflops = matmul_tflops()
    print(f"bf16 matmul 8192^3: {tflops:.0f} TFLOP/s")
    if a.breakdown:
        n, d, v = (int(x) for x in a.shapes.split(",")[0].split(":"))
        breakdown(n, d, v, [int(c) for c in a.breakdown.split(",")])
        if not a.only and not a.chunks:
            return
    chunks = [int(c) for c in a.chunks.split(",") if c]
    only = [o for o in a.only.split(",") if o]
    label = f"[softcap={a.softcap:g},z_loss={a.z_loss:g}]" if a.softcap or a.z_loss else ""
    if label:
        methods = build_loss_methods(only, a.softcap, a.z_loss)
    else:
        methods = build_methods(only, chunks)
    os.makedirs(os.path.dirname(os.path.abspath(a.csv)), exist_ok=True)
    new = not os.path.exists(a.csv)
    with open(a.csv, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        if new:
            writer.writeheader()
        for shape in a.shapes.split(","):
            n, d, v = (int(x) for x in shape.split(":"))
            bench_shape(n, d, v, a.modes.split(","), methods, a.reps, tflops, meta, writer, label=label)
            f.flush()


if __name__ == "__main__":
    main()
