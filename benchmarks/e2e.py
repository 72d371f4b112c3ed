"""End to end: one GRPO-style training step of a whole HF model, per method, from 4k to 512k tokens.

Models (random init from a config, bf16 on CUDA): ``1.5b`` is Qwen2.5-1.5B's shape (Qwen2: hidden 1536, intermediate
8960, 28 layers, 12 heads, 2 kv heads, vocab 151936, tied embeddings); ``8b`` is Llama-3-8B's (Llama: 4096, 14336,
32 layers, 32 heads, 8 kv heads, vocab 128256); ``30b-a3b`` is Qwen3-30B-A3B's (Qwen3-MoE: hidden 2048, 48 layers,
32 heads, 4 kv heads, head dim 128, 128 experts of 768 in every layer, top 8, vocab 151936; HF's default grouped_mm
experts). All keep every layer by default: bf16 weights and grads of the 8B take 32 GB of an H200's 141 GB, of the
30B 122 GB (run it cut); ``--layers N`` cuts every model to N layers, and the output says so.

The step: per-token log-prob (log_softmax + gather) and entropy of the logits, PPO's clipped ratio against old
log-probs times advantages, minus an entropy bonus; then backward (no optimizer step). Methods:
  eager        the model and loss as written
  inductor     torch.compile(step)
  liger        eager on Liger's patched model (apply_liger_kernel_to_qwen2/llama/qwen3_moe: RMSNorm, RoPE, SwiGLU;
               for the MoE its fused experts, LigerExperts, under transformers 5); its fused linear CE gives no
               log-prob + entropy, so the loss is the same code on the logits (when installed)
  tilecompile  torch.compile(step, backend="tilecompile")
each with activation checkpointing on and off (``--checkpointing on,off``). Each (model, method, checkpointing)
runs in its own process: Liger patches HF's classes globally, and an OOM or a crash stays in that process.

Per length (doubling, ``--lengths``; one row of B=1): the first step's time (compilation included) and the graphs it
compiled, then the median of ``--repeats`` steps: tokens/s and peak memory (``max_memory_allocated``, weights and
grads included). A method stops at its first out-of-memory (or the ``--search`` after it): the longest length that
ran is its longest sequence.
Compiles: static by default, one per length (``torch._dynamo.reset()`` between lengths); ``--dynamic`` compiles
once with dynamic=True and counts the recompiles (on torch 2.11 CUDA that crashed in the first backward with "shape
'[N/16, 1536]' is invalid for input of size 1", issue #13). Inductor's caches are off unless ``--warm-cache``, so the
first step's time is a cold compile.

Model FLOPs of one step (the ``model_flops`` column; ``tflops`` = model_flops / median step time, ``mfu`` = tflops /
``--peak-tflops``, by default 989.4: the H100/H200 SXM's dense bf16 peak, NVIDIA's datasheet, without sparsity):
    model_flops = 6 · P · T + 12 · L · H · d_head · A
  P       the matmuls' parameters: every nn.Linear weight, the lm_head once even when tied to the embedding (the
          embedding's lookup is no matmul; norms, biases and the loss are left out); 2 FLOPs per weight and token
          forward, 4 backward (input and weight grads). MoE experts (stacked gate_up_proj / down_proj): the weights
          a token runs through, top_k / num_experts of them
  T       real tokens of the step (the ``real_tokens`` column): attention_mask's ones, every slot without a mask
  L, H    layers and query heads (GQA shares K/V, not the products), d_head the head width
  A       the (query, key) pairs the mask allows among real tokens, summed over rows: per row and document, m real
          tokens attend their real prefix, m(m+1)/2 pairs; documents (position_ids restarting) split a row only
          without an attention_mask, as HF's masks do. Per layer and head, QK^T and PV cost 2 · d_head FLOPs a pair
          each forward (4 · H · d_head · A a layer), backward twice the forward: 12 · L · H · d_head · A.
Activation checkpointing's recompute is not counted (model FLOPs, not hardware FLOPs), nor the pad slots' work.

The CSV (``--csv``, default benchmarks/results/e2e.csv) gets each row as soon as it is measured, appended to the rows
there (``--overwrite`` starts it anew; a file with other columns is rewritten with the union of both, old rows' new
cells empty), so a sweep is split over runs of 10 minutes and a run cut short keeps what it measured; --tiny and CPU
runs write a temp file, anew each run, unless ``--csv`` says otherwise. Each row carries the GPU name,
torch/triton/transformers versions, the date and ``--note``. ``--search K``: after a method's first OOM, up to K
more lengths bisecting the longest that ran and the shortest that ran out of memory (multiples of 4096), each a row;
an OOM there narrows the search. ``--budget S``: the run gets S seconds of wall time, counted from the end of its
own start (its imports: leave a margin under a GPU call's limit); the worker still running then is stopped with its
children, its length gets a row "cut by --budget", and the methods after it are skipped (printed, no row).
``--probe``: the first step and one timed step per length (the note says "single-step probe"), for lengths whose
repeats would not fit a run. ``benchmarks/plot_e2e.py`` turns the CSV into a PNG and, with ``--table``, the
Markdown tables of benchmarks/RESULTS.md.

usage: python benchmarks/e2e.py [--models 1.5b,8b] [--methods eager,inductor,liger,tilecompile]
           [--checkpointing on,off] [--lengths 4096,...,524288] [--dynamic] [--packed K] [--csv PATH] [--overwrite]
           [--padded 8x4096] [--mask ones] [--env TILECOMPILE_ATTENTION=0] [--search K] [--probe] [--note TEXT]
           [--budget SECONDS]
       python benchmarks/e2e.py --tiny --device cpu --methods eager,tilecompile --inner aot_eager   (smoke test)
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import csv
import datetime
import importlib.metadata
import json
import linecache
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings

import torch
import torch.nn.functional as F

MODELS = {  # family, hidden, intermediate, layers, heads, kv heads, vocab, tied, rope theta
    "1.5b": ("qwen2", 1536, 8960, 28, 12, 2, 151936, True, 1e6),
    "8b": ("llama", 4096, 14336, 32, 32, 8, 128256, False, 5e5),
    "30b-a3b": ("qwen3_moe", 2048, 768, 48, 32, 4, 151936, False, 1e6),  # intermediate: each expert's
}
MOE = {"30b-a3b": dict(num_experts=128, num_experts_per_tok=8, head_dim=128, intermediate_size=6144)}
TINY = (64, 176, 2, 4, 2, 1000)  # hidden, intermediate, layers, heads, kv heads, vocab for --tiny
TINY_MOE = dict(num_experts=8, num_experts_per_tok=2, head_dim=16, intermediate_size=176)  # and 8 experts of 176
METHODS = ("eager", "inductor", "liger", "tilecompile")
PEAK_TFLOPS = 989.4  # H100/H200 SXM, dense bf16 (NVIDIA's datasheet)
SEARCH_STEP = 4096  # --search's lengths are multiples of this
FIELDS = [
    "model", "family", "tiny", "dtype", "layers", "full_layers", "method", "checkpointing", "dynamic", "packed",
    "rows", "mask", "env",
    "seq_len", "ok", "error", "tok_s", "step_s", "tflops", "mfu", "peak_gib", "host_gib", "first_step_s", "compile_s",
    "graphs",
    "compiles_total", "rewrites", "host_syncs", "loss", "model_flops", "real_tokens", "repeats", "note",
    "device", "torch", "triton", "transformers", "liger", "date", "commit",
]  # fmt: skip
ROW, TRY = "ROW ", "TRY "  # a worker's lines: a result, the row it runs next (its fields before the step's)


def _host_peak_gib() -> float:
    """Peak pinned host memory in use over the timed steps: the offload's pool (the offloaded checkpoints, exact
    sizes) plus PyTorch's caching host allocator (other pinned tensors) where this torch has its statistics."""
    from tilecompile.ops import offload

    stats = getattr(torch.cuda, "host_memory_stats", None)
    other = (stats().get("active_bytes.peak") or 0) if stats is not None else 0
    return round((offload.host_stats()["peak"] + other) / 2**30, 3)


