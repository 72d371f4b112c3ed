"""Differentiable tensor-parallel collectives: forward/backward pairs over torch's functional collectives.

The functional collectives (``torch.distributed._functional_collectives``) have no autograd of their own. Each
boundary of a tensor-parallel region needs a forward collective and a different backward one (the boundaries are
listed in passes/tensor_parallel.py's docstring), so each pair is an ``autograd.Function`` whose two halves call
the functional collectives. AOTAutograd traces through both halves, so the compiled forward and backward graphs
hold plain ``_c10d_functional`` ops (and their ``wait_tensor``), which Inductor can reorder and, on CUDA, fuse with
the matmuls next to them (async TP).

| function              | forward                    | backward                   | where                              |
|-----------------------|----------------------------|----------------------------|------------------------------------|
| ``copy_to_tp``        | identity                   | all_reduce (sum)           | replicated input of colwise        |
| ``reduce_from_tp``    | all_reduce (sum)           | identity                   | partial output of rowwise          |
| ``gather_from_tp``    | all_gather along ``dim``   | own slice along ``dim``    | sharded value into replicated code |
| ``scatter_to_tp``     | own slice along ``dim``    | all_gather along ``dim``   | replicated value into sharded code |
| ``gather_seq``        | all_gather along ``dim``   | reduce_scatter along dim   | SP: Shard(seq) into colwise        |
| ``reduce_scatter_seq``| reduce_scatter along dim   | all_gather along ``dim``   | SP: partial output of rowwise      |

Every function takes the group by name (a ``str``: FX graphs cannot hold a ProcessGroup) with its size and this
process's rank in it. Outputs are fresh tensors or views made by autograd.Function (never custom-op aliases).
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol


def _wait(t: torch.Tensor) -> torch.Tensor:
    # eager: an AsyncCollectiveTensor to wait on; traced: already followed by wait_tensor in the graph
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def all_reduce(x: torch.Tensor, op: str, group: str) -> torch.Tensor:
    return _wait(funcol.all_reduce(x.contiguous(), op, group))


def all_gather(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    return _wait(funcol.all_gather_tensor(x.contiguous(), dim, group))


def reduce_scatter(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    return _wait(funcol.reduce_scatter_tensor(x.contiguous(), "sum", dim, group))


def _own_slice(x: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    size = x.shape[dim] // world
    return x.narrow(dim, rank * size, size).contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, world, rank):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return all_reduce(g, "sum", ctx.group), None, None, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, world, rank):
        return all_reduce(x, "sum", group)

    @staticmethod
    def backward(ctx, g):
        return g, None, None, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, world, rank):
        ctx.dim, ctx.world, ctx.rank = dim, world, rank
        return all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return _own_slice(g, ctx.dim, ctx.rank, ctx.world), None, None, None, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, world, rank):
        ctx.dim, ctx.group = dim, group
        return _own_slice(x, dim, rank, world)

    @staticmethod
    def backward(ctx, g):
        return all_gather(g, ctx.dim, ctx.group), None, None, None, None


def _seq_pair(name: str, forward_op, backward_op) -> type[torch.autograd.Function]:
    """The sequence-parallel Function: ``forward_op(x, dim, group)`` forward, ``backward_op(g, dim, group)``
    backward (all_gather and reduce_scatter, one each way)."""

    class _SeqPair(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, dim, group, world, rank):
            ctx.dim, ctx.group = dim, group
            return forward_op(x, dim, group)

        @staticmethod
        def backward(ctx, g):
            return backward_op(g, ctx.dim, ctx.group), None, None, None, None

    _SeqPair.__name__ = _SeqPair.__qualname__ = name
    return _SeqPair


_GatherSeq = _seq_pair("_GatherSeq", all_gather, reduce_scatter)
_ReduceScatterSeq = _seq_pair("_ReduceScatterSeq", reduce_scatter, all_gather)


def copy_to_tp(x: torch.Tensor, group: str, world: int, rank: int) -> torch.Tensor:
    """Identity forward; all_reduce of the gradient (a replicated value read by column-parallel linears)."""
    return _CopyToTP.apply(x, group, world, rank)


def reduce_from_tp(x: torch.Tensor, group: str, world: int, rank: int) -> torch.Tensor:
    """all_reduce forward (partial sums of a row-parallel linear); identity backward."""
    return _ReduceFromTP.apply(x, group, world, rank)


def gather_from_tp(x: torch.Tensor, dim: int, group: str, world: int, rank: int) -> torch.Tensor:
    """all_gather along ``dim`` forward; this rank's slice of the (replicated) gradient backward."""
    return _GatherFromTP.apply(x, dim, group, world, rank)


