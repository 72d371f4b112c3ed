"""Compiles what Hugging Face ``Trainer`` and TRL's ``SFTTrainer`` / ``GRPOTrainer`` run for the loss, with the
model's forward, so that the lm_head and the log-prob / cross-entropy math meet in one graph and are fused.

``TrainingArguments(torch_compile_backend="tilecompile")`` cannot work: accelerate's ``TorchDynamoPlugin`` takes only
its fixed ``DynamoBackend`` list. ``model.compile(backend="tilecompile")`` compiles the model alone, which returns its
logits, so the lm_head cannot be fused. ``compile_trainer(trainer)`` compiles instead:

- a Hugging Face ``Trainer`` (or a subclass that keeps its ``compute_loss``): the forward with the loss, returning the
  loss only, whenever ``compute_loss`` is asked for the loss alone (training, ``prediction_loss_only`` evaluation);
  a call that needs the outputs (logits for ``compute_metrics``) runs the model as before, uncompiled;
- TRL's trainers (their model forward patched by ``trl.trainer.utils.add_fused_lm_head``, called with
  ``fused_lm_head=True``): that forward, written as the torch math TRL's ``ChunkedLogProbFunction`` computes
  (``log_softmax`` / ``gather``, ``-Σ softmax·log_softmax``, zero where the label is -100), so tilecompile fuses it.
  The forward without ``fused_lm_head`` (generation in GRPO) stays TRL's, uncompiled. ``is_top1`` (SFT's
  ``mean_token_accuracy`` metric) needs the argmax of the logits, which the fused op does not compute: it is taken
  from TRL's own kernel, forward only and without gradient, on the hidden states the compiled graph returns.
"""

from __future__ import annotations

import functools
import logging
import os
import types
import warnings
from typing import Any

import torch

log = logging.getLogger("tilecompile")

_TRL_FUSED_FORWARD = ("_fused_forward", os.path.join("trl", "trainer", "utils.py"))  # its code's name and file
# The closure of TRL's fused forward whose meaning we know; any other set is another TRL version: left alone
_TRL_CLOSURE = {
    "original_forward",
    "backbone_attr",
    "temperature",
    "cast_lm_head_to_fp32",
    "outputs",
    "final_logit_softcapping",
    "logit_scale",
    "text_config",
}
_SUPPORTED_OUTPUTS = {"log_probs", "entropy", "is_top1"}


class IntegrationError(ValueError):
    """A trainer ``compile_trainer`` cannot compile as asked (the message says why and what to do)."""


def compile_trainer(trainer: Any, *, backend: Any = "tilecompile", options: dict | None = None, dynamic=None) -> Any:
    """Compile ``trainer``'s loss computation with its model's forward (one call before ``trainer.train()``).

    ``trainer``: a ``transformers.Trainer`` or one of TRL's trainers. ``backend``, ``options`` and ``dynamic`` go to
    ``torch.compile``. Returns the trainer. Calling it twice on one trainer is an error."""
    if getattr(trainer, "_tilecompile", None) is not None:
        raise IntegrationError("compile_trainer: this trainer is already compiled by tilecompile")
    args = getattr(trainer, "args", None)
    if args is not None and getattr(args, "torch_compile", False):
        raise IntegrationError(
            "compile_trainer: the trainer's args have torch_compile=True, so Trainer would compile the model a second "
            "time (with accelerate's backend list, which cannot name tilecompile); set torch_compile=False"
        )
    compile_kwargs = dict(backend=backend, options=options, dynamic=dynamic)
    patched = []
    for name in ("model", "ref_model"):
        model = getattr(trainer, name, None)
        if model is None:
            continue
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        spec = _trl_fused_head(base)
        if spec is not None:
            _patch_fused_forward(base, spec, compile_kwargs)
            patched.append(name)
        elif name == "model" and _has_trl_fused_head(base):
            raise IntegrationError(
                "compile_trainer: the model's forward is patched by a version of TRL's add_fused_lm_head that "
                "tilecompile does not know (its closure differs); upgrade tilecompile or pin the TRL version it tests"
            )
    if not patched:
        _patch_compute_loss(trainer, compile_kwargs)
        patched.append("compute_loss")
    model = getattr(trainer, "model", None)
    if model is not None:
        _keep_one_input_hook(model.get_base_model() if hasattr(model, "get_base_model") else model)
    trainer._tilecompile = tuple(patched)
    return trainer


