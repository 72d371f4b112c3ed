"""tilecompile.integrations.verl.compile_actor with verl 0.7.x's real actor (``DataParallelPPOActor``, one gloo rank on
CPU, a tiny Qwen2 in fp32, its module plain): log-probs and entropy of ``compute_log_prob`` and 3 ``update_policy``
calls (verl's vanilla PPO loss, entropy_coeff 0.01, AdamW, 2 micro-batches of 2) against the same actor without
tilecompile (on its padded path: its remove-padding path needs flash-attn), with remove-padding and with padded
batches of left-padded prompts and right-padded responses; every batch has other lengths, and they compile once;
the report has the attention, the fused lm_head and the tiled MLPs.

verl 0.7 is not in the project's test extras: .ci/compat runs this file in a venv of its own (``verl-0.7.1``) and it
skips elsewhere."""

from __future__ import annotations

import copy
import os

import pytest
import torch

verl = pytest.importorskip("verl", reason="verl 0.7 is installed only in .ci/compat's verl-0.7.1 venv")
if not verl.__version__.startswith("0.7."):
    pytest.skip(f"verl {verl.__version__}: the actor is verl 0.7's (tests/test_verl.py covers 0.9's engine)",
                allow_module_level=True)  # fmt: skip
transformers = pytest.importorskip("transformers")

import torch.distributed as dist  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.workers.actor.dp_actor import DataParallelPPOActor  # noqa: E402
from verl.workers.config import FSDPEngineConfig  # noqa: E402
from verl.workers.config.actor import FSDPActorConfig  # noqa: E402

import tilecompile  # noqa: E402
from tilecompile.integrations.verl import IntegrationError, compile_actor  # noqa: E402

V = 128
OPTIONS = {"inner": "aot_eager", "mlp_min_tokens": 0, "strict": True}


@pytest.fixture(scope="module", autouse=True)
def _gloo():
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29541")
        dist.init_process_group("gloo", rank=0, world_size=1)
    yield


