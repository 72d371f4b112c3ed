"""The attention pass on a GPU: the op's exactness and speed, and the whole training step it unlocks.

``--check``: ``tilecompile::masked_attention`` (flash varlen path and chunked path) against a float64 reference in
bf16, with eager SDPA's own error under the dense mask beside it, for packed documents and a sliding window.

``--ops``: fwd+bwd time of one attention layer's worth of work (B=1, H=12, Hkv=2, D=128, bf16): SDPA is_causal
(flash), SDPA with a dense boolean mask (what the compiled graph ran before the pass), masked_attention on packed
documents (varlen flash), and the chunked fallback. CUDA-event median of repeats after warm-up.

``--e2e``: one GRPO-style step (per-token log-prob + entropy, clipped ratio) of a Qwen2.5-1.5B-shaped HF Qwen2
(28 layers, V=151936, tied, bf16, random init) with activation checkpointing, per method and length; ``--docs K``
passes ``position_ids`` of K packed documents per row. Prints one JSON row per (method, length).

``--padded``: the padded mask families at the op (B x N, H=12, Hkv=2, D=128, bf16), fwd+bwd: masked_attention with
its plan (made once, as the pass shares it across layers; its own time given apart), against flash attention
on the same real tokens (the valid tokens packed, flash varlen over them: the floor) and SDPA with the dense mask
(what the graph ran without the pass); each case also checked against float64 at every position. Each call is
timed alone on an idle GPU (``*_ms``), and ours and the exact floor also with 20 calls queued back to back
(``*_queued_ms``), as a whole step runs them: there the op's host work (its launches and Python) hides behind the
GPU's unless it is the longer.

usage: python benchmarks/bench_attention.py --check --ops --e2e --padded --methods eager,inductor,tilecompile
       --lengths 16384 [--docs 16] [--layers 28] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).parent))


def _env() -> dict:
    import triton

    return dict(
        gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, date=time.strftime("%F")
    )


def _packed(n: int, docs: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(position_ids [1, n] restarting at 0 per document, doc ids [1, n]) for ``docs`` equal documents."""
    size = n // docs
    doc = torch.clamp(torch.arange(n, device=device) // size, max=docs - 1)
    start = doc * size
    return (torch.arange(n, device=device) - start)[None], doc[None]


def check(device) -> list[dict]:
    from tilecompile.kernels import attention as K

    rows = []
    torch.manual_seed(0)
    b, h, hkv, n, d = 1, 12, 2, 2048, 128
    for case, kw in (("packed 4 docs", dict(docs=4)), ("window 256", dict(window=256)), ("causal", {})):
        q = torch.randn(b, h, n, d, device=device, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(b, hkv, n, d, device=device, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(b, hkv, n, d, device=device, dtype=torch.bfloat16, requires_grad=True)
        pos, doc = _packed(n, kw["docs"], device) if "docs" in kw else (None, None)
        hi = kw["window"] - 1 if "window" in kw else None
        g = torch.randn(b, h, n, d, device=device, dtype=torch.bfloat16)
        ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref = K.reference(*ref_in, pos, doc, None, 0, hi, d**-0.5, [])
        ref_grads = torch.autograd.grad(ref, ref_in, g.double())
        plan = K.varlen_plan(q, k, pos, doc, None, 0, hi)
        out, _ = torch.ops.tilecompile.masked_attention(q, k, v, pos, doc, None, 0, hi, d**-0.5, [])
        grads = torch.autograd.grad(out, (q, k, v), g)
        eager = K.reference(q, k, v, pos, doc, None, 0, hi, d**-0.5, [])
        eager_grads = torch.autograd.grad(eager, (q, k, v), g)

        def err(a, r):
            return ((a.double() - r).norm() / r.norm()).item()

        row = dict(check=case, path="varlen" if plan is not None else "chunked")
        for name, a, e, r in zip(("out", "dq", "dk", "dv"), (out, *grads), (eager, *eager_grads), (ref, *ref_grads)):
            row[f"{name}_err"], row[f"{name}_eager_err"] = err(a, r), err(e, r)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _time(fn, reps: int = 10) -> float:
    """CUDA-event median of ``reps`` calls after 3 warm-up calls (bench_fused_linear_ce's timer, one warm-up of
    its own)."""
    from bench_fused_linear_ce import _time as median_ms

    for _ in range(2):
        fn()
    return median_ms(fn, reps)


def _time_queued(fn, calls: int = 20, reps: int = 3) -> float:
    """Milliseconds a call when ``calls`` calls are queued back to back between two CUDA events (the median of
    ``reps`` such runs, after warm-up): the host runs ahead as it does inside a whole step, so a call's host work
    shows only where it outlasts the call's GPU work. ``_time`` starts each call on an idle GPU instead."""

    def queued() -> None:
        for _ in range(calls):
            fn()

    return _time(queued, reps) / calls


def ops(device, n: int, docs: int) -> list[dict]:
    from tilecompile.kernels import attention as K

    b, h, hkv, d = 1, 12, 2, 128
    q = torch.randn(b, h, n, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, hkv, n, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, hkv, n, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(q)
    pos, doc = _packed(n, docs, device)
    causal_flops = 4 * b * h * n * n * d / 2 * 3.5  # fwd 2 GEMMs + bwd 5 GEMMs over the causal half: 7/2 x fwd

    def run(f):
        def step():
            out = f()
            torch.autograd.grad(out, (q, k, v), g)

        return step

    variants = {
        "sdpa is_causal (flash)": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        f"masked_attention {docs} docs (varlen)": lambda: torch.ops.tilecompile.masked_attention(
            q, k, v, pos, doc, None, 0, None, d**-0.5, []
        )[0],
        f"masked_attention {docs} docs (chunked)": lambda: _chunked(q, k, v, pos, doc, d),
        "sdpa dense bool mask": lambda: F.scaled_dot_product_attention(
            q, k, v, attn_mask=torch.ones(n, n, dtype=torch.bool, device=device).tril(), enable_gqa=True
        ),
    }
    rows = []
    for name, f in variants.items():
        if "chunked" in name and n > 16384:
            continue  # minutes per repeat at this length: the fallback is not what long packed rows take
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        try:
            ms = _time(run(f))
            row = dict(op=name, n=n, ms=ms, peak_extra_gib=(torch.cuda.max_memory_allocated() - base) / 2**30)
            if "is_causal" in name:
                row["tflops"] = causal_flops / ms / 1e9
        except torch.cuda.OutOfMemoryError:
            row = dict(op=name, n=n, ok=False, error="OOM")
        rows.append(row)
        print(json.dumps(row), flush=True)
    del K
    return rows


def _chunked(q, k, v, pos, doc, d):
    from tilecompile.kernels import attention as K

    class F_(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            out, lse = K.chunked_fwd(q, k, v, pos, doc, None, 0, None, d**-0.5)
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, go):
            q, k, v, out, lse = ctx.saved_tensors
            return K.chunked_bwd(go, q, k, v, out, lse, pos, doc, None, 0, None, d**-0.5)

    return F_.apply(q, k, v)


def make_model(layers: int, device):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=layers,
                      num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=1 << 20,
                      rope_theta=1e6, tie_word_embeddings=True, attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def step_fn(model):
    def step(ids, adv, old_lp, position_ids=None):
        kw = {} if position_ids is None else {"position_ids": position_ids}
        logits = model(input_ids=ids, use_cache=False, **kw).logits[:, :-1].float()
        labels = ids[:, 1:]
        logp = F.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        probs = F.softmax(logits, dim=-1)
        ent = torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)
        ratio = torch.exp(logp - old_lp)
        pg = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
        return pg.mean() - 1e-3 * ent.mean()

    return step


class _Done(Exception):
    pass


def e2e(device, methods, lengths, docs, layers, single=False) -> list[dict]:
    rows = []
    for method in methods:
        model = make_model(layers, device)
        step = step_fn(model)
        # dynamic=False: each length compiles on its own (an automatic-dynamic recompile crashes in torch 2.11's
        # backward, issue #13)
        if method == "inductor":
            step = torch.compile(step, dynamic=False)
        elif method == "tilecompile":
            step = torch.compile(step, backend="tilecompile", dynamic=False)
        for n in lengths:
            ids = torch.randint(0, 151936, (1, n), device=device)
            adv = torch.randn(1, n - 1, device=device)
            old = -torch.rand(1, n - 1, device=device) * 5
            pos = _packed(n, docs, device)[0] if docs else None
            row = dict(method=method, n=n, docs=docs, layers=layers, gc=1)
            try:
                for p in model.parameters():
                    p.grad = None
                t0 = time.perf_counter()
                loss = step(ids, adv, old, pos)
                loss.backward()
                torch.cuda.synchronize()
                row["first_s"] = time.perf_counter() - t0
                if single:  # one step (compile included) and its peak: what fits, not how fast
                    peak = torch.cuda.max_memory_allocated() / 2**30
                    row.update(ok=True, peak_total_gib=peak, loss=loss.item())
                    raise _Done
                for p in model.parameters():
                    p.grad = None
                torch.cuda.empty_cache()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                loss = step(ids, adv, old, pos)
                loss.backward()
                torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                grad_norm = torch.stack([p.grad.float().norm() for p in model.parameters() if p.grad is not None])
                peak = (torch.cuda.max_memory_allocated() - base) / 2**30
                row.update(ok=True, tok_s=n / dt, step_s=dt, peak_gib=peak, loss=loss.item(),
                           grad_norm=grad_norm.norm().item())  # fmt: skip
            except _Done:
                pass
            except torch.cuda.OutOfMemoryError:
                row.update(ok=False, error="OOM")
            except Exception as exc:  # a compiler failure is a result too
                row.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")
            if method == "tilecompile":
                import tilecompile

                r = tilecompile.report()
                row["counts"] = r.counts
                row["attention"] = sorted({x.detail for x in r.rewrites if x.pass_name == "attention"})
                row["attention_skipped"] = sorted({s.reason for s in r.skipped if s.pass_name == "attention"})
                row["failures"] = [f"{f.pass_name}: {f.reason[:400]}" for f in r.failures]
                tilecompile.reset()
            print(json.dumps(row), flush=True)
            rows.append(row)
            del ids, adv, old
            torch.cuda.empty_cache()
        del model, step
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    return rows


def _pad_rows(rows: int, n: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    """[rows, n] long padding mask of one family (TRL: a left-padded prompt then a right-padded completion)."""
    m = torch.zeros(rows, n, dtype=torch.long)
    half = n // 2
    for r in range(rows):
        if kind == "ones":
            m[r] = 1
        elif kind == "trl":
            p = int(torch.randint(int(0.3 * half), half + 1, (1,), generator=gen))
            c = int(torch.randint(int(0.3 * half), half + 1, (1,), generator=gen))
            m[r, half - p : half + c] = 1
        else:
            length = int(torch.randint(n // 4, n + 1, (1,), generator=gen))
            m[r, :length] = 1
            if kind == "left":
                m[r] = m[r].flip(0)
    return m


def padded(device, shapes: list[tuple[int, int]], repeats: int = 10) -> list[dict]:
    rows = []
    gen = torch.Generator().manual_seed(0)
    for b, n in shapes:
        for kind in ("ones", "left", "right", "trl", "trl+docs"):
            valid = _pad_rows(b, n, kind.removesuffix("+docs"), gen).to(device)
            doc = (torch.arange(n, device=device) // (n // 4))[None].expand(b, n) if "docs" in kind else None
            row = dict(padded=f"{b}x{n}", kind=kind, **_padded_case(device, valid, doc, repeats))
            print(json.dumps(row), flush=True)
            rows.append(row)
            torch.cuda.empty_cache()
    return rows


def _padded_case(device, valid: torch.Tensor, doc: torch.Tensor | None, repeats: int) -> dict:
    import tilecompile.ops.attention as OA
    from tilecompile.kernels import attention as K

    (b, n), h, hkv, d = valid.shape, 12, 2, 128

    def hf_layout(heads):  # [B, heads, N, D] views of token-major storage, as HF's q, k, v
        return torch.randn(b, n, heads, d, device=device, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()

    q, k, v = hf_layout(h), hf_layout(hkv), hf_layout(hkv)
    g = torch.randn(b, n, h, d, device=device, dtype=torch.bfloat16).transpose(1, 2)
    scale = d**-0.5
    plan_ms = _time(lambda: OA.attention_plan(None, doc, valid, 0, None), repeats)
    plan = OA.attention_plan(None, doc, valid, 0, None)
    before = dict(OA.PATHS)

    def ours(plan=plan):
        out, _ = torch.ops.tilecompile.masked_attention(q, k, v, None, doc, valid, 0, None, scale, plan)
        torch.autograd.grad(out, (q, k, v), g)

    ours()
    path = "flash" if OA.PATHS["flash"] > before["flash"] else "chunked"
    # the same plan with the natural order refused (info[7] = 0): the packed order, its row gathers included
    sorted_plan = list(plan)
    sorted_plan[5] = plan[5].clone()
    sorted_plan[5][7] = 0
    natural = bool(plan[5][7]) and not bool(plan[5][6])
    # the floor: flash varlen over the real tokens alone, packed once outside the timing
    pk = K.packed(plan, b, n)
    t1 = pk["t1"] if pk else int(valid.sum())
    order = pk["order"] if pk else None
    qf, kf, vf, gf = (K._pack(t.detach(), order)[:t1].contiguous() for t in (q, k, v, g))
    cu, mx = (pk["cu1"], pk["max1"]) if pk else (None, None)

    def floor():
        out, lse = K.flash_fwd(qf, kf, vf, cu, cu, mx, mx, True, -1, 0, scale)
        K.flash_bwd(gf, qf, kf, vf, out, lse, cu, cu, mx, mx, True, -1, 0, scale)

    # the exact floor: also the right-pad rows' own attention (each over its row's real keys), pre-packed
    t2 = pk["t2"] if pk and pk["cu2"] is not None else 0
    if t2:
        q2, g2 = (K._pack(t.detach(), order)[t1 : t1 + t2].contiguous() for t in (q, g))
        cu2 = pk["cu2"] - t1

    def floor_exact():
        floor()
        if t2:
            out, lse = K.flash_fwd(q2, kf, vf, cu2, cu, pk["max2"], mx, False, -1, -1, scale)
            K.flash_bwd(g2, q2, kf, vf, out, lse, cu2, cu, pk["max2"], mx, False, -1, -1, scale)

    mask = K.block_mask(torch.arange(n, device=device), n, None, doc, valid, 0, None)

    def dense():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        torch.autograd.grad(out, (q, k, v), g)

    row = dict(real=round(t1 / (b * n), 3), path=path, natural=natural, plan_ms=plan_ms,
               ours_ms=_time(ours, repeats), packed_order_ms=_time(lambda: ours(sorted_plan), repeats),
               floor_ms=_time(floor, repeats) if pk else None, dense_ms=_time(dense, repeats),
               floor_exact_ms=_time(floor_exact, repeats) if pk else None, ours_queued_ms=_time_queued(ours),
               floor_exact_queued_ms=_time_queued(floor_exact) if pk else None)  # fmt: skip
    with torch.no_grad():
        ref = K.reference(*(t.detach().double() for t in (q, k, v)), None, doc, valid, 0, None, scale)
        out, _ = torch.ops.tilecompile.masked_attention(q, k, v, None, doc, valid, 0, None, scale, plan)
        eager = K.reference(q, k, v, None, doc, valid, 0, None, scale)
        row["err"] = (out.double() - ref).abs().max().item()
        row["eager_err"] = (eager.double() - ref).abs().max().item()
    if row["floor_ms"]:
        row["x_floor"] = round(row["ours_ms"] / row["floor_ms"], 3)
        row["x_floor_exact"] = round(row["ours_ms"] / row["floor_exact_ms"], 3)
        row["x_floor_exact_queued"] = round(row["ours_queued_ms"] / row["floor_exact_queued_ms"], 3)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--padded", default="", help="op-level padded cases, e.g. 8x4096,2x16384")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--ops", action="store_true")
    ap.add_argument("--ops-n", type=int, default=65536)
    ap.add_argument("--e2e", action="store_true")
    ap.add_argument("--methods", default="eager,inductor,tilecompile")
    ap.add_argument("--lengths", default="16384")
    ap.add_argument("--docs", type=int, default=0)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--single", action="store_true", help="one step per length: compile + step time and peak")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    import tilecompile.ops.attention  # noqa: F401

    device = torch.device("cuda")
    out = dict(env=_env(), rows=[])
    print(json.dumps(out["env"]), flush=True)
    if a.check:
        out["rows"] += check(device)
    if a.ops:
        out["rows"] += ops(device, a.ops_n, max(a.docs, 16))
    if a.padded:
        shapes = [tuple(int(x) for x in s.split("x")) for s in a.padded.split(",")]
        out["rows"] += padded(device, shapes)
    if a.e2e:
        lengths = [int(x) for x in a.lengths.split(",")]
        out["rows"] += e2e(device, a.methods.split(","), lengths, a.docs, a.layers, a.single)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
