"""Padded (stock trl.DPOTrainer) vs packed vs packed + shared prompt (packing_hf.DPOTrainer) DPO, CPU.

Pairs come from GSM8K (train split): the reference answer is ``chosen``, the same answer with its lines in
reverse order (the final ``#### n`` first) is ``rejected``; tokenized by TRL with the SmolLM2 tokenizer.
Two prompt sets: ``short`` (the question alone, ~50 tokens) and ``long`` (three worked GSM8K examples
before the question, a few-shot prompt of ~400 tokens, as prompt-heavy preference data is).
All contenders train the same tiny llama (fp32, same initial weights) on the same batches of pairs in
the same order, with reference log-probs precomputed, AdamW: stock pads every batch to ``2B x longest``
and runs sdpa; ``packed`` runs one ``[1, T]`` row with packing_hf's varlen attention
(``shared_prompt=False``); ``shared`` holds every pair's prompt once (``shared_prompt=True``). Every
contender runs in its own subprocess (so its peak RSS is its own), the contenders alternate, and the rounds
are repeated.

Reported per contender: real tokens/s of the training steps (forward + backward + optimizer step,
median over rounds; real tokens = the tokens of both sequences of every pair, as the padded batch holds
them, so the three contenders are measured on the same work), peak RSS of the process and its growth over
the state before the first step, and the per-step losses; the table gives ratios over padded and the
largest loss difference.

    python benchmarks/bench_dpo.py            # ~10-15 minutes on 2 cores
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


CONTENDERS = ("padded", "packed", "shared")
SHOTS = 3  # worked examples before the question in the long-prompt set


def _pairs(n: int, prompts: str = "short"):
    import datasets

    rows = []
    with open(DATA_DIR / "gsm8k_train.jsonl") as f:
        for line in f:
            rows.append(json.loads(line))
            if len(rows) == n + SHOTS * n:
                break
    examples, rows = rows[n:], rows[:n]

    def prompt(i: int, r: dict) -> str:
        question = f"Question: {r['question']}\nAnswer:"
        if prompts == "short":
            return question
        shots = examples[i * SHOTS : (i + 1) * SHOTS]
        return "".join(f"Question: {e['question']}\nAnswer: {e['answer']}\n\n" for e in shots) + question

    return datasets.Dataset.from_dict(
        {
            "prompt": [prompt(i, r) for i, r in enumerate(rows)],
            "chosen": [" " + r["answer"] for r in rows],
            "rejected": [" " + "\n".join(reversed(r["answer"].split("\n"))) for r in rows],
        }
    )


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def run_contender(
    contender: str, prompts: str, num_pairs: int, batch_pairs: int, steps: int, out: str
) -> None:
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
    packed = contender != "padded"
    attn = packing_hf.register_attention() if packed else "sdpa"
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn).float()
    trainer_cls, config_cls = (DPOTrainer, DPOConfig) if packed else (trl.DPOTrainer, trl.DPOConfig)
    extra = {"shared_prompt": contender == "shared"} if packed else {}
    args = config_cls(
        **extra,
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
    data = _pairs(num_pairs, prompts)
    trainer = trainer_cls(model=model, args=args, train_dataset=data, processing_class=tokenizer)
    data = trainer.train_dataset
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-4)
    order = np.random.default_rng(SEED).permutation(len(data))
    model.train()
    rss_before = _rss_mib()
    seconds, tokens, losses, computed = [], [], [], []
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
        computed.append(int(batch["packed_input_ids" if packed else "input_ids"].numel()))
    Path(out).write_text(
        json.dumps(
            {
                "seconds": seconds,
                "tokens": tokens,
                "losses": losses,
                "rss_before_mib": rss_before,
                "rss_peak_mib": _rss_mib(),
                "computed_tokens": computed,
            }
        )
    )


def _run_set(prompts: str, args) -> dict:
    """Every contender on one prompt set, interleaved over the rounds; their summaries and ratios."""
    results: dict[str, list[dict]] = {c: [] for c in CONTENDERS}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    for round_index in range(args.rounds):
        shift = round_index % len(CONTENDERS)
        for contender in CONTENDERS[shift:] + CONTENDERS[:shift]:
            out = f"/tmp/bench_dpo_{prompts}_{contender}_{round_index}.json"
            command = [
                sys.executable,
                __file__,
                "--_contender",
                contender,
                "--_out",
                out,
                "--_prompts",
                prompts,
            ]
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
            print(f"{prompts} prompts, round {round_index}: {contender} done", flush=True)

    summary = {}
    for contender, runs in results.items():
        rates = [sum(r["tokens"]) / sum(r["seconds"]) for r in runs]
        summary[contender] = {
            "tokens_per_s": statistics.median(rates),
            "tokens_per_s_runs": rates,
            "step_s_median": statistics.median(s for r in runs for s in r["seconds"]),
            "rss_peak_mib": max(r["rss_peak_mib"] for r in runs),
            "rss_growth_mib": max(r["rss_peak_mib"] - r["rss_before_mib"] for r in runs),
            "computed_tokens_per_step": statistics.mean(runs[0]["computed_tokens"]),
            "real_tokens_per_step": statistics.mean(runs[0]["tokens"]),
            "losses": runs[0]["losses"],
        }
    padded = summary["padded"]
    rows = []
    ratios = {}
    for name, s in summary.items():
        loss_diff = max(abs(a - b) for a, b in zip(padded["losses"], s["losses"], strict=True))
        ratios[name] = {
            "tokens_per_s_over_padded": s["tokens_per_s"] / padded["tokens_per_s"],
            "rss_growth_over_padded": s["rss_growth_mib"] / padded["rss_growth_mib"],
            "max_abs_loss_difference": loss_diff,
            "runs_identical": all(r["losses"] == results[name][0]["losses"] for r in results[name]),
        }
        rows.append(
            {
                "prompts": prompts,
                "contender": name,
                "tokens_per_s": round(s["tokens_per_s"], 1),
                "x_padded": round(ratios[name]["tokens_per_s_over_padded"], 2),
                "step_s": round(s["step_s_median"], 3),
                "computed_tok/step": round(s["computed_tokens_per_step"]),
                "real_tok/step": round(s["real_tokens_per_step"]),
                "rss_peak_MiB": round(s["rss_peak_mib"], 1),
                "rss_growth_MiB": round(s["rss_growth_mib"], 1),
                "max_loss_diff": f"{loss_diff:.1e}",
            }
        )
    return {"summary": summary, "ratios": ratios, "rows": rows}


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=48)
    parser.add_argument("--batch-pairs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", choices=["short", "long", "both"], default="both")
    args = parser.parse_args()
    if args.quick:
        args.pairs, args.steps, args.rounds = 8, 2, 1

    sets = ["long", "short"] if args.prompts == "both" else [args.prompts]
    results = {prompts: _run_set(prompts, args) for prompts in sets}
    rows = [row for result in results.values() for row in result["rows"]]
    print_table(rows, list(rows[0]))
    for prompts, result in results.items():
        r = result["ratios"]
        print(
            f"{prompts} prompts: packed {r['packed']['tokens_per_s_over_padded']:.2f}x, packed + shared prompt "
            f"{r['shared']['tokens_per_s_over_padded']:.2f}x stock padded tokens/s"
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
                "data": "GSM8K train: chosen = answer, rejected = answer lines reversed; short prompts = the "
                f"question, long prompts = {SHOTS} worked examples + the question",
            },
            "results": {p: {k: v for k, v in r.items() if k != "rows"} for p, r in results.items()},
        },
        args,
    )


if __name__ == "__main__":
    if "--_contender" in sys.argv:
        import argparse

        inner = argparse.ArgumentParser()
        inner.add_argument("--_contender")
        inner.add_argument("--_out")
        inner.add_argument("--_prompts")
        inner.add_argument("--pairs", type=int)
        inner.add_argument("--batch-pairs", type=int)
        inner.add_argument("--steps", type=int)
        a = inner.parse_args()
        run_contender(a._contender, a._prompts, a.pairs, a.batch_pairs, a.steps, a._out)
    else:
        main()
