"""Benchmark: a verl-style PPO actor loss from hidden states, compiled three ways, side by side in one process.

The step (what verl's dp_actor computes after the trunk): logits = lm_head(h) shifted against the labels
(``logits[:, :-1]``), divided in place by the temperature, per-token log-prob (log_softmax + gather) and entropy
(logsumexp − Σ softmax·z), then the PPO clipped loss minus an entropy bonus, masked means over the response.
h [B, T, D] stands in for the trunk's output (requires grad); the lm_head weight is a parameter.

Methods: ``eager``; ``inductor`` (``torch.compile(step)``); ``tilecompile`` (``torch.compile(step,
backend="tilecompile")``: the fused_linear_ce pass rewrites the lm_head region to the fused op in its loss-aware
mode, Inductor compiles the rest); ``tilecompile-recompute`` (the same with ``ce_loss_aware`` off: the op's
backward recomputes the logits); ``tilecompile-eagergrad`` (loss-aware, the loss's per-token gradient run by eager
autograd in each row block instead of compiled: ``ce_loss_grad_compile=off``). The report's mode is in the CSV.
Time: median of ``--reps`` fwd+bwd timings after a warm-up that includes compilation (CUDA events on the GPU,
perf_counter on CPU). Peak extra memory:
``max_memory_allocated`` during one step minus what is allocated with the inputs in place (CUDA only). Errors:
loss, dh and dW relative to eager (fp32 eager on CPU; same dtype on GPU).
FLOP floor of the lm_head part: fwd+bwd = 6·N·D·V.

usage: python benchmarks/bench_e2e_logprob.py [--shapes 16384:4096:151936,16384:1536:151936] [--reps 5]
           [--only eager,inductor,tilecompile,tilecompile-recompute,tilecompile-eagergrad] [--csv PATH]
       python benchmarks/bench_e2e_logprob.py --tiny      (CPU, N=64 D=32 V=257 fp32: checks that it runs)
"""

from __future__ import annotations

import argparse
import csv
import datetime
import gc
import os
import statistics
import time
import traceback

import torch
import torch.nn.functional as F

CSV_FIELDS = [
    "date", "device", "torch", "triton", "N", "D", "V", "dtype", "method", "ms", "peak_extra_gib",
    "lm_head_floor_tflop", "rewrites", "mode", "relerr_loss", "relerr_dh", "relerr_dw", "error",
]  # fmt: skip
SUMMARY = (
    "N",
    "D",
    "V",
    "method",
    "ms",
    "peak_extra_gib",
    "rewrites",
    "relerr_loss",
    "relerr_dh",
    "relerr_dw",
    "error",
)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum()


def ppo_step(lm_head, h, ids, response_mask, old_logp, advantages, temperature: float):
    logits = lm_head(h)
    logits = logits[:, :-1, :]
    logits.div_(temperature)
    labels = ids[:, 1:]
    logp = torch.gather(F.log_softmax(logits.float(), dim=-1), -1, labels.unsqueeze(-1)).squeeze(-1)
    z = logits.float()
    entropy = torch.logsumexp(z, dim=-1) - torch.sum(F.softmax(z, dim=-1) * z, dim=-1)
    ratio = torch.exp(logp - old_logp)
    adv = advantages[:, None]
    pg = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 0.8, 1.2))
    return masked_mean(pg, response_mask) - 0.001 * masked_mean(entropy, response_mask)


def make_inputs(n: int, d: int, v: int, dtype: torch.dtype, device: str, batch: int):
    g = torch.Generator(device="cpu").manual_seed(0)
    seq = n // batch + 1  # the shift drops one position per sequence: N = batch * (seq - 1)
    lm_head = torch.nn.Linear(d, v, bias=False).to(device=device, dtype=dtype)
    with torch.no_grad():
        lm_head.weight.copy_((torch.randn(v, d, generator=g) * d**-0.5).to(dtype))
    h = (torch.randn(batch, seq, d, generator=g)).to(device=device, dtype=dtype).requires_grad_()
    ids = torch.randint(0, v, (batch, seq), generator=g).to(device)
    mask = (torch.rand(batch, seq - 1, generator=g) > 0.1).float().to(device)
    old_logp = (-torch.rand(batch, seq - 1, generator=g) * 3).to(device)
    advantages = torch.randn(batch, generator=g).to(device)
    return lm_head, (h, ids, mask, old_logp, advantages)


