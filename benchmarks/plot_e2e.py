"""Plot benchmarks/e2e.py's CSV: peak memory and tokens/s against sequence length, one line per method.

One row of panels per model (and per static/dynamic compile, and per batch layout, when the CSV has several), log
axes; a batch layout measured at one length only is left to the table (a panel of one dot says nothing); colour is
the method, a solid line has activation checkpointing on, a dashed one off; a run with flags (``--env``) is a line
of its own, with hollow markers. A line ends at the method's longest sequence; the legend gives that length and what
stopped it (OOM or an error), or that nothing did. The title carries the GPUs, versions and dates from the CSV. The
CSV is read as e2e.py appends it: where a (model, method, checkpointing, dynamic, rows, mask, packed, seq_len) was
measured more than once (with the same tiny, layers and env: a cut model or a flag's run is another measurement),
the latest date's row counts; older rows' missing columns read as their defaults. A row whose note starts with
``withdrawn:`` (a measurement found wrong after the fact: the note says why) stays in the CSV and is left out of the
plot and the table.

``--table`` prints the Markdown of benchmarks/RESULTS.md's whole-model table instead: a line per (model, method,
checkpointing, compile, batch, length) with tokens/s, peak GiB, TFLOP/s, MFU %, first step s, compiles and note (the
env flags first); padded batches (rows > 1 or TRL's mask) in a table of their own, each table under a line of its
GPUs, versions and dates.

usage: python benchmarks/plot_e2e.py [benchmarks/results/e2e.csv] [--out PNG] [--table]   (the PNG needs matplotlib)
"""

from __future__ import annotations

import argparse
import csv
import pathlib

SHAPES = {"1.5b": "Qwen2.5-1.5B shape", "8b": "Llama-3-8B shape"}
COLORS = {"eager": "tab:gray", "inductor": "tab:blue", "liger": "tab:orange", "tilecompile": "tab:green"}
# eager's hollow square is drawn larger: Liger's memory is eager's, and its line would hide eager's otherwise
MARKERS = {"eager": dict(marker="s", markersize=9, fillstyle="none"), "inductor": dict(marker="^"),
           "liger": dict(marker="D", markersize=5), "tilecompile": dict(marker="o")}  # fmt: skip
KEY = ("model", "tiny", "layers", "env", "method", "checkpointing", "dynamic", "rows", "mask", "packed", "seq_len")
WITHDRAWN = "withdrawn:"  # a note's prefix: the row is kept in the CSV, out of the plot and the table
DEFAULTS = {"rows": "1", "packed": "0", "dynamic": "0"}  # what older CSVs without these columns measured
COLUMNS = ("model", "method", "ckpt", "compile", "batch", "length", "tokens/s", "peak GiB", "TFLOP/s", "MFU %",
           "first step s", "compiles", "note")  # fmt: skip


