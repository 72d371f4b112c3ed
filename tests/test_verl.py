"""tilecompile.integrations.verl.compile_engine with verl's real engine (verl 0.9.1's FSDPEngineWithLMHead, FSDP2,
one gloo rank on CPU): 3 PPO updates (verl's ppo_loss, entropy_coeff 0.01, AdamW) of a tiny Qwen2 with
remove-padding and with padded batches of left-padded prompts and right-padded responses, then a log-prob pass,
against the same engine without tilecompile: losses, grad norms, log-probs and entropy equal; the report has the
attention, the fused lm_head and the tiled MLPs; micro-batches of other lengths compile nothing new.

verl is not in the project's test extras (its pins conflict with them: transformers < 5.11, tensordict <= 0.10):
.ci/compat runs this file in a venv of its own (``verl-0.9.1``) and it skips elsewhere."""

from __future__ import annotations

import contextlib
import functools
import os

import pytest
import torch

verl = pytest.importorskip("verl", reason="verl is installed only in .ci/compat's verl venv")
transformers = pytest.importorskip("transformers")
tensordict = pytest.importorskip("tensordict")

import torch.distributed as dist  # noqa: E402
from verl.plugin.platform.platform_cuda import PlatformCUDA  # noqa: E402
from verl.plugin.platform.platform_manager import set_platform  # noqa: E402
from verl.trainer.config import CheckpointConfig  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import ActorConfig, FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig  # noqa: E402
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding  # noqa: E402

import tilecompile  # noqa: E402
from tilecompile.integrations.verl import IntegrationError, compile_engine  # noqa: E402

V = 128
OPTIONS = {"inner": "aot_eager", "mlp_min_tokens": 0, "strict": True}
FP32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}


class PlatformCPU(PlatformCUDA):
    """verl 0.9.1 has no CPU platform (it falls back to CUDA's); this one is CUDA's with the device calls made
    CPU's, set through verl's own ``set_platform``."""

    device_name = property(lambda self: "cpu")
    vendor_name = property(lambda self: "cpu")
    device_module = property(lambda self: torch.cpu)

    def is_available(self):
        return True

    def is_platform_available(self, use_smi_check=False):
        return True

    def current_device(self):
        return "cpu"

    def device_count(self):
        return 1

    def set_device(self, device_index):
        pass

    def synchronize(self, device_index=None):
        pass

    def manual_seed(self, seed):
        torch.manual_seed(seed)

    def manual_seed_all(self, seed):
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings):
        pass

    def empty_cache(self):
        pass

    def get_device_capability(self, device_index=0):
        return None, None

    def communication_backend_name(self):
        return "gloo"

    @contextlib.contextmanager
    def nvtx_range(self, msg):
        yield

    def profiler_start(self):
        pass

    def profiler_stop(self):
        pass


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    set_platform(PlatformCPU())
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29531")
        dist.init_process_group("gloo", rank=0, world_size=1)
    path = tmp_path_factory.mktemp("qwen2")
    cfg = transformers.Qwen2Config(
        hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=V, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(path)
    return str(path)


def engine(path: str, rmpad: bool, mixed_precision: dict | None = FP32, compiled: bool = False, fused: bool = False):
    """verl's actor engine as its TrainingWorker builds it (FSDP2, gradient checkpointing, sdpa: no flash-attn on a
    CPU), compiled with tilecompile or not."""
    model_config = HFModelConfig(
        path=path, load_tokenizer=False, use_remove_padding=rmpad, enable_gradient_checkpointing=True,
        override_config={"attn_implementation": "sdpa"}, use_fused_kernels=fused,
    )  # fmt: skip
    engine_config = FSDPEngineConfig(
        strategy="fsdp2", forward_only=False, model_dtype="fp32", use_torch_compile=False,
        mixed_precision=mixed_precision,
    )  # fmt: skip
    engine_config.use_remove_padding = rmpad
    eng = FSDPEngineWithLMHead(model_config, engine_config, FSDPOptimizerConfig(lr=1e-2), CheckpointConfig())
    eng.initialize()
    return compile_engine(eng, options=OPTIONS) if compiled else eng


def batch(seed: int, rmpad: bool, prompt: int = 6, response: int = 5, rows: int = 4):
    """An actor update's batch: left-padded prompts, right-padded responses, old log-probs and advantages, in verl's
    no-padding (nested) layout; 2 micro-batches of 2 rows."""
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (rows, prompt + response), generator=g)
    mask = torch.ones(rows, prompt + response, dtype=torch.long)
    for r in range(rows):
        mask[r, : int(torch.randint(0, 3, (1,), generator=g))] = 0
        mask[r, prompt + 1 + int(torch.randint(0, response - 1, (1,), generator=g)) :] = 0
    td = TensorDict(
        {
            "input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "prompts": ids[:, :prompt], "responses": ids[:, prompt:], "response_mask": mask[:, prompt:].clone(),
            "old_log_probs": torch.randn(rows, response, generator=g) * 0.1 - 4,
            "advantages": torch.randn(rows, response, generator=g),
        },
        batch_size=[rows],
    )  # fmt: skip
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(
        td, use_remove_padding=rmpad, use_dynamic_bsz=False, micro_batch_size_per_gpu=2, use_fused_kernels=False,
        calculate_entropy=True, temperature=1.0, global_batch_size=rows, max_token_len_per_gpu=1000,
    )  # fmt: skip
    return td