def _reset_host_peak() -> None:
    from tilecompile.ops import offload

    offload.reset_host_peak()
    if hasattr(torch.cuda, "reset_peak_host_memory_stats"):
        torch.cuda.reset_peak_host_memory_stats()


def write_rows(path: str, rows: list[dict], fields: list[str], append: bool = False) -> pathlib.Path:
    """``rows`` to ``path``: JSON for a .json path, else CSV of ``fields`` (others left out); the path written. With
    ``append``, after the rows already there; a CSV whose header differs is rewritten with the union of the columns
    (``fields`` first; cells a row lacks stay empty)."""
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    there = append and out.exists() and out.stat().st_size > 0
    if out.suffix == ".json":
        out.write_text(json.dumps((json.loads(out.read_text()) if there else []) + rows, indent=1) + "\n")
        return out
    old_fields, old_rows = [], []
    if there:
        with open(out, newline="") as f:
            reader = csv.DictReader(f)
            old_fields = reader.fieldnames or []
            old_rows = list(reader) if old_fields != fields else []
    if there and old_fields == fields:
        with open(out, "a", newline="") as f:
            csv.DictWriter(f, fieldnames=fields, extrasaction="ignore").writerows(rows)
        return out
    union = fields + [c for c in old_fields if c not in fields]
    part = out.with_name(out.name + ".part")  # replaced in one step: a run killed meanwhile loses no old rows
    with open(part, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=union, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(old_rows + rows)
    os.replace(part, out)
    return out


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def versions(device: torch.device) -> dict:
    def version(package: str) -> str:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return ""

    # the device's copy of the tree may carry a stale .git: a caller that knows the commit says so
    commit = os.environ.get("TILECOMPILE_BENCH_COMMIT", "")
    try:
        if not commit:
            git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
            commit = git.stdout.strip()
    except OSError:
        pass
    return dict(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", torch=torch.__version__,
        triton=version("triton"), transformers=version("transformers"), liger=version("liger-kernel"),
        date=_now(), commit=commit,
    )  # fmt: skip


def full_layers(name: str, tiny: bool) -> int:
    """The layers of model ``name`` (of its tiny stand-in with ``tiny``) before ``--layers`` cuts it."""
    return TINY[2] if tiny else MODELS[name][3]


def timed_step(model: torch.nn.Module, step, batch: tuple, cuda: bool) -> tuple[float, float, torch.Tensor]:
    """One step (``step(*batch).backward()``) with the grads dropped first: (host seconds until ``backward()``
    returns, wall seconds to the synchronize, the loss)."""
    for p in model.parameters():
        p.grad = None
    start = time.perf_counter()
    loss = step(*batch)
    loss.backward()
    host = time.perf_counter() - start
    if cuda:
        torch.cuda.synchronize()
    return host, time.perf_counter() - start, loss


def build(name: str, tiny: bool, layers: int, checkpointing: bool, liger: bool, device: torch.device):
    import transformers

    family, d, i, n, h, kv, v, tied, theta = MODELS[name]
    if tiny:
        d, i, n, h, kv, v = TINY
    if liger:  # patches HF's classes before the model is built; the loss needs the logits, so no fused CE
        import liger_kernel.transformers as lk

        patch = {"qwen2": lk.apply_liger_kernel_to_qwen2, "llama": lk.apply_liger_kernel_to_llama,
                 "qwen3_moe": getattr(lk, "apply_liger_kernel_to_qwen3_moe", None)}[family]  # fmt: skip
        if patch is None:
            raise RuntimeError(f"this liger-kernel has no patch for {family}")
        patch(rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False)
    config_cls, model_cls = {
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    }[family]
    sizes = dict(intermediate_size=i)
    if family == "qwen3_moe":  # every layer MoE (decoder_sparse_step 1); intermediate is each expert's
        moe = TINY_MOE if tiny else MOE[name]
        sizes = dict(moe, moe_intermediate_size=i, decoder_sparse_step=1, mlp_only_layers=[])
    cfg = config_cls(
        hidden_size=d, num_hidden_layers=layers or n, num_attention_heads=h,
        num_key_value_heads=kv, vocab_size=v, tie_word_embeddings=tied, rope_theta=theta,
        max_position_embeddings=1 << 20, attn_implementation="sdpa", **sizes,
    )  # fmt: skip
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in bf16 directly: the 8B in fp32 would take 32 GB just to be cast
    try:
        with torch.device(device):
            model = model_cls(cfg)
    finally:
        torch.set_default_dtype(default)
    if checkpointing:
        enable = getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)
        enable({"use_reentrant": False})
    return model.train(), n


