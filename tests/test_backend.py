"""The backend itself: registration, settings precedence, undo-on-failure, strict mode, report, logging."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.fx as fx
from helpers import assert_close, compile_options

import tilecompile
from tilecompile import config, pipeline, reporting
from tilecompile import reporting as R


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.fc(x)).sum()


def test_entry_point_registration_in_fresh_interpreter():
    code = textwrap.dedent(
        """
        import sys, torch
        assert "tilecompile" not in sys.modules
        f = torch.compile(lambda x: torch.sin(x) * 2, backend="tilecompile", options={"inner": "eager"})
        x = torch.randn(5)
        torch.testing.assert_close(f(x), torch.sin(x) * 2)
        import tilecompile
        assert tilecompile.report().graphs == 1, tilecompile.report()
        print("ok")
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TILECOMPILE_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


def test_defaults_and_env(monkeypatch):
    for name, _, _ in config.describe():
        monkeypatch.delenv(name, raising=False)
    s = config.load()
    assert (s.tiled_mlp, s.fused_linear_ce, s.tensor_parallel) == (True, True, True)
    assert (s.strict, s.inner) == (False, "inductor")
    monkeypatch.setenv("TILECOMPILE_TILED_MLP", "0")
    monkeypatch.setenv("TILECOMPILE_INNER", "aot_eager")
    s = config.load()
    assert s.tiled_mlp is False and s.inner == "aot_eager"


def test_options_win_over_env(monkeypatch):
    monkeypatch.setenv("TILECOMPILE_TILED_MLP", "0")
    monkeypatch.setenv("TILECOMPILE_MLP_CHUNK_TOKENS", "128")
    s = config.load({"tiled_mlp": 1, "TILECOMPILE_MLP_CHUNK_TOKENS": 256})
    assert s.tiled_mlp is True and s.mlp_chunk_tokens == 256
    ours, rest = config.split_options({"tiled_mlp": True, "max_autotune": False})
    assert ours == {"tiled_mlp": True} and rest == {"max_autotune": False}


def test_options_reach_the_passes_through_torch_compile(monkeypatch):
    monkeypatch.setenv("TILECOMPILE_FUSED_LINEAR_CE", "1")
    seen = []
    monkeypatch.setattr(pipeline, "load_pass", lambda name: seen.append(name) or _NoopPass)
    f = torch.compile(Tiny(), backend="tilecompile", options=compile_options(fused_linear_ce=False))
    f(torch.randn(2, 8))
    assert seen == ["canonical", "memory_plan", "tensor_parallel", "attention", "tiled_mlp", "layer_regions"]


class _NoopPass:
    @staticmethod
    def run(gm, ctx):
        return pipeline.PassResult()


@pytest.mark.parametrize(
    ("var", "value", "allowed"),
    [
        ("TILECOMPILE_TILED_MLP", "maybe", "1/0"),
        ("TILECOMPILE_INNER", "tvm", "inductor, aot_eager, eager"),
        ("TILECOMPILE_MLP_CHUNK_TOKENS", "-3", "integers >= 0"),
        ("TILECOMPILE_LOG", "loud", "warning, info, debug"),
    ],
)
def test_invalid_env_value_is_a_clear_error(monkeypatch, var, value, allowed):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=var) as err:
        config.load()
    assert allowed in str(err.value) and repr(value) in str(err.value)
    f = torch.compile(Tiny(), backend="tilecompile")
    with pytest.raises(Exception, match=var):
        f(torch.randn(2, 8))


def test_invalid_option_value_and_unknown_key():
    with pytest.raises(ValueError, match=r"options\['strict'\]"):
        config.load({"strict": "sometimes"})
    f = torch.compile(Tiny(), backend="tilecompile", options={"no_such_knob": 1})
    with pytest.raises(Exception, match="no_such_knob.*neither a tilecompile setting"):
        f(torch.randn(2, 8))


class _Broken:
    """A pass that rewrites the graph half-way and then raises: the pipeline must undo the half rewrite."""

    @staticmethod
    def run(gm, ctx):
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target is torch.relu:
                node.target = torch.sigmoid  # a change that must not survive
        raise RuntimeError("forced failure")


class _WrongShape:
    """A pass whose rewrite declares an expectation the new node does not meet."""

    @staticmethod
    def run(gm, ctx):
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and node.target is torch.relu:
                with gm.graph.inserting_after(node):
                    new = gm.graph.call_function(torch.sum, (node,), {"dim": -1})
                node.replace_all_uses_with(new, delete_user_cb=lambda u, new=new: u is not new)
                pipeline.expect(new, node.meta["example_value"])
        return pipeline.PassResult(rewrites=[R.Rewrite("tiled_mlp", "fc")])


