"""Fuzzing the lm_head's loss-aware mode: hypothesis draws RL / SFT loss forms and checks the mode and the grads.

A drawn loss is a sum of per-token terms of the log-prob and entropy (PPO clip with old log-probs and advantages, the
k1 / k3 KL to reference log-probs, a squared log-ratio spelled ``d * d``, an entropy bonus, plain NLL), aggregated by
one of the usual reductions (token-mean, seq-mean-token-mean, seq-mean-token-sum, token-sum over a fixed length), with a
mask or none, scaled inside the graph or after it, optionally under activation checkpointing and with small row blocks.
Mixed in (the forms a review found, 8f2ccdf): per-token terms that read an external requiring grad (a value head
``h @ wv``, a learnable coefficient ``log_alpha.exp() * entropy`` or ``log_beta.exp() * kl``), whose grads must be
eager's too; the aggregate ``d`` squared as ``d * d`` or ``d ** 2``; the per-token values sliced (``logp[:, 1:]``,
OpenRLHF's ``logp[:, -k:]``) before the loss math; an external factor read after the log-probs' first use, changed in
place there (``mul_``, ``t[:1] *= 2``) or computed there under no_grad (the recompute mode must run, with its reason;
without a nonlinear first use before it, a linear sum of log-prob and entropy is still the lm_head region's and the op
may run after the external, in the loss-aware mode), or computed there in grad mode, or changed in place before the
lm_head (the loss-aware mode). Forms the mode must refuse (a per-token value returned, a value centred on its mean, a
sequence-level nonlinearity, a product of two means) are drawn too: they must fall back to the recompute mode. Every
case: the report's mode, then loss, grads of h and W and the inputs changed in place against eager (fp32), the
externals' grads (sums over all tokens) against float64 with eager fp32's own error as the margin.
Profiles: ``TILECOMPILE_FUZZ=ci`` (default, 60 examples, about a minute on 2 cores) or ``long`` (5,000 examples,
scaled by ``TILECOMPILE_FUZZ_SCALE``; about 1 s each).
"""

from __future__ import annotations

import copy
import dataclasses
import os

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from helpers import assert_close, compile_options
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

import tilecompile

TERMS = ("pg_clip", "kl_k1", "kl_k3", "kl_sq", "entropy_bonus", "nll")
EXTERNAL_TERMS = ("value_head", "alpha_entropy", "beta_kl")  # read a tensor that requires grad
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "token_sum_norm")
REFUSED = ("return_logp", "centred", "sequence_ratio", "product_of_means")
SLICES = (None, "drop_first", "last_k")
SQUARES = (None, "mul_self", "pow2")
# an external factor of the loss math: where it is changed / computed, and the reason the recompute mode gives
LATE = {None: None, "inplace_before": None, "grad_after": None, "inplace_after": "changes in place",
        "inplace_view_after": "changes in place", "no_grad_after": "another grad mode"}  # fmt: skip
V, D = 29, 12
LONG = settings.get_current_profile_name() == "long"
LONG_SCALE = float(os.environ.get("TILECOMPILE_FUZZ_SCALE", "1"))


@dataclasses.dataclass(frozen=True)
class LossSpec:
    terms: tuple[str, ...]
    aggregation: str
    refused: str | None = None  # one of REFUSED: the recompute mode must run
    slice: str | None = None  # one of SLICES: the per-token values (and the batch tensors) sliced first
    keep: int = 1  # last_k: how many tokens (at most all)
    square: str | None = None  # one of SQUARES: the loss d + 0.5 squared
    late: str | None = None  # a key of LATE
    # the late forms: sigmoid of the per-token sum first, a use of the log-probs before the late external for sure
    # (without it a linear sum of log-prob and entropy is still the lm_head region's, whose op then runs later)
    first_use: bool = True
    mask: str = "random"  # none | random | ones
    shift: bool = True
    temperature: float = 1.0
    scale_in_graph: float = 1.0
    scale_after: float = 1.0
    checkpoint: bool = False
    block_rows: int = 0
    batch: int = 2
    tokens: int = 7
    seed: int = 0

    @property
    def n(self) -> int:  # tokens per sequence that the lm_head scores
        return self.tokens - 1 if self.shift else self.tokens

    @property
    def start(self) -> int:  # the first token the loss reads
        return {None: 0, "drop_first": 1, "last_k": self.n - min(self.keep, self.n)}[self.slice]


