"""fused_linear_ce pass: every spelling of log-prob / entropy / cross-entropy on an lm_head fires and matches eager
(outputs and gradients); every non-match is left alone with its reason in the report; tiny Hugging Face models
(Llama, Qwen2, Qwen3) compiled through RL and SFT step functions get exactly one rewrite and eager's gradients."""

from __future__ import annotations

import copy
import math
import operator

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from helpers import assert_close, assert_grads_close
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import tilecompile
from tilecompile import config, pipeline
from tilecompile import graph as G
from tilecompile.backend import tilecompile_backend

D, V = 16, 37
OPTIONS = {"strict": True, "inner": "aot_eager", "tiled_mlp": False}


@pytest.fixture(autouse=True)
def _strict(monkeypatch):
    monkeypatch.setenv("TILECOMPILE_STRICT", "1")
    tilecompile.reset()
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# ------------------------------------------------------------------------------------------------- harness


class Head(torch.nn.Module):
    """An lm_head (``lm_head``) followed by one spelling of the math: ``spelling(self, h, labels, *extra)``."""

    def __init__(self, spelling, bias: bool = False) -> None:
        super().__init__()
        self.lm_head = torch.nn.Linear(D, V, bias=bias)
        self.spelling = spelling

    def forward(self, h, labels, *extra):
        return self.spelling(self, h, labels, *extra)


def _outputs(out) -> list[torch.Tensor]:
    return [o for o in (out if isinstance(out, tuple | list) else (out,)) if isinstance(o, torch.Tensor)]


def compile_and_compare(spelling, labels=None, extra=(), batch=(3, 7), rewrites=1, options=None, bias=False):
    """Compile ``Head(spelling)``; outputs and gradients (h and weight) must equal eager's. Returns the report."""
    torch.manual_seed(0)
    model = Head(spelling, bias=bias)
    reference = copy.deepcopy(model)
    h = torch.randn(*batch, D, requires_grad=True)
    labels = torch.randint(0, V, batch) if labels is None else labels
    h_ref = h.detach().clone().requires_grad_()
    expected = _outputs(reference(h_ref, labels, *extra))
    compiled = torch.compile(model, backend="tilecompile", options={**OPTIONS, **(options or {})})
    actual = _outputs(compiled(h, labels, *extra))
    rep = tilecompile.report()
    assert rep.counts["fused_linear_ce"] == rewrites, rep
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert a.dtype == e.dtype, (i, a.dtype, e.dtype)
        assert_close(a, e, rtol=1e-5, atol=1e-5, name=f"output {i}")
    pairs = [(a, e) for a, e in zip(actual, expected) if e.requires_grad]
    if pairs:
        grads = [torch.randn_like(e) for _, e in pairs]
        torch.autograd.backward([a for a, _ in pairs], grads)
        torch.autograd.backward([e for _, e in pairs], grads)
        assert_close(h.grad, h_ref.grad, rtol=1e-5, atol=1e-5, name="grad of h")
        assert_grads_close(model, reference, rtol=1e-5, atol=1e-5)
    return rep


def compiled_graphs(fn, *args, **options) -> list[fx.GraphModule]:
    """The graphs tilecompile hands to its inner compiler when compiling ``fn(*args)``."""
    graphs: list[fx.GraphModule] = []

    def backend(gm, example_inputs):
        compiled = tilecompile_backend(gm, example_inputs, options={**OPTIONS, **options})
        graphs.append(gm)
        return compiled

    torch.compile(fn, backend=backend)(*args)
    return graphs


def fused_calls(gm: fx.GraphModule) -> list[fx.Node]:
    target = torch.ops.tilecompile.fused_linear_logprob.default
    return [n for _, sub in G.graph_modules(gm) for n in sub.graph.nodes if n.target is target]


def with_ignored(labels: torch.Tensor, value: int = -100, every: int = 3) -> torch.Tensor:
    labels = labels.clone()
    labels.view(-1)[::every] = value
    return labels


# ------------------------------------------------------------------------------------------------ spellings


def lp_functions(m, h, y):
    return torch.gather(F.log_softmax(m.lm_head(h), dim=-1), -1, y.unsqueeze(-1)).squeeze(-1)


def lp_methods(m, h, y):
    return m.lm_head(h).log_softmax(-1).gather(-1, y[..., None]).squeeze(-1)


def lp_gather_minus_logsumexp(m, h, y):
    z = m.lm_head(h).float()
    return z.gather(-1, y.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)


def lp_minus_keepdim_logsumexp(m, h, y):
    z = m.lm_head(h)
    logp = z - z.logsumexp(-1, keepdim=True)
    return torch.take_along_dim(logp, y.unsqueeze(-1), dim=-1).squeeze(-1)


def lp_neg_cross_entropy(m, h, y):
    z = m.lm_head(h)
    return -F.cross_entropy(z.view(-1, V), y.view(-1), reduction="none").view(y.shape)


def lp_nll_loss(m, h, y):
    logp = F.log_softmax(m.lm_head(h).flatten(0, 1), dim=-1)
    return -F.nll_loss(logp, y.flatten(), reduction="none")


def lp_lse_of_flat_view(m, h, y):
    z = m.lm_head(h)
    lse = z.view(-1, V).logsumexp(-1).view(y.shape)
    return z.gather(-1, y.unsqueeze(-1)).squeeze(-1) - lse


def entropy_verl(m, h, y):
    z = m.lm_head(h)
    pd = F.softmax(z, dim=-1)
    return torch.logsumexp(z, dim=-1) - torch.sum(pd * z, dim=-1)


def entropy_p_logp(m, h, y):
    z = m.lm_head(h).float()
    return -(F.softmax(z, -1) * F.log_softmax(z, -1)).sum(-1)


def entropy_exp_logp(m, h, y):
    logp = m.lm_head(h).log_softmax(dim=-1)
    return -torch.sum(torch.exp(logp) * logp, dim=-1)


def ce_mean(m, h, y):
    return F.cross_entropy(m.lm_head(h).view(-1, V), y.view(-1), ignore_index=-100)


def ce_sum(m, h, y):
    return F.cross_entropy(m.lm_head(h).reshape(-1, V), y.reshape(-1), reduction="sum")


def ce_mean_ignore_7(m, h, y):
    return F.cross_entropy(m.lm_head(h).view(-1, V).float(), y.view(-1), ignore_index=7, reduction="mean")


CE_MODULE = torch.nn.CrossEntropyLoss(ignore_index=-100, reduction="sum")


def ce_module(m, h, y):
    return CE_MODULE(m.lm_head(h).flatten(0, -2), y.flatten())


def ce_hf_mean(m, h, y):
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss(m.lm_head(h), y, vocab_size=V)


def ce_hf_num_items(m, h, y):
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss(m.lm_head(h), y, vocab_size=V, num_items_in_batch=torch.tensor(9))


