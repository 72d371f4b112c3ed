"""The canonical pass (passes/canonical.py): spellings that hide a value are the value for every later pass.

``x * 1.0``, ``x / 1``, ``x - 0``, ``0 + x`` beside an MLP's up projection still tile; ``torch.min(a, b)`` in a PPO
loss still takes the lm_head's loss-aware mode; a custom autograd.Function whose forward is a linear and whose
backward is its gradient is read as that linear (and one whose backward is not keeps its call, with a reason). Where
the identity would change a value (dtype, a write in place, no_grad, a returned tensor) the node stays: each such
case is compiled and compared with eager, so a wrong rewrite shows as a wrong value.
"""

from __future__ import annotations

import pytest
import test_loss_aware as LAT
import torch
import torch.nn.functional as F
from helpers import as_torch_2_11, assert_close, compile_options, torch_2_11_form_backend
from test_graph import capture

import tilecompile

D, INTER = 16, 24


def _compile(fn, **options):
    return torch.compile(fn, backend="tilecompile", options=compile_options(**options))


class MLP(torch.nn.Module):
    def __init__(self, spell: str) -> None:
        super().__init__()
        self.spell = spell
        self.gate = torch.nn.Linear(D, INTER, bias=False)
        self.up = torch.nn.Linear(D, INTER, bias=False)
        self.down = torch.nn.Linear(INTER, D, bias=False)

    def forward(self, x):
        up, s = self.up(x), self.spell
        spellings = {
            "times_one": lambda: up * 1.0, "one_times": lambda: 1 * up, "div_one": lambda: up / 1.0,
            "minus_zero": lambda: up - 0, "zero_plus": lambda: 0.0 + up, "method_mul": lambda: up.mul(1),
        }  # fmt: skip
        up = spellings[s]()
        return self.down(F.silu(self.gate(x)) * up)


@pytest.mark.parametrize("spell", ["times_one", "one_times", "div_one", "minus_zero", "zero_plus", "method_mul"])
def test_neutral_literal_beside_the_up_projection_tiles(spell):
    model = MLP(spell)
    x = torch.randn(2, 5, D, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    ref = MLP(spell)
    ref.load_state_dict(model.state_dict())
    out = _compile(model)(x)
    expected = ref(x_ref)
    assert_close(out, expected, rtol=1e-5, atol=1e-6, name="out")
    out.sum().backward()
    expected.sum().backward()
    assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6, name="grad of x")
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, name=f"grad of {name}")
    assert tilecompile.report().counts["tiled_mlp"] == 1, tilecompile.report()


def test_switched_off_the_spelling_hides_the_projection():
    _compile(MLP("times_one"), canonical=False)(torch.randn(2, 5, D))
    rep = tilecompile.report()
    assert rep.counts["tiled_mlp"] == 0
    assert any("is not a linear (up projection)" in s.reason for s in rep.skipped), rep


def _same_as_eager(fn, *inputs):
    eager = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    expected = fn(*eager)
    actual = _compile(fn)(*inputs)
    expected, actual = (v if isinstance(v, tuple) else (v,) for v in (expected, actual))
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert a.dtype == e.dtype, f"output {i}: {a.dtype} != {e.dtype}"
        assert_close(a, e, rtol=0, atol=0, name=f"output {i}")
    return inputs, eager, actual


def _written_after(a):
    x = a.sin()
    y = x * 1.0  # y is written below: it must stay a tensor of its own, or x changes too
    y.add_(1.0)
    return x.cos(), y


def _operand_written(a):
    x = a.sin()
    y = x + 0.0
    x.mul_(3.0)  # x changes after y was taken
    return y.cos(), x


def _view_written(a):
    x = a.sin()
    y = x - 0
    y[0].zero_()
    return x.cos(), y


def _int_plus_float(ids):
    return (ids + 0.0) * 2  # a float: the node changes the dtype


def _returned(a):
    x = a.sin()
    return x, x * 1.0  # two outputs that must not be one tensor


@pytest.mark.parametrize("fn", [_written_after, _operand_written, _view_written, _returned], ids=lambda f: f.__name__)
def test_identity_kept_where_it_would_change_a_value(fn):
    _, _, actual = _same_as_eager(fn, torch.randn(4, 3))
    if fn is _returned:
        assert actual[0].data_ptr() != actual[1].data_ptr()


def test_integer_plus_float_zero_stays_a_float():
    _same_as_eager(_int_plus_float, torch.arange(6))


def test_no_grad_plus_zero_stays_detached():
    def f(x, w):
        with torch.no_grad():
            y = x + 0.0
        return (y * w).sum() + (x * 2).sum()

    x, w = torch.randn(5, requires_grad=True), torch.randn(5, requires_grad=True)
    (x, w), (x_ref, w_ref), (out,) = _same_as_eager(f, x, w)
    out.backward()
    f(x_ref, w_ref).backward()
    assert_close(x.grad, x_ref.grad, rtol=0, atol=0, name="grad of x")  # 2 everywhere: nothing through y
    assert_close(w.grad, w_ref.grad, rtol=0, atol=0, name="grad of w")


def test_min_max_of_two_tensors_and_the_reductions():
    def f(a, b):
        lo, hi = torch.min(a, b), torch.max(a, other=b)
        return lo, hi, a.min(b), torch.max(a, 1)[0], torch.min(a), a.max(dim=0).values

    a, b = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4, requires_grad=True)
    _same_as_eager(f, a, b)