@pytest.mark.parametrize("bad_pass", [_Broken, _WrongShape])
def test_failing_pass_is_undone_with_one_warning(monkeypatch, bad_pass):
    real = pipeline.load_pass
    monkeypatch.setattr(pipeline, "load_pass", lambda name: bad_pass if name == "tiled_mlp" else real(name))
    model = Tiny()
    x = torch.randn(3, 8)
    f = torch.compile(model, backend="tilecompile", options=compile_options(strict=False))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = f(x)
    ours = [w for w in caught if "tilecompile" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert "'tiled_mlp'" in str(ours[0].message) and "undone" in str(ours[0].message)
    assert_close(out, model(x), rtol=1e-6, atol=1e-6, name="output")
    rep = tilecompile.report()
    assert rep.counts["tiled_mlp"] == 0
    assert [f.pass_name for f in rep.failures] == ["tiled_mlp"]


@pytest.mark.parametrize("bad_pass", [_Broken, _WrongShape])
def test_strict_mode_raises(monkeypatch, bad_pass):
    real = pipeline.load_pass
    monkeypatch.setattr(pipeline, "load_pass", lambda name: bad_pass if name == "tiled_mlp" else real(name))
    f = torch.compile(Tiny(), backend="tilecompile", options=compile_options(strict=True))
    with pytest.raises(Exception, match="tiled_mlp"):
        f(torch.randn(3, 8))


def test_strict_from_env(monkeypatch):
    monkeypatch.setattr(pipeline, "load_pass", lambda name: _Broken)
    monkeypatch.setenv("TILECOMPILE_STRICT", "1")
    f = torch.compile(Tiny(), backend="tilecompile", options={"inner": "eager"})
    with pytest.raises(Exception, match="forced failure"):
        f(torch.randn(3, 8))


class _Reporting:
    @staticmethod
    def run(gm, ctx):
        return pipeline.PassResult(
            rewrites=[R.Rewrite("fused_linear_ce", "lm_head", {"h": (4, 8)}, {"h": "torch.float32"})],
            skipped=[R.Skip("fused_linear_ce", "linear_1", "model.head", "logits are returned from the graph")],
        )


def test_report_contents_and_reset(monkeypatch):
    monkeypatch.setattr(pipeline, "load_pass", lambda name: _Reporting if name == "fused_linear_ce" else _NoopPass)
    f = torch.compile(Tiny(), backend="tilecompile", options=compile_options())
    f(torch.randn(3, 8))
    rep = tilecompile.report()
    assert rep.counts == {**dict.fromkeys(reporting.PASS_NAMES, 0), "fused_linear_ce": 1}
    assert rep.rewrites[0].module_path == "lm_head" and rep.rewrites[0].shapes == {"h": (4, 8)}
    assert rep.skipped[0].reason == "logits are returned from the graph"
    text = str(rep)
    assert "fused_linear_ce=1" in text and "lm_head" in text and "logits are returned from the graph" in text
    tilecompile.reset()
    rep2 = tilecompile.report()
    assert rep2.counts == dict.fromkeys(reporting.PASS_NAMES, 0)
    assert rep2.rewrites == [] and rep2.skipped == [] and rep2.graphs == 0
    assert rep.counts["fused_linear_ce"] == 1  # an earlier snapshot is not changed by reset()


def test_dynamo_restart_is_reported_once(monkeypatch):
    """Under dynamic=True AOTAutograd specialises a symbolic float (here the exponent, an attribute of the module,
    left symbolic by the setting) by making Dynamo restart its analysis: the backend runs twice for one graph, and
    only the last run counts."""
    from tilecompile import backend

    runs = []
    monkeypatch.setattr(backend, "run_passes", lambda gm, *a: runs.append(gm) or pipeline.run_passes(gm, *a))

    class GatedPow(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate, self.up, self.down = (torch.nn.Linear(8, 8, bias=False) for _ in range(3))
            self.p = 2.0

        def forward(self, x):
            return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x)).pow(self.p).mean()

    x = torch.randn(3, 5, 8, requires_grad=True)
    for specialize, expected_runs in ((False, 2), (True, 1)):  # a module's float is a constant by default
        runs.clear()
        tilecompile.reset()
        torch._dynamo.reset()
        options = compile_options(specialize_module_floats=specialize)
        torch.compile(GatedPow(), backend="tilecompile", dynamic=True, options=options)(x).backward()
        rep = tilecompile.report()
        assert len(runs) == expected_runs, f"specialize_module_floats={specialize}: {len(runs)} runs"
        assert rep.graphs == 1 and rep.counts["tiled_mlp"] == 1, rep


