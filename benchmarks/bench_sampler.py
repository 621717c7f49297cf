"""Multipack sampler: packing speed and fill of both plans, against TRL's bfd packing, next-fit and padded batches.

Two parts, both measured in the same run as the baselines:

1. Speed on 1,000,000 synthetic lengths (lognormal, mean ~640, clipped to 16..4096; then the harder mix of
   median 500 and sigma 0.7, which has few samples under 100 tokens to fill gaps with) at a 4096-token
   budget, after the one-time numba compilation: ``pack_best_fit_decreasing``, the random-order best
   fit, and the sampler's plan for both ``mixing="random"`` (default) and ``"sorted"`` (first epoch,
   which includes the epoch-independent work, and later epochs), against naive next-fit on the same
   lengths and TRL's ``pack_dataset(..., strategy="bfd")`` on the first 100,000 of them (TRL is too
   slow for 1M).
2. Fill and length mix on real data from ``../shared/data`` (GSM8K train, GPTeacher roleplay +
   toolformer, Alpaca-GPT4 1k), tokenized with the SmolLM2 tokenizer as an Alpaca prompt + answer +
   EOS, at budgets 2048, 4096, 8192 and 16384: batches against the Martello-Toth L2 lower bound and
   fill for both sampler plans, TRL bfd (as called by default, which packs each 1,000-row map batch
   on its own, and over the whole dataset at once), next-fit and plain padded batches of the same
   average real tokens per step; and the std across batches of a batch's mean sample length for both
   plans, divided by that of random batches (the samples shuffled, then cut at the budget: next-fit,
   mean of 3 shuffles). ~1 is a random mix; the sorted plan groups lengths (3-9x on this data).

Run from the project root: ``python benchmarks/bench_sampler.py [--quick]``. Writes
``benchmarks/results/bench_sampler.json``.
"""

from __future__ import annotations

import json
import math
import time

import numpy as np
from _common import DATA_DIR, base_parser, load_gsm8k, load_tokenizer, print_table, write_json

from packing_hf import _binpack
from packing_hf.sampler import MultipackBatchSampler, lengths_from_dataset
from packing_hf.strategies import padded_batches

ALPACA_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the "
    "request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
)


def synthetic_lengths(n: int, mean: float = 640.0, sigma: float = 1.0, seed: int = 0) -> np.ndarray:
    """``n`` lognormal lengths clipped to [16, 4096], with ``mu`` chosen so the clipped mean is ~``mean``."""
    rng = np.random.default_rng(seed)
    z = rng.standard_normal(n)
    low, high = math.log(16.0), math.log(4096.0)
    for _ in range(40):  # bisection on mu: the clipped mean grows with mu
        mu = (low + high) / 2
        if np.clip(np.exp(mu + sigma * z), 16, 4096).round().mean() < mean:
            low = mu
        else:
            high = mu
    return np.clip(np.exp(mu + sigma * z), 16, 4096).round().astype(np.int64)


def measure(fn, *, repeat: int, warmup: int = 1) -> dict[str, float]:
    """Median wall-clock and CPU seconds of ``fn()``.

    CPU time (``time.process_time``) is the figure for "one core": on a shared machine the wall clock
    also counts the time other processes held the core.
    """
    for _ in range(warmup):
        fn()
    wall, cpu = [], []
    for _ in range(repeat):
        w, c = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - w)
        cpu.append(time.process_time() - c)
    return {
        "wall": float(np.median(wall)),
        "cpu": float(np.median(cpu)),
        "wall_min": min(wall),
        "cpu_min": min(cpu),
    }


def arrow_dataset(lengths: np.ndarray):
    """A ``datasets.Dataset`` with an ``input_ids`` list column of the given lengths (token ids are 1)."""
    import datasets
    import pyarrow as pa

    offsets = np.zeros(lengths.size + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    column = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(np.ones(int(offsets[-1]), np.int32)))
    return datasets.Dataset(pa.table({"input_ids": column}))


def trl_bfd_rows(dataset, budget: int, whole: bool = False) -> tuple[int, int]:
    """Rows TRL's bfd packing produces, and its real tokens (``whole``: one map batch for everything)."""
    from trl.data_utils import pack_dataset

    map_kwargs = {"batch_size": len(dataset)} if whole else {}
    packed = pack_dataset(dataset, budget, strategy="bfd", map_kwargs=map_kwargs)
    return len(packed), int(lengths_from_dataset(packed).sum())


