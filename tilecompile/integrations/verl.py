"""verl 0.9.x: ``compile_engine``; verl 0.7.x: ``compile_actor`` (``DataParallelPPOActor``, at the end of the file).

Compiles what verl's FSDP engine runs for a micro-batch (``FSDPEngineWithLMHead.forward_step``, verl 0.9.x): the
model forward with the per-token log-prob / entropy math after its lm_head, so that the lm_head is fused (its [N, V]
logits never built), the MLPs tiled and the attention masks rewritten::

    from tilecompile.integrations.verl import compile_engine

    compile_engine(engine)  # engine: verl's FSDPEngineWithLMHead, after engine.initialize()

``compile_engine`` replaces ``engine.forward_step`` by a step that keeps verl's own code wherever it is not the
model and its log-probs:

- ``micro_batch.to(device)`` and verl's ``prepare_model_inputs`` (nested/jagged TensorDict in, dense tensors out)
  run eagerly, as verl wrote them: Dynamo recurses without end in ``TensorDict.to`` (tensordict 0.10), and
  views of jagged tensors hit a PyTorch bug under compile (``view(): cannot view shape (2, j1) as [2, j1]``).
- the compiled function gets dense tensors only: verl's model inputs (remove-padding: the packed ``(1, nnz)`` ids
  and positions; padded: ``(B, S)`` ids, positions and the padding mask), the labels (verl's rolled ids, laid out
  like the logits) and the temperature. It calls the FSDP2 root module with them. FSDP2's hooks break the graph at
  every unit verl wraps (each decoder layer, the embeddings, an untied lm_head), so the pieces are laid out for
  that: the lm_head's own ``forward`` computes ``log_softmax`` / ``gather`` and ``logsumexp - sum(softmax * z)``
  (the math of verl's ``logprobs_from_logits``, which on a GPU takes flash-attn's Triton cross-entropy and on a CPU
  loops over rows, and of ``entropy_from_logits``, written once without a loop) in the lm_head's graph, where the
  lm_head pass fuses it; each decoder layer builds its attention mask in its own graph (``_use_layer_masks``),
  where the attention pass reads it. Shapes are dynamic: one compile serves every micro-batch length.
- back in eager mode the per-token values are packed into verl's nested tensors (a boolean mask on the padded
  path), and verl's ``loss_function`` runs on them as before. verl's losses (``ppo_loss``, ``sft_loss``) read
  TensorDicts and nested tensors and loop over rows (``no_padding_2_padding``), so the loss stays outside the
  graph: the fused op runs in recompute mode (its backward recomputes the logits tile by tile).

Refused (``IntegrationError``, at ``compile_engine``): ``use_fused_kernels`` (verl's own fused lm_head, which returns
log-probs the passes cannot read), Ulysses sequence parallelism, FSDP1, LoRA, a value-head engine. Micro-batches that
ask for what the compiled step does not compute (``calculate_sum_pi_squared``, top-K distillation, multi-modal
inputs, 3-D position ids) run verl's own ``forward_step``, with a warning naming why.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import Any

import torch

from tilecompile.integrations import loss_head
from tilecompile.integrations.trainers import IntegrationError

log = logging.getLogger("tilecompile")

_FUSED_KERNELS = (
    "use_fused_kernels=True: verl's own fused lm_head kernel returns the log-probs from inside the model, where the "
    "lm_head pass cannot read them; set actor_rollout_ref.model.use_fused_kernels=False (tilecompile fuses the lm_head "
    "itself)"
)  # the refusals compile_engine and compile_actor share
_ULYSSES = "Ulysses sequence parallelism (ulysses_sequence_parallel_size > 1) is not supported"
_FSDP1 = "FSDP1 (strategy='fsdp') is not supported; use strategy='fsdp2'"
_ATTR = "_tilecompile"  # set on a compiled engine; its value is the step's compiled function


def compile_engine(engine: Any, *, backend: Any = "tilecompile", options: dict | None = None) -> Any:
    """Compile ``engine``'s micro-batch forward (verl 0.9.x ``FSDPEngineWithLMHead``, initialized) with tilecompile:
    one call before training. ``backend`` and ``options`` go to ``torch.compile``. Returns the engine."""
    if getattr(engine, _ATTR, None) is not None:
        raise IntegrationError("compile_engine: this engine is already compiled by tilecompile")
    why = _refused(engine)
    if why is not None:
        raise IntegrationError(f"compile_engine: {why}")
    module = engine.module
    _install_head_forward(module)
    compiled = torch.compile(_per_token, backend=backend, options=options, dynamic=True)
    # torch 2.11: the graph break at a layer's FSDP2 hooks falls inside the decoder's loop over its layers, and
    # Dynamo then runs that whole frame eagerly ("graph break in loop"); a layer compiled on its own keeps its graph
    # (where Dynamo traces the loop, torch 2.13, these compiles are inlined into that trace). As LossHead.compile.
    for layer in getattr(module.get_decoder(), "layers", ()):
        layer.compile(backend=backend, options=options, dynamic=True)
    original = engine.forward_step
    warned: set[str] = set()

    def forward_step(micro_batch, loss_function, forward_only):
        why = _unsupported(micro_batch)
        if why is not None:
            if why not in warned:
                warned.add(why)
                log.warning("tilecompile: verl's forward_step runs uncompiled, as verl wrote it: %s", why)
            return original(micro_batch, loss_function=loss_function, forward_only=forward_only)
        return _step(engine, compiled, micro_batch, loss_function)

    engine.forward_step = forward_step
    setattr(engine, _ATTR, compiled)
    return engine


# ------------------------------------------------------------------ what is refused, what falls back


def _refused(engine: Any) -> str | None:
    """Why ``engine`` cannot be compiled at all, or None."""
    names = [c.__name__ for c in type(engine).__mro__]
    if "FSDPEngineWithLMHead" not in names:
        return f"needs verl's FSDPEngineWithLMHead (verl 0.9.x); got {type(engine).__name__}"
    if "FSDPEngineWithValueHead" in names:
        return "a value-head engine (the critic) has no lm_head to fuse; compile the actor's engine"
    if getattr(engine, "module", None) is None:
        return "the engine has no module yet; call engine.initialize() first"
    model_config = getattr(engine, "model_config", None)
    if getattr(model_config, "use_fused_kernels", False) or getattr(engine.engine_config, "use_fused_kernels", False):
        return _FUSED_KERNELS
    if getattr(engine, "use_ulysses_sp", False):
        return _ULYSSES
    if isinstance(engine.module, torch.distributed.fsdp.FullyShardedDataParallel):
        return _FSDP1
    if getattr(engine, "_is_lora", False):
        return "LoRA (lora_rank > 0) is not supported yet: its adapters sit beside the projections the passes rewrite"
    return None


def _unsupported(micro_batch: Any) -> str | None:
    """Why a micro-batch must run verl's own ``forward_step``, or None."""
    from verl.utils import tensordict_utils as tu

    def flag(key: str) -> bool:
        return bool(tu.get_non_tensor_data(data=micro_batch, key=key, default=False))

    if flag("use_fused_kernels"):
        return "use_fused_kernels in the micro-batch (verl's own fused lm_head)"
    if flag("calculate_sum_pi_squared"):
        return "calculate_sum_pi_squared (needs the full softmax, which the fused op does not build)"
    if flag("distillation_use_topk") or flag("distillation_only"):
        return "top-K distillation (needs the logits)"
    if len(micro_batch.get("multi_modal_inputs", [])):
        return "multi-modal inputs"
    if micro_batch["position_ids"].dim() == 3:
        return "3-D (mrope) position ids"
    return None


