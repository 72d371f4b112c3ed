"""memory_plan: a checkpointed layer is kept whole (no recompute) where the memory budget allows.

The planner's choice for given sizes and rooms (static and symbolic), and through a tiny HF Qwen2 with gradient
checkpointing: values and gradients equal to eager's (float64) with every choice, the saved-tensor bytes that keeping
costs, the report's reasons, and a longer sequence that no longer fits planned again."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_close, compile_options

import tilecompile
from tilecompile import config
from tilecompile.passes import memory_plan

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _fresh():
    tilecompile.reset()
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _layers(*sizes):
    return [memory_plan.Layer(site=None, where=f"layers.{i}", saved=s, kept=k) for i, (s, k) in enumerate(sizes)]


def test_choose_keeps_layers_from_the_last_while_they_fit():
    layers = _layers((10, 100), (10, 100), (10, 100), (10, 100))
    base = 4 * 10 + 100  # every layer's checkpointed input and one layer's recompute
    assert memory_plan.choose(layers, base - 1).keep == []
    assert memory_plan.choose(layers, base).keep == []
    assert memory_plan.choose(layers, base + 90).keep == [3]
    assert memory_plan.choose(layers, base + 2 * 90 + 89).keep == [2, 3]
    plan = memory_plan.choose(layers, 10**9)
    assert plan.keep == [0, 1, 2, 3] and plan.total == base + 4 * 90
    layers[2].why_not = "its outputs are used other than one by one (getitem)"
    assert memory_plan.choose(layers, base + 2 * 90).keep == [1, 3]  # a layer that cannot be kept is passed over


def test_choose_with_symbolic_sizes_decides_at_the_hint_and_guards():
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    env = ShapeEnv()
    symbol = env.create_symbol(64, source=ConstantSource("n"), dynamic_dim=DimDynamic.DYNAMIC)
    n = env.create_symintnode(symbol, hint=64)
    layers = _layers((n * 8, n * 80), (n * 8, n * 80))
    plan = memory_plan.choose(layers, 64 * (16 + 80 + 72))  # fits one kept layer at n = 64
    assert plan.keep == [1]
    assert memory_plan._hint(plan.total) == 64 * (16 + 80 + 72)
    assert bool(plan.total <= 64 * (16 + 80 + 72))  # what the pass evaluates: a guard on n
    assert env.guards, "the plan's fit must be guarded"


def test_memory_budget_setting():
    assert config.load({"memory_budget": "12.5"}).memory_budget == 12.5
    assert config.load(environ={"TILECOMPILE_MEMORY_BUDGET": "0.8"}).memory_budget == 0.8
    for bad in ("-1", "lots", "inf", True):
        with pytest.raises(ValueError, match="memory_budget"):
            config.load({"memory_budget": bad})


# ------------------------------------------------------------------------------------------ through HF Qwen2


def _model(layers=3):
    cfg = transformers.Qwen2Config(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg).double()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model.train()


def _step(model, ids):
    logits = model(input_ids=ids).logits[:, :-1]
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return -logp.mean()


def _saved_bytes(fn, *args):
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return out, total[0]


def _run(room, ids, monkeypatch, dynamic=None, model=None, budget=None, **options):
    """Compile the step with a budget whose room is ``room`` bytes (a function of the layers, or None: no budget);
    returns (loss, grads, saved bytes, report) and checks loss and grads against eager."""
    tilecompile.reset()
    torch._dynamo.reset()
    model = model or _model()
    reference = copy.deepcopy(model)
    if room is not None:
        monkeypatch.setattr(memory_plan, "room_for", lambda *args: (room, "budget set by the test"))
    budget = budget if budget is not None else 1.0 if room is not None else 0.0
    options = compile_options(inner="aot_eager", memory_budget=budget, mlp_min_tokens=0, **options)
    f = torch.compile(_step, backend="tilecompile", options=options, dynamic=dynamic)
    f(model, ids)  # compiled outside the counting hooks: under the user's hooks the plan would leave the step alone
    loss, saved = _saved_bytes(f, model, ids)
    loss.backward()
    expected = _step(reference, ids)
    expected.backward()
    assert_close(loss, expected, rtol=1e-10, atol=1e-12, name="loss")
    for (name, p), r in zip(model.named_parameters(), reference.parameters()):
        assert_close(p.grad, r.grad, rtol=1e-9, atol=1e-11, name=name)
    return saved, tilecompile.report()


def _layer_sizes(ids):
    """The planner's own sizes of the model's three layers for ``ids`` (read from a compile without a budget)."""
    seen = []
    real = memory_plan.choose

    def spy(layers, room):
        seen.extend(
            (memory_plan._hint(x.saved), memory_plan._hint(x.kept), memory_plan._hint(x.computed)) for x in layers
        )
        return real(layers, room)

    mp = pytest.MonkeyPatch()
    mp.setattr(memory_plan, "choose", spy)
    mp.setattr(memory_plan, "room_for", lambda *args: (0, "sizing"))
    options = compile_options(inner="aot_eager", memory_budget=1.0, mlp_min_tokens=0)
    torch.compile(_step, backend="tilecompile", options=options)(_model(), ids)
    mp.undo()
    tilecompile.reset()
    torch._dynamo.reset()
    return seen


def test_every_choice_matches_eager_and_keeping_saves_more(monkeypatch):
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    sizes = _layer_sizes(ids)
    # kept: what the partitioner saves for a layer's backward; computed (the reserve): every tensor it computes
    assert len(sizes) == 3 and all(0 < s < k and c > 0 for s, k, c in sizes), sizes
    base = sum(s for s, _, _ in sizes) + max(c for _, _, c in sizes)
    extra = [k - s for s, k, _ in sizes]

    saved_none, rep = _run(None, ids, monkeypatch)  # no budget: the model's checkpointing
    assert "memory_plan" not in rep.counts or rep.counts["memory_plan"] == 0
    assert rep.counts["tiled_mlp"] == 3

    saved_all, rep = _run(10**12, ids, monkeypatch)
    assert rep.counts["memory_plan"] == 3
    mlp_reasons = [s.reason for s in rep.skipped if s.pass_name == "tiled_mlp"]
    assert len(mlp_reasons) == 3 and all("keeps layer" in r for r in mlp_reasons)
    assert saved_all > saved_none, (saved_all, saved_none)  # kept layers save their activations
    # the planner's estimate (the partitioner's saved set per layer, the cos/sin and mask counted in each) bounds
    # what keeping really costs, and is not far above it
    assert saved_all - saved_none <= sum(extra) <= 2 * (saved_all - saved_none), (sum(extra), saved_all - saved_none)

    saved_one, rep = _run(base + extra[2], ids, monkeypatch)  # room for the last layer only
    assert rep.counts["memory_plan"] == 1
    assert [r.module_path for r in rep.rewrites if r.pass_name == "memory_plan"] == ["model.layers.2"]
    left = [s for s in rep.skipped if s.pass_name == "memory_plan"]
    assert [s.module_path for s in left] == ["model.layers.0", "model.layers.1"]
    assert all("past the room" in s.reason for s in left)
    assert saved_none < saved_one < saved_all

    _, rep = _run(base - 1, ids, monkeypatch)  # not even the checkpointed inputs fit; offload is off by default
    left = [s for s in rep.skipped if s.pass_name == "memory_plan"]
    assert len(left) == 3 and all("already exceed the room" in s.reason for s in left)
    assert all("offload is off (TILECOMPILE_OFFLOAD=off)" in s.reason for s in left)  # tests/test_offload.py: on


def test_a_longer_sequence_that_no_longer_fits_is_planned_again(monkeypatch):
    short = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(2))
    long = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(3))
    sizes = _layer_sizes(short)
    room = 2 * (sum(s for s, _, _ in sizes) + max(c for _, _, c in sizes) + sum(k - s for s, k, _ in sizes))  # 2x all
    model = _model()
    reference = copy.deepcopy(model)
    monkeypatch.setattr(memory_plan, "room_for", lambda *args: (room, "budget set by the test"))
    options = compile_options(inner="aot_eager", memory_budget=1.0, mlp_min_tokens=0)
    f = torch.compile(_step, backend="tilecompile", options=options, dynamic=True)
    kept = []
    for ids in (short, long):
        tilecompile.reset()
        loss = f(model, ids)
        loss.backward()
        expected = _step(reference, ids)
        expected.backward()
        assert_close(loss, expected, rtol=1e-10, atol=1e-12, name="loss")
        for p, r in zip(model.parameters(), reference.parameters()):
            assert_close(p.grad, r.grad, rtol=1e-9, atol=1e-11, name="grad")
        kept.append(tilecompile.report().counts.get("memory_plan", 0))
    assert kept[0] == 3  # at 9 tokens every layer fits twice over
    assert kept[1] < 3  # at 40 the guard fails: compiled again, fewer layers kept


def test_auto_budget_plans_on_cuda_only_and_sets_aside_grads_and_optimizer_states():
    assert config.load({}).memory_budget is None  # auto
    assert config.load({"memory_budget": "auto"}).memory_budget is None
    assert memory_plan._budget(None, torch.device("cpu")) == 0.0
    assert memory_plan._budget(None, torch.device("cuda", 0)) == memory_plan.AUTO_FRACTION
    assert memory_plan._budget(12.0, torch.device("cpu")) == 12.0
    room, words = memory_plan.room_for(4.0, torch.device("cpu"), trainable=2**30)
    assert room == 1 * 2**30 and "3.00 GiB set aside for grads and optimizer states" in words
    assert memory_plan.room_for(2.0, torch.device("cpu"), trainable=2**30)[0] == 0


def test_auto_budget_leaves_a_cpu_graph_as_it_is():
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    f = torch.compile(_step, backend="tilecompile", options=compile_options(memory_budget="auto"))
    f(_model(), ids).backward()
    rep = tilecompile.report()
    assert rep.counts.get("memory_plan", 0) == 0 and rep.counts["tiled_mlp"] == 3


@pytest.mark.parametrize("fits", [True, False])
def test_without_checkpointing_the_mlps_stay_whole_where_the_graph_fits(monkeypatch, fits):
    """No checkpointed layer: the plan weighs the whole graph's activations; where they fit, the tiled MLP pass
    leaves every MLP whole and says why; where not, the MLPs are tiled as before. Values and grads equal eager's."""
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(4))
    model = _model()
    model.gradient_checkpointing_disable()
    seen = {}
    real = memory_plan.graph_activations

    def spy(gm):
        seen["total"], seen["largest"] = real(gm)
        return seen["total"], seen["largest"]

    monkeypatch.setattr(memory_plan, "graph_activations", spy)
    room = 10**12 if fits else 0
    monkeypatch.setattr(memory_plan, "room_for", lambda *args: (room, "budget set by the test"))
    _, rep = _run(None, ids, monkeypatch, model=model, budget=1.0)
    assert seen["total"] > 0
    reasons = [s.reason for s in rep.skipped if s.pass_name == "tiled_mlp"]
    if fits:
        assert rep.counts.get("tiled_mlp", 0) == 0
        assert len(reasons) == 3 and all("keeps the whole graph (no checkpointing" in r for r in reasons)
    else:
        assert rep.counts["tiled_mlp"] == 3 and not reasons


