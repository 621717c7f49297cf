"""Small helpers shared by the benchmark scripts (plain scripts, run from the project root).

Every benchmark compares packing_hf against the stock baseline *in the same run*, prints a table of
ratios and writes JSON under ``benchmarks/results/`` (git-ignored). Timings never go into tests.

Usage from a script in ``benchmarks/`` (run as ``python benchmarks/bench_x.py``, so this folder is on
``sys.path``)::

    from _common import base_parser, gsm8k_token_ids, print_table, time_call, write_json

    args = base_parser("what this measures").parse_args()
    stats = time_call(lambda: fn(batch), repeat=5 if args.quick else 30)
    print_table(rows, ["case", "ours_ms", "stock_ms", "speedup"])
    write_json("bench_x", {"rows": rows}, args)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
# ../shared/data relative to the project root, as in tests/conftest.py; PACKING_HF_DATA overrides it.
# A clone outside the workplace's tree falls back to the workplace's fixed location of the data.
_CANDIDATES = (ROOT.parent / "shared" / "data", Path("/work/shared/data"))
DATA_DIR = Path(
    os.environ.get("PACKING_HF_DATA", next((p for p in _CANDIDATES if p.is_dir()), _CANDIDATES[0]))
)
TOKENIZER_DIR = DATA_DIR / "smollm2_tokenizer"
RESULTS_DIR = ROOT / "benchmarks" / "results"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def base_parser(description: str) -> argparse.ArgumentParser:
    """An argument parser with the flags every benchmark shares: ``--quick`` and ``--output``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--quick", action="store_true", help="fewer sizes and repeats (a smoke run, ~seconds)"
    )
    parser.add_argument(
        "--output", type=Path, default=None, help="JSON path (default: benchmarks/results/<name>.json)"
    )
    return parser


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while timing (as ``timeit`` does): otherwise a collection
    triggered by one function's allocations is billed to whichever function runs next."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


def time_call(
    fn: Callable[[], Any], *, repeat: int = 30, warmup: int = 3, clock: str = "wall"
) -> dict[str, float]:
    """Time ``fn()``: ``warmup`` untimed calls, then ``repeat`` timed ones (garbage collector paused).

    ``clock="wall"`` (``perf_counter``) is what a user waits; ``clock="cpu"`` (``process_time``, all
    threads of this process) is steadier for single-threaded CPU code on a machine shared with other
    jobs, since time spent waiting for a core is not counted.

    Returns seconds: ``median`` (the figure to report: robust to a noisy shared machine), ``min``,
    ``max`` and the number of timed calls ``n``.
    """
    return compare_calls({"fn": fn}, repeat=repeat, warmup=warmup, clock=clock)["fn"]


def compare_calls(
    fns: dict[str, Callable[[], Any]], *, repeat: int = 30, warmup: int = 3, clock: str = "wall"
) -> dict[str, dict[str, float]]:
    """Time several functions *interleaved* (a, b, a, b, ...), so that load from other processes on a
    shared machine hits all of them alike; ratios of the medians are then fair. ``clock`` and the keys
    returned per function are as in :func:`time_call`.
    """
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    now = CLOCKS[clock]
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    with _gc_paused():
        for _ in range(repeat):
            for name, fn in fns.items():
                start = now()
                fn()
                times[name].append(now() - start)
    return {
        name: {"median": statistics.median(t), "min": min(t), "max": max(t), "n": repeat}
        for name, t in times.items()
    }


def load_tokenizer():
    """The SmolLM2 tokenizer from the shared data folder (offline)."""
    from transformers import AutoTokenizer

    if not TOKENIZER_DIR.is_dir():
        sys.exit(f"tokenizer not found at {TOKENIZER_DIR}; set PACKING_HF_DATA to the shared data folder")
    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))


