"""Hugging Face's `kernels` package under activation checkpointing: keep its per-call routing out of the trace
where it routes nowhere.

transformers >= 5.25 requires `kernels` (5.24 uses it when installed) and wraps each attention module's forward
with ``kernels.use_kernelized_func``: the wrapper sets a module-global ``CompileableContextVar`` to a dict
{id(function): (the module's private wrapper, the forward it selected)} around the original forward, and the
wrapped function (``apply_rotary_pos_emb``) reads it to route its call to a kernel that ``kernels.kernelize``
installed. Under ``torch.compile`` that set is an attribute write on a global object. Inside the activation
checkpoint's higher-order op Dynamo refuses such a side effect ("HOP: Unsafe side effect ... Attempted to mutate
UserDefinedObjectVariable(CompileableContextVar)"), breaks the graph in every layer, and the layers run eagerly:
nothing is rewritten.

The routing only matters for a module that ``kernelize`` gave another forward. Under compile, the wrapped
function's dispatch calls the selected forward only when it is not the class's own (``forward_func is not
type(self).forward``); otherwise it calls the plain function, exactly as when the variable is unset. So a set whose
every entry selects the class's own forward changes nothing any reader does. ``install()`` makes
``CompileableContextVar.set`` skip such a set while compiling (returning a token that ``reset`` knows to skip too)
and leaves every other call as it was: eager runs, kernelized modules and other values are untouched. The fix is
narrower than Dynamo's ``skip_fwd_side_effects_in_bwd_under_checkpoint``, which would let every side effect inside
every checkpoint body of the user's run once in the forward and not in the recompute.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger("tilecompile")

_SKIPPED = object()  # the token of a set that was skipped: its reset is skipped too
_installed: type | None = None


def routes_nowhere(value: Any) -> bool:
    """``value`` is a routing dict whose every entry selects its wrapper's own class forward (nothing kernelized)."""
    if not isinstance(value, dict):
        return False
    for entry in value.values():
        if not (isinstance(entry, tuple) and len(entry) == 2):
            return False
        wrapper, forward = entry
        if forward is not type(wrapper).forward:
            return False
    return True


def _patch(cls: type) -> None:
    original_set, original_reset = cls.set, cls.reset

    def set(self, value):  # noqa: A001 - the method's own name
        if torch.compiler.is_compiling() and not self.uses_global_var and routes_nowhere(value):
            return _SKIPPED
        return original_set(self, value)

    def reset(self, token):
        if token is _SKIPPED:
            return None
        return original_reset(self, token)

    set.__wrapped__, reset.__wrapped__ = original_set, original_reset  # type: ignore[attr-defined]
    cls.set, cls.reset = set, reset


def install() -> bool:
    """Patch ``kernels``' ``CompileableContextVar`` if the package is imported and has the shape described above;
    False (nothing changed) otherwise. Called from the backend (before Dynamo traces) and when kernels is imported
    later than tilecompile, on the backend's first call."""
    global _installed
    import sys

    module = sys.modules.get("kernels._internals.layer.layer")
    cls = getattr(module, "CompileableContextVar", None)
    if cls is None or _installed is cls:
        return _installed is cls and cls is not None
    if not all(callable(getattr(cls, m, None)) for m in ("get", "set", "reset")):
        log.info("kernels' CompileableContextVar has another shape; its routing is left as it is")
        return False
    if not {"global_var", "uses_global_var"} <= set(vars(cls("tilecompile_probe"))):
        log.info("kernels' CompileableContextVar keeps other state; its routing is left as it is")
        return False
    _patch(cls)
    _installed = cls
    return True