# ------------------------------------------------------------------ the compiled part


def _install_head_forward(module: torch.nn.Module) -> None:
    """Give the FSDP2 root ``module`` (a causal LM) and its lm_head a second mode, chosen by the ``tilecompile_*``
    keywords: the root runs its decoder and hands the hidden states to the lm_head, and the lm_head returns the
    per-token log-probs and entropy instead of logits. verl wraps the lm_head in an FSDP2 unit of its own (untied
    embeddings), and FSDP2's hooks break the graph at each wrapped module's call; with the per-token math inside the
    lm_head's own ``forward`` the linear and its log-softmax share that call's graph, where the lm_head pass fuses
    them. Any other call (verl's own ``forward_step``, generation) runs the model's forward as before."""
    if not callable(getattr(module, "get_decoder", None)) or not callable(
        getattr(module, "get_output_embeddings", None)
    ):
        raise IntegrationError(
            f"compile_engine: needs a causal LM with get_decoder() and get_output_embeddings() (Hugging Face's); "
            f"got {type(module).__name__}"
        )
    model_forward = module.forward
    lm_head = module.get_output_embeddings()
    if not isinstance(lm_head, torch.nn.Linear):
        raise IntegrationError(f"compile_engine: the lm_head is a {type(lm_head).__name__}, not a Linear")
    head_forward = lm_head.forward

    def forward(*args, tilecompile_labels=None, tilecompile_temperature=1.0, tilecompile_entropy=False, **kwargs):
        if tilecompile_labels is None:
            return model_forward(*args, **kwargs)
        hidden = module.get_decoder()(*args, **kwargs).last_hidden_state
        return lm_head(
            hidden,
            tilecompile_labels=tilecompile_labels,
            tilecompile_temperature=tilecompile_temperature,
            tilecompile_entropy=tilecompile_entropy,
        )

    def lm_head_forward(hidden, tilecompile_labels=None, tilecompile_temperature=1.0, tilecompile_entropy=False):
        if tilecompile_labels is None:
            return head_forward(hidden)
        logits = torch.nn.functional.linear(hidden, lm_head.weight, lm_head.bias)
        return _log_probs_entropy(logits, tilecompile_labels, tilecompile_temperature, tilecompile_entropy)

    module.forward = forward
    lm_head.forward = lm_head_forward
    _use_layer_masks(module)


