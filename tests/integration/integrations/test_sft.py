"""packing_hf.SFTTrainer on real GSM8K data (SmolLM2 tokenizer and its ChatML chat template), tiny llama, CPU.

Stock TRL refuses a custom collator in padding-free mode; the subclass accepts it, TRL's bfd-packed rows
(``seq_lengths``) become one ``cu_seq_lens`` segment per packed sample, completion-only masks survive into
the batches, a conversational dataset trains with multipack, the loss decreases and parameters change.
"""

from __future__ import annotations

import datasets
import pytest
import torch

trl = pytest.importorskip("trl")

import packing_hf  # noqa: E402


def _config(tmp_path, **overrides) -> packing_hf.SFTConfig:
    values = dict(
        output_dir=str(tmp_path / "sft"), report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True,
        logging_steps=1, seed=0, learning_rate=3e-3, num_train_epochs=1,
    )  # fmt: skip
    values.update(overrides)
    return packing_hf.SFTConfig(**values)


def _expected_labels(features: list[dict]) -> torch.Tensor:
    """The prepared rows' labels, concatenated, with every packed sample's first token masked."""
    labels = []
    for feature in features:
        row = torch.tensor(feature["labels"])
        starts = torch.tensor(feature.get("seq_lengths", [len(row)])).cumsum(0) - torch.tensor(
            feature.get("seq_lengths", [len(row)])
        )
        row[starts] = -100
        labels.append(row)
    return torch.cat(labels)


def test_stock_trl_refuses_a_custom_collator_in_padding_free_mode(tokenizer, tiny_llama, tmp_path):
    data = datasets.Dataset.from_dict({"prompt": ["1+1="], "completion": ["2"]})
    config = trl.SFTConfig(
        str(tmp_path / "stock"), padding_free=True, packing=True, report_to="none", use_cpu=True
    )
    with pytest.raises(ValueError, match="custom data collator"):
        trl.SFTTrainer(
            model=tiny_llama(),
            args=config,
            train_dataset=data,
            processing_class=tokenizer,
            data_collator=packing_hf.PaddingFreeCollator(),
        )


def test_sft_bfd_packing_with_custom_collator(gsm8k_rows, tokenizer, tiny_llama, tmp_path, feature_recording_collator):
    rows = gsm8k_rows(12)
    data = datasets.Dataset.from_dict(
        {
            "prompt": [f"Question: {r['question']}\nAnswer:" for r in rows],
            "completion": [f" {r['answer']}" for r in rows],
        }
    )
    model = tiny_llama()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    collator = feature_recording_collator(pad_token_id=tokenizer.pad_token_id)
    config = _config(tmp_path, packing=True, padding_free=True, max_length=512, per_device_train_batch_size=1)
    trainer = packing_hf.SFTTrainer(
        model=model, args=config, train_dataset=data, processing_class=tokenizer, data_collator=collator
    )
    assert trainer.data_collator is collator
    prepared = trainer.train_dataset
    assert "seq_lengths" in prepared.column_names and len(prepared) < len(rows)  # TRL packed several per row

    # completion-only: TRL masked every prompt token (prompt + completion tokenize as prompt, then completion)
    prompt_tokens = sum(len(ids) for ids in tokenizer(list(data["prompt"]))["input_ids"])
    assert sum(sum(1 for t in row if t == -100) for row in prepared["labels"]) == prompt_tokens

    batch = next(iter(trainer.get_train_dataloader()))
    features = collator.features[0]
    seq_lengths = [n for f in features for n in f["seq_lengths"]]
    assert batch["cu_seq_lens_q"].tolist() == [0, *torch.tensor(seq_lengths).cumsum(0).tolist()]
    assert batch["max_length_q"] == max(seq_lengths)
    assert torch.equal(batch["labels"][0], _expected_labels(features))  # the masks survive, per packed sample

    result = trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert result.global_step == len(prepared) >= 3
    assert logs[-1]["loss"] < logs[0]["loss"] - 0.1
    assert all(0 < h["padded_batch_efficiency"] <= 1 for h in logs)
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_sft_chat_template_with_multipack(gsm8k_rows, tokenizer, tiny_llama, tmp_path, feature_recording_collator):
    """Conversational prompt/completion rendered with SmolLM2's ChatML template; multipack batches,
    completion-only loss (the system and user turns, and the assistant header, are not trained)."""
    rows = gsm8k_rows(8, offset=40)
    data = datasets.Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": r["question"]}],
                "completion": [{"role": "assistant", "content": r["answer"]}],
            }
            for r in rows
        ]
    )
    model = tiny_llama()
    collator = feature_recording_collator(pad_token_id=tokenizer.pad_token_id)
    config = _config(tmp_path, max_tokens_per_batch=700, max_length=None)
    trainer = packing_hf.SFTTrainer(
        model=model, args=config, train_dataset=data, processing_class=tokenizer, data_collator=collator
    )
    prepared = trainer.train_dataset
    for example, labels, ids in zip(data, prepared["labels"], prepared["input_ids"], strict=True):
        prompt = tokenizer.apply_chat_template(example["prompt"], add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer(prompt)["input_ids"]
        assert ids[: len(prompt_ids)] == prompt_ids and "<|im_start|>system" in prompt
        assert labels[: len(prompt_ids)] == [-100] * len(prompt_ids)
        assert labels[len(prompt_ids) :] == ids[len(prompt_ids) :]

    result = trainer.train()
    sampler = trainer._multipack_sampler
    assert result.global_step == len(sampler) >= 2
    seen = sorted(len(f["input_ids"]) for batch in collator.features for f in batch)
    assert seen == sorted(len(ids) for ids in prepared["input_ids"])  # every conversation once
    for batch in collator.features:
        assert sum(len(f["input_ids"]) for f in batch) <= 700
        assert all("labels" in f for f in batch)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs[-1]["loss"] < logs[0]["loss"]


def test_logged_entropy_and_accuracy_equal_trls_on_the_same_steps(
    gsm8k_rows, tokenizer, tiny_llama, tmp_path
):
    """The default (``logit_metrics="labelled"``: the model's own loss, metrics at the labelled tokens only)
    logs the loss, entropy and token accuracy TRL's fused LM head logs on the same steps (lr 0: same weights)."""
    rows = gsm8k_rows(8)
    data = datasets.Dataset.from_dict(
        {
            "prompt": [f"Question: {r['question']}\nAnswer:" for r in rows],
            "completion": [f" {r['answer']}" for r in rows],
        }
    )
    logged = {}
    for mode in ("labelled", "trl"):
        config = _config(
            tmp_path / mode, logit_metrics=mode, padding_free=True, max_tokens_per_batch=512, max_length=None,
            max_steps=3, learning_rate=0.0, gradient_checkpointing=False,
        )  # fmt: skip
        trainer = packing_hf.SFTTrainer(
            model=tiny_llama(), args=config, train_dataset=data, processing_class=tokenizer
        )
        trainer.train()
        logged[mode] = [e for e in trainer.state.log_history if "entropy" in e]
    assert len(logged["labelled"]) == len(logged["trl"]) == 3
    for ours, theirs in zip(logged["labelled"], logged["trl"], strict=True):
        for key in ("loss", "entropy", "mean_token_accuracy", "num_tokens"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), key
    with pytest.raises(ValueError, match="logit_metrics must be 'labelled' or 'trl'"):
        _config(tmp_path, logit_metrics="fast")
