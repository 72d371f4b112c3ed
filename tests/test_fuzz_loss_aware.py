"""Fuzzing the lm_head's loss-aware mode: hypothesis draws RL / SFT loss forms and checks the mode and the grads.

A drawn loss is a sum of per-token terms of the log-prob and entropy (PPO clip with old log-probs and advantages,
the k1 / k3 KL to reference log-probs, an entropy bonus, plain NLL), aggregated by one of the usual reductions
(token-mean, seq-mean-token-mean, seq-mean-token-sum, token-sum over a fixed length), with a mask or none, scaled
inside the graph or after it, optionally under activation checkpointing and with small row blocks. Forms the mode
must refuse (a per-token value returned, a value centred on its mean, a sequence-level nonlinearity) are drawn too:
they must fall back to the recompute mode. Every case: the report's mode, then loss and grads against eager (fp32).
Profiles: ``TILECOMPILE_FUZZ=ci`` (default, a few examples) or ``long``.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from helpers import assert_close, compile_options
from hypothesis import given, settings
from hypothesis import strategies as st

import tilecompile

TERMS = ("pg_clip", "kl_k1", "kl_k3", "entropy_bonus", "nll")
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "token_sum_norm")
REFUSED = ("return_logp", "centred", "sequence_ratio")
V, D = 29, 12


@dataclasses.dataclass(frozen=True)
class LossSpec:
    terms: tuple[str, ...]
    aggregation: str
    refused: str | None = None  # one of REFUSED: the recompute mode must run
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


def _per_token(spec: LossSpec, logp, entropy, b):
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
        elif term == "entropy_bonus":
            total = total - 0.01 * entropy
        elif term == "nll":
            total = total - logp
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

    def loss(self, h, ids, b):
        spec = self.spec
        logits = self.lm_head(h)
        labels = ids
        if spec.shift:
            logits, labels = logits[:, :-1], ids[:, 1:]
        if spec.temperature != 1.0:
            logits = logits / spec.temperature
        z = logits.float()
        logp = F.log_softmax(z, dim=-1).gather(-1, labels[..., None]).squeeze(-1)
        entropy = torch.logsumexp(z, dim=-1) - (F.softmax(z, dim=-1) * z).sum(-1)
        x = _per_token(spec, logp, entropy, b)
        if spec.refused == "centred":
            x = x - logp.mean()
        if spec.refused == "sequence_ratio":
            return -(torch.exp(((logp - b["old"]) * b["mask"]).sum(-1) / b["mask"].sum(-1)) * b["adv"]).mean(), None
        loss = _aggregate(spec, x, b["mask"]) * spec.scale_in_graph
        return loss, (logp if spec.refused == "return_logp" else None)

    def forward(self, h, ids, b):
        if self.spec.checkpoint:
            loss, extra = torch.utils.checkpoint.checkpoint(self.loss, h, ids, b, use_reentrant=False)
        else:
            loss, extra = self.loss(h, ids, b)
        return (loss,) if extra is None else (loss, extra)


@st.composite
def loss_specs(draw):
    refused = draw(st.sampled_from((None, None, None, *REFUSED)))
    return LossSpec(
        terms=tuple(draw(st.lists(st.sampled_from(TERMS), min_size=1, max_size=3, unique=True))),
        aggregation=draw(st.sampled_from(AGGREGATIONS)),
        refused=refused,
        mask=draw(st.sampled_from(("none", "random", "ones"))),
        shift=draw(st.booleans()),
        temperature=draw(st.sampled_from((1.0, 0.7, 1.3))),
        scale_in_graph=draw(st.sampled_from((1.0, 0.25, 3.0))),
        scale_after=draw(st.sampled_from((1.0, 0.125, 1024.0))),
        checkpoint=draw(st.booleans()),
        block_rows=draw(st.sampled_from((0, 1, 4))),
        batch=draw(st.integers(1, 3)),
        tokens=draw(st.integers(2, 9)),
        seed=draw(st.integers(0, 2**16)),
    )


def _inputs(spec: LossSpec):
    g = torch.Generator().manual_seed(spec.seed)
    n = spec.tokens - 1 if spec.shift else spec.tokens
    h = torch.randn(spec.batch, spec.tokens, D, generator=g)
    ids = torch.randint(0, V, (spec.batch, spec.tokens), generator=g)
    if spec.mask == "random":
        mask = (torch.rand(spec.batch, n, generator=g) > 0.3).float()
        mask[:, 0] = 1.0  # every sequence keeps a token (an empty one is 0 / 0 in eager too)
    else:
        mask = torch.ones(spec.batch, n)
    b = {
        "mask": mask,
        "old": -torch.rand(spec.batch, n, generator=g) * 2 - 2,
        "ref": -torch.rand(spec.batch, n, generator=g) * 2 - 2,
        "adv": torch.randn(spec.batch, generator=g),
    }
    return h, ids, b


@settings(max_examples=settings.default.max_examples // 2 or 1)  # each example compiles: 12 in CI
@given(spec=loss_specs())
def test_loss_forms_choose_their_mode_and_match_eager(spec):
    # a fresh Dynamo per example: a float attribute that changed between compiles would become symbolic (and keep
    # the recompute mode, tests/test_loss_aware.py::test_dynamic_shapes)
    torch._dynamo.reset()
    tilecompile.reset()
    torch.manual_seed(spec.seed)
    model = Step(spec)
    reference = copy.deepcopy(model)
    h, ids, b = _inputs(spec)
    h = h.requires_grad_()
    h_ref = h.detach().clone().requires_grad_()
    expected = reference(h_ref, ids, b)
    options = compile_options(ce_loss_block_rows=spec.block_rows)
    actual = torch.compile(model, backend="tilecompile", options=options)(h, ids, b)
    (rw,) = [r for r in tilecompile.report().rewrites if r.pass_name == "fused_linear_ce"]
    # one sequence: the sequence-level value is itself a one-element loss, which the mode takes (exactly)
    refused = spec.refused and not (spec.refused == "sequence_ratio" and spec.batch == 1)
    want = "recompute mode" if refused else "loss-aware mode"
    assert want in rw.detail, (spec, rw.detail)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert_close(a, e, rtol=1e-5, atol=1e-6, name=f"output {i}")
    (actual[0] * spec.scale_after).backward()
    (expected[0] * spec.scale_after).backward()
    # fp32 sums in another order: each element within 1e-5 of itself or of 1e-5 of the tensor's largest entry
    for name, got, want in (("h", h.grad, h_ref.grad), ("W", model.lm_head.weight.grad, reference.lm_head.weight.grad)):
        assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()), name=f"grad of {name}")
