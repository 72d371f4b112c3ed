"""Long-context SFT of a Hugging Face Qwen2 model on packed documents, with the model's own loss (``labels=``).

    python examples/sft_long_context.py                            # CPU: a tiny Qwen2, compared with eager
    python examples/sft_long_context.py --size 1.5b --seq 65536 --device cuda --packed 16   # Qwen2.5-1.5B, bf16

The model is built from a config (random weights, nothing downloaded). Each row packs ``--packed K`` documents of
uneven lengths; ``position_ids`` restart at 0 at each document, so attention stays inside it. The first quarter of
each document is its prompt: its labels are -100, as are the document starts (no token predicts the next
document's first). Hugging Face computes the cross-entropy inside ``forward`` (shifted labels, ``ignore_index``,
mean); the whole step is compiled with backend="tilecompile", which turns the lm_head + that cross-entropy into one
fused op (no [N, V] logits), the packed-document mask into masked attention (no [N, N] mask) and tiles the MLPs.
"""

from __future__ import annotations

import argparse
import copy
import resource
import time

import torch

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
        vocab_size=v, tie_word_embeddings=True, max_position_embeddings=1 << 20, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.Qwen2ForCausalLM(cfg).to(dtype)
    if checkpointing:  # transformers 5 renamed gradient checkpointing to activation checkpointing
        enable = getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)
        enable({"use_reentrant": False})
    return model.train()


def packed_batch(batch: int, seq: int, packed: int, vocab: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Token ids, position_ids restarting per document, and labels (-100 on prompts and document starts)."""
    g = torch.Generator().manual_seed(1)
    docs = max(packed, 1)
    cuts = torch.randperm(seq - 1, generator=g)[: docs - 1].sort().values + 1  # uneven document lengths
    lengths = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([seq])]))
    positions = torch.cat([torch.arange(n) for n in lengths.tolist()]).expand(batch, seq).contiguous()
    prompt = torch.repeat_interleave(lengths // 4, lengths)  # each token's document's prompt length
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    labels = ids.masked_fill(positions < prompt, -100)  # HF shifts: labels[t] is the target of logits[t - 1]
    return {k: t.to(device) for k, t in dict(input_ids=ids, position_ids=positions, labels=labels).items()}


def sft_loss(model, input_ids, position_ids, labels):
    return model(input_ids=input_ids, position_ids=position_ids, labels=labels, use_cache=False).loss


def peak_memory(device: torch.device) -> str:
    if device.type == "cuda":
        return f"peak memory {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB (max_memory_allocated)"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    return f"peak memory not measured on CPU; peak RSS of the process {rss:.2f} GiB (Python, torch and compiler)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--seq", type=int, default=512, help="tokens per row")
    ap.add_argument("--batch", type=int, default=1, help="rows")
    ap.add_argument("--packed", type=int, default=4, help="documents per row (0: one, no position_ids)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default=None, help="default: bf16 on CUDA")
    ap.add_argument("--checkpointing", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--inner", default="inductor", choices=("inductor", "aot_eager", "eager"), help="inner compiler")
    args = ap.parse_args()

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    model = build(args.size, dtype, device, args.checkpointing)
    batch = packed_batch(args.batch, args.seq, args.packed, model.config.vocab_size, device)
    if not args.packed:
        batch["position_ids"] = None  # one document per row: HF's own positions, and flash is_causal

    options = {"inner": args.inner}
    if args.size == "tiny":
        options["mlp_min_tokens"] = 0  # tile even these tiny MLPs (by default MLPs under 2048 tokens are left alone)
    compiled_loss = torch.compile(sft_loss, backend="tilecompile", options=options)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3 if args.size == "tiny" else 1e-5)
    ref = copy.deepcopy(model) if args.size == "tiny" else None  # eager, to compare with (tiny only)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    for step in range(args.steps):
        start = time.perf_counter()
        loss = compiled_loss(model, **batch)
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start  # the first step's includes the compile
        if step == 0 and ref is not None:
            expected = sft_loss(ref, **batch)
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
