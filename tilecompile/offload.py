"""Checkpointed inputs offloaded to host memory: the partition step that puts ``tilecompile::offload`` and
``tilecompile::reload`` (tilecompile/ops/offload.py) into the compiled forward and backward graphs.

The memory plan (passes/memory_plan.py) tags, in the Dynamo graph, the node that makes a checkpointed layer's input
(``node.meta["custom"][TAG]``: the layer's name). AOTAutograd copies a node's ``custom`` meta to every node it
traces from it, and its partitioner's forward and backward graphs keep it; so after the partition (the inner
compiler's own: Inductor's min-cut, or the default one for ``aot_eager``), the tensors the forward saves for the
backward that carry the tag are the layers' inputs. A layer region's call (passes/layer_regions.py) saves the
operands its backward needs again, as outputs of its own; where the memory plan marked the layer's call with the
positions of its offloaded operands (``mark_operands``), those outputs are the layers' inputs too (``region_input``).
Each one that is a computed, contiguous tensor (not a graph input, not a view, not also a user output) is then:

- in the forward: copied to the host after its last use there (``offload``), the host copy saved in its place;
  each offload holds the previous one's input until its own call, the last waits for its copy (see the ops);
- in the backward: brought back before its first use (``reload``), which prefetches the next one the backward will
  reload (the placeholders' order of first use).

``partition(base)`` wraps a partition function for ``aot_autograd``; ``InductorPartitioner`` is the same for
Inductor's ``custom_partitioner_fn``. ``take_offloaded()`` tells the backend what the last partitions offloaded, by
layer, so the report says only what happened.
"""

from __future__ import annotations

import functools
import operator
import pathlib
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomPartitionerFn, get_hash_for_files

from tilecompile.ops import offload as _ops  # noqa: F401 - registers tilecompile::offload and tilecompile::reload

TAG = "tilecompile_offload"  # node.meta["custom"] key: the checkpointed layer whose input the node makes
LAYER = "tilecompile_offloaded_layer"  # node.meta key: a checkpoint call whose input goes to the host
TAG_INDEX = "tilecompile_offload_index"  # which output of the node (a call's getitem), or None: the node itself
# node.meta["custom"] key on an offloaded layer's checkpoint call, and on the layer-region call made of it:
# (the layer, the positions of its offloaded inputs among the call's operands)
REGION = "tilecompile_offload_operands"

_done: dict[str, int] = {}  # layer -> host bytes (at the sizes' hints), of the partitions since the last take


def tag(node: fx.Node, layer: str, index: int | None = None) -> None:
    """Marks ``node`` as making ``layer``'s input; ``index``: the input is output ``index`` of the call ``node``
    (the getitems AOTAutograd makes of a layer region's call carry the call's meta, its saved tensors' too)."""
    node.meta["custom"] = {**(node.meta.get("custom") or {}), TAG: layer, TAG_INDEX: index}


def mark_operands(site: fx.Node, layer: str, positions: list[int]) -> None:
    """Marks the checkpoint call ``site`` of ``layer`` with the positions (among its operands, the body left out) of
    the inputs to offload: where the call becomes a layer region's call, the region saves those operands as outputs
    of its own, and the partition finds them by this mark (``region_input``)."""
    site.meta["custom"] = {**(site.meta.get("custom") or {}), REGION: (layer, tuple(positions))}


def region_input(gm: fx.GraphModule, n: fx.Node) -> tuple[str, fx.Node] | None:
    """(the layer, the operand) where ``n`` is an output of a marked layer region's call that is one of the
    region's marked operands, saved again (a region's forward returns the operands its backward needs), else None."""
    if n.op != "call_function" or n.target is not operator.getitem:
        return None
    call, j = n.args
    if not isinstance(call, fx.Node) or call.target is not torch.ops.higher_order.invoke_subgraph:
        return None
    mark = (call.meta.get("custom") or {}).get(REGION)
    sub = getattr(gm, call.args[0].target, None) if isinstance(call.args[0], fx.Node) else None
    if mark is None or not isinstance(sub, fx.GraphModule):
        return None
    results = sub.graph.find_nodes(op="output")[0].args[0]
    made = results[j] if isinstance(results, (tuple, list)) and j < len(results) else None
    if not isinstance(made, fx.Node) or made.op != "placeholder":
        return None
    k = sub.graph.find_nodes(op="placeholder").index(made)
    operand = call.args[2 + k] if k in mark[1] and 2 + k < len(call.args) else None
    return (mark[0], operand) if isinstance(operand, fx.Node) else None


def tagged(gm: fx.GraphModule) -> dict[str, fx.Node]:
    """The layers whose input ``gm`` tags, and the tagged nodes."""
    return {n.meta["custom"][TAG]: n for n in gm.graph.nodes if TAG in (n.meta.get("custom") or {})}


def take_offloaded() -> dict[str, int]:
    """The layers the partitions since the last call offloaded, with their host bytes; forgets them."""
    done = dict(_done)
    _done.clear()
    return done


def _is_view(n: fx.Node) -> bool:
    return isinstance(n.target, torch._ops.OpOverload) and bool(getattr(n.target, "is_view", False))


def _last_uses(n: fx.Node) -> list[fx.Node]:
    """The nodes that read ``n`` in its graph, through views of it (a view keeps its base alive)."""
    found: list[fx.Node] = []
    for user in n.users:
        if user.op == "output":
            continue
        found.append(user)
        if _is_view(user):
            found.extend(_last_uses(user))
    return found


def _hint_bytes(value: torch.Tensor) -> int:
    from tilecompile import graph as fxgraph

    numel = 1
    for d in value.shape:
        numel *= d if isinstance(d, int) else (fxgraph.hint(d) or 0)
    return numel * value.element_size()


