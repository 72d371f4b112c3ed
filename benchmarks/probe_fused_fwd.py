"""Probe: the no-grad log-prob forward as one Triton GEMM with the softmax statistics in its epilogue, TMA version.

A first pointer-based version (commit d17b007) ran at about two thirds of cuBLAS. This one loads tiles with tensor
descriptors (TMA on Hopper) in a persistent loop over output tiles, and compares it, in interleaved rounds, with
cuBLAS's unchunked GEMM and the op's chunked forward. Per-row partials of each [BM, BN] tile (max, Σe, Σe·x, the
label's logit) are merged in PyTorch, as in d17b007.

usage: python benchmarks/probe_fused_fwd.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from tilecompile.kernels import fused_linear_ce as K


@triton.jit
def _stats_tma_kernel(
    h_desc, w_desc, labels_ptr, pm_ptr, ps_ptr, pa_ptr, zy_ptr, n_rows, vocab, dim, n_vtiles, inv_t,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr,
    FLATTEN: tl.constexpr,
):  # fmt: skip
    num_m = tl.cdiv(n_rows, BM)
    num_tiles = num_m * n_vtiles
    k_tiles = tl.cdiv(dim, BK)
    in_group = GROUP_M * n_vtiles
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=FLATTEN):
        first_m = (tile // in_group) * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (tile % in_group) % size_m
        pid_n = (tile % in_group) // size_m
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kk in range(k_tiles):
            a = h_desc.load([pid_m * BM, kk * BK])
            b = w_desc.load([pid_n * BN, kk * BK])
            acc = tl.dot(a, b.T, acc)
        rows = pid_m * BM + tl.arange(0, BM)
        cols = pid_n * BN + tl.arange(0, BN)
        row_ok = rows < n_rows
        x = tl.where((cols < vocab)[None, :], acc * inv_t, float("-inf"))
        m = tl.max(x, axis=1)
        e = tl.exp(x - m[:, None])
        out = rows.to(tl.int64) * n_vtiles + pid_n
        tl.store(pm_ptr + out, m, mask=row_ok)
        tl.store(ps_ptr + out, tl.sum(e, axis=1), mask=row_ok)
        tl.store(pa_ptr + out, tl.sum(tl.where(e > 0.0, e * (x - m[:, None]), 0.0), axis=1), mask=row_ok)
        labels = tl.load(labels_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
        hit = labels[:, None] == cols[None, :]
        has = tl.max(hit.to(tl.int32), axis=1) > 0
        tl.store(zy_ptr + rows, tl.sum(tl.where(hit, x, 0.0), axis=1), mask=row_ok & has)


def fwd_tma(h, w, y, cfg, sms):
    bm, bn, bk, group_m, warps, stages, flatten, mult = cfg
    n, d = h.shape
    v = w.shape[0]
    n_vtiles = triton.cdiv(v, bn)
    pm = torch.empty(n * n_vtiles, device=h.device, dtype=torch.float32)
    ps, pa = torch.empty_like(pm), torch.empty_like(pm)
    zy = torch.zeros(n, device=h.device, dtype=torch.float32)
    h_desc = TensorDescriptor.from_tensor(h, [bm, bk])
    w_desc = TensorDescriptor.from_tensor(w, [bn, bk])
    progs = min(sms * mult, triton.cdiv(n, bm) * n_vtiles)
    _stats_tma_kernel[(progs,)](
        h_desc, w_desc, y, pm, ps, pa, zy, n, v, d, n_vtiles, 1.0, BM=bm, BN=bn, BK=bk, GROUP_M=group_m,
        NUM_SMS=progs, FLATTEN=flatten, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    m_t, s_t, a_t = (t.view(n, n_vtiles) for t in (pm, ps, pa))
    big_m = m_t.amax(dim=1, keepdim=True)
    scale = torch.exp(m_t - big_m)
    big_s = (s_t * scale).sum(dim=1)
    log_s = torch.log(big_s)
    lse = big_m.squeeze(1) + log_s
    ent = log_s - ((a_t + (m_t - big_m) * s_t) * scale).sum(dim=1) / big_s
    return torch.where(y != -100, zy - lse, 0.0), ent, lse


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    n, d, v = 16384, 4096, 151936
    torch.manual_seed(0)
    h = torch.randn(n, d, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(v, d, device="cuda", dtype=torch.bfloat16) * d**-0.5
    y = torch.randint(0, v, (n,), device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    full = torch.empty(n, v, device="cuda", dtype=torch.bfloat16)
    ref = K.fused_linear_logprob_fwd(h, w, y, 1.0, -100, True)
    cases = {
        "cublas full": lambda: torch.mm(h, w.t(), out=full),
        "op fwd": lambda: K.fused_linear_logprob_fwd(h, w, y, 1.0, -100, True),
    }
    rows = []
    # (BM, BN, BK, GROUP_M, warps, stages, flatten, programs per SM)
    configs = [
        (128, 256, 64, 8, 8, 3, True, 1),
        (128, 256, 64, 8, 8, 4, True, 1),
        (128, 256, 64, 8, 8, 3, False, 1),
        (128, 128, 64, 8, 8, 4, True, 1),
        (128, 128, 64, 8, 4, 4, True, 2),
        (256, 128, 64, 8, 8, 3, True, 1),
        (128, 256, 64, 16, 8, 3, True, 1),
        (64, 256, 64, 8, 4, 4, True, 2),
    ]
    for cfg in configs:
        try:
            got = fwd_tma(h, w, y, cfg, sms)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - a config that does not compile or fit
            print(f"tma {cfg}: {exc!r}"[:400], flush=True)
            continue
        err = [((a - b).norm() / b.norm()).item() for a, b in zip(got, ref)]
        print(json.dumps({"name": f"tma {cfg} agreement lp/ent/lse", "relerr": err}), flush=True)
        cases[f"tma {cfg}"] = lambda cfg=cfg: fwd_tma(h, w, y, cfg, sms)
    times: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for name, fn in cases.items():
            fn()
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            times.setdefault(name, []).append(s.elapsed_time(e))
    for name, ts in times.items():
        row = {"name": name, "median": round(statistics.median(ts), 3), "all": [round(t, 2) for t in ts]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"gpu": torch.cuda.get_device_name(), "triton": triton.__version__, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
