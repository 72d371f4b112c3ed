"""Checkpointed inputs offloaded to host memory (the memory plan's offload, tilecompile/offload.py and its ops).

On a CPU the ops are plain copies, so these tests check what does not depend on the device: the ops' schemas and
fakes, which layers the plan sends to the host for a given room and host budget, that the compiled forward saves
the offload's output in place of the layer's input and the backward reloads it (the partition's own count, by
layer and bytes), the report's reasons, and values and gradients equal to eager's (float64) through aot_eager,
Inductor and dynamic shapes."""

from __future__ import annotations

import copy

import pytest
import test_memory_plan as plan_tests
import torch
from helpers import assert_close, compile_options

import tilecompile
from tilecompile import offload
from tilecompile.passes import memory_plan

_fresh = plan_tests._fresh  # autouse: a fresh report and Dynamo around each test (that module skips without HF)


def test_the_ops_schemas_and_fakes():
    x = torch.randn(4, 6, dtype=torch.float64)
    host = torch.ops.tilecompile.offload(x, None, None, True)
    assert host.device.type == "cpu" and torch.equal(host, x) and host.data_ptr() != x.data_ptr()
    back = torch.ops.tilecompile.reload(host, None, None, torch.device("cpu"))
    assert torch.equal(back, x) and back.data_ptr() != host.data_ptr()
    torch.library.opcheck(torch.ops.tilecompile.offload.default, (x, x.clone(), host.clone(), False))
    torch.library.opcheck(torch.ops.tilecompile.reload.default, (host, host.clone(), x.clone(), torch.device("cpu")))
    assert torch.Tag.cudagraph_unsafe in torch.ops.tilecompile.offload.default.tags


_model, _step = plan_tests._model, plan_tests._step  # the tiny checkpointed Qwen2 and its log-prob step


def _run(monkeypatch, ids_list, room=None, dynamic=None, layers=3, **options):
    """Compiles the step with ``options`` (and a room of ``room`` bytes); for each ids: loss and grads against eager.
    Returns (the partitions' offloads: layer -> bytes, the last report)."""
    if room is not None:
        monkeypatch.setattr(memory_plan, "room_for", lambda *args: (room, "budget set by the test"))
    done: dict[str, int] = {}
    real = offload.apply

    def spy(fw, bw, num_fwd_outputs):
        result = real(fw, bw, num_fwd_outputs)
        assert sum(n.target is torch.ops.tilecompile.offload.default for n in fw.graph.nodes) == len(result)
        assert sum(n.target is torch.ops.tilecompile.reload.default for n in bw.graph.nodes) == len(result)
        done.update(result)
        return result

    monkeypatch.setattr(offload, "apply", spy)
    model = _model(layers)
    reference = copy.deepcopy(model)
    opts = compile_options(memory_budget=1.0, layer_regions=True, **options)
    f = torch.compile(_step, backend="tilecompile", options=opts, dynamic=dynamic)
    for ids in ids_list:
        tilecompile.reset()
        loss = f(model, ids)
        loss.backward()
        expected = _step(reference, ids)
        expected.backward()
        # Inductor's CPU code reassociates float64 sums: about 1e-9 off eager in the loss and 3e-8 in the grads,
        # with or without the offload
        rtol, atol = (1e-6, 1e-7) if opts["inner"] == "inductor" else (1e-10, 1e-12)
        assert_close(loss, expected, rtol=rtol, atol=atol, name="loss")
        for (name, p), r in zip(model.named_parameters(), reference.parameters()):
            assert_close(p.grad, r.grad, rtol=10 * rtol, atol=10 * atol, name=name)
    return done, tilecompile.report()


def _ids(seed, n=9):
    return torch.randint(0, 97, (2, n), generator=torch.Generator().manual_seed(seed))


