"""The chunked LM head on real tiny fp32 models against their own full logits (1e-6 relative): the loss of every
``loss_normalization`` with ``loss_weights`` on a packed row, per-token log-probs and entropies, and the gradient
of every parameter (the LM head, tied input embeddings, final norms), for llama with a tied and an untied head,
Gemma 2's soft-capping, Cohere's ``logit_scale`` and Granite's ``logits_scaling``, a vocabulary not divisible by
the chunk; a chunk loop dropping one token is caught by the same check. The Trainer: no ``(tokens, vocabulary)``
logits in training or evaluation, ``eval_loss`` unchanged, and a head it cannot chunk keeps the full logits and
says why once. (Packed vs padded, gradient accumulation and 2/3 processes: ``test_loss.py`` and
``tests/distributed/test_loss_multiprocess.py`` compare the chunked packed step with full-logits padded ones.)
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

import packing_hf
from packing_hf import _loss, loss_head
from packing_hf.integrations import chunked_head
from packing_hf.integrations.chunked_head import (
    ChunkedHead,
    causal_lm_loss,
    model_token_logprobs,
    resolve_head,
)
from packing_hf.integrations.parallel import ParallelPlan
from packing_hf.loss_head import LogitHead, target_coefficients

REL = 1e-6
VOCAB = 61  # prime: no chunk size divides it
CHUNK = 4
SHAPE = dict(
    vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
    num_key_value_heads=1, head_dim=8,
)  # fmt: skip
MODELS = {
    "llama_tied": ("llama", {"tie_word_embeddings": True}, LogitHead()),
    "llama_untied": ("llama", {"tie_word_embeddings": False}, LogitHead()),
    "gemma2_softcap": ("gemma2", {"final_logit_softcapping": 2.0}, LogitHead(softcap=2.0)),
    "cohere_scale": ("cohere", {"logit_scale": 0.5}, LogitHead(scale=0.5)),
    "granite_scaling": ("granite", {"logits_scaling": 4.0}, LogitHead(divisor=4.0)),
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    yield


def _model(name: str):
    model_type, overrides, _ = MODELS[name]
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **SHAPE, **overrides)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().train()


def _packed_row():
    """Three samples in one row (prompts masked, the collator masks every sample's first label), with weights."""
    generator = torch.Generator().manual_seed(3)
    samples = []
    for length, prompt in ((7, 2), (5, 0), (9, 4)):
        ids = torch.randint(0, VOCAB, (length,), generator=generator).tolist()
        weights = (torch.randint(0, 9, (length,), generator=generator) / 4).tolist()
        samples.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:], "loss_weights": weights})
    batch = packing_hf.PaddingFreeCollator()(samples)
    inputs = {k: batch[k] for k in ("input_ids", "position_ids")}
    return inputs, batch["labels"], batch["loss_weights"]


def _grads(model, loss):
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [dict(model.named_parameters())[n] for n in names], allow_unused=True)
    return {n: g for n, g in zip(names, grads, strict=True) if g is not None}


def _check_model(name: str, assert_close) -> None:
    model = _model(name)
    resolved = resolve_head(model)
    assert not isinstance(resolved, str), resolved
    assert resolved[1] == MODELS[name][2]
    if name == "llama_tied":
        assert model.lm_head.weight is model.model.embed_tokens.weight
    inputs, labels, weights = _packed_row()
    position_ids = inputs["position_ids"]
    for normalization in _loss.LOSS_NORMALIZATIONS:
        logits = model(**inputs).logits  # (1, T, V): the full-logits path
        per_target = F.cross_entropy(logits[0, :-1], labels[0, 1:], reduction="none")[None]
        want = _loss.loss_numerator(per_target, labels, normalization, weights, position_ids)
        coefficients = target_coefficients(labels, normalization, weights, position_ids)
        got, stats, outputs = causal_lm_loss(model, inputs, labels, coefficients, chunk_size=CHUNK)
        assert outputs.logits.shape[1] == 0  # the model projected nothing
        assert_close(got.detach(), want.detach(), f"{name} {normalization} loss", rel=REL)
        want_grads, got_grads = _grads(model, want), _grads(model, got)
        assert (
            want_grads.keys() == got_grads.keys()
        )  # the head's weight is lm_head.weight or the tied embeddings
        for param, grad in want_grads.items():
            assert_close(got_grads[param], grad, f"{name} {normalization} d/d{param}", rel=REL)
    # per-token log-probs and entropies (the preference / RL paths), every target scored, with gradients
    targets = torch.cat([inputs["input_ids"][:, 1:], torch.full((1, 1), -100)], dim=1)
    log_p = model(**inputs).logits.log_softmax(-1)
    want_logps = torch.where(targets != -100, log_p.gather(-1, targets.clamp(min=0)[..., None])[..., 0], 0.0)
    want_entropy = -(log_p.exp() * log_p).sum(-1)
    (logps, entropy, _, _), _ = model_token_logprobs(model, inputs, targets, entropy=True, chunk_size=CHUNK)
    assert_close(logps.detach(), want_logps.detach(), f"{name} log-probs", rel=REL)
    assert_close(entropy.detach(), want_entropy.detach(), f"{name} entropies", rel=REL)
    upstream = torch.linspace(-1.0, 2.0, targets.shape[1])
    want_grads = _grads(model, (want_logps * upstream).sum() + want_entropy.sum())
    got_grads = _grads(model, (logps * upstream).sum() + entropy.sum())
    for param, grad in want_grads.items():
        assert_close(got_grads[param], grad, f"{name} log-prob d/d{param}", rel=REL)


