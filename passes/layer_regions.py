"""Checkpointed layers with identical bodies -> one shared region (``invoke_subgraph``): compiled once, run N times.

Under activation checkpointing Dynamo gives each decoder layer its own ``tag_activation_checkpoint`` call and body.
AOTAutograd inlines every body into the joint graph, so AOTAutograd and Inductor trace, partition, lower and
generate code for the same layer 28 times; under dynamic shapes every one of those steps also evaluates symbolic
sizes. Here every group of call sites whose bodies are the same graph (node for node: targets, constants, the
shapes, dtypes and requires_grad of their inputs) and whose checkpoint options match becomes calls of one
``invoke_subgraph`` region that holds the checkpoint call. AOTAutograd traces the region's forward and backward once
(its partitioner keeps the checkpoint's recompute tags), and Inductor compiles the region once and calls it at
every site. What runs is the same: the same ops in the same order on the same operands.

Inductor binds a region's symbolic sizes from its inputs: a size that is an expression of a symbol (``s42 + 1``,
the token count when a loss input is one token shorter) needs the symbol itself among them. The root graph's
placeholder that binds each such symbol is passed to every call as an extra, unused operand.

Regions are made in the root graph only (the backend's undo restores the root). The backend lowers a graph through
``lower`` here, with its own lowering step: a region that fails to compile, forward or backward (the backward is
lowered at once then), is undone (``undo``) and the flat graph lowered instead.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from tilecompile import config, offload, reporting
from tilecompile import graph as fxgraph
from tilecompile.pass_api import PassContext, PassResult, snapshot_graph

NAME = "layer_regions"
_FLAT = "tilecompile_flat_graph"  # gm.meta key: the root graph before this pass (``undo``)
_REGION = "tilecompile_layer_region"  # region module meta: made here (the pass does not look inside it)
_names = itertools.count()


def _checkpoint_op():
    return torch.ops.higher_order.tag_activation_checkpoint


def _invoke_op():
    return torch.ops.higher_order.invoke_subgraph


def run(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    result = PassResult()
    if gm.meta.get(_REGION):
        return result
    sites = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is _checkpoint_op()]
    if not sites:
        return result
    for site in sites:
        result.consider(site, _candidate(site))
    if ctx.graph_name != "<root>":  # the backend's undo restores the root graph only
        _skip(result, gm, sites, "inside another higher-order op's body: regions are made in the root graph only")
        return result
    subclass = _subclass_input(gm)
    if subclass:  # AOTAutograd traces such a graph through the subclass, which invoke_subgraph has no rule for
        reason = f"the graph takes a tensor subclass ({subclass}): AOTAutograd cannot trace a region through it"
        _skip(result, gm, sites, reason)
        return result
    groups: dict[str, list[fx.Node]] = {}
    for site in sites:
        key, reason = _key(gm, site)
        if reason:
            _skip(result, gm, [site], reason)
        else:
            groups.setdefault(key, []).append(site)
    binders = _symbol_binders(gm)
    shared = []
    for group in groups.values():
        reason = _check_group(group, binders)
        if reason:
            _skip(result, gm, group, reason)
        else:
            shared.append(group)
    if not shared:
        return result
    gm.meta.setdefault(_FLAT, snapshot_graph(gm.graph))  # the first flat graph: a second run must undo to it
    for group in shared:
        paths = [_where(gm, site) for site in group]  # before the sites are replaced
        name = _share(gm, group, binders)
        detail = f"one of {len(group)} checkpointed layers that share one compiled region ({name})"
        for site, path in zip(group, paths):
            result.rewrote(site, reporting.Rewrite(NAME, path, detail=detail))
    for ref in [n for n in gm.graph.nodes if n.op == "get_attr" and not n.users]:  # the shared sites' old bodies
        gm.graph.erase_node(ref)
    return result


def _candidate(site: fx.Node) -> str:
    return f"checkpointed region {site.name}"


def _skip(result: PassResult, gm: fx.GraphModule, sites: list[fx.Node], reason: str) -> None:
    for site in sites:
        result.skip(site, reporting.Skip(NAME, _candidate(site), _where(gm, site), reason))


def undo(gm: fx.GraphModule) -> bool:
    """Puts back the flat root graph this pass replaced (True), or does nothing where it made no region (False)."""
    flat = gm.meta.pop(_FLAT, None)
    if flat is None:
        return False
    gm.graph = flat
    gm.recompile()
    return True


def _subclass_input(gm: fx.GraphModule) -> str:
    """The class name of a tensor-subclass input of ``gm`` (DTensor, a quantized weight), or ''."""
    for node in gm.graph.find_nodes(op="placeholder"):
        value = fxgraph.example_value(node)
        if isinstance(value, torch.Tensor) and is_traceable_wrapper_subclass(value):
            return type(value).__name__
    return ""


def forget(gm: fx.GraphModule) -> None:
    """Drops the flat graph kept for ``undo`` (the compile succeeded)."""
    gm.meta.pop(_FLAT, None)


def made(gm: fx.GraphModule) -> bool:
    """Whether this pass made regions in ``gm`` that ``undo`` can take back."""
    return _FLAT in gm.meta


def _where(gm: fx.GraphModule, site: fx.Node) -> str:
    """The module the checkpointed call ran (the call site itself carries no module stack): the longest module path
    its body's nodes share, e.g. ``model.layers.3``."""
    body = getattr(gm, site.args[0].target, None) if site.args and isinstance(site.args[0], fx.Node) else None
    if not isinstance(body, fx.GraphModule):
        return fxgraph.module_path(site)
    return fxgraph.common_module_path(n for n in body.graph.nodes if n.op == "call_function") or fxgraph.module_path(
        site
    )


