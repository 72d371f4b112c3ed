"""GRPO of a tiny Qwen2 with TRL's GRPOTrainer, compiled with tilecompile in one line (compile_trainer).

    python examples/trl_grpo.py           # CPU, 3 steps, compared with the same trainer without tilecompile
    python examples/trl_grpo.py --bf16    # bf16 autocast over fp32 weights

The training forward (TRL's fused_lm_head call: log-probs and entropy) is compiled and its lm_head fused;
generation runs TRL's forward uncompiled. The reward is a toy one: the completion's length.
"""

from __future__ import annotations

import argparse
import tempfile

import datasets
import torch
from hf_trainer_sft import V, qwen2, tokenizer
from trl import GRPOConfig, GRPOTrainer

import tilecompile
from tilecompile.integrations import compile_trainer


def reward(completions, **_):
    return [len(c) / 10 for c in completions]


def train(compiled: bool, bf16: bool, options: dict) -> list[tuple[float, float]]:
    g = torch.Generator().manual_seed(2)
    prompts = [" ".join(f"w{int(i)}" for i in torch.randint(0, V - 3, (3 + k % 4,), generator=g)) for k in range(8)]
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out, max_steps=3, per_device_train_batch_size=4, num_generations=4, max_completion_length=6,
            learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, bf16=bf16, seed=0,
            disable_tqdm=True,
        )  # fmt: skip
        data = datasets.Dataset.from_dict({"prompt": prompts})
        trainer = GRPOTrainer(
            model=qwen2(), reward_funcs=reward, args=args, train_dataset=data, processing_class=tokenizer()
        )
        if compiled:
            compile_trainer(trainer, options=options)  # the one line
        trainer.train()
    return [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "grad_norm" in h]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--inner", default=None, help="inner compiler (inductor, aot_eager, eager)")
    a = p.parse_args()
    options = {"mlp_min_tokens": 0, **({"inner": a.inner} if a.inner else {})}  # a tiny model: tile every MLP
    eager = train(False, a.bf16, options)
    tilecompile.reset()
    got = train(True, a.bf16, options)
    for step, ((loss, norm), (eloss, enorm)) in enumerate(zip(got, eager)):
        print(f"step {step}: loss {loss:.6f} (eager {eloss:.6f}), grad norm {norm:.6f} (eager {enorm:.6f})")
    print(tilecompile.report())


if __name__ == "__main__":
    main()