def grpo_step(model, ids, adv, old_logp, position_ids=None, attention_mask=None, loss_mask=None):
    out = model(input_ids=ids, position_ids=position_ids, attention_mask=attention_mask, use_cache=False)
    logits = out.logits[:, :-1].float()
    logp = F.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    entropy = torch.logsumexp(logits, dim=-1) - (F.softmax(logits, dim=-1) * logits).sum(-1)
    ratio = torch.exp(logp - old_logp)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    if loss_mask is None:
        return pg.mean() - 1e-3 * entropy.mean()
    return ((pg - 1e-3 * entropy) * loss_mask).sum() / loss_mask.sum().clamp(min=1)  # the completion tokens


def inputs(n: int, vocab: int, packed: int, device: torch.device, rows: int = 1, mask: str = "") -> tuple:
    """(ids, adv, old_logp, position_ids, attention_mask, loss_mask). ``mask``: '' (none), 'ones' (a collator's
    all-ones attention_mask), 'trl' (TRL's GRPO batch: each row a prompt left-padded to n/2, then a completion
    right-padded to n/2; prompt and completion lengths uniform in [0.3, 1] of their half; the loss on the completion
    tokens)."""
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(0, vocab, (rows, n), generator=g)
    adv, old_logp = torch.randn(rows, n - 1, generator=g), -5 * torch.rand(rows, n - 1, generator=g)
    pos = attention = loss_mask = None
    if packed:  # K equal documents; position_ids restart at 0 in each
        doc = torch.clamp(torch.arange(n) // (n // packed), max=packed - 1)
        pos = (torch.arange(n) - torch.searchsorted(doc, doc))[None]
    if mask == "ones":
        attention = torch.ones(rows, n, dtype=torch.long)
    elif mask == "trl":
        half = n // 2
        attention = torch.zeros(rows, n, dtype=torch.long)
        completion = torch.zeros(rows, n, dtype=torch.long)
        for r in range(rows):
            p = int(torch.randint(int(0.3 * half), half + 1, (1,), generator=g))
            c = int(torch.randint(int(0.3 * half), half + 1, (1,), generator=g))
            attention[r, half - p : half + c] = 1
            completion[r, half : half + c] = 1
        loss_mask = completion[:, 1:].float()
    return tuple(None if t is None else t.to(device) for t in (ids, adv, old_logp, pos, attention, loss_mask))


def matmul_params(model: torch.nn.Module) -> int:
    """P: the nn.Linear weights' elements, each weight once (a tied lm_head is the embedding's, counted here once);
    of stacked MoE experts (3-D ``gate_up_proj`` / ``down_proj``), top_k / num_experts: the weights a token runs."""
    weights = {id(m.weight): m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)}
    total = sum(w.numel() for w in weights.values())
    config = getattr(model, "config", None)
    top_k, experts = getattr(config, "num_experts_per_tok", 0), getattr(config, "num_experts", 0)
    if top_k and experts:
        stacked = [p for name, p in model.named_parameters() if name.endswith(("gate_up_proj", "down_proj"))]
        total += sum(p.numel() for p in stacked if p.dim() == 3) * top_k // experts
    return total


