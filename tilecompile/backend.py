"""The ``tilecompile`` torch.compile backend: rewrite the Dynamo graph, then hand it to the inner compiler.

Registered through the ``torch_dynamo_backends`` entry point (pyproject.toml), so
``torch.compile(model, backend="tilecompile")`` works without importing this package. ``tilecompile_backend`` is a
plain function on purpose: decorating it with ``register_backend`` as well would register the name twice.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import pathlib
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from tilecompile import (
    config,
    distributed,
    dynamo_compat,
    eager_frames,
    graph_breaks,
    hf_grouped_mm,
    hub_kernels,
    releases,
)
from tilecompile import reporting as R
from tilecompile.passes import layer_regions
from tilecompile.pipeline import run_passes

log = logging.getLogger("tilecompile")
# loaded by torch.compile(backend="tilecompile") before Dynamo traces: a failing import in the traced code raises
# ImportError there instead of breaking the graph (OpenRLHF's optional flash_attn import)
dynamo_compat.install()
hub_kernels.install()  # transformers' `kernels` wrapper: no side effect inside checkpointed layers while tracing
hf_grouped_mm.install()  # transformers < 5.24: an opaque backward for its grouped_mm fallback (untiled experts)
eager_frames.install()  # a frame at Dynamo's recompile limit runs eagerly: the report says so
distributed.install()  # a compiled DDP module: the passes see the whole graph before DDP's bucket split
_LEVELS = {"warning": logging.WARNING, "info": logging.INFO, "debug": logging.DEBUG}


def tilecompile_backend(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    options: dict[str, Any] | None = None,
    mode: str | None = None,
) -> Callable[..., Any]:
    """Backend entry: ``options`` holds tilecompile's keys (see ``tilecompile.config``) and Inductor config patches."""
    settings = config.load(options)
    hub_kernels.install()  # `kernels` imported after tilecompile: from this frame's recompiles and the next frames on
    hf_grouped_mm.install()
    _, inductor_options = config.split_options(options)
    _configure_logging(settings.log)
    eager_frames.compiled_here()
    releases.check_transformers()  # a release outside the tested range: one warning
    # Dynamo may restart its analysis from inside the inner compile (AOTAutograd specialising a symbolic float
    # under dynamic shapes) and call this backend again for the same code: only the last call is reported. A compile
    # that raises otherwise (Dynamo then retries the frame split at a break, or raises) counts no rewrite either.
    graph_name = "graph ?"
    with R.discarded_on_error(lambda: graph_name, quiet=(torch._dynamo.exc.RestartAnalysis,)):
        R.count_graph()
        graph_name = f"graph {R.report().graphs}"
        try:
            _specialize_floats(gm, settings)
            with R.graph_scope(graph_name):
                gm = run_passes(gm, settings, graph_name)
                _note_graph_breaks(gm, settings)
            compiled = _compile(gm, example_inputs, settings, mode, inductor_options, graph_name)
        finally:
            _forget_specialized_floats()
        return R.serving(graph_name, gm, compiled)  # the report counts the modules this graph serves


def _note_graph_breaks(gm: fx.GraphModule, settings: config.Settings) -> None:
    """Reports the regions a graph break split (logits or a mask crossing into another graph); never fails a
    compile (it only reads the graph)."""
    try:
        notes = [s for s in graph_breaks.notes(gm) if settings.pass_enabled(s.pass_name)]
    except Exception as exc:  # noqa: BLE001 - a diagnostic must not stop the compile
        log.warning("could not look for graph breaks in the rewritten graph: %s: %s", type(exc).__name__, exc)
        return
    R.record(skipped=notes)


def _configure_logging(level: str) -> None:
    log.setLevel(_LEVELS[level])
    if not log.handlers and level != "warning":
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[tilecompile] %(levelname)s %(message)s"))
        log.addHandler(handler)


def _inductor_patches(mode: str | None, options: dict[str, Any]) -> dict[str, Any]:
    import torch._inductor.config as inductor_config

    patches: dict[str, Any] = {}
    if mode not in (None, "default"):
        modes = torch._inductor.list_mode_options()
        if mode not in modes:
            raise ValueError(f"tilecompile: unknown mode {mode!r}; allowed: {', '.join(sorted(modes))}")
        patches.update(torch._inductor.list_mode_options(mode))
    known = inductor_config.get_config_copy()
    for key, value in options.items():
        if key not in known:
            raise ValueError(
                f"tilecompile: options key {key!r} is neither a tilecompile setting "
                f"({', '.join(n for n, _, _ in config.describe())}) nor an Inductor config option"
            )
        patches[key] = value
    return patches


@functools.lru_cache(maxsize=1)
def cache_tag() -> str:
    """A digest of tilecompile's own source, made part of the compile-cache keys taken under this backend.

    Inductor's on-disk caches key a graph by its nodes, not by what a custom op does: after tilecompile changes an
    op's decomposition or output shapes, a cached graph built for the old code would be loaded and fail (or worse).
    """
    import tilecompile

    digest = hashlib.sha256()
    for pkg in ("", ".passes", ".kernels"):  # each folder with its subpackages (tilecompile/ holds ops/)
        module = __import__(f"tilecompile{pkg}", fromlist=["_"]) if pkg else tilecompile
        for d in module.__path__:
            for path in sorted(pathlib.Path(d).rglob("*.py")):  # the pass packages' stages included
                digest.update(str(path.relative_to(d)).encode())
                digest.update(path.read_bytes())
    return "tilecompile-" + digest.hexdigest()[:16]


