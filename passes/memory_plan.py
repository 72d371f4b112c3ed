"""Memory as speed: a checkpointed layer is kept whole (its activations saved, nothing recomputed) where the memory
budget allows; the others stay checkpointed as the model asked.

A user turns activation checkpointing on so that the step fits. Where the device has room, the recompute is time
given away (about a tenth of the step for a dense model). With a budget (``memory_budget``: auto, the default, is
AUTO_FRACTION of a CUDA device's memory and no plan on a CPU; GiB when above 1; a fraction of the device's memory at
most 1; 0 plans nothing), this pass sizes each ``tag_activation_checkpoint`` call of the root graph from its fake
tensors:

- ``saved``: what checkpointing holds until the backward, the call's tensor inputs that are neither parameters nor
  read by another checkpointed call (the hidden state entering the layer);
- ``kept``: what the layer holds for its backward without checkpointing: ``saved`` and the computed tensors in the
  forward graph AOTAutograd's partitioner cuts from the body (the partition the inner compiler uses), traced once
  per distinct body; where that
  cannot be told (symbolic sizes), ``computed``, every floating tensor the body computes (views and casts of one
  tensor not counted twice), an upper bound.

The room is the budget less what the device holds when the graph is compiled (weights, and gradients where they
exist), three times the trainable weights set aside for the grads and optimizer states still to come, and a reserve
of the largest layer's ``computed`` (one layer's recompute or its backward's temporaries at a time). The
checkpointed inputs of every layer come first; layers are then kept from the last one (the first the backward
reaches) towards the first while the total fits. A kept layer's body is inlined into the root graph: AOTAutograd
saves what its backward needs and recomputes nothing, and the tiled MLP pass leaves its MLP (dense or experts)
whole (node meta ``KEPT``). Under dynamic shapes the sizes are symbolic: the plan is decided at the graph's hint
and guarded (``total <= room``), so a longer sequence that would not fit recompiles and is planned again. Without
checkpointing, the whole graph's ``computed`` is weighed against the room: where it fits, the MLPs stay untiled.

Where the checkpointed inputs alone exceed the room, every layer stays checkpointed and, with ``offload`` auto, the
inputs of as few layers as make the rest fit go to pinned host memory, from the first layer on (the last the
backward reaches), within the host budget (``host_budget``: auto is HOST_FRACTION of the host's available memory).
``offload`` all sends every layer's input to the host and keeps none; off (the default, until it is measured at
length on a GPU) sends none. The offload itself is a partition step of the inner compile (tilecompile/offload.py):
here the nodes that make those inputs are tagged, and the layer's call is marked with their positions among its
operands (for the layer region it may become, whose own saved copies the partition then offloads); the report's
offload lines that the partition did not carry out are turned into skips by the backend. Where the user's code
already offloads (saved-tensors hooks), the backend sees the hooks on the stack when it compiles: the plan then
leaves the layers checkpointed and says so.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import os
from typing import Any

import torch
import torch.fx as fx

from tilecompile import graph as fxgraph
from tilecompile import offload, ops, reporting
from tilecompile.pass_api import PassContext, PassResult

NAME = "memory_plan"
KEPT = "tilecompile_kept_layer"  # node.meta key: the node belongs to a layer this pass kept whole (its name)
GIB = 2**30
AUTO_FRACTION = 0.85  # the budget under auto: of a CUDA device's memory (the rest: the allocator's fragmentation)
HOST_FRACTION = 0.8  # the host budget under auto: of the host memory available when the graph is compiled
_NOT_COMPUTED = frozenset({"detach", "to", "float", "half", "bfloat16", "type_as", "contiguous", "clone"})


def _checkpoint_op() -> Any:
    return torch.ops.higher_order.tag_activation_checkpoint


@dataclasses.dataclass
class Layer:
    site: fx.Node  # the tag_activation_checkpoint call
    where: str
    saved: Any  # bytes (an int, or a SymInt under dynamic shapes)
    kept: Any  # what it saves for its backward without checkpointing (the partitioner's, or ``computed``)
    why_not: str | None = None  # why the layer cannot be kept, or None
    computed: Any = None  # every floating tensor its body computes: bounds one recompute's temporaries
    inputs: list[fx.Node] = dataclasses.field(default_factory=list)  # the root graph's nodes ``saved`` counts


@dataclasses.dataclass
class Plan:
    keep: list[int]  # indices of the layers kept whole
    room: int  # bytes the activations may take
    total: Any  # bytes the plan holds: every layer's saved, the kept layers' kept instead, and the reserve
    reserve: Any
    saved: Any  # every layer's saved bytes


def _bytes(value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return 0
    return value.numel() * value.element_size()


def _hint(n: Any) -> int:
    if not isinstance(n, torch.SymInt):
        return int(n)
    value = fxgraph.hint(n)
    if value is None:
        raise ValueError(f"no hint for the size {n}")
    return value


def gib(size: Any) -> str:
    """Bytes in words: GiB, MiB or KiB."""
    n = _hint(size)
    for unit, scale in (("GiB", GIB), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 2**10:.1f} KiB"


def body_of(gm: fx.GraphModule, site: fx.Node) -> fx.GraphModule | None:
    body = getattr(gm, site.args[0].target, None) if site.args and isinstance(site.args[0], fx.Node) else None
    return body if isinstance(body, fx.GraphModule) else None


def _is_parameter(node: Any) -> bool:
    value = fxgraph.example_value(node)
    return isinstance(value, torch.nn.Parameter) or (
        node.op in ("placeholder", "get_attr") and ("_parameters_" in node.name or "_buffers_" in node.name)
    )


def _computed(gm: fx.GraphModule) -> Any:
    """The sizes of the floating tensors ``gm`` computes (views and casts of one tensor counted once)."""
    for n in gm.graph.nodes:
        value = fxgraph.example_value(n)
        if n.op not in ("call_function", "call_method") or not isinstance(value, torch.Tensor):
            continue
        if value.is_floating_point() and not fxgraph.is_view_like(n) and fxgraph.op(n) not in _NOT_COMPUTED:
            yield _bytes(value)


def computed_bytes(body: fx.GraphModule) -> Any:
    """Every floating tensor the body computes: an upper bound on what its backward can save, and on its
    recompute's temporaries."""
    return sum(_computed(body), 0)


