"""What the passes rewrote and skipped, across every graph compiled since the last ``tilecompile.reset()``.

Counts are of modules, not graphs: one compiled graph often serves many modules (Dynamo reuses a decoder layer's
graph for every layer of the same class, as under per-block compile or FSDP2's per-layer graph breaks). Each graph's
compiled function notes the distinct parameter tensors it runs with (``serving``), and a rewrite in that graph
counts once per module it served: one graph of 28 layers counts 28 MLPs, and its row says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import torch

PASS_NAMES = ("tensor_parallel", "attention", "fused_linear_ce", "tiled_mlp", "layer_regions")


@dataclasses.dataclass
class Rewrite:
    """One region a pass rewrote."""

    pass_name: str
    module_path: str
    shapes: dict[str, tuple] = dataclasses.field(default_factory=dict)
    dtypes: dict[str, str] = dataclasses.field(default_factory=dict)
    detail: str = ""
    graph: str = ""  # the graph it was made in (set by ``graph_scope``)


@dataclasses.dataclass
class Skip:
    """One candidate a pass looked at and left alone, with the reason."""

    pass_name: str
    candidate: str
    module_path: str
    reason: str


@dataclasses.dataclass
class Failure:
    """A pass that raised or failed its checks; its rewrites in that graph were undone."""

    pass_name: str
    graph: str
    reason: str


@dataclasses.dataclass
class CompileError:
    """An inner compile that raised: Dynamo retried the frame (split at a break of its own) or raised to the user.
    The graph's rewrites are not counted."""

    graph: str
    reason: str


@dataclasses.dataclass
class EagerFrame:
    """A function tilecompile compiled that Dynamo stopped compiling at a recompile limit: it runs eagerly from then
    on, with no rewrite."""

    function: str
    limit: str
    last_reason: str


class Report:
    """``counts`` (pass -> modules rewritten), ``rewrites``, ``skipped`` and ``failures``; ``compile_errors``,
    ``eager_frames`` and ``breaks`` (Dynamo's graph-break reasons since the last reset, with counts) say where
    nothing could be rewritten; ``modules(r)`` says how many modules the graph of rewrite ``r`` served (1 until it
    ran, or when it holds no parameters)."""

    def __init__(self) -> None:
        self.rewrites: list[Rewrite] = []
        self.skipped: list[Skip] = []
        self.failures: list[Failure] = []
        self.compile_errors: list[CompileError] = []
        self.eager_frames: list[EagerFrame] = []
        self.breaks: dict[str, int] = {}
        self.graphs = 0
        self.served: dict[str, int] = {}  # graph -> distinct parameter sets it ran with

    def modules(self, rewrite: Rewrite) -> int:
        return max(1, self.served.get(rewrite.graph, 0))

    @property
    def counts(self) -> dict[str, int]:
        counts = dict.fromkeys(PASS_NAMES, 0)
        for r in self.rewrites:
            counts[r.pass_name] = counts.get(r.pass_name, 0) + self.modules(r)
        return counts

    def snapshot(self) -> Report:
        copy = Report()
        copy.rewrites, copy.skipped, copy.failures = list(self.rewrites), list(self.skipped), list(self.failures)
        copy.compile_errors, copy.eager_frames = list(self.compile_errors), list(self.eager_frames)
        copy.breaks = new_breaks() if self is _current else dict(self.breaks)
        copy.graphs = self.graphs
        copy.served = {g: len(ids) for g, ids in _served.items()} if self is _current else dict(self.served)
        return copy

    def __str__(self) -> str:
        lines = [f"tilecompile report: {self.graphs} graph(s) compiled; modules rewritten:"]
        lines.append("  " + "  ".join(f"{k}={v}" for k, v in self.counts.items()))
        if self.rewrites:
            lines.append("rewritten:")
            rows = [("pass", "module", "shapes", "dtypes", "detail")]
            for r in self.rewrites:
                shapes = " ".join(f"{k}={_dims(v)}" for k, v in r.shapes.items())
                dtypes = " ".join(f"{k}={str(v).removeprefix('torch.')}" for k, v in r.dtypes.items())
                path, n = r.module_path or "<root>", self.modules(r)
                path += f" (x{n}: one {r.graph or 'graph'} served {n} modules)" if n > 1 else ""
                rows.append((r.pass_name, path, shapes, dtypes, r.detail))
            lines += _table(rows)
        if self.skipped:
            lines.append("skipped:")
            rows = [("pass", "candidate", "module", "reason")]
            rows += [(s.pass_name, s.candidate, s.module_path or "<root>", s.reason) for s in self.skipped]
            lines += _table(rows)
        if self.failures:
            lines.append("failed (undone):")
            lines += _table([("pass", "graph", "reason")] + [(f.pass_name, f.graph, f.reason) for f in self.failures])
        if self.compile_errors:
            lines.append("compiles that raised (Dynamo retried the frame or raised; their rewrites are not counted):")
            lines += _table([("graph", "error")] + [(e.graph, e.reason) for e in self.compile_errors])
        if self.eager_frames:
            lines.append("ran eagerly (Dynamo's recompile limit; no rewrite from then on):")
            rows = [("function", "limit", "last guard that failed")]
            lines += _table(rows + [(f.function, f.limit, f.last_reason) for f in self.eager_frames])
        if self.breaks:
            lines.append("graph breaks since tilecompile.reset() (Dynamo's, any backend; TORCH_LOGS=graph_breaks):")
            lines += [f"  x{n}  {reason.splitlines()[0][:200]}" for reason, n in self.breaks.items()]
        return "\n".join(lines)

    __repr__ = __str__