def load_gsm8k(split: str = "train", limit: int | None = None) -> list[dict]:
    """GSM8K rows ``{"question", "answer"}`` from the shared data folder, in file order."""
    path = DATA_DIR / f"gsm8k_{split}.jsonl"
    if not path.is_file():
        sys.exit(f"GSM8K not found at {path}; set PACKING_HF_DATA to the shared data folder")
    rows = []
    with open(path) as f:
        for line in f:
            rows.append(json.loads(line))
            if limit is not None and len(rows) >= limit:
                break
    return rows


def gsm8k_token_ids(split: str = "train", limit: int | None = None, tokenizer=None) -> list[list[int]]:
    """GSM8K as ``Question: ...\\nAnswer: ...<eos>`` token ids (the same format as tests/conftest.py)."""
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer()
    rows = load_gsm8k(split, limit)
    texts = [f"Question: {r['question']}\nAnswer: {r['answer']}{tokenizer.eos_token}" for r in rows]
    return tokenizer(texts)["input_ids"]


def compact_vocabulary(samples: Sequence[Sequence[int]]) -> tuple[list[list[int]], int]:
    """The samples with the token ids they use renumbered ``0 .. V - 1``, and ``V``: a small LM head for a CPU run
    of a tiny model on real data (the same sequences, other ids)."""
    used = np.unique(np.concatenate([np.asarray(x, np.int64) for x in samples]))
    remap = np.zeros(int(used.max()) + 1, np.int64)
    remap[used] = np.arange(used.size)
    return [remap[np.asarray(x, np.int64)].tolist() for x in samples], int(used.size)


def environment() -> dict[str, Any]:
    """Versions and machine facts stored next to every result, so figures can be compared fairly."""
    import torch
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> None:
    """Print ``rows`` as a fixed-width text table; floats get 3 significant decimals."""

    def fmt(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3f}" if abs(value) < 1000 else f"{value:.0f}"
        return str(value)

    cells = [[fmt(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)))


def write_json(name: str, payload: dict[str, Any], args: argparse.Namespace | None = None) -> Path:
    """Write ``payload`` plus the environment and CLI args to ``benchmarks/results/<name>.json``."""
    output = getattr(args, "output", None) or RESULTS_DIR / f"{name}.json"
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "benchmark": name,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "args": {k: str(v) for k, v in vars(args).items()} if args is not None else {},
        "environment": environment(),
        **payload,
    }
    output.write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {output.relative_to(ROOT) if output.is_relative_to(ROOT) else output}")
    return output


# ---- run conditions: threads, load, spread (issue 49: figures with their spread) ---------------------------


def add_mix_and_memory_arguments(parser: argparse.ArgumentParser) -> None:
    """``--mix`` (one of :data:`MIXES`) and ``--cpu-memory`` / ``--no-cpu-memory``, shared by bench_trainers and
    bench_e2e."""
    parser.add_argument("--mix", choices=MIXES, default="blend", help="the data mix (see _common.MIXES)")
    parser.add_argument(
        "--cpu-memory", action=argparse.BooleanOptionalAction, default=True,
        help="on CPU, measure every step's peak resident memory (pins glibc's mmap threshold for the whole run: "
        "~15%% more CPU time for every contender alike; --no-cpu-memory for throughput alone)",
    )  # fmt: skip


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    """``--threads``: torch's intra-op threads, set by :func:`set_threads` before the model is built."""
    parser.add_argument(
        "--threads", type=int, default=None,
        help="torch intra-op threads (torch.set_num_threads), default 1 on CPU: with as many threads as cores, "
        "anything else taking a core (another job, the process's own data loading) makes the threads wait for "
        "each other at every parallel region and the runs bimodal; on CUDA torch's own default",
    )  # fmt: skip


def set_threads(threads: int | None, device: str) -> dict[str, Any]:
    """Set torch's intra-op threads (``threads``, or 1 on CPU and torch's default on CUDA when None) and return
    what the run had: ``threads``, ``interop_threads``, ``cpu_count`` and the cores this process may run on."""
    import torch

    if threads is None:
        threads = 1 if device == "cpu" else torch.get_num_threads()
    if threads < 1:
        raise SystemExit(f"--threads {threads}: give at least 1 thread")
    torch.set_num_threads(threads)
    affinity = getattr(os, "sched_getaffinity", None)
    return {
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "cpu_count": os.cpu_count(),
        "usable_cores": len(affinity(0)) if affinity else None,
    }


