"""Probe: which SDPA backend ``is_causal`` with ``enable_gqa`` runs here, and each backend's fwd + bwd time.

The op's whole-row path (an all-ones padding mask) should run the kernel the no-mask step runs. For one row of N
tokens (H=12, Hkv=2, D=128, bf16, HF's token-major q, k, v) this times SDPA under each single backend
(``sdpa_kernel``), and the cuDNN and flash aten ops called directly with GQA's k, v (whether they take them, and
the shape of the log-sum-exp they return).

usage: python benchmarks/probe_sdpa_backends.py [--n 16384]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from bench_attention import _time  # this script's folder is on sys.path
from torch.nn.attention import SDPBackend, sdpa_kernel


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=16384)
    n = ap.parse_args().n
    b, h, hkv, d = 1, 12, 2, 128
    dev = torch.device("cuda")

    def hf(heads):
        return torch.randn(b, n, heads, d, device=dev, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()

    q, k, v = hf(h), hf(hkv), hf(hkv)
    g = torch.randn(b, n, h, d, device=dev, dtype=torch.bfloat16).transpose(1, 2)
    row = {"n": n}
    for name, backend in (
        ("default", None),
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("cudnn", SDPBackend.CUDNN_ATTENTION),
        ("efficient", SDPBackend.EFFICIENT_ATTENTION),
    ):

        def fn(backend=backend):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            torch.autograd.grad(out, (q, k, v), g)

        try:
            if backend is None:
                row[name] = round(_time(fn), 3)
            else:
                with sdpa_kernel([backend]):
                    row[name] = round(_time(fn), 3)
        except RuntimeError as exc:
            row[name] = f"error: {str(exc)[:120]}"
    with torch.no_grad():
        for label, kk, vv in (("gqa", k, v), ("mha", k.repeat_interleave(6, 1), v.repeat_interleave(6, 1))):
            try:
                res = torch.ops.aten._scaled_dot_product_cudnn_attention(
                    q, kk, vv, None, True, 0.0, True, False, scale=d**-0.5
                )
                ref = F.scaled_dot_product_attention(q.double(), kk.double(), vv.double(), is_causal=True)
                row[f"cudnn_{label}"] = dict(
                    lse=list(res[1].shape),
                    lse_stride=list(res[1].stride()),
                    out_stride=list(res[0].stride()),
                    err=(res[0].double() - ref).abs().max().item(),
                )
            except RuntimeError as exc:
                row[f"cudnn_{label}"] = f"error: {str(exc)[:160]}"
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
