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

No host sync in steady state: the waits are stream waits. The side stream's copies are in issue order, so a
reload's host-to-device copy follows the forward's device-to-host copy of the same tensor.

Host blocks come from ``HostPool``, not PyTorch's caching host allocator: that one rounds every pinned allocation up
to a power of two (an 8B layer's input at 384k tokens, 3 GiB, takes 4), which the plan's host budget does not see.
The pool pins blocks of the exact size (``cudaHostRegister`` over a plain host allocation) and hands a block out
again once nothing holds it (its storage's only user is the pool): a later offload's copy into it is on the same
side stream as the reload's copy out of it, so it is ordered after that without a wait. A request no free block
holds is a new block; the free blocks smaller than it are dropped first (the blocks of a step are of one size, a
layer's input; smaller ones are an earlier, shorter step's), after the side stream's copies are done: the one host
sync, and only where the length grew. ``host_stats()`` gives the bytes held, in use and the peak.

On a CPU both ops are plain copies (the tests' path: values and gradients through the same graphs).
"""

from __future__ import annotations

from typing import Any

import torch

from tilecompile.ops import define_op


class HostPool:
    """Host blocks of exact sizes, reused once free (see the module's docstring). ``pin(ptr, nbytes)`` and
    ``unpin(ptr)`` register and unregister a block (on a CPU, for the tests, they may do nothing); ``drain()`` waits
    for the copies that may still touch a block before one is dropped."""

    def __init__(self, pin: Any, unpin: Any, drain: Any) -> None:
        self._pin, self._unpin, self._drain = pin, unpin, drain
        self._blocks: list[Any] = []  # the untyped storages of the blocks, each pinned once
        self.peak = 0  # the most bytes in use at once since the last reset_peak

    @staticmethod
    def _free(block: Any) -> bool:
        return torch._C._storage_Use_Count(block._cdata) == 1  # the pool's own reference only

    def take(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A host tensor of ``shape`` and ``dtype`` on a free block (the smallest that holds it) or a new one."""
        nbytes = max(1, shape.numel() * dtype.itemsize)
        free = [b for b in self._blocks if self._free(b)]
        fits = [b for b in free if b.nbytes() >= nbytes]
        if fits:
            block = min(fits, key=lambda b: b.nbytes())
        else:
            smaller = [b for b in free if b.nbytes() < nbytes]
            if smaller:
                self._drain()
                for b in smaller:
                    self._unpin(b.data_ptr())
                    self._blocks.remove(b)
                del b, smaller, free  # the dropped blocks' memory goes back before the new one is taken
            block = torch.empty(nbytes, dtype=torch.uint8).untyped_storage()
            self._pin(block.data_ptr(), nbytes)
            self._blocks.append(block)
        host = torch.empty(0, dtype=dtype).set_(block, 0, shape)
        self.peak = max(self.peak, self.in_use())
        return host

    def in_use(self) -> int:
        return sum(b.nbytes() for b in self._blocks if not self._free(b))

    def held(self) -> int:
        return sum(b.nbytes() for b in self._blocks)

    def reset_peak(self) -> None:
        self.peak = self.in_use()

    def release(self) -> None:
        """Drops the free blocks (unpinned); the ones in use stay."""
        free = [b for b in self._blocks if self._free(b)]
        if free:
            self._drain()
        for b in free:
            self._unpin(b.data_ptr())
            self._blocks.remove(b)


def _pin(ptr: int, nbytes: int) -> None:
    code = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 1))  # 1: cudaHostRegisterPortable (every device)
    if code != 0:
        raise torch.OutOfMemoryError(f"tilecompile offload: pinning {nbytes} bytes of host memory failed "
                                     f"(cudaHostRegister error {code}); TILECOMPILE_HOST_BUDGET sets less")  # fmt: skip


def _unpin(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


def _drain() -> None:
    for stream in _side.values():
        stream.synchronize()


_pool = HostPool(_pin, _unpin, _drain)


def host_stats() -> dict[str, int]:
    """The offload's pinned host memory: bytes held by the pool, in use now, and the peak in use since the last
    ``reset_host_peak()``."""
    return {"held": _pool.held(), "in_use": _pool.in_use(), "peak": _pool.peak}


def reset_host_peak() -> None:
    _pool.reset_peak()


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
    host = _pool.take(x.shape, x.dtype)
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
