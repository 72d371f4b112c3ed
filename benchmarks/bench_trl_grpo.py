"""TRL's GRPOTrainer with and without tilecompile: training-step tokens/s and peak memory (issue 24).

Model: e2e.py's ``1.5b`` Qwen2 shape (28 layers, hidden 1536, vocab 151936, tied), random init (seed 0), fp32
weights trained under ``GRPOConfig(bf16=True)`` (bf16 autocast over fp32 weights, HF Trainer's mixed precision;
``--weights bf16`` builds the model in bf16 instead), gradient checkpointing on (GRPOConfig's default, HF's
non-reentrant checkpointing), AdamW, ``beta=0`` (no reference model, TRL's default), no vLLM: generation is TRL's
``model.generate``. Tokenizer: a word-level one over ``w0 .. w{V-1}`` (nothing downloaded), so a prompt of P words is
P tokens. Data: an in-memory ``datasets.Dataset`` of prompts, all ``--prompt-len`` tokens long; reward: the
completion's length (a toy). Each step generates ``--batch`` completions (``--batch / --generations`` prompts,
``--generations`` each) of exactly ``--completion-len`` tokens (``min_new_tokens`` = max, so every step has the same
shapes and the compiled forward compiles once), then one training forward and backward over the
``batch x (prompt + completion)`` rows (TRL's ``fused_lm_head`` call: log-probs and entropy of the completion
tokens) and an optimizer step. Variants, each in its own process:
  trl          GRPOTrainer as it is (TRL's own chunked fused lm_head)
  tilecompile  the same, with ``tilecompile.integrations.compile_trainer(trainer)`` before ``train()`` (README.md's
               one line: the training forward compiled with its log-prob / entropy math; generation uncompiled)

How the training step is timed apart from generation: the trainer instance's ``training_step`` and
``_prepare_inputs`` are wrapped (``torch.cuda.synchronize`` at each edge). HF's ``training_step`` calls
``_prepare_inputs`` (GRPO's generation, rewards and advantages) and then ``compute_loss`` + backward; the training
time of a step is ``training_step`` minus its ``_prepare_inputs``: forward + backward, without generation and
without the optimizer step. Training tokens: every slot of the rows that pass through the training forward (batch x
(prompt + completion), padding included; ``real_tokens`` counts the attention mask's ones). tokens/s: the median of
the steps after the first (the first includes tilecompile's compile: its train time is ``first_train_s``).
Peak memory (cuda): ``max_memory_allocated`` over the training forward + backward (reset when generation ends;
weights, grads and AdamW state included) and over the whole run (``peak_all_gib``, generation's KV cache included).
Also: the logged loss / grad norm / entropy per step (to compare the variants), ``tilecompile.report()``'s counts,
the graphs Dynamo compiled and whether a recompile limit was hit (Dynamo's warning, caught from its logger).
Both variants get ``keep_one_input_hook`` (``--hook-fix off`` leaves it out): HF's checkpointing enable adds a
forward hook on the embeddings at every call and TRL re-enables checkpointing after each generation, so without it
the hooks pile up, Dynamo's guard on their number fails and the compiled forward recompiles at every step
(measured on CPU with transformers 5.17 and 5.24: 3 steps, 3 graphs, 7 hooks). ``--budget`` seconds bound the run:
no new step starts past it (a callback stops training), and a worker still running at its end is killed.

Needs trl and datasets (trl pinned in constraints.txt). Offline GPU machine: the wheels in ``.whl/``, installed as
``python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl`` and
``PYTHONPATH=/tmp/site:$PWD``.

usage: python benchmarks/bench_trl_grpo.py [--variants trl,tilecompile] [--steps 4] [--batch 8 --generations 8]
           [--prompt-len 1920 --completion-len 128] [--budget 500] [--out results.csv|results.json]
       python benchmarks/bench_trl_grpo.py --tiny --device cpu --inner aot_eager      (smoke test)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e import MODELS, TINY, versions, write_rows  # noqa: E402

VARIANTS = ("trl", "tilecompile")
FIELDS = [
    "variant", "ok", "error", "steps", "batch", "generations", "prompt_len", "completion_len", "train_tokens",
    "real_tokens", "train_tok_s", "train_s", "first_train_s", "gen_s", "peak_train_gib", "peak_all_gib", "graphs",
    "attention", "fused_linear_ce", "tiled_mlp", "recompile_limit", "hook_fix", "embed_hooks", "losses",
    "grad_norms", "entropies", "weights",
    "layers", "tiny", "device", "torch", "triton", "transformers", "trl", "date", "commit",
]  # fmt: skip
ROW = "ROW "  # a worker's result line starts with this


def tokenizer(vocab: int):
    """Word-level: ``w{i}`` is token i; 0 pad, 1 eos, 2 unk."""
    import tokenizers
    import transformers
    from tokenizers.models import WordLevel

    words = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    tok = tokenizers.Tokenizer(WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def qwen2(tiny: bool, layers: int, dtype: torch.dtype, device: str):
    import transformers

    _, d, i, n, h, kv, v, tied, theta = MODELS["1.5b"]
    if tiny:
        d, i, n, h, kv, v = TINY
    cfg = transformers.Qwen2Config(
        hidden_size=d, intermediate_size=i, num_hidden_layers=layers or n, num_attention_heads=h,
        num_key_value_heads=kv, vocab_size=v, tie_word_embeddings=tied, rope_theta=theta, attn_implementation="sdpa",
        pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):  # built where it trains: a 1.5B fp32 init on the host takes a while
            return transformers.Qwen2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)


def keep_one_input_hook(model) -> None:
    """HF's gradient checkpointing enable registers one more forward hook on the input embeddings at every call
    (``enable_input_require_grads``, for input_ids models) and its disable removes them only under PEFT; TRL disables
    and re-enables checkpointing around each generation, so the hooks pile up (2 a step) and a compiled forward's
    guard on their number fails: a recompile every step. Removing the previous hooks before each enable keeps one."""
    enable = model.enable_input_require_grads

    def enable_once():
        model.disable_input_require_grads()
        enable()

    model.enable_input_require_grads = enable_once


def reward(completions, **_):
    return [len(c) / 100 for c in completions]


class _RecompileLimit(logging.Handler):
    """Catches Dynamo's warning that a function hit its recompile (cache size) limit."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.hit = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if "recompile_limit" in text or "cache_size_limit" in text:
            self.hit.append(text.splitlines()[0][:200])


