"""SFT of a tiny Qwen2 with Hugging Face's Trainer, compiled with tilecompile in one line (compile_trainer).

    python examples/hf_trainer_sft.py           # CPU, 3 steps, compared with the same Trainer without tilecompile
    python examples/hf_trainer_sft.py --bf16    # bf16 autocast over fp32 weights (the trainers' default)

The model is built from a config (random weights, nothing downloaded). HF's cross-entropy (labels=) is fused with
the lm_head, the padded batch's attention mask becomes masked attention, the MLPs are tiled.
"""

from __future__ import annotations

import argparse
import tempfile

import datasets
import tokenizers
import torch
import transformers
from tokenizers.models import WordLevel

import tilecompile
from tilecompile.integrations import compile_trainer

V = 128


def tokenizer() -> transformers.PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i + 3 for i in range(V - 3)}}
    tok = tokenizers.Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def qwen2() -> transformers.Qwen2ForCausalLM:
    cfg = transformers.Qwen2Config(
        hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=V, tie_word_embeddings=True, attn_implementation="sdpa", pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(cfg)


def train(compiled: bool, bf16: bool, options: dict) -> list[tuple[float, float]]:
    g = torch.Generator().manual_seed(1)
    rows = [list(range(s, s + n)) for s, n in zip(torch.randint(3, V - 20, (8,), generator=g).tolist(),
                                                   torch.randint(5, 17, (8,), generator=g).tolist())]  # fmt: skip
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, max_steps=3, per_device_train_batch_size=4, learning_rate=1e-3, logging_steps=1,
            report_to=[], save_strategy="no", use_cpu=True, bf16=bf16, seed=0, disable_tqdm=True,
        )  # fmt: skip
        trainer = transformers.Trainer(
            model=qwen2(), args=args, train_dataset=datasets.Dataset.from_dict({"input_ids": rows}),
            data_collator=transformers.DataCollatorForLanguageModeling(tokenizer(), mlm=False),
        )  # fmt: skip
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