def hard_mix_lengths(n: int, seed: int = 0) -> np.ndarray:
    """``n`` lognormal lengths of median 500 and sigma 0.7 clipped to [16, 4096]: few samples under 100
    tokens, so the gaps a random-order best fit leaves are hard to close."""
    rng = np.random.default_rng(seed)
    return np.clip(np.exp(math.log(500.0) + 0.7 * rng.standard_normal(n)).round(), 16, 4096).astype(np.int64)


def speed(args, lengths: np.ndarray, label: str) -> dict:
    from trl.data_utils import pack_dataset

    n = lengths.size
    n_trl = 20_000 if args.quick else 100_000
    repeat = 3 if args.quick else 7
    budget = 4096
    print(f"\n== speed: {n:,} {label} (mean {lengths.mean():.1f}, 16..4096), budget {budget} ==")

    start = time.perf_counter()
    _binpack.pack_best_fit_decreasing(lengths[:1000], budget)
    _binpack.pack_next_fit(lengths[:1000], budget)
    first_call = time.perf_counter() - start  # compilation, or loading numba's on-disk cache

    ours = measure(lambda: _binpack.pack_best_fit_decreasing(lengths, budget), repeat=repeat)
    naive = measure(lambda: _binpack.pack_next_fit(lengths, budget), repeat=repeat)
    packing = _binpack.pack_best_fit_decreasing(lengths, budget)
    next_fit = _binpack.pack_next_fit(lengths, budget)
    bound = _binpack.lower_bound_l2(lengths, budget)

    order = np.random.default_rng(0).permutation(lengths.size)
    random_order = measure(lambda: _binpack.pack_best_fit_random_order(lengths, budget, order), repeat=repeat)
    random_packing = _binpack.pack_best_fit_random_order(lengths, budget, order)
    plans = {}
    for mixing in ("random", "sorted"):
        sampler = MultipackBatchSampler(lengths, budget, num_replicas=8, rank=0, mixing=mixing)
        first_epoch = measure(
            lambda m=mixing: MultipackBatchSampler(lengths, budget, num_replicas=8, rank=0, mixing=m)._plan(
                0
            ),
            repeat=1,
        )
        epochs = iter(range(1, 10_000))
        plan = measure(lambda s=sampler, e=epochs: s._plan(next(e)), repeat=repeat)  # a fresh epoch per call
        plans[mixing] = (sampler, first_epoch, plan)
    sampler, first_epoch, plan = plans["random"]
    sorted_sampler, sorted_first_epoch, sorted_plan = plans["sorted"]

    subset = lengths[:n_trl]
    dataset = arrow_dataset(subset)
    trl = measure(lambda: pack_dataset(dataset, budget, strategy="bfd"), repeat=1, warmup=0)
    ours_subset = measure(lambda: _binpack.pack_best_fit_decreasing(subset, budget), repeat=repeat)
    trl_rows, _ = trl_bfd_rows(dataset, budget)
    ours_subset_bins = _binpack.pack_best_fit_decreasing(subset, budget).num_bins

    result = {
        "n": n,
        "budget": budget,
        "mean_length": float(lengths.mean()),
        "first_call_s": first_call,
        "multipack_cpu_s": ours["cpu"],
        "multipack_wall_s": ours["wall"],
        "multipack_wall_min_s": ours["wall_min"],
        "random_order_cpu_s": random_order["cpu"],
        "random_order_batches": random_packing.num_bins,
        "sampler_first_epoch_cpu_s": first_epoch["cpu"],
        "sampler_first_epoch_wall_s": first_epoch["wall"],
        "sampler_epoch_plan_cpu_s": plan["cpu"],
        "sampler_epoch_plan_wall_s": plan["wall"],
        "sampler_batches": len(sampler) * 8,
        "sorted_sampler_first_epoch_cpu_s": sorted_first_epoch["cpu"],
        "sorted_sampler_epoch_plan_cpu_s": sorted_plan["cpu"],
        "sorted_sampler_batches": len(sorted_sampler) * 8,
        "next_fit_cpu_s": naive["cpu"],
        "multipack_batches": packing.num_bins,
        "next_fit_batches": next_fit.num_bins,
        "lower_bound_l2": bound,
        "multipack_fill": packing.efficiency(),
        "next_fit_fill": next_fit.efficiency(),
        "multipack_over_bound_pct": 100.0 * (packing.num_bins - bound) / bound,
        "trl_n": n_trl,
        "trl_bfd_cpu_s": trl["cpu"],
        "trl_bfd_wall_s": trl["wall"],
        "multipack_on_trl_subset_cpu_s": ours_subset["cpu"],
        "speedup_vs_trl_same_n": trl["cpu"] / ours_subset["cpu"],
        "throughput_ratio_vs_trl": (n / ours["cpu"]) / (n_trl / trl["cpu"]),
        "trl_bfd_batches": trl_rows,
        "multipack_batches_on_trl_subset": ours_subset_bins,
        "time_ratio_vs_next_fit": ours["cpu"] / naive["cpu"],
    }
    rows = [
        {
            "method": f"multipack (ours), {n:,}",
            "cpu_s": ours["cpu"],
            "wall_s": ours["wall"],
            "batches": packing.num_bins,
            "fill": packing.efficiency(),
        },
        {
            "method": f"next-fit (numba), {n:,}",
            "cpu_s": naive["cpu"],
            "wall_s": naive["wall"],
            "batches": next_fit.num_bins,
            "fill": next_fit.efficiency(),
        },
        {
            "method": f"random-order best fit, {n:,}",
            "cpu_s": random_order["cpu"],
            "wall_s": random_order["wall"],
            "batches": random_packing.num_bins,
            "fill": random_packing.efficiency(),
        },
        *(
            {
                "method": f"sampler {mixing}, {which}, {n:,}",
                "cpu_s": timing["cpu"],
                "wall_s": timing["wall"],
                "batches": len(s) * 8,
                "fill": s.efficiency(),
            }
            for mixing, (s, first, later) in plans.items()
            for which, timing in (("first epoch", first), ("next epochs", later))
        ),
        {
            "method": f"multipack (ours), {n_trl:,}",
            "cpu_s": ours_subset["cpu"],
            "wall_s": ours_subset["wall"],
            "batches": ours_subset_bins,
            "fill": "",
        },
        {
            "method": f"TRL pack_dataset bfd, {n_trl:,}",
            "cpu_s": trl["cpu"],
            "wall_s": trl["wall"],
            "batches": trl_rows,
            "fill": "",
        },
    ]
    print_table(rows, ["method", "cpu_s", "wall_s", "batches", "fill"])
    print(
        f"L2 lower bound {bound:,} batches: multipack +{packing.num_bins - bound} "
        f"({result['multipack_over_bound_pct']:.4f}%), next-fit +{next_fit.num_bins - bound}"
    )
    print(
        f"CPU-time speed-up vs TRL bfd on the same {n_trl:,} lengths: {result['speedup_vs_trl_same_n']:.0f}x; "
        f"throughput ratio ({n:,} ours vs {n_trl:,} TRL): {result['throughput_ratio_vs_trl']:.0f}x; "
        f"time vs next-fit: {result['time_ratio_vs_next_fit']:.1f}x for "
        f"{100 * (1 - packing.num_bins / next_fit.num_bins):.1f}% fewer batches"
    )
    return result


