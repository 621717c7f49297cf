"""PaddingFreeCollator vs transformers.DataCollatorWithFlattening, same batches, same run.

Batches are real GSM8K samples (``Question: ...\\nAnswer: ...<eos>`` tokenized with the SmolLM2
tokenizer), drawn in a seeded random order and filled up to 4k, 16k and 64k tokens per batch, as
``datasets`` rows (dicts of Python lists). Three cases: ``input_ids`` only, ``input_ids`` + ``labels``
(question tokens masked with -100), plus ``input_ids`` rows as numpy arrays (a dataset formatted with
``with_format("numpy")``). Both collators are checked to produce identical tensors before
being timed. Reports milliseconds per batch (median) and the speedup ``stock / ours``.

Run from the project root::

    python benchmarks/bench_collator.py            # full run
    python benchmarks/bench_collator.py --quick    # smoke run
"""

from __future__ import annotations

import random
import sys

import numpy as np
import torch
from _common import base_parser, compare_calls, load_gsm8k, load_tokenizer, print_table, write_json
from transformers import DataCollatorWithFlattening

from packing_hf import PaddingFreeCollator

BUDGETS = (4096, 16384, 65536)


def build_features(limit: int | None) -> tuple[list[dict], list[dict]]:
    """GSM8K rows as features: ``[{"input_ids"}]`` and ``[{"input_ids", "labels"}]`` (prompt masked)."""
    tokenizer = load_tokenizer()
    rows = load_gsm8k("train", limit)
    prompts = [f"Question: {r['question']}\nAnswer:" for r in rows]
    texts = [f"{p} {r['answer']}{tokenizer.eos_token}" for p, r in zip(prompts, rows, strict=True)]
    ids = tokenizer(texts)["input_ids"]
    prompt_lengths = [len(p) for p in tokenizer(prompts)["input_ids"]]
    plain = [{"input_ids": x} for x in ids]
    # the prompt's last token may merge with the answer's first one; the mask only needs to be plausible
    with_labels = [
        {"input_ids": x, "labels": [-100] * min(k, len(x)) + x[k:]}
        for x, k in zip(ids, prompt_lengths, strict=True)
    ]
    return plain, with_labels


def make_batches(features: list[dict], budget: int, count: int, seed: int = 0) -> list[list[dict]]:
    """``count`` batches of consecutive samples (seeded shuffle), each filled up to ``budget`` tokens."""
    order = list(range(len(features)))
    random.Random(seed).shuffle(order)
    batches, current, tokens, cursor = [], [], 0, 0
    while len(batches) < count:
        feature = features[order[cursor % len(order)]]
        cursor += 1
        n = len(feature["input_ids"])
        if current and tokens + n > budget:
            batches.append(current)
            current, tokens = [], 0
        current.append(feature)
        tokens += n
    return batches


def check_identical(stock: dict, ours: dict, where: str) -> None:
    """Refuse to time collators that disagree: a fast wrong answer is worth nothing."""
    for key, expected in stock.items():
        got = ours.get(key)
        same = torch.equal(expected, got) if isinstance(expected, torch.Tensor) else expected == got
        if not same or (isinstance(expected, torch.Tensor) and expected.dtype != got.dtype):
            sys.exit(f"{where}: PaddingFreeCollator and DataCollatorWithFlattening differ on {key!r}")


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=8, help="distinct batches per size (cycled)")
    parser.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="cpu (default): process CPU time, steady on a shared machine (both collators are single-threaded); "
        "wall: elapsed time",
    )
    args = parser.parse_args()
    repeat = 5 if args.quick else 30
    plain, with_labels = build_features(limit=2000 if args.quick else None)

    stock = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)
    ours = PaddingFreeCollator(return_seq_idx=True)

    rows = []
    # rows of a dataset formatted with .with_format("numpy") arrive as arrays
    numpy_rows = [{"input_ids": np.asarray(f["input_ids"], dtype=np.int64)} for f in plain]
    cases = (("input_ids", plain), ("input_ids+labels", with_labels), ("input_ids numpy", numpy_rows))
    for case, features in cases:
        for budget in BUDGETS:
            batches = make_batches(features, budget, args.batches)
            for i, batch in enumerate(batches):
                check_identical(stock(batch), ours(batch), f"{case}, {budget} tokens, batch {i}")
            timings = compare_calls(
                {
                    "stock": lambda b=batches: [stock(x) for x in b],
                    "ours": lambda b=batches: [ours(x) for x in b],
                },
                repeat=repeat,
                clock=args.clock,
            )
            t_stock = timings["stock"]["median"] / len(batches)
            t_ours = timings["ours"]["median"] / len(batches)
            tokens = sum(len(f["input_ids"]) for b in batches for f in b) / len(batches)
            rows.append(
                {
                    "case": case,
                    "budget": budget,
                    "tokens": round(tokens),
                    "samples": round(sum(map(len, batches)) / len(batches), 1),
                    "stock_ms": t_stock * 1e3,
                    "ours_ms": t_ours * 1e3,
                    "speedup": t_stock / t_ours,
                    "ours_Mtok_s": tokens / t_ours / 1e6,
                }
            )
    print(
        f"\nPaddingFreeCollator vs DataCollatorWithFlattening (interleaved, median of {repeat}, {args.clock} ms per batch)"
    )
    print_table(
        rows, ["case", "budget", "tokens", "samples", "stock_ms", "ours_ms", "speedup", "ours_Mtok_s"]
    )
    write_json("bench_collator", {"repeat": repeat, "clock": args.clock, "rows": rows}, args)


if __name__ == "__main__":
    main()
