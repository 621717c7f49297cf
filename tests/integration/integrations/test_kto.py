"""packing_hf.KTOTrainer against stock trl.KTOTrainer on padded batches: same log-probs, KL, loss, gradients.

GSM8K examples (the reference answer is desirable, its lines reversed undesirable), tokenized by TRL with the
SmolLM2 tokenizer; tiny llamas (fp32) loaded twice with the same weights: sdpa for the stock padded run,
packing_hf's varlen attention for the packed run; a reference model unlike the policy.
"""

from __future__ import annotations

import datasets
import pytest
import torch
from transformers import TrainerCallback

trl = pytest.importorskip("trl")

import packing_hf  # noqa: E402
from packing_hf.integrations.kto import KTOConfig, KTOTrainer  # noqa: E402
from packing_hf.unpaired import ROW_KEYS, PaddingFreeUnpairedCollator  # noqa: E402

REL = 1e-5
MAX_LENGTH = 160

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def examples(gsm8k_rows):
    rows = [r for r in gsm8k_rows(300) if len(r["question"]) + len(r["answer"]) < 300]

    def build(n: int) -> datasets.Dataset:
        picked = rows[:n]
        return datasets.Dataset.from_dict(
            {
                "prompt": [f"Question: {r['question']}\nAnswer:" for r in picked],
                "completion": [
                    " " + (r["answer"] if i % 3 else "\n".join(reversed(r["answer"].split("\n"))))
                    for i, r in enumerate(picked)
                ],
                "label": [bool(i % 3) for i in range(n)],
            }
        )

    return build


@pytest.fixture(scope="module")
def twins(tiny_llama):
    def build(seed: int = 0):
        stock = tiny_llama(seed=seed)
        packed = tiny_llama(attn_implementation=packing_hf.register_attention())
        packed.load_state_dict(stock.state_dict())
        return stock, packed

    return build


def _common(tmp_path, name: str, **overrides) -> dict:
    defaults = dict(
        output_dir=str(tmp_path / name),
        per_device_train_batch_size=4,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        max_steps=1,
        seed=0,
        bf16=False,  # TRL defaults to bf16 autocast, even on CPU; exactness is measured in fp32
        max_length=MAX_LENGTH,
    )
    return {**defaults, **overrides}


def _build(tmp_path, tokenizer, twins, data, **config):
    policy_stock, policy_packed = twins()
    ref_stock, ref_packed = (None, None) if config.get("precompute_ref_log_probs") else twins(seed=1)
    stock = trl.KTOTrainer(
        model=policy_stock,
        ref_model=ref_stock,
        args=trl.KTOConfig(**_common(tmp_path, "stock", **config)),
        train_dataset=data(),
        processing_class=tokenizer,
    )
    packed = KTOTrainer(
        model=policy_packed,
        ref_model=ref_packed,
        args=KTOConfig(**_common(tmp_path, "packed", **config)),
        train_dataset=data(),
        processing_class=tokenizer,
    )
    return stock, packed


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    scale = float(want.abs().max()) or 1.0
    assert float((got - want).abs().max()) <= REL * scale, f"{what}: {got} vs {want}"


def _terms(key: str, metrics: dict, beta: float) -> list[float]:
    """The magnitudes a logged ``key`` is a small difference of (``assert_close``'s ``terms``): a reward is
    beta x (policy - reference) summed log-probs, the margin a difference of two rewards, the KL a mean of
    policy - reference log-probs of the mismatched completions (log-probs of the same size, ~800 here): all
    cancel sums of log-probs, and the KL is 0 when the policy is its reference."""
    prefix = "eval_" if key.startswith("eval_") else ""
    logps = [metrics[prefix + k] for k in ("logps/chosen", "logps/rejected") if prefix + k in metrics]
    if key[len(prefix) :] in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        return [beta * value for value in logps]
    return logps if key[len(prefix) :] == "kl" else []


def _loss_and_grads(trainer, batch):
    trainer.model.train()
    trainer.model.zero_grad()
    for values in trainer._metrics["train"].values():
        values.clear()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])
    metrics = {k: torch.tensor(v, dtype=torch.float64) for k, v in trainer._metrics["train"].items()}
    return loss.detach(), grads, metrics