def logp_entropy_ce_together(m, h, y):
    z = m.lm_head(h)
    logp = z.log_softmax(-1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
    ent = torch.logsumexp(z, dim=-1) - (F.softmax(z, dim=-1) * z).sum(-1)
    ce = F.cross_entropy(z.view(-1, V), y.view(-1))
    return logp, ent, ce


def shifted(m, h, y):
    z = m.lm_head(h)[:, :-1]
    logp = z.log_softmax(-1).gather(-1, y[:, 1:].unsqueeze(-1)).squeeze(-1)
    return logp, entropy_of(z)


def entropy_of(z):
    return torch.logsumexp(z, dim=-1) - torch.sum(F.softmax(z, dim=-1) * z, dim=-1)


def temperature_div(m, h, y):
    z = m.lm_head(h).float() / 0.7
    return z.log_softmax(-1).gather(-1, y.unsqueeze(-1)).squeeze(-1), entropy_of(z)


def temperature_mul(m, h, y):
    z = 1.25 * m.lm_head(h)
    return F.cross_entropy(z.flatten(0, 1), y.flatten(), reduction="none")


def temperature_inplace(m, h, y):
    z = m.lm_head(h)[:, :-1]
    z.div_(0.6)
    return z.log_softmax(-1).gather(-1, y[:, 1:].unsqueeze(-1)).squeeze(-1), entropy_of(z)


def temperature_tensor(m, h, y, t):
    z = m.lm_head(h).float() / t
    return z.log_softmax(-1).gather(-1, y.unsqueeze(-1)).squeeze(-1), entropy_of(z)


def two_views(m, h, y):
    z = m.lm_head(h)
    return entropy_of(z), F.cross_entropy(z.view(-1, V), y.view(-1), reduction="sum")


def selected_rows(m, h, y, rows):
    z = m.lm_head(h.flatten(0, 1))[rows]
    return z.log_softmax(-1).gather(-1, y.flatten()[rows].unsqueeze(-1)).squeeze(-1)


def entropy_only_shifted(m, h, y):
    return entropy_of(m.lm_head(h)[:, :-1].float())


def trl_selective_log_softmax(logits, index):
    """TRL's GRPO log-prob: gather − a row-by-row logsumexp for fp32, a row-by-row log_softmax otherwise."""
    if logits.dtype in [torch.float32, torch.float64]:
        selected_logits = torch.gather(logits, dim=-1, index=index.unsqueeze(-1)).squeeze(-1)
        logsumexp_values = torch.stack([torch.logsumexp(lg, dim=-1) for lg in logits])
        return selected_logits - logsumexp_values
    per_token_logps = []
    for row_logits, row_labels in zip(logits, index):
        row_logps = F.log_softmax(row_logits, dim=-1)
        per_token_logps.append(row_logps.gather(dim=-1, index=row_labels.unsqueeze(-1)).squeeze(-1))
    return torch.stack(per_token_logps)


def lp_trl_fp32(m, h, y):
    return trl_selective_log_softmax(m.lm_head(h)[:, :-1] / 0.9, y[:, 1:])


MATCHES = [
    lp_functions,
    lp_methods,
    lp_gather_minus_logsumexp,
    lp_minus_keepdim_logsumexp,
    lp_neg_cross_entropy,
    lp_nll_loss,
    lp_lse_of_flat_view,
    entropy_verl,
    entropy_p_logp,
    entropy_exp_logp,
    logp_entropy_ce_together,
    shifted,
    temperature_div,
    temperature_mul,
    temperature_inplace,
    two_views,
    entropy_only_shifted,
    lp_trl_fp32,
]


@pytest.mark.parametrize("spelling", MATCHES)
def test_spelling_fires_and_matches_eager(spelling):
    rep = compile_and_compare(spelling)
    (rw,) = rep.rewrites
    assert rw.module_path == "lm_head"
    assert rw.shapes["N/D/V"][1:] == (D, V)
    assert rw.dtypes["weight"] == "torch.float32"


@settings(max_examples=max(10, settings.default.max_examples // 100))  # each example compiles: 10 in CI, 100 long
@given(
    shift=st.booleans(),
    upcast=st.booleans(),
    temperature=st.sampled_from([None, "div", "mul", "inplace", "tensor"]),
    logp=st.sampled_from([None, "log_softmax", "gather_lse", "ce_none", "flat_lse", "nll_reshaped"]),
    entropy=st.sampled_from([None, "verl", "p_logp", "exp_logp"]),
    entropy_no_grad=st.booleans(),
    ce=st.sampled_from([None, "mean", "sum"]),
)
def test_combinations_of_spellings(shift, upcast, temperature, logp, entropy, entropy_no_grad, ce):
    """Any mix of producer steps and consumers on the same logits: one rewrite, eager's outputs and grads."""
    assume(logp or entropy or ce)
    tilecompile.reset()
    torch._dynamo.reset()

    def spelling(m, h, y, t):
        z = m.lm_head(h)
        if shift:
            z, y = z[:, :-1], y[:, 1:]
        if upcast:
            z = z.float()
        if temperature == "div":
            z = z / 0.8
        elif temperature == "mul":
            z = 1.3 * z
        elif temperature == "inplace":
            z.div_(0.8)
        elif temperature == "tensor":
            z = z / t
        outs = []
        if logp == "log_softmax":
            outs.append(lp_of(z, y))
        elif logp == "gather_lse":
            outs.append(z.gather(-1, y.unsqueeze(-1)).squeeze(-1) - z.logsumexp(-1))
        elif logp == "ce_none":
            outs.append(-F.cross_entropy(z.reshape(-1, V), y.reshape(-1), reduction="none"))
        elif logp == "flat_lse":
            outs.append(z.gather(-1, y.unsqueeze(-1)).squeeze(-1) - z.reshape(-1, V).logsumexp(-1).view(y.shape))
        elif logp == "nll_reshaped":
            outs.append(-F.nll_loss(z.log_softmax(-1).reshape(-1, V), y.reshape(-1), reduction="none"))
        with torch.set_grad_enabled(not entropy_no_grad):
            if entropy == "verl":
                outs.append(entropy_of(z))
            elif entropy == "p_logp":
                outs.append(-(F.softmax(z, -1) * F.log_softmax(z, -1)).sum(-1))
            elif entropy == "exp_logp":
                lp = z.log_softmax(-1)
                outs.append(-(lp.exp() * lp).sum(-1))
        if ce:
            outs.append(F.cross_entropy(z.reshape(-1, V), y.reshape(-1), reduction=ce))
        return tuple(outs)

    compile_and_compare(spelling, extra=(torch.tensor(0.8),))


@pytest.mark.parametrize("spelling", [ce_mean, ce_sum, ce_mean_ignore_7, ce_module, ce_hf_mean, ce_hf_num_items])
def test_cross_entropy_reductions_with_ignored_labels(spelling):
    if spelling in (ce_hf_mean, ce_hf_num_items):
        pytest.importorskip("transformers")
    torch.manual_seed(1)
    labels = with_ignored(torch.randint(0, V, (3, 7)), value=7 if spelling is ce_mean_ignore_7 else -100)
    rep = compile_and_compare(spelling, labels=labels)
    assert "cross_entropy" in rep.rewrites[0].detail


def test_ce_none_with_ignore_index_gives_zero_rows():
    def spelling(m, h, y):
        return -F.cross_entropy(m.lm_head(h).view(-1, V), y.view(-1), ignore_index=0, reduction="none")

    labels = with_ignored(torch.randint(1, V, (3, 7)), value=0)
    compile_and_compare(spelling, labels=labels)


def test_mean_cross_entropy_of_all_ignored_labels_is_nan_like_eager():
    labels = torch.full((2, 5), -100)
    compile_and_compare(ce_mean, labels=labels, batch=(2, 5))


def test_trl_row_by_row_log_softmax():
    # TRL's branch for bf16/fp16 logits, here on fp32 ones (so that it compares exactly)
    def spelling(m, h, y):
        rows = zip(m.lm_head(h), y)
        return torch.stack(
            [F.log_softmax(z, dim=-1).gather(dim=-1, index=t.unsqueeze(-1)).squeeze(-1) for z, t in rows]
        )

    compile_and_compare(spelling)


def test_entropy_under_no_grad_stays_without_grad():
    def spelling(m, h, y):
        z = m.lm_head(h)
        with torch.no_grad():
            ent = entropy_of(z)
        return lp_of(z, y), ent

    compile_and_compare(spelling)


def test_first_use_under_no_grad_with_a_later_use_that_needs_grad():
    def spelling(m, h, y):
        z = m.lm_head(h)
        with torch.no_grad():
            mean_entropy = entropy_of(z).mean()
        return lp_of(z, y) * mean_entropy

    compile_and_compare(spelling)


def test_no_grad_step_runs_the_forward_only():
    torch.manual_seed(0)
    model, h, y = Head(logp_entropy_ce_together), torch.randn(2, 4, D), torch.randint(0, V, (2, 4))
    with torch.no_grad():
        out = torch.compile(model, backend="tilecompile", options=OPTIONS)(h, y)
        ref = model(h, y)
    assert tilecompile.report().counts["fused_linear_ce"] == 1
    for a, e in zip(out, ref):
        assert not a.requires_grad
        assert_close(a, e, rtol=1e-5, atol=1e-5)


def test_labels_computed_after_the_first_use_are_moved_up():
    def spelling(m, h, y):
        z = m.lm_head(h)
        mean_entropy = entropy_of(z).mean()
        labels = torch.roll(y, shifts=-1, dims=1)  # computed after mean_entropy, where the fused call goes
        return lp_of(z, labels) * mean_entropy

    compile_and_compare(spelling)
    assert "1 fused call" in tilecompile.report().rewrites[0].detail


def test_late_rejection_leaves_the_graph_untouched(monkeypatch):
    """The rewrite plans before it inserts: labels computed after the first use of the log-probs by an in-place op
    cannot move above it, which is found only once the calls are known. The pass rejects the region with that
    reason having created, moved and erased no node (no rollback), and the graph is the one it was given."""
    from tilecompile.pass_api import PassContext
    from tilecompile.passes import lm_head

    def spelling(m, h, y):
        z = m.lm_head(h)
        running = torch.cumsum(entropy_of(z), dim=-1)  # the entropy's first use outside: the fused call goes here
        labels = y.clone()
        labels.add_(1)  # in place, after that use: cannot be moved up
        return lp_of(z, labels % V) * running

    torch.manual_seed(0)
    h, y = torch.randn(3, 7, D), torch.randint(0, V, (3, 7))
    [gm] = compiled_graphs(Head(spelling), h, y, fused_linear_ce=False)
    before = [(n.name, n.op, str(n.target), str(n.args), str(n.kwargs)) for n in gm.graph.nodes]
    touched = []
    for name in ("create_node", "erase_node"):
        real = getattr(fx.Graph, name)
        monkeypatch.setattr(
            fx.Graph, name, lambda self, *a, _n=name, _real=real, **k: touched.append(_n) or _real(self, *a, **k)
        )
    real_prepend = fx.Node.prepend
    monkeypatch.setattr(fx.Node, "prepend", lambda self, x: touched.append("prepend") or real_prepend(self, x))

    result = lm_head.run(gm, PassContext(config.load({**OPTIONS, "strict": False})))

    assert not result.rewrites
    [skip] = result.skipped
    assert "cannot be moved" in skip.reason, skip.reason
    assert touched == []
    assert [(n.name, n.op, str(n.target), str(n.args), str(n.kwargs)) for n in gm.graph.nodes] == before
    monkeypatch.undo()
    monkeypatch.setenv("TILECOMPILE_STRICT", "1")
    torch._dynamo.reset()
    compile_and_compare(spelling, rewrites=0)  # left as eager computes it: the labels read after the write


def test_reshaped_log_softmax_into_nll_loss():
    def spelling(m, h, y):
        logp = F.log_softmax(m.lm_head(h), dim=-1)
        return F.nll_loss(logp.reshape(-1, V), y.reshape(-1)), logp.gather(-1, y.unsqueeze(-1)).squeeze(-1)

    compile_and_compare(spelling)
    assert "1 fused call" in tilecompile.report().rewrites[0].detail


def test_dynamic_labels_length_equal_only_at_run_time():
    """labels = y[:, 1:] with y one longer than h: the sizes s0 and s1 - 1 are equal only at run time. The rewrite
    guards on it; a call where they differ recompiles and is left unfused (gather then takes a sub-block)."""

    def spelling(m, h, y):
        return lp_of(m.lm_head(h), y[:, 1:])

    torch.manual_seed(0)
    model = Head(spelling)
    compiled = torch.compile(model, backend="tilecompile", options=OPTIONS, dynamic=True)
    for batch, seq, seq_y in ((2, 5, 6), (3, 7, 8), (2, 6, 6)):
        h, y = torch.randn(batch, seq, D), torch.randint(0, V, (batch, seq_y))
        assert_close(compiled(h, y), model(h, y), rtol=1e-5, atol=1e-6)
    rep = tilecompile.report()
    assert rep.counts["fused_linear_ce"] == 1 and rep.graphs == 2, rep
    assert "one label per row" in rep.skipped[0].reason


def test_tensor_temperature_scales_h():
    compile_and_compare(temperature_tensor, extra=(torch.tensor(0.8),))
    assert "folded into h" in tilecompile.report().rewrites[0].detail


def test_selected_rows_move_onto_h():
    # advanced indexing of the rows (a boolean mask would graph-break on its data-dependent shape)
    compile_and_compare(selected_rows, extra=(torch.tensor([0, 3, 4, 9, 20]),))


def test_shift_slice_is_replayed_on_h():
    torch.manual_seed(0)
    model = Head(shifted)
    h, y = torch.randn(2, 6, D), torch.randint(0, V, (2, 6))
    (gm,) = compiled_graphs(model, h, y)
    (call,) = fused_calls(gm)
    assert G.shape(call.args[0]) == (2, 5, D) and G.shape(call.args[2]) == (2, 5)
    assert not any(G.as_linear(n) for n in gm.graph.nodes), "the [N, V] logits are still computed"
    assert call.args[5] is True  # with_entropy
    assert tilecompile.report().rewrites[0].shapes["N/D/V"] == (10, D, V)


def test_one_call_serves_logp_entropy_and_ce():
    torch.manual_seed(0)
    (gm,) = compiled_graphs(Head(logp_entropy_ce_together), torch.randn(2, 4, D), torch.randint(0, V, (2, 4)))
    (call,) = fused_calls(gm)  # the [B*T, V] view for the CE holds the same rows as the [B, T, V] logits
    assert call.args[5] is True


def test_equal_casts_share_one_call():
    def spelling(m, h, y):
        logits = m.lm_head(h)[:, :-1]
        logp = F.log_softmax(logits.float(), dim=-1).gather(-1, y[:, 1:].unsqueeze(-1)).squeeze(-1)
        return logp, entropy_of(logits.float())

    torch.manual_seed(0)
    (gm,) = compiled_graphs(Head(spelling), torch.randn(2, 4, D), torch.randint(0, V, (2, 4)))
    (call,) = fused_calls(gm)
    assert call.args[5] is True


def test_small_vocab_chunks_match_eager():
    compile_and_compare(logp_entropy_ce_together, options={"ce_vocab_chunk": 8})  # 37 = 4 chunks of 8 and a tail


def test_settings_and_temperature_reach_the_op():
    torch.manual_seed(0)
    h, y = torch.randn(2, 4, D), torch.randint(0, V, (2, 4))
    graphs = compiled_graphs(Head(temperature_div), h, y, check_inputs=True, ce_vocab_chunk=16)
    (call,) = fused_calls(graphs[0])
    assert call.args[6] is True and call.args[7] == 16
    assert math.isclose(call.args[3], 0.7)


def test_tied_embedding_weight():
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(V, D)
            self.lm_head = torch.nn.Linear(D, V, bias=False)
            self.lm_head.weight = self.embed.weight

        def forward(self, ids):
            h = torch.tanh(self.embed(ids))
            z = self.lm_head(h)[:, :-1]
            return F.cross_entropy(z.reshape(-1, V), ids[:, 1:].reshape(-1))

    torch.manual_seed(0)
    model, ids = Tied(), torch.randint(0, V, (2, 6))
    reference = copy.deepcopy(model)
    out = torch.compile(model, backend="tilecompile", options=OPTIONS)(ids)
    ref = reference(ids)
    assert tilecompile.report().counts["fused_linear_ce"] == 1
    assert_close(out, ref, rtol=1e-5, atol=1e-6, name="loss")
    out.backward()
    ref.backward()
    assert_grads_close(model, reference, rtol=1e-5, atol=1e-6)


def test_policy_and_reference_heads_in_one_graph():
    """DPO-style: two lm_heads on the same labels, the reference one under no_grad: two regions, two rewrites."""

    class Two(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.policy = torch.nn.Linear(D, V, bias=False)
            self.reference = torch.nn.Linear(D, V, bias=False)

        def forward(self, h, y):
            logp = lp_of(self.policy(h), y)
            with torch.no_grad():
                ref = lp_of(self.reference(h), y)
            return -F.logsigmoid(0.1 * (logp - ref).sum(-1)).mean()

    torch.manual_seed(0)
    model, h, y = Two(), torch.randn(4, 6, D), torch.randint(0, V, (4, 6))
    reference = copy.deepcopy(model)
    out = torch.compile(model, backend="tilecompile", options=OPTIONS)(h, y)
    ref = reference(h, y)
    rep = tilecompile.report()
    assert rep.counts["fused_linear_ce"] == 2, rep
    assert sorted(r.module_path for r in rep.rewrites) == ["policy", "reference"]
    assert_close(out, ref, rtol=1e-5, atol=1e-6, name="loss")
    out.backward()
    ref.backward()
    assert_grads_close(model, reference, rtol=1e-5, atol=1e-7)
    assert model.reference.weight.grad is None


def test_rewritten_graph_does_not_match_again():
    torch.manual_seed(0)
    settings = config.load(OPTIONS)
    graphs = []

    def backend(gm, example_inputs):
        pipeline.run_passes(gm, settings)
        pipeline.run_passes(gm, settings)
        graphs.append(gm)
        return gm.forward

    h, y = torch.randn(2, 4, D), torch.randint(0, V, (2, 4))
    torch.compile(Head(logp_entropy_ce_together), backend=backend)(h, y)
    rep = tilecompile.report()
    assert rep.counts["fused_linear_ce"] == 1 and not rep.skipped, rep


def test_pass_off_leaves_graph_alone():
    compile_and_compare(ce_mean, rewrites=0, options={"fused_linear_ce": False})
    assert not tilecompile.report().skipped


def test_autocast_casts_h_and_weight_like_the_linear():
    def spelling(m, h, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            z = m.lm_head(h)
            return lp_of(z, y).float(), entropy_of(z).float()

    torch.manual_seed(0)
    model = Head(spelling)
    h, y = torch.randn(3, 5, D), torch.randint(0, V, (3, 5))
    with torch.no_grad():
        exact = (lp_of(model.lm_head(h), y), entropy_of(model.lm_head(h)))
        eager = model(h, y)
        out = torch.compile(model, backend="tilecompile", options=OPTIONS)(h, y)
    rep = tilecompile.report()
    assert rep.counts["fused_linear_ce"] == 1 and "autocast to bfloat16" in rep.rewrites[0].detail, rep
    for o, e, x in zip(out, eager, exact):
        assert (o - x).abs().max() <= 2 * (e - x).abs().max() + 1e-2


@pytest.mark.slow
def test_inductor_inner_compiler():
    compile_and_compare(logp_entropy_ce_together, options={"inner": "inductor"})


def test_dynamic_shapes():
    torch.manual_seed(0)
    model = Head(shifted)
    compiled = torch.compile(model, backend="tilecompile", options=OPTIONS, dynamic=True)
    for batch, seq in ((2, 6), (3, 9)):
        h, y = torch.randn(batch, seq, D), torch.randint(0, V, (batch, seq))
        for a, e in zip(compiled(h, y), model(h, y)):
            assert_close(a, e, rtol=1e-5, atol=1e-5)
    rep = tilecompile.report()
    assert rep.graphs == 1 and rep.counts["fused_linear_ce"] == 1, rep


# ------------------------------------------------------------------------------------------------- row parts


def lse_rows_into_buffer(z, chunk):
    """OpenRLHF's _logsumexp_by_chunk: logsumexp of row chunks written into a preallocated buffer."""
    flat = z.reshape(-1, z.shape[-1])
    out = torch.zeros(flat.shape[0], dtype=z.dtype, device=z.device)
    for i in range(0, flat.shape[0], chunk):
        out[i : i + chunk] = torch.logsumexp(flat[i : i + chunk], dim=-1)
    return out.view(z.shape[:-1])


def entropy_split_cat(m, h, y):
    # TRL's entropy_from_logits: flatten, split the rows, entropy per chunk, cat, reshape back
    z = m.lm_head(h)
    flat = z.reshape(-1, V)
    parts = [-(torch.exp(lp) * lp).sum(-1) for lp in (F.log_softmax(c, dim=-1) for c in flat.split(4, dim=0))]
    return torch.cat(parts, dim=0).reshape(z.shape[:-1])


def logp_chunk_cat_with_labels(m, h, y):
    # parts along the sequence dim, each with its own labels' part
    z = m.lm_head(h) / 0.7
    parts = [lp_of(zc, yc) for zc, yc in zip(z.chunk(3, dim=1), y.chunk(3, dim=1))]
    return torch.cat(parts, dim=1)


def logp_entropy_unbind_stack(m, h, y):
    z = m.lm_head(h)
    return torch.stack([lp_of(zr, yr) for zr, yr in zip(z.unbind(0), y.unbind(0))]), torch.stack(
        [entropy_of(zr) for zr in z.unbind(0)]
    )


def logp_slices_cat(m, h, y):
    z = m.lm_head(h)[:, :-1]
    t = y[:, 1:]
    return torch.cat([lp_of(z[:, :2], t[:, :2]), lp_of(z[:, 2:5], t[:, 2:5]), lp_of(z[:, 5:], t[:, 5:])], dim=1)


def log_softmax_parts_then_gather(m, h, y):
    # the vocabulary-sized log-softmax joined from row parts, then one gather
    z = m.lm_head(h).float()
    logp = torch.cat([F.log_softmax(z.narrow(1, 0, 3), -1), F.log_softmax(z.narrow(1, 3, 4), -1)], dim=1)
    return logp.gather(-1, y.unsqueeze(-1)).squeeze(-1)


def logp_buffer_setitem(m, h, y):
    z = m.lm_head(h)
    z.div_(0.9)  # OpenRLHF's in-place temperature
    picked = torch.gather(z, dim=-1, index=y.unsqueeze(-1)).squeeze(-1)
    return picked - lse_rows_into_buffer(z, 4)


def entropy_buffer_copy(m, h, y):
    z = m.lm_head(h)
    out = torch.empty(z.shape[:-1], dtype=z.dtype)
    for i in range(z.shape[0]):
        out[i].copy_(entropy_of(z[i]))
    return out


def logp_buffer_int_rows(m, h, y):
    z = m.lm_head(h)
    out = h.new_zeros(y.shape)
    for i in range(z.shape[0]):
        out[i] = lp_of(z[i], y[i])
    return out


def temperature_inplace_operator(m, h, y):
    z = m.lm_head(h)
    z /= 0.8
    return lp_of(z, y), entropy_of(z)


ROW_PART_MATCHES = [
    entropy_split_cat,
    logp_chunk_cat_with_labels,
    logp_entropy_unbind_stack,
    logp_slices_cat,
    log_softmax_parts_then_gather,
    logp_buffer_setitem,
    entropy_buffer_copy,
    logp_buffer_int_rows,
    temperature_inplace_operator,
]


@pytest.mark.parametrize("spelling", ROW_PART_MATCHES)
def test_row_parts_fire_and_match_eager(spelling):
    rep = compile_and_compare(spelling)
    (fused,) = rep.rewrites
    assert "; 1 fused call(s)" in fused.detail and fused.shapes["N/D/V"][0] == 3 * 7 - 3 * (
        spelling is logp_slices_cat
    ), fused
    if spelling is not temperature_inplace_operator:
        assert "rows joined from parts by" in fused.detail, fused.detail


def test_row_parts_and_whole_rows_share_one_call():
    # OpenRLHF: the gather reads the whole logits, the logsumexp comes from row chunks: one call for both
    rep = compile_and_compare(logp_buffer_setitem)
    assert "log-prob (via gather, logsumexp)" in rep.rewrites[0].detail
    assert "temperature 0.9" in rep.rewrites[0].detail and "by buffer" in rep.rewrites[0].detail


def test_function_compiled_on_its_own_inside_the_step_fuses():
    # OpenRLHF's compute_entropy carries its own @torch.compile: Dynamo inlines it into the step being compiled
    @torch.compile
    def entropy(logits):
        pd = F.softmax(logits, dim=-1)
        return torch.logsumexp(logits, dim=-1) - torch.sum(pd * logits, dim=-1)

    def spelling(m, h, y):
        z = m.lm_head(h)
        return lp_of(z, y), entropy(z)

    rep = compile_and_compare(spelling)
    assert rep.graphs == 1


def gap(m, h, y):
    z = m.lm_head(h)
    return torch.cat([entropy_of(z[:, :3]), entropy_of(z[:, 4:])], dim=1)


def out_of_order(m, h, y):
    z = m.lm_head(h)
    return torch.cat([entropy_of(z[:, 3:]), entropy_of(z[:, :3])], dim=1)


def overlapping_writes(m, h, y):
    z = m.lm_head(h).view(-1, V)
    out = torch.zeros(z.shape[0])
    out[0:8] = torch.logsumexp(z[0:8], -1)
    out[6:] = torch.logsumexp(z[6:], -1)
    return z.gather(-1, y.view(-1, 1)).squeeze(-1) - out


def rows_left_unwritten(m, h, y):
    z = m.lm_head(h).view(-1, V)
    out = torch.zeros(z.shape[0])
    out[0:8] = torch.logsumexp(z[0:8], -1)
    return z.gather(-1, y.view(-1, 1)).squeeze(-1) - out


def read_before_written(m, h, y):
    z = m.lm_head(h).view(-1, V)
    out = torch.zeros(z.shape[0])
    out[0:8] = torch.logsumexp(z[0:8], -1)
    early = out.sum()
    out[8:] = torch.logsumexp(z[8:], -1)
    return z.gather(-1, y.view(-1, 1)).squeeze(-1) - out + early


def foreign_write(m, h, y):
    z = m.lm_head(h).view(-1, V)
    out = torch.zeros(z.shape[0])
    out[0:8] = torch.logsumexp(z[0:8], -1)
    out[8:] = 0.0
    return z.gather(-1, y.view(-1, 1)).squeeze(-1) - out


def rounding_buffer(m, h, y):
    z = m.lm_head(h).view(-1, V)
    out = torch.zeros(z.shape[0], dtype=torch.bfloat16)
    out[0:8] = torch.logsumexp(z[0:8], -1)
    out[8:] = torch.logsumexp(z[8:], -1)
    return z.gather(-1, y.view(-1, 1)).squeeze(-1) - out


def labels_of_other_rows(m, h, y):
    z = m.lm_head(h)
    return torch.cat([lp_of(z[:, :3], y[:, 1:4]), lp_of(z[:, 3:], y[:, 3:])], dim=1)


NOT_A_PARTITION = [
    (gap, "leaves rows 3:4"),
    (out_of_order, "only the rows in their own order"),
    (overlapping_writes, "rows 6:8 of"),
    (rows_left_unwritten, "leaves rows 8:21"),
    (read_before_written, "before setitem_1 writes into it"),
    (foreign_write, "written with values not computed from these logits"),
    (labels_of_other_rows, "labels of a part"),
    (rounding_buffer, "which rounds them"),
]


@pytest.mark.parametrize(("spelling", "reason"), NOT_A_PARTITION)
def test_row_parts_that_are_not_a_partition_are_left_alone(spelling, reason):
    rep = compile_and_compare(spelling, rewrites=0)
    reasons = [s.reason for s in rep.skipped if s.pass_name == "fused_linear_ce"]
    assert len(reasons) == 1 and reason in reasons[0], rep


# ----------------------------------------------------------------------------------------------- non-matches


def returns_logits(m, h, y):
    z = m.lm_head(h)
    return F.cross_entropy(z.view(-1, V), y.view(-1)), z


def uses_argmax(m, h, y):
    z = m.lm_head(h)
    accuracy = (z.argmax(-1) == y).float().mean()
    return lp_of(z, y).sum() + accuracy


def lp_of(z, y):
    return z.log_softmax(-1).gather(-1, y.unsqueeze(-1)).squeeze(-1)


def samples(m, h, y):
    z = m.lm_head(h)
    p = F.softmax(z, dim=-1)
    token = torch.multinomial(p.view(-1, V).detach(), 1)
    return lp_of(z, y) + 0 * token.view(y.shape)


def computed_weight(m, h, y):
    return lp_of(F.linear(h, m.lm_head.weight * 2.0), y)


def with_bias(m, h, y):
    return lp_of(m.lm_head(h), y)


def soft_targets(m, h, y, target):
    return F.cross_entropy(m.lm_head(h).view(-1, V), target)


def class_weights(m, h, y, w):
    return F.cross_entropy(m.lm_head(h).view(-1, V), y.view(-1), weight=w)


def label_smoothing(m, h, y):
    return F.cross_entropy(m.lm_head(h).view(-1, V), y.view(-1), label_smoothing=0.1)


def z_loss(m, h, y):
    z = m.lm_head(h).view(-1, V)
    return F.cross_entropy(z, y.view(-1)) + 1e-4 * torch.logsumexp(z, dim=-1).pow(2).mean()


def vector_temperature(m, h, y, t):
    return lp_of(m.lm_head(h) / t, y)


def softmax_of_other_dim(m, h, y):
    z = m.lm_head(h)
    return lp_of(z, y), F.softmax(z, dim=0).sum()


NON_MATCHES = [
    (returns_logits, (), "returned from the graph"),
    (samples, (), "multinomial"),
    (computed_weight, (), "not a graph input"),
    (soft_targets, (torch.softmax(torch.randn(21, V), -1),), "floating-point targets"),
    (vector_temperature, (torch.rand(V) + 0.5,), "0-dim"),
    (softmax_of_other_dim, (), "softmax"),
]


def test_linear_with_bias_fires():
    # F.linear(h, W, b): the bias goes into the fused op (tests/test_lm_head_options.py has the other spellings)
    (rw,) = compile_and_compare(with_bias, bias=True).rewrites
    assert "bias" in rw.detail, rw


@pytest.mark.parametrize(("spelling", "extra", "reason"), NON_MATCHES)
def test_non_match_is_skipped_with_reason(spelling, extra, reason):
    rep = compile_and_compare(spelling, extra=extra, rewrites=0, bias=spelling is with_bias)
    reasons = [s.reason for s in rep.skipped if s.pass_name == "fused_linear_ce"]
    assert len(reasons) == 1 and reason in reasons[0], rep
    assert rep.skipped[0].module_path == ("" if spelling is computed_weight else "lm_head")


def test_checkpointed_loss_with_its_lm_head_fires():
    def spelling(m, h, y):
        def loss(h):
            z = m.lm_head(h)
            return F.cross_entropy(z.view(-1, V), y.view(-1)), entropy_of(z)

        return torch.utils.checkpoint.checkpoint(loss, h, use_reentrant=False)

    compile_and_compare(spelling)


def test_checkpointed_entropy_of_outside_logits_is_skipped():
    # verl's entropy_checkpointing: the logits cross into the checkpoint body
    def spelling(m, h, y):
        z = m.lm_head(h)
        return lp_of(z, y), torch.utils.checkpoint.checkpoint(entropy_of, z, use_reentrant=False)

    compile_and_compare(spelling, rewrites=0)
    (skip,) = [s for s in tilecompile.report().skipped if s.pass_name == "fused_linear_ce"]
    assert "checkpoint" in skip.reason and skip.module_path == "lm_head"


def test_returned_logits_reason_says_what_to_compile():
    compile_and_compare(returns_logits, rewrites=0)
    (skip,) = [s for s in tilecompile.report().skipped if s.pass_name == "fused_linear_ce"]
    assert "compile the function that computes the loss" in skip.reason


def test_plain_linears_are_not_candidates():
    class MLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(D, D)

        def forward(self, h, y):
            return torch.relu(self.fc(h)).sum()

    torch.compile(MLP(), backend="tilecompile", options=OPTIONS)(torch.randn(2, D), None)
    rep = tilecompile.report()
    assert rep.counts["fused_linear_ce"] == 0 and not rep.skipped


# ---------------------------------------------------------------------------------------- Hugging Face models

HF_VOCAB = 257
# the whole backend, tiled_mlp included (tiling every MLP however short), so the passes are tested together
HF_OPTIONS = {"strict": True, "inner": "aot_eager", "mlp_min_tokens": 0}


def tiny_hf(name: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A random-init Llama / Qwen2 / Qwen3 causal LM: hidden 64, 2 layers, vocab 257 (Qwen3's embedding tied)."""
    transformers = pytest.importorskip("transformers")
    common = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=HF_VOCAB,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    if name == "llama":
        cfg = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    elif name == "qwen2":
        cfg = transformers.Qwen2Config(**common)
        cls = transformers.Qwen2ForCausalLM
    else:
        cfg = transformers.Qwen3Config(**common, head_dim=16, tie_word_embeddings=True)
        cls = transformers.Qwen3ForCausalLM
    torch.manual_seed(0)
    return cls(cfg).to(dtype)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum()


def ppo_step(model, ids, mask, old_logp, advantages):
    """verl's actor update: log-probs and entropy of the temperature-scaled, shifted logits; PPO clipped loss."""
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    logits = logits[:, :-1, :]
    logits.div_(0.9)
    labels = ids[:, 1:]
    logp = torch.gather(F.log_softmax(logits, dim=-1), -1, labels.unsqueeze(-1)).squeeze(-1)
    pd = F.softmax(logits, dim=-1)
    entropy = torch.logsumexp(logits, dim=-1) - torch.sum(pd * logits, dim=-1)
    response = mask[:, 1:].float()
    ratio = torch.exp(logp - old_logp)
    pg = torch.maximum(-advantages[:, None] * ratio, -advantages[:, None] * torch.clamp(ratio, 0.8, 1.2))
    return masked_mean(pg, response) - 0.01 * masked_mean(entropy, response)


def grpo_step(model, ids, mask, old_logp, advantages):
    """GRPO: per-token log-probs as gather - logsumexp, clipped ratio, k3 KL to a reference, per-sequence mean."""
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1].float()
    logp = logits.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1) - logits.logsumexp(dim=-1)
    ratio = torch.exp(logp - old_logp)
    per_token = -torch.min(ratio * advantages[:, None], ratio.clamp(0.8, 1.2) * advantages[:, None])
    ref_logp = old_logp.detach() - 0.05
    kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1
    per_token = per_token + 0.04 * kl
    response = mask[:, 1:].float()
    return ((per_token * response).sum(-1) / response.sum(-1)).mean()


def sft_step(model, ids, mask, old_logp, advantages):
    """The model's own loss (transformers' ForCausalLMLoss) when called with labels=."""
    labels = ids.masked_fill(mask == 0, -100)
    return model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss


def hf_batch(batch: int = 2, seq: int = 12):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, HF_VOCAB, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, -3:] = 0
    old_logp = -torch.rand(batch, seq - 1, generator=g) * 5
    advantages = torch.randn(batch, generator=g)
    return ids, mask, old_logp, advantages


@pytest.mark.parametrize("step", [ppo_step, grpo_step, sft_step])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_hf_model_step_matches_eager(arch, step):
    model = tiny_hf(arch)
    reference = copy.deepcopy(model)
    batch = hf_batch()
    expected = step(reference, *batch)
    expected.backward()
    actual = torch.compile(step, backend="tilecompile", options=HF_OPTIONS)(model, *batch)
    rep = tilecompile.report()
    assert rep.counts["fused_linear_ce"] == 1, rep
    (fused,) = [r for r in rep.rewrites if r.pass_name == "fused_linear_ce"]
    assert fused.module_path == "lm_head"
    assert fused.shapes["N/D/V"] == (22 if step is not sft_step else 24, 64, HF_VOCAB)
    assert_close(actual, expected, rtol=1e-5, atol=1e-6, name="loss")
    actual.backward()
    assert_grads_close(model, reference, rtol=1e-4, atol=1e-6)


def test_hf_model_compiled_alone_is_skipped_with_advice():
    model = tiny_hf("qwen3")
    ids, mask, _, _ = hf_batch()
    torch.compile(model, backend="tilecompile", options=OPTIONS)(input_ids=ids, labels=ids)
    rep = tilecompile.report()
    assert rep.counts["fused_linear_ce"] == 0
    (skip,) = [s for s in rep.skipped if s.pass_name == "fused_linear_ce"]
    assert skip.module_path.endswith("lm_head")  # graph.clean_path leaves "0." of L['args'][0] here
    assert "returned from the graph" in skip.reason and "compile the function that computes the loss" in skip.reason


@pytest.mark.gpu
def test_hf_model_bf16_on_gpu():
    """bf16 Qwen3 on CUDA through Inductor: the loss and gradients are as close to an fp32 reference as eager bf16's."""
    model = tiny_hf("qwen3").cuda()
    fp32 = copy.deepcopy(model)
    eager_bf16 = copy.deepcopy(model).to(torch.bfloat16)
    model = model.to(torch.bfloat16)
    batch = [t.cuda() for t in hf_batch(batch=4, seq=64)]
    ref = ppo_step(fp32, *batch)
    ref.backward()
    eager = ppo_step(eager_bf16, *batch)
    eager.backward()
    out = torch.compile(ppo_step, backend="tilecompile", options={"strict": True})(model, *batch)
    out.backward()
    assert tilecompile.report().counts["fused_linear_ce"] == 1
    eager_err = (eager.double() - ref.double()).abs().item()
    assert (out.double() - ref.double()).abs().item() <= 2 * eager_err + 2e-2
    for (name, p), q, e in zip(model.named_parameters(), fp32.parameters(), eager_bf16.parameters()):
        err = (p.grad.double() - q.grad.double()).norm() / q.grad.double().norm().clamp_min(1e-12)
        eager_err = (e.grad.double() - q.grad.double()).norm() / q.grad.double().norm().clamp_min(1e-12)
        assert err <= 2 * eager_err + 1e-2, (name, err.item(), eager_err.item())


# ------------------------------------------------------------------------------------------ graph.py helpers


def test_eliminate_dead_code_keeps_in_place_calls():
    def f(x):
        y = x * 2
        y.div_(3)  # no users, but it changes y
        unused = x + 1  # noqa: F841 - dead
        return y.sum()

    gm = fx.symbolic_trace(f)
    G.eliminate_dead_code(gm.graph)
    gm.recompile()
    assert [n.target for n in gm.graph.nodes if n.op == "call_method"] == ["div_", "sum"]
    assert not any(n.target is operator.add for n in gm.graph.nodes)
    x = torch.randn(4)
    assert_close(gm(x), f(x), rtol=0, atol=0)
    assert G.is_inplace(next(n for n in gm.graph.nodes if n.target == "div_"))


# ------------------------------------------------------------------------------------ recompiles and dynamic=True

# every spelling above that fuses in the first static graph (row parts included): it must fuse in every later graph
# too, whether Dynamo recompiles for a new length (static, then automatic dynamic) or compiles with dynamic=True
_FUSING_SPELLINGS = [
    *MATCHES,
    ce_mean,
    ce_sum,
    ce_mean_ignore_7,
    *ROW_PART_MATCHES,
]


def _fused_per_graph(spelling, dynamic, lengths=((2, 7), (3, 8), (2, 11)), grad=True):
    """Compile ``Head(spelling)`` for three lengths: every graph compiled must carry one rewrite, values eager's."""
    if spelling is log_softmax_parts_then_gather:  # its parts are 3 + 4 rows along dim 1: vary the batch only
        lengths = ((2, 7), (3, 7), (5, 7))
    torch.manual_seed(0)
    model = Head(spelling)
    compiled = torch.compile(model, backend="tilecompile", options=OPTIONS, dynamic=dynamic)
    per_graph = []
    for batch, seq in lengths:
        h, y = torch.randn(batch, seq, D, requires_grad=grad), torch.randint(0, V, (batch, seq))
        before = tilecompile.report()
        with torch.set_grad_enabled(grad):
            actual, expected = _outputs(compiled(h, y)), _outputs(model(h, y))
        rep = tilecompile.report()
        if rep.graphs > before.graphs:  # this call compiled a graph (one per call here: the head has no breaks)
            assert rep.graphs == before.graphs + 1, rep
            per_graph.append(rep.counts["fused_linear_ce"] - before.counts["fused_linear_ce"])
        for a, e in zip(actual, expected, strict=True):
            assert_close(a, e, rtol=1e-5, atol=1e-5, name=f"{spelling.__name__} at {(batch, seq)}")
    return per_graph, rep


@pytest.mark.parametrize("dynamic", [None, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("spelling", _FUSING_SPELLINGS, ids=lambda s: s.__name__)
def test_spelling_fuses_in_every_graph(spelling, dynamic):
    per_graph, rep = _fused_per_graph(spelling, dynamic)
    assert per_graph and all(n == 1 for n in per_graph), (per_graph, [s.reason for s in rep.skipped])


@pytest.mark.parametrize("dynamic", [None, True], ids=["static", "dynamic"])
def test_trl_selective_log_softmax_under_no_grad_fuses_in_every_graph(dynamic):
    # issue 21: the loop over the rows pins the row count by a guard, so its parts partition the rows at every length
    per_graph, rep = _fused_per_graph(lp_trl_fp32, dynamic, grad=False)
    assert per_graph and all(n == 1 for n in per_graph), (per_graph, [s.reason for s in rep.skipped])


def _ce_ignore_param(m, h, y, ignore_index):
    return F.cross_entropy(m.lm_head(h).flatten(0, 1), y.flatten(), ignore_index=ignore_index)


def _ce_ignore_literal(m, h, y, ignore_index):
    return F.cross_entropy(m.lm_head(h).flatten(0, 1), y.flatten(), ignore_index=-100)


@pytest.mark.parametrize("spelling", [_ce_ignore_param, _ce_ignore_literal], ids=["parameter", "literal"])
def test_ignore_index_argument_under_dynamic_shapes_is_pinned(spelling):
    """issue 21: an int ignore_index passed into the compiled function is a SymInt under dynamic=True; the pass pins
    it to its value by a guard (another value recompiles, and is fused for that value)."""
    torch.manual_seed(0)
    model = Head(spelling)
    compiled = torch.compile(model, backend="tilecompile", options=OPTIONS, dynamic=True)
    calls = ((2, 7, -100), (3, 5, -100), (2, 9, 3)) if spelling is _ce_ignore_param else ((2, 7, -100), (3, 5, -100))
    for batch, seq, ignore in calls:
        h = torch.randn(batch, seq, D, requires_grad=True)
        y = with_ignored(torch.randint(0, V, (batch, seq)), ignore)
        h_ref = h.detach().clone().requires_grad_()
        actual, expected = compiled(h, y, ignore), model(h_ref, y, ignore)
        assert_close(actual, expected, rtol=1e-5, atol=1e-5, name=f"loss at {(batch, seq, ignore)}")
        actual.backward()
        expected.backward()
        assert_close(h.grad, h_ref.grad, rtol=1e-5, atol=1e-5, name="grad of h")
    rep = tilecompile.report()
    graphs = 2 if spelling is _ce_ignore_param else 1  # one per ignore_index value
    assert rep.graphs == graphs and rep.counts["fused_linear_ce"] == graphs, rep
    details = " ".join(r.detail for r in rep.rewrites)
    assert "ignore_index=-100" in details and ("ignore_index=3" in details) == (spelling is _ce_ignore_param)


def _temperature_negative(m, h, y):
    z = m.lm_head(h) / -0.5
    return z.log_softmax(-1).gather(-1, y.unsqueeze(-1)).squeeze(-1)


def _temperature_zero_scale(m, h, y):
    z = m.lm_head(h) * 0.0
    return entropy_of(z)


@pytest.mark.parametrize(
    ("spelling", "how"),
    [(_temperature_negative, "divided by -0.5"), (_temperature_zero_scale, "multiplied by 0")],
    ids=["negative", "zero"],
)
def test_temperature_not_above_zero_is_skipped_with_reason(spelling, how):
    # issue 21: the rewrite was dropped without an entry in the report
    rep = compile_and_compare(spelling, rewrites=0)
    reasons = [s.reason for s in rep.skipped if s.pass_name == "fused_linear_ce"]
    assert len(reasons) == 1 and how in reasons[0] and "finite and > 0" in reasons[0], rep


@pytest.mark.parametrize(
    ("spelling", "eager_type"),
    [(lp_functions, RuntimeError), (lp_gather_minus_logsumexp, RuntimeError), (lp_neg_cross_entropy, IndexError)],
    ids=["log_softmax_gather", "gather_minus_logsumexp", "cross_entropy"],
)
def test_out_of_range_label_raises_eagers_type_without_the_sentinel(spelling, eager_type):
    """issue 21: the op's error for a label outside [0, V) names no internal ignore_index sentinel and is of the type
    eager raises (RuntimeError for gather, IndexError for cross_entropy); still a ValueError, as the op's others."""
    from tilecompile.ops.fused_linear_ce import NO_IGNORE, LabelOutOfRange
    from tilecompile.passes.lm_head.rewrite import _NO_IGNORE

    assert NO_IGNORE == _NO_IGNORE
    model = Head(spelling)
    h, y = torch.randn(3, 7, D), torch.randint(0, V, (3, 7))
    y[1, 2] = V + 3
    with pytest.raises(eager_type):
        model(h, y)
    compiled = torch.compile(model, backend="tilecompile", options=OPTIONS)
    with pytest.raises(eager_type) as err:
        compiled(h, y)
    assert tilecompile.report().counts["fused_linear_ce"] == 1
    text = str(err.value)
    assert isinstance(err.value, LabelOutOfRange | ValueError) and f"label {V + 3} out of range" in text, text
    assert str(NO_IGNORE) not in text, text
    assert ("there is no ignore_index" in text) == (eager_type is RuntimeError), text