LOSS = functools.partial(
    ppo_loss,
    ActorConfig(strategy="fsdp2", rollout_n=1, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2,
                entropy_coeff=0.01, calculate_entropy=True),
)  # fmt: skip


def graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def run(eng, rmpad: bool) -> tuple[list[list[float]], dict, list[int]]:
    """3 updates with prompts of 6, 7, 8 tokens (other packed lengths each step), then a log-prob pass; the grad
    norm, metrics and micro-batch losses of each update, the log-probs and entropy, and the graph count after each
    update."""
    metrics, counts = [], []
    for step in range(3):
        with eng.train_mode():
            out = eng.train_batch(batch(step, rmpad, prompt=6 + step), LOSS)
        m, losses = out["metrics"], list(out["loss"])  # the loss of each micro-batch, as the engine returns it
        assert len(losses) == 2, losses
        metrics.append([m["grad_norm"], *(float(m[k].aggregate()) for k in ("actor/pg_loss", "actor/entropy_loss"))])
        metrics[-1] += losses
        counts.append(graphs())
    with eng.eval_mode():
        out = eng.infer_batch(batch(7, rmpad), None)["model_output"]
    return metrics, {k: out[k].values() if out[k].is_nested else out[k] for k in ("log_probs", "entropy")}, counts


def assert_same(got, want, rtol: float, atol: float = 0.0) -> None:
    (gm, go, _), (wm, wo, _) = got, want
    for step, (g, w) in enumerate(zip(gm, wm)):
        assert len(g) == len(w) == 5, (g, w)
        for name, a, b in zip(("grad_norm", "pg_loss", "entropy_loss", "loss[0]", "loss[1]"), g, w):
            assert abs(a - b) <= rtol * abs(b) + atol, f"step {step} {name}: {a} vs plain verl's {b}"
    for k in ("log_probs", "entropy"):
        err = ((go[k] - wo[k]).abs() / (wo[k].abs() + atol)).max().item()
        assert go[k].shape == wo[k].shape and err <= max(rtol, 1e-30), f"{k}: relative error {err}"


@pytest.mark.parametrize("rmpad", [True, False], ids=["remove_padding", "padded"])
def test_engine_update_matches_plain_verl(model_path, rmpad):
    want = run(engine(model_path, rmpad), rmpad)
    tilecompile.reset()
    torch._dynamo.reset()
    got = run(engine(model_path, rmpad, compiled=True), rmpad)
    assert_same(got, want, rtol=1e-5, atol=1e-6)
    r = tilecompile.report()
    c = r.counts
    assert c["attention"] >= 2 and c["tiled_mlp"] >= 2 and c["fused_linear_ce"] >= 1, str(r)
    assert not r.failures, str(r)
    counts = got[2]
    assert counts[0] == counts[1] == counts[2], f"graphs after each update {counts}: other lengths recompiled"


def test_bf16_autocast(model_path):
    """verl's default mixed precision (bf16 parameters under bf16 autocast, fp32 reduce): verl computes its log-probs
    and entropy from bf16 logits, the fused op in fp32, so they agree to bf16's rounding."""
    mixed = {"param_dtype": "bf16", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    want = run(engine(model_path, True, mixed), True)
    tilecompile.reset()
    torch._dynamo.reset()
    got = run(engine(model_path, True, mixed, compiled=True), True)
    assert_same(got, want, rtol=5e-2, atol=5e-2)
    assert tilecompile.report().counts["fused_linear_ce"] >= 1, str(tilecompile.report())


def test_refuses_use_fused_kernels(model_path):
    eng = engine(model_path, True, fused=True)
    with pytest.raises(IntegrationError, match="use_fused_kernels"):
        compile_engine(eng)


def infer(eng, rmpad: bool, **flags) -> dict:
    td = batch(7, rmpad)
    tu.assign_non_tensor(td, **flags)
    with eng.eval_mode():
        out = eng.infer_batch(td, None)["model_output"]
    return {k: v.values() if v.is_nested else v for k, v in out.items()}


def test_temperature(model_path):
    """verl's temperature (one number for the batch) reaches the fused op as its temperature."""
    want = infer(engine(model_path, True), True, temperature=0.7)
    got = infer(engine(model_path, True, compiled=True), True, temperature=0.7)
    for k in ("log_probs", "entropy"):
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)
    rewrites = [x for x in tilecompile.report().rewrites if x.pass_name == "fused_linear_ce"]
    assert rewrites and all("temperature 0.7" in x.detail for x in rewrites), str(tilecompile.report())


def test_logits_only_outputs_run_verls_own_step(model_path, caplog):
    """calculate_sum_pi_squared needs the whole softmax: that micro-batch runs verl's own forward_step, and says so."""
    want = infer(engine(model_path, True), True, calculate_sum_pi_squared=True)
    with caplog.at_level("WARNING", logger="tilecompile"):
        got = infer(engine(model_path, True, compiled=True), True, calculate_sum_pi_squared=True)
    assert "calculate_sum_pi_squared" in caplog.text
    for k in ("log_probs", "entropy", "sum_pi_squared"):
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)
