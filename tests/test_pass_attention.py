"""The attention pass: HF models' [N, N] masks become is_causal / masked attention; outputs and grads equal eager.

Tiny HF Llama, Qwen2, Qwen3 and Mistral models, with and without activation checkpointing, over four inputs: no
mask, a padding mask (left and right), packed documents through ``position_ids``, and a sliding window. Each
compares the loss and every parameter gradient with eager, asserts the report's rewrites, and (for the long
cases) that no tensor of N² elements is ever created while the compiled step runs.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, assert_grads_close, compile_options
from torch.utils._python_dispatch import TorchDispatchMode

import tilecompile
import tilecompile.ops.attention  # noqa: F401
from tilecompile.kernels import attention as K

transformers = pytest.importorskip("transformers")

_TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, attn_implementation="sdpa")  # fmt: skip


def make_model(family: str, window: int | None = None, checkpointing: bool = False):
    torch.manual_seed(0)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_TINY))
    elif family == "qwen2":
        extra = dict(use_sliding_window=True, sliding_window=window, max_window_layers=0) if window else {}
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**_TINY, **extra))
    elif family == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**_TINY, head_dim=8))
    elif family == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**_TINY, sliding_window=window))
    else:
        raise ValueError(family)
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def packed_positions(lengths: list[int], batch: int) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0).expand(batch, -1).contiguous()


def padding_mask(batch: int, n: int) -> torch.Tensor:
    mask = torch.ones(batch, n, dtype=torch.long)
    mask[0, :3] = 0  # left padding
    if batch > 1:
        mask[1, n - 4 :] = 0  # right padding
    return mask


def step(model, ids, **kwargs):
    logits = model(input_ids=ids, use_cache=False, **kwargs).logits.float()
    logp = F.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    weights = torch.arange(logp.shape[-1], dtype=logp.dtype) % 3 + 0.5  # (linspace would specialise N)
    return -(logp * weights).mean() + 0.1 * logits.pow(2).mean()


def compare(model, ids, options=None, tol=(1e-5, 1e-4), **kwargs):
    """Loss and grads of the compiled step as eager's: ``tol`` = (loss, grads) relative tolerances."""
    reference = copy.deepcopy(model)
    compiled = torch.compile(step, backend="tilecompile", options=compile_options(**(options or {})))
    loss = compiled(model, ids, **kwargs)
    loss.backward()
    expected = step(reference, ids, **kwargs)
    expected.backward()
    assert_close(loss, expected, rtol=tol[0], atol=tol[0] / 10, name="loss")
    assert_grads_close(model, reference, rtol=tol[1], atol=1e-6 if tol[1] <= 1e-4 else tol[1])
    return tilecompile.report()


def _details(report) -> list[str]:
    return [r.detail for r in report.rewrites if r.pass_name == "attention"]


CASES = {
    "none": (dict(), "is_causal=True"),
    "padding": (dict(attention_mask=padding_mask(2, 24)), "key valid in"),
    "packed": (dict(position_ids=packed_positions([7, 11, 6], 2)), "same"),
}


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("case", list(CASES))
def test_hf_models_match_eager(family, case, checkpointing):
    kwargs, detail = CASES[case]
    model = make_model(family, checkpointing=checkpointing)
    ids = torch.randint(0, 97, (2, 24))
    report = compare(model, ids, **kwargs)
    details = _details(report)
    assert report.counts["attention"] == 2, (report.counts, report.skipped)
    assert all(detail in d for d in details), details
    # HF repeats k, v per query head (repeat_kv) whenever SDPA gets a mask: attention takes the 2 key heads
    assert all("GQA 4/2 heads, repeat_kv read through" in d for d in details), details
    assert not [s for s in report.skipped if s.pass_name == "attention"]


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_sliding_window_matches_eager(family, checkpointing):
    model = make_model(family, window=5, checkpointing=checkpointing)
    ids = torch.randint(0, 97, (2, 24))
    report = compare(model, ids)
    assert report.counts["attention"] == 2, (report.counts, report.skipped)
    assert all("0 <= Δindex <= 4" in d for d in _details(report)), _details(report)


