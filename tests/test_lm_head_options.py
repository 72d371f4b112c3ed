"""The lm_head pass on what the peers' suites use (issue 25): verl's ``torch.matmul`` with casts and transposes,
a bias (either spelling), a final-logit softcap, z-loss and lse, label smoothing, class weights and argmax.

Each spelling is compiled through the backend (strict, aot_eager) and compared with eager, outputs and the grads of
h and every parameter, and both are compared with a float64 copy of the model: the rewrite's error must not exceed
eager's own by more than a small margin. Where it cannot be rewritten, the report must say why."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close

import tilecompile

D, V = 16, 37
OPTIONS = {"strict": True, "inner": "aot_eager", "tiled_mlp": False}


@pytest.fixture(autouse=True)
def _strict(monkeypatch):
    monkeypatch.setenv("TILECOMPILE_STRICT", "1")
    tilecompile.reset()
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Head(torch.nn.Module):
    """An lm_head weight [V, D] (and a bias [V]) followed by ``spelling(self, h, labels, *extra)``."""

    def __init__(self, spelling, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(V, D, dtype=dtype) / D**0.5)
        self.bias = torch.nn.Parameter(torch.randn(V, dtype=dtype))
        self.spelling = spelling

    def forward(self, h, labels, *extra):
        return self.spelling(self, h, labels, *extra)


def _tensors(out) -> list[torch.Tensor]:
    return [o for o in (out if isinstance(out, tuple | list) else (out,)) if isinstance(o, torch.Tensor)]


def _run(model, h, labels, extra, compiled: bool):
    h = h.detach().clone().requires_grad_()
    fn = torch.compile(model, backend="tilecompile", options=OPTIONS) if compiled else model
    outs = _tensors(fn(h, labels, *extra))
    with_grad = [o for o in outs if o.requires_grad]
    if with_grad:
        gen = torch.Generator().manual_seed(1)
        seeds = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype) for o in with_grad]
        torch.autograd.backward(with_grad, seeds)
    grads = [h.grad] + [p.grad for _, p in model.named_parameters()]
    return outs, grads


def check(spelling, extra=(), rewrites=1, dtype=torch.float32, labels=None, batch=(3, 5), tol=1e-5):
    """Compile ``Head(spelling)``: the report's count, outputs and grads against eager and against float64."""
    torch.manual_seed(0)
    model = Head(spelling, dtype)
    h = torch.randn(*batch, D, dtype=dtype)
    labels = torch.randint(0, V, batch) if labels is None else labels
    eager = _run(copy.deepcopy(model), h, labels, extra, compiled=False)
    f64_extra = tuple(e.double() if isinstance(e, torch.Tensor) and e.is_floating_point() else e for e in extra)
    exact = _run(copy.deepcopy(model).double(), h.double(), labels, f64_extra, compiled=False)
    got = _run(model, h, labels, extra, compiled=True)
    rep = tilecompile.report()
    assert rep.counts["fused_linear_ce"] == rewrites, rep
    for kind, (a_list, e_list, x_list) in zip(("output", "grad"), zip(got, eager, exact)):
        assert len(a_list) == len(e_list)
        for i, (a, e, x) in enumerate(zip(a_list, e_list, x_list)):
            if e is None:
                assert a is None, (kind, i)
                continue
            assert a.dtype == e.dtype, (kind, i, a.dtype, e.dtype)
            if not a.is_floating_point():
                assert torch.equal(a, e), (kind, i)
                continue
            assert_close(a, e, rtol=tol, atol=tol, name=f"{kind} {i} against eager")
            eager_err = (e.double() - x).abs().max().item()
            assert_close(a, x, rtol=0, atol=3 * eager_err + tol, name=f"{kind} {i} against float64")
    return rep


def lp_of(z, y):
    return z.log_softmax(-1).gather(-1, y.unsqueeze(-1)).squeeze(-1)


def entropy_of(z):
    p = z.softmax(-1)
    return torch.logsumexp(z, -1) - (p * z).sum(-1)


def skip_reasons(rep) -> list[str]:
    return [s.reason for s in rep.skipped if s.pass_name == "fused_linear_ce"]


# ------------------------------------------------------------------------------------- matmul spellings


def verl_matmul(m, h, y):
    z = torch.matmul(h.float(), m.weight.transpose(0, 1).float()) / 0.7
    return lp_of(z, y), entropy_of(z)


def verl_matmul_inplace(m, h, y):
    z = torch.matmul(h.float(), m.weight.transpose(0, 1).float())
    z /= 0.7
    return lp_of(z, y), entropy_of(z)


