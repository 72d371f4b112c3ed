"""A Megatron-Core GPTModel (local spec: RMSNorm, SwiGLU, RoPE) trained through tilecompile, tiny, on CPU.

    python examples/megatron_gpt.py              # PPO-style loss on log-probs and entropy from the logits
    python examples/megatron_gpt.py --labels     # mcore's own per-token cross-entropy (labels=)

Needs megatron-core (tested with 0.16.1). Three SGD steps of the compiled step against the same model in eager,
then ``tilecompile.report()``: mcore's linears read as F.linear (they are autograd.Functions), the MLP tiled in every
layer and the lm_head fused with the loss. One line is needed besides ``torch.compile``:

    torch._dynamo.config.ignore_logging_functions.add(warnings.warn)

mcore 0.16 calls ``warnings.warn(..., DeprecationWarning)`` in every RowParallelLinear call (tp_group=None), and
Dynamo cannot trace a warning class argument: without the line each call breaks the graph (13 graphs for 2 layers),
and no pass sees an MLP or the lm_head whole. With it, Dynamo drops the call from compiled code (eager still warns).
Tensor parallel > 1 runs correctly but unrewritten: Dynamo runs each ColumnParallelLinear outside the graph (its
backward's ``all_reduce(async_op=True)``). ``cpu_shims()`` is for eager mcore on a machine without CUDA only.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

import tilecompile


def cpu_shims() -> None:
    """mcore places a few buffers on CUDA whatever the model's device; on CPU, put them on the CPU."""
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.tensor_parallel as mcore_tp
    import megatron.core.transformer.utils as transformer_utils

    def causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    class NoFork:  # the CUDA RNG tracker (dropout is 0 here)
        def fork(self, name=None):
            return contextlib.nullcontext()

    # Dynamo's table of torch functions, built from their names (init_process_group clears it): built before the
    # patch, it does not hold the lambda, which is then traced as the plain function it is
    torch._dynamo.trace_rules.get_torch_obj_rule_map()
    torch.cuda.current_device = lambda: "cpu"
    transformer_utils.get_default_causal_mask = fused_softmax.get_default_causal_mask = causal_mask
    mcore_tp.get_cuda_rng_tracker = lambda *a, **k: NoFork()


def gpt_model(vocab: int):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, gated_linear_unit=True,
        activation_func=F.silu, normalization="RMSNorm", add_bias_linear=False, use_cpu_initialization=True,
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    return GPTModel(config, spec, vocab_size=vocab, max_sequence_length=256, position_embedding_type="rope")


def ppo_step(model, batch):
    logits = model(batch["ids"], batch["pos"], None).float()
    logp = torch.gather(logits.log_softmax(-1), -1, batch["ids"][..., None]).squeeze(-1)
    entropy = torch.logsumexp(logits, -1) - (logits.softmax(-1) * logits).sum(-1)
    ratio = torch.exp(logp - batch["old"])
    adv = batch["adv"][:, None]
    pg = -torch.min(ratio * adv, torch.clamp(ratio, 0.8, 1.28) * adv)
    return ((pg - 0.01 * entropy) * batch["mask"]).sum() / batch["mask"].sum()


def labels_step(model, batch):
    per_token = model(batch["ids"], batch["pos"], None, labels=batch["labels"])
    return (per_token * batch["mask"]).sum() / batch["mask"].sum()


def make_batch(vocab: int, batch: int, seq: int) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return {
        "ids": ids,
        "pos": torch.arange(seq)[None].expand(batch, seq),
        "labels": torch.roll(ids, -1, dims=1),
        "mask": (torch.rand(batch, seq, generator=g) > 0.2).float(),
        "old": -torch.rand(batch, seq, generator=g) * 3 - 3,
        "adv": torch.randn(batch, generator=g),
    }


def train(step, compiled: bool, vocab: int, batch: dict, steps: int = 3) -> list[float]:
    model = gpt_model(vocab)
    fn = torch.compile(step, backend="tilecompile", options={"mlp_min_tokens": 0}) if compiled else step
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        loss = fn(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--labels", action="store_true", help="mcore's own cross-entropy (labels=)")
    args = parser.parse_args()
    os.environ.setdefault("TILECOMPILE_INNER", "aot_eager")  # Inductor on CPU works too, only slower to compile
    from megatron.core import parallel_state

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        if not torch.cuda.is_available():
            cpu_shims()
        parallel_state.initialize_model_parallel(1, 1)
        torch._dynamo.config.ignore_logging_functions.add(warnings.warn)  # the one line (see the docstring)
        vocab, step = 512, labels_step if args.labels else ppo_step
        batch = make_batch(vocab, batch=2, seq=64)
        eager = train(step, False, vocab, batch)
        compiled = train(step, True, vocab, batch)
        for i, (e, c) in enumerate(zip(eager, compiled)):
            print(f"step {i}: eager {e:.6f}  tilecompile {c:.6f}")
        print(tilecompile.report())
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        if max(abs(e - c) / abs(e) for e, c in zip(eager, compiled)) > 1e-4:
            raise SystemExit("tilecompile's losses differ from eager's")


if __name__ == "__main__":
    main()
