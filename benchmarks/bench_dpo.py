"""Stock padded TRL vs packing_hf's packed DPO, reward-model and KTO training, CPU.

Three trainers, each with its own stock padded baseline measured in the same run:

- ``dpo``: stock ``trl.DPOTrainer`` (``padded``) vs ``packing_hf.DPOTrainer`` on one ``[1, T]`` row
  (``packed``, ``shared_prompt=False``) vs the same holding every pair's prompt once (``shared``);
  reference log-probs precomputed.
- ``reward``: stock ``trl.RewardTrainer`` vs ``packing_hf.RewardTrainer`` (``packed``) on a llama
  sequence classifier (one score, ``pad_token_id`` set), each pair's ``prompt + chosen`` and
  ``prompt + rejected`` scored.
- ``kto``: stock ``trl.KTOTrainer`` vs ``packing_hf.KTOTrainer`` (``packed``) on the same pairs made
  unpaired, TRL's format (``prompt + chosen`` labelled desirable, ``prompt + rejected`` undesirable), with
  the KL term (every example's prompt with a neighbour's completion: a second forward) and reference
  log-probs precomputed; a step takes ``2 x --batch-pairs`` examples, as many sequences as the others.

Pairs come from GSM8K (train split): the reference answer is ``chosen``, the same answer with its lines in
reverse order (the final ``#### n`` first) is ``rejected``; tokenized by TRL with the SmolLM2 tokenizer.
Two prompt sets: ``short`` (the question alone, ~50 tokens) and ``long`` (three worked GSM8K examples
before the question, a few-shot prompt of ~400 tokens, as prompt-heavy preference data is).
All contenders of a trainer train the same tiny llama (fp32, same initial weights) on the same batches in
the same order, AdamW: stock pads every batch to the longest sequence and runs sdpa; packed contenders
run packing_hf's varlen attention. Every contender runs in its own subprocess (so its peak RSS is its
own), the contenders of a trainer alternate with the order rotated every round, and the rounds repeat.

Reported per contender: real tokens/s of the training steps (forward + backward + optimizer step,
median over rounds; real tokens = the non-padding tokens of the padded batch, KL sequences included, which
every contender's batch carries, so all contenders of a trainer are measured on the same work), the tokens
computed per step (the packed rows' length: checked to hold no padding and to total fewer than padded's),
peak RSS of the process and its growth over the state before the first step, and the per-step losses;
the table gives ratios over the trainer's stock padded contender and the largest loss difference from it.

A full run is long: the 49k-token LM head dominates DPO and KTO steps. The README's figures
(``--pairs 16 --batch-pairs 4 --steps 20 --rounds 3``, both prompt sets, 2 threads) took 35 minutes for DPO,
37 minutes for KTO and 2 minutes for the reward model on 2 CPU cores. The defaults take 8 pairs per step (~12k
real tokens per step with long prompts): ``--steps 4 --rounds 1`` of them took 27 minutes on 2 shared, loaded
cores (one thread per contender: ``BENCH_THREADS=1``), which extrapolates to ~4.5 hours for 20 steps and 3 rounds.

    python benchmarks/bench_dpo.py                          # all three trainers (see above)
    python benchmarks/bench_dpo.py --trainers dpo --prompts long
    python benchmarks/bench_dpo.py --quick                  # a smoke run
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
SHOTS = 3  # worked examples before the question in the long-prompt set
MAX_LENGTH = 1024  # above every sequence of both sets: nothing is truncated or dropped
CONTENDERS = {
    "dpo": ("padded", "packed", "shared"),
    "reward": ("padded", "packed"),
    "kto": ("padded", "packed"),
}
LOSS_WARNING = 1e-5  # a larger loss difference from stock means the contenders did not do the same work


def _pairs(n: int, prompts: str) -> dict[str, list[str]]:
    """``n`` GSM8K preference pairs ``{"prompt", "chosen", "rejected"}`` with the ``prompts`` set's prompts."""
    rows = load_gsm8k("train", limit=n + SHOTS * n)
    examples, rows = rows[n:], rows[:n]

    def prompt(i: int, r: dict) -> str:
        question = f"Question: {r['question']}\nAnswer:"
        if prompts == "short":
            return question
        shots = examples[i * SHOTS : (i + 1) * SHOTS]
        return "".join(f"Question: {e['question']}\nAnswer: {e['answer']}\n\n" for e in shots) + question

    return {
        "prompt": [prompt(i, r) for i, r in enumerate(rows)],
        "chosen": [" " + r["answer"] for r in rows],
        "rejected": [" " + "\n".join(reversed(r["answer"].split("\n"))) for r in rows],
    }


def _unpaired(pairs: dict[str, list[str]]) -> dict[str, list]:
    """TRL's unpaired (KTO) format: every pair's chosen (``label=True``) then its rejected (``False``)."""
    return {
        "prompt": [p for p in pairs["prompt"] for _ in range(2)],
        "completion": [c for pair in zip(pairs["chosen"], pairs["rejected"], strict=True) for c in pair],
        "label": [label for _ in pairs["prompt"] for label in (True, False)],
    }


