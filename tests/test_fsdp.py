"""FSDP2 (``fully_shard``) as verl and torchtitan wrap a model, on gloo (CPU) ranks.

Per decoder layer and the root (``tilecompile.LossHead``, so that the lm_head and the loss share one graph), 2 ranks,
each on its half of the batch, 3 AdamW steps: the loss, every gradient and the weights equal one process training on
the whole batch (fp32); with bf16 mixed precision (bf16 params, fp32 reduce) the compiled step equals eager FSDP2 at
bf16 tolerance. Every rewrite fires: the fused lm_head (loss-aware), and in every layer the attention (LossHead has
each layer build HF's causal mask from the padding mask, so the pass reads it) and the tiled MLP. The references run
HF's own sdpa masks, so the equality also covers the switch of mask building.
Without LossHead (a whole-step compile of an FSDP2 model) the report names the logits and the mask crossing graphs.

TP inside FSDP2 on torchtitan's 2-D mesh (dp=2 x tp=2, 4 ranks): ``tilecompile.parallelize`` cannot compose with
``fully_shard`` (FSDP2 swaps the parameters for DTensors and the shard records are lost), so both orders are
refused with a clear error before any step runs, never a wrong loss.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tilecompile
from tilecompile import parallel as TP

LAYERS, STEPS = 2, 3
LR, EPS = 1e-2, 1e-5  # eps: see tests/test_ddp.py (a smooth AdamW step, so weights compare to lr / 1000)


def loss_fn(logits, ids, mask, old_logp, adv):
    """The PPO loss of tests/test_tensor_parallel.py on the logits (log-probs and entropy at temperature 0.9)."""
    logits = logits[:, :-1] / 0.9
    logp = torch.gather(F.log_softmax(logits, dim=-1), -1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    entropy = torch.logsumexp(logits, dim=-1) - (F.softmax(logits, dim=-1) * logits).sum(-1)
    response = mask[:, 1:].float()
    ratio = torch.exp(logp - old_logp)
    pg = torch.maximum(-adv[:, None] * ratio, -adv[:, None] * ratio.clamp(0.8, 1.2))
    return ((pg - 0.01 * entropy) * response).sum() / response.sum()


def _halves():
    from test_tensor_parallel import batch

    ids, mask, old_logp, adv = batch(n=4, seq=8)
    mask[2, :3] = 0  # a left-padded row in the second half
    return [tuple(t[2 * h : 2 * h + 2] for t in (ids, mask, old_logp, adv)) for h in (0, 1)]


def _reference(model, halves):
    """One process, the whole batch (the mean of the halves' losses, as FSDP2 averages the gradients)."""
    full = tilecompile.LossHead(copy.deepcopy(model), loss_fn, layer_masks=False)  # HF's own sdpa masks
    opt = torch.optim.AdamW(full.parameters(), lr=LR, eps=EPS)
    out = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = (full(*halves[0]) + full(*halves[1])) / 2
        loss.backward()
        out.append((loss.detach(), _snapshot(full)))
        opt.step()
    return out


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _snapshot(head):
    return {n: (_full(p.detach()).clone(), _full(p.grad).clone()) for n, p in head.named_parameters()}


def _train_fsdp(rank, model, halves, compiled, mp=None):
    from helpers import compile_options
    from torch.distributed.fsdp import fully_shard

    head = tilecompile.LossHead(model, loss_fn, layer_masks=compiled)  # eager: HF's own masks, as the reference
    assert head.layer_masks == compiled
    kwargs = {"mp_policy": mp} if mp is not None else {}
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(head, **kwargs)
    opt = torch.optim.AdamW(head.parameters(), lr=LR, eps=EPS)
    torch._dynamo.reset()
    tilecompile.reset()
    step = head
    if compiled and mp is None:  # the README's layout: the head and each layer (LossHead.compile)
        head.compile(backend="tilecompile", options=compile_options())
    elif compiled:  # a plain torch.compile of the head: the layers' graphs come from Dynamo's graph breaks
        step = torch.compile(head, backend="tilecompile", options=compile_options())
    out = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = step(*halves[rank])
        loss.backward()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        out.append((total / 2, _snapshot(head)))
        opt.step()
    return out, tilecompile.report()


def _compare(rank, got, expected, rtol, atol, param_atol):
    from helpers import assert_close

    for i, ((loss, state), (ref_loss, ref_state)) in enumerate(zip(got, expected)):
        assert_close(loss, ref_loss, rtol=rtol, atol=atol, name=f"rank {rank} step {i} loss")
        for name, (p, g) in state.items():
            ref_p, ref_g = ref_state[name]
            assert_close(g, ref_g, rtol=rtol * 10, atol=atol, name=f"rank {rank} step {i} grad of {name}")
            if param_atol is not None:
                assert_close(p, ref_p, rtol=0, atol=param_atol, name=f"rank {rank} step {i} {name}")


def _check_rewrites(rep):
    """Every rewrite fires, counted per module: the layers' graph (one, serving both layers) holds the attention
    (its mask built there from the padding mask: masked_attention, a row is left-padded) and the tiled MLP."""
    counts = rep.counts
    assert (counts["attention"], counts["fused_linear_ce"], counts["tiled_mlp"]) == (LAYERS, 1, LAYERS), rep
    assert any(r.pass_name == "fused_linear_ce" and "loss-aware" in r.detail for r in rep.rewrites), rep
    attention = [r for r in rep.rewrites if r.pass_name == "attention"]
    assert len(attention) == 1 and rep.modules(attention[0]) == LAYERS, rep  # one graph, two layers
    assert "masked_attention" in attention[0].detail, rep
    assert not rep.skipped and not rep.failures, rep


def check_fsdp_fp32(rank, world):
    """fp32: the compiled FSDP2 step equals one process on the whole batch, 3 AdamW steps."""
    from test_tensor_parallel import tiny

    halves = _halves()
    model = tiny("llama", layers=LAYERS)
    expected = _reference(model, halves)
    got, rep = _train_fsdp(rank, model, halves, compiled=True)
    _check_rewrites(rep)
    _compare(rank, got, expected, rtol=1e-5, atol=1e-6, param_atol=1e-3 * LR)


def check_fsdp_bf16(rank, world):
    """bf16 params, fp32 gradient reduction (verl's and torchtitan's mixed precision): the compiled step equals
    eager FSDP2 with the same policy at bf16 tolerance."""
    from test_tensor_parallel import tiny
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    halves = _halves()
    model = tiny("qwen2", layers=LAYERS)
    eager_model = copy.deepcopy(model)
    expected, _ = _train_fsdp(rank, eager_model, halves, compiled=False, mp=mp)
    got, rep = _train_fsdp(rank, model, halves, compiled=True, mp=mp)
    _check_rewrites(rep)
    # the weights are not compared: AdamW moves a weight whose bf16 gradient is near zero by up to lr either way;
    # the losses and gradients of the later steps are computed on them
    _compare(rank, got, expected, rtol=2e-2, atol=2e-3, param_atol=None)


def scenario_two(rank, world):
    check_fsdp_fp32(rank, world)
    check_fsdp_bf16(rank, world)


def _mesh_2d(world: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))


