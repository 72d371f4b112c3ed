"""Hypothesis strategies for the pass fuzz tests (tests/test_fuzz.py): small modules in every spelling a pass claims
to match, near-misses it must leave alone, and the shapes, dtypes and inputs to run them on.

A case is a frozen spec (plain data, so hypothesis prints it and a failure can be pasted into a regression test)
plus ``build_*`` functions that turn it into an ``nn.Module`` and inputs. Every module also runs as the float64
reference: ``module.reference = True`` drops the spelled-out dtype casts (``.float()``), so the reference stays
in float64 end to end.

Spellings follow the passes' docstrings:

- ``passes/lm_head/__init__.py``: lm_head linear (``nn.Linear`` / ``F.linear`` / ``h @ W.t()`` / ``matmul(h, W.T)``),
  optional ``.float()``, temperature (Python number: ``/ t``, ``* (1/t)``, ``.div(t)``, in-place ``.div_(t)``;
  or a 0-d tensor), optional shift (``logits[:, :-1]`` with ``labels[:, 1:]``), then log-prob
  (``log_softmax().gather()``, ``take_along_dim``, ``gather - logsumexp``, ``-cross_entropy(reduction="none")``),
  entropy (``lse - Σ p·z``, ``-Σ p·log p``, ``-Σ exp(logp)·logp``), both, or a CE / NLL loss (mean, sum).
- ``passes/mlp/dense.py``: ``down(act(gate(x)) * up(x))``, linears in any spelling (``nn.Linear``, ``F.linear``,
  ``x @ w.t()``, a separate bias add), SiLU / GELU (exact, tanh) / ReLU in their spellings, either order of the
  gate multiply, fused ``gate_up`` weights cut by ``chunk``, ``split`` or slicing (either half first).
- ``passes/attention/__init__.py``: an SDPA mask computed from aranges and per-token tensors (causal, sliding window,
  padding, packed documents, chunks; boolean or 0 / -inf), by hand or through transformers' ``sdpa_mask``; see the
  attention section below.
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

CE_LINEARS = ("module", "F.linear", "matmul_t", "matmul_T", "transpose", "verl_matmul")
# how a bias enters the logits: none, F.linear's, added after the product, added in place (``z += b``)
CE_BIASES = ("none", "linear", "add", "iadd")
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
    # row parts (static shapes only: a part of a symbolic dim is not provably a partition at the next size)
    "entropy_split_cat": (True, False),  # TRL's entropy_from_logits: flatten, split(chunk), entropy, cat
    "logp_lse_buffer": (True, True),  # OpenRLHF: gather − logsumexp of row chunks written into a zeros buffer
    "chunk_cat_with_labels": (True, True),  # log-prob and entropy of z.chunk(k, -2) with labels.chunk(k, -1), cat
    "entropy_rows_copy": (True, False),  # out[i].copy_(entropy(z[i])) into an empty buffer, row by row
    "bias": (True, True),  # log-prob of an lm_head module with a bias
    "lse_alone": (True, False),  # logsumexp(z) on its own, no log-prob: an output of the op
    "z_loss": (True, False),  # mean CE + 1e-2 · mean lse² (Liger's and PaLM's z-loss)
    "argmax_too": (True, True),  # log-prob, and argmax of the logits (token accuracy): an output of the op
    "label_smoothing": (True, False),  # F.cross_entropy(label_smoothing=0.1)
    "class_weights": (True, False),  # F.cross_entropy(weight=w), w ~ U(0.5, 1.5)
}
# heads whose grads are log-probs' alone (onehot − p times the output grad): no entropy's p·(z − E z)
_LOGP_ONLY_HEADS = {
    "log_softmax_gather", "take_along_dim", "gather_minus_logsumexp", "neg_ce_none", "trl_selective", "ce_mean",
    "ce_sum", "nll_mean", "nll_mean_reshaped_logp", "logits_returned", "argmax_too", "bias", "lse_alone",
    "label_smoothing", "class_weights", "logp_lse_buffer", "buffer_read_early", "computed_weight",
}  # fmt: skip
CE_ROW_PARTS = ("entropy_split_cat", "logp_lse_buffer", "chunk_cat_with_labels", "entropy_rows_copy", "parts_gap",
                "buffer_read_early")  # fmt: skip
# near-misses: each computes something from the logits the fused op cannot (or must not) replace
CE_NEAR_MISSES = {
    "logits_returned": True,  # log-prob, and the logits leave the graph too
    "softmax_dim0": False,  # log_softmax over the token dim: not a softmax over the vocabulary
    "computed_weight": True,  # weight computed in the graph (W * 2), not a parameter
    "probs_returned": False,  # softmax(z) leaves the graph
    "parts_gap": False,  # entropy of rows 0:1 and 2:, joined: row 1 left out (needs 3 rows)
    "buffer_read_early": True,  # a logsumexp buffer read (summed) before its last rows are written
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
    chunk: int = 4  # rows per part (split, buffer) or number of parts (chunk) of the row-part heads
    bias: str = "none"  # a key of CE_BIASES
    softcap: float = 0.0  # c · tanh(z / c) after the cast, before the temperature (0: none)

    @property
    def near_miss(self) -> bool:
        return self.head in CE_NEAR_MISSES

    @property
    def labels_all_valid(self) -> bool:
        if self.head in CE_HEADS:
            return CE_HEADS[self.head][1]
        return self.head in ("logits_returned", "argmax_too", "bias", "computed_weight", "buffer_read_early")

    @property
    def fires(self) -> int:
        return 0 if self.near_miss else 1


class LMHead(nn.Module):
    """``forward(h, labels[, t]) -> tuple of outputs`` in the spelling ``spec`` names."""

    def __init__(self, spec: CESpec, d: int, v: int) -> None:
        super().__init__()
        self.spec = spec
        self.lm_head = nn.Linear(d, v, bias=spec.head == "bias" or spec.bias != "none")
        self.reference = False

    def logits(self, h: torch.Tensor, t: torch.Tensor | None) -> torch.Tensor:
        if self.spec.autocast and not self.reference:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                z = self.linear(h)
        else:
            z = self.linear(h)
        return self.scale(z, t)

    def linear(self, h: torch.Tensor) -> torch.Tensor:
        s, w, b = self.spec, self.lm_head.weight, self.lm_head.bias
        if s.head == "computed_weight":
            z = F.linear(h, w * 2.0)
        elif s.head == "bias" or (s.linear == "module" and s.bias in ("none", "linear")):
            z = self.lm_head(h)
        elif s.linear == "F.linear" or s.linear == "module":
            z = F.linear(h, w, b if s.bias == "linear" else None)
        elif s.linear == "matmul_t":
            z = h @ w.t()
        elif s.linear == "matmul_T":
            z = torch.matmul(h, w.T)
        elif s.linear == "verl_matmul" and self.reference:  # the float64 reference stays float64 (as cast_float)
            z = torch.matmul(h, w.transpose(0, 1))
        elif s.linear == "verl_matmul":  # verl's reference: the product in fp32 whatever h and W are
            z = torch.matmul(h.float(), w.transpose(0, 1).float())
        else:
            z = h @ w.transpose(0, 1)
        if s.bias == "linear" and s.linear not in ("module", "F.linear") and s.head != "bias":
            z = z + b
        elif s.bias == "add":
            z = z + b
        elif s.bias == "iadd":
            z += b
        return z

    def scale(self, z: torch.Tensor, t: torch.Tensor | None) -> torch.Tensor:
        s = self.spec
        if s.cast_float and not self.reference:
            z = z.float()
        if s.softcap:
            z = torch.tanh(z / s.softcap) * s.softcap
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

    def _grad_term_sizes(self, h: torch.Tensor, z: torch.Tensor) -> dict[str, float]:
        """The size to judge the lm_head's input and parameter grads by: the fused op recomputes the logits in its
        backward and takes p = exp(z − lse) from them, so p carries an error of the logits' size in its exponent,
        eps · max|z| · p, however small what is left of onehot − p (a confident row: 1 − p_y ~ 1e-4 while p_y
        rounds with 1); an entropy's grad p·(z − E z) multiplies that by up to 2 max|z|. Through ∂z/∂h = W / t
        (and h / t for W, summed over the rows): found by the long profile, a bias and a tensor temperature over
        a confident row, the op's grad h 1.8e-7 off float64 where eager's was 1.9e-8 (bar 3.8e-8)."""
        finite = z.detach()[torch.isfinite(z.detach())]
        if not finite.numel():
            return {}
        zmax = float(finite.abs().max())
        logp_only = self.spec.head in _LOGP_ONLY_HEADS
        size = 1.5 * zmax * (1.0 if logp_only else 1.0 + 2.0 * zmax)  # 1.5: _loss's largest weight
        t = self.spec.t if self.spec.temperature != "none" else 1.0
        rows = max(1, finite.numel() // max(1, z.shape[-1]))
        hmax = float(h.detach().abs().nan_to_num(0.0, 0.0, 0.0).max()) if h.numel() else 0.0
        wmax = float(self.lm_head.weight.detach().abs().max())
        sizes = {"h": size * wmax / t, "lm_head.weight": rows * size * hmax / t}
        if self.lm_head.bias is not None:
            sizes["lm_head.bias"] = rows * size / t
        return sizes

    def forward(self, h: torch.Tensor, labels: torch.Tensor, t: torch.Tensor | None = None) -> tuple:
        s = self.spec
        z = self.logits(h, t)
        if self.reference:
            # lse, Σ softmax·z and z_y are of the logits' size: an output that cancels them (the op's entropy
            # lse − Σ p·z of a confident row, ~1e-3 of |z|) rounds with them
            finite = z.detach()[torch.isfinite(z.detach())]
            self.output_term_size = float(finite.abs().max()) if finite.numel() else 0.0
            self.grad_term_sizes = self._grad_term_sizes(h, z)
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
        if head == "entropy_split_cat":
            parts = []
            for chunk in z.reshape(-1, v).split(s.chunk, dim=0):
                lp = F.log_softmax(chunk, dim=-1)
                parts.append(-(torch.exp(lp) * lp).sum(-1))
            return (torch.cat(parts, dim=0).reshape(z.shape[:-1]),)
        if head in ("logp_lse_buffer", "buffer_read_early"):
            picked = torch.gather(z, dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)
            flat = z.reshape(-1, v)
            n = flat.shape[0]
            chunk = s.chunk if head == "logp_lse_buffer" else max(1, n // 2)
            lse = torch.zeros(n, device=z.device, dtype=z.dtype)
            early = None
            for i in range(0, n, chunk):
                lse[i : i + chunk] = torch.logsumexp(flat[i : i + chunk], dim=-1)
                early = lse.sum() if early is None and head == "buffer_read_early" else early
            out = (picked - lse.view(labels.shape),)
            return (*out, early) if early is not None else out
        if head == "chunk_cat_with_labels":
            zs, ys = z.chunk(s.chunk, dim=-2), labels.chunk(s.chunk, dim=-1)
            logps = [F.log_softmax(c, -1).gather(-1, y.unsqueeze(-1)).squeeze(-1) for c, y in zip(zs, ys)]
            entropies = [torch.logsumexp(c, -1) - (torch.softmax(c, -1) * c).sum(-1) for c in zs]
            return torch.cat(logps, dim=-1), torch.cat(entropies, dim=-1)
        if head == "entropy_rows_copy":
            flat = z.reshape(-1, v)
            out = torch.empty(flat.shape[0], device=z.device, dtype=z.dtype)
            for i in range(flat.shape[0]):
                out[i].copy_(-(F.softmax(flat[i], -1) * F.log_softmax(flat[i], -1)).sum(-1))
            return (out.view(z.shape[:-1]),)
        if head == "parts_gap":
            flat = z.reshape(-1, v)
            p = torch.cat([F.softmax(flat[0:1], -1), F.softmax(flat[2:], -1)])
            return (-(p * torch.cat([F.log_softmax(flat[0:1], -1), F.log_softmax(flat[2:], -1)])).sum(-1),)
        if head == "lse_alone":
            return (torch.logsumexp(z, dim=-1),)
        if head == "label_smoothing":
            return (F.cross_entropy(z.reshape(-1, v), labels.reshape(-1), ignore_index=ii, label_smoothing=0.1),)
        if head == "class_weights":
            w = 1.0 + 0.5 * torch.cos(torch.arange(v, device=z.device, dtype=z.dtype))  # fixed, in [0.5, 1.5]
            return (F.cross_entropy(z.reshape(-1, v), labels.reshape(-1), ignore_index=ii, weight=w),)
        if head == "z_loss":
            flat = z.reshape(-1, v)
            ce = F.cross_entropy(flat, labels.reshape(-1), ignore_index=ii)
            return ce + 1e-2 * torch.logsumexp(flat, dim=-1).pow(2).mean(), ce
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
        self.grad_term_sizes = {}  # filled by the reference's backward (_weight_terms)
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
        if self.reference:  # the size of the terms the down projection sums: what its rounding scales with
            terms = h.detach().abs() @ self.down_proj.weight.detach().abs().t()
            self.term_size = float(terms.max()) if terms.numel() else 0.0
        y = self.linear(h, self.down_proj)
        if self.reference and y.requires_grad:
            separate = s.split == "separate"
            self._weight_terms(g, x, "gate_proj" if separate else "gate_up_proj")
            self._weight_terms(u, x2 if miss == "different_inputs" else x, "up_proj" if separate else "gate_up_proj")
            self._weight_terms(y, h, "down_proj")
        return (y, h) if miss == "intermediate_returned" else (y,)

    def _weight_terms(self, out: torch.Tensor, inp: torch.Tensor, name: str) -> None:
        """A hook on ``out`` (= inp · Wᵀ + b) that records the size of the terms W's and b's grads sum over the
        rows, max Σ_n |∂out[n, j]| · |inp[n, k]| and max Σ_n |∂out[n, j]|: those sums cancel (found by the long
        profile: one weight of d = 1 summed over 8 bf16 rows, 5% of it left), so their rounding scales with the
        terms. Read by the harness after the backward (``grad_term_sizes``)."""
        if not out.requires_grad:
            return
        x = inp.detach().abs().nan_to_num(0.0, 0.0, 0.0)

        def hook(g: torch.Tensor) -> None:
            ga = g.detach().abs().nan_to_num(0.0, 0.0, 0.0)
            rows_g, rows_x = ga.reshape(-1, ga.shape[-1]), x.reshape(-1, x.shape[-1])
            if not rows_g.numel() or rows_g.shape[0] != rows_x.shape[0]:
                return
            sizes = self.grad_term_sizes
            for key, size in ((f"{name}.weight", rows_g.t() @ rows_x), (f"{name}.bias", rows_g.sum(0))):
                sizes[key] = max(sizes.get(key, 0.0), float(size.max()))

        out.register_hook(hook)


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

    @property
    def grad_term_sizes(self) -> dict[str, float]:
        """The MLP's weight and bias grads are sums over the rows that cancel (GatedMLP._weight_terms; found by
        the long profile: fp16, the down projection's bias grad of terms ~0.3 summed to 0.019, the op half a unit
        of the terms off float64, eager luckier at 3.7e-6, a bar of 8.5e-5 from the sum)."""
        return {f"mlp.{k}": v for k, v in getattr(self.mlp, "grad_term_sizes", {}).items()}


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
def ce_specs(
    draw, *, near_miss: bool = False, shift_ok: bool = False, autocast_ok: bool = False, row_parts: bool = False
) -> CESpec:
    heads = CE_NEAR_MISSES if near_miss else CE_HEADS
    head = draw(st.sampled_from(sorted(h for h in heads if h in CE_ROW_PARTS or not row_parts)))
    temperature = draw(st.sampled_from(CE_TEMPERATURES))
    t = 1.0 if temperature == "none" else draw(st.sampled_from([0.3, 0.7, 1.0, 1.5, 2.0]))
    plain = near_miss or head in ("bias", "computed_weight")  # near misses miss for their own reason only
    bias = "none" if plain else draw(st.sampled_from(("none", "none", *CE_BIASES[1:])))
    # a softcap before a tensor temperature is skipped (the temperature cannot be folded into h): not drawn
    tensor_t = temperature in ("tensor", "tensor_grad")
    softcap = 0.0 if plain or tensor_t else draw(st.sampled_from([0.0, 0.0, 0.0, 1.5, 5.0]))
    linear = draw(st.sampled_from(CE_LINEARS))
    autocast_ok = autocast_ok and linear != "verl_matmul"  # autocast would run verl's fp32 product in bf16
    return CESpec(
        head=head,
        linear=linear,
        temperature=temperature,
        t=t,
        cast_float=draw(st.booleans()),
        shift=shift_ok and draw(st.booleans()),
        ignore_index=draw(st.sampled_from([-100, -100, -1, 0])),
        autocast=autocast_ok and draw(st.integers(0, 4)) == 0,
        chunk=draw(st.sampled_from([1, 2, 3, 4, 7, 64])),
        bias=bias,
        softcap=softcap,
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


# ------------------------------------------------------------------------------------------------ attention

# passes/attention/__init__.py: an SDPA mask built from aranges and per-token [B, N] tensors, read by what it computes.
# Atoms (each in several spellings), ANDed in several spellings: causal c_q - c_kv >= offset (c: the index, or
# position_ids), a sliding window c_q - c_kv < W (both sides when not causal), padding read on the key axis,
# documents (ids, or found from position_ids restarting, as HF does) and chunks (index // C, per token). Masks are
# boolean or float 0 / -inf, built by hand (broadcast or HF-style advanced indexing) or by transformers' own
# ``sdpa_mask`` (with and without vmap; near-misses then inside its mask function where HF would put them).
ATTN_CAUSAL = ("ge", "le", "not_gt", "sub_ge", "torch.ge")
ATTN_WINDOWS = ("hf", "lt", "le", "not_ge")
ATTN_COMBINE = ("&", "logical_and", "mul", "demorgan", "hf_and")
ATTN_BUILDERS = ("broadcast", "broadcast", "hf_sdpa_mask", "hf_vmap")
# near-miss -> a piece of the reason the report must give
ATTN_NEAR_MISSES = {
    "tril": "not index arithmetic",  # torch.tril(ones(N, N)): a kernel, not index arithmetic
    "or": "or of conditions",  # causal | (key == 0): an attention sink is a disjunction
    "random": "not",  # AND a random [B, 1, N, N] input ("not index arithmetic" / "not a per-token tensor")
    "per_head": "differs per head",  # AND a window that differs per head ([1, H, N, N], H > 1)
    "dropout": "dropout_p",
    "pad_query": "not the key axis",  # padding read along the query axis
    "mask_reused": "also used by",  # the mask leaves the graph too
    "finfo_min": "not 0 / -inf",  # where(m, 0, finfo.min): a fully masked row attends everywhere, not nowhere
}


@dataclasses.dataclass(frozen=True)
class AttnSpec:
    """One attention module: the mask it builds (which atoms, in which spelling) and the SDPA call's shape."""

    causal: str = "ge"  # a spelling of ATTN_CAUSAL, or "none"
    offset: int = 0  # causal is c_q - c_kv >= offset (1: strictly causal, < 0: a few future keys too)
    coord: str = "index"  # what causal / window compare: "index" or "pos" (position_ids)
    window: int | None = None
    window_spelling: str = "lt"
    padding: str | None = None  # "broadcast" (pad[:, None, None, :]) or "gather" (pad[b_idx, kv_idx])
    pad_long: bool = False  # the padding mask is int64 (0 / 1), read through .bool()
    docs: str | None = None  # "input" (doc ids) or "from_pos" (HF's find_packed_sequence_indices)
    chunk: int | None = None  # chunked local attention: c = arange(N) // chunk per token, c_q == c_kv
    chunk_overlay: bool = False  # chunks as HF's chunked_overlay spells them: after each row's left padding
    indexing: str = "broadcast"  # per-token tensors read as t[:, None, :, None] or t[b_idx, q_idx] (HF)
    frame: str = "4d"  # index atoms as [N, N] ("2d") or [1, 1, N, N] ("4d")
    combine: str = "&"
    expand: bool = False  # .expand(B, 1, N, N) at the end
    additive: str | None = None  # None, "where" (where(m, 0, -inf)) or "where_not" (where(~m, -inf, 0))
    builder: str = "broadcast"
    near_miss: str | None = None
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 8
    enable_gqa: bool = True
    scale: float | None = None
    checkpoint: str = "none"  # "attn" (each layer's attention, the mask passed in) or "all" (the mask built inside)
    layers: int = 1  # layers sharing the mask

    @property
    def fires(self) -> int:
        """Rewrites per graph: one per layer for a claimed mask, none for a near-miss."""
        return 0 if self.near_miss else self.layers

    @property
    def kind(self) -> str:
        """The mask's atoms, for hypothesis' statistics: e.g. "causal(pos)+window+padding+docs(from_pos)"."""
        if self.near_miss:
            return f"near-miss {self.near_miss}"
        parts = []
        if self.causal != "none":
            parts.append(f"causal{'' if self.offset == 0 else f'{self.offset:+d}'}({self.coord})")
        if self.window is not None:
            parts.append("window")
        if self.padding:
            parts.append("padding")
        if self.docs:
            parts.append(f"docs({self.docs})")
        if self.chunk is not None:
            parts.append("chunks(overlay)" if self.chunk_overlay else "chunks")
        return "+".join(parts)

    @property
    def inputs(self) -> tuple[str, ...]:
        names = ["x"]
        if self.padding or self.near_miss == "pad_query":
            names.append("pad")
        if self.docs == "input":
            names.append("doc")
        if self.coord == "pos" or self.docs == "from_pos":
            names.append("pos")
        if self.near_miss == "random":
            names.append("rmask")
        return tuple(names)


