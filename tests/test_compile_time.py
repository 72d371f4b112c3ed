"""Compile time under dynamic shapes: the backend and its passes run once per graph, not once per Dynamo restart."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from helpers import assert_close, compile_options
from torch._dynamo.utils import counters

import tilecompile
from tilecompile import backend, dynamo_floats, pipeline


class Block(torch.nn.Module):
    """An HF-style layer under activation checkpointing: SDPA fed float attributes, an RMSNorm eps, a gated MLP."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads, self.scaling, self.dropout, self.eps = heads, (d // heads) ** -0.5, 0.0, 1e-6
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
        self.gate, self.up = torch.nn.Linear(d, 24, bias=False), torch.nn.Linear(d, 24, bias=False)
        self.down = torch.nn.Linear(24, d, bias=False)

    def forward(self, x):
        b, n, d = x.shape
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.qkv(h).chunk(3, -1))
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout, scale=self.scaling, is_causal=True)
        x = x + a.transpose(1, 2).reshape(b, n, d)
        return x + self.down(F.silu(self.gate(x)) * self.up(x))


class LoraBlock(Block):
    """``Block`` plus a LoRA adapter beside it, scaled as PEFT's ``lora.Linear`` does: from a dict per adapter."""

    def __init__(self, d: int = 16) -> None:
        super().__init__(d)
        self.lora_a, self.lora_b = torch.nn.Linear(d, 4, bias=False), torch.nn.Linear(4, d, bias=False)
        self.lora_scaling = {"default": 2.0}

    def forward(self, x):
        return super().forward(x) + self.lora_b(self.lora_a(x)) * self.lora_scaling["default"]


class Model(torch.nn.Module):
    def __init__(self, vocab: int = 50, d: int = 16, block=Block) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList(block(d) for _ in range(2))

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return x.float().pow(2).mean()


def _runs(monkeypatch) -> list:
    runs = []
    monkeypatch.setattr(backend, "run_passes", lambda gm, *a: runs.append(gm) or pipeline.run_passes(gm, *a))
    return runs


def test_dynamic_hf_style_step_compiles_without_a_restart(monkeypatch):
    """Embedding's norm_type and SDPA's scale / dropout_p are floats AOTAutograd cannot turn into tensors: without
    the backend specializing them first, Dynamo restarts and the passes and AOTAutograd run twice."""
    runs = _runs(monkeypatch)
    aot, frames = counters["aot_autograd"]["total"], counters["frames"]["ok"]  # global counts: deltas
    model = Model()
    ref = Model()
    ref.load_state_dict(model.state_dict())
    f = torch.compile(model, backend="tilecompile", dynamic=True, options=compile_options())
    for n in (7, 11):  # one compile serves both lengths
        ids = torch.randint(0, 50, (2, n))
        for p in (*model.parameters(), *ref.parameters()):
            p.grad = None
        out, expected = f(ids), ref(ids)
        out.backward()
        expected.backward()
        assert_close(out, expected, rtol=1e-5, atol=1e-6, name=f"loss at {n}")
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, name=f"grad of {name} at {n}")
    assert len(runs) == 1, f"the passes ran {len(runs)} times for one graph (a Dynamo restart)"
    assert counters["aot_autograd"]["total"] - aot == 1, "AOTAutograd traced the graph more than once"
    assert counters["frames"]["ok"] - frames == 1, "one compile serves both lengths"
    rep = tilecompile.report()
    assert rep.graphs == 1 and rep.counts["tiled_mlp"] == 2, rep


