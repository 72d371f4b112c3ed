"""MoE experts (HF transformers 5's grouped experts: stacked ``gate_up_proj`` [E, 2I, D] / ``down_proj`` [E, D, I] run
by ``grouped_mm`` over the routed rows sorted by expert) through the backend: the tiled_mlp pass rewrites them into
``tilecompile::tiled_grouped_mlp`` (tilecompile/ops/tiled_grouped_mlp.py, passes/mlp/experts.py), the step
equals eager's, the op saves less than eager's experts, and the forms it does not tile keep a reason."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import GraphCapture, assert_close, assert_grads_close, compile_options, rel_err

import tilecompile
from tilecompile.ops.tiled_grouped_mlp import tiled_grouped_mlp

transformers = pytest.importorskip("transformers")

RTOL, ATOL = 1e-5, 1e-6
VOCAB = 64


def _config(kind: str, experts: int = 4, top_k: int = 2):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts_per_tok=top_k,
        max_position_embeddings=64,
    )
    if kind == "mixtral":
        return transformers.MixtralConfig(**common, intermediate_size=24, num_local_experts=experts)
    return transformers.Qwen3MoeConfig(
        **common, intermediate_size=32, moe_intermediate_size=24, num_experts=experts, head_dim=8
    )


def _model(kind: str, **kw):
    torch.manual_seed(0)
    cfg = _config(kind, **kw)
    model = (transformers.MixtralForCausalLM if kind == "mixtral" else transformers.Qwen3MoeForCausalLM)(cfg)
    return model.train()


def _compile(model, **options):
    opts = compile_options(**{"fused_linear_ce": False, "mlp_chunk_tokens": 3, **options})
    return torch.compile(model, backend="tilecompile", options=opts)


def _step(model, ids):
    logits = model(input_ids=ids, use_cache=False).logits
    logits.float().square().mean().backward()
    return logits


def _rewrites():
    return [r for r in tilecompile.report().rewrites if r.pass_name == "tiled_mlp"]


def _skips():
    return [s for s in tilecompile.report().skipped if s.pass_name == "tiled_mlp"]


EXPERT_PATHS = ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]

# ------------------------------------------------------------------------------------------------- HF models


HF_CASES = [
    ("mixtral", "grouped_mm", 2, 7),
    ("mixtral", "grouped_mm", 3, 5),
    ("qwen3_moe", "grouped_mm", 2, 7),
    ("qwen3_moe", "grouped_mm", 3, 5),
    ("mixtral", "batched_mm", 3, 5),
    ("qwen3_moe", "batched_mm", 2, 7),
]


@pytest.mark.parametrize("kind,implementation,batch,length", HF_CASES)
def test_hf_moe_experts_tiled_and_equal_eager(kind, implementation, batch, length):
    """B > 1, B * L * top_k routed rows not a multiple of the 3-row chunk: logits and every grad equal eager.
    grouped_mm (HF's default) hands the op its grouped rows; batched_mm's per-row gathered weights are undone:
    the rows are sorted into groups around the op."""
    model = _model(kind)
    model.set_experts_implementation(implementation)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (batch, length))
    out = _step(_compile(model), ids)
    expected = _step(ref, ids)
    assert_close(out, expected, rtol=RTOL, atol=ATOL, name="logits")
    assert_grads_close(model, ref, rtol=RTOL, atol=ATOL)
    rep = tilecompile.report()
    assert rep.counts["tiled_mlp"] == 2, rep
    assert sorted(r.module_path for r in _rewrites()) == EXPERT_PATHS, rep
    assert not _skips(), rep
    rows = batch * length * 2
    form = "rows=grouped" if implementation == "grouped_mm" else "rows=gathered"
    for r in _rewrites():
        assert r.shapes["x"] == (rows, 16) and r.shapes["gate_up_weight"] == (4, 48, 16), r.shapes
        assert r.shapes["gate_weight"] == (4, 16, 24) and r.shapes["down_weight"] == (4, 24, 16), r.shapes
        assert f"experts=4 {form}" in r.detail and "fused=gate_up" in r.detail and "chunk_tokens=3" in r.detail, r
        assert "the stacked weight one operand" in r.detail, r.detail  # gate_up whole, its grad whole
        assert "row_weight=" in r.detail and "row_weight=none" not in r.detail, r  # the routing weights taken in


def test_hf_moe_under_activation_checkpointing():
    """HF's gradient checkpointing puts each layer in a checkpoint body: the experts are tiled there too."""
    model = _model("mixtral")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (2, 7))
    out = _step(_compile(model), ids)
    expected = _step(ref, ids)
    assert_close(out, expected, rtol=RTOL, atol=ATOL, name="logits")
    assert_grads_close(model, ref, rtol=RTOL, atol=ATOL)
    assert sorted(r.module_path for r in _rewrites()) == EXPERT_PATHS, tilecompile.report()
    assert not _skips(), tilecompile.report()


def _op_nodes(graphs, name: str) -> list[torch.fx.Node]:
    """Nodes calling ``tilecompile::name`` in the graphs and their submodules (a layer region's compiled body)."""
    modules = [m for g in graphs for m in g.modules() if isinstance(m, torch.fx.GraphModule)]
    return [n for m in modules for n in m.graph.nodes if str(n.target) == f"tilecompile.{name}.default"]