@pytest.mark.parametrize("name", list(MODELS))
def test_chunked_head_equals_the_models_logits(name, assert_close):
    _check_model(name, assert_close)


def _dropping(n, size):
    """A broken chunk loop: the first token of every chunk after the first is skipped."""
    for start in range(0, n, size):
        yield (start + 1 if start else 0), min(start + size, n)


def test_negative_control_a_chunk_boundary_dropping_a_token(assert_close, monkeypatch):
    monkeypatch.setattr(loss_head, "_chunks", _dropping)
    with pytest.raises(AssertionError, match="loss"):
        _check_model("llama_untied", assert_close)


def _trainer(tmp_path, model, chunked: bool, **kwargs):
    samples = [s for s in _samples()]
    args = packing_hf.TrainingArguments(
        str(tmp_path), max_tokens_per_batch=24, max_steps=1, learning_rate=0.0, report_to="none",
        save_strategy="no", use_cpu=True, disable_tqdm=True, packing_metrics=False, seed=0,
        chunked_loss=chunked, logging_steps=1, **kwargs,
    )  # fmt: skip
    return packing_hf.Trainer(model=model, args=args, train_dataset=samples, eval_dataset=samples)


def _samples():
    generator = torch.Generator().manual_seed(5)
    for length in (6, 9, 4, 11, 7):
        ids = torch.randint(0, VOCAB, (length,), generator=generator).tolist()
        yield {"input_ids": ids, "labels": [-100, -100, *ids[2:]]}


def test_trainer_builds_no_logits_and_keeps_its_losses(tmp_path, assert_close):
    shapes = []
    results = {}
    for chunked in (True, False):
        model = _model("llama_untied")
        # the logits the model returns: what its head projected (a hook on the head itself would keep the full
        # logits: the chunked head honours the head's hooks)
        hook = model.register_forward_hook(
            lambda m, a, out, chunked=chunked: shapes.append((chunked, tuple(out.logits.shape)))
        )
        trainer = _trainer(tmp_path, model, chunked)
        trainer.train()
        loss = next(e["loss"] for e in trainer.state.log_history if "loss" in e)
        results[chunked] = (loss, trainer.evaluate()["eval_loss"])
        hook.remove()
    assert {s[-2] for c, s in shapes if c} == {0}  # chunked: the head projects no token, in train and eval
    assert all(s[-2] > 0 for c, s in shapes if not c)
    assert_close(results[True][0], results[False][0], "train loss", rel=REL)
    assert_close(results[True][1], results[False][1], "eval_loss", rel=REL)


