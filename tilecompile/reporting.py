"""What the passes rewrote and skipped, across every graph compiled since the last ``tilecompile.reset()``."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any

PASS_NAMES = ("tensor_parallel", "attention", "fused_linear_ce", "tiled_mlp")


@dataclasses.dataclass
class Rewrite:
    """One region a pass rewrote."""

    pass_name: str
    module_path: str
    shapes: dict[str, tuple] = dataclasses.field(default_factory=dict)
    dtypes: dict[str, str] = dataclasses.field(default_factory=dict)
    detail: str = ""


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


class Report:
    """``counts`` (pass -> regions rewritten), ``rewrites``, ``skipped`` and ``failures``."""

    def __init__(self) -> None:
        self.rewrites: list[Rewrite] = []
        self.skipped: list[Skip] = []
        self.failures: list[Failure] = []
        self.graphs = 0

    @property
    def counts(self) -> dict[str, int]:
        counts = dict.fromkeys(PASS_NAMES, 0)
        for r in self.rewrites:
            counts[r.pass_name] = counts.get(r.pass_name, 0) + 1
        return counts

    def snapshot(self) -> Report:
        copy = Report()
        copy.rewrites, copy.skipped, copy.failures = list(self.rewrites), list(self.skipped), list(self.failures)
        copy.graphs = self.graphs
        return copy

    def __str__(self) -> str:
        lines = [f"tilecompile report: {self.graphs} graph(s) compiled"]
        lines.append("  " + "  ".join(f"{k}={v}" for k, v in self.counts.items()))
        if self.rewrites:
            lines.append("rewritten:")
            rows = [("pass", "module", "shapes", "dtypes", "detail")]
            for r in self.rewrites:
                shapes = " ".join(f"{k}={_dims(v)}" for k, v in r.shapes.items())
                dtypes = " ".join(f"{k}={str(v).removeprefix('torch.')}" for k, v in r.dtypes.items())
                rows.append((r.pass_name, r.module_path or "<root>", shapes, dtypes, r.detail))
            lines += _table(rows)
        if self.skipped:
            lines.append("skipped:")
            rows = [("pass", "candidate", "module", "reason")]
            rows += [(s.pass_name, s.candidate, s.module_path or "<root>", s.reason) for s in self.skipped]
            lines += _table(rows)
        if self.failures:
            lines.append("failed (undone):")
            lines += _table([("pass", "graph", "reason")] + [(f.pass_name, f.graph, f.reason) for f in self.failures])
        return "\n".join(lines)

    __repr__ = __str__


def _dims(shape: Any) -> str:
    return "[" + ",".join(str(s) for s in shape) + "]" if isinstance(shape, tuple | list) else str(shape)


def _table(rows: list[tuple[Any, ...]]) -> list[str]:
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]


_lock = threading.Lock()
_current = Report()


def record(rewrites: list[Rewrite] = (), skipped: list[Skip] = (), failures: list[Failure] = ()) -> None:
    with _lock:
        _current.rewrites.extend(rewrites)
        _current.skipped.extend(skipped)
        _current.failures.extend(failures)


@contextlib.contextmanager
def discarded_on(exc_type: type[BaseException]):
    """Records made inside the block are dropped again if it raises ``exc_type`` (Dynamo restarting its analysis:
    the graph is traced and compiled anew, and would otherwise be counted twice)."""
    with _lock:
        report, marks = _current, (len(_current.rewrites), len(_current.skipped), len(_current.failures))
        graphs = _current.graphs
    try:
        yield
    except exc_type:
        with _lock:
            if report is _current:  # not reset meanwhile
                del report.rewrites[marks[0] :], report.skipped[marks[1] :], report.failures[marks[2] :]
                report.graphs = graphs
        raise


def count_graph() -> None:
    with _lock:
        _current.graphs += 1


def report() -> Report:
    """What was rewritten (a snapshot: later compiles don't change the returned object)."""
    with _lock:
        return _current.snapshot()


def reset() -> None:
    """Clear the report."""
    global _current
    with _lock:
        _current = Report()