def _key(gm: fx.GraphModule, site: fx.Node) -> tuple[str, str]:
    """(the site's grouping key, '') or ('', the reason it cannot be shared)."""
    body_ref = site.args[0] if site.args else None
    if not isinstance(body_ref, fx.Node) or body_ref.op != "get_attr":
        return "", "its body is not a submodule of the graph"
    body = getattr(gm, body_ref.target, None)
    if not isinstance(body, fx.GraphModule):
        return "", "its body is not a GraphModule"
    if not all(isinstance(a, fx.Node) for a in site.args[1:]):
        return "", "a constant operand (a region takes tensors and symbolic sizes)"
    index: dict[fx.Node, int] = {}
    parts: list[Any] = [repr(site.kwargs)]
    for i, node in enumerate(body.graph.nodes):
        index[node] = i
        if node.op == "placeholder":
            parts.append(("in", _describe(fxgraph.example_value(node))))
        elif node.op in ("get_attr", "call_module"):
            return "", f"its body reads a module attribute ({node.target}): not compared"
        elif _reads_value(node):
            return "", "its body reads a tensor's value on the host (.item(), e.g. a float Dynamo made a tensor)"
        else:
            args = fx.node.map_arg((node.args, node.kwargs), lambda n: _Ref(index[n]))
            parts.append((node.op, _target(node.target), repr(args)))
    return repr(parts), ""


class _Ref:
    """A node reference in a grouping key: its repr, ``%3``, is nothing a constant's repr can be."""

    def __init__(self, index: int) -> None:
        self.index = index

    def __repr__(self) -> str:
        return f"%{self.index}"


def _reads_value(node: fx.Node) -> bool:
    """``.item()`` / ``.tolist()`` and kin: AOTAutograd traces a region without the data-dependent scalars that
    reading a value makes (the flat graph turns such a float back into a tensor)."""
    if node.op == "call_method":
        return node.target in ("item", "tolist", "__float__", "__int__", "__bool__")
    return node.target in (torch.Tensor.item, torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default)


def _target(target: Any) -> str:
    if isinstance(target, str):
        return target
    return f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', repr(target))}@{id(target)}"


def _describe(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", type(value).__qualname__, str(tuple(value.shape)), str(value.stride()), str(value.dtype),
                str(value.device), value.requires_grad)  # fmt: skip
    if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
        return (type(value).__name__, str(value.node.expr))
    return ("value", repr(value))


def _symbol_binders(gm: fx.GraphModule) -> dict[Any, fx.Node]:
    """symbol -> the placeholder of ``gm`` that is that symbol (a SymInt input whose expression is one symbol)."""
    binders: dict[Any, fx.Node] = {}
    for node in gm.graph.nodes:
        value = fxgraph.example_value(node) if node.op == "placeholder" else None
        if isinstance(value, torch.SymInt) and value.node.expr.is_Symbol:
            binders.setdefault(value.node.expr, node)
    return binders


def _free_symbols(value: Any) -> set:
    symbols: set = set()
    if isinstance(value, torch.Tensor):
        for size in (*value.shape, *value.stride()):
            if isinstance(size, torch.SymInt):
                symbols |= size.node.expr.free_symbols
    elif isinstance(value, torch.SymInt):
        symbols |= value.node.expr.free_symbols
    return symbols


