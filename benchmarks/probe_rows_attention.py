"""Probe: an all-ones padding mask at one row of N tokens: the op's whole-row path against SDPA's is_causal kernel.

Times fwd + bwd (CUDA-event median) of SDPA ``is_causal`` with ``enable_gqa`` (what the no-mask step runs), the op
with its plan (``masked_attention``), the whole-row flash kernel called directly, and flash varlen with one segment;
prints which path the op took and any warning it gave. H=12, Hkv=2, D=128, bf16, HF's token-major q, k, v.

usage: python benchmarks/probe_rows_attention.py [--n 16384] [--b 1]
"""

from __future__ import annotations

import argparse
import json
import warnings

import torch
import torch.nn.functional as F
from bench_attention import _time  # this script's folder is on sys.path

import tilecompile.ops.attention as OA
from tilecompile.kernels import attention as K


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--b", type=int, default=1)
    args = ap.parse_args()
    b, n, h, hkv, d = args.b, args.n, 12, 2, 128
    dev = torch.device("cuda")

    def hf(heads):
        return torch.randn(b, n, heads, d, device=dev, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()

    q, k, v = hf(h), hf(hkv), hf(hkv)
    g = torch.randn(b, n, h, d, device=dev, dtype=torch.bfloat16).transpose(1, 2)
    valid = torch.ones(b, n, dtype=torch.long, device=dev)
    plan = OA.attention_plan(None, None, valid, 0, None)
    print(
        "plan info",
        plan[5].tolist(),
        "packed",
        {k_: v_ for k_, v_ in K.packed(plan, b, n).items() if k_ in ("rows", "t1", "t2", "max1")},
        flush=True,
    )

    def sdpa():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        torch.autograd.grad(out, (q, k, v), g)

    def ours():
        out, _ = torch.ops.tilecompile.masked_attention(q, k, v, None, None, valid, 0, None, d**-0.5, plan)
        torch.autograd.grad(out, (q, k, v), g)

    q4, k4, v4, g4 = (t.detach().transpose(1, 2) for t in (q, k, v, g))

    def dense():
        out, lse = K.flash_dense_fwd(q4, k4, v4, True, -1, 0, d**-0.5)
        K.flash_dense_bwd(g4, q4, k4, v4, out, lse, True, -1, 0, d**-0.5)

    qf, kf, vf, gf = (t.reshape(b * n, -1, d) for t in (q4, k4, v4, g4))
    cu = torch.arange(0, b * n + 1, n, device=dev, dtype=torch.int32)

    def varlen():
        out, lse = K.flash_fwd(qf, kf, vf, cu, cu, n, n, True, -1, 0, d**-0.5)
        K.flash_bwd(gf, qf, kf, vf, out, lse, cu, cu, n, n, True, -1, 0, d**-0.5)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        before = dict(OA.PATHS)
        ours()
        print("paths", {p: OA.PATHS[p] - before[p] for p in before}, "warnings", [str(w.message) for w in caught])
    row = {
        name: round(_time(fn), 3)
        for name, fn in (
            ("sdpa_is_causal_ms", sdpa),
            ("ours_ms", ours),
            ("dense_direct_ms", dense),
            ("varlen_ms", varlen),
        )
    }
    print(json.dumps(dict(b=b, n=n, **row)), flush=True)


if __name__ == "__main__":
    main()
