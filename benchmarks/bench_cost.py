"""Cost-balanced multipack: the ranks' wait, recurring batches, planning speed and few-shape compiles.

Four parts, each against its baseline in the same run:

1. *Spread* on long-tail lengths (see :func:`long_tail_lengths`): the slowest rank's predicted cost per step
   over the ranks' mean, summed over an epoch (``rank_cost_max_over_mean``, 1.0 = no wait), for today's
   token-balanced steps and for cost-balanced ones, at 2, 4 and 8 ranks and caps 4k, 8k, 16k (the cap is
   the budget; longer conversations are truncated to it, as ``max_length`` + ``overflow="truncate"``
   would). Cost models: the FLOPs of a SmolLM2-135M-shaped and a Llama-1B-shaped config
   (:meth:`CostModel.from_config`) and verl's ``24576 L + L**2``. The batches, their fill and count are
   the same under both balances (only which batches share a step changes): reported once.
2. *Recurrence*: the share of multi-sample batches of epoch e that come back unchanged in epoch e + 1
   (mean of e = 0, 1) at budgets 2k-16k, on the same long-tail lengths and on lognormal fits.
3. *Planning speed* (CPU time, medians, interleaved): the sampler's plan of a new epoch for 1,000,000
   lognormal lengths (median ~500, cap 4096, budget 4096, 8 ranks) with and without a cost model, and
   with ``mixing="sorted"``; TRL's ``pack_dataset(strategy="bfd")`` on the first 100,000 against the
   sampler's plan of those 100,000 (``--quick``: 100k / 20k).
4. *Few shapes*: dynamo graphs over an epoch of multipack batches (real long-tail lengths, 1,024-token
   budget, a 1-layer Llama, dynamo with the ``eager`` backend) for ``dynamic=False`` and the default
   automatic dynamic shapes, with no padding, ``pad_to_multiple_of=64`` and 8 ``length_buckets``; and the
   padding tokens each costs (share of the emitted tokens).

Long-tail lengths: real per-sample token counts (GSM8K train, GPTeacher roleplay + toolformer,
Alpaca-GPT4 1k; SmolLM2 tokenizer, Alpaca template + answer + EOS) concatenated into multi-turn
"conversations" of ``ceil(exp(N(1.0, 1.1)))`` turns drawn at random (median 3 turns, ~560 tokens; p99
~6k; the longest tens of thousands), a ShareGPT-like long tail built from the real data in
``../shared/data`` (no ShareGPT file is there).

    python benchmarks/bench_cost.py            # ~5 min on 2 busy CPU cores
    python benchmarks/bench_cost.py --quick
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch
from _common import base_parser, load_tokenizer, print_table, write_json

from packing_hf import CostModel, PaddingFreeCollator, register_attention
from packing_hf.collator import length_buckets, segment_buckets
from packing_hf.cost import rank_cost_spread
from packing_hf.sampler import MultipackBatchSampler

SMOLLM2_135M = dict(
    hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, vocab_size=49152,
)  # fmt: skip
LLAMA_1B = dict(
    hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, head_dim=64, vocab_size=128256,
)  # fmt: skip


def real_turn_lengths_by_set() -> dict[str, np.ndarray]:
    """Token counts of every real sample in ../shared/data, by data set (SmolLM2 tokenizer, Alpaca template)."""
    import json

    from _common import DATA_DIR, load_gsm8k
    from bench_sampler import alpaca_text

    tokenizer = load_tokenizer()
    sets = {
        "gsm8k_train": [{"instruction": r["question"], "output": r["answer"]} for r in load_gsm8k("train")]
    }
    for name in ("gpteacher_roleplay", "gpteacher_toolformer", "alpaca_gpt4_1k"):
        with open(DATA_DIR / f"{name}.json") as f:
            sets[name] = json.load(f)
    out = {}
    for name, records in sets.items():
        ids = tokenizer([alpaca_text(r, tokenizer.eos_token) for r in records])["input_ids"]
        out[name] = np.array([len(x) for x in ids], dtype=np.int64)
    return out


def real_turn_lengths() -> np.ndarray:
    """Token counts of every real sample in ../shared/data (the turns of the long-tail conversations)."""
    return np.concatenate(list(real_turn_lengths_by_set().values()))


def long_tail_lengths(turns_pool: np.ndarray, n: int, seed: int = 0) -> np.ndarray:
    """``n`` conversations of ``ceil(exp(N(1.0, 1.1)))`` real samples each (uncapped)."""
    rng = np.random.default_rng(seed)
    turns = np.ceil(np.exp(rng.normal(1.0, 1.1, n))).astype(np.int64)
    picked = turns_pool[rng.integers(0, turns_pool.size, int(turns.sum()))]
    return np.add.reduceat(picked, np.concatenate([[0], np.cumsum(turns)[:-1]]))


def lognormal_lengths(n: int, median: float, sigma: float, cap: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(np.exp(math.log(median) + sigma * rng.standard_normal(n)).round(), 1, cap).astype(np.int64)


def cost_models() -> dict[str, CostModel]:
    from transformers import AutoConfig

    return {
        "SmolLM2-135M flops": CostModel.from_config(AutoConfig.for_model("llama", **SMOLLM2_135M)),
        "Llama-1B flops": CostModel.from_config(AutoConfig.for_model("llama", **LLAMA_1B)),
        "verl 24576,1": CostModel(24576, 1),
    }


def multipack_step_costs(sampler: MultipackBatchSampler, cost: CostModel, epochs: range) -> list[np.ndarray]:
    """``(num_steps, num_ranks)`` predicted cost of every rank's batch, for each epoch."""
    out = []
    for epoch in epochs:
        plan = sampler._plan(epoch)
        out.append(cost.bin_costs(plan["bin_tokens"], plan["bin_squares"])[plan["steps"]])
    return out


