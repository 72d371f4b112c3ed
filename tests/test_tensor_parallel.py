"""Tensor parallel: ``tilecompile.parallelize`` + ``passes/tensor_parallel.py`` on gloo (CPU), 2 and 4 processes.

Each spawned rank builds the same tiny HF model, runs an unsharded copy eagerly for the reference, then shards the
model, compiles a PPO-style log-prob + entropy loss through the backend and checks: the loss equals the reference,
every gradient equals the reference's (sharded ones against the matching slice), and the compiled forward and
backward graphs hold exactly the expected functional collectives. Several configurations run inside one spawn
(process start and imports cost more than a tiny compile).
"""

from __future__ import annotations

import copy
import os
import socket
import sys
from collections import Counter

import helpers
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tilecompile
from tilecompile import parallel as TP

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTER, VOCAB = 8, 4, 8, 64, 96, 128
RTOL, ATOL = 1e-4, 2e-5
VOCAB_PARALLEL_FUSED = True

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


def tiny(arch: str, layers: int = 2, tied: bool = False) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),  # q_norm / k_norm per head
        "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM),  # q_norm / k_norm over all heads
    }[arch]
    cfg = cfg_cls(
        hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=layers, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, vocab_size=VOCAB, max_position_embeddings=64,
        attn_implementation="sdpa", tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(0)
    return model_cls(cfg).train()


def batch(n: int = 2, seq: int = 8, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, seq), generator=g)
    mask = torch.ones(n, seq, dtype=torch.long)
    mask[0, -2:] = 0
    old_logp = -torch.rand(n, seq - 1, generator=g) * 5
    adv = torch.randn(n, generator=g)
    return ids, mask, old_logp, adv


def ppo_loss(model, ids, mask, old_logp, adv):
    """Log-probs and entropy of temperature-scaled shifted logits; clipped PPO loss minus an entropy bonus."""
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1] / 0.9
    logp = torch.gather(F.log_softmax(logits, dim=-1), -1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    entropy = torch.logsumexp(logits, dim=-1) - (F.softmax(logits, dim=-1) * logits).sum(-1)
    response = mask[:, 1:].float()
    ratio = torch.exp(logp - old_logp)
    pg = torch.maximum(-adv[:, None] * ratio, -adv[:, None] * ratio.clamp(0.8, 1.2))
    return ((pg - 0.01 * entropy) * response).sum() / response.sum()


class PPOLoss(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids, mask, old_logp, adv):
        return ppo_loss(self.model, ids, mask, old_logp, adv)


def sft_loss(model, ids, mask, old_logp, adv):
    """The model's own loss (cross-entropy with ignore_index=-100 on padded labels)."""
    labels = ids.masked_fill(mask == 0, -100)
    return model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss


# ------------------------------------------------------------------------------------- graph capture

_COLLECTIVES = {
    "all_reduce": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
}


def count_collectives(gm: torch.fx.GraphModule) -> Counter:
    """``Counter`` of functional collectives in an AOT graph: all_reduce:sum, all_reduce:max, all_gather, ..."""
    out: Counter = Counter()
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if node.target.namespace != "_c10d_functional":
            continue
        name = _COLLECTIVES.get(node.target._opname)
        if name is None:
            continue
        if name == "all_reduce":
            name += ":" + str(node.args[1])
        out[name] += 1
    return out


class GraphCapture(helpers.GraphCapture):
    """``helpers.GraphCapture`` with the collectives of the kept graphs counted."""

    def counts(self) -> tuple[Counter, Counter]:
        fw, bw = Counter(), Counter()
        for g in self.fw:
            fw += count_collectives(g)
        for g in self.bw:
            bw += count_collectives(g)
        return fw, bw


# ------------------------------------------------------------------------------------------ spawning


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, scenario: str, args: tuple) -> None:
    os.environ["CI"] = "true"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        globals()[scenario](rank, world, *args)
    finally:
        dist.destroy_process_group()