def test_flag_off_leaves_the_mask():
    model = make_model("qwen2")
    report = compare(model, torch.randint(0, 97, (2, 24)), options={"attention": False})
    assert report.counts["attention"] == 0


class _LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op returns while active."""

    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0
        self.where = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))  # the mode is off inside: a higher-order op's body is not watched
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() > self.largest:
                self.largest, self.where = t.numel(), str(func)
        return out


@pytest.mark.parametrize("case", ["none", "padding", "packed"])
def test_no_quadratic_tensor_at_run_time(case):
    """At N = 2048 an [N, N] mask has 4M elements; no op of the compiled step (forward or backward) returns a
    tensor of even an eighth of that. The mode watches the compiled graphs' ops as they run (entered around the
    compiled callable and the backward, so Dynamo's guards see no mode); ops inside the custom ops are not seen
    one by one, and their blocks are bounded by ``CHUNK_BUDGET_BYTES`` (kernels/attention_reference.py)."""
    from tilecompile.backend import tilecompile_backend

    n = 2048
    kwargs = {
        "none": {},
        "padding": {"attention_mask": padding_mask(1, n)},
        "packed": {"position_ids": packed_positions([700, 1000, 348], 1)},
    }[case]
    mode = _LargestTensor()

    def watched(gm, example_inputs):
        compiled = tilecompile_backend(gm, example_inputs, options=compile_options(mlp_min_tokens=0))

        def run(*args):
            with mode:
                return compiled(*args)

        return run

    model = make_model("qwen2", checkpointing=True)
    ids = torch.randint(0, 97, (1, n))
    loss = torch.compile(step, backend=watched)(model, ids, **kwargs)
    with mode:
        loss.backward()
    assert tilecompile.report().counts["attention"] == 2
    assert mode.largest > 0
    # the logits [N, V] (2048 * 97) are the largest legitimate tensors
    assert mode.largest < n * n // 8, (mode.largest, mode.where)


def test_dynamic_shapes_one_compile_serves_other_lengths():
    model = make_model("llama", checkpointing=True)
    reference = copy.deepcopy(model)
    compiled = torch.compile(step, backend="tilecompile", options=compile_options(), dynamic=True)
    graphs = []
    for n, lengths in ((24, [7, 11, 6]), (37, [20, 17])):
        ids = torch.randint(0, 97, (1, n))
        pos = packed_positions(lengths, 1)
        model.zero_grad()
        reference.zero_grad()
        loss = compiled(model, ids, position_ids=pos)
        loss.backward()
        expected = step(reference, ids, position_ids=pos)
        expected.backward()
        assert_close(loss, expected, rtol=1e-5, atol=1e-6, name=f"loss at {n}")
        assert_grads_close(model, reference, rtol=1e-4, atol=1e-6)
        graphs.append(tilecompile.report().graphs)
    assert graphs[0] == graphs[1], f"the second length compiled again ({graphs})"
    report = tilecompile.report()
    assert report.counts["attention"] == 2 * report.graphs  # (Dynamo hands this step over as two graphs)
    assert not [s for s in report.skipped if s.pass_name == "attention"]


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_bf16_autocast_over_fp32_weights(checkpointing):
    """The trainers' default mixed precision: fp32 weights under bf16 autocast. RoPE's fp32 cos / sin make q and k
    fp32 beside a bf16 v, and SDPA under autocast casts all three; the rewritten op gets the same casts (it failed
    before: 'q, k, v must share one float dtype'). Loss and grads as eager's under the same autocast."""
    model = make_model("qwen2", checkpointing=checkpointing)
    ids = torch.randint(0, 97, (2, 24))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = compare(model, ids, tol=(2e-2, 5e-2), attention_mask=padding_mask(2, 24))  # bf16 roundings
    assert report.counts["attention"] == 2 and not report.failures, report
    assert all("key valid in" in d for d in _details(report)), _details(report)
    assert report.counts["layer_regions"] == (2 if checkpointing else 0), report  # the layers shared under autocast


# ---------------------------------------------------------------------------------- hand-written masks


