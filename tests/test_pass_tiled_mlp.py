"""tiled_mlp pass: gated MLPs in every spelling become ``tilecompile::tiled_gated_mlp``; near-misses are skipped
with their reason; HF Llama / Qwen2 / Qwen3 (with and without activation checkpointing) match eager."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, assert_grads_close, compile_options, rel_err

import tilecompile
from tilecompile import config, pipeline
from tilecompile import graph as G

D, INTER = 16, 24  # hidden, intermediate of the small MLPs
RTOL, ATOL = 1e-4, 1e-5


def _compile(model, dynamic=None, **options):
    opts = compile_options(**{"fused_linear_ce": False, "mlp_chunk_tokens": 4, **options})
    return torch.compile(model, backend="tilecompile", options=opts, dynamic=dynamic)


def _rewrites():
    return [r for r in tilecompile.report().rewrites if r.pass_name == "tiled_mlp"]


def _skips():
    return [s for s in tilecompile.report().skipped if s.pass_name == "tiled_mlp"]


def _check_against_eager(model, *inputs, rtol=RTOL, atol=ATOL, **options):
    """Compile ``model``, run forward + backward on it and on an eager copy; outputs and grads must agree."""
    ref = copy.deepcopy(model)
    compiled = _compile(model, **options)
    xs = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
    rs = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out, expected = compiled(*xs), ref(*rs)
    assert_close(out, expected, rtol=rtol, atol=atol, name="output")
    (out.float().square().mean()).backward()
    (expected.float().square().mean()).backward()
    assert_grads_close(model, ref, rtol=rtol, atol=atol)
    for i, (a, b) in enumerate(zip(xs, rs)):
        if a.grad is not None or b.grad is not None:
            assert_close(a.grad, b.grad, rtol=rtol, atol=atol, name=f"grad of input {i}")
    return out


# ------------------------------------------------------------------------------------------------ spellings


class MLP(torch.nn.Module):
    """Separate gate / up / down linears; ``spell`` says how the forward is written."""

    def __init__(self, spell: str, bias: bool = False) -> None:
        super().__init__()
        self.spell = spell
        self.gate_proj = torch.nn.Linear(D, INTER, bias=bias)
        self.up_proj = torch.nn.Linear(D, INTER, bias=bias)
        self.down_proj = torch.nn.Linear(INTER, D, bias=bias)
        self.act_fn = torch.nn.SiLU()

    def forward(self, x):
        g, u = self.gate_proj(x), self.up_proj(x)
        s = self.spell
        if s == "silu":
            h = F.silu(g) * u
        elif s == "nn_silu":
            h = self.act_fn(g) * u
        elif s == "x_sigmoid":
            h = g * torch.sigmoid(g) * u
        elif s == "sigmoid_x_method":
            h = (g.sigmoid() * g) * u
        elif s == "gelu":
            h = F.gelu(g) * u
        elif s == "gelu_tanh":
            h = F.gelu(g, approximate="tanh") * u
        elif s == "relu":
            h = torch.relu(g) * u
        elif s == "up_first":
            h = u * F.silu(g)
        elif s == "plus_zero":  # Megatron-Core's GLU: act(gate) * (up + glu_linear_offset), 0.0 by default
            h = F.silu(g) * (u + 0.0)
        elif s == "zero_plus":
            h = F.silu(g) * (0 + u)
        elif s == "matmul":
            g = x @ self.gate_proj.weight.t()
            u = torch.matmul(x, self.up_proj.weight.T)
            if self.gate_proj.bias is not None:
                g, u = g + self.gate_proj.bias, self.up_proj.bias + u
            h = F.silu(g) * u
            out = h @ self.down_proj.weight.t()
            return out if self.down_proj.bias is None else out + self.down_proj.bias
        else:
            raise ValueError(s)
        return self.down_proj(h)


class FusedMLP(torch.nn.Module):
    """One ``gate_up`` linear whose output is cut in two along the last dim."""

    def __init__(self, spell: str, bias: bool = False, up_first: bool = False, act: str = "silu") -> None:
        super().__init__()
        self.spell, self.up_first, self.act = spell, up_first, act
        self.gate_up_proj = torch.nn.Linear(D, 2 * INTER, bias=bias)
        self.down_proj = torch.nn.Linear(INTER, D, bias=bias)

    def forward(self, x):
        gu = self.gate_up_proj(x)
        if self.spell == "chunk":
            a, b = gu.chunk(2, dim=-1)
        elif self.spell == "torch_chunk":
            a, b = torch.chunk(gu, 2, -1)
        elif self.spell == "split":
            a, b = torch.split(gu, INTER, dim=-1)
        elif self.spell == "split_list":
            a, b = gu.split([INTER, INTER], -1)
        elif self.spell == "slice":
            a, b = gu[..., :INTER], gu[..., INTER:]
        elif self.spell == "slice_full":
            a, b = gu[:, :, :INTER], gu[:, :, INTER:]
        else:
            raise ValueError(self.spell)
        gate, up = (b, a) if self.up_first else (a, b)
        act = F.gelu(gate, approximate="tanh") if self.act == "gelu_tanh" else F.silu(gate)
        return self.down_proj(up * act)


SEPARATE = [
    ("silu", "silu"),
    ("nn_silu", "silu"),
    ("x_sigmoid", "silu"),
    ("sigmoid_x_method", "silu"),
    ("gelu", "gelu"),
    ("gelu_tanh", "gelu_tanh"),
    ("relu", "relu"),
    ("up_first", "silu"),
    ("plus_zero", "silu"),
    ("zero_plus", "silu"),
    ("matmul", "silu"),
]


@pytest.mark.parametrize("spell,activation", SEPARATE, ids=[s for s, _ in SEPARATE])
def test_separate_linears_fire(spell, activation):
    _check_against_eager(MLP(spell), torch.randn(2, 5, D))
    (r,) = _rewrites()
    assert f"activation={activation} " in r.detail and "fused=no" in r.detail, r.detail
    assert (
        r.shapes["x"] == (2, 5, D) and r.shapes["gate_weight"] == (INTER, D) and r.shapes["down_weight"] == (D, INTER)
    )
    assert r.dtypes["compute"] == "torch.float32"
    assert not _skips(), tilecompile.report()


@pytest.mark.parametrize("spell", ["silu", "matmul"])
def test_biases_fire(spell):
    _check_against_eager(MLP(spell, bias=True), torch.randn(2, 5, D))
    (r,) = _rewrites()
    assert "bias=gate,up,down" in r.detail, r.detail


FUSED = [
    ("chunk", {}),
    ("torch_chunk", {"up_first": True}),
    ("split", {"bias": True}),
    ("split_list", {"act": "gelu_tanh"}),
    ("slice", {"up_first": True, "bias": True}),
    ("slice_full", {}),
]


@pytest.mark.parametrize("spell,kw", FUSED, ids=[s for s, _ in FUSED])
def test_fused_gate_up_fires(spell, kw):
    _check_against_eager(FusedMLP(spell, **kw), torch.randn(2, 5, D))
    (r,) = _rewrites()
    assert "fused=gate_up" in r.detail, r.detail
    assert r.shapes["gate_up_weight"] == (2 * INTER, D) and r.shapes["gate_weight"] == (INTER, D), r.shapes


class Block(torch.nn.Module):
    def __init__(self, spell: str = "silu") -> None:
        super().__init__()
        self.mlp = MLP(spell)

    def forward(self, x):
        return x + self.mlp(x)


def test_two_dim_input_and_module_path():
    _check_against_eager(Block(), torch.randn(7, D))
    (r,) = _rewrites()
    assert r.module_path == "mlp" and r.shapes["x"] == (7, D), r


def test_dynamic_shapes_fire_once_and_serve_other_lengths():
    model = MLP("silu")
    ref = copy.deepcopy(model)
    compiled = _compile(model, dynamic=True)
    for n in (5, 9):
        x = torch.randn(2, n, D)
        assert_close(compiled(x), ref(x), rtol=RTOL, atol=ATOL, name=f"output at {n} tokens")
    assert len(_rewrites()) == 1, tilecompile.report()


def test_settings_reach_the_op():
    _check_against_eager(MLP("silu"), torch.randn(2, 5, D), mlp_chunk_tokens=3, mlp_grad_accum="param")
    (r,) = _rewrites()
    assert "chunk_tokens=3 " in r.detail and "grad_accum=param" in r.detail, r.detail


def test_inserted_op_carries_settings_and_metas():
    seen = {}

    def capture(gm, example_inputs):
        gm = pipeline.run_passes(gm, config.load(compile_options(mlp_chunk_tokens=7, mlp_chunk_budget_mb=3)))
        seen["gm"] = gm
        # harmless when run twice: the rewritten region no longer matches
        gm = pipeline.run_passes(gm, config.load(compile_options()))
        return gm.forward

    torch.compile(Block(), backend=capture)(torch.randn(2, 5, D))
    (node,) = [n for n in seen["gm"].graph.nodes if n.target is torch.ops.tilecompile.tiled_gated_mlp.default]
    assert node.args[7:] == ("silu", 7, 3, "fp32"), node.args
    assert tuple(node.meta["example_value"].shape) == (2, 5, D)
    assert G.module_path(node) == "mlp", node.meta.get("nn_module_stack")
    assert not any(n.target is F.silu for n in seen["gm"].graph.nodes)
    assert len(_rewrites()) == 1, tilecompile.report()


@pytest.mark.parametrize("mode", ["bf16", "autocast"])
def test_cpu_bf16_and_autocast_match_eager(mode):
    fp32_ref = MLP("silu", bias=True)
    model = copy.deepcopy(fp32_ref)
    if mode == "bf16":
        model = model.to(torch.bfloat16)
    ref = copy.deepcopy(model)
    compiled = _compile(model)
    x = torch.randn(2, 5, D)
    xb = x.to(torch.bfloat16) if mode == "bf16" else x
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
        out, expected = compiled(xb), ref(xb)
    reference = fp32_ref(x)
    for t in (out, expected, reference):
        t.float().square().mean().backward()
    assert out.dtype == expected.dtype == torch.bfloat16
    for ours, eager in _err_vs_reference(model, ref, fp32_ref, out, expected, reference):
        assert ours <= 2 * eager + 2e-3, (ours, eager)
    (r,) = _rewrites()
    weight = "torch.bfloat16" if mode == "bf16" else "torch.float32"
    assert r.dtypes == {"x": str(xb.dtype), "weight": weight, "compute": "torch.bfloat16"}, r.dtypes
    assert ("autocast" in r.detail) == (mode == "autocast"), r.detail


@pytest.mark.parametrize("tiled", [True, False], ids=["tiled", "untiled"])
def test_backward_saves_no_intermediate(tiled):
    """The point of the pass: what the compiled graph saves for backward holds no [tokens, I] tensor."""
    model = Block("silu")
    compiled = _compile(model, tiled_mlp=tiled)
    x = torch.randn(4, 64, D, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = compiled(x)
    out.sum().backward()
    wide = [shape for shape in saved if shape and shape[-1] == INTER and torch.Size(shape).numel() >= 4 * 64 * INTER]
    assert (not wide) == tiled, saved
    assert len(_rewrites()) == int(tiled)


class AutocastInside(torch.nn.Module):
    """``torch.autocast`` inside the compiled code: Dynamo puts _enter/_exit_autocast nodes in the graph."""

    def __init__(self, nested: bool) -> None:
        super().__init__()
        self.nested = nested
        self.mlp = MLP("silu")

    def forward(self, x):
        m = self.mlp
        with torch.autocast("cpu", dtype=torch.bfloat16):
            g, u = m.gate_proj(x), m.up_proj(x)
            if self.nested:
                with torch.autocast("cpu", enabled=False):
                    a = F.silu(g)
            else:
                a = F.silu(g)
            return m.down_proj(a * u).float()


@pytest.mark.parametrize("nested", [False, True], ids=["block", "edge_inside"])
def test_autocast_block_in_graph(nested):
    _check_against_eager(AutocastInside(nested), torch.randn(2, 5, D), rtol=2e-2, atol=2e-2)
    if nested:
        assert not _rewrites()
        (s,) = _skips()
        assert "autocast block starts or ends inside the MLP" in s.reason, s
    else:
        (r,) = _rewrites()
        assert r.dtypes["compute"] == "torch.bfloat16" and "autocast" in r.detail, r


# ----------------------------------------------------------------------------------------------- near-misses


class NearMiss(torch.nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.gate_proj = torch.nn.Linear(D, INTER, bias=False)
        self.up_proj = torch.nn.Linear(D, INTER, bias=False)
        self.down_proj = torch.nn.Linear(INTER, D, bias=False)
        self.lora_a, self.lora_b = torch.nn.Linear(D, 2, bias=False), torch.nn.Linear(2, INTER, bias=False)

    def forward(self, x):
        k = self.kind
        if k == "different_x":
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x * 2))
        if k == "used_elsewhere":
            g = self.gate_proj(x)
            return self.down_proj(F.silu(g) * self.up_proj(x)) + g.sum()
        if k == "not_gated":
            return self.down_proj(F.gelu(self.up_proj(x)))
        if k == "not_gated_x_sigmoid":
            u = self.up_proj(x)
            return self.down_proj(u * torch.sigmoid(u))
        if k == "weight_computed":
            g = F.linear(x, self.gate_proj.weight * 2)
            return self.down_proj(F.silu(g) * self.up_proj(x))
        if k == "plus_one":  # a nonzero offset is not the up projection itself
            return self.down_proj(F.silu(self.gate_proj(x)) * (self.up_proj(x) + 1.0))
        if k == "sigmoid_glu":
            return self.down_proj(torch.sigmoid(self.gate_proj(x)) * self.up_proj(x))
        if k == "lora_gate":  # PEFT's LoRA: base_layer(x) + lora_B(lora_A(x)) * scaling
            return self.down_proj(F.silu(self.gate_proj(x) + self.lora_b(self.lora_a(x)) * 2.0) * self.up_proj(x))
        if k == "branch_of_another_input":  # linear(x) + linear(linear(2x)): not an adapter of the projection
            return self.down_proj(F.silu(self.gate_proj(x) + self.lora_b(self.lora_a(x * 2))) * self.up_proj(x))
        if k == "lora_up":
            return self.down_proj(F.silu(self.gate_proj(x)) * (self.up_proj(x) + self.lora_b(self.lora_a(x))))
        raise ValueError(k)


NEAR_MISSES = [
    ("different_x", "must be the same x"),
    ("used_elsewhere", "also used outside the MLP"),
    ("not_gated", "not gated"),
    ("not_gated_x_sigmoid", "not gated"),
    ("weight_computed", "not a graph input"),
    ("sigmoid_glu", "neither factor"),
    ("plus_one", "is not a linear (up projection)"),
    ("lora_gate", "the gate projection has a low-rank adapter added to it"),
    ("lora_up", "the up projection has a low-rank adapter added to it"),
    ("branch_of_another_input", "is not a linear (gate projection)"),
]


@pytest.mark.parametrize("kind,reason", NEAR_MISSES, ids=[k for k, _ in NEAR_MISSES])
def test_near_misses_are_skipped_with_reason(kind, reason):
    class Wrap(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = NearMiss(kind)

        def forward(self, x):
            return self.mlp(x)

    _check_against_eager(Wrap(), torch.randn(2, 5, D))
    assert not _rewrites(), tilecompile.report()
    (s,) = _skips()
    assert reason in s.reason and s.candidate == "down projection mlp.down_proj" and s.module_path == "mlp", s


def test_below_min_tokens_is_skipped():
    _check_against_eager(MLP("silu"), torch.randn(2, 5, D), mlp_min_tokens=11)
    assert not _rewrites()
    (s,) = _skips()
    assert "10 tokens < mlp_min_tokens=11" in s.reason, s
    torch._dynamo.reset()
    _check_against_eager(MLP("silu"), torch.randn(2, 5, D), mlp_min_tokens=10)
    assert len(_rewrites()) == 1


@pytest.mark.parametrize("first, second", [(4, 16), (16, 4)])
def test_min_tokens_under_dynamic_shapes_recompiles_across_the_threshold(first, second):
    """With a symbolic token count the decision is a guard: a call on the other side of mlp_min_tokens recompiles
    (tiled above it, untiled below), instead of keeping the first graph's choice for every length."""
    model = MLP("silu")
    ref = copy.deepcopy(model)
    compiled = _compile(model, dynamic=True, mlp_min_tokens=8)
    tiled = []
    for t in (first, second):
        x = torch.randn(1, t, D)
        assert_close(compiled(x), ref(x), rtol=RTOL, atol=ATOL, name=f"output T={t}")
        tiled.append(len(_rewrites()))
    rep = tilecompile.report()
    assert rep.graphs == 2, rep
    assert tiled == ([0, 1] if first < second else [1, 1]), rep
    assert any("tokens < mlp_min_tokens=8" in s.reason for s in _skips()), rep


