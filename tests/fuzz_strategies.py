"""Hypothesis strategies for the pass fuzz tests (tests/test_fuzz.py): small modules in every spelling a pass claims
to match, near-misses it must leave alone, and the shapes, dtypes and inputs to run them on.

A case is a frozen spec (plain data, so hypothesis prints it and a failure can be pasted into a regression test)
plus ``build_*`` functions that turn it into an ``nn.Module`` and inputs. Every module also runs as the float64
reference: ``module.reference = True`` drops the spelled-out dtype casts (``.float()``), so the reference stays
in float64 end to end.

Spellings follow the passes' docstrings:

- ``passes/fused_linear_ce.py``: lm_head linear (``nn.Linear`` / ``F.linear`` / ``h @ W.t()`` / ``matmul(h, W.T)``),
  optional ``.float()``, temperature (Python number: ``/ t``, ``* (1/t)``, ``.div(t)``, in-place ``.div_(t)``;
  or a 0-d tensor), optional shift (``logits[:, :-1]`` with ``labels[:, 1:]``), then log-prob
  (``log_softmax().gather()``, ``take_along_dim``, ``gather - logsumexp``, ``-cross_entropy(reduction="none")``),
  entropy (``lse - Σ p·z``, ``-Σ p·log p``, ``-Σ exp(logp)·logp``), both, or a CE / NLL loss (mean, sum).
- ``passes/tiled_mlp.py``: ``down(act(gate(x)) * up(x))``, linears in any spelling (``nn.Linear``, ``F.linear``,
  ``x @ w.t()``, a separate bias add), SiLU / GELU (exact, tanh) / ReLU in their spellings, either order of the
  gate multiply, fused ``gate_up`` weights cut by ``chunk``, ``split`` or slicing (either half first).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from hypothesis import strategies as st
from torch import nn

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# ------------------------------------------------------------------------------------------------ lm_head / CE

CE_LINEARS = ("module", "F.linear", "matmul_t", "matmul_T", "transpose")
CE_TEMPERATURES = ("none", "div", "mul_inv", "div_method", "div_", "torch.div", "tensor", "tensor_grad")
# head -> (fires, needs every label valid): gather in eager fails on negative labels, so a gather-based
# log-prob gets no ignored rows; cross_entropy / nll_loss spellings take ignore_index and ignored rows.
CE_HEADS = {
    "log_softmax_gather": (True, True),
    "take_along_dim": (True, True),
    "gather_minus_logsumexp": (True, True),
    "neg_ce_none": (True, False),
    "entropy_lse": (True, False),
    "entropy_plogp": (True, False),
    "entropy_exp_logp": (True, False),
    "logp_and_entropy": (True, True),
    "ce_mean": (True, False),
    "ce_sum": (True, False),
    "nll_mean": (True, False),  # nll_loss(log_softmax(z.reshape(-1, V)), y.reshape(-1))
    "nll_mean_reshaped_logp": (True, False),  # nll_loss(log_softmax(z).reshape(-1, V), y.reshape(-1))
    "ce_mean_and_entropy": (True, False),
    "trl_selective": (True, True),  # TRL's selective_log_softmax: per-row logsumexp / log_softmax, then stack
}
# near-misses: each computes something from the logits the fused op cannot (or must not) replace
CE_NEAR_MISSES = {
    "logits_returned": True,  # log-prob, and the logits leave the graph too
    "argmax_too": True,  # log-prob, and argmax of the logits (sampling / accuracy)
    "lse_alone": False,  # logsumexp(z) on its own (a z-loss term), no log-prob
    "softmax_dim0": False,  # log_softmax over the token dim: not a softmax over the vocabulary
    "bias": True,  # lm_head with a bias (the fused op has none)
    "computed_weight": True,  # weight computed in the graph (W * 2), not a parameter
    "probs_returned": False,  # softmax(z) leaves the graph
}


@dataclasses.dataclass(frozen=True)
class CESpec:
    """One lm_head -> log-prob / entropy / CE module, in one spelling."""

    head: str  # a key of CE_HEADS or CE_NEAR_MISSES
    linear: str = "F.linear"
    temperature: str = "none"
    t: float = 1.0
    cast_float: bool = False  # logits.float() after the linear
    shift: bool = False  # logits[:, :-1] against labels[:, 1:] ([B, T, D] only)
    ignore_index: int = -100
    autocast: bool = False  # the linear under torch.autocast("cpu", bfloat16) (fp32 inputs only)

    @property
    def near_miss(self) -> bool:
        return self.head in CE_NEAR_MISSES

    @property
    def labels_all_valid(self) -> bool:
        if self.head in CE_HEADS:
            return CE_HEADS[self.head][1]
        return self.head in ("logits_returned", "argmax_too", "bias", "computed_weight")

    @property
    def fires(self) -> int:
        return 0 if self.near_miss else 1


class LMHead(nn.Module):
    """``forward(h, labels[, t]) -> tuple of outputs`` in the spelling ``spec`` names."""

    def __init__(self, spec: CESpec, d: int, v: int) -> None:
        super().__init__()
        self.spec = spec
        self.lm_head = nn.Linear(d, v, bias=spec.head == "bias")
        self.reference = False

    def logits(self, h: torch.Tensor, t: torch.Tensor | None) -> torch.Tensor:
        if self.spec.autocast and not self.reference:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                z = self.linear(h)
        else:
            z = self.linear(h)
        return self.scale(z, t)

    def linear(self, h: torch.Tensor) -> torch.Tensor:
        s, w = self.spec, self.lm_head.weight
        if s.head == "computed_weight":
            z = F.linear(h, w * 2.0)
        elif s.head == "bias" or s.linear == "module":
            z = self.lm_head(h)
        elif s.linear == "F.linear":
            z = F.linear(h, w)
        elif s.linear == "matmul_t":
            z = h @ w.t()
        elif s.linear == "matmul_T":
            z = torch.matmul(h, w.T)
        else:
            z = h @ w.transpose(0, 1)
        return z

    def scale(self, z: torch.Tensor, t: torch.Tensor | None) -> torch.Tensor:
        s = self.spec
        if s.cast_float and not self.reference:
            z = z.float()
        if s.temperature == "div":
            z = z / s.t
        elif s.temperature == "mul_inv":
            z = z * (1.0 / s.t)
        elif s.temperature == "div_method":
            z = z.div(s.t)
        elif s.temperature == "div_":
            z.div_(s.t)
        elif s.temperature == "torch.div":
            z = torch.div(z, s.t)
        elif s.temperature in ("tensor", "tensor_grad"):
            z = z / t
        return z

    def forward(self, h: torch.Tensor, labels: torch.Tensor, t: torch.Tensor | None = None) -> tuple:
        s = self.spec
        z = self.logits(h, t)
        if s.shift:
            z, labels = z[:, :-1], labels[:, 1:]
        v, ii = z.shape[-1], s.ignore_index
        head = s.head
        if head in ("log_softmax_gather", "logits_returned", "argmax_too", "bias", "computed_weight"):
            logp = z.log_softmax(dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
            if head == "logits_returned":
                return logp, z
            if head == "argmax_too":
                return logp, (z.argmax(-1) == labels).float()
            return (logp,)
        if head == "take_along_dim":
            return (torch.take_along_dim(F.log_softmax(z, dim=-1), labels[..., None], dim=-1).squeeze(-1),)
        if head == "gather_minus_logsumexp":
            return (z.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1),)
        if head == "neg_ce_none":
            nll = F.cross_entropy(z.reshape(-1, v), labels.reshape(-1), ignore_index=ii, reduction="none")
            return (-nll.view(labels.shape),)
        if head == "entropy_lse":
            return (torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1),)
        if head == "entropy_plogp":
            p = F.softmax(z, dim=-1)
            return (-(p * F.log_softmax(z, dim=-1)).sum(-1),)
        if head == "entropy_exp_logp":
            lp = z.log_softmax(-1)
            return (-torch.sum(lp.exp() * lp, dim=-1),)
        if head == "logp_and_entropy":  # verl's logprobs_from_logits + entropy_from_logits
            logp = torch.gather(z.log_softmax(-1), -1, labels.unsqueeze(-1)).squeeze(-1)
            p = torch.nn.functional.softmax(z, dim=-1)
            entropy = torch.logsumexp(z, dim=-1) - torch.sum(p * z, dim=-1)
            return logp, entropy
        if head == "ce_mean":
            return (F.cross_entropy(z.reshape(-1, v), labels.reshape(-1), ignore_index=ii),)
        if head == "ce_sum":
            z2, y1 = (z.reshape(-1, v), labels.reshape(-1)) if s.shift else (z.view(-1, v), labels.view(-1))
            return (F.cross_entropy(z2, y1, ignore_index=ii, reduction="sum"),)
        if head == "nll_mean":
            return (F.nll_loss(F.log_softmax(z.reshape(-1, v), -1), labels.reshape(-1), ignore_index=ii),)
        if head == "nll_mean_reshaped_logp":
            return (F.nll_loss(F.log_softmax(z, -1).reshape(-1, v), labels.reshape(-1), ignore_index=ii),)
        if head == "ce_mean_and_entropy":
            loss = F.cross_entropy(z.reshape(-1, v), labels.reshape(-1), ignore_index=ii)
            p = z.softmax(-1)
            return loss, torch.logsumexp(z, -1) - (p * z).sum(-1)
        if head == "trl_selective":
            if z.dtype in (torch.float32, torch.float64):
                picked = torch.gather(z, dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)
                return (picked - torch.stack([torch.logsumexp(row, dim=-1) for row in z]),)
            rows = []
            for row_z, row_y in zip(z, labels):
                rows.append(F.log_softmax(row_z, dim=-1).gather(dim=-1, index=row_y.unsqueeze(-1)).squeeze(-1))
            return (torch.stack(rows),)
        if head == "lse_alone":
            return (torch.logsumexp(z, dim=-1),)
        if head == "softmax_dim0":
            return (z.log_softmax(dim=0).sum(-1),)
        if head == "probs_returned":
            p = z.softmax(-1)
            return p, -(p * z.log_softmax(-1)).sum(-1)
        raise ValueError(f"unknown head {head!r}")


# ------------------------------------------------------------------------------------------------------ MLP

MLP_LINEARS = ("module", "F.linear", "matmul_t", "bias_add_left", "bias_add_right")
MLP_ACTIVATIONS = {
    "F.silu": "silu",
    "nn.SiLU": "silu",
    "x*sigmoid(x)": "silu",
    "sigmoid(x)*x": "silu",
    "F.gelu": "gelu",
    "nn.GELU": "gelu",
    "gelu_tanh": "gelu_tanh",
    "F.relu": "relu",
    "torch.relu": "relu",
}
MLP_SPLITS = ("separate", "chunk", "split", "slice", "chunk_up_first")
MLP_NEAR_MISSES = ("different_inputs", "not_gated", "computed_weight", "intermediate_returned", "no_activation", "tanh")


@dataclasses.dataclass(frozen=True)
class MLPSpec:
    """One gated MLP ``down(act(gate(x)) * up(x))`` in one spelling (or a near-miss)."""

    linear: str = "F.linear"
    act: str = "F.silu"
    split: str = "separate"
    act_first: bool = True  # act(g) * u, else u * act(g)
    bias: bool = False
    near_miss: str | None = None
    autocast: bool = False  # the whole MLP under torch.autocast("cpu", bfloat16) (fp32 inputs only)
    checkpoint: bool = False  # the MLP inside torch.utils.checkpoint (a nested graph under Dynamo)

    @property
    def mixed_autocast(self) -> bool:
        """Under autocast, ``x @ w.t() + b`` is a bf16 matmul then an fp32 add: a dtype chain the op (one compute
        dtype) cannot reproduce, so the pass skips it ("mixed dtypes")."""
        return self.autocast and self.bias and self.linear not in ("module", "F.linear")

    @property
    def fires(self) -> int:
        return 0 if self.near_miss or self.mixed_autocast else 1


class GatedMLP(nn.Module):
    """``forward(x[, x2]) -> (y,)`` (or ``(y, h)`` for the intermediate_returned near-miss)."""

    def __init__(self, spec: MLPSpec, d: int, i: int, d_out: int) -> None:
        super().__init__()
        self.spec, self.i = spec, i
        if spec.split == "separate":
            self.gate_proj = nn.Linear(d, i, bias=spec.bias)
            self.up_proj = nn.Linear(d, i, bias=spec.bias)
        else:
            self.gate_up_proj = nn.Linear(d, 2 * i, bias=spec.bias)
        self.down_proj = nn.Linear(i, d_out, bias=spec.bias)
        self.act_fn = nn.SiLU() if spec.act == "nn.SiLU" else nn.GELU() if spec.act == "nn.GELU" else None
        self.reference = False

    def linear(self, x: torch.Tensor, layer: nn.Linear, *, computed: bool = False) -> torch.Tensor:
        kind, w, b = self.spec.linear, layer.weight, layer.bias
        if computed:
            return F.linear(x, w * 2.0, b)
        if kind == "module":
            return layer(x)
        if kind == "F.linear":
            return F.linear(x, w, b)
        y = x @ w.t()
        if b is None:
            return y
        return y + b if kind in ("matmul_t", "bias_add_left") else b + y

    def activation(self, g: torch.Tensor) -> torch.Tensor:
        a = self.spec.act
        if self.spec.near_miss == "tanh":
            return torch.tanh(g)
        if a in ("nn.SiLU", "nn.GELU"):
            return self.act_fn(g)
        if a == "F.silu":
            return F.silu(g)
        if a == "x*sigmoid(x)":
            return g * torch.sigmoid(g)
        if a == "sigmoid(x)*x":
            return g.sigmoid() * g
        if a == "F.gelu":
            return F.gelu(g)
        if a == "gelu_tanh":
            return F.gelu(g, approximate="tanh")
        if a == "F.relu":
            return F.relu(g)
        return torch.relu(g)

    def forward(self, x: torch.Tensor, x2: torch.Tensor | None = None) -> tuple:
        if self.spec.checkpoint:
            return torch.utils.checkpoint.checkpoint(self.maybe_autocast, x, x2, use_reentrant=False)
        return self.maybe_autocast(x, x2)

    def maybe_autocast(self, x: torch.Tensor, x2: torch.Tensor | None) -> tuple:
        if self.spec.autocast and not self.reference:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.mlp(x, x2)
        return self.mlp(x, x2)

    def mlp(self, x: torch.Tensor, x2: torch.Tensor | None) -> tuple:
        s, i = self.spec, self.i
        miss = s.near_miss
        if s.split == "separate":
            g = self.linear(x, self.gate_proj, computed=miss == "computed_weight")
            u = self.linear(x2 if miss == "different_inputs" else x, self.up_proj)
        else:
            gu = self.linear(x, self.gate_up_proj, computed=miss == "computed_weight")
            if s.split == "chunk":
                g, u = gu.chunk(2, dim=-1)
            elif s.split == "split":
                g, u = torch.split(gu, i, dim=-1)
            elif s.split == "slice":
                g, u = gu[..., :i], gu[..., i:]
            else:  # chunk_up_first
                u, g = gu.chunk(2, dim=-1)
        if miss == "not_gated":
            return (self.down_proj(self.activation(g)),)
        a = g if miss == "no_activation" else self.activation(g)
        h = a * u if s.act_first else u * a
        y = self.linear(h, self.down_proj)
        return (y, h) if miss == "intermediate_returned" else (y,)


class Block(nn.Module):
    """A residual gated MLP followed by an lm_head log-prob + entropy: both passes in one graph."""

    def __init__(self, mlp: MLPSpec, ce: CESpec, d: int, i: int, v: int) -> None:
        super().__init__()
        self.mlp = GatedMLP(mlp, d, i, d)
        self.head = LMHead(ce, d, v)
        self.reference = False

    def forward(self, x: torch.Tensor, labels: torch.Tensor, t: torch.Tensor | None = None) -> tuple:
        self.mlp.reference = self.head.reference = self.reference
        h = x + self.mlp(x)[0]
        return self.head(h, labels, t)


# ----------------------------------------------------------------------------------------------- inputs


@dataclasses.dataclass(frozen=True)
class Layout:
    """Leading dims of the tokens: ``(N,)`` or ``(B, T)``; ``extra_lengths`` are further calls (same compile)
    with the last leading dim changed (a new sequence length / token count)."""

    lead: tuple[int, ...]
    extra_lengths: tuple[int, ...] = ()
    dynamic: bool | None = None  # torch.compile(dynamic=...)

    def shapes(self) -> list[tuple[int, ...]]:
        return [self.lead] + [(*self.lead[:-1], n) for n in self.extra_lengths]


SMALL_PRIMES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


def dims(max_value: int) -> st.SearchStrategy[int]:
    """Sizes biased to the awkward ones: 1, primes, one off a power of two, then anything."""
    awkward = [n for n in (1, *SMALL_PRIMES, 15, 17, 31, 33, 63, 65, 127, 129) if n <= max_value]
    return st.one_of(st.sampled_from(sorted(set(awkward))), st.integers(1, max_value))


@st.composite
def layouts(draw, *, max_tokens: int = 40, min_last: int = 1, allow_dynamic: bool = True) -> Layout:
    if draw(st.booleans()):
        lead = (draw(st.integers(min_last, max_tokens)),)
    else:
        b = draw(st.integers(1, 3))
        lead = (b, draw(st.integers(min_last, max(min_last, max_tokens // b))))
    extra: tuple[int, ...] = ()
    dynamic = None
    if allow_dynamic and draw(st.integers(0, 3)) == 0:
        n = draw(st.integers(1, 2))
        extra = tuple(draw(st.lists(st.integers(min_last, max_tokens), min_size=n, max_size=n, unique=True)))
        extra = tuple(e for e in extra if e != lead[-1]) or (lead[-1] + 1,)
        dynamic = draw(st.sampled_from([None, True]))
    return Layout(lead, extra, dynamic)


def dtype_names(allow_low_precision: bool = True) -> st.SearchStrategy[str]:
    if not allow_low_precision:
        return st.just("float32")
    return st.sampled_from(["float32", "float32", "float32", "bfloat16", "float16"])


@st.composite
def ce_specs(draw, *, near_miss: bool = False, shift_ok: bool = False, autocast_ok: bool = False) -> CESpec:
    head = draw(st.sampled_from(sorted(CE_NEAR_MISSES if near_miss else CE_HEADS)))
    temperature = draw(st.sampled_from(CE_TEMPERATURES))
    t = 1.0 if temperature == "none" else draw(st.sampled_from([0.3, 0.7, 1.0, 1.5, 2.0]))
    return CESpec(
        head=head,
        linear=draw(st.sampled_from(CE_LINEARS)),
        temperature=temperature,
        t=t,
        cast_float=draw(st.booleans()),
        shift=shift_ok and draw(st.booleans()),
        ignore_index=draw(st.sampled_from([-100, -100, -1, 0])),
        autocast=autocast_ok and draw(st.integers(0, 4)) == 0,
    )


@st.composite
def mlp_specs(draw, *, near_miss: bool = False, autocast_ok: bool = False) -> MLPSpec:
    miss = draw(st.sampled_from(MLP_NEAR_MISSES)) if near_miss else None
    split = draw(st.sampled_from(MLP_SPLITS))
    if miss == "different_inputs":
        split = "separate"
    return MLPSpec(
        linear=draw(st.sampled_from(MLP_LINEARS)),
        act=draw(st.sampled_from(sorted(MLP_ACTIVATIONS))),
        split=split,
        act_first=draw(st.booleans()),
        bias=draw(st.booleans()),
        near_miss=miss,
        autocast=autocast_ok and draw(st.integers(0, 4)) == 0,
        checkpoint=draw(st.integers(0, 4)) == 0,
    )


def labels_for(
    shape: tuple[int, ...], vocab: int, ignore_index: int, density: float, gen: torch.Generator
) -> torch.Tensor:
    """Labels in [0, vocab) with about ``density`` of them (at least one when > 0; all when 1) = ignore_index."""
    labels = torch.randint(0, vocab, shape, generator=gen)
    if density > 0:
        mask = torch.rand(shape, generator=gen) < density
        if density >= 1:
            mask[...] = True
        elif not mask.any():
            mask.view(-1)[0] = True
        labels[mask] = ignore_index
    return labels


def init_(module: nn.Module, gen: torch.Generator, scale: float) -> None:
    """Weights ~ N(0, scale² / fan_in) (float64 draws, so every dtype sees the same numbers), biases ~ N(0, 0.1²)."""
    with torch.no_grad():
        for p in module.parameters():
            fan_in = p.shape[-1] if p.dim() == 2 else 10
            std = scale / math.sqrt(fan_in) if p.dim() == 2 else 0.1
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * std)