def _kl_logps(trainer, batch):
    """The policy's per-example log-probs of the mismatched (KL) completions, ``(B,)``."""
    if isinstance(trainer, KTOTrainer):
        trainer._install_packed_forward(trainer.model)
        trainer._kl_rows = {k[3:]: v for k, v in batch.items() if k.startswith("KL_") and k[3:] in ROW_KEYS}
    try:
        return trainer._compute_kl_logps(trainer.model, batch)
    finally:
        trainer._kl_rows = None


def _one_step(stock, packed, collator=None):
    rows = [stock.train_dataset[i] for i in range(4)]
    for i, row in enumerate(rows):  # the same tokenization and KL completions
        assert all(packed.train_dataset[i][k] == v for k, v in row.items() if k.endswith("_ids"))
    padded = stock._prepare_inputs(stock.data_collator(rows))
    batch = packed._prepare_inputs((collator or packed.data_collator)(rows))
    kl = (_kl_logps(packed, batch), _kl_logps(stock, padded)) if "KL_input_ids" in padded else None
    return _loss_and_grads(packed, batch), _loss_and_grads(stock, padded), padded, batch, kl


@pytest.mark.parametrize(
    "config",
    [{"loss_type": "kto"}, {"loss_type": "apo_zero_unpaired"}, {"precompute_ref_log_probs": True}],
    ids=["kto", "apo_zero_unpaired", "precomputed_reference"],
)
def test_loss_gradients_and_metrics_match_stock(tmp_path, tokenizer, twins, examples, config, assert_close):
    stock, packed = _build(tmp_path, tokenizer, twins, lambda: examples(8), **config)
    (loss_p, grads_p, metrics_p), (loss_s, grads_s, metrics_s), padded, batch, kl = _one_step(stock, packed)
    if kl is not None:
        assert kl[1].shape == (4,)
        _close(*kl, "KL log-probs")
    for key in ("input_ids", "attention_mask", "completion_mask", "KL_input_ids", "label", "ref_logps"):
        if key in padded:
            assert torch.equal(batch[key], padded[key]), key  # TRL's padded layout, exactly
    assert batch["packed_input_ids"].numel() < padded["input_ids"].numel()
    _close(loss_p, loss_s, "loss")
    _close(grads_p, grads_s, "gradients")
    assert (
        metrics_p.keys() == metrics_s.keys() and {"kl", "logps/chosen", "logits/rejected"} <= metrics_s.keys()
    )
    for key, want in metrics_s.items():
        terms = _terms(key, metrics_s, stock.args.beta)
        assert_close(metrics_p[key], want, f"metric {key}", rel=REL, terms=terms)


class _OneSequence(PaddingFreeUnpairedCollator):
    """Negative control: every packed row run as one sequence (no boundaries between the examples)."""

    def __call__(self, features, return_tensors=None):
        batch = super().__call__(features, return_tensors)
        for prefix in ("", "KL_"):
            total = batch[prefix + "packed_input_ids"].shape[1]
            batch[prefix + "position_ids"] = torch.arange(total)[None]
            batch[prefix + "cu_seq_lens_q"] = batch[prefix + "cu_seq_lens_k"] = torch.tensor(
                [0, total], dtype=torch.int32
            )
            batch[prefix + "max_length_q"] = batch[prefix + "max_length_k"] = total
        return batch


def test_negative_control_rows_without_boundaries_are_caught(tmp_path, tokenizer, twins, examples):
    stock, packed = _build(tmp_path, tokenizer, twins, lambda: examples(8))
    control = _OneSequence(max_length=MAX_LENGTH, overflow="truncate", pad_token_id=tokenizer.pad_token_id)
    (loss_p, grads_p, metrics_p), (loss_s, grads_s, metrics_s), _, _, kl = _one_step(stock, packed, control)
    with pytest.raises(AssertionError):
        _close(*kl, "KL log-probs")
    with pytest.raises(AssertionError):
        _close(metrics_p["logps/chosen"], metrics_s["logps/chosen"], "completion log-probs")
    with pytest.raises(AssertionError):
        _close(loss_p, loss_s, "loss")
    with pytest.raises(AssertionError):
        _close(grads_p, grads_s, "gradients")


class _GradientProbe(TrainerCallback):
    def __init__(self):
        self.grads = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append(
            torch.cat([p.grad.flatten().clone() for p in model.parameters() if p.grad is not None])
        )