def _per_token(spec: LossSpec, logp, entropy, h_tok, b):
    total = 0.0
    for term in spec.terms:
        if term == "pg_clip":
            ratio = torch.exp(logp - b["old"])
            adv = b["adv"][:, None]
            total = total + torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 0.8, 1.28))
        elif term == "kl_k1":
            total = total + 0.05 * (logp - b["ref"])
        elif term == "kl_k3":
            delta = b["ref"] - logp
            total = total + 0.04 * (torch.exp(delta) - delta - 1)
        elif term == "kl_sq":
            d = logp - b["ref"]
            total = total + 0.5 * (d * d)  # one operand twice: per token, still fine
        elif term == "entropy_bonus":
            total = total - 0.01 * entropy
        elif term == "nll":
            total = total - logp
        elif term == "value_head":  # actor-critic: a value head on h, an external that requires grad
            total = total + 0.5 * (h_tok @ b["wv"] - b["ret"]) ** 2
        elif term == "alpha_entropy":  # SAC-style learnable entropy coefficient
            total = total - b["log_alpha"].exp() * entropy
        elif term == "beta_kl":
            total = total + b["log_beta"].exp() * (logp - b["ref"])
    return total


def _aggregate(spec: LossSpec, x, mask):
    if spec.aggregation == "token_mean":
        return (x * mask).sum() / mask.sum()
    if spec.aggregation == "seq_mean_token_mean":
        return ((x * mask).sum(-1) / mask.sum(-1)).mean()
    if spec.aggregation == "seq_mean_token_sum":
        return (x * mask).sum(-1).mean()
    return (x * mask).sum() / (mask.shape[0] * 16)  # token-sum normalised by a fixed length (Dr. GRPO)


class Step(torch.nn.Module):
    def __init__(self, spec: LossSpec) -> None:
        super().__init__()
        self.spec = spec
        self.lm_head = torch.nn.Linear(D, V, bias=False)
        self.f64 = False  # the float64 reference: the loss math in float64 too

    def loss(self, h, ids, b):
        spec = self.spec
        if spec.late == "inplace_before":
            b["late"].mul_(3.0)  # before the lm_head: the op sees the new values too
        logits = self.lm_head(h)
        labels = ids
        if spec.shift:
            logits, labels = logits[:, :-1], ids[:, 1:]
        if spec.temperature != 1.0:
            logits = logits / spec.temperature
        z = logits.double() if self.f64 else logits.float()
        logp = F.log_softmax(z, dim=-1).gather(-1, labels[..., None]).squeeze(-1)
        entropy = torch.logsumexp(z, dim=-1) - (F.softmax(z, dim=-1) * z).sum(-1)
        h_tok = h[:, :-1] if spec.shift else h
        b = dict(b)
        if spec.slice is not None:
            sl = slice(1, None) if spec.slice == "drop_first" else slice(-min(spec.keep, spec.n), None)
            logp, entropy, h_tok = logp[:, sl], entropy[:, sl], h_tok[:, sl]
            for k in ("old", "ref", "ret", "mask"):
                b[k] = b[k][:, sl]
        mask = b["mask"]
        if spec.refused == "sequence_ratio":
            return -(torch.exp(((logp - b["old"]) * mask).sum(-1) / mask.sum(-1)) * b["adv"]).mean(), None
        x = _per_token(spec, logp, entropy, h_tok, b)
        if spec.late is not None and spec.first_use:
            x = torch.sigmoid(x)  # the log-probs' first use (at the latest): where the op runs
        if spec.late == "inplace_after":
            b["late"].mul_(3.0)
        elif spec.late == "inplace_view_after":
            b["late"][:1] *= 2.0
        if spec.late in ("inplace_before", "inplace_after", "inplace_view_after"):
            x = x * (0.5 + b["late"][:, None])
        elif spec.late == "no_grad_after":
            with torch.no_grad():
                baseline = h_tok @ b["wv0"]  # moved above the op in grad mode, it would carry a grad to h
            x = x * baseline
        elif spec.late == "grad_after":
            x = x * (h_tok @ b["wv0"])  # after the first use, same grad mode: an external with h's grad
        if spec.refused == "centred":
            x = x - logp.mean()
        loss = _aggregate(spec, x, mask) * spec.scale_in_graph
        if spec.refused == "product_of_means":
            loss = loss * ((entropy * mask).sum() / mask.sum())  # two linear values meet: not one loss
        if spec.square == "mul_self":
            d = loss + 0.5
            loss = d * d  # not linear in the log-probs: S is d
        elif spec.square == "pow2":
            loss = (loss + 0.5) ** 2
        return loss, (logp if spec.refused == "return_logp" else None)

    def forward(self, h, ids, b):
        if self.spec.checkpoint:
            loss, extra = torch.utils.checkpoint.checkpoint(self.loss, h, ids, b, use_reentrant=False)
        else:
            loss, extra = self.loss(h, ids, b)
        return (loss,) if extra is None else (loss, extra)