def test_specialized_floats_keep_their_guards(monkeypatch):
    """A module's floats become constants guarded on their value: the first change recompiles and computes with the
    new value; a float that changed is symbolic from then on (no recompile a value). A float passed as an argument
    stays symbolic from the start."""
    specialized = []
    spec = dynamo_floats.specialize_module_floats
    monkeypatch.setattr(dynamo_floats, "specialize_module_floats", lambda gm: specialized.extend(spec(gm)) or [])
    model = Model()
    f = torch.compile(lambda ids, t: model(ids) * t, backend="tilecompile", dynamic=True, options=compile_options())
    ids = torch.randint(0, 50, (2, 9))
    f(ids, 0.5).backward()
    assert len(specialized) == 7, specialized  # norm_type, and each layer's eps, scale and dropout_p
    frames = counters["frames"]["ok"]
    assert_close(f(ids, 0.25), model(ids) * 0.25, rtol=1e-5, atol=1e-6, name="loss at another t")
    assert counters["frames"]["ok"] == frames, "a float argument was specialized"
    # SDPA's scale reaches ATen as a double: it can never be symbolic, each value is a compile (as in torch)
    for eps, scaling, recompiled in ((1e-3, 0.5, 1), (1e-2, 0.5, 0), (1e-2, 0.25, 1)):
        for block in model.blocks:
            block.eps, block.scaling = eps, scaling
        assert_close(f(ids, 0.5), model(ids) * 0.5, rtol=1e-5, atol=1e-6, name=f"loss at eps {eps}")
        assert counters["frames"]["ok"] == frames + recompiled, f"eps {eps}: the guard or the memory of it is lost"
        frames = counters["frames"]["ok"]
    torch._dynamo.reset()  # frame ids start again: what was learnt of the old frame does not hold for the new one
    f = torch.compile(lambda ids, t: model(ids) * t, backend="tilecompile", dynamic=True, options=compile_options())
    specialized.clear()
    f(ids, 0.5)
    assert len(specialized) == 7, specialized


def test_floats_in_a_module_dict_are_specialized_too(monkeypatch):
    """PEFT keeps each LoRA layer's scale in a dict per adapter (``scaling['default']``). Under dynamic=True it is a
    constant guarded on its value, as a module's float attribute is: the checkpointed layers still share one region
    (a float left symbolic is read by ``.item()`` in each body, which keeps them apart), and a changed value
    recompiles and computes with it."""
    specialized = []
    spec = dynamo_floats.specialize_module_floats
    monkeypatch.setattr(dynamo_floats, "specialize_module_floats", lambda gm: specialized.extend(spec(gm)) or [])
    torch.manual_seed(0)
    model, ref = Model(block=LoraBlock), Model(block=LoraBlock)
    ref.load_state_dict(model.state_dict())
    f = torch.compile(model, backend="tilecompile", dynamic=True, options=compile_options(layer_regions=True))
    ids = torch.randint(0, 50, (2, 9))
    out, expected = f(ids), ref(ids)
    out.backward()
    expected.backward()
    assert_close(out, expected, rtol=1e-5, atol=1e-6, name="loss")
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, name=f"grad of {name}")
    assert len(specialized) == 9, specialized  # norm_type, each layer's eps, scale, dropout_p and LoRA scale
    rep = tilecompile.report()
    assert rep.counts["layer_regions"] == 2, rep
    frames = counters["frames"]["ok"]
    for scaled in (*model.blocks, *ref.blocks):
        scaled.lora_scaling["default"] = 0.5
    assert_close(f(ids), ref(ids), rtol=1e-5, atol=1e-6, name="loss at another LoRA scale")
    assert counters["frames"]["ok"] == frames + 1, "the LoRA scale's guard is lost"


def test_automatic_dynamic_floats_stay_symbolic():
    """Under dynamic=None Dynamo makes a module's float symbolic only after it changed: the backend leaves it so (a
    second change compiles nothing, as with Inductor)."""
    model = Model()
    f = torch.compile(model, backend="tilecompile", options=compile_options())
    ids = torch.randint(0, 50, (2, 9))
    f(ids)
    frames = counters["frames"]["ok"]
    for eps, recompiled in ((1e-3, 1), (1e-2, 0)):
        for block in model.blocks:
            block.eps = eps
        assert_close(f(ids), model(ids), rtol=1e-5, atol=1e-6, name=f"loss at eps {eps}")
        assert counters["frames"]["ok"] == frames + recompiled, f"eps {eps}"
        frames = counters["frames"]["ok"]


