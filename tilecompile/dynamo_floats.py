"""Dynamo's symbolic floats under ``dynamic=True``: which to make constants before AOTAutograd sees the graph.

Two steps run on every graph before the passes (``specialize_floats``), and one after the inner compile
(``forget_specialized_floats``): a module's float attributes (an RMSNorm's eps, attention's scaling) become guarded
constants (``specialize_module_floats``, switched by ``specialize_module_floats``), and floats that AOTAutograd
would restart Dynamo for are specialized now instead (``specialize_untensorifiable_floats``). Each function's
docstring says why; the backend (``tilecompile/backend.py``) calls them.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.fx as fx

from tilecompile import config

log = logging.getLogger("tilecompile")


def specialize_floats(gm: fx.GraphModule, settings: config.Settings) -> None:
    """``specialize_module_floats`` (if on), then ``specialize_untensorifiable_floats``; should either fail (torch's
    internals differ), the graph compiles as before (floats symbolic, Dynamo restarting for some)."""
    steps = [specialize_module_floats] if settings.specialize_module_floats else []
    for step in (*steps, specialize_untensorifiable_floats):
        try:
            step(gm)
        except Exception as exc:  # noqa: BLE001 - a missed saving, never a failed compile
            if settings.strict:
                raise
            log.info("%s failed (%s: %s); floats stay symbolic", step.__name__, type(exc).__name__, exc)


# (Dynamo's frame id, source) of a module's float -> the value it was specialized to, and the floats that a recompile
# of the same frame saw with another value (a schedule written into a module attribute): those stay symbolic from
# then on, one recompile rather than one per value.
_MODULE_FLOATS: dict[tuple[int | None, str], float] = {}
_VARYING: set[tuple[int | None, str]] = set()
# symbols this compile told AOTAutograd not to tensorify. TensorifyState is global and outlives the compile, and its
# names recur (a recompile of the frame, another frame's float): Dynamo would specialize those at their next trace.
_TOLD: set[str] = set()


def _specialize(memo: torch.SymFloat, symbol: str) -> float:
    """``memo``'s value, guarded (a change recompiles), and AOTAutograd told not to tensorify (or restart for) it."""
    from torch._dynamo.symbolic_convert import TensorifyState
    from torch.fx.experimental.symbolic_shapes import guard_scalar

    value = float(guard_scalar(memo))
    TensorifyState.specialize(symbol)
    _TOLD.add(symbol)
    return value


def forget_specialized_floats() -> None:
    """After the inner compile (AOTAutograd's tensorify pass has read them): this compile's names leave
    TensorifyState, so that no later trace specializes a float of the same name unasked."""
    from torch._dynamo.symbolic_convert import TensorifyState

    TensorifyState.force_specializations.difference_update(_TOLD)
    _TOLD.clear()


def _float_placeholders(gm: fx.GraphModule):
    """(placeholder, its SymFloat, the symbol's name) for each float Dynamo made a symbolic graph input."""
    for ph in gm.graph.find_nodes(op="placeholder"):
        memo = getattr(ph.meta.get("example_value"), "item_memo", None)
        symbol = getattr(getattr(memo, "node", None), "_expr", None)
        if isinstance(memo, torch.SymFloat) and hasattr(symbol, "name"):
            yield ph, memo, symbol.name