class Attn(torch.nn.Module):
    def __init__(self, heads=4, kv_heads=2, dim=32):
        super().__init__()
        self.h, self.hkv, self.d = heads, kv_heads, dim // heads
        self.q = torch.nn.Linear(dim, dim)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.d)

    def forward(self, x, mask, **sdpa):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.h, self.d).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, self.hkv, self.d).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.hkv != self.h, **sdpa)
        return out.transpose(1, 2).reshape(b, n, -1)


def _broadcast_causal(x):
    i = torch.arange(x.shape[1], device=x.device)
    return i[:, None] >= i[None, :]


def _float_window(x):
    i = torch.arange(x.shape[1], device=x.device)
    d = i[:, None] - i[None, :]
    return torch.where((d >= 0) & (d < 4), 0.0, float("-inf"))


def _doc_mask(x, doc):
    return (doc[:, None, :, None] == doc[:, None, None, :]) & ~(
        torch.arange(x.shape[1])[None, :] > torch.arange(x.shape[1])[:, None]
    )


def _pad_ne_0(x, pad):
    return _broadcast_causal(x)[None, None] & (pad != 0)[:, None, None, :]


def _pad_eq_1(x, pad):  # pad holds 0, 1 and 2 here: only the 1s are keys
    return _broadcast_causal(x)[None, None] & (pad == 1)[:, None, None, :]


def _masked_fill(x, pad):
    allowed = _broadcast_causal(x)[None, None] & pad.bool()[:, None, None, :]
    return torch.zeros(pad.shape[0], 1, x.shape[1], x.shape[1]).masked_fill(~allowed, float("-inf"))


_TOKEN_BUILDS = (_doc_mask, _pad_ne_0, _pad_eq_1, _masked_fill)


@pytest.mark.parametrize(
    "build,expected",
    [(_broadcast_causal, "is_causal=True"), (_float_window, "0 <= Δindex <= 3"), (_doc_mask, "same"),
     (_pad_ne_0, "key valid in l_doc_ ne 0"), (_pad_eq_1, "key valid in l_doc_ eq 1"),
     (_masked_fill, "key valid in l_doc_")],
    ids=["broadcast-causal", "float-window", "documents-not-causal-spelled", "pad-ne-0", "pad-eq-1", "masked-fill"],
)  # fmt: skip
def test_hand_written_masks(build, expected):
    torch.manual_seed(0)
    model = Attn()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 19, 32, requires_grad=True)
    doc = torch.tensor([[0] * 5 + [1] * 14, [0] * 12 + [1] * 7])
    if build is _pad_eq_1:
        doc[0, 9:12] = 2

    def fn(m, x, doc):
        mask = build(x, doc) if build in _TOKEN_BUILDS else build(x)
        return m(x, mask)

    compiled = torch.compile(fn, backend="tilecompile", options=compile_options())
    out = compiled(model, x, doc)
    x_ref = x.detach().clone().requires_grad_()
    expected_out = fn(ref, x_ref, doc)
    assert_close(out, expected_out, rtol=1e-5, atol=1e-6, name="out")
    g = torch.randn_like(out)
    out.backward(g)
    expected_out.backward(g)
    assert_close(x.grad, x_ref.grad, rtol=1e-4, atol=1e-5, name="x.grad")
    assert_grads_close(model, ref, rtol=1e-4, atol=1e-5)
    details = _details(tilecompile.report())
    assert len(details) == 1 and expected in details[0], details


_REPEATS = {
    "repeat_kv": (lambda t, r: t[:, :, None].expand(*t.shape[:2], r, *t.shape[2:]).flatten(1, 2), True),
    "repeat_kv-reshape": (lambda t, r: t[:, :, None].expand(-1, -1, r, -1, -1).reshape(t.shape[0], -1, *t.shape[2:]),
                          True),
    "repeat_interleave": (lambda t, r: t.repeat_interleave(r, dim=1), True),
    "tiled-repeat": (lambda t, r: t.repeat(1, r, 1, 1), False),  # head h reads key head h % Hkv: not GQA's order
    "tiled-expand": (lambda t, r: t[:, None].expand(-1, r, -1, -1, -1).reshape(t.shape[0], -1, *t.shape[2:]), False),
}  # fmt: skip


