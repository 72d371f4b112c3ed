"""Shared test helpers: one assert_close that says where and how much, error against a float64 reference."""

from __future__ import annotations

import contextlib
import operator
import warnings
from collections.abc import Callable, Iterable

import torch
import torch.fx as fx

from tilecompile import graph as G


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, rtol: float, atol: float, name: str = "") -> None:
    """Like torch.testing.assert_close, but the message names the tensor, the worst index and the error sizes."""
    label = f"{name}: " if name else ""
    if actual.shape != expected.shape:
        raise AssertionError(f"{label}shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    finite_mismatch = torch.isfinite(a) != torch.isfinite(e)
    if finite_mismatch.any():
        idx = tuple(int(i) for i in finite_mismatch.nonzero()[0])
        raise AssertionError(f"{label}non-finite mismatch at {idx}: got {a[idx].item()}, expected {e[idx].item()}")
    both = torch.isfinite(a) & torch.isfinite(e)
    diff = torch.where(both, (a - e).abs(), torch.zeros_like(a))
    bad = diff > atol + rtol * e.abs()
    if bad.any():
        flat = int(torch.argmax(torch.where(bad, diff, torch.zeros_like(diff))))
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape))
        raise AssertionError(
            f"{label}{int(bad.sum())}/{a.numel()} elements differ; worst at {idx}: got {a[idx].item():.6g}, "
            f"expected {e[idx].item():.6g} (|diff| {diff[idx].item():.3g}, max |diff| {diff.max().item():.3g}, "
            f"rtol={rtol}, atol={atol})"
        )


def rel_err(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """||actual - reference|| / ||reference|| in float64 (0 when both are 0)."""
    a, r = actual.detach().double().cpu(), reference.detach().double().cpu()
    denom = r.norm().item()
    num = (a - r).norm().item()
    return num if denom == 0 else num / denom


def assert_grads_close(
    model: torch.nn.Module, reference: torch.nn.Module, *, rtol: float, atol: float, skip: Iterable[str] = ()
) -> None:
    """Every parameter gradient of ``model`` equals ``reference``'s (both None counts as equal)."""
    ref = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        if name in skip:
            continue
        q = ref[name]
        if p.grad is None or q.grad is None:
            assert p.grad is None and q.grad is None, f"grad of {name}: {p.grad is None=} {q.grad is None=}"
            continue
        assert_close(p.grad, q.grad, rtol=rtol, atol=atol, name=f"grad of {name}")


def compile_options(**overrides) -> dict:
    """Options for test compiles: strict, aot_eager inner compiler, every MLP tiled (no memory plan, which on a GPU
    would keep MLPs whole where they fit); overrides win."""
    return {"strict": True, "inner": "aot_eager", "mlp_min_tokens": 0, "memory_budget": 0, **overrides}


def run_step(fn: Callable, *args):
    out = fn(*args)
    out.backward()
    return out


@contextlib.contextmanager
def no_fallback():
    """The loss-aware op's compiled per-token gradient falling back to eager autograd (a warning) is an error."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="tilecompile: compiling the loss-aware gradient")
        yield


def as_torch_2_11(gm: fx.GraphModule) -> fx.GraphModule:
    """Each ``autograd_function_apply`` of ``gm`` in the form Dynamo of torch 2.11 records it: every intermediate of the
    forward body returned as a result of its own (after the outputs), an unused gradient placeholder for each in the
    backward body, and an unused ``getitem`` of each in the outer graph."""
    added = 0
    for node in list(gm.graph.nodes):
        if getattr(node.target, "__name__", None) != "autograd_function_apply":
            continue
        fwd, bwd = (getattr(gm, a.target) for a in node.args[:2])
        (out,) = [n for n in fwd.graph.nodes if n.op == "output"]
        outputs, saved = out.args[0]
        extra = [n for n in fwd.graph.nodes if n.op == "call_method" or n.op == "call_function"]
        extra = [n for n in extra if n not in outputs and isinstance(G.example_value(n), torch.Tensor)]
        out.args = (((*outputs, *extra), saved),)
        fwd.recompile()
        places = [n for n in bwd.graph.nodes if n.op == "placeholder"]
        with bwd.graph.inserting_after(places[len(outputs) - 1]):
            for i in range(len(extra)):
                bwd.graph.placeholder(f"unused_{i}")
        bwd.recompile()
        last = max(node.users, key=lambda u: list(gm.graph.nodes).index(u))
        with gm.graph.inserting_after(last):
            for i in range(len(extra)):
                gm.graph.call_function(operator.getitem, (node, len(outputs) + i))
        added += len(extra)
    gm.recompile()
    assert added, "no autograd.Function of the graph has an intermediate to return"
    return gm


def torch_2_11_form_backend(**options) -> Callable:
    """tilecompile (``compile_options(**options)``) on the graph in torch 2.11's form (``as_torch_2_11``)."""
    from tilecompile.backend import tilecompile_backend

    def backend(gm, inputs):
        return tilecompile_backend(as_torch_2_11(gm), inputs, options=compile_options(**options))

    return backend


class GraphCapture:
    """Replaces the backend's inner compiler by AOTAutograd (eager, min-cut partition, as the aot_eager backend) with
    compilers that keep the forward and backward graphs in ``fw`` and ``bw``."""

    def __init__(self) -> None:
        self.fw: list[torch.fx.GraphModule] = []
        self.bw: list[torch.fx.GraphModule] = []

    def __enter__(self) -> GraphCapture:
        from tilecompile import backend

        self._saved = backend.inner_compile

        def inner(gm, example_inputs, inner, mode, options):
            from functorch.compile import make_boxed_func
            from torch._functorch.aot_autograd import aot_module_simplified

            def keep(into):
                def compiler(g, _inputs):
                    into.append(g)
                    return make_boxed_func(g.forward)

                return compiler

            from functorch.compile import min_cut_rematerialization_partition

            return aot_module_simplified(  # as the aot_eager backend does
                gm, example_inputs, fw_compiler=keep(self.fw), bw_compiler=keep(self.bw),
                partition_fn=min_cut_rematerialization_partition, keep_inference_input_mutations=True,
            )  # fmt: skip

        backend.inner_compile = inner
        return self

    def __exit__(self, *exc) -> None:
        from tilecompile import backend

        backend.inner_compile = self._saved
