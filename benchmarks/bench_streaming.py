"""Streaming packing vs the map-style sampler: fill, samples/s and memory over a 10M-sample stream.

The lengths follow the shared real data: GSM8K train, GPTeacher roleplay + toolformer and Alpaca-GPT4 1k,
tokenized with the SmolLM2 tokenizer (Alpaca prompt + answer + EOS, as in ``bench_sampler.py``);
``--samples`` lengths (default 10,000,000) are drawn from them with replacement. Budget 4096.

Contenders, each in its own fresh process so that its resident memory (RSS) is its own:

- ``PackedStream`` (ours, streaming): samples are generated on the fly, chunk by chunk (token lists
  sliced from one shared list), through a function source, so the dataset never exists in memory;
  one full pass, RSS and throughput sampled every ``--every`` samples.
- ``MultipackBatchSampler`` (map-style): needs every length up front (an 8-byte-per-sample array here;
  a real map-style run also holds the dataset, not counted), plans the epoch, then yields index lists.

Both pack the same lengths. Reported: fill (real tokens / (batches x budget)), batches against the L2
lower bound, samples/s (CPU time, one thread; wall time too), RSS at start / middle / end and its growth
over the run, and, as a fixed reference, offline best-fit decreasing over all lengths at once. Run from the project root: ``python benchmarks/bench_streaming.py [--quick]``; writes
``benchmarks/results/streaming.json``.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time

import numpy as np
from _common import DATA_DIR, base_parser, load_gsm8k, load_tokenizer, print_table, write_json

BUDGET = 4096
ALPACA_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the "
    "request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
)


def real_lengths() -> np.ndarray:
    """Token lengths of the shared data sets (about 19,000 samples)."""
    tokenizer = load_tokenizer()
    records = [
        {"instruction": r["question"], "input": "", "output": r["answer"]} for r in load_gsm8k("train")
    ]
    for name in ("gpteacher_roleplay.json", "gpteacher_toolformer.json", "alpaca_gpt4_1k.json"):
        with open(DATA_DIR / name) as f:
            records += json.load(f)
    texts = []
    for r in records:
        template = ALPACA_WITH_INPUT if r.get("input") else ALPACA_NO_INPUT
        prompt = template.format(instruction=r["instruction"], input=r.get("input", ""))
        texts.append(prompt + r["output"] + tokenizer.eos_token)
    return np.array([len(x) for x in tokenizer(texts)["input_ids"]], dtype=np.int64)


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def chunk_lengths(pool: np.ndarray, n: int, chunk: int, seed: int):
    """The ``n`` stream lengths, chunk by chunk (the same sequence every time for a seed)."""
    for c, start in enumerate(range(0, n, chunk)):
        rng = np.random.default_rng([seed, c])
        yield rng.choice(pool, size=min(chunk, n - start))


def run_streaming(pool: np.ndarray, n: int, every: int, queue) -> None:
    import torch

    from packing_hf.streaming import PackedStream

    torch.set_num_threads(1)
    tokens_row = [7] * int(pool.max())  # samples are slices of this: real lists, nothing shared mutably

    def source():
        for lengths in chunk_lengths(pool, n, 100_000, seed=0):
            for length in lengths.tolist():
                yield {"input_ids": tokens_row[:length]}

    stream = PackedStream(source, BUDGET, buffer_size=2048, open_batches=32, seed=0)
    trace = [(0, time.perf_counter(), time.process_time(), rss_mb())]
    seen = batches = tokens = 0
    next_mark = every
    for batch in stream:
        batches += 1
        seen += len(batch)
        tokens += sum(len(s["input_ids"]) for s in batch)
        if seen >= next_mark:
            trace.append((seen, time.perf_counter(), time.process_time(), rss_mb()))
            next_mark += every
    trace.append((seen, time.perf_counter(), time.process_time(), rss_mb()))
    stats = stream.stats()
    queue.put({"samples": seen, "batches": batches, "tokens": tokens, "trace": trace, "stats": stats})


def run_map_style(pool: np.ndarray, n: int, every: int, queue) -> None:
    import torch

    from packing_hf import _binpack
    from packing_hf.sampler import MultipackBatchSampler

    torch.set_num_threads(1)
    trace = [(0, time.perf_counter(), time.process_time(), rss_mb())]
    lengths = np.concatenate(list(chunk_lengths(pool, n, 100_000, seed=0)))  # all lengths up front
    sampler = MultipackBatchSampler(lengths, BUDGET, seed=0)
    seen = batches = tokens = 0
    next_mark = every
    for batch in sampler:
        batches += 1
        seen += len(batch)
        tokens += int(lengths[batch].sum())
        if seen >= next_mark:
            trace.append((seen, time.perf_counter(), time.process_time(), rss_mb()))
            next_mark += every
    trace.append((seen, time.perf_counter(), time.process_time(), rss_mb()))
    offline = _binpack.pack_best_fit_decreasing(lengths, BUDGET)  # reference: no shuffling, no ranks
    queue.put(
        {
            "samples": seen,
            "batches": batches,
            "tokens": tokens,
            "trace": trace,
            "lower_bound": _binpack.lower_bound_l2(lengths, BUDGET),
            "offline_bfd_batches": offline.num_bins,
            "offline_bfd_fill": offline.efficiency(),
        }
    )


def in_process(target, *args) -> dict:
    """Run ``target(*args, queue)`` in a fresh spawned process: its memory is measured on its own."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def summarize(name: str, result: dict, n: int) -> dict:
    trace = np.array(result["trace"], dtype=np.float64)  # (marks, 4): samples, wall, cpu, rss
    wall = trace[-1, 1] - trace[0, 1]
    cpu = trace[-1, 2] - trace[0, 2]
    rss = trace[:, 3]
    after_warmup = rss[len(rss) // 10 :] if len(rss) > 10 else rss
    mid = rss[len(rss) // 2]
    return {
        "method": name,
        "samples": int(result["samples"]),
        "batches": int(result["batches"]),
        "fill": result["tokens"] / (result["batches"] * BUDGET),
        "samples_per_s_cpu": n / cpu,
        "samples_per_s_wall": n / wall,
        "rss_before_data_mb": float(rss[0]),
        "rss_start_mb": float(rss[1] if len(rss) > 2 else rss[0]),
        "rss_mid_mb": float(mid),
        "rss_end_mb": float(rss[-1]),
        "rss_max_mb": float(rss.max()),
        "rss_growth_after_10pct_mb": float(after_warmup.max() - after_warmup.min()),
        "cpu_s": cpu,
        "wall_s": wall,
    }


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=None, help="stream length (default 10M, --quick 1M)")
    parser.add_argument("--every", type=int, default=None, help="samples between RSS/throughput samples")
    args = parser.parse_args()
    n = args.samples or (1_000_000 if args.quick else 10_000_000)
    every = args.every or max(1, n // 40)
    pool = real_lengths()
    print(f"lengths of the shared data: {pool.size:,} samples, mean {pool.mean():.1f}, max {pool.max()}")
    print(f"streaming {n:,} samples drawn from them, budget {BUDGET}")

    streaming = in_process(run_streaming, pool, n, every)
    map_style = in_process(run_map_style, pool, n, every)
    rows = [
        summarize("PackedStream (streaming)", streaming, n),
        summarize("MultipackBatchSampler (map)", map_style, n),
    ]
    bound = int(map_style["lower_bound"])
    for row in rows:
        row["over_L2_pct"] = 100.0 * (row["batches"] - bound) / bound
    print_table(
        rows,
        ["method", "samples", "batches", "over_L2_pct", "fill", "samples_per_s_cpu", "samples_per_s_wall",
         "rss_before_data_mb", "rss_start_mb", "rss_end_mb", "rss_growth_after_10pct_mb"],
    )  # fmt: skip
    ours, base = rows
    ratios = {
        "fill_ratio": ours["fill"] / base["fill"],
        "throughput_ratio_cpu": ours["samples_per_s_cpu"] / base["samples_per_s_cpu"],
        "rss_end_ratio": ours["rss_end_mb"] / base["rss_end_mb"],
    }
    print(
        f"offline best-fit decreasing over all lengths (reference): {map_style['offline_bfd_batches']:,} batches, "
        f"fill {map_style['offline_bfd_fill']:.4f}"
    )
    print(
        f"L2 lower bound {bound:,} batches. Streaming vs map-style: fill x{ratios['fill_ratio']:.4f}, "
        f"samples/s (CPU) x{ratios['throughput_ratio_cpu']:.2f}, end RSS x{ratios['rss_end_ratio']:.2f}; "
        f"streaming RSS grew {ours['rss_growth_after_10pct_mb']:.1f} MB after the first 10% "
        f"(map-style: {base['rss_growth_after_10pct_mb']:.1f} MB)"
    )
    trace_fields = ["samples", "wall_s", "cpu_s", "rss_mb"]
    write_json(
        "streaming",
        {
            "n": n,
            "budget": BUDGET,
            "length_pool": {"size": int(pool.size), "mean": float(pool.mean()), "max": int(pool.max())},
            "lower_bound_l2": bound,
            "offline_bfd_batches": int(map_style["offline_bfd_batches"]),
            "offline_bfd_fill": float(map_style["offline_bfd_fill"]),
            "rows": rows,
            "ratios": ratios,
            "streaming_stats": streaming["stats"],
            "traces": {
                "streaming": {"fields": trace_fields, "points": streaming["trace"]},
                "map_style": {"fields": trace_fields, "points": map_style["trace"]},
            },
        },
        args,
    )


if __name__ == "__main__":
    main()