def load_average() -> list[float] | None:
    """The machine's 1, 5 and 15 minute load averages (``os.getloadavg``), None where there is none: above the
    cores a run uses, other jobs took them and wall-clock figures are not the machine's."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def relative_spread(values: Sequence[float | None]) -> float | None:
    """``(max - min) / median`` of the values given (None left out): the spread of a figure over repeats."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    median = statistics.median(values)
    return (max(values) - min(values)) / median if median else None


def vs_ideal(tokens_per_s: float, rebalance_tokens_per_s: float, rebalance_fill: float) -> float:
    """A padding-free contender's real tokens per second over its ideal against ``batch_rebalance``: the tokens
    per second batch_rebalance would reach if none of its tokens were padding (its real tokens per second over its
    real-token share ``rebalance_fill``, i.e. every token it computes per second). 1.0: packing costs nothing on
    top of the model's work; the same for CPU seconds."""
    return tokens_per_s / (rebalance_tokens_per_s / rebalance_fill)


# ---- data mixes (issue 49: packing against length-grouped padded batches) --------------------------------

#: ``blend``: every real set at once (GSM8K train, GPTeacher, Alpaca-GPT4 1k); ``gsm8k``; ``alpaca_gpteacher``
#: (instructions of a wide length spread); ``long_tail``: multi-turn conversations of real samples, their turn
#: counts long-tailed, each up to the budget (see :func:`mix_token_ids`).
MIXES = ("blend", "gsm8k", "alpaca_gpteacher", "long_tail")


def mix_token_ids(mix: str, tokenizer, n: int, seed: int, budget: int) -> list[list[int]]:
    """``n`` samples of a data mix as token ids (the SmolLM2 tokenizer, Alpaca template + answer + EOS), shuffled
    with ``seed``. None is longer than ``budget``: a sample that is is an error, never cut (except in ``blend``,
    whose benchmarks cut at the budget as before; none of its samples is longer than 1k tokens).

    ``long_tail`` conversations have ``ceil(exp(N(1.0, 1.1)))`` turns (median 3, mean ~5, a few of 20+: the
    distribution of benchmarks/bench_cost.py), every turn a real sample of the blend drawn at random; a
    conversation ends before a turn that would take it over ``budget`` (so the longest reach the budget, none
    passes it, and nothing is cut).
    """
    from bench_sampler import alpaca_text, real_datasets

    if mix not in MIXES:
        raise ValueError(f"unknown data mix {mix!r}; choose from {MIXES}")
    data = real_datasets(False)
    sources = {
        "blend": [r for rows in data.values() for r in rows],
        "gsm8k": data["gsm8k_train"],
        "alpaca_gpteacher": data["gpteacher"] + data["alpaca_gpt4_1k"],
        "long_tail": [r for rows in data.values() for r in rows],
    }
    records = sources[mix]
    rng = np.random.default_rng(seed)
    eos = tokenizer.eos_token
    if mix != "long_tail":
        order = rng.permutation(len(records))[:n]
        ids = tokenizer([alpaca_text(records[i], eos) for i in order])["input_ids"]
        if mix == "blend":
            return [x[:budget] for x in ids]
        too_long = max(map(len, ids))
        if too_long > budget:
            raise SystemExit(
                f"--mix {mix}: a sample of {too_long} tokens is longer than --budget {budget}; raise it"
            )
        return ids
    turns = np.ceil(np.exp(rng.normal(1.0, 1.1, n))).astype(np.int64)
    picked = rng.integers(0, len(records), int(turns.sum()))
    unique, inverse = np.unique(picked, return_inverse=True)
    pool = tokenizer([alpaca_text(records[i], eos) for i in unique])["input_ids"]
    conversations, start = [], 0
    for count in turns:
        conversation: list[int] = []
        for k in inverse[start : start + count]:
            if len(conversation) + len(pool[k]) > budget:
                break
            conversation += pool[k]
        if not conversation:
            raise SystemExit(
                f"--mix long_tail: a turn of {len(pool[inverse[start]])} tokens is longer than --budget"
            )
        conversations.append(conversation)
        start += count
    return conversations