def _build_trainer(trainer: str, contender: str, prompts: str, num_pairs: int, batch_pairs: int):
    """The ``trainer`` of ``contender`` (stock TRL for ``padded``, else packing_hf) with its model and data."""
    import datasets
    import torch
    import trl
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
    )

    import packing_hf

    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    config = AutoConfig.for_model(
        "llama",
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,  # the reward model pools at the last token that is not padding
    )
    packed = contender != "padded"
    attn = packing_hf.register_attention() if packed else "sdpa"
    model_cls = AutoModelForSequenceClassification if trainer == "reward" else AutoModelForCausalLM
    torch.manual_seed(SEED)
    model = model_cls.from_config(config, attn_implementation=attn).float()
    pairs = _pairs(num_pairs, prompts)
    options: dict = {"per_device_train_batch_size": batch_pairs}
    if trainer == "dpo":
        options.update(precompute_ref_log_probs=True)
        if packed:
            options.update(shared_prompt=contender == "shared")
    elif trainer == "kto":
        pairs = _unpaired(pairs)
        # KTO's KL completions come from the neighbours in batches of this size: as many sequences as a pair batch
        options.update(per_device_train_batch_size=2 * batch_pairs, precompute_ref_log_probs=True)
    name = {"dpo": "DPO", "reward": "Reward", "kto": "KTO"}[trainer]
    library = packing_hf if packed else trl  # the same class names in both
    trainer_cls, config_cls = getattr(library, f"{name}Trainer"), getattr(library, f"{name}Config")
    args = config_cls(
        **options,
        output_dir=f"/tmp/bench_dpo_{trainer}_{contender}",
        max_length=MAX_LENGTH,
        bf16=False,  # TRL's default autocast; the comparison is in fp32
        gradient_checkpointing=False,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        save_strategy="no",
        seed=SEED,
    )
    return trainer_cls(
        model=model, args=args, train_dataset=datasets.Dataset.from_dict(pairs), processing_class=tokenizer
    )


def _tokens(batch: dict, packed: bool) -> tuple[int, int]:
    """(real, computed) tokens of a step: the padded layout's non-padding tokens (every contender's batch
    carries it) and the tokens the model runs (the packed rows, or the padded batch), KL rows included."""
    prefixes = [p for p in ("", "KL_") if p + "attention_mask" in batch]
    real = sum(int(batch[p + "attention_mask"].sum()) for p in prefixes)
    computed = sum(batch[p + ("packed_input_ids" if packed else "input_ids")].numel() for p in prefixes)
    return real, computed


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def run_contender(job: dict) -> None:
    """One contender in this process: set up, train ``steps`` steps, write timings/losses/memory to ``out``."""
    import numpy as np
    import torch

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    trainer = _build_trainer(
        job["trainer"], job["contender"], job["prompts"], job["pairs"], job["batch_pairs"]
    )
    model, data, batch_size = trainer.model, trainer.train_dataset, trainer.args.per_device_train_batch_size
    packed = job["contender"] != "padded"
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-4)
    order = np.random.default_rng(SEED).permutation(len(data))
    model.train()
    rss_before = _rss_mib()
    seconds, tokens, losses, computed = [], [], [], []
    for step in range(job["steps"]):
        start = (step * batch_size) % len(data)
        indices = [int(i) for i in order[start : start + batch_size]]
        t0 = time.perf_counter()
        batch = trainer._prepare_inputs(trainer.data_collator([data[i] for i in indices]))
        real, run = _tokens(batch, packed)
        loss = trainer.compute_loss(model, dict(batch))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - t0)
        tokens.append(real)
        computed.append(run)
        losses.append(float(loss))
    result = {"seconds": seconds, "tokens": tokens, "losses": losses, "computed_tokens": computed}
    Path(job["out"]).write_text(
        json.dumps({**result, "rss_before_mib": rss_before, "rss_peak_mib": _rss_mib()})
    )


def _run_rounds(trainer: str, prompts: str, args) -> dict[str, list[dict]]:
    """Every contender of ``trainer`` ``args.rounds`` times, each in its own subprocess, interleaved."""
    contenders = CONTENDERS[trainer]
    results: dict[str, list[dict]] = {c: [] for c in contenders}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    for round_index in range(args.rounds):
        shift = round_index % len(contenders)
        for contender in contenders[shift:] + contenders[:shift]:
            out = f"/tmp/bench_dpo_{trainer}_{prompts}_{contender}_{round_index}.json"
            job = dict(trainer=trainer, contender=contender, prompts=prompts, out=out)
            job.update(pairs=args.pairs, batch_pairs=args.batch_pairs, steps=args.steps)
            done = subprocess.run(
                [sys.executable, __file__, "--_job", json.dumps(job)], env=env, capture_output=True, text=True
            )
            if done.returncode:
                sys.exit(f"{trainer} {contender} ({prompts} prompts) failed:\n{done.stderr[-4000:]}")
            results[contender].append(json.loads(Path(out).read_text()))
            print(f"{trainer}, {prompts} prompts, round {round_index}: {contender} done", flush=True)
    return results


