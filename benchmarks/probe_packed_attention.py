"""Probe: where the time of packed masked attention goes (the op against flash on the real tokens alone).

For one padded batch (bench_attention's families, H=12, Hkv=2, D=128, bf16, HF's token-major q, k, v), runs the op's
forward + backward under ``torch.profiler`` and prints the CUDA kernels by total time, beside the same for the
floor (flash varlen over the pre-packed real tokens): the difference is the op's packing overhead, kernel by kernel.

usage: python benchmarks/probe_packed_attention.py [--batch 8x4096] [--kinds left,trl,trl+docs] [--rows 12]
"""

from __future__ import annotations

import argparse

import torch
from bench_attention import _pad_rows  # this script's folder is on sys.path
from torch.profiler import ProfilerActivity, profile

import tilecompile.ops.attention as OA
from tilecompile.kernels import attention as K


def _profile(fn, rows: int) -> None:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="8x4096")
    ap.add_argument("--kinds", default="left,trl,trl+docs")
    ap.add_argument("--rows", type=int, default=12)
    args = ap.parse_args()
    b, n = (int(x) for x in args.batch.split("x"))
    gen = torch.Generator().manual_seed(0)
    for kind in args.kinds.split(","):
        _case(kind, b, n, gen, args.rows)


def _case(kind: str, b: int, n: int, gen: torch.Generator, rows: int) -> None:
    dev = torch.device("cuda")
    h, hkv, d = 12, 2, 128
    valid = _pad_rows(b, n, kind.removesuffix("+docs"), gen).to(dev)
    doc = (torch.arange(n, device=dev) // (n // 4))[None].expand(b, n) if "docs" in kind else None

    def hf(heads):
        return torch.randn(b, n, heads, d, device=dev, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()

    q, k, v = hf(h), hf(hkv), hf(hkv)
    g = torch.randn(b, n, h, d, device=dev, dtype=torch.bfloat16).transpose(1, 2)
    plan = OA.attention_plan(None, doc, valid, 0, None)
    pk = K.packed(plan, b, n)
    print(f"== {kind} {b}x{n}: t1={pk['t1']} t2={pk['t2']} segments={len(pk['cu1']) - 1}", flush=True)

    def ours():
        out, _ = torch.ops.tilecompile.masked_attention(q, k, v, None, doc, valid, 0, None, d**-0.5, plan)
        torch.autograd.grad(out, (q, k, v), g)

    t1 = pk["t1"]
    qf, kf, vf, gf = (K._pack(t.detach(), pk["order"])[:t1].contiguous() for t in (q, k, v, g))
    cu, mx = pk["cu1"], pk["max1"]

    def floor():
        out, lse = K.flash_fwd(qf, kf, vf, cu, cu, mx, mx, True, -1, 0, d**-0.5)
        K.flash_bwd(gf, qf, kf, vf, out, lse, cu, cu, mx, mx, True, -1, 0, d**-0.5)

    print("-- ours", flush=True)
    _profile(ours, rows)
    print("-- floor", flush=True)
    _profile(floor, rows)


if __name__ == "__main__":
    main()