# ---- what a batching does to the steps (issue 49's "real edges") -------------------------------------------


def spread_stats(values: Sequence[float]) -> dict[str, float]:
    """``min``, ``median``, ``max``, ``mean`` and the coefficient of variation ``cv`` (std / mean) of ``values``."""
    array = np.asarray(values, dtype=np.float64)
    mean = float(array.mean())
    return {
        "min": float(array.min()),
        "median": float(np.median(array)),
        "max": float(array.max()),
        "mean": mean,
        "cv": float(array.std() / mean) if mean else 0.0,
    }


def _correlation(x: np.ndarray, y: np.ndarray) -> float | None:
    if x.size < 3 or x.std() == 0 or y.std() == 0:
        return None
    return float(np.corrcoef(x, y)[0, 1])


def batching_statistics(
    steps: Sequence[Sequence[tuple[Sequence[int], int]]], budget: int, shuffles: int = 5
) -> dict[str, Any]:
    """How a batching shapes the steps of one epoch: tokens per step, padding and memory, and how mixed the steps are.

    Args:
        steps: per optimizer step, its micro-batches, each ``(sample lengths, emitted tokens)``: the emitted
            tokens count the padding (a padded ``(B, L)`` batch emits ``B * L``; a packed row its real tokens).
        budget: the tokens one micro-batch may hold at equal memory (a packed row's budget; a padded batch's
            ``B * L``).
        shuffles: random batchings of the same samples the mixing is compared with.

    Returns a dict of:
        ``real_tokens_per_step`` / ``real_tokens_per_micro_batch``: :func:`spread_stats` (constant tokens per step:
        a low ``cv``); ``emitted_max_over_budget``: the largest micro-batch's emitted tokens over ``budget`` (what
        the peak activation memory follows: <= 1 at equal memory) and ``micro_batches_over_budget``;
        ``fill``: real over emitted tokens; ``step_mean_length_std``: the std across steps of a step's mean sample
        length, ``mixing_ratio``: that over the same std for random steps cut the same way (the samples shuffled,
        mean of ``shuffles``; ``mixing_reference`` says how: steps of the same sample counts where every step but
        the last holds as many samples, else steps of at most ``budget`` tokens, filled in the shuffled order as
        next-fit does, since a token budget couples a step's sample count to its lengths): ~1 is mixed like random
        batches, large is length-homogeneous steps;
        ``position_corr``: Pearson's r of a step's mean length with its index in the epoch (a trend over the
        epoch), ``lag1_autocorr``: of consecutive steps' mean lengths (runs of long or short steps).
    """
    lengths = [[n for lens, _ in step for n in lens] for step in steps]
    tokens = [sum(s) for s in lengths]
    micro_real = [sum(lens) for step in steps for lens, _ in step]
    micro_emitted = [emitted for step in steps for _, emitted in step]
    means = np.array([np.mean(s) for s in lengths])
    counts = [len(s) for s in lengths]
    flat = np.concatenate([np.asarray(s, np.float64) for s in lengths])
    fixed_count = len(set(counts[:-1])) <= 1
    random_std = []
    for seed in range(shuffles):
        shuffled = np.random.default_rng(seed).permutation(flat)
        if fixed_count:
            parts = np.split(shuffled, np.cumsum(counts)[:-1])
        else:  # next-fit: a step closes when the next sample would take it over the budget
            parts, start, total = [], 0, 0.0
            for k, n in enumerate(shuffled):
                if total + n > budget and k > start:
                    parts.append(shuffled[start:k])
                    start, total = k, 0.0
                total += n
            parts.append(shuffled[start:])
        random_std.append(float(np.std([p.mean() for p in parts])))
    reference = float(np.mean(random_std))
    std = float(means.std())
    return {
        "steps": len(steps),
        "micro_batches": len(micro_real),
        "samples_per_step": spread_stats(counts),
        "real_tokens_per_step": spread_stats(tokens),
        "real_tokens_per_micro_batch": spread_stats(micro_real),
        "emitted_max_over_budget": max(micro_emitted) / budget,
        "micro_batches_over_budget": sum(e > budget for e in micro_emitted),
        "fill": sum(micro_real) / sum(micro_emitted),
        "step_mean_length_std": std,
        "random_step_mean_length_std": reference,
        "mixing_ratio": std / reference if reference else None,
        "mixing_reference": "same sample counts" if fixed_count else "next-fit at the budget",
        "position_corr": _correlation(np.arange(means.size, dtype=np.float64), means),
        "lag1_autocorr": _correlation(means[:-1], means[1:]) if means.size > 3 else None,
    }