def cast_then_transpose(m, h, y):
    z = h.float() @ m.weight.float().t()
    return F.cross_entropy(z.view(-1, V), y.view(-1))


def mm_of_flat(m, h, y):
    z = torch.mm(h.reshape(-1, D), m.weight.T)
    return F.cross_entropy(z, y.view(-1), reduction="sum")


@pytest.mark.parametrize("spelling", [verl_matmul, verl_matmul_inplace, cast_then_transpose, mm_of_flat])
def test_matmul_spellings_fire(spelling):
    check(spelling)


@pytest.mark.parametrize("spelling", [verl_matmul, verl_matmul_inplace])
def test_verl_matmul_of_bf16_weights_fires_in_fp32(spelling):
    # h and W in bf16, the logits in fp32 (verl's reference): the op computes in fp32 as the graph does
    rep = check(spelling, dtype=torch.bfloat16, tol=2e-2)
    (rw,) = rep.rewrites
    assert rw.dtypes["weight"] == "torch.bfloat16" and rw.dtypes["logits"] == "torch.float32"


def einsum_head(m, h, y):
    return lp_of(torch.einsum("btd,vd->btv", h, m.weight), y)


def weight_stored_transposed(m, h, y):
    return lp_of(h @ m.weight.t().contiguous(), y)


@pytest.mark.parametrize("spelling", [einsum_head, weight_stored_transposed])
def test_unread_matmul_of_a_weight_gets_a_reason(spelling):
    rep = check(spelling, rewrites=0)
    (reason,) = skip_reasons(rep)
    assert "weight" in reason and "does not read as an lm_head" in reason, reason


# ------------------------------------------------------------------------------------------------- bias


def bias_linear(m, h, y):
    z = F.linear(h, m.weight, m.bias)
    return lp_of(z, y), entropy_of(z)


def bias_added(m, h, y):
    z = h @ m.weight.t() + m.bias
    return F.cross_entropy(z.view(-1, V), y.view(-1))


def bias_added_first(m, h, y):
    z = m.bias + torch.matmul(h, m.weight.T)
    return -F.cross_entropy(z.view(-1, V), y.view(-1), reduction="none"), entropy_of(z / 0.8)


def bias_inplace(m, h, y):
    z = h @ m.weight.t()
    z += m.bias
    return F.cross_entropy(z.view(-1, V), y.view(-1), reduction="sum")


def bias_of_shifted_logits(m, h, y):
    z = (h @ m.weight.t())[:, :-1] + m.bias
    return F.cross_entropy(z.reshape(-1, V), y[:, 1:].reshape(-1))


@pytest.mark.parametrize("spelling", [bias_linear, bias_added, bias_added_first, bias_inplace, bias_of_shifted_logits])
def test_bias_fires_with_its_gradient(spelling):
    (rw,) = check(spelling).rewrites
    assert "; bias " in rw.detail, rw


def bias_after_temperature(m, h, y):
    return lp_of(h @ m.weight.t() / 0.5 + m.bias, y)


def test_bias_after_a_temperature_gets_a_reason():
    (reason,) = skip_reasons(check(bias_after_temperature, rewrites=0))
    assert "already scaled" in reason, reason


# ---------------------------------------------------------------------------------------------- softcap


def gemma_softcap(m, h, y):
    # Gemma 2/3's final_logit_softcapping, as transformers spells it
    z = h @ m.weight.t()
    z = z / 3.0
    z = torch.tanh(z)
    z = z * 3.0
    return F.cross_entropy(z.view(-1, V), y.view(-1))


def softcap_one_line_then_temperature(m, h, y):
    z = 2.0 * (F.linear(h, m.weight) / 2.0).tanh()
    z = z / 0.7
    return lp_of(z, y), entropy_of(z)


def softcap_with_bias(m, h, y):
    z = torch.tanh((h @ m.weight.t() + m.bias) / 1.5) * 1.5
    return lp_of(z, y), F.cross_entropy(z.view(-1, V), y.view(-1), ignore_index=3)


def tanh_alone(m, h, y):
    return entropy_of(torch.tanh(h @ m.weight.t()))  # a softcap of 1, scale 1


SOFTCAPS = [gemma_softcap, softcap_one_line_then_temperature, softcap_with_bias, tanh_alone]


@pytest.mark.parametrize("spelling", SOFTCAPS)
def test_softcap_fires_with_its_gradient(spelling):
    (rw,) = check(spelling).rewrites
    assert "softcap" in rw.detail, rw