def _actor(rmpad: bool, model=None, **config):
    if model is None:
        cfg = transformers.Qwen2Config(
            vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, attn_implementation="sdpa",
        )  # fmt: skip
        torch.manual_seed(0)
        model = transformers.Qwen2ForCausalLM(cfg).train()
    settings = dict(strategy="fsdp2", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, use_dynamic_bsz=False,
                    entropy_coeff=0.01, use_remove_padding=rmpad, rollout_n=1, use_torch_compile=False,
                    fsdp_config=FSDPEngineConfig(dtype="float32"), grad_clip=1.0)  # fmt: skip
    settings.update(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return DataParallelPPOActor(FSDPActorConfig(**settings), model, optimizer)


def _batch(seed: int, prompt: int, response: int) -> DataProto:
    g = torch.Generator().manual_seed(seed)
    b = 4
    prompts = torch.randint(1, V, (b, prompt), generator=g)
    responses = torch.randint(1, V, (b, response), generator=g)
    prompt_mask = torch.ones(b, prompt, dtype=torch.long)
    response_mask = torch.ones(b, response, dtype=torch.long)
    for i in range(b):  # left-padded prompts, right-padded responses, each row its own lengths
        prompt_mask[i, : int(torch.randint(0, prompt - 1, (1,), generator=g))] = 0
        response_mask[i, int(torch.randint(1, response + 1, (1,), generator=g)) :] = 0
    prompts = prompts * prompt_mask
    responses = responses * response_mask
    mask = torch.cat([prompt_mask, response_mask], 1)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    tensors = {
        "input_ids": torch.cat([prompts, responses], 1), "attention_mask": mask, "position_ids": positions,
        "responses": responses, "response_mask": response_mask.float(),
        "old_log_probs": -torch.rand(b, response, generator=g) - 4.0,
        "advantages": torch.randn(b, response, generator=g),
    }  # fmt: skip
    meta = {"temperature": 0.7, "micro_batch_size": 2, "use_dynamic_bsz": False, "calculate_entropy": True}
    return DataProto.from_dict(tensors=tensors, meta_info=meta)


def _close(a, b, name):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("rmpad", [True, False], ids=["remove_padding", "padded"])
def test_actor_log_probs_and_updates_match_plain_verl(rmpad):
    tilecompile.reset()
    torch._dynamo.reset()
    # plain verl's remove-padding path needs flash-attn's bert_padding, not installable on a CPU: the reference is
    # plain verl's padded path (the same per-token values; the packed rows only change how attention is masked)
    plain = _actor(False)
    ours = _actor(rmpad, model=copy.deepcopy(plain.actor_module))
    compile_actor(ours, options=OPTIONS)
    shapes = [(6, 5), (9, 7), (5, 11)]
    for step, (prompt, response) in enumerate(shapes):
        batch = _batch(step, prompt, response)
        expected_out = plain.compute_log_prob(copy.deepcopy(batch), calculate_entropy=True)
        got_out = ours.compute_log_prob(copy.deepcopy(batch), calculate_entropy=True)
        mask = batch.batch["response_mask"].bool()
        _close(got_out["log_probs"][mask], expected_out["log_probs"][mask], f"log-probs, step {step}")
        _close(got_out["entropys"][mask], expected_out["entropys"][mask], f"entropy, step {step}")
        expected = plain.update_policy(copy.deepcopy(batch))
        got = ours.update_policy(copy.deepcopy(batch))
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
            if key in expected:
                _close(torch.tensor(got[key], dtype=torch.float64), torch.tensor(expected[key], dtype=torch.float64),
                       f"{key}, step {step}")  # fmt: skip
        if step == 0:  # the log-prob pass (no grad) and the update (grad) have compiled their graphs
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for p, q in zip(ours.actor_module.parameters(), plain.actor_module.parameters()):
        # AdamW steps a weight by about lr (1e-3) whatever its grad's size: a grad near zero turns fp32 noise into a
        # visible step, so the weights are held to 1e-5 (1% of one step), the grads' norms above to 1e-5 relative
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=lambda m: f"weights after 3 updates: {m}")
    counts = tilecompile.report().counts
    assert counts["fused_linear_ce"] >= 1 and counts["tiled_mlp"] >= 2 and counts["attention"] >= 2, counts
    later = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
    assert later == 0, f"batches of other lengths compiled {later} more graphs"


def test_refusals_name_the_setting():
    actor = _actor(True, use_fused_kernels=True)
    with pytest.raises(IntegrationError, match="use_fused_kernels"):
        compile_actor(actor)
    with pytest.raises(IntegrationError, match="DataParallelPPOActor"):
        compile_actor(object())


def test_bf16_autocast_over_fp32_weights():
    """verl's default: fp32 weights under bf16 autocast (``fsdp_config.dtype``); the compiled actor's log-probs and
    entropy stay within bf16's error of plain verl's, on the padded and the remove-padding path."""
    tilecompile.reset()
    torch._dynamo.reset()
    plain = _actor(False, fsdp_config=FSDPEngineConfig(dtype="bfloat16"))
    for rmpad in (False, True):
        ours = _actor(rmpad, model=copy.deepcopy(plain.actor_module), fsdp_config=FSDPEngineConfig(dtype="bfloat16"))
        compile_actor(ours, options=OPTIONS)
        batch = _batch(7, 6, 5)
        expected = plain.compute_log_prob(copy.deepcopy(batch), calculate_entropy=True)
        got = ours.compute_log_prob(copy.deepcopy(batch), calculate_entropy=True)
        mask = batch.batch["response_mask"].bool()
        for key in ("log_probs", "entropys"):  # ours in fp32 (verl's on a CPU: bf16; with flash-attn's CE: fp32)
            assert got[key].dtype == torch.float32
            torch.testing.assert_close(got[key][mask], expected[key][mask].float(), rtol=3e-2, atol=3e-2)
        norms = ours.update_policy(copy.deepcopy(batch))["actor/grad_norm"]
        assert torch.isfinite(torch.tensor(norms)).all() and min(norms) > 0