# ------------------------------------------------------------------ attention masks built in each layer's graph


def _use_layer_masks(module: torch.nn.Module) -> bool:
    """``tilecompile.integrations.loss_head.use_layer_masks`` (each decoder layer builds HF's causal mask over the
    padding mask in its own graph, where the attention pass reads it), extended to verl's remove-padding batches:
    one packed row, ``attention_mask=None`` and position ids that restart at each sequence. For those HF builds a
    causal-and-same-sequence mask from the sequence index of each token (``find_packed_sequence_indices``) before
    the first layer; FSDP2 breaks the graph at every layer, so the layers got it as an input. Here the layers get
    the [B, 1, N] sequence index instead and build the same mask themselves (``_packed_attention``)."""
    if not loss_head.use_layer_masks(module):
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(_PACKED_MASK, _packed_attention)
    AttentionMaskInterface.register(_PACKED_MASK, _packed_mask)
    for m in module.modules():
        cfg = getattr(m, "config", None)
        if getattr(cfg, "_attn_implementation", None) == loss_head.LAYER_MASK:
            cfg._attn_implementation = _PACKED_MASK
    return True


_PACKED_MASK = "tilecompile_verl_sdpa"


def _packed_sequence_index(mask_function) -> torch.Tensor | None:
    """The [B, N] sequence index inside HF's ``and_masks(causal_mask_function,
    packed_sequence_mask_function(index))``, or None for any other mask function."""
    mu = loss_head._HF["masking_utils"]
    cells = dict(zip(mask_function.__code__.co_freevars, mask_function.__closure__ or ()))
    if mask_function.__name__ != "and_mask" or "mask_functions" not in cells:
        return None
    parts = cells["mask_functions"].cell_contents
    if len(parts) != 2 or parts[0] is not mu.causal_mask_function:
        return None
    packed = parts[1]
    inner = dict(zip(packed.__code__.co_freevars, packed.__closure__ or ()))
    if packed.__qualname__ != mu.packed_sequence_mask_function.__name__ + ".<locals>.inner_mask":
        return None
    index = inner.get("packed_sequence_mask")
    return None if index is None else index.cell_contents