@pytest.mark.parametrize("spelling", list(_REPEATS))
def test_repeated_key_heads_are_read_through(spelling):
    """k, v repeated per query head become GQA's key heads in the op only when query head h reads key head
    h // rep (repeat_kv's order); a tiled repeat (h % Hkv) stays as written. Values and grads as eager either way."""
    repeat, read = _REPEATS[spelling]
    torch.manual_seed(0)
    x = torch.randn(2, 19, 32, dtype=torch.float64, requires_grad=True)
    wq, wk, wv = (torch.randn(32, n, dtype=torch.float64, requires_grad=True) for n in (32, 16, 16))
    pad = torch.ones(2, 19, dtype=torch.long)
    pad[0, :4] = 0
    pad[1, 15:] = 0

    def fn(x, wq, wk, wv, pad):
        b, n, _ = x.shape
        q = (x @ wq).view(b, n, 4, 8).transpose(1, 2)
        k, v = ((x @ w).view(b, n, 2, 8).transpose(1, 2) for w in (wk, wv))
        k, v = repeat(k, 2), repeat(v, 2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=_pad_ne_0(x, pad))

    inputs = (x, wq, wk, wv)
    out = torch.compile(fn, backend="tilecompile", options=compile_options())(*inputs, pad)
    refs = [t.detach().clone().requires_grad_() for t in inputs]
    expected = fn(*refs, pad)
    assert_close(out, expected, rtol=1e-10, atol=1e-12, name="out")
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, g)
    expected_grads = torch.autograd.grad(expected, refs, g)
    for name, got, want in zip(("x", "wq", "wk", "wv"), grads, expected_grads):
        assert_close(got, want, rtol=1e-10, atol=1e-12, name=f"{name}.grad")
    details = _details(tilecompile.report())
    assert len(details) == 1 and "masked_attention" in details[0], details
    assert ("GQA 4/2 heads, repeat_kv read through" in details[0]) is read, details


def _hf_chunked(x, pad, chunk=4, overlay=None):
    """HF's chunked local attention mask (Llama 4's ``create_chunked_causal_mask``, broadcast path): chunks start
    after each row's left padding, ``(kv - lp[b]) // C == (q - lp[b]) // C``, causal, padding keys out."""
    import transformers.masking_utils as MU

    lp = (pad.cumsum(dim=-1) == torch.zeros_like(pad)).sum(dim=-1)
    fn = (
        MU.and_masks(overlay(chunk, lp), MU.causal_mask_function)
        if overlay
        else MU.chunked_causal_mask_function(chunk, lp)
    )
    b, n = pad.shape
    return MU.sdpa_mask(
        batch_size=b, q_length=n, kv_length=n, mask_function=fn, attention_mask=pad.bool(),
        allow_is_causal_skip=False, use_vmap=False,
    )  # fmt: skip


def _shifted_chunks(chunk, lp):  # (kv - lp) // C == (q - lp + 1) // C: not one chunking of the index
    return lambda b, h, q, kv: (kv - lp[b]) // chunk == (q - lp[b] + 1) // chunk


def _chunks_of_two_divisors(chunk, lp):
    return lambda b, h, q, kv: (kv - lp[b]) // chunk == (q - lp[b]) // (chunk + 1)


