"""A Megatron-Core GPTModel (local spec: RMSNorm, SwiGLU, RoPE) through the backend on CPU (issue 27).

Tiny model (hidden 64, 2 layers, vocab 512, fp32) at tensor-parallel world size 1 over gloo. mcore's linears, its
tensor-parallel region copies and its vocab-parallel cross-entropy are autograd.Functions; the backend reads them
as the math they compute (passes/lm_head/library_kernels.py), so each layer's MLP is tiled and the lm_head fused, on the
logits path (PPO loss on log-probs and entropy) and on the ``labels=`` path (mcore's own per-token CE; a target
outside the vocabulary is a clear error). Loss and every parameter gradient equal eager's (fp32, relative 1e-5).

Megatron-Core's deprecation ``warnings.warn`` in every RowParallelLinear call breaks the graph; the documented
one-liner ``torch._dynamo.config.ignore_logging_functions.add(warnings.warn)`` removes the breaks (tested both ways).
Eager mcore on CPU needs small shims, here only: ``torch.cuda.current_device`` (its buffers and RoPE's inv_freq are
placed there), the default causal mask (made on "cuda") and the CUDA RNG tracker's fork (dropout is 0).
"""

from __future__ import annotations

import contextlib
import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, compile_options, torch_2_11_form_backend

import tilecompile
from tilecompile.passes.lm_head import library_kernels as LK

pytest.importorskip("megatron.core")

import megatron.core.fusions.fused_softmax as fused_softmax  # noqa: E402
import megatron.core.tensor_parallel as mcore_tp  # noqa: E402
import megatron.core.transformer.utils as transformer_utils  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

VOCAB, B, S = 512, 2, 16
RTOL, ATOL = 1e-5, 1e-6


class _NoForkTracker:
    def fork(self, name=None):
        return contextlib.nullcontext()


def _causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


@pytest.fixture(scope="module")
def _tp_world_of_one(tmp_path_factory):
    """gloo world size 1 and mcore's parallel state at TP = PP = 1 (created here, destroyed after the module)."""
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        store = tmp_path_factory.mktemp("gloo") / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    if dist.get_world_size() != 1:
        pytest.skip("needs a world of one process")
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    if created:
        dist.destroy_process_group()


@pytest.fixture
def mcore_cpu(monkeypatch, _tp_world_of_one):
    """The CPU shims eager mcore needs, and the one-liner that keeps its deprecation warnings out of the graph."""
    # Dynamo's table of torch functions is built from their names (init_process_group clears it): built before the
    # patch, it does not hold the shim, which is then traced as the plain function it is
    torch._dynamo.trace_rules.get_torch_obj_rule_map()
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    monkeypatch.setattr(transformer_utils, "get_default_causal_mask", _causal_mask)
    monkeypatch.setattr(fused_softmax, "get_default_causal_mask", _causal_mask)
    monkeypatch.setattr(mcore_tp, "get_cuda_rng_tracker", lambda *a, **k: _NoForkTracker())
    with torch._dynamo.config.patch(ignore_logging_functions={warnings.warn}):
        yield


def gpt_model() -> GPTModel:
    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, gated_linear_unit=True,
        activation_func=F.silu, normalization="RMSNorm", add_bias_linear=False, use_cpu_initialization=True,
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=64, position_embedding_type="rope")


def make_batch() -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    labels = torch.roll(ids, -1, dims=1)
    return {
        "ids": ids,
        "pos": torch.arange(S)[None].expand(B, S),
        "labels": labels,
        "mask": (torch.rand(B, S, generator=g) > 0.2).float(),
        "old": -torch.rand(B, S, generator=g) * 3 - 3,
        "adv": torch.randn(B, generator=g),
    }


def ppo_step(model, batch):
    """Log-probs and entropy from the logits, GRPO-style clipping (torch.min), masked token mean."""
    logits = model(batch["ids"], batch["pos"], None).float()
    logp = torch.gather(logits.log_softmax(-1), -1, batch["ids"][..., None]).squeeze(-1)
    entropy = torch.logsumexp(logits, -1) - (logits.softmax(-1) * logits).sum(-1)
    ratio = torch.exp(logp - batch["old"])
    adv = batch["adv"][:, None]
    pg = -torch.min(ratio * adv, torch.clamp(ratio, 0.8, 1.28) * adv)
    mask = batch["mask"]
    return ((pg - 0.01 * entropy) * mask).sum() / mask.sum()


