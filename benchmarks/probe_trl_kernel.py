"""Probe (GPU): TRL's own CUDA path of selective_log_softmax / entropy_from_logits inside a compiled PPO step.

bench_rl_logprob.py's ``trl`` variant (TRL as installed: its Triton kernel on CUDA) gave a NaN loss at 16k tokens
through tilecompile. This runs a small bf16 Qwen2 step eager, through Inductor, and through tilecompile with each
pass switched off in turn, and prints each loss (and whether it is finite).

usage: python3 benchmarks/probe_trl_kernel.py [--tokens 2048] [--layers 2]
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    import transformers
    from trl.trainer.utils import entropy_from_logits, selective_log_softmax

    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--dump", default="", help="folder for the graphs before / after the passes")
    args = p.parse_args()
    cfg = transformers.Qwen2Config(hidden_size=512, intermediate_size=1024, num_hidden_layers=args.layers,
                                   num_attention_heads=8, num_key_value_heads=2, vocab_size=args.vocab,
                                   max_position_embeddings=args.tokens + 1, attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg).cuda().bfloat16()
    n = args.tokens
    ids = torch.randint(0, args.vocab, (1, n + 1), device="cuda")
    old = -torch.rand(1, n, device="cuda") * 3
    adv = torch.randn(1, device="cuda")

    def step(ids, old, adv):
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
        logits = logits / 0.9
        logp = selective_log_softmax(logits, ids[:, 1:])
        ent = entropy_from_logits(logits)
        ratio = torch.exp(logp - old)
        pg = torch.maximum(-adv[:, None] * ratio, -adv[:, None] * torch.clamp(ratio, 0.8, 1.2))
        return pg.mean() - 0.001 * ent.mean(), logp.detach().float(), ent.detach().float()

    def show(name, fn):
        torch._dynamo.reset()
        try:
            loss, logp, ent = fn(ids, old, adv)
            print(f"{name:40s} loss {loss.item():.6f} finite logp {bool(torch.isfinite(logp).all())} "
                  f"finite entropy {bool(torch.isfinite(ent).all())} logp[:3] {logp[0, :3].tolist()}")  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - a probe prints what failed
            print(f"{name:40s} failed: {type(exc).__name__}: {str(exc)[:200]}")

    show("eager", step)
    show("inductor", torch.compile(step))
    show("aot_eager", torch.compile(step, backend="aot_eager"))
    show("tilecompile", torch.compile(step, backend="tilecompile"))
    for off in ("attention", "fused_linear_ce", "tiled_mlp"):
        show(f"tilecompile, {off}=0", torch.compile(step, backend="tilecompile", options={off: False}))
    show("tilecompile inner=aot_eager", torch.compile(step, backend="tilecompile", options={"inner": "aot_eager"}))
    if args.dump:  # the graphs before and after the passes, with and without the attention pass
        from tilecompile import config
        from tilecompile.pipeline import run_passes

        for attention in (True, False):

            def backend(gm, example_inputs, attention=attention):
                with open(f"{args.dump}/before_attention{int(attention)}.py", "w") as f:
                    f.write(gm.print_readable(print_output=False))
                gm = run_passes(gm, config.load({"attention": attention}), "probe")
                with open(f"{args.dump}/after_attention{int(attention)}.py", "w") as f:
                    f.write(gm.print_readable(print_output=False))
                return gm.forward

            show(f"dump, attention={attention}", torch.compile(step, backend=backend))


if __name__ == "__main__":
    main()