def ppo_torch_min(model, h, ids, batch):
    """TRL's GRPO spelling of the clip: -min(ratio * A, clamp(ratio) * A)."""
    logp, entropy = LAT.logp_entropy(model, h, ids)
    ratio = torch.exp(logp - batch["old"])
    a = batch["adv"][:, None]
    pg = -torch.min(ratio * a, torch.clamp(ratio, 0.8, 1.28) * a)
    return LAT.masked_mean(pg, batch["mask"]) - 0.01 * LAT.masked_mean(entropy, batch["mask"])


def ppo_torch_max_method(model, h, ids, batch):
    logp, _ = LAT.logp_entropy(model, h, ids)
    ratio = torch.exp(logp - batch["old"])
    a = batch["adv"][:, None]
    return LAT.masked_mean((-a * ratio).max(-a * torch.clamp(ratio, 0.8, 1.28)), batch["mask"])


@pytest.mark.parametrize("loss_fn", [ppo_torch_min, ppo_torch_max_method], ids=lambda f: f.__name__)
def test_ppo_clip_with_torch_min_takes_the_loss_aware_mode(loss_fn):
    assert "loss-aware mode" in LAT.detail(LAT.run(loss_fn))


def test_ppo_clip_with_torch_min_without_the_pass_keeps_the_recompute_mode():
    assert "recompute mode" in LAT.detail(LAT.run(ppo_torch_min, options={"canonical": False}))


class _Linear(torch.autograd.Function):
    """A library's linear: forward x @ w.t(), backward its exact gradient (as Megatron-Core's, at TP world size 1)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return torch.matmul(x, w.t())

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g2, x2 = g.contiguous().view(-1, g.shape[-1]), x.contiguous().view(-1, x.shape[-1])
        return g.matmul(w), g2.t().matmul(x2)


class _ScaledGrad(_Linear):
    """Forward a linear, backward twice its gradient: not the linear's function, so it must not be read as one."""

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g2, x2 = g.contiguous().view(-1, g.shape[-1]), x.contiguous().view(-1, x.shape[-1])
        return 2 * g.matmul(w), g2.t().matmul(x2)


class _Head(torch.nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn
        self.w = torch.nn.Parameter(torch.randn(37, D) / 4)

    def forward(self, h, ids):
        logits = self.fn.apply(h, self.w).float()
        return -torch.gather(logits.log_softmax(-1), -1, ids[..., None]).mean()


@pytest.mark.parametrize("form", ["dynamo", "torch_2_11"])
@pytest.mark.parametrize("fn", [_Linear, _ScaledGrad], ids=["exact_gradient", "other_gradient"])
def test_linear_autograd_function_read_only_when_its_backward_is_the_gradient(fn, form):
    """``torch_2_11``: the graph in the form Dynamo of torch 2.11 records (``helpers.as_torch_2_11``: mcore's linear
    comes back as ``(x @ w.t(), w.t())`` with an unused gradient for ``w.t()``, seen on the H200), read the same."""
    model, ref = _Head(fn), _Head(fn)
    ref.load_state_dict(model.state_dict())
    h = torch.randn(3, 7, D, requires_grad=True)
    h_ref = h.detach().clone().requires_grad_()
    ids = torch.randint(0, 37, (3, 7))
    compiled = _compile(model) if form == "dynamo" else torch.compile(model, backend=torch_2_11_form_backend())
    out, expected = compiled(h, ids), ref(h_ref, ids)
    out.backward()
    expected.backward()
    assert_close(out, expected, rtol=1e-5, atol=1e-6, name="loss")
    assert_close(h.grad, h_ref.grad, rtol=1e-5, atol=1e-6, name="grad of h")
    assert_close(model.w.grad, ref.w.grad, rtol=1e-5, atol=1e-6, name="grad of w")
    rep = tilecompile.report()
    if fn is _Linear:
        assert rep.counts["canonical"] == 1 and rep.counts["fused_linear_ce"] == 1, rep
    else:
        assert rep.counts["fused_linear_ce"] == 0, rep
        (skip,) = [s for s in rep.skipped if s.pass_name == "canonical"]
        assert "not read as a linear or a loss" in skip.reason and "is not the linear's" in skip.reason, skip


def _torch_2_11_linear_graph():
    """_Head(_Linear)'s Dynamo graph in torch 2.11's form, with its autograd.Function call."""
    gm = as_torch_2_11(capture(_Head(_Linear), torch.randn(3, 7, D), torch.randint(0, 37, (3, 7))))
    (call,) = [n for n in gm.graph.nodes if getattr(n.target, "__name__", None) == "autograd_function_apply"]
    return gm, call


@pytest.mark.parametrize("reader", ["outer graph", "backward"])
def test_torch_2_11_extra_result_that_is_read_keeps_the_call(reader):
    """The extra results are set aside only while nothing reads them: one the outer graph uses (a side effect's
    value) or whose gradient the backward reads keeps the call, with a reason."""
    from tilecompile.passes.lm_head import library_kernels as LK

    gm, call = _torch_2_11_linear_graph()
    if reader == "outer graph":
        (extra,) = [u for u in call.users if u.args[1] == 1]
        with gm.graph.inserting_after(extra):
            gm.graph.call_method("sum", (extra,))
    else:
        bwd = getattr(gm, call.args[1].target)
        unused = [n for n in bwd.graph.nodes if n.op == "placeholder"][1]
        with bwd.graph.inserting_after(unused):
            bwd.graph.call_method("sum", (unused,))
    reason = LK.read_function(call, gm)
    assert isinstance(reason, str) and reason.endswith("not read as a linear or a loss: its forward returns 2 values")
    gm, call = _torch_2_11_linear_graph()  # untouched, the same form is read as the linear
    assert isinstance(LK.read_function(call, gm), LK.FunctionCall)
