"""Where the first step's compile time goes: tilecompile against plain Inductor / aot_eager, static against dynamic.

The step is benchmarks/e2e.py's (the HF model built there, activation checkpointing on, its GRPO-style loss, one
fwd+bwd). Each variant runs in its own process (a cold start: Inductor's caches off, Dynamo fresh) and is timed over
its first step (compilation included), then once more at a second length under dynamic=True (a recompile would
show there). Variants: ``<compiler>:<static|dynamic>`` with compiler ``tilecompile`` (our passes, then
``--inner``), ``inductor`` or ``aot_eager`` (the floor: the same step without our passes);
``tilecompile:dynamic:restart`` is the backend without its float specialization (tilecompile/backend.py,
``specialize_untensorifiable_floats``): Dynamo's restart, as before, to measure what that saves. Under
dynamic=True the Inductor variants turn off mix-order reduction, as the backend does (``dynamic_workarounds``).

Columns (seconds of wall time, or of this process's CPU time with ``--clock cpu``; phases summed over every call,
restarts included):
  first      the first step, fwd+bwd, compile included (cpu: its process CPU time, whatever the clock)
  attempts   backend calls for the step's frames; restarts = attempts - graphs (Dynamo traced the frame again)
  dynamo     Dynamo's bytecode tracing (``bytecode_tracing``)
  passes     tilecompile's passes (tilecompile/pipeline.py TIMES; per pass in the JSON), undo snapshots included
  aot        AOTAutograd: metadata collection + joint-graph trace (``aot_collect_metadata``, ``aot_trace_joint_graph``)
  partition  the joint graph's passes and the fw/bw partitioner
  inductor   Inductor's compile of the fw and bw graphs (``compile_fx_inner``), codegen and kernel compiles included
  kwait      of which waiting for kernel compiles / autotuning (``async_compile.wait``)
  loss_grad  the loss-aware lm_head's per-token gradient, compiled by its own torch.compile at run time
  guards     shape-env guards added inside the backend (our passes, AOTAutograd, Inductor), all calls together
  evals      symbolic evaluations (ShapeEnv.evaluate_expr) during Dynamo's tracing / our passes / the rest
  next       the step at the second length (dynamic only) and how many frames it compiled

usage (GPU, the 1.5B step at 16k, the issue 26 table; under 8 minutes on an H200: two variants at a time, the
two of the acceptance ratio, tilecompile dynamic and Inductor static, side by side; --budget cuts what is left):
  python3 benchmarks/compile_time.py --jobs 2 --out benchmarks/results/compile_time.md
usage (CPU, the same module graph at tiny widths, aot_eager as the inner compiler):
  python benchmarks/compile_time.py --device cpu --tiny --inner aot_eager --lengths 64,96 --clock cpu --out /tmp/ct.md
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import subprocess
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import e2e  # noqa: E402

ROW = "ROW "
# side by side in pairs (--jobs 2): the two of the issue 26 ratio together, then the other two
DEFAULT_VARIANTS = "tilecompile:dynamic,inductor:static,tilecompile:static,inductor:dynamic"
RATIOS = (  # (ours, the floor) of the first step, printed under the table when both ran
    ("tilecompile:dynamic", "inductor:static"),
    ("tilecompile:dynamic", "inductor:dynamic"),
    ("tilecompile:static", "inductor:static"),
    ("tilecompile:dynamic", "tilecompile:dynamic:restart"),
    ("tilecompile:dynamic", "aot_eager:dynamic"),
    ("tilecompile:static", "aot_eager:static"),
)
PHASES = {  # column -> Dynamo's timer names (torch._dynamo.utils.compilation_time_metrics)
    "dynamo": ("bytecode_tracing",),
    "aot": ("aot_collect_metadata", "aot_trace_joint_graph"),
    "partition": ("_recursive_joint_graph_passes", "min_cut_rematerialization_partition", "default_partition"),
    "inductor": ("compile_fx_inner",),
    "kwait": ("async_compile.wait",),
}


class _Evals:
    """Counts ShapeEnv.evaluate_expr calls (outermost only) by the phase the benchmark is in."""

    phase = "dynamo"
    counts: dict[str, int] = {}
    depth = 0

    @classmethod
    def install(cls) -> None:
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        orig = ShapeEnv.evaluate_expr

        def evaluate_expr(self, *args, **kwargs):
            if cls.depth == 0:
                cls.counts[cls.phase] = cls.counts.get(cls.phase, 0) + 1
            cls.depth += 1
            try:
                return orig(self, *args, **kwargs)
            finally:
                cls.depth -= 1

        ShapeEnv.evaluate_expr = evaluate_expr

    @classmethod
    @contextlib.contextmanager
    def during(cls, phase: str):
        before, cls.phase = cls.phase, phase
        try:
            yield
        finally:
            cls.phase = before


def _metrics_marks() -> dict[str, int]:
    from torch._dynamo.utils import compilation_time_metrics

    return {k: len(v) for k, v in compilation_time_metrics.items()}


def _metrics_since(marks: dict[str, int], until: dict[str, int] | None = None) -> dict[str, float]:
    from torch._dynamo.utils import compilation_time_metrics

    out = {}
    for k, v in compilation_time_metrics.items():
        end = len(v) if until is None else until.get(k, 0)
        out[k] = sum(v[marks.get(k, 0) : end])
    return out


class _CpuClock:
    """``time`` for torch._dynamo.utils with ``time_ns`` reading this process's CPU time: Dynamo's phase timers
    then count CPU seconds (``--clock cpu``: a shared machine, where wall time measures the neighbours)."""

    def __getattr__(self, name: str):
        return getattr(time, name)

    @staticmethod
    def time_ns() -> int:
        return time.process_time_ns()


def worker(cfg: dict) -> None:
    import torch._dynamo.utils as dynamo_utils
    from torch._dynamo.utils import counters

    if cfg["clock"] == "cpu":
        dynamo_utils.time = _CpuClock()

    import tilecompile
    from tilecompile import backend as TB
    from tilecompile import pipeline
    from tilecompile.ops import fused_linear_ce as FLCE

    compiler, shapes, *how = cfg["variant"].split(":")
    dynamic = shapes == "dynamic"
    if how == ["restart"]:  # as before the backend specialized floats itself: Dynamo restarts for them
        TB.specialize_untensorifiable_floats = lambda gm: []
    device = torch.device(cfg["device"])
    torch._inductor.config.force_disable_caches = True
    _Evals.install()
    clock = time.process_time if cfg["clock"] == "cpu" else time.perf_counter
    model, _ = e2e.build(cfg["model"], cfg["tiny"], cfg["layers"], True, False, device)

    # the loss-aware gradient's own compile: its Dynamo/AOT/Inductor timers are taken out of the step's
    loss_grad = {"s": 0.0, "compiles": 0, "marks": []}
    orig_grads = FLCE._compiled_grads

    def compiled_grads(fn, key, with_entropy, backend):
        run = orig_grads(fn, key, with_entropy, backend)
        k = (key, with_entropy, backend)

        def timed(*a):
            if k in FLCE._COMPILED:
                return run(*a)
            start, marks = clock(), _metrics_marks()
            try:
                return run(*a)
            finally:
                loss_grad["s"] += clock() - start
                loss_grad["compiles"] += 1
                loss_grad["marks"].append((marks, _metrics_marks()))

        return timed

    FLCE._compiled_grads = compiled_grads

    calls = []

    def measured(gm, example_inputs):
        fake = torch._guards.detect_fake_mode(example_inputs)
        env = getattr(fake, "shape_env", None)
        guards = len(env.guards) if env is not None else 0
        start = clock()
        try:
            with _Evals.during("backend"):
                if compiler == "tilecompile":
                    options = {"inner": cfg["inner"], **cfg["options"]}
                    if cfg["tiny"]:
                        options.setdefault("mlp_min_tokens", 0)
                    return TB.tilecompile_backend(gm, example_inputs, options=options)
                if compiler == "inductor":
                    from torch._inductor.compile_fx import compile_fx

                    return compile_fx(gm, example_inputs, config_patches=TB.dynamic_workarounds(example_inputs, {}))
                from torch._dynamo.backends.debugging import aot_eager

                return aot_eager(gm, example_inputs)
        finally:
            added = (len(env.guards) - guards) if env is not None else 0
            calls.append(dict(s=clock() - start, guards=added))

    orig_run_passes = TB.run_passes

    def run_passes(*a, **k):
        with _Evals.during("passes"):
            return orig_run_passes(*a, **k)

    TB.run_passes = run_passes

    def step_fn(*a):
        return e2e.grpo_step(model, *a)

    step = torch.compile(step_fn, backend=measured, dynamic=dynamic)

    def run(n: int) -> tuple[float, float]:
        batch = e2e.inputs(n, model.config.vocab_size, 0, device)
        for p in model.parameters():
            p.grad = None
        wall, cpu = time.perf_counter(), time.process_time()
        step(*batch).backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        return (cpu if cfg["clock"] == "cpu" else wall), cpu

    lengths = cfg["lengths"] if dynamic else cfg["lengths"][:1]
    row = dict(variant=cfg["variant"], model=cfg["model"], tiny=int(cfg["tiny"]), layers=model.config.num_hidden_layers,
               seq_len=lengths[0], inner=cfg["inner"] if compiler == "tilecompile" else compiler,
               device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               torch=torch.__version__)  # fmt: skip
    tilecompile.reset()
    pipeline.reset_times()
    marks = _metrics_marks()
    first, cpu = run(lengths[0])
    frames = counters["frames"]["ok"]
    metrics = _metrics_since(marks)
    for before, after in loss_grad["marks"]:  # the nested compile's own timers
        for k, v in _metrics_since(before, after).items():
            metrics[k] -= v
    graphs = tilecompile.report().graphs if compiler == "tilecompile" else frames - loss_grad["compiles"]
    row.update(
        first=round(first, 2), cpu=round(cpu, 2), attempts=len(calls), graphs=graphs,
        restarts=len(calls) - graphs, frames=frames,
        passes=round(sum(t.cpu_s if cfg["clock"] == "cpu" else t.wall_s
                         for n, t in pipeline.TIMES.items() if n in pipeline.PASS_ORDER), 2),
        pass_times={n: [t.runs, round(t.wall_s, 3), round(t.cpu_s, 3)] for n, t in pipeline.TIMES.items()},
        loss_grad=round(loss_grad["s"], 2), loss_grad_compiles=loss_grad["compiles"],
        guards=sum(c["guards"] for c in calls), evals=dict(_Evals.counts),
        backend_calls=[round(c["s"], 2) for c in calls],
    )  # fmt: skip
    for column, names in PHASES.items():
        row[column] = round(sum(metrics.get(n, 0.0) for n in names), 2)
    row["timers"] = {k: round(v, 2) for k, v in sorted(metrics.items(), key=lambda kv: -kv[1]) if v >= 0.05}
    if dynamic and len(lengths) > 1:
        next_s, next_cpu = run(lengths[1])
        row.update(next_len=lengths[1], next=round(next_s, 2), next_cpu=round(next_cpu, 2),
                   next_frames=counters["frames"]["ok"] - frames)  # fmt: skip
    print(ROW + json.dumps(row), flush=True)


def table(rows: list[dict]) -> str:
    cols = ["variant", "first", "cpu", "attempts", "restarts", "dynamo", "passes", "aot", "partition", "inductor",
            "kwait", "loss_grad", "guards", "evals", "next"]  # fmt: skip

    def cell(r: dict, c: str) -> str:
        if c == "evals":
            e = r.get("evals", {})
            return "/".join(str(e.get(k, 0)) for k in ("dynamo", "passes", "backend"))
        if c == "next" and "next" in r:
            return f"{r['next']} ({r['next_frames']} compiled)"
        return str(r.get(c, ""))

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(cell(r, c) for c in cols) + " |")
    first = {r["variant"]: r["first"] for r in rows if "first" in r}
    for ours, floor in RATIOS:
        if ours in first and floor in first and first[floor]:
            lines.append(f"\n{ours} / {floor}, first step: {first[ours] / first[floor]:.2f}x")
    return "\n".join(lines)


def _collect(variant: str, proc: subprocess.Popen, timeout: int) -> dict:
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return dict(variant=variant, error="over the --budget")
    found = [json.loads(line[len(ROW) :]) for line in stdout.splitlines() if line.startswith(ROW)]
    return found[0] if found else dict(variant=variant, error=" ".join(stderr.strip().splitlines()[-1:]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="", help="Markdown table (and the rows as JSON lines beside it, .jsonl)")
    ap.add_argument("--variants", default=DEFAULT_VARIANTS, help="comma-separated compiler:static|dynamic")
    ap.add_argument("--model", default="1.5b", choices=tuple(e2e.MODELS))
    ap.add_argument("--layers", type=int, default=0, help="0: all of the model's layers (28 for 1.5b)")
    ap.add_argument("--tiny", action="store_true", help="the model's module graph at e2e.py's tiny widths")
    ap.add_argument("--lengths", default="16384,8192", help="first length (every variant), second (dynamic only)")
    ap.add_argument("--inner", default="inductor", choices=("inductor", "aot_eager", "eager"))
    ap.add_argument("--options", default="", help="KEY=VALUE[,KEY=VALUE] tilecompile options (e.g. ce_loss_aware=0)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--budget", type=int, default=450, help="seconds for all variants; one still running is cut")
    ap.add_argument("--clock", default="wall", choices=("wall", "cpu"), help="cpu: process CPU s (shared machines)")
    ap.add_argument("--jobs", type=int, default=1, help="variants run side by side (1: one after the other)")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(json.loads(args.worker))
    if not args.out:
        ap.error("--out PATH is required")
    layers = args.layers or e2e.MODELS[args.model][3]
    options = dict(kv.split("=", 1) for kv in args.options.split(",") if kv)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows, started = [], time.perf_counter()
    variants = args.variants.split(",")
    procs = {}
    for variant in variants:
        cfg = dict(variant=variant, model=args.model, tiny=args.tiny, layers=layers, inner=args.inner,
                   options=options, device=args.device, clock=args.clock,
                   lengths=[int(x) for x in args.lengths.split(",")])  # fmt: skip
        cmd = [sys.executable, __file__, "--worker", json.dumps(cfg)]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        procs[variant] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        if len(procs) >= args.jobs or variant == variants[-1]:  # a batch of --jobs variants runs side by side
            for name, proc in procs.items():
                left = args.budget - (time.perf_counter() - started)
                rows.append(_collect(name, proc, max(1, int(left))))
                print(json.dumps(rows[-1]), flush=True)
            procs = {}
            text = table(rows)
            when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
            tiny = ", tiny" if args.tiny else ""
            head = f"{args.model}, {layers} layers{tiny}, lengths {args.lengths}, inner {args.inner}"
            head += f", jobs {args.jobs}, {args.clock} seconds"
            out.write_text(f"{head}, {when}\n\n{text}\n")
            out.with_suffix(".jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(text)
    print(f"wrote {out} ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