def _dims(shape: Any) -> str:
    return "[" + ",".join(str(s) for s in shape) + "]" if isinstance(shape, tuple | list) else str(shape)


def _table(rows: list[tuple[Any, ...]]) -> list[str]:
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]


_lock = threading.Lock()
_current = Report()
_served: dict[str, set[int]] = {}  # graph name -> ids of the first parameter of each call (the live report's)
_graph: list[str] = []  # the graph being compiled (``graph_scope``), innermost last
_MAX_SERVED = 4096  # a graph fed fresh parameter tensors every call stops being counted here


def record(rewrites: list[Rewrite] = (), skipped: list[Skip] = (), failures: list[Failure] = ()) -> None:
    with _lock:
        if _graph:
            for r in rewrites:
                r.graph = r.graph or _graph[-1]
        _current.rewrites.extend(rewrites)
        _current.skipped.extend(skipped)
        _current.failures.extend(failures)


def withdraw(pass_name: str, graph: str, reason: str) -> None:
    """Takes back the rewrites ``pass_name`` made in ``graph`` (undone after the fact) and records why."""
    with _lock:
        _current.rewrites[:] = [r for r in _current.rewrites if not (r.pass_name == pass_name and r.graph == graph)]
        _current.failures.append(Failure(pass_name, graph, reason))


def decline(pass_name: str, graph: str, candidate: str, reason: str) -> None:
    """Turns the rewrites ``pass_name`` made in ``graph`` into skips with ``reason``: undone before the compile by a
    choice (a setting that rules them out), not a failure."""
    with _lock:
        mine = [r for r in _current.rewrites if r.pass_name == pass_name and r.graph == graph]
        _current.rewrites[:] = [r for r in _current.rewrites if not any(r is m for m in mine)]
        _current.skipped.extend(Skip(pass_name, candidate, r.module_path, reason) for r in mine)


def retract(pass_name: str, graph: str, module_path: str, candidate: str, reason: str) -> None:
    """Turns the rewrites ``pass_name`` recorded for ``module_path`` in ``graph`` into a skip with ``reason``: a later
    stage (the inner compile) did not carry them out."""
    with _lock:
        mine = [r for r in _current.rewrites
                if r.pass_name == pass_name and r.graph == graph and r.module_path == module_path]  # fmt: skip
        if mine:
            _current.rewrites[:] = [r for r in _current.rewrites if not any(r is m for m in mine)]
            _current.skipped.append(Skip(pass_name, candidate, module_path, reason))