@st.composite
def loss_specs(draw):
    # half the examples a loss the mode takes, a quarter a refused form, a quarter a late external it must refuse
    kind = draw(st.sampled_from(("taken", "taken", "refused", "late")))
    refused = draw(st.sampled_from(REFUSED)) if kind == "refused" else None
    late_forms = [k for k, why in LATE.items() if (why is not None) == (kind == "late")]
    late = draw(st.sampled_from(late_forms if kind != "refused" else tuple(LATE)))
    terms = draw(st.lists(st.sampled_from(TERMS), min_size=1, max_size=3, unique=True))
    terms += draw(st.lists(st.sampled_from(EXTERNAL_TERMS), max_size=2, unique=True))
    slice_ = draw(st.sampled_from(SLICES))
    shift = draw(st.booleans())
    return LossSpec(
        terms=tuple(draw(st.permutations(terms))),
        aggregation=draw(st.sampled_from(AGGREGATIONS)),
        refused=refused,
        slice=slice_,
        keep=draw(st.integers(1, 8)),
        square=draw(st.sampled_from(SQUARES)),
        late=late,
        first_use=draw(st.sampled_from((True, True, False))),
        mask=draw(st.sampled_from(("none", "random", "ones"))),
        shift=shift,
        temperature=draw(st.sampled_from((1.0, 0.7, 1.3))),
        scale_in_graph=draw(st.sampled_from((1.0, 0.25, 3.0))),
        scale_after=draw(st.sampled_from((1.0, 0.125, 1024.0))),
        # an in-place change inside a checkpoint runs again in the recomputation (eager's grads differ themselves)
        checkpoint=draw(st.booleans()) and not (late or "").startswith("inplace"),
        block_rows=draw(st.sampled_from((0, 1, 4))),
        batch=draw(st.integers(1, 3)),
        tokens=draw(st.integers(2 + shift if slice_ == "drop_first" else 2, 9)),  # a token left after the slice
        seed=draw(st.integers(0, 2**16)),
    )


def _inputs(spec: LossSpec):
    g = torch.Generator().manual_seed(spec.seed)
    n = spec.n
    h = torch.randn(spec.batch, spec.tokens, D, generator=g)
    ids = torch.randint(0, V, (spec.batch, spec.tokens), generator=g)
    if spec.mask == "random":
        mask = (torch.rand(spec.batch, n, generator=g) > 0.3).float()
        mask[:, spec.start] = 1.0  # every sequence keeps a token the loss reads (an empty one is 0 / 0 in eager too)
    else:
        mask = torch.ones(spec.batch, n)
    b = {
        "mask": mask,
        "old": -torch.rand(spec.batch, n, generator=g) * 2 - 2,
        "ref": -torch.rand(spec.batch, n, generator=g) * 2 - 2,
        "adv": torch.randn(spec.batch, generator=g),
        "ret": torch.randn(spec.batch, n, generator=g),
        "late": torch.rand(spec.batch, generator=g),
        "wv0": torch.randn(D, generator=g) * 0.3,
        "wv": (torch.randn(D, generator=g) * 0.3).requires_grad_(),
        "log_alpha": torch.tensor(-2.0).requires_grad_(),
        "log_beta": torch.full((1,), -3.0).requires_grad_(),
    }
    return h, ids, b


def _copy(b: dict) -> dict:
    return {k: v.detach().clone().requires_grad_(v.requires_grad) for k, v in b.items()}