def _left_pads(pad: torch.Tensor | None, b: int, device) -> torch.Tensor:
    """[B] each row's leading padding tokens, as HF's create_chunked_causal_mask counts them (zeros without padding)."""
    if pad is None:
        return torch.zeros(b, dtype=torch.long, device=device)
    return (pad.cumsum(dim=-1) == torch.zeros_like(pad, dtype=torch.long)).sum(dim=-1)


def _bhqk(b: int, n: int, heads: int, device) -> tuple[torch.Tensor, ...]:
    """HF's index tensors: batch [B, 1, 1, 1], head [1, H, 1, 1], query [1, 1, N, 1], key [1, 1, 1, N]."""
    ar = torch.arange(n, device=device)
    return (
        torch.arange(b, device=device)[:, None, None, None],
        torch.arange(heads, device=device)[None, :, None, None],
        ar[None, None, :, None],
        ar[None, None, None, :],
    )


class Attention(nn.Module):
    """``forward(x, pad, doc, pos, rmask) -> (h,)``: ``layers`` residual attention layers sharing one mask."""

    def __init__(self, spec: AttnSpec, dim: int) -> None:
        super().__init__()
        self.spec = spec
        h, hkv, d = spec.heads, spec.kv_heads, spec.head_dim
        self.q = nn.ModuleList(nn.Linear(dim, h * d) for _ in range(spec.layers))
        self.kv = nn.ModuleList(nn.Linear(dim, 2 * hkv * d) for _ in range(spec.layers))
        self.o = nn.ModuleList(nn.Linear(h * d, dim) for _ in range(spec.layers))
        self.reference = False
        self.probe: torch.Generator | None = None  # the reference's noise probe (see add_rounding)
        self.bounds: dict[str, float] = {}  # what the probe's noise can add at most to the q / kv grads, by name
        self.out_unit = 0.0  # the unit rounding of the run's out, which the op's δ = rowsum(do ⊙ out) reads

    def forward(self, x, pad=None, doc=None, pos=None, rmask=None) -> tuple:
        if self.spec.checkpoint == "all" and not self.reference:
            return torch.utils.checkpoint.checkpoint(self.body, x, pad, doc, pos, rmask, use_reentrant=False)
        return self.body(x, pad, doc, pos, rmask)

    def body(self, x, pad, doc, pos, rmask) -> tuple:
        s = self.spec
        mask = self.mask(x, pad, doc, pos, rmask)
        h = x
        for layer in range(s.layers):
            if s.checkpoint == "attn" and not self.reference:
                y = torch.utils.checkpoint.checkpoint(self.attend, layer, h, mask, use_reentrant=False)
            else:
                y = self.attend(layer, h, mask)
            h = h + y
        if s.near_miss == "mask_reused":
            return h, mask.to(torch.float32).mean()
        return (h,)

    def attend(self, layer: int, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        s = self.spec
        b, n, _ = x.shape
        q = self.q[layer](x).view(b, n, s.heads, s.head_dim).transpose(1, 2)
        k, v = self.kv[layer](x).view(b, n, 2, s.kv_heads, s.head_dim).permute(2, 0, 3, 1, 4)
        dropout = 0.25 if s.near_miss == "dropout" else 0.0
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, scale=s.scale, enable_gqa=s.enable_gqa
        )
        if self.reference and self.probe is not None and out.requires_grad:
            self.add_rounding(layer, x, out, q, k, v, mask)
        return self.o[layer](out.transpose(1, 2).reshape(b, n, -1))

    def add_rounding(self, layer, x, out, q, k, v, mask) -> None:
        """Adds to dq and dk the rounding an fp32 flash-style backward puts in ds, as random-signed noise.

        ds_ij = p_ij (dp_ij - δ_i) with dp_ij = do_i·v_j; the op takes δ_i = do_i·out_i (not Σ_j p_ij dp_ij, which
        cancels exactly on a row with one allowed key, as eager's and fp64's dq and dk do there) with out as stored,
        rounded to the run's dtype (``out_unit``; flash does the same), so ds_ij carries rounding up to
        p_ij·(eps·|do_i|·|v_j| + out_unit·|do_i|·|out_i|), which reaches dq = scale·ds·k and dk = scale·dsᵀ·q.
        Run on the float64 reference, the probe shows what that noise becomes in every grad it flows into (see
        tests/test_fuzz.py, attention_probe); ``bounds`` gets what it adds at most to this layer's q / kv grads (where
        random signs can cancel in a sum over few tokens)."""
        s, gen, unit = self.spec, self.probe, torch.finfo(torch.float32).eps
        out_unit = max(unit, self.out_unit)
        scale = s.scale if s.scale is not None else s.head_dim**-0.5
        group = s.heads // s.kv_heads
        qd, od = q.detach(), out.detach()
        kd, vd = (t.detach().repeat_interleave(group, 1) for t in (k, v))
        bias = torch.where(mask, 0.0, float("-inf")) if mask.dtype == torch.bool else mask
        p = torch.softmax(qd @ kd.transpose(-1, -2) * scale + bias, -1).nan_to_num(0.0)  # [B, H, N, N]
        noise = {}

        def on_out(g: torch.Tensor) -> None:
            size = g.abs() @ vd.abs().transpose(-1, -2) + (g.abs() * od.abs()).sum(-1, keepdim=True) * out_unit / unit
            sign = torch.randint(0, 2, size.shape, generator=gen, dtype=size.dtype) * 2 - 1
            ds = unit * p * size

            def heads(t: torch.Tensor) -> torch.Tensor:  # [B, H, N, D] -> [B, Hkv, N, D]: a key head's queries
                return t.view(t.shape[0], s.kv_heads, group, *t.shape[2:]).sum(2)

            noise["q"] = scale * (ds * sign) @ kd
            noise["k"] = heads(scale * (ds * sign).transpose(-1, -2) @ qd)  # summed over the heads of a key head
            # at most: |dq| <= scale·ds·|k|, |dk| <= scale·dsᵀ·|q|, through the linear layers' |input|
            bq, bk = scale * ds @ kd.abs(), heads(scale * ds.transpose(-1, -2) @ qd.abs())
            bq, bk = (t.transpose(1, 2).flatten(2) for t in (bq, bk))  # [B, N, heads · D]
            ax = x.detach().abs()
            for name, b in ((f"q.{layer}", bq), (f"kv.{layer}", bk)):
                self.bounds[f"grad {name}.weight"] = (b.transpose(1, 2) @ ax).sum(0).amax().item()
                self.bounds[f"grad {name}.bias"] = b.sum((0, 1)).amax().item()

        out.register_hook(on_out)
        q.register_hook(lambda grad: grad + noise["q"])
        k.register_hook(lambda grad: grad + noise["k"])

    # -- the mask

    def mask(self, x, pad, doc, pos, rmask) -> torch.Tensor:
        s = self.spec
        b, n, _ = x.shape
        for t in (pad, doc, pos):
            if t is not None:
                # Real models tie a per-token tensor's length to the hidden states' (embedding, RoPE); an input read
                # only through advanced indexing keeps a length symbol of its own under dynamic shapes, which the
                # pass cannot prove equal to N (it leaves such a mask alone).
                torch._check(t.shape[-1] == n)
        if s.builder == "broadcast":
            m = self.combine(self.atoms(b, n, x.device, pad, doc, pos))
        else:
            m = self.hf_mask(b, n, x.device, pad, doc, pos, rmask)
        bi, hi, qi, ki = _bhqk(b, n, s.heads, x.device)
        if s.near_miss == "per_head":
            m = m & (qi - ki <= hi + 2)
        elif s.builder == "broadcast" and s.near_miss == "or":
            m = m | (ki == 0)
        elif s.builder == "broadcast" and s.near_miss == "random":
            m = m & rmask
        elif s.builder == "broadcast" and s.near_miss == "pad_query":
            m = m & pad.bool()[:, None, :, None]
        if s.expand:
            m = m.expand(b, -1, n, n) if m.dim() == 4 else m.expand(b, 1, n, n)
        if s.near_miss == "finfo_min":
            m = torch.where(m, 0.0, torch.finfo(torch.float32).min)  # HF's eager masks use finfo(dtype).min
        elif s.additive == "where":
            m = torch.where(m, 0.0, float("-inf"))
        elif s.additive == "where_not":
            m = torch.where(~m, float("-inf"), 0.0)
        return m

    def tokens(self, t: torch.Tensor, b: int, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(t at the query, t at the key) of a per-token [B, N] tensor, broadcastable to [B, 1, N, N]."""
        if self.spec.indexing == "gather":
            bi, _, qi, ki = _bhqk(b, n, 1, device)
            return t[bi, qi], t[bi, ki]
        return t[:, None, :, None], t[:, None, None, :]

    def coords(self, b: int, n: int, device, pos) -> tuple[torch.Tensor, torch.Tensor]:
        if self.spec.coord == "pos":
            return self.tokens(pos, b, n, device)
        i = torch.arange(n, device=device)
        if self.spec.frame == "2d":
            return i[:, None], i[None, :]
        return i[None, None, :, None], i[None, None, None, :]

    def atoms(self, b: int, n: int, device, pad, doc, pos) -> list[torch.Tensor]:
        s = self.spec
        cq, ck = self.coords(b, n, device, pos)
        atoms = []
        if s.near_miss == "tril":
            atoms.append(torch.tril(torch.ones(n, n, dtype=torch.bool, device=device)))
        elif s.causal != "none":
            k = s.offset
            ck_k = ck if k == 0 else ck + k
            if s.causal == "ge":
                atoms.append(cq >= ck_k)
            elif s.causal == "le":
                atoms.append(ck_k <= cq)
            elif s.causal == "not_gt":
                atoms.append(~(ck_k > cq))
            elif s.causal == "sub_ge":
                atoms.append((cq - ck) >= k)
            else:
                atoms.append(torch.ge(cq, ck_k))
        if s.window is not None:
            w = s.window
            if s.window_spelling == "hf":
                atoms.append(ck > cq - w)
            elif s.window_spelling == "lt":
                atoms.append((cq - ck) < w)
            elif s.window_spelling == "le":
                atoms.append(cq - ck <= w - 1)
            else:
                atoms.append(~(cq >= ck + w))
            if s.causal == "none" and s.near_miss != "tril":  # a window on both sides
                atoms.append((ck - cq) < w)
        if s.padding:
            valid = pad.bool() if s.pad_long else pad
            if s.padding == "gather":
                bi, _, _, ki = _bhqk(b, n, 1, device)
                atoms.append(valid[bi, ki])
            else:
                atoms.append(valid[:, None, None, :])
        if s.docs:
            d = doc if s.docs == "input" else _packed_sequence_indices(pos)
            dq, dk = self.tokens(d, b, n, device)
            atoms.append(dq == dk)
        if s.chunk is not None and s.chunk_overlay:  # (kv - lp[b]) // C == (q - lp[b]) // C, HF's spelling
            bi, _, qi, ki = _bhqk(b, n, 1, device)
            lp = _left_pads(pad, b, device)
            atoms.append((ki - lp[bi]) // s.chunk == (qi - lp[bi]) // s.chunk)
        elif s.chunk is not None:
            c = torch.arange(n, device=device) // s.chunk
            if s.indexing == "gather":
                _, _, qi, ki = _bhqk(b, n, 1, device)
                atoms.append(c[qi] == c[ki])
            elif s.frame == "2d":
                atoms.append(c[:, None] == c[None, :])
            else:
                atoms.append(c[None, None, :, None] == c[None, None, None, :])
        return atoms

    def combine(self, atoms: list[torch.Tensor]) -> torch.Tensor:
        how = self.spec.combine
        if how == "hf_and":
            m = atoms[0].new_ones((), dtype=torch.bool)
            for a in atoms:
                m = m & a
            return m
        if how == "demorgan":
            out = ~atoms[0]
            for a in atoms[1:]:
                out = out | ~a
            return ~out
        m = atoms[0]
        for a in atoms[1:]:
            m = m & a if how == "&" else torch.logical_and(m, a) if how == "logical_and" else m * a
        return m

    def hf_mask(self, b: int, n: int, device, pad, doc, pos, rmask) -> torch.Tensor:
        """The mask as transformers builds it: its mask functions, through ``sdpa_mask`` (vmap or broadcast)."""
        import transformers.masking_utils as MU

        s = self.spec
        fn = MU.causal_mask_function
        if s.window is not None:
            fn = MU.and_masks(fn, MU.sliding_window_overlay(s.window))
        if s.coord == "pos":
            fn = MU.remap_positions_for_packed_sequence(fn, pos)
        if s.docs:
            packed = doc if s.docs == "input" else MU.find_packed_sequence_indices(pos)
            if packed is not None:  # None: eager found one document per row (no constraint)
                fn = MU.and_masks(fn, MU.packed_sequence_mask_function(packed))
        if s.chunk is not None and s.chunk_overlay:
            fn = MU.and_masks(fn, MU.chunked_overlay(s.chunk, _left_pads(pad, b, device)))
        elif s.chunk is not None:
            c = torch.arange(n, device=device) // s.chunk
            fn = MU.and_masks(fn, lambda bi, hi, qi, ki: c[qi] == c[ki])
        if s.near_miss == "or":  # an attention sink
            fn = MU.or_masks(fn, lambda bi, hi, qi, ki: ki == 0)
        elif s.near_miss == "random":  # a custom pattern read from a tensor (what HF's vmap path is for)
            fn = MU.and_masks(fn, lambda bi, hi, qi, ki: rmask[bi, 0, qi, ki])
        elif s.near_miss == "pad_query":
            fn = MU.and_masks(fn, lambda bi, hi, qi, ki: pad.bool()[bi, qi])
        return MU.sdpa_mask(
            batch_size=b,
            q_length=n,
            kv_length=n,
            mask_function=fn,
            attention_mask=None if not s.padding else pad.bool(),
            allow_is_causal_skip=False,
            use_vmap=s.builder == "hf_vmap",
            device=device,
        )


def _packed_sequence_indices(pos: torch.Tensor) -> torch.Tensor:
    """Document ids from position_ids that restart (HF's find_packed_sequence_indices, without its early exit)."""
    first = pos[:, :1] - 1
    return (torch.diff(pos, prepend=first, dim=-1) != 1).cumsum(-1)


@dataclasses.dataclass(frozen=True)
class AttnInputs:
    """How an example's per-token inputs are drawn (from a generator, so that any length can be made)."""

    dim: int  # model width
    scale: float  # weights ~ N(0, scale² / fan_in)
    pad: str = "left"  # "left", "right", "both" (TRL), "holes", "none", "all" (a row wholly padded), "mixed",
    # "all_but_one" (every row but the first wholly padded)
    doc_rate: float = 0.2  # chance a token starts a new document
    doc_reuse: bool = False  # document ids come back (mod 2): non-contiguous documents
    tok_dtype: str = "int64"
    flash: bool = False  # route the op's CUDA path (packed flash varlen) through the CPU emulation


def attn_make_inputs(spec: AttnSpec, ai: AttnInputs):
    def make(lead: tuple[int, ...], gen: torch.Generator) -> dict:
        b, n = lead
        out = {"x": torch.randn((b, n, ai.dim), generator=gen, dtype=torch.float64)}
        tok = getattr(torch, ai.tok_dtype)
        if "pad" in spec.inputs:
            pad = torch.ones(b, n, dtype=torch.bool)
            for row in range(b):
                kind = ai.pad if ai.pad != "mixed" else ("left", "right", "none", "all")[row % 4]
                if ai.pad == "all_but_one":
                    kind = "none" if row == 0 else "all"
                cut = int(torch.randint(0, n + 1, (), generator=gen))
                if kind == "left":
                    pad[row, :cut] = False
                elif kind == "both":
                    pad[row, : cut // 2] = False
                    pad[row, n - int(torch.randint(0, n - cut // 2 + 1, (), generator=gen)) :] = False
                elif kind == "right":
                    pad[row, n - cut :] = False
                elif kind == "holes":
                    pad[row] = torch.rand(n, generator=gen) < 0.7
                elif kind == "all":
                    pad[row] = False
            out["pad"] = pad.long() if spec.pad_long else pad
        starts = torch.rand(b, n, generator=gen) < ai.doc_rate
        starts[:, 0] = True
        ids = starts.long().cumsum(-1) - 1
        if "doc" in spec.inputs:
            out["doc"] = (ids % 2 if ai.doc_reuse else ids).to(tok)
        if "pos" in spec.inputs:
            index = torch.arange(n).expand(b, n)
            first = torch.where(starts, index, torch.zeros_like(index)).cummax(-1).values
            out["pos"] = (index - first).to(tok)  # restarts at 0 with each document
        if "rmask" in spec.inputs:
            out["rmask"] = torch.rand(b, 1, n, n, generator=gen) < 0.6
        return out

    return make


@st.composite
def attn_specs(draw, *, near_miss: str | None = None) -> AttnSpec:
    """A claimed mask, or (``near_miss``: a key of ATTN_NEAR_MISSES) that near-miss on top of a drawn mask."""
    miss = near_miss
    builder = draw(st.sampled_from(ATTN_BUILDERS))
    if miss == "tril":
        builder = "broadcast"
    hf = builder != "broadcast"
    causal = "ge" if hf else draw(st.sampled_from((*ATTN_CAUSAL, "none")))
    window = draw(st.one_of(st.none(), st.integers(1, 40)))
    padding = draw(st.sampled_from([None, "broadcast", "gather"]))
    docs = draw(st.sampled_from([None, "input", "from_pos"]))
    # chunks are documents too: one mask holds one document equality (two are a reason, not a rewrite)
    chunk = None if docs else draw(st.sampled_from([None, None, 1, 4, 16]))
    coord = draw(st.sampled_from(["index", "index", "pos"]))
    if causal == "none" and window is None and not padding and not docs and not chunk and miss != "tril":
        causal = "ge"  # at least one atom (an all-True mask is a different claim)
    offset = 0 if hf or causal == "none" else draw(st.sampled_from([0, 0, 0, 1, -2]))
    if window is not None and offset >= window:
        offset = 0  # lo > hi allows no key at all: the pass leaves that alone ("the mask allows no key at all")
    heads = draw(st.sampled_from([2, 4, 6] if miss == "per_head" else [1, 2, 4, 6]))
    # Dynamo cannot trace HF's vmap (a TorchFunctionMode) inside a checkpoint body: only the attention there. Dropout
    # in a checkpoint body is PyTorch's matter: the recompute draws again under an eager inner compiler, and Dynamo
    # asserts (lift_tracked_freevar_to_input) under dynamic=True, both with torch.compile(backend="eager") alone.
    checkpoint = draw(st.sampled_from(["none", "none", "attn", "attn" if builder == "hf_vmap" else "all"]))
    if miss == "dropout":
        checkpoint = "none"
    kv_heads = draw(st.sampled_from([k for k in (1, 2, 3, 4, 6) if heads % k == 0]))
    return AttnSpec(
        causal=causal,
        offset=offset,
        coord=coord,
        window=window,
        window_spelling=draw(st.sampled_from(ATTN_WINDOWS)),
        padding=padding,
        pad_long=draw(st.booleans()),
        docs=docs,
        chunk=chunk,
        chunk_overlay=chunk is not None and builder != "hf_vmap" and draw(st.booleans()),
        indexing=draw(st.sampled_from(["broadcast", "gather"])),
        frame=draw(st.sampled_from(["2d", "4d"])),
        combine=draw(st.sampled_from(ATTN_COMBINE)),
        # padding alone is a [B, 1, 1, N] mask, which the pass reads only once expanded to [B, 1, N, N] (as HF does)
        expand=draw(st.booleans()) or (causal == "none" and window is None and not docs and not chunk),
        additive=draw(st.sampled_from([None, None, "where", "where_not"])),
        builder=builder,
        near_miss=miss,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=draw(st.sampled_from([1, 2, 3, 4, 5, 8, 12, 16, 32])),
        enable_gqa=heads != kv_heads or draw(st.booleans()),
        scale=draw(st.sampled_from([None, None, 0.3, 1.0])),
        checkpoint=checkpoint,
        layers=draw(st.sampled_from([1, 1, 1, 2])),
    )