def real_tokens(rows: int, n: int, attention_mask: torch.Tensor | None) -> int:
    """T: attention_mask's ones, every slot without a mask."""
    return rows * n if attention_mask is None else int(attention_mask.sum())


def attention_pairs(rows: int, n: int, position_ids=None, attention_mask=None) -> int:
    """A: the (query, key) pairs the causal mask allows among real tokens, summed over rows. Per row and document the
    m real tokens attend their real prefix: m(m+1)/2. Documents start where position_ids do not step by one (HF's
    find_packed_sequence_indices), and only without an attention_mask, as HF builds the mask. O(rows · n) on the host.
    """
    real = torch.ones(rows, n, dtype=torch.long) if attention_mask is None else attention_mask.cpu().long()
    doc = torch.zeros(rows, n, dtype=torch.long)
    if position_ids is not None and attention_mask is None:
        pos = position_ids.cpu().expand(rows, n)
        doc = (torch.diff(pos, prepend=pos[:, :1] - 1) != 1).long().cumsum(-1)
    doc = doc + (n + 1) * torch.arange(rows)[:, None]  # one bin per (row, document)
    m = torch.zeros(rows * (n + 1), dtype=torch.long).index_add_(0, doc.flatten(), real.flatten())
    return int((m * (m + 1) // 2).sum())


def model_flops(config, params: int, tokens: int, pairs: int) -> int:
    """One training step's model FLOPs: 6 · P · T + 12 · L · H · d_head · A (the module docstring derives it)."""
    d_head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 6 * params * tokens + 12 * config.num_hidden_layers * config.num_attention_heads * d_head * pairs


def next_length(lengths: list[int], errors: dict[int, str], search: int, step: int = SEARCH_STEP) -> int | None:
    """The length to run next, given ``errors``: each length run so far, in run order, '' where it ran, else its error.
    ``lengths`` in order until the first failure; after an OOM, up to ``search`` more lengths, each the middle (a
    multiple of ``step``) of the longest that ran (0 if none) and the shortest OOM; None when done."""
    failed = [n for n, e in errors.items() if e]
    if not failed:
        return next((n for n in lengths if n not in errors), None)
    searched = len(errors) - 1 - list(errors).index(failed[0])
    if searched >= search or any(e != "OOM" for e in errors.values() if e):
        return None
    lo = max((n for n, e in errors.items() if not e), default=0)
    hi = min(failed)
    middle = round((lo + hi) / 2 / step) * step
    return middle if lo < middle < hi else None


def profile(fn, args, kw, title: str, top: int = 12) -> None:
    """The kernels of one step (after a warm-up), by their total GPU time, largest first."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    fn(*args, **kw)
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(*args, **kw)
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in kernels)
    print(f"-- profile: {title}, {total / 1e3:.2f} ms of kernels", flush=True)
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]:
        print(f"  {e.self_device_time_total / 1e3:8.3f} ms x{e.count:<4d} {e.key[:110]}", flush=True)


def _sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def _host_syncs() -> int:
    """Host syncs tilecompile's attention has made so far (its mask plans: one per compiled graph's step)."""
    from tilecompile.kernels import attention as K

    return K.HOST_SYNCS[0]


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


_MAX_ENTRIES = 2_000_000


def record_memory_history() -> None:
    """The CUDA allocator's trace on, with Python stacks (``live_at_peak`` groups by them)."""
    torch.cuda.memory._record_memory_history(max_entries=_MAX_ENTRIES, stacks="python")


def memory_trace() -> list[dict]:
    """The current device's allocator trace so far."""
    trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    assert len(trace) < _MAX_ENTRIES, "the allocator's trace wrapped; raise _MAX_ENTRIES"
    return trace


def _origin(frames: list[dict]) -> str:
    """The innermost frame outside torch's own Python files (Inductor's generated code is outside them), with its
    source line."""
    torch_dir = os.path.dirname(torch.__file__)
    for fr in frames:
        name = fr.get("filename", "")
        if name.startswith(torch_dir) and "torchinductor" not in name:
            continue
        text = linecache.getline(name, fr.get("line", 0)).strip()
        return f"{os.path.basename(name)}:{fr.get('line')}:{fr.get('name')}: {text[:110]}"
    return "(torch only) " + (f"{frames[0].get('name')}" if frames else "")


def live_at_peak(trace: list[dict], mark: int, top: int = 14) -> dict:
    """Replays the allocator's trace (allocated bytes fall at a free's request, as ``max_memory_allocated``'s do):
    what is live at entry ``mark`` (the last step's start: weights, grads, whatever a step keeps for the next), the
    step's peak after it, and the allocations live then, by origin, largest first."""

    def replay(upto: int, after: int) -> tuple[dict[int, tuple[int, list]], int, int]:
        """The allocations live after entry ``upto``, and (the peak, its entry) between ``after`` and there."""
        live: dict[int, tuple[int, list]] = {}
        now = best = at = 0
        for i, e in enumerate(trace[: upto + 1]):
            if e["action"] == "alloc":
                live[e["addr"]] = (e["size"], e.get("frames", []))
                now += e["size"]
                if i >= after and now > best:
                    best, at = now, i
            elif e["action"] == "free_requested" and e["addr"] in live:
                now -= live.pop(e["addr"])[0]
        return live, best, at

    def by_origin(live: dict[int, tuple[int, list]]) -> list[str]:
        groups: dict[str, list[int]] = {}
        for size, frames in live.values():
            g = groups.setdefault(_origin(frames), [0, 0])
            g[0] += size
            g[1] += 1
        rows = sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]
        return [f"{b / 2**20:9.1f} MiB x{n:<3d} {origin}" for origin, (b, n) in rows]

    at_start = replay(mark - 1, len(trace))[0] if mark else {}
    _, best, at = replay(len(trace) - 1, mark)
    at_best = replay(at, len(trace))[0]  # a second pass to the peak's entry: no copy of the live set at every new peak
    return {
        "start_gib": round(sum(size for size, _ in at_start.values()) / 2**30, 3),
        "traced_peak_gib": round(best / 2**30, 3),  # what was live at the step's peak, the start's bytes included
        "at_start": by_origin(at_start),
        "by_origin": by_origin(at_best),
    }


