"""The fused lm_head's loss-aware mode: grads in the forward when the graph reduces log-prob / entropy to a loss.

Each test compiles a loss, asserts which mode the report says ran, and compares the loss and the gradients of h and
the lm_head weight with eager's (fp32 on CPU; the GPU test compares bf16 with a float64 reference). A loss that is
not of the supported shape falls back to the recompute mode with a reason, and its gradients are eager's too.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from helpers import assert_close, compile_options, no_fallback, rel_err

import tilecompile
from tilecompile.kernels import fused_linear_ce as K
from tilecompile.ops import fused_linear_ce as O

B, T, D, V = 3, 11, 16, 37
TEMPERATURE = 0.9


class Head(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lm_head = torch.nn.Linear(D, V, bias=False)


def masked_mean(x, mask, dim=None):
    return (x * mask).sum() / mask.sum() if dim is None else (x * mask).sum(dim) / mask.sum(dim)


def logp_entropy(model, h, ids):
    logits = model.lm_head(h)[:, :-1]
    logits = logits / TEMPERATURE
    z = logits.float()
    logp = torch.gather(F.log_softmax(z, dim=-1), -1, ids[:, 1:, None]).squeeze(-1)
    entropy = torch.logsumexp(z, dim=-1) - (F.softmax(z, dim=-1) * z).sum(-1)
    return logp, entropy


def ppo_clip(logp, old, adv, low=0.2, high=0.28):
    ratio = torch.exp(logp - old)
    a = adv[:, None]
    return torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - low, 1 + high)), ratio


def ppo_token_mean(model, h, ids, batch):
    logp, entropy = logp_entropy(model, h, ids)
    pg, ratio = ppo_clip(logp, batch["old"], batch["adv"])
    clipfrac = masked_mean(((ratio - 1).abs() > 0.2).float(), batch["mask"])
    loss = masked_mean(pg, batch["mask"]) - 0.01 * masked_mean(entropy, batch["mask"])
    return loss, clipfrac.detach(), entropy.detach().mean()


def grpo_kl_seq_mean_token_mean(model, h, ids, batch):
    logp, _ = logp_entropy(model, h, ids)
    pg, _ = ppo_clip(logp, batch["old"], batch["adv"])
    delta = batch["ref"] - logp
    kl = torch.exp(delta) - delta - 1  # k3 estimator
    per_seq = masked_mean(pg + 0.04 * kl, batch["mask"], dim=-1)
    return per_seq.mean()


def seq_mean_token_sum(model, h, ids, batch):
    logp, entropy = logp_entropy(model, h, ids)
    pg, _ = ppo_clip(logp, batch["old"], batch["adv"])
    per_seq = ((pg - 0.001 * entropy) * batch["mask"]).sum(-1)
    return per_seq.mean() / 4.0  # a scale inside the graph (gradient accumulation over 4 micro-batches)


def entropy_bonus_only(model, h, ids, batch):
    _, entropy = logp_entropy(model, h, ids)
    return -masked_mean(entropy, batch["mask"])


def sft_cross_entropy(model, h, ids, batch):
    logits = model.lm_head(h)[:, :-1].float()
    labels = ids[:, 1:].masked_fill(batch["mask"] == 0, -100)
    return F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), ignore_index=-100)


def squared_loss(model, h, ids, batch):
    """Nonlinear after the reduction: S is the mean, its square is autograd's business (g = 2·S)."""
    logp, _ = logp_entropy(model, h, ids)
    return masked_mean(-logp, batch["mask"]) ** 2


def make_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, dict]:
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, D, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    batch = {
        "mask": (torch.rand(B, T - 1, generator=g) > 0.25).float(),
        "old": -torch.rand(B, T - 1, generator=g) * 3 - 1,
        "ref": -torch.rand(B, T - 1, generator=g) * 3 - 1,
        "adv": torch.randn(B, generator=g),
    }
    batch["mask"][:, 0] = 1.0
    return h, ids, batch


def _copy(batch: dict) -> dict:
    return {k: v.detach().clone().requires_grad_(v.requires_grad) for k, v in batch.items()}


