"""Hugging Face model families beyond Llama / Qwen, as fine-tuning users run them: activation checkpointing on, a
collator's padded batch (a left-padded row, a right-padded row, a full row), float64. The compiled step's loss and
every parameter gradient equal eager's; the report has each layer's attention, its MLP tiled (or a reason where the
MLP is not gated) and the checkpointed layers with identical bodies in shared regions, and no pass failed.

The families differ where the passes read them: Gemma 3 alternates sliding-window and global layers (two regions),
Phi-3 fuses qkv and gate_up, Cohere runs attention and MLP in parallel from one LayerNorm, OLMo-2 normalises after
the sublayers, Granite scales residuals and logits, GPT-NeoX and Starcoder2 have ungated MLPs."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, assert_grads_close, compile_options

import tilecompile

transformers = pytest.importorskip("transformers")

LAYERS = 3
_TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=LAYERS, num_attention_heads=4,
             num_key_value_heads=2, attn_implementation="sdpa", pad_token_id=0)  # fmt: skip
_GEMMA3 = dict(head_dim=8, sliding_window=6, layer_types=["sliding_attention", "full_attention", "sliding_attention"])
FAMILIES = {  # name: (config class, model class, config overrides, gated MLP)
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", _GEMMA3, True),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}, True),
    "cohere": ("CohereConfig", "CohereForCausalLM", {}, True),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}, True),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(residual_multiplier=0.5, logits_scaling=2.0), True),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}, False),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {}, False),
}  # fmt: skip


def _model(name: str) -> torch.nn.Module:
    cfg_name, model_name, extra, _ = FAMILIES[name]
    cfg = getattr(transformers, cfg_name)(**{**_TINY, **extra})
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(cfg).double().train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _step(model, ids, mask):
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    logp = F.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    weight = mask[:, 1:].to(logp.dtype)
    return -(logp * weight).sum() / weight.sum()


def _compare(model, **options) -> tilecompile.Report:
    """The compiled step on a padded batch (a left-padded row, a right-padded row, a full row) against eager's:
    loss and every gradient; returns the report."""
    ref = copy.deepcopy(model)
    ids = torch.randint(1, 97, (3, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[0, :3] = 0
    mask[1, 8:] = 0
    loss = torch.compile(_step, backend="tilecompile", options=compile_options(**options))(model, ids, mask)
    loss.backward()
    expected = _step(ref, ids, mask)
    expected.backward()
    assert_close(loss, expected, rtol=1e-10, atol=1e-12, name="loss")
    assert_grads_close(model, ref, rtol=1e-8, atol=1e-12)
    return tilecompile.report()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_padded_batch_with_checkpointing(name):
    rep = _compare(_model(name), layer_regions=True)
    c = rep.counts
    assert not rep.failures and rep.graphs == 1, str(rep)
    # Gemma 3's one global layer has no twin: it stays flat, with a reason
    shared = LAYERS - 1 if name == "gemma3" else LAYERS
    assert c["attention"] == LAYERS and c["layer_regions"] == shared, str(rep)
    alone = [s for s in rep.skipped if s.pass_name == "layer_regions"]
    assert len(alone) == LAYERS - shared and all("nothing to share" in s.reason for s in alone), str(rep)
    if FAMILIES[name][3]:
        assert c["tiled_mlp"] == LAYERS, str(rep)
    else:
        reasons = [s.reason for s in rep.skipped if s.pass_name == "tiled_mlp"]
        assert c["tiled_mlp"] == 0 and len(reasons) == LAYERS and all("not gated" in r for r in reasons), str(rep)


def test_eager_attention_gets_a_reason():
    """Gemma 2 has no SDPA path in transformers 5 (its attention softcapping): its eager attention, matmul, softmax
    and matmul, is left as it is with a reason per layer, and the step is still right."""
    cfg = transformers.Gemma2Config(**{**_TINY, "attn_implementation": "eager"}, head_dim=8, sliding_window=6)
    torch.manual_seed(0)
    rep = _compare(transformers.Gemma2ForCausalLM(cfg).double().train())
    eager = [s for s in rep.skipped if s.pass_name == "attention"]
    assert rep.counts["attention"] == 0 and not rep.failures, str(rep)
    assert len(eager) == LAYERS and all("attn_implementation='sdpa'" in s.reason for s in eager), str(rep)
    assert sorted(s.module_path for s in eager) == [f"model.layers.{i}.self_attn" for i in range(LAYERS)], str(rep)