def _op_calls(graphs, name: str) -> int:
    return len(_op_nodes(graphs, name))


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm"])
def test_routing_weight_taken_in_so_checkpointing_recomputes_no_expert_forward(monkeypatch, implementation):
    """HF multiplies the experts' output by the routing weights; the op takes that multiply in (``row_weight``), so
    its output is needed by no backward: under activation checkpointing the backward graph runs only the op's
    backward, not its forward again (left outside, the multiply's weight grad needs the op's output, and the
    recompute reruns the whole op: 28 instead of 22 S·D·I FLOPs). Loss and grads, the router's included, equal
    eager's. With the fold switched off (``routing_weight`` returning None) the recompute comes back."""
    from tilecompile.passes.mlp import experts

    ids = torch.randint(0, VOCAB, (2, 7))
    for fold in (True, False):
        torch._dynamo.reset()  # the second model would reuse the first's compiled graph
        tilecompile.reset()
        if not fold:
            monkeypatch.setattr(experts, "routing_weight", lambda m: None)
        model = _model("qwen3_moe")
        model.set_experts_implementation(implementation)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        ref = copy.deepcopy(model)
        with GraphCapture() as graphs:
            out = _step(_compile(model), ids)
        assert_close(out, _step(ref, ids), rtol=RTOL, atol=ATOL, name="logits")
        assert_grads_close(model, ref, rtol=RTOL, atol=ATOL)
        rewrites = _rewrites()
        assert sorted(r.module_path for r in rewrites) == EXPERT_PATHS, tilecompile.report()
        assert all(("row_weight=none" in r.detail) != fold for r in rewrites), [r.detail for r in rewrites]
        # one node per layer, or one for both where the identical layers share a compiled region
        calls = _op_calls(graphs.fw, "tiled_grouped_mlp")
        assert calls in (1, 2) and _op_calls(graphs.bw, "tiled_grouped_mlp_backward") == calls
        assert _op_calls(graphs.bw, "tiled_grouped_mlp") == (0 if fold else calls), graphs.bw
        # HF's stacked gate_up goes in whole (up_weight None), so its grad comes back whole: no sum of two slices
        for node in _op_nodes(graphs.fw, "tiled_grouped_mlp") + _op_nodes(graphs.bw, "tiled_grouped_mlp_backward"):
            up = node.args[4 if "backward" in str(node.target) else 3]
            assert up is None, node.format_node()


def test_dynamic_lengths_compile_once():
    """dynamic=True: one graph serves several lengths (the routed row count symbolic), each equal to eager."""
    model = _model("qwen3_moe")
    ref = copy.deepcopy(model)
    opts = compile_options(fused_linear_ce=False, mlp_chunk_tokens=3)
    compiled = torch.compile(model, backend="tilecompile", options=opts, dynamic=True)
    for length in (5, 9, 6):
        ids = torch.randint(0, VOCAB, (2, length))
        model.zero_grad(), ref.zero_grad()
        out = _step(compiled, ids)
        expected = _step(ref, ids)
        assert_close(out, expected, rtol=RTOL, atol=ATOL, name=f"logits at length {length}")
        assert_grads_close(model, ref, rtol=RTOL, atol=ATOL)
    rep = tilecompile.report()
    assert rep.graphs == 1 and len(_rewrites()) == 2, rep


def test_expert_that_receives_no_tokens():
    """8 experts, top-1, 6 tokens: at least two experts get no rows; their grads are zero, as in eager."""
    model = _model("mixtral", experts=8, top_k=1)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (2, 3))
    out = _step(_compile(model), ids)
    expected = _step(ref, ids)
    assert_close(out, expected, rtol=RTOL, atol=ATOL, name="logits")
    assert_grads_close(model, ref, rtol=RTOL, atol=ATOL)
    assert len(_rewrites()) == 2, tilecompile.report()
    for layer in model.model.layers:
        grad = layer.mlp.experts.gate_up_proj.grad
        idle = [e for e in range(8) if not grad[e].any()]
        assert len(idle) >= 2, idle
        assert not layer.mlp.experts.down_proj.grad[idle].any()


def test_cpu_autocast_bf16_over_fp32_weights():
    """grouped_mm is not an autocast op: under bf16 autocast HF's experts still run in fp32 (eager and compiled),
    the rest of the model in bf16. The tiled op keeps that: compute float32, equal to eager to bf16 accuracy."""
    model = _model("mixtral")
    ref = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (2, 7))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = _step(_compile(model), ids)
        expected = _step(ref, ids)
    assert out.dtype == expected.dtype == torch.bfloat16
    assert rel_err(out, expected) < 1e-2, rel_err(out, expected)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert rel_err(p.grad, q.grad) < 3e-2, (name, rel_err(p.grad, q.grad))
    assert len(_rewrites()) == 2, tilecompile.report()
    for r in _rewrites():
        assert r.dtypes == {"x": "torch.float32", "weight": "torch.float32", "compute": "torch.float32"}, r.dtypes


def test_bf16_weights_read_through_functional_grouped_mm():
    """bf16 weights: HF calls torch.nn.functional.grouped_mm (not its fp32 fallback op); tiled all the same."""
    model = _model("qwen3_moe").to(torch.bfloat16)
    ref = copy.deepcopy(model)
    fp32 = _model("qwen3_moe")
    ids = torch.randint(0, VOCAB, (2, 7))
    out = _step(_compile(model), ids)
    expected = _step(ref, ids)
    reference = _step(fp32, ids)
    assert len(_rewrites()) == 2, tilecompile.report()
    assert _rewrites()[0].dtypes["compute"] == "torch.bfloat16"
    # ours against the fp32 model within a small margin of eager bf16's own error
    assert rel_err(out, reference) <= 1.5 * rel_err(expected, reference) + 1e-3
    for (name, p), q, r in zip(model.named_parameters(), ref.parameters(), fp32.parameters()):
        ours, eager = rel_err(p.grad, r.grad), rel_err(q.grad, r.grad)
        assert ours <= 1.5 * eager + 2e-2, (name, ours, eager)


