"""What a pass is given and gives back: ``PassContext``, ``PassResult``, ``expect`` for the nodes it inserts, and
``snapshot_graph`` for a pass that keeps a copy to undo with.

A pass is a module in ``tilecompile.passes`` with ``NAME`` and ``run(gm, ctx) -> PassResult``; the pipeline
(``tilecompile/pipeline.py``) runs them in order and checks each. This module sits below both, so that the passes
and the pipeline never import each other.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch.fx as fx

from tilecompile import reporting
from tilecompile.config import Settings

EXPECTED = "tilecompile_expected"  # node.meta key: what a newly inserted node must produce (``expect``)
# node.meta key that tensor_parallel sets on the gather after a vocab_colwise lm_head (its ShardSpec), for the lm_head
# pass to fuse the gathered lm_head into vocab_parallel_logprob
VOCAB_GATHER = "tilecompile_tp_vocab"


@dataclasses.dataclass
class PassContext:
    settings: Settings
    graph_name: str = "<root>"


@dataclasses.dataclass
class PassResult:
    rewrites: list[reporting.Rewrite] = dataclasses.field(default_factory=list)
    skipped: list[reporting.Skip] = dataclasses.field(default_factory=list)
    # the candidates a pass looked at (``consider``) and those it decided, by a rewrite or a skip with its reason:
    # the pipeline checks that none was dropped without a reason (strict: PassFailed)
    looked_at: dict[Any, str] = dataclasses.field(default_factory=dict)
    decided: set[Any] = dataclasses.field(default_factory=set)

    def consider(self, key: Any, candidate: str) -> None:
        """``key`` (e.g. the candidate's anchor node) must end in ``rewrote`` or ``skip`` before the pass returns."""
        self.looked_at[key] = candidate

    def rewrote(self, key: Any, rewrite: reporting.Rewrite) -> None:
        self.rewrites.append(rewrite)
        self.decided.add(key)

    def skip(self, key: Any, skip: reporting.Skip) -> None:
        self.skipped.append(skip)
        self.decided.add(key)

    def undecided(self) -> list[str]:
        return [what for key, what in self.looked_at.items() if key not in self.decided]

    def extend(self, other: PassResult) -> None:
        self.rewrites += other.rewrites
        self.skipped += other.skipped
        self.looked_at.update(other.looked_at)
        self.decided |= other.decided


def expect(node: fx.Node, value: Any) -> None:
    """Declare what a newly inserted node must produce (a fake tensor, or a tuple of them)."""
    node.meta[EXPECTED] = value


def snapshot_graph(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` whose nodes keep the extra attributes Dynamo sets on them (``_dynamo_source`` ...)."""
    saved = copy.deepcopy(graph)
    for old, new in zip(graph.nodes, saved.nodes):
        for key, value in vars(old).items():
            if key not in vars(new):
                setattr(new, key, value)
    return saved