def spawn(world: int, scenario: str, *args) -> None:
    torch.multiprocessing.spawn(_entry, args=(world, _free_port(), scenario, args), nprocs=world, join=True)


# ------------------------------------------------------------------------------------------ checks


def reference(arch: str, tied: bool, data, layers: int = 2, loss_fn=ppo_loss):
    model = tiny(arch, layers, tied)
    full = copy.deepcopy(model)
    loss = loss_fn(full, *data)
    loss.backward()
    return model, full, loss.detach()


def check_grads(model, full, rank: int, world: int) -> None:
    from helpers import assert_close

    ref = dict(full.named_parameters())
    for name, p in model.named_parameters():
        q = ref[name]
        spec = TP.spec_of(p)
        expected = q.grad
        if spec is not None and spec.dim is not None:
            expected = TP._shard(q.grad, spec.dim, rank, world, spec.parts)
        assert p.grad is not None, f"no grad for {name}"
        assert_close(p.grad, expected, rtol=RTOL, atol=ATOL, name=f"rank {rank} grad of {name}")


def run_tp(rank, world, arch, options, tied=False, sp=False, plan=PLAN, loss_fn=ppo_loss, layers=2):
    """One configuration: returns the (forward, backward) collective counts after checking values."""
    from helpers import assert_close, compile_options

    data = batch()
    model, full, expected = reference(arch, tied, data, layers, loss_fn=loss_fn)
    tilecompile.parallelize(model, plan, sequence_parallel=sp)
    torch._dynamo.reset()
    tilecompile.reset()
    with GraphCapture() as cap:
        loss = torch.compile(loss_fn, backend="tilecompile", options=compile_options(**options))(model, *data)
        loss.backward()
    assert_close(loss, expected, rtol=RTOL, atol=ATOL, name=f"rank {rank} loss")
    check_grads(model, full, rank, world)
    return cap.counts(), tilecompile.report()


def expected_counts(layers: int, fused: bool, tied: bool = False, qk_norm: bool = False) -> tuple[Counter, Counter]:
    """Plain TP: per attention block and per MLP one all_reduce forward (rowwise) and one backward (the colwise
    input); the lm_head's input one backward; its statistics (fused: max then sum) or its gathered logits.
    Qwen3: the grads of q_norm and k_norm (replicated weights over sharded heads) are all-reduced backward."""
    fw = Counter({"all_reduce:sum": 2 * layers})
    bw = Counter({"all_reduce:sum": 2 * layers + 1 + (2 * layers if qk_norm else 0)})
    if fused:
        fw += Counter({"all_reduce:max": 1, "all_reduce:sum": 1})
    else:
        fw += Counter({"all_gather": 1})
    if tied:  # the vocab-parallel embedding's lookup
        fw += Counter({"all_reduce:sum": 1})
    return fw, bw


def check_plain(rank, world, arch, options, loss_fn=ppo_loss, layers=2):
    (fw, bw), rep = run_tp(rank, world, arch, options, loss_fn=loss_fn, layers=layers)
    fused = options.get("fused_linear_ce", 1) == 1 and VOCAB_PARALLEL_FUSED
    want_fw, want_bw = expected_counts(layers, fused)
    assert (fw, bw) == (want_fw, want_bw), f"{arch} {options}: fw {dict(fw)} bw {dict(bw)}\n{rep}"
    regions = {r.module_path: r.detail for r in rep.rewrites if r.pass_name == "tensor_parallel"}
    blocks = [f"model.layers.{i}.{m}" for i in range(layers) for m in ("mlp", "self_attn")]
    assert sorted(regions) == ["lm_head", *blocks], regions
    assert "gate_proj:colwise, up_proj:colwise, down_proj:rowwise" in regions["model.layers.0.mlp"], regions
    assert "forward: all_reduce(down_proj); backward: all_reduce(gate_proj)" in regions["model.layers.0.mlp"]
    assert "q_proj:colwise, k_proj:colwise, v_proj:colwise, o_proj:rowwise" in regions["model.layers.0.self_attn"]
    assert rep.counts["tiled_mlp"] == (0 if options.get("tiled_mlp", 1) == 0 else layers), rep
    assert rep.counts.get("attention", 0) == (0 if options.get("attention", 1) == 0 else layers), rep
    assert rep.counts["fused_linear_ce"] == (1 if fused else 0), rep


