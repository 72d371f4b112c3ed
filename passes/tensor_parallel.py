"""Rewrites sharded-parameter graphs into graphs with torch.distributed collectives (not built yet).

``tilecompile.parallelize`` does not exist yet, so no parameter carries a sharding annotation and this pass finds
nothing to lower. It is listed in the pipeline so that its flag, its report key and its place in the order exist.
"""

from __future__ import annotations

import torch.fx as fx

from tilecompile.pipeline import PassContext, PassResult

NAME = "tensor_parallel"


def run(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    return PassResult()
