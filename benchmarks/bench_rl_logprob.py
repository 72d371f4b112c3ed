"""Benchmark: one compiled PPO step whose log-probs and entropy are spelled by verl's formulas or by TRL's functions.

The model: Qwen2.5-1.5B's shape (HF Qwen2: hidden 1536, intermediate 8960, 28 layers, V=151936, tied embeddings;
built by ``benchmarks/e2e.py``'s ``build``), random init, bf16 on CUDA, activation checkpointing on; one row of
``--tokens`` tokens (16k: the anchor). The step: logits[:, :-1] / temperature, per-token log-prob and entropy, PPO's
clipped ratio against old log-probs times the advantage minus an entropy bonus, masked means; then backward (no
optimizer step). Every variant is ``torch.compile(step, backend="tilecompile", dynamic=False)``, in one process:

  verl       ``benchmarks/bench_e2e_logprob.py``'s ``ppo_step``: in-place ``div_``, log_softmax + gather,
             logsumexp − Σ softmax·z
  trl        TRL's GRPO spelling: ``logits /= t``, ``trl.trainer.utils.selective_log_softmax`` and
             ``entropy_from_logits`` as installed. On CUDA, TRL 1.x sends them to its own Triton kernel when its
             checks pass; the fused_linear_ce pass reads those kernel calls as their math and fuses them
             (``passes/lm_head/library_kernels.py``; the report says how many fused calls it made)
  trl-torch  the same functions with TRL's kernel check answered "no", so they run TRL's torch code: a row-by-row
             log_softmax stacked (bf16) and the entropy of 128-row chunks concatenated, which the fused_linear_ce
             pass joins back into one fused call

Per variant: the first step (compile included), then the median of ``--repeats`` steps: tokens/s, step time, and
peak memory (``max_memory_allocated`` over the timed steps, weights and grads included); the tilecompile report's
lm_head rewrites and fused calls, and the loss. Results go to a CSV with the GPU name, torch / triton / transformers
/ TRL versions and the date. The issue's bar: trl and trl-torch within 5% of verl in tokens/s and peak memory.

TRL is optional: without it the trl rows are skipped with a note. On a machine without network, install the wheels
carried with the project: ``python3 -m pip install --no-deps trl-*.whl`` (``trl.trainer.utils`` also imports
``datasets``, which needs ``dill`` and ``multiprocess``: their wheels too where they are missing).

usage: python3 benchmarks/bench_rl_logprob.py [--tokens 16384] [--layers 28] [--repeats 3]
           [--variants verl,trl,trl-torch] [--csv PATH]
       python3 benchmarks/bench_rl_logprob.py --tiny     (CPU, tiny Qwen2, 256 tokens, aot_eager: checks that it runs)
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import importlib.metadata
import pathlib
import re
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from bench_e2e_logprob import masked_mean, ppo_step  # noqa: E402 - verl's spelling of the step
from e2e import build, versions  # noqa: E402 - the 1.5B-shaped model, the machine's versions

VARIANTS = ("verl", "trl", "trl-torch")
TEMPERATURE = 0.9
FIELDS = [
    "date", "device", "torch", "triton", "transformers", "trl", "commit", "variant", "tokens", "layers", "dtype",
    "checkpointing", "ok", "error", "tok_s", "step_s", "first_step_s", "peak_gib", "graphs", "lm_head_rewrites",
    "fused_calls", "loss",
]  # fmt: skip


def trl_step(logits_of, ids, mask, old_logp, advantages, temperature: float):
    """TRL's GRPO trainer's spelling (``_get_per_token_logps_and_entropies``), then verl's PPO loss."""
    from trl.trainer.utils import entropy_from_logits, selective_log_softmax

    logits = logits_of(ids)[:, :-1, :]
    logits /= temperature
    logp = selective_log_softmax(logits, ids[:, 1:])
    entropy = entropy_from_logits(logits)
    ratio = torch.exp(logp - old_logp)
    adv = advantages[:, None]
    pg = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 0.8, 1.2))
    return masked_mean(pg, mask) - 0.001 * masked_mean(entropy, mask)


@contextlib.contextmanager
def trl_torch_code():
    """TRL's own kernel check answers "no": its functions run their torch code."""
    import trl.trainer.utils as utils

    saved = getattr(utils, "_supports_trl_loss_kernel", None)
    if saved is not None:
        utils._supports_trl_loss_kernel = lambda *args, **kwargs: False
    try:
        yield
    finally:
        if saved is not None:
            utils._supports_trl_loss_kernel = saved


def make_inputs(n: int, vocab: int, device: torch.device) -> tuple:
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(0, vocab, (1, n + 1), generator=g)  # the shift leaves n tokens
    mask = (torch.rand(1, n, generator=g) > 0.1).float()
    old_logp = -3 * torch.rand(1, n, generator=g)
    advantages = torch.randn(1, generator=g)
    return tuple(t.to(device) for t in (ids, mask, old_logp, advantages))