# ---------------------------------------------------------------------------------------------- saved bytes


class _Saved:
    """Bytes of the distinct storages a step saves for backward, parameters left out."""

    def __init__(self, params) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.storages: dict[int, int] = {}

    def pack(self, t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.params:
            self.storages[ptr] = t.untyped_storage().nbytes()
        return t

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())


def _expert_inputs(dtype=torch.float32, rows=96, d=16, inter=64, experts=4):
    torch.manual_seed(0)
    x = torch.randn(rows, d, dtype=dtype, requires_grad=True)
    gate_up = torch.randn(experts, 2 * inter, d, dtype=dtype, requires_grad=True)
    down = torch.randn(experts, d, inter, dtype=dtype, requires_grad=True)
    offsets = torch.tensor([20, 20, 61, 90], dtype=torch.int32)  # an empty expert, 6 rows past the last
    return x, gate_up, down, offsets


def _eager_experts(x, gate_up, down, offsets):
    g, u = F.grouped_mm(x, gate_up.transpose(-2, -1), offs=offsets).chunk(2, dim=-1)
    return F.grouped_mm(F.silu(g) * u, down.transpose(-2, -1), offs=offsets)


def _tiled_experts(x, gate_up, down, offsets, **kw):
    w = gate_up.transpose(-2, -1)
    inter = w.shape[-1] // 2
    return tiled_grouped_mlp(x, offsets, w[..., :inter], w[..., inter:], down.transpose(-2, -1), **kw)


def test_op_saves_only_its_inputs():
    """The op saves the routed rows and the offsets (and the weights); eager's experts save [S, I]-sized tensors."""
    x, gate_up, down, offsets = _expert_inputs()
    counts = {}
    for name, fn in (("eager", _eager_experts), ("tiled", _tiled_experts)):
        saved = _Saved([gate_up, down, x])
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            out = fn(x, gate_up, down, offsets)
            out.backward(torch.ones_like(out))  # not .sum(): grouped_mm's backward fails on an expanded grad
        counts[name] = saved.bytes
    assert counts["tiled"] == offsets.nbytes, counts
    rows, inter = x.shape[0], down.shape[-1]
    assert counts["eager"] >= 2 * rows * inter * 4, counts  # at least the gate_up output [S, 2I]


def test_compiled_model_saves_less_with_experts_tiled():
    """The compiled Mixtral step with the experts tiled saves less for backward than with them off
    (``mlp_experts=0``, whose report says so), by at least one [S, 2I] tensor per layer."""
    ids = torch.randint(0, VOCAB, (2, 24))
    saved_bytes = {}
    for on in (True, False):
        tilecompile.reset()
        model = _model("mixtral")
        compiled = _compile(model, mlp_experts=on)
        saved = _Saved(model.parameters())
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            _step(compiled, ids)
        saved_bytes[on] = saved.bytes
        if on:
            assert len(_rewrites()) == 2, tilecompile.report()
        else:
            assert not _rewrites() and sorted(s.module_path for s in _skips()) == EXPERT_PATHS, tilecompile.report()
            assert all("mlp_experts=0" in s.reason for s in _skips()), tilecompile.report()
    rows = 2 * 24 * 2
    assert saved_bytes[False] - saved_bytes[True] >= 2 * rows * 48 * 4, saved_bytes


def test_untiled_experts_compile_as_one_graph():
    """Experts left alone (``mlp_experts=0``) on CPU in fp32 run through HF's grouped_mm fallback op, whose backward
    is opaque (transformers' own op from 5.24, tilecompile/hf_grouped_mm.py's before, where its Python backward's
    ``tolist`` made every inner compile fail): one graph, no compile error, loss and grads equal eager's."""
    model = _model("qwen3_moe")
    ref = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (2, 7))
    out = _step(_compile(model, mlp_experts=False), ids)
    expected = _step(ref, ids)
    assert_close(out, expected, rtol=RTOL, atol=ATOL, name="logits")
    assert_grads_close(model, ref, rtol=RTOL, atol=ATOL)
    rep = tilecompile.report()
    assert rep.graphs == 1 and not rep.compile_errors and not _rewrites(), str(rep)


