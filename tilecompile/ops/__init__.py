"""tilecompile's custom ops (one module per fused region), and what their implementations share."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


def define_op(name: str, schema: str, impl: Any, fake: Any, tags: tuple = ()) -> Any:
    """The custom op ``tilecompile::<name>`` declared by its schema (where its arguments and their types are written
    once), with its implementation and its fake; both take the schema's arguments in order. ``tags``: torch.Tag's."""
    op = torch.library.custom_op(f"tilecompile::{name}", impl, mutates_args=(), schema=schema, tags=tags)
    op.register_fake(fake)
    return op


def _keep(t: torch.Tensor) -> torch.Tensor:
    return t


@contextlib.contextmanager
def own_autograd() -> Iterator[None]:
    """Autograd that tilecompile runs for itself (the passes' fake runs at compile time, the loss-aware op's
    per-token gradient at run time) stays out of the user's saved-tensors hooks (activation offloading, and the
    hooks of non-reentrant checkpointing, which would start a recomputation in the middle of the forward): a pair
    of no-op hooks goes on top of the stack. Where hooks are disabled (``disable_saved_tensors_hooks``), none can
    run and none may be pushed."""
    enabled = getattr(torch._C._autograd, "_saved_tensors_hooks_is_enabled", lambda: True)()
    _beneath.append(user_saved_tensors_hooks())
    try:
        with torch.autograd.graph.saved_tensors_hooks(_keep, _keep) if enabled else contextlib.nullcontext():
            yield
    finally:
        _beneath.pop()


_beneath: list[bool] = []  # per own_autograd() entered: whether the user's hooks were on the stack beneath it


def user_saved_tensors_hooks() -> bool:
    """Whether saved-tensors hooks of the user's (activation offloading: TRL's, torchtune's, a
    ``saved_tensors_hooks`` context around the step) are on the stack, seen through ``own_autograd``'s own."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", lambda _: None)(True)
    if top is not None and all(f is _keep for f in top):
        return bool(_beneath) and _beneath[-1]
    return top is not None