def apply(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int) -> dict[str, int]:
    """Offloads the tagged tensors ``fw`` saves for ``bw``; returns the layers done with their bytes."""
    output = fw.graph.find_nodes(op="output")[0]
    outputs = list(output.args[0])
    users_see = {n for n in outputs[:num_fwd_outputs] if isinstance(n, fx.Node)}
    placeholders = {p.name: p for p in bw.graph.find_nodes(op="placeholder")}
    chosen: list[fx.Node] = []
    layer_of: dict[fx.Node, str] = {}
    saved = [n for n in dict.fromkeys(outputs[num_fwd_outputs:]) if isinstance(n, fx.Node)]
    regions = {n: r for n in saved if (r := region_input(fw, n)) is not None}
    also_read = {n: operand for n, (_, operand) in regions.items()}  # a region's copy -> its operand (one storage)
    # an operand saved itself as well as through a region's copy: offloading either leaves the other on the device
    both = {operand for operand in also_read.values() if operand in saved}
    for n in saved:
        if n in both or also_read.get(n) in both:
            continue
        if n in regions:  # a layer region's own copy of its offloaded input
            layer_of[n] = regions[n][0]
        elif TAG in (n.meta.get("custom") or {}):
            index = n.meta["custom"].get(TAG_INDEX)
            if index is not None and not (n.target is operator.getitem and n.args[1] == index):
                continue  # another output of the tagged call: what the region saves for itself, not the layer's input
            layer_of[n] = n.meta["custom"][TAG]
        else:
            continue
        value = n.meta.get("val")
        operand = also_read.get(n)
        if (
            n in users_see
            or (operand is not None and (operand in users_see or operand.op == "placeholder"))
            or n.op == "placeholder"
            or _is_view(n)
            or not isinstance(value, torch.Tensor)
            or not value.is_contiguous()
            or n.name not in placeholders
            or not placeholders[n.name].users  # saved, but the backward never reads it: nothing to offload
        ):
            continue
        chosen.append(n)
    if not chosen:
        return {}
    order = {n: i for i, n in enumerate(fw.graph.nodes)}

    def readers(n: fx.Node) -> list[fx.Node]:  # a region's copy shares its operand's storage: both must be done
        return _last_uses(n) + (_last_uses(also_read[n]) if n in also_read else [])

    points = sorted(((max([order[n]] + [order[u] for u in readers(n)]), n) for n in chosen),
                    key=lambda p: p[0])  # fmt: skip
    hosts: dict[fx.Node, fx.Node] = {}
    previous, last, last_at = None, None, -1
    nodes = list(fw.graph.nodes)
    for i, (at, n) in enumerate(points):
        anchor = last if last is not None and last_at == at else nodes[at]  # two with one last reader: in order
        with fw.graph.inserting_after(anchor):
            args = (n, previous, last, i == len(points) - 1)  # `last`: orders the calls, as the waits assume
            host = fw.graph.call_function(torch.ops.tilecompile.offload.default, args)
        host.meta.update(custom=n.meta.get("custom"), val=n.meta["val"].to("cpu"))
        hosts[n] = host
        previous, last, last_at = n, host, at
    saved = [hosts.get(x, x) if isinstance(x, fx.Node) else x for x in outputs[num_fwd_outputs:]]
    output.update_arg(0, tuple(outputs[:num_fwd_outputs] + saved))

    border = {n: i for i, n in enumerate(bw.graph.nodes)}
    firsts = sorted(((min(border[u] for u in placeholders[n.name].users), placeholders[n.name], n) for n in chosen),
                    key=lambda f: f[0])  # fmt: skip
    bnodes = list(bw.graph.nodes)
    done: dict[str, int] = {}
    reloads: set[fx.Node] = set()
    back = None
    for i, (at, p, n) in enumerate(firsts):
        following = firsts[i + 1][1] if i + 1 < len(firsts) else None
        value = p.meta["val"]
        with bw.graph.inserting_before(bnodes[at]):  # one first user for two: inserted in this order before it
            args = (p, following, back, value.device)  # `back`, the previous reload: orders the calls
            back = bw.graph.call_function(torch.ops.tilecompile.reload.default, args)
        back.meta["val"] = value
        reloads.add(back)
        p.replace_all_uses_with(back, delete_user_cb=lambda u: u not in reloads)  # a reload's `next` stays on the host
        p.meta["val"] = value.to("cpu")
        p.meta.pop("tensor_meta", None)  # the device's; nothing here needs it again
        layer = layer_of[n]
        done[layer] = done.get(layer, 0) + _hint_bytes(value)
    for gm in (fw, bw):
        gm.graph.lint()
        gm.recompile()
    return done


def partition(base: Callable[..., Any]) -> Callable[..., Any]:
    """``base`` (a partition function of ``aot_autograd``), then the offload of the tagged saved tensors."""

    @functools.wraps(base)
    def partition_fn(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> tuple[fx.GraphModule, ...]:
        fw, bw = base(joint, joint_inputs, **kwargs)
        _done.update(apply(fw, bw, kwargs["num_fwd_outputs"]))
        return fw, bw

    return partition_fn


class InductorPartitioner(CustomPartitionerFn):
    """Inductor's ``custom_partitioner_fn``: its min-cut partition, then the offload (module level: Inductor's
    caches pickle the config)."""

    def __call__(self, gm: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> tuple[fx.GraphModule, ...]:
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        return partition(min_cut_rematerialization_partition)(gm, joint_inputs, **kwargs)

    def uuid(self) -> Any:
        here = pathlib.Path(__file__)
        return get_hash_for_files((str(here), str(here.parent / "ops" / "offload.py")))