def test_grouped_mm_fallback_backward_op_float64():
    """tilecompile::grouped_mm_fallback_backward against autograd through a per-expert loop, an idle expert and
    rows past the last offset included (their dx is zero: the forward wrote no output for them)."""
    from tilecompile.hf_grouped_mm import grouped_mm_fallback_backward

    g = torch.Generator().manual_seed(3)
    x = torch.randn(11, 5, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(4, 5, 3, dtype=torch.float64, generator=g, requires_grad=True)
    offs = torch.tensor([3, 3, 7, 9])
    dy = torch.randn(11, 3, dtype=torch.float64, generator=g)
    start, parts = 0, []
    for e, end in enumerate(offs.tolist()):
        parts.append(x[start:end] @ w[e])
        start = end
    parts.append(x[start:] * 0 @ w[0])
    torch.cat(parts).backward(dy)
    dx, dw = grouped_mm_fallback_backward(dy, x.detach(), w.detach(), offs)
    assert_close(dx, x.grad, rtol=1e-12, atol=1e-14, name="dx")
    assert_close(dw, w.grad, rtol=1e-12, atol=1e-14, name="dw")
    torch.library.opcheck(grouped_mm_fallback_backward, (dy, x.detach(), w.detach(), offs))


# ------------------------------------------------------------------------------------------------------ the op


def _reference(x, gate_up, down, offsets, activation, row_mask=None):
    """Plain per-expert loop, rows past offsets[-1] zero; ``row_mask`` [S, 1] zero-fills the gate_up output."""
    act = {
        "silu": F.silu,
        "gelu": F.gelu,
        "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
        "relu": F.relu,
    }[activation]
    out, lo = [], 0
    for e, hi in enumerate(offsets.tolist()):
        p = F.linear(x[lo:hi], gate_up[e])
        if row_mask is not None:
            p = p.masked_fill(row_mask[lo:hi], 0)
        g, u = p.chunk(2, dim=-1)
        out.append(F.linear(act(g) * u, down[e]))
        lo = hi
    out.append(x.new_zeros((x.shape[0] - lo, down.shape[1])))
    return torch.cat(out)


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh", "relu"])
@pytest.mark.parametrize("chunk", [0, 1, 7])
@pytest.mark.parametrize("grad_accum", ["fp32", "param"])
def test_op_float64_against_reference(activation, chunk, grad_accum):
    torch.manual_seed(1)
    rows, d, inter, d_out, experts = 37, 13, 11, 13, 5
    x = torch.randn(rows, d, dtype=torch.float64, requires_grad=True)
    gate_up = torch.randn(experts, 2 * inter, d, dtype=torch.float64, requires_grad=True)
    down = torch.randn(experts, d_out, inter, dtype=torch.float64, requires_grad=True)
    offsets = torch.tensor([9, 9, 9, 30, 35])  # int64, two empty experts, 2 rows past the last
    out = _tiled_experts(x, gate_up, down, offsets, activation=activation, chunk_tokens=chunk, grad_accum=grad_accum)
    expected = _reference(x, gate_up, down, offsets, activation)
    assert_close(out, expected, rtol=1e-12, atol=1e-12, name="out")
    dy = torch.randn_like(out)
    ours = torch.autograd.grad(out, (x, gate_up, down), dy)
    theirs = torch.autograd.grad(expected, (x, gate_up, down), dy)
    for name, a, b in zip(("x", "gate_up", "down"), ours, theirs):
        assert_close(a, b, rtol=1e-12, atol=1e-12, name=f"grad of {name}")
    assert not ours[0][35:].any() and not ours[1][1:3].any()  # rows past the last expert, empty experts


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "relu"])
@pytest.mark.parametrize("chunk", [0, 1, 4])
def test_op_row_mask_float64(activation, chunk):
    """``row_mask`` is ``masked_fill(gate_up, mask, 0)`` before the gate, for rows inside experts' groups and past
    the last: the output and every grad equal the masked reference; masked rows give zero output and zero dx, and
    their values reach no weight grad (changing them changes nothing)."""
    torch.manual_seed(3)
    rows, d, inter, experts = 23, 7, 5, 4
    x = torch.randn(rows, d, dtype=torch.float64, requires_grad=True)
    gate_up = torch.randn(experts, 2 * inter, d, dtype=torch.float64, requires_grad=True)
    down = torch.randn(experts, d, inter, dtype=torch.float64, requires_grad=True)
    offsets = torch.tensor([6, 6, 15, 20], dtype=torch.int32)
    mask = torch.zeros(rows, 1, dtype=torch.bool)
    mask[[0, 5, 7, 8, 14, 19, 21]] = True  # group edges, a run inside a group, a row past the last
    dy = torch.randn(rows, d, dtype=torch.float64)
    grads = {}
    for name, rows_x in (("x", x), ("x with masked rows changed", x.detach().masked_fill(mask, 1e3))):
        rows_x = rows_x.detach().requires_grad_()
        out = _tiled_experts(rows_x, gate_up, down, offsets, activation=activation, chunk_tokens=chunk, row_mask=mask)
        expected = _reference(rows_x, gate_up, down, offsets, activation, row_mask=mask)
        assert_close(out, expected, rtol=1e-12, atol=1e-12, name=f"out ({name})")
        assert not out[mask.squeeze(-1)].any()
        grads[name] = torch.autograd.grad(out, (rows_x, gate_up, down), dy)
        theirs = torch.autograd.grad(expected, (rows_x, gate_up, down), dy)
        for what, a, b in zip(("x", "gate_up", "down"), grads[name], theirs):
            assert_close(a, b, rtol=1e-12, atol=1e-12, name=f"grad of {what} ({name})")
        assert not grads[name][0][mask.squeeze(-1)].any()
    for a, b in zip(*grads.values()):
        assert torch.equal(a, b)


def test_op_separate_gate_and_up_weights_and_partial_grads():
    """Gate and up as two stacked weights; only some inputs need grad (the rest get none, and no work)."""
    torch.manual_seed(2)
    x = torch.randn(10, 6, dtype=torch.float64)
    wg = torch.randn(3, 6, 4, dtype=torch.float64, requires_grad=True)
    wu = torch.randn(3, 6, 4, dtype=torch.float64)
    wd = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    offsets = torch.tensor([4, 4, 10], dtype=torch.int32)
    out = tiled_grouped_mlp(x, offsets, wg, wu, wd, chunk_tokens=3)
    lo, parts = 0, []
    for e, hi in enumerate(offsets.tolist()):
        parts.append((F.silu(x[lo:hi] @ wg[e]) * (x[lo:hi] @ wu[e])) @ wd[e])
        lo = hi
    expected = torch.cat(parts)
    assert_close(out, expected, rtol=1e-12, atol=1e-12, name="out")
    ours = torch.autograd.grad(out.sum(), (wg, wd))
    theirs = torch.autograd.grad(expected.sum(), (wg, wd))
    for a, b in zip(ours, theirs):
        assert_close(a, b, rtol=1e-12, atol=1e-12, name="grad")