def batch_rebalance_steps(
    lengths: np.ndarray, ranks: int, per_rank: int, epoch: int
) -> list[list[list[int]]]:
    """transformers' ``BatchRebalanceSampler`` (``train_sampling_strategy="batch_rebalance"``) as the Trainer
    builds it (no gradient accumulation, ``dataloader_drop_last=False``): every rank's padded micro-batches."""
    from transformers.trainer_pt_utils import BatchRebalanceSampler

    plans = []
    for rank in range(ranks):
        sampler = BatchRebalanceSampler(
            lengths.tolist(), per_rank * ranks, ranks, 1, rank=rank, drop_last=False, seed=42
        )
        sampler.set_epoch(epoch)
        plans.append(list(sampler))
    return plans


def padded_step_costs(plans: list[list[list[int]]], lengths: np.ndarray, cost: CostModel) -> np.ndarray:
    """``(num_steps, num_ranks)``: the cost of every padded micro-batch, ``rows x cost(longest)``."""
    return np.array(
        [
            [len(b) * float(cost([int(lengths[b].max())])[0]) for b in step]
            for step in zip(*plans, strict=True)
        ]
    )


def spread_figures(step_costs: list[np.ndarray]) -> tuple[float, float]:
    """``(median over steps of max / mean across ranks, sum of the slowest rank / sum of the mean)``."""
    stacked = np.concatenate(step_costs)
    return float(np.median(stacked.max(axis=1) / stacked.mean(axis=1))), rank_cost_spread(stacked)


