"""The plain-PyTorch side of ``kernels/fused_linear_ce.py`` (its module docstring has the math).

``torch_fwd_epilogue`` / ``torch_bwd_epilogue`` are the Triton epilogues' same steps on one chunk of logits (the CPU
path, and what the Triton kernels are checked against under ``TRITON_INTERPRET=1``); ``reference_logprob_entropy``
is the unfused formula (tests and benchmarks only: it builds [N, V]).
"""

from __future__ import annotations

import torch


def torch_logits(z, v_start, inv_t, bias, softcap):
    """(x, tanh): the chunk's logits softcap(z + b) / t in fp32, and the softcap's tanh (None without one)."""
    u = z.float()
    if bias is not None:
        u = u + bias[v_start : v_start + z.shape[1]].float()
    th = None
    if softcap:
        th = torch.tanh(u / softcap)
        u = softcap * th
    return u * inv_t, th


def torch_fwd_epilogue(
    z, labels, state, logp, ent, stats, v_start, inv_t, ignore_index, with_entropy, is_last, launch=None, *,
    bias=None, softcap=0.0, zsum=None, argmax=None, all_rows=False,
):  # fmt: skip
    """The forward epilogue in PyTorch: same online update as ``_fused_linear_ce_fwd_kernel``."""
    m, s, a, zy = state
    active = labels != ignore_index
    row_on = torch.ones_like(active) if (with_entropy or all_rows) else active
    x, _ = torch_logits(z, v_start, inv_t, bias, softcap)
    x = torch.where(row_on[:, None], x, float("-inf"))
    if argmax is not None and z.shape[1]:
        # the first index of the largest, as torch.argmax, which takes a NaN for the largest (max propagates it)
        tile_max, tile_arg = x.max(dim=1)
        first_nan = tile_max.isnan() & ~m.isnan()
        argmax.copy_(torch.where((tile_max > m) | first_nan, tile_arg + v_start, argmax))
    if zsum is not None:
        zsum.add_(torch.where(row_on[:, None], x, 0.0).sum(dim=1))
    m_new = torch.maximum(m, x.amax(dim=1))
    m_ref = torch.where(m_new == float("-inf"), 0.0, m_new)
    alpha = torch.exp(m - m_ref)
    shift = torch.where(m == float("-inf"), 0.0, m - m_ref)
    a.copy_(alpha * (a + shift * s))
    s.mul_(alpha)
    e = torch.exp(x - m_ref[:, None])
    s.add_(e.sum(dim=1))
    a.add_(torch.where(e > 0, e * (x - m_ref[:, None]), 0.0).sum(dim=1))
    m.copy_(m_new)
    y_local = labels.long() - v_start
    hit = active & (y_local >= 0) & (y_local < z.shape[1])
    picked = x.gather(1, y_local.clamp(0, max(z.shape[1] - 1, 0))[:, None]).squeeze(1)
    zy.copy_(torch.where(hit, picked, zy))
    if is_last:
        log_s = torch.log(s)
        logp.copy_(torch.where(active, (zy - m) - log_s, 0.0))
        stats.copy_(torch.where(row_on[:, None], torch.stack((m, log_s), dim=1), 0.0))
        if with_entropy:
            ent.copy_(log_s - a / s)


def torch_bwd_epilogue(
    z, labels, stats, ent, glp, gent, v_start, inv_t, ignore_index, launch=None, *, bias=None, softcap=0.0,
    glse=None, gzs=None,
):  # fmt: skip
    """The backward epilogue in PyTorch: z (the chunk of logits) becomes dz in place."""
    active = labels != ignore_index
    x, th = torch_logits(z, v_start, inv_t, bias, softcap)
    log_p = (x - stats[:, :1]) - stats[:, 1:]
    p = torch.exp(log_p)
    dz = torch.zeros_like(x)
    if glp is not None:
        g = torch.where(active, glp, 0.0)[:, None]
        cols = torch.arange(z.shape[1], device=z.device) + v_start
        dz = torch.where(cols[None, :] == labels.long()[:, None], g, 0.0) - g * p
    if gent is not None:
        dz = dz - gent[:, None] * torch.where(p > 0, p * (log_p + ent[:, None]), 0.0)
    if glse is not None:
        dz = dz + glse[:, None] * p
    if gzs is not None:
        dz = dz + gzs[:, None]
    dz = dz * inv_t
    if th is not None:
        dz = dz * (1.0 - th * th)
    z.copy_(dz)


def reference_logprob_entropy(
    h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, ignore_index: int = -100
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unfused formula (builds the [N, V] logits): logp (0 at ignored rows) and entropy, in the logits' dtype."""
    z = (h @ weight.t()) / temperature
    lse = torch.logsumexp(z, dim=-1)
    active = labels != ignore_index
    zy = z.gather(-1, torch.where(active, labels, 0).long().unsqueeze(-1)).squeeze(-1)
    logp = torch.where(active, zy - lse, torch.zeros_like(lse))
    ent = lse - (torch.softmax(z, dim=-1) * z).sum(-1)
    return logp, ent
