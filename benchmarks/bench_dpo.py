"""Padded (stock trl.DPOTrainer) vs packed (packing_hf.DPOTrainer) DPO on real preference pairs, CPU.

Pairs come from GSM8K (train split): the reference answer is ``chosen``, the same answer with its lines in
reverse order (the final ``#### n`` first) is ``rejected``; tokenized by TRL with the SmolLM2 tokenizer.
Both contenders train the same tiny llama (fp32, same initial weights) on the same batches of pairs in
the same order, with reference log-probs precomputed, AdamW: stock pads every batch to ``2B x longest``
and runs sdpa; packed runs one ``[1, T]`` row with packing_hf's varlen attention. Every contender runs in
its own subprocess (so its peak RSS is its own), the contenders alternate, and the rounds are repeated.

Reported per contender: real tokens/s of the training steps (forward + backward + optimizer step,
median over rounds), peak RSS of the process and its growth over the state before the first step, and
the per-step losses; the table gives packed/padded ratios and the largest loss difference.

    python benchmarks/bench_dpo.py            # ~3-5 minutes on 2 cores
    python benchmarks/bench_dpo.py --quick    # a smoke run
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

from _common import DATA_DIR, TOKENIZER_DIR, base_parser, print_table, write_json  # noqa: E402

SEED = 0


def _pairs(n: int):
    import datasets

    rows = []
    with open(DATA_DIR / "gsm8k_train.jsonl") as f:
        for line in f:
            rows.append(json.loads(line))
            if len(rows) == n:
                break
    return datasets.Dataset.from_dict(
        {
            "prompt": [f"Question: {r['question']}\nAnswer:" for r in rows],
            "chosen": [" " + r["answer"] for r in rows],
            "rejected": [" " + "\n".join(reversed(r["answer"].split("\n"))) for r in rows],
        }
    )


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def run_contender(contender: str, num_pairs: int, batch_pairs: int, steps: int, out: str) -> None:
    """One contender in this process: set up, train ``steps`` steps, write timings/losses/memory to ``out``."""
    import numpy as np
    import torch
    import trl
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    import packing_hf
    from packing_hf.integrations.dpo import DPOConfig, DPOTrainer

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
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
    packed = contender == "packed"
    attn = packing_hf.register_attention() if packed else "sdpa"
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn).float()
    trainer_cls, config_cls = (DPOTrainer, DPOConfig) if packed else (trl.DPOTrainer, trl.DPOConfig)
    args = config_cls(
        output_dir=f"/tmp/bench_dpo_{contender}",
        per_device_train_batch_size=batch_pairs,
        precompute_ref_log_probs=True,
        max_length=1024,
        bf16=False,  # TRL's default autocast; the comparison is in fp32
        gradient_checkpointing=False,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        save_strategy="no",
        seed=SEED,
    )
    trainer = trainer_cls(model=model, args=args, train_dataset=_pairs(num_pairs), processing_class=tokenizer)
    data = trainer.train_dataset
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-4)
    order = np.random.default_rng(SEED).permutation(len(data))
    model.train()
    rss_before = _rss_mib()
    seconds, tokens, losses = [], [], []
    for step in range(steps):
        start = (step * batch_pairs) % len(data)
        indices = [int(i) for i in order[start : start + batch_pairs]]
        t0 = time.perf_counter()
        batch = trainer._prepare_inputs(trainer.data_collator([data[i] for i in indices]))
        loss = trainer.compute_loss(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - t0)
        tokens.append(int(batch["attention_mask"].sum()))
        losses.append(float(loss))
    computed = int(batch["packed_input_ids"].numel()) if packed else int(batch["input_ids"].numel())
    Path(out).write_text(
        json.dumps(
            {
                "seconds": seconds,
                "tokens": tokens,
                "losses": losses,
                "rss_before_mib": rss_before,
                "rss_peak_mib": _rss_mib(),
                "last_batch_computed_tokens": computed,
            }
        )
    )


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=48)
    parser.add_argument("--batch-pairs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if args.quick:
        args.pairs, args.steps, args.rounds = 16, 3, 1

    results: dict[str, list[dict]] = {"padded": [], "packed": []}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    for round_index in range(args.rounds):
        order = ("padded", "packed") if round_index % 2 == 0 else ("packed", "padded")
        for contender in order:
            out = f"/tmp/bench_dpo_{contender}_{round_index}.json"
            command = [sys.executable, __file__, "--_contender", contender, "--_out", out]
            command += [
                "--pairs",
                str(args.pairs),
                "--batch-pairs",
                str(args.batch_pairs),
                "--steps",
                str(args.steps),
            ]
            subprocess.run(command, env=env, check=True, capture_output=True)
            results[contender].append(json.loads(Path(out).read_text()))
            print(f"round {round_index}: {contender} done", flush=True)

    summary = {}
    for contender, runs in results.items():
        rates = [sum(r["tokens"]) / sum(r["seconds"]) for r in runs]
        summary[contender] = {
            "tokens_per_s": statistics.median(rates),
            "tokens_per_s_runs": rates,
            "step_s_median": statistics.median(s for r in runs for s in r["seconds"]),
            "rss_peak_mib": max(r["rss_peak_mib"] for r in runs),
            "rss_growth_mib": max(r["rss_peak_mib"] - r["rss_before_mib"] for r in runs),
            "losses": runs[0]["losses"],
        }
    padded, packed = summary["padded"], summary["packed"]
    loss_diff = max(abs(a - b) for a, b in zip(padded["losses"], packed["losses"], strict=True))
    runs_agree = all(r["losses"] == results["packed"][0]["losses"] for r in results["packed"])
    real = sum(results["padded"][0]["tokens"])
    rows = [
        {
            "contender": name,
            "tokens_per_s": round(s["tokens_per_s"], 1),
            "step_s": round(s["step_s_median"], 3),
            "rss_peak_MiB": round(s["rss_peak_mib"], 1),
            "rss_growth_MiB": round(s["rss_growth_mib"], 1),
            "final_loss": round(s["losses"][-1], 5),
        }
        for name, s in summary.items()
    ]
    print_table(rows, list(rows[0]))
    ratios = {
        "tokens_per_s_packed_over_padded": packed["tokens_per_s"] / padded["tokens_per_s"],
        "rss_growth_packed_over_padded": packed["rss_growth_mib"] / padded["rss_growth_mib"],
        "max_abs_loss_difference": loss_diff,
        "packed_runs_identical": runs_agree,
    }
    print(
        f"packed/padded tokens/s: {ratios['tokens_per_s_packed_over_padded']:.2f}x   RSS growth: "
        f"{ratios['rss_growth_packed_over_padded']:.2f}x   max |loss difference| over {len(packed['losses'])} "
        f"steps: {loss_diff:.2e}   ({real} real tokens per run)"
    )
    write_json(
        "dpo",
        {
            "config": {
                "pairs": args.pairs,
                "batch_pairs": args.batch_pairs,
                "steps": args.steps,
                "rounds": args.rounds,
                "model": "llama from_config hidden 64, 2 layers, 4 heads / 2 KV, SmolLM2 vocabulary (49,152)",
                "data": "GSM8K train: chosen = answer, rejected = answer lines reversed",
            },
            "summary": summary,
            "ratios": ratios,
        },
        args,
    )


if __name__ == "__main__":
    if "--_contender" in sys.argv:
        import argparse

        inner = argparse.ArgumentParser()
        inner.add_argument("--_contender")
        inner.add_argument("--_out")
        inner.add_argument("--pairs", type=int)
        inner.add_argument("--batch-pairs", type=int)
        inner.add_argument("--steps", type=int)
        a = inner.parse_args()
        run_contender(a._contender, a.pairs, a.batch_pairs, a.steps, a._out)
    else:
        main()