def _check_same_work(trainer: str, prompts: str, results: dict[str, list[dict]]) -> None:
    """Every contender saw the same real tokens per step; the packed ones took the packed path: they computed
    no padding (at most the real tokens: fewer with a shared prompt) and fewer tokens than padded in all."""
    padded = results["padded"][0]
    for name, runs in results.items():
        real, computed = runs[0]["tokens"], runs[0]["computed_tokens"]
        if real != padded["tokens"]:
            sys.exit(
                f"{trainer} ({prompts}): {name} saw other batches than padded: {real} vs {padded['tokens']}"
            )
        no_padding = all(c <= r for c, r in zip(computed, real, strict=True))
        if name != "padded" and not (no_padding and sum(computed) < sum(padded["computed_tokens"])):
            sys.exit(
                f"{trainer} ({prompts}): {name} did not take the packed path: computed tokens per step "
                f"{computed} vs real {real} and padded {padded['computed_tokens']}"
            )


def _summarize(trainer: str, prompts: str, results: dict[str, list[dict]]) -> dict:
    """Per contender: median tokens/s over rounds, memory, loss difference; ratios over stock padded."""
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
    ratios, rows = {}, []
    for name, s in summary.items():
        loss_diff = max(abs(a - b) for a, b in zip(padded["losses"], s["losses"], strict=True))
        ratios[name] = {
            "tokens_per_s_over_padded": s["tokens_per_s"] / padded["tokens_per_s"],
            "rss_growth_over_padded": s["rss_growth_mib"] / padded["rss_growth_mib"],
            "computed_tokens_over_padded": s["computed_tokens_per_step"] / padded["computed_tokens_per_step"],
            "max_abs_loss_difference": loss_diff,
            "runs_identical": all(r["losses"] == results[name][0]["losses"] for r in results[name]),
        }
        rows.append(
            {
                "trainer": trainer,
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
    parser.add_argument(
        "--trainers", default="dpo,reward,kto", help="comma-separated subset of dpo,reward,kto"
    )
    parser.add_argument("--pairs", type=int, default=48)
    parser.add_argument("--batch-pairs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", choices=["short", "long", "both"], default="both")
    args = parser.parse_args()
    trainers = [t.strip() for t in args.trainers.split(",") if t.strip()]
    unknown = sorted(set(trainers) - set(CONTENDERS))
    if unknown or not trainers:
        parser.error(f"--trainers {args.trainers!r}: unknown {unknown}; choose from {', '.join(CONTENDERS)}")
    if args.quick:
        args.pairs, args.batch_pairs, args.steps, args.rounds = 4, 2, 2, 1

    sets = ["long", "short"] if args.prompts == "both" else [args.prompts]
    results: dict[str, dict] = {}
    for trainer in trainers:
        for prompts in sets:
            runs = _run_rounds(trainer, prompts, args)
            _check_same_work(trainer, prompts, runs)
            results.setdefault(trainer, {})[prompts] = _summarize(trainer, prompts, runs)
    rows = [row for by_set in results.values() for result in by_set.values() for row in result["rows"]]
    print_table(rows, list(rows[0]))
    for trainer, by_set in results.items():
        for prompts, result in by_set.items():
            others = [c for c in CONTENDERS[trainer] if c != "padded"]
            ratios = ", ".join(f"{c} {result['ratios'][c]['tokens_per_s_over_padded']:.2f}x" for c in others)
            print(f"{trainer}, {prompts} prompts: {ratios} stock padded tokens/s")
            for c in others:
                if result["ratios"][c]["max_abs_loss_difference"] > LOSS_WARNING:
                    print(f"  WARNING: {c} losses differ from stock padded by more than {LOSS_WARNING:g}")
    write_json(
        "dpo",
        {
            "config": {
                "trainers": trainers,
                "pairs": args.pairs,
                "batch_pairs": args.batch_pairs,
                "steps": args.steps,
                "rounds": args.rounds,
                "model": "llama from_config hidden 64, 2 layers, 4 heads / 2 KV, SmolLM2 vocabulary (49,152); "
                "reward: sequence classifier with one score",
                "data": "GSM8K train: chosen = answer, rejected = answer lines reversed; short prompts = the "
                f"question, long prompts = {SHOTS} worked examples + the question; KTO: every pair as two "
                "unpaired examples (chosen desirable, rejected undesirable)",
            },
            "results": {
                t: {p: {k: v for k, v in r.items() if k != "rows"} for p, r in by_set.items()}
                for t, by_set in results.items()
            },
        },
        args,
    )


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--_job":
        run_contender(json.loads(sys.argv[2]))
    else:
        main()