def test_op_fp32_error_against_float64_within_grouped_mms():
    """fp32, chunked: the op's error against a float64 reference is no more than eager grouped_mm's own (rows past
    the last expert: grouped_mm leaves them undefined, the op zeros them)."""
    x, gate_up, down, offsets = _expert_inputs()
    out = _tiled_experts(x, gate_up, down, offsets, chunk_tokens=5)
    expected = _eager_experts(x, gate_up, down, offsets)
    reference = _reference(*(t.detach().double() for t in (x, gate_up, down)), offsets, "silu")
    ours, eager = rel_err(out[:90], reference[:90]), rel_err(expected[:90], reference[:90])
    assert ours <= 2 * eager + 1e-7, (ours, eager)
    assert not out[90:].any()


def test_op_rejects_bad_offsets_and_opcheck():
    x, gate_up, down, _ = _expert_inputs(torch.float64, rows=8, d=4, inter=3, experts=2)
    with pytest.raises(ValueError, match="non-decreasing"):
        _tiled_experts(x, gate_up, down, torch.tensor([5, 3]))
    with pytest.raises(ValueError, match="non-decreasing"):
        _tiled_experts(x, gate_up, down, torch.tensor([5, 9]))
    w = gate_up.transpose(-2, -1)
    args = (x, torch.tensor([3, 6]), w[..., :3], w[..., 3:], down.transpose(-2, -1), "silu", 2, 256, "fp32")
    torch.library.opcheck(torch.ops.tilecompile.tiled_grouped_mlp.default, args)
    mask = torch.tensor([[True], [False]] * 4)
    torch.library.opcheck(torch.ops.tilecompile.tiled_grouped_mlp.default, (*args, mask))
    with pytest.raises(ValueError, match="row_mask"):
        _tiled_experts(x, gate_up, down, torch.tensor([3, 6]), row_mask=mask.expand(8, 3))


# --------------------------------------------------------------------------------------------------- reasons


def test_batched_mm_experts_under_autocast_get_a_reason():
    """batched_mm's bmm is an autocast op (bf16) while its gathered weights stay fp32: a dtype chain the op (one
    compute dtype) would not reproduce, so the experts are left alone with that reason, and the step equals eager."""
    model = _model("mixtral")
    model.set_experts_implementation("batched_mm")
    ref = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (2, 5))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = _step(_compile(model), ids)
        expected = _step(ref, ids)
    assert rel_err(out, expected) < 1e-2
    assert not _rewrites()
    skips = _skips()
    assert sorted(s.module_path for s in skips) == EXPERT_PATHS, tilecompile.report()
    assert all("mixed dtypes inside the experts" in s.reason for s in skips), tilecompile.report()


class _GroupedExperts(torch.nn.Module):
    """Stacked experts over rows already grouped by expert, as HF's grouped_mm experts compute them (bf16: the only
    dtype torch's grouped_mm takes under Dynamo)."""

    def __init__(self, form: str, experts=3, d=8, inter=16) -> None:
        super().__init__()
        self.form = form
        for name, shape in (("gate_up_proj", (2 * inter, d)), ("up_proj", (inter, d)), ("down_proj", (d, inter))):
            w = torch.randn(experts, *shape) / 4
            setattr(self, name, torch.nn.Parameter(w.to(torch.bfloat16)))

    def forward(self, x, offsets):
        w1, wd = self.gate_up_proj.transpose(-2, -1), self.down_proj.transpose(-2, -1)
        if self.form == "not_gated":
            h = F.silu(F.grouped_mm(x, self.up_proj.transpose(-2, -1), offs=offsets))
            return F.grouped_mm(h, wd, offs=offsets)
        if self.form == "lone":  # one grouped matmul, no MLP around it
            return F.grouped_mm(x, w1, offs=offsets)
        g, u = F.grouped_mm(x, w1, offs=offsets).chunk(2, dim=-1)
        if self.form == "up_first":
            return F.grouped_mm(u * F.gelu(g, approximate="tanh"), wd, offs=offsets)
        if self.form == "separate":
            u = F.grouped_mm(x, self.up_proj.transpose(-2, -1), offs=offsets)
            return F.grouped_mm(F.silu(g) * u, wd, offs=offsets)
        if self.form == "leaked":  # the gate output is also returned: the op would have to keep it
            return F.grouped_mm(F.silu(g) * u, wd, offs=offsets), g
        raise ValueError(self.form)


@pytest.mark.parametrize("form,activation", [("up_first", "gelu_tanh"), ("separate", "silu")])
def test_grouped_spellings_fire(form, activation):
    model = _GroupedExperts(form)
    ref = copy.deepcopy(model)
    x = torch.randn(14, 8, dtype=torch.bfloat16)
    offsets = torch.tensor([5, 5, 12], dtype=torch.int32)
    out, expected = _compile(model)(x, offsets), ref(x, offsets)
    assert rel_err(out[:12], expected[:12]) < 1e-2, rel_err(out[:12], expected[:12])  # bf16 rounding apart
    out[:12].float().square().sum().backward()
    expected[:12].float().square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is not None:
            assert rel_err(p.grad, q.grad) < 2e-2, (name, rel_err(p.grad, q.grad))
        else:
            assert p.grad is None, name
    (r,) = _rewrites()
    assert f"activation={activation} " in r.detail and ("fused=no" in r.detail) == (form == "separate"), r.detail