def _storage_base(n: fx.Node) -> fx.Node:
    """The node whose storage ``n`` views (through aten view ops, detach, _unsafe_view), or ``n``."""
    aliasing = (torch.ops.aten._unsafe_view.default, torch.ops.aten.detach.default)
    while (
        n.op == "call_function"
        and isinstance(n.target, torch._ops.OpOverload)
        and (getattr(n.target, "is_view", False) or n.target in aliasing)
        and n.args
        and isinstance(n.args[0], fx.Node)
    ):
        n = n.args[0]
    return n


def saved_by_autograd(body: fx.GraphModule, inner: str) -> int | None:
    """The bytes of computed tensors AOTAutograd saves for the body's backward without checkpointing, from the forward
    graph its partitioner cuts (Inductor's min-cut, or the default partition for other inner compilers) over the
    body's fake inputs; None where that cannot be told: symbolic sizes, no fake inputs, or a trace that fails."""
    from torch._functorch import partitioners
    from torch._functorch.aot_autograd import aot_module_simplified

    inputs = [fxgraph.example_value(n) for n in body.graph.find_nodes(op="placeholder")]
    if not inputs or not all(isinstance(v, torch.Tensor) for v in inputs):
        return None
    fake_mode = getattr(inputs[0], "fake_mode", None)
    if fake_mode is None or any(isinstance(d, torch.SymInt) for v in inputs for d in v.shape):
        return None
    outputs = next(n for n in body.graph.nodes if n.op == "output").args[0]
    user_outputs = len(outputs) if isinstance(outputs, (tuple, list)) else 1
    seen: list[int] = []

    def forward(fw: fx.GraphModule, _inputs: Any) -> Any:
        saved = next(n for n in fw.graph.nodes if n.op == "output").args[0][user_outputs:]
        # views share their base's storage, and the body's own inputs (weights, the hidden state, the mask) are held
        # anyway: the computed bases are the cost
        bases = {_storage_base(n) for n in saved if isinstance(n, fx.Node)}
        seen.append(sum(_bytes(b.meta.get("val")) for b in bases if b.op != "placeholder"))
        return fw.forward

    partition = (
        partitioners.min_cut_rematerialization_partition if inner == "inductor" else partitioners.default_partition
    )
    try:
        with torch._guards.tracing(torch._guards.TracingContext(fake_mode)), fake_mode:
            aot_module_simplified(
                body, inputs, fw_compiler=forward, bw_compiler=lambda g, _: g.forward, partition_fn=partition
            )
    except Exception:  # the upper bound stands in (the caller's fallback); the plan itself does not fail
        return None
    return seen[0] if seen and isinstance(seen[0], int) else None