def batching_row(
    contender: str,
    figures: dict[str, Any],
    columns: Sequence[str],
    peak_mib_med: float | None = None,
    peak_mib_max: float | None = None,
) -> dict[str, Any]:
    """One table row of a contender's :func:`batching_statistics` ``figures``: the ``columns`` named, in that order,
    from ``contender``, ``steps``, ``tok_step_med`` / ``_min`` / ``_max`` / ``_cv`` (real tokens per optimizer step),
    ``tok_micro_cv`` (per micro-batch), ``padded_max/budget``, ``fill``, ``mixing_ratio``, ``position_corr``,
    ``lag1_autocorr`` and the measured peak memory per step ``peak_mib_med`` / ``peak_mib_max`` (MiB, None where
    not measured)."""
    tokens = figures["real_tokens_per_step"]
    row = {
        "contender": contender,
        "steps": figures["steps"],
        "tok_step_med": tokens["median"],
        "tok_step_min": tokens["min"],
        "tok_step_max": tokens["max"],
        "tok_step_cv": tokens["cv"],
        "tok_micro_cv": figures["real_tokens_per_micro_batch"]["cv"],
        "padded_max/budget": figures["emitted_max_over_budget"],
        "fill": figures["fill"],
        "mixing_ratio": figures["mixing_ratio"],
        "position_corr": figures["position_corr"],
        "lag1_autocorr": figures["lag1_autocorr"],
        "peak_mib_med": peak_mib_med,
        "peak_mib_max": peak_mib_max,
    }
    return {column: row[column] for column in columns}


