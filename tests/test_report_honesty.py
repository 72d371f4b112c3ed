"""The report never looks healthy while nothing was rewritten: a compile that raised counts no rewrite, a frame at
Dynamo's recompile limit is named as running eagerly, a skip reason names only causes that happened, Dynamo's graph
breaks are listed, and a transformers release outside the supported range gets one warning."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import compile_options

import tilecompile
import tilecompile.backend as backend
from tilecompile import releases


class _GatedMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(8, 16, bias=False)
        self.up = torch.nn.Linear(8, 16, bias=False)
        self.down = torch.nn.Linear(16, 8, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x)).sum()


def test_a_compile_that_raised_counts_no_rewrite(monkeypatch):
    """The passes rewrite the MLP, then the inner compile raises a data-dependent error (as HF's grouped_mm fallback
    backward did on CPU): Dynamo runs the frame another way, and the report counts no tiled MLP but names the error."""
    inner = backend.inner_compile
    calls = []

    def fails_once(gm, *args, **kwargs):
        calls.append(gm)
        if len(calls) == 1:
            raise torch._subclasses.fake_tensor.DataDependentOutputException(torch.ops.aten._local_scalar_dense.default)
        return inner(gm, *args, **kwargs)

    monkeypatch.setattr(backend, "inner_compile", fails_once)
    model = _GatedMLP()
    x = torch.randn(4, 8)
    out = torch.compile(model, backend="tilecompile", options=compile_options())(x)
    torch.testing.assert_close(out, model(x))
    rep = tilecompile.report()
    assert calls and rep.counts["tiled_mlp"] == 0 and not rep.rewrites, str(rep)
    assert len(rep.compile_errors) == 1 and "DataDependentOutputException" in rep.compile_errors[0].reason, str(rep)
    assert "compiles that raised" in str(rep)


def test_the_same_compile_succeeding_counts_its_rewrite():
    """The control of the test above: without the error the MLP counts once."""
    model = _GatedMLP()
    torch.compile(model, backend="tilecompile", options=compile_options())(torch.randn(4, 8))
    rep = tilecompile.report()
    assert rep.counts["tiled_mlp"] == 1 and not rep.compile_errors, str(rep)


_LOW_LIMIT = dict(recompile_limit=2, automatic_dynamic_shapes=False)


def test_recompile_limit_fallback_is_reported():
    """A Python int that changes every call recompiles the frame until Dynamo's limit; from then on it runs eagerly,
    and the report names the function, the limit and the last guard that failed."""

    def scaled(x, n):
        return (x * n).sin().sum()

    compiled = torch.compile(scaled, backend="tilecompile", options=compile_options())
    with torch._dynamo.config.patch(**_LOW_LIMIT):
        for n in range(4):
            compiled(torch.randn(3), n)
    rep = tilecompile.report()
    assert rep.graphs == 2, str(rep)
    (frame,) = rep.eager_frames
    assert "'scaled'" in frame.function and frame.limit == "recompile_limit=2" and "n ==" in frame.last_reason, rep
    assert "ran eagerly" in str(rep)


def test_other_backends_frames_are_not_reported():
    """The recompile-limit warning of a frame compiled by another backend is not tilecompile's to report."""

    def other(x, n):
        return (x + n).sum()

    compiled = torch.compile(other, backend="eager")
    with torch._dynamo.config.patch(**_LOW_LIMIT):
        for n in range(4):
            compiled(torch.randn(3), n)
    assert not tilecompile.report().eager_frames


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def test_model_compiled_without_its_loss_says_so():
    """The model compiled alone (its logits returned, the loss computed outside): no graph break and no FSDP2, so the
    lm_head's reason says to compile the function that computes the loss, and does not invent a break."""
    model = torch.compile(_tiny_llama(), backend="tilecompile", options=compile_options())
    ids = torch.randint(0, 97, (2, 8))
    logits = model(input_ids=ids, use_cache=False).logits
    F.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
    rep = tilecompile.report()
    (reason,) = [s.reason for s in rep.skipped if s.pass_name == "fused_linear_ce" and s.candidate == "lm_head"]
    assert "are what the compiled function returns" in reason, str(rep)
    assert "compile the function that computes the loss" in reason, str(rep)
    for invented in ("a graph break around", "another graph", "FSDP2", "LossHead", "Dynamo ended"):
        assert invented not in reason, reason
    assert not rep.breaks, str(rep)


def test_graph_breaks_are_listed():
    """A break in the compiled step (a print) is listed with its reason, so a report with fewer rewrites than
    expected shows why."""

    def step(x):
        y = x.sin()
        print("between")  # noqa: T201 - the graph break under test
        return y.cos().sum()

    torch.compile(step, backend="tilecompile", options=compile_options())(torch.randn(3))
    rep = tilecompile.report()
    assert rep.breaks and any("print" in r.lower() or "builtin" in r.lower() for r in rep.breaks), str(rep)
    assert "graph breaks since tilecompile.reset()" in str(rep)
    tilecompile.reset()
    assert not tilecompile.report().breaks


@pytest.mark.parametrize(
    "version,supported",
    [("4.57.6", False), ("5.2.0", False), ("5.3.0", True), ("5.10.4", True), ("5.25.3", True), ("5.26.0", False),
     ("6.0.0", False), ("5.25.0.dev0", True)],
)  # fmt: skip
def test_supported_range(version, supported):
    assert releases.transformers_supported(version) is supported


def test_a_release_outside_the_range_warns_once(monkeypatch):
    transformers = pytest.importorskip("transformers")
    monkeypatch.setattr(transformers, "__version__", "5.99.0")
    monkeypatch.setattr(releases, "_warned", set())
    with pytest.warns(UserWarning, match=r"transformers 5\.99\.0 is newer than the newest tested release"):
        torch.compile(lambda x: x.sin(), backend="tilecompile", options=compile_options())(torch.randn(3))
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.compile(lambda x: x.cos(), backend="tilecompile", options=compile_options())(torch.randn(3))


def test_pyproject_states_the_same_range():
    import pathlib

    import tomllib

    root = pathlib.Path(__file__).resolve().parents[1]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    (spec,) = [e for e in extras if e.startswith("transformers")]
    low, high = releases.TRANSFORMERS
    major, minor = (int(p) for p in high.split(".")[:2])
    assert spec == f"transformers>={low},<{major}.{minor + 1}", spec
