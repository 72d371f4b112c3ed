"""GRPO training step of a Hugging Face Qwen2 model, compiled whole (model forward + loss) with backend="tilecompile".

    python examples/grpo_step.py                                   # CPU: a tiny Qwen2, compared with eager
    python examples/grpo_step.py --packed 4                        # 4 completions per row (position_ids restart)
    python examples/grpo_step.py --size 1.5b --seq 16384 --device cuda --packed 8   # Qwen2.5-1.5B shape, bf16

The model is built from a config (random weights, nothing downloaded). Each row holds ``--packed K`` completions
of one prompt group (or one completion when K is 0); ``position_ids`` restart at 0 at each completion and the
first quarter of each is its prompt (no loss there). The loss is GRPO's: group-normalised rewards as advantages,
the per-token log-prob ratio against the old policy, clipped, minus an entropy bonus, averaged over the
completion tokens. Old log-probs come from a no-grad call of the same compiled function (the fused lm_head op runs
forward only there). Several ``--steps`` reuse the batch, as GRPO's inner epochs do, so the ratio leaves 1.

tilecompile rewrites the attention mask HF builds (flash ``is_causal``, or masked attention over the packed
completions), the lm_head + log_softmax/gather + entropy (one fused op, no [N, V] logits) and the MLPs (tiled).
"""

from __future__ import annotations

import argparse
import copy
import resource
import time

import torch
import torch.nn.functional as F

import tilecompile

SIZES = {  # Qwen2 shapes: hidden, intermediate, layers, heads, kv heads, vocab (embeddings tied)
    "tiny": (64, 176, 2, 4, 2, 1000),
    "1.5b": (1536, 8960, 28, 12, 2, 151936),
}


def build(size: str, dtype: torch.dtype, device: torch.device, checkpointing: bool) -> torch.nn.Module:
    import transformers

    d, i, n, h, kv, v = SIZES[size]
    cfg = transformers.Qwen2Config(
        hidden_size=d, intermediate_size=i, num_hidden_layers=n, num_attention_heads=h, num_key_value_heads=kv,
        vocab_size=v, tie_word_embeddings=True, max_position_embeddings=131072, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.Qwen2ForCausalLM(cfg).to(dtype)
    if checkpointing:  # transformers 5 renamed gradient checkpointing to activation checkpointing
        enable = getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)
        enable({"use_reentrant": False})
    return model.train()


def rollout(batch: int, seq: int, packed: int, vocab: int, device: torch.device) -> dict[str, torch.Tensor]:
    """A batch as a GRPO trainer hands it over: token ids, positions, completion mask and per-token advantages."""
    g = torch.Generator().manual_seed(1)
    docs = max(packed, 1)
    doc = torch.clamp(torch.arange(seq) // (seq // docs), max=docs - 1)  # which completion each token is in
    start = torch.searchsorted(doc, doc)  # its first token
    positions = (torch.arange(seq) - start).expand(batch, seq)
    prompt = torch.bincount(doc)[doc] // 4  # the first quarter of each completion is its prompt
    rewards = torch.randn(batch, docs, generator=g)
    adv = (rewards - rewards.mean()) / (rewards.std(correction=0) + 1e-4)  # one group: the whole batch
    out = dict(
        ids=torch.randint(0, vocab, (batch, seq), generator=g),
        position_ids=positions.contiguous(),
        mask=(positions >= prompt)[:, 1:].float(),  # targets: completion tokens of the same document
        adv=adv[:, doc][:, 1:].contiguous(),
    )
    return {k: t.to(device) for k, t in out.items()}


def token_logprobs(model, ids, position_ids, temperature: float = 1.0):
    """Per-token log-prob of the next token and the entropy of the policy there, written as RL trainers write it."""
    logits = model(input_ids=ids, position_ids=position_ids, use_cache=False).logits[:, :-1].float() / temperature
    logp = F.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    entropy = torch.logsumexp(logits, dim=-1) - (F.softmax(logits, dim=-1) * logits).sum(-1)
    return logp, entropy


def grpo_loss(model, ids, position_ids, mask, adv, old_logp, clip: float = 0.2, entropy_coef: float = 1e-3):
    logp, entropy = token_logprobs(model, ids, position_ids)
    ratio = torch.exp(logp - old_logp)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip, 1 + clip))
    return ((pg - entropy_coef * entropy) * mask).sum() / mask.sum()


def peak_memory(device: torch.device) -> str:
    if device.type == "cuda":
        return f"peak memory {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB (max_memory_allocated)"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    return f"peak memory not measured on CPU; peak RSS of the process {rss:.2f} GiB (Python, torch and compiler)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--seq", type=int, default=128, help="tokens per row")
    ap.add_argument("--batch", type=int, default=2, help="rows")
    ap.add_argument("--packed", type=int, default=0, help="completions per row (0: one, no position_ids)")
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps on the same batch")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default=None, help="default: bf16 on CUDA")
    ap.add_argument("--checkpointing", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--inner", default="inductor", choices=("inductor", "aot_eager", "eager"), help="inner compiler")
    args = ap.parse_args()

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    model = build(args.size, dtype, device, args.checkpointing)
    batch = rollout(args.batch, args.seq, args.packed, model.config.vocab_size, device)
    if not args.packed:
        batch["position_ids"] = None  # one completion per row: HF's own positions, and flash is_causal

    options = {"inner": args.inner}
    if args.size == "tiny":
        options["mlp_min_tokens"] = 0  # tile even these tiny MLPs (by default MLPs under 2048 tokens are left alone)
    compiled_logprobs = torch.compile(token_logprobs, backend="tilecompile", options=options)
    compiled_loss = torch.compile(grpo_loss, backend="tilecompile", options=options)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3 if args.size == "tiny" else 1e-6)
    ref = copy.deepcopy(model) if args.size == "tiny" else None  # eager, to compare with (tiny only)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    with torch.no_grad():  # the policy that sampled the batch
        old_logp = compiled_logprobs(model, batch["ids"], batch["position_ids"])[0]
    for step in range(args.steps):
        start = time.perf_counter()
        loss = compiled_loss(model, batch["ids"], batch["position_ids"], batch["mask"], batch["adv"], old_logp)
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start  # the first step's includes the compile
        if step == 0 and ref is not None:
            expected = grpo_loss(ref, batch["ids"], batch["position_ids"], batch["mask"], batch["adv"], old_logp)
            expected.backward()
            worst = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
            print(f"loss {loss.item():.6f} (eager {expected.item():.6f}), largest grad difference {worst:.2e}")
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens = args.batch * args.seq
        print(f"step {step}: loss {loss.item():.6f}  fwd+bwd {seconds:.2f} s  {tokens / seconds:,.0f} tokens/s")
    print(peak_memory(device))
    print(tilecompile.report())


if __name__ == "__main__":
    main()
