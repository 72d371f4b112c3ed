"""Data-parallel engines under the tilecompile backend: DDP's graph split comes after the passes.

DDP. With Dynamo's default ``optimize_ddp=True`` ("ddp_optimizer"), Dynamo hands the graph of a compiled
``DistributedDataParallel`` module to ``DDPOptimizer``, which splits it at DDP's bucket boundaries (about 25 MiB of
parameters each) and calls the backend once per piece, so that each piece's backward can start its bucket's
all-reduce while the pieces before it still run their backward (communication overlaps compute). Every real model
spans several buckets, and the split falls inside the regions the passes rewrite: a gated MLP whose gate and up
projections sit in two pieces, an lm_head whose logits end one piece and whose log-softmax starts the next, an
attention mask built in one piece and used in others. So the passes saw fragments and rewrote little.

``install()`` makes a DDP compile whose backend is tilecompile run the passes on the whole graph first, and then
lets ``DDPOptimizer`` split the rewritten graph at the same bucket boundaries and compile each piece with the inner
compiler (Inductor, aot_eager). A rewritten region is one node (a custom op), so no split can cut through it; the
pieces still each have their own backward, so the bucket all-reduces overlap as before. Nothing of the user's
settings changes: ``optimize_ddp=False`` still compiles one graph (one all-reduce after the whole backward), and
other backends' DDP compiles are left as they are. ``ddp_split_after_passes=0`` switches this off.

Why not ``optimize_ddp="python_reducer"``: it keeps the graph whole but needs compiled autograd (a second trace of
the backward, through our custom ops) and is decided when the DDP module is built, before any compile.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

_ORIGINAL: Any = None


def tilecompile_call(compiler: Any) -> dict[str, Any] | None:
    """The keyword arguments (``options``, ``mode``) of a torch.compile call whose backend is tilecompile, read off
    the compiler Dynamo holds (``torch.compile``'s wrapper, or the backend function itself); None for others."""
    from tilecompile.backend import tilecompile_backend

    chain, seen = [compiler], set()
    while chain:
        c = chain.pop()
        if c is None or id(c) in seen:
            continue
        seen.add(id(c))
        if c is tilecompile_backend or getattr(c, "compiler_name", None) == "tilecompile":
            return dict(getattr(c, "kwargs", None) or {})
        if getattr(c, "compiler_fn", None) is tilecompile_backend:
            return dict(getattr(c, "kwargs", None) or {})
        chain += [getattr(c, "compiler_fn", None), getattr(c, "_torchdynamo_orig_backend", None)]
    return None


def _compile_fn(self: Any, gm: fx.GraphModule, example_inputs: list[Any], **configs: Any) -> Any:
    """``DDPOptimizer.compile_fn`` for a tilecompile compile: the backend's passes on the whole graph, then the split
    of the rewritten graph, each piece compiled by the backend's inner compiler."""
    from tilecompile import backend, config

    kwargs = tilecompile_call(self.backend_compile_fn)
    if kwargs is None or not config.load(kwargs.get("options")).ddp_split_after_passes:
        return _ORIGINAL(self, gm, example_inputs, **configs)
    inner_compile, outer = backend._inner_compile, self.backend_compile_fn

    def split_then_compile(rewritten, inputs, inner, mode, options):
        # the backend's last step (its inner compile) becomes DDPOptimizer's split, whose pieces go to that step
        def piece(sub: fx.GraphModule, sub_inputs: list[Any], **_: Any) -> Any:
            unalias_detached_outputs(sub)
            return inner_compile(sub, sub_inputs, inner, mode, options)

        self.backend_compile_fn = piece
        try:
            return _ORIGINAL(self, rewritten, inputs, **configs)
        finally:
            self.backend_compile_fn = outer

    backend._inner_compile = split_then_compile  # under Dynamo's compile lock: one compile at a time
    try:
        return backend.tilecompile_backend(gm, example_inputs, **kwargs)
    finally:
        backend._inner_compile = inner_compile


def _is_detach(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target == "detach"
    return node.op == "call_function" and node.target in (torch.detach, torch.ops.aten.detach.default)


def unalias_detached_outputs(gm: fx.GraphModule) -> int:
    """Clones each output of ``gm`` that is the ``detach`` of another output's storage; returns how many.

    AOTAutograd (torch 2.13) regenerates an output that aliases another output by replaying its views, and gets the
    shape wrong when a graph returns a view of an intermediate together with its ``detach``
    (``z = (x * w)[:, :-1]; return z.detach(), z`` fails with "incorrect out shape after application of ViewMeta
    sequence"). The loss-aware lm_head takes its input detached and anchors its gradient on the input itself, so a
    DDP split between the two hands exactly that pair across a piece boundary. The clone costs one copy of the
    lm_head's input ([tokens, hidden]) in the forward, only where a split falls there.
    """
    from torch.multiprocessing.reductions import StorageWeakRef

    output = next(n for n in gm.graph.nodes if n.op == "output")
    outs = [a for a in torch.utils._pytree.tree_leaves(output.args[0]) if isinstance(a, fx.Node)]

    def storage(node: fx.Node) -> Any:
        value = node.meta.get("example_value")
        if not isinstance(value, torch.Tensor):
            return None
        try:
            return StorageWeakRef(value.untyped_storage())
        except (NotImplementedError, RuntimeError):
            return None

    refs = {n: storage(n) for n in outs}
    cloned = 0
    for node in dict.fromkeys(outs):
        ref = refs[node]
        if ref is None or not _is_detach(node) or not any(o is not node and refs[o] == ref for o in outs):
            continue
        with gm.graph.inserting_after(node):
            copy = gm.graph.call_method("clone", (node,))
        copy.meta = dict(node.meta)
        copy.meta["example_value"] = node.meta["example_value"].clone()
        output.replace_input_with(node, copy)
        cloned += 1
    if cloned:
        gm.graph.lint()
        gm.recompile()
    return cloned


def install() -> bool:
    """Route DDPOptimizer's compile through ``_compile_fn``; False (and nothing changed) where this torch differs."""
    global _ORIGINAL
    if _ORIGINAL is not None:
        return True
    try:
        from torch._dynamo.backends.distributed import DDPOptimizer
    except ImportError:
        return False
    original = getattr(DDPOptimizer, "compile_fn", None)
    if original is None:
        return False
    _ORIGINAL = original
    DDPOptimizer.compile_fn = _compile_fn
    return True


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


__all__ = ["LossHead", "install", "tilecompile_call"]
