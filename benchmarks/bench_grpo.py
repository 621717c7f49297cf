"""Stock padded (trl.GRPOTrainer) vs packed vs packed + shared prompt (packing_hf.GRPOTrainer), GRPO on CPU.

What is timed: the training forward + backward of GRPO micro-batches, through the trainers' own
``compute_loss`` (TRL's loss, ``loss_type="dapo"``, on the per-token log-probs of the policy) and
``loss.backward()``. Generation is not timed and not run: every micro-batch holds ``--prompts`` GSM8K
questions (train split, ``Question: ...\\nAnswer:``, SmolLM2 tokenizer) with ``G = --generations``
completions each, whose **lengths are synthetic**: the token count of a random GSM8K reference answer times
a log-normal factor (sigma 0.35), capped at ``--max-completion`` (256; capped completions have no EOS),
filled with random token ids. This gives the spread of real GRPO groups (here median ~110 tokens, from ~20
to the cap) without sampling from an untrained model. Advantages are random. The same micro-batches, in
the same order, go to every contender.

Contenders (each in its own subprocess, so the peak RSS is its own; alternating order over rounds):
``padded`` (stock TRL: left-padded prompts + right-padded completions, sdpa), ``packed`` (every rollout one
segment of a packed row, packing_hf's varlen attention) and ``shared`` (``share_prompt=True``: each group's
prompt once, its completions as branches). Model: tiny llama from config (hidden 64, 2 layers, 4 heads / 2
KV) with the SmolLM2 vocabulary (49,152): TRL's fused LM head scores every position on CPU, so the head
dominates, as the vocabulary does for small real models.

Reported: tokens each contender computes per micro-batch (``B x (P + C)`` padded, ``G (P + R)`` packed,
``P + G (R + 1)`` shared, summed over groups), real tokens/s of forward + backward (real tokens =
``sum(P_i + R_i)``, the same numerator for all), ratios against padded measured in the same run, peak RSS
and its growth over the state before the first step, and the largest loss difference against padded.

    python benchmarks/bench_grpo.py            # ~3-4 minutes on 2 cores
    python benchmarks/bench_grpo.py --quick    # a smoke run
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import TOKENIZER_DIR, base_parser, load_gsm8k, print_table, write_json  # noqa: E402

SEED = 0
CONTENDERS = ("padded", "packed", "shared")


def make_rollouts(num_batches: int, prompts: int, generations: int, max_completion: int) -> list[dict]:
    """``num_batches`` micro-batches as token-id lists: ``{"prompts": [[...]], "completions": [[[...] x G]]}``."""
    import numpy as np
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    rows = load_gsm8k("train", limit=num_batches * prompts + 512)
    answer_lengths = np.array(
        [len(ids) for ids in tokenizer([r["answer"] for r in rows[-512:]])["input_ids"]]
    )
    rng = np.random.default_rng(SEED)
    batches = []
    for b in range(num_batches):
        questions = rows[b * prompts : (b + 1) * prompts]
        prompt_ids = tokenizer([f"Question: {r['question']}\nAnswer:" for r in questions])["input_ids"]
        completions = []
        for _ in questions:
            lengths = rng.choice(answer_lengths, generations) * rng.lognormal(0.0, 0.35, generations)
            lengths = np.clip(lengths.round().astype(int), 1, max_completion)
            group = []
            for n in lengths:
                ids = rng.integers(100, 40_000, n).tolist()
                if n < max_completion:
                    ids[-1] = tokenizer.eos_token_id
                group.append(ids)
            completions.append(group)
        batches.append({"prompts": prompt_ids, "completions": completions})
    return batches


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _padded_inputs(batch: dict, pad_id: int, generator) -> dict:
    """TRL's micro-batch layout: left-padded prompts, right-padded completions, group-ordered rows."""
    import torch
    from trl.trainer.utils import pad

    prompts = [
        torch.tensor(p)
        for p, group in zip(batch["prompts"], batch["completions"], strict=True)
        for _ in group
    ]
    completions = [torch.tensor(c) for group in batch["completions"] for c in group]
    completion_mask = pad([torch.ones_like(c) for c in completions], padding_value=0, padding_side="right")
    return {
        "prompt_ids": pad(prompts, padding_value=pad_id, padding_side="left"),
        "prompt_mask": pad([torch.ones_like(p) for p in prompts], padding_value=0, padding_side="left"),
        "completion_ids": pad(completions, padding_value=pad_id, padding_side="right"),
        "completion_mask": completion_mask,
        "advantages": torch.randn(len(completions), generator=generator),
        "num_items_in_batch": completion_mask.sum(),
    }


