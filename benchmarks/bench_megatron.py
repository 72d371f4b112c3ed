"""One GRPO-style training step of a Megatron-Core GPTModel (local spec), per method: tokens/s and peak memory.

Model: Qwen2.5-1.5B's shape in mcore's local spec (hidden 1536, ffn 8960 SwiGLU, 28 layers, 12 heads, 2 query groups,
vocab 151936, tied embeddings, RMSNorm, RoPE), bf16 weights, tensor-parallel world size 1, batch 1. The local spec's
attention is mcore's DotProductAttention (baddbmm + softmax over [b, heads, s, s]: memory grows as s²).
The step: logits -> per-token log-prob and entropy -> PPO clipping (``torch.min``) -> masked mean; backward, no
optimizer step. Methods, each in its own process:
  eager        mcore as written
  inductor     torch.compile(step)
  tilecompile  torch.compile(step, backend="tilecompile")
Both compiled methods get ``torch._dynamo.config.ignore_logging_functions.add(warnings.warn)`` (mcore's deprecation
warning in every RowParallelLinear call breaks the graph otherwise). Attention dropout is 0, so mcore's CUDA RNG
tracker fork around it is replaced by a no-op for every method (Dynamo cannot trace the tracker's state swaps).
Per length: the first step's time (compile included) and the graphs compiled, then, after a second step (mcore
allocates its global memory buffer in the first call: Dynamo compiles the step once more), the median of ``--repeats``
steps' tokens/s and ``max_memory_allocated`` (weights and grads included). One JSON line per (method, length).

usage: python benchmarks/bench_megatron.py [--methods eager,inductor,tilecompile] [--lengths 2048,4096,8192]
       python benchmarks/bench_megatron.py --tiny --device cpu --inner aot_eager      (smoke test)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch
import torch.nn.functional as F

SHAPE_1P5B = dict(num_layers=28, hidden_size=1536, num_attention_heads=12, num_query_groups=2, ffn_hidden_size=8960)
SHAPE_TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128)


def _setup(device: str, tmp: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core import tensor_parallel as mcore_tp

    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{tmp}/s", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)

    class NoFork:
        def fork(self, name=None):
            return contextlib.nullcontext()

    mcore_tp.get_cuda_rng_tracker = lambda *a, **k: NoFork()
    # the modules that imported the tracker's getter by name (layers.py's weight init among them) reach the tracker
    # itself: its fork is a no-op too (no state to add on CUDA, nothing for Dynamo to trace)
    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random.get_cuda_rng_tracker().fork = NoFork().fork
    if device == "cpu":  # eager mcore's CUDA-only buffers (examples/megatron_gpt.py says why the order matters)
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
        from megatron_gpt import cpu_shims

        cpu_shims()


def _model(tiny: bool, vocab: int, seq: int, device: str):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(0)
    bf16 = device == "cuda"
    config = TransformerConfig(
        **(SHAPE_TINY if tiny else SHAPE_1P5B), gated_linear_unit=True, activation_func=F.silu,
        normalization="RMSNorm", add_bias_linear=False, bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32, use_cpu_initialization=device == "cpu",
        bias_activation_fusion=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    model = GPTModel(config, spec, vocab_size=vocab, max_sequence_length=seq, position_embedding_type="rope",
                     share_embeddings_and_output_weights=True, rotary_base=1000000)  # fmt: skip
    return model.to(device)


def ppo_step(model, batch):
    logits = model(batch["ids"], batch["pos"], None).float()
    logp = torch.gather(logits.log_softmax(-1), -1, batch["ids"][..., None]).squeeze(-1)
    entropy = torch.logsumexp(logits, -1) - (logits.softmax(-1) * logits).sum(-1)
    ratio = torch.exp(logp - batch["old"])
    adv = batch["adv"][:, None]
    pg = -torch.min(ratio * adv, torch.clamp(ratio, 0.8, 1.28) * adv)
    return ((pg - 0.01 * entropy) * batch["mask"]).sum() / batch["mask"].sum()


def _one(args) -> None:
    """Runs one method at every length in this process; prints a JSON line per length."""
    import tilecompile

    device, vocab = args.device, 1000 if args.tiny else 151936
    with tempfile.TemporaryDirectory() as tmp:
        _setup(device, tmp)
        model = _model(args.tiny, vocab, max(args.lengths), device)
        cfg = torch._dynamo.config  # torch 2.13's name of the set; older releases have ignore_logger_methods
        ignore = "ignore_logging_functions" if hasattr(cfg, "ignore_logging_functions") else "ignore_logger_methods"
        getattr(cfg, ignore).add(warnings.warn)
        for seq in args.lengths:
            torch._dynamo.reset()
            tilecompile.reset()
            if args.method == "eager":
                fn = ppo_step
            elif args.method == "inductor":
                fn = torch.compile(ppo_step)
            else:
                fn = torch.compile(ppo_step, backend="tilecompile", options={"inner": args.inner})
            g = torch.Generator().manual_seed(seq)
            batch = {
                "ids": torch.randint(0, vocab, (1, seq), generator=g),
                "pos": torch.arange(seq)[None],
                "mask": (torch.rand(1, seq, generator=g) > 0.1).float(),
                "old": -torch.rand(1, seq, generator=g) * 3 - 3,
                "adv": torch.randn(1, generator=g),
            }
            batch = {k: v.to(device) for k, v in batch.items()}
            gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
            row = {"method": args.method, "seq": seq, "device": gpu, "torch": torch.__version__, "warn_off": ignore}
            try:
                times = []
                for i in range(args.repeats + 2):
                    if device == "cuda":
                        torch.cuda.synchronize()
                        torch.cuda.reset_peak_memory_stats()
                    t0 = time.perf_counter()
                    ppo = fn(model, batch)
                    ppo.backward()
                    model.zero_grad(set_to_none=True)
                    if device == "cuda":
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
                    if i == 0:
                        row["first_step_s"] = round(times[0], 2)
                        row["loss"] = float(ppo)
                steady = statistics.median(times[2:])
                row["tokens_per_s"] = round(seq / steady)
                if device == "cuda":
                    row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
                if args.method == "tilecompile":
                    rep = tilecompile.report()
                    row["graphs"], row["counts"] = rep.graphs, rep.counts
            except torch.OutOfMemoryError:
                row["oom"] = True
                print(json.dumps(row), flush=True)
                break
            print(json.dumps(row), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", default="eager,inductor,tilecompile")
    p.add_argument("--method", help=argparse.SUPPRESS)
    p.add_argument("--lengths", default="2048,4096,8192", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--inner", default="inductor", help="tilecompile's inner compiler")
    p.add_argument("--tiny", action="store_true", help="a 2-layer, hidden-64 model (smoke test)")
    args = p.parse_args()
    if args.method:
        _one(args)
        # a worker leaves at once: with NCCL's process group alive the interpreter's exit hung until the call's
        # time limit on the H200 (its rows are printed and flushed by then)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    for method in args.methods.split(","):
        cmd = [sys.executable, __file__, "--method", method, "--lengths", ",".join(map(str, args.lengths)),
               "--repeats", str(args.repeats), "--device", args.device, "--inner", args.inner]  # fmt: skip
        out = subprocess.run(cmd + (["--tiny"] if args.tiny else []), capture_output=True, text=True)
        lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
        print("\n".join(lines) if lines else json.dumps({"method": method, "error": out.stderr[-2000:]}), flush=True)


if __name__ == "__main__":
    main()