@pytest.mark.parametrize(
    "form,reason",
    [
        ("not_gated", "experts not gated"),
        ("lone", "grouped_mm not read as the gate/up or down projection"),
        ("leaked", "also used outside the experts"),
    ],
)
def test_grouped_near_misses_get_a_reason(form, reason):
    _assert_skipped_with(_GroupedExperts(form), reason)


def _assert_skipped_with(model: torch.nn.Module, reason: str) -> None:
    """``model`` (x [14, 8], offsets [5, 5, 12]) compiles with its experts left alone and one skip giving ``reason``."""
    x = torch.randn(14, 8, dtype=torch.bfloat16)
    offsets = torch.tensor([5, 5, 12], dtype=torch.int32)
    _compile(model)(x, offsets)
    assert not _rewrites(), tilecompile.report()
    (s,) = _skips()
    assert reason in s.reason, s


# ------------------------------------------------------------------------------- zero-filled (sentinel) rows


def _hf_grouped_mm():
    import transformers.integrations.moe  # noqa: F401 - registers torch.ops.transformers.grouped_mm_fallback

    return torch.ops.transformers.grouped_mm_fallback


class _SentinelExperts(torch.nn.Module):
    """HF's grouped_mm experts (transformers/integrations/moe.py) with expert-parallel sentinel rows: expert ids >=
    ``num_experts`` are rows routed to experts on other ranks. transformers 5.17 runs this code always, 5.24 under
    ``_is_expert_parallel``: the sort puts the sentinels at the tail, ``histc`` leaves them out of the offsets, ``x``
    is zero-filled in place, the gate_up output zero-filled before the gate, the down output after. float64 through
    HF's fallback grouped_mm (what HF calls for non-bf16 weights under Dynamo). ``expose_rows``: the masked down
    output is returned too (a second reader: the routing-weight multiply then stays outside the op)."""

    def __init__(self, experts=4, d=6, inter=5, expose_rows=True) -> None:
        super().__init__()
        self.num_experts, self.expose_rows = experts, expose_rows
        self.gate_up_proj = torch.nn.Parameter(torch.randn(experts, 2 * inter, d, dtype=torch.float64) / 2)
        self.down_proj = torch.nn.Parameter(torch.randn(experts, d, inter, dtype=torch.float64) / 2)

    def forward(self, hidden, top_k_index, top_k_weights):
        mm, experts = _hf_grouped_mm(), self.num_experts
        tokens, top_k = top_k_index.shape
        expert_ids_g, perm = torch.sort(top_k_index.reshape(-1))
        x = hidden[perm // top_k]
        sample_weights_g = top_k_weights.reshape(-1)[perm]
        tokens_per_expert = torch.histc(expert_ids_g.double(), bins=experts, min=0, max=experts - 1)
        offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
        sentinel_mask = (expert_ids_g >= experts).unsqueeze(-1)
        x.masked_fill_(sentinel_mask, 0.0)
        proj = mm(x, self.gate_up_proj.transpose(-2, -1), offs=offsets).masked_fill(sentinel_mask, 0.0)
        gate, up = proj.chunk(2, dim=-1)
        proj = mm(F.silu(gate) * up, self.down_proj.transpose(-2, -1), offs=offsets).masked_fill(sentinel_mask, 0.0)
        weighted = proj * sample_weights_g.unsqueeze(-1)
        inv_perm = torch.empty_like(perm)
        inv_perm[perm] = torch.arange(perm.size(0))
        out = weighted[inv_perm].view(tokens, top_k, -1).sum(dim=1)
        return out, (proj if self.expose_rows else None), sentinel_mask


@pytest.mark.parametrize("expose_rows", [True, False], ids=["rows_read", "weight_taken_in"])
@pytest.mark.parametrize("sentinels", [0, 5], ids=["no_sentinel", "sentinels"])
def test_sentinel_masked_experts_tiled_float64(sentinels, expose_rows):
    """The experts read through the sentinel zero fill and tiled (the mask handed to the op): one graph (HF 5.17's
    fallback backward, whose ``.tolist()`` cannot be traced, no longer in it), output and every grad equal eager in
    float64, the sentinel rows zero in the output and in the hidden states' grad. Where nothing else reads the
    masked down output, the routing-weight multiply after the post-mask goes into the op (``row_weight``), the
    routing weights' grad from the op's backward."""
    torch.manual_seed(4)
    model = _SentinelExperts(expose_rows=expose_rows)
    ref = copy.deepcopy(model)
    tokens, top_k = 9, 2
    hidden = torch.randn(tokens, 6, dtype=torch.float64, requires_grad=True)
    index = torch.randint(0, 4, (tokens, top_k))
    index.view(-1)[torch.randperm(tokens * top_k)[:sentinels]] = 4 + torch.arange(sentinels) % 2  # other ranks'
    weights = torch.rand(tokens, top_k, dtype=torch.float64).masked_fill(index >= 4, 0.0)  # as EP dispatch leaves
    weights.requires_grad_()
    out, rows, mask = _compile(model)(hidden, index, weights)
    expected, expected_rows, _ = ref(hidden, index, weights)
    assert_close(out, expected, rtol=1e-12, atol=1e-12, name="out")
    if expose_rows:
        assert_close(rows, expected_rows, rtol=1e-12, atol=1e-12, name="expert rows")
        assert not rows[mask.squeeze(-1)].any()
    assert int(mask.sum()) == sentinels
    dy = torch.randn_like(out)
    ours = torch.autograd.grad(out, (hidden, weights, *model.parameters()), dy)
    theirs = torch.autograd.grad(expected, (hidden, weights, *ref.parameters()), dy)
    for name, a, b in zip(("hidden", "routing weights", "gate_up_proj", "down_proj"), ours, theirs):
        assert_close(a, b, rtol=1e-12, atol=1e-12, name=f"grad of {name}")
    only_sentinels = (index >= 4).all(-1)  # tokens routed only to other ranks get no gradient here
    assert not ours[0][only_sentinels].any()
    rep = tilecompile.report()
    assert rep.graphs == 1 and rep.counts["tiled_mlp"] == 1 and not _skips(), rep
    (r,) = _rewrites()
    assert "row_mask=sentinel_mask" in r.detail and "fused=gate_up" in r.detail, r.detail
    assert ("row_weight=none" in r.detail) == expose_rows, r.detail


class _RowMaskedExperts(torch.nn.Module):
    """Grouped experts whose gate and up are zero-filled on rows an input mask flags, anywhere in the groups (not
    only past the last offset, where the op would give zero anyway): the fill before the chunk (HF's spelling) or
    after it, on separate gate and up projections."""

    def __init__(self, form: str, experts=3, d=5, inter=4) -> None:
        super().__init__()
        self.form = form
        for name, shape in (("gate_up_proj", (2 * inter, d)), ("up_proj", (inter, d)), ("down_proj", (d, inter))):
            setattr(self, name, torch.nn.Parameter(torch.randn(experts, *shape, dtype=torch.float64) / 2))

    def forward(self, x, offsets, mask):
        mm = _hf_grouped_mm()
        if self.form == "fill_then_chunk":
            gate, up = mm(x, self.gate_up_proj.transpose(-2, -1), offs=offsets).masked_fill(mask, 0).chunk(2, dim=-1)
        else:  # "separate": each projection filled after its own grouped_mm (the gate a slice of gate_up)
            gate = mm(x, self.gate_up_proj.transpose(-2, -1), offs=offsets)[..., :4].masked_fill(mask, 0.0)
            up = torch.masked_fill(mm(x, self.up_proj.transpose(-2, -1), offs=offsets), mask, 0.0)
        return mm(F.gelu(gate, approximate="tanh") * up, self.down_proj.transpose(-2, -1), offs=offsets)


@pytest.mark.parametrize("form", ["fill_then_chunk", "separate"])
def test_row_masked_experts_tiled_float64(form):
    """Rows flagged inside the experts' groups: the tiled op zeroes them as the fill does, in the output and in every
    grad, equal to eager in float64; their values reach no weight grad."""
    torch.manual_seed(5)
    model = _RowMaskedExperts(form)
    ref = copy.deepcopy(model)
    offsets = torch.tensor([4, 4, 11], dtype=torch.int32)
    mask = torch.zeros(13, 1, dtype=torch.bool)
    mask[[0, 3, 6, 7, 12]] = True
    x = torch.randn(13, 5, dtype=torch.float64, requires_grad=True)
    compiled = _compile(model)
    out, expected = compiled(x, offsets, mask), ref(x, offsets, mask)
    assert_close(out[:11], expected[:11], rtol=1e-12, atol=1e-12, name="out")
    assert not out[mask.squeeze(-1)].any()
    dy = torch.randn_like(out)
    dy[11:] = 0  # rows past the last offset: HF's fallback leaves their grad out, the op zeros them
    ours = torch.autograd.grad(out, (x, *model.parameters()), dy, allow_unused=True)
    theirs = torch.autograd.grad(expected, (x, *ref.parameters()), dy, allow_unused=True)
    for (name, _), a, b in zip([("x", x), *model.named_parameters()], ours, theirs):
        assert (a is None) == (b is None), name
        if a is not None:
            assert_close(a, b, rtol=1e-12, atol=1e-12, name=f"grad of {name}")
    assert not ours[0][mask.squeeze(-1)].any()
    x2 = x.detach().masked_fill(mask, 7.0).requires_grad_()
    again = torch.autograd.grad(compiled(x2, offsets, mask), (x2, *model.parameters()), dy, allow_unused=True)
    assert all(torch.equal(a, b) for a, b in zip(ours, again) if a is not None)
    (r,) = _rewrites()
    assert "row_mask=l_mask_" in r.detail and ("fused=no" in r.detail) == (form == "separate"), r.detail


class _BadFillExperts(torch.nn.Module):
    def __init__(self, form: str, experts=3, d=8, inter=16) -> None:
        super().__init__()
        self.form = form
        self.gate_up_proj = torch.nn.Parameter((torch.randn(experts, 2 * inter, d) / 4).to(torch.bfloat16))
        self.down_proj = torch.nn.Parameter((torch.randn(experts, d, inter) / 4).to(torch.bfloat16))

    def forward(self, x, offsets):
        p = F.grouped_mm(x, self.gate_up_proj.transpose(-2, -1), offs=offsets)
        rows = x[:, :1] > 0
        if self.form == "gate_only":
            g, u = p.chunk(2, dim=-1)
            g = g.masked_fill(rows, 0.0)
        elif self.form == "elementwise":
            g, u = p.masked_fill(rows.expand(-1, p.shape[-1]), 0.0).chunk(2, dim=-1)
        else:
            raise ValueError(self.form)
        return F.grouped_mm(F.silu(g) * u, self.down_proj.transpose(-2, -1), offs=offsets)


@pytest.mark.parametrize(
    "form,reason",
    [
        ("gate_only", "zero-filled by different masks (gate: rows, up: none)"),
        ("elementwise", "is not a row mask [14, 1]"),
    ],
)
def test_zero_fills_the_op_cannot_take_get_a_reason(form, reason):
    _assert_skipped_with(_BadFillExperts(form), reason)


def _step_equals_eager(family, checkpointing, **options):
    """The family's tiny model (HF checkpointing on or off) compiled with ``options``: logits, grads equal eager's."""
    model = _model(family)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (2, 7))
    out = _step(_compile(model, **options), ids)
    assert_close(out, _step(ref, ids), rtol=RTOL, atol=ATOL, name="logits")
    assert_grads_close(model, ref, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_experts_left_alone_where_tiling_does_not_pay(checkpointing):
    """With a token threshold set (``mlp_min_tokens`` > 0), experts whose saved activations (4 [S, I] tensors) are
    no more than what the tiled op would hold in its backward (a chunk's weight grad, the chunk budget, the carry)
    are left alone, the two sizes in the reason: per layer in a checkpoint body, summed over the graph's expert MLPs
    without checkpointing. The step still equals eager's."""
    _step_equals_eager("mixtral", checkpointing, mlp_min_tokens=1)
    assert not _rewrites(), tilecompile.report()
    reasons = [s.reason for s in _skips() if "experts" in s.module_path]
    assert len(reasons) == 2 and all("tiling does not pay" in r for r in reasons), reasons
    where = "this checkpointed layer" if checkpointing else "the graph's expert MLPs together"
    assert all(where in r and "MiB" in r for r in reasons), reasons


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("scale,tiled_in_a_body", [(0.5, True), (1.0, False), (2.0, False)])
def test_tiled_where_the_activations_exceed_the_ops_bytes(monkeypatch, checkpointing, scale, tiled_in_a_body):
    """The rule's threshold, with the op's bytes set to ``scale`` times the layer's saved bytes: tiled where the
    activations exceed them, in a checkpoint body as without checkpointing (where the graph's expert MLPs are summed,
    so the graph's two layers hold twice one layer's bytes: tiled at 1.0 too). Values equal eager's."""
    from tilecompile.passes.mlp import experts

    monkeypatch.setattr(experts, "op_bytes", lambda m, *args: int(experts.saved_bytes(m) * scale))
    _step_equals_eager("qwen3_moe", checkpointing, mlp_min_tokens=1)
    expected = tiled_in_a_body if checkpointing else scale < 2
    assert len(_rewrites()) == (2 if expected else 0), tilecompile.report()
    if not expected:
        reasons = [s.reason for s in _skips() if "experts" in s.module_path]
        where = "held only through its recompute and backward" if checkpointing else "the graph's expert MLPs together"
        assert reasons and all("tiling does not pay" in r and where in r for r in reasons), reasons


def test_op_bytes_count_a_chunks_weight_grad_only_without_the_wgrad_kernel(monkeypatch):
    """On CUDA with Triton the grouped_wgrad kernel writes each chunk's weight grads straight into the grads: the op
    holds no [E, D, I] part then; off CUDA (or with the kernel off) it does, and op_bytes counts it."""
    from tilecompile.ops import tiled_grouped_mlp as grouped_op
    from tilecompile.passes.mlp import experts

    found = []
    monkeypatch.setattr(experts, "check_pays", lambda m, *args: found.append(m))
    _step(_compile(_model("qwen3_moe"), mlp_min_tokens=1), torch.randint(0, VOCAB, (2, 7)))
    assert found, tilecompile.report()
    e, d, i = 4, 16, 24  # the tiny model's experts: [E, D, I] gate and up, [E, I, D] down, fp32
    carry, chunk = 2 * (2 * d * i + i * d) * 4, 256 * 2**20
    assert experts.op_bytes(found[0], 256, "fp32") == carry + e * d * i * 4 + chunk  # on this CPU
    assert not grouped_op.wgrad_kernel_runs(torch.device("cpu"))
    assert grouped_op.wgrad_kernel_runs(torch.device("cuda")) == grouped_op.grouped_kernels.HAS_TRITON
    monkeypatch.setattr(grouped_op, "wgrad_kernel_runs", lambda device: True)  # as on a GPU
    assert experts.op_bytes(found[0], 256, "fp32") == carry + chunk
    monkeypatch.undo()
    monkeypatch.setattr(grouped_op, "USE_WGRAD_KERNEL", False)
    assert not grouped_op.wgrad_kernel_runs(torch.device("cuda"))


def test_experts_of_a_layer_the_memory_plan_keeps_stay_whole(monkeypatch):
    """With room for every checkpointed layer, the memory plan keeps them whole and the experts pass leaves their
    experts untiled, saying so; values and grads still equal eager's."""
    from tilecompile.passes import memory_plan

    monkeypatch.setattr(memory_plan, "room_for", lambda *args: (10**12, "budget set by the test"))
    model = _model("qwen3_moe")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (2, 7))
    out = _step(_compile(model, memory_budget=1.0), ids)
    expected = _step(ref, ids)
    assert_close(out, expected, rtol=RTOL, atol=ATOL, name="logits")
    assert_grads_close(model, ref, rtol=RTOL, atol=ATOL)
    assert tilecompile.report().counts["memory_plan"] == 2 and not _rewrites()
    reasons = [s.reason for s in _skips()]
    # transformers >= 5.25 compiles each checkpointed layer as a frame of its own (its __call__ breaks the graph), so
    # the layer has no path inside the model there: the report names the checkpoint call (the same name in both
    # frames, one reason, or tag_activation_checkpoint_1 in the second: both seen)
    names = ("model.layers.", "tag_activation_checkpoint")
    assert (len(reasons) == 2) if "model.layers." in str(reasons) else (1 <= len(reasons) <= 2), reasons
    assert all(any(f"the memory plan keeps layer {name}" in r for name in names) for r in reasons), reasons