def expected_sp_counts(layers: int, fused: bool, tied: bool = False, qk_norm: bool = False) -> tuple[Counter, Counter]:
    """Sequence parallel: each block's colwise input is all-gathered along the sequence (reduce-scattered
    backward) and its rowwise output reduce-scattered (all-gathered backward); the embedding's output is sliced
    (all-gathered backward); the lm_head's input is all-gathered. All-reduces: the lm_head statistics forward,
    and backward the gradient of each RMSNorm weight (2 per layer and the final norm), which each rank's tokens
    give only in part."""
    fw = Counter({"all_gather": 2 * layers + 1, "reduce_scatter": 2 * layers})
    bw = Counter({"reduce_scatter": 2 * layers + 1, "all_gather": 2 * layers + 1, "all_reduce:sum": 2 * layers + 1})
    fw += Counter({"all_reduce:max": 1, "all_reduce:sum": 1}) if fused else Counter({"all_gather": 1})
    if tied:  # the vocab-parallel lookup is reduce-scattered into the sequence shards (instead of being sliced:
        fw += Counter({"reduce_scatter": 1})  # its backward all-gather replaces the slice's)
    if qk_norm:
        bw += Counter({"all_reduce:sum": 2 * layers})
    return fw, bw


def check_sp(rank, world, arch, options, loss_fn=ppo_loss, layers=2, tied=False):
    (fw, bw), rep = run_tp(rank, world, arch, options, sp=True, loss_fn=loss_fn, layers=layers, tied=tied)
    fused = options.get("fused_linear_ce", 1) == 1
    want = expected_sp_counts(layers, fused, tied, qk_norm=arch == "qwen3")
    assert (fw, bw) == want, f"SP {arch} {options}: fw {dict(fw)} bw {dict(bw)}\n{rep}"
    regions = {r.module_path: r.detail for r in rep.rewrites if r.pass_name == "tensor_parallel"}
    assert "forward: all_gather(gate_proj), reduce_scatter(down_proj)" in regions["model.layers.0.mlp"], regions
    assert rep.counts["fused_linear_ce"] == (1 if fused else 0), rep


def check_tied(rank, world):
    """Qwen3 with tied embeddings: the input embedding looks up its vocabulary rows and all-reduces (forward);
    q_norm / k_norm weights act on sharded heads, so their grads are all-reduced."""
    (fw, bw), rep = run_tp(rank, world, "qwen3", {}, tied=True, layers=1)
    assert (fw, bw) == expected_counts(1, fused=True, tied=True, qk_norm=True), (fw, bw)
    regions = {r.module_path: r.detail for r in rep.rewrites if r.pass_name == "tensor_parallel"}
    assert "embed_tokens:vocab_embedding; forward: all_reduce(embed_tokens)" in regions["model.embed_tokens"], regions