def test_pass_off_leaves_graph_alone():
    _check_against_eager(MLP("silu"), torch.randn(2, 5, D), tiled_mlp=False)
    assert not _rewrites() and not _skips()


# ------------------------------------------------------------------------------------------ Hugging Face models


def _hf_model(name: str, checkpointing: bool):
    transformers = pytest.importorskip("transformers")
    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[name]
    cfg = cfg_cls(
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=96,
        max_position_embeddings=64,
    )
    model = model_cls(cfg)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


class _Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids, use_cache=False).logits


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "ckpt"])
@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_hf_models_one_rewrite_per_layer(name, checkpointing):
    model = _hf_model(name, checkpointing)
    ref = copy.deepcopy(model)
    compiled = _compile(model, fused_linear_ce=True)  # the HF model itself, as users compile it
    ids = torch.randint(0, 96, (2, 12))
    out = compiled(input_ids=ids, use_cache=False).logits
    expected = ref(input_ids=ids, use_cache=False).logits
    assert_close(out, expected, rtol=RTOL, atol=ATOL, name="logits")
    out.square().mean().backward()
    expected.square().mean().backward()
    assert_grads_close(model, ref, rtol=RTOL, atol=ATOL)
    paths = sorted(r.module_path for r in _rewrites())
    assert len(paths) == 2 and paths[0].endswith("layers.0.mlp") and paths[1].endswith("layers.1.mlp"), paths
    assert all("activation=silu fused=no" in r.detail for r in _rewrites())