def run(loss_fn, *, scale=1.0, options=None, dynamic=None, h_dtype=torch.float32, extra=None):
    """Compile ``loss_fn``; its first output times ``scale`` (a scale after the graph: gradient accumulation, a
    GradScaler) is backpropagated; loss, outputs and grads (of h, the lm_head and the batch tensors that require
    grad) must equal eager's. ``extra``: more batch tensors. Each side gets its own copy of the batch (a loss may
    change it in place). Returns the report."""
    torch.manual_seed(0)
    model = Head()
    reference = copy.deepcopy(model)
    h, ids, batch = make_batch()
    batch.update(extra or {})
    batch, batch_ref = _copy(batch), _copy(batch)
    h = h.to(h_dtype).requires_grad_()
    h_ref = h.detach().clone().requires_grad_()
    expected = loss_fn(reference, h_ref, ids, batch_ref)
    options = compile_options(**(options or {}))
    compiled = torch.compile(loss_fn, backend="tilecompile", options=options, dynamic=dynamic)
    actual = compiled(model, h, ids, batch)
    expected = expected if isinstance(expected, tuple) else (expected,)
    actual = actual if isinstance(actual, tuple) else (actual,)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert_close(a, e, rtol=1e-5, atol=1e-6, name=f"output {i}")
    (actual[0] * scale).backward()
    (expected[0] * scale).backward()
    atol = 1e-7 * scale  # grads are scale times larger: the same relative bar
    assert_close(h.grad, h_ref.grad, rtol=1e-5, atol=atol, name="grad of h")
    assert_close(model.lm_head.weight.grad, reference.lm_head.weight.grad, rtol=1e-5, atol=atol, name="grad of W")
    for k, v in batch.items():
        if v.requires_grad:
            assert_close(v.grad, batch_ref[k].grad, rtol=1e-5, atol=atol, name=f"grad of {k}")
    return tilecompile.report()


def detail(rep) -> str:
    (rw,) = [r for r in rep.rewrites if r.pass_name == "fused_linear_ce"]
    return rw.detail


LOSSES = [ppo_token_mean, grpo_kl_seq_mean_token_mean, seq_mean_token_sum, entropy_bonus_only, sft_cross_entropy,
          squared_loss]  # fmt: skip


@pytest.mark.parametrize("loss_fn", LOSSES, ids=lambda f: f.__name__)
def test_loss_aware_mode_runs_and_matches_eager(loss_fn):
    assert "loss-aware mode" in detail(run(loss_fn))


@pytest.mark.parametrize("scale", [0.25, 1024.0], ids=["grad_accumulation", "grad_scaler"])
def test_loss_scaled_after_the_graph(scale):
    assert "loss-aware mode" in detail(run(ppo_token_mean, scale=scale))


def test_row_blocks_smaller_than_the_tokens():
    # 30 tokens in blocks of 7: the per-token gradient of each block is formed before later rows are known
    assert "loss-aware mode" in detail(run(grpo_kl_seq_mean_token_mean, options={"ce_loss_block_rows": 7}))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_loss_keeps_its_dtype(dtype):
    """A CE mean on bf16 / fp16 logits is a bf16 / fp16 scalar: the op's fp32 zero anchor, added to it, must not
    promote it (a dtype change the pipeline's fake-tensor check rejected: the fuzzer's CI failure)."""
    torch.manual_seed(0)
    model = Head().to(dtype)
    reference = copy.deepcopy(model)
    h, ids, batch = make_batch()
    labels = ids[:, 1:].masked_fill(batch["mask"] == 0, -100).reshape(-1)

    def ce(model, h):
        return F.cross_entropy(model.lm_head(h)[:, :-1].reshape(-1, V), labels, ignore_index=-100)

    h = h.to(dtype).requires_grad_()
    h_ref = h.detach().clone().requires_grad_()
    actual = torch.compile(ce, backend="tilecompile", options=compile_options())(model, h)
    expected = ce(reference, h_ref)
    assert actual.dtype == dtype
    assert "loss-aware mode" in detail(tilecompile.report())
    assert_close(actual.float(), expected.float(), rtol=2e-2, atol=1e-3, name="loss")
    actual.backward()
    expected.backward()
    assert_close(h.grad.float(), h_ref.grad.float(), rtol=5e-2, atol=2e-3, name="grad of h")
    w, w_ref = model.lm_head.weight.grad, reference.lm_head.weight.grad
    assert_close(w.float(), w_ref.float(), rtol=5e-2, atol=2e-3, name="grad of W")