def test_a_head_that_cannot_be_chunked_keeps_the_logits_and_says_why_once(tmp_path, caplog):
    config = AutoConfig.for_model(
        "opt", vocab_size=VOCAB, hidden_size=16, ffn_dim=32, num_hidden_layers=1, num_attention_heads=2,
        word_embed_proj_dim=16,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    assert "does not call its head once" in resolve_head(model)
    trainer = _trainer(tmp_path, model, True)
    with caplog.at_level(logging.WARNING, logger="packing_hf.integrations.loss_policy"):
        assert trainer.loss_policy.chunked_head(trainer, model) is None
        assert trainer.loss_policy.chunked_head(trainer, model) is None
    said = [r.getMessage() for r in caplog.records if "chunked_loss" in r.getMessage()]
    assert len(said) == 1 and "OPTForCausalLM" in said[0], said
    opted_out = _trainer(tmp_path, _model("llama_untied"), False)
    assert opted_out.loss_policy.chunked_head(opted_out, model) is None


def _register(model, hook: str, labels: torch.Tensor):
    """One of the hooks a user puts on the LM head (or on every module), by name; returns its handle."""
    head = model.lm_head
    if hook == "temperature":
        return head.register_forward_hook(lambda module, args, out: out / 0.7)
    if hook == "vocabulary_mask":  # every token that is never a target here is forbidden
        masked = torch.ones(VOCAB, dtype=torch.bool)
        masked[labels[labels != -100]] = False
        return head.register_forward_hook(lambda module, args, out: out.masked_fill(masked, float("-inf")))
    if (
        hook == "gradient_scale"
    ):  # a backward hook: the loss is unchanged, the gradients below the head are not
        return head.register_full_backward_hook(lambda module, grad_in, grad_out: (grad_in[0] * 3.0,))
    if hook == "global_temperature":  # on every module, through torch's global registry
        return torch.nn.modules.module.register_module_forward_hook(
            lambda module, args, out: out / 0.7 if module is head else None
        )
    raise ValueError(hook)


HEAD_HOOKS = ("temperature", "vocabulary_mask", "gradient_scale", "global_temperature")


def _check_hooked_head(tmp_path, hook: str, assert_close) -> None:
    """The Trainer's training loss and gradients with a hook on the LM head equal stock's (the model's own loss,
    ``model(**inputs, labels=labels)``, which calls the head and so its hooks)."""
    model = _model("llama_untied")
    inputs, labels, _ = _packed_row()
    trainer = _trainer(tmp_path, model, True)  # first: it keeps the packed samples apart in the model
    handle = _register(model, hook, labels)
    try:
        want = model(**inputs, labels=labels).loss
        want_grads = _grads(model, want)
        count = (labels[:, 1:] != -100).sum()
        got = trainer.compute_loss(model, {**inputs, "labels": labels}, num_items_in_batch=count)
        got_grads = _grads(model, got)
    finally:
        handle.remove()
    assert_close(got.detach(), want.detach(), f"{hook}: loss", rel=REL)
    assert want_grads.keys() == got_grads.keys()
    for param, grad in want_grads.items():
        assert_close(got_grads[param], grad, f"{hook}: d/d{param}", rel=REL)


@pytest.mark.parametrize("hook", HEAD_HOOKS)
def test_hooks_on_the_head_are_honoured(tmp_path, hook, assert_close):
    """The chunked head would skip the head's hooks (it reads the weight): with any, the full logits are kept."""
    _check_hooked_head(tmp_path, hook, assert_close)
    model = _model("llama_untied")
    handle = _register(model, hook, torch.tensor([[0]]))
    assert "which computing the logits in chunks would skip" in resolve_head(model)
    handle.remove()
    assert not isinstance(resolve_head(model), str)  # removed: chunked again


@pytest.mark.parametrize("hook", HEAD_HOOKS)
def test_negative_control_hooks_skipped_by_the_chunked_head_are_caught(
    tmp_path, hook, assert_close, monkeypatch
):
    monkeypatch.setattr(chunked_head, "_bypassed_calls", lambda head, engine: None)
    with pytest.raises(AssertionError, match="loss" if hook != "gradient_scale" else "d/dmodel"):
        _check_hooked_head(tmp_path, hook, assert_close)


def test_the_plan_names_the_engine_whose_hooks_the_head_may_carry(assert_close):
    """An engine's hooks on the head (DeepSpeed ZeRO-3 gathers the weight in them) are expected where the run's
    :class:`ParallelPlan` runs that engine, and nowhere else: without it they are hooks the chunked head would
    skip, so the full logits are kept. Under ZeRO-3 the chunked head runs as a call of the head (``in_calls``:
    the hooks run around it), with the loss of the head read as held."""
    model = _model("llama_untied")
    calls = []

    def gather(module, args):  # stands for DeepSpeed's pre-forward gather (ZeRO-3 registers it on every module)
        calls.append(module)

    gather.__module__ = "deepspeed.runtime.zero.parameter_offload"
    handle = model.lm_head.register_forward_pre_hook(gather)
    try:
        assert "its lm_head has forward pre-hooks" in resolve_head(model)  # no engine: a hook like any other
        assert "its lm_head has forward pre-hooks" in resolve_head(model, ParallelPlan("fsdp", 2, 2, 0))
        zero3 = resolve_head(model, ParallelPlan("deepspeed", 3, 2, 0))
        assert isinstance(zero3, ChunkedHead) and zero3.head is model.lm_head and zero3.in_calls
        zero2 = resolve_head(model, ParallelPlan("deepspeed", 2, 2, 0))
        assert isinstance(zero2, ChunkedHead) and not zero2.in_calls
        inputs, labels, weights = _packed_row()
        coefficients = target_coefficients(labels, "token", weights, inputs["position_ids"])
        calls.clear()
        in_call, _, _ = causal_lm_loss(model, inputs, labels, coefficients, zero3, chunk_size=CHUNK)
        assert len(calls) == 2  # the model's call of its head, and the chunked head's own
        calls.clear()
        held, _, _ = causal_lm_loss(model, inputs, labels, coefficients, zero2, chunk_size=CHUNK)
        assert len(calls) == 1
    finally:
        handle.remove()
    assert_close(in_call, held, "the chunked loss in a call of the head", rel=REL)


def test_a_forward_of_its_own_on_the_head_is_honoured():
    model = _model("llama_untied")
    head = model.lm_head
    head.forward = lambda x: torch.nn.Linear.forward(head, x) / 0.7  # as accelerate's device hooks replace it
    assert "a forward of its own" in resolve_head(model)


def _step(model, inputs, labels, weights, *, chunked: bool):
    """One packed step: the summed weighted loss (chunked head or the model's own logits) and every gradient
    (``.backward()``: reentrant checkpointing refuses ``torch.autograd.grad``)."""
    model.zero_grad(set_to_none=True)
    inputs = {
        **inputs,
        "use_cache": False,
    }  # what checkpointing forces (stock eager masks a cached call differently)
    coefficients = target_coefficients(labels, "token", weights, inputs["position_ids"])
    if chunked:
        loss, _, _ = causal_lm_loss(model, inputs, labels, coefficients, chunk_size=CHUNK)
    else:
        logits = model(**inputs).logits.float()  # (1, T, V)
        per_target = F.cross_entropy(logits[0, :-1], labels[0, 1:], reduction="none")[None]
        loss = (per_target * coefficients).sum()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _check_checkpointing(assert_close, use_reentrant: bool, corrupt=lambda: None) -> None:
    model = _model("llama_untied")
    inputs, labels, weights = _packed_row()
    want, want_grads = _step(model, inputs, labels, weights, chunked=True)
    calls = []
    # inside the checkpointed forward (the layer's own hooks stay outside; a recompute may stop early)
    model.model.layers[0].self_attn.register_forward_pre_hook(lambda *args: calls.append(1))
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": use_reentrant})
    corrupt()
    got, got_grads = _step(model, inputs, labels, weights, chunked=True)
    assert len(calls) == 2  # the layer ran again in backward: checkpointing is on
    assert_close(got, want, "checkpointed loss", rel=REL)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        assert_close(got_grads[name], grad, f"checkpointed d/d{name}", rel=REL)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_gradient_checkpointing_keeps_the_chunked_loss_and_grads(use_reentrant, assert_close):
    _check_checkpointing(assert_close, use_reentrant)


def test_negative_control_checkpointing_with_a_chunk_dropping_a_token(assert_close, monkeypatch):
    with pytest.raises(AssertionError, match="checkpointed loss"):  # only the checkpointed step drops it
        _check_checkpointing(
            assert_close, False, lambda: monkeypatch.setattr(loss_head, "_chunks", _dropping)
        )


@pytest.mark.parametrize("drop", [False, True])
def test_bf16_autocast_stays_within_bf16_noise_of_the_full_logits(drop, monkeypatch):
    """Under CPU bf16 autocast the chunked step's loss and gradients are as far from the fp32 step as the
    full-logits path's own are (bf16 rounding), not further; negative control (``drop``): a chunk loop that
    drops tokens is caught."""
    if drop:
        monkeypatch.setattr(loss_head, "_chunks", _dropping)
        with pytest.raises(AssertionError):
            _check_bf16()
    else:
        _check_bf16()


def _check_bf16() -> None:
    model = _model("llama_tied")
    inputs, labels, weights = _packed_row()
    exact, exact_grads = _step(model, inputs, labels, weights, chunked=False)  # fp32: the reference
    results = {}
    for chunked in (True, False):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results[chunked] = _step(model, inputs, labels, weights, chunked=chunked)
    (chunked_loss, chunked_grads), (full_loss, full_grads) = results[True], results[False]
    assert full_loss != exact  # autocast did round (else this compares nothing)

    def error(got, want):
        return float((got - want).abs().max() / want.abs().max())

    bf16 = 2.0**-8  # bf16 unit roundoff
    assert error(chunked_loss, exact) <= 2 * error(full_loss, exact) + bf16
    for name, grad in exact_grads.items():
        assert error(chunked_grads[name], grad) <= 2 * error(full_grads[name], grad) + bf16, name
