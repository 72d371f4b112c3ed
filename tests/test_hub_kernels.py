"""tilecompile/hub_kernels.py: the `kernels` package's routing variable, set around every attention forward of
transformers >= 5.25, does not break checkpointed layers out of the graph when it routes nowhere, and is left alone
(eager, kernelized modules) everywhere else.

The first tests use a stand-in module of the same shape as ``kernels._internals.layer.layer`` (written here), so they
run without `kernels`; the last runs the real package where it is installed (CI's compatibility stage)."""

from __future__ import annotations

import contextvars
import inspect
import json
import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch
from helpers import assert_close, compile_options
from torch.utils.checkpoint import checkpoint

import tilecompile
from tilecompile import hub_kernels


class _RoutingVar:
    """The stand-in: a ContextVar in eager, a global attribute (a side effect for Dynamo) while compiling."""

    def __init__(self, name):
        self.context_var = contextvars.ContextVar(name, default=None)
        self.global_var = None
        self.uses_global_var = False

    def get(self):
        if self.uses_global_var or torch.compiler.is_compiling():
            return self.global_var
        return self.context_var.get()

    def set(self, value):
        if self.uses_global_var or torch.compiler.is_compiling():
            previous, self.global_var, self.uses_global_var = self.global_var, value, True
            return previous
        return self.context_var.set(value)

    def reset(self, token):
        if self.uses_global_var:
            self.global_var, self.uses_global_var = token, token is not None
        else:
            self.context_var.reset(token)


class _Func(torch.nn.Module):
    """A routable function (as ``use_kernel_forward_from_hub`` makes one): the kernel when routed, else the math."""

    def forward(self, x):
        return torch.sin(x)


class _Kernel(_Func):
    def forward(self, x):
        return torch.sin(x) * 2  # a "kernel" that differs, so that routing to it shows


@pytest.fixture
def routing(monkeypatch):
    """A fresh stand-in module in the place of kernels' layer module, installed; yields the routing variable."""
    module = types.ModuleType("kernels._internals.layer.layer")
    module.CompileableContextVar = type("CompileableContextVar", (_RoutingVar,), {})
    monkeypatch.setitem(__import__("sys").modules, "kernels._internals.layer.layer", module)
    monkeypatch.setattr(hub_kernels, "_installed", None)
    var = module.CompileableContextVar("_ACTIVE_KERNEL_FUNCS")
    assert hub_kernels.install()
    return var


class _Layer(torch.nn.Module):
    """An attention-like layer wrapped as ``use_kernelized_func`` wraps one: the routing set around its forward."""

    def __init__(self, var, wrapper):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.var, self.__dict__["wrapper"] = var, wrapper

    def forward(self, x):
        token = self.var.set({id(_Func): (self.wrapper, self.wrapper.forward.__func__)})
        try:
            routed = self.var.get()
            entry = routed.get(id(_Func)) if routed is not None else None
            if entry is not None and entry[1] is not type(self.wrapper).forward:
                y = entry[1](self.wrapper, self.proj(x))
            else:
                y = torch.sin(self.proj(x))
            return y
        finally:
            self.var.reset(token)


class _Model(torch.nn.Module):
    def __init__(self, var, wrapper):
        super().__init__()
        self.layers = torch.nn.ModuleList(_Layer(var, wrapper) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False)
        return x.square().mean()


def _run(var, wrapper):
    torch.manual_seed(0)
    model = _Model(var, wrapper).double()
    x = torch.randn(4, 8, dtype=torch.float64)
    loss = torch.compile(model, backend="tilecompile", options=compile_options())(x)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    expected = model(x)
    expected.backward()
    assert_close(loss, expected, rtol=1e-12, atol=1e-14, name="loss")
    for g, p in zip(grads, model.parameters()):
        assert_close(g, p.grad, rtol=1e-12, atol=1e-14, name="grad")
    return tilecompile.report(), loss.item()


def test_routing_nowhere_stays_in_one_graph(routing):
    """Nothing kernelized: the checkpointed layers trace whole (one graph), as without the wrapper."""
    rep, _ = _run(routing, _Func())
    assert rep.graphs == 1, str(rep)
    assert routing.global_var is None and not routing.uses_global_var


def test_kernelized_module_keeps_its_routing(routing):
    """A module routed to a kernel keeps the original behaviour (the set happens; Dynamo breaks the graph at it, as
    before): compiled and eager both compute the kernel's result, not the plain function's."""
    wrapper = _Func()
    wrapper.forward = types.MethodType(_Kernel.forward, wrapper)  # what kernelize does
    _, routed = _run(routing, wrapper)
    tilecompile.reset()
    torch._dynamo.reset()
    _, plain = _run(routing, _Func())
    assert abs(routed - plain) > 1e-3, (routed, plain)


