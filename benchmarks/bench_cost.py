"""Cost-balanced multipack: the ranks' wait, batch mixing, planning speed and few-shape compiles.

Four parts, each against its baseline in the same run:

1. *Spread* on long-tail lengths (see :func:`long_tail_lengths`): the ranks' predicted cost per step, as the
   median over steps of the slowest rank over the ranks' mean and as the sum over an epoch of the slowest rank
   over the sum of the mean (``rank_cost_max_over_mean``; 1.0 = no wait), for token-balanced and for
   cost-balanced steps, at 2, 4 and 8 ranks and caps 4k, 8k, 16k (the cap is the budget; longer conversations
   are truncated to it, as ``max_length`` + ``overflow="truncate"`` would). Cost models: the FLOPs of a
   SmolLM2-135M-shaped and a Llama-1B-shaped config (:meth:`CostModel.from_config`) and verl's
   ``24576 L + L**2``. The batch count and fill are the same under both balances: reported once. Beside them,
   transformers' ``train_sampling_strategy="batch_rebalance"`` (``BatchRebalanceSampler``, padded batches,
   as many steps, no gradient accumulation, ``dataloader_drop_last=False`` as the Trainer's default): the same
   spreads of its padded micro-batches' cost (``rows x cost(longest)``), its steps, its padding share and the
   samples it repeats to fill the last step. Then the same on small sets (300 tool-call conversations of real
   GPTeacher toolformer samples, 200 and 1,000 long-tail conversations, the 999 Alpaca-GPT4 samples; capped
   at 4,096, budget 16,384, ``CostModel(1, 1/2048)``; all steps of 5 epochs): few steps, no bins of similar
   cost left to group.
2. *Mixing*: the std across batches of a batch's mean sample length over that of random batches (shuffled,
   cut at the budget; ~1 is a random mix) and the share of multi-sample batches of epoch e found unchanged in
   epoch e + 1 (mean of e = 0, 1), at budgets 2k, 4k, 8k, 1 rank and 8 ranks cost-balanced, on the real length
   sets (GSM8K train, GPTeacher roleplay and toolformer, Alpaca-GPT4 1k), the long-tail lengths and
   lognormal fits.
3. *Planning speed* (CPU time): the sampler's first plan (with the epoch-independent work), iterating every
   batch of rank 0, and a new epoch's plan, for 1,000,000 lengths (budget 4,096) of three mixes: lognormal of
   median 500 with sigma 0.7 (few samples under 100 tokens: the hard mix to fill) and 1.0, clipped to
   16..4,096, and long-tail conversations capped at 4,096; ``mixing="random"`` and ``"sorted"`` on one rank and
   cost-balanced random on 8; the batches over the Martello-Toth L2 lower bound. TRL's
   ``pack_dataset(strategy="bfd")`` on the first 100,000 of each mix against the sampler's first plan of them
   (``--quick``: 100k / 20k).
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


def lognormal_lengths(
    n: int, median: float, sigma: float, cap: int, seed: int = 0, floor: int = 1
) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(np.exp(math.log(median) + sigma * rng.standard_normal(n)).round(), floor, cap).astype(
        np.int64
    )


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


def epoch_batches(sampler: MultipackBatchSampler, epoch: int) -> list[list[int]]:
    sampler.set_epoch(epoch)
    return list(sampler)


def recurrence(epochs: list[list[list[int]]]) -> float:
    """Share of the multi-sample batches of an epoch found unchanged in the next (mean over consecutive pairs)."""
    sets = [{frozenset(b) for b in batches if len(b) > 1} for batches in epochs]
    return float(np.mean([len(a & b) / max(len(a), 1) for a, b in zip(sets[:-1], sets[1:], strict=True)]))


def mixing(long_tail: np.ndarray, pools: dict[str, np.ndarray], quick: bool) -> list[dict]:
    """Batch mean-length spread against random batches', and recurring batches, at 1 rank and 8 cost-balanced."""
    from bench_sampler import mean_length_spread, random_batches_spread

    n = long_tail.size
    sources = {"long-tail (real turns)": long_tail, **pools}
    for median, sigma in ((500, 1.0), (1200, 1.0)):
        sources[f"lognormal median {median}, sigma {sigma}"] = lognormal_lengths(
            n, median, sigma, 1 << 20, seed=1
        )
    cost = cost_models()["SmolLM2-135M flops"]
    rows = []
    for name, lengths in sources.items():
        for budget in (2048, 4096, 8192):
            capped = np.minimum(lengths, budget)
            reference = random_batches_spread(capped, budget)
            for ranks in (1, 8):
                kwargs = {"num_replicas": ranks, "rank": 0, "shard": False}
                if ranks > 1:
                    kwargs["cost_model"] = cost
                sampler = MultipackBatchSampler(capped, budget, seed=0, **kwargs)
                epochs = [epoch_batches(sampler, e) for e in range(3)]
                spread = np.mean([mean_length_spread(capped, batches) for batches in epochs])
                rows.append(
                    {
                        "lengths": name,
                        "budget": budget,
                        "ranks": ranks,
                        "multi_sample_batches": sum(len(b) > 1 for b in epochs[0]),
                        "mean_length_spread_vs_random": spread / reference,
                        "recurring_pct": 100 * recurrence(epochs),
                        "fill": sampler.efficiency(0),
                    }
                )
    print(
        "\n== mixing: std across batches of a batch's mean length over that of random batches (goal <= 1.3x), "
        "and multi-sample batches found unchanged in the next epoch (goal <= 5%); 8 ranks cost-balanced =="
    )
    print_table(rows, ["lengths", "budget", "ranks", "multi_sample_batches", "mean_length_spread_vs_random", "recurring_pct", "fill"])  # fmt: skip
    return rows