def labels_step(model, batch):
    """mcore's own per-token cross-entropy (``labels=``), masked mean."""
    per_token = model(batch["ids"], batch["pos"], None, labels=batch["labels"])
    return (per_token * batch["mask"]).sum() / batch["mask"].sum()


def _twins() -> tuple[GPTModel, GPTModel]:
    """Two models with the same weights (mcore's modules hold process groups: no deepcopy)."""
    model, reference = gpt_model(), gpt_model()
    reference.load_state_dict(model.state_dict())
    return model, reference


def _against_eager(step, form: str = "dynamo", **options) -> tilecompile.reporting.Report:
    """``form="torch_2_11"``: the graph as Dynamo of torch 2.11 records it (``helpers.as_torch_2_11``)."""
    model, reference = _twins()
    batch = make_batch()
    expected = step(reference, batch)
    expected.backward()
    if form == "dynamo":
        backend = {"backend": "tilecompile", "options": compile_options(**options)}
    else:
        backend = {"backend": torch_2_11_form_backend(**options)}
    actual = torch.compile(step, **backend)(model, batch)
    actual.backward()
    assert_close(actual, expected, rtol=RTOL, atol=ATOL, name="loss")
    ref = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None and ref[name].grad is not None, name
        assert_close(p.grad, ref[name].grad, rtol=RTOL, atol=ATOL, name=f"grad of {name}")
    return tilecompile.report()


def _fused(rep) -> list:
    return [r for r in rep.rewrites if r.pass_name == "fused_linear_ce"]


@pytest.mark.parametrize("form", ["dynamo", "torch_2_11"])
@pytest.mark.parametrize("step", [ppo_step, labels_step], ids=["logits_ppo", "labels"])
def test_gpt_model_step_is_rewritten_and_equals_eager(mcore_cpu, step, form):
    rep = _against_eager(step, form)
    assert rep.graphs == 1, rep
    mlps = sorted(r.module_path for r in rep.rewrites if r.pass_name == "tiled_mlp")
    assert mlps == ["decoder.layers.0.mlp", "decoder.layers.1.mlp"], rep
    (fused,) = _fused(rep)
    assert fused.module_path == "output_layer" and "loss-aware mode" in fused.detail, rep
    if step is labels_step:
        assert "Megatron-Core's vocab-parallel cross-entropy" in fused.detail, fused
    linears = [r for r in rep.rewrites if r.pass_name == "canonical"]
    assert len(linears) == 9 and all("LinearWithGradAccumulationAndAsyncCommunication" in r.detail for r in linears)
    assert not rep.failures, rep


def test_cross_entropy_over_more_than_one_rank_is_refused_with_a_reason(mcore_cpu, monkeypatch):
    """A tensor-parallel group of two (the logits a vocabulary shard): mcore's CE is kept, with the reason."""
    monkeypatch.setattr(LK, "_group_size", lambda name: 2)
    rep = _against_eager(labels_step)
    assert not _fused(rep), rep
    reasons = [s.reason for s in rep.skipped if s.pass_name == "canonical"]
    assert any("tensor-parallel group of 2 ranks" in r for r in reasons), rep
    assert rep.counts["tiled_mlp"] == 2, rep


def test_linear_whose_backward_all_reduces_stays_correct(mcore_cpu):
    """ColumnParallelLinear at TP > 1 all-reduces its input gradient in its own backward (``async_op=True``), forced on
    here at TP 1 (over one rank: the identity, so eager's values are the model's). Dynamo cannot trace that
    collective and runs the whole function outside the graphs (a break at each one): the passes never see the
    output layer, nothing is fused, and the step equals eager."""
    model, reference = _twins()
    model.output_layer.allreduce_dgrad = reference.output_layer.allreduce_dgrad = True
    batch = make_batch()
    expected = ppo_step(reference, batch)
    actual = torch.compile(ppo_step, backend="tilecompile", options=compile_options())(model, batch)
    assert_close(actual, expected, rtol=RTOL, atol=ATOL, name="loss")
    actual.backward()
    expected.backward()
    ref = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert_close(p.grad, ref[name].grad, rtol=RTOL, atol=ATOL, name=f"grad of {name}")
    rep = tilecompile.report()
    assert rep.graphs > 1 and not _fused(rep), rep
    assert not any(r.module_path == "output_layer" for r in rep.rewrites), rep
    assert rep.counts["tiled_mlp"] == 2, rep