def build(method: str):
    if method == "eager":
        return ppo_step
    if method == "inductor":
        return torch.compile(ppo_step)
    if method == "tilecompile":  # the loss reduces to a scalar: the loss-aware mode (grads in the forward, 3 GEMMs)
        return torch.compile(ppo_step, backend="tilecompile")
    if method == "tilecompile-recompute":  # the same with the loss-aware mode off: the op recomputes z (4 GEMMs)
        return torch.compile(ppo_step, backend="tilecompile", options={"ce_loss_aware": False})
    if method == "tilecompile-eagergrad":  # loss-aware, the loss's per-token gradient by eager autograd per block
        return torch.compile(ppo_step, backend="tilecompile", options={"ce_loss_grad_compile": "off"})
    raise ValueError(f"unknown method {method!r}")


def run_once(fn, lm_head, inputs, temperature):
    h = inputs[0]
    h.grad = None
    lm_head.weight.grad = None
    loss = fn(lm_head, *inputs, temperature)
    loss.backward()
    return loss.detach(), h.grad, lm_head.weight.grad


def timed(fn, lm_head, inputs, temperature, reps: int, cuda: bool) -> float:
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run_once(fn, lm_head, inputs, temperature)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            run_once(fn, lm_head, inputs, temperature)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def bench_shape(n, d, v, dtype, device, methods, reps, batch, temperature, rows):
    import tilecompile

    cuda = device.startswith("cuda")
    lm_head, inputs = make_inputs(n, d, v, dtype, device, batch)
    reference = None
    for method in methods:
        row = dict(N=n, D=d, V=v, dtype=str(dtype).replace("torch.", ""), method=method)
        row["lm_head_floor_tflop"] = f"{6 * n * d * v / 1e12:.3f}"
        try:
            torch._dynamo.reset()
            tilecompile.reset()
            fn = build(method)
            out = run_once(fn, lm_head, inputs, temperature)  # warm-up, includes compilation
            out = tuple(t.clone() for t in out)
            rep = tilecompile.report()
            row["rewrites"] = rep.counts["fused_linear_ce"] if method.startswith("tilecompile") else ""
            modes = [r.detail.rpartition("; ")[2] for r in rep.rewrites if r.pass_name == "fused_linear_ce"]
            row["mode"] = " | ".join(modes)
            if reference is None:
                reference = out
            row["relerr_loss"], row["relerr_dh"], row["relerr_dw"] = (
                f"{rel(a, b):.2e}" for a, b in zip(out, reference)
            )
            del out
            gc.collect()
            if cuda:
                torch.cuda.synchronize()
                inputs[0].grad = None
                lm_head.weight.grad = None
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                run_once(fn, lm_head, inputs, temperature)
                torch.cuda.synchronize()
                row["peak_extra_gib"] = f"{(torch.cuda.max_memory_allocated() - base) / 2**30:.2f}"
            row["ms"] = f"{timed(fn, lm_head, inputs, temperature, reps, cuda):.2f}"
        except Exception as exc:  # noqa: BLE001 - a method that fails is a row with its error, not a crash
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            traceback.print_exc()
            if cuda:
                torch.cuda.empty_cache()
        print(", ".join(f"{k}={row.get(k, '')}" for k in SUMMARY))
        rows.append(row)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="16384:4096:151936,16384:1536:151936", help="N:D:V,... (N = tokens)")
    p.add_argument("--only", default="eager,inductor,tilecompile")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--batch", type=int, default=4, help="sequences the N tokens are split into")
    p.add_argument("--temperature", type=float, default=0.9)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--tiny", action="store_true", help="CPU, N=64 D=32 V=257 fp32, 2 reps: checks that it runs")
    p.add_argument("--csv", default=None, help="default: benchmarks/results/e2e_logprob[_tiny].csv")
    args = p.parse_args(argv)

    if args.tiny:
        shapes, dtype, device, reps = [(64, 32, 257)], torch.float32, "cpu", 2
    else:
        shapes = [tuple(int(x) for x in s.split(":")) for s in args.shapes.split(",")]
        dtype, reps = getattr(torch, args.dtype), args.reps
        device = "cuda" if torch.cuda.is_available() else "cpu"
    methods = [m for m in args.only.split(",") if m]
    here = os.path.dirname(os.path.abspath(__file__))
    path = args.csv or os.path.join(here, "results", "e2e_logprob_tiny.csv" if args.tiny else "e2e_logprob.csv")

    rows: list[dict] = []
    for n, d, v in shapes:
        if n % args.batch:
            raise SystemExit(f"N={n} is not a multiple of --batch {args.batch}")
        bench_shape(n, d, v, dtype, device, methods, reps, args.batch, args.temperature, rows)

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = ""
    common = dict(
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        device=torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        torch=torch.__version__,
        triton=triton_version,
    )
    os.makedirs(os.path.dirname(path), exist_ok=True)
    new = not os.path.exists(path)
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        if new:
            writer.writeheader()
        for row in rows:
            writer.writerow({**common, **row})
    print(f"wrote {len(rows)} rows to {path}")


if __name__ == "__main__":
    main()
