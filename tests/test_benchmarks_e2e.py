"""benchmarks/e2e.py's model FLOPs, CSV appending and length search, and plot_e2e.py's table: CPU, no model runs."""

from __future__ import annotations

import csv
import pathlib
import subprocess
import sys
import types

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import e2e  # noqa: E402
import plot_e2e  # noqa: E402

BATCHES = [  # n, rows, packed, mask: as e2e.inputs builds them
    (37, 1, 0, ""), (37, 1, 4, ""), (40, 1, 1, ""), (40, 1, 3, "ones"), (24, 3, 0, "trl"), (31, 2, 0, "trl"),
    (30, 3, 2, "trl"),
]  # fmt: skip


def _batch(n: int, rows: int, packed: int, mask: str) -> tuple:
    _, _, _, position_ids, attention_mask, _ = e2e.inputs(n, 1000, packed, torch.device("cpu"), rows, mask)
    return position_ids, attention_mask


def _allowed(n: int, rows: int, position_ids, attention_mask) -> torch.Tensor:
    """[rows, n, n]: query q may read key k, by the definition, one pair at a time: both real, k <= q, and the same
    document (position_ids restarting at 0) when there is no attention_mask."""
    real = torch.ones(rows, n, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    docs = position_ids is not None and attention_mask is None
    doc = (position_ids.expand(rows, n) == 0).cumsum(-1) if docs else torch.zeros(rows, n, dtype=torch.long)
    allowed = torch.zeros(rows, n, n, dtype=torch.bool)
    for b in range(rows):
        for q in range(n):
            for k in range(q + 1):
                allowed[b, q, k] = bool(real[b, q] and real[b, k] and doc[b, q] == doc[b, k])
    return allowed


@pytest.mark.parametrize("n, rows, packed, mask", BATCHES)
def test_attention_pairs_count_the_allowed_pairs(n, rows, packed, mask):
    position_ids, attention_mask = _batch(n, rows, packed, mask)
    allowed = _allowed(n, rows, position_ids, attention_mask)
    assert e2e.attention_pairs(rows, n, position_ids, attention_mask) == int(allowed.sum())
    if not mask and not packed:
        assert int(allowed.sum()) == rows * n * (n + 1) // 2


@pytest.mark.parametrize("n, rows, packed, mask", BATCHES)
def test_attention_pairs_match_the_mask_hf_builds(n, rows, packed, mask):
    """The real queries' allowed keys in HF's own sdpa mask (documents only without an attention_mask)."""
    masking_utils = pytest.importorskip("transformers.masking_utils")
    from transformers import Qwen2Config

    config = Qwen2Config(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, attn_implementation="sdpa")
    position_ids, attention_mask = _batch(n, rows, packed, mask)
    hf = masking_utils.create_causal_mask(
        config=config, inputs_embeds=torch.zeros(rows, n, 8), attention_mask=attention_mask, cache=None,
        position_ids=position_ids, allow_is_causal_skip=False,
    )[:, 0]  # fmt: skip
    real = torch.ones(rows, n, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    assert e2e.attention_pairs(rows, n, position_ids, attention_mask) == int((hf & real[:, :, None]).sum())


def test_model_flops():
    """P counts each nn.Linear weight once (the tied lm_head once, no embedding, biases or norms), T the real tokens."""

    class Toy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.norm = torch.nn.Embedding(50, 8), torch.nn.LayerNorm(8)
            self.up, self.lm_head = torch.nn.Linear(8, 12), torch.nn.Linear(8, 50, bias=False)
            self.lm_head.weight = self.embed.weight

    params = e2e.matmul_params(Toy())
    assert params == 8 * 12 + 50 * 8
    position_ids, attention_mask = _batch(24, 3, 0, "trl")
    tokens = e2e.real_tokens(3, 24, attention_mask)
    assert tokens == int(attention_mask.sum()) < 3 * 24 and e2e.real_tokens(2, 24, None) == 48
    pairs = e2e.attention_pairs(3, 24, position_ids, attention_mask)
    config = types.SimpleNamespace(hidden_size=64, num_attention_heads=4, num_hidden_layers=2)  # d_head 16
    assert e2e.model_flops(config, params, tokens, pairs) == 6 * params * tokens + 12 * 2 * 4 * 16 * pairs
    config.head_dim = 32  # a head width of its own (not hidden / heads)
    assert e2e.model_flops(config, params, tokens, pairs) == 6 * params * tokens + 12 * 2 * 4 * 32 * pairs


def _search(lengths: list[int], fits, search: int) -> list[tuple[int, str]]:
    errors = {}
    while (n := e2e.next_length(lengths, errors, search)) is not None:
        errors[n] = "" if fits(n) else "OOM"
    return list(errors.items())


def test_search_bisects_between_the_longest_fit_and_the_shortest_oom():
    lengths = [4096 << k for k in range(6)]
    runs = _search(lengths, lambda n: n <= 90_000, 3)
    assert [n for n, _ in runs] == [*lengths, 98304, 81920, 90112]  # each between the longest fit and shortest OOM
    assert max(n for n, e in runs if not e) == 81920
    assert _search(lengths, lambda n: n <= 90_000, 0) == [(n, "" if n <= 65536 else "OOM") for n in lengths]
    assert [n for n, _ in _search(lengths, lambda n: n <= 66_000, 5)] == [*lengths, 98304, 81920, 73728, 69632]
    assert [n for n, _ in _search([65536], lambda n: n <= 20_000, 3)] == [65536, 32768, 16384, 24576]  # none fit
    assert [n for n, _ in _search(lengths, lambda n: True, 3)] == lengths
    errors = {4096: "", 8192: "RuntimeError: boom"}  # an error that is no OOM ends the method
    assert e2e.next_length(lengths, errors, 3) is None


def _read(path: pathlib.Path) -> tuple[list[str], list[dict]]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader)


def test_csv_appends_and_widens_an_older_header(tmp_path):
    path = tmp_path / "e2e.csv"
    e2e.write_rows(path, [dict(model="1.5b", seq_len=4096, old="x")], ["model", "seq_len", "old"])
    fields = ["model", "seq_len", "tflops"]
    e2e.write_rows(path, [dict(model="8b", seq_len=8192, tflops=412.5)], fields, append=True)
    header, rows = _read(path)
    assert header == ["model", "seq_len", "tflops", "old"]  # the union, the new fields first
    assert rows == [dict(model="1.5b", seq_len="4096", tflops="", old="x"),
                    dict(model="8b", seq_len="8192", tflops="412.5", old="")]  # fmt: skip
    e2e.write_rows(path, [dict(model="8b", seq_len=16384)], header, append=True)  # same header: appended
    assert [r["seq_len"] for r in _read(path)[1]] == ["4096", "8192", "16384"]
    e2e.write_rows(path, [dict(model="8b", seq_len=1)], fields)  # no append: anew
    assert _read(path) == (fields, [dict(model="8b", seq_len="1", tflops="")])
    older = [f for f in e2e.FIELDS if f not in ("tflops", "mfu", "model_flops", "real_tokens", "repeats", "note")]
    e2e.write_rows(path, [dict(model="1.5b")], older)
    e2e.write_rows(path, [dict(model="1.5b")], e2e.FIELDS, append=True)
    assert _read(path)[0] == e2e.FIELDS and not list(tmp_path.glob("*.part"))


ENV = dict(device="NVIDIA H200", torch="2.11.0+cu130", triton="3.6.0", transformers="5.17.0")


def _row(**kw) -> dict:
    base = dict(model="1.5b", tiny="0", layers="28", full_layers="28", method="tilecompile", checkpointing="1",
                dynamic="0", rows="1", mask="", packed="0", env="", seq_len="65536", ok="1", error="", tok_s="14879.0",
                peak_gib="11.785", tflops="", mfu="", first_step_s="81.21", graphs="2", note="", **ENV)  # fmt: skip
    return {k: str(v) for k, v in (base | kw).items()}


def test_table():
    old = {k: v for k, v in _row(date="2026-12-01 10:00 UTC").items() if k not in ("tflops", "mfu", "rows", "packed")}
    oom = dict(ok="0", error="OOM", tok_s="", peak_gib="", first_step_s="", graphs="")
    rows = [
        old,  # an older CSV's row: no tflops, mfu, rows, packed
        _row(date="2026-12-05 09:00 UTC", tok_s="15000.0", tflops="412.3", mfu="0.4167", note="single-step probe"),
        _row(date="2026-12-05 09:30 UTC", env="TILECOMPILE_ATTENTION=0", tok_s="9000.0"),  # a flag's run: its own
        _row(date="2026-12-04 08:00 UTC", method="eager", **oom),
        _row(date="2026-12-05 10:00 UTC", rows="8", mask="trl", seq_len="4096", tok_s="38903.1", dynamic="1"),
        _row(date="2026-12-06 10:00 UTC", tok_s="1.0", note="withdrawn: its gradients were wrong"),  # left out
    ]
    latest = plot_e2e.latest(rows)
    assert len(latest) == 4  # the older row of the same measurement is replaced by the later one
    lines = plot_e2e.table(latest).splitlines()
    padded = lines.index(next(line for line in lines if line.startswith("Padded batches")))
    one_row, padded_rows = lines[:padded], lines[padded:]
    assert one_row[0].startswith("One row: NVIDIA H200; torch 2.11.0+cu130, triton 3.6.0, transformers 5.17.0;")
    assert one_row[0].endswith("2026-12-04, 2026-12-05")  # the days of its rows, not the replaced row's
    assert one_row[2] == "| " + " | ".join(plot_e2e.COLUMNS) + " |"
    cells = lambda lines: [line[2:-2].split(" | ") for line in lines if line.startswith("| 1.5b")]  # noqa: E731
    assert cells(one_row) == [
        ["1.5b", "eager", "on", "static", "one row", "64k", "OOM", "", "", "", "", "", ""],
        ["1.5b", "tilecompile", "on", "static", "one row", "64k", "15,000", "11.79", "412", "41.7", "81.21", "2",
         "single-step probe"],
        ["1.5b", "tilecompile", "on", "static", "one row", "64k", "9,000", "11.79", "", "", "81.21", "2",
         "TILECOMPILE_ATTENTION=0"],
    ]  # fmt: skip
    padded_cells = ["1.5b", "tilecompile", "on", "dynamic", "8 rows, TRL-padded", "4k", "38,903", "11.79", "", ""]
    assert cells(padded_rows) == [[*padded_cells, "81.21", "2", ""]]


def test_budget_stops_the_worker_and_says_so(tmp_path):
    """A worker still running when ``--budget`` is spent is stopped (its process group), and the length it was on
    gets a row that says why, keyed as the worker's own rows are; a worker inside its budget runs as before."""
    cfg = dict(model="1.5b", method="eager", checkpointing=False, lengths=[64], tiny=True, layers=0, dynamic=False,
               packed=0, repeats=1, inner="aot_eager", warm_cache=False, device="cpu", rows=1, mask="", env="",
               search=0, peak_tflops=e2e.PEAK_TFLOPS, note="")  # fmt: skip
    out = tmp_path / "rows.csv"
    cut = e2e.run_worker(cfg, out, deadline=e2e.time.monotonic() + 0.2)  # the worker is still importing torch
    assert [(r["seq_len"], r["ok"], r["error"]) for r in cut] == [(64, 0, "cut by --budget")]
    ran = e2e.run_worker(cfg, out, deadline=e2e.time.monotonic() + 600)
    assert [(r["seq_len"], r["ok"]) for r in ran] == [(64, 1)]
    key = ("model", "tiny", "layers", "env", "method", "checkpointing", "dynamic", "rows", "packed")
    assert {k: str(cut[0][k]) for k in key} == {k: str(ran[0][k]) for k in key}  # one line in plot_e2e
    _, rows = _read(out)
    assert [(r["ok"], r["error"]) for r in rows] == [("0", "cut by --budget"), ("1", "")]


def test_budget_skips_the_methods_after_the_cut(tmp_path):
    """``e2e.py --budget``: the method running when the budget is spent gets its row, the methods after it none."""
    out = tmp_path / "rows.csv"
    cmd = [sys.executable, e2e.__file__, "--tiny", "--device", "cpu", "--models", "1.5b", "--methods",
           "eager,tilecompile", "--checkpointing", "on", "--inner", "aot_eager", "--budget", "0.5",
           "--csv", str(out)]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "tilecompile  ckpt=1 skipped: --budget 0.5 s spent" in run.stdout
    _, rows = _read(out)
    assert [(r["method"], r["ok"], r["error"]) for r in rows] == [("eager", "0", "cut by --budget")]


def test_live_at_peak_replays_the_allocators_trace():
    """--snapshot's replay: the start's live set, the peak after the mark, and what is live at it by origin."""
    M = 2**20
    here = {"filename": __file__, "line": 1, "name": "f"}
    trace = [
        dict(action="alloc", addr=1, size=100 * M, frames=[here]),  # before the mark: live at the start
        dict(action="alloc", addr=2, size=50 * M, frames=[here]),
        dict(action="free_requested", addr=2, size=50 * M),
        dict(action="alloc", addr=3, size=400 * M, frames=[here]),  # the mark: the step starts here
        dict(action="alloc", addr=4, size=300 * M, frames=[{"filename": "other.py", "line": 9, "name": "g"}]),
        dict(action="free_requested", addr=3, size=400 * M),
        dict(action="alloc", addr=5, size=200 * M, frames=[here]),
        dict(action="free_requested", addr=99, size=7 * M),  # allocated before the trace began: not counted
    ]
    got = e2e.live_at_peak(trace, 3)
    assert got["start_gib"] == round(100 * M / 2**30, 3)
    assert got["traced_peak_gib"] == round(800 * M / 2**30, 3)  # 100 + 400 + 300, before the 400 is freed
    sizes = sorted(float(line.split()[0]) for line in got["by_origin"])
    assert sizes == [300.0, 500.0]  # this file's 100 + 400, other.py's 300
    assert any("other.py:9:g" in line for line in got["by_origin"])
