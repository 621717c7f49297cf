"""packing_hf.RewardTrainer against stock trl.RewardTrainer on padded pairs: same scores, loss, gradients.

GSM8K pairs (the reference answer vs. its lines reversed) with an explicit prompt, tokenized by TRL with
the SmolLM2 tokenizer (whose pad token is its EOS: stock scores the last token that is not the pad id,
and so must the packed run); one tiny llama sequence classifier (fp32, one score) loaded twice with the
same weights: sdpa for the stock padded run, packing_hf's varlen attention for the packed run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import datasets
import pytest
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, TrainerCallback

trl = pytest.importorskip("trl")

import packing_hf  # noqa: E402
from packing_hf.integrations.reward import RewardConfig, RewardTrainer  # noqa: E402
from packing_hf.preference import PaddingFreeRewardCollator  # noqa: E402

REL = 1e-5

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def pairs(gsm8k_rows):
    short = [r for r in gsm8k_rows(400) if len(r["question"]) < 160 and len(r["answer"]) < 250]

    def build(n: int, margin: bool = False) -> datasets.Dataset:
        rows = short[:n]
        data = {
            "prompt": [f"Question: {r['question']}\nAnswer:" for r in rows],
            "chosen": [" " + r["answer"] for r in rows],
            "rejected": [" " + "\n".join(reversed(r["answer"].split("\n"))) for r in rows],
        }
        if margin:
            data["margin"] = [0.25 * (i % 3) for i in range(n)]
        return datasets.Dataset.from_dict(data)

    return build


@pytest.fixture(scope="module")
def twins(tokenizer):
    def build(seed: int = 0):
        config = AutoConfig.for_model(
            "llama", vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, num_labels=1,
        )  # fmt: skip
        torch.manual_seed(seed)
        stock = AutoModelForSequenceClassification.from_config(config, attn_implementation="sdpa").float()
        packed = AutoModelForSequenceClassification.from_config(
            config, attn_implementation=packing_hf.register_attention()
        ).float()
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
        bf16=False,
        max_length=256,
    )
    return {**defaults, **overrides}


def _build(tmp_path, tokenizer, twins, data, **config):
    stock_model, packed_model = twins()
    stock = trl.RewardTrainer(
        model=stock_model,
        args=trl.RewardConfig(**_common(tmp_path, "stock", **config)),
        train_dataset=data(),
        processing_class=tokenizer,
    )
    packed = RewardTrainer(
        model=packed_model,
        args=RewardConfig(**_common(tmp_path, "packed", **config)),
        train_dataset=data(),
        processing_class=tokenizer,
    )
    return stock, packed


def _close(got, want, what):
    scale = float(want.abs().max()) or 1.0
    assert float((got - want).abs().max()) <= REL * scale, f"{what}: {got} vs {want}"


def _loss_grads_logits(trainer, batch):
    trainer.model.train()
    trainer.model.zero_grad()
    loss, outputs = trainer.compute_loss(trainer.model, dict(batch), return_outputs=True)
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])
    return loss.detach(), grads, outputs.logits.detach()


def test_scores_loss_gradients_and_metrics_match_stock(tmp_path, tokenizer, twins, pairs):
    stock, packed = _build(
        tmp_path, tokenizer, twins, lambda: pairs(4, margin=True), center_rewards_coefficient=0.01
    )
    rows = [stock.train_dataset[i] for i in range(4)]
    padded_batch = stock._prepare_inputs(stock.data_collator(rows))
    packed_batch = packed._prepare_inputs(packed.data_collator(rows))
    assert packed_batch["packed_input_ids"].numel() < padded_batch["input_ids"].numel()
    assert torch.equal(packed_batch["input_ids"], padded_batch["input_ids"])  # the same padded layout
    loss_p, grads_p, logits_p = _loss_grads_logits(packed, packed_batch)
    loss_s, grads_s, logits_s = _loss_grads_logits(stock, padded_batch)
    assert logits_p.shape == logits_s.shape == (8, 1)
    _close(logits_p, logits_s, "scores")
    _close(loss_p, loss_s, "loss")
    _close(grads_p, grads_s, "gradients")
    for key, values in stock._metrics["train"].items():
        got, want = torch.tensor(packed._metrics["train"][key]), torch.tensor(values)
        assert torch.allclose(got, want, rtol=REL, atol=1e-6), f"metric {key}: {got} vs {want}"

    # negative control: scores read at every sequence's last token (its EOS, the pad id here) instead of where
    # stock pools (the last token that is not the pad id) fail the same check
    config = packed.model.config
    pad, config.pad_token_id = config.pad_token_id, -1
    try:
        with torch.no_grad():
            scores = packed.model(
                **{k: v for k, v in packed_batch.items() if k != "margin"}, use_cache=False
            ).logits
    finally:
        config.pad_token_id = pad
    with pytest.raises(AssertionError):
        _close(scores, logits_s, "scores at the EOS")


class _GradientProbe(TrainerCallback):
    def __init__(self):
        self.grads = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append(
            torch.cat([p.grad.flatten().clone() for p in model.parameters() if p.grad is not None])
        )


def test_gradient_accumulation_training_matches_stock(tmp_path, tokenizer, twins, pairs):
    config = dict(
        per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2, optim="sgd",
        learning_rate=0.05, logging_steps=1,
    )  # fmt: skip
    stock, packed = _build(tmp_path, tokenizer, twins, lambda: pairs(8), **config)
    probes = []
    for trainer in (stock, packed):
        probes.append(_GradientProbe())
        trainer.add_callback(probes[-1])
        trainer.train()
    grads_s, grads_p = (probe.grads for probe in probes)
    assert len(grads_s) == len(grads_p) == 2
    for step, (g_p, g_s) in enumerate(zip(grads_p, grads_s, strict=True)):
        _close(g_p, g_s, f"accumulated gradient of step {step}")
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (stock, packed)]
    _close(torch.tensor(losses[1]), torch.tensor(losses[0]), "logged losses")


@dataclass
class _Recording(PaddingFreeRewardCollator):
    batches: list = field(default_factory=list, init=False, repr=False)

    def __call__(self, features, return_tensors=None):
        self.batches.append([len(f["chosen_ids"]) + len(f["rejected_ids"]) for f in features])
        return super().__call__(features, return_tensors)


def test_multipack_keeps_pairs_whole_within_the_budget(tmp_path, tokenizer, twins, pairs):
    _, model = twins()
    collator = _Recording()
    budget = 600
    trainer = RewardTrainer(
        model=model,
        args=RewardConfig(
            **_common(tmp_path, "multipack", max_steps=-1, num_train_epochs=1), max_tokens_per_batch=budget
        ),
        data_collator=collator,
        train_dataset=pairs(12),
        processing_class=tokenizer,
    )
    trainer.train()
    assert sum(len(b) for b in collator.batches) == 12  # every pair once, both sequences together
    assert all(sum(b) <= budget for b in collator.batches)
    assert len(collator.batches) == trainer.state.global_step < 12


def test_prompt_only_dataset_and_padded_collator_are_refused(tmp_path, tokenizer, twins, pairs):
    _, model = twins()
    with pytest.raises(ValueError, match="no \\['chosen', 'rejected'\\]"):
        RewardTrainer(
            model=model,
            args=RewardConfig(**_common(tmp_path, "refused")),
            train_dataset=pairs(2).remove_columns(["chosen", "rejected"]),
            processing_class=tokenizer,
        )
    with pytest.raises(ValueError, match="does not pack reward pairs"):
        RewardTrainer(
            model=model,
            args=RewardConfig(**_common(tmp_path, "refused")),
            data_collator=trl.trainer.reward_trainer.DataCollatorForPreference(pad_token_id=0),
            train_dataset=pairs(2),
            processing_class=tokenizer,
        )
