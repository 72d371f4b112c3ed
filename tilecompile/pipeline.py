"""Runs the passes in order over a Dynamo graph (and the bodies of its higher-order ops), checking each.

A pass is a module in ``tilecompile.passes`` with ``NAME`` and ``run(gm, ctx) -> PassResult``. After each pass
the pipeline lints every graph it may have touched and re-propagates fake tensors through every node the pass
marked with ``expect(node, value)``, checking shape and dtype against what the replaced nodes produced. A pass
that raises or fails a check is undone for this graph and a warning names it (``strict`` raises instead). Every
candidate a pass looked at (``PassResult.consider``) must end in a rewrite or a skip with its reason.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from typing import Any

import torch
import torch.fx as fx

from tilecompile import graph as fxgraph
from tilecompile import reporting
from tilecompile.config import Settings
from tilecompile.ops import own_autograd
from tilecompile.pass_api import EXPECTED, PassContext, PassResult, snapshot_graph
from tilecompile.passes import attention, canonical, layer_regions, lm_head, memory_plan, mlp, tensor_parallel

log = logging.getLogger("tilecompile")

# canonical first: it rewrites spellings that hide a value (x + 0.0, torch.min(a, b), a linear autograd.Function);
# memory_plan next: a layer it keeps whole joins the root graph before the passes rewrite it;
# layer_regions last: it compares the checkpoint bodies as the other passes left them
PASSES = {p.NAME: p for p in (canonical, memory_plan, tensor_parallel, attention, lm_head, mlp, layer_regions)}
PASS_ORDER = tuple(PASSES)


@dataclasses.dataclass
class PassTime:
    """How often a pass ran over a root graph (its nested graphs included) and the CPU / wall seconds it took,
    the pipeline's checks of its rewrites (lint, fake-run, recompile) and its undo snapshot included."""

    runs: int = 0
    cpu_s: float = 0.0
    wall_s: float = 0.0


# pass name -> PassTime since the last ``reset_times()``, and "snapshot" (the undo copies) and "check" (the checks of
# the rewrites), both also counted in their pass's; benchmarks/compile_time.py prints them
TIMES: dict[str, PassTime] = {}


def reset_times() -> None:
    TIMES.clear()


class _Timed:
    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        self.cpu, self.wall = time.process_time(), time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        t = TIMES.setdefault(self.name, PassTime())
        t.runs += 1
        t.cpu_s += time.process_time() - self.cpu
        t.wall_s += time.perf_counter() - self.wall


class PassFailed(RuntimeError):
    """A pass raised or produced a graph that failed its checks (raised only in strict mode)."""


def load_pass(name: str):
    return PASSES[name]


def run_passes(gm: fx.GraphModule, settings: Settings, graph_name: str = "graph") -> fx.GraphModule:
    # The passes fake-run new nodes on tensors that may require grad. A user's saved-tensors hooks (activation
    # offloading: verl, torchtune) would then pack fake tensors at compile time and fail on their data pointers;
    # they belong to run time. A pair of no-op hooks on top of the stack keeps them out while the passes run.
    with own_autograd():
        return _run_passes(gm, settings, graph_name)


def _run_passes(gm: fx.GraphModule, settings: Settings, graph_name: str) -> fx.GraphModule:
    for name in PASS_ORDER:
        if not settings.pass_enabled(name):
            log.debug("pass %s is off", name)
            # a pass whose absence would make the graph wrong says so (tensor parallel on sharded parameters)
            check_off = getattr(PASSES[name], "check_off", None)
            if check_off is not None:
                check_off(gm)
            continue
        with _Timed(name):
            _run_pass(gm, name, settings, graph_name)
    return gm


