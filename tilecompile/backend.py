"""The ``tilecompile`` torch.compile backend: rewrite the Dynamo graph, then hand it to the inner compiler.

Registered through the ``torch_dynamo_backends`` entry point (pyproject.toml), so
``torch.compile(model, backend="tilecompile")`` works without importing this package. ``tilecompile_backend`` is a
plain function on purpose: decorating it with ``register_backend`` as well would register the name twice.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import logging
import pathlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from tilecompile import (
    config,
    dynamo_compat,
    dynamo_floats,
    eager_frames,
    graph_breaks,
    hf_grouped_mm,
    hub_kernels,
    offload,
    releases,
    reporting,
)
from tilecompile.passes import layer_regions
from tilecompile.pipeline import run_passes

log = logging.getLogger("tilecompile")
# loaded by torch.compile(backend="tilecompile") before Dynamo traces: a failing import in the traced code raises
# ImportError there instead of breaking the graph (OpenRLHF's optional flash_attn import)
dynamo_compat.install()
hub_kernels.install()  # transformers' `kernels` wrapper: no side effect inside checkpointed layers while tracing
hf_grouped_mm.install()  # transformers < 5.24: an opaque backward for its grouped_mm fallback (untiled experts)
eager_frames.install()  # a frame at Dynamo's recompile limit runs eagerly: the report says so
_LEVELS = {"warning": logging.WARNING, "info": logging.INFO, "debug": logging.DEBUG}


def tilecompile_backend(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    options: dict[str, Any] | None = None,
    mode: str | None = None,
) -> Callable[..., Any]:
    """Backend entry: ``options`` holds tilecompile's keys (see ``tilecompile.config``) and Inductor config patches."""
    return compile_graph(gm, example_inputs, options=options, mode=mode)


def compile_graph(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    options: dict[str, Any] | None = None,
    mode: str | None = None,
    lower: Callable[..., Any] | None = None,
) -> Callable[..., Any]:
    """The backend's two steps: rewrite the graph (the passes), then lower it. ``lower(gm, example_inputs, inner,
    mode, inductor_options)`` is the lowering step, ``inner_compile`` unless given (DDP's split gives its own, which
    lowers each piece with ``inner_compile``)."""
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
    with reporting.discarded_on_error(lambda: graph_name, quiet=(torch._dynamo.exc.RestartAnalysis,)):
        reporting.count_graph()
        graph_name = f"graph {reporting.report().graphs}"
        try:
            dynamo_floats.specialize_floats(gm, settings)
            with reporting.graph_scope(graph_name):
                gm = run_passes(gm, settings, graph_name)
                _note_graph_breaks(gm, settings)
            planned = offload.tagged(gm)
            offload.take_offloaded()
            # the layer regions' lowering: compiled whole, or undone and the flat graph lowered where that fails
            compiled = layer_regions.lower(
                gm, example_inputs, settings, mode, inductor_options, graph_name, lower or inner_compile
            )
            _offloads_done(planned, offload.take_offloaded(), graph_name, settings)
        finally:
            dynamo_floats.forget_specialized_floats()
        return reporting.serving(graph_name, gm, compiled)  # the report counts the modules this graph serves


def _offloads_done(planned: dict[str, fx.Node], done: dict[str, int], graph_name: str, settings: Any) -> None:
    """The memory plan's offloads the partition did not carry out become skips, with the reason."""
    for layer in planned:
        if layer in done:
            continue
        reason = (
            "checkpointed on the device: its input was planned for host memory, but "
            + (f"the inner compiler {settings.inner!r} has no partition step"
               if settings.inner == "eager" else
               "the compiled forward does not save it as a computed, contiguous tensor of its own")
        )  # fmt: skip
        reporting.retract("memory_plan", graph_name, layer, f"checkpointed layer {layer}", reason)


def _note_graph_breaks(gm: fx.GraphModule, settings: config.Settings) -> None:
    """Reports the regions a graph break split (logits or a mask crossing into another graph); never fails a
    compile (it only reads the graph)."""
    try:
        notes = [s for s in graph_breaks.notes(gm) if settings.pass_enabled(s.pass_name)]
    except Exception as exc:  # noqa: BLE001 - a diagnostic must not stop the compile
        log.warning("could not look for graph breaks in the rewritten graph: %s: %s", type(exc).__name__, exc)
        return
    reporting.record(skipped=notes)


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
    digest = hashlib.sha256()
    for pkg in ("tilecompile", "tilecompile.passes", "tilecompile.kernels"):  # tilecompile/ holds ops/
        # where each package lives, read without the backend importing the package above it: each is loaded by
        # the time the backend is (it lives in the first and imports the others' modules); else from its spec
        loaded = getattr(sys.modules.get(pkg), "__path__", None)
        for d in loaded or importlib.util.find_spec(pkg).submodule_search_locations:
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


def inner_compile(
    gm: fx.GraphModule, example_inputs: Sequence[Any], inner: str, mode: str | None, options: dict[str, Any]
) -> Callable[..., Any]:
    patches = _inductor_patches(mode, options)
    offloads = bool(offload.tagged(gm))  # the memory plan offloads checkpointed inputs: a partition step of ours
    if inner == "inductor":
        from torch._inductor.compile_fx import compile_fx

        patches = {**dynamic_workarounds(example_inputs, options), **patches}
        if offloads:
            patches["custom_partitioner_fn"] = offload.InductorPartitioner()
        # AOTAutograd's cache would skip the partition step and with it the report of what it offloaded
        no_cache = torch._functorch.config.patch(enable_autograd_cache=False) if offloads else contextlib.nullcontext()
        with _tagged_caches(), no_cache:
            return compile_fx(gm, example_inputs, config_patches=patches)
    if patches:
        log.warning("inner compiler is %s: Inductor options %s are ignored", inner, sorted(patches))
    if inner == "aot_eager":
        from torch._dynamo.backends.common import aot_autograd
        from torch._dynamo.backends.debugging import aot_eager, boxed_nop
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        if not offloads:
            return aot_eager(gm, example_inputs)
        partition_fn = offload.partition(min_cut_rematerialization_partition)
        return aot_autograd(
            fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=partition_fn, keep_inference_input_mutations=True
        )(gm, example_inputs)
    return gm.forward
