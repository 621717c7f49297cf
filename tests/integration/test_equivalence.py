"""Step-0 equivalence: the same GSM8K samples as one padded batch and as packed multipack batches give the
same loss (relative difference <= 1e-6, fp32) and the same gradients (cosine >= 0.999999, in float64),
including when the packed samples are spread over several gradient-accumulation micro-batches.

Both sides go through the Trainer's own machinery (``get_batch_samples`` -> ``num_items_in_batch`` ->
``training_step``): stock ``transformers.Trainer`` on the padded batch, ``packing_hf.Trainer`` on the
packed ones.
"""

from __future__ import annotations

import copy

import datasets
import pytest
import torch
import transformers

import packing_hf


def _step(trainer, model, batches: list[dict]) -> tuple[float, torch.Tensor]:
    """One optimizer step's worth of forward/backward through the Trainer: (summed loss, flat float64 grads)."""
    model.zero_grad()
    num_items = trainer.get_batch_samples(iter(batches), len(batches), trainer.args.device)[1]
    trainer.current_gradient_accumulation_steps = len(batches)
    loss = sum(float(trainer.training_step(model, dict(batch), num_items)) for batch in batches)
    grads = torch.cat([p.grad.double().flatten() for p in model.parameters() if p.grad is not None])
    return loss, grads


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_step0_padded_equals_packed(
    gsm8k_tokenized, tokenizer, tiny_llama, recording_collator, right_padded_batch, tmp_path, micro_batches
):
    rows = [row["input_ids"] for row in gsm8k_tokenized[:6]]
    total = sum(map(len, rows))
    # one bin holding everything, or a budget that needs several micro-batches
    budget = total if micro_batches == 1 else max(map(len, rows)) + 60
    dataset = datasets.Dataset.from_dict({"input_ids": rows, "idx": list(range(len(rows)))})
    model = tiny_llama()  # fp32, no dropout
    reference = copy.deepcopy(model)

    collator = recording_collator(pad_token_id=tokenizer.pad_token_id)
    args = packing_hf.TrainingArguments(
        str(tmp_path / "packed"), max_tokens_per_batch=budget, report_to="none", use_cpu=True,
        packing_preflight="off",
    )  # fmt: skip
    packed_trainer = packing_hf.Trainer(model=model, args=args, train_dataset=dataset, data_collator=collator)
    packed_batches = list(packed_trainer.get_train_dataloader())
    assert len(packed_batches) == 1 if micro_batches == 1 else len(packed_batches) >= 2
    seen = [i for batch in collator.batches for i in batch]
    assert sorted(seen) == list(range(len(rows)))  # the padded batch holds the same samples
    for batch in packed_batches:
        batch.pop("packing_hf_stats")

    stock_args = transformers.TrainingArguments(str(tmp_path / "padded"), report_to="none", use_cpu=True)
    padded_trainer = transformers.Trainer(model=reference, args=stock_args)
    padded = right_padded_batch([rows[i] for i in seen], tokenizer.pad_token_id)

    packed_loss, packed_grads = _step(packed_trainer, model, packed_batches)
    padded_loss, padded_grads = _step(padded_trainer, reference, [padded])

    cosine = float(torch.nn.functional.cosine_similarity(packed_grads, padded_grads, dim=0))
    assert abs(packed_loss - padded_loss) / abs(padded_loss) <= 1e-6
    assert cosine >= 0.999999
    assert float((packed_grads - padded_grads).abs().max()) <= 1e-4 * float(padded_grads.abs().max())
