"""Real RL libraries' log-prob / entropy code, unchanged, inside one compiled PPO step of a tiny Hugging Face model:
one fused lm_head call each, and eager's loss and gradients (fp32, relative 1e-5).

- TRL (``trl.trainer.utils``): ``selective_log_softmax`` (a logsumexp per row, stacked) and
  ``entropy_from_logits`` (rows split into chunks, entropy per chunk, cat). On CUDA TRL 1.x takes its own Triton
  kernel; on CPU it runs the torch code tested here.
- OpenRLHF (``openrlhf.models.utils``): ``log_probs_from_logits`` (in-place temperature; without flash_attn, a
  logsumexp of row chunks written into a preallocated buffer) and ``compute_entropy`` (carries its own
  ``@torch.compile``, which Dynamo inlines into the step). ``openrlhf.models`` imports deepspeed, peft and
  flash_attn (CUDA-only); where those are missing, ``models/utils.py`` is loaded from the installed package on its
  own, with a stand-in for deepspeed (used only by ``set_z3_leaf_modules``, not called here).

Both libraries are optional test dependencies: each test skips when its library is not installed.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import pathlib
import sys
import types

import pytest
import torch
from helpers import assert_close, assert_grads_close, compile_options, torch_2_11_form_backend

import tilecompile

transformers = pytest.importorskip("transformers")

VOCAB = 257
TEMPERATURE = 0.9


def tiny_qwen2() -> torch.nn.Module:
    cfg = transformers.Qwen2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(cfg)


def batch(b: int = 2, seq: int = 12):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (b, seq), generator=g)
    mask = torch.ones(b, seq, dtype=torch.long)
    mask[0, -3:] = 0
    old_logp = -torch.rand(b, seq - 1, generator=g) * 5
    advantages = torch.randn(b, generator=g)
    return ids, mask, old_logp, advantages


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum()


def ppo_loss(logp, entropy, mask, old_logp, advantages):
    """PPO's clipped surrogate minus an entropy bonus, masked means over the response tokens."""
    response = mask[:, 1:].float()
    ratio = torch.exp(logp - old_logp)
    pg = torch.maximum(-advantages[:, None] * ratio, -advantages[:, None] * torch.clamp(ratio, 0.8, 1.2))
    return masked_mean(pg, response) - 0.01 * masked_mean(entropy, response)


def compile_and_compare(step, *, graphs: int = 1):
    """The step compiled whole vs eager: one lm_head rewrite with one fused call, eager's loss and gradients."""
    model = tiny_qwen2()
    reference = copy.deepcopy(model)
    inputs = batch()
    with torch.compiler.set_stance("force_eager"):  # eager through any torch.compile inside the library too
        expected = step(reference, *inputs)
    expected.backward()
    actual = torch.compile(step, backend="tilecompile", options=compile_options())(model, *inputs)
    rep = tilecompile.report()
    assert rep.graphs == graphs, rep
    assert rep.counts["fused_linear_ce"] == 1, rep
    (fused,) = [r for r in rep.rewrites if r.pass_name == "fused_linear_ce"]
    assert fused.module_path == "lm_head" and fused.shapes["N/D/V"] == (22, 64, VOCAB), fused
    assert fused.detail.startswith("log-prob, entropy") and "; 1 fused call(s)" in fused.detail, fused.detail
    assert "loss-aware mode" in fused.detail, fused.detail  # the PPO loss takes the lm_head's grads in the forward
    assert f"temperature {TEMPERATURE:g}" in fused.detail, fused.detail
    assert_close(actual, expected, rtol=1e-5, atol=1e-7, name="loss")
    actual.backward()
    assert_grads_close(model, reference, rtol=1e-5, atol=1e-7)
    return fused


# ------------------------------------------------------------------------------------------------------ TRL


@pytest.fixture(scope="module")
def trl_utils():
    return pytest.importorskip("trl.trainer.utils")


