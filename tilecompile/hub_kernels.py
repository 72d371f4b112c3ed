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

transformers imports `kernels` lazily, when a model is built, which is usually after ``import tilecompile`` and
before the first ``torch.compile`` trace; a patch made at the backend's first call would come too late (Dynamo has
already split that frame, and keeps the split). So where the module is not imported yet, ``install()`` puts a finder
on ``sys.meta_path`` that patches the class as soon as the module has run.
"""

from __future__ import annotations

import importlib.abc
import logging
import sys
from typing import Any

import torch

log = logging.getLogger("tilecompile")

MODULE = "kernels._internals.layer.layer"  # where CompileableContextVar lives (kernels 0.19)
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
    False (nothing changed) otherwise. Where it is not imported yet, the patch waits for its import (the finder
    below). Called when the backend is loaded, and on its first call."""
    global _installed
    module = sys.modules.get(MODULE)
    cls = getattr(module, "CompileableContextVar", None)
    if cls is None:
        if module is None and not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
            sys.meta_path.insert(0, _PatchOnImport())
        return False
    if _installed is cls:
        return True
    if not all(callable(getattr(cls, m, None)) for m in ("get", "set", "reset")):
        log.info("kernels' CompileableContextVar has another shape; its routing is left as it is")
        return False
    if not {"global_var", "uses_global_var"} <= set(vars(cls("tilecompile_probe"))):
        log.info("kernels' CompileableContextVar keeps other state; its routing is left as it is")
        return False
    _patch(cls)
    _installed = cls
    return True


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds ``MODULE`` through the other finders and has its loader call ``install()`` once the module has run; it
    leaves every other import, and the module itself, as they are."""

    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None) if finder is not self else None
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        run = getattr(loader, "exec_module", None)
        if run is None:
            return spec

        def exec_module(module):
            run(module)
            try:
                install()
            except Exception as e:  # the patch is an optimisation: a failure must not break the user's import
                log.info("kernels' CompileableContextVar was not patched: %s", e)

        loader.exec_module = exec_module  # this module's loader instance only
        return spec