def alpaca_text(row: dict, eos: str) -> str:
    template = ALPACA_WITH_INPUT if row.get("input") else ALPACA_NO_INPUT
    return template.format(instruction=row["instruction"], input=row.get("input", "")) + row["output"] + eos


def real_datasets(quick: bool) -> dict[str, list[dict]]:
    gsm8k = [{"instruction": r["question"], "input": "", "output": r["answer"]} for r in load_gsm8k("train")]
    gpteacher = []
    for name in ("gpteacher_roleplay.json", "gpteacher_toolformer.json"):
        with open(DATA_DIR / name) as f:
            gpteacher += json.load(f)
    with open(DATA_DIR / "alpaca_gpt4_1k.json") as f:
        alpaca = json.load(f)
    data = {"gsm8k_train": gsm8k, "gpteacher": gpteacher, "alpaca_gpt4_1k": alpaca}
    return {k: v[:2000] for k, v in data.items()} if quick else data


def mean_length_spread(lengths: np.ndarray, batches) -> float:
    """Std across batches of a batch's mean sample length."""
    return float(np.std([lengths[np.asarray(b)].mean() for b in batches]))


def random_batches_spread(lengths: np.ndarray, budget: int, draws: int = 3) -> float:
    """The same for random batches: shuffled, then cut at the budget (next-fit); mean of ``draws`` shuffles."""
    spreads = []
    for seed in range(draws):
        order = np.random.default_rng(1000 + seed).permutation(lengths.size)
        packing = _binpack.pack_next_fit(lengths[order], budget)
        spreads.append(mean_length_spread(lengths, [order[b] for b in packing.bins()]))
    return float(np.mean(spreads))


