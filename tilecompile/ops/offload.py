"""Activations offloaded to host memory between the forward and the backward: two custom ops that the offload
partition (tilecompile/offload.py) puts into the compiled forward and backward graphs.

``tilecompile::offload(x, previous, after, wait) -> host``: a host copy of ``x`` (contiguous; pinned when ``x`` is on a
CUDA device), made on a side stream of ``x``'s device while the compute stream goes on. The forward graph returns
``host`` as the saved tensor in place of ``x``, so ``x`` is freed on the device once the forward is done with it.
Two hazards and what answers them:

- the caching allocator may hand ``x``'s block to a later allocation of the compute stream while the copy still
  reads it: ``x.record_stream(side)`` holds the block until the side stream's work is done;
- Inductor reuses a dead buffer of its own for a later kernel's output, outside the allocator: the graph passes the
  previous offload's input as ``previous``, which keeps that buffer alive (in Inductor's eyes) until this call, and
  here the compute stream waits for every earlier copy before going on. The last offload of a graph has ``wait``
  set: the compute stream waits for its copy at once (one layer's copy on the compute stream's path per step).

``after`` (both ops): the previous call's output, which this call does not read: it only orders the calls
(Inductor may reorder independent nodes; the waits above rely on the graph's order). For a reload that keeps the
previous layer's reloaded input alive until this call, which comes right after that layer's backward.

``tilecompile::reload(host, next, after, device) -> x``: ``host`` back on ``device``. When a previous reload
prefetched it (it was that call's ``next``), the compute stream only waits for that copy; otherwise the copy is made
now, on the side stream, and waited for. Then ``next`` (the host tensor the backward reloads after this one) is
copied on the side stream into a fresh device tensor, held here until its reload: one layer's copy ahead of its use,
under the compute of this one.

No host sync anywhere: the waits are stream waits. The side stream's copies are in issue order, so a reload's
host-to-device copy follows the forward's device-to-host copy of the same tensor. Pinned host blocks come from
PyTorch's caching host allocator, which reuses them across steps once their copies are done.

On a CPU both ops are plain copies (the tests' path: values and gradients through the same graphs).
"""

from __future__ import annotations

from typing import Any

import torch

from tilecompile.ops import define_op

_side: dict[torch.device, Any] = {}  # a side stream per CUDA device
_pending: list[Any] = []  # the events of host copies the compute stream has not waited for yet
_prefetched: dict[int, tuple[torch.Tensor, torch.Tensor, Any]] = {}  # host data_ptr -> (host, device copy, event)


def _side_stream(device: torch.device) -> Any:
    if device not in _side:
        _side[device] = torch.cuda.Stream(device)
    return _side[device]


def _offload(x: torch.Tensor, previous: torch.Tensor | None, after: torch.Tensor | None, wait: bool) -> torch.Tensor:
    if x.device.type != "cuda":
        return x.to("cpu", copy=True).contiguous()
    compute = torch.cuda.current_stream(x.device)
    if previous is None:  # the forward's first offload: what an aborted step left behind is dropped
        _prefetched.clear()
    for done in _pending:  # the earlier copies (``previous``'s): issued a layer ago, done by now as a rule
        compute.wait_event(done)
    _pending.clear()
    side = _side_stream(x.device)
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    side.wait_stream(compute)  # x is made on the compute stream
    with torch.cuda.stream(side):
        host.copy_(x, non_blocking=True)
        done = torch.cuda.Event()
        done.record(side)
    x.record_stream(side)
    if wait:
        compute.wait_event(done)
    else:
        _pending.append(done)
    return host


def _offload_fake(
    x: torch.Tensor, previous: torch.Tensor | None, after: torch.Tensor | None, wait: bool
) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device="cpu")


def _copy_on_side(host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, Any]:
    compute = torch.cuda.current_stream(device)
    out = torch.empty(host.shape, dtype=host.dtype, device=device)  # the compute stream's block
    side = _side_stream(device)
    side.wait_stream(compute)  # the block may have been the compute stream's until now
    with torch.cuda.stream(side):
        out.copy_(host, non_blocking=True)
        done = torch.cuda.Event()
        done.record(side)
    out.record_stream(side)  # a prefetch dropped unused (an aborted backward) is not handed out mid-copy
    return out, done


def _reload(
    host: torch.Tensor, next: torch.Tensor | None, after: torch.Tensor | None, device: torch.device
) -> torch.Tensor:
    if device.type != "cuda":
        return host.to(device, copy=True)
    entry = _prefetched.pop(host.data_ptr(), None)  # it holds its host tensor: that address is this tensor's
    if entry is not None:
        out, done = entry[1], entry[2]
    else:
        out, done = _copy_on_side(host, device)
    torch.cuda.current_stream(device).wait_event(done)
    if next is not None and next.data_ptr() not in _prefetched:
        copy, ready = _copy_on_side(next, device)
        _prefetched[next.data_ptr()] = (next, copy, ready)  # holding `next` keeps its address from being reused
    return out


def _reload_fake(
    host: torch.Tensor, next: torch.Tensor | None, after: torch.Tensor | None, device: torch.device
) -> torch.Tensor:
    return torch.empty(host.shape, dtype=host.dtype, device=device)


_UNSAFE = (torch.Tag.cudagraph_unsafe,)  # state kept across calls (pending copies, prefetches): never in a CUDA graph
offload = define_op("offload", "(Tensor x, Tensor? previous, Tensor? after, bool wait) -> Tensor", _offload,
                    _offload_fake, _UNSAFE)  # fmt: skip
reload = define_op("reload", "(Tensor host, Tensor? next, Tensor? after, Device device) -> Tensor", _reload,
                   _reload_fake, _UNSAFE)  # fmt: skip