def worker(cfg: dict) -> None:
    import datasets
    import transformers
    import trl
    from torch._dynamo.utils import counters

    import tilecompile
    from tilecompile.integrations import compile_trainer

    cuda = cfg["device"] == "cuda"
    torch._inductor.config.force_disable_caches = not cfg["warm_cache"]
    warnings.filterwarnings("ignore", "dynamo_pgo force disabled")
    limit = _RecompileLimit()
    logging.getLogger("torch._dynamo").addHandler(limit)
    tiny, variant = cfg["tiny"], cfg["variant"]
    model = qwen2(tiny, cfg["layers"], torch.bfloat16 if cfg["weights"] == "bf16" else torch.float32, cfg["device"])
    if cfg["hook_fix"]:
        keep_one_input_hook(model)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    prompts = [" ".join(f"w{int(t)}" for t in torch.randint(3, vocab, (cfg["prompt_len"],), generator=g))
               for _ in range(cfg["steps"] * cfg["batch"] // cfg["generations"])]  # fmt: skip
    sync = (lambda: torch.cuda.synchronize()) if cuda else (lambda: None)
    steps, deadline = [], cfg["deadline"]

    class Stop(transformers.TrainerCallback):  # the budget: no new step past the deadline
        def on_step_end(self, args, state, control, **kwargs):
            if time.time() > deadline:
                control.should_training_stop = True

    with tempfile.TemporaryDirectory() as out:
        args = trl.GRPOConfig(
            output_dir=out, max_steps=cfg["steps"], per_device_train_batch_size=cfg["batch"],
            num_generations=cfg["generations"], max_completion_length=cfg["completion_len"],
            generation_kwargs={"min_new_tokens": cfg["completion_len"]}, beta=0.0, learning_rate=1e-6,
            gradient_checkpointing=True, bf16=cuda or cfg["bf16"], use_cpu=not cuda, logging_steps=1, report_to=[],
            save_strategy="no", seed=0, disable_tqdm=True, dataloader_num_workers=0,
        )  # fmt: skip
        trainer = trl.GRPOTrainer(
            model=model, reward_funcs=reward, args=args, train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
            processing_class=tokenizer(vocab), callbacks=[Stop()],
        )  # fmt: skip
        if variant == "tilecompile":
            options = {"inner": cfg["inner"], **({"mlp_min_tokens": 0} if tiny else {})}  # tile tiny MLPs too
            compile_trainer(trainer, options=options)
        prepare, training_step = trainer._prepare_inputs, trainer.training_step
        peak_all = [0]

        def timed_prepare(batch):
            sync()
            start = time.perf_counter()
            inputs = prepare(batch)
            sync()
            steps[-1]["gen_s"] += time.perf_counter() - start
            prompt, completion = inputs["prompt_ids"], inputs["completion_ids"]
            steps[-1]["tokens"] += prompt.shape[0] * (prompt.shape[1] + completion.shape[1])
            steps[-1]["real"] += int(inputs["prompt_mask"].sum() + inputs["completion_mask"].sum())
            if cuda:  # the training peak starts here
                peak_all[0] = max(peak_all[0], torch.cuda.max_memory_allocated())
                torch.cuda.reset_peak_memory_stats()
            return inputs

        def timed_training_step(model, inputs, num_items_in_batch=None):
            steps.append(dict(gen_s=0.0, tokens=0, real=0))
            sync()
            start = time.perf_counter()
            loss = training_step(model, inputs, num_items_in_batch)
            sync()
            steps[-1]["train_s"] = time.perf_counter() - start - steps[-1]["gen_s"]
            if cuda:
                steps[-1]["peak"] = torch.cuda.max_memory_allocated()
                peak_all[0] = max(peak_all[0], steps[-1]["peak"])
            return loss

        trainer._prepare_inputs, trainer.training_step = timed_prepare, timed_training_step
        graphs_before = counters["stats"]["unique_graphs"]
        trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
    later = steps[1:] or steps
    train_s = statistics.median(s["train_s"] for s in later)
    report = tilecompile.report()
    counts = report.counts
    row = dict(
        variant=variant, ok=1, steps=len(steps), batch=cfg["batch"], generations=cfg["generations"],
        prompt_len=cfg["prompt_len"], completion_len=cfg["completion_len"], train_tokens=later[0]["tokens"],
        real_tokens=later[0]["real"],
        train_tok_s=round(statistics.median(s["tokens"] / s["train_s"] for s in later), 1),
        train_s=round(train_s, 4), first_train_s=round(steps[0]["train_s"], 2),
        gen_s=round(statistics.median(s["gen_s"] for s in later), 3),
        peak_train_gib=round(max(s["peak"] for s in later) / 2**30, 3) if cuda else "",
        peak_all_gib=round(peak_all[0] / 2**30, 3) if cuda else "",
        graphs=counters["stats"]["unique_graphs"] - graphs_before, attention=counts["attention"],
        fused_linear_ce=counts["fused_linear_ce"], tiled_mlp=counts["tiled_mlp"],
        recompile_limit=" | ".join(limit.hit), hook_fix=int(cfg["hook_fix"]),
        embed_hooks=len(model.get_input_embeddings()._forward_hooks), losses=[h["loss"] for h in logs],
        grad_norms=[h.get("grad_norm") for h in logs], entropies=[h.get("entropy") for h in logs],
        weights=cfg["weights"], layers=model.config.num_hidden_layers, tiny=int(tiny), trl=trl.__version__,
        **versions(torch.device(cfg["device"])),
    )  # fmt: skip
    if cfg["show_report"] and variant == "tilecompile":
        print(report, flush=True)
    print(ROW + json.dumps(row), flush=True)


def run_worker(cfg: dict, timeout: float) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(cfg)], stdout=subprocess.PIPE, text=True,
                            env=env)  # fmt: skip
    try:
        stdout, _ = proc.communicate(timeout=timeout)
        error = f"worker exited with {proc.returncode}" if proc.returncode else ""
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, _ = proc.communicate()
        error = f"killed at the budget's end ({timeout:.0f} s)"
    row = None
    for line in stdout.splitlines():
        if line.startswith(ROW):
            row = json.loads(line[len(ROW) :])
        else:
            print(line)
    return row or dict(variant=cfg["variant"], ok=0, error=error or "no result")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, run in this order")
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps (the first includes the compile)")
    ap.add_argument("--batch", type=int, default=8, help="per_device_train_batch_size (rows per training step)")
    ap.add_argument("--generations", type=int, default=8, help="num_generations (completions per prompt)")
    ap.add_argument("--prompt-len", type=int, default=1920, help="tokens per prompt")
    ap.add_argument("--completion-len", type=int, default=128, help="tokens per completion (max_completion_length)")
    ap.add_argument("--weights", default="fp32", choices=("fp32", "bf16"), help="the model's dtype (bf16=True)")
    ap.add_argument("--layers", type=int, default=0, help="cut the model to this many layers (0: all 28)")
    ap.add_argument(
        "--hook-fix",
        default="on",
        choices=("on", "off"),
        help="keep_one_input_hook (default on; off: HF's hooks pile up, tilecompile recompiles each step)",
    )
    ap.add_argument("--budget", type=float, default=500, help="seconds for the whole run")
    ap.add_argument("--inner", default="inductor", choices=("inductor", "aot_eager", "eager"))
    ap.add_argument("--warm-cache", action="store_true", help="let Inductor reuse its caches (default: cold)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--bf16", action="store_true", help="bf16=True on cpu too (always on cuda)")
    ap.add_argument("--tiny", action="store_true", help=f"e2e.py's tiny shape {TINY}, 4 rows of 48 + 16: smoke test")
    ap.add_argument("--report", action="store_true", help="print the tilecompile variant's report")
    ap.add_argument("--out", default="", help="write the rows: .csv or .json (by the suffix)")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(json.loads(args.worker))

    if args.tiny:  # unless given: 4 rows (2 prompts x 2) of 48 prompt + 16 completion tokens
        given = set(sys.argv)
        args.batch = args.batch if "--batch" in given else 4
        args.generations = args.generations if "--generations" in given else 2
        args.prompt_len = args.prompt_len if "--prompt-len" in given else 48
        args.completion_len = args.completion_len if "--completion-len" in given else 16
        args.steps = args.steps if "--steps" in given else 3
    start = time.time()
    deadline = start + args.budget
    print(json.dumps(versions(torch.device(args.device))), flush=True)
    rows = []
    for variant in args.variants.split(","):
        if variant not in VARIANTS:
            raise SystemExit(f"unknown variant {variant!r}: one of {', '.join(VARIANTS)}")
        cfg = dict(variant=variant, steps=args.steps, batch=args.batch, generations=args.generations,
                   prompt_len=args.prompt_len, completion_len=args.completion_len, weights=args.weights,
                   layers=args.layers, inner=args.inner, warm_cache=args.warm_cache, device=args.device,
                   bf16=args.bf16, hook_fix=args.hook_fix == "on", tiny=args.tiny, show_report=args.report,
                   deadline=deadline - 30)  # fmt: skip
        row = run_worker(cfg, timeout=max(deadline - time.time(), 1))
        keys = ("ok", "error", "steps", "train_tokens", "train_tok_s", "first_train_s", "gen_s", "peak_train_gib",
                "peak_all_gib", "graphs", "attention", "fused_linear_ce", "tiled_mlp", "recompile_limit", "embed_hooks",
                "losses")  # fmt: skip
        print(f"{variant:<12} " + " ".join(f"{k}={row[k]}" for k in keys if row.get(k) not in (None, "")), flush=True)
        rows.append(row)
    print(f"total {time.time() - start:.0f} s", flush=True)
    if args.out:
        print(f"wrote {write_rows(args.out, rows, FIELDS)}")


if __name__ == "__main__":
    main()