def test_passes_run_in_nested_graphs(monkeypatch):
    """Bodies of activation-checkpoint regions are GraphModules of their own; every pass sees each one."""
    seen = []

    class _Spy:
        @staticmethod
        def run(gm, ctx):
            seen.append((ctx.graph_name, any(n.op == "call_function" for n in gm.graph.nodes)))
            return pipeline.PassResult()

    monkeypatch.setattr(pipeline, "load_pass", lambda name: _Spy if name == "tiled_mlp" else _NoopPass)
    fc = torch.nn.Linear(8, 8)

    def fn(x):
        return torch.utils.checkpoint.checkpoint(lambda t: torch.relu(fc(t)), x, use_reentrant=False).sum()

    out = torch.compile(fn, backend="tilecompile", options=compile_options())(torch.randn(2, 8, requires_grad=True))
    out.backward()
    assert seen[0][0] == "<root>" and any(name.startswith("wrap_body") for name, _ in seen), seen


def test_logging_info(monkeypatch, caplog):
    monkeypatch.setattr(pipeline, "load_pass", lambda name: _Reporting if name == "fused_linear_ce" else _NoopPass)
    with caplog.at_level(logging.INFO, logger="tilecompile"):
        f = torch.compile(Tiny(), backend="tilecompile", options=compile_options(log="info"))
        f(torch.randn(3, 8))
    messages = [r.getMessage() for r in caplog.records if r.name == "tilecompile"]
    assert any("rewrote lm_head" in m for m in messages), messages
    assert any("skipped linear_1" in m for m in messages), messages


@pytest.mark.parametrize("inner", ["eager", "aot_eager"])
def test_inner_compilers_match_eager(inner):
    model = Tiny()
    x = torch.randn(4, 8, requires_grad=True)
    f = torch.compile(model, backend="tilecompile", options=compile_options(inner=inner))
    out = f(x)
    out.backward()
    gx = x.grad.clone()
    x.grad = None
    ref = model(x)
    ref.backward()
    assert_close(out, ref, rtol=1e-6, atol=1e-6, name="out")
    assert_close(gx, x.grad, rtol=1e-6, atol=1e-6, name="dx")


def test_inductor_is_the_default_inner_compiler(monkeypatch):
    import torch._inductor.compile_fx as cfx

    calls = []

    def fake_compile_fx(gm, example_inputs, config_patches=None):
        calls.append(config_patches)
        return gm.forward

    monkeypatch.setattr(cfx, "compile_fx", fake_compile_fx)
    monkeypatch.delenv("TILECOMPILE_INNER", raising=False)
    f = torch.compile(Tiny(), backend="tilecompile", mode="max-autotune-no-cudagraphs")
    f(torch.randn(2, 8))
    assert len(calls) == 1 and calls[0].get("max_autotune") is True


def test_inductor_caches_are_keyed_by_tilecompile_source(monkeypatch, tmp_path):
    """Inductor's cache keys cannot see what a custom op does, so the backend tags them with a digest of its own
    source while the inner compile runs (and only then); the digest changes with any byte of that source."""
    import torch._inductor.compile_fx as cfx

    from tilecompile import backend

    seen = []

    def fake_compile_fx(gm, example_inputs, config_patches=None):
        seen.append(torch.compiler.config.cache_key_tag)
        return gm.forward

    monkeypatch.setattr(cfx, "compile_fx", fake_compile_fx)
    with torch.compiler.config.patch(cache_key_tag="user-tag"):
        torch.compile(Tiny(), backend="tilecompile", options={"inner": "inductor"})(torch.randn(2, 8))
        assert seen == [f"user-tag|{backend.cache_tag()}"]
        assert torch.compiler.config.cache_key_tag == "user-tag"
    # the digest covers every source file of the passes, their packages' stages included: a copy with one byte
    # changed in a stage hashes differently
    import shutil

    import tilecompile.passes as passes_pkg

    shutil.copytree(passes_pkg.__path__[0], tmp_path / "passes", ignore=shutil.ignore_patterns("__pycache__"))
    before = backend.cache_tag()
    monkeypatch.setattr(passes_pkg, "__path__", [str(tmp_path / "passes")])
    backend.cache_tag.cache_clear()
    try:
        assert backend.cache_tag() == before  # the same bytes elsewhere: the same digest
        with open(tmp_path / "passes" / "lm_head" / "rewrite.py", "ab") as fh:
            fh.write(b"\n")
        backend.cache_tag.cache_clear()
        assert backend.cache_tag() != before
    finally:
        monkeypatch.undo()
        backend.cache_tag.cache_clear()


