"""Where Dynamo traces user code differently from how Python runs it, in a way that splits RL training steps.

A failing ``import`` inside compiled code. Python raises ``ImportError`` there and the code's own
``try/except ImportError`` takes its fallback: OpenRLHF's ``log_probs_from_logits`` tries
``from flash_attn.ops.triton.cross_entropy import cross_entropy_loss`` and falls back to torch code. Dynamo
(torch 2.11-2.13) breaks the graph at the import instead ("Import failure"): the step becomes several graphs, the
logits cross the break, and no pass sees the lm_head and its log-probs together. With ``install()``, a compile whose
backend is tilecompile raises the ``ImportError`` inside the traced frame, as Python does: the user's handler is
traced like any other code, and an unhandled one ends as Dynamo ends any uncaught exception (a graph break, and the
error in eager). Other backends' compiles are left as they are; ``trace_import_errors=0`` switches it off.

The import outcome is not guarded: a module that becomes importable after the compile is not seen by that graph.
"""

from __future__ import annotations

import dis
from typing import Any

from tilecompile import config

_ORIGINAL: Any = None


def _tilecompile_options(tx: Any) -> dict[str, Any] | None:
    """The ``options=`` of the torch.compile call being traced when its backend is tilecompile, else None."""
    backend = getattr(getattr(tx, "output", None), "compiler_fn", None)
    # under DDP (optimize_ddp) the compiler is DDPOptimizer.compile_fn, which calls the wrapped backend per bucket
    backend = getattr(getattr(backend, "__self__", None), "backend_compile_fn", backend)
    chain = [backend, getattr(backend, "_torchdynamo_orig_backend", None)]
    if not any(getattr(b, "compiler_name", None) == "tilecompile" for b in chain):
        return None
    kwargs = next((b.kwargs for b in chain if isinstance(getattr(b, "kwargs", None), dict)), {})
    return dict(kwargs.get("options") or {})


def _import_name(tx: Any, inst: Any) -> None:
    options = _tilecompile_options(tx)
    if options is not None and config.load(options).trace_import_errors and len(tx.stack) >= 2:
        from torch._dynamo import exc

        level, fromlist = (v.as_python_constant() for v in tx.stack[-2:])
        try:
            __import__(inst.argval, fromlist=fromlist, level=level, globals=tx.f_globals)
        except ImportError as error:
            tx.popn(2)
            exc.raise_observed_exception(type(error), tx, args=[str(error)])
    _ORIGINAL(tx, inst)


def install() -> bool:
    """Route Dynamo's IMPORT_NAME through ``_import_name``; False (and nothing changed) where this torch differs."""
    global _ORIGINAL
    if _ORIGINAL is not None:
        return True
    try:
        from torch._dynamo import exc
        from torch._dynamo import symbolic_convert as sc
    except ImportError:
        return False
    base = getattr(sc, "InstructionTranslatorBase", None)
    original = getattr(base, "IMPORT_NAME", None)
    if original is None or not hasattr(exc, "raise_observed_exception") or not hasattr(base, "dispatch_table"):
        return False
    _ORIGINAL = original
    base.IMPORT_NAME = _import_name  # subclasses created later build their tables from it
    opcode = dis.opmap["IMPORT_NAME"]
    todo = [base]
    while todo:  # each translator class holds its own opcode table, built when the class was created
        cls = todo.pop()
        todo += cls.__subclasses__()
        table = cls.__dict__.get("dispatch_table")
        if isinstance(table, list) and len(table) > opcode and table[opcode] is original:
            table[opcode] = _import_name
    return True
