"""MoE experts (HF transformers 5's grouped experts: stacked ``gate_up_proj`` [E, 2I, D] / ``down_proj`` [E, D, I] run
by ``grouped_mm`` over the routed rows sorted by expert) through the backend: the tiled_mlp pass rewrites them into
``tilecompile::tiled_grouped_mlp`` (tilecompile/ops/tiled_grouped_mlp.py, passes/tiled_mlp_experts.py), the step
equals eager's, the op saves less than eager's experts, and the forms it does not tile keep a reason."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, assert_grads_close, compile_options, rel_err

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


# ------------------------------------------------------------------------------------------------------ the op


def _reference(x, gate_up, down, offsets, activation):
    """Plain per-expert loop, rows past offsets[-1] zero."""
    act = {
        "silu": F.silu,
        "gelu": F.gelu,
        "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
        "relu": F.relu,
    }[activation]
    out, lo = [], 0
    for e, hi in enumerate(offsets.tolist()):
        g, u = F.linear(x[lo:hi], gate_up[e]).chunk(2, dim=-1)
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
    model = _GroupedExperts(form)
    x = torch.randn(14, 8, dtype=torch.bfloat16)
    offsets = torch.tensor([5, 5, 12], dtype=torch.int32)
    _compile(model)(x, offsets)
    assert not _rewrites(), tilecompile.report()
    (s,) = _skips()
    assert reason in s.reason, s