def check_tp_inside_fsdp_refused(rank, world):
    """parallelize, then fully_shard per layer and root on the dp mesh (torchtitan's order): the first compile
    refuses, naming the lost shards and what to do, before a loss exists. fully_shard, then parallelize: refused
    in parallelize. The model that never met FSDP2 still compiles (the check looks only at graphs over a broken
    model)."""
    from helpers import compile_options
    from test_tensor_parallel import PLAN, PPOLoss, batch, tiny
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh_2d(world)
    data = batch()
    model = tiny("llama", layers=1)
    tilecompile.parallelize(model, PLAN, group=mesh["tp"].get_group())
    assert TP.lost_shards(model) == []
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    root = fully_shard(PPOLoss(model), mesh=mesh["dp"])
    assert TP.lost_shards(model), "fully_shard kept the parameters: the refusal below tests nothing"
    torch._dynamo.reset()
    tilecompile.reset()
    step = torch.compile(root, backend="tilecompile", options=compile_options())
    with pytest.raises(Exception, match=r"tilecompile\.parallelize sharded in LlamaForCausalLM .* replaced by "
                                        r"fully_shard \(FSDP2\) .* does not compose with FSDP2") as err:  # fmt: skip
        step(*data)
    assert "DDP across the tensor-parallel groups" in str(err.value)
    assert tilecompile.report().counts["tensor_parallel"] == 0

    other = tiny("llama", layers=1)
    fully_shard(other, mesh=mesh["dp"])
    with pytest.raises(TP.PlanError, match=r"model\.embed_tokens\.weight is a DTensor: the model was sharded before"):
        tilecompile.parallelize(other, PLAN, group=mesh["tp"].get_group())
    assert TP.info_of(other) is None

    plain = tiny("llama", layers=1)  # unrelated to the broken model: compiles as before
    torch._dynamo.reset()
    loss = torch.compile(PPOLoss(plain), backend="tilecompile", options=compile_options())(*data)
    assert torch.isfinite(loss)