def _needed_symbols(group: list[fx.Node]) -> set:
    needed: set = set()
    for site in group:
        for operand in site.args[1:]:
            needed |= _free_symbols(fxgraph.example_value(operand))
    return needed


def _check_group(group: list[fx.Node], binders: dict[Any, fx.Node]) -> str:
    if len(group) < 2:
        return "no other checkpointed region has the same body: nothing to share"
    for site in group:
        for operand in site.args[1:]:
            value = fxgraph.example_value(operand)
            if not isinstance(value, torch.Tensor | torch.SymInt):
                return f"operand {operand.name} is neither a tensor nor a symbolic size"
            if is_traceable_wrapper_subclass(value):
                return f"operand {operand.name} is a tensor subclass ({type(value).__name__})"
    unbound = [s for s in _needed_symbols(group) if s not in binders]
    if unbound:
        return f"symbolic sizes {sorted(map(str, unbound))} have no input of their own to bind them in the region"
    if any(isinstance(o, fx.Node) and o.op == "placeholder" for o in _outputs(_body(group[0]))[0]):
        return "the body returns one of its inputs (a region's outputs must be new tensors)"
    return ""


def _body(site: fx.Node) -> fx.GraphModule:
    return site.graph.owning_module.get_submodule(site.args[0].target)


def _outputs(body: fx.GraphModule) -> tuple[tuple, bool]:
    """(what ``body`` returns, as a tuple; whether it returns one value rather than a tuple or list)."""
    out = body.graph.output_node().args[0]
    return (tuple(out), False) if isinstance(out, tuple | list) else ((out,), True)


def _pruned(body: fx.GraphModule) -> tuple[fx.GraphModule, list[int]]:
    """A copy of ``body`` without the inputs it does not read (a float the backend made a constant: the region
    would carry it for nothing), and the positions of those it keeps."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(body.graph, {}))
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    used = [i for i, ph in enumerate(inputs) if ph.users]
    for ph in inputs:
        if not ph.users:
            graph.erase_node(ph)
    return fx.GraphModule(body, graph, class_name=type(body).__name__), used


def _share(gm: fx.GraphModule, group: list[fx.Node], binders: dict[Any, fx.Node]) -> str:
    """One region module for ``group``; every site becomes a call of it. Returns the region's name."""
    first = group[0]
    body, used = _pruned(_body(first))
    for node in body.graph.nodes:  # the memory plan's tags in a body are per call; the region's are on its calls
        custom = node.meta.get("custom") or {}
        if offload.TAG in custom:
            node.meta["custom"] = {k: v for k, v in custom.items() if k not in (offload.TAG, offload.TAG_INDEX)}
    symbols = [binders[s] for s in sorted(_needed_symbols(group), key=str)]
    graph = fx.Graph()
    inputs = [graph.placeholder(f"arg{i}") for i in range(len(used))]
    for i, sym in enumerate(symbols):  # unused by the body: they bind the symbols of the inputs' sizes
        graph.placeholder(f"sym{i}").meta["example_value"] = fxgraph.example_value(sym)
    for ph, i in zip(inputs, used):
        ph.meta["example_value"] = fxgraph.example_value(first.args[1 + i])
    root = torch.nn.Module()
    root.body = body
    call = graph.call_function(_checkpoint_op(), (graph.get_attr("body"), *inputs), dict(first.kwargs))
    outs, single = _outputs(body)
    if single:
        graph.output((call,))
    else:
        graph.output(tuple(graph.call_function(operator.getitem, (call, i)) for i in range(len(outs))))
    region = fx.GraphModule(root, graph, class_name="LayerRegion")
    region.meta[_REGION] = True
    name = f"tilecompile_layers_{next(_names)}"
    while hasattr(gm, name):
        name = f"tilecompile_layers_{next(_names)}"
    gm.add_submodule(name, region)
    for site in group:
        with gm.graph.inserting_before(site):
            ref = gm.graph.get_attr(name)
            operands = [site.args[1 + i] for i in used]
            new = gm.graph.call_function(_invoke_op(), (ref, name, *operands, *symbols))
        new.meta.update(site.meta)
        mark = (site.meta.get("custom") or {}).get(offload.REGION)
        if mark is not None:  # the memory plan offloads these operands: the partition finds the region's copies
            layer, positions = mark
            kept = tuple(used.index(p) for p in positions if p in used)
            new.meta["custom"] = {**site.meta["custom"], offload.REGION: (layer, kept)}
        if single:
            new.meta["example_value"] = (site.meta.get("example_value"),)
            with gm.graph.inserting_after(new):
                item = gm.graph.call_function(operator.getitem, (new, 0))
            item.meta.update(site.meta)
            site.replace_all_uses_with(item)
        else:
            site.replace_all_uses_with(new)
        gm.graph.erase_node(site)
    return name