@pytest.mark.parametrize("chunk_size", [5, 128])  # 5: five chunks of the 22 rows; 128 (TRL's default): one
def test_trl_selective_log_softmax_and_entropy_from_logits(trl_utils, chunk_size):
    def step(model, ids, mask, old_logp, advantages):
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        logits = logits[:, :-1] / TEMPERATURE
        logp = trl_utils.selective_log_softmax(logits, ids[:, 1:])
        entropy = trl_utils.entropy_from_logits(logits, chunk_size=chunk_size)
        return ppo_loss(logp, entropy, mask, old_logp, advantages)

    fused = compile_and_compare(step)
    assert "rows joined from parts by stack" in fused.detail, fused.detail  # the logsumexp row by row
    assert ("cat" in fused.detail) == (chunk_size < 22), fused.detail  # the entropy chunk by chunk


def test_trl_temperature_argument(trl_utils):
    # selective_log_softmax(..., temperature=t) divides inside; the entropy gets its own logits / t
    def step(model, ids, mask, old_logp, advantages):
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1]
        logp = trl_utils.selective_log_softmax(logits, ids[:, 1:], temperature=TEMPERATURE)
        entropy = trl_utils.entropy_from_logits(logits / TEMPERATURE, chunk_size=8)
        return ppo_loss(logp, entropy, mask, old_logp, advantages)

    compile_and_compare(step)


# ------------------------------------------------------------------------------------------------- OpenRLHF


def _load_openrlhf_utils() -> types.ModuleType:
    try:
        return importlib.import_module("openrlhf.models.utils")
    except ImportError:
        pass
    spec = importlib.util.find_spec("openrlhf")
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / "models" / "utils.py"
    name = "openrlhf_models_utils"  # Dynamo resolves the functions' globals through sys.modules by this name
    if name in sys.modules:
        return sys.modules[name]
    stand_in = None
    if importlib.util.find_spec("deepspeed") is None:
        stand_in = sys.modules.setdefault("deepspeed", types.ModuleType("deepspeed"))
    try:
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        module_spec.loader.exec_module(module)
    finally:
        if stand_in is not None and sys.modules.get("deepspeed") is stand_in:
            del sys.modules["deepspeed"]
    return module


@pytest.fixture(scope="module")
def openrlhf_utils():
    pytest.importorskip("openrlhf")
    return _load_openrlhf_utils()


def openrlhf_step(utils):
    def step(model, ids, mask, old_logp, advantages):
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1]
        logp = utils.log_probs_from_logits(logits, ids[:, 1:], temperature=TEMPERATURE)  # divides logits in place
        entropy = utils.compute_entropy(logits)  # its own @torch.compile: inlined into this graph
        return ppo_loss(logp, entropy, mask, old_logp, advantages)

    return step


@pytest.mark.parametrize("chunk", [1024, 5])  # 1024 (OpenRLHF's default): one chunk of the 22 rows; 5: five
def test_openrlhf_log_probs_from_logits_and_compute_entropy(openrlhf_utils, monkeypatch, chunk):
    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("with flash_attn installed, fp32 log-probs go through flash_attn's Triton cross-entropy")
    monkeypatch.setattr(openrlhf_utils._logsumexp_by_chunk, "__defaults__", (chunk,))
    fused = compile_and_compare(openrlhf_step(openrlhf_utils))
    assert "rows joined from parts by buffer" in fused.detail, fused.detail


def test_openrlhf_without_traced_import_errors_breaks_the_graph(openrlhf_utils):
    """Dynamo's own handling of the failed ``import flash_attn``: a graph break there, so the lm_head and its
    log-probs land in different graphs and nothing is fused (what ``trace_import_errors`` fixes)."""
    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash_attn is installed: the import does not fail")
    step = openrlhf_step(openrlhf_utils)
    model = tiny_qwen2()
    torch.compile(step, backend="tilecompile", options=compile_options(trace_import_errors=False))(model, *batch())
    rep = tilecompile.report()
    assert rep.graphs > 1 and rep.counts["fused_linear_ce"] == 0, rep


# ------------------------------------------------------------------------ TRL's Triton kernel (its CUDA path)