def test_softcap_in_bf16_matches_float64_as_well_as_eager():
    check(gemma_softcap, dtype=torch.bfloat16, tol=3e-2)


def softcap_twice(m, h, y):
    z = torch.tanh(torch.tanh(h @ m.weight.t() / 2.0))
    return lp_of(z, y)


def test_second_softcap_gets_a_reason():
    (reason,) = skip_reasons(check(softcap_twice, rewrites=0))
    assert "already softcapped" in reason, reason


# ----------------------------------------------------------------------------------------- z-loss, lse


def z_loss_scalar(m, h, y):
    z = (h @ m.weight.t()).view(-1, V)
    return F.cross_entropy(z, y.view(-1)) + 1e-2 * torch.logsumexp(z, dim=-1).pow(2).mean()


def liger_z_loss(m, h, y, scale=1e-4):
    # Liger's reference: CE over the non-ignored tokens plus scale · lse² over the same tokens (even at scale 0)
    z = F.linear(h, m.weight, m.bias).view(-1, V).float()
    y = y.view(-1)
    keep = y != -100
    lse = torch.logsumexp(z, dim=-1)
    ce = F.cross_entropy(z, y, reduction="sum") / keep.sum()
    return ce + scale * (lse.pow(2) * keep).sum() / keep.sum(), lse


def liger_z_loss_scale_zero(m, h, y):
    return liger_z_loss(m, h, y, scale=0.0)


def lse_returned_with_logp(m, h, y):
    z = torch.tanh(h @ m.weight.t() / 4.0) * 4.0
    return lp_of(z, y), z.logsumexp(-1, keepdim=True)


def logp_plus_lse(m, h, y):
    z = h @ m.weight.t()
    return z.gather(-1, y.unsqueeze(-1)).squeeze(-1) + 0.5 * torch.logsumexp(z, -1)  # z_y − lse/2


@pytest.mark.parametrize("spelling", [z_loss_scalar, liger_z_loss, liger_z_loss_scale_zero, lse_returned_with_logp,
                                      logp_plus_lse])  # fmt: skip
def test_z_loss_and_lse_fire_with_their_gradient(spelling):
    labels = torch.randint(0, V, (3, 5))
    if spelling in (liger_z_loss, liger_z_loss_scale_zero):
        labels[0, ::2] = -100
    (rw,) = check(spelling, labels=labels).rewrites
    assert "recompute mode" in rw.detail and "lse" in rw.detail, rw


# ------------------------------------------------------------------------- label smoothing, class weights


def smoothing_mean(m, h, y):
    return F.cross_entropy((h @ m.weight.t()).view(-1, V), y.view(-1), label_smoothing=0.1)


def smoothing_sum_ignore(m, h, y):
    z = F.linear(h, m.weight, m.bias).view(-1, V)
    return F.cross_entropy(z, y.view(-1), label_smoothing=0.25, reduction="sum", ignore_index=-100)


def smoothing_none(m, h, y):
    z = h @ m.weight.t()
    return F.cross_entropy(z.view(-1, V), y.view(-1), label_smoothing=0.3, reduction="none")


def smoothing_by_hand(m, h, y):
    # Liger's / CCE's spelling: (1 − ε)·nll + ε·(−mean_j log p_j)
    logp = (torch.tanh(h @ m.weight.t() / 5.0) * 5.0).log_softmax(-1)
    nll = -logp.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    return ((1 - 0.2) * nll - 0.2 * logp.mean(-1)).mean()


def class_weights_mean(m, h, y, w):
    return F.cross_entropy((h @ m.weight.t()).view(-1, V), y.view(-1), weight=w)


def class_weights_none(m, h, y, w):
    return F.cross_entropy((h @ m.weight.t()).view(-1, V), y.view(-1), weight=w, reduction="none")


def class_weights_nll_sum(m, h, y, w):
    logp = F.log_softmax(F.linear(h, m.weight, m.bias).view(-1, V), -1)
    return F.nll_loss(logp, y.view(-1), weight=w, reduction="sum", ignore_index=-100)


def weighted_gather(m, h, y, w):
    # the class weight applied by hand to the gathered log-prob
    return -(w[y] * lp_of(h @ m.weight.t(), y)).mean()


WEIGHTS = (torch.rand(V) + 0.1,)
SMOOTHING_AND_WEIGHTS = [
    (smoothing_mean, ()),
    (smoothing_sum_ignore, ()),
    (smoothing_none, ()),
    (smoothing_by_hand, ()),
    (class_weights_mean, WEIGHTS),
    (class_weights_none, WEIGHTS),
    (class_weights_nll_sum, WEIGHTS),
    (weighted_gather, WEIGHTS),
]