@settings(max_examples=max(1, round(5000 * LONG_SCALE)) if LONG else 60)  # each example compiles: ~1 s
@given(spec=loss_specs())
# the review's forms (8f2ccdf), each once in every profile, over several row blocks
@example(LossSpec(("pg_clip", "value_head"), "token_mean", block_rows=4, batch=3, tokens=9))
@example(LossSpec(("nll", "alpha_entropy", "beta_kl"), "seq_mean_token_mean", block_rows=1, checkpoint=True))
@example(LossSpec(("nll",), "token_mean", square="mul_self", block_rows=4, batch=3, tokens=9))
@example(LossSpec(("kl_k3", "entropy_bonus"), "seq_mean_token_sum", slice="drop_first", block_rows=1))
@example(LossSpec(("pg_clip",), "token_sum_norm", slice="last_k", keep=3, square="pow2", batch=3))
@example(LossSpec(("pg_clip",), "token_mean", late="inplace_after"))
@example(LossSpec(("kl_sq", "nll"), "token_mean", late="inplace_view_after", slice="last_k", keep=4))
@example(LossSpec(("entropy_bonus",), "seq_mean_token_mean", late="no_grad_after", block_rows=4))
@example(LossSpec(("pg_clip", "entropy_bonus"), "token_mean", late="grad_after", square="mul_self", block_rows=1))
def test_loss_forms_choose_their_mode_and_match_eager(spec):
    # a fresh Dynamo per example: a float attribute that changed between compiles would become symbolic (and keep
    # the recompute mode, tests/test_loss_aware.py::test_dynamic_shapes)
    torch._dynamo.reset()
    tilecompile.reset()
    torch.manual_seed(spec.seed)
    model = Step(spec)
    reference = copy.deepcopy(model)
    ref64 = copy.deepcopy(model).double()
    ref64.f64 = True
    h, ids, b = _inputs(spec)
    b64 = {k: v.detach().double().requires_grad_(v.requires_grad) for k, v in b.items()}
    h64 = h.double().requires_grad_()
    (ref64(h64, ids, b64)[0] * spec.scale_after).backward()
    b, b_ref = _copy(b), _copy(b)  # each side its own batch: the loss may change it in place
    h = h.requires_grad_()
    h_ref = h.detach().clone().requires_grad_()
    expected = reference(h_ref, ids, b_ref)
    options = compile_options(ce_loss_block_rows=spec.block_rows)
    actual = torch.compile(model, backend="tilecompile", options=options)(h, ids, b)
    (rw,) = [r for r in tilecompile.report().rewrites if r.pass_name == "fused_linear_ce"]
    # one sequence: the sequence-level value is itself a one-element loss, which the mode takes (exactly)
    refused = spec.refused and not (spec.refused == "sequence_ratio" and spec.batch == 1)
    # the sequence-level form returns before the late external is read
    why = None if spec.refused == "sequence_ratio" else LATE[spec.late]
    # the mode that ran (a recompute reason may name the loss-aware mode: "the loss-aware mode needs one ...")
    modes = [m for m in ("recompute mode", "loss-aware mode") if f"; {m} (" in rw.detail]
    assert len(modes) == 1, (spec, rw.detail)
    want = "recompute mode" if refused or why else "loss-aware mode"
    if why and not refused and not spec.first_use and modes == ["loss-aware mode"]:
        want = "loss-aware mode"  # the region's value first used after the late external: the op runs there too
    event(want)
    for form in (spec.refused, spec.slice, spec.square, spec.late, *set(spec.terms) & set(EXTERNAL_TERMS)):
        if form:
            event(f"{form}{'' if spec.first_use or not spec.late else ' (no first use)'} ({want})")
    assert modes == [want], (spec, rw.detail)
    if why and not refused and want == "recompute mode":
        assert why in rw.detail, (spec, rw.detail)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert_close(a, e, rtol=1e-5, atol=1e-6, name=f"output {i}")
    assert_close(b["late"], b_ref["late"], rtol=0, atol=0, name="late, changed in place")
    (actual[0] * spec.scale_after).backward()
    (expected[0] * spec.scale_after).backward()
    # fp32 sums in another order: each element within 1e-5 of itself or of 1e-5 of the tensor's largest entry
    grads = [("h", h.grad, h_ref.grad), ("W", model.lm_head.weight.grad, reference.lm_head.weight.grad)]
    for name, got, want in grads:
        assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()), name=f"grad of {name}")
    # an external's grad is a sum over all tokens (a scalar: log_alpha), with cancellation: held to float64, where
    # the compiled error may be twice eager fp32's plus 1e-5 of the largest entry
    for k in ("wv", "log_alpha", "log_beta"):
        got, want, exact = b[k].grad, b_ref[k].grad, b64[k].grad
        if want is None:  # an external the drawn loss does not read
            assert got is None, f"grad of {k}: eager has none, compiled has one"
            continue
        assert got is not None, f"grad of {k}: compiled has none"
        bar = 2 * float((want.double() - exact).abs().max()) + 1e-5 * float(exact.abs().max())
        assert_close(got, exact, rtol=0, atol=bar, name=f"grad of {k} (float64 reference)")
