"""Probe (H200): are the gradients of the whole-model step right with shared layer regions?

The e2e.py GRPO step of the 1.5B shape (28 layers, activation checkpointing on, bf16 weights), one batch, compiled
several ways; every parameter's gradient is compared with an fp32 eager step of the same model (weights upcast), and
bf16 eager's own distance from that reference is the floor. Per variant: the loss, the largest and the median relative
error ``|g - g_ref| / |g_ref|`` over the parameters, the lowest cosine and the parameter it belongs to, the first
step's seconds (compile included, caches off), then the median of ``--repeats`` steps and their peak memory.

Variants (``--variants``):
  eager          bf16 eager, the floor
  flat           tilecompile, layer regions off
  regions        tilecompile, layer regions on (the backend turns Inductor's reorder_for_peak_memory off for them)
  regions-reorder  layer regions on with reorder_for_peak_memory forced on (the setting the CPU tests found wrong)

usage: python3 benchmarks/probe_regions_grads.py [--n 4096] [--mask ''|ones|trl] [--rows 1] [--layers 0]
       [--variants eager,flat,regions,regions-reorder] [--dynamic]
       python3 benchmarks/probe_regions_grads.py --tiny --n 64 --variants eager,flat,regions   (CPU smoke test)
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import statistics
import time
import warnings

import torch
from e2e import build, grpo_step, inputs

import tilecompile

VARIANTS = {
    "eager": None,
    "flat": {"layer_regions": False},
    "regions": {"layer_regions": True},
    "regions-reorder": {"layer_regions": True, "reorder_for_peak_memory": True},
}


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def compare(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict:
    rel, cos = {}, {}
    for name, r in ref.items():
        g = got[name].float()
        rel[name] = float((g - r).norm() / r.norm().clamp(min=1e-30))
        cos[name] = float(torch.nn.functional.cosine_similarity(g.flatten(), r.flatten(), dim=0))
    worst = max(rel, key=rel.get)
    lowest = min(cos, key=cos.get)
    return dict(rel_max=round(rel[worst], 5), rel_max_param=worst, rel_median=round(statistics.median(rel.values()), 5),
                cos_min=round(cos[lowest], 6), cos_min_param=lowest, missing=sorted(set(ref) - set(got)))  # fmt: skip


def step_once(model, step, batch) -> tuple[float, float]:
    for p in model.parameters():
        p.grad = None
    start = time.perf_counter()
    loss = step(*batch)
    loss.backward()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, loss.item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--mask", default="", help="'' (none), ones, trl")
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--dynamic", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="the tiny stand-in on CPU through aot_eager (smoke test)")
    args = ap.parse_args()
    torch._inductor.config.force_disable_caches = True
    device = torch.device("cpu" if args.tiny else "cuda")
    model, _ = build("1.5b", args.tiny, args.layers, True, False, device)
    batch = inputs(args.n, model.config.vocab_size, 0, device, args.rows, args.mask)

    reference = copy.deepcopy(model).float()
    _, ref_loss = step_once(reference, functools.partial(grpo_step, reference), batch)
    ref = {k: v.detach().clone() for k, v in grads(reference).items()}
    del reference
    if device.type == "cuda":
        torch.cuda.empty_cache()
    print(json.dumps(dict(variant="fp32-eager", loss=ref_loss, n=args.n, rows=args.rows, mask=args.mask)), flush=True)

    for name in args.variants.split(","):
        options = VARIANTS[name]
        torch._dynamo.reset()
        tilecompile.reset()
        step = lambda *a: grpo_step(model, *a)  # noqa: E731
        if options is not None:
            options = dict(options, **({"inner": "aot_eager", "mlp_min_tokens": 0} if args.tiny else {}))
            step = torch.compile(step, backend="tilecompile", dynamic=args.dynamic, options=options)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first, loss = step_once(model, step, batch)
        row = dict(variant=name, loss=loss, loss_err=abs(loss - ref_loss), first_step_s=round(first, 2),
                   **compare(grads(model), ref))  # fmt: skip
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        times = [step_once(model, step, batch)[0] for _ in range(args.repeats)]
        report = tilecompile.report()
        peak = round(torch.cuda.max_memory_allocated() / 2**30, 3) if cuda else ""
        row.update(step_s=round(statistics.median(times), 4), peak_gib=peak,
                   rewrites=" ".join(f"{k}={v}" for k, v in report.counts.items() if v) if options else "",
                   warnings=sorted({f"{w.category.__name__}: {str(w.message)[:200]}" for w in caught}))  # fmt: skip
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
