"""Rewrites graphs of ``tilecompile.parallelize``-sharded parameters into graphs with tensor-parallel collectives.

    x -> colwise(W_r) -> local math -> rowwise(W_r) -> y     becomes
    x -> copy_to_tp -> colwise -> local math -> rowwise -> reduce_from_tp -> y   (Σ_r partial_r = y)

Dynamo traces the model with its local shards, so the graph already computes this rank's part; what it lacks
are the collectives at the boundaries. Placements are propagated forward from the sharded parameters (each value
is Replicate, Shard(dim) of the tensor-parallel features/heads, or, with sequence parallel, Shard(seq)); a
row-parallel linear's Partial output is reduced where it is made, so Partial never travels. Boundaries:

| boundary                             | forward        | backward        | function            |
|--------------------------------------|----------------|-----------------|---------------------|
| Replicate into colwise               | identity       | all_reduce      | copy_to_tp          |
| Partial -> Replicate (after rowwise) | all_reduce     | identity        | reduce_from_tp      |
| SP: Shard(seq) into colwise          | all_gather     | reduce_scatter  | gather_seq          |
| SP: Partial -> Shard(seq)            | reduce_scatter | all_gather      | reduce_scatter_seq  |

An op the propagation rules do not know (or one that mixes the sharded dim, such as a sum over it) gets its
sharded inputs all-gathered first (``gather_from_tp``): correct, slower, and reported. A vocab_colwise lm_head
calls ``tilecompile::vocab_parallel_linear`` (so the code after it traces with the whole vocabulary); it becomes
copy_to_tp -> local linear -> gather of the logits, and ``passes/lm_head/__init__.py`` (later in the pipeline) turns
that gather followed by log-prob/entropy/CE into the vocab-parallel fused op. A tied input embedding of a
vocab-parallel lm_head looks up its local rows (others masked to 0) and all-reduces.
Sequence parallel: a replicated embedding's output is sliced along the sequence (gradient all-gathered), so the
residual stream is Shard(seq). A value that needs grad and is broadcast along a sharded dim (an RMSNorm weight
over the sequence-sharded stream, Qwen3's q_norm over sharded heads) has its gradient all-reduced, since each
rank's shard gives only part of it. Gathers and slices change
shapes Dynamo recorded; the example values after them are recomputed, so the next passes read true shapes.

The pass lowers the root graph and, through their call sites, the bodies of higher-order ops (activation
checkpointing), whose inputs' placements come from the caller. It must not be skipped on a graph with sharded
parameters (the graph would compute with shards and no collectives), so its failures raise ``TensorParallelError``
even outside strict mode, and the pipeline calls ``check_off`` when it is switched off.
Not handled (an error, never a silent wrong graph): a packed value used whole, sequence parallel under dynamic
shapes, a checkpoint body shared by call sites with different placements.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import operator
from typing import Any

import torch
import torch.fx as fx

from tilecompile import graph as fxgraph
from tilecompile import parallel, reporting
from tilecompile.ops import collectives
from tilecompile.pass_api import VOCAB_GATHER, PassContext, PassResult

NAME = "tensor_parallel"
_DONE = "_tilecompile_tp_lowered"


class TensorParallelError(RuntimeError):
    """A sharded graph the pass cannot lower; it must not run without its collectives."""

    undo_is_unsafe = True


@dataclasses.dataclass(frozen=True)
class Shard:
    """A value split across the group along ``dim``: tensor-parallel features/heads, or the sequence (``seq``).
    ``parts`` > 1: a packed value (gate_up) whose local slice is [part0_r, part1_r, ...] along ``dim``."""

    dim: int
    seq: bool = False
    parts: int = 1

    def moved(self, dim: int) -> Shard:
        return Shard(dim, self.seq, self.parts)


@dataclasses.dataclass(frozen=True)
class Group:
    name: str
    world: int
    rank: int


class _Fallback(Exception):
    """The op cannot run on the local shards: gather its sharded inputs (the message says why)."""


_ELEMENTWISE = frozenset(
    {"add", "sub", "mul", "div", "neg", "silu", "gelu", "relu", "sigmoid", "tanh", "exp", "log", "pow", "rsqrt",
     "sqrt", "abs", "clamp", "clamp_min", "clamp_max", "contiguous", "dropout", "clone", "detach", "cos", "sin",
     "softplus", "erf", "square", "reciprocal", "log1p", "expm1", "where", "masked_fill", "maximum", "minimum",
     "floor_divide", "remainder", "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_not",
     "and_", "or_", "__and__", "__or__", "mul_", "div_", "add_", "sub_", "neg_", "clamp_", "masked_fill_",
     "float", "half", "bfloat16", "double", "to", "type_as", "type", "silu_", "relu_", "exp_", "tanh_", "pow_"}
)  # fmt: skip
_CASTS = frozenset({"float", "half", "bfloat16", "double", "to", "type_as", "type"})
_KEEP_SHAPE_REDUCTIONS = frozenset({"softmax", "log_softmax", "cumsum", "cumprod"})
_REDUCTIONS = frozenset({"sum", "mean", "amax", "amin", "var", "std", "logsumexp", "norm", "prod", "all", "any"})
_SDPA = (torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention)
_EMBEDDING = (torch.nn.functional.embedding,)
_VOCAB_LINEAR = torch.ops.tilecompile.vocab_parallel_linear.default


# ----------------------------------------------------------------------------------------------- lowering


class _Lowering:
    """Propagates placements through one graph and inserts the collectives."""

    def __init__(self, gm: fx.GraphModule, group: Group, inputs: dict[fx.Node, Any],
                 specs: dict[fx.Node, parallel.ShardSpec], records: _Records) -> None:  # fmt: skip
        self.gm, self.graph, self.group = gm, gm.graph, group
        self.place: dict[fx.Node, Any] = dict(inputs)  # node -> Shard | None | list of them (tuples)
        self.specs = dict(specs)  # sharded parameters (placeholders) and their views/casts -> spec
        self.records = records
        self.gathered: dict[fx.Node, fx.Node] = {}
        self.copied: dict[fx.Node, fx.Node] = {}
        self.sp = any(s.sequence_parallel for s in specs.values())
        self.root: fx.GraphModule = gm  # the graph Dynamo handed over; a body's lowering gets its caller's
        self.body_outputs: list[Any] = []  # a body's output placements, for its call site
        self.body_values: dict[fx.Node, Any] = {}  # higher-order call -> its outputs' refreshed example values
        self.dirty: set[fx.Node] = set()  # nodes whose example value changed shape
        self.fresh: set[fx.Node] = set()  # nodes ``finish`` has been over

    # --- graph editing
    def insert(self, fn, x: fx.Node, *args, before: fx.Node | None = None, after: fx.Node | None = None,
               meta_from: fx.Node | None = None) -> fx.Node:  # fmt: skip
        ctx = self.graph.inserting_before(before) if before is not None else self.graph.inserting_after(after)
        with ctx:
            node = self.graph.call_function(fn, (x, *args))
        src = meta_from or x
        for key in ("nn_module_stack", "stack_trace"):
            if key in src.meta:
                node.meta[key] = src.meta[key]
        node.meta["example_value"] = self._fake(fn, x, args)
        return node

    def _fake(self, fn, x: fx.Node, args: tuple) -> Any:
        value = fxgraph.example_value(x)
        if not isinstance(value, torch.Tensor):
            return None
        shape = list(value.shape)
        if fn in collectives.GATHERS or fn in collectives.SCATTERS:
            d = args[0]
            shape[d] = shape[d] * self.group.world if fn in collectives.GATHERS else shape[d] // self.group.world
        mode = getattr(value, "fake_mode", None)
        if mode is None:
            return torch.empty(shape, dtype=value.dtype, device=value.device)
        with mode:
            return torch.empty(shape, dtype=value.dtype, device=value.device)

    def g(self) -> tuple[str, int, int]:
        return self.group.name, self.group.world, self.group.rank

    # --- redistribution
    def to_replicate(self, x: fx.Node, consumer: fx.Node, why: str) -> fx.Node:
        """``x`` all-gathered (for ``consumer`` only), when it is sharded."""
        s = self.place.get(x)
        if not isinstance(s, Shard):
            return x
        if s.parts != 1:
            raise TensorParallelError(
                f"{consumer.name} ({fxgraph.op(consumer) or consumer.op}) reads the packed sharded value {x.name}: "
                "gathering"
                " it would interleave its parts; split it (chunk/split/slice) before using it whole"
            )
        mutated = any(fxgraph.is_inplace(u) and u.args and u.args[0] is x for u in x.users)
        if x in self.gathered and not mutated:
            return self.gathered[x]
        node = self.insert(collectives.gather_from_tp, x, s.dim, *self.g(), before=consumer)
        self.place[node] = None
        if not mutated:
            self.gathered[x] = node
        self.records.gather(consumer, x, s, why)
        return node

    def sum_grad(self, x: fx.Node, consumer: fx.Node) -> fx.Node:
        """``x`` broadcast into a sharded consumer: identity forward, gradient all-reduced (copy_to_tp)."""
        key = ("grad", x)
        if key not in self.copied:
            node = self.insert(collectives.copy_to_tp, x, *self.g(), before=consumer)
            self.place[node] = None
            self.copied[key] = node
            reg = self.records._region(consumer, own=True)
            reg["bwd"].append("all_reduce(weight grad: each rank's shard gives part of it)")
        return self.copied[key]

    def replace_arg(self, node: fx.Node, old: fx.Node, new: fx.Node) -> None:
        if old is not new:
            node.replace_input_with(old, new)

    # --- walk
    def run(self) -> list[Any]:
        for node in list(self.graph.nodes):
            if node.op in ("placeholder", "get_attr"):
                self.place.setdefault(node, None)
                continue
            if node.op == "output":
                self.output(node)
                continue
            if node.op == "call_function" and node.target is _VOCAB_LINEAR:
                self.vocab_linear(node, self.specs.get(self.param(node.args[1])))
                continue
            lin = fxgraph.as_linear(node)
            if lin is not None and self.specs.get(self.param(lin.weight)) is not None:
                self.records.linear(node, self.specs[self.param(lin.weight)])
                self.linear(lin, self.specs[self.param(lin.weight)])
                continue
            if node.op == "call_function" and node.target in _EMBEDDING and self.specs.get(self.param(node.args[1])):
                self.embedding(node, self.specs[self.param(node.args[1])])
                continue
            if node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator):
                self.higher_order(node)
                continue
            self.generic(node)
            if self.sp and node.op == "call_function" and node.target in _EMBEDDING and self.place[node] is None:
                self.scatter_embedding(node)
        return self.body_outputs

    def param(self, node: Any) -> fx.Node | None:
        src = fxgraph.graph_input(node)
        return src if src is not None and src in self.specs else None

    def output(self, node: fx.Node) -> None:
        (outs,) = node.args
        if self.gm is not self.root:
            self.body_outputs = [self.place.get(o) if isinstance(o, fx.Node) else None for o in _flat(outs)]
            return
        for o in _flat(outs):
            if isinstance(o, fx.Node) and isinstance(self.place.get(o), Shard):
                self.replace_arg(node, o, self.to_replicate(o, node, "returned from the graph"))

    # --- linears
    def colwise_input(self, node: fx.Node, x: fx.Node, spec: parallel.ShardSpec) -> fx.Node:
        """``x`` as a column-parallel linear reads it: replicated (copy_to_tp), or all-gathered from Shard(seq)."""
        s = self.place.get(x)
        if isinstance(s, Shard) and s.seq:
            new = self.copied.get(("seq", x))
            if new is None:
                new = self.insert(collectives.gather_seq, x, s.dim, *self.g(), before=node, meta_from=node)
                self.copied[("seq", x)] = new
                self.records.add(node, "gather_seq", spec)
        else:
            if isinstance(s, Shard):
                x = self.to_replicate(x, node, "a sharded value read by a column-parallel linear")
            new = self.copied.get(("rep", x))
            if new is None:
                new = self.insert(collectives.copy_to_tp, x, *self.g(), before=node, meta_from=node)
                self.copied[("rep", x)] = new
                self.records.add(node, "copy_to_tp", spec)
        self.place[new] = None
        return new

    def vocab_linear(self, node: fx.Node, spec: parallel.ShardSpec | None) -> None:
        """``vocab_parallel_linear(h, W_r, b_r)`` (a vocab_colwise lm_head's call) -> copy_to_tp, linear, gather."""
        h, weight, bias = node.args[:3]
        if spec is None:
            raise TensorParallelError(f"{node.name}: vocab_parallel_linear on a weight parallelize did not shard")
        self.records.linear(node, spec)
        x = self.colwise_input(node, h, spec)
        with self.graph.inserting_before(node):
            lin = self.graph.call_function(torch.nn.functional.linear, (x, weight, bias))
        lin.meta.update({k: v for k, v in node.meta.items() if k in ("nn_module_stack", "stack_trace")})
        value = fxgraph.example_value(node)
        with _fake_mode(value) or contextlib.nullcontext():
            local = fxgraph.shape(weight)[0]
            lin.meta["example_value"] = torch.empty((*value.shape[:-1], local), dtype=value.dtype, device=value.device)
        gathered = self.insert(
            collectives.gather_from_tp, lin, len(value.shape) - 1, *self.g(), after=lin, meta_from=node
        )
        gathered.meta[VOCAB_GATHER] = spec
        self.place[lin] = Shard(len(value.shape) - 1)
        self.place[gathered] = None
        self.records.add(node, "gather_logits", spec)
        node.replace_all_uses_with(gathered)
        self.graph.erase_node(node)

    def linear(self, lin: fxgraph.Linear, spec: parallel.ShardSpec) -> None:
        node = lin.node
        if spec.dim == 0:  # colwise, packed_colwise, vocab_colwise: replicated input, sharded output features
            new = self.colwise_input(node, lin.input, spec)
            self.replace_arg(node, lin.input, new)
            self.place[node] = Shard(len(fxgraph.shape(node)) - 1, parts=max(1, len(spec.parts)))
            if spec.style == "vocab_colwise":
                gathered = self.insert(
                    collectives.gather_from_tp, node, len(fxgraph.shape(node)) - 1, *self.g(), after=node
                )
                gathered.meta[VOCAB_GATHER] = spec
                node.replace_all_uses_with(gathered, delete_user_cb=lambda u: u is not gathered)
                self.place[gathered] = None
                self.records.add(node, "gather_logits", spec)
            return
        # rowwise: input sharded on its last dim, output partial
        x = lin.input
        s = self.place.get(x)
        last = len(fxgraph.shape(x)) - 1
        if s != Shard(last):
            x = self.to_replicate(x, node, "a row-parallel linear's input sharded another way")
            x = self.insert(collectives.scatter_to_tp, x, last, *self.g(), before=node)
            self.place[x] = Shard(last)
            self.replace_arg(node, lin.input, x)
            self.records.add(node, "scatter_input", spec)
        bias = lin.bias
        if bias is not None:  # added once, after the reduction
            if fxgraph.op(node) != "linear":
                raise TensorParallelError(f"{node.name}: a row-parallel linear with a bias spelled {fxgraph.op(node)}")
            node.args = (*node.args[:2], None, *node.args[3:]) if len(node.args) > 2 else node.args
            if "bias" in node.kwargs:
                node.kwargs = {k: v for k, v in node.kwargs.items() if k != "bias"}
        out_nd = len(fxgraph.shape(node))
        if self.sp:
            sd = _seq_dim(out_nd)
            self.check_seq(node, sd)
            red = self.insert(collectives.reduce_scatter_seq, node, sd, *self.g(), after=node)
            self.place[red] = Shard(sd, seq=True)
            self.records.add(node, "reduce_scatter_seq", spec)
        else:
            red = self.insert(collectives.reduce_from_tp, node, *self.g(), after=node)
            self.place[red] = None
            self.records.add(node, "reduce_from_tp", spec)
        out = red
        if bias is not None:
            with self.graph.inserting_after(red):
                out = self.graph.call_function(operator.add, (red, bias))
            out.meta.update({k: v for k, v in node.meta.items() if k in ("nn_module_stack", "stack_trace")})
            out.meta["example_value"] = self._fake(operator.add, red, ())
            self.place[out] = self.place[red]
        node.replace_all_uses_with(out, delete_user_cb=lambda u: u is not red)
        self.place[node] = None  # only the reduction reads it

    def check_seq(self, node: fx.Node, dim: int) -> None:
        size = (fxgraph.shape(node) or ())[dim] if fxgraph.shape(node) else None
        if not isinstance(size, int):
            raise TensorParallelError(
                f"sequence parallel needs a static sequence length; {node.name} has size {size} on dim {dim} "
                "(compile with dynamic=False)"
            )
        if size % self.group.world:
            raise TensorParallelError(
                f"sequence parallel: sequence length {size} of {node.name} is not divisible by the tensor-parallel "
                f"size {self.group.world}"
            )

    # --- vocab-parallel embedding (tied to a vocab_colwise lm_head)
    def embedding(self, node: fx.Node, spec: parallel.ShardSpec) -> None:
        ids, weight = node.args[0], node.args[1]
        extra = [a for a in node.args[2:] if a not in (None, 2.0, False)]
        if extra or node.kwargs.get("padding_idx") is not None or node.kwargs.get("max_norm") is not None:
            raise TensorParallelError(f"{node.name}: a vocab-parallel embedding with padding_idx/max_norm/sparse")
        local = fxgraph.shape(weight)[0]
        lo = self.group.rank * local
        value = fxgraph.example_value(ids)
        mode = getattr(value, "fake_mode", None)
        b = fxgraph.NodeBuilder(self.graph, node, mode)
        shifted = b.call(operator.sub, ids, lo)
        inside = b.call(operator.and_, b.call(operator.ge, shifted, 0), b.call(operator.lt, shifted, local))
        safe = b.call(torch.where, inside, shifted, 0)
        looked = b.call(torch.nn.functional.embedding, safe, weight)
        masked = b.call(operator.mul, looked, b.call("to", b.call(torch.unsqueeze, inside, -1), fxgraph.dtype(node),
                                                         method=True))  # fmt: skip
        if self.sp:
            sd = _seq_dim(len(fxgraph.shape(node)))
            self.check_seq(node, sd)
            red = self.insert(collectives.reduce_scatter_seq, masked, sd, *self.g(), before=node, meta_from=node)
            self.place[red] = Shard(sd, seq=True)
            self.records.add(node, "reduce_scatter_seq", spec, embedding=True)
        else:
            red = self.insert(collectives.reduce_from_tp, masked, *self.g(), before=node, meta_from=node)
            self.place[red] = None
            self.records.add(node, "reduce_from_tp", spec, embedding=True)
        for n in b.new:
            self.place[n] = None
        node.replace_all_uses_with(red)
        self.graph.erase_node(node)

    def scatter_embedding(self, node: fx.Node) -> None:
        """Sequence parallel: a replicated embedding's output enters the residual stream as this rank's slice of
        the sequence (its gradient is all-gathered back), so every block starts from Shard(seq)."""
        sd = _seq_dim(len(fxgraph.shape(node)))
        self.check_seq(node, sd)
        sliced = self.insert(collectives.scatter_to_tp, node, sd, *self.g(), after=node)
        node.replace_all_uses_with(sliced, delete_user_cb=lambda u: u is not sliced)
        self.place[sliced] = Shard(sd, seq=True)
        path = fxgraph.module_path(node)
        self.records.regions.setdefault(path, {"linears": [], "fwd": [], "bwd": [], "shapes": {}})["bwd"].append(
            "all_gather(sequence scatter of the embedding)"
        )

    # --- higher-order ops: lower their bodies with the callers' placements
    def higher_order(self, node: fx.Node) -> None:
        bodies = [a for a in node.args if isinstance(a, fx.Node) and a.op == "get_attr"]
        tensors = [a for a in node.args if isinstance(a, fx.Node) and a.op != "get_attr"]
        if not any(isinstance(self.place.get(a), Shard) or self.param(a) is not None for a in tensors):
            self.place[node] = None
            return
        if len(bodies) != 1:
            raise TensorParallelError(f"{node.name}: sharded values enter {node.target} (not an activation checkpoint)")
        body = getattr(self.gm, bodies[0].target)
        holders = [n for n in body.graph.nodes if n.op == "placeholder"]
        args = [a for a in node.args[node.args.index(bodies[0]) + 1 :]]
        if len(holders) != len(args):
            raise TensorParallelError(f"{node.name}: {len(args)} arguments for a body of {len(holders)} inputs")
        inputs, specs = {}, {}
        for h, a in zip(holders, args):
            if isinstance(a, fx.Node):
                inputs[h] = self.place.get(a)
                if self.param(a) is not None:
                    specs[h] = self.specs[self.param(a)]
        # the same body may serve several call sites (identical layers): lowered once, for one set of placements
        signature = (
            tuple(inputs.get(h) for h in holders),
            tuple((s.style, s.dim, s.parts) if (s := specs.get(h)) else None for h in holders),
        )
        done = getattr(body, _DONE, None)
        if isinstance(done, tuple):
            if done[0] != signature:
                raise TensorParallelError(
                    f"{node.name}: the body {bodies[0].target} is called from two sites with different placements"
                )
            self.place[node], self.body_values[node] = done[1], done[2]
            return
        self.finish(until=node)  # the caller's values reaching the body have their true shapes now
        sub = _Lowering(body, self.group, inputs, specs, self.records)
        sub.root = self.root
        sub.sp = self.sp
        for h, a in zip(holders, args):
            if isinstance(a, fx.Node) and _shapes(fxgraph.example_value(a)) != _shapes(fxgraph.example_value(h)):
                h.meta["example_value"] = fxgraph.example_value(a)
                sub.dirty.add(h)
        outs = sub.run()
        sub.finish()
        (out_node,) = [n for n in body.graph.nodes if n.op == "output"]
        values = tuple(fxgraph.example_value(o) if isinstance(o, fx.Node) else o for o in _flat(out_node.args[0]))
        setattr(body, _DONE, (signature, outs, values))
        self.place[node], self.body_values[node] = outs, values

    # --- every other op
    def generic(self, node: fx.Node) -> None:
        ins = {a: self.place[a] for a in node.all_input_nodes if isinstance(self.place.get(a), Shard)}
        for a in _flat((node.args, node.kwargs)):
            if isinstance(a, fx.Node) and isinstance(self.place.get(a), list) and fxgraph.op(node) != "getitem":
                raise TensorParallelError(f"{node.name} reads the tuple {a.name} whole")
        if fxgraph.op(node) == "getitem" and isinstance(self.place.get(node.args[0]), list):
            items = self.place[node.args[0]]
            self.place[node] = items[node.args[1]] if isinstance(node.args[1], int) else None
            return
        if not ins:
            self.place[node] = None
            return
        value = fxgraph.example_value(node)
        if not isinstance(value, torch.Tensor | tuple | list):  # sizes, dtypes, devices
            if self.sp and any(s.seq for s in ins.values()):
                raise TensorParallelError(f"{node.name} reads a size of a sequence-sharded value (dynamic shapes?)")
            self.place[node] = None
            return
        try:
            out = _rule(node, ins, self)
        except _Fallback as why:
            for a in ins:
                self.replace_arg(node, a, self.to_replicate(a, node, str(why)))
            out = None
        if fxgraph.is_inplace(node) and node.args and isinstance(node.args[0], fx.Node):
            if out != self.place.get(node.args[0]):
                raise TensorParallelError(f"in-place {node.name} would change the placement of {node.args[0].name}")
        self.place[node] = out

    def finish(self, until: fx.Node | None = None) -> None:
        """Gathers, scatters and sequence shards change shapes that Dynamo recorded for local values: refresh the
        example values downstream of them, in graph order (up to ``until``, exclusive), so that the next passes
        (and checkpoint bodies, whose inputs take their callers' shapes) read true shapes."""
        for node in self.graph.nodes:
            if node is until:
                return
            if node in self.fresh:
                continue
            self.fresh.add(node)
            if node.op == "call_function" and node.target in collectives.ALL:
                node.meta["example_value"] = self._fake(node.target, node.args[0], node.args[1:])
                if node.target not in collectives.IDENTITIES:
                    self.dirty.add(node)
                continue
            if node.op not in ("call_function", "call_method") or not any(
                a in self.dirty for a in node.all_input_nodes
            ):
                continue
            old = fxgraph.example_value(node)
            if isinstance(node.target, torch._ops.HigherOrderOperator):
                new = self.body_values.get(node)
                if new is None:
                    raise TensorParallelError(f"{node.name}: values of changed shape enter {node.target}")
            else:
                new = self._run_fake(node, old)
            node.meta["example_value"] = new
            if _shapes(new) != _shapes(old):
                self.dirty.add(node)

    def _run_fake(self, node: fx.Node, old: Any) -> Any:
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), fxgraph.example_value)
        mode = _fake_mode(old) or _fake_mode(args) or contextlib.nullcontext()
        try:
            with mode:
                if node.op == "call_method":
                    return getattr(args[0], node.target)(*args[1:], **kwargs)
                return node.target(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - say which node, not a fake-tensor trace
            raise TensorParallelError(f"{node.name} does not run on the redistributed values ({exc})") from exc


def _shapes(tree: Any) -> list:
    return [tuple(t.shape) for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _fake_mode(tree: Any) -> Any:
    for t in torch.utils._pytree.tree_leaves(tree):
        if isinstance(t, torch._subclasses.fake_tensor.FakeTensor):
            return t.fake_mode
    return None


def _seq_dim(ndim: int) -> int:
    """The sequence dim of hidden states: [B, S, D] -> 1, [N, D] (tokens flattened) -> 0."""
    return ndim - 2 if ndim >= 2 else 0


def _flat(tree: Any) -> list[Any]:
    out: list[Any] = []
    fx.node.map_aggregate(tree, out.append)
    return out


# ------------------------------------------------------------------------------------------ placement rules


def _rule(node: fx.Node, ins: dict[fx.Node, Shard], low: _Lowering) -> Any:
    """The placement of ``node``'s output from its sharded inputs ``ins``; raises _Fallback when unknown."""
    name = fxgraph.op(node)
    if node.op == "call_function" and node.target in _SDPA:
        return _sdpa(node, ins)
    if name in _ELEMENTWISE:
        return _elementwise(node, name, ins, low)
    x = fxgraph.arg(node, 0, "input")
    s = ins.get(x) if isinstance(x, fx.Node) else None
    if s is None or len(ins) != 1:
        if name in ("cat", "concat", "stack"):
            return _cat(node, name, ins)
        if name == "matmul":
            return _matmul(node, ins)
        raise _Fallback(f"{name or node.target} of several sharded values")
    xs, ys = fxgraph.shape(x), fxgraph.shape(node)
    nd = len(xs)
    if name in ("view", "reshape", "flatten", "unflatten"):
        return _reshape(s, xs, ys, _view_args(node) if name in ("view", "reshape") else None)
    if name in ("transpose", "swapaxes"):
        d0, d1 = (fxgraph.normalize_dim(fxgraph.arg(node, i), nd) for i in (1, 2))
        return s.moved(d1 if s.dim == d0 else d0 if s.dim == d1 else s.dim)
    if name == "t":
        return s.moved(1 - s.dim) if nd == 2 else s
    if name == "permute":
        dims = (
            node.args[1:] if len(node.args) > 2 or not isinstance(fxgraph.arg(node, 1), list | tuple) else node.args[1]
        )
        dims = [fxgraph.normalize_dim(d, nd) for d in dims]
        return s.moved(dims.index(s.dim))
    if name == "unsqueeze":
        d = fxgraph.normalize_dim(fxgraph.arg(node, 1, "dim"), nd + 1)
        return s.moved(s.dim + 1 if d <= s.dim else s.dim)
    if name == "squeeze":
        return _reshape(s, xs, ys, None)
    if name == "expand":
        return s.moved(s.dim + len(ys) - nd)
    if name == "getitem":
        return _index(node, s, xs)
    if name in ("chunk", "split", "unbind", "split_with_sizes", "tensor_split"):
        return _split(node, name, s, xs)
    if name == "narrow":
        if fxgraph.normalize_dim(fxgraph.arg(node, 1, "dim"), nd) == s.dim:
            raise _Fallback("narrow along the sharded dim")
        return s
    if name in _KEEP_SHAPE_REDUCTIONS:
        if fxgraph.normalize_dim(fxgraph.arg(node, 1, "dim"), nd) == s.dim:
            raise _Fallback(f"{name} along the sharded dim")
        return s
    if name in _REDUCTIONS or name in ("max", "min", "argmax", "argmin"):
        return _reduce(node, name, s, xs, ys)
    raise _Fallback(f"no placement rule for {name or node.target}")


def _elementwise(node: fx.Node, name: str, ins: dict[fx.Node, Shard], low: _Lowering) -> Shard:
    out_nd = len(fxgraph.shape(node) or ())
    operands = [node.args[0]] if name in _CASTS else [a for a in _flat((node.args, node.kwargs))]
    operands = [a for a in operands if isinstance(a, fx.Node) and isinstance(fxgraph.example_value(a), torch.Tensor)]
    placed = {a: ins[a] for a in operands if a in ins}
    if not placed:
        return None
    aligned = {s.moved(s.dim + out_nd - len(fxgraph.shape(a))) for a, s in placed.items()}
    if len(aligned) != 1:
        raise _Fallback(f"{name} of values sharded differently")
    (out,) = aligned
    for a in operands:
        if a in placed:
            continue
        shape = fxgraph.shape(a)
        d = out.dim - (out_nd - len(shape))
        if d < 0 or fxgraph.hint(shape[d]) == 1:  # broadcast along the sharded dim
            if fxgraph.example_value(a).requires_grad:
                # its gradient sums over the sharded dim, of which this rank holds a part: an RMSNorm weight over
                # the sequence-sharded residual stream (SP), Qwen3's q_norm / k_norm weights over sharded heads
                node.replace_input_with(a, low.sum_grad(a, node))
            continue
        if out.seq:  # SP: a replicated operand (the residual stream before the first layer) is sliced
            sliced = low.insert(collectives.scatter_to_tp, a, d, *low.g(), before=node)
            low.place[sliced] = Shard(d, seq=True)
            node.replace_input_with(a, sliced)
            low.records.scatter(node, a)
            continue
        raise _Fallback(f"{name} of a sharded value and a replicated one of full size along the sharded dim")
    return out


def _view_args(node: fx.Node) -> list | None:
    rest = node.args[1:] or tuple(node.kwargs.get("shape", node.kwargs.get("size", ())) or ())
    if len(rest) == 1 and isinstance(rest[0], list | tuple | torch.Size):
        rest = tuple(rest[0])
    return list(rest)


def _reshape(s: Shard, xs: tuple, ys: tuple, sizes: list | None) -> Shard:
    """A reshape keeps a shard when the dims before it hold the same number of elements on both sides; the
    sharded dim lands on the output dim spelled -1 (``view(*input_shape, -1, head_dim)``), else on the first
    such dim that is not a lone 1."""
    xs, ys = [fxgraph.hint(i) for i in xs], [fxgraph.hint(i) for i in ys]
    if None in xs or None in ys:
        raise _Fallback("reshape with unknown sizes")
    before = math.prod(xs[: s.dim])
    candidates = [e for e in range(len(ys)) if math.prod(ys[:e]) == before and e < len(ys)]
    if not candidates:
        raise _Fallback("reshape that moves the sharded dim inside another")
    if s.parts != 1 and xs[s.dim] not in [ys[e] for e in candidates]:
        raise _Fallback("reshape of a packed value's sharded dim")
    if sizes is not None and len(sizes) == len(ys):
        for e in candidates:
            if sizes[e] == -1:
                return s.moved(e)
    for e in candidates:
        if ys[e] != 1 or xs[s.dim] == 1:
            return s.moved(e)
    return s.moved(candidates[0])


def _index(node: fx.Node, s: Shard, xs: tuple) -> Shard:
    index = node.args[1]
    items = list(index) if isinstance(index, tuple) else [index]
    if any(isinstance(i, fx.Node) for i in items):
        raise _Fallback("advanced indexing of a sharded value")
    nd = len(xs)
    if Ellipsis in items:
        k = items.index(Ellipsis)
        n_real = sum(1 for i in items if i is not None and i is not Ellipsis)
        items = items[:k] + [slice(None)] * (nd - n_real) + items[k + 1 :]
    items += [slice(None)] * (nd - sum(1 for i in items if i is not None))
    src, out = 0, 0
    for i in items:
        if i is None:
            out += 1
            continue
        if src == s.dim:
            if isinstance(i, int) or not _whole(i, xs[src]):
                return _part_slice(s, i, xs[src], out)
            return s.moved(out)
        if not isinstance(i, int):
            out += 1
        src += 1
    raise _Fallback("index past the sharded dim")


def _whole(i: Any, size: Any) -> bool:
    if not isinstance(i, slice) or i.step not in (None, 1) or i.start not in (None, 0):
        return False
    return i.stop is None or i.stop >= fxgraph.hint(size)


def _part_slice(s: Shard, i: Any, size: Any, out: int) -> Shard:
    """A slice of a packed value that is exactly one of its local parts."""
    size = fxgraph.hint(size)
    if s.parts > 1 and isinstance(i, slice) and i.step in (None, 1) and size % s.parts == 0:
        part = size // s.parts
        start = 0 if i.start is None else (i.start + size if i.start < 0 else i.start)
        stop = size if i.stop is None else min(size, i.stop + size if i.stop < 0 else i.stop)
        if start % part == 0 and stop - start == part:
            return Shard(out, s.seq, 1)
    raise _Fallback("a slice along the sharded dim")


def _split(node: fx.Node, name: str, s: Shard, xs: tuple) -> list:
    value = fxgraph.example_value(node)
    n = len(value) if isinstance(value, tuple | list) else 0
    dim = fxgraph.arg(node, 2, "dim", 0)
    dim = (
        fxgraph.normalize_dim(dim, len(xs))
        if name != "unbind"
        else fxgraph.normalize_dim(fxgraph.arg(node, 1, "dim", 0), len(xs))
    )
    if dim != s.dim:
        moved = s.moved(s.dim - 1 if name == "unbind" and dim < s.dim else s.dim)
        return [moved] * n
    if name == "unbind" or s.parts <= 1 or n != s.parts:
        raise _Fallback(f"{name} along the sharded dim")
    sizes = {fxgraph.hint(v.shape[dim]) for v in value}
    if len(sizes) != 1:
        raise _Fallback(f"{name} of a packed value into unequal parts")
    return [Shard(s.dim, s.seq, 1)] * n


def _reduce(node: fx.Node, name: str, s: Shard, xs: tuple, ys: tuple) -> Shard:
    dim = fxgraph.arg(node, 1, "dim")
    if dim is None:
        raise _Fallback(f"{name} over all dims")
    dims = {fxgraph.normalize_dim(d, len(xs)) for d in (dim if isinstance(dim, list | tuple) else [dim])}
    if s.dim in dims:
        raise _Fallback(f"{name} over the sharded dim")
    if name in ("max", "min") and isinstance(fxgraph.example_value(node), tuple):
        raise _Fallback(f"{name} with indices")
    if len(ys) == len(xs):
        return s
    return s.moved(s.dim - sum(1 for d in dims if d < s.dim))


def _sdpa(node: fx.Node, ins: dict[fx.Node, Shard]) -> Shard:
    q, k, v = (fxgraph.arg(node, i, n) for i, n in enumerate(("query", "key", "value")))
    nd = len(fxgraph.shape(q))
    want = Shard(nd - 3)
    if nd < 3 or any(ins.get(t) != want for t in (q, k, v)):
        raise _Fallback("attention whose q, k, v are not all sharded by heads")
    mask = fxgraph.arg(node, 3, "attn_mask")
    if isinstance(mask, fx.Node):
        ms = fxgraph.shape(mask)
        d = want.dim - (nd - len(ms))
        if ins.get(mask) is None and d >= 0 and fxgraph.hint(ms[d]) != 1:
            raise _Fallback("an attention mask with a heads dim")
    return want


def _cat(node: fx.Node, name: str, ins: dict[fx.Node, Shard]) -> Shard:
    items = fxgraph.arg(node, 0, "tensors")
    if not isinstance(items, list | tuple) or any(ins.get(t) is None for t in items):
        raise _Fallback(f"{name} of sharded and replicated values")
    places = {ins[t] for t in items}
    if len(places) != 1:
        raise _Fallback(f"{name} of values sharded differently")
    (s,) = places
    nd = len(fxgraph.shape(items[0]))
    dim = fxgraph.normalize_dim(fxgraph.arg(node, 1, "dim", 0), nd + (name == "stack"))
    if name == "stack":
        return s.moved(s.dim + 1 if dim <= s.dim else s.dim)
    if dim == s.dim:
        raise _Fallback(f"{name} along the sharded dim")
    return s


def _matmul(node: fx.Node, ins: dict[fx.Node, Shard]) -> Shard:
    a, b = fxgraph.arg(node, 0), fxgraph.arg(node, 1)
    sa, sb = ins.get(a), ins.get(b)
    na, nb = len(fxgraph.shape(a)), len(fxgraph.shape(b))
    if sa is not None and sb is not None and na == nb and sa == sb and not sa.seq and sa.dim < na - 2:
        return sa
    raise _Fallback("matmul of sharded operands")


# ------------------------------------------------------------------------------------------------ report


class _Records:
    """Collectives inserted, grouped by the module that holds the sharded linears (an MLP, an attention block)."""

    def __init__(self) -> None:
        self.regions: dict[str, dict[str, Any]] = {}

    def _region(self, node: fx.Node, own: bool = False) -> dict[str, Any]:
        """The block holding ``node``'s module (an MLP, an attention), or with ``own`` the module itself (an
        lm_head, an embedding: a region of one module)."""
        path = fxgraph.module_path(node)
        parent = path.rsplit(".", 1)[0] if "." in path and not own else path
        return self.regions.setdefault(parent, {"linears": [], "fwd": [], "bwd": [], "shapes": {}})

    def linear(self, node: fx.Node, spec: parallel.ShardSpec, embedding: bool = False) -> None:
        reg = self._region(node, own=embedding or spec.style == "vocab_colwise")
        leaf = _leaf(spec, node if embedding else None)
        entry = f"{leaf}:{'vocab_embedding' if embedding else spec.style}"
        if entry not in reg["linears"]:
            reg["linears"].append(entry)
            reg["shapes"][leaf] = spec.global_shape

    def add(self, node: fx.Node, what: str, spec: parallel.ShardSpec, embedding: bool = False) -> None:
        reg = self._region(node, own=embedding or spec.style == "vocab_colwise")
        leaf = _leaf(spec, node if embedding else None)
        if embedding:
            self.linear(node, spec, embedding=True)
        fn = {"copy_to_tp": collectives.copy_to_tp, "gather_seq": collectives.gather_seq,
              "gather_logits": collectives.gather_from_tp, "reduce_scatter_seq": collectives.reduce_scatter_seq,
              "reduce_from_tp": collectives.reduce_from_tp,
              "scatter_input": collectives.scatter_to_tp}[what]  # fmt: skip
        fwd, bwd = collectives.COLLECTIVES[fn]
        if what == "gather_logits":
            fwd = f"{fwd}({leaf} logits; fused_linear_ce replaces it by all_reduce max + sum when it fuses the loss)"
            reg["fwd"].append(fwd)
        elif fwd:
            reg["fwd"].append(f"{fwd}({leaf})")
        if bwd:
            reg["bwd"].append(f"{bwd}({leaf})")

    def gather(self, consumer: fx.Node, x: fx.Node, s: Shard, why: str) -> None:
        reg = self._region(consumer)
        reg["fwd"].append(f"all_gather({x.name} dim {s.dim}: {why})")

    def scatter(self, node: fx.Node, x: fx.Node) -> None:
        reg = self._region(node)
        reg["bwd"].append(f"all_gather(slice of {x.name})")

    def rewrites(self, group: Group) -> list[reporting.Rewrite]:
        out = []
        for path, reg in self.regions.items():
            detail = (
                f"tp={group.world} {', '.join(reg['linears']) or 'no sharded linears'}; "
                f"forward: {', '.join(reg['fwd']) or 'none'}; backward: {', '.join(reg['bwd']) or 'none'}"
            )
            out.append(reporting.Rewrite(NAME, path, dict(reg["shapes"]), {}, detail))
        return out


def _leaf(spec: parallel.ShardSpec, node: fx.Node | None = None) -> str:
    """The sharded module's own name (``q_proj``); for a tied embedding, the embedding's (``embed_tokens``)."""
    if node is not None and fxgraph.module_path(node):
        return fxgraph.module_path(node).rsplit(".", 1)[-1]
    parts = spec.fqn.split(".")
    return parts[-2] if len(parts) >= 2 else spec.fqn


# --------------------------------------------------------------------------------------------------- run


def sharded_inputs(gm: fx.GraphModule) -> dict[fx.Node, parallel.ShardSpec]:
    """Placeholders of ``gm`` that are parameters sharded by ``tilecompile.parallelize``, with their specs."""
    out = {}
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        arg = node.meta.get("grapharg")
        spec = parallel.spec_of(getattr(arg, "example", None)) if arg is not None else None
        if spec is not None:
            out[node] = spec
    return out


def graph_params(gm: fx.GraphModule) -> list[torch.Tensor]:
    """The parameters ``gm``'s placeholders hold (what Dynamo recorded for each)."""
    out = []
    for node in gm.graph.nodes:
        arg = node.meta.get("grapharg") if node.op == "placeholder" else None
        example = getattr(arg, "example", None)
        if isinstance(example, torch.nn.Parameter):
            out.append(example)
    return out


def check_intact(gm: fx.GraphModule) -> None:
    """A graph over a parallelized model whose parameters lost their shard records (FSDP2 applied after
    ``parallelize``) would run on shards without collectives: refuse it before it runs."""
    why = parallel.check_shards_intact(graph_params(gm))
    if why is not None:
        raise TensorParallelError(why)


def check_off(gm: fx.GraphModule) -> None:
    """Called by the pipeline when this pass is switched off: a graph of sharded parameters must not compile."""
    check_intact(gm)
    specs = sharded_inputs(gm)
    if specs:
        names = ", ".join(sorted({s.fqn for s in specs.values()})[:3])
        raise TensorParallelError(
            f"the tensor_parallel pass is off (TILECOMPILE_TENSOR_PARALLEL=0 or options) but the graph reads "
            f"parameters sharded by tilecompile.parallelize ({names}, ...): it would compute on shards without "
            "collectives. Turn the pass on."
        )


def run(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    result = PassResult()
    if getattr(gm, _DONE, None) is not None:
        return result  # a body lowered through its call site, or a graph lowered before
    check_intact(gm)
    specs = sharded_inputs(gm)
    if not specs:
        return result
    groups = {(s.group, s.world, s.rank) for s in specs.values()}
    if len(groups) != 1:
        raise TensorParallelError(f"parameters sharded over {len(groups)} different groups in one graph")
    if any(collectives.ALL.__contains__(n.target) for n in gm.graph.nodes if n.op == "call_function"):
        return result  # already lowered: running twice is harmless
    group = Group(*groups.pop())
    records = _Records()
    placements = {n: _param_placement(s, len(fxgraph.shape(n) or ())) for n, s in specs.items()}
    low = _Lowering(gm, group, placements, specs, records)
    try:
        low.run()
        low.finish()
    except _Fallback as exc:
        raise TensorParallelError(str(exc)) from exc
    setattr(gm, _DONE, True)
    gm.recompile()
    result.rewrites += records.rewrites(group)
    return result


def _param_placement(spec: parallel.ShardSpec, ndim: int) -> Shard | None:
    if spec.dim is None:
        return None
    return Shard(spec.dim if ndim == 2 else 0, parts=max(1, len(spec.parts)))
