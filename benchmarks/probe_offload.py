"""Offloaded checkpointed inputs on a GPU (issue 43): the same checkpointed step with every layer's input offloaded
(``offload=all``, in layer regions as by default, or flat) and with every layer checkpointed on the device
(``memory_budget=0``, no offload, with layer regions and without them), compiled with tilecompile (Inductor): loss
and gradients against the offloaded step's, peak GPU memory, the pool's pinned host bytes (against the inputs'
exact bytes), step time and the report's plan lines. A small Qwen2 (4 layers, hidden 1024, bf16 weights) at
``--tokens`` tokens, one row each.

``--snapshot``: the whole run, from the model's build, runs under the CUDA allocator's memory history; each row then
also has ``at_peak``: the allocations live when the last repeat starts (``at_start``: the weights, the grads, and
whatever a step keeps for the next one) and at that step's peak of allocated bytes (``by_origin``), each grouped by
the line that made them (the innermost frame outside torch's own Python files, with its source text, so Inductor's
generated ``call`` shows its buffer), largest first. ``repeats_start_peak_gib``: per repeat, the bytes allocated at
its start and its peak.

usage: python benchmarks/probe_offload.py [--tokens 16384] [--layers 4] [--repeats 3] [--variants regions,offload]
                                          [--snapshot]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import transformers
from e2e import live_at_peak, memory_trace, record_memory_history

import tilecompile


def build(layers: int) -> torch.nn.Module:
    cfg = transformers.Qwen2Config(vocab_size=32000, hidden_size=1024, intermediate_size=4096,
                                   num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2,
                                   attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg).to("cuda", torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model.train()


def step(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits[:, :-1].float()
    return -torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).mean()


def run(options: dict, args: argparse.Namespace, ids: torch.Tensor) -> dict:
    from tilecompile.ops import offload

    tilecompile.reset()
    torch._dynamo.reset()
    if args.snapshot:  # from before the model is built, so what a step starts with has its origin too
        record_memory_history()
    model = build(args.layers)
    f = torch.compile(step, backend="tilecompile", options=options)
    loss = f(model, ids)
    loss.backward()
    # on the host: a variant run later must not start with this one's grads on the GPU (before 2026-12-07 they stayed,
    # and each later variant's peak read 0.47 GiB higher per variant before it)
    grads = {n: p.grad.float().cpu() for n, p in model.named_parameters()}
    times, repeats, mark = [], [], 0
    for r in range(args.repeats):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        if args.snapshot and r == args.repeats - 1:
            mark = len(memory_trace())
        t = time.perf_counter()
        f(model, ids).backward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        repeats.append([round(start / 2**30, 3), round(torch.cuda.max_memory_allocated() / 2**30, 3)])
    at_peak = None
    if args.snapshot:
        at_peak = live_at_peak(memory_trace(), mark)
        torch.cuda.memory._record_memory_history(enabled=None)
    host = offload.host_stats()
    report = tilecompile.report()
    plan = [r.detail[:120] for r in report.rewrites if r.pass_name == "memory_plan"][:2]
    plan += [s.reason[:160] for s in report.skipped if s.pass_name == "memory_plan"][:2]
    exact = args.layers * ids.numel() * model.config.hidden_size * 2  # the layers' bf16 inputs
    return {"options": options, "loss": loss.item(), "grads": grads, "step_s": min(times),
            "peak_gib": max(p for _, p in repeats), "repeats_start_peak_gib": repeats, "host_peak_bytes": host["peak"],
            "host_held_bytes": host["held"], "inputs_bytes": exact if options.get("offload") == "all" else 0,
            "plan": plan, **({"at_peak": at_peak} if at_peak is not None else {})}  # fmt: skip


# Inductor's reorder_for_peak_memory is on by default for graphs without regions (the backend turns it off for graphs
# with regions); the *_noreorder variants turn it off for the flat and the offloaded step. Offloaded layers share the
# layer regions since 2026-12-06 ("offload"); "offload_flat" is the offloaded step as it was before
VARIANTS = {
    "regions": {"memory_budget": 0.0},
    # the plan on (a budget of a thousandth of the device: nothing kept, offload off): the device plan the offload's
    # own compile is like, less the offload
    "plan_device": {"memory_budget": 0.001},
    "flat": {"memory_budget": 0.0, "layer_regions": False},
    "offload": {"offload": "all"},
    "offload_flat": {"offload": "all", "layer_regions": False},
    "flat_noreorder": {"memory_budget": 0.0, "layer_regions": False, "reorder_for_peak_memory": False},
    "offload_noreorder": {"offload": "all", "reorder_for_peak_memory": False},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variants", default="regions,flat,offload", help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--snapshot", action="store_true", help="what is live at the last step's peak, by origin")
    args = ap.parse_args()
    torch.manual_seed(1)
    ids = torch.randint(0, 32000, (1, args.tokens), device="cuda")
    names = args.variants.split(",")
    rows = [run(VARIANTS[name], args, ids) for name in names]
    offloaded = rows[names.index("offload")] if "offload" in names else rows[-1]
    for row in rows:  # each against the offloaded step (the device plan of the same compile is the like-for-like one)
        if row is offloaded:
            continue
        worst = max((row["grads"][n] - offloaded["grads"][n]).abs().max().item() for n in row["grads"])
        row["offload_max_grad_diff"], row["offload_loss_diff"] = worst, offloaded["loss"] - row["loss"]
    for row in rows:
        row.pop("grads")
        print(json.dumps(row), flush=True)
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": args.tokens,
                      "layers": args.layers}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
