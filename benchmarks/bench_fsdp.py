"""FSDP2 at world size 1 against the same step without FSDP2: tokens/s, peak memory, compile time (issue 23).

Model: e2e.py's ``1.5b`` (Qwen2.5-1.5B's shape: 28 layers, hidden 1536, vocab 151936, tied), random init in fp32
(seed 0), activation checkpointing on (HF's non-reentrant ``gradient_checkpointing_enable``). The step: e2e.py's
GRPO-style loss (per-token log-prob and entropy, PPO clipping against old log-probs, entropy bonus), one row of
``--lengths`` tokens (16384 by default) with an all-ones attention_mask (as verl and every collator pass one; ``--mask
''`` passes none: under FSDP2 LossHead then gets HF's [1, 1, N, N] mask built before the layers, an input of each
layer's graph, and the attention stays dense, as the report's skip says), forward and backward, no optimizer
step. Variants, each in its own process
(so that each peak memory is its own):
  tilecompile        no FSDP2: the fp32 init cast to bf16 weights (e2e.py's layout: bf16 weights and grads), and
                     ``torch.compile(step, backend="tilecompile")`` over e2e.py's ``grpo_step``
  tilecompile-fsdp2  verl's / torchtitan's layout: fp32 weights, ``fully_shard`` per decoder layer and the root with
                     ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (bf16 compute, fp32 grads);
                     compiled as README.md's FSDP2 section says: the root is ``tilecompile.LossHead(model, loss)``
                     (the lm_head and the loss in one graph; each layer builds its own causal mask) and
                     ``head.compile(backend="tilecompile")`` (the head and each layer)
  eager-fsdp2        the same FSDP2 model and LossHead, not compiled (HF's own sdpa masks: layer_masks=False)
  tilecompile-autocast  (not run by default) no FSDP2, fp32 weights, the compiled step under bf16 autocast (HF
                     Trainer's mixed precision): the no-FSDP2 step with the FSDP2 variant's weight and grad memory
The bf16 weights of ``tilecompile`` are the FSDP2 variants' fp32 weights rounded to bf16, which is what
``param_dtype=bf16`` computes with, so the first step's losses should agree to bf16 rounding. Peak memory differs
by layout as well as by FSDP2: fp32 weights and grads take 11.5 GiB where bf16 take 5.74.

World size 1: one process, ``init_process_group`` over nccl (cuda) or gloo (cpu), MASTER_ADDR/MASTER_PORT set here.
Per variant: the first step (compilation included), then the median of ``--repeats`` timed steps: tokens/s, peak
memory (``max_memory_allocated`` over the timed steps, weights and grads included), compile seconds (first step
minus the median), the first step's loss, and ``tilecompile.report()``'s counts of attention, fused_linear_ce and
tiled_mlp (FSDP2: one graph serves all 28 layers; each layer it serves counts). ``--budget`` seconds bound the
whole run: a variant that would start with too little time left is skipped, one that runs past the end is killed,
and its row says so. Inductor's caches are off unless ``--warm-cache`` (a cold compile, as in e2e.py).

usage: python benchmarks/bench_fsdp.py [--variants tilecompile,tilecompile-fsdp2,eager-fsdp2] [--lengths 16384]
           [--budget 280] [--out results.csv|results.json]
       python benchmarks/bench_fsdp.py --tiny --device cpu --inner aot_eager      (smoke test, about a minute)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import warnings

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e import MODELS, TINY, grpo_step, inputs, versions, write_rows  # noqa: E402

VARIANTS = ("tilecompile", "tilecompile-fsdp2", "eager-fsdp2", "tilecompile-autocast")
DEFAULT = VARIANTS[:3]
FIELDS = [
    "variant", "fsdp2", "compiled", "weights", "compute", "seq_len", "ok", "error", "tok_s", "step_s", "peak_gib",
    "first_step_s", "compile_s", "loss", "graphs", "attention", "fused_linear_ce", "tiled_mlp", "skipped",
    "failures", "layers", "checkpointing", "tiny", "device", "torch", "triton", "transformers", "date", "commit",
]  # fmt: skip
ROW = "ROW "  # a worker's result lines start with this
MIN_SECONDS = dict.fromkeys(VARIANTS, 60) | {"eager-fsdp2": 25}  # fewer seconds left (cuda): the variant is skipped


def grpo_loss(logits, ids, attention_mask, adv, old_logp):
    """e2e.py's ``grpo_step`` after the model: the loss from the logits (LossHead's ``loss_fn``)."""
    logits = logits[:, :-1].float()
    logp = F.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    entropy = torch.logsumexp(logits, dim=-1) - (F.softmax(logits, dim=-1) * logits).sum(-1)
    ratio = torch.exp(logp - old_logp)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    return pg.mean() - 1e-3 * entropy.mean()


def build_fp32(tiny: bool, layers: int, checkpointing: bool, device: torch.device):
    """e2e.py's 1.5b Qwen2 (or its tiny shape), random init in fp32 with seed 0, activation checkpointing on."""
    import transformers

    _, d, i, n, h, kv, v, tied, theta = MODELS["1.5b"]
    if tiny:
        d, i, n, h, kv, v = TINY
    cfg = transformers.Qwen2Config(
        hidden_size=d, intermediate_size=i, num_hidden_layers=layers or n, num_attention_heads=h,
        num_key_value_heads=kv, vocab_size=v, tie_word_embeddings=tied, rope_theta=theta,
        max_position_embeddings=1 << 20, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.Qwen2ForCausalLM(cfg)
    if checkpointing:
        enable = getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)
        enable({"use_reentrant": False})
    return model.train()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(cfg: dict) -> None:
    """One variant at every length; prints one ``ROW {json}`` line per length."""
    import torch.distributed as dist

    import tilecompile

    device = torch.device(cfg["device"])
    cuda = device.type == "cuda"
    variant = cfg["variant"]
    fsdp2, compiled = variant.endswith("fsdp2"), variant.startswith("tilecompile")
    torch._inductor.config.force_disable_caches = not cfg["warm_cache"]
    warnings.filterwarnings("ignore", "dynamo_pgo force disabled")
    if cuda:
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    # env:// from MASTER_ADDR/PORT (run_worker sets them)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1, **({"device_id": device} if cuda else {}))
    bf16 = cuda or cfg["bf16"]  # bf16 compute on cuda; fp32 on cpu unless --bf16 (CPU bf16 GEMMs are slow)
    model = build_fp32(cfg["tiny"], cfg["layers"], cfg["checkpointing"], device)
    options = {"inner": cfg["inner"], **({"mlp_min_tokens": 0} if cfg["tiny"] else {})}  # tile tiny MLPs too
    if fsdp2:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
        kwargs = {"mp_policy": mp} if mp is not None else {}
        head = tilecompile.LossHead(model, grpo_loss, layer_masks=compiled)
        for layer in model.model.layers:
            fully_shard(layer, **kwargs)
        fully_shard(head, **kwargs)
        if compiled:  # the head and each decoder layer (LossHead.compile: torch 2.11 skips the decoder's loop)
            head.compile(backend="tilecompile", options=options)
        step = head
        weights, compute = "fp32", "bf16 (FSDP2 param_dtype)" if bf16 else "fp32"
        params = head.parameters
    else:
        autocast = variant == "tilecompile-autocast"
        if bf16 and not autocast:
            model.to(torch.bfloat16)
        fn = lambda ids, mask, adv, old: grpo_step(model, ids, adv, old, attention_mask=mask)  # noqa: E731
        step = torch.compile(fn, backend="tilecompile", options=options) if compiled else fn
        weights = compute = "bf16" if bf16 else "fp32"
        if autocast:
            weights, compute, inner = "fp32", "bf16 autocast" if bf16 else "fp32", step

            def step(*batch):
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                    return inner(*batch)

        params = model.parameters
    base = dict(variant=variant, fsdp2=int(fsdp2), compiled=int(compiled), weights=weights, compute=compute,
                layers=model.config.num_hidden_layers, checkpointing=int(cfg["checkpointing"]), tiny=int(cfg["tiny"]),
                **versions(device))  # fmt: skip

    def run(batch) -> tuple[float, float]:
        for p in params():
            p.grad = None
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        loss = step(*batch)
        loss.backward()
        if cuda:
            torch.cuda.synchronize(device)
        return time.perf_counter() - start, loss.item()

    for n in cfg["lengths"]:
        row = dict(base, seq_len=n)
        torch._dynamo.reset()  # one static compile per length
        tilecompile.reset()
        try:
            ids, adv, old_logp, _, mask, _ = inputs(n, model.config.vocab_size, 0, device, 1, cfg["mask"])
            batch = (ids, mask, adv, old_logp)
            first, first_loss = run(batch)
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            times = []
            for _ in range(cfg["repeats"]):
                if times and time.time() > cfg["deadline"]:  # the budget: at least one timed step
                    break
                times.append(run(batch)[0])
            median = statistics.median(times)
            report = tilecompile.report()
            counts = report.counts
            row.update(ok=1, tok_s=round(n / median, 1), step_s=round(median, 4), first_step_s=round(first, 2),
                       compile_s=round(first - median, 2), loss=first_loss, graphs=report.graphs,
                       attention=counts["attention"], fused_linear_ce=counts["fused_linear_ce"],
                       tiled_mlp=counts["tiled_mlp"], skipped=len(report.skipped), failures=len(report.failures),
                       peak_gib=round(torch.cuda.max_memory_allocated(device) / 2**30, 3) if cuda else "")  # fmt: skip
            if cfg["show_report"] and compiled:
                print(report, flush=True)
        except Exception as exc:
            oom = isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()
            row.update(ok=0, error="OOM" if oom else f"{type(exc).__name__}: {str(exc)[:300]}")
        print(ROW + json.dumps(row), flush=True)
        if not row["ok"]:
            break
    dist.destroy_process_group()


