"""Probe: how fast the GEMMs behind the two ops run on this GPU, in the shapes and orders the ops issue them.

The speed targets of the fused log-prob op and the tiled MLP are ratios to Inductor, whose time is almost all
GEMMs; a recomputing op issues more GEMMs (8·N·D·V instead of 6·N·D·V; 11 MLP GEMMs instead of 9), so whether a
target can be met depends on the rate GEMMs reach here. This script measures that rate (a short burst of 8192³
products and the same products back to back for longer), then each GEMM family the ops run, chunked as the ops
chunk them, in both operand orders, and the forward epilogue of the log-prob op under a few launch settings.

usage: python benchmarks/probe_gemm.py [--json PATH] [--only lmhead,mlp,epilogue]
Prints one line per measurement: name, ms, TFLOP/s (or GB/s for the epilogue).
"""

from __future__ import annotations

import argparse
import json

import torch
from bench_fused_linear_ce import _time as timed  # the same CUDA-event median (this script's folder is on sys.path)

from tilecompile.kernels import fused_linear_ce as K

RESULTS: list[dict] = []


def report(name: str, ms: float, flops: float = 0.0, nbytes: float = 0.0) -> None:
    row = {"name": name, "ms": round(ms, 3)}
    if flops:
        row["tflops"] = round(flops / ms / 1e9, 1)
    if nbytes:
        row["gbps"] = round(nbytes / ms / 1e6, 1)
    RESULTS.append(row)
    print(json.dumps(row), flush=True)


def rates() -> None:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    f = 2 * 8192**3
    for reps in (10, 200):

        def run(reps=reps):
            for _ in range(reps):
                torch.mm(a, b, out=c)

        report(f"rate 8192^3 x{reps}", timed(run), f * reps)


