"""``tilecompile.parallelize(model, plan, group)``: shard a model's parameters in place for tensor parallelism.

    plan = {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise",
            "model.layers.*.mlp.gate_proj": "colwise", ..., "lm_head": "vocab_colwise"}
    tilecompile.parallelize(model, plan, group=tp_group)
    model = torch.compile(model, backend="tilecompile")

Keys are globs over module names (``fnmatch``: ``*`` matches any text, dots included); each matched module's
``weight`` (and ``bias``) is replaced in place by this rank's slice, a plain tensor: the same ``Parameter`` objects
stay in the model (tied weights stay tied, optimizers built later see the local shards). Each sharded parameter
carries a ``ShardSpec`` (style, dim, group, global shape) that ``passes/tensor_parallel.py`` reads to put the
collectives in the compiled graph. Without the backend (eager) a parallelized model computes garbage: compile it.

Styles:
- ``colwise``: weight [out, in] split on out (dim 0), bias too; output features are sharded.
- ``rowwise``: weight split on in (dim 1); the bias stays whole (added once, after the all-reduce).
- ``packed_colwise``: a fused weight whose output features are several parts (gate_up: two equal halves; qkv: the
  q, k, v sizes from the attention module's head counts); each part is split on its own, so this rank holds
  [gate_r; up_r] and ``chunk(2, -1)`` of its output gives its local gate and up.
- ``vocab_colwise``: an lm_head split on the vocabulary (dim 0); tied or not (a tied input embedding then looks
  up its local rows, and the pass sums the lookups across ranks).

Attention projections are split by whole heads: q/k/v colwise, o rowwise; the head counts (KV heads too) must
divide by the group size. Hugging Face Llama / Qwen2 attention reshape with ``(*input_shape, -1, head_dim)``, so
the local head count follows from the local weight and nothing in the module needs changing. A norm over a
sharded linear's whole output (OLMo-2's ``q_norm = RMSNorm(heads * head_dim)`` beside ``q_proj``; Qwen3's per-head
norms are fine) is refused: its mean of squares would need every rank's features (so is Cohere's per-head norm
with a weight per head, which the plan would leave whole).
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import functools
import re
import weakref
from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist

from tilecompile.ops import collectives

STYLES = ("colwise", "rowwise", "packed_colwise", "vocab_colwise")
_ATTR = "_tilecompile_shard"
_MODEL_ATTR = "_tilecompile_parallel"
_PARALLELIZED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # models parallelize() sharded, while alive
_FSDP_HINT = (
    "tilecompile.parallelize does not compose with FSDP2 (fully_shard): FSDP2 replaces every parameter by a DTensor "
    "(and, in the forward, by a fresh unsharded tensor), so the shard records the tensor_parallel pass reads are "
    "lost and the model would run on its shards without the collectives: a wrong loss. For data parallelism over "
    "tilecompile.parallelize, wrap the model in DDP across the tensor-parallel groups (each DDP group holds one "
    "tensor-parallel rank of every group); or shard with FSDP2 alone"
)


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """What the pass needs to know of one sharded parameter."""

    fqn: str
    style: str  # one of STYLES
    dim: int | None  # the sharded tensor dim; None: not sharded (a rowwise bias, added after the reduction)
    group: str  # the process group's name (what the functional collectives take)
    world: int
    rank: int
    global_shape: tuple[int, ...]
    parts: tuple[int, ...] = ()  # packed_colwise: global sizes of the parts along ``dim``
    sequence_parallel: bool = False


@dataclasses.dataclass(frozen=True)
class ParallelInfo:
    """Stored on the model by ``parallelize``: the plan and what it sharded."""

    plan: dict[str, str]
    group: str
    world: int
    rank: int
    sequence_parallel: bool
    params: dict[str, ShardSpec]


class PlanError(ValueError):
    """A plan that cannot be applied; the message says which entry and why."""


def spec_of(t: object) -> ShardSpec | None:
    """The ShardSpec ``parallelize`` attached to parameter ``t`` (None for a replicated or unknown tensor)."""
    return getattr(t, _ATTR, None) if isinstance(t, torch.Tensor) else None


def info_of(model: torch.nn.Module) -> ParallelInfo | None:
    return getattr(model, _MODEL_ATTR, None)


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    return DTensor


def _check_not_fsdp(model: torch.nn.Module) -> None:
    """``parallelize`` after ``fully_shard`` (or after torch's own DTensor ``parallelize_module``) is refused."""
    dtensor = _dtensor_type()
    for name, p in model.named_parameters():
        if dtensor is not None and isinstance(p, dtensor):
            raise PlanError(
                f"{name} is a DTensor: the model was sharded before (fully_shard / FSDP2, or torch's "
                f"parallelize_module). {_FSDP_HINT}"
            )


def lost_shards(model: torch.nn.Module) -> list[str]:
    """FQNs of parameters ``parallelize`` sharded in ``model`` that no longer carry their ShardSpec (a parameter
    swapped for another tensor since: FSDP2's DTensors, its unsharded parameters in the forward)."""
    info = info_of(model)
    if info is None:
        return []
    lost = []
    for fqn in info.params:
        try:
            p = model.get_parameter(fqn)
        except AttributeError:
            lost.append(fqn)
            continue
        if spec_of(p) is None:
            lost.append(fqn)
    return lost


def check_shards_intact(graph_params: Iterable[torch.Tensor]) -> str | None:
    """Why a graph over ``graph_params`` (the parameters its placeholders hold) must not compile: it reads a model
    that ``parallelize`` sharded but whose parameters lost their shard records since (FSDP2 applied after
    ``parallelize``); None when all is well."""
    ids = {id(p) for p in graph_params}
    if not ids:
        return None
    for model in list(_PARALLELIZED):
        if not any(id(p) in ids for p in model.parameters()):
            continue
        lost = lost_shards(model)
        if lost:
            by = "by fully_shard (FSDP2)" if _is_fsdp(model) else "by other tensors"
            return (
                f"{len(lost)} parameter(s) tilecompile.parallelize sharded in {type(model).__name__} "
                f"({', '.join(lost[:3])}{', ...' if len(lost) > 3 else ''}) were replaced {by} after parallelize and "
                f"lost their shard records. {_FSDP_HINT}"
            )
    return None


def _is_fsdp(model: torch.nn.Module) -> bool:
    """``fully_shard`` was applied to ``model`` or one of its modules (or to a module holding it)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def _heads_module(model: torch.nn.Module, name: str) -> torch.nn.Module | None:
    """The attention module a projection belongs to (its parent, when that has ``head_dim``)."""
    parent = name.rsplit(".", 1)[0] if "." in name else ""
    mod = model.get_submodule(parent) if parent else model
    return mod if isinstance(getattr(mod, "head_dim", None), int) else None


def _config_of(model: torch.nn.Module, attn: torch.nn.Module):
    return getattr(attn, "config", None) or getattr(model, "config", None)


def _packed_parts(model: torch.nn.Module, name: str, rows: int) -> tuple[int, ...]:
    """Global sizes of a packed weight's parts: q, k, v of a fused qkv; else two equal halves (gate_up)."""
    leaf = name.rsplit(".", 1)[-1]
    attn = _heads_module(model, name)
    if "qkv" in leaf and attn is not None:
        cfg = _config_of(model, attn)
        heads = getattr(cfg, "num_attention_heads", None)
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        if heads is not None and (heads + 2 * kv) * attn.head_dim == rows:
            return (heads * attn.head_dim, kv * attn.head_dim, kv * attn.head_dim)
        raise PlanError(f"{name}: cannot tell the q/k/v sizes of a packed weight with {rows} rows")
    if rows % 2:
        raise PlanError(f"{name}: packed_colwise needs two equal halves (gate, up) but the weight has {rows} rows")
    return (rows // 2, rows // 2)


def _check_heads(model: torch.nn.Module, name: str, rows: int, world: int, parts: tuple[int, ...]) -> None:
    attn = _heads_module(model, name)
    if attn is None:
        return
    hd = attn.head_dim
    for size in parts or (rows,):
        if size % hd:
            continue  # not a head-structured output
        heads = size // hd
        if heads % world:
            leaf = name.rsplit(".", 1)[-1]
            kind = "key/value heads" if leaf.startswith(("k", "v")) else "heads"
            raise PlanError(
                f"{name}: {heads} {kind} (out_features {size} = {heads} x head_dim {hd}) do not divide by the "
                f"tensor-parallel size {world}; attention is split by whole heads"
            )


def _check_norms(
    model: torch.nn.Module, name: str, style: str, pattern: str, sizes: tuple[int, ...], planned: Mapping[str, object]
) -> None:
    """Refuses a colwise linear beside a module holding one weight per output feature of it, which the plan would
    leave whole. OLMo-2's ``q_norm`` is ``RMSNorm(heads * head_dim)`` applied to ``q_proj``'s output before the
    reshape to heads: it reduces over the features this plan shards, so after sharding its weight no longer fits
    the local output (Dynamo then fails with a fake tensor error) and a local mean of squares would not be the
    norm's. Cohere's ``q_norm`` is per head but weighs each head apart (weight ``[heads, head_dim]``): the same
    misfit. The test: a sibling module (same parent) outside the plan whose own ``weight`` is 1-D and as long as
    the linear's global output (or one of its packed parts), or ``[n, head_dim]`` with ``n * head_dim`` that long.
    Per-head norms shared by all heads (Qwen3's, Gemma3's: size ``head_dim``) are fine under head sharding; the
    block's own norms (``input_layernorm``) sit one level up, beside ``self_attn`` and ``mlp``."""
    parent_name, _, _ = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    head_dim = getattr(parent, "head_dim", None)
    head_dim = head_dim if isinstance(head_dim, int) else None
    for child_name, child in parent.named_children():
        fqn = f"{parent_name}.{child_name}" if parent_name else child_name
        weight = getattr(child, "weight", None)
        if fqn == name or fqn in planned or not isinstance(weight, torch.Tensor):
            continue
        shape = tuple(weight.shape)
        if len(shape) == 1 and shape[0] in sizes and shape[0] != head_dim:
            what = f"spans all {shape[0]} of its output features"
        elif len(shape) == 2 and head_dim is not None and shape[1] == head_dim and shape[0] * head_dim in sizes:
            what = f"weighs each of its {shape[0]} heads apart"
        else:
            continue
        hint = ", e.g. shard only the MLP and the lm_head" if head_dim is not None else ""
        raise PlanError(
            f"{name} (matched by {pattern!r}, {style}) cannot be sharded: {fqn} ({type(child).__name__}, weight "
            f"{list(shape)}) beside it {what}, which the plan splits across ranks. A norm over a projection's whole "
            f"output (OLMo-2's q_norm / k_norm) or with a weight per head (Cohere's) is not supported under tensor "
            f"parallelism (per-head norms of size head_dim are fine): leave the linears of "
            f"{parent_name or 'the model'} out of the plan (they then run replicated){hint}"
        )


def _closest(pattern: str, names: list[str]) -> list[str]:
    generic = sorted({re.sub(r"(?<=\.)\d+(?=\.|$)", "*", n) for n in names} | set(names))
    return difflib.get_close_matches(pattern, generic, n=3, cutoff=0.5)


def _shard(t: torch.Tensor, dim: int, rank: int, world: int, parts: tuple[int, ...]) -> torch.Tensor:
    if not parts:
        size = t.shape[dim] // world
        return t.narrow(dim, rank * size, size).clone(memory_format=torch.contiguous_format)
    pieces, start = [], 0
    for p in parts:
        size = p // world
        pieces.append(t.narrow(dim, start + rank * size, size))
        start += p
    return torch.cat(pieces, dim=dim).contiguous()


def _vocab_parallel_forward(mod: torch.nn.Linear, group: str, world: int, rank: int, x: torch.Tensor) -> torch.Tensor:
    return collectives.vocab_parallel_linear(x, mod.weight, mod.bias, group, world, rank)


def parallelize(
    model: torch.nn.Module,
    plan: Mapping[str, str],
    group: dist.ProcessGroup | None = None,
    sequence_parallel: bool = False,
) -> torch.nn.Module:
    """Shard ``model``'s parameters in place by ``plan`` over ``group`` (default: the whole world); returns it."""
    if info_of(model) is not None:
        raise PlanError("this model is already parallelized (tilecompile.parallelize was called on it before)")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("tilecompile.parallelize needs torch.distributed initialized (init_process_group)")
    _check_not_fsdp(model)
    group = group if group is not None else dist.group.WORLD
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    group_name = group.group_name
    for pattern, style in plan.items():
        if style not in STYLES:
            raise PlanError(f"plan[{pattern!r}] = {style!r}: unknown style; allowed: {', '.join(STYLES)}")

    modules = dict(model.named_modules())
    names = [n for n in modules if n]
    chosen: dict[str, tuple[str, str]] = {}  # module name -> (style, pattern)
    for pattern, style in plan.items():
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            close = _closest(pattern, names)
            hint = f"; closest names: {', '.join(close)}" if close else ""
            raise PlanError(f"plan key {pattern!r} matches no module of {type(model).__name__}{hint}")
        for n in hits:
            if n in chosen and chosen[n][0] != style:
                raise PlanError(f"{n} is matched by {chosen[n][1]!r} ({chosen[n][0]}) and {pattern!r} ({style})")
            chosen[n] = (style, pattern)

    # check everything first, so an error leaves the model untouched
    todo: list[tuple[str, torch.nn.Parameter, ShardSpec]] = []
    seen: dict[int, ShardSpec] = {}
    for name, (style, pattern) in chosen.items():
        mod = modules[name]
        weight = getattr(mod, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise PlanError(f"{name} (matched by {pattern!r}) has no 2-D weight to shard as {style}")
        if spec_of(weight) is not None:
            raise PlanError(f"{name}.weight is already sharded (a model parallelized twice?)")
        shape = tuple(weight.shape)
        dim = 1 if style == "rowwise" else 0
        parts = _packed_parts(model, name, shape[0]) if style == "packed_colwise" else ()
        for size in parts or (shape[dim],):
            if size % world:
                what = "a part of " if parts else ""
                raise PlanError(
                    f"{name}.weight {list(shape)}: {what}dim {dim} of size {size} is not divisible by the "
                    f"tensor-parallel size {world} ({style})"
                )
        if style in ("colwise", "packed_colwise", "rowwise"):
            _check_heads(model, name, shape[0] if dim == 0 else shape[1], world, parts)
        if style in ("colwise", "packed_colwise"):
            _check_norms(model, name, style, pattern, (shape[0], *parts), chosen)
        spec = ShardSpec(f"{name}.weight", style, dim, group_name, world, rank, shape, parts, sequence_parallel)
        if id(weight) in seen and seen[id(weight)].style != style:
            raise PlanError(f"{name}.weight is tied to {seen[id(weight)].fqn} with another style")
        seen[id(weight)] = spec
        todo.append((f"{name}.weight", weight, spec))
        bias = getattr(mod, "bias", None)
        if isinstance(bias, torch.Tensor):
            bdim = None if style == "rowwise" else 0
            bspec = ShardSpec(f"{name}.bias", style, bdim, group_name, world, rank, tuple(bias.shape), parts,
                              sequence_parallel)  # fmt: skip
            todo.append((f"{name}.bias", bias, bspec))

    params: dict[str, ShardSpec] = {}
    done: set[int] = set()
    for fqn, p, spec in todo:
        if id(p) not in done:
            with torch.no_grad():
                if spec.dim is not None:
                    p.data = _shard(p.data, spec.dim, rank, world, spec.parts)
            setattr(p, _ATTR, spec)
            done.add(id(p))
        params[fqn] = spec
    for name, (style, _) in chosen.items():
        mod = modules[name]
        if style == "vocab_colwise" and isinstance(mod, torch.nn.Linear):
            # the module returns the whole [..., V] logits (code after it may view them as (-1, vocab_size)); the
            # pass turns the call into a local linear, and the fused lm_head pass never gathers them
            mod.forward = functools.partial(_vocab_parallel_forward, mod, group_name, world, rank)
        elif isinstance(mod, torch.nn.Linear):
            mod.out_features, mod.in_features = mod.weight.shape
    # a tied input embedding (same Parameter as a vocab_colwise lm_head) now holds this rank's rows
    for mod in modules.values():
        if isinstance(mod, torch.nn.Embedding) and spec_of(mod.weight) is not None:
            mod.num_embeddings = mod.weight.shape[0]
    setattr(model, _MODEL_ATTR, ParallelInfo(dict(plan), group_name, world, rank, sequence_parallel, params))
    _PARALLELIZED.add(model)
    return model


__all__ = [
    "STYLES", "ParallelInfo", "PlanError", "ShardSpec", "check_shards_intact", "info_of", "lost_shards",
    "parallelize", "spec_of",
]  # fmt: skip