@pytest.fixture
def trl_kernel_path(trl_utils, monkeypatch):
    """TRL's CUDA branch traced on CPU: TRL takes its Triton kernel when ``_supports_trl_loss_kernel`` holds (CUDA
    logits) and Dynamo records the launch only where ``has_triton()`` (a GPU) says Triton works. Patched, the CPU
    graph holds exactly what a CUDA graph holds; the kernel must be fused away, since it cannot run here."""
    if not hasattr(trl_utils, "_fused_logprob_entropy"):
        pytest.skip("this TRL has no Triton log-prob kernel (or triton is missing)")
    import torch.utils._triton as triton_utils

    monkeypatch.setattr(triton_utils, "has_triton", lambda: True)
    monkeypatch.setattr(trl_utils, "_supports_trl_loss_kernel", lambda *args, **kwargs: True)
    return trl_utils


def trl_step(utils, spelling: str, pad_label: int | None = None):
    """``row_mask``: the temperature argument and TRL's row mask (masked rows' labels set to ``pad_label``, which
    TRL's kernel never reads; its torch code gathers them); ``grpo``: TRL's GRPO trainer (``logits /= t``)."""

    def step(model, ids, mask, old_logp, advantages):
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1]
        if spelling == "grpo":
            logits /= TEMPERATURE
            logp = utils.selective_log_softmax(logits, ids[:, 1:])
            entropy = utils.entropy_from_logits(logits)
        else:
            keep = mask[:, 1:].bool()
            labels = ids[:, 1:] if pad_label is None else ids[:, 1:].masked_fill(~keep, pad_label)
            logp = utils.selective_log_softmax(logits, labels, temperature=TEMPERATURE, row_mask=keep)
            entropy = utils.entropy_from_logits(logits / TEMPERATURE)
        return ppo_loss(logp, entropy, mask, old_logp, advantages)

    return step