def run_variant(variant: str, model, batch, args, device: torch.device) -> dict:
    import tilecompile

    cuda = device.type == "cuda"

    def logits_of(ids):
        return model(input_ids=ids, use_cache=False).logits

    def step(ids, mask, old_logp, advantages):
        if variant == "verl":  # ppo_step(lm_head, h, ...) computes lm_head(h): here the whole model of the ids
            return ppo_step(logits_of, ids, ids, mask, old_logp, advantages, TEMPERATURE)
        return trl_step(logits_of, ids, mask, old_logp, advantages, TEMPERATURE)

    options = {"inner": args.inner, **({"mlp_min_tokens": 0} if args.tiny else {})}
    compiled = torch.compile(step, backend="tilecompile", dynamic=False, options=options)

    def once() -> tuple[float, float]:
        for p in model.parameters():
            p.grad = None
        start = time.perf_counter()
        loss = compiled(*batch)
        loss.backward()
        if cuda:
            torch.cuda.synchronize(device)
        return time.perf_counter() - start, loss.item()

    torch._dynamo.reset()
    tilecompile.reset()
    row = dict(variant=variant, ok=0)
    with trl_torch_code() if variant == "trl-torch" else contextlib.nullcontext():
        try:
            first, _ = once()
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            times, loss = [], 0.0
            for _ in range(args.repeats):
                seconds, loss = once()
                times.append(seconds)
            median = statistics.median(times)
            row.update(ok=1, tok_s=round(args.tokens / median, 1), step_s=round(median, 4),
                       first_step_s=round(first, 2), loss=loss,
                       peak_gib=round(torch.cuda.max_memory_allocated(device) / 2**30, 3) if cuda else "")  # fmt: skip
        except Exception as exc:  # an OOM or a compiler failure is a result too
            oom = isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()
            row.update(error="OOM" if oom else f"{type(exc).__name__}: {str(exc)[:300]}")
    rep = tilecompile.report()
    fused = [r for r in rep.rewrites if r.pass_name == "fused_linear_ce"]
    calls = sum(int(m.group(1)) for r in fused if (m := re.search(r"(\d+) fused call", r.detail)))
    row.update(graphs=rep.graphs, lm_head_rewrites=len(fused), fused_calls=calls)
    if not fused:
        row["error"] = row.get("error") or "; ".join(s.reason[:200] for s in rep.skipped if "lm_head" in s.module_path)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16384, help="tokens in the one row (after the shift)")
    ap.add_argument("--layers", type=int, default=28, help="decoder layers (28: the whole 1.5B)")
    ap.add_argument("--repeats", type=int, default=3, help="timed steps after the first")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated: " + ",".join(VARIANTS))
    ap.add_argument("--inner", default="", help="tilecompile's inner compiler (default inductor; aot_eager --tiny)")
    ap.add_argument("--tiny", action="store_true", help="CPU, tiny Qwen2, 256 tokens, 2 layers: a smoke test")
    ap.add_argument("--csv", default="", help="default: benchmarks/results/rl_logprob.csv (a temp file with --tiny)")
    args = ap.parse_args()
    if args.tiny:
        args.tokens = args.tokens if "--tokens" in sys.argv else 256
        args.layers = args.layers if "--layers" in sys.argv else 2
        args.repeats = args.repeats if "--repeats" in sys.argv else 1
    args.inner = args.inner or ("aot_eager" if args.tiny else "inductor")
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")

    variants = args.variants.split(",")
    try:
        import trl.trainer.utils  # noqa: F401 - it imports datasets (and so dill, multiprocess) too

        trl_version = importlib.metadata.version("trl")
    except ImportError as exc:
        trl_version = ""
        print(f"TRL cannot be imported ({exc}): no trl rows; install the TRL wheel carried with the project "
              "(pip install --no-deps trl-*.whl; datasets, dill and multiprocess too if missing)")  # fmt: skip
        variants = [v for v in variants if not v.startswith("trl")]

    model, _ = build("1.5b", args.tiny, args.layers, True, False, device)
    batch = make_inputs(args.tokens, model.config.vocab_size, device)
    meta = dict(versions(device), trl=trl_version, tokens=args.tokens, layers=model.config.num_hidden_layers,
                dtype=str(model.dtype).removeprefix("torch."), checkpointing=1)  # fmt: skip
    shape = "tiny Qwen2" if args.tiny else "Qwen2 1.5B shape"
    print(f"{meta['device']}: {shape}, {meta['layers']} layers, {meta['dtype']}, {args.tokens} tokens, "
          f"activation checkpointing, torch {meta['torch']}, triton {meta['triton'] or '-'}, TRL {trl_version or '-'}",
          flush=True)  # fmt: skip

    rows = []
    for variant in variants:
        row = dict(meta, **run_variant(variant, model, batch, args, device))
        rows.append(row)
        print(f"{variant:10s} " + (f"{row['tok_s']:>10.1f} tok/s  {row['step_s']:.3f} s/step  peak "
              f"{row['peak_gib'] or '-'} GiB  first step {row['first_step_s']} s" if row["ok"] else "FAILED")
              + f"  | {row['graphs']} graph(s), {row['lm_head_rewrites']} lm_head rewrite(s), {row['fused_calls']} "
              f"fused call(s){'  | ' + row['error'] if row.get('error') else ''}", flush=True)  # fmt: skip
        if device.type == "cuda":
            torch.cuda.empty_cache()

    by = {r["variant"]: r for r in rows if r["ok"]}
    for other in ("trl-torch", "trl"):
        if "verl" in by and other in by:
            speed = by[other]["tok_s"] / by["verl"]["tok_s"]
            memory = by[other]["peak_gib"] / by["verl"]["peak_gib"] if by["verl"]["peak_gib"] else None
            within = abs(speed - 1) <= 0.05 and (memory is None or abs(memory - 1) <= 0.05)
            print(f"{other} / verl: tokens/s x{speed:.3f}" + (f", peak memory x{memory:.3f}" if memory else "")
                  + f" ({'within' if within else 'NOT within'} 5%)")  # fmt: skip

    out = pathlib.Path(args.csv or (pathlib.Path(tempfile.gettempdir()) / "rl_logprob_tiny.csv" if args.tiny else
                                    pathlib.Path(__file__).parent / "results" / "rl_logprob.csv"))  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    new = not out.exists()
    with out.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        if new:
            writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