def size_layers(gm: fx.GraphModule, sites: list[fx.Node], inner: str = "inductor") -> list[Layer]:
    readers: dict[fx.Node, int] = {}
    for site in sites:
        for a in set(site.all_input_nodes):
            readers[a] = readers.get(a, 0) + 1
    layers, by_body = [], {}
    for site in sites:
        inputs = [a for a in dict.fromkeys(site.all_input_nodes) if readers[a] == 1 and not _is_parameter(a)]
        inputs = [a for a in inputs if isinstance(fxgraph.example_value(a), torch.Tensor)]
        saved = sum((_bytes(fxgraph.example_value(a)) for a in inputs), 0)
        body = body_of(gm, site)
        computed, kept = 0, 0
        if body is not None:
            computed = computed_bytes(body)
            shapes = tuple(
                (tuple(v.shape), v.dtype, v.requires_grad) if isinstance(v := fxgraph.example_value(n), torch.Tensor)
                else None for n in body.graph.find_nodes(op="placeholder")
            )  # fmt: skip
            key = (body.code, str(shapes))  # identical layers are traced once (str: sizes may be symbolic)
            if key not in by_body:
                by_body[key] = saved_by_autograd(body, inner)
            kept = saved + by_body[key] if by_body[key] is not None else computed
        why_not = None
        if body is None:
            why_not = "its body is not a graph module"
        elif any(not (u.op == "call_function" and u.target is operator.getitem) for u in site.users):
            why_not = "its outputs are used other than one by one (getitem)"
        layers.append(Layer(site, _where(gm, site), saved, kept, why_not, computed, inputs))
    return layers


def _where(gm: fx.GraphModule, site: fx.Node) -> str:
    body = body_of(gm, site)
    if body is None:
        return fxgraph.module_path(site)
    return fxgraph.common_module_path(n for n in body.graph.nodes if n.op == "call_function") or site.name


def choose(layers: list[Layer], room: int) -> Plan:
    """Keep layers from the last while the total fits ``room`` at the sizes' hints."""
    saved = sum((layer.saved for layer in layers), 0)
    reserve = max((x.kept if x.computed is None else x.computed for x in layers), key=_hint, default=0)
    total = saved + reserve
    keep: list[int] = []
    for i in reversed(range(len(layers))):
        if layers[i].why_not is not None:
            continue
        extra = layers[i].kept - layers[i].saved
        if _hint(total + extra) > room:
            break
        total = total + extra
        keep.append(i)
    return Plan(sorted(keep), room, total, reserve, saved)


def trainable_bytes(gm: fx.GraphModule) -> int:
    """Bytes of the graph's parameters that require grad (at their hints)."""
    total = 0
    for n in gm.graph.nodes:
        value = fxgraph.example_value(n)
        if n.op in ("placeholder", "get_attr") and isinstance(value, torch.Tensor) and value.requires_grad:
            total += _hint(_bytes(value)) if _is_parameter(n) else 0
    return total


def host_room(setting: float | None) -> tuple[int, str]:
    """(bytes of host memory the offloaded inputs may take, words for the report): ``setting`` GiB, or under auto
    HOST_FRACTION of what the host has available now."""
    if setting is not None:
        return int(setting * GIB), f"host budget {gib(int(setting * GIB))}"
    available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    try:
        with open("/proc/meminfo") as f:  # MemAvailable counts the page cache the kernel can give back
            fields = dict(line.split(":", 1) for line in f)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        pass
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))  # the ranks on this host share it
    share = f", shared by {ranks} local ranks" if ranks > 1 else ""
    return int(HOST_FRACTION * available / ranks), f"{HOST_FRACTION:g} of the host's {gib(available)} available{share}"