def _mine(report):
    rewrites = {r.module_path: r.detail for r in report.rewrites if r.pass_name == "memory_plan"}
    skips = {s.module_path: s.reason for s in report.skipped if s.pass_name == "memory_plan"}
    return rewrites, skips


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_offload_all_sends_every_layers_input_to_the_host(monkeypatch, inner):
    done, rep = _run(monkeypatch, [_ids(1)], offload="all", inner=inner)
    layer_bytes = 2 * 9 * 32 * 8  # [2, 9, 32] float64: the hidden state entering each layer
    assert done == {f"model.layers.{i}": layer_bytes for i in range(3)}
    rewrites, skips = _mine(rep)
    assert sorted(rewrites) == [f"model.layers.{i}" for i in range(3)] and not skips
    assert all("offloaded to host memory" in d and "3 of 3 layers offloaded" in d for d in rewrites.values())
    # the offloaded layers share one layer region: the partition offloads the region's own saved copy of its input
    regions = sorted(r.module_path for r in rep.rewrites if r.pass_name == "layer_regions")
    assert regions == [f"model.layers.{i}" for i in range(3)], rep
    assert not [s for s in rep.skipped if s.pass_name == "layer_regions"], rep


def test_auto_offloads_from_the_first_layer_only_what_the_room_needs(monkeypatch):
    ids = _ids(2)
    layer_bytes = 2 * 9 * 32 * 8
    seen = {}
    real = memory_plan.choose_offload

    def spy(layers, plan, room, host, every, can):
        seen["base"] = memory_plan._hint(plan.saved + plan.reserve)
        return real(layers, plan, room, host, every, can)

    monkeypatch.setattr(memory_plan, "choose_offload", spy)
    reserve_and_all = None
    # a room that the checkpointed inputs and one recompute exceed by a little more than one layer's input
    monkeypatch.setattr(memory_plan, "room_for", lambda *args: (0, "probe"))
    _run(monkeypatch, [ids], offload="auto", host_budget=1e-12)  # host budget of ~0: nothing offloaded, sizes seen
    reserve_and_all = seen["base"]
    tilecompile.reset()
    torch._dynamo.reset()
    done, rep = _run(monkeypatch, [ids], room=reserve_and_all - layer_bytes - 1, offload="auto")
    assert done == {"model.layers.0": layer_bytes, "model.layers.1": layer_bytes}
    rewrites, skips = _mine(rep)
    assert sorted(rewrites) == ["model.layers.0", "model.layers.1"]
    assert "with the inputs of 2 earlier layers on the host" in skips["model.layers.2"]


def test_the_host_budget_and_offload_off_are_honoured_and_said(monkeypatch):
    ids = _ids(3)
    layer_bytes = 2 * 9 * 32 * 8
    done, rep = _run(monkeypatch, [ids], room=0, offload="auto", host_budget=1.5 * layer_bytes / 2**30)
    assert done == {"model.layers.0": layer_bytes}  # the host holds one layer's input
    rewrites, skips = _mine(rep)
    assert sorted(rewrites) == ["model.layers.0"]
    assert all("holds no more than the 1 earlier layers' inputs" in skips[f"model.layers.{i}"] for i in (1, 2))
    tilecompile.reset()
    torch._dynamo.reset()
    done, rep = _run(monkeypatch, [ids], room=0)  # the default: off
    rewrites, skips = _mine(rep)
    assert not done and not rewrites and all("offload is off" in r for r in skips.values())


def test_dynamic_lengths_offload_at_every_length(monkeypatch):
    done, rep = _run(monkeypatch, [_ids(4, 9), _ids(5, 17), _ids(6, 33)], offload="all", dynamic=True)
    assert sorted(done) == [f"model.layers.{i}" for i in range(3)]
    assert rep.counts.get("memory_plan", 0) in (0, 3)  # compiled once: later calls add no rewrite
    assert not [s for s in rep.skipped if s.pass_name == "memory_plan"]


