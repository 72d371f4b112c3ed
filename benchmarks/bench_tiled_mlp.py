"""Tiled gated MLP (SwiGLU) fwd+bwd: time and peak memory, every method side by side in one process on one GPU.

Methods: eager PyTorch, Inductor (torch.compile of the same module), torch.utils.checkpoint around the MLP,
Liger's tiled MLP (DeepSpeed ALST algorithm; only when liger_kernel imports), and the tilecompile op
(``torch.ops.tilecompile.tiled_gated_mlp``) with fp32 and with param-dtype weight-grad accumulation.
Extra tilecompile rows at the main shape: the PyTorch elementwise path instead of the fused Triton kernels, the
backward without tiling over parts of I ("1part"), and other chunk budgets.

FLOPs (model, recompute not counted, same for every method): forward 3 GEMMs of 2·N·D·I, backward 6 → 18·N·D·I.
Time: median of ``--reps`` fwd+bwd steps timed with CUDA events, after warm-up (which includes compilation).
Peak extra: ``max_memory_allocated`` during one step minus the memory allocated before it with inputs, weights and
the upstream grad allocated and all grads None (so the new grads, dx and the output count as extra).
``peak_extra_anchor_gib`` is the same with the previous step's grads still allocated at the baseline, as
the project's anchor MLP benchmark (kept outside this repository) measures.

usage: python benchmarks/bench_tiled_mlp.py [--ns 65536,8192,32768,131072] [--csv benchmarks/results/tiled_mlp.csv]
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import statistics
import time
import traceback

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tilecompile.ops import tiled_mlp


class SwiGLU(nn.Module):
    def __init__(self, d: int, i: int):
        super().__init__()
        self.gate_proj = nn.Linear(d, i, bias=False)
        self.up_proj = nn.Linear(d, i, bias=False)
        self.down_proj = nn.Linear(i, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def tilecompile_fn(mlp: SwiGLU, **kw):
    def fn(x):
        return tiled_mlp.tiled_gated_mlp(
            x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight, activation="silu", **kw
        )

    return fn


def methods_for(mlp: SwiGLU, main_shape: bool) -> dict:
    methods = {
        "eager": mlp,
        "inductor": torch.compile(mlp, dynamic=False),
        "checkpoint": lambda x: checkpoint(mlp, x, use_reentrant=False),
    }
    try:
        from liger_kernel.ops.tiled_mlp import apply_tiled_mlp

        methods["liger-tiled"] = lambda x: apply_tiled_mlp(lambda m, t: m(t), mlp, x)
    except Exception as e:
        print("liger unavailable:", type(e).__name__, e)
    methods["tilecompile-fp32"] = tilecompile_fn(mlp, grad_accum="fp32")
    methods["tilecompile-param"] = tilecompile_fn(mlp, grad_accum="param")
    if main_shape:
        methods["tilecompile-fp32-torch-ew"] = ({"USE_TRITON": False}, tilecompile_fn(mlp, grad_accum="fp32"))
        methods["tilecompile-fp32-1part"] = ({"_MAX_I_PARTS": 1}, tilecompile_fn(mlp, grad_accum="fp32"))
        methods["tilecompile-param-1part"] = ({"_MAX_I_PARTS": 1}, tilecompile_fn(mlp, grad_accum="param"))
        methods["tilecompile-fp32-512mb"] = tilecompile_fn(mlp, grad_accum="fp32", budget_mb=512)
        methods["tilecompile-param-128mb"] = tilecompile_fn(mlp, grad_accum="param", budget_mb=128)
    return methods


class _Memory:
    """CUDA events and allocator stats on the GPU; wall clock and no memory numbers on CPU (a dry run)."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def empty_cache(self) -> None:
        if self.cuda:
            torch.cuda.empty_cache()

    def start(self) -> int:
        self.sync()
        self.empty_cache()
        if not self.cuda:
            return 0
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()

    def peak_since(self, base: int) -> float:
        self.sync()
        return (torch.cuda.max_memory_allocated() - base) / 2**30 if self.cuda else float("nan")

    def timer(self):
        """Start timing; the returned callable stops and gives milliseconds."""
        if not self.cuda:
            t0 = time.perf_counter()
            return lambda: (time.perf_counter() - t0) * 1e3
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()

        def stop() -> float:
            e.record()
            torch.cuda.synchronize()
            return s.elapsed_time(e)

        return stop