def run_worker(cfg: dict, timeout: float) -> list[dict]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    env.update(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0")
    proc = subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(cfg)], stdout=subprocess.PIPE, text=True,
                            env=env)  # fmt: skip
    rows = []
    try:
        stdout, _ = proc.communicate(timeout=timeout)
        error = f"worker exited with {proc.returncode}" if proc.returncode else ""
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, _ = proc.communicate()
        error = f"killed at the budget's end ({timeout:.0f} s)"
    for line in stdout.splitlines():
        if line.startswith(ROW):
            rows.append(json.loads(line[len(ROW) :]))
        else:
            print(line)
    missing = [n for n in cfg["lengths"] if n not in {r["seq_len"] for r in rows}]
    if missing and error:
        rows.append(dict(variant=cfg["variant"], seq_len=missing[0], ok=0, error=error))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--variants", default=",".join(DEFAULT), help="comma-separated, run in this order: " + ",".join(VARIANTS)
    )
    ap.add_argument("--lengths", default="16384", help="tokens (one row), comma-separated")
    ap.add_argument("--repeats", type=int, default=5, help="timed steps after the first (median)")
    ap.add_argument("--budget", type=float, default=280, help="seconds for the whole run")
    ap.add_argument("--layers", type=int, default=0, help="cut the model to this many layers (0: all 28)")
    ap.add_argument("--checkpointing", default="on", choices=("on", "off"), help="activation checkpointing")
    ap.add_argument("--mask", default="ones", choices=("", "ones"), help="ones (default): an all-ones attention_mask")
    ap.add_argument("--inner", default="inductor", choices=("inductor", "aot_eager", "eager"))
    ap.add_argument("--warm-cache", action="store_true", help="let Inductor reuse its caches (default: cold)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--bf16", action="store_true", help="bf16 compute on cpu too (always on cuda)")
    ap.add_argument("--tiny", action="store_true", help=f"e2e.py's tiny shape {TINY}, length 128: a smoke test")
    ap.add_argument("--report", action="store_true", help="print each compiled variant's tilecompile.report()")
    ap.add_argument("--out", default="", help="write the rows: .csv or .json (by the suffix)")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(json.loads(args.worker))

    start = time.time()
    deadline = start + args.budget
    lengths = [128] if args.tiny and "--lengths" not in sys.argv else [int(x) for x in args.lengths.split(",")]
    print(json.dumps(versions(torch.device(args.device))), flush=True)
    rows = []
    for variant in args.variants.split(","):
        if variant not in VARIANTS:
            raise SystemExit(f"unknown variant {variant!r}: one of {', '.join(VARIANTS)}")
        left = deadline - time.time()
        if args.device == "cuda" and left < MIN_SECONDS[variant]:
            rows.append(dict(variant=variant, seq_len=lengths[0], ok=0, error=f"skipped: {left:.0f} s of budget left"))
            print(f"{variant:<20} {rows[-1]['error']}", flush=True)
            continue
        cfg = dict(variant=variant, lengths=lengths, repeats=args.repeats, layers=args.layers, mask=args.mask,
                   checkpointing=args.checkpointing == "on",
                   inner=args.inner, warm_cache=args.warm_cache, device=args.device, bf16=args.bf16, tiny=args.tiny,
                   show_report=args.report, deadline=deadline - 5)  # fmt: skip
        got = run_worker(cfg, timeout=max(left, 1))
        for row in got:
            keys = ("seq_len", "ok", "error", "tok_s", "peak_gib", "first_step_s", "compile_s", "loss", "graphs",
                    "attention", "fused_linear_ce", "tiled_mlp")  # fmt: skip
            print(f"{variant:<20} " + " ".join(f"{k}={row[k]}" for k in keys if row.get(k) not in (None, "")))
        rows += got
    print(f"total {time.time() - start:.0f} s", flush=True)
    if args.out:
        print(f"wrote {write_rows(args.out, rows, FIELDS)}")


if __name__ == "__main__":
    main()
