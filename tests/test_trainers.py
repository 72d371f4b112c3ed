"""tilecompile.integrations.compile_trainer with the real trainers: HF Trainer, TRL SFTTrainer (padded, packed) and
GRPOTrainer, each 3 steps of a tiny Qwen2 on CPU, against the same trainer without tilecompile: the logged losses,
grad norms and metrics equal, and the report has the attention, the fused lm_head and the tiled MLPs."""

from __future__ import annotations

import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

import tilecompile  # noqa: E402
from tilecompile.integrations import IntegrationError, compile_trainer  # noqa: E402

V = 128
OPTIONS = {"inner": "aot_eager", "mlp_min_tokens": 0, "strict": True}


def tokenizer():
    from tokenizers.models import WordLevel

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i + 3 for i in range(V - 3)}}
    tok = tokenizers.Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def qwen2():
    cfg = transformers.Qwen2Config(
        hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=V, tie_word_embeddings=True, attn_implementation="sdpa", pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(cfg)


def token_rows(n: int = 8, seed: int = 1) -> list[list[int]]:
    """Rows of 5..16 tokens, each a run of consecutive ids (a pattern 3 steps at lr 1e-2 start to predict)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length, start = int(torch.randint(5, 17, (1,), generator=g)), int(torch.randint(3, V - 20, (1,), generator=g))
        rows.append(list(range(start, start + length)))
    return rows


def common_args(bf16: bool) -> dict:
    """3 steps, logged each; bf16 (autocast over the fp32 weights) at a smaller learning rate, so that the rounding
    differences of one step do not grow through Adam's normalised updates into different trajectories."""
    return dict(
        output_dir="unused", max_steps=3, per_device_train_batch_size=4, learning_rate=1e-3 if bf16 else 1e-2,
        logging_steps=1,
        report_to=[], save_strategy="no", use_cpu=True, bf16=bf16, seed=0, disable_tqdm=True,
    )  # fmt: skip


def logged(trainer, keys) -> list[tuple]:
    return [tuple(h[k] for k in keys) for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]


def assert_same_logs(got, want, rtol: float) -> None:
    assert len(got) == len(want) == 3, (got, want)
    for step, (g, w) in enumerate(zip(got, want)):
        for a, b in zip(g, w):
            assert abs(a - b) <= rtol * max(abs(b), 1e-3), f"step {step}: {got} vs eager {want}"


def assert_report(graphs: int, lm_head: str) -> None:
    r = tilecompile.report()
    c = r.counts
    assert c["attention"] == 2 * graphs and c["tiled_mlp"] == 2 * graphs and c["fused_linear_ce"] == graphs, str(r)
    assert all(lm_head in x.detail for x in r.rewrites if x.pass_name == "fused_linear_ce"), str(r)
    assert not r.failures, str(r)


def lm_head_dtype() -> set[str]:
    """The logits' dtype at every fused lm_head (h and the weight stay fp32 under autocast; the GEMM is bf16)."""
    rewrites = [x for x in tilecompile.report().rewrites if x.pass_name == "fused_linear_ce"]
    autocast = {"autocast to bfloat16" in x.detail for x in rewrites}
    noted = {"noted"} if autocast == {True} else set()
    return {str(x.dtypes.get("logits")).removeprefix("torch.") for x in rewrites} | noted


def test_hf_trainer(tmp_path):
    """HF's own cross-entropy (labels=) fused; padded batches (masked attention)."""
    collator = transformers.DataCollatorForLanguageModeling(tokenizer(), mlm=False)
    data = datasets.Dataset.from_dict({"input_ids": token_rows()})

    def run(compiled: bool, bf16: bool):
        args = transformers.TrainingArguments(**{**common_args(bf16), "output_dir": str(tmp_path)})
        trainer = transformers.Trainer(model=qwen2(), args=args, train_dataset=data, data_collator=collator)
        if compiled:
            compile_trainer(trainer, options=OPTIONS)
        trainer.train()
        return logged(trainer, ("loss", "grad_norm"))

    for bf16, rtol in ((False, 1e-5), (True, 2e-3)):
        eager = run(False, bf16)
        tilecompile.reset()
        torch._dynamo.reset()
        assert_same_logs(run(True, bf16), eager, rtol)
        graphs = tilecompile.report().graphs
        assert graphs >= 1
        assert_report(graphs, "cross_entropy")
        if bf16:  # the lm_head under autocast: bf16 h against the fp32 weight
            assert lm_head_dtype() == {"bfloat16", "noted"}, str(tilecompile.report())


try:
    import trl
except ImportError:  # an optional test dependency: the TRL tests skip without it
    trl = None
needs_trl = pytest.mark.skipif(trl is None, reason="needs trl")


@needs_trl
@pytest.mark.parametrize("packing,bf16", [(False, False), (True, False), (False, True)])
def test_sft_trainer(tmp_path, packing, bf16):
    """TRL's SFTTrainer: its fused_lm_head forward compiled as torch math and fused; loss, grad norm, entropy and
    mean_token_accuracy (TRL's own kernel on the compiled graph's hidden states) equal TRL's."""
    data = datasets.Dataset.from_dict({"input_ids": token_rows()})

    def run(compiled: bool):
        args = trl.SFTConfig(**{**common_args(bf16), "output_dir": str(tmp_path)}, packing=packing)
        trainer = trl.SFTTrainer(model=qwen2(), args=args, train_dataset=data, processing_class=tokenizer())
        if compiled:
            compile_trainer(trainer, options=OPTIONS)
            assert trainer._tilecompile == ("model",)
        trainer.train()
        return logged(trainer, ("loss", "grad_norm", "entropy", "mean_token_accuracy"))

    eager = run(False)
    tilecompile.reset()
    torch._dynamo.reset()
    got = run(True)
    assert_same_logs(got, eager, 2e-3 if bf16 else 1e-5)
    if not bf16:
        assert any(row[3] > 0 for row in eager), eager  # the accuracy metric is exercised, not all zeros
    graphs = tilecompile.report().graphs
    assert 1 <= graphs <= 3
    assert_report(graphs, "log-prob, entropy")
    detail = " ".join(x.detail for x in tilecompile.report().rewrites if x.pass_name == "attention")
    # packing: padding-free rows (position_ids restart per document, no attention_mask); else a padded batch
    assert "masked_attention" in detail, detail
    if bf16:
        assert lm_head_dtype() == {"bfloat16", "noted"}, str(tilecompile.report())


@needs_trl
def test_fused_forward_matches_trl():
    """The compiled fused forward against TRL's own on one batch: every output, and the grads, with an is_top1 that
    is true on half the tokens (labels set to the argmax there)."""
    from trl.trainer.utils import add_fused_lm_head

    models = []
    for compiled in (False, True):
        model = qwen2()
        add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy", "is_top1"))
        if compiled:
            trainer = type("T", (), {"model": model, "args": None})()
            compile_trainer(trainer, options=OPTIONS)
        models.append(model)
    ids = torch.randint(3, V, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # a left-padded row
    with torch.no_grad():
        top = models[0](input_ids=ids, attention_mask=mask).logits.argmax(-1)
    labels = torch.where(torch.rand(2, 12) < 0.5, torch.roll(top, 1, 1), ids)
    labels = labels.masked_fill(mask == 0, -100)
    outs = []
    for model in models:
        out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        (out.loss + 0.1 * out.entropy.sum()).backward()
        outs.append(out)
    want, got = outs
    assert want.is_top1.any() and not want.is_top1.all()
    assert torch.equal(got.is_top1, want.is_top1) and torch.equal(got.label_mask, want.label_mask)
    for name in ("loss", "log_probs", "entropy"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-5, atol=1e-5, msg=name)
    for (name, p), q in zip(models[1].named_parameters(), models[0].parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert tilecompile.report().counts["fused_linear_ce"] == 1
    assert "temperature 0.7" in str(tilecompile.report())


@needs_trl
def test_grpo_trainer(tmp_path, caplog):
    """TRL's GRPOTrainer, 3 steps with gradient checkpointing: the training forward compiled (generation is not),
    equal to TRL's, no recompile limit hit, no recompile a step."""
    g = torch.Generator().manual_seed(2)
    prompts = [" ".join(f"w{int(i)}" for i in torch.randint(0, V - 3, (3 + k % 4,), generator=g)) for k in range(8)]
    data = datasets.Dataset.from_dict({"prompt": prompts})

    def reward(completions, **_):
        return [len(c) / 10 for c in completions]

    def run(compiled: bool, bf16: bool):
        args = trl.GRPOConfig(
            **{**common_args(bf16), "output_dir": str(tmp_path)},
            num_generations=4, max_completion_length=6, beta=0.0, gradient_checkpointing=True,
        )  # fmt: skip
        trainer = trl.GRPOTrainer(
            model=qwen2(), reward_funcs=reward, args=args, train_dataset=data, processing_class=tokenizer()
        )
        if compiled:
            compile_trainer(trainer, options=OPTIONS)
        trainer.train()
        return logged(trainer, ("loss", "grad_norm", "entropy"))

    for bf16 in (False, True):
        eager = run(False, bf16)
        tilecompile.reset()
        torch._dynamo.reset()
        with caplog.at_level(logging.WARNING, logger="torch._dynamo"):
            got = run(True, bf16)
        assert_same_logs(got, eager, 2e-3 if bf16 else 1e-5)
        assert "recompile_limit" not in caplog.text and "cache_size_limit" not in caplog.text, caplog.text
        graphs = tilecompile.report().graphs
        # checkpointing toggled around each generation: one more graph a step if HF's input hooks piled up (3 here)
        assert 1 <= graphs <= 2, str(tilecompile.report())
        assert_report(graphs, "log-prob, entropy")


try:
    import peft
except ImportError:  # an optional test dependency, as trl is
    peft = None


@pytest.mark.skipif(trl is None or peft is None, reason="needs trl and peft")
def test_sft_trainer_lora_with_checkpointing(tmp_path):
    """TRL's SFTTrainer on a LoRA model (``peft_config``) with gradient checkpointing, fine-tuning's usual setup. HF
    hooks the frozen input embeddings with ``requires_grad_()`` (``enable_input_require_grads``), which breaks the
    compiled graph in every step and keeps the lm_head apart from its loss. The checkpointing is non-reentrant, so
    ``compile_trainer`` removes the hook (and Trainer.train's enable of checkpointing adds none): the lm_head is
    fused, the logs equal the eager trainer's (which keeps it)."""
    data = datasets.Dataset.from_dict({"input_ids": token_rows()})

    def run(compiled: bool):
        args = trl.SFTConfig(**{**common_args(False), "output_dir": str(tmp_path)}, gradient_checkpointing=True)
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
        trainer = trl.SFTTrainer(
            model=qwen2(), args=args, train_dataset=data, processing_class=tokenizer(), peft_config=lora
        )
        base = trainer.model.get_base_model()
        assert base._require_grads_hooks and not base.get_input_embeddings().weight.requires_grad
        if compiled:
            compile_trainer(trainer, options=OPTIONS)
            assert not getattr(base, "_require_grads_hooks", None)
        trainer.train()
        return logged(trainer, ("loss", "grad_norm", "entropy"))

    eager = run(False)
    tilecompile.reset()
    torch._dynamo.reset()
    got = run(True)
    assert_same_logs(got, eager, 1e-5)
    rep = tilecompile.report()
    graphs = rep.graphs  # one a length until Dynamo makes the length dynamic; four a length with the hook's break
    assert graphs <= 2 and rep.counts["fused_linear_ce"] == graphs and rep.counts["attention"] == 2 * graphs, str(rep)
    mlp = {s.reason for s in rep.skipped if s.pass_name == "tiled_mlp"}
    assert mlp and all("low-rank adapter" in r for r in mlp), str(rep)


@pytest.mark.skipif(peft is None, reason="needs peft")
def test_lora_model_compiled_by_hand_names_the_hook():
    """A LoRA model with checkpointing compiled directly: the report's lm_head skip names the hook that broke the
    graph and what to call; after ``disable_input_require_grads()`` the lm_head is fused, the gradients as eager's."""
    import copy

    from tilecompile import graph_breaks

    def step(model, ids):
        logits = model(input_ids=ids, use_cache=False).logits
        return -torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).mean()

    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
    model = peft.get_peft_model(qwen2(), lora)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(3, V, (2, 12))
    torch.compile(step, backend="tilecompile", options=OPTIONS)(model, ids).backward()
    rep = tilecompile.report()
    assert rep.counts["fused_linear_ce"] == 0, str(rep)
    head = [s.reason for s in rep.skipped if s.pass_name == "fused_linear_ce" and s.candidate == "lm_head"]
    assert head and "model.disable_input_require_grads()" in head[0], str(rep)

    tilecompile.reset()  # the break above is forgotten: a later report does not name it
    assert graph_breaks._fix_head() == graph_breaks._FIX_NO_LOSS

    model.disable_input_require_grads()
    ref = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    tilecompile.reset()
    torch._dynamo.reset()
    torch.compile(step, backend="tilecompile", options=OPTIONS)(model, ids).backward()
    step(ref, ids).backward()
    rep = tilecompile.report()
    assert rep.graphs == 1 and rep.counts["fused_linear_ce"] == 1, str(rep)
    grads = [(n, p.grad, q.grad) for (n, p), q in zip(model.named_parameters(), ref.parameters()) if p.requires_grad]
    assert grads
    for name, got, want in grads:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.skipif(peft is None, reason="needs peft")
@pytest.mark.parametrize("checkpointing", ["non-reentrant", "reentrant", "old format", "off"])
def test_input_hook_removed_only_without_reentrant_checkpointing(tmp_path, checkpointing):
    """compile_trainer removes HF's input hook, and keeps later enables from adding it, only where no layer may
    checkpoint reentrantly (which needs it): a function without use_reentrant=False, or a layer flagged for
    checkpointing with no function (HF's old format, whose forward calls torch's checkpoint itself)."""
    model = peft.get_peft_model(qwen2(), peft.LoraConfig(r=4, target_modules="all-linear"))
    base = model.get_base_model()
    if checkpointing != "off":
        base.gradient_checkpointing_enable({"use_reentrant": checkpointing == "reentrant"})
    if checkpointing == "old format":
        for layer in base.model.layers:
            del layer._gradient_checkpointing_func
    base.enable_input_require_grads()
    kept = checkpointing in ("reentrant", "old format")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    compile_trainer(transformers.Trainer(model=model, args=args), options=OPTIONS)
    assert bool(base._require_grads_hooks) == kept
    if kept:
        base.enable_input_require_grads()
        assert len(base._require_grads_hooks) == 1  # still one hook
    else:
        with pytest.warns(UserWarning, match="leaves enable_input_require_grads off"):
            base.enable_input_require_grads()
        assert not base._require_grads_hooks


def test_refuses_trainer_compile_flag(tmp_path):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, torch_compile=True, report_to=[])
    trainer = transformers.Trainer(model=qwen2(), args=args)
    with pytest.raises(IntegrationError, match="torch_compile=False"):
        compile_trainer(trainer)
    args.torch_compile = False
    compile_trainer(trainer)
    with pytest.raises(IntegrationError, match="already compiled"):
        compile_trainer(trainer)