def _run_pass(gm: fx.GraphModule, name: str, settings: Settings, graph_name: str) -> None:
    with _Timed("snapshot"):
        saved = {sub_name: snapshot_graph(sub.graph) for sub_name, sub in fxgraph.graph_modules(gm)}
    try:
        result = PassResult()
        module = load_pass(name)
        for sub_name, sub in fxgraph.graph_modules(gm):
            result.extend(module.run(sub, PassContext(settings, sub_name)))
        for what in result.undecided():  # a candidate dropped without a reason: a bug of the pass
            if settings.strict:
                raise PassFailed(f"{what} was looked at and dropped without a reason")
            result.skipped.append(reporting.Skip(name, what, "", "dropped without a reason (a bug in the pass)"))
        with _Timed("check"):
            for _, sub in fxgraph.graph_modules(gm):
                sub.graph.lint()
                check_rewritten_nodes(sub)
                sub.recompile()
    except Exception as exc:  # noqa: BLE001 - any failure of a pass undoes it
        _restore(gm, saved)
        if getattr(exc, "undo_is_unsafe", False):  # e.g. a sharded graph left without its collectives
            raise
        reason = f"{type(exc).__name__}: {exc}"
        reporting.record(failures=[reporting.Failure(name, graph_name, reason)])
        if settings.strict:
            raise PassFailed(f"tilecompile pass {name!r} failed on {graph_name}: {reason}") from exc
        warnings.warn(
            f"tilecompile: pass {name!r} failed on {graph_name} and was undone; the graph compiles without it "
            f"({reason}). Set TILECOMPILE_STRICT=1 to raise instead.",
            stacklevel=4,
        )
        return
    reporting.record(rewrites=result.rewrites, skipped=result.skipped)
    for r in result.rewrites:
        log.info("%s rewrote %s %s%s", name, r.module_path or "<root>", r.shapes, f": {r.detail}" if r.detail else "")
    for s in result.skipped:
        log.info("%s skipped %s at %s: %s", name, s.candidate, s.module_path or "<root>", s.reason)


def _restore(gm: fx.GraphModule, saved: dict[str, fx.Graph]) -> None:
    for sub_name, sub in fxgraph.graph_modules(gm):
        if sub_name in saved:
            sub.graph = saved[sub_name]
            sub.recompile()


def check_rewritten_nodes(gm: fx.GraphModule) -> None:
    """Fake-run every node a pass marked with ``expect``; its shapes and dtypes must match the expectation."""
    for node in gm.graph.nodes:
        if EXPECTED not in node.meta:
            continue
        expected = node.meta.pop(EXPECTED)
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: fxgraph.example_value(n))
        # The mode the example values belong to: under Dynamo the tracing context may hold a different one (the
        # backend's), and fake tensors of two modes cannot be mixed.
        modes = {id(t.fake_mode): t.fake_mode for t in _flat_tensors((args, kwargs, expected)) if _is_fake(t)}
        if len(modes) != 1:
            raise PassFailed(f"cannot check {node.format_node()}: its inputs carry {len(modes)} fake modes")
        (fake_mode,) = modes.values()
        with fake_mode:
            if node.op == "call_function":
                actual = node.target(*args, **kwargs)
            elif node.op == "call_method":
                actual = getattr(args[0], node.target)(*args[1:], **kwargs)
            else:
                raise PassFailed(f"cannot check {node.op} node {node.name}")
        _compare(node, actual, expected)
        node.meta["example_value"] = actual
        for user in node.users:
            if fxgraph.op(user) == "getitem" and isinstance(actual, tuple | list):
                item = actual[user.args[1]]
                if EXPECTED in user.meta:
                    _compare(user, item, user.meta.pop(EXPECTED))
                user.meta["example_value"] = item


def _is_fake(t: torch.Tensor) -> bool:
    return isinstance(t, torch._subclasses.fake_tensor.FakeTensor)


def _flat_tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _compare(node: fx.Node, actual: Any, expected: Any) -> None:
    a, e = _flat_tensors(actual), _flat_tensors(expected)
    if len(a) != len(e):
        raise PassFailed(f"{node.name}: produces {len(a)} tensors, the graph expects {len(e)}")
    for i, (x, y) in enumerate(zip(a, e)):
        if x.dtype != y.dtype or not fxgraph.same_shape(tuple(x.shape), tuple(y.shape)):
            raise PassFailed(
                f"{node.name} output {i}: got {tuple(x.shape)} {x.dtype}, the graph expects {tuple(y.shape)} {y.dtype}"
            )