def test_without_the_patch_the_layers_leave_the_graph(routing, monkeypatch):
    """The failure the patch removes: with the original set, the checkpointed layers do not trace whole."""
    cls = type(routing)
    monkeypatch.setattr(cls, "set", cls.set.__wrapped__)
    monkeypatch.setattr(cls, "reset", cls.reset.__wrapped__)
    rep, _ = _run(routing, _Func())
    assert rep.graphs != 1, str(rep)


def test_eager_calls_are_untouched(routing):
    token = routing.set({id(_Func): (_Func(), _Func.forward)})
    assert isinstance(token, contextvars.Token) and routing.get() is not None
    routing.reset(token)
    assert routing.get() is None and not routing.uses_global_var


def test_routes_nowhere():
    f = _Func()
    assert hub_kernels.routes_nowhere({1: (f, _Func.forward)})
    assert hub_kernels.routes_nowhere({})
    assert not hub_kernels.routes_nowhere({1: (f, _Kernel.forward)})
    assert not hub_kernels.routes_nowhere(None) and not hub_kernels.routes_nowhere({1: f})


def test_real_kernels_package_is_patched():
    """Where `kernels` is installed (transformers 5.25 requires it): its variable is the one patched."""
    layer = pytest.importorskip("kernels._internals.layer.layer")
    import tilecompile.backend  # noqa: F401 - the backend installs the patch when loaded

    assert hub_kernels.install()
    assert layer.CompileableContextVar.set.__name__ == "set" and hasattr(layer.CompileableContextVar.set, "__wrapped__")


def _fresh_python(tmp_path, code: str) -> str:
    """Runs ``code`` in a new interpreter (nothing imported yet), from ``tmp_path`` (first on its path); its stdout."""
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def test_kernels_imported_after_tilecompile_is_patched_on_import(tmp_path):
    """transformers imports `kernels` when a model is built, after ``import tilecompile`` and before Dynamo's first
    trace: the patch must be in place by then (the backend's first call is too late for that frame). A stand-in
    package of the real module's shape stands first on the path."""
    layer = tmp_path / "kernels" / "_internals" / "layer"
    layer.mkdir(parents=True)
    for folder in (layer.parent.parent, layer.parent, layer):
        (folder / "__init__.py").write_text("")
    (layer / "layer.py").write_text(inspect.getsource(_RoutingVar).replace("_RoutingVar", "CompileableContextVar"))
    (layer / "layer.py").write_text("import contextvars\nimport torch\n\n" + (layer / "layer.py").read_text())
    out = _fresh_python(
        tmp_path,
        f"""
        import sys
        import tilecompile.backend
        assert {hub_kernels.MODULE!r} not in sys.modules
        import kernels._internals.layer.layer as layer
        print(layer.__file__, hasattr(layer.CompileableContextVar.set, "__wrapped__"))
        """,
    )
    path, patched = out.split()
    assert path.startswith(str(tmp_path)) and patched == "True", out


def test_user_order_keeps_checkpointed_layers_in_one_graph(tmp_path):
    """The user's order on a transformers release that routes through `kernels` (5.25 requires it): import
    tilecompile, build a checkpointed model (transformers imports kernels here), compile, one step. Every layer is
    rewritten in one graph. Skips where building the model does not import kernels."""
    pytest.importorskip("transformers")
    out = _fresh_python(
        tmp_path,
        f"""
        import json, sys
        import torch, tilecompile, transformers
        cfg = transformers.Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                       num_attention_heads=4, num_key_value_heads=2)
        model = transformers.Qwen2ForCausalLM(cfg).train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={{"use_reentrant": False}})
        model.config.use_cache = False
        if {hub_kernels.MODULE!r} not in sys.modules:
            print(json.dumps(None)); raise SystemExit
        ids = torch.randint(0, 97, (2, 9))
        step = torch.compile(lambda m, x: m(input_ids=x, labels=x).loss, backend="tilecompile",
                             options=dict(strict=True, inner="aot_eager", mlp_min_tokens=0))
        step(model, ids).backward()
        rep = tilecompile.report()
        print(json.dumps(dict(graphs=rep.graphs, counts=rep.counts, breaks=sum(rep.breaks.values()))))
        """,
    )
    seen = json.loads(out.strip().splitlines()[-1])
    if seen is None:
        pytest.skip("building the model did not import kernels (this transformers does not route through it)")
    assert seen["graphs"] == 1 and seen["breaks"] == 0, seen
    assert seen["counts"]["attention"] == 3 and seen["counts"]["tiled_mlp"] == 3, seen