@contextlib.contextmanager
def discarded_on_error(graph: Callable[[], str], quiet: tuple[type[BaseException], ...]):
    """Records made inside the block are dropped again if it raises: the graph was not compiled. Dynamo restarts its
    analysis (``quiet``: the graph is traced and compiled anew, and would otherwise be counted twice), or retries the
    frame split at a break of its own, or raises to the user; any other error is noted as a ``CompileError`` of
    graph ``graph()``."""
    with _lock:
        report, marks = _current, (len(_current.rewrites), len(_current.skipped), len(_current.failures))
        graphs = _current.graphs
    try:
        yield
    except BaseException as exc:
        with _lock:
            if report is _current:  # not reset meanwhile
                del report.rewrites[marks[0] :], report.skipped[marks[1] :], report.failures[marks[2] :]
                report.graphs = graphs
                if not isinstance(exc, quiet):
                    text = str(exc).strip()
                    first = text.splitlines()[0][:200] if text else ""
                    report.compile_errors.append(CompileError(graph(), f"{type(exc).__name__}: {first}"))
        raise


def eager_frame(frame: EagerFrame) -> None:
    with _lock:
        if frame not in _current.eager_frames:
            _current.eager_frames.append(frame)


_breaks_at_reset: dict = {}  # Dynamo's graph-break counts by reason when reset() last ran


def new_breaks() -> dict[str, int]:
    """Dynamo's graph-break reasons recorded since ``reset()`` (every backend's: the counters are the process's),
    with how often each was hit since. ``torch._dynamo.reset()`` does not clear Dynamo's counters; ``reset()`` notes
    where they stood."""
    from torch._dynamo.utils import counters

    return {str(r): n - _breaks_at_reset.get(r, 0) for r, n in counters["graph_break"].items()
            if n > _breaks_at_reset.get(r, 0)}  # fmt: skip


@contextlib.contextmanager
def graph_scope(name: str):
    """Rewrites recorded inside belong to graph ``name`` (their module count is that graph's)."""
    _graph.append(name)
    try:
        yield
    finally:
        _graph.pop()


def serving(name: str, gm: Any, compiled: Any) -> Any:
    """``compiled`` (graph ``name``'s compiled function), noting the distinct parameter sets it is called with.

    The key of a call is its first parameter input (what Dynamo lifted from the module: the same tensor object on
    every step, FSDP2's unsharded parameters included). A graph with no parameter inputs is left as it is.
    """
    index = _first_param_index(gm)
    if index is None or not callable(compiled):
        return compiled
    # the boxed calling convention (Dynamo hands over one list of inputs)
    boxed = type(gm).__name__ == "GmWrapper" or bool(getattr(compiled, "_boxed_call", False))
    seen = _served.setdefault(name, set())

    def run(*args: Any) -> Any:
        inputs = args[0] if boxed and len(args) == 1 and isinstance(args[0], list) else args
        if len(seen) < _MAX_SERVED and index < len(inputs):
            seen.add(id(inputs[index]))
        return compiled(*args)

    for attr in ("_boxed_call", "zero_grad"):
        if hasattr(compiled, attr):
            setattr(run, attr, getattr(compiled, attr))
    return run


def _first_param_index(gm: Any) -> int | None:
    graph = getattr(gm, "graph", None)
    if graph is None:
        return None
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for i, node in enumerate(placeholders):
        arg = node.meta.get("grapharg")
        if isinstance(getattr(arg, "example", None), torch.nn.Parameter):
            return i
    return None


def count_graph() -> None:
    with _lock:
        _current.graphs += 1


def report() -> Report:
    """What was rewritten (a snapshot: later compiles don't change the returned object)."""
    with _lock:
        return _current.snapshot()


def reset() -> None:
    """Clear the report, and forget the graph breaks Dynamo recorded so far (``new_breaks`` counts from here)."""
    global _current, _served
    with _lock:
        _current = Report()
        _served = {}
    from torch._dynamo.utils import counters

    _breaks_at_reset.clear()
    _breaks_at_reset.update(counters["graph_break"])
