"""Tensor-parallel PPO-style training of a Llama with tilecompile: shard with a plan, compile, train.

    torchrun --nproc-per-node 2 examples/tp_llama.py                  # CPU: gloo, a tiny Llama
    torchrun --nproc-per-node 4 examples/tp_llama.py --tp 2           # TP=2 inside groups, DDP across them
    torchrun --nproc-per-node 8 examples/tp_llama.py --size 8b --seq 4096 --sequence-parallel   # GPUs: NCCL, bf16

The model is built from a config (random weights, nothing downloaded). ``tilecompile.parallelize`` shards its
parameters in place; the tilecompile backend puts the collectives in the compiled graph, runs the MLPs tiled on
their local shards and the lm_head's log-prob/entropy vocabulary-parallel (the logits are never gathered).
``--check`` compares the first step's loss with the unsharded model on the same batch (tiny sizes only).
"""

from __future__ import annotations

import argparse
import copy
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import tilecompile

PLAN = {
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "lm_head": "vocab_colwise",
}

SIZES = {  # Llama shapes: hidden, intermediate, layers, heads, kv heads, vocab
    "tiny": (64, 176, 2, 8, 4, 512),
    "1b": (2048, 8192, 16, 32, 8, 128256),
    "8b": (4096, 14336, 32, 32, 8, 128256),
}


def build(size: str, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    import transformers

    d, i, n, h, kv, v = SIZES[size]
    cfg = transformers.LlamaConfig(
        hidden_size=d, intermediate_size=i, num_hidden_layers=n, num_attention_heads=h, num_key_value_heads=kv,
        vocab_size=v, max_position_embeddings=131072, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)  # every rank builds the same weights; parallelize keeps each rank's slice
    with torch.device(device):  # on the GPU the whole model fits before sharding (8B: 32 GB in fp32)
        model = transformers.LlamaForCausalLM(cfg)
    return model.to(dtype).train()


class PPOLoss(torch.nn.Module):
    """The loss inside the module, so that DDP (when used) wraps it and the loss is compiled with the lm_head."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids, mask, old_logp, adv):
        logits = self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1] / 0.9
        logp = torch.gather(F.log_softmax(logits.float(), dim=-1), -1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        entropy = torch.logsumexp(logits.float(), dim=-1) - (F.softmax(logits.float(), dim=-1) * logits).sum(-1)
        response = mask[:, 1:].float()
        ratio = torch.exp(logp - old_logp)
        pg = torch.maximum(-adv[:, None] * ratio, -adv[:, None] * ratio.clamp(0.8, 1.2))
        return ((pg - 0.01 * entropy) * response).sum() / response.sum()


def batch(n: int, seq: int, vocab: int, seed: int, device: torch.device):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, seq), generator=g)
    mask = torch.ones(n, seq, dtype=torch.long)
    old_logp = -torch.rand(n, seq - 1, generator=g) * 5
    adv = torch.randn(n, generator=g)
    return [t.to(device) for t in (ids, mask, old_logp, adv)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=0, help="tensor-parallel size (default: every process)")
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--batch", type=int, default=2, help="sequences per data-parallel group")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--sequence-parallel", action="store_true")
    ap.add_argument("--inner", default="inductor", choices=("inductor", "aot_eager"))
    ap.add_argument("--check", action="store_true", help="first loss against the unsharded model (tiny only)")
    ap.add_argument("--async-tp", action="store_true", help="CUDA + --sequence-parallel: Inductor's micro-pipeline TP")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    tp = args.tp or world
    if world % tp:
        raise SystemExit(f"--tp {tp} does not divide the {world} processes")
    # TP groups are consecutive ranks (one host's GPUs); DP groups take one rank of each TP group
    tp_groups = [dist.new_group(list(range(g * tp, (g + 1) * tp))) for g in range(world // tp)]
    dp_groups = [dist.new_group(list(range(r, world, tp))) for r in range(tp)]
    tp_group, dp_group, dp_rank = tp_groups[rank // tp], dp_groups[rank % tp], rank // tp

    dtype = torch.bfloat16 if cuda else torch.float32
    model = build(args.size, dtype, device)
    vocab = model.config.vocab_size
    data = batch(args.batch, args.seq, vocab, seed=1 + dp_rank, device=device)
    reference = None
    if args.check:
        reference = PPOLoss(copy.deepcopy(model).float())(*batch(args.batch, args.seq, vocab, 1 + dp_rank, device))

    tilecompile.parallelize(model, PLAN, group=tp_group, sequence_parallel=args.sequence_parallel)
    if args.async_tp and cuda:
        # the sequence-parallel all_gather -> matmul and matmul -> reduce_scatter pairs are in the form Inductor's
        # micro-pipeline pass decomposes into overlapped steps (it needs symmetric memory on the TP group)
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group

        enable_symm_mem_for_group(tp_group.group_name)
        torch._inductor.config._micro_pipeline_tp = True
    loss_module = PPOLoss(model)
    if world > tp:
        from torch.nn.parallel import DistributedDataParallel as DDP

        torch._dynamo.config.optimize_ddp = False  # keep the graph whole (the lm_head and the loss together)
        loss_module = DDP(loss_module, process_group=dp_group)
    step = torch.compile(loss_module, backend="tilecompile", options={"inner": args.inner})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    for i in range(args.steps):
        start = time.perf_counter()
        loss = step(*data)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        tokens = args.batch * args.seq * (world // tp)
        if rank == 0:
            print(f"step {i}: loss {loss.item():.6f}  {tokens / seconds:,.0f} tokens/s  ({seconds:.2f} s)")
        if i == 0 and reference is not None and rank % tp == 0:
            diff = abs(loss.item() - reference.item())
            print(f"rank {rank}: first loss {loss.item():.6f}, unsharded {reference.item():.6f}, |diff| {diff:.2e}")
            if diff > 1e-4:
                raise SystemExit("the tensor-parallel loss differs from the unsharded model's")
    if rank == 0:
        print(tilecompile.report())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
