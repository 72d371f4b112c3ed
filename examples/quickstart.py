"""Quickstart: compile an RL-style step (log-probs + entropy of a tiny decoder) with backend="tilecompile".

Runs on CPU in about a minute (Inductor compiles C++ there); on a GPU the same code uses the Triton kernels.
    python examples/quickstart.py
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

import tilecompile


class MLP(nn.Module):
    def __init__(self, d: int, i: int):
        super().__init__()
        self.gate_proj = nn.Linear(d, i, bias=False)
        self.up_proj = nn.Linear(d, i, bias=False)
        self.down_proj = nn.Linear(i, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 1000, d: int = 64, i: int = 176, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(MLP(d, i) for _ in range(layers))
        self.norm = nn.RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = h + layer(h)
        return self.norm(h)


def step(model: TinyLM, ids: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """A policy-gradient loss with an entropy bonus, written the way RL trainers write it."""
    logits = model.lm_head(model(ids)).float()
    logits, labels = logits[:, :-1], ids[:, 1:]
    logp = torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return -(logp * advantages).mean() - 0.01 * entropy.mean()


def main() -> None:
    torch.manual_seed(0)
    model = TinyLM()
    ids = torch.randint(0, 1000, (2, 129))
    adv = torch.randn(2, 128)

    compiled_step = torch.compile(step, backend="tilecompile", options={"mlp_min_tokens": 0})
    loss = compiled_step(model, ids, adv)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]

    model.zero_grad()
    ref = step(model, ids, adv)
    ref.backward()
    worst = max((g - p.grad).abs().max().item() for g, p in zip(grads, model.parameters()))
    print(f"loss {loss.item():.6f} (eager {ref.item():.6f}), largest grad difference {worst:.2e}")
    print(tilecompile.report())


if __name__ == "__main__":
    main()