@pytest.mark.slow
def test_inductor_cpu_end_to_end():
    model = Tiny()
    x = torch.randn(4, 8)
    f = torch.compile(model, backend="tilecompile", options={"strict": True})
    assert_close(f(x), model(x), rtol=1e-5, atol=1e-5, name="out")
    assert tilecompile.report().graphs == 1


def test_pipeline_restores_graph_on_failure_directly():
    gm = fx.symbolic_trace(Tiny())
    before = gm.code
    settings = config.load({"strict": False, "tensor_parallel": False, "fused_linear_ce": False})
    real = pipeline.load_pass
    try:
        pipeline.load_pass = lambda name: _Broken
        with pytest.warns(UserWarning, match="forced failure"):
            pipeline.run_passes(gm, settings)
    finally:
        pipeline.load_pass = real
    assert gm.code == before


def test_dynamic_graphs_turn_off_inductor_mix_order_reduction(monkeypatch):
    """torch 2.11's mix-order reduction miscomputes its workspace slice under symbolic token counts (issue #13):
    a dynamic graph compiles without it, a static one keeps Inductor's default, and a user's own setting wins."""
    import torch._inductor.compile_fx as cfx

    seen = []

    def fake_compile_fx(gm, example_inputs, config_patches=None):
        seen.append(dict(config_patches or {}))
        return gm.forward

    monkeypatch.setattr(cfx, "compile_fx", fake_compile_fx)
    monkeypatch.delenv("TILECOMPILE_INNER", raising=False)
    fn = lambda x: torch.nn.functional.rms_norm(x, (x.shape[-1],)).sum()  # noqa: E731
    torch.compile(fn, backend="tilecompile", dynamic=True)(torch.randn(5, 8))
    torch._dynamo.reset()
    torch.compile(fn, backend="tilecompile", dynamic=False)(torch.randn(5, 8))
    torch._dynamo.reset()
    options = {"triton.mix_order_reduction": True}
    torch.compile(fn, backend="tilecompile", dynamic=True, options=options)(torch.randn(5, 8))
    key = "triton.mix_order_reduction"
    assert [p.get(key) for p in seen] == [False, None, True], seen


def _optional_fast_path(x):
    y = x.cos()
    try:
        from tilecompile_no_such_module import fast  # noqa: F401 - absent: the fallback below runs
    except ImportError:
        return y.sin() * 2
    return x


def _required_module(x):
    import tilecompile_no_such_module  # noqa: F401

    return x


def test_failed_import_in_compiled_code_is_traced_like_python():
    """A failed import raises ImportError inside the graph (its except branch is traced): one graph, no break."""
    from torch._dynamo.utils import counters

    x = torch.randn(5)
    counters.clear()
    out = torch.compile(_optional_fast_path, backend="tilecompile", options=compile_options())(x)
    assert_close(out, x.cos().sin() * 2, rtol=0, atol=0)
    assert tilecompile.report().graphs == 1 and counters["frames"]["total"] == 1, dict(counters["frames"])
    with pytest.raises(ImportError, match="tilecompile_no_such_module"):  # unhandled: raised as eager raises it
        torch.compile(_required_module, backend="tilecompile", options=compile_options())(x)


def test_failed_import_breaks_the_graph_when_switched_off_and_for_other_backends():
    from torch._dynamo.utils import counters

    x = torch.randn(5)
    for backend, options in (("tilecompile", compile_options(trace_import_errors=False)), ("eager", None)):
        torch._dynamo.reset()
        counters.clear()
        out = torch.compile(_optional_fast_path, backend=backend, options=options)(x)
        assert_close(out, x.cos().sin() * 2, rtol=0, atol=0)
        assert counters["frames"]["total"] > 1 and counters["stats"]["unique_graphs"] != 1, (backend, counters)


_DDP_SCRIPT = """
import os, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
dist.init_process_group("gloo", rank=0, world_size=1)

class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        try:
            import tilecompile_no_such_module  # noqa: F401
        except ImportError:
            y = y * 2
        return self.lin(y).sum()

model = torch.nn.parallel.DistributedDataParallel(M())
torch.compile(model, backend="tilecompile", options={"strict": True, "inner": "aot_eager"})(torch.randn(2, 4))
print("GRAPHS", torch._dynamo.utils.counters["stats"]["unique_graphs"])
dist.destroy_process_group()
"""


def test_failed_import_is_traced_under_ddp_too():
    """Under DDP, Dynamo's compiler is DDPOptimizer.compile_fn wrapping the backend: the import is still traced
    (it was not, and the module's whole forward then ran eager: no graph)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {**os.environ, "PORT": port}
    done = subprocess.run([sys.executable, "-c", _DDP_SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "GRAPHS 1" in done.stdout, done.stdout + done.stderr[-3000:]