def specialize_module_floats(gm: fx.GraphModule) -> list[str]:
    """Under ``dynamic=True``, replace each float attribute of an ``nn.Module`` (or an item of one, as
    ``_is_module_attribute`` reads it) by its value, guarded; returns the symbols specialized.

    Such a float (an RMSNorm's eps, attention's ``scaling``, RoPE's ``attention_scaling``) enters the Dynamo graph
    as a 0-d float64 CPU tensor placeholder read by ``.item()``. AOTAutograd turns the tensor math on it into ops
    on that CPU tensor (``_tensorify_python_scalars``), so Inductor compiles C++ kernels for them beside the GPU's
    and every kernel that reads one takes it as an argument instead of a literal. A static compile treats these
    floats as constants; modules do not change them from step to step. Each ``.item()`` of the placeholder (in the
    graph or in an activation-checkpoint body) is replaced by the value, with ``guard_scalar``'s value guard (a
    changed value recompiles) and ``TensorifyState.specialize`` (so that AOTAutograd does not restart Dynamo for
    the float no node reads any more). A float whose value changed since it was last specialized stays symbolic.
    Floats passed as arguments (a temperature, a coefficient) are left alone, and so is every float when the compile
    assumes static shapes (``dynamic=None``): Dynamo makes a float symbolic there only after its value changed.
    """
    from torch._dynamo.symbolic_convert import TensorifyState

    if torch._dynamo.config.assume_static_by_default:  # dynamic=None: a float is symbolic only once it has changed
        return []
    compile_id = torch._guards.CompileContext.current_compile_id()
    frame, done = getattr(compile_id, "frame_id", None), []
    if getattr(compile_id, "frame_compile_id", None) == 0:  # a frame's first compile (ids restart at dynamo.reset())
        for known in [k for k in (*_MODULE_FLOATS, *_VARYING) if k[0] == frame]:
            _MODULE_FLOATS.pop(known, None)
            _VARYING.discard(known)
    for ph, memo, symbol in _float_placeholders(gm):
        source = getattr(ph.meta.get("grapharg"), "source", None)
        items = _item_uses(gm, ph) if _is_module_attribute(source) else None
        if items is None or TensorifyState.should_specialize(symbol):
            continue
        name = source.name  # a method before torch 2.12, a property since
        key = (frame, name() if callable(name) else name)
        if key in _MODULE_FLOATS and _MODULE_FLOATS[key] != float(memo.node.hint):
            _VARYING.add(key)
        if key in _VARYING:
            continue  # it varies: symbolic, as torch keeps it
        _MODULE_FLOATS[key] = value = _specialize(memo, symbol)
        for module, item in items:
            item.replace_all_uses_with(value)  # type: ignore[arg-type]  # FX puts a constant in its place as well
            module.graph.erase_node(item)
        for module in {id(m): m for m, _ in items}.values():
            module.recompile()
        done.append(symbol)
    if done:
        log.debug("specialized %d module floats to guarded constants: %s", len(done), done)
    return done


def _is_module_attribute(source: Any) -> bool:
    """``source`` reads an attribute of an ``nn.Module`` (Dynamo's guard source of a module, FSDP's included), or an
    item of a dict, list or tuple such an attribute holds (PEFT's LoRA layers keep their ``scaling`` per adapter in
    a dict: ``lora.Linear.scaling['default']``)."""
    while type(source).__name__ in ("DictGetItemSource", "GetItemSource"):
        source = source.base
    if type(source).__name__ != "AttrSource":
        return False
    where = source.guard_source
    where = where() if callable(where) else where  # a method before torch 2.12, a property since
    return where.is_unspecialized_nn_module() or where.is_specialized_nn_module() or where.is_fsdp_module()


def _item_uses(gm: fx.GraphModule, value: fx.Node) -> list[tuple[fx.GraphModule, fx.Node]] | None:
    """The ``.item()`` nodes that read the 0-d tensor ``value``, followed into checkpoint bodies, with the graph
    module each lies in; None if some use is anything else."""
    found = []
    for user in value.users:
        if user.op == "call_method" and user.target == "item" and len(user.args) == 1:
            found.append((gm, user))
            continue
        body, placeholders = _hop_body(gm, user, value)
        if body is None:
            return None
        for ph in placeholders:
            inner = _item_uses(body, ph)
            if inner is None:
                return None
            found += inner
    return found