def _keep_one_input_hook(model: torch.nn.Module) -> None:
    """HF's gradient-checkpointing enable registers one more forward hook on the input embeddings at every call
    (``enable_input_require_grads``) and its disable removes them only under PEFT; TRL's GRPO disables and re-enables
    checkpointing around each generation, so the hooks pile up (two a step) and the compiled forward's guard on
    their number fails: one more compile every step (transformers 5.17 and 5.24). Here each enable removes the
    previous hook first, so one stays.

    None stays where no layer checkpoints reentrantly (``_reentrant_checkpointing``): the hook calls
    ``requires_grad_()`` on the embeddings' output so that reentrant checkpointing sees an input that needs a
    gradient, which the non-reentrant one (transformers 5's default) does not need. With frozen embeddings (PEFT,
    LoRA) that call breaks the compiled graph in every step and keeps the lm_head apart from its loss
    (``tilecompile/graph_breaks.py``); with checkpointing through HF's non-reentrant function the parameters'
    gradients are the same without it."""
    enable = getattr(model, "enable_input_require_grads", None)
    disable = getattr(model, "disable_input_require_grads", None)
    if not callable(enable) or not callable(disable):
        return

    def has_hook() -> bool:
        hooks = getattr(model, "_require_grads_hooks", None)
        return bool(hooks) or getattr(model, "_require_grads_hook", None) is not None

    def enable_once(*args: Any, **kwargs: Any) -> Any:
        if has_hook():
            disable()
        if not _reentrant_checkpointing(model):
            warnings.warn(
                "tilecompile: compile_trainer leaves enable_input_require_grads off (no layer checkpoints "
                "reentrantly; its requires_grad_() on frozen embeddings would break the compiled graph); the "
                "embeddings' output gets no gradient",
                stacklevel=2,
            )
            return None
        return enable(*args, **kwargs)

    model.enable_input_require_grads = enable_once
    if has_hook() and not _reentrant_checkpointing(model):
        disable()
        log.info("tilecompile: enable_input_require_grads's hook removed (no layer checkpoints reentrantly)")


def _reentrant_checkpointing(model: torch.nn.Module) -> bool:
    """Whether some module of ``model`` checkpoints with (possibly) reentrant checkpointing: HF sets each
    checkpointed layer's ``_gradient_checkpointing_func`` to ``partial(checkpoint, use_reentrant=...)``; a function
    that does not say ``use_reentrant=False`` counts as reentrant, and so does a module flagged
    ``gradient_checkpointing`` with no function (HF's old format, whose forward calls torch's checkpoint, reentrant
    by default)."""
    for module in model.modules():
        if not getattr(module, "gradient_checkpointing", False):
            continue
        func = getattr(module, "_gradient_checkpointing_func", None)
        if not isinstance(func, functools.partial) or func.keywords.get("use_reentrant") is not False:
            return True  # no function at all: an old-format model calling torch's checkpoint itself
    return False


# ------------------------------------------------------------------ HF Trainer: the loss with the forward


class _LossOnly:
    """Stands for the model inside ``Trainer.compute_loss``: calling it runs the compiled forward + loss and returns
    ``{"loss": loss}`` (no logits leave the compiled graph). Attribute reads go to the model."""

    def __init__(self, model: torch.nn.Module, compiled):
        self._model, self._compiled = model, compiled

    def __call__(self, **inputs):
        return {"loss": self._compiled(self._model, inputs)}

    def __getattr__(self, name):
        return getattr(self._model, name)