def write_snapshot(path: str, row: dict, at_peak: dict) -> None:
    """Appends what was live at a length's last timed step's peak (or, where it failed, at the peak of its attempt),
    by origin, to ``path`` (JSON lines), and prints the largest."""
    keys = ("model", "layers", "method", "checkpointing", "env", "seq_len", "ok", "error", "peak_gib")
    with open(path, "a") as f:
        f.write(json.dumps(dict({k: row.get(k) for k in keys}, **at_peak)) + "\n")
    print(f"snapshot {row['seq_len']}: start {at_peak['start_gib']} GiB, traced peak {at_peak['traced_peak_gib']} GiB")
    for line in at_peak["by_origin"][:8]:
        print("snapshot   " + line)


def set_switches(spec: str) -> None:
    """``E2E_SET`` (through ``--env``): ``module.NAME=value[;...]``, a module switch of the project set in the
    worker before the build (``tilecompile.kernels.tiled_grouped_mlp.USE_TMA=True``), for an A/B of a kernel path
    that has no setting. The value is a Python literal; the switch must exist."""
    for item in filter(None, (part.strip() for part in spec.split(";"))):
        target, value = item.split("=", 1)
        module, name = target.rsplit(".", 1)
        mod = importlib.import_module(module)
        if not hasattr(mod, name):
            raise SystemExit(f"E2E_SET: {module} has no {name}")
        setattr(mod, name, ast.literal_eval(value))
        print(f"E2E_SET {module}.{name} = {getattr(mod, name)!r}", flush=True)