# Found by review: loss forms the mode must either get right or refuse (each once gave wrong grads or a crash).


def value_head_loss(model, h, ids, batch):
    """Actor-critic PPO: the loss math reads a value head on h, an external that requires grad."""
    logp, _ = logp_entropy(model, h, ids)
    pg, _ = ppo_clip(logp, batch["old"], batch["adv"])
    value = h[:, :-1] @ batch["wv"]
    return masked_mean(pg, batch["mask"]) + 0.5 * masked_mean((value - batch["ref"]) ** 2, batch["mask"])


def learnable_entropy_coefficient(model, h, ids, batch):
    logp, entropy = logp_entropy(model, h, ids)
    return masked_mean(-logp * batch["adv"][:, None] - batch["log_alpha"].exp() * entropy, batch["mask"])


def square_of_a_mean(model, h, ids, batch):
    d = masked_mean(logp_entropy(model, h, ids)[0], batch["mask"]) + 1.0
    return d * d  # not linear in the log-probs, though one operand: S is d, its square autograd's business


def sliced_logprobs(model, h, ids, batch):
    logp, _ = logp_entropy(model, h, ids)
    return (torch.sigmoid(logp[:, 1:]) * batch["mask"][:, 1:]).sum()  # OpenRLHF's log_probs[:, -num_actions:]


@pytest.mark.parametrize(
    ("loss_fn", "extra"),
    [
        (value_head_loss, {"wv": torch.randn(D).requires_grad_()}),
        (learnable_entropy_coefficient, {"log_alpha": torch.tensor(-2.0).requires_grad_()}),
        (square_of_a_mean, None),
        (sliced_logprobs, None),
    ],
    ids=lambda x: getattr(x, "__name__", ""),
)
def test_loss_aware_mode_on_review_cases(loss_fn, extra):
    # blocks of 7 rows of the 30 tokens: a loss treated as linear when it is not shows up across blocks
    assert "loss-aware mode" in detail(run(loss_fn, extra=extra, options={"ce_loss_block_rows": 7}))


def advantage_scaled_in_place(model, h, ids, batch):
    logp, _ = logp_entropy(model, h, ids)
    first = torch.sigmoid(logp)  # the log-probs' first use: where the op runs
    batch["adv"].mul_(3.0)  # the loss math reads the advantages after this
    return masked_mean(first * (batch["adv"][:, None] * 0.5), batch["mask"])


def baseline_under_no_grad(model, h, ids, batch):
    logp, _ = logp_entropy(model, h, ids)
    first = torch.sigmoid(logp)
    with torch.no_grad():
        baseline = h[:, :-1] @ batch["wv"]  # computed after the first use: moving it above would give it a grad
    return masked_mean(first * baseline, batch["mask"])


@pytest.mark.parametrize(
    ("loss_fn", "why"),
    [(advantage_scaled_in_place, "changes in place"), (baseline_under_no_grad, "another grad mode")],
    ids=lambda x: getattr(x, "__name__", ""),
)
def test_externals_changed_after_the_op_keep_the_recompute_mode(loss_fn, why):
    d = detail(run(loss_fn, extra={"wv": torch.randn(D)}))
    assert "recompute mode" in d and why in d, d


@pytest.mark.slow
def test_time_major_logits_through_inductor():
    """Transposed logits: the op's fake grad_h must have the real one's (contiguous) strides, or Inductor's
    stride assertion fails at run time."""

    def time_major(model, h, ids, batch):
        z = model.lm_head(h)[:, :-1].float().transpose(0, 1)
        logp = torch.gather(F.log_softmax(z, -1), -1, ids[:, 1:].t()[..., None]).squeeze(-1)
        return -(logp * batch["mask"].t()).mean()

    assert "loss-aware mode" in detail(run(time_major, options={"inner": "inductor"}))