def offload_sources(
    gm: fx.GraphModule, layer: Layer, sites: list[fx.Node], own: bool = False
) -> list[tuple[fx.Node, Any]] | str:
    """The nodes that make ``layer``'s checkpointed inputs (with the output index where the node is a call), or why
    it cannot be offloaded. An input that is an output of an earlier checkpointed call is made inside that call's
    body: both the call (its getitems carry its meta) and the body's node (AOTAutograd traces a checkpoint body node
    by node, each under its own meta) are returned. With ``own``, a body another call shares is copied first (to be
    tagged for this call only); without, nothing in ``gm`` changes."""
    if not layer.inputs:
        return "it has no checkpointed input of its own"
    found = []
    computed = computed_inputs(layer)  # the graph's inputs are held by the caller anyway
    if not computed:
        return "its input is an input of the compiled graph (held by the caller anyway: offloading frees nothing)"
    for a in computed:
        if a.op == "call_function" and a.target is operator.getitem and a.args[0] in sites:
            site, index = a.args[0], a.args[1]
            body = _own_body(gm, site, sites) if own else body_of(gm, site)
            result = next(n for n in body.graph.nodes if n.op == "output").args[0]
            made = result[index] if isinstance(result, (tuple, list)) else result
            if not isinstance(made, fx.Node) or made.op == "placeholder":
                return "its input passes through the previous layer unchanged"
            found += [(site, index), (made, None)]
        else:
            found.append((a, None))
    return found


def _own_body(gm: fx.GraphModule, site: fx.Node, sites: list[fx.Node]) -> fx.GraphModule:
    """``site``'s body, copied first where another call shares it (a tag on its nodes must be this call's only)."""
    holder = site.args[0]
    if not any(s is not site and s.args[0].target == holder.target for s in sites):
        return body_of(gm, site)
    copy = fx.GraphModule(body_of(gm, site), _copied_graph(body_of(gm, site)))
    name = f"{holder.target}_{site.name}".replace(".", "_")
    setattr(gm, name, copy)
    with gm.graph.inserting_before(site):
        own = gm.graph.get_attr(name)
    own.meta = dict(holder.meta)
    site.update_arg(0, own)
    return copy


def _copied_graph(body: fx.GraphModule) -> fx.Graph:
    graph = fx.Graph()
    graph.output(graph.graph_copy(body.graph, {}))  # node_copy copies each node's meta
    return graph


def computed_inputs(layer: Layer) -> list[fx.Node]:
    """``layer``'s checkpointed inputs that the graph computes (its own inputs are the caller's to hold)."""
    return [a for a in layer.inputs if a.op != "placeholder"]


def host_bytes(layer: Layer) -> Any:
    """What offloading ``layer`` moves: its computed checkpointed inputs (not the graph's own inputs)."""
    return sum((_bytes(fxgraph.example_value(a)) for a in computed_inputs(layer)), 0)


def choose_offload(layers: list[Layer], plan: Plan, room: int, host: int, every: bool, can: list[int]) -> list[int]:
    """The layers whose checkpointed inputs go to the host, from the first (the last the backward reaches: the most
    time to bring them back): every one that can under ``every``, else as few as make the checkpointed inputs and one
    recompute fit ``room``; within ``host`` bytes either way."""
    on_device, on_host, chosen = plan.saved + plan.reserve, 0, []
    for i in can:
        if not every and _hint(on_device) <= room:
            break
        moved = host_bytes(layers[i])
        if on_host + _hint(moved) > host:
            break
        chosen.append(i)
        on_device = on_device - moved
        on_host += _hint(moved)
    return chosen


def room_for(budget: float, device: torch.device, trainable: int = 0) -> tuple[int, str]:
    """(bytes the activations may take, words for the report) from the budget, what the device holds now, and the
    gradients and optimizer states still to come: estimated from above as three times the trainable weights (a grad
    and two Adam states of their dtype), whether or not some exist already."""
    if device.type == "cuda":
        capacity = torch.cuda.get_device_properties(device).total_memory
        held = torch.cuda.memory_allocated(device)
    else:
        capacity = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        held = 0
    limit = int(budget * GIB) if budget > 1 else int(budget * capacity)
    to_come = 3 * trainable
    words = f"budget {gib(limit)}" + (f", {gib(held)} held when compiled" if held else "")
    words += f", {gib(to_come)} set aside for grads and optimizer states" if to_come else ""
    return max(0, limit - held - to_come), words


def _budget(setting: float | None, device: torch.device) -> float:
    """The budget in force: the setting, or under auto AUTO_FRACTION of a CUDA device (0, no plan, on a CPU)."""
    if setting is not None:
        return setting
    return AUTO_FRACTION if device.type == "cuda" else 0.0


def _device(nodes: Any) -> torch.device:
    for n in nodes:
        value = fxgraph.example_value(n)
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


def graph_activations(gm: fx.GraphModule) -> tuple[Any, Any]:
    """(every floating tensor the graph computes, the largest of them): from above, what its backward could save,
    and one temporary of its own."""
    sizes = list(_computed(gm))
    return sum(sizes, 0), max(sizes, key=_hint, default=0)