def test_deprecation_warnings_break_the_graph_without_the_one_liner(mcore_cpu):
    model, batch = gpt_model(), make_batch()
    with torch._dynamo.config.patch(ignore_logging_functions=set()):
        torch.compile(labels_step, backend="tilecompile", options=compile_options())(model, batch)
    assert tilecompile.report().graphs > 1


def test_target_outside_the_vocabulary_is_an_error_not_another_value(mcore_cpu):
    """mcore returns lse − max z for such a target (bad input at TP 1); the fused op says so instead (CPU: always)."""
    from tilecompile.ops.fused_linear_ce import LabelOutOfRange

    model, batch = gpt_model(), make_batch()
    batch["labels"][1, 3] = VOCAB + 5
    with pytest.raises((LabelOutOfRange, RuntimeError, IndexError), match="out of range"):
        torch.compile(labels_step, backend="tilecompile", options=compile_options())(model, batch)


def test_example_runs_on_cpu():
    """examples/megatron_gpt.py as a user runs it: 3 SGD steps equal eager's, one graph, every rewrite."""
    from test_examples import counts, run_example

    out = run_example("megatron_gpt.py", "--labels", timeout=600)
    c = counts(out.stdout)
    assert (c["fused_linear_ce"], c["tiled_mlp"], c["canonical"]) == (1, 2, 9), out.stdout
    assert "1 graph(s) compiled" in out.stdout, out.stdout
    steps = [line.split() for line in out.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 3 and all(s[3] == s[5] for s in steps), out.stdout  # eager's loss to the printed digits


def test_cross_entropy_of_logits_from_outside_the_graph_gets_a_reason(mcore_cpu):
    """No linear in the graph to fuse it with: mcore's CE stays as it is, and the report says why."""
    z = torch.randn(8, 2, 32, requires_grad=True)
    z_ref = z.detach().clone().requires_grad_()
    t = torch.randint(0, 32, (8, 2))

    def loss(z, t):
        return mcore_tp.vocab_parallel_cross_entropy(z, t).mean()

    actual = torch.compile(loss, backend="tilecompile", options=compile_options())(z, t)
    expected = loss(z_ref, t)
    actual.backward()
    expected.backward()
    assert_close(actual, expected, rtol=RTOL, atol=ATOL, name="loss")
    assert_close(z.grad, z_ref.grad, rtol=RTOL, atol=ATOL, name="grad of z")
    (skip,) = tilecompile.report().skipped
    assert "_VocabParallelCrossEntropy not fused: its logits come from no linear" in skip.reason, skip


def _tp2_rank(rank: int, store: str, out: str) -> None:
    """One rank of a tensor-parallel group of two: the labels= step compiled against the same model in eager."""
    import torch.distributed as dist

    os.environ["TILECOMPILE_STRICT"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    parallel_state.initialize_model_parallel(2, 1)
    torch._dynamo.trace_rules.get_torch_obj_rule_map()  # before the patch (init_process_group clears it)
    torch.cuda.current_device = lambda: "cpu"
    transformer_utils.get_default_causal_mask = fused_softmax.get_default_causal_mask = _causal_mask
    mcore_tp.get_cuda_rng_tracker = lambda *a, **k: _NoForkTracker()
    torch._dynamo.config.ignore_logging_functions.add(warnings.warn)
    try:
        rep = _against_eager(labels_step)
        with open(f"{out}.{rank}", "w") as f:
            f.write("\n".join([f"graphs {rep.graphs}", *(f"{k} {v}" for k, v in rep.counts.items())]))
            f.write("".join(f"\nskip {s.pass_name}: {s.reason}" for s in rep.skipped))
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.distributed
def test_tensor_parallel_two_ranks_stays_correct_and_says_why_nothing_is_fused(tmp_path):
    """TP = 2 over gloo: Dynamo runs each ColumnParallelLinear outside the graphs (its backward's async all-reduce),
    the vocab-parallel CE over two ranks is refused with its reason, and on each rank the loss and every gradient of
    its shards equal eager's."""
    torch.multiprocessing.spawn(_tp2_rank, args=(str(tmp_path / "store"), str(tmp_path / "rep")), nprocs=2, join=True)
    for rank in range(2):
        lines = (tmp_path / f"rep.{rank}").read_text().splitlines()
        assert "fused_linear_ce 0" in lines and int(lines[0].split()[1]) > 1, lines
        assert any("tensor-parallel group of 2 ranks" in x for x in lines if x.startswith("skip canonical")), lines
