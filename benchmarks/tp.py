"""Benchmark: tensor-parallel PPO step, tilecompile vs DTensor ``parallelize_module`` + Inductor, same model and plan.

Launch one process per GPU of the tensor-parallel group (the world is one TP group):

    torchrun --nproc-per-node 2 benchmarks/tp.py                # TP=2 (then 4, 8: --nproc-per-node 4 / 8)
    torchrun --nproc-per-node 8 benchmarks/tp.py --models llama-8b --seq 8192 --layers 8
    torchrun --nproc-per-node 2 benchmarks/tp.py --tiny         # CPU (gloo), tiny shapes: checks that it runs

Models (random weights from a config, nothing downloaded): ``llama-8b`` (Llama-3-8B shape: hidden 4096, 32 layers,
32 heads / 8 KV heads, intermediate 14336, vocab 128256) and ``qwen2-1.5b`` (hidden 1536, 28 layers, 12 / 2 heads,
intermediate 8960, vocab 151936, tied embeddings). ``--layers`` cuts the depth (same per-layer cost).

Plan (both methods): q/k/v colwise and o rowwise when the head counts (KV too) divide by TP, else attention stays
replicated (Qwen2-1.5B has 2 KV heads: replicated at TP=4/8); gate/up colwise, down rowwise; lm_head vocab-parallel.
- ``tilecompile``: ``tilecompile.parallelize`` + ``torch.compile(backend="tilecompile")``: collectives in the graph,
  tiled MLPs on the local shards, vocab-parallel fused log-prob/entropy (logits never gathered).
- ``dtensor``: ``parallelize_module`` (ColwiseParallel / RowwiseParallel; the lm_head ColwiseParallel with
  Replicate output, i.e. the logits all-gathered, as a PPO loss on DTensor needs) + ``torch.compile`` (Inductor).
  A tied embedding (Qwen2) is replicated under DTensor; tilecompile shards it with the lm_head.

The step: log-prob + entropy PPO loss of the temperature-scaled shifted logits (verl's actor), forward + backward,
no optimizer. Measured: median of ``--reps`` steps after ``--warmup`` (compile included in the warm-up), CUDA events;
tokens/s = batch·seq / step time (per TP group); peak memory = ``max_memory_allocated`` on rank 0 during the timed
steps. Both methods run in the same process one after the other on the same weights and batch; their first losses
are compared. Results go to ``benchmarks/results/tp.csv`` (GPU, torch/triton versions, date).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import gc
import os
import statistics
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

MODELS = {  # hidden, intermediate, layers, heads, kv heads, head_dim, vocab, tied, arch
    "llama-8b": (4096, 14336, 32, 32, 8, 128, 128256, False, "llama"),
    "qwen2-1.5b": (1536, 8960, 28, 12, 2, 128, 151936, True, "qwen2"),
    "tiny-llama": (64, 176, 2, 8, 4, 8, 512, False, "llama"),
    "tiny-qwen2": (64, 176, 2, 4, 2, 16, 512, True, "qwen2"),
}
CSV_FIELDS = [
    "date", "device", "torch", "triton", "model", "layers", "tp", "batch", "seq", "dtype", "method", "attention",
    "ms", "tokens_per_s", "peak_gib", "loss", "loss_reldiff_vs_other", "rewrites", "error",
]  # fmt: skip


def build(name: str, layers: int | None, dtype: torch.dtype, device: torch.device):
    import transformers

    d, i, n, h, kv, hd, v, tied, arch = MODELS[name]
    cls_cfg, cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[arch]
    cfg = cls_cfg(
        hidden_size=d, intermediate_size=i, num_hidden_layers=layers or n, num_attention_heads=h,
        num_key_value_heads=kv, head_dim=hd, vocab_size=v, tie_word_embeddings=tied, max_position_embeddings=131072,
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(cfg)
    return model.to(dtype).train()


def plan_for(name: str, tp: int) -> tuple[dict[str, str], bool]:
    """The sharding plan, and whether attention is sharded (its head counts divide by ``tp``)."""
    _, _, _, h, kv, _, _, _, _ = MODELS[name]
    plan = {
        "model.layers.*.mlp.gate_proj": "colwise",
        "model.layers.*.mlp.up_proj": "colwise",
        "model.layers.*.mlp.down_proj": "rowwise",
        "lm_head": "vocab_colwise",
    }
    attention = h % tp == 0 and kv % tp == 0
    if attention:
        for p in ("q_proj", "k_proj", "v_proj"):
            plan[f"model.layers.*.self_attn.{p}"] = "colwise"
        plan["model.layers.*.self_attn.o_proj"] = "rowwise"
    return plan, attention


class PPOLoss(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids, mask, old_logp, adv):
        logits = self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1]
        logits = logits.float() / 0.9
        logp = torch.gather(F.log_softmax(logits, dim=-1), -1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        entropy = torch.logsumexp(logits, dim=-1) - (F.softmax(logits, dim=-1) * logits).sum(-1)
        response = mask[:, 1:].float()
        ratio = torch.exp(logp - old_logp)
        pg = torch.maximum(-adv[:, None] * ratio, -adv[:, None] * ratio.clamp(0.8, 1.2))
        return ((pg - 0.01 * entropy) * response).sum() / response.sum()


def make_batch(n: int, seq: int, vocab: int, device: torch.device):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (n, seq), generator=g)
    mask = torch.ones(n, seq, dtype=torch.long)
    old_logp = -torch.rand(n, seq - 1, generator=g) * 5
    adv = torch.randn(n, generator=g)
    return [t.to(device) for t in (ids, mask, old_logp, adv)]


def setup_tilecompile(model, plan, inner: str):
    import tilecompile

    tilecompile.reset()
    tilecompile.parallelize(model, plan)
    return torch.compile(PPOLoss(model), backend="tilecompile", options={"inner": inner})


def setup_dtensor(model, plan, device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    styles = {
        "colwise": ColwiseParallel(),
        "rowwise": RowwiseParallel(),
        "vocab_colwise": ColwiseParallel(output_layouts=Replicate()),  # the PPO loss needs whole logits
    }
    parallelize_module(model, mesh, {k: styles[v] for k, v in plan.items()})
    return torch.compile(PPOLoss(model))


def run_method(method, args, name, dtype, device, batch, cuda):
    tp = dist.get_world_size()
    plan, attention = plan_for(name, tp)
    row = {"model": name, "layers": args.layers or MODELS[name][2], "tp": tp, "batch": args.batch,
           "seq": args.seq, "dtype": str(dtype).removeprefix("torch."), "method": method,
           "attention": "sharded" if attention else "replicated"}  # fmt: skip
    try:
        model = build(name, args.layers, dtype, device)
        step = setup_tilecompile(model, plan, args.inner) if method == "tilecompile" else setup_dtensor(
            model, plan, device)  # fmt: skip
        first = None
        for _ in range(args.warmup):
            loss = step(*batch)
            loss.backward()
            first = loss.item() if first is None else first
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(args.reps):
            model.zero_grad(set_to_none=True)
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            loss = step(*batch)
            loss.backward()
            if cuda:
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                times.append((time.perf_counter() - t0) * 1e3)
        ms = statistics.median(times)
        row.update(ms=round(ms, 3), tokens_per_s=round(args.batch * args.seq / (ms / 1e3), 1), loss=first,
                   peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 3) if cuda else "")  # fmt: skip
        if method == "tilecompile":
            import tilecompile

            row["rewrites"] = " ".join(f"{k}={v}" for k, v in tilecompile.report().counts.items())
    except Exception as exc:  # noqa: BLE001 - one failing method must not lose the other's row
        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        if dist.get_rank() == 0:
            traceback.print_exc()
    finally:
        model = step = None  # noqa: F841 - free before the next method
        gc.collect()
        torch._dynamo.reset()
        if cuda:
            torch.cuda.empty_cache()
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="llama-8b,qwen2-1.5b")
    p.add_argument("--methods", default="tilecompile,dtensor")
    p.add_argument("--layers", type=int, default=None, help="cut the depth (default: the model's)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--inner", default="inductor", choices=("inductor", "aot_eager"))
    p.add_argument("--tiny", action="store_true", help="CPU/gloo, tiny models, 16 tokens: checks that it runs")
    p.add_argument("--csv", default=None, help="default: benchmarks/results/tp[_tiny].csv")
    args = p.parse_args(argv)
    if args.tiny:
        args.models, args.seq, args.batch, args.reps, args.warmup = "tiny-llama,tiny-qwen2", 16, 2, 2, 1
    cuda = torch.cuda.is_available() and not args.tiny
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if cuda else torch.float32
    rows = []
    for name in args.models.split(","):
        batch = make_batch(args.batch, args.seq, MODELS[name][6], device)
        got = [run_method(m, args, name, dtype, device, batch, cuda) for m in args.methods.split(",")]
        losses = [r.get("loss") for r in got]
        if len(got) == 2 and None not in losses:
            diff = abs(losses[0] - losses[1]) / max(abs(losses[1]), 1e-12)
            for r in got:
                r["loss_reldiff_vs_other"] = f"{diff:.2e}"
        rows += got
        if rank == 0:
            for r in got:
                print({k: r.get(k) for k in ("model", "tp", "method", "attention", "ms", "tokens_per_s", "peak_gib",
                                             "loss", "error")})  # fmt: skip
    if rank == 0:
        here = os.path.dirname(os.path.abspath(__file__))
        path = args.csv or os.path.join(here, "results", "tp_tiny.csv" if args.tiny else "tp.csv")
        try:
            import triton

            triton_version = triton.__version__
        except ImportError:
            triton_version = ""
        meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "triton": triton_version,
                "device": torch.cuda.get_device_name(device) if cuda else "cpu"}  # fmt: skip
        new = not os.path.exists(path)
        with open(path, "a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
            if new:
                writer.writeheader()
            for r in rows:
                writer.writerow({**meta, **r})
        print(f"wrote {len(rows)} rows to {path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
