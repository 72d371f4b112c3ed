"""Probe for issue #13: which Inductor setting makes dynamic=True fail in the first backward of an HF Qwen2 step.

usage: python benchmarks/probe_dynamic.py [--layers 2] [--n 4096,6144]
Runs the GRPO-style step of bench_attention.py with dynamic=True under several variants and prints one JSON row
per variant and length (the error's last frames when it fails).
"""

import argparse
import json
import sys
import traceback

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import bench_attention as B  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--n", default="4096,6144")
    ap.add_argument("--gc", type=int, default=0)
    ap.add_argument("--only", default="", help="comma-separated substrings of the variants to run")
    a = ap.parse_args()
    variants = {
        "inductor": ("inductor", {}),
        "inductor split_reductions=False": ("inductor", {"split_reductions": False}),
        "tilecompile": ("tilecompile", {}),
        "tilecompile split_reductions=False": ("tilecompile", {"split_reductions": False}),
        "inductor mix_order_reduction=False": ("inductor", {"triton.mix_order_reduction": False}),
        "tilecompile mix_order_reduction=False": ("tilecompile", {"triton.mix_order_reduction": False}),
    }
    if a.only:
        variants = {k: v for k, v in variants.items() if any(o in k for o in a.only.split(","))}
    for name, (backend, opts) in variants.items():
        torch._dynamo.reset()
        model = B.make_model(a.layers, "cuda")
        if not a.gc:
            model.gradient_checkpointing_disable()
        step = torch.compile(B.step_fn(model), backend=backend, dynamic=True, options=opts or None)
        for n in [int(x) for x in a.n.split(",")]:
            ids = torch.randint(0, 151936, (1, n), device="cuda")
            adv, old = torch.randn(1, n - 1, device="cuda"), -torch.rand(1, n - 1, device="cuda")
            row = dict(variant=name, n=n, layers=a.layers, gc=a.gc)
            try:
                step(ids, adv, old).backward()
                torch.cuda.synchronize()
                row["ok"] = True
            except Exception as exc:  # the failure is the result
                row.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:300]}",
                           where=traceback.format_exc().splitlines()[-12:])  # fmt: skip
            print(json.dumps(row), flush=True)
            if not row["ok"]:
                break
        del model, step
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