def test_gradient_accumulation_training_matches_stock(tmp_path, tokenizer, twins, examples, assert_close):
    config = dict(
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=1,
        optim="sgd",
        learning_rate=0.05,
        logging_steps=1,
    )
    stock, packed = _build(tmp_path, tokenizer, twins, lambda: examples(4), **config)
    probes = []
    for trainer in (stock, packed):
        probes.append(_GradientProbe())
        trainer.add_callback(probes[-1])
        trainer.train()
    (grads_s,), (grads_p,) = (probe.grads for probe in probes)
    _close(grads_p, grads_s, "accumulated gradient")
    logs = [next(h for h in t.state.log_history if "loss" in h) for t in (stock, packed)]
    for key, want in logs[0].items():
        if isinstance(want, float) and key not in ("learning_rate", "epoch") and "per_second" not in key:
            terms = _terms(key, logs[0], stock.args.beta)
            assert_close(logs[1][key], want, f"logged {key}", rel=REL, terms=terms)
    params = [torch.cat([p.detach().flatten() for p in t.model.parameters()]) for t in (stock, packed)]
    _close(params[1], params[0], "parameters after one SGD step")


def test_multipack_budget_trains(tmp_path, tokenizer, twins, examples):
    (_, model), (_, ref) = twins(), twins(seed=1)
    args = KTOConfig(
        **_common(tmp_path, "multipack", max_tokens_per_batch=500, train_sampling_strategy="sequential")
    )
    trainer = KTOTrainer(
        model=model, ref_model=ref, args=args, train_dataset=examples(8), processing_class=tokenizer
    )
    lengths = trainer._multipack_lengths_of(trainer.train_dataset)
    assert lengths.shape == (8,) and (lengths <= 2 * MAX_LENGTH).all()
    batch = next(iter(trainer.get_train_dataloader()))
    assert batch["packed_input_ids"].numel() + batch["KL_packed_input_ids"].numel() <= 500
    assert trainer.train().global_step == 1


@pytest.mark.parametrize(
    "options, match",
    [
        ({"use_liger_kernel": True}, "use_liger_kernel"),
        ({"pad_to_multiple_of": 8}, "pad_to_multiple_of"),
    ],
)
def test_refusals_name_the_option(tmp_path, tokenizer, twins, examples, options, match):
    _, model = twins()
    with pytest.raises(ValueError, match=match):
        KTOTrainer(
            model=model, args=KTOConfig(**_common(tmp_path, "refused", **options)), train_dataset=examples(4),
            processing_class=tokenizer,
        )  # fmt: skip


def test_refusals_of_vision_data_and_padded_collators(tmp_path, tokenizer, twins, examples):
    _, model = twins()
    args = KTOConfig(**_common(tmp_path, "refused"))
    images = examples(4).add_column("images", [[None]] * 4)
    with pytest.raises(ValueError, match="vision"):
        KTOTrainer(model=model, args=args, train_dataset=images, processing_class=tokenizer)
    padded = trl.trainer.kto_trainer.DataCollatorForUnpairedPreference(pad_token_id=0)
    with pytest.raises(ValueError, match="does not pack"):
        KTOTrainer(
            model=model,
            args=args,
            data_collator=padded,
            train_dataset=examples(4),
            processing_class=tokenizer,
        )
    with pytest.raises(ValueError, match="compute_metrics"):
        KTOTrainer(
            model=model, args=args, train_dataset=examples(4), processing_class=tokenizer,
            compute_metrics=lambda p: {},
        )  # fmt: skip


def test_evaluation_matches_stock(tmp_path, tokenizer, twins, examples, assert_close):
    stock, packed = _build(tmp_path, tokenizer, twins, lambda: examples(4), per_device_eval_batch_size=4)
    results = [t.evaluate(examples(4)) for t in (stock, packed)]
    assert {"eval_loss", "eval_kl", "eval_logps/chosen"} <= results[0].keys()
    for key, want in results[0].items():
        if key not in ("eval_runtime", "eval_samples_per_second", "eval_steps_per_second", "epoch"):
            terms = _terms(key, results[0], stock.args.beta)
            assert_close(results[1][key], want, f"evaluation {key}", rel=REL, terms=terms)