def worker(cfg: dict) -> None:
    """One (model, method, checkpointing) over every length (and ``--search``'s): ``TRY {json}`` before a length,
    ``ROW {json}`` after it."""
    from torch._dynamo.utils import counters

    import tilecompile

    device = torch.device(cfg["device"])
    cuda = device.type == "cuda"
    torch._inductor.config.force_disable_caches = not cfg["warm_cache"]
    warnings.filterwarnings("ignore", "dynamo_pgo force disabled")  # the caches being off is the point
    method, dynamic = cfg["method"], cfg["dynamic"]
    set_switches(os.environ.get("E2E_SET", ""))
    snapshot = cuda and cfg.get("snapshot", "")
    if snapshot:  # from before the build, so what a step starts with (the weights among it) has its origin too
        record_memory_history()
    model, full = build(cfg["model"], cfg["tiny"], cfg["layers"], cfg["checkpointing"], method == "liger", device)
    base = dict(model=cfg["model"], family=MODELS[cfg["model"]][0], tiny=int(cfg["tiny"]),
                dtype=str(model.dtype).removeprefix("torch."), layers=model.config.num_hidden_layers,
                full_layers=full, method=method, checkpointing=int(cfg["checkpointing"]), dynamic=int(dynamic),
                packed=cfg["packed"], rows=cfg.get("rows", 1), mask=cfg.get("mask", ""),
                env=cfg.get("env", "") if method == "tilecompile" else "", repeats=cfg["repeats"],
                note=cfg.get("note", ""), **versions(device))  # fmt: skip
    params, rows = matmul_params(model), cfg.get("rows", 1)

    def compiled():
        step = lambda *a: grpo_step(model, *a)  # noqa: E731
        if method == "inductor":
            return torch.compile(step, dynamic=dynamic)
        if method == "tilecompile":
            options = {"inner": cfg["inner"], **({"mlp_min_tokens": 0} if cfg["tiny"] else {})}  # tile tiny MLPs too
            return torch.compile(step, backend="tilecompile", dynamic=dynamic, options=options)
        return step

    def run(step, batch) -> tuple[float, float]:
        _, seconds, loss = timed_step(model, step, batch, cuda)
        return seconds, loss.item()

    step, total, errors = compiled(), 0, {}
    while (n := next_length(cfg["lengths"], errors, cfg.get("search", 0))) is not None:
        row, batch = dict(base, seq_len=n), None
        print(TRY + json.dumps(row), flush=True)
        if not dynamic and method in ("inductor", "tilecompile"):
            torch._dynamo.reset()  # one compile per length, as a static-shape user gets it
            step = compiled()
        tilecompile.reset()
        graphs_before = counters["stats"]["unique_graphs"]
        mark = len(memory_trace()) if snapshot else 0  # an OOM's trace: from this length's start
        try:
            batch = inputs(n, model.config.vocab_size, cfg["packed"], device, rows, cfg.get("mask", ""))
            tokens = real_tokens(rows, n, batch[4])
            flops = model_flops(model.config, params, tokens, attention_pairs(rows, n, batch[3], batch[4]))
            row.update(model_flops=flops, real_tokens=tokens)
            first, _ = run(step, batch)
            graphs = counters["stats"]["unique_graphs"] - graphs_before
            total += graphs
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
                _reset_host_peak()  # pinned host memory: offloaded checkpoints
            times, loss = [], 0.0
            syncs = _host_syncs()
            for i in range(cfg["repeats"]):
                if snapshot and i == cfg["repeats"] - 1:
                    mark = len(memory_trace())
                seconds, loss = run(step, batch)
                times.append(seconds)
            syncs = (_host_syncs() - syncs) / cfg["repeats"]
            if cuda and cfg.get("profile"):
                profile(run, (step, batch), {}, f"{method} at {n} tokens, one step", top=cfg["profile"])
            median = statistics.median(times)
            report = tilecompile.report()
            tflops = flops / median / 1e12
            row.update(ok=1, tok_s=round(n * rows / median, 1), step_s=round(median, 4), first_step_s=round(first, 2),
                       tflops=_sig(tflops), mfu=_sig(tflops / cfg.get("peak_tflops", PEAK_TFLOPS)),
                       compile_s=round(first - median, 2), graphs=graphs, compiles_total=total, loss=loss,
                       host_syncs=syncs,
                       rewrites=" ".join(f"{k}={v}" for k, v in report.counts.items() if v) if report.graphs else "",
                       peak_gib=round(torch.cuda.max_memory_allocated(device) / 2**30, 3) if cuda else "",
                       host_gib=_host_peak_gib() if cuda else "")  # fmt: skip
        except Exception as exc:  # an OOM ends the doubling (next_length: then the search)
            row.update(ok=0, error="OOM" if _is_oom(exc) else f"{type(exc).__name__}: {str(exc)[:300]}")
        if snapshot:
            write_snapshot(snapshot, row, live_at_peak(memory_trace(), mark))
        errors[n] = row.get("error", "")
        print(ROW + json.dumps(row), flush=True)
        del batch
        if cuda:
            torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="1.5b,8b", help="comma-separated: " + ",".join(MODELS))
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated: " + ",".join(METHODS))
    ap.add_argument("--checkpointing", default="on,off", help="activation checkpointing: on,off / on / off")
    ap.add_argument("--lengths", default=",".join(str(4096 << k) for k in range(8)), help="tokens (one row)")
    ap.add_argument("--layers", type=int, default=0, help="cut every model to this many layers (0: all)")
    ap.add_argument("--dynamic", action="store_true", help="compile once with dynamic=True (default: per length)")
    ap.add_argument("--packed", type=int, default=0, help="K documents per row via position_ids (0: one)")
    ap.add_argument("--padded", default="", help="ROWSxLEN: TRL's padded GRPO batch (tokens/s counts every slot)")
    ap.add_argument("--mask", default="", choices=("", "ones"), help="ones: pass an all-ones attention_mask")
    ap.add_argument("--env", default="", help="KEY=VALUE[,KEY=VALUE] for the tilecompile workers (e.g. flags)")
    ap.add_argument("--repeats", type=int, default=3, help="timed steps per length after the first")
    ap.add_argument("--inner", default="inductor", choices=("inductor", "aot_eager", "eager"),
                    help="tilecompile's inner compiler (aot_eager for a fast CPU smoke test)")  # fmt: skip
    ap.add_argument("--warm-cache", action="store_true", help="let Inductor reuse its caches (default: cold)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help=f"tiny models {TINY}, lengths 64,128: a smoke test")
    ap.add_argument("--csv", default="", help="appended to; default: benchmarks/results/e2e.csv (--tiny or a CPU: "
                    "a temp file, anew each run)")  # fmt: skip
    ap.add_argument("--overwrite", action="store_true", help="start the CSV anew instead of appending to it")
    ap.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS, help="MFU's peak (default: H100/H200 bf16)")
    ap.add_argument("--search", type=int, default=0, help="after the first OOM, up to K bisected lengths")
    ap.add_argument("--probe", action="store_true", help="one timed step per length (repeats 1), noted in the row")
    ap.add_argument("--profile", type=int, default=0, help="after the timed steps, the K costliest kernels of one")
    ap.add_argument("--note", default="", help="free text for the rows' note column")
    ap.add_argument("--snapshot", action="store_true", help="what is live at each length's peak, by origin (the "
                    "CUDA allocator's trace of the last timed step, or of a failed attempt), to the CSV's "
                    ".snapshot.jsonl")  # fmt: skip
    ap.add_argument("--budget", type=float, default=0, help="wall seconds for this whole run (0: none): the worker "
                    "running when they are spent is stopped, its length gets a 'cut by --budget' row; the rest is "
                    "skipped")  # fmt: skip
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(json.loads(args.worker))

    lengths = [64, 128] if args.tiny and "--lengths" not in sys.argv else [int(x) for x in args.lengths.split(",")]
    rows_per_batch, mask = 1, args.mask
    if args.padded:
        rows_per_batch, length = (int(x) for x in args.padded.split("x"))
        lengths, mask = [length], "trl"
    methods = args.methods.split(",")
    if "liger" in methods:
        try:
            import liger_kernel  # noqa: F401
        except ImportError:
            print("liger_kernel is not installed: no liger rows", flush=True)
            methods.remove("liger")
    smoke = args.tiny or not args.device.startswith("cuda")
    out = pathlib.Path(args.csv or (pathlib.Path(tempfile.gettempdir()) / "e2e_tiny.csv" if smoke else
                                    pathlib.Path(__file__).parent / "results" / "e2e.csv"))  # fmt: skip
    if (args.overwrite or (smoke and not args.csv)) and out.exists():
        out.unlink()
    note = "; ".join(x for x in ("single-step probe" if args.probe else "", args.note) if x)
    print(json.dumps(versions(torch.device(args.device))), flush=True)
    rows, deadline = [], time.monotonic() + args.budget if args.budget > 0 else None
    if deadline is not None:  # workers run in groups of their own then: a SIGTERM here ends them through an exit
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    for name in args.models.split(","):
        full = full_layers(name, args.tiny)
        cut = f"cut to {args.layers} of {full} layers" if args.layers and args.layers < full else f"all {full} layers"
        print(f"== {name} ({MODELS[name][0]}{', tiny' if args.tiny else ''}): {cut}", flush=True)
        for method in methods:
            for ckpt in args.checkpointing.split(","):
                cfg = dict(model=name, method=method, checkpointing=ckpt == "on", lengths=lengths, tiny=args.tiny,
                           layers=args.layers, dynamic=args.dynamic, packed=args.packed,
                           repeats=1 if args.probe else args.repeats, inner=args.inner, warm_cache=args.warm_cache,
                           device=args.device, rows=rows_per_batch, mask=mask, env=args.env, search=args.search,
                           peak_tflops=args.peak_tflops, note=note, profile=args.profile,
                           snapshot=str(out.with_suffix(".snapshot.jsonl")) if args.snapshot else "")  # fmt: skip
                if deadline is not None and time.monotonic() >= deadline:
                    print(
                        f"{method:<12} ckpt={int(ckpt == 'on')} skipped: --budget {args.budget:g} s spent", flush=True
                    )
                    continue
                rows += run_worker(cfg, out, deadline)
    summary(rows)
    print(f"wrote {out}")


