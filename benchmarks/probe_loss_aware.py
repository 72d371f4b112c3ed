"""Probe (H200): the loss-aware fused op (3 GEMMs, grads in the forward) against the recompute op (4 GEMMs).

One PPO-style loss F(logp, entropy, old, adv, mask) over N tokens; times op forward + backward (CUDA events, median
of --reps after 2 warm-ups) and peak memory above the inputs, for several row-block sizes; errors of dh / dW
against a float64 reference on a row subset are checked by tests, not here.

Each row block evaluates the loss's per-token gradient; ``inductor-grad`` rows compile it (torch.func.grad under
torch.compile) instead of running eager autograd.

usage: python3 benchmarks/probe_loss_aware.py [--n 16384] [--dims 1536,4096] [--blocks 1024,1536,2048]
       [--profile R] (kernel tables of the op at row block R, F's gradient eager and compiled)
"""

from __future__ import annotations

import argparse
import itertools
import statistics

import torch
import torch.fx as fx

from tilecompile.ops import fused_linear_ce as O


def ppo(lp, ent, old, adv, mask):
    ratio = torch.exp(lp - old)
    pg = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 0.8, 1.2))
    return (pg * mask).sum() / mask.sum() - 0.001 * (ent * mask).sum() / mask.sum()


def timed(fn, reps):
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=16384)
    p.add_argument("--v", type=int, default=151936)
    p.add_argument("--dims", default="1536,4096")
    p.add_argument("--blocks", default="1024,1536,2048")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--profile", type=int, default=0, help="profile the loss-aware op at this row block")
    p.add_argument("--epilogues", action="store_true", help="sweep the epilogues' launch settings on one row block")
    args = p.parse_args()
    if args.epilogues:
        sweep_epilogues(1536, args.v, args.reps)
        return
    gm = fx.symbolic_trace(ppo)
    key = O.register_loss(gm, gm.code)
    print(torch.cuda.get_device_name(), torch.__version__)
    for d in (int(x) for x in args.dims.split(",")):
        bench(args.n, d, args.v, key, [int(x) for x in args.blocks.split(",")], args.reps, args.profile)


def bench(n: int, d: int, v: int, key: int, blocks: list[int], reps: int, profile: int = 0) -> None:
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, d, generator=g).to(dev, dt).requires_grad_()
    w = (torch.randn(v, d, generator=g) * d**-0.5).to(dev, dt).requires_grad_()
    y = torch.randint(0, v, (n,), generator=g).to(dev)
    old = (-torch.rand(n, generator=g) * 3).to(dev)
    adv = torch.randn(n, generator=g).to(dev)
    mask = (torch.rand(n, generator=g) > 0.1).float().to(dev)
    extras = [old, adv, mask]

    def recompute():
        h.grad = w.grad = None
        lp, ent = torch.ops.tilecompile.fused_linear_logprob(h, w, y, 0.9, -100, True)
        ppo(lp, ent, old, adv, mask).backward()

    def loss_aware(r, grad_backend="eager"):
        def run():
            h.grad = w.grad = None
            lp, ent, dh, dw = torch.ops.tilecompile.fused_linear_logprob_loss(
                h.detach(), w.detach(), y, 0.9, -100, True, False, extras, key, r, grad_backend
            )
            (ppo(lp, ent, old, adv, mask) + torch.ops.tilecompile.loss_anchor(h, w, dh, dw)).backward()

        return run

    variants = [("recompute (4 GEMMs)", recompute)] + [(f"loss-aware R={r}", loss_aware(r)) for r in blocks]
    variants += [(f"loss-aware R={r} inductor-grad", loss_aware(r, "inductor")) for r in blocks]
    if profile:
        _profile(loss_aware(profile), f"D={d} loss-aware R={profile} (F's gradient by eager autograd)")
        _profile(loss_aware(profile, "inductor"), f"D={d} loss-aware R={profile} (F's gradient compiled)")
        return
    ref = None
    for name, fn in variants:
        torch.cuda.synchronize()
        h.grad = w.grad = None
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        grads = (h.grad.float().clone(), w.grad.float().clone())
        if ref is None:
            ref = grads
        err = [((a - b).norm() / b.norm()).item() for a, b in zip(grads, ref)]
        ms = timed(fn, reps)
        floor = 6 * n * d * v / 1e12
        print(
            f"D={d} {name:22s} {ms:8.2f} ms  peak extra {peak:5.2f} GiB  6NDV={floor:.1f} TFLOP "
            f"({floor / ms * 1e3:.0f} TFLOP/s)  rel dh/dW vs recompute {err[0]:.1e}/{err[1]:.1e}"
        )


def sweep_epilogues(rows: int, v: int, reps: int) -> None:
    """Forward / backward epilogue of one [rows, V] block of whole-vocabulary logits, per launch setting."""
    from tilecompile.kernels import fused_linear_ce as K

    dev = "cuda"
    z = (torch.randn(rows, v, device=dev) * 3).bfloat16()
    labels = torch.randint(0, v, (rows,), device=dev)
    logp, ent = torch.empty(rows, device=dev), torch.empty(rows, device=dev)
    stats = torch.empty(rows, 2, device=dev)
    glp, gent = torch.randn(rows, device=dev), torch.randn(rows, device=dev)
    gbytes = rows * v * 2 / 1e9
    for cap, warps, per_sm in itertools.product((8192, 16384), (8, 16), (2, 4, 8)):
        launch = dict(K._ROW_LAUNCH, cap=cap, warps=warps, grid_per_sm=per_sm)

        def fwd(launch=launch):
            state = (
                torch.full((rows,), float("-inf"), device=dev),
                *(torch.zeros(rows, device=dev) for _ in range(3)),
            )
            K._triton_fwd_epilogue(z, labels, state, logp, ent, stats, 0, 1.0, -100, True, True, launch)

        ms = timed(fwd, reps)
        print(f"fwd cap={cap} warps={warps} per_sm={per_sm}: {ms:.3f} ms ({gbytes / ms:.2f} TB/s)")
    for cap, per_prog in itertools.product((1024, 2048), (0, 8192, 16384, 32768)):
        zz, launch = z.clone(), {"cap": cap, "cols_per_prog": per_prog}

        def bwd(zz=zz, launch=launch):
            K._triton_bwd_epilogue(zz, labels, stats, ent, glp, gent, 0, 1.0, -100, launch)

        ms = timed(bwd, reps)
        print(f"bwd cap={cap} cols_per_prog={per_prog}: {ms:.3f} ms ({2 * gbytes / ms:.2f} TB/s read+write)")


def _profile(fn, label: str) -> None:
    import time

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    host = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3
    print(f"{label}: host enqueue {host:.1f} ms, wall {wall:.1f} ms")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    print(events.table(sort_by="cuda_time_total", row_limit=24, max_name_column_width=60))
    total = sum(e.device_time_total for e in events) / 1e3
    kernels = sum(e.count for e in events if e.device_time_total > 0)
    print(f"{label}: {kernels} kernel launches, {total:.1f} ms of kernel time")


if __name__ == "__main__":
    main()
