"""DDP under the tilecompile backend: DDP's graph split comes after the passes.

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

from tilecompile import backend
from tilecompile.backend import tilecompile_backend

_ORIGINAL: Any = None


def tilecompile_call(compiler: Any) -> dict[str, Any] | None:
    """The keyword arguments (``options``, ``mode``) of a torch.compile call whose backend is tilecompile, read off
    the compiler Dynamo holds (``torch.compile``'s wrapper, or the backend function itself); None for others."""
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
    """``DDPOptimizer.compile_fn`` for a tilecompile compile: the backend's rewrite on the whole graph, then, as its
    lowering step, the split of the rewritten graph, each piece lowered by the backend's inner compiler."""
    from tilecompile import config

    kwargs = tilecompile_call(self.backend_compile_fn)
    if kwargs is None or not config.load(kwargs.get("options")).ddp_split_after_passes:
        return _ORIGINAL(self, gm, example_inputs, **configs)
    outer = self.backend_compile_fn

    def split_then_lower(rewritten, inputs, inner, mode, options):
        def piece(sub: fx.GraphModule, sub_inputs: list[Any], **_: Any) -> Any:
            unalias_detached_outputs(sub)
            return backend.inner_compile(sub, sub_inputs, inner, mode, options)

        self.backend_compile_fn = piece
        try:
            return _ORIGINAL(self, rewritten, inputs, **configs)
        finally:
            self.backend_compile_fn = outer

    return backend.compile_graph(gm, example_inputs, lower=split_then_lower, **kwargs)


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


__all__ = ["install", "tilecompile_call", "unalias_detached_outputs"]
