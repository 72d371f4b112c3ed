"""Does the installed transformers' MoE step get its experts rewritten, and does it equal eager?

Qwen3-30B-A3B's layer shape (hidden 2048, 32 heads, 4 KV heads, 128 experts of 768, top 8, vocab 151936) cut to
``--layers``, bf16, activation checkpointing on, the GRPO step of benchmarks/e2e.py on ``--tokens`` tokens with a
collator's all-ones attention_mask. Prints the transformers release, the report's counts and the expert rewrites,
the loss against eager's and one timed step of each (single runs, after one warm-up step; no speed claim: issue 42
measures that). Run on the GPU machine:

    PYTHONUNBUFFERED=1 python3 benchmarks/probe_moe_rewrite.py --layers 2 --tokens 8192 --out $OUT/moe_rewrite.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from e2e import grpo_step, inputs, timed_step  # noqa: E402


def build(layers: int, device: torch.device):
    import transformers

    cfg = transformers.Qwen3MoeConfig(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
        num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
        max_position_embeddings=1 << 17, attn_implementation="sdpa", tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = transformers.Qwen3MoeForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    model.gradient_checkpointing_enable({"use_reentrant": False})
    return model.train()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    import transformers

    import tilecompile

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build(args.layers, device)
    ids, adv, old_logp, _, mask, _ = inputs(args.tokens, 151936, 0, device, mask="ones")
    batch = (model, ids, adv, old_logp, None, mask)
    cuda = device.type == "cuda"
    result = dict(transformers=transformers.__version__, torch=torch.__version__, layers=args.layers,
                  tokens=args.tokens, device=torch.cuda.get_device_name() if cuda else "cpu",
                  date=time.strftime("%Y-%m-%d"))  # fmt: skip

    _, _, expected = timed_step(model, grpo_step, batch, cuda)
    _, eager_s, expected = timed_step(model, grpo_step, batch, cuda)
    expected_grad = model.model.layers[0].mlp.experts.gate_up_proj.grad.float().clone()
    compiled = torch.compile(grpo_step, backend="tilecompile")
    start = time.perf_counter()
    _, _, loss = timed_step(model, compiled, batch, cuda)
    result["first_step_s"] = round(time.perf_counter() - start, 1)
    _, step_s, loss = timed_step(model, compiled, batch, cuda)
    grad = model.model.layers[0].mlp.experts.gate_up_proj.grad.float()
    rep = tilecompile.report()
    experts = [r for r in rep.rewrites if r.pass_name == "tiled_mlp" and r.module_path.endswith("experts")]
    result.update(
        counts=rep.counts, failures=[f.reason for f in rep.failures], compile_errors=len(rep.compile_errors),
        expert_rewrites=[f"{r.module_path}: {r.detail}" for r in experts],
        expert_skips=[f"{s.module_path}: {s.reason}" for s in rep.skipped if s.pass_name == "tiled_mlp"],
        loss=float(loss), eager_loss=float(expected), eager_step_s=round(eager_s, 3), step_s=round(step_s, 3),
        expert_grad_rel_err=float((grad - expected_grad).norm() / expected_grad.norm()),
        peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
    )  # fmt: skip
    print(json.dumps(result, indent=1))
    print(rep)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