def lmhead(n: int = 16384, d: int = 4096, v: int = 151936) -> None:
    torch.manual_seed(0)
    h = torch.randn(n, d, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(v, d, device="cuda", dtype=torch.bfloat16) * d**-0.5
    f = 2 * n * d * v
    z = torch.empty(n, v, device="cuda", dtype=torch.bfloat16)
    report("lmhead z full h@W.T", timed(lambda: torch.mm(h, w.t(), out=z)), f)
    del z
    for c in (2048, 4096, 8192, 16384, 32768):
        buf = torch.empty(n * c, device="cuda", dtype=torch.bfloat16)

        def fwd(c=c, buf=buf):
            for v0 in range(0, v, c):
                wc = w[v0 : v0 + c]
                torch.mm(h, wc.t(), out=buf[: n * wc.shape[0]].view(n, wc.shape[0]))

        def fwd_t(c=c, buf=buf):
            for v0 in range(0, v, c):
                wc = w[v0 : v0 + c]
                torch.mm(wc, h.t(), out=buf[: n * wc.shape[0]].view(wc.shape[0], n))

        report(f"lmhead z chunks C={c} [N,C]", timed(fwd), f)
        report(f"lmhead z chunks C={c} [C,N]", timed(fwd_t), f)
        if c in (4096, 8192, 16384):
            dw = torch.empty_like(w)
            z = buf.view(n, c)
            acc = torch.zeros(n, d, device="cuda", dtype=torch.float32)
            acc_t = torch.zeros(d, n, device="cuda", dtype=torch.float32)
            tmp = torch.empty(n, d, device="cuda", dtype=torch.bfloat16)

            def dwf(c=c, z=z, dw=dw):
                for v0 in range(0, v, c):
                    k = min(c, v - v0)
                    torch.mm(z[:, :k].t(), h, out=dw[v0 : v0 + k])

            def dhf(c=c, z=z, acc=acc):
                for v0 in range(0, v, c):
                    k = min(c, v - v0)
                    torch.addmm(acc, z[:, :k], w[v0 : v0 + k], out_dtype=torch.float32, out=acc)

            def dhf_t(c=c, z=z, acc_t=acc_t):
                for v0 in range(0, v, c):
                    k = min(c, v - v0)
                    torch.addmm(acc_t, w[v0 : v0 + k].t(), z[:, :k].t(), out_dtype=torch.float32, out=acc_t)

            def dhf_bf16(c=c, z=z, acc=acc, tmp=tmp):
                for v0 in range(0, v, c):
                    k = min(c, v - v0)
                    torch.mm(z[:, :k], w[v0 : v0 + k], out=tmp)
                    acc.add_(tmp)

            # contiguous chunk views (the op's buffer is contiguous per chunk: [N, k] with stride k)
            report(f"lmhead dW chunks C={c}", timed(dwf), f)
            report(f"lmhead dh fp32-addmm C={c} [N,D]", timed(dhf), f)
            report(f"lmhead dh fp32-addmm C={c} [D,N]", timed(dhf_t), f)
            report(f"lmhead dh bf16-mm+add C={c}", timed(dhf_bf16), f)
            del dw, acc, acc_t, tmp
        del buf
        torch.cuda.empty_cache()


def overlap(n: int = 16384, d: int = 4096, v: int = 151936) -> None:
    """The forward (GEMM + epilogue per chunk): in order on one stream, and with the epilogue on a side stream
    over two chunk buffers, so that chunk i's epilogue can run beside chunk i+1's GEMM."""
    torch.manual_seed(0)
    h = torch.randn(n, d, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(v, d, device="cuda", dtype=torch.bfloat16) * d**-0.5
    labels = torch.randint(0, v, (n,), device="cuda")
    f = 2 * n * d * v
    for c in (4096, 8192, 16384):
        out = [torch.empty(n, device="cuda") for _ in range(3)]
        report(
            f"fwd op C={c}", timed(lambda c=c: K.fused_linear_logprob_fwd(h, w, labels, 1.0, -100, True, chunk=c)), f
        )
        bufs = [torch.empty(n * c, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        side = torch.cuda.Stream()
        for prio in (0, -1):
            side = torch.cuda.Stream(priority=prio)

            def run(c=c, bufs=bufs, side=side, out=out):
                main = torch.cuda.current_stream()
                state = (
                    torch.full((n,), float("-inf"), device="cuda"),
                    *(torch.zeros(n, device="cuda") for _ in range(3)),
                )
                done = [None, None]
                for idx, v0 in enumerate(range(0, v, c)):
                    wc = w[v0 : v0 + c]
                    z = bufs[idx % 2][: n * wc.shape[0]].view(n, wc.shape[0])
                    if done[idx % 2] is not None:
                        main.wait_event(done[idx % 2])
                    torch.mm(h, wc.t(), out=z)
                    ready = torch.cuda.Event()
                    ready.record(main)
                    side.wait_event(ready)
                    with torch.cuda.stream(side):
                        K._triton_fwd_epilogue(z, labels, state, *out, v0, 1.0, -100, True, v0 + c >= v)
                        ev = torch.cuda.Event()
                        ev.record(side)
                    done[idx % 2] = ev
                main.wait_stream(side)

            report(f"fwd overlapped C={c} side-priority={prio}", timed(run), f)
        del bufs
        torch.cuda.empty_cache()


def epilogue(n: int = 16384, v: int = 151936) -> None:
    torch.manual_seed(0)
    labels = torch.randint(0, v, (n,), device="cuda")
    for c in (4096, 16384):
        z = torch.randn(n, c, device="cuda", dtype=torch.bfloat16)
        chunks = -(-v // c)
        nbytes = n * c * 2 * chunks
        st = [torch.zeros(n, device="cuda") for _ in range(4)]
        out = [torch.zeros(n, device="cuda") for _ in range(3)]
        for warps in (4, 8, 16):
            for mult in (1, 4, 16):
                for stages in (1, 3):
                    for cap in (c, 2048):
                        if cap > c:
                            continue
                        block = K._block_c(c, cap)
                        grid = min(n, K._num_sms(z.device) * mult)

                        def run(block=block, warps=warps, grid=grid, stages=stages, z=z, st=st, out=out, chunks=chunks):
                            for i in range(chunks):
                                K._fused_linear_ce_fwd_kernel[(grid,)](
                                    z, labels, *st, out[0], out[1], out[2], n, z.shape[1], i * z.shape[1],
                                    z.stride(0), 1.0, -100, HAS_ENTROPY=True, IS_LAST=False,
                                    SINGLE_TILE=z.shape[1] <= block, BLOCK_C=block, NUM_STAGES=stages,
                                    num_warps=warps,
                                )  # fmt: skip

                        try:
                            ms = timed(run)
                        except Exception as exc:  # noqa: BLE001 - a config that does not compile
                            print(f"epilogue C={c} w={warps} x{mult} s={stages} b={block}: {exc!r}"[:200])
                            continue
                        report(f"epilogue C={c} warps={warps} grid={mult}xSM stages={stages} block={block}", ms, 0,
                               nbytes)  # fmt: skip
        # the op's own choice
        state = (torch.full((n,), float("-inf"), device="cuda"), *(torch.zeros(n, device="cuda") for _ in range(3)))

        def op_choice(z=z, state=state, chunks=chunks, out=out):
            for i in range(chunks):
                K._triton_fwd_epilogue(z, labels, state, *out, i * z.shape[1], 1.0, -100, True, False)

        report(f"epilogue C={c} op default", timed(op_choice), 0, nbytes)
        del z


def mlp(n: int = 65536, d: int = 3584, i: int = 18944) -> None:
    torch.manual_seed(0)
    x = torch.randn(n, d, device="cuda", dtype=torch.bfloat16)
    wg = torch.randn(i, d, device="cuda", dtype=torch.bfloat16) * d**-0.5
    wd = torch.randn(d, i, device="cuda", dtype=torch.bfloat16) * i**-0.5
    f = 2 * n * d * i
    g = torch.empty(n, i, device="cuda", dtype=torch.bfloat16)
    report("mlp full x@Wg.T", timed(lambda: torch.mm(x, wg.t(), out=g)), f)
    y = torch.empty(n, d, device="cuda", dtype=torch.bfloat16)
    report("mlp full g@Wd.T (down)", timed(lambda: torch.mm(g, wd.t(), out=y)), f)
    dwg = torch.empty(i, d, device="cuda", dtype=torch.bfloat16)
    report("mlp full dWg = g.T@x", timed(lambda: torch.mm(g.t(), x, out=dwg)), f)
    report("mlp full dx = g@Wg", timed(lambda: torch.mm(g, wg, out=y)), f)
    g = dwg = None  # noqa: F841 - freed before the tiles
    torch.cuda.empty_cache()
    for chunk, parts in ((1728, 4), (2304, 4), (1728, 1), (4096, 4), (6912, 1)):
        rows, width = chunk * parts, -(-i // parts)
        t = torch.empty(rows, width, device="cuda", dtype=torch.bfloat16)
        acc = torch.zeros(i, d, device="cuda", dtype=torch.float32)
        dx = torch.zeros(rows, d, device="cuda", dtype=torch.float32)

        def fwd_gemm(rows=rows, width=width, t=t):
            for s in range(0, n, rows):
                for lo in range(0, i, width):
                    hi = min(lo + width, i)
                    torch.mm(x[s : s + rows], wg[lo:hi].t(), out=t[: min(rows, n - s), : hi - lo])

        def wgrad(rows=rows, width=width, t=t, acc=acc):
            for s in range(0, n, rows):
                for lo in range(0, i, width):
                    hi = min(lo + width, i)
                    tt = t[: min(rows, n - s), : hi - lo]
                    torch.addmm(acc[lo:hi], tt.t(), x[s : s + rows], out_dtype=torch.float32, out=acc[lo:hi])

        def dxg(rows=rows, width=width, t=t, dx=dx):
            for s in range(0, n, rows):
                for lo in range(0, i, width):
                    hi = min(lo + width, i)
                    tt = t[: min(rows, n - s), : hi - lo]
                    torch.addmm(dx[: tt.shape[0]], tt, wg[lo:hi], out_dtype=torch.float32, out=dx[: tt.shape[0]])

        tag = f"mlp tiles [{rows}, {width}]"
        report(f"{tag} x@Wg.T", timed(fwd_gemm), f)
        report(f"{tag} fp32 acc += t.T@x", timed(wgrad), f)
        report(f"{tag} fp32 dx += t@Wg", timed(dxg), f)
        del t, acc, dx
        torch.cuda.empty_cache()


def op_variants(n: int = 16384, d: int = 4096, v: int = 151936, rounds: int = 3) -> None:
    """The whole op (no-grad forward; forward + backward) under each setting, interleaved over ``rounds`` so that
    clock drift spreads over all of them; Inductor's compiled formula and the 8192³ rate in every round."""
    import statistics

    from tilecompile.ops.fused_linear_ce import linear_logprob_entropy

    torch.manual_seed(0)
    h = torch.randn(n, d, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(v, d, device="cuda") * d**-0.5).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, v, (n,), device="cuda")
    ga, ge = torch.randn(n, device="cuda"), torch.randn(n, device="cuda") * 0.01

    def eager(h, w, y):
        z = (h @ w.t()).float()
        lp = torch.log_softmax(z, -1).gather(-1, y[:, None])[:, 0]
        return lp, torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)

    inductor = torch.compile(eager)
    old = {"cap": 8192, "warps": 0, "grid_per_sm": 0, "stages": 2}  # 0: the former formulas
    new = dict(K._FWD_LAUNCH)

    def setting(fwd_c, launch, dh_t):
        def apply():
            K.FWD_CHUNK_BUDGET_BYTES = n * 2 * fwd_c
            cfg = dict(launch)
            if cfg["warps"] == 0:  # the former: warps from the tile width, 32 warps of programs per SM
                blk = K._block_c(fwd_c, cfg["cap"])
                cfg["warps"] = min(16, max(4, blk // 512))
                cfg["grid_per_sm"] = max(1, 32 // cfg["warps"])
            K._FWD_LAUNCH = cfg
            K._DH_TRANSPOSED = dh_t

        return apply

    settings = {
        "fwdC=4096 old-epi dh[N,D] (landed)": setting(4096, old, False),
        "fwdC=4096 new-epi dh[N,D]": setting(4096, new, False),
        "fwdC=2048 new-epi dh[N,D]": setting(2048, new, False),
        "fwdC=8192 new-epi dh[N,D]": setting(8192, new, False),
        "fwdC=16384 new-epi dh[N,D]": setting(16384, new, False),
        "fwdC=4096 new-epi dh[D,N]": setting(4096, new, True),
        "fwdC=2048 new-epi dh[D,N]": setting(2048, new, True),
    }

    def fwd(fn):
        with torch.no_grad():
            return fn(h, w, y)

    def fwdbwd(fn):
        h.grad = w.grad = None
        lp, ent = fn(h, w, y)
        ((lp * ga).sum() + (ent * ge).sum()).backward()

    times: dict[str, list[float]] = {}
    peaks: dict[str, float] = {}
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(rounds):
        times.setdefault("rate 8192^3 x10 (TFLOP/s)", []).append(
            10 * 2 * 8192**3 / timed(lambda: [a @ a for _ in range(10)]) / 1e9
        )
        for mode, step in (("fwd", fwd), ("fwdbwd", fwdbwd)):
            times.setdefault(f"inductor {mode}", []).append(timed(lambda step=step: step(inductor)))
            for name, apply in settings.items():
                apply()
                step(linear_logprob_entropy)
                h.grad = w.grad = None
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                times.setdefault(f"{name} {mode}", []).append(timed(lambda step=step: step(linear_logprob_entropy)))
                peaks[f"{name} {mode}"] = (torch.cuda.max_memory_allocated() - base) / 2**30
                h.grad = w.grad = None
        settings["fwdC=4096 old-epi dh[N,D] (landed)"]()
    # every setting computes the same thing: outputs and grads against the landed setting's
    ref = None
    for name, apply in settings.items():
        apply()
        h.grad = w.grad = None
        lp, ent = linear_logprob_entropy(h, w, y)
        ((lp * ga).sum() + (ent * ge).sum()).backward()
        got = [t.detach().float() for t in (lp, ent, h.grad, w.grad)]
        ref = ref or got
        err = [((a - b).norm() / b.norm()).item() for a, b in zip(got, ref)]
        row = {"name": f"op agreement {name}", "relerr lp/ent/dh/dW": [f"{e:.1e}" for e in err]}
        RESULTS.append(row)
        print(json.dumps(row), flush=True)
    h.grad = w.grad = None
    for name, ts in times.items():
        med = statistics.median(ts)
        row = {"name": f"op {name}", "median": round(med, 3), "all": [round(t, 2) for t in ts]}
        if name in peaks:
            row["peak_extra_gib"] = round(peaks[name], 3)
        RESULTS.append(row)
        print(json.dumps(row), flush=True)


def chunk_rounds(n: int = 16384, d: int = 4096, v: int = 151936, rounds: int = 5) -> None:
    """The forward's z GEMMs, unchunked and over vocabulary chunks in both operand orders, interleaved over
    ``rounds`` (so clock drift spreads over all settings), then the whole no-grad forward of the op per chunk."""
    import statistics

    torch.manual_seed(0)
    h = torch.randn(n, d, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(v, d, device="cuda", dtype=torch.bfloat16) * d**-0.5
    y = torch.randint(0, v, (n,), device="cuda")
    full = torch.empty(n, v, device="cuda", dtype=torch.bfloat16)
    buf = torch.empty(n * 32768, device="cuda", dtype=torch.bfloat16)

    def chunked(c, transposed):
        def run():
            for v0 in range(0, v, c):
                wc = w[v0 : v0 + c]
                k = wc.shape[0]
                if transposed:
                    torch.mm(wc, h.t(), out=buf[: n * k].view(k, n))
                else:
                    torch.mm(h, wc.t(), out=buf[: n * k].view(n, k))

        return run

    def op(c):
        K_budget = n * 2 * c

        def run():
            K.FWD_CHUNK_BUDGET_BYTES = K_budget
            K.fused_linear_logprob_fwd(h, w, y, 1.0, -100, True)

        return run

    cases = {"full": lambda: torch.mm(h, w.t(), out=full)}
    for c in (1024, 2048, 4096, 8192, 16384, 32768):
        cases[f"C={c} [N,C]"] = chunked(c, False)
        cases[f"C={c} [C,N]"] = chunked(c, True)
    for c in (2048, 4096, 8192, 16384, 32768):
        cases[f"op fwd C={c}"] = op(c)
    times: dict[str, list[float]] = {}
    for _ in range(rounds):
        for name, fn in cases.items():
            times.setdefault(name, []).append(timed(fn, reps=1))
    for name, ts in times.items():
        row = {"name": f"rounds {name}", "median": round(statistics.median(ts), 3), "all": [round(t, 2) for t in ts]}
        RESULTS.append(row)
        print(json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--only", default="rates,lmhead,overlap,epilogue,mlp,op")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for part in args.only.split(","):
        {
            "rates": rates,
            "lmhead": lmhead,
            "overlap": overlap,
            "epilogue": epilogue,
            "mlp": mlp,
            "op": op_variants,
            "chunks": chunk_rounds,
        }[part]()
        if part != "rates":
            rates()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": RESULTS}, fh, indent=1)


if __name__ == "__main__":
    main()