def scatter_to_tp(x: torch.Tensor, dim: int, group: str, world: int, rank: int) -> torch.Tensor:
    """This rank's slice along ``dim`` forward; all_gather of the gradient backward."""
    return _ScatterToTP.apply(x, dim, group, world, rank)


def gather_seq(x: torch.Tensor, dim: int, group: str, world: int, rank: int) -> torch.Tensor:
    """Sequence parallel: all_gather along the sequence dim forward; reduce_scatter of the gradient backward."""
    return _GatherSeq.apply(x, dim, group, world, rank)


def reduce_scatter_seq(x: torch.Tensor, dim: int, group: str, world: int, rank: int) -> torch.Tensor:
    """Sequence parallel: reduce_scatter along the sequence dim forward; all_gather of the gradient backward."""
    return _ReduceScatterSeq.apply(x, dim, group, world, rank)


# what each function does to its input's shape along its dim (for fake values): x times, x divided
GATHERS = (gather_from_tp, gather_seq)
SCATTERS = (scatter_to_tp, reduce_scatter_seq)
IDENTITIES = (copy_to_tp, reduce_from_tp)
ALL = GATHERS + SCATTERS + IDENTITIES

# the collectives each function puts in the forward and backward graphs
COLLECTIVES = {
    copy_to_tp: (None, "all_reduce"),
    reduce_from_tp: ("all_reduce", None),
    gather_from_tp: ("all_gather", None),
    scatter_to_tp: (None, "all_gather"),
    gather_seq: ("all_gather", "reduce_scatter"),
    reduce_scatter_seq: ("reduce_scatter", "all_gather"),
}

__all__ = [
    "all_gather",
    "all_reduce",
    "copy_to_tp",
    "gather_from_tp",
    "gather_seq",
    "reduce_from_tp",
    "reduce_scatter",
    "reduce_scatter_seq",
    "scatter_to_tp",
]


# ------------------------------------------------------------------------ vocab-parallel lm_head (a marker)


@torch.library.custom_op("tilecompile::vocab_parallel_linear", mutates_args=())
def vocab_parallel_linear(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: str, world: int, rank: int
) -> torch.Tensor:
    """``linear(h, weight, bias)`` of this rank's vocabulary rows, all-gathered: the whole [..., V] logits.

    What a ``vocab_colwise`` lm_head calls (``tilecompile.parallelize`` swaps its forward), so that Dynamo traces
    the code after the lm_head with the logits' true width (Hugging Face's loss views them as ``(-1, vocab_size)``).
    The tensor_parallel pass replaces it with ``copy_to_tp -> linear -> gather_from_tp``; the fused lm_head pass then
    drops the gather. This eager implementation (process-group collectives) runs only when nothing replaced it.
    """
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    z = torch.nn.functional.linear(h, weight, bias)
    parts = [torch.empty_like(z) for _ in range(world)]
    dist.all_gather(parts, z.contiguous(), group=_resolve_process_group(group))
    return torch.cat(parts, dim=-1)


@vocab_parallel_linear.register_fake
def _(h, weight, bias, group, world, rank):
    return h.new_empty((*h.shape[:-1], weight.shape[0] * world))


def _vpl_setup(ctx, inputs, output):
    h, weight, bias, group, world, rank = inputs
    ctx.save_for_backward(h, weight)
    ctx.group, ctx.world, ctx.rank, ctx.has_bias = group, world, rank, bias is not None


def _vpl_backward(ctx, g):
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    h, weight = ctx.saved_tensors
    g = _own_slice(g, g.dim() - 1, ctx.rank, ctx.world)
    dh = g @ weight
    dist.all_reduce(dh, group=_resolve_process_group(ctx.group))
    dw = g.reshape(-1, g.shape[-1]).t() @ h.reshape(-1, h.shape[-1])
    db = g.reshape(-1, g.shape[-1]).sum(0) if ctx.has_bias else None
    return dh, dw, db, None, None, None


vocab_parallel_linear.register_autograd(_vpl_backward, setup_context=_vpl_setup)