def spread_row(
    lengths: np.ndarray, budget: int, ranks: int, costs: dict[str, CostModel], epochs: range
) -> list[dict]:
    """Token-balanced, cost-balanced and ``batch_rebalance`` figures for every cost model."""
    samplers = {
        "tokens": MultipackBatchSampler(lengths, budget, num_replicas=ranks, rank=0),
        "cost": MultipackBatchSampler(
            lengths, budget, num_replicas=ranks, rank=0, cost_model=next(iter(costs.values()))
        ),
    }
    steps = len(samplers["tokens"])
    # batch_rebalance with as many steps, so a step holds as many real tokens on average
    per_rank = max(1, round(lengths.size / (steps * ranks)))
    rebalanced = [batch_rebalance_steps(lengths, ranks, per_rank, epoch) for epoch in epochs]
    rows_emitted = sum(len(b) * int(lengths[b].max()) for plan in rebalanced for rank in plan for b in rank)
    real = sum(int(lengths[b].sum()) for plan in rebalanced for rank in plan for b in rank)
    yielded = sum(len(b) for plan in rebalanced for rank in plan for b in rank)
    rows = []
    for name, cost in costs.items():
        # the same packing (the epoch-independent template is kept); the steps are re-planned for this model
        samplers["cost"].cost_model, samplers["cost"]._plan_cache = cost, None
        row = {"cost_model": name, "ranks": ranks, "steps": steps}
        for balance, sampler in samplers.items():
            median, total = spread_figures(multipack_step_costs(sampler, cost, epochs))
            row[f"{balance}_median"], row[f"{balance}_sum"] = median, total
        row["fill"] = samplers["cost"].efficiency()
        row["fill_tokens_balanced"] = samplers["tokens"].efficiency()
        median, total = spread_figures([padded_step_costs(plan, lengths, cost) for plan in rebalanced])
        row.update(
            batch_rebalance_median=median,
            batch_rebalance_sum=total,
            batch_rebalance_steps=len(rebalanced[0][0]),
            batch_rebalance_padding_pct=100 * (1 - real / rows_emitted),
            batch_rebalance_repeats=yielded - lengths.size * len(epochs),
        )
        rows.append(row)
    return rows


SPREAD_COLUMNS = [
    "ranks", "steps", "tokens_median", "tokens_sum", "cost_median", "cost_sum", "fill", "batch_rebalance_median",
    "batch_rebalance_sum", "batch_rebalance_steps", "batch_rebalance_padding_pct", "batch_rebalance_repeats",
]  # fmt: skip


def spread(lengths: np.ndarray, quick: bool) -> list[dict]:
    rows = []
    caps = (4096, 8192) if quick else (4096, 8192, 16384)
    for cap in caps:
        capped = np.minimum(lengths, cap)
        for ranks in (2, 4, 8):
            for row in spread_row(capped, cap, ranks, cost_models(), range(1)):
                rows.append({"cap": cap, **row})
    print(
        "\n== per-step spread of the ranks' predicted cost (max / mean; median over steps, and the sum of the slowest "
        "rank over the sum of the mean: 1.0 = nobody waits), long-tail lengths capped at the budget =="
    )
    print_table(rows, ["cap", "cost_model", *SPREAD_COLUMNS])
    return rows


def small_sets(pools: dict[str, np.ndarray], quick: bool) -> list[dict]:
    """The same figures on data sets of a few hundred conversations: few steps, no bins of similar cost to group."""
    budget, cap, cost = 16384, 4096, CostModel(1.0, 1 / 2048)
    sets = {
        "300 tool-call conversations": long_tail_lengths(pools["gpteacher_toolformer"], 300, seed=1),
        "200 long-tail conversations": long_tail_lengths(np.concatenate(list(pools.values())), 200, seed=2),
        "1,000 long-tail conversations": long_tail_lengths(
            np.concatenate(list(pools.values())), 1000, seed=3
        ),
        "999 Alpaca-GPT4 samples": pools["alpaca_gpt4_1k"],
    }
    rows = []
    for name, lengths in sets.items():
        capped = np.minimum(lengths, cap)
        for ranks in (2, 4, 8):
            for row in spread_row(
                capped, budget, ranks, {"CostModel(1, 1/2048)": cost}, range(2 if quick else 5)
            ):
                rows.append({"data": name, "samples": capped.size, "tokens": int(capped.sum()), **row})
    print(
        f"\n== the same on small sets (capped at {cap}, budget {budget}, CostModel(1, 1/2048); all steps of "
        f"{2 if quick else 5} epochs) =="
    )
    print_table(rows, ["data", "samples", "tokens", *SPREAD_COLUMNS])
    return rows


def recurrence(sampler: MultipackBatchSampler, epoch: int) -> float:
    """Share of the multi-sample batches of ``epoch`` found unchanged in ``epoch + 1``."""
    batches = []
    for e in (epoch, epoch + 1):
        sampler.set_epoch(e)
        batches.append({frozenset(b) for b in sampler if len(b) > 1})
    return len(batches[0] & batches[1]) / max(len(batches[0]), 1)


