"""The transformers releases users run: every rewrite fires on each supported release, with activation checkpointing
off and on, and the step equals eager's.

Each model family of the matrix (Llama, Qwen2, Qwen3, Mistral, Gemma 3, Qwen3-MoE, Mixtral) runs a PPO step (the
per-token log-probs and entropy of the policy, a clipped ratio against detached old log-probs, an entropy bonus,
a masked mean) on a collator's padded batch: a left-padded row, a right-padded row and a full one. The report must
show each layer's attention rewritten, the lm_head fused, each layer's MLP (the experts for MoE) tiled, and no
failure; the loss and every gradient equal eager's in fp32 to a relative 1e-5.

The suite runs this file under the pinned release; ``.ci/compat`` runs it (with the MoE and trainer smoke tests)
under the oldest supported release, verl's pin, the GPU image's and the newest, each in a venv of its own.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, assert_grads_close, compile_options

import tilecompile

transformers = pytest.importorskip("transformers")

LAYERS = 2
VOCAB = 89
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=LAYERS,
               num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa", pad_token_id=0,
               max_position_embeddings=64)  # fmt: skip
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=24)
FAMILIES = {  # name: (config class, model class, config overrides)
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=8)),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(head_dim=8, sliding_window=6, layer_types=["sliding_attention", "full_attention"])),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(head_dim=8, num_experts=4, **_MOE)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
}  # fmt: skip
MOE = ("qwen3_moe", "mixtral")
RTOL, ATOL = 1e-5, 1e-7


def _model(name: str, checkpointing: bool) -> torch.nn.Module:
    cfg_name, model_name, extra = FAMILIES[name]
    cfg = getattr(transformers, cfg_name)(**{**_COMMON, **extra})
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(cfg).float().train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def ppo_step(model, ids, mask, old_logp, advantages):
    """A PPO-style loss: clipped ratio of the policy's per-token log-probs, an entropy bonus, masked mean."""
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1]
    logp_all = F.log_softmax(logits.float(), dim=-1)
    logp = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    ratio = torch.exp(logp - old_logp)
    clipped = torch.clamp(ratio, 0.8, 1.2)
    per_token = -torch.minimum(ratio * advantages, clipped * advantages) - 0.01 * entropy
    weight = mask[:, 1:].to(per_token.dtype)
    return (per_token * weight).sum() / weight.sum()


def padded_batch(length: int = 12):
    """A collator's batch: a left-padded row, a right-padded row, a full row; old log-probs and advantages."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (3, length), generator=gen)
    mask = torch.ones(3, length, dtype=torch.long)
    mask[0, :3] = 0
    mask[1, length - 4 :] = 0
    old_logp = -torch.rand(3, length - 1, generator=gen) * 5
    advantages = torch.randn(3, 1, generator=gen)
    return ids, mask, old_logp, advantages


@pytest.mark.parametrize("checkpointing", [False, True], ids=["ckpt_off", "ckpt_on"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_rewrite_fires_and_the_step_equals_eager(name, checkpointing):
    model = _model(name, checkpointing)
    ref = copy.deepcopy(model)
    batch = padded_batch()
    step = torch.compile(ppo_step, backend="tilecompile", options=compile_options(mlp_chunk_tokens=5))
    loss = step(model, *batch)
    loss.backward()
    expected = ppo_step(ref, *batch)
    expected.backward()
    rep = tilecompile.report()
    assert not rep.failures, str(rep)
    c = rep.counts
    assert c["attention"] == LAYERS and c["fused_linear_ce"] == 1 and c["tiled_mlp"] == LAYERS, str(rep)
    if name in MOE:
        tiled = sorted(r.module_path for r in rep.rewrites if r.pass_name == "tiled_mlp")
        assert tiled == [f"model.layers.{i}.mlp.experts" for i in range(LAYERS)], str(rep)
    assert_close(loss, expected, rtol=RTOL, atol=ATOL, name="loss")
    assert_grads_close(model, ref, rtol=RTOL, atol=ATOL)


def test_supported_range_is_checked():
    """The release this suite runs under is inside the range the package states (a release outside it would get a
    warning from the backend: tests/test_report_honesty.py checks the warning)."""
    from tilecompile import releases

    assert releases.transformers_supported(transformers.__version__), (transformers.__version__, releases.TRANSFORMERS)