def fill(args) -> list[dict]:
    import datasets

    tokenizer = load_tokenizer()
    rows = []
    budgets = (2048, 4096) if args.quick else (2048, 4096, 8192, 16384)
    for name, records in real_datasets(args.quick).items():
        ids = tokenizer([alpaca_text(r, tokenizer.eos_token) for r in records])["input_ids"]
        lengths = np.array([len(x) for x in ids], dtype=np.int64)
        dataset = datasets.Dataset.from_dict({"input_ids": ids})
        for budget in budgets:
            tokens = int(lengths.sum())
            bound = _binpack.lower_bound_l2(lengths, budget)
            mixed = MultipackBatchSampler(lengths, budget)
            ordered = MultipackBatchSampler(lengths, budget, mixing="sorted")
            reference = random_batches_spread(lengths, budget)
            mixed_spread = np.mean([mixed.stats(epoch)["batch_mean_length_std"] for epoch in range(3)])
            trl_rows, trl_tokens = trl_bfd_rows(dataset, budget)
            trl_whole_rows, _ = trl_bfd_rows(dataset, budget, whole=True)
            assert trl_tokens == tokens  # nothing truncated: every sample fits the budget
            next_fit = _binpack.pack_next_fit(lengths, budget)
            batch_size = max(1, round(budget / lengths.mean()))
            padded = padded_batches(
                lengths, batch_size, order=np.random.default_rng(0).permutation(lengths.size)
            )
            rows.append(
                {
                    "dataset": name,
                    "budget": budget,
                    "samples": int(lengths.size),
                    "mean_len": float(lengths.mean()),
                    "tokens": tokens,
                    "L2": bound,
                    "multipack": len(mixed),
                    "over_L2": len(mixed) - bound,
                    "fill": mixed.efficiency(),
                    "fill_vs_L2": bound / len(mixed),
                    "sorted": len(ordered),
                    "sorted_over_L2": len(ordered) - bound,
                    "sorted_fill": ordered.efficiency(),
                    "extra_vs_sorted_pct": 100.0 * (len(mixed) / len(ordered) - 1),
                    "random_batches_len_std": reference,
                    "multipack_len_std_ratio": mixed_spread / reference,
                    "sorted_len_std_ratio": ordered.stats()["batch_mean_length_std"] / reference,
                    "trl_bfd": trl_rows,
                    "trl_bfd_fill": tokens / (trl_rows * budget),
                    "trl_bfd_whole": trl_whole_rows,
                    "trl_bfd_whole_fill": tokens / (trl_whole_rows * budget),
                    "next_fit": next_fit.num_bins,
                    "next_fit_fill": next_fit.efficiency(),
                    "padded_bs": batch_size,
                    "padded_steps": padded.steps,
                    "padded_fill": padded.efficiency,
                }
            )
    print("\n== fill on real data (SmolLM2 tokenizer, Alpaca template + answer + EOS) ==")
    print_table(
        rows,
        [
            "dataset", "budget", "samples", "L2", "multipack", "fill", "sorted", "sorted_fill",
            "extra_vs_sorted_pct", "multipack_len_std_ratio", "sorted_len_std_ratio", "trl_bfd", "trl_bfd_fill",
            "trl_bfd_whole", "next_fit_fill", "padded_fill",
        ],
    )  # fmt: skip
    return rows


def main() -> None:
    args = base_parser(__doc__.splitlines()[0]).parse_args()
    n = 100_000 if args.quick else 1_000_000
    speed_result = speed(args, synthetic_lengths(n), "lognormal lengths (sigma 1.0)")
    hard_result = speed(args, hard_mix_lengths(n), "lognormal lengths (median 500, sigma 0.7)")
    fill_rows = fill(args)
    write_json(
        "bench_sampler", {"speed": speed_result, "speed_sigma_0_7": hard_result, "fill": fill_rows}, args
    )


if __name__ == "__main__":
    main()
