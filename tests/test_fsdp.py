"""FSDP2 (``fully_shard``) as verl and torchtitan wrap a model, on gloo (CPU) ranks.

TP inside FSDP2 on torchtitan's 2-D mesh (dp=2 x tp=2, 4 ranks): ``tilecompile.parallelize`` cannot compose with
``fully_shard`` (FSDP2 swaps the parameters for DTensors and the shard records are lost), so both orders are
refused with a clear error before any step runs, never a wrong loss.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import tilecompile
from tilecompile import parallel as TP


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


def scenario_four(rank, world):
    check_tp_inside_fsdp_refused(rank, world)


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
def test_tp_inside_fsdp2_is_refused_on_four_ranks():
    spawn(4, "scenario_four")