def _model_loss(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    outputs = model(**inputs)
    loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
    if loss is None:
        raise IntegrationError(
            "compile_trainer: the model returned no loss (pass labels, or compile your own compute_loss with "
            "torch.compile(..., backend='tilecompile'))"
        )
    return loss


def _patch_compute_loss(trainer: Any, compile_kwargs: dict) -> None:
    original = trainer.compute_loss
    compiled = torch.compile(_model_loss, **compile_kwargs)

    @functools.wraps(original)
    def compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None):
        plain = getattr(trainer, "compute_loss_func", None) is None and getattr(trainer, "label_smoother", None) is None
        if return_outputs or not plain:  # the caller needs the outputs (logits), or computes the loss from them
            return original(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        return original(_LossOnly(model, compiled), inputs, return_outputs=False, num_items_in_batch=num_items_in_batch)

    trainer.compute_loss = compute_loss


# ------------------------------------------------------------------ TRL: the fused lm_head forward


def _has_trl_fused_head(model: torch.nn.Module) -> bool:
    # functools.wraps gave it the model's own forward's name and module: know it by its code object
    code = getattr(getattr(getattr(model, "forward", None), "__func__", None), "__code__", None)
    name, file = _TRL_FUSED_FORWARD
    return code is not None and code.co_name == name and code.co_filename.endswith(file)


def _trl_fused_head(model: torch.nn.Module) -> dict | None:
    """What TRL's ``add_fused_lm_head`` closed over (temperature, outputs, ...), or None when ``model`` has no such
    forward or one of another TRL version."""
    if not _has_trl_fused_head(model):
        return None
    fn = model.forward.__func__
    names = fn.__code__.co_freevars
    if not _TRL_CLOSURE <= set(names):
        return None
    spec = {n: c.cell_contents for n, c in zip(names, fn.__closure__ or ()) if n in _TRL_CLOSURE}
    spec["trl_forward"] = model.forward
    return spec


def _unsupported(spec: dict, kwargs: dict) -> str | None:
    """Why a fused-lm_head call must run TRL's own forward, or None."""
    extra = set(spec["outputs"]) - _SUPPORTED_OUTPUTS
    if extra:
        return f"outputs {sorted(extra)} (the fused op computes log-probs and entropy)"
    if kwargs.get("output_router_logits") or getattr(spec["text_config"], "output_router_logits", False):
        return "MoE router logits (the load-balancing loss)"
    return None


def _fused_step(spec: dict):
    """The per-token math of TRL's fused forward, as a function of (model, backbone args, kwargs, labels, ...)."""
    temperature, softcap, scale = float(spec["temperature"]), spec["final_logit_softcapping"], spec["logit_scale"]
    backbone_attr, cast_fp32, outputs = spec["backbone_attr"], spec["cast_lm_head_to_fp32"], tuple(spec["outputs"])
    keep_hidden = "is_top1" in outputs

    def step(model, args, kwargs, labels, shift_labels, num_items_in_batch):
        hidden = getattr(model, backbone_attr)(*args, **kwargs).last_hidden_state
        if shift_labels is None:
            hidden, labels = hidden[:, :-1], labels[:, 1:]
        else:
            labels = shift_labels
        lm_head = model.get_output_embeddings()
        mask = labels != -100
        if cast_fp32:
            with torch.autocast(hidden.device.type, enabled=False):
                bias = None if lm_head.bias is None else lm_head.bias.float()
                logits = torch.nn.functional.linear(hidden.float(), lm_head.weight.float(), bias)
        else:
            logits = lm_head(hidden)
        if scale != 1.0:
            logits = logits * scale
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        z = logits.float()
        if temperature != 1.0:
            z = z / temperature
        logp = torch.log_softmax(z, dim=-1)
        picked = logp.gather(-1, torch.where(mask, labels, 0).unsqueeze(-1)).squeeze(-1)
        log_probs = torch.where(mask, picked, 0.0)
        entropy = None
        if "entropy" in outputs:
            entropy = torch.where(mask, -(torch.softmax(z, dim=-1) * logp).sum(-1), 0.0)
        count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        loss = -log_probs.sum() / count
        return loss, log_probs, entropy, mask, (hidden.detach() if keep_hidden else None), labels

    return step


def _is_top1(model: torch.nn.Module, spec: dict, hidden: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor):
    """TRL's own ``is_top1`` (the label is the first argmax), forward only: its kernel, as TRL's forward calls it."""
    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer import utils as trl_utils

    lm_head = model.get_output_embeddings()
    h = hidden.reshape(-1, hidden.size(-1))
    if spec["cast_lm_head_to_fp32"]:
        h = h.float()
    chunk = getattr(trl_utils, "_CHUNKED_LOGPROB_CHUNK_SIZE", 32768)
    with torch.no_grad():
        out = ChunkedLogProbFunction.apply(
            h, lm_head.weight, lm_head.bias, labels.clamp(min=0).reshape(-1), spec["temperature"], chunk,
            spec["final_logit_softcapping"], spec["logit_scale"], ("is_top1",),
        )  # fmt: skip
    return out[4].view(mask.shape).masked_fill(~mask, 0)


def _patch_fused_forward(model: torch.nn.Module, spec: dict, compile_kwargs: dict) -> None:
    from trl.trainer.utils import FusedCausalLMOutput

    trl_forward = spec["trl_forward"]
    compiled = torch.compile(_fused_step(spec), **compile_kwargs)
    warned = set()

    @functools.wraps(type(model).forward)  # generate validates its kwargs against this signature
    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
        if not fused_lm_head:
            return trl_forward(
                *args, labels=labels, shift_labels=shift_labels, num_items_in_batch=num_items_in_batch, **kwargs
            )
        why = _unsupported(spec, kwargs)
        if why is not None:
            if why not in warned:
                warned.add(why)
                log.warning("tilecompile: TRL's fused lm_head call runs uncompiled, as TRL wrote it: %s", why)
            return trl_forward(
                *args,
                fused_lm_head=True,
                labels=labels,
                shift_labels=shift_labels,
                num_items_in_batch=num_items_in_batch,
                **kwargs,
            )
        kwargs["use_cache"] = False
        loss, log_probs, entropy, mask, hidden, shifted = compiled(
            self, args, kwargs, labels, shift_labels, num_items_in_batch
        )
        is_top1 = _is_top1(self, spec, hidden, shifted, mask) if hidden is not None else None
        return FusedCausalLMOutput(loss=loss, log_probs=log_probs, entropy=entropy, is_top1=is_top1, label_mask=mask)

    model.forward = types.MethodType(forward, model)
