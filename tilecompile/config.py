"""tilecompile's settings: one typed table, defaults from ``TILECOMPILE_*`` env vars, per-compile overrides.

Every setting has an env var ``TILECOMPILE_<NAME>`` and an ``options=`` key (``"<name>"`` or the env var's name).
``torch.compile(..., options={...})`` wins over the environment. An invalid value is a ``ValueError`` that names
the variable and the allowed values. Nothing else in the project reads ``os.environ`` for ``TILECOMPILE_*``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")


@dataclasses.dataclass(frozen=True)
class _Spec:
    kind: type  # bool, int or str
    default: Any
    doc: str
    choices: tuple[str, ...] = ()
    minimum: int = 0


_SPECS: dict[str, _Spec] = {
    # passes: each 1 (on) or 0 (off)
    "canonical": _Spec(bool, True, "x + 0.0, x * 1.0, torch.min(a, b), linear autograd.Functions -> what they compute"),
    "tensor_parallel": _Spec(bool, True, "lower tilecompile.parallelize() annotations to collectives"),
    "attention": _Spec(bool, True, "SDPA fed an [N, N] mask built from positions -> is_causal / masked attention"),
    "fused_linear_ce": _Spec(bool, True, "lm_head -> log-prob / entropy / cross-entropy -> one fused op"),
    "tiled_mlp": _Spec(bool, True, "gated MLPs -> sequence-chunked recompute regions"),
    # needs Inductor's reorder_for_peak_memory off to get the gradients right, on CPU and CUDA
    # (passes/layer_regions.py, region_workarounds; benchmarks/probe_regions_grads.py measured it on the H200)
    "layer_regions": _Spec(bool, True, "checkpointed layers with identical bodies -> one region, compiled once"),
    # memory_plan: per checkpointed layer, keep its activations (no recompute) where memory_budget allows
    "memory_plan": _Spec(bool, True, "checkpointed layers kept whole (no recompute) where memory_budget allows"),
    # memory_plan: the device memory the whole step may take (weights, grads, optimizer states, activations);
    # None = auto: AUTO_MEMORY_FRACTION of a CUDA device's memory, no plan on a CPU; 0 = no plan
    "memory_budget": _Spec(
        float,
        None,
        "memory the step may take: auto (0.85 of a CUDA device's, no plan on CPU), GiB (> 1), a fraction "
        "of the device's memory (<= 1), 0: no plan",
    ),
    # memory_plan: checkpointed layers' inputs copied to host memory between the forward and the backward
    # off by default until it is measured at length on a GPU (issue 43): the plan's room is conservative (3x the
    # trainable weights set aside), so auto would offload steps that fit
    "offload": _Spec(
        str,
        "off",
        "checkpointed inputs to host memory: off, auto (only where the device's budget runs out), all",
        ("off", "auto", "all"),
    ),
    # memory_plan: the host memory the offloaded inputs may take; None = auto: HOST_FRACTION of what is available
    "host_budget": _Spec(
        float, None, "host memory offloaded inputs may take: auto (0.8 of what the host has available), GiB"
    ),
    # safety: a failing rewrite raises instead of being undone with a warning
    "strict": _Spec(bool, False, "raise when a pass fails instead of undoing it with a warning"),
    # the compiler the rewritten graph is handed to
    "inner": _Spec(str, "inductor", "inner compiler", ("inductor", "aot_eager", "eager")),
    # logging level of the `tilecompile` logger
    "log": _Spec(str, "warning", "log level of the tilecompile logger", ("warning", "info", "debug")),
    # tiled_mlp: tokens per chunk; 0 = derived at run time from mlp_chunk_budget_mb
    "mlp_chunk_tokens": _Spec(int, 0, "tokens per MLP chunk (0: from the memory budget)"),
    # tiled_mlp: bytes of [chunk, intermediate] activations one chunk may hold, in MiB
    "mlp_chunk_budget_mb": _Spec(int, 256, "MiB of intermediate activations per MLP chunk", minimum=1),
    # tiled_mlp: below this many tokens the MLP is left alone (tiling would only cost time); 0 = always tile
    "mlp_min_tokens": _Spec(int, 2048, "MLPs on fewer tokens are not tiled (0: always tile)"),
    # tiled_mlp: MoE experts over stacked weights (HF's grouped_mm / batched_mm experts) -> tiled_grouped_mlp
    "mlp_experts": _Spec(bool, True, "MoE experts -> per-expert token-chunked recompute regions"),
    # tiled_mlp: dtype of the weight-gradient accumulators
    "mlp_grad_accum": _Spec(str, "fp32", "weight-grad accumulation dtype", ("fp32", "param")),
    # fused_linear_ce: vocabulary columns per chunk; 0 = chosen by the op
    "ce_vocab_chunk": _Spec(int, 0, "vocab columns per chunk in the fused CE op (0: automatic)"),
    # fused_linear_ce: grads in the forward (3 GEMMs, not 4) when the graph reduces the outputs to a scalar loss
    "ce_loss_aware": _Spec(bool, True, "lm_head grads computed in the forward when the graph ends in a scalar loss"),
    # fused_linear_ce, loss-aware mode: rows per block of whole-vocabulary logits; 0 = from the op's memory budget
    "ce_loss_block_rows": _Spec(int, 0, "rows per logits block in the loss-aware mode (0: automatic)"),
    # fused_linear_ce, loss-aware mode: what compiles the loss's per-token gradient, run once per logits block;
    # auto = inductor for CUDA tensors when the inner compiler is inductor, else eager autograd
    "ce_loss_grad_compile": _Spec(
        str, "auto", "compiler of the loss-aware mode's per-token gradient", ("auto", "inductor", "aot_eager", "off")
    ),
    # fused_linear_ce: check labels on CUDA (one device-side check and a host sync per call)
    "check_inputs": _Spec(bool, False, "validate labels on CUDA (costs a host sync per call)"),
    # Dynamo: a failing import inside compiled code raises ImportError there, as in Python (dynamo_compat.py)
    "trace_import_errors": _Spec(bool, True, "a failing import in compiled code raises ImportError in the graph"),
    # DDP (optimize_ddp's graph split at bucket boundaries): the passes see the whole graph, then it is split
    "ddp_split_after_passes": _Spec(bool, True, "under DDP, rewrite the whole graph before DDP's bucket split"),
    # dynamic=True: a module's float attributes (norm eps, attention scaling) become constants guarded on their value
    "specialize_module_floats": _Spec(bool, True, "under dynamic shapes, modules' float attributes are constants"),
}

_ALIASES = {f"TILECOMPILE_{name.upper()}": name for name in _SPECS}


def env_var(name: str) -> str:
    return f"TILECOMPILE_{name.upper()}"


def _parse(name: str, raw: Any, source: str) -> Any:
    spec = _SPECS[name]
    if spec.kind is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, int) and raw in (0, 1):
            return bool(raw)
        text = str(raw).strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise ValueError(f"{source}={raw!r} is invalid: allowed values are 1/0 (or true/false, on/off)")
    if spec.kind is float:
        if spec.default is None and str(raw).strip().lower() == "auto":
            return None
        try:
            number = float(str(raw).strip()) if not isinstance(raw, bool) else None
        except ValueError:
            number = None
        if number is None or not number >= 0 or number == float("inf"):
            allowed = "auto or finite numbers >= 0" if spec.default is None else "finite numbers >= 0"
            raise ValueError(f"{source}={raw!r} is invalid: allowed values are {allowed}")
        return number
    if spec.kind is int:
        try:
            value = int(str(raw).strip()) if not isinstance(raw, int) or isinstance(raw, bool) else raw
        except ValueError:
            value = None
        if value is None or isinstance(raw, bool) or value < spec.minimum:
            raise ValueError(f"{source}={raw!r} is invalid: allowed values are integers >= {spec.minimum}")
        return value
    text = str(raw).strip().lower()
    if text not in spec.choices:
        raise ValueError(f"{source}={raw!r} is invalid: allowed values are {', '.join(spec.choices)}")
    return text


@dataclasses.dataclass(frozen=True)
class Settings:
    canonical: bool
    tensor_parallel: bool
    attention: bool
    fused_linear_ce: bool
    tiled_mlp: bool
    layer_regions: bool
    memory_plan: bool
    memory_budget: float | None  # None: auto
    offload: str
    host_budget: float | None  # None: auto
    strict: bool
    inner: str
    log: str
    mlp_chunk_tokens: int
    mlp_chunk_budget_mb: int
    mlp_min_tokens: int
    mlp_experts: bool
    mlp_grad_accum: str
    ce_vocab_chunk: int
    ce_loss_aware: bool
    ce_loss_block_rows: int
    ce_loss_grad_compile: str
    check_inputs: bool
    trace_import_errors: bool
    ddp_split_after_passes: bool
    specialize_module_floats: bool

    def pass_enabled(self, pass_name: str) -> bool:
        return bool(getattr(self, pass_name))


def split_options(options: Mapping[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split ``options=`` into (tilecompile's keys, canonical names) and (everything else, for Inductor)."""
    ours: dict[str, Any] = {}
    rest: dict[str, Any] = {}
    for key, value in (options or {}).items():
        name = _ALIASES.get(key, key)
        if name in _SPECS:
            ours[name] = value
        else:
            rest[key] = value
    return ours, rest


def load(options: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    """Settings from the environment, overridden by tilecompile's keys in ``options``."""
    environ = os.environ if environ is None else environ
    ours, _ = split_options(options)
    values = {}
    for name, spec in _SPECS.items():
        if name in ours:
            values[name] = _parse(name, ours[name], f"options[{name!r}]")
        elif env_var(name) in environ and environ[env_var(name)] != "":
            values[name] = _parse(name, environ[env_var(name)], env_var(name))
        else:
            values[name] = spec.default
    return Settings(**values)


def describe() -> list[tuple[str, str, str]]:
    """(env var, default, meaning) for each setting: the README's flags table."""

    def shown(spec: _Spec) -> str:
        return (
            str(int(spec.default))
            if spec.kind is bool
            else ("auto" if spec.default is None else f"{spec.default:g}")
            if spec.kind is float
            else str(spec.default)
        )

    return [(env_var(n), shown(s), s.doc) for n, s in _SPECS.items()]