def _compare_padded(model, ref, x, run, run_ref) -> None:
    """``run(x)`` (compiled) against ``run_ref`` on a copy of x: values, x's grad and every parameter grad in
    float64; the grads are zeroed after."""
    n = x.shape[1]
    out = run(x)
    x_ref = x.detach().clone().requires_grad_()
    expected = run_ref(x_ref)
    assert_close(out, expected, rtol=1e-10, atol=1e-12, name=f"out (n={n})")
    g = torch.randn_like(out)
    out.backward(g)
    expected.backward(g)
    assert_close(x.grad, x_ref.grad, rtol=1e-10, atol=1e-12, name=f"x.grad (n={n})")
    assert_grads_close(model, ref, rtol=1e-10, atol=1e-12)
    model.zero_grad(), ref.zero_grad()


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("chunk", [1, 4, 7])
def test_hf_chunked_local_attention(chunk, dynamic):
    """HF's ``chunked_overlay`` (floor division of the index less each row's left padding) becomes masked_attention
    with the chunk ids as documents, made once per graph: values and grads as eager (float64) at every position,
    left- and right-padded rows, and a second length on the same compile under dynamic shapes."""
    torch.manual_seed(0)
    model = Attn().double()
    ref = copy.deepcopy(model)
    compiled = torch.compile(lambda m, x, pad: m(x, _hf_chunked(x, pad, chunk)), backend="tilecompile",
                             options=compile_options(), dynamic=dynamic)  # fmt: skip
    for n in (19, 23) if dynamic else (19,):
        x = torch.randn(3, n, 32, dtype=torch.float64, requires_grad=True)
        pad = torch.ones(3, n, dtype=torch.long)
        pad[0, :5] = 0
        pad[1, n - 6 :] = 0
        run = lambda x, pad=pad: compiled(model, x, pad)  # noqa: E731
        _compare_padded(model, ref, x, run, lambda x, pad=pad: ref(x, _hf_chunked(x, pad, chunk)))
    details = _details(tilecompile.report())
    assert details and all(f"same chunk (index - lp[b]) // {chunk}" in d for d in details), details


@pytest.mark.parametrize(
    "overlay,reason",
    [(_shifted_chunks, "other than the query's and key's index"), (_chunks_of_two_divisors, "same divisor")],
    ids=["shifted", "two-divisors"],
)
def test_hf_chunked_near_misses_are_left_alone(overlay, reason):
    torch.manual_seed(0)
    model = Attn().double()
    x = torch.randn(2, 13, 32, dtype=torch.float64)
    pad = torch.ones(2, 13, dtype=torch.long)
    pad[0, :3] = 0
    fn = lambda m, x, pad: m(x, _hf_chunked(x, pad, 4, overlay))  # noqa: E731
    out = torch.compile(fn, backend="tilecompile", options=compile_options())(model, x, pad)
    assert_close(out, fn(model, x, pad), rtol=1e-10, atol=1e-12, name="out")
    report = tilecompile.report()
    skipped = [s.reason for s in report.skipped if s.pass_name == "attention"]
    assert report.counts["attention"] == 0 and skipped and reason in skipped[0], skipped


@pytest.mark.parametrize(
    "build,reason",
    [
        (lambda x: torch.rand(x.shape[1], x.shape[1]) > 0.5, "not index arithmetic"),
        (lambda x: (lambda i: (i[:, None] >= i[None, :]) | (i[None, :] == 0))(torch.arange(x.shape[1])), "or"),
        (lambda x: (lambda i: i[:, None] >= i[None, :] + 1)(torch.arange(x.shape[1])), None),
        (
            lambda x: torch.zeros(x.shape[1], x.shape[1]).masked_fill(~_broadcast_causal(x), torch.finfo(x.dtype).min),
            "not -inf",
        ),  # a row with no key would attend uniformly: not a boolean mask's semantics
    ],
    ids=["random", "disjunction", "strictly-causal", "finfo-min-fill"],
)
def test_masks_left_alone_or_exact(build, reason):
    """A mask that is not index arithmetic, or a disjunction, is left alone with a reason; the output equals eager
    either way (a strictly causal mask, whose first row is empty, is rewritten and still equals eager)."""
    torch.manual_seed(0)
    model = Attn(heads=2, kv_heads=2)
    x = torch.randn(1, 13, 32)
    torch.manual_seed(1)
    fn = lambda m, x: m(x, build(x))  # noqa: E731
    compiled = torch.compile(fn, backend="tilecompile", options=compile_options())
    torch.manual_seed(1)
    out = compiled(model, x)
    torch.manual_seed(1)
    assert_close(out, fn(model, x), rtol=1e-5, atol=1e-6, name="out")
    report = tilecompile.report()
    skipped = [s.reason for s in report.skipped if s.pass_name == "attention"]
    if reason is None:
        assert report.counts["attention"] == 1 and not skipped
    else:
        assert report.counts["attention"] == 0 and skipped and reason in skipped[0], skipped


