"""verl's actor update with and without tilecompile: tokens/s and peak memory (issue 41).

The update is verl 0.9.1's own: ``FSDPEngineWithLMHead.train_batch`` (FSDP2 at world size 1, fp32 weights,
``param_dtype=bf16`` / ``reduce_dtype=fp32`` mixed precision under bf16 autocast, AdamW, HF's non-reentrant gradient
checkpointing) on a batch in verl's remove-padding layout, with verl's ``ppo_loss`` (vanilla PPO clipping against old
log-probs, entropy bonus 0.01: the entropy is computed). verl packs each mini-batch into micro-batches of at most
``--tokens`` tokens (``use_dynamic_bsz``, 16384 by default): left-padded prompts of 128-512 and right-padded responses
of 256-1536 tokens, drawn anew for every step, so every micro-batch has another length. Model: Qwen2.5-1.5B's config
(hidden 1536, 28 layers, 12 heads, 2 KV heads, intermediate 8960, vocab 151936, tied embeddings), random init;
``--layers`` keeps the first layers only.

Methods, each in its own process (so that each peak memory is its own), one after the other:
  verl         plain verl as it trains by default: ``use_torch_compile=True`` (its entropy helper compiled with
               Inductor), flash_attention_2 (varlen over the packed sequences) when flash-attn is importable, else
               sdpa; log-probs through flash-attn's Triton cross-entropy when flash-attn has it
  tilecompile  the same engine after ``tilecompile.integrations.verl.compile_engine(engine)``: sdpa attention (the
               attention pass makes it flash / varlen), the lm_head fused with the log-prob and entropy math, the
               MLPs tiled; one dynamic compile

Per method: ``--warmup`` steps (the first compiles), then ``--steps`` timed steps: tokens/s (real tokens, no padding,
over the timed steps' wall time), peak memory (``max_memory_allocated`` over the timed steps: weights, grads and AdamW
state included), the first step's seconds, the report's counts. Each method's row is appended to ``--out``
(benchmarks/results/verl.csv) as soon as it finishes, so a run cut short keeps what it measured. ``--budget`` seconds
(420) bound the whole run: a method is started only with at least 60 s left, killed at the end, and its row says so.
On one H200 the default run (2 methods, 28 layers) should take 4-6 minutes; ``--layers 8`` is a quicker look.

The GPU machine has no network: verl and what importing its engine needs travel as wheels (python 3.12, manylinux),
installed without dependencies into .site; torch, triton, accelerate, peft, huggingface_hub and safetensors come
from the image. TRL 0.29.1 is there because verl's monkey patch imports TRL's value-head model when TRL is
installed, which TRL 1.x removed; transformers 5.10.4 because verl 0.9.1 pins transformers < 5.11, and tokenizers
0.22.2 because transformers 5.10.4 checks for tokenizers <= 0.23.0 at import (the image's is 0.23.2). The same
versions as .ci/compat's verl venv, where tests/test_verl.py passes. ray and datasets are left out: ray's wheel
(79 MB) is more than the GPU machine takes along (64 MiB), datasets is not on the image (nor its dependencies dill
and multiprocess), and one process never calls either; verl's modules import them, so where they are not installed
``stub_missing`` stands in for them at import time. Here (28 wheels, about 27 MB):

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
      verl==0.9.1 tensordict==0.10.0 pyvers==0.1.0 orjson==3.13.0 cloudpickle==3.1.3 importlib_metadata==10.2.0 \
      lazy-importer==0.1.0 zipp==4.1.2 codetiming==1.4.0 omegaconf==2.4.0 msgpack==1.2.4 click==8.5.1 \
      jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 attrs==26.1.0 \
      pillow==13.0.0 requests==2.34.2 urllib3==2.8.0 idna==3.20 certifi==2026.10.19.post1 charset-normalizer==3.5.3 \
      pyyaml==6.0.4 protobuf==7.36.2 trl==0.29.1 transformers==5.10.4 tokenizers==0.22.2

Then on the GPU machine, with .whl sent along with the working tree (the device tool's ``carry=[".whl"]``):

    python3 -m pip install -q --no-deps --no-build-isolation -e .
    python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl
    PYTHONPATH=$PWD/.site python3 benchmarks/bench_verl.py

usage: python benchmarks/bench_verl.py [--methods verl,tilecompile] [--layers 28] [--tokens 16384] [--steps 3]
           [--warmup 2] [--budget 420] [--out benchmarks/results/verl.csv]
       python benchmarks/bench_verl.py --tiny      (CPU smoke test of the same code, gloo, aot_eager; a minute)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e import versions, write_rows  # noqa: E402

METHODS = ("verl", "tilecompile")
QWEN25_15B = dict(
    hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
    vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)  # fmt: skip
TINY = dict(
    hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=128, tie_word_embeddings=True,
)  # fmt: skip
FIELDS = [
    "method", "ok", "error", "layers", "tokens", "tok_s", "step_s", "peak_gib", "first_step_s", "steps",
    "micro_batches", "attention", "fused_linear_ce", "tiled_mlp", "graphs", "attn", "pg_loss", "tiny", "device",
    "torch", "triton", "transformers", "verl", "date", "commit",
]  # fmt: skip


# ------------------------------------------------------------------ one method, in its own process


def cpu_platform():
    """verl 0.9.1 has no CPU platform (it falls back to CUDA's): CUDA's with the device calls made CPU's, for
    ``--tiny``, set through verl's own ``set_platform``."""
    from verl.plugin.platform.platform_cuda import PlatformCUDA

    class PlatformCPU(PlatformCUDA):
        device_name = property(lambda self: "cpu")
        vendor_name = property(lambda self: "cpu")
        device_module = property(lambda self: torch.cpu)
        is_available = lambda self: True  # noqa: E731
        is_platform_available = lambda self, use_smi_check=False: True  # noqa: E731
        current_device = lambda self: "cpu"  # noqa: E731
        device_count = lambda self: 1  # noqa: E731
        set_device = lambda self, index: None  # noqa: E731
        synchronize = lambda self, index=None: None  # noqa: E731
        manual_seed = lambda self, seed: torch.manual_seed(seed)  # noqa: E731
        manual_seed_all = lambda self, seed: torch.manual_seed(seed)  # noqa: E731
        set_allocator_settings = lambda self, settings: None  # noqa: E731
        empty_cache = lambda self: None  # noqa: E731
        get_device_capability = lambda self, index=0: (None, None)  # noqa: E731
        communication_backend_name = lambda self: "gloo"  # noqa: E731
        nvtx_range = lambda self, msg: contextlib.nullcontext()  # noqa: E731
        profiler_start = lambda self: None  # noqa: E731
        profiler_stop = lambda self: None  # noqa: E731

    return PlatformCPU()


class _Stub:
    """Stands for any name of a stubbed package at import time (a decorator returns what it decorates)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Stub(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return _Stub(self._name + "()")

    def __mro_entries__(self, bases):
        return (object,)

    def __or__(self, other):  # in annotations evaluated at import: ``Dataset | dict[str, Dataset] | None``
        return self

    __ror__ = __or__

    def __getitem__(self, item):  # ``Dataset[...]``
        return self


# imported by verl's modules at import time, never called by one process's engine step: ray (verl/__init__.py,
# verl.single_controller), datasets (verl.utils.dataset, which the FSDP engine's module imports for an enum; the GPU
# image has no datasets, and its wheel's own dependencies dill and multiprocess are not there either)
STUBBED = ("ray", "datasets")


def stub_missing() -> list[str]:
    """Where a package of ``STUBBED`` is not installed (or is named in ``BENCH_VERL_STUB``, comma-separated, to check
    this where it is), make ``import name`` (and ``name.*``) give stand-ins, so that verl's modules import; the names
    stubbed."""
    import importlib.abc
    import importlib.machinery
    import importlib.util
    import types

    forced = set(filter(None, os.environ.get("BENCH_VERL_STUB", "").split(",")))
    names = [n for n in STUBBED if n in forced or importlib.util.find_spec(n) is None]
    if not names:
        return []

    class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in names:
                return importlib.machinery.ModuleSpec(name, self, is_package=True)
            return None

        def create_module(self, spec):
            module = types.ModuleType(spec.name)
            module.__path__ = []

            def getattr_(attr):
                if attr.startswith("__"):
                    raise AttributeError(attr)
                return _Stub(f"{spec.name}.{attr}")

            module.__getattr__ = getattr_
            return module

        def exec_module(self, module):
            pass

    sys.meta_path.insert(0, Finder())
    return names


def flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def make_batch(step: int, cfg: dict):
    """One step's batch in verl's remove-padding layout (``left_right_2_no_padding``), drawn from seed ``step``."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    g = torch.Generator().manual_seed(1000 + step)
    rows, (p_lo, p_hi), (r_lo, r_hi), vocab = cfg["rows"], cfg["prompt"], cfg["response"], cfg["vocab"]
    ids = torch.randint(3, vocab, (rows, p_hi + r_hi), generator=g)
    mask = torch.zeros(rows, p_hi + r_hi, dtype=torch.long)
    for r in range(rows):
        p = int(torch.randint(p_lo, p_hi + 1, (1,), generator=g))
        n = int(torch.randint(r_lo, r_hi + 1, (1,), generator=g))
        mask[r, p_hi - p : p_hi + n] = 1
    td = TensorDict(
        {
            "input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "prompts": ids[:, :p_hi], "responses": ids[:, p_hi:], "response_mask": mask[:, p_hi:].clone(),
            "old_log_probs": torch.randn(rows, r_hi, generator=g) * 0.1 - 3,
            "advantages": torch.randn(rows, r_hi, generator=g),
        },
        batch_size=[rows],
    )  # fmt: skip
    tokens = int(mask.sum())
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(
        td, use_remove_padding=True, use_dynamic_bsz=True, max_token_len_per_gpu=cfg["tokens"],
        micro_batch_size_per_gpu=1, use_fused_kernels=False, calculate_entropy=True, temperature=1.0,
        global_batch_size=rows,
    )  # fmt: skip
    return td, tokens


def worker(cfg: dict) -> dict:
    """Build verl's engine for ``cfg["method"]``, run the steps, return the row."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["port"]))
    if stubbed := stub_missing():
        print(f"  not installed: {', '.join(stubbed)}; verl imports stand-ins (stub_missing)", file=sys.stderr,
              flush=True)  # fmt: skip
    import functools

    import torch.distributed as dist
    from verl.plugin.platform.platform_manager import set_platform
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import ActorConfig, FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    from verl.workers.utils.losses import ppo_loss

    import tilecompile
    from tilecompile.integrations.verl import compile_engine

    cuda = not cfg["tiny"]
    if not cuda:
        set_platform(cpu_platform())
    else:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    method = cfg["method"]
    attn = "flash_attention_2" if method == "verl" and cuda and flash_attn_available() else "sdpa"
    model_config = HFModelConfig(
        path=cfg["model"], load_tokenizer=False, use_remove_padding=True, enable_gradient_checkpointing=True,
        override_config={"attn_implementation": attn},
    )  # fmt: skip
    engine_config = FSDPEngineConfig(strategy="fsdp2", forward_only=False, model_dtype="fp32", use_torch_compile=True)
    engine_config.use_remove_padding = True
    engine = FSDPEngineWithLMHead(model_config, engine_config, FSDPOptimizerConfig(lr=1e-6), CheckpointConfig())
    engine.initialize()
    if method == "tilecompile":
        compile_engine(engine, options={"inner": "aot_eager"} if cfg["tiny"] else None)
    forward_step, calls = engine.forward_step, [0]

    def counted(*args, **kwargs):  # the micro-batches verl's dynamic batching made
        calls[0] += 1
        return forward_step(*args, **kwargs)

    engine.forward_step = counted
    loss = functools.partial(
        ppo_loss,
        ActorConfig(strategy="fsdp2", rollout_n=1, ppo_mini_batch_size=cfg["rows"], ppo_micro_batch_size_per_gpu=1,
                    entropy_coeff=0.01, calculate_entropy=True, use_dynamic_bsz=True),
    )  # fmt: skip
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    row = dict(method=method, attn=attn, ok=0)
    times, tokens, micro = [], 0, 0
    for step in range(cfg["warmup"] + cfg["steps"]):
        timed = step >= cfg["warmup"]
        if step == cfg["warmup"] and cuda:
            torch.cuda.reset_peak_memory_stats()
        td, n = make_batch(step, cfg)
        sync()
        before = calls[0]
        t0 = time.perf_counter()
        with engine.train_mode():
            out = engine.train_batch(td, loss)
        sync()
        dt = time.perf_counter() - t0
        metrics = out["metrics"]
        pg = metrics["actor/pg_loss"]
        pg = float(pg.aggregate()) if hasattr(pg, "aggregate") else float(pg)
        print(f"  {method} step {step}: {n} tokens in {dt:.2f} s, pg_loss {pg:.5f}", file=sys.stderr, flush=True)
        if step == 0:
            row.update(first_step_s=round(dt, 2), pg_loss=pg)
        if timed:
            times.append(dt)
            tokens += n
            micro += calls[0] - before
            if time.time() > cfg["deadline"]:  # the budget: at least one timed step
                break
    counts = tilecompile.report().counts
    row.update(
        ok=1, tok_s=round(tokens / sum(times), 1), step_s=round(sum(times) / len(times), 4), steps=len(times),
        micro_batches=micro, peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 3) if cuda else "",
        graphs=int(torch._dynamo.utils.counters["stats"]["unique_graphs"]),
        **{k: counts.get(k, 0) for k in ("attention", "fused_linear_ce", "tiled_mlp")},
    )  # fmt: skip
    dist.destroy_process_group()
    return row


# ------------------------------------------------------------------ the run


def save_model(cfg: dict, tiny: bool, layers: int | None) -> str:
    """A random-init Qwen2 of ``cfg`` (bf16 on the GPU; verl loads it in fp32) saved to a temporary folder."""
    import transformers

    config = transformers.Qwen2Config(**cfg, pad_token_id=0, eos_token_id=1)
    if layers:
        config.num_hidden_layers = layers
    path = tempfile.mkdtemp(prefix="bench_verl_")
    torch.manual_seed(0)
    device = "cpu" if tiny or not torch.cuda.is_available() else "cuda"
    with torch.device(device):
        model = transformers.Qwen2ForCausalLM(config).to(torch.float32 if tiny else torch.bfloat16)
    model.save_pretrained(path)
    del model
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--layers", type=int, default=None, help="keep the first N decoder layers (28 in the 1.5B)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens a micro-batch at most (16384)")
    ap.add_argument("--rows", type=int, default=None, help="rows a step (24: about two 16k micro-batches)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--budget", type=float, default=420, help="seconds for the whole run")
    ap.add_argument("--tiny", action="store_true", help="a tiny Qwen2 on CPU: the same code path, for a smoke test")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "verl.csv"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print("ROW " + json.dumps(worker(json.loads(args.worker))), flush=True)
        return

    start = time.time()
    deadline = start + args.budget
    model_cfg = TINY if args.tiny else QWEN25_15B
    layers = args.layers or model_cfg["num_hidden_layers"]
    model = save_model(model_cfg, args.tiny, args.layers)
    print(f"model saved in {time.time() - start:.0f} s: {model}", file=sys.stderr, flush=True)
    base = dict(
        model=model, tiny=args.tiny, vocab=model_cfg["vocab_size"], steps=args.steps, warmup=args.warmup,
        tokens=args.tokens or (48 if args.tiny else 16384), rows=args.rows or (6 if args.tiny else 24),
        prompt=(2, 8) if args.tiny else (128, 512), response=(4, 12) if args.tiny else (256, 1536),
    )  # fmt: skip
    info = versions(torch.device("cpu" if args.tiny else "cuda"))
    try:
        import importlib.metadata

        info["verl"] = importlib.metadata.version("verl")
    except importlib.metadata.PackageNotFoundError:
        info["verl"] = ""
    for method in args.methods.split(","):
        left = deadline - time.time()
        common = dict(method=method, layers=layers, tokens=base["tokens"], tiny=int(args.tiny), **info)
        if left < 60:
            row = dict(common, ok=0, error=f"skipped: {left:.0f} s of budget left")
        else:
            cfg = dict(base, method=method, port=free_port(), deadline=deadline - 30)
            proc = subprocess.Popen(
                [sys.executable, __file__, "--worker", json.dumps(cfg)], stdout=subprocess.PIPE, text=True
            )
            try:
                stdout, _ = proc.communicate(timeout=left)
                found = [line[4:] for line in stdout.splitlines() if line.startswith("ROW ")]
                error = "" if found else f"worker exited {proc.returncode} with no row (its stderr above)"
                row = dict(common, **(json.loads(found[-1]) if found else dict(ok=0, error=error)))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                row = dict(common, ok=0, error=f"killed at the budget's end ({left:.0f} s)")
        write_rows(args.out, [row], FIELDS, append=True)
        print(json.dumps({k: row.get(k) for k in FIELDS if row.get(k) not in (None, "")}), flush=True)
    print(f"rows appended to {args.out}; {time.time() - start:.0f} s in all", file=sys.stderr)


if __name__ == "__main__":
    main()
