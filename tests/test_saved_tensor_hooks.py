"""Saved-tensors hooks (activation offloading, as verl and torchtune build it) act at run time only.

The passes fake-run the nodes they insert; a user's pack hook must not see those fake tensors (it would fail on
their data pointers, and the pass would be undone). At run time the hooks see what the rewritten graph saves: less
than the unrewritten graph, which is the memory saving the passes exist for.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_close, assert_grads_close, compile_options, no_fallback

import tilecompile

transformers = pytest.importorskip("transformers")


class Offload:
    """Pack hook that moves every saved tensor to a CPU copy (reading its storage pointer, as dedup code does)."""

    def __init__(self) -> None:
        self.bytes = 0

    def pack(self, t: torch.Tensor):
        t.untyped_storage().data_ptr()
        self.bytes += t.numel() * t.element_size()
        return t.device, t.to("cpu", copy=True)

    def unpack(self, packed):
        device, t = packed
        return t.to(device)

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def _model():
    torch.manual_seed(0)
    sizes = dict(vocab_size=97, hidden_size=32, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
    cfg = transformers.LlamaConfig(**sizes, num_key_value_heads=2, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg).train()


def _step(model, ids):
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return -logp.mean()


def test_offloading_hooks_see_only_run_time_tensors_and_the_step_is_fully_rewritten():
    model = _model()
    reference = copy.deepcopy(model)
    baseline = copy.deepcopy(model)
    ids = torch.randint(0, 97, (2, 64))
    ours, plain = Offload(), Offload()
    compiled = torch.compile(_step, backend="tilecompile", options=compile_options())
    with ours.hooks():
        loss = compiled(model, ids)
    loss.backward()
    counts = tilecompile.report().counts
    assert not tilecompile.report().failures, tilecompile.report().failures
    assert (counts["attention"], counts["fused_linear_ce"], counts["tiled_mlp"]) == (2, 1, 2), counts

    expected = _step(reference, ids)
    expected.backward()
    assert_close(loss, expected, rtol=1e-6, atol=1e-6, name="loss")
    assert_grads_close(model, reference, rtol=1e-5, atol=1e-7)

    torch._dynamo.reset()
    off = compile_options(attention=False, fused_linear_ce=False, tiled_mlp=False)
    with plain.hooks():
        torch.compile(_step, backend="tilecompile", options=off)(baseline, ids).backward()
    # the unrewritten graph saves the [N, V] logits' softmax and each MLP's [N, I] intermediates
    n, vocab, inter = ids.numel() - ids.shape[0], 97, 96
    assert ours.bytes > 0
    assert plain.bytes - ours.bytes >= 4 * (n * vocab + 2 * ids.numel() * inter), (plain.bytes, ours.bytes)


# The loss-aware lm_head op forms its per-token gradient with autograd inside its own forward, at run time.


def _lm_head_loss(ids, mask):
    def loss(h, w):
        logp = torch.gather(torch.log_softmax(torch.nn.functional.linear(h, w).float(), -1), -1, ids[..., None])
        return -(logp.squeeze(-1) * mask).sum() / mask.sum()

    return loss


def _inputs():
    g = torch.Generator().manual_seed(0)
    b, t, d, v = 2, 5, 8, 11
    return torch.randn(b, t, d, generator=g), torch.randn(v, d, generator=g), torch.randint(0, v, (b, t), generator=g)


# the op's per-token gradient by eager autograd, or compiled (torch.func.grad under torch.compile): either way the
# user's hooks see none of it and stay enabled (Dynamo tracing torch.func.grad under hooks once left them disabled
# for the thread, and the user's next save_on_cpu raised)
GRAD_COMPILE = pytest.mark.parametrize("grad_compile", ["off", "aot_eager"])


@pytest.fixture(autouse=True)
def _fresh_compiled_gradients():
    """Each test's first call compiles the op's gradient anew (where it runs: under the test's hooks)."""
    from tilecompile.ops import fused_linear_ce as O

    O._COMPILED.clear()
    yield


def _hooks_enabled() -> bool:
    return torch._C._autograd._saved_tensors_hooks_is_enabled()


@GRAD_COMPILE
def test_loss_aware_op_keeps_its_own_autograd_out_of_user_hooks(grad_compile):
    """No unpack during the forward: the op's inner autograd does not go through the user's hooks."""
    h0, w0, ids = _inputs()
    body = _lm_head_loss(ids, torch.ones(ids.shape))
    compiled = torch.compile(body, backend="tilecompile", options=compile_options(ce_loss_grad_compile=grad_compile))
    compiled(h0.clone().requires_grad_(), w0.clone().requires_grad_())  # compile outside the hooks
    assert "loss-aware mode" in tilecompile.report().rewrites[0].detail
    seen = {"phase": "forward", "forward unpacks": 0}

    def unpack(t):
        seen["forward unpacks"] += seen["phase"] == "forward"
        return t

    with no_fallback(), torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
        loss = compiled(h0.clone().requires_grad_(), w0.clone().requires_grad_())
    seen["phase"] = "backward"
    loss.backward()
    assert seen["forward unpacks"] == 0 and _hooks_enabled()


@GRAD_COMPILE
def test_offloading_across_steps(grad_compile):
    """Activation offloading around each step's forward, the first call (and the gradient's compile) inside it."""
    h0, w0, ids = _inputs()
    body = _lm_head_loss(ids, (torch.arange(ids.numel()).reshape(ids.shape) % 4 > 0).float())
    compiled = torch.compile(body, backend="tilecompile", options=compile_options(ce_loss_grad_compile=grad_compile))
    for step in range(3):
        results = []
        for fn in (body, compiled):
            h, w = (h0 * (1 + step)).requires_grad_(), w0.clone().requires_grad_()
            with no_fallback(), torch.autograd.graph.save_on_cpu():
                loss = fn(h, w)
            loss.backward()
            results.append((loss, h.grad, w.grad))
            assert _hooks_enabled(), f"step {step}: saved-tensors hooks left disabled"
        for a, e, name in zip(*reversed(results), ("loss", "grad of h", "grad of W")):
            assert_close(a, e, rtol=1e-5, atol=1e-6, name=f"step {step} {name}")
    assert "loss-aware mode" in tilecompile.report().rewrites[0].detail


@GRAD_COMPILE
def test_selective_checkpoint_around_a_compiled_loss(grad_compile):
    """A user's selective activation checkpoint (its hooks and policy) around the compiled loss: the op's inner
    autograd once unpacked through the checkpoint's hooks mid-forward ("not found in storage")."""
    import functools

    from torch.utils import checkpoint as C

    h0, w0, ids = _inputs()
    body = _lm_head_loss(ids, (torch.arange(ids.numel()).reshape(ids.shape) % 3 > 0).float())

    def policy(ctx, op, *args, **kwargs):
        return C.CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.mm.default else C.CheckpointPolicy.PREFER_RECOMPUTE

    def run(fn):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        context = functools.partial(C.create_selective_checkpoint_contexts, policy)
        loss = C.checkpoint(fn, h * 1.0, w, use_reentrant=False, context_fn=context)
        loss.backward()
        return loss, h.grad, w.grad

    expected = run(body)
    with no_fallback():
        actual = run(
            torch.compile(body, backend="tilecompile", options=compile_options(ce_loss_grad_compile=grad_compile))
        )
    assert "loss-aware mode" in tilecompile.report().rewrites[0].detail and _hooks_enabled()
    for a, e, name in zip(actual, expected, ("loss", "grad of h", "grad of W")):
        assert_close(a, e, rtol=1e-5, atol=1e-6, name=name)


@GRAD_COMPILE
def test_compile_with_saved_tensors_hooks_disabled(grad_compile):
    h0, w0, ids = _inputs()
    body = _lm_head_loss(ids, torch.ones(ids.shape))
    h = h0.clone().requires_grad_()
    options = compile_options(ce_loss_grad_compile=grad_compile)
    with no_fallback(), torch.autograd.graph.disable_saved_tensors_hooks("this region saves nothing through hooks"):
        loss = torch.compile(body, backend="tilecompile", options=options)(h, w0)
        assert not _hooks_enabled()  # still disabled: the op put the state back as it found it
    assert _hooks_enabled()
    assert_close(loss, body(h0, w0), rtol=1e-5, atol=1e-6, name="loss")