def plan_uncheckpointed(gm: fx.GraphModule, settings: Any) -> None:
    """No checkpointed layer: where everything the graph computes fits the room, its nodes are marked ``KEPT``, so
    the tiled MLP pass leaves the MLPs whole (tiled, they recompute the gate and up projections in the backward)."""
    device = _device(gm.graph.find_nodes(op="placeholder"))
    budget = _budget(settings.memory_budget, device)
    if budget <= 0:
        return
    total, largest = graph_activations(gm)
    room, words = room_for(budget, device, trainable_bytes(gm))
    fits = _hint(total + largest) <= room
    if not isinstance(total, int):
        bool(total + largest <= room)  # a guard on the answer: a length on the other side of the fit re-plans
    if not fits:
        return
    subject = f"the whole graph (no checkpointing; at most {gib(total)} of activations, within the room of "
    subject += f"{gib(room)}: {words})"
    for n in gm.graph.nodes:
        if n.op == "call_function":
            n.meta[KEPT] = subject


def run(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    result = PassResult()
    if ctx.settings.memory_budget == 0 or ctx.graph_name != "<root>":  # no plan: the model's checkpointing as it is
        return result
    sites = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is _checkpoint_op()]
    hooked = ops.user_saved_tensors_hooks()
    if not sites:
        if not hooked:
            plan_uncheckpointed(gm, ctx.settings)
        return result
    device = _device(a for site in sites for a in site.all_input_nodes)
    budget = _budget(ctx.settings.memory_budget, device)
    if budget <= 0:
        return result
    layers = size_layers(gm, sites, ctx.settings.inner)
    for layer in layers:
        result.consider(layer.site, f"checkpointed layer {layer.where}")
    if hooked:
        reason = ("checkpointed, as the model asks: the step runs under saved-tensors hooks (the user's code offloads "
                  "or packs what the backward saves), which the plan leaves alone")  # fmt: skip
        for layer in layers:
            result.skip(layer.site, reporting.Skip(NAME, f"checkpointed layer {layer.where}", layer.where, reason))
        return result
    room, words = room_for(budget, device, trainable_bytes(gm))
    every = ctx.settings.offload == "all"
    plan = choose(layers, room)
    if every:  # every checkpointed input to the host, nothing kept: the offload measured on its own
        plan.keep, plan.total = [], plan.saved + plan.reserve
    if plan.keep:
        bool(plan.total <= room)  # under dynamic shapes: a guard, so a length the plan does not fit re-plans
    elif not isinstance(plan.saved + plan.reserve, int) and not every:
        bool(plan.saved + plan.reserve + (layers[-1].kept - layers[-1].saved) > room)
    over = _hint(plan.saved + plan.reserve) > room
    offloaded: list[int] = []
    sources: dict[int, Any] = {}
    host, host_words = 0, ""
    if every or (over and ctx.settings.offload == "auto" and not plan.keep):
        host, host_words = host_room(ctx.settings.host_budget)
        sources = {i: offload_sources(gm, layer, sites) for i, layer in enumerate(layers)}
        can = [i for i, found in sources.items() if not isinstance(found, str)]
        offloaded = choose_offload(layers, plan, room, host, every, can)
        moved = sum((host_bytes(layers[i]) for i in offloaded), 0)
        left = plan.saved + plan.reserve - moved
        if offloaded and not every and not isinstance(left, int):
            bool(left <= room)  # a length the offload no longer covers re-plans
        if offloaded and not isinstance(moved, int):
            bool(moved <= host)  # nor one past the host budget
    elif ctx.settings.offload == "auto" and not plan.keep and not isinstance(plan.saved + plan.reserve, int):
        bool(plan.saved + plan.reserve <= room)  # a length whose inputs no longer fit re-plans (and offloads)
    on_host = sum((_hint(host_bytes(layers[i])) for i in offloaded), 0)
    for i, layer in enumerate(layers):
        if i in plan.keep or i in offloaded:
            continue
        if layer.why_not is not None and not over:
            reason = f"checkpointed: it cannot be kept whole ({layer.why_not})"
        elif (offloaded or every) and isinstance(sources.get(i), str):
            reason = f"checkpointed on the device: its input cannot go to the host ({sources[i]})"
        elif every or (offloaded and on_host + _hint(host_bytes(layer)) > host):
            reason = (f"checkpointed on the device: the host budget ({gib(host)}; {host_words}) holds no more than "
                      f"the {len(offloaded)} earlier layers' inputs ({gib(on_host)})")  # fmt: skip
        elif offloaded:
            reason = (f"checkpointed on the device: with the inputs of {len(offloaded)} earlier layers on the host "
                      f"({gib(on_host)}), the rest fits the room of {gib(room)} ({words})")  # fmt: skip
        elif over:
            why = {"off": "offload is off (TILECOMPILE_OFFLOAD=off)"}.get(ctx.settings.offload)
            if why is None and sources:
                why = (f"no layer's input can go to the host ({sources[i]})" if isinstance(sources[i], str) else
                       f"the host budget ({gib(host)}; {host_words}) holds none of them")  # fmt: skip
            reason = (f"checkpointed: the layers' checkpointed inputs ({gib(plan.saved)}) and one layer's recompute "
                      f"({gib(plan.reserve)}) already exceed the room ({gib(room)}; {words}); "
                      f"{why or 'keeping a layer whole would only add to that'}")  # fmt: skip
        else:
            reason = (f"checkpointed: keeping it too would add about {gib(layer.kept - layer.saved)} to the plan's "
                      f"{gib(plan.total)}, past the room of {gib(room)} ({words})")  # fmt: skip
        result.skip(layer.site, reporting.Skip(NAME, f"checkpointed layer {layer.where}", layer.where, reason))
    for i in plan.keep:
        layer = layers[i]
        inline(gm, layer.site, layer.where)
        detail = (f"kept whole: its activations saved (about {gib(layer.kept)}), nothing recomputed; "
                  f"{len(plan.keep)} of {len(layers)} layers kept, the plan holds about {gib(plan.total)} of the "
                  f"room's {gib(room)} ({words})")  # fmt: skip
        result.rewrote(layer.site, reporting.Rewrite(NAME, layer.where, detail=detail))
    for i in offloaded:
        layer = layers[i]
        for node, index in offload_sources(gm, layer, sites, own=True):
            offload.tag(node, layer.where, index)
        layer.site.meta[offload.LAYER] = True
        computed = computed_inputs(layer)  # their positions, for the layer region the call may become
        offload.mark_operands(layer.site, layer.where, [p for p, a in enumerate(layer.site.args[1:]) if a in computed])
        because = ("offload=all" if every else
                   f"the layers' checkpointed inputs ({gib(plan.saved)}) and one layer's recompute "
                   f"({gib(plan.reserve)}) exceed the room ({gib(room)}; {words})")  # fmt: skip
        detail = (f"checkpointed, its input ({gib(host_bytes(layer))}) offloaded to host memory from the forward to "
                  f"the backward: {because}; {len(offloaded)} of {len(layers)} layers offloaded, {gib(on_host)} on "
                  f"the host ({host_words})")  # fmt: skip
        result.rewrote(layer.site, reporting.Rewrite(NAME, layer.where, detail=detail))
    if plan.keep:
        fxgraph.eliminate_dead_code(gm.graph)
    return result