def test_module_floats_leave_no_cpu_scalar_math(monkeypatch):
    """Under dynamic=True, no op of the compiled forward reads a module's float as a tensor (what AOTAutograd makes
    of a symbolic float: a float64 CPU scalar tensor, C++ kernels beside the GPU's); with the setting off, some do."""
    from torch._functorch.aot_autograd import aot_module_simplified

    forwards = []

    def inner(gm, example_inputs, *_):
        fw = lambda g, _: forwards.append(g) or g  # noqa: E731
        return aot_module_simplified(gm, example_inputs, fw_compiler=fw, bw_compiler=lambda g, _: g)

    monkeypatch.setattr(backend, "inner_compile", inner)

    def reads_of_float_tensors(specialize: bool) -> int:
        options = compile_options(specialize_module_floats=specialize)
        torch.compile(Model(), backend="tilecompile", dynamic=True, options=options)(torch.randint(0, 50, (2, 9)))
        gm = forwards[-1]
        vals = {n: n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")}
        scalars = {n for n, v in vals.items() if isinstance(v, torch.Tensor) and v.dtype == torch.float64}
        return sum(1 for n in gm.graph.nodes if n.op == "call_function" and scalars & set(n.all_input_nodes))

    assert reads_of_float_tensors(False) > 0, "the test no longer sees what it is about"
    assert reads_of_float_tensors(True) == 0


def test_pass_times_count_each_pass_once_per_graph():
    pipeline.reset_times()
    options = compile_options(layer_regions=True)  # every pass on, whatever the environment says
    f = torch.compile(Model(), backend="tilecompile", dynamic=True, options=options)
    f(torch.randint(0, 50, (2, 9))).backward()
    assert {name: t.runs for name, t in pipeline.TIMES.items()} == {
        **dict.fromkeys(pipeline.PASS_ORDER, 1),
        "snapshot": len(pipeline.PASS_ORDER),
        "check": len(pipeline.PASS_ORDER),
    }, pipeline.TIMES
    assert all(t.cpu_s >= 0 and t.wall_s > 0 for t in pipeline.TIMES.values())


def test_a_failing_specialization_costs_only_the_restart(monkeypatch):
    """Should torch's internals differ, the backend compiles as before: Dynamo restarts, the step is right."""

    def broken(gm):
        raise AttributeError("no TensorifyState here")

    monkeypatch.setattr(dynamo_floats, "specialize_untensorifiable_floats", broken)
    monkeypatch.setattr(dynamo_floats, "specialize_module_floats", broken)
    runs = _runs(monkeypatch)
    model = Model()
    f = torch.compile(model, backend="tilecompile", dynamic=True, options=compile_options(strict=False))
    ids = torch.randint(0, 50, (2, 9))
    assert_close(f(ids), model(ids), rtol=1e-5, atol=1e-6, name="loss")
    assert len(runs) == 2, "the restart this test is about did not happen"


def test_a_changed_float_outside_checkpoints_stays_symbolic():
    """A module float read outside any checkpoint: the first change recompiles, later ones do not; a float argument
    of another compiled function stays symbolic after a model with many module floats compiled."""

    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.alpha = 0.5

        def forward(self, x):
            return x * self.alpha + 1

    model, x = Scaled(), torch.randn(4, 3)
    f = torch.compile(model, backend="tilecompile", dynamic=True, options=compile_options())
    f(x)
    frames = counters["frames"]["ok"]
    for alpha, recompiled in ((0.25, 1), (0.125, 0), (0.0625, 0)):
        model.alpha = alpha
        assert_close(f(x), model(x), rtol=0, atol=0, name=f"alpha {alpha}")
        assert counters["frames"]["ok"] == frames + recompiled, f"alpha {alpha}"
        frames = counters["frames"]["ok"]

    class Norms(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norms = torch.nn.ModuleList(Scaled() for _ in range(60))

        def forward(self, x):
            for n in self.norms:
                x = n(x)
            return x

    torch.compile(Norms(), backend="tilecompile", dynamic=True, options=compile_options())(x)
    g = torch.compile(lambda x, t: x * t, backend="tilecompile", dynamic=True, options=compile_options())
    frames = counters["frames"]["ok"]
    for t in (0.5, 0.25, 0.125):
        g(x, t)
    assert counters["frames"]["ok"] == frames + 1, "a float argument was specialized"