@pytest.mark.parametrize("checkpointed", [False, True], ids=["flat", "checkpointed"])
def test_a_mask_passed_in_is_left_with_a_reason(checkpointed):
    """A mask made outside the compiled code enters the root graph as an input: its values are unknown at compile
    time, so SDPA keeps it, and the report says why (under checkpointing it reaches SDPA through the layer's body)."""
    torch.manual_seed(0)
    model = Attn(heads=2, kv_heads=2)
    x = torch.randn(1, 11, 32)
    mask = _broadcast_causal(x)

    def fn(m, x, mask):
        if checkpointed:
            return torch.utils.checkpoint.checkpoint(m, x, mask, use_reentrant=False)
        return m(x, mask)

    out = torch.compile(fn, backend="tilecompile", options=compile_options())(model, x, mask)
    assert_close(out, fn(model, x, mask), rtol=1e-5, atol=1e-6, name="out")
    report = tilecompile.report()
    skipped = [s.reason for s in report.skipped if s.pass_name == "attention"]
    assert report.counts["attention"] == 0
    assert len(skipped) == 1 and "input of" in skipped[0] and "made by the caller" in skipped[0], skipped


def test_dropout_is_left_alone():
    model = Attn(heads=2, kv_heads=2)
    fn = lambda m, x: m(x, _broadcast_causal(x), dropout_p=0.1)  # noqa: E731
    torch.compile(fn, backend="tilecompile", options=compile_options())(model, torch.randn(1, 9, 32))
    skipped = [s.reason for s in tilecompile.report().skipped if s.pass_name == "attention"]
    assert skipped and "dropout_p" in skipped[0]


# ------------------------------------------------------------------------------------- masks sliced to the key length


class KeySlicedAttn(Attn):
    """Attention that slices the mask it is handed to the key length, as transformers 4.57's sdpa path does
    (``attention_mask[:, :, :, : key.shape[-2]]``): the whole mask when it is that long, symbolic or not."""

    def forward(self, x, mask, **sdpa):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.h, self.d).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, self.hkv, self.d).permute(2, 0, 3, 1, 4)
        mask = mask[:, :, :, : k.shape[-2]]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, **sdpa)
        return out.transpose(1, 2).reshape(b, n, -1)


class KeySlicedLayers(torch.nn.Module):
    """Two such layers fed one mask built once (4.57's models), each under activation checkpointing or not: then
    the mask enters each layer's body as an input and is sliced there."""

    def __init__(self, checkpointing: bool):
        super().__init__()
        self.layers = torch.nn.ModuleList([KeySlicedAttn(), KeySlicedAttn()])
        self.checkpointing = checkpointing

    def forward(self, x, pad):
        mask = _pad_ne_0(x, pad)
        for layer in self.layers:
            if self.checkpointing:
                x = x + torch.utils.checkpoint.checkpoint(layer, x, mask, use_reentrant=False)
            else:
                x = x + layer(x, mask)
        return x


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_mask_sliced_to_the_key_length_is_the_mask(checkpointing, dynamic):
    """A slice of the key dim that provably keeps all of it (a literal end, or the key length as a symbol under
    dynamic shapes) is the mask itself: every layer's attention is rewritten, one mask read for all, and values and
    grads equal eager's in float64 (a second length on the same compile under dynamic shapes)."""
    torch.manual_seed(0)
    model = KeySlicedLayers(checkpointing).double()
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="tilecompile", options=compile_options(), dynamic=dynamic)
    for n in (19, 23) if dynamic else (19,):
        x = torch.randn(2, n, 32, dtype=torch.float64, requires_grad=True)
        pad = torch.ones(2, n, dtype=torch.long)
        pad[0, :4] = 0
        pad[1, n - 5 :] = 0
        _compare_padded(model, ref, x, lambda x, pad=pad: compiled(x, pad), lambda x, pad=pad: ref(x, pad))
    report = tilecompile.report()
    assert report.graphs == 1, report
    assert report.counts["attention"] == 2, report
    assert not [s for s in report.skipped if s.pass_name == "attention"], report.skipped
    assert all("key valid in l_pad_ ne 0" in d for d in _details(report)), _details(report)