def pin_mmap_threshold(threshold: int = 128 * 1024) -> bool:
    """Fix glibc's ``mmap`` threshold (``mallopt(M_MMAP_THRESHOLD)``; its initial value by default), which turns off
    its dynamic raise: by default a freed block of up to 32 MiB raises the threshold, later blocks of that size come
    from the heap, which keeps freed memory, and a step's peak resident memory then no longer follows its tensors.
    Pinned, every block above ``threshold`` is mapped and given back when freed (measured here: a tiny Llama's
    step at 256 / 512 / 1,024 / 2,048 tokens grows the peak by 26 / 53 / 107 / 214 MiB every time; unpinned, the
    same steps read 0 to 230 MiB). It costs every contender alike some page faults (~15 % CPU time on a tiny model).
    Returns False where there is no glibc (the figures are then what the allocator gives)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        return bool(ctypes.CDLL(name).mallopt(-3, threshold))  # M_MMAP_THRESHOLD = -3
    except (OSError, AttributeError):
        return False


class PeakRSS:
    """The growth of this process's peak resident memory over a span, on CPU (Linux): ``start()`` resets the peak
    (``/proc/self/clear_refs``, the kernel's ``VmHWM`` reset), ``growth()`` is the peak since then minus the
    resident memory at ``start()``, in bytes. With :func:`pin_mmap_threshold` (called here) large tensors are
    ``mmap``-ed and given back when freed, so the peak follows a step's activations. ``available`` is False where
    the reset is refused."""

    def __init__(self) -> None:
        self.base = 0
        self.pinned = pin_mmap_threshold()
        try:
            self.start()
            self.available = True
        except OSError:
            self.available = False

    @staticmethod
    def _status(key: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
        raise OSError(f"/proc/self/status has no {key}")

    def start(self) -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self.base = self._status("VmRSS")

    def growth(self) -> int:
        return self._status("VmHWM") - self.base



class StepPeak:
    """The peak memory of one step at a time, in bytes: on CUDA ``max_memory_allocated`` between :meth:`start` and
    :meth:`stop` (both synchronise); on CPU the growth of the peak resident memory (:class:`PeakRSS`, where
    ``cpu_memory`` asks for it and the kernel allows the reset); ``None`` otherwise."""

    def __init__(self, device: str, cpu_memory: bool = True) -> None:
        self.cuda = device == "cuda"
        self.rss = PeakRSS() if not self.cuda and cpu_memory else None

    def start(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        elif self.rss is not None and self.rss.available:
            self.rss.start()

    def stop(self) -> int | None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        if self.rss is not None and self.rss.available:
            return self.rss.growth()
        return None

# ---- equal memory: every contender's micro-batch within the same padded tokens -----------------------------


def equal_memory_batch_size(lengths: Sequence[int], budget: int) -> int:
    """The samples per padded batch whose worst case fits ``budget`` padded tokens: ``budget // longest`` (how a
    user sizes ``per_device_train_batch_size`` so that no step runs out of memory). With ``group_by_length`` the
    batch that holds the longest sample is padded to it all the same, so grouping cannot take more."""
    longest = max(lengths)
    if longest > budget:
        raise ValueError(f"a sample of {longest} tokens is longer than the budget {budget}; raise it")
    return budget // longest


def rebalance_micro_batches(
    lengths: Sequence[int], effective_batch_size: int, grad_accum: int, seed: int = 42, epoch: int = 0
) -> list[list[int]]:
    """transformers' ``BatchRebalanceSampler`` on one device as the Trainer builds it (its default seed 42,
    ``dataloader_drop_last=False``): the micro-batches of one epoch, ``grad_accum`` per optimizer step."""
    from transformers.trainer_pt_utils import BatchRebalanceSampler

    sampler = BatchRebalanceSampler(
        lengths=list(lengths), effective_batch_size=effective_batch_size, dp_size=1, grad_accum=grad_accum,
        seed=seed, drop_last=False,
    )  # fmt: skip
    sampler.set_epoch(epoch)
    return list(sampler)


def rebalance_equal_memory(lengths: Sequence[int], budget: int, grad_accum: int) -> int:
    """The largest effective batch size (samples per optimizer step) for which every micro-batch of
    ``BatchRebalanceSampler`` (``grad_accum`` micro-batches per step, padded to their longest) fits ``budget``
    padded tokens over the epoch, found by bisection over the sizes the Trainer can ask for
    (``per_device_train_batch_size * grad_accum``) whose last step has a micro-batch for every slot (a smaller
    tail would repeat samples); every candidate is checked on the epoch's own micro-batches."""
    lengths = list(lengths)
    n = len(lengths)

    def fits(size: int) -> bool:
        plan = rebalance_micro_batches(lengths, size, grad_accum)
        return max(len(b) * max(lengths[i] for i in b) for b in plan) <= budget

    sizes = [s for s in range(grad_accum, n + 1, grad_accum) if n % s == 0 or n % s >= grad_accum]
    if not sizes or not fits(sizes[0]):
        raise ValueError(
            f"batch_rebalance: {grad_accum} micro-batches of one sample each exceed the budget {budget}"
        )
    low, high = 0, len(sizes) - 1  # sizes[low] fits
    while low < high:
        mid = (low + high + 1) // 2
        if fits(sizes[mid]):
            low = mid
        else:
            high = mid - 1
    return sizes[low]