def inline(gm: fx.GraphModule, site: fx.Node, name: str) -> None:
    """Replace the checkpoint call ``site`` by its body's nodes, each marked ``KEPT``; its getitems by the values."""
    body = body_of(gm, site)
    inputs = iter(site.args[1:])
    env: dict[fx.Node, Any] = {}
    outputs: Any = None
    for n in body.graph.nodes:
        if n.op == "placeholder":
            env[n] = next(inputs)
        elif n.op == "output":
            outputs = fx.node.map_arg(n.args[0], env.__getitem__)
        else:
            with gm.graph.inserting_before(site):
                if n.op == "get_attr":  # a nested module of the body: carried over under a fresh name
                    attr = f"{site.name}_{n.target}".replace(".", "_")
                    setattr(gm, attr, functools.reduce(getattr, n.target.split("."), body))
                    new = gm.graph.get_attr(attr)
                    new.meta = dict(n.meta)
                else:
                    new = gm.graph.node_copy(n, env.__getitem__)
            new.meta[KEPT] = f"layer {name}"
            env[n] = new
    for user in list(site.users):  # getitems only (size_layers)
        user.replace_all_uses_with(outputs[user.args[1]])
        gm.graph.erase_node(user)
    holder = site.args[0]
    gm.graph.erase_node(site)
    if not holder.users:  # the body is gone from the graph: no pass should rewrite it again
        gm.graph.erase_node(holder)
        delattr(gm, holder.target)
