"""The MoE experts op alone (issue 42): tilecompile::tiled_grouped_mlp against grouped_mm unchunked, same rows.

Shape: Qwen3-30B-A3B's experts (128 experts, D 2048, I 768, top 8, SiLU), bf16, ``--tokens`` tokens routed to
8 experts each (uniform random, no expert twice per token), the rows sorted by expert as HF's grouped_mm experts
sort them; weights in HF's layout (``gate_up_proj`` [E, 2I, D], ``down_proj`` [E, D, I]). One step is forward +
backward (dx and both weight grads) of:
  grouped_mm     F.grouped_mm(x, Wguᵀ) -> silu(g) * u -> F.grouped_mm(h, Wdᵀ), autograd saving its activations
  tiled          the op, grouped path (grouped_mm over token chunks, no host sync), per ``--chunks`` and grad_accum,
                 the weight grads by the grouped_wgrad kernel and the rows by rows_out (``USE_WGRAD_KERNEL``,
                 ``USE_ROWS_KERNEL`` on, whatever their defaults)
  tiled_part     the op at the budget's chunk with each chunk's weight grads from grouped_mm ([E, K, N], all experts)
                 and the carry, the rows by torch.where, as before both kernels
  tiled_loop     the op's per-expert loop path (the one before issue 42: torch.mm per expert and chunk, host syncs)
Median of ``--repeats`` steps (CUDA events, after 2 warm-up steps); TFLOP/s with each method's own FLOPs:
  grouped_mm: 18·S·D·I (forward 6, backward 12),  tiled: 22·S·D·I (+ 4 for the gate/up GEMM recomputed)
and ``model_tflops`` = 18·S·D·I / time for both (the same work counted once). ``peak_extra_gib``: the step's peak
allocation above what was allocated before it (inputs, weights, dy). ``grad_err`` (tiled rows at the acceptance
shape): the largest of the three grads' ``max|g - g_ref| / max|g_ref|`` against grouped_mm's (both bf16). Then
``--memory-tokens``: the same step at those lengths, one timed step each, unchunked against tiled fp32 / param:
where tiling starts to hold less (the break-even the experts pass's ``check_pays`` estimates). Last, a host-sync
check: one tiled step under ``torch.cuda.set_sync_debug_mode("error")``.

Rows go to ``--csv`` (default benchmarks/results/moe_op.csv; appended) as they are measured, with the GPU name,
torch/triton versions, date and commit. One H200 call (about 2 minutes):

    PYTHONUNBUFFERED=1 python3 benchmarks/bench_moe_op.py --csv $OUT/moe_op.csv
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from e2e import profile, versions, write_rows  # noqa: E402

from tilecompile.ops import tiled_grouped_mlp as grouped_op  # noqa: E402

FIELDS = ["method", "tokens", "rows", "chunk", "grad_accum", "ms", "tflops", "model_tflops", "time_vs_grouped_mm",
          "peak_extra_gib", "grad_err", "note", "experts", "hidden", "inter", "top_k", "device", "torch", "triton",
          "date", "commit"]  # fmt: skip
GIB = 2**30


def _grouped_mm(a, b, offs):
    return F.grouped_mm(a, b, offs=offs) if hasattr(F, "grouped_mm") else torch._grouped_mm(a, b, offs)


def routed(tokens: int, experts: int, hidden: int, inter: int, top_k: int, device):
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.rand(tokens, experts, generator=g).topk(top_k, dim=-1).indices.reshape(-1).to(device)
    ids, perm = torch.sort(ids)
    offsets = torch.cumsum(torch.bincount(ids, minlength=experts), 0).to(torch.int32)
    rows = tokens * top_k
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)[perm // top_k].requires_grad_()
    gate_up = (torch.randn(experts, 2 * inter, hidden, device=device) / hidden**0.5).bfloat16().requires_grad_()
    down = (torch.randn(experts, hidden, inter, device=device) / inter**0.5).bfloat16().requires_grad_()
    dy = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16)
    return x, gate_up, down, offsets, dy


def step_grouped_mm(x, gate_up, down, offsets, dy, **_):
    g, u = _grouped_mm(x, gate_up.transpose(-2, -1), offsets).chunk(2, dim=-1)
    y = _grouped_mm(F.silu(g) * u, down.transpose(-2, -1), offsets)
    return torch.autograd.grad(y, (x, gate_up, down), dy)


def step_tiled(x, gate_up, down, offsets, dy, chunk=0, grad_accum="fp32"):
    # the stacked gate_up whole, as the experts pass hands it over: its grad comes back whole, in its layout
    y = grouped_op.tiled_grouped_mlp(
        x, offsets, gate_up.transpose(-2, -1), None, down.transpose(-2, -1), chunk_tokens=chunk, grad_accum=grad_accum
    )
    return torch.autograd.grad(y, (x, gate_up, down), dy)


def measure(fn, args, kw, repeats: int) -> tuple[float, float]:
    """(median ms, peak GiB above what was allocated before the step)."""
    for _ in range(2 if repeats > 1 else 1):
        fn(*args, **kw)
    if not args[0].is_cuda:  # --device cpu: a smoke test of the script, host time, no memory
        start = time.perf_counter()
        fn(*args, **kw)
        return (time.perf_counter() - start) * 1e3, 0.0
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        grads = fn(*args, **kw)
        end.record()
        del grads
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), (torch.cuda.max_memory_allocated() - base) / GIB


@contextlib.contextmanager
def switched(module, **values):
    """Module switches set to ``values``, whatever their defaults; the defaults again after."""
    saved = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def op_kernels(on: bool):
    """grouped_wgrad and rows_out both on (the tiled rows) or both off (tiled_part: the op before them)."""
    return switched(grouped_op, USE_WGRAD_KERNEL=on, USE_ROWS_KERNEL=on)


WGRAD_CONFIGS = [  # (BLOCK_K, BLOCK_N, BLOCK_R, num_warps, num_stages, HALVES, loads through tensor descriptors)
    (128, 256, 64, 8, 3, 1, False),  # the default's
    (128, 256, 64, 8, 3, 2, False),  # the same, the tile's columns in two accumulators (the epilogue's registers)
    (128, 128, 64, 8, 4, 1, False),
    (128, 256, 64, 8, 3, 1, True),
    (128, 256, 64, 8, 3, 2, True),
    (128, 256, 64, 8, 4, 1, True),
    (128, 256, 64, 8, 4, 2, True),
    (128, 256, 32, 8, 4, 1, True),
    (128, 128, 64, 8, 4, 1, True),
    (128, 128, 64, 4, 4, 1, True),
    (256, 128, 64, 8, 3, 1, True),
    (64, 256, 64, 4, 4, 1, True),
    (128, 128, 128, 8, 3, 1, True),
]
_CFG_KEYS = ("BLOCK_K", "BLOCK_N", "BLOCK_R", "num_warps", "num_stages", "HALVES")


def wgrad_sweep(data, inter: int, repeats: int = 10) -> None:
    """One chunk's weight grads at the budget's chunk (the op's second chunk, an expert crossing each edge):
    grouped_wgrad per block config and load (pointers or tensor descriptors), with an fp32 carry and, for each
    load's first config, a bf16 one (``grad_accum="param"``), against grouped_mm's [E, K, N] part alone, for the
    gate's (x, dg: K = D, N = I) and the down's (h, dy: K = I, N = D)."""
    from tilecompile.kernels import tiled_grouped_mlp as kernels

    x, _, _, offsets, dy = data
    n, d = x.shape
    chunk = grouped_op._grouped_chunk(n, inter, x.dtype, 0, 256)
    s, t = chunk, min(2 * chunk, n)
    offs = offsets.to(torch.int32)
    local = (offs - s).clamp(0, t - s)
    experts = offs.shape[0]
    cases = {
        "gate (K=D, N=I)": (x.detach()[s:t], torch.randn(t - s, inter, device=x.device, dtype=x.dtype), d, inter),
        "down (K=I, N=D)": (torch.randn(t - s, inter, device=x.device, dtype=x.dtype), dy[s:t], inter, d),
    }

    for name, (a, b, k, width) in cases.items():
        grad = torch.empty(experts, k, width, device=x.device, dtype=x.dtype)
        flops = 2 * (t - s) * k * width
        ms = measure(torch._grouped_mm, (a.t(), b, local), {}, repeats)[0]
        print(f"-- wgrad {name}, rows {s}:{t}: grouped_mm's part {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s)",
              flush=True)  # fmt: skip
        seen = set()
        for cfg in WGRAD_CONFIGS:
            carries = [torch.float32] + ([torch.bfloat16] if cfg[6] not in seen else [])
            seen.add(cfg[6])
            for carry_dtype in carries:
                carry = torch.empty(2, k, width, device=x.device, dtype=carry_dtype)
                label = f"{cfg[:6]} {'tma' if cfg[6] else 'pointers'} carry {str(carry_dtype)[6:]}"
                try:
                    with switched(kernels, _WGRAD=dict(zip(_CFG_KEYS, cfg[:6])), USE_TMA=cfg[6]):
                        args = (grad, carry, a, b, offs, s, t, n, 1, False)
                        ms = measure(kernels.grouped_wgrad, args, {}, repeats)[0]
                    print(f"   {label}: {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s)", flush=True)
                except Exception as exc:  # a config past the shared memory of this GPU, or a load it cannot take
                    print(f"   {label}: failed ({type(exc).__name__}: {str(exc)[:120]})", flush=True)


def speed(unit: int, ms: float, base_ms: float, own: int) -> dict:
    """ms, TFLOP/s of ``own``·S·D·I FLOPs, model TFLOP/s (18·S·D·I), time against grouped_mm's."""
    return dict(ms=round(ms, 3), tflops=round(own * unit / ms / 1e9, 1), model_tflops=round(18 * unit / ms / 1e9, 1),
                time_vs_grouped_mm=round(ms / base_ms, 3))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--chunks", default="0,16384,65536,131072,262144", help="tiled chunk rows (0: from the budget)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--memory-tokens", default="4096,8192,16384,32768,65536", help="'' to skip the memory sweep")
    ap.add_argument("--no-loop", action="store_true", help="skip the old per-expert loop path")
    ap.add_argument("--csv", default=str(pathlib.Path(__file__).parent / "results" / "moe_op.csv"))
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of the script (small shapes)")
    ap.add_argument("--profile", action="store_true", help="the GPU kernels of one grouped_mm and one tiled step")
    ap.add_argument("--wgrad-sweep", action="store_true", help="grouped_wgrad's block configs on one chunk, alone")
    ap.add_argument(
        "--wgrad-loads",
        default="both",
        choices=("pointers", "tma", "both"),
        help="the tiled rows' grouped_wgrad loads: pointer loads, tensor descriptors (TMA), or each",
    )
    ap.add_argument("--grid-row", action="store_true", help="the tiled_grid row (grouped_wgrad before f18a449)")
    args = ap.parse_args()
    device = torch.device(args.device)
    meta = dict(experts=args.experts, hidden=args.hidden, inter=args.inter, top_k=args.top_k, **versions(device))
    print(meta, flush=True)
    shape = (args.experts, args.hidden, args.inter, args.top_k)

    def row(**kw) -> None:
        r = dict(meta, **kw)
        write_rows(args.csv, [r], FIELDS, append=True)
        shown = " ".join(f"{k}={r[k]}" for k in FIELDS[:11] if r.get(k) not in (None, ""))
        print(shown + (f"  ({r['note']})" if r.get("note") else ""), flush=True)

    # the acceptance shape: time and TFLOP/s against grouped_mm unchunked
    tokens = args.tokens
    data = routed(tokens, args.experts, args.hidden, args.inter, args.top_k, device)
    rows = data[0].shape[0]
    unit = rows * args.hidden * args.inter  # S·D·I
    base_ms, base_gib = measure(step_grouped_mm, data, {}, args.repeats)
    reference = step_grouped_mm(*data)

    def grad_err(kw: dict, reference: tuple = reference) -> float:
        ours = step_tiled(*data, **kw)
        return round(max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                         for a, b in zip(ours, reference)), 5)  # fmt: skip

    row(
        method="grouped_mm",
        tokens=tokens,
        rows=rows,
        **speed(unit, base_ms, base_ms, 18),
        peak_extra_gib=round(base_gib, 3),
    )
    from tilecompile.kernels import tiled_grouped_mlp as kernels

    variants = [(int(c), "fp32") for c in args.chunks.split(",") if c] + [(0, "param")]
    loads = {"pointers": [False], "tma": [True], "both": [False, True]}[args.wgrad_loads]
    for chunk, accum in variants:
        for tma in loads:
            try:
                # the tiled rows: weight grads by grouped_wgrad, rows by rows_out
                with op_kernels(True), switched(kernels, USE_TMA=tma):
                    ms, gib = measure(step_tiled, data, dict(chunk=chunk, grad_accum=accum), args.repeats)
                    err = grad_err(dict(chunk=chunk, grad_accum=accum))
                    ran = kernels.tma_runs(device) and grouped_op.wgrad_kernel_runs(device)
            except Exception as exc:  # the descriptor loads on a Triton or GPU that cannot take them: said, not fatal
                if not tma:
                    raise
                print(f"tiled chunk={chunk} {accum} with tensor descriptors failed: {type(exc).__name__}: "
                      f"{str(exc)[:300]}", flush=True)  # fmt: skip
                continue
            auto = grouped_op._grouped_chunk(rows, args.inter, torch.bfloat16, chunk, 256)
            notes = ["chunk from mlp_chunk_budget_mb=256 (split evenly)" if chunk == 0 else ""]
            notes.append(f"grouped_wgrad loads: {'tensor descriptors' if ran else 'pointers'}")
            row(
                method="tiled",
                tokens=tokens,
                rows=rows,
                chunk=auto,
                grad_accum=accum,
                **speed(unit, ms, base_ms, 22),
                peak_extra_gib=round(gib, 3),
                grad_err=err,
                note="; ".join(n for n in notes if n),
            )
    if device.type == "cuda" and args.grid_row:  # grouped_wgrad before it went persistent: a block an (expert, tile)
        with op_kernels(True), switched(kernels, _programs=lambda _device: 1 << 30):
            ms, gib = measure(step_tiled, data, {}, args.repeats)
            err = grad_err({})
        budget_chunk = grouped_op._grouped_chunk(rows, args.inter, torch.bfloat16, 0, 256)
        row(method="tiled_grid", tokens=tokens, rows=rows, chunk=budget_chunk, grad_accum="fp32",
            **speed(unit, ms, base_ms, 22), peak_extra_gib=round(gib, 3), grad_err=err,
            note="grouped_wgrad with a block for every (expert, tile), as before f18a449")  # fmt: skip
    with op_kernels(False):  # before the kernels: grouped_mm's part and the carry, the rows by torch.where
        ms, gib = measure(step_tiled, data, {}, args.repeats)
        err = grad_err({})
    row(
        method="tiled_part",
        tokens=tokens,
        rows=rows,
        chunk=grouped_op._grouped_chunk(rows, args.inter, torch.bfloat16, 0, 256),
        grad_accum="fp32",
        **speed(unit, ms, base_ms, 22),
        peak_extra_gib=round(gib, 3),
        grad_err=err,
        note="weight grads: grouped_mm's [E, K, N] part per chunk, then the carry; rows by torch.where (no kernels)",
    )
    if args.wgrad_sweep and device.type == "cuda":
        wgrad_sweep(data, args.inter)
    if args.profile and device.type == "cuda":
        profile(step_grouped_mm, data, {}, "grouped_mm")
        with op_kernels(True):  # as the tiled rows
            profile(step_tiled, data, {}, "tiled, the budget's chunk")
            profile(step_tiled, data, dict(chunk=rows), "tiled, one chunk")
    if not args.no_loop:
        grouped_op.USE_GROUPED = False
        try:
            ms, gib = measure(step_tiled, data, {}, 2)
        finally:
            grouped_op.USE_GROUPED = True
        row(
            method="tiled_loop",
            tokens=tokens,
            rows=rows,
            grad_accum="fp32",
            **speed(unit, ms, base_ms, 22),
            peak_extra_gib=round(gib, 3),
            note="before issue 42",
        )
    del data, reference, grad_err
    torch.cuda.empty_cache()

    # memory at other lengths: where tiling starts to hold less than the activations left alone
    for n in [int(t) for t in args.memory_tokens.split(",") if t]:
        data = routed(n, *shape, device)
        rows = data[0].shape[0]
        unit = rows * args.hidden * args.inter
        base_ms, base_gib = measure(step_grouped_mm, data, {}, 3)
        row(
            method="grouped_mm",
            tokens=n,
            rows=rows,
            **speed(unit, base_ms, base_ms, 18),
            peak_extra_gib=round(base_gib, 3),
            note="memory sweep",
        )
        for accum in ("fp32", "param"):
            ms, gib = measure(step_tiled, data, dict(grad_accum=accum), 3)
            chunk = grouped_op._grouped_chunk(rows, args.inter, torch.bfloat16, 0, 256)
            row(
                method="tiled",
                tokens=n,
                rows=rows,
                chunk=chunk,
                grad_accum=accum,
                **speed(unit, ms, base_ms, 22),
                peak_extra_gib=round(gib, 3),
                note="memory sweep",
            )
        del data
        torch.cuda.empty_cache()

    if not device.type == "cuda":
        print(f"wrote {args.csv}")
        return
    # no host sync in the tiled step (warm: Triton compiled, the probes run)
    data = routed(4096, *shape, device)
    step_tiled(*data, chunk=8192)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step_tiled(*data, chunk=8192)
        print("host syncs in a tiled step (3 chunks): none (set_sync_debug_mode('error') raised nothing)", flush=True)
    except RuntimeError as exc:
        print(f"host sync in a tiled step: {exc}", flush=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    print(f"wrote {args.csv}")


if __name__ == "__main__":
    main()