def bench_shape(n: int, d: int, i: int, reps: int, main_shape: bool, device: str = "cuda") -> list[dict]:
    torch.manual_seed(0)
    mem = _Memory(device)
    mlp = SwiGLU(d, i).to(device, torch.bfloat16)
    x = torch.randn(1, n, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(1, n, d, device=device, dtype=torch.bfloat16)
    flops = 18 * n * d * i
    rows, refs = [], {}
    for name, fn in methods_for(mlp, main_shape).items():
        settings = {}
        if isinstance(fn, tuple):  # (module settings of tiled_mlp for this row, fn)
            settings, fn = fn
        saved = {k: getattr(tiled_mlp, k) for k in settings}
        for k, v in settings.items():
            setattr(tiled_mlp, k, v)
        row = {"method": name, "n": n, "d": d, "i": i, "dtype": "bfloat16"}

        def clear():
            x.grad = None
            for p in mlp.parameters():
                p.grad = None

        def step(fn=fn):
            clear()
            fn(x).backward(gy)

        try:
            t0 = time.perf_counter()
            step()  # warm-up (compiles where needed)
            step()
            mem.sync()
            row["warmup_s"] = round(time.perf_counter() - t0, 2)
            refs[name] = (x.grad.float(), mlp.down_proj.weight.grad.float(), mlp.gate_proj.weight.grad.float())
            # anchor-style peak: baseline holds the previous step's grads, which step() frees first
            base = mem.start()
            step()
            row["peak_extra_anchor_gib"] = mem.peak_since(base)
            # strict peak: baseline with inputs, weights and gy only
            clear()
            base = mem.start()
            step()
            row["peak_extra_gib"] = mem.peak_since(base)
            ts = []
            for _ in range(reps):
                clear()
                t = mem.timer()
                fn(x).backward(gy)
                ts.append(t())
            row["ms"] = statistics.median(ts)
            row["ms_min"] = min(ts)
            row["tflops"] = flops / (row["ms"] / 1e3) / 1e12
        except Exception as ex:
            row["error"] = f"{type(ex).__name__}: {str(ex)[:200]}"
            traceback.print_exc(limit=3)
        finally:
            for k, v in saved.items():
                setattr(tiled_mlp, k, v)
        clear()
        mem.empty_cache()
        rows.append(row)
    if device == "cuda":
        rows += gemm_floor_rows(mlp, x, gy, reps, flops)
    ref = refs.get("eager")
    ind = next((r for r in rows if r["method"] == "inductor" and "ms" in r), None)
    for r in rows:
        if ref is not None and r["method"] in refs:
            for key, a, b in zip(("relerr_dx", "relerr_dwdown", "relerr_dwgate"), refs[r["method"]], ref):
                r[key] = ((a - b).norm() / b.norm()).item()
        if ind is not None and "ms" in r:
            r["x_inductor"] = r["ms"] / ind["ms"]
    return rows


def gemm_floor_rows(mlp: SwiGLU, x, gy, reps: int, flops: int) -> list[dict]:
    """The GEMMs alone, unchunked, as cuBLAS runs them here: 9 (what Inductor issues) and 11 (plus the recompute of
    gate and up that a tiled MLP needs), with no elementwise work. A method with that many GEMMs of 2·N·D·I cannot
    beat this row, so it shows what a ratio to Inductor can reach on this GPU."""
    n, d = x.shape[-2], x.shape[-1]
    x2, dy = x.detach().view(-1, d), gy.view(-1, d)
    wg, wu, wd = (p.detach() for p in (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight))

    def gemms(recompute: bool):
        g, u = x2 @ wg.t(), x2 @ wu.t()
        g @ wd.t()  # the output (g stands in for act(g)·u)
        if recompute:
            torch.mm(x2, wg.t(), out=g)
            torch.mm(x2, wu.t(), out=u)
        dh = dy @ wd
        dy.t() @ g  # dW_down
        dh.t() @ x2  # dW_gate (dh stands in for dg)
        u.t() @ x2  # dW_up (u stands in for du)
        (dh @ wg).addmm_(u, wu)  # dx

    rows = []
    for count, recompute in ((9, False), (11, True)):
        row = {"method": f"cublas-{count}-gemms-only", "n": n, "d": d, "i": wg.shape[0], "dtype": "bfloat16"}
        gemms(recompute)
        torch.cuda.synchronize()
        ts = []
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            gemms(recompute)
            e.record()
            torch.cuda.synchronize()
            ts.append(s.elapsed_time(e))
        row.update(ms=statistics.median(ts), ms_min=min(ts), peak_extra_gib=float("nan"))
        row.update(peak_extra_anchor_gib=float("nan"), tflops=flops / (row["ms"] / 1e3) / 1e12)
        rows.append(row)
        torch.cuda.empty_cache()
    return rows


FIELDS = ["gpu", "torch", "triton", "date", "method", "n", "d", "i", "dtype", "ms", "ms_min", "tflops", "x_inductor",
          "peak_extra_gib", "peak_extra_anchor_gib", "relerr_dx", "relerr_dwdown", "relerr_dwgate", "warmup_s",
          "error"]  # fmt: skip


def fmt_row(r: dict) -> str:
    if "error" in r:
        return f"| {r['n']} | {r['method']} | error: {r['error'][:80]} | | | | |"
    return (
        f"| {r['n']} | {r['method']} | {r['ms']:.1f} | {r.get('x_inductor', float('nan')):.2f} | {r['tflops']:.0f} "
        f"| {r['peak_extra_gib']:.2f} | {r['peak_extra_anchor_gib']:.2f} | {r.get('relerr_dx', float('nan')):.1e} / "
        f"{r.get('relerr_dwdown', float('nan')):.1e} |"
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ns", default="65536,8192,32768,131072")
    ap.add_argument("--d", type=int, default=3584)
    ap.add_argument("--i", type=int, default=18944)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--csv", default="benchmarks/results/tiled_mlp.csv")
    ap.add_argument("--md", default="", help="also write the markdown table here")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script on small shapes")
    ap.add_argument("--time-budget-s", type=float, default=1e9, help="skip remaining shapes after this long")
    a = ap.parse_args()
    import triton

    meta = {
        "gpu": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
    }
    if a.device == "cuda":
        print(meta, "addmm out_dtype fp32 accumulation:", tiled_mlp._cuda_out_dtype_addmm_ok(torch.device("cuda")))
    os.makedirs(os.path.dirname(a.csv) or ".", exist_ok=True)
    header = "| N | method | ms | × Inductor | TFLOP/s | peak extra GiB | anchor-style GiB | relerr dx / dWdown |"
    lines = [header, "|---|---|---|---|---|---|---|---|"]
    t_start = time.perf_counter()
    with open(a.csv, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for k, n in enumerate(int(v) for v in a.ns.split(",")):
            if time.perf_counter() - t_start > a.time_budget_s:
                print(f"time budget spent: skipping N={n}")
                continue
            rows = bench_shape(n, a.d, a.i, a.reps, main_shape=(k == 0), device=a.device)
            for r in rows:
                w.writerow({**meta, **{key: r.get(key, "") for key in FIELDS if key not in meta}})
                lines.append(fmt_row(r))
                print(lines[-1], flush=True)
            f.flush()
    print("\n".join(lines))
    if a.md:
        with open(a.md, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
