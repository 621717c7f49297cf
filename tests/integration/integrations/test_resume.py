"""Exact mid-epoch resume of a multipack run: a run resumed from a checkpoint consumes exactly the batches the
uninterrupted run had left (none replayed, none skipped twice), in epoch 0 and in a later epoch, and ends
with the same weights. A checkpoint whose data order cannot be reproduced is refused.
"""

from __future__ import annotations

import json
import math

import datasets
import pytest
import torch

import packing_hf
from packing_hf.integrations.trainer import SAMPLER_STATE_NAME

BUDGET, GAS, EPOCHS, VOCAB = 256, 2, 2, 128


@pytest.fixture(scope="module")
def dataset(gsm8k_tokenized):
    """30 real GSM8K rows cut to a quarter of their length, ids folded into a 128-token vocabulary."""
    rows = [row["input_ids"][: max(8, len(row["input_ids"]) // 4)] for row in gsm8k_tokenized[:30]]
    return datasets.Dataset.from_dict(
        {"input_ids": [[t % VOCAB for t in r] for r in rows], "idx": list(range(30))}
    )


def _trainer(model_factory, dataset, out_dir, collator, **overrides):
    values = dict(
        max_tokens_per_batch=BUDGET, gradient_accumulation_steps=GAS, num_train_epochs=EPOCHS,
        learning_rate=1e-3, save_strategy="steps", save_steps=1, report_to="none", use_cpu=True,
        disable_tqdm=True, logging_steps=1, seed=0,
    )  # fmt: skip
    values.update(overrides)
    args = packing_hf.TrainingArguments(str(out_dir), **values)
    model = model_factory(vocab_size=VOCAB)
    return packing_hf.Trainer(model=model, args=args, train_dataset=dataset, data_collator=collator)


def test_resume_mid_epoch_replays_nothing(tiny_llama, recording_collator, dataset, tmp_path):
    full = recording_collator()
    trainer = _trainer(tiny_llama, dataset, tmp_path / "full", full)
    per_epoch = len(trainer.get_train_dataloader())
    full.batches.clear()
    trainer.train()
    steps_per_epoch = math.ceil(per_epoch / GAS)
    assert trainer.state.global_step == EPOCHS * steps_per_epoch >= 4
    assert len(full.batches) == EPOCHS * per_epoch
    final = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}

    # a checkpoint in the middle of epoch 0, and one in the middle of epoch 1
    for step in (1, steps_per_epoch + 1):
        checkpoint = tmp_path / "full" / f"checkpoint-{step}"
        state = json.loads((checkpoint / SAMPLER_STATE_NAME).read_text())["sampler"]
        epoch, consumed = divmod(step, steps_per_epoch)
        assert (state["epoch"], state["batches_consumed"]) == (epoch, consumed * GAS)

        resumed = recording_collator()
        again = _trainer(tiny_llama, dataset, tmp_path / f"resumed{step}", resumed, save_strategy="no")
        again.train(resume_from_checkpoint=str(checkpoint))
        already = epoch * per_epoch + consumed * GAS
        assert resumed.batches == full.batches[already:], f"resume from step {step}: wrong batches"
        assert again.state.global_step == trainer.state.global_step
        for name, param in again.model.named_parameters():
            torch.testing.assert_close(param, final[name], rtol=0, atol=1e-6, msg=f"{name} after resume")


def test_resume_refuses_another_data_order(tiny_llama, recording_collator, dataset, tmp_path):
    trainer = _trainer(tiny_llama, dataset, tmp_path / "run", recording_collator(), max_steps=1)
    trainer.train()
    checkpoint = str(tmp_path / "run" / "checkpoint-1")
    changed = _trainer(
        tiny_llama, dataset, tmp_path / "other", recording_collator(), max_steps=2, max_tokens_per_batch=200,
        save_strategy="no",
    )  # fmt: skip
    with pytest.raises(ValueError, match="cannot resume the multipack data order"):
        changed.train(resume_from_checkpoint=checkpoint)
    other_seed = _trainer(
        tiny_llama,
        dataset,
        tmp_path / "seed",
        recording_collator(),
        max_steps=2,
        seed=1,
        save_strategy="no",
    )
    with pytest.raises(ValueError, match="seed"):
        other_seed.train(resume_from_checkpoint=checkpoint)
    # explicitly accepted: the data order restarts, nothing is raised
    accepted = _trainer(
        tiny_llama, dataset, tmp_path / "ok", recording_collator(), max_steps=2, max_tokens_per_batch=200,
        ignore_data_skip=True, save_strategy="no",
    )  # fmt: skip
    accepted.train(resume_from_checkpoint=checkpoint)
    assert accepted.state.global_step == 2