@pytest.mark.parametrize(("spelling", "extra"), SMOOTHING_AND_WEIGHTS, ids=lambda x: getattr(x, "__name__", ""))
def test_label_smoothing_and_class_weights_fire(spelling, extra):
    labels = torch.randint(0, V, (3, 5))
    if spelling not in (smoothing_by_hand, weighted_gather):
        labels[1, 1::2] = -100
    check(spelling, extra=extra, labels=labels)


def smoothing_and_weights(m, h, y, w):
    return F.cross_entropy((h @ m.weight.t()).view(-1, V), y.view(-1), weight=w, label_smoothing=0.1)


def test_label_smoothing_with_class_weights_gets_a_reason():
    (reason,) = skip_reasons(check(smoothing_and_weights, extra=WEIGHTS, rewrites=0))
    assert "class weights and label_smoothing" in reason, reason


# ------------------------------------------------------------------------------------------------- argmax


def accuracy(m, h, y):
    z = h @ m.weight.t() + m.bias
    return F.cross_entropy(z.view(-1, V), y.view(-1)), (z.argmax(-1) == y).float().mean()


def predicted_tokens(m, h, y):
    z = torch.tanh(h @ m.weight.t() / 3.0) * 3.0
    return lp_of(z, y), z.log_softmax(-1).argmax(dim=-1, keepdim=True)


def greedy_of_softmax(m, h, y):
    z = h @ m.weight.t() / 0.7
    return entropy_of(z), z.softmax(-1).argmax(-1)


@pytest.mark.parametrize("spelling", [accuracy, predicted_tokens, greedy_of_softmax])
def test_argmax_is_an_output_of_the_fused_op(spelling):
    (rw,) = check(spelling).rewrites
    assert "argmax" in rw.detail, rw


def argmax_of_negated(m, h, y):
    z = h @ m.weight.t()
    return lp_of(z, y), (-z.log_softmax(-1)).argmax(-1)  # the least likely token: not the op's argmax


def test_argmax_of_a_decreasing_form_gets_a_reason():
    (reason,) = skip_reasons(check(argmax_of_negated, rewrites=0))
    assert "argmax" in reason, reason


def bias_then_tensor_temperature(m, h, y, t):
    z = (F.linear(h, m.weight, m.bias) / t).float()
    return lp_of(z, y), entropy_of(z)


def test_bias_then_tensor_temperature_scales_the_bias_too():
    # the tensor temperature is folded into h; (h·Wᵀ + b) / t needs b / t as the op's bias (grads to t as well)
    check(bias_then_tensor_temperature, extra=(torch.tensor(0.6, requires_grad=True),))


def test_softcapped_scalar_loss_takes_the_loss_aware_mode():
    # Gemma's CE reduces to one scalar: the grads come out of the forward (3 GEMMs) with the softcap's derivative
    labels = torch.randint(0, V, (3, 5))
    labels[2, ::2] = -100
    (rw,) = check(gemma_softcap, labels=labels).rewrites
    assert "loss-aware mode" in rw.detail and "softcap 3" in rw.detail, rw


# ------------------------------------------------------------------------------------ a Gemma 2 model


def test_gemma2_final_logit_softcap_fuses_and_matches_eager():
    """A tiny Gemma 2 (final_logit_softcapping=30, tied embedding) through an SFT step: its lm_head, softcap and
    cross-entropy become one fused call, and the loss and every grad equal eager's."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Gemma2Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, vocab_size=101, max_position_embeddings=32, final_logit_softcapping=30.0,
        attn_logit_softcapping=None, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(cfg)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 101, (2, 9))

    def step(m, ids):
        logits = m(input_ids=ids, use_cache=False).logits
        return F.cross_entropy(logits[:, :-1].reshape(-1, 101), ids[:, 1:].reshape(-1))

    expected = step(reference, ids)
    expected.backward()
    got = torch.compile(step, backend="tilecompile", options=OPTIONS)(model, ids)
    got.backward()
    rep = tilecompile.report()
    (rw,) = rep.rewrites
    assert rw.pass_name == "fused_linear_ce" and "softcap 30" in rw.detail, rw
    assert not skip_reasons(rep), rep  # the attention's q·kᵀ (a product reaching a softmax) is no lm_head
    assert_close(got, expected, rtol=1e-5, atol=1e-5, name="loss")
    ref = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert_close(p.grad, ref[name].grad, rtol=1e-4, atol=1e-5, name=f"grad of {name}")