# ------------------------------------------------------------------------------------------------- lowering


def lower(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    settings: config.Settings,
    mode: str | None,
    options: dict[str, Any],
    graph_name: str,
    lower: Callable[..., Any],
) -> Callable[..., Any]:
    """Lower ``gm`` with the backend's lowering step ``lower`` (its inner compile, or DDP's split). A graph with shared
    layer regions is compiled with
    its backward lowered at once (not at the first ``backward()``); where that fails, the regions are undone and the
    flat graph compiled, after one warning, so that a torch version whose AOTAutograd or Inductor cannot take a region
    costs a compile, not the user's step. Strict mode raises instead. Dynamo's restarts and running out of memory pass
    through."""
    if not made(gm):
        return lower(gm, example_inputs, settings.inner, mode, options)
    if conflict := region_conflict(settings, options):
        undo(gm)
        reporting.decline(NAME, graph_name, "checkpointed layer", conflict)
        return lower(gm, example_inputs, settings.inner, mode, options)
    try:
        with _backward_lowered_at_once():
            compiled = lower(gm, example_inputs, settings.inner, mode, region_workarounds(settings, options))
    except (torch._dynamo.exc.RestartAnalysis, torch.OutOfMemoryError):
        raise
    except Exception as exc:
        if settings.strict:
            raise
        undo(gm)
        compiled = lower(gm, example_inputs, settings.inner, mode, options)  # raises on its own error
        text = str(exc).strip()
        reason = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
        reporting.withdraw(NAME, graph_name, reason)
        warnings.warn(
            f"tilecompile: {settings.inner} could not compile the shared layer regions of {graph_name} ({reason}); "
            "the layers were compiled one by one instead. TILECOMPILE_LAYER_REGIONS=0 skips the attempt.",
            stacklevel=2,
        )
        return compiled
    forget(gm)
    return compiled


def region_workarounds(settings: config.Settings, options: dict[str, Any]) -> dict[str, Any]:
    """Inductor settings a graph with shared layer regions needs: ``reorder_for_peak_memory`` off.

    Inductor's reordering for peak memory gets gradients wrong around invoke_subgraph calls. Through Inductor's CPU
    backend (torch 2.13), an HF Qwen2 step whose logits also feed a second loss term had its attention weights'
    gradients off by about 5e-2 (cosine 0.5 against eager), static and dynamic (tests/test_layer_regions.py). On the
    H200 (torch 2.11), the 28-layer 1.5B step's layer-norm weights were off by up to 0.95 relative (cosine 0.79;
    benchmarks/probe_regions_grads.py). With the setting off, or without the regions, the gradients match eager's."""
    if settings.inner != "inductor" or "reorder_for_peak_memory" in options:
        return options
    return {**options, "reorder_for_peak_memory": False}


def region_conflict(settings: config.Settings, options: dict[str, Any]) -> str | None:
    """Why a graph's layer regions must be undone before its compile, or None: the user asked Inductor for
    ``reorder_for_peak_memory`` (see ``region_workarounds``), or the inner compiler is ``eager`` (no AOTAutograd to
    run an ``invoke_subgraph`` call under autograd), so the layers are compiled one by one instead."""
    if settings.inner == "inductor" and options.get("reorder_for_peak_memory"):
        return "reorder_for_peak_memory=True was asked for; Inductor's reordering gets gradients wrong around regions"
    if settings.inner == "eager":  # torch 2.13: "fake_mode should be enabled for HOPs" at the first step
        return ("the inner compiler 'eager' runs the graph as Dynamo gave it, and a region's call runs only through "
                "AOTAutograd")  # fmt: skip
    return None


def _backward_lowered_at_once():
    """AOTAutograd compiling the backward with the forward (torch 2.11 compiles it lazily for static shapes, and for
    dynamic ones retries a failed backward lazily): a backward that cannot take a region then fails here."""
    cfg = torch._functorch.config
    if not hasattr(cfg, "force_non_lazy_backward_lowering"):
        return contextlib.nullcontext()
    return cfg.patch(force_non_lazy_backward_lowering=True)
