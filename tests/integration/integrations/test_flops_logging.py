"""Model FLOPs in the training logs of packing_hf.Trainer and SFTTrainer (real GSM8K tokens, tiny llama, CPU):
the same tokens cut into samples two ways log the same matmul FLOPs and attention FLOPs that differ exactly
as the sum of the squared sample lengths says."""

from __future__ import annotations

import datasets
import pytest

import packing_hf
from packing_hf.cost import CostModel

CUTS = {"four": [10, 20, 30, 40], "two": [30, 70]}  # the same 100 tokens, two packings


def _train_one_step(kind: str, cut: list[int], tokens: list[int], model, tokenizer, tmp_path) -> dict:
    common = dict(
        output_dir=str(tmp_path / kind), max_tokens_per_batch=128, max_steps=1, logging_steps=1,
        report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True, peak_tflops=1.0,
    )  # fmt: skip
    if kind == "trainer":  # one offline-packed row, its samples given by seq_lengths
        data = datasets.Dataset.from_dict({"input_ids": [tokens], "seq_lengths": [cut]})
        trainer = packing_hf.Trainer(
            model=model, args=packing_hf.TrainingArguments(**common), train_dataset=data
        )
    else:  # the samples themselves; multipack puts all of them in the one batch
        starts = [sum(cut[:i]) for i in range(len(cut))]
        data = datasets.Dataset.from_dict(
            {"input_ids": [tokens[s : s + n] for s, n in zip(starts, cut, strict=True)]}
        )
        trainer = packing_hf.SFTTrainer(
            model=model, args=packing_hf.SFTConfig(**common), train_dataset=data, processing_class=tokenizer
        )
    trainer.train()
    return next(h for h in trainer.state.log_history if "loss" in h)


@pytest.mark.parametrize("kind", ["trainer", "sft"])
def test_logged_attention_flops_follow_the_sum_of_squares(
    kind, gsm8k_tokenized, tokenizer, tiny_llama, tmp_path
):
    tokens = [t for row in gsm8k_tokenized for t in row["input_ids"]][:100]
    logs = {
        name: _train_one_step(kind, cut, tokens, tiny_llama(), tokenizer, tmp_path)
        for name, cut in CUTS.items()
    }
    counter = CostModel.from_config(tiny_llama().config)
    for name, cut in CUTS.items():
        squares = sum(n * n for n in cut)
        assert logs[name]["attention_flops_per_step"] == counter.quadratic * squares
        assert logs[name]["model_flops_per_step"] == counter.linear * 100 + counter.quadratic * squares
        # negative control: the whole row as one sequence (T**2) is not what is logged
        assert logs[name]["attention_flops_per_step"] != counter.quadratic * 100**2
        assert logs[name]["step_seconds_p50"] > 0 and logs[name]["model_tflops_per_s"] > 0
        assert logs[name]["mfu"] == pytest.approx(logs[name]["model_tflops_per_s"] / 1.0, rel=1e-12)
    difference = logs["two"]["attention_flops_per_step"] - logs["four"]["attention_flops_per_step"]
    assert difference == counter.quadratic * (30**2 + 70**2 - 10**2 - 20**2 - 30**2 - 40**2)
    assert logs["two"]["model_flops_per_step"] - logs["four"]["model_flops_per_step"] == difference
