"""Canonical views: the same math in different spellings looks the same to a pass."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from tilecompile import graph as G


def capture(fn, *args) -> fx.GraphModule:
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    assert len(graphs) == 1
    return graphs[0]


def nodes_with(gm, predicate):
    return [n for n in gm.graph.nodes if predicate(n)]


W = torch.randn(6, 4)
B = torch.randn(6)
X = torch.randn(3, 5, 4)

LINEARS = {
    "F.linear": lambda x, w: F.linear(x, w),
    "torch._C._nn.linear": lambda x, w: torch._C._nn.linear(x, w),
    "x @ w.t()": lambda x, w: x @ w.t(),
    "x @ w.T": lambda x, w: x @ w.T,
    "matmul(x, w.T)": lambda x, w: torch.matmul(x, w.T),
    "x @ w.transpose(0, 1)": lambda x, w: x @ w.transpose(0, 1),
    "x @ w.permute(1, 0)": lambda x, w: x @ w.permute(1, 0),
    "nn.Linear": None,
}


@pytest.mark.parametrize("spelling", list(LINEARS))
def test_linear_spellings(spelling):
    if spelling == "nn.Linear":
        lin = torch.nn.Linear(4, 6)
        gm = capture(lambda x: lin(x), X)
    else:
        gm = capture(LINEARS[spelling], X, W)
    views = [v for v in map(G.as_linear, gm.graph.nodes) if v is not None]
    assert len(views) == 1, gm.code
    v = views[0]
    assert v.input.op == "placeholder" and v.weight.op in ("placeholder", "get_attr")
    assert G.shape(v.weight) == (6, 4)
    assert (v.bias is not None) == (spelling == "nn.Linear")


def test_matmul_without_transposed_weight_is_not_a_linear():
    gm = capture(lambda x, w: x @ w, X, W.t().contiguous())
    assert all(G.as_linear(n) is None for n in gm.graph.nodes)


class SiLUModule(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.act = torch.nn.SiLU()

    def forward(self, x):
        return self.act(x)


ACTIVATIONS = {
    "F.silu": (lambda x: F.silu(x), "silu"),
    "nn.SiLU": (SiLUModule(), "silu"),
    "x*sigmoid(x)": (lambda x: x * torch.sigmoid(x), "silu"),
    "sigmoid(x)*x": (lambda x: torch.sigmoid(x) * x, "silu"),
    "x*x.sigmoid()": (lambda x: x * x.sigmoid(), "silu"),
    "F.gelu": (lambda x: F.gelu(x), "gelu"),
    "F.gelu tanh": (lambda x: F.gelu(x, approximate="tanh"), "gelu_tanh"),
    "F.relu": (lambda x: F.relu(x), "relu"),
    "x.relu()": (lambda x: x.relu(), "relu"),
}


@pytest.mark.parametrize("spelling", list(ACTIVATIONS))
def test_activation_spellings(spelling):
    fn, kind = ACTIVATIONS[spelling]
    gm = capture(fn, X)
    acts = [a for a in map(G.as_activation, gm.graph.nodes) if a is not None]
    assert [a.kind for a in acts] == [kind], gm.code
    assert acts[0].input.op == "placeholder"


def test_sigmoid_of_other_tensor_is_not_silu():
    gm = capture(lambda x, y: x * torch.sigmoid(y), X, X.clone())
    assert all(G.as_activation(n) is None for n in gm.graph.nodes)


@pytest.mark.parametrize(
    "fn",
    [lambda x, y: x.float(), lambda x, y: x.to(torch.float32), lambda x, y: x.type_as(y), lambda x, y: x.to(y.dtype)],
    ids=["float", "to_dtype", "type_as", "to_dtype_of"],
)
def test_cast_spellings(fn):
    gm = capture(lambda x, y: fn(x, y) * 2, X.half(), X)
    casts = nodes_with(gm, lambda n: G.cast_target(n) is not None)
    assert len(casts) == 1 and G.cast_target(casts[0]) == torch.float32
    mul = nodes_with(gm, lambda n: G.op(n) == "mul")[0]
    assert G.strip_casts(mul.args[0]).op == "placeholder"


def test_to_device_is_not_a_cast():
    gm = capture(lambda x: x.to("cpu") * 2, X)
    assert not nodes_with(gm, lambda n: G.cast_target(n) is not None)


SOFTMAX_OPS = {
    "F.softmax": (lambda z: F.softmax(z, dim=-1), "softmax"),
    "torch.softmax": (lambda z: torch.softmax(z, -1), "softmax"),
    "z.softmax": (lambda z: z.softmax(-1), "softmax"),
    "F.log_softmax": (lambda z: F.log_softmax(z, dim=-1), "log_softmax"),
    "z.log_softmax": (lambda z: z.log_softmax(dim=-1), "log_softmax"),
    "torch.logsumexp": (lambda z: torch.logsumexp(z, dim=-1), "logsumexp"),
    "z.logsumexp": (lambda z: z.logsumexp(-1), "logsumexp"),
}


@pytest.mark.parametrize("spelling", list(SOFTMAX_OPS))
def test_softmax_family(spelling):
    fn, name = SOFTMAX_OPS[spelling]
    gm = capture(fn, X)
    found = nodes_with(gm, lambda n: G.op(n) == name)
    assert len(found) == 1, gm.code
    assert G.normalize_dim(G.arg(found[0], 1, "dim"), 3) == 2


@pytest.mark.parametrize(
    "fn", [lambda z, y: z.gather(-1, y), lambda z, y: torch.gather(z, -1, y)], ids=["method", "function"]
)
def test_gather_spellings(fn):
    gm = capture(fn, X, torch.zeros(3, 5, 1, dtype=torch.long))
    (g,) = nodes_with(gm, lambda n: G.op(n) == "gather")
    assert G.arg(g, 0, "input").op == "placeholder" and G.arg(g, 1, "dim") == -1


def test_view_like_and_graph_input():
    gm = capture(lambda x: x.view(15, 4).unsqueeze(0).reshape(15, 4).float() + 1, X)
    add = nodes_with(gm, lambda n: G.op(n) == "add")[0]
    assert G.graph_input(add.args[0]).op == "placeholder"
    assert G.graph_input(add) is None


def test_module_path():
    class Inner(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.proj(x)

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Inner(), Inner()])

        def forward(self, x):
            return self.layers[1](self.layers[0](x))

    gm = capture(Outer(), X)
    paths = [G.module_path(n) for n in gm.graph.nodes if G.as_linear(n) is not None]
    assert paths == ["layers.0.proj", "layers.1.proj"]
    assert G.clean_path("L['self']._modules['model']._modules['layers']['3'].mlp") == "model.layers.3.mlp"
    # Hugging Face 5.x wraps forward in a *args decorator: the root is L['args'][0]
    assert G.clean_path("L['args'][0].model.layers[1].mlp") == "model.layers.1.mlp"
    # PEFT's PeftModel and LoraModel reach their submodules through __dict__['_modules']
    peft = "L['m'].__dict__['_modules']['base_model'].__dict__['_modules']['model']._modules['model']"
    assert G.clean_path(peft + "._modules['layers']._modules['1'].mlp") == "base_model.model.model.layers.1.mlp"


def test_module_path_of_a_module_reached_through_a_global():
    """transformers >= 5.25 wraps functions such as apply_rotary_pos_emb in modules reached through a global: the
    node belongs to the innermost module of the model's own tree (what a layer's common path is made from)."""
    gm = capture(torch.nn.Linear(4, 4), X)
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    node.meta["nn_module_stack"] = {
        "a": ("L['model'].model.layers.0", torch.nn.Module),
        "b": ("L['model'].model.layers.0.self_attn", torch.nn.Module),
        "c": ("G['__import_transformers_dot_models_dot_qwen2'].apply_rotary_pos_emb", torch.nn.Module),
    }
    assert G.module_path(node) == "model.layers.0.self_attn"
    node.meta["nn_module_stack"] = {  # a model that is itself a global: its own tree, not the wrapper's
        "a": ("G['model'].model.layers[1]", torch.nn.Module),
        "c": ("G['__import_transformers_dot_models_dot_qwen2'].apply_rotary_pos_emb", torch.nn.Module),
    }
    assert G.module_path(node) == G.clean_path("G['model'].model.layers[1]")
    node.meta["nn_module_stack"] = {"c": ("G['helpers'].rope", torch.nn.Module)}
    assert G.module_path(node) == G.clean_path("G['helpers'].rope")  # the only module: its path, as before


def test_dead_code_elimination_keeps_calls_made_for_their_side_effects():
    """A user's Triton kernel is a call that returns nothing and writes into its arguments (Dynamo's
    ``triton_kernel_wrapper_mutation``); FX's own DCE drops it, leaving the output buffer uninitialised."""
    from torch._higher_order_ops.triton_kernel_wrap import triton_kernel_wrapper_mutation

    g = fx.Graph()
    x = g.placeholder("x")
    out = g.call_function(torch.empty_like, (x,))
    kwargs = {"in_ptr": x, "out_ptr": out}
    kernel = g.call_function(
        triton_kernel_wrapper_mutation,
        (),
        {"kernel_idx": 0, "constant_args_idx": 0, "grid": [(1, 1, 1)], "tma_descriptor_metadata": {}, "kwargs": kwargs},
    )
    unused = g.call_function(torch.neg, (x,))
    g.output(out)
    # inside the body of a higher-order op (TRL's kernel sits in its autograd.Function's forward): FX's DCE of the
    # outer graph cleans such bodies too, without the side-effect check
    outer = fx.Graph()
    y = outer.placeholder("y")
    outer.get_attr("body")
    dead = outer.call_function(torch.neg, (y,))
    outer.output(y)
    root = torch.nn.Module()
    root.body = fx.GraphModule(torch.nn.Module(), g)
    fx.GraphModule(root, outer)
    G.eliminate_dead_code(outer)
    assert dead not in list(outer.nodes)
    assert kernel in list(g.nodes) and unused in list(g.nodes)  # the body is the pass's own business
    G.eliminate_dead_code(g)
    nodes = list(g.nodes)
    assert kernel in nodes and unused not in nodes


def test_hint_of_a_symbolic_size_on_either_torch(monkeypatch):
    """``G.hint`` reads a symbolic size's hint through torch 2.13's ``optimization_hint``, or torch 2.11's
    ``hint_int``, whose FutureWarning on every call is kept from the user."""
    import warnings

    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental import symbolic_shapes as S

    env = S.ShapeEnv()
    s = env.create_symintnode(env.create_symbol(7, ConstantSource("s"), dynamic_dim=S.DimDynamic.DYNAMIC), hint=7)
    assert (G.hint(3), G.hint(s), G.hint(2 * s + 1)) == (3, 7, 15)

    def old_hint_int(size):
        warnings.warn("used size_hint instead of hint_int", FutureWarning, stacklevel=2)
        return 7 if size is s else -1

    monkeypatch.delattr(S, "optimization_hint", raising=False)
    monkeypatch.setattr(S, "hint_int", old_hint_int, raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert G.hint(s) == 7