def test_eager_inner_compiler_has_no_partition_and_the_report_says_so(monkeypatch):
    ids = _ids(7)
    monkeypatch.setattr(memory_plan, "room_for", lambda *args: (0, "budget set by the test"))
    model = _model()
    opts = compile_options(memory_budget=1.0, offload="all", inner="eager")
    torch.compile(_step, backend="tilecompile", options=opts)(model, ids).backward()
    rewrites, skips = _mine(tilecompile.report())
    assert not rewrites and len(skips) == 3
    assert all("has no partition step" in r for r in skips.values())
    regions = [s.reason for s in tilecompile.report().skipped if s.pass_name == "layer_regions"]
    assert regions and all("inner compiler 'eager'" in r for r in regions), regions


def test_choose_offload_for_given_rooms_and_host_budgets_static_and_symbolic():
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    def layers(size):
        return [memory_plan.Layer(site=None, where=f"layers.{i}", saved=size, kept=size) for i in range(4)]

    plan = memory_plan.Plan([], 0, 0, reserve=50, saved=4 * 10)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(memory_plan, "host_bytes", lambda layer: layer.saved)  # these layers have no graph nodes
        ls = layers(10)
        assert memory_plan.choose_offload(ls, plan, 90, 10**9, False, [0, 1, 2, 3]) == []  # fits: nothing moves
        assert memory_plan.choose_offload(ls, plan, 89, 10**9, False, [0, 1, 2, 3]) == [0]
        assert memory_plan.choose_offload(ls, plan, 70, 10**9, False, [0, 1, 2, 3]) == [0, 1]
        assert memory_plan.choose_offload(ls, plan, 0, 10**9, False, [0, 1, 2, 3]) == [0, 1, 2, 3]  # all, still over
        assert memory_plan.choose_offload(ls, plan, 0, 25, False, [0, 1, 2, 3]) == [0, 1]  # the host holds two
        assert memory_plan.choose_offload(ls, plan, 0, 10**9, False, [1, 3]) == [1, 3]  # the ones that can
        assert memory_plan.choose_offload(ls, plan, 10**9, 10**9, True, [0, 1, 2, 3]) == [0, 1, 2, 3]  # all

        env = ShapeEnv()
        n = env.create_symintnode(env.create_symbol(64, source=ConstantSource("n"), dynamic_dim=DimDynamic.DYNAMIC),
                                  hint=64)  # fmt: skip
        ls = layers(n * 8)
        plan = memory_plan.Plan([], 0, 0, reserve=n * 80, saved=n * 32)
        # at n = 64: 112 * 64 bytes against a room of 100 * 64: two layers' inputs (16 * 64) must go
        assert memory_plan.choose_offload(ls, plan, 100 * 64, 10**9, False, [0, 1, 2, 3]) == [0, 1]