def run_worker(cfg: dict, out: pathlib.Path, deadline: float | None = None) -> list[dict]:
    """Runs one worker; each of its rows is printed and appended to ``out`` as it comes. With a ``deadline``
    (``time.monotonic()``) the worker runs in a process group of its own, stopped whole (Inductor's compile workers
    too) at the deadline, when the length it was on gets a row saying so, or when this process ends first (an
    exception, Ctrl-C, SIGTERM: ``main`` makes that an exit; no row then). Without a deadline it stays in this
    process's group, so an outer ``timeout`` or Ctrl-C reaches it."""
    cmd = [sys.executable, __file__, "--worker", json.dumps(cfg)]
    extra = dict(kv.split("=", 1) for kv in cfg.get("env", "").split(",") if kv)
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(extra if cfg["method"] == "tilecompile" else {}))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, start_new_session=deadline is not None)
    cut = threading.Event()

    def stop() -> None:
        cut.set()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    timer = None
    if deadline is not None:
        timer = threading.Timer(max(0.0, deadline - time.monotonic()), stop)
        timer.daemon = True
        timer.start()
    given = ("model", "method", "packed", "rows", "mask", "repeats", "note")  # until the worker says more
    layers = cfg["layers"] or full_layers(cfg["model"], cfg["tiny"])  # as build() cuts the model
    env_row = cfg.get("env", "") if cfg["method"] == "tilecompile" else ""
    rows, trying = [], dict({k: cfg[k] for k in given}, checkpointing=int(cfg["checkpointing"]), layers=layers,
                            dynamic=int(cfg["dynamic"]), seq_len=cfg["lengths"][0], date=_now(), tiny=int(cfg["tiny"]),
                            env=env_row)  # fmt: skip

    def add(row: dict) -> None:
        rows.append(row)
        write_rows(out, [row], FIELDS, append=True)
        keys = ("seq_len", "ok", "error", "tok_s", "tflops", "peak_gib", "first_step_s", "graphs", "rewrites",
                "host_syncs")  # fmt: skip
        shown = " ".join(f"{k}={row[k]}" for k in keys if row.get(k) not in (None, ""))
        print(f"{row['method']:<12} ckpt={row['checkpointing']} {shown}", flush=True)

    try:
        for line in proc.stdout:
            if line.startswith(TRY):
                trying = json.loads(line[len(TRY) :])
            elif line.startswith(ROW):
                add(json.loads(line[len(ROW) :]))
            else:
                print(line, end="")
        code = proc.wait()
    finally:
        if timer is not None:
            timer.cancel()
            if proc.poll() is None:  # this process is ending first: its worker's group goes with it
                stop()
                proc.wait()
    if code != 0 and trying["seq_len"] not in {r["seq_len"] for r in rows}:  # died without a word
        add(dict(trying, ok=0, error="cut by --budget" if cut.is_set() else f"worker exited with {code}"))
    return rows


def summary(rows: list[dict]) -> None:
    """Per (model, method, checkpointing): the longest length that ran, the first length's first step (its compile
    included), compiles, and the shortest longer length's failure."""
    print(f"\n{'model':<6} {'method':<12} {'ckpt':<4} {'longest':>8} {'first step s':>12} {'compiles':>8}  stopped by")
    keys = dict.fromkeys((r["model"], r["method"], r["checkpointing"]) for r in rows)
    for model, method, ckpt in keys:
        mine = [r for r in rows if (r["model"], r["method"], r["checkpointing"]) == (model, method, ckpt)]
        ok = [r for r in mine if r["ok"]]
        longest = max((r["seq_len"] for r in ok), default=0)
        above = sorted((r["seq_len"], r["error"]) for r in mine if not r["ok"] and r["seq_len"] > longest)
        failed = f"{above[0][1]} at {above[0][0]}" if above else ""
        first = ok[0]["first_step_s"] if ok else ""
        compiles = sum(r.get("graphs", 0) or 0 for r in ok)
        print(f"{model:<6} {method:<12} {'on' if ckpt else 'off':<4} {longest:>8} {first:>12} {compiles:>8}  {failed}")


if __name__ == "__main__":
    main()
