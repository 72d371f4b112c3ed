"""MoE experts (HF transformers 5's grouped experts: stacked ``gate_up_proj`` [E, 2I, D] / ``down_proj`` [E, D, I]
run by ``grouped_mm``) through the backend: not tiled yet, so the tiled_mlp pass must say so in the report (no
silent miss) and the step must equal eager's."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_close, assert_grads_close, compile_options

import tilecompile


def _mixtral():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MixtralConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(cfg).train()


def test_mixtral_experts_get_a_reason_and_equal_eager():
    model = _mixtral()
    ref = copy.deepcopy(model)
    opts = compile_options(fused_linear_ce=False, mlp_chunk_tokens=4)
    compiled = torch.compile(model, backend="tilecompile", options=opts)
    ids = torch.randint(0, 64, (2, 10))
    out = compiled(input_ids=ids, use_cache=False).logits
    expected = ref(input_ids=ids, use_cache=False).logits
    assert_close(out, expected, rtol=1e-4, atol=1e-5, name="logits")
    out.square().mean().backward()
    expected.square().mean().backward()
    assert_grads_close(model, ref, rtol=1e-4, atol=1e-5)
    rep = tilecompile.report()
    skips = [s for s in rep.skipped if s.pass_name == "tiled_mlp" and "MoE experts" in s.reason]
    assert rep.counts["tiled_mlp"] == 0, rep
    assert sorted(s.module_path for s in skips) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"], rep