def _tagged_caches():
    """``torch.compiler.config.cache_key_tag`` with ``cache_tag()`` appended (a no-op where torch lacks the tag)."""
    cfg = torch.compiler.config
    if not hasattr(cfg, "cache_key_tag"):
        return contextlib.nullcontext()
    return cfg.patch(cache_key_tag="|".join(t for t in (cfg.cache_key_tag, cache_tag()) if t))


def is_dynamic(example_inputs: Sequence[Any]) -> bool:
    """Some input has a symbolic size, or is a symbolic scalar: the graph serves more than one shape."""
    for x in example_inputs:
        if isinstance(x, torch.SymInt | torch.SymFloat):
            return True
        if isinstance(x, torch.Tensor) and any(not isinstance(s, int) for s in x.shape):
            return True
    return False


def _specialize_floats(gm: fx.GraphModule, settings: config.Settings) -> None:
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


def _forget_specialized_floats() -> None:
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


def dynamic_workarounds(example_inputs: Sequence[Any], options: dict[str, Any]) -> dict[str, Any]:
    """Inductor settings a dynamic-shape graph needs, unless the user set them.

    Inductor's mix-order reduction (on by default since torch 2.10; it fuses the two reductions of an RMSNorm
    backward) slices its workspace with an unparenthesised symbolic offset when the token count is symbolic:
    ``workspace[0 * 1 + floor(s/16) * 1536 : ...].view(1 + floor(s/16), 1536)``, so the first backward of a
    dynamic HF model step fails with "shape '[N/16, 1536]' is invalid for input of size 1" (torch 2.11, CUDA;
    benchmarks/probe_dynamic.py shows it and that this setting alone removes it, for Inductor and tilecompile).
    """
    import torch._inductor.config as inductor_config

    key = "triton.mix_order_reduction"
    if not is_dynamic(example_inputs) or key in options or key not in inductor_config.get_config_copy():
        return {}
    return {key: False}


def _compile(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    settings: config.Settings,
    mode: str | None,
    options: dict[str, Any],
    graph_name: str,
) -> Callable[..., Any]:
    """The inner compile. A graph with shared layer regions is compiled with its backward lowered at once (not at the
    first ``backward()``); where that fails, the regions are undone and the flat graph compiled, after one warning,
    so that a torch version whose AOTAutograd or Inductor cannot take a region costs a compile, not the user's step.
    Strict mode raises instead. Dynamo's restarts and running out of memory pass through."""
    if not layer_regions.made(gm):
        return _inner_compile(gm, example_inputs, settings.inner, mode, options)
    if conflict := region_conflict(settings, options):
        layer_regions.undo(gm)
        R.decline(layer_regions.NAME, graph_name, "checkpointed layer", conflict)
        return _inner_compile(gm, example_inputs, settings.inner, mode, options)
    try:
        with _backward_lowered_at_once():
            compiled = _inner_compile(gm, example_inputs, settings.inner, mode, region_workarounds(settings, options))
    except (torch._dynamo.exc.RestartAnalysis, torch.OutOfMemoryError):
        raise
    except Exception as exc:
        if settings.strict:
            raise
        layer_regions.undo(gm)
        compiled = _inner_compile(gm, example_inputs, settings.inner, mode, options)  # raises on its own error
        text = str(exc).strip()
        reason = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
        R.withdraw(layer_regions.NAME, graph_name, reason)
        warnings.warn(
            f"tilecompile: {settings.inner} could not compile the shared layer regions of {graph_name} ({reason}); "
            "the layers were compiled one by one instead. TILECOMPILE_LAYER_REGIONS=0 skips the attempt.",
            stacklevel=2,
        )
        return compiled
    layer_regions.forget(gm)
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
    ``reorder_for_peak_memory`` (see ``region_workarounds``), so the layers are compiled one by one instead."""
    if settings.inner == "inductor" and options.get("reorder_for_peak_memory"):
        return "reorder_for_peak_memory=True was asked for; Inductor's reordering gets gradients wrong around regions"
    return None


def _backward_lowered_at_once():
    """AOTAutograd compiling the backward with the forward (torch 2.11 compiles it lazily for static shapes, and for
    dynamic ones retries a failed backward lazily): a backward that cannot take a region then fails here."""
    cfg = torch._functorch.config
    if not hasattr(cfg, "force_non_lazy_backward_lowering"):
        return contextlib.nullcontext()
    return cfg.patch(force_non_lazy_backward_lowering=True)


def _inner_compile(
    gm: fx.GraphModule, example_inputs: Sequence[Any], inner: str, mode: str | None, options: dict[str, Any]
) -> Callable[..., Any]:
    patches = _inductor_patches(mode, options)
    if inner == "inductor":
        from torch._inductor.compile_fx import compile_fx

        patches = {**dynamic_workarounds(example_inputs, options), **patches}
        with _tagged_caches():
            return compile_fx(gm, example_inputs, config_patches=patches)
    if patches:
        log.warning("inner compiler is %s: Inductor options %s are ignored", inner, sorted(patches))
    if inner == "aot_eager":
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example_inputs)
    return gm.forward