def check_tp_ddp_defaults(rank, world):
    """What to use instead: TP=2 inside {0,1} and {2,3}, DDP across them with Dynamo's default optimize_ddp and
    small buckets (DDP splits the graph; the passes ran first): each half's loss and the averaged gradients equal one
    process on the whole batch, with the tensor-parallel collectives and every rewrite in place."""
    from helpers import assert_close, compile_options
    from test_tensor_parallel import PLAN, PPOLoss, batch, check_grads, ppo_loss, tiny
    from torch.nn.parallel import DistributedDataParallel as DDP

    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp, dp = tp_groups[rank // 2], dp_groups[rank % 2]
    half = rank // 2
    ids, mask, old_logp, adv = batch(n=4)
    halves = [tuple(t[2 * h : 2 * h + 2] for t in (ids, mask, old_logp, adv)) for h in (0, 1)]
    model = tiny("llama", layers=1)
    full = copy.deepcopy(model)
    losses = [ppo_loss(full, *hb) for hb in halves]
    ((losses[0] + losses[1]) / 2).backward()
    tilecompile.parallelize(model, PLAN, group=tp)
    dist._DEFAULT_FIRST_BUCKET_BYTES = 4096
    ddp = DDP(PPOLoss(model), process_group=dp, bucket_cap_mb=4096 / 2**20)
    torch._dynamo.reset()
    tilecompile.reset()
    assert torch._dynamo.config.optimize_ddp is True
    loss = torch.compile(ddp, backend="tilecompile", options=compile_options())(*halves[half])
    loss.backward()
    assert_close(loss, losses[half], rtol=1e-4, atol=2e-5, name=f"rank {rank} loss of half {half}")
    check_grads(model, full, rank % 2, 2)
    counts = tilecompile.report().counts
    assert (counts["attention"], counts["fused_linear_ce"], counts["tiled_mlp"]) == (1, 1, 1), tilecompile.report()
    assert counts["tensor_parallel"] == 3, tilecompile.report()  # the attention block, the MLP, the lm_head


def scenario_four(rank, world):
    check_tp_inside_fsdp_refused(rank, world)
    check_tp_ddp_defaults(rank, world)


def _entry(rank, world, port, name):
    os.environ["CI"] = "true"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        globals()[name](rank, world)
    finally:
        dist.destroy_process_group()


def spawn(world: int, name: str) -> None:
    from test_tensor_parallel import _free_port

    torch.multiprocessing.spawn(_entry, args=(world, _free_port(), name), nprocs=world, join=True)


@pytest.mark.distributed
def test_fsdp2_per_layer_and_root_two_ranks():
    spawn(2, "scenario_two")


@pytest.mark.distributed
def test_tp_inside_fsdp2_is_refused_on_four_ranks():
    spawn(4, "scenario_four")


# ------------------------------------------------------------------------------------------ one process


@pytest.fixture
def one_rank():
    from test_tensor_parallel import _free_port

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_one_graph_counts_every_module_it_serves():
    """Per-block compile (torchtitan's): Dynamo compiles one graph for both layers; the report counts 2 MLPs and
    says the graph served 2 modules. The step equals eager."""
    from helpers import assert_close, assert_grads_close, compile_options
    from test_tensor_parallel import batch, ppo_loss, tiny

    model = tiny("llama", layers=LAYERS)
    reference = copy.deepcopy(model)
    for layer in model.model.layers:
        layer.compile(backend="tilecompile", options=compile_options())
    data = batch()
    loss, expected = ppo_loss(model, *data), ppo_loss(reference, *data)
    loss.backward()
    expected.backward()
    assert_close(loss, expected, rtol=1e-5, atol=1e-6, name="loss")
    assert_grads_close(model, reference, rtol=1e-4, atol=1e-6)
    rep = tilecompile.report()
    assert rep.graphs == 1 and rep.counts["tiled_mlp"] == LAYERS, rep
    (mlp,) = [r for r in rep.rewrites if r.pass_name == "tiled_mlp"]
    assert rep.modules(mlp) == LAYERS and f"x{LAYERS}: one graph 1 served {LAYERS} modules" in str(rep), rep


def test_whole_step_under_fsdp2_reports_what_the_breaks_split(one_rank):
    """A whole-step compile of an FSDP2 model (per layer + root, the issue's first row) breaks at every layer: the
    report names the lm_head whose logits leave their graph, the log-softmax that reads them in another, and the
    mask entering the layers' graph, each with what to do. The loss equals eager."""
    from helpers import assert_close, compile_options
    from test_tensor_parallel import batch, ppo_loss, tiny
    from torch.distributed.fsdp import fully_shard

    model = tiny("llama", layers=LAYERS)
    expected = ppo_loss(copy.deepcopy(model), *batch())
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    loss = torch.compile(ppo_loss, backend="tilecompile", options=compile_options())(model, *batch())
    assert_close(loss, expected, rtol=1e-5, atol=1e-6, name="loss")
    rep = tilecompile.report()
    assert rep.graphs > 2 and rep.counts["fused_linear_ce"] == 0 and rep.counts["attention"] == 0, rep
    reasons = {(s.pass_name, s.candidate): s.reason for s in rep.skipped}
    assert "leave this graph as an output" in reasons["fused_linear_ce", "lm_head"], rep
    assert "tilecompile.LossHead" in reasons["fused_linear_ce", "lm_head"], rep
    assert "are an input of this graph" in reasons["fused_linear_ce", "log_softmax of an input"], rep
    assert "attn_mask [2, 1, 8, 8] is an input of this graph" in reasons["attention", "sdpa"], rep


def test_loss_head_needs_a_causal_lm():
    with pytest.raises(TypeError, match="LossHead needs a causal LM with get_decoder"):
        tilecompile.LossHead(torch.nn.Linear(2, 2), loss_fn)


@pytest.mark.parametrize("layout", ["head.compile", "torch.compile(head)"])
def test_losshead_without_a_mask_rewrites_every_layer(one_rank, layout):
    """No attention_mask (one causal sequence a row): LossHead gives the layers the equal all-ones mask, so every
    layer's attention is rewritten (HF would otherwise read its default positions as a packed-sequence mask built
    before the first layer); the loss and every gradient equal eager FSDP2 without a mask."""
    from helpers import assert_close, compile_options
    from test_tensor_parallel import tiny
    from torch.distributed.fsdp import fully_shard

    def ce(logits, ids, mask):
        assert mask is None  # the loss sees what the caller passed
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())

    model = tiny("qwen2", layers=LAYERS)
    heads = []
    for compiled in (False, True):
        head = tilecompile.LossHead(copy.deepcopy(model), ce, layer_masks=compiled)
        for layer in head.model.model.layers:
            fully_shard(layer)
        fully_shard(head)
        heads.append(head)
    eager, head = heads
    torch._dynamo.reset()
    tilecompile.reset()
    step = head
    if layout == "head.compile":
        head.compile(backend="tilecompile", options=compile_options())
    else:
        step = torch.compile(head, backend="tilecompile", options=compile_options())
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    loss, expected = step(ids), eager(ids)
    loss.backward()
    expected.backward()
    assert_close(loss, expected, rtol=1e-5, atol=1e-6, name="loss")
    for (name, p), (_, q) in zip(head.named_parameters(), eager.named_parameters()):
        assert_close(_full(p.grad), _full(q.grad), rtol=1e-4, atol=1e-6, name=f"grad of {name}")
    rep = tilecompile.report()
    assert (rep.counts["attention"], rep.counts["fused_linear_ce"], rep.counts["tiled_mlp"]) == (LAYERS, 1, LAYERS), rep
    assert not [s for s in rep.skipped if s.pass_name == "attention"], rep