def test_switched_off_by_the_option():
    d = detail(run(ppo_token_mean, options={"ce_loss_aware": False}))
    assert "recompute mode" in d and "ce_loss_aware=0" in d


def returns_logp(model, h, ids, batch):
    logp, _ = logp_entropy(model, h, ids)
    return masked_mean(-logp, batch["mask"]), logp


def centred(model, h, ids, batch):
    logp, _ = logp_entropy(model, h, ids)
    return masked_mean((logp - logp.mean()) ** 2, batch["mask"])


def sequence_level_ratio(model, h, ids, batch):
    logp, _ = logp_entropy(model, h, ids)
    seq_ratio = torch.exp(masked_mean(logp - batch["old"], batch["mask"], dim=-1))  # GSPO-style
    return -(seq_ratio * batch["adv"]).mean()


def two_losses(model, h, ids, batch):
    logp, entropy = logp_entropy(model, h, ids)
    return masked_mean(-logp, batch["mask"]), masked_mean(entropy, batch["mask"])


@pytest.mark.parametrize(
    ("loss_fn", "why"),
    [
        (returns_logp, "reach 2 values"),
        (centred, "reach 2 values"),  # logp and its mean meet in one element: not per token
        (sequence_level_ratio, "not a scalar loss"),
        (two_losses, "reach 2 values"),
    ],
    ids=lambda x: getattr(x, "__name__", ""),
)
def test_other_losses_fall_back_to_recompute_with_the_reason(loss_fn, why):
    d = detail(run(loss_fn))
    assert "recompute mode" in d and why in d, d


def test_no_grad_call_runs_the_forward_only_and_names_no_mode():
    model = Head()
    h, ids, batch = make_batch()
    compiled = torch.compile(ppo_token_mean, backend="tilecompile", options=compile_options())
    with torch.no_grad():
        expected = ppo_token_mean(model, h, ids, batch)
        actual = compiled(model, h, ids, batch)
    assert_close(actual[0], expected[0], rtol=1e-5, atol=1e-6, name="loss")
    d = detail(tilecompile.report())
    assert "mode" not in d, d


def test_dynamic_shapes():
    # under dynamic=True Python floats become symbolic; the loss math that reads one stays in the recompute mode
    rep = run(grpo_kl_seq_mean_token_mean, dynamic=True)
    details = [r.detail for r in rep.rewrites if r.pass_name == "fused_linear_ce"]
    assert details and all("recompute mode" in d and "symbolic Python number" in d for d in details), details


def test_through_inductor():
    # Inductor's CPU backend: the saved grads are donated to the backward, which scales them in place
    assert "loss-aware mode" in detail(run(ppo_token_mean, options={"inner": "inductor"}))


# --------------------------------------------------------------------------------------------- the op itself


def _ppo(lp, ent, old, adv, mask):
    ratio = torch.exp(lp - old)
    pg = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 0.8, 1.2))
    return (pg * mask).sum() / mask.sum() - 0.01 * (ent * mask).sum() / mask.sum()


@pytest.mark.parametrize("block_rows", [0, 5, 600])
@pytest.mark.parametrize("shifted", [False, True])
def test_op_against_float64(block_rows, shifted):
    """The op's logp and grads against the float64 formula; a shifted h[:, :-1] of long rows (one segment per
    sequence, no copy) and row blocks that straddle segments."""
    g = torch.Generator().manual_seed(1)
    rows = 700 if shifted else 37
    h_full = torch.randn(2, rows + 1, D, generator=g, dtype=torch.float64)
    w = torch.randn(V, D, generator=g, dtype=torch.float64) * 0.3
    y = torch.randint(0, V, (2, rows), generator=g)
    y[0, 3] = -100
    old = -torch.rand(2, rows, generator=g, dtype=torch.float64) - 2
    adv = torch.randn(2, 1, generator=g, dtype=torch.float64)
    mask = (torch.rand(2, rows, generator=g) > 0.2).double()
    fn = fx.symbolic_trace(_ppo)
    key = O.register_loss(fn, fn.code)
    h32 = h_full.float()[:, :-1] if shifted else h_full.float()[:, 1:].contiguous()
    if shifted:
        assert len(O._row_segments(h32)) == 2  # no copy of the shifted rows
    h32 = h32.detach().requires_grad_()
    w32 = w.float().requires_grad_()
    extras = [old.float(), adv.float(), mask.float()]
    lp, ent, dh, dw = torch.ops.tilecompile.fused_linear_logprob_loss(
        h32.detach(), w32.detach(), y, TEMPERATURE, -100, True, False, extras, key, block_rows
    )
    loss = _ppo(lp, ent, *extras) + torch.ops.tilecompile.loss_anchor(h32, w32, dh, dw)
    loss.backward()

    h64 = (h_full[:, :-1] if shifted else h_full[:, 1:]).clone().requires_grad_()
    w64 = w.clone().requires_grad_()
    lp64, ent64 = K.reference_logprob_entropy(h64, w64, y, TEMPERATURE, -100)
    _ppo(lp64, ent64, old, adv, mask).backward()
    assert_close(lp, lp64, rtol=1e-5, atol=1e-5, name="logp")
    assert rel_err(h32.grad, h64.grad) < 1e-5 and rel_err(w32.grad, w64.grad) < 1e-5