def _packed_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
                 local_size=None, **kwargs):  # fmt: skip
    """HF's mask function for ``_PACKED_MASK``: packed sequences over no padding give the layers their [B, 1, N]
    sequence index; everything else is ``loss_head``'s (the padding mask, or HF's own mask)."""
    plain = isinstance(q_offset, int) and q_offset == 0 and isinstance(kv_offset, int) and kv_offset == 0
    index = _packed_sequence_index(mask_function) if plain and local_size is None and attention_mask is None else None
    if index is not None and index.shape[-1] == kv_length:
        return index.unsqueeze(1)
    return loss_head._layer_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function,
                                 attention_mask, local_size, **kwargs)  # fmt: skip


def _packed_attention(module, query, key, value, attention_mask, **kwargs):
    """HF's sdpa attention; a [B, 1, N] sequence index becomes HF's causal-and-same-sequence mask here, in the
    layer's graph (the same ``sdpa_mask`` call HF makes before the first layer)."""
    if attention_mask is not None and attention_mask.dim() in (2, 3):
        # under dynamic shapes the mask's sizes are symbols of their own (a graph input): say they are the batch and
        # the keys' length, so that the attention pass sees a per-token tensor of the attention's shape
        torch._check(attention_mask.shape[0] == query.shape[0])
        torch._check(attention_mask.shape[-1] == key.shape[2])
    if attention_mask is not None and attention_mask.dim() == 3:
        mu = loss_head._HF["masking_utils"]
        index = attention_mask[:, 0]
        fn = mu.and_masks(mu.causal_mask_function, mu.packed_sequence_mask_function(index))
        attention_mask = mu.sdpa_mask(query.shape[0], query.shape[2], key.shape[2], mask_function=fn,
                                      allow_is_causal_skip=False, device=query.device)  # fmt: skip
        return loss_head._HF["sdpa_attention_forward"](module, query, key, value, attention_mask, **kwargs)
    return loss_head._layer_attention(module, query, key, value, attention_mask, **kwargs)


# ------------------------------------------------------------------ the per-token math


def _log_probs_entropy(logits: torch.Tensor, labels: torch.Tensor, temperature, entropy: bool):
    """verl's ``logprobs_from_logits`` and ``entropy_from_logits`` on ``logits / temperature`` (the same math, in
    fp32, no loop over rows)."""
    z = logits.float()
    if isinstance(temperature, torch.Tensor):
        z = z / temperature.clamp(min=1e-8).unsqueeze(-1)
    elif temperature != 1.0:
        z = z / temperature
    logp = torch.log_softmax(z, dim=-1)
    log_probs = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ent = torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(-1) if entropy else None
    return log_probs, ent


def _per_token(module, model_inputs: dict, labels: torch.Tensor, temperature, entropy: bool):
    return module(
        **model_inputs,
        use_cache=False,
        tilecompile_labels=labels,
        tilecompile_temperature=temperature,
        tilecompile_entropy=entropy,
    )


# ------------------------------------------------------------------ the eager step around it


