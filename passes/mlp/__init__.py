"""The tiled_mlp pass: gated MLPs, dense and MoE experts, become token-chunked recompute regions.

Two stages over one graph, each find -> check -> rewrite with a reason for every candidate it leaves:
``experts.py`` (MoE experts over stacked [E, ...] weights -> ``tilecompile::tiled_grouped_mlp``), then
``dense.py`` (``down(act(gate(x)) * up(x))`` -> ``tilecompile::tiled_gated_mlp``); ``common.py`` holds what both
read. The experts go first: their projections are grouped matmuls the dense stage would not read, and a rewritten
region is one node the dense stage passes over.
"""

from __future__ import annotations

import torch.fx as fx

from tilecompile import graph as fxgraph
from tilecompile.pass_api import PassContext, PassResult
from tilecompile.passes.mlp.common import NAME
from tilecompile.passes.mlp.dense import run_dense
from tilecompile.passes.mlp.experts import run_experts

__all__ = ["NAME", "run"]


def run(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    result = PassResult()
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    markers = [i for n, i in order.items() if fxgraph.is_autocast_marker(n)]
    changed = run_experts(gm, ctx, result, order, markers)
    changed = run_dense(gm, ctx, result, order, markers) or changed
    if changed:
        gm.recompile()
    return result