def _key_offset_causal(x):  # keys numbered from -2 (two before the queries), then the first two cut off: causal
    i, j = torch.arange(x.shape[1]), torch.arange(x.shape[1] + 2)
    return (j[None, :] <= i[:, None] + 2)[None, None, :, 2:]


def _key_offset_window(x):  # the same, keys at most one behind the query: a window
    i, j = torch.arange(x.shape[1]), torch.arange(x.shape[1] + 2)
    return ((j[None, :] <= i[:, None] + 2) & (j[None, :] > i[:, None]))[None, None, :, 2:]


def _one_row_of_the_batch(x, pad):  # a [2, 1, N, N] mask's second row: pad would have to be cut the same way
    return _pad_ne_0(x, torch.cat([pad, pad.flip(0)]))[1:]


@pytest.mark.parametrize(
    "build,expected,reason",
    [(_key_offset_causal, "is_causal=True", None), (_key_offset_window, "0 <= Δindex <= 1", None),
     (_one_row_of_the_batch, None, "a slice of per-token tensor")],
    ids=["key-offset-causal", "key-offset-window", "one-row-of-the-batch"],
)  # fmt: skip
def test_mask_slices_that_restrict_are_exact_or_refused(build, expected, reason):
    """A slice that restricts an axis is the index read from its start on (exact), or, where it would cut a
    per-token tensor, a reason; the output equals eager's in float64 either way."""
    torch.manual_seed(0)
    model = Attn().double()
    x = torch.randn(1, 13, 32, dtype=torch.float64, requires_grad=True)
    pad = torch.ones(1, 13, dtype=torch.long)
    pad[0, :3] = 0

    def fn(m, x, pad):
        return m(x, build(x, pad) if build is _one_row_of_the_batch else build(x))

    out = torch.compile(fn, backend="tilecompile", options=compile_options())(model, x, pad)
    x_ref = x.detach().clone().requires_grad_()
    want = fn(model, x_ref, pad)
    assert_close(out, want, rtol=1e-10, atol=1e-12, name="out")
    out.sum().backward()
    want.sum().backward()
    assert_close(x.grad, x_ref.grad, rtol=1e-10, atol=1e-12, name="x.grad")
    report = tilecompile.report()
    skipped = [s.reason for s in report.skipped if s.pass_name == "attention"]
    if reason is None:
        assert report.counts["attention"] == 1 and not skipped, (report, skipped)
        assert expected in _details(report)[0], _details(report)
    else:
        assert report.counts["attention"] == 0 and skipped and reason in skipped[0], skipped


# --------------------------------------------------------------------------------------------------- the op


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "spec",
    [dict(lo=0), dict(lo=0, hi=6), dict(doc=True), dict(lo=0, doc=True, pos=True), dict(lo=0, valid=True), dict()],
    ids=["causal", "window", "docs-bidirectional", "docs-positions", "padding", "full"],
)
def test_op_against_float64_reference(spec, dtype):
    torch.manual_seed(0)
    b, h, hkv, n, d = 2, 6, 2, 53, 12
    q, k, v = (torch.randn(b, heads, n, d, dtype=dtype, requires_grad=True) for heads in (h, hkv, hkv))
    doc = torch.tensor([[0] * 20 + [1] * 33, [0] * 40 + [1] * 13]) if spec.get("doc") else None
    pos = torch.cat([torch.arange(20), torch.arange(33)])[None] if spec.get("pos") else None
    valid = padding_mask(b, n).bool() if spec.get("valid") else None
    lo, hi = spec.get("lo"), spec.get("hi")
    out, lse = torch.ops.tilecompile.masked_attention(q, k, v, pos, doc, valid, lo, hi, 0.25, [])
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = K.reference(*ref_in, pos, doc, valid, lo, hi, 0.25)
    ref_grads = torch.autograd.grad(ref, ref_in, g.double())
    eager = K.reference(q, k, v, pos, doc, valid, lo, hi, 0.25)
    eager_grads = torch.autograd.grad(eager, (q, k, v), g)
    for name, a, e, r in zip(("out", "dq", "dk", "dv"), (out, *grads), (eager, *eager_grads), (ref, *ref_grads)):
        ours, theirs = (a.double() - r).abs().max().item(), (e.double() - r).abs().max().item()
        assert ours <= 2 * theirs + 1e-12 * r.abs().max().item() + (1e-6 if dtype == torch.float32 else 0), (
            name, ours, theirs,
        )  # fmt: skip
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)