def test_checkpoint_of_a_plain_block():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(D)
            self.mlp = MLP("silu")

        def forward(self, x):
            return x + torch.utils.checkpoint.checkpoint(lambda h: self.mlp(self.norm(h)), x, use_reentrant=False)

    _check_against_eager(Block(), torch.randn(2, 5, D))
    (r,) = _rewrites()
    assert r.module_path.endswith("mlp"), r


@pytest.mark.slow
def test_inductor_cpu():
    # Inductor compiles C++ for every kernel: a two-block residual model keeps that to a few seconds
    model = torch.nn.Sequential(Block("silu"), torch.nn.LayerNorm(D), Block("gelu_tanh"))
    _check_against_eager(model, torch.randn(2, 9, D), inner="inductor", rtol=1e-4, atol=1e-5)
    assert sorted(r.module_path for r in _rewrites()) == ["0.mlp", "2.mlp"], tilecompile.report()


# ------------------------------------------------------------------------------------------------------- GPU


def _err_vs_reference(model, ref, fp32_ref, out, expected, reference):
    """(error of the compiled model, error of eager at the same dtype), each against an fp32 reference."""
    errs = [(rel_err(out, reference), rel_err(expected, reference))]
    fp32 = dict(fp32_ref.named_parameters())
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        errs.append((rel_err(p.grad, fp32[name].grad), rel_err(q.grad, fp32[name].grad)))
    return errs


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["bf16", "autocast"])
def test_gpu_hf_llama(mode):
    fp32_ref = _Logits(_hf_model("llama", checkpointing=False)).cuda()
    model = copy.deepcopy(fp32_ref)
    if mode == "bf16":
        model = model.to(torch.bfloat16)
    ref = copy.deepcopy(model)
    compiled = _compile(model, mlp_chunk_tokens=64)  # 256 tokens: four chunks
    ids = torch.randint(0, 96, (2, 128), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=mode == "autocast"):
        out, expected = compiled(ids), ref(ids)
    reference = fp32_ref(ids)
    for t in (out, expected, reference):
        t.float().square().mean().backward()
    assert out.dtype == expected.dtype == torch.bfloat16
    for ours, eager in _err_vs_reference(model, ref, fp32_ref, out, expected, reference):
        assert ours <= 2 * eager + 2e-3, (ours, eager)
    rewrites = _rewrites()
    assert len(rewrites) == 2 and all(r.dtypes["compute"] == "torch.bfloat16" for r in rewrites), rewrites