def _step(engine: Any, compiled, micro_batch: Any, loss_function):
    """verl's ``forward_step`` with the model and its log-probs compiled (see the module docstring)."""
    from verl.utils import tensordict_utils as tu
    from verl.utils.device import get_device_id, get_device_name
    from verl.workers.engine.utils import detach_tree

    micro_batch = micro_batch.to(get_device_id())
    model_inputs, output_args = engine.prepare_model_inputs(micro_batch=micro_batch)
    rmpad = tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True)
    want_entropy = bool(tu.get_non_tensor_data(data=micro_batch, key="calculate_entropy", default=False))
    cu_seqlens = micro_batch["input_ids"].offsets()
    rolled = output_args["input_ids_rmpad_rolled"]
    if rmpad:
        labels = rolled.unsqueeze(0)  # (1, nnz), like the packed ids
        temperature = output_args["temperature_rmpad"].unsqueeze(0)
        keep = None
    else:
        ids = model_inputs["input_ids"]
        keep = model_inputs["attention_mask"].bool()  # verl's mask: position < length, per row
        labels = torch.zeros_like(ids).masked_scatter_(keep, rolled)
        temperature = output_args["temperature"].unsqueeze(-1).expand(ids.shape)
    host = micro_batch["temperature"]
    if not isinstance(host, torch.Tensor):  # one temperature for the batch: a number, which the fused op takes
        temperature = float(host)
    _mark_dynamic(model_inputs, labels, temperature)

    autocast_dtype = getattr(engine, "_autocast_dtype", torch.bfloat16)
    autocast = (
        nullcontext()
        if autocast_dtype == torch.float32
        else torch.autocast(device_type=get_device_name(), dtype=autocast_dtype)
    )
    with autocast:
        log_probs, entropy = compiled(engine.module, model_inputs, labels, temperature, want_entropy)
        if rmpad:
            pad_size = output_args["pad_size"]
            log_probs = engine._gather_and_unpad_packed(log_probs.squeeze(0), pad_size)
            entropy = None if entropy is None else engine._gather_and_unpad_packed(entropy.squeeze(0), pad_size)
        else:
            log_probs = log_probs[keep]
            entropy = None if entropy is None else entropy[keep]
        model_output = {"log_probs": torch.nested.nested_tensor_from_jagged(log_probs, cu_seqlens)}
        if want_entropy:
            model_output["entropy"] = torch.nested.nested_tensor_from_jagged(entropy, cu_seqlens)

        if loss_function is not None:
            loss, metrics = loss_function(
                model_output=model_output, data=micro_batch, dp_group=engine.get_data_parallel_group()
            )
        else:
            loss, metrics = torch.tensor(1.0, device=get_device_name()), {}
        output = {"model_output": detach_tree(model_output), "loss": loss.detach().item(), "metrics": metrics}
    return loss, output


def _mark_dynamic(model_inputs: dict, labels: torch.Tensor, temperature) -> None:
    """The token dimension (and the batch, on the padded path) of every per-token input varies between
    micro-batches: mark it dynamic, so that the first compile serves every length."""
    tensors = [t for t in model_inputs.values() if isinstance(t, torch.Tensor)] + [labels]
    if isinstance(temperature, torch.Tensor):
        tensors.append(temperature)
    for t in tensors:
        for dim in range(t.dim()):
            if t.shape[dim] > 1:
                torch._dynamo.maybe_mark_dynamic(t, dim)


# ------------------------------------------------------------------ verl 0.7.x: the actor


def compile_actor(actor: Any, *, backend: Any = "tilecompile", options: dict | None = None) -> Any:
    """Compile ``actor``'s micro-batch forward (verl 0.7.x ``DataParallelPPOActor``, the actor or the reference
    policy; its module a Hugging Face causal LM, plain or under FSDP2) with tilecompile: one call before training.
    Returns the actor.

    ``_forward_micro_batch`` is replaced by a step that unpads eagerly as verl does (remove-padding: the packed ids
    and positions, written in torch where verl calls flash-attn's ``unpad_input``, and the rolled ids; padded: the
    ids rolled by one), calls the model with its per-token log-prob and entropy
    math compiled in the lm_head's graph (as ``compile_engine``: fused there, never building the logits), with the
    token dimension dynamic (one compile for every micro-batch length; verl's own ``logprobs_from_logits_v2`` loops
    over the packed rows, which put their count into the graph and recompiled per batch), and pads the values back
    as verl does. verl's policy loss stays outside, as in ``update_policy``.

    Refused (``IntegrationError``): ``use_fused_kernels``, Ulysses sequence parallelism, FSDP1 (``strategy='fsdp'``:
    use ``fsdp2``). Micro-batches with multi-modal inputs, 3-D position ids, ``calculate_sum_pi_squared``, the prefix
    grouper, or an all-padding mask run verl's own ``_forward_micro_batch``, with a warning naming why."""
    names = [c.__name__ for c in type(actor).__mro__]
    if "DataParallelPPOActor" not in names:
        raise IntegrationError(
            f"compile_actor: needs verl's DataParallelPPOActor (verl 0.7.x); got {type(actor).__name__}"
        )
    if getattr(actor, _ATTR, None) is not None:
        raise IntegrationError("compile_actor: this actor is already compiled by tilecompile")
    module = actor.actor_module
    why = None
    if getattr(actor, "use_fused_kernels", False):
        why = _FUSED_KERNELS
    elif getattr(actor, "use_ulysses_sp", False):
        why = _ULYSSES
    elif isinstance(module, torch.distributed.fsdp.FullyShardedDataParallel):
        why = _FSDP1
    if why is not None:
        raise IntegrationError(f"compile_actor: {why}")
    try:
        _install_head_forward(module)
    except IntegrationError as exc:
        raise IntegrationError(str(exc).replace("compile_engine", "compile_actor")) from None
    compiled = torch.compile(_per_token, backend=backend, options=options, dynamic=True)
    for layer in getattr(module.get_decoder(), "layers", ()):  # as compile_engine: FSDP2's breaks at each layer
        layer.compile(backend=backend, options=options, dynamic=True)
    original = actor._forward_micro_batch
    warned: set[str] = set()

    def forward_micro_batch(micro_batch, temperature, calculate_entropy=False):
        why = _actor_unsupported(actor, micro_batch)
        if why is not None:
            if why not in warned:
                warned.add(why)
                log.warning("tilecompile: verl's _forward_micro_batch runs uncompiled, as verl wrote it: %s", why)
            return original(micro_batch, temperature=temperature, calculate_entropy=calculate_entropy)
        return _actor_step(actor, compiled, micro_batch, temperature, calculate_entropy)

    actor._forward_micro_batch = forward_micro_batch
    setattr(actor, _ATTR, compiled)
    return actor