def run_contender(contender: str, batches_path: str, steps: int, out: str) -> None:
    """One contender in this process: ``steps`` timed forward + backward passes, results written to ``out``."""
    import datasets
    import torch
    import trl
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    import packing_hf

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    batches = json.loads(Path(batches_path).read_text())
    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    config = AutoConfig.for_model(
        "llama",
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    stock = contender == "padded"
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation="sdpa" if stock else packing_hf.register_attention()
    ).float()
    generations = len(batches[0]["completions"][0])
    common = dict(
        output_dir=f"/tmp/bench_grpo_{contender}",
        num_generations=generations,
        per_device_train_batch_size=generations * len(batches[0]["prompts"]),
        max_completion_length=max(len(c) for b in batches for g in b["completions"] for c in g),
        loss_type="dapo",
        beta=0.0,
        bf16=False,  # TRL's default autocast; the comparison is in fp32
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        save_strategy="no",
        seed=SEED,
    )
    if stock:
        trainer_cls, args = trl.GRPOTrainer, trl.GRPOConfig(**common)
    else:
        trainer_cls = packing_hf.GRPOTrainer
        args = packing_hf.GRPOConfig(**common, share_prompt=contender == "shared")
    trainer = trainer_cls(
        model=model,
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=args,
        train_dataset=datasets.Dataset.from_dict({"prompt": ["unused"]}),
        processing_class=tokenizer,
    )
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train; the loss reads it
    model.train()
    generator = torch.Generator().manual_seed(SEED)
    inputs = [_padded_inputs(b, tokenizer.pad_token_id, generator) for b in batches]
    rss_before = _rss_mib()
    seconds, real, losses = [], [], []
    for step in range(steps):
        batch = inputs[step % len(inputs)]
        t0 = time.perf_counter()
        loss = trainer.compute_loss(model, batch)
        loss.backward()
        seconds.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
        real.append(int(batch["prompt_mask"].sum() + batch["completion_mask"].sum()))
        losses.append(float(loss))
    stats = getattr(trainer, "packing_stats", None)
    padded_tokens = sum(int(b["prompt_ids"].numel() + b["completion_ids"].numel()) for b in inputs[:steps])
    computed = stats["packed_tokens"] if stats else padded_tokens
    Path(out).write_text(
        json.dumps(
            {
                "seconds": seconds,
                "real_tokens": real,
                "computed_tokens_per_batch": computed / steps,
                "losses": losses,
                "rss_before_mib": rss_before,
                "rss_peak_mib": _rss_mib(),
            }
        )
    )


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=2, help="prompts (groups) per micro-batch")
    parser.add_argument("--generations", type=int, default=8, help="G, completions per prompt")
    parser.add_argument("--max-completion", type=int, default=256)
    parser.add_argument("--steps", type=int, default=6, help="timed micro-batches per contender and round")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds, args.max_completion = 2, 1, 64

    batches = make_rollouts(args.steps, args.prompts, args.generations, args.max_completion)
    batches_path = "/tmp/bench_grpo_batches.json"
    Path(batches_path).write_text(json.dumps(batches))
    prompt_tokens = sum(len(p) for b in batches for p in b["prompts"])
    completion_tokens = [len(c) for b in batches for g in b["completions"] for c in g]
    results: dict[str, list[dict]] = {name: [] for name in CONTENDERS}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    for round_index in range(args.rounds):
        shift = round_index % len(CONTENDERS)
        for contender in CONTENDERS[shift:] + CONTENDERS[:shift]:  # interleaved, rotating order
            out = f"/tmp/bench_grpo_{contender}_{round_index}.json"
            command = [sys.executable, __file__, "--_contender", contender, "--_out", out]
            command += ["--_batches", batches_path, "--steps", str(args.steps)]
            subprocess.run(command, env=env, check=True, capture_output=True)
            results[contender].append(json.loads(Path(out).read_text()))
            print(f"round {round_index}: {contender} done", flush=True)

    summary = {}
    for contender, runs in results.items():
        rates = [sum(r["real_tokens"]) / sum(r["seconds"]) for r in runs]
        summary[contender] = {
            "real_tokens_per_s": statistics.median(rates),
            "real_tokens_per_s_runs": rates,
            "step_s_median": statistics.median(s for r in runs for s in r["seconds"]),
            "computed_tokens_per_batch": runs[0]["computed_tokens_per_batch"],
            "rss_peak_mib": max(r["rss_peak_mib"] for r in runs),
            "rss_growth_mib": max(r["rss_peak_mib"] - r["rss_before_mib"] for r in runs),
            "losses": runs[0]["losses"],
        }
    base = summary["padded"]
    rows = []
    for name, s in summary.items():
        s["speedup_vs_padded"] = s["real_tokens_per_s"] / base["real_tokens_per_s"]
        s["computed_tokens_vs_padded"] = s["computed_tokens_per_batch"] / base["computed_tokens_per_batch"]
        s["max_abs_loss_difference_vs_padded"] = max(
            abs(a - b) for a, b in zip(s["losses"], base["losses"], strict=True)
        )
        rows.append(
            {
                "contender": name,
                "computed_tokens/batch": round(s["computed_tokens_per_batch"]),
                "vs_padded": round(s["computed_tokens_vs_padded"], 3),
                "real_tok/s": round(s["real_tokens_per_s"], 1),
                "speedup": round(s["speedup_vs_padded"], 2),
                "step_s": round(s["step_s_median"], 3),
                "rss_peak_MiB": round(s["rss_peak_mib"], 1),
                "rss_growth_MiB": round(s["rss_growth_mib"], 1),
                "max|dloss|": s["max_abs_loss_difference_vs_padded"],
            }
        )
    print_table(rows, list(rows[0]))
    g = args.generations
    groups = args.steps * args.prompts
    token_counts = {
        "G(P+R)": g * prompt_tokens + sum(completion_tokens),
        "P+G(R+1)": prompt_tokens + sum(completion_tokens) + len(completion_tokens),
        "P+GR": prompt_tokens + sum(completion_tokens),
    }
    print(
        f"{groups} groups of G={g}: mean prompt {prompt_tokens / groups:.1f} tokens, completions median "
        f"{statistics.median(completion_tokens)} (min {min(completion_tokens)}, max {max(completion_tokens)}); "
        f"tokens G(P+R) = {token_counts['G(P+R)']} -> shared P+G(R+1) = {token_counts['P+G(R+1)']} "
        f"({token_counts['P+G(R+1)'] / token_counts['G(P+R)']:.3f}x; the ideal P+GR = {token_counts['P+GR']})"
    )
    write_json(
        "grpo",
        {
            "config": {
                "prompts_per_batch": args.prompts,
                "generations": g,
                "max_completion": args.max_completion,
                "steps": args.steps,
                "rounds": args.rounds,
                "model": "llama from_config hidden 64, 2 layers, 4 heads / 2 KV, SmolLM2 vocabulary (49,152)",
                "data": "GSM8K train questions; synthetic completion lengths (GSM8K answer lengths x lognormal "
                "factor, capped), random token ids",
                "timed": "compute_loss (dapo, beta=0) + backward of one micro-batch, fp32, CPU",
            },
            "token_counts": token_counts,
            "completion_lengths": completion_tokens,
            "summary": summary,
        },
        args,
    )


if __name__ == "__main__":
    if "--_contender" in sys.argv:
        import argparse

        inner = argparse.ArgumentParser()
        inner.add_argument("--_contender")
        inner.add_argument("--_out")
        inner.add_argument("--_batches")
        inner.add_argument("--steps", type=int)
        a = inner.parse_args()
        run_contender(a._contender, a._batches, a.steps, a._out)
    else:
        main()
