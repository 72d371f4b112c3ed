"""DDP as users run it: ``torch.compile(DDP(module), backend="tilecompile")`` with Dynamo's defaults, on 2 gloo ranks.

``optimize_ddp`` is left at its default ("ddp_optimizer": the graph is split at DDP's bucket boundaries); the
buckets are made small so that the tiny model spans many of them, as any real model does. Each rank trains on its
half of the batch for 3 AdamW steps; the losses, every gradient and the parameters after each step must equal one
process training on the whole batch (the mean of the two halves' losses, as DDP averages the gradients), and every
rewrite must fire: attention and the tiled MLP in each layer, the fused lm_head with its loss.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist

import tilecompile

LAYERS, STEPS = 2, 3
RTOL, ATOL = 1e-5, 1e-6
# AdamW's step is lr * g / (|g| + eps) at first: with the default eps (1e-8) a gradient element within its rounding
# error (~1e-9 here) of zero can move its weight by up to lr either way. eps = 1e-5 keeps the step a smooth function
# of the gradient (a 1e-9 gradient error moves a weight by at most lr * 1e-4), so weights are held to lr / 1000.
LR, EPS = 1e-2, 1e-5
PARAM_ATOL = 1e-3 * LR


def _halves():
    from test_tensor_parallel import batch

    ids, mask, old_logp, adv = batch(n=4, seq=8)
    mask[2, :3] = 0  # a left-padded row in the second half
    return [tuple(t[2 * h : 2 * h + 2] for t in (ids, mask, old_logp, adv)) for h in (0, 1)]


def _reference(model, halves):
    """One process, the whole batch: per step the mean of the halves' losses, its grads, then an AdamW step."""
    from test_tensor_parallel import ppo_loss

    full = copy.deepcopy(model)
    opt = torch.optim.AdamW(full.parameters(), lr=LR, eps=EPS)
    out = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = (ppo_loss(full, *halves[0]) + ppo_loss(full, *halves[1])) / 2
        loss.backward()
        grads = {n: p.grad.clone() for n, p in full.named_parameters()}
        opt.step()
        out.append((loss.detach(), grads, {n: p.detach().clone() for n, p in full.named_parameters()}))
    return out


class _Pieces:
    """Counts the graphs the backend hands to its inner compiler (DDP's pieces)."""

    def __enter__(self):
        from tilecompile import backend

        self.calls, self._saved = 0, backend.inner_compile

        def inner(*args):
            self.calls += 1
            return self._saved(*args)

        backend.inner_compile = inner
        return self

    def __exit__(self, *exc):
        from tilecompile import backend

        backend.inner_compile = self._saved


def _train_ddp(rank, model, halves, options, bucket_cap_mb):
    from helpers import compile_options
    from test_tensor_parallel import PPOLoss
    from torch.nn.parallel import DistributedDataParallel as DDP

    # DDP's first bucket (1 MiB by default, and DDPOptimizer wants it no larger than the others) made small too
    dist._DEFAULT_FIRST_BUCKET_BYTES = int(bucket_cap_mb * 2**20)
    ddp = DDP(PPOLoss(model), bucket_cap_mb=bucket_cap_mb)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    torch._dynamo.reset()
    tilecompile.reset()
    step = torch.compile(ddp, backend="tilecompile", options=compile_options(**options))
    out = []
    with _Pieces() as pieces:
        for _ in range(STEPS):
            opt.zero_grad()
            loss = step(*halves[rank])
            loss.backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            opt.step()
            total = loss.detach().clone()
            dist.all_reduce(total)
            out.append((total / 2, grads, {n: p.detach().clone() for n, p in model.named_parameters()}))
    return out, pieces.calls, tilecompile.report()


def check_ddp_defaults(rank, world):
    """Many buckets, Dynamo's defaults: DDP's split comes after the passes, so every rewrite fires; the pieces
    still each go to the inner compiler (several of them: the buckets' all-reduces can still overlap)."""
    from helpers import assert_close
    from test_tensor_parallel import tiny

    assert torch._dynamo.config.optimize_ddp is True  # Dynamo's default: DDPOptimizer splits the graph
    halves = _halves()
    model = tiny("llama", layers=LAYERS)
    expected = _reference(model, halves)
    got, pieces, rep = _train_ddp(rank, model, halves, {}, bucket_cap_mb=0.02)
    assert pieces >= 3, f"DDP split the graph into {pieces} piece(s); the test needs several buckets\n{rep}"
    assert rep.graphs == 1, rep
    counts = rep.counts
    assert (counts["attention"], counts["fused_linear_ce"], counts["tiled_mlp"]) == (LAYERS, 1, LAYERS), rep
    assert not rep.skipped and not rep.failures, rep
    for i, ((loss, grads, params), (ref_loss, ref_grads, ref_params)) in enumerate(zip(got, expected)):
        assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL, name=f"rank {rank} step {i} loss")
        for name, g in grads.items():
            assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, name=f"rank {rank} step {i} grad of {name}")
        for name, p in params.items():
            assert_close(p, ref_params[name], rtol=0, atol=PARAM_ATOL, name=f"rank {rank} step {i} {name}")


def check_split_first(rank, world):
    """``ddp_split_after_passes=0``: DDP splits first, as it does for other backends, and the passes see only
    fragments (what users got before): fewer rewrites, each missing one named in the report. The training is still
    right."""
    from helpers import assert_close
    from test_tensor_parallel import tiny

    halves = _halves()
    model = tiny("llama", layers=LAYERS)
    expected = _reference(model, halves)[:1]
    global STEPS
    saved, STEPS = STEPS, 1
    try:
        got, pieces, rep = _train_ddp(rank, model, halves, {"ddp_split_after_passes": 0}, bucket_cap_mb=0.02)
    finally:
        STEPS = saved
    assert rep.graphs == pieces >= 3, rep
    counts = rep.counts
    assert (counts["attention"], counts["fused_linear_ce"], counts["tiled_mlp"]) != (LAYERS, 1, LAYERS), rep
    assert_close(got[0][0], expected[0][0], rtol=RTOL, atol=ATOL, name=f"rank {rank} loss")


def scenario(rank, world):
    check_ddp_defaults(rank, world)
    check_split_first(rank, world)


def _entry(rank, world, port, name):
    os.environ["CI"] = "true"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        globals()[name](rank, world)
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_ddp_many_buckets_dynamo_defaults():
    from test_tensor_parallel import _free_port

    torch.multiprocessing.spawn(_entry, args=(2, _free_port(), "scenario"), nprocs=2, join=True)