def test_op_without_a_registered_loss_says_so():
    h, w, y = torch.randn(4, D), torch.randn(V, D), torch.randint(0, V, (4,))
    with pytest.raises(RuntimeError, match="no loss function registered"):
        torch.ops.tilecompile.fused_linear_logprob_loss(h, w, y, 1.0, -100, True, False, [], 12345, 0)


# F's per-token gradient, compiled: the op evaluates it once per row block, so eager autograd's dozens of small
# kernels each time are what compiling it (torch.func.grad under torch.compile) removes.

_CALLS = {"compiles": 0, "runs": 0}


@torch._dynamo.register_backend(name="tc_test_counting")
def _counting_backend(gm, example_inputs):
    from torch._dynamo.backends.debugging import aot_eager

    _CALLS["compiles"] += 1
    compiled = aot_eager(gm, example_inputs)

    def call(*args):
        _CALLS["runs"] += 1
        return compiled(*args)

    return call


@torch._dynamo.register_backend(name="tc_test_failing")
def _failing_backend(gm, example_inputs):
    raise RuntimeError("this backend always fails")


def _op_case(rows: int, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    h, w = torch.randn(2, rows, D, generator=g), torch.randn(V, D, generator=g) * 0.3
    y = torch.randint(0, V, (2, rows), generator=g)
    y[1, 2] = -100
    extras = [-torch.rand(2, rows, generator=g) - 2, torch.randn(2, 1, generator=g),
              (torch.rand(2, rows, generator=g) > 0.2).float()]  # fmt: skip
    return h, w, y, extras


def _op_grads(case, key, backend, block_rows=5):
    h, w, y, extras = case
    return torch.ops.tilecompile.fused_linear_logprob_loss(
        h, w, y, TEMPERATURE, -100, True, False, extras, key, block_rows, backend
    )


def test_op_compiled_gradient_equals_eager_and_compiles_once_per_shape_kind():
    fn = fx.symbolic_trace(_ppo)
    key = O.register_loss(fn, fn.code)
    O._COMPILED.clear()
    _CALLS.update(compiles=0, runs=0)
    with no_fallback():
        for rows, blocks in ((37, 15), (45, 18), (53, 22)):  # 2 x rows tokens in blocks of 5
            case = _op_case(rows)
            runs = _CALLS["runs"]
            for a, e, name in zip(_op_grads(case, key, "tc_test_counting"), _op_grads(case, key, "eager"),
                                  ("logp", "entropy", "dh", "dW")):  # fmt: skip
                assert_close(a, e, rtol=1e-6, atol=1e-7, name=name)
            assert _CALLS["runs"] - runs == blocks  # F's gradient ran compiled, once per row block
    # the first length compiled static, the second recompiled with a symbolic length, the third reused it
    assert _CALLS["compiles"] == 2


def test_op_gradient_that_fails_to_compile_falls_back_to_eager_with_a_warning():
    fn = fx.symbolic_trace(_ppo)
    key = O.register_loss(fn, fn.code)
    O._COMPILED.clear()
    case = _op_case(37)
    expected = _op_grads(case, key, "eager")
    with pytest.warns(UserWarning, match="compiling the loss-aware gradient with backend 'tc_test_failing' failed"):
        actual = _op_grads(case, key, "tc_test_failing")
    for a, e in zip(actual, expected):
        assert_close(a, e, rtol=0, atol=0)
    with no_fallback():  # once is enough: the key stays on eager autograd
        _op_grads(case, key, "tc_test_failing")


def test_op_gradient_with_an_unknown_backend_falls_back_to_eager_with_a_warning():
    fn = fx.symbolic_trace(_ppo)
    key = O.register_loss(fn, fn.code)
    case = _op_case(37)
    with pytest.warns(UserWarning, match="backend 'no_such_backend' failed"):
        actual = _op_grads(case, key, "no_such_backend")
    for a, e in zip(actual, _op_grads(case, key, "eager")):
        assert_close(a, e, rtol=0, atol=0)


@pytest.mark.parametrize("loss_fn", [ppo_token_mean, grpo_kl_seq_mean_token_mean, sft_cross_entropy, square_of_a_mean],
                         ids=lambda f: f.__name__)  # fmt: skip
def test_compiled_per_token_gradient_through_the_backend(loss_fn):
    O._COMPILED.clear()
    with no_fallback():
        rep = run(loss_fn, options={"ce_loss_grad_compile": "aot_eager", "ce_loss_block_rows": 7})
    assert "loss-aware mode" in detail(rep)
    assert list(O._COMPILED) and all(f is not None for f in O._COMPILED.values())


def test_compiled_per_token_gradient_with_inductor_on_cpu():
    fn = fx.symbolic_trace(_ppo)
    key = O.register_loss(fn, fn.code)
    case = _op_case(37)
    with no_fallback():
        for a, e in zip(_op_grads(case, key, "inductor"), _op_grads(case, key, "eager")):
            assert_close(a, e, rtol=1e-5, atol=1e-6)


def test_grad_compile_setting_picks_the_backend():
    from tilecompile import config
    from tilecompile.passes.lm_head import _grad_backend

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    auto = config.load({}, environ={})
    assert _grad_backend(auto, cuda) == "inductor" and _grad_backend(auto, cpu) == "eager"
    assert _grad_backend(config.load({"inner": "aot_eager"}, environ={}), cuda) == "eager"
    assert _grad_backend(config.load({"ce_loss_grad_compile": "off"}, environ={}), cuda) == "eager"
    assert _grad_backend(config.load({"ce_loss_grad_compile": "aot_eager"}, environ={}), cpu) == "aot_eager"


@pytest.mark.gpu
@pytest.mark.parametrize("grad_backend", ["eager", "inductor"])
def test_bf16_on_gpu_against_float64(grad_backend):
    """bf16 grads of the loss-aware op against float64; the error may not exceed the recompute op's by much."""
    torch.manual_seed(0)
    n, d, v = 4096, 256, 32000
    dev = "cuda"
    h64 = torch.randn(n, d, dtype=torch.float64, device=dev)
    w64 = torch.randn(v, d, dtype=torch.float64, device=dev) * d**-0.5
    y = torch.randint(0, v, (n,), device=dev)
    old = -torch.rand(n, device=dev) - 2
    adv = torch.randn(n, device=dev)
    mask = (torch.rand(n, device=dev) > 0.1).float()
    fn = fx.symbolic_trace(_ppo)
    key = O.register_loss(fn, fn.code)

    def grads(which):
        h = h64.bfloat16().requires_grad_()
        w = w64.bfloat16().requires_grad_()
        if which == "loss-aware":
            lp, ent, dh, dw = torch.ops.tilecompile.fused_linear_logprob_loss(
                h.detach(), w.detach(), y, 1.0, -100, True, False, [old, adv, mask], key, 512, grad_backend
            )
            (_ppo(lp, ent, old, adv, mask) + torch.ops.tilecompile.loss_anchor(h, w, dh, dw)).backward()
        else:
            lp, ent = torch.ops.tilecompile.fused_linear_logprob(h, w, y, 1.0, -100, True)
            _ppo(lp, ent, old, adv, mask).backward()
        return h.grad, w.grad

    h_ref, w_ref = h64.clone().requires_grad_(), w64.clone().requires_grad_()
    lp64, ent64 = K.reference_logprob_entropy(h_ref, w_ref, y)
    _ppo(lp64, ent64, old.double(), adv.double(), mask.double()).backward()
    with no_fallback():
        ours, recompute = grads("loss-aware"), grads("recompute")
    for a, b, ref in zip(ours, recompute, (h_ref.grad, w_ref.grad)):
        assert rel_err(a, ref) <= 2 * rel_err(b, ref) + 1e-3, (rel_err(a, ref), rel_err(b, ref))


def test_checkpoint_policy_has_a_stable_cache_hash():
    """AOTAutograd's cache bypasses a graph whose selective-checkpoint context_fn has no cache_hash."""
    from tilecompile.passes import lm_head as P

    a, b = P._saves_loss_aware_op(), P._saves_loss_aware_op()
    assert a.cache_hash == b.cache_hash and a.cache_hash.startswith("tilecompile-")
    cache = pytest.importorskip("torch._functorch._aot_autograd.autograd_cache")
    if not hasattr(cache, "_collect_context_fn_hashes"):
        pytest.skip("this torch's AOTAutograd cache does not read context_fn hashes")
    gm = fx.GraphModule(torch.nn.Module(), fx.Graph())
    gm.meta["_checkpoint_context_fn"] = a
    assert cache._collect_context_fn_hashes(gm) == [a.cache_hash]  # no BypassAOTAutogradCache


def test_checkpointed_loss_saves_the_op_instead_of_running_it_again(monkeypatch):
    """torch.utils.checkpoint around lm_head + loss: the body's policy saves the loss-aware op's outputs, so its
    3 GEMMs run once (in the forward), not again in the backward's recomputation."""
    calls = []
    forward = K.fused_linear_logprob_loss_fwd
    monkeypatch.setattr(K, "fused_linear_logprob_loss_fwd", lambda *a, **k: calls.append(1) or forward(*a, **k))

    def checkpointed(model, h, ids, batch):
        loss = torch.utils.checkpoint.checkpoint(
            lambda m, x: ppo_token_mean(m, x, ids, batch)[0], model, h, use_reentrant=False
        )
        return loss

    d = detail(run(checkpointed))
    assert "loss-aware mode" in d and "saved, not recomputed" in d, d
    assert len(calls) == 1


def test_loss_gradient_under_a_dynamic_compile_compiles_once(monkeypatch):
    """Under ``torch.compile(dynamic=True)`` the op's own compile of the per-token gradient (made while the step runs,
    inside the step's dynamic setting) is symbolic from its first call: the step's second length compiles nothing."""
    O._COMPILED.clear()
    options = compile_options(ce_loss_grad_compile="aot_eager")
    step = torch.compile(sft_cross_entropy, backend="tilecompile", options=options, dynamic=True)
    graphs, compile_ = [], torch.compile

    def counting_compile(fn, *, backend, **kwargs):  # the op's compile of the gradient (the step's is made above)
        def count(gm, inputs):
            graphs.append(gm)
            return torch._dynamo.lookup_backend(backend)(gm, inputs)

        return compile_(fn, backend=count, **kwargs)

    monkeypatch.setattr(torch, "compile", counting_compile)
    # no profile of an earlier process (Dynamo's local PGO would start the gradient symbolic after a first run)
    monkeypatch.setattr(torch._dynamo.config, "automatic_dynamic_local_pgo", False)
    model = Head()
    for t in (T, T - 3):
        h, ids, batch = make_batch()
        batch = {k: v[:, : t - 1].clone() if v.dim() == 2 else v for k, v in batch.items()}
        with no_fallback():
            out = step(model, h[:, :t].clone().requires_grad_(), ids[:, :t].clone(), batch)
            (out[0] if isinstance(out, tuple) else out).backward()
        model.zero_grad(set_to_none=True)  # as before the first call: no guard on a grad that appeared
    rep = tilecompile.report()
    assert rep.graphs == 1 and "loss-aware mode" in detail(rep), rep  # one dynamic compile of the step
    assert len(graphs) == 1, [g.code for g in graphs]