def test_a_step_under_the_users_saved_tensors_hooks_is_left_alone(monkeypatch):
    """TRL's and torchtune's activation offloading wrap the step in saved-tensors hooks: the plan keeps nothing and
    says why, even with room for every layer; the hooks still see every saved tensor; values and grads match."""
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(5))
    model = _model()
    reference = copy.deepcopy(model)
    monkeypatch.setattr(memory_plan, "room_for", lambda *args: (10**12, "budget set by the test"))
    packed = []

    def pack(t):
        packed.append(t.numel())
        return t

    options = compile_options(inner="aot_eager", memory_budget=1.0, mlp_min_tokens=0)
    f = torch.compile(_step, backend="tilecompile", options=options)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = f(model, ids)
    loss.backward()
    expected = _step(reference, ids)
    expected.backward()
    assert_close(loss, expected, rtol=1e-10, atol=1e-12, name="loss")
    for p, r in zip(model.parameters(), reference.parameters()):
        assert_close(p.grad, r.grad, rtol=1e-9, atol=1e-11, name="grad")
    rep = tilecompile.report()
    assert rep.counts.get("memory_plan", 0) == 0 and packed
    left = [s.reason for s in rep.skipped if s.pass_name == "memory_plan"]
    assert len(left) == 3 and all("saved-tensors hooks" in r for r in left)