def timed(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def planning_speed(long_tail_pool: np.ndarray, quick: bool) -> dict:
    """Planning and iterating an epoch on three mixes, against TRL's bfd on the first ``n_trl`` lengths."""
    import datasets
    from bench_sampler import arrow_dataset
    from trl.data_utils import pack_dataset

    datasets.disable_progress_bars()
    n, n_trl, repeat = (100_000, 20_000, 3) if quick else (1_000_000, 100_000, 5)
    budget = 4096
    mixes = {
        # few samples under 100 tokens: the gaps random-order best fit leaves are hard to close
        "lognormal median 500, sigma 0.7": lognormal_lengths(n, 500, 0.7, budget, floor=16),
        "lognormal median 500, sigma 1.0": lognormal_lengths(n, 500, 1.0, budget, floor=16),
        "long-tail (real turns)": np.minimum(long_tail_lengths(long_tail_pool, n, seed=4), budget),
    }
    cost = cost_models()["SmolLM2-135M flops"]
    for mixing in ("random", "sorted"):  # load numba's compiled kernels before anything is timed
        list(
            MultipackBatchSampler(
                mixes["long-tail (real turns)"][:5000], budget, num_replicas=8, rank=0, mixing=mixing
            )
        )
    rows, trl = [], []
    for mix, lengths in mixes.items():
        samplers = {
            "random, 1 rank": MultipackBatchSampler(lengths, budget),
            "sorted, 1 rank": MultipackBatchSampler(lengths, budget, mixing="sorted"),
            "random, cost-balanced, 8 ranks": MultipackBatchSampler(
                lengths, budget, num_replicas=8, rank=0, cost_model=cost
            ),
        }
        for name, sampler in samplers.items():
            first = timed(lambda sampler=sampler: sampler._plan(0))  # the epoch-independent work, once
            iterate = timed(lambda sampler=sampler: sum(1 for _ in sampler))  # every batch of this rank
            epochs = [timed(lambda sampler=sampler, e=e: sampler._plan(e)) for e in range(1, repeat + 1)]
            stats = sampler.stats(0)
            rows.append(
                {
                    "lengths": mix,
                    "plan": name,
                    "first_epoch_s": first,
                    "iterate_s": iterate,
                    "first_plus_iterate_s": first + iterate,
                    "new_epoch_s": float(np.median(epochs)),
                    "batches": stats["batches"],
                    "over_l2_pct": 100 * (stats["batches"] - stats["lower_bound"]) / stats["lower_bound"],
                    "fill": stats["efficiency"],
                }
            )
        subset = lengths[:n_trl]
        dataset = arrow_dataset(subset)
        trl_s = timed(lambda dataset=dataset: pack_dataset(dataset, budget, strategy="bfd"))
        sampler_s = timed(lambda subset=subset: MultipackBatchSampler(subset, budget)._plan(0))
        trl.append(
            {
                "lengths": mix,
                "trl_bfd_s": trl_s,
                "sampler_first_plan_s": sampler_s,
                "speedup": trl_s / sampler_s,
            }
        )
    print(
        f"\n== planning one epoch of {n:,} lengths (clipped to 16..{budget}), budget {budget}, and iterating every "
        "batch of rank 0 (CPU s; over_l2_pct: batches over the Martello-Toth L2 lower bound) =="
    )
    print_table(rows, ["lengths", "plan", "first_epoch_s", "iterate_s", "first_plus_iterate_s", "new_epoch_s", "batches", "over_l2_pct", "fill"])  # fmt: skip
    print(
        f"\n== TRL pack_dataset(strategy='bfd') on the first {n_trl:,} lengths vs the sampler's first plan of them =="
    )
    print_table(trl, ["lengths", "trl_bfd_s", "sampler_first_plan_s", "speedup"])
    return {"rows": rows, "n": n, "trl_n": n_trl, "trl": trl}


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
    parser.add_argument("--parts", nargs="+", default=["spread", "mixing", "speed", "shapes"])
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
    if "mixing" in args.parts or "recurrence" in args.parts:  # "recurrence": its former name
        result["mixing"] = mixing(long_tail, pools, args.quick)
    if "speed" in args.parts:
        result["speed"] = planning_speed(pool, args.quick)
    if "shapes" in args.parts:
        result["few_shapes"] = few_shapes(long_tail, args.quick)
    write_json("bench_cost", result, args)


if __name__ == "__main__":
    main()