def test_offloaded_and_device_layers_share_one_region(monkeypatch):
    """Partial offload: the two offloaded layers and the two checkpointed on the device are calls of one layer
    region; the partition offloads the inputs of the first two only (its count, by layer and bytes), and the step
    equals eager's (float64)."""
    layer_bytes = 2 * 9 * 32 * 8
    done, rep = _run(monkeypatch, [_ids(8)], room=0, layers=4, offload="auto", host_budget=2.5 * layer_bytes / 2**30)
    assert done == {"model.layers.0": layer_bytes, "model.layers.1": layer_bytes}
    regions = sorted(r.module_path for r in rep.rewrites if r.pass_name == "layer_regions")
    assert regions == [f"model.layers.{i}" for i in range(4)], rep
    assert len({r.detail for r in rep.rewrites if r.pass_name == "layer_regions"}) == 1  # one region for all four


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_offloaded_region_input_saved_on_the_host_only(monkeypatch, inner):
    """The forward of a graph with offloaded layer regions saves, for each offloaded layer, the host copy in place of
    the region's own copy of its input (no device tensor of the input left among the saved ones), and the backward
    reloads it for the region's backward call."""
    saved = {}
    real = offload.apply

    def spy(fw, bw, num_fwd_outputs):
        result = real(fw, bw, num_fwd_outputs)
        out = list(fw.graph.find_nodes(op="output")[0].args[0])[num_fwd_outputs:]
        saved["hosts"] = [n for n in out if getattr(n, "target", None) is torch.ops.tilecompile.offload.default]
        saved["regions"] = [n for n in out if offload.region_input(fw, n) is not None]
        saved["result"] = result
        return result

    monkeypatch.setattr(offload, "apply", spy)
    monkeypatch.setattr(memory_plan, "room_for", lambda *args: (0, "budget set by the test"))
    model = _model(3)
    reference = copy.deepcopy(model)
    ids = _ids(5)
    opts = compile_options(memory_budget=1.0, offload="all", layer_regions=True, inner=inner)
    f = torch.compile(_step, backend="tilecompile", options=opts)
    loss = f(model, ids)
    loss.backward()
    expected = _step(reference, ids)
    expected.backward()
    rtol, atol = (1e-6, 1e-7) if inner == "inductor" else (1e-10, 1e-12)
    assert_close(loss, expected, rtol=rtol, atol=atol, name="loss")
    for (name, p), r in zip(model.named_parameters(), reference.parameters()):
        assert_close(p.grad, r.grad, rtol=10 * rtol, atol=10 * atol, name=name)
    if inner == "aot_eager":  # Inductor's partition is its own (the spy sees it only through custom_partitioner_fn)
        assert len(saved["hosts"]) == 3 and not saved["regions"], saved
        assert sorted(saved["result"]) == [f"model.layers.{i}" for i in range(3)]
    assert tilecompile.report().counts["layer_regions"] == 3


def test_the_host_pool_takes_exact_sizes_and_reuses_free_blocks():
    """The pinned pool (on a CPU with pinning a no-op, recorded): a block is exactly the bytes asked for (PyTorch's
    caching host allocator would round 3 MiB up to 4), is handed out again only once nothing holds it, the smallest
    free block that fits serves a request, and a longer step's request drops the shorter step's free blocks (after
    the copies drain) instead of holding both."""
    from tilecompile.ops.offload import HostPool

    pinned, drained = {}, []
    pool = HostPool(lambda ptr, n: pinned.__setitem__(ptr, n), lambda ptr: pinned.pop(ptr), lambda: drained.append(1))
    shape = torch.Size([3, 512, 1024])  # 3 MiB of fp16
    a = pool.take(shape, torch.float16)
    b = pool.take(shape, torch.float16)
    assert a.shape == shape and a.dtype == torch.float16 and a.is_contiguous()
    assert sorted(pinned.values()) == [3 * 2**20] * 2 and pool.held() == 6 * 2**20 == pool.in_use()
    a.fill_(1.0)
    b.fill_(2.0)  # two blocks: writing one leaves the other
    assert a.eq(1).all() and a.data_ptr() != b.data_ptr()
    saved = a.detach()  # what autograd holds: another tensor on the same storage
    ptr_a = a.data_ptr()
    del a
    c = pool.take(shape, torch.float16)
    assert c.data_ptr() not in (ptr_a, b.data_ptr()) and len(pinned) == 3  # a's block is still held (saved)
    del saved
    d = pool.take(torch.Size([2, 512, 1024]), torch.float16)  # 2 MiB: a's free 3 MiB block serves it
    assert d.data_ptr() == ptr_a and len(pinned) == 3 and pool.peak == 9 * 2**20 and not drained
    del b, c, d
    assert pool.in_use() == 0
    e = pool.take(torch.Size([4, 512, 1024]), torch.float16)  # longer: the three free 3 MiB blocks go first
    assert drained and list(pinned.values()) == [4 * 2**20] and pool.held() == 4 * 2**20
    pool.reset_peak()
    assert pool.peak == 4 * 2**20
    del e
    pool.release()
    assert not pinned and pool.held() == 0