def check_checkpointing(rank, world, sp=False):
    """Activation checkpointing: the collectives go into the checkpoint bodies; the recomputed forward repeats each
    block's forward collectives in the backward (plain: one all-reduce per block; SP: its all-gather and its
    reduce-scatter)."""
    from helpers import assert_close, compile_options

    data = batch()
    model = tiny("llama", layers=1)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    full = copy.deepcopy(model)
    expected = ppo_loss(full, *data)
    expected.backward()
    tilecompile.parallelize(model, PLAN, sequence_parallel=sp)
    torch._dynamo.reset()
    tilecompile.reset()
    with GraphCapture() as cap:
        loss = torch.compile(ppo_loss, backend="tilecompile", options=compile_options())(model, *data)
        loss.backward()
    assert_close(loss, expected, rtol=RTOL, atol=ATOL, name=f"rank {rank} loss")
    check_grads(model, full, rank, world)
    if sp:
        fw, bw = expected_sp_counts(1, fused=True)
        bw += Counter({"all_gather": 2, "reduce_scatter": 2})
    else:
        fw, bw = expected_counts(1, fused=True)
        bw += Counter({"all_reduce:sum": 2})
    assert cap.counts() == (fw, bw), cap.counts()
    assert tilecompile.report().counts["tiled_mlp"] == 1, tilecompile.report()