# torch_2_11: the graph as Dynamo of torch 2.11 records it (the function's forward intermediates as extra results);
# alone: without the attention pass, whose dead-code sweep would otherwise drop those results before the lm_head pass
@pytest.mark.parametrize("form", ["dynamo", "torch_2_11", "torch_2_11_alone"])
@pytest.mark.parametrize("spelling", ["grpo", "row_mask"])
def test_trl_triton_kernel_path_is_fused(trl_utils, trl_kernel_path, spelling, form):
    expected_step = trl_step(trl_utils, spelling)  # the reference: TRL's torch code (eager, unpatched)
    model = tiny_qwen2()
    reference = copy.deepcopy(model)
    inputs = batch()
    with pytest.MonkeyPatch.context() as undo:
        undo.setattr(trl_utils, "_supports_trl_loss_kernel", lambda *args, **kwargs: False)
        expected = expected_step(reference, *inputs)
    expected.backward()
    compiled = trl_step(trl_kernel_path, spelling, pad_label=-100)
    if form == "dynamo":
        actual = torch.compile(compiled, backend="tilecompile", options=compile_options())(model, *inputs)
    else:
        options = {"attention": False} if form == "torch_2_11_alone" else {}
        actual = torch.compile(compiled, backend=torch_2_11_form_backend(**options))(model, *inputs)
    rep = tilecompile.report()
    (fused,) = [r for r in rep.rewrites if r.pass_name == "fused_linear_ce"]
    assert "read from 2 call(s) of TRL's Triton log-prob/entropy kernel" in fused.detail, fused.detail
    assert fused.detail.startswith("log-prob, entropy") and "; 1 fused call(s)" in fused.detail, fused.detail
    assert "loss-aware mode" in fused.detail, fused.detail
    assert_close(actual, expected, rtol=1e-5, atol=1e-7, name="loss")
    actual.backward()
    assert_grads_close(model, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dynamic", [False, True])
def test_trl_triton_kernel_under_no_grad_is_fused(trl_utils, trl_kernel_path, dynamic):
    """Old / reference log-probs: under no_grad Dynamo inlines the kernel's launch into empty buffers (with
    dynamic shapes the launch also reads the logits' symbolic strides; they must go with it, or they count as
    another use of the logits)."""
    weight = torch.randn(VOCAB, 16)

    def old_logprobs(utils):
        def fn(h, ids):
            with torch.no_grad():
                return utils.selective_log_softmax(torch.nn.functional.linear(h, weight), ids, temperature=TEMPERATURE)

        return fn

    g = torch.Generator().manual_seed(0)
    h, ids = torch.randn(2, 7, 16, generator=g), torch.randint(0, VOCAB, (2, 7), generator=g)
    with pytest.MonkeyPatch.context() as undo:
        undo.setattr(trl_utils, "_supports_trl_loss_kernel", lambda *args, **kwargs: False)
        expected = old_logprobs(trl_utils)(h, ids)
    options = compile_options()
    actual = torch.compile(old_logprobs(trl_kernel_path), backend="tilecompile", options=options, dynamic=dynamic)(
        h, ids
    )
    (fused,) = [r for r in tilecompile.report().rewrites if r.pass_name == "fused_linear_ce"]
    assert "read from 1 call(s) of TRL's Triton" in fused.detail and "loss-aware" not in fused.detail, fused.detail
    assert_close(actual, expected, rtol=1e-5, atol=1e-6, name="log-probs")


def test_trl_triton_kernel_left_alone_when_the_logits_escape(trl_kernel_path):
    """The logits are also returned: nothing can be fused, and the kernel (better than the plain math) stays."""
    from tilecompile import config
    from tilecompile.pipeline import run_passes

    def step(model, ids):
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
        return trl_kernel_path.selective_log_softmax(logits, ids[:, 1:]).sum(), logits

    graphs = []

    def inspect(gm, example_inputs):  # the passes only: the graph keeps a Triton launch that cannot run on CPU
        graphs.append(run_passes(gm, config.load(compile_options()), "inspected"))
        outputs = [n.meta["example_value"] for n in gm.graph.output_node().args[0]]
        return lambda *args: [torch.zeros(o.shape, dtype=o.dtype) for o in outputs]

    torch.compile(step, backend=inspect)(tiny_qwen2(), batch()[0])
    rep = tilecompile.report()
    assert rep.counts["fused_linear_ce"] == 0, rep
    (skip,) = [s for s in rep.skipped if s.candidate.startswith("TRL's Triton")]
    assert "left as is" in skip.reason and "returned" in skip.reason, skip.reason
    (gm,) = graphs
    names = [getattr(n.target, "__name__", "") for n in gm.graph.nodes]
    assert "autograd_function_apply" in names and "log_softmax" not in names, names


@pytest.mark.gpu
def test_trl_cuda_kernel_path_inside_a_compiled_step(trl_utils):
    """On CUDA TRL sends its log-prob and entropy to its own Triton kernels; the lm_head pass reads them as their
    math and fuses them (before that, a pass's dead-code elimination once dropped the launch, which Dynamo records
    as a call that returns nothing, and the log-probs were an uninitialised buffer)."""
    model = tiny_qwen2().cuda().bfloat16()
    ids, mask, old_logp, advantages = (t.cuda() for t in batch())

    def step(model, ids, mask, old_logp, advantages):
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1] / TEMPERATURE
        logp = trl_utils.selective_log_softmax(logits, ids[:, 1:])
        entropy = trl_utils.entropy_from_logits(logits)
        return ppo_loss(logp, entropy, mask, old_logp, advantages), logp.detach().float()

    expected, logp_eager = step(model, ids, mask, old_logp, advantages)
    actual, logp = torch.compile(step, backend="tilecompile", options={"strict": True})(
        model, ids, mask, old_logp, advantages
    )
    (fused,) = [r for r in tilecompile.report().rewrites if r.pass_name == "fused_linear_ce"]
    assert "TRL's Triton" in fused.detail, fused.detail
    assert (logp <= 0).all(), logp
    assert_close(logp, logp_eager, rtol=2e-2, atol=5e-2, name="log-probs")
    assert_close(actual.float(), expected.float(), rtol=2e-2, atol=2e-3, name="loss")