def _tokens(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _float(x: str) -> float | None:
    return float(x) if x not in ("", None) else None


def latest(rows: list[dict]) -> list[dict]:
    """One row per ``KEY``: the latest date's (the later in the file on a tie), withdrawn rows left out; every cell a
    string, '' if missing."""
    best = {}
    for r in rows:
        r = {k: v or "" for k, v in r.items() if k}
        if r.get("note", "").startswith(WITHDRAWN):
            continue
        r.update({k: r.get(k) or v for k, v in DEFAULTS.items()})
        key = tuple(r.get(k, "") for k in KEY)
        if key not in best or r.get("date", "") >= best[key].get("date", ""):
            best[key] = r
    return list(best.values())


def read(path: str) -> list[dict]:
    with open(path, newline="") as f:
        return latest([r for r in csv.DictReader(f) if r.get("seq_len")])


def _padded(r: dict) -> bool:
    return r["rows"] != "1" or r.get("mask") == "trl"


def _layout(r: dict) -> str:
    """The batch beside its length: rows, documents, the attention_mask."""
    mask = {"trl": "TRL-padded", "ones": "all-ones mask"}.get(r.get("mask", ""), r.get("mask", ""))
    parts = (f"{r['rows']} rows" if r["rows"] != "1" else "", f"{r['packed']} documents" if r["packed"] != "0" else "")
    return ", ".join(p for p in (*parts, mask) if p) or "one row"


def _env(rows: list[dict]) -> str:
    """The GPUs, versions and days the rows were measured on."""

    def each(k: str) -> str:
        return ", ".join(sorted({r.get(k, "") for r in rows} - {""})) or "-"

    return (f"{each('device')}; torch {each('torch')}, triton {each('triton')}, transformers {each('transformers')}; "
            f"{', '.join(sorted({r.get('date', '')[:10] for r in rows} - {''})) or 'undated'}")  # fmt: skip


def _rank(x: str, known) -> tuple:
    """Where ``x`` stands among ``known`` (unknown ones after, by name)."""
    return (list(known).index(x) if x in known else len(known), x)


def _order(r: dict) -> tuple:
    """Model, batch (one row first), compile, method, checkpointing on first, length."""
    batch = (_padded(r), _layout(r) != "one row", _layout(r))
    model = (_rank(r["model"], SHAPES), r.get("tiny", ""), _int(r.get("layers")))
    return (*model, *batch, r["dynamic"], _rank(r["method"], COLORS), r["checkpointing"] != "1", _int(r["seq_len"]))


def _int(x: str | None) -> int:
    return int(x) if x else 0


def _cells(r: dict) -> list[str]:
    model = r["model"] + (" tiny" if r.get("tiny") == "1" else "")
    if r.get("layers") and r.get("full_layers") and r["layers"] != r["full_layers"]:
        model += f" ({r['layers']} of {r['full_layers']} layers)"
    ok = r.get("ok") == "1"
    tok_s, peak, tflops, mfu = (_float(r.get(k)) for k in ("tok_s", "peak_gib", "tflops", "mfu"))
    cells = [model, r["method"], "on" if r["checkpointing"] == "1" else "off",
             "dynamic" if r["dynamic"] == "1" else "static", _layout(r), _tokens(_int(r["seq_len"])),
             f"{tok_s:,.0f}" if ok and tok_s is not None else r.get("error", "")[:40] or "failed",
             "" if peak is None else f"{peak:.2f}", "" if tflops is None else f"{tflops:.3g}",
             "" if mfu is None else f"{100 * mfu:.1f}", r.get("first_step_s", ""), r.get("graphs", ""),
             "; ".join(x for x in (r.get("env", ""), r.get("note", "")) if x)]  # fmt: skip
    return [c.replace("|", "\\|") for c in cells]


def table(rows: list[dict]) -> str:
    """Markdown: the one-row table, then the padded batches' (rows > 1 or TRL's mask), each under its env line."""
    out = []
    for title, padded in (("One row", False), ("Padded batches", True)):
        mine = [r for r in rows if _padded(r) == padded]
        if mine:
            out += [f"{title}: {_env(mine)}", "", "| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
            out += ["| " + " | ".join(_cells(r)) + " |" for r in sorted(mine, key=_order)] + [""]
    return "\n".join(out)


def plot(rows: list[dict], out: pathlib.Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit("plot_e2e.py needs matplotlib: pip install matplotlib") from exc

    panel = lambda r: (r["model"], r.get("tiny"), r.get("layers"), r["dynamic"], _layout(r))  # noqa: E731
    lengths: dict[tuple, set] = {}
    for r in rows:
        lengths.setdefault(panel(r), set()).add(r["seq_len"])
    # a panel is a sweep over lengths; a batch measured at one length only is a row of the table, not a dot
    panels = [k for k in dict.fromkeys(panel(r) for r in sorted(rows, key=_order)) if len(lengths[k]) > 1]
    if not panels:
        raise SystemExit("no batch layout was measured at more than one length: nothing to plot (see --table)")
    fig, axes = plt.subplots(len(panels), 2, figsize=(13, 4.2 * len(panels)), squeeze=False)
    for key, (ax_mem, ax_tok) in zip(panels, axes):
        model, _, _, dynamic, layout = key
        mine = [r for r in rows if panel(r) == key]
        first = mine[0]
        depth = f"{first['layers']} of {first['full_layers']} layers" if first.get("layers") else ""
        compile_kind = "one dynamic compile" if dynamic == "1" else "static compile per length"
        shape = SHAPES.get(model, model) if first.get("tiny") != "1" else f"tiny stand-in for {model}"
        title = f"{shape} ({depth}), {compile_kind}" + ("" if layout == "one row" else f", {layout}")
        line = lambda r: (r["method"], r["checkpointing"], r.get("env", ""))  # noqa: E731
        lines = sorted({line(r) for r in mine}, key=lambda k: (_rank(k[0], COLORS), k[1], k[2]))
        for method, ckpt, env in lines:
            runs = sorted((r for r in mine if line(r) == (method, ckpt, env)), key=lambda r: int(r["seq_len"] or 0))
            ok = [r for r in runs if r["ok"] == "1"]
            stop = next((r["error"] for r in runs if r["ok"] != "1"), "")
            longest = _tokens(max(int(r["seq_len"]) for r in ok)) if ok else "none"
            reach = f"longest {longest}, then {stop[:20]}" if stop else f"measured up to {longest}"  # no limit seen
            label = f"{method}{' ' + env if env else ''}, ckpt {'on' if ckpt == '1' else 'off'} ({reach})"
            style = dict(color=COLORS.get(method), linestyle="-" if ckpt == "1" else "--", label=label,
                         **MARKERS.get(method, dict(marker="o")))  # fmt: skip
            if env:  # a flag's run: the method's colour, hollow markers and a thinner line
                style.update(fillstyle="none", linewidth=1, markersize=8)
            xs = [int(r["seq_len"]) for r in ok]
            mem = [_float(r["peak_gib"]) for r in ok]
            if any(m is not None for m in mem):
                ax_mem.plot(xs, mem, **style)
            ax_tok.plot(xs, [_float(r["tok_s"]) for r in ok], **style)
        for ax, ylabel in ((ax_mem, "peak memory (GiB, max_memory_allocated)"), (ax_tok, "tokens/s")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel(f"sequence length (tokens, {'per row' if _padded(first) else 'one row'})")
            ax.set_ylabel(ylabel)
            ax.set_title(title, fontsize=10)
            ax.grid(True, alpha=0.3)
            ticks = sorted({int(r["seq_len"]) for r in mine if r["seq_len"]})
            ax.set_xticks(ticks, [_tokens(t) for t in ticks])
        if not ax_mem.lines:
            ax_mem.text(0.5, 0.5, "peak memory not measured (CPU)", ha="center", transform=ax_mem.transAxes)
        ax_tok.legend(fontsize=7)
    dtype = rows[0].get("dtype") or "bf16"
    fig.suptitle(f"One GRPO training step (fwd + bwd), {dtype}, random init\n{_env(rows)}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / fig.get_figheight()))  # room for the two title lines
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", nargs="?", default=str(pathlib.Path(__file__).parent / "results" / "e2e.csv"))
    ap.add_argument("--out", default="", help="PNG path (default: the CSV's path with .png)")
    ap.add_argument("--table", action="store_true", help="print the Markdown tables instead of the PNG")
    args = ap.parse_args()
    rows = read(args.csv)
    if not rows:
        raise SystemExit(f"{args.csv} has no rows")
    if args.table:
        print(table(rows))
    else:
        plot(rows, pathlib.Path(args.out or pathlib.Path(args.csv).with_suffix(".png")))


if __name__ == "__main__":
    main()