def check_packed(rank, world):
    """Phi-3's fused gate_up_proj as packed_colwise (each half split on its own; its attention stays replicated):
    the tiled MLP pass tiles the local gate_up shard."""
    from helpers import assert_close, compile_options

    transformers = pytest.importorskip("transformers")
    cfg = transformers.Phi3Config(
        hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=1, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0,
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(cfg).train()
    data = batch()
    full = copy.deepcopy(model)
    expected = ppo_loss(full, *data)
    expected.backward()
    plan = {"model.layers.*.mlp.gate_up_proj": "packed_colwise", "model.layers.*.mlp.down_proj": "rowwise",
            "lm_head": "vocab_colwise"}  # fmt: skip
    tilecompile.parallelize(model, plan)
    torch._dynamo.reset()
    tilecompile.reset()
    with GraphCapture() as cap:
        loss = torch.compile(ppo_loss, backend="tilecompile", options=compile_options())(model, *data)
        loss.backward()
    assert_close(loss, expected, rtol=RTOL, atol=ATOL, name=f"rank {rank} loss")
    check_grads(model, full, rank, world)
    fw = Counter({"all_reduce:sum": 2, "all_reduce:max": 1})  # down_proj, the lm_head statistics
    assert cap.counts() == (fw, Counter({"all_reduce:sum": 2})), cap.counts()
    rep = tilecompile.report()
    assert rep.counts["tiled_mlp"] == 1 and "fused=gate_up" in rep.rewrites[-1].detail, rep


def check_dynamic(rank, world):
    """dynamic=True: one compile serves two sequence lengths, both equal to the unsharded model."""
    from helpers import assert_close, compile_options

    model = tiny("llama", layers=1)
    full = copy.deepcopy(model)
    tilecompile.parallelize(model, PLAN)
    torch._dynamo.reset()
    tilecompile.reset()
    step = torch.compile(ppo_loss, backend="tilecompile", options=compile_options(), dynamic=True)
    for seq in (8, 12):
        data = batch(seq=seq)
        model.zero_grad()
        full.zero_grad()
        expected = ppo_loss(full, *data)
        expected.backward()
        loss = step(model, *data)
        loss.backward()
        assert_close(loss, expected, rtol=RTOL, atol=ATOL, name=f"rank {rank} loss at {seq} tokens")
        check_grads(model, full, rank, world)
    graphs = tilecompile.report().graphs
    assert graphs <= 2 and tilecompile.report().counts["fused_linear_ce"] == graphs, tilecompile.report()


def check_vocab_parallel_op(rank, world):
    """The vocab-parallel op alone (eager, odd sizes, ignored rows, temperature): log-prob, entropy and the grads of
    h (summed across ranks) and of this rank's weight rows equal the unfused formula on the whole vocabulary."""
    from helpers import assert_close

    from tilecompile.kernels.fused_linear_ce import reference_logprob_entropy
    from tilecompile.ops.fused_linear_ce import vocab_parallel_logprob

    g = torch.Generator().manual_seed(3)
    n, d, v = 13, 24, 38 * world
    h = torch.randn(n, d, generator=g, dtype=torch.float64).float()
    w = torch.randn(v, d, generator=g, dtype=torch.float64).float()
    labels = torch.randint(0, v, (n,), generator=g)
    labels[[2, 7]] = -100
    glp, gent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp_ref, ent_ref = reference_logprob_entropy(hr, wr, labels, temperature=0.7)
    ((lp_ref * glp).sum() + (ent_ref * gent).sum()).backward()
    rows = v // world
    hl, wl = h.clone().requires_grad_(), w[rank * rows : (rank + 1) * rows].clone().requires_grad_()
    group = dist.group.WORLD.group_name
    lp, ent = vocab_parallel_logprob(hl, wl, labels, 0.7, -100, True, 0, group, world, rank)
    ((lp * glp).sum() + (ent * gent).sum()).backward()
    assert_close(lp, lp_ref, rtol=1e-5, atol=1e-5, name="logp")
    assert_close(ent, ent_ref, rtol=1e-5, atol=1e-5, name="entropy")
    dh = hl.grad.clone()
    dist.all_reduce(dh)  # the op returns this shard's part of dh (copy_to_tp sums it in a compiled graph)
    assert_close(dh, hr.grad, rtol=1e-4, atol=1e-5, name="grad h")
    assert_close(wl.grad, wr.grad[rank * rows : (rank + 1) * rows], rtol=1e-4, atol=1e-5, name="grad W shard")
    bad = labels.clone()
    bad[0] = v  # out of range on every rank
    with pytest.raises(ValueError, match="out of range"):
        vocab_parallel_logprob(h, w[rank * rows : (rank + 1) * rows], bad, 1.0, -100, True, 0, group, world, rank)


class _SoftmaxMix(torch.nn.Module):
    """A softmax over the features a colwise linear shards: no local rule, so the pass all-gathers them first."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(16, 32)
        self.down = torch.nn.Linear(32, 16)

    def forward(self, x):
        return self.down(torch.softmax(self.up(x), dim=-1)).square().mean()


def check_fallback(rank, world):
    from helpers import assert_close, compile_options

    torch.manual_seed(0)
    model = _SoftmaxMix()
    full = copy.deepcopy(model)
    x = torch.randn(3, 5, 16)
    expected = full(x)
    expected.backward()
    tilecompile.parallelize(model, {"up": "colwise", "down": "rowwise"})
    torch._dynamo.reset()
    tilecompile.reset()
    with GraphCapture() as cap:
        loss = torch.compile(model, backend="tilecompile", options=compile_options())(x)
        loss.backward()
    assert_close(loss, expected, rtol=RTOL, atol=ATOL, name="loss")
    check_grads(model, full, rank, world)
    # forward: the gather before the softmax, the rowwise all-reduce; backward: the all-gather of the down input's
    # gradient (its input was replicated, so it was sliced for the rowwise); x needs no grad, so no all-reduce
    assert cap.counts() == (Counter({"all_gather": 1, "all_reduce:sum": 1}), Counter({"all_gather": 1}))
    details = " | ".join(r.detail for r in tilecompile.report().rewrites if r.pass_name == "tensor_parallel")
    assert "softmax along the sharded dim" in details, details


def scenario_two(rank, world):
    """2 ranks: the vocab-parallel op; Llama with every pass and each pass off; Qwen2 (q/k/v biases); HF's own
    loss; sequence parallel; tied embeddings; checkpointing; a packed gate_up; dynamic shapes."""
    check_vocab_parallel_op(rank, world)
    check_fallback(rank, world)
    check_plain(rank, world, "llama", {})
    for off in ("fused_linear_ce", "tiled_mlp", "attention"):  # each pass off in turn (one layer: faster)
        check_plain(rank, world, "llama", {off: 0}, layers=1)
    check_plain(rank, world, "qwen2", {}, layers=1)
    check_plain(rank, world, "llama", {}, loss_fn=sft_loss, layers=1)  # cross-entropy, ignore_index=-100 rows
    check_sp(rank, world, "llama", {}, layers=1)
    check_sp(rank, world, "qwen2", {"fused_linear_ce": 0, "tiled_mlp": 0}, layers=1)
    check_tied(rank, world)
    check_checkpointing(rank, world)
    check_checkpointing(rank, world, sp=True)
    check_packed(rank, world)
    check_dynamic(rank, world)


def check_tp_dp(rank, world):
    """TP=2 inside groups {0,1} and {2,3}, DDP across them ({0,2}, {1,3}), each group on its half of the batch:
    the loss of each half and the averaged gradients equal single-process training on the whole batch."""
    from helpers import assert_close, compile_options
    from torch.nn.parallel import DistributedDataParallel as DDP

    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp, dp = tp_groups[rank // 2], dp_groups[rank % 2]
    tp_rank, half = rank % 2, rank // 2
    ids, mask, old_logp, adv = batch(n=4)
    halves = [tuple(t[2 * h : 2 * h + 2] for t in (ids, mask, old_logp, adv)) for h in (0, 1)]
    model = tiny("llama", layers=1)
    full = copy.deepcopy(model)
    losses = [ppo_loss(full, *hb) for hb in halves]
    ((losses[0] + losses[1]) / 2).backward()
    tilecompile.parallelize(model, PLAN, group=tp)
    # DDP wraps a module that returns the loss, so the loss is in the compiled graph with the lm_head (compiling a
    # function around a DDP module breaks the graph at DDP's forward); DDPOptimizer's graph split is turned off
    ddp = DDP(PPOLoss(model), process_group=dp)
    torch._dynamo.reset()
    tilecompile.reset()
    with GraphCapture() as cap, torch._dynamo.config.patch(optimize_ddp=False):
        loss = torch.compile(ddp, backend="tilecompile", options=compile_options())(*halves[half])
        loss.backward()
    assert_close(loss, losses[half], rtol=RTOL, atol=ATOL, name=f"rank {rank} loss of half {half}")
    check_grads(model, full, tp_rank, 2)
    assert cap.counts() == expected_counts(1, fused=True), (cap.counts(), str(tilecompile.report()))
    assert tilecompile.report().counts["fused_linear_ce"] == 1


def scenario_four(rank, world):
    """4 ranks: plan errors; Llama and Qwen2 with every pass; sequence parallel; TP=2 x DP=2."""
    check_tp_dp(rank, world)
    scenario_errors(rank, world)
    check_plain(rank, world, "llama", {}, layers=1)
    check_sp(rank, world, "qwen3", {}, layers=1, tied=True)


def scenario_errors(rank, world):
    """Plans that cannot be applied on 4 ranks fail with the reason, before touching the model."""
    transformers = pytest.importorskip("transformers")
    small = tiny("llama", layers=1)
    small.model.layers[0].mlp.gate_proj = torch.nn.Linear(HIDDEN, 90, bias=False)
    with pytest.raises(TP.PlanError, match=r"gate_proj.weight \[90, 64\]: dim 0 of size 90 is not divisible by the "
                                           r"tensor-parallel size 4"):  # fmt: skip
        tilecompile.parallelize(small, {"model.layers.0.mlp.gate_proj": "colwise"})
    cfg = transformers.LlamaConfig(hidden_size=48, intermediate_size=64, num_hidden_layers=1, num_attention_heads=6,
                                   num_key_value_heads=2, head_dim=8, vocab_size=VOCAB)  # fmt: skip
    odd = transformers.LlamaForCausalLM(cfg)
    with pytest.raises(TP.PlanError, match=r"k_proj: 2 key/value heads .* do not divide by the tensor-parallel size 4"):
        tilecompile.parallelize(odd, {"model.layers.*.self_attn.k_proj": "colwise"})
    with pytest.raises(TP.PlanError, match=r"q_proj: 6 heads .* do not divide by the tensor-parallel size 4"):
        tilecompile.parallelize(odd, {"model.layers.*.self_attn.q_proj": "colwise"})
    assert all(TP.spec_of(p) is None for p in odd.parameters())
    model = tiny("llama")
    tilecompile.parallelize(model, PLAN)
    assert tuple(model.model.layers[0].self_attn.k_proj.weight.shape) == (KV_HEADS * HEAD_DIM // 4, HIDDEN)
    assert tuple(model.model.layers[0].self_attn.o_proj.weight.shape) == (HIDDEN, HEADS * HEAD_DIM // 4)
    assert tuple(model.lm_head.weight.shape) == (VOCAB // 4, HIDDEN)
    spec = TP.spec_of(model.model.layers[1].mlp.down_proj.weight)
    assert (spec.style, spec.dim, spec.world, spec.rank, spec.global_shape) == ("rowwise", 1, 4, rank, (HIDDEN, INTER))


@pytest.mark.distributed
def test_two_ranks_match_unsharded():
    spawn(2, "scenario_two")


@pytest.mark.distributed
def test_four_ranks_match_unsharded():
    spawn(4, "scenario_four")


# ------------------------------------------------------------------------------------ parallelize errors


@pytest.fixture
def one_process_group():
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_one_rank_group_and_pass_off(one_process_group):
    """A group of one: the lowered graph (collectives over one rank) equals the model; with the pass switched off
    a parallelized model refuses to compile instead of running on shards without collectives."""
    from helpers import assert_close, compile_options

    data = batch()
    model, full, expected = reference("llama", False, data, layers=1)
    tilecompile.parallelize(model, PLAN)
    with GraphCapture() as cap:
        loss = torch.compile(ppo_loss, backend="tilecompile", options=compile_options())(model, *data)
        loss.backward()
    assert_close(loss, expected, rtol=RTOL, atol=ATOL, name="loss")
    check_grads(model, full, 0, 1)
    assert cap.counts() == expected_counts(1, fused=True)
    torch._dynamo.reset()
    off = torch.compile(ppo_loss, backend="tilecompile", options=compile_options(tensor_parallel=0))
    with pytest.raises(Exception, match="tensor_parallel pass is off .* sharded by tilecompile.parallelize"):
        off(model, *data)


def test_plan_errors_name_the_problem(one_process_group):
    model = tiny("llama")
    with pytest.raises(TP.PlanError, match="unknown style.*allowed: colwise, rowwise"):
        tilecompile.parallelize(model, {"lm_head": "columnwise"})
    with pytest.raises(TP.PlanError, match=r"matches no module.*closest names: model\.layers\.\*\.mlp\.gate_proj"):
        tilecompile.parallelize(model, {"model.layers.*.mlp.gate_prj": "colwise"})
    assert TP.info_of(model) is None and all(TP.spec_of(p) is None for p in model.parameters())
    tilecompile.parallelize(model, {"lm_head": "vocab_colwise"})
    with pytest.raises(TP.PlanError, match="already parallelized"):
        tilecompile.parallelize(model, {"lm_head": "vocab_colwise"})


def test_norm_over_sharded_features_is_refused(one_process_group):
    """OLMo-2's q_norm / k_norm span all heads of q_proj / k_proj (RMSNorm(heads * head_dim) before the reshape):
    head sharding is refused in parallelize, naming the projection and the norm, instead of a fake-tensor error in
    Dynamo at compile time. The refusal does not depend on the group size (the plan is wrong for the model on any
    number of ranks), and it leaves the model untouched."""
    transformers = pytest.importorskip("transformers")
    model = tiny("olmo2", layers=1)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj .* model\.layers\.0\.self_attn\.q_norm "
                                         r"\(Olmo2RMSNorm, weight \[64\]\)"):  # fmt: skip
        tilecompile.parallelize(model, PLAN)
    with pytest.raises(TP.PlanError, match=r"self_attn\.k_norm \(Olmo2RMSNorm, weight \[32\]\)"):
        tilecompile.parallelize(model, {"model.layers.*.self_attn.k_proj": "colwise"})
    assert TP.info_of(model) is None and all(TP.spec_of(p) is None for p in model.parameters())
    # a norm over the MLP's intermediate features (BitNet's ffn_sub_norm, between up_proj and down_proj)
    cfg = transformers.BitNetConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=1,
                                    num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=VOCAB,
                                    bos_token_id=0, eos_token_id=1)  # fmt: skip
    bitnet = transformers.BitNetForCausalLM(cfg)
    with pytest.raises(
        TP.PlanError, match=rf"mlp\.gate_proj .*\.mlp\.ffn_sub_norm \(BitNetRMSNorm, weight \[{INTER}\]\)"
    ):
        tilecompile.parallelize(bitnet, {"model.layers.*.mlp.gate_proj": "colwise"})
    # Cohere's per-head norms with a weight per head ([heads, head_dim]): unsharded, they do not fit either
    cfg = transformers.CohereConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=1,
                                    num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=VOCAB,
                                    use_qk_norm=True, bos_token_id=0, eos_token_id=1, pad_token_id=2)  # fmt: skip
    cohere = transformers.CohereForCausalLM(cfg)
    with pytest.raises(
        TP.PlanError, match=rf"self_attn\.k_norm \(CohereLayerNorm, weight \[{KV_HEADS}, {HEAD_DIM}\]\)"
    ):
        tilecompile.parallelize(cohere, {"model.layers.*.self_attn.k_proj": "colwise"})
    # any module with a 1-D weight of the output's size beside the linear counts, whatever its class
    block = torch.nn.Module()
    block.up, block.scale = torch.nn.Linear(8, 16), torch.nn.LayerNorm(16)
    with pytest.raises(TP.PlanError, match=r"up \(matched by 'up', colwise\) .* scale \(LayerNorm, weight \[16\]\)"):
        tilecompile.parallelize(block, {"up": "colwise"})


def test_per_head_and_block_norms_are_accepted(one_process_group):
    """Qwen3's q_norm / k_norm are per head (size head_dim): fine under head sharding (the two- and four-rank
    scenarios compare it with the unsharded model). The decoder layer's own norms sit beside self_attn and mlp,
    not beside the projections: an OLMo-2 plan that shards only the MLP and the lm_head is accepted, compiles and
    matches the unsharded model."""
    from helpers import assert_close, compile_options

    qwen3 = tiny("qwen3", layers=1)
    tilecompile.parallelize(qwen3, PLAN)
    assert TP.spec_of(qwen3.model.layers[0].self_attn.q_proj.weight).style == "colwise"
    assert TP.spec_of(qwen3.model.layers[0].self_attn.q_norm.weight) is None
    data = batch()
    model, full, expected = reference("olmo2", False, data, layers=1)
    plan = {k: v for k, v in PLAN.items() if "self_attn" not in k}
    tilecompile.parallelize(model, plan)
    torch._dynamo.reset()
    loss = torch.compile(ppo_loss, backend="tilecompile", options=compile_options())(model, *data)
    loss.backward()
    assert_close(loss, expected, rtol=RTOL, atol=ATOL, name="loss")
    check_grads(model, full, 0, 1)


@pytest.mark.slow
@pytest.mark.distributed
def test_tp_llama_example_runs_under_torchrun():
    """examples/tp_llama.py on 2 CPU processes: the first loss equals the unsharded model's (--check)."""
    import pathlib
    import subprocess

    root = pathlib.Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TILECOMPILE_")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port())]
    cmd += [str(root / "examples" / "tp_llama.py"), "--inner", "aot_eager", "--check", "--steps", "2", "--seq", "16"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "rank 0: first loss" in out.stdout and "fused_linear_ce=1" in out.stdout, out.stdout
