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