def test_op_opcheck():
    torch.manual_seed(0)
    q = torch.randn(1, 4, 33, 8).transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    k, v = (torch.randn(1, 2, 33, 8, requires_grad=True) for _ in range(2))
    doc = torch.zeros(1, 33, dtype=torch.long)
    doc[:, 10:] = 1
    torch.library.opcheck(torch.ops.tilecompile.masked_attention.default, (q, k, v, None, doc, None, 0, None, 0.3, []))


def test_op_rejects_bad_input():
    q = torch.randn(1, 3, 8, 4)
    k = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match="multiple of key heads"):
        torch.ops.tilecompile.masked_attention(q, k, k, None, None, None, 0, None, 0.5, [])
    with pytest.raises(ValueError, match=r"doc must be \[B or 1, N\]"):
        torch.ops.tilecompile.masked_attention(q, q, q, None, torch.zeros(1, 7), None, 0, None, 0.5, [])


@pytest.mark.slow
def test_inductor_cpu_checkpointed_packed():
    """Through Inductor's CPU backend (its stride asserts check the ops' fake kernels against the real ones)."""
    model = make_model("qwen2", checkpointing=True)
    report = compare(model, torch.randint(0, 97, (2, 24)), options={"inner": "inductor"},
                     position_ids=packed_positions([7, 11, 6], 2))  # fmt: skip
    assert report.counts["attention"] == 2


def _vmapped(fn):
    for dims in ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None), (0, None, None, None)):
        fn = torch.vmap(fn, in_dims=dims, out_dims=0)
    return fn


def test_vmap_built_masks():
    """Masks built with torch.vmap over (batch, head, q, kv), as HF does for custom mask functions."""
    from transformers.masking_utils import and_masks, causal_mask_function, sdpa_mask, sliding_window_overlay

    def plain(x, pad):
        n = x.shape[2]
        mask = _vmapped(lambda b, h, q, kv: kv <= q)(torch.arange(2), torch.arange(1), torch.arange(n), torch.arange(n))
        return F.scaled_dot_product_attention(x, x, x, attn_mask=mask)

    def hf(x, pad):
        mask = sdpa_mask(batch_size=2, q_length=x.shape[2], kv_length=x.shape[2], attention_mask=pad.bool(),
                         mask_function=and_masks(causal_mask_function, sliding_window_overlay(3)), use_vmap=True,
                         allow_is_causal_skip=False, device=x.device)  # fmt: skip
        return F.scaled_dot_product_attention(x, x, x, attn_mask=mask)

    pad = torch.ones(2, 9, dtype=torch.long)
    pad[0, :2] = 0
    for fn, expected in ((plain, "is_causal=True"), (hf, "0 <= Δindex <= 2 and key valid in")):
        tilecompile.reset()
        torch._dynamo.reset()
        x = torch.randn(2, 2, 9, 4, requires_grad=True)
        out = torch.compile(fn, backend="tilecompile", options=compile_options())(x, pad)
        x_ref = x.detach().clone().requires_grad_()
        ref = fn(x_ref, pad)
        assert_close(out, ref, rtol=1e-5, atol=1e-6, name=fn.__name__)
        out.sum().backward()
        ref.sum().backward()
        assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6, name=f"{fn.__name__} x.grad")
        details = _details(tilecompile.report())
        assert len(details) == 1 and expected in details[0], details
