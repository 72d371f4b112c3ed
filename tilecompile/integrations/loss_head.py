"""FSDP2 and a causal LM's loss: ``LossHead`` keeps the lm_head and the loss in one graph, and ``use_layer_masks``
lets each decoder layer's graph build its own attention mask (Hugging Face's ``AttentionInterface`` /
``AttentionMaskInterface``), so that the attention pass can read it."""

from __future__ import annotations

from typing import Any

import torch

LAYER_MASK = "tilecompile_sdpa"  # the attention implementation LossHead gives an sdpa model

# transformers' modules the two functions below call, imported by ``use_layer_masks`` (outside any trace): Dynamo
# cannot trace ``from transformers import ...`` through transformers' lazy top-level module ("Bad import result",
# transformers 5.17), which fell back to eager for every layer
_HF: dict = {}


def _layer_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
                local_size=None, **kwargs):  # fmt: skip
    """HF's mask function for ``LAYER_MASK``: the plain causal mask over a padding mask is left for each layer to
    build (``_layer_attention`` gets the [B, N] padding mask, or None); anything else is HF's own sdpa mask."""
    mu = _HF["masking_utils"]
    plain = mask_function is mu.causal_mask_function and local_size is None
    plain = plain and isinstance(q_offset, int) and q_offset == 0 and isinstance(kv_offset, int) and kv_offset == 0
    if plain and (attention_mask is None or (attention_mask.dim() == 2 and attention_mask.shape[-1] == kv_length)):
        return attention_mask
    return mu.sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                        local_size, **kwargs)  # fmt: skip


def _layer_attention(module, query, key, value, attention_mask, **kwargs):
    """HF's sdpa attention, with a [B, N] padding mask made into HF's causal [B, 1, N, N] mask here, in the layer's
    graph, where the attention pass reads how it is built."""
    mu = _HF["masking_utils"]
    if attention_mask is None or attention_mask.dim() == 2:
        b, q_len, kv_len = query.shape[0], query.shape[2], key.shape[2]
        attention_mask = mu.sdpa_mask(b, q_len, kv_len, attention_mask=attention_mask, allow_is_causal_skip=False,
                                      device=query.device)  # fmt: skip
    return _HF["sdpa_attention_forward"](module, query, key, value, attention_mask, **kwargs)


def use_layer_masks(model: torch.nn.Module) -> bool:
    """Gives a Hugging Face sdpa ``model`` the attention implementation ``LAYER_MASK``: the same math, with the causal
    mask built inside each attention call from the padding mask instead of once before the first layer. False (and
    nothing changed) for other models and implementations."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) not in ("sdpa", LAYER_MASK):
        return False
    try:
        import transformers.masking_utils as masking_utils
        from transformers import AttentionInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:
        return False
    _HF.update(masking_utils=masking_utils, sdpa_attention_forward=sdpa_attention_forward)
    AttentionInterface.register(LAYER_MASK, _layer_attention)
    AttentionMaskInterface.register(LAYER_MASK, _layer_mask)
    for module in model.modules():
        cfg = getattr(module, "config", None)
        if getattr(cfg, "_attn_implementation", None) == "sdpa":
            cfg._attn_implementation = LAYER_MASK
    return True


class LossHead(torch.nn.Module):
    """A causal LM and its loss in one module, laid out so that the lm_head and the loss share one graph under
    FSDP2: ``LossHead(model, loss_fn)(input_ids, attention_mask, *args)`` runs the decoder
    (``model.get_decoder()``), then ``model.get_output_embeddings()`` (the lm_head) and
    ``loss_fn(logits, input_ids, attention_mask, *args)`` in its own ``forward``.

    FSDP2 wraps each of its hooks in ``torch._dynamo.disable``, so a compile breaks the graph at every call of a
    wrapped module; each function on the way (the user's step, ``LlamaForCausalLM.forward``, ``LlamaModel.forward``)
    then compiles as graphs of its own, the lm_head ends one (its logits an output) and the loss starts another. Here
    the break falls at the decoder call, and the rest of ``forward`` (lm_head, then the loss) resumes as one graph in
    which the fused lm_head fires; each decoder layer's own graph gets the tiled MLP. The attention mask would be
    built once before the first layer and enter each layer's graph as an input, so the attention pass could not
    read it; with ``layer_masks`` (default) an sdpa model is switched to ``LAYER_MASK``: each layer's graph builds
    HF's causal mask from the [B, N] padding mask itself (``use_layer_masks``), and the attention pass rewrites it.
    Masks other than causal-over-padding (sliding windows, packed sequences) are left as HF builds them.
    Use it as the FSDP2 root::

        head = tilecompile.LossHead(model, loss_fn)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(head, mesh=mesh)
        head.compile(backend="tilecompile")  # the head and each layer (``compile``)
        loss = head(input_ids, attention_mask, *loss_args)
    """

    def __init__(self, model: torch.nn.Module, loss_fn: Any, layer_masks: bool = True) -> None:
        super().__init__()
        if not callable(getattr(model, "get_decoder", None)) or not callable(
            getattr(model, "get_output_embeddings", None)
        ):
            raise TypeError(
                f"LossHead needs a causal LM with get_decoder() and get_output_embeddings() (Hugging Face's); "
                f"got {type(model).__name__}"
            )
        self.model = model
        self.loss_fn = loss_fn
        self.layer_masks = layer_masks and use_layer_masks(model)

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """``torch.compile`` in place (``nn.Module.compile``'s arguments), this head and each decoder layer: under
        FSDP2 with torch 2.11, the graph break at a layer's hooks falls inside the decoder's loop over its layers,
        and Dynamo then skips the decoder's whole frame ("graph break in loop": every layer ran eagerly, no
        attention or MLP rewrite, measured on the H200); a layer compiled on its own keeps its graph. Where Dynamo
        does trace the decoder's loop (torch 2.13), the layers' own compiles are inlined into that trace, as
        before."""
        super().compile(*args, **kwargs)
        for layer in getattr(self.model.get_decoder(), "layers", ()):
            layer.compile(*args, **kwargs)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *args: Any, **kwargs: Any):
        decoder = self.model.get_decoder()
        layer_mask = attention_mask
        if layer_mask is None and self.layer_masks:
            # the same mask as none at HF's default positions (one causal sequence a row); without it HF reads its
            # arange positions as a packed-sequence mask, built before the first layer, which the layers cannot read
            layer_mask = torch.ones_like(input_ids)
        hidden = decoder(input_ids=input_ids, attention_mask=layer_mask, use_cache=False).last_hidden_state
        logits = self.model.get_output_embeddings()(hidden)
        return self.loss_fn(logits, input_ids, attention_mask, *args, **kwargs)


__all__ = ["LAYER_MASK", "LossHead", "use_layer_masks"]
