"""Probe: is a compiled step bound by the host (Python, launches) or by the GPU, static against dynamic shapes?

e2e.py's GRPO step (Qwen2.5-1.5B shape cut to ``--layers``, activation checkpointing), per variant and length: the
median of ``--repeats`` steps of wall time (``step_s``, to a synchronize) and of host time (``host_s``: until
``backward()`` returns, before the synchronize; the host has then enqueued everything), then one step under
``torch.profiler``: the GPU's busy time (the sum of kernel times), kernel launches, and the ops with the most host
time. ``host_s`` close to ``step_s`` with ``gpu_s`` well under it means the step waits on the host.

usage: python benchmarks/probe_host.py [--layers 4] [--lengths 8192,16384]
           [--variants tilecompile:static,tilecompile:dynamic,inductor:static] [--rows 15]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from e2e import build, grpo_step, inputs, timed_step  # this script's folder is on sys.path
from torch.profiler import ProfilerActivity, profile

import tilecompile  # noqa: F401  (registers the backend)

_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--lengths", default="8192,16384")
    ap.add_argument("--variants", default="tilecompile:static,tilecompile:dynamic,inductor:static")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rows", type=int, default=15, help="host ops shown per profile")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="e2e.py's tiny model (a CPU smoke test)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    model, _ = build("1.5b", args.tiny, args.layers, True, False, dev)
    for variant in args.variants.split(","):
        backend, shapes = variant.split(":")
        dynamic = shapes == "dynamic"
        step = None
        for n in (int(x) for x in args.lengths.split(",")):
            if step is None or not dynamic:  # static: one compile per length
                torch._dynamo.reset()
                step = torch.compile(lambda *a: grpo_step(model, *a), backend=backend, dynamic=dynamic)
            batch = inputs(n, model.config.vocab_size, 0, dev)
            for _ in range(3):  # the compile, then warm-up
                timed_step(model, step, batch, cuda)
            hosts, walls, _ = zip(*(timed_step(model, step, batch, cuda) for _ in range(args.repeats)))
            with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
                timed_step(model, step, batch, cuda)
            events = prof.key_averages()
            gpu = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
            row = dict(variant=variant, layers=args.layers, n=n, step_s=round(statistics.median(walls), 4),
                       host_s=round(statistics.median(hosts), 4), gpu_s=round(gpu / 1e6, 4),
                       launches=sum(e.count for e in events if e.key in _LAUNCHES))  # fmt: skip
            print("ROW " + json.dumps(row), flush=True)
            print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
