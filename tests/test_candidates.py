"""Every candidate a pass looks at ends in a rewrite or in a skip with its reason (issue 21).

A pass says which candidates it looked at (``PassResult.consider``) and decides each one (``rewrote`` / ``skip``);
the pipeline checks that none is left undecided (strict: ``PassFailed``; otherwise a skip saying it is a bug).
Here: that check itself, and the lm_head and MLP passes over their near-miss graphs, each candidate of which must
be decided (the ledger), with a reason of its own in the report."""

from __future__ import annotations

import pytest
import test_pass_fused_linear_ce as CE
import test_pass_tiled_mlp as MLP
import torch

import tilecompile
from tilecompile import config, pipeline
from tilecompile import reporting as R
from tilecompile.passes import lm_head, mlp


@pytest.fixture(autouse=True)
def _strict(monkeypatch):
    monkeypatch.setenv("TILECOMPILE_STRICT", "1")
    tilecompile.reset()
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def ledger(monkeypatch):
    """The PassResult of every run of the lm_head and MLP passes: (pass name, looked at, decided)."""
    seen = []
    for module in (lm_head, mlp):

        def spy(gm, ctx, _run=module.run, _name=module.NAME):
            result = _run(gm, ctx)
            seen.append((_name, dict(result.looked_at), set(result.decided)))
            return result

        monkeypatch.setattr(module, "run", spy)
    return seen


def _dropping_pass(gm, ctx):
    result = pipeline.PassResult()
    result.consider(next(iter(gm.graph.nodes)), "the first node")
    return result  # looked at, neither rewritten nor skipped


@pytest.mark.parametrize("strict", [True, False])
def test_pipeline_catches_a_candidate_dropped_without_a_reason(monkeypatch, strict):
    monkeypatch.setattr(lm_head, "run", _dropping_pass)
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    settings = config.load({"strict": strict, "tiled_mlp": False, "attention": False}, environ={})
    if strict:
        with pytest.raises(pipeline.PassFailed, match="the first node was looked at and dropped without a reason"):
            pipeline.run_passes(gm, settings)
        return
    pipeline.run_passes(gm, settings)
    (skip,) = tilecompile.report().skipped
    assert skip == R.Skip("fused_linear_ce", "the first node", "", "dropped without a reason (a bug in the pass)")


def _logits_plus_vector(m, h, y, b):
    # a per-row [..., 1] shift of the logits (not a [V] bias, which is fused): not math the fused op reads; the pass
    # used to drop such an add without a word
    return (m.lm_head(h) + b).log_softmax(-1).gather(-1, y.unsqueeze(-1)).squeeze(-1)


def _logits_of_logits(m, h, y):
    z = m.lm_head(h)
    return torch.log_softmax(z.exp(), -1).sum(-1)  # softmax of exp(z): not a form of z


LM_HEAD_NEAR_MISSES = [
    *((s, e) for s, e, _ in CE.NON_MATCHES),
    *((s, ()) for s, _ in CE.NOT_A_PARTITION),
    (CE._temperature_negative, ()),
    (CE._temperature_zero_scale, ()),
    (_logits_plus_vector, (torch.randn(3, 7, 1),)),
    (_logits_of_logits, ()),
]


@pytest.mark.parametrize(("spelling", "extra"), LM_HEAD_NEAR_MISSES, ids=lambda x: getattr(x, "__name__", ""))
def test_every_lm_head_candidate_ends_in_a_skip_with_a_reason(ledger, spelling, extra):
    CE.compile_and_compare(spelling, extra=extra, rewrites=0, bias=spelling is CE.with_bias)
    runs = [(looked, decided) for name, looked, decided in ledger if name == "fused_linear_ce"]
    assert runs and all(looked for looked, _ in runs), ledger  # the pass looked at the lm_head
    assert all(set(looked) == decided for looked, decided in runs), ledger
    skips = [s for s in tilecompile.report().skipped if s.pass_name == "fused_linear_ce"]
    assert len(skips) == sum(len(looked) for looked, _ in runs) and all(s.reason for s in skips), skips


def test_reason_for_logits_the_algebra_does_not_follow():
    rep = CE.compile_and_compare(_logits_plus_vector, extra=(torch.randn(3, 7, 1),), rewrites=0)
    (skip,) = rep.skipped
    assert "reach log_softmax" in skip.reason and "through add" in skip.reason, skip


class _ScaledNotGated(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP.NearMiss("not_gated")

    def forward(self, x):
        return self.mlp.down_proj(torch.nn.functional.silu(self.mlp.up_proj(x)) * 0.5)


@pytest.mark.parametrize("kind", [k for k, _ in MLP.NEAR_MISSES] + ["scaled_not_gated"])
def test_every_mlp_candidate_ends_in_a_skip_with_a_reason(ledger, kind):
    class Wrap(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = MLP.NearMiss(kind)

        def forward(self, x):
            return self.mlp(x)

    model = _ScaledNotGated() if kind == "scaled_not_gated" else Wrap()
    MLP._check_against_eager(model, torch.randn(2, 5, MLP.D))
    runs = [(looked, decided) for name, looked, decided in ledger if name == "tiled_mlp"]
    assert runs and all(set(looked) == decided for looked, decided in runs), ledger
    skips = MLP._skips()
    assert len(skips) == sum(len(looked) for looked, _ in runs) >= 1 and all(s.reason for s in skips), skips
    if kind == "scaled_not_gated":
        assert "not gated" in skips[0].reason and "a constant" in skips[0].reason, skips