def recurring(long_tail: np.ndarray, quick: bool) -> list[dict]:
    n = long_tail.size
    sources = {"long-tail (real turns)": long_tail}
    for median, sigma in ((500, 1.0), (1200, 1.0)):
        sources[f"lognormal median {median}, sigma {sigma}"] = lognormal_lengths(
            n, median, sigma, 1 << 20, seed=1
        )
    rows = []
    for name, lengths in sources.items():
        for budget in (2048, 4096) if quick else (2048, 4096, 8192, 16384):
            sampler = MultipackBatchSampler(np.minimum(lengths, budget), budget, seed=0)
            multi = sum(len(b) > 1 for b in sampler)
            rows.append(
                {
                    "lengths": name,
                    "budget": budget,
                    "multi_sample_batches": multi,
                    "recurring_pct": 100 * float(np.mean([recurrence(sampler, e) for e in (0, 1)])),
                    "fill": sampler.efficiency(),
                }
            )
    print("\n== multi-sample batches found unchanged in the next epoch (goal <= 5%) ==")
    print_table(rows, ["lengths", "budget", "multi_sample_batches", "recurring_pct", "fill"])
    return rows


def planning_speed(quick: bool) -> dict:
    from bench_sampler import arrow_dataset
    from trl.data_utils import pack_dataset

    n, n_trl, repeat = (100_000, 20_000, 3) if quick else (1_000_000, 100_000, 5)
    lengths = lognormal_lengths(n, 500, 1.0, 4096)
    cost = cost_models()["SmolLM2-135M flops"]
    samplers = {
        "random, token-balanced": MultipackBatchSampler(lengths, 4096, num_replicas=8, rank=0),
        "random, cost-balanced": MultipackBatchSampler(
            lengths, 4096, num_replicas=8, rank=0, cost_model=cost
        ),
        "sorted, cost-balanced": MultipackBatchSampler(
            lengths, 4096, num_replicas=8, rank=0, cost_model=cost, mixing="sorted"
        ),
    }
    for mixing in ("random", "sorted"):  # load numba's compiled kernels before anything is timed
        MultipackBatchSampler(lengths[:5000], 4096, num_replicas=8, rank=0, mixing=mixing)._plan(0)
    first = {}
    for name, sampler in samplers.items():  # the epoch-independent work, once
        start = time.process_time()
        sampler._plan(0)
        first[name] = time.process_time() - start
    epochs = {name: iter(range(1, 10_000)) for name in samplers}
    times: dict[str, list[float]] = {name: [] for name in samplers}
    for _ in range(repeat):  # interleaved: a new epoch of every plan in turn
        for name, sampler in samplers.items():
            start = time.process_time()
            sampler._plan(next(epochs[name]))
            times[name].append(time.process_time() - start)
    subset = lengths[:n_trl]
    dataset = arrow_dataset(subset)
    start = time.process_time()
    pack_dataset(dataset, 4096, strategy="bfd")
    trl_s = time.process_time() - start
    small = MultipackBatchSampler(subset, 4096, num_replicas=8, rank=0, cost_model=cost)
    start = time.process_time()
    small._plan(0)
    small_first = time.process_time() - start
    rows = [
        {
            "plan": name,
            "first_epoch_s": first[name],
            "new_epoch_s": float(np.median(times[name])),
            "batches": len(sampler) * 8,
            "fill": sampler.efficiency(),
        }
        for name, sampler in samplers.items()
    ]
    sorted_fill = samplers["sorted, cost-balanced"].efficiency()
    print(
        f"\n== planning one epoch, {n:,} lognormal lengths (median 500, cap 4096), budget 4096, 8 ranks (CPU s) =="
    )
    print_table(rows, ["plan", "first_epoch_s", "new_epoch_s", "batches", "fill"])
    speedup = trl_s / small_first
    print(
        f"fill, cost-balanced random vs sorted: {100 * (samplers['random, cost-balanced'].efficiency() - sorted_fill):+.3f} "
        f"points; TRL bfd on {n_trl:,} lengths {trl_s:.2f} s vs the cost-balanced sampler's first plan of them "
        f"{small_first:.3f} s: {speedup:.0f}x"
    )
    return {
        "rows": rows,
        "n": n,
        "trl_n": n_trl,
        "trl_bfd_s": trl_s,
        "sampler_on_trl_n_s": small_first,
        "speedup_vs_trl": speedup,
    }


