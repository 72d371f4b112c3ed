"""Plot benchmarks/e2e.py's CSV: peak memory and tokens/s against sequence length, one line per method.

One row of panels per model (and per static/dynamic compile when the CSV has both); colour is the method, a solid
line has activation checkpointing on, a dashed one off. A line ends at the method's longest sequence; the legend
gives that length and what stopped it (OOM or an error). The title carries the GPU, versions and date from the CSV.

usage: python benchmarks/plot_e2e.py [benchmarks/results/e2e.csv] [--out PNG]   (needs matplotlib)
"""

from __future__ import annotations

import argparse
import csv
import pathlib

SHAPES = {"1.5b": "Qwen2.5-1.5B shape", "8b": "Llama-3-8B shape"}
COLORS = {"eager": "tab:gray", "inductor": "tab:blue", "liger": "tab:orange", "tilecompile": "tab:green"}


def _tokens(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _float(x: str) -> float | None:
    return float(x) if x not in ("", None) else None


def plot(rows: list[dict], out: pathlib.Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit("plot_e2e.py needs matplotlib: pip install matplotlib") from exc

    panels = sorted({(r["model"], r["dynamic"]) for r in rows}, key=lambda k: (list(SHAPES).index(k[0]), k[1]))
    fig, axes = plt.subplots(len(panels), 2, figsize=(13, 4.2 * len(panels)), squeeze=False)
    for (model, dynamic), (ax_mem, ax_tok) in zip(panels, axes):
        mine = [r for r in rows if (r["model"], r["dynamic"]) == (model, dynamic)]
        first = mine[0]
        depth = f"{first['layers']} of {first['full_layers']} layers" if first.get("layers") else ""
        compile_kind = "one dynamic compile" if dynamic == "1" else "static compile per length"
        shape = SHAPES.get(model, model) if first.get("tiny") != "1" else f"tiny stand-in for {model}"
        title = f"{shape} ({depth}), {compile_kind}"
        order = list(COLORS)
        lines = sorted({(r["method"], r["checkpointing"]) for r in mine}, key=lambda k: (order.index(k[0]), k[1]))
        for method, ckpt in lines:
            runs = sorted((r for r in mine if (r["method"], r["checkpointing"]) == (method, ckpt)),
                          key=lambda r: int(r["seq_len"] or 0))  # fmt: skip
            ok = [r for r in runs if r["ok"] == "1"]
            stop = next((r["error"] for r in runs if r["ok"] != "1"), "")
            longest = _tokens(max(int(r["seq_len"]) for r in ok)) if ok else "none"
            then = f", then {stop[:20]}" if stop else ""
            label = f"{method}, ckpt {'on' if ckpt == '1' else 'off'} (longest {longest}{then})"
            style = dict(color=COLORS.get(method), linestyle="-" if ckpt == "1" else "--", marker="o", label=label)
            xs = [int(r["seq_len"]) for r in ok]
            mem = [_float(r["peak_gib"]) for r in ok]
            if any(m is not None for m in mem):
                ax_mem.plot(xs, mem, **style)
            ax_tok.plot(xs, [_float(r["tok_s"]) for r in ok], **style)
        for ax, ylabel in ((ax_mem, "peak memory (GiB, max_memory_allocated)"), (ax_tok, "tokens/s")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("sequence length (tokens, one row)")
            ax.set_ylabel(ylabel)
            ax.set_title(title, fontsize=10)
            ax.grid(True, alpha=0.3)
            ticks = sorted({int(r["seq_len"]) for r in mine if r["seq_len"]})
            ax.set_xticks(ticks, [_tokens(t) for t in ticks])
        if not ax_mem.lines:
            ax_mem.text(0.5, 0.5, "peak memory not measured (CPU)", ha="center", transform=ax_mem.transAxes)
        ax_tok.legend(fontsize=7)
    env = rows[0]
    fig.suptitle(
        f"One GRPO training step (fwd + bwd), {env.get('dtype') or 'bf16'}, random init — {env['device']}, "
        f"torch {env['torch']}, triton {env['triton'] or '-'}, transformers {env['transformers']}, {env['date']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", nargs="?", default=str(pathlib.Path(__file__).parent / "results" / "e2e.csv"))
    ap.add_argument("--out", default="", help="PNG path (default: the CSV's path with .png)")
    args = ap.parse_args()
    with open(args.csv, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["seq_len"]]
    if not rows:
        raise SystemExit(f"{args.csv} has no rows")
    plot(rows, pathlib.Path(args.out or pathlib.Path(args.csv).with_suffix(".png")))


if __name__ == "__main__":
    main()