def _hop_body(gm: fx.GraphModule, user: fx.Node, value: fx.Node) -> tuple[fx.GraphModule | None, list[fx.Node]]:
    """(body, its placeholders that receive ``value``) when ``user`` is a checkpoint / wrap HOP passing ``value``
    positionally to its body; (None, []) otherwise."""
    if user.op != "call_function" or getattr(user.target, "__name__", "") not in _BODY_HOPS:
        return None, []
    body_attr = user.args[0] if user.args else None
    body = getattr(gm, body_attr.target, None) if getattr(body_attr, "op", "") == "get_attr" else None
    if not isinstance(body, fx.GraphModule) or value in user.kwargs.values():
        return None, []
    placeholders = list(body.graph.find_nodes(op="placeholder"))
    if len(placeholders) != len(user.args) - 1:
        return None, []
    return body, [placeholders[i - 1] for i, a in enumerate(user.args) if a is value]


def specialize_untensorifiable_floats(gm: fx.GraphModule) -> list[str]:
    """Specialize now the symbolic floats that AOTAutograd would make Dynamo restart for; returns their symbols.

    Under ``dynamic=True`` a float attribute enters the Dynamo graph as a 0-d tensor placeholder and ``.item()``.
    After tracing the joint graph, AOTAutograd's ``_tensorify_python_scalars`` turns a float used in tensor math
    into a tensor; a float that no traced node uses as a scalar operand cannot be, so it raises
    ``RestartAnalysis``: Dynamo traces the frame again with the float specialized (guarded on its value), and the
    passes and AOTAutograd run a second time. Every HF model pays that: ``F.embedding`` drops ``norm_type`` unless
    ``max_norm`` is set, and SDPA's ``scale`` and ``dropout_p`` are C++ doubles (specialized where they enter the
    op). For a float whose every use is one of those arguments (followed into activation-checkpoint bodies), this
    does what the restart would do, before the passes run: ``guard_scalar`` (the same value guard) and
    ``TensorifyState.specialize``, so that AOTAutograd does not restart for it. The graph is left as it is.
    """
    from torch._dynamo.symbolic_convert import TensorifyState

    done = []
    for ph, memo, symbol in _float_placeholders(gm):
        if not ph.users or TensorifyState.should_specialize(symbol) or not _only_double_uses(gm, ph):
            continue
        _specialize(memo, symbol)
        done.append(symbol)
    if done:
        log.debug("specialized floats %s (no tensor math uses them) before AOTAutograd, not by a restart", done)
    return done


# (target, positional index, keyword) of arguments that reach ATen as a double, or not at all
_DOUBLE_ARGS = (
    (torch.nn.functional.embedding, 4, "norm_type"),  # used only with max_norm (checked below)
    (torch.nn.functional.scaled_dot_product_attention, 4, "dropout_p"),
    (torch.nn.functional.scaled_dot_product_attention, 6, "scale"),
)
_BODY_HOPS = ("tag_activation_checkpoint", "wrap")  # (body, *operands): operand i is the body's placeholder i


def _only_double_uses(gm: fx.GraphModule, value: fx.Node) -> bool:
    """Every use of the 0-d tensor ``value`` is ``.item()`` fed only to ``_DOUBLE_ARGS``, or an operand of a
    checkpoint body in which the same holds for its placeholder."""
    for user in value.users:
        if user.op == "call_method" and user.target == "item" and len(user.args) == 1:
            if not user.users or not all(_is_double_arg(u, user) for u in user.users):
                return False
        else:
            body, uses = _hop_body(gm, user, value)
            if body is None or not all(_only_double_uses(body, ph) for ph in uses):
                return False
    return True


def _is_double_arg(user: fx.Node, item: fx.Node) -> bool:
    if user.op != "call_function":
        return False
    slots = [(i, k) for target, i, k in _DOUBLE_ARGS if user.target is target]
    allowed = {i for i, _ in slots} | {k for _, k in slots}
    where = {i for i, a in enumerate(user.args) if a is item} | {k for k, a in user.kwargs.items() if a is item}
    if not slots or not where or not where <= allowed:
        return False
    if user.target is torch.nn.functional.embedding:  # norm_type only matters with max_norm
        max_norm = user.args[3] if len(user.args) > 3 else user.kwargs.get("max_norm")
        return max_norm is None
    return True