def few_shapes(long_tail: np.ndarray, quick: bool) -> list[dict]:
    from torch._dynamo.utils import counters
    from transformers import AutoConfig, AutoModelForCausalLM

    budget = 1024
    lengths = np.minimum(long_tail[: 150 if quick else 1500], budget)
    sampler = MultipackBatchSampler(lengths, budget, seed=0)
    rng = np.random.default_rng(0)
    ids = [rng.integers(1, 128, int(n)).tolist() for n in lengths]
    rows = []
    for dynamic in (False, None):
        for name, kwargs in (
            ("none", {}),
            ("pad_to_multiple_of=64", {"pad_to_multiple_of": 64}),
            ("8 length_buckets", {"length_buckets": length_buckets(budget)}),
            (
                "8 length + 8 segment buckets",
                {"length_buckets": length_buckets(budget), "segment_buckets": segment_buckets(budget)},
            ),
        ):
            torch._dynamo.reset()
            counters.clear()
            config = AutoConfig.for_model(
                "llama", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, use_cache=False,
            )  # fmt: skip
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config, attn_implementation=register_attention())
            compiled = torch.compile(model, backend="eager", dynamic=dynamic)
            collator = PaddingFreeCollator(**kwargs)
            shapes = set()
            start = time.perf_counter()
            for batch_ids in sampler:
                batch = collator([{"input_ids": ids[i]} for i in batch_ids])
                shapes.add(batch["input_ids"].shape[1])
                compiled(**batch).loss.backward()
            rows.append(
                {
                    "dynamic": {None: "auto (default)", False: "False"}[dynamic],
                    "rows": name,
                    "batches": len(sampler),
                    "distinct_T": len(shapes),
                    "graphs": counters["stats"]["unique_graphs"],
                    "hit_recompile_limit": counters["stats"]["unique_graphs"]
                    >= torch._dynamo.config.recompile_limit,
                    "empty_segments_per_batch": collator.stats["empty_segments"] / collator.stats["batches"],
                    "padding_pct": 100
                    * collator.stats["padding_tokens"]
                    / (collator.stats["tokens"] + collator.stats["padding_tokens"]),
                    "epoch_s": time.perf_counter() - start,
                }
            )
    print(
        f"\n== dynamo graphs over one epoch of multipack batches (budget {budget}, {lengths.size} long-tail samples) =="
    )
    print_table(
        rows,
        [
            "dynamic",
            "rows",
            "batches",
            "distinct_T",
            "graphs",
            "hit_recompile_limit",
            "empty_segments_per_batch",
            "padding_pct",
            "epoch_s",
        ],
    )
    return rows


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", default=["spread", "recurrence", "speed", "shapes"])
    args = parser.parse_args()
    pools = real_turn_lengths_by_set()
    pool = np.concatenate(list(pools.values()))
    long_tail = long_tail_lengths(pool, 20_000 if args.quick else 100_000)
    q = np.percentile(long_tail, [50, 90, 99])
    print(
        f"long-tail lengths: {long_tail.size:,} conversations of real samples ({pool.size:,} turns to draw from): "
        f"median {q[0]:.0f}, mean {long_tail.mean():.0f}, p90 {q[1]:.0f}, p99 {q[2]:.0f}, max {long_tail.max()}"
    )
    result = {
        "long_tail": {
            "n": int(long_tail.size),
            "median": float(q[0]),
            "mean": float(long_tail.mean()),
            "p99": float(q[2]),
        }
    }
    if "spread" in args.parts:
        result["spread"] = spread(long_tail, args.quick)
        result["small_sets"] = small_sets(pools, args.quick)
    if "recurrence" in args.parts:
        result["recurrence"] = recurring(long_tail, args.quick)
    if "speed" in args.parts:
        result["speed"] = planning_speed(args.quick)
    if "shapes" in args.parts:
        result["few_shapes"] = few_shapes(long_tail, args.quick)
    write_json("bench_cost", result, args)


if __name__ == "__main__":
    main()