def _actor_unsupported(actor: Any, micro_batch: dict) -> str | None:
    if "multi_modal_inputs" in micro_batch:
        return "multi-modal inputs"
    if micro_batch["position_ids"].dim() == 3:
        return "3-D (mrope) position ids"
    if actor.config.get("calculate_sum_pi_squared", False):
        return "calculate_sum_pi_squared (needs the full softmax, which the fused op does not build)"
    if getattr(actor, "use_prefix_grouper", False) and "uid" in micro_batch:
        return "the prefix grouper"
    if actor.use_remove_padding and not bool(micro_batch["attention_mask"].any()):
        return "an all-padding micro-batch"
    return None


def _actor_step(actor: Any, compiled, micro_batch: dict, temperature, calculate_entropy: bool) -> dict:
    """verl 0.7's ``_forward_micro_batch`` (remove-padding or padded, no sequence parallelism) with the model and
    its per-token math compiled; returns verl's ``{"log_probs", "entropys"}``, each (batch, response length)."""
    response_length = micro_batch["responses"].size(-1)
    input_ids = micro_batch["input_ids"]
    attention_mask = micro_batch["attention_mask"]
    position_ids = micro_batch["position_ids"]
    batch_size, seqlen = input_ids.shape
    dtype = actor.param_dtype
    autocast = nullcontext() if dtype == torch.float32 else torch.autocast(device_type=actor.device_name, dtype=dtype)
    with autocast:
        if actor.use_remove_padding:  # flash-attn's unpad_input (verl's), in torch: it needs no flash-attn
            indices = attention_mask.flatten().nonzero().squeeze(-1)  # a host sync, as in verl's own
            ids = input_ids.flatten()[indices].unsqueeze(0)  # (1, nnz)
            positions = position_ids.flatten()[indices].unsqueeze(0)
            model_inputs = {"input_ids": ids, "attention_mask": None, "position_ids": positions}
            labels = torch.roll(ids, shifts=-1, dims=1)
        else:
            model_inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
            labels = torch.roll(input_ids, shifts=-1, dims=1)  # position t scores token t + 1, as verl's slice
        _mark_dynamic({k: v for k, v in model_inputs.items() if v is not None}, labels, temperature)
        log_probs, entropy = compiled(actor.actor_module, model_inputs, labels, float(temperature), calculate_entropy)

        def response_part(values: torch.Tensor) -> torch.Tensor:
            if actor.use_remove_padding:  # pad_input: zeros at the padding
                flat = values.new_zeros(batch_size * seqlen).index_copy(0, indices, values.squeeze(0))
                values = flat.view(batch_size, seqlen)
            return values[:, -response_length - 1 : -1]

        outputs = {"log_probs": response_part(log_probs)}
        if calculate_entropy:
            outputs["entropys"] = response_part(entropy)
    return outputs


__all__ = ["IntegrationError", "compile_actor", "compile_engine"]
