"""Batching-strategy statistics: how padded, online, fixed-length and multipack batches use their tokens.

Pure numpy over sample lengths (no torch, no HF), built on the bin-packing algorithms of
:mod:`packing_hf._binpack`. ``packing-hf stats`` prints :func:`compare_strategies`; the main job and the
benchmarks use :func:`padded_batches` as the padded baseline.

>>> [s.strategy for s in compare_strategies([5, 3, 8, 2, 7, 1], 10)]
['padded', 'online', 'fixed', 'fixed-split', 'multipack']
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._binpack import (
    LengthsLike,
    as_lengths,
    check_budget,
    lower_bound_l2,
    pack_best_fit_decreasing,
    pack_next_fit,
)
from ._limits import check_int

__all__ = [
    "StrategyStats",
    "compare_strategies",
    "fixed_length_packing",
    "multipack",
    "online_minibatches",
    "padded_batches",
]


@dataclass(frozen=True)
class StrategyStats:
    """How one batching strategy uses the tokens it provisions, on one dataset.

    Attributes:
        strategy: short name (``"padded"``, ``"online"``, ``"fixed"``, ``"fixed-split"``, ``"multipack"``).
        steps: batches (rows for fixed-length packing) in one epoch.
        real_tokens: tokens of data the model sees (after any truncation).
        slot_tokens: tokens the strategy provisions: padded ``batch x longest`` for padded batches,
            ``steps x max_step_tokens`` for online flattening (memory must hold the largest step),
            ``steps x budget`` for fixed-length rows and multipack.
        max_step_tokens: the largest step, in provisioned tokens (what peak memory scales with).
        truncated_tokens: tokens cut off samples longer than the budget (0 where nothing is cut).
        split_samples: samples cut across two rows (only ``"fixed-split"``: their pieces cannot
            attend to each other).
        note: one line on what the strategy does.

    >>> s = padded_batches([3, 1, 2, 2], batch_size=2)
    >>> s.steps, s.real_tokens, s.slot_tokens, round(s.efficiency, 3)
    (2, 8, 10, 0.8)
    """

    strategy: str
    steps: int
    real_tokens: int
    slot_tokens: int
    max_step_tokens: int
    truncated_tokens: int = 0
    split_samples: int = 0
    note: str = ""

    @property
    def efficiency(self) -> float:
        """``real_tokens / slot_tokens`` (1.0 when nothing is provisioned)."""
        return self.real_tokens / self.slot_tokens if self.slot_tokens else 1.0

    @property
    def padding_tokens(self) -> int:
        """Provisioned tokens that hold no data."""
        return self.slot_tokens - self.real_tokens

    def as_dict(self) -> dict[str, int | float | str]:
        """A flat dict (for tables, JSON, loggers), with ``efficiency`` and ``padding_tokens``."""
        return {
            "strategy": self.strategy,
            "steps": self.steps,
            "real_tokens": self.real_tokens,
            "slot_tokens": self.slot_tokens,
            "padding_tokens": self.padding_tokens,
            "efficiency": self.efficiency,
            "max_step_tokens": self.max_step_tokens,
            "truncated_tokens": self.truncated_tokens,
            "split_samples": self.split_samples,
            "note": self.note,
        }


def _ordered(lengths: LengthsLike, order: np.ndarray | None) -> np.ndarray:
    lengths = as_lengths(lengths)
    if order is None:
        return lengths
    order = np.asarray(order, dtype=np.int64)
    if order.shape != lengths.shape or (
        lengths.size and not np.array_equal(np.sort(order), np.arange(lengths.size))
    ):
        raise ValueError(f"order must be a permutation of range({lengths.size}), got shape {order.shape}")
    return lengths[order]


def _steps_of(
    lengths: LengthsLike, batch_size: int, order: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """The lengths in visiting order and the first sample of every step of ``batch_size`` samples."""
    batch_size = check_int(batch_size, "batch_size (samples per step)", 1)
    lengths = _ordered(lengths, order)
    return lengths, np.arange(0, lengths.size, batch_size)


def padded_batches(
    lengths: LengthsLike, batch_size: int, *, order: np.ndarray | None = None
) -> StrategyStats:
    """Plain padded batches: ``batch_size`` samples per step, each padded to the step's longest.

    Args:
        lengths: ``(n,)`` ints > 0.
        batch_size: samples per step (the last step may hold fewer).
        order: ``(n,)`` visiting order (default: dataset order; pass a random permutation for what a
            shuffled ``DataLoader`` sees).

    >>> padded_batches([4, 1, 1, 1], batch_size=2).as_dict()["padding_tokens"]
    3
    """
    lengths, starts = _steps_of(lengths, batch_size, order)
    if lengths.size == 0:
        return StrategyStats("padded", 0, 0, 0, 0, note="batches padded to their longest sample")
    slots = np.maximum.reduceat(lengths, starts) * np.diff(np.append(starts, lengths.size))  # longest x size
    note = f"{batch_size} samples per step, padded to the longest"
    return StrategyStats(
        "padded", starts.size, int(lengths.sum()), int(slots.sum()), int(slots.max()), note=note
    )


def online_minibatches(
    lengths: LengthsLike, batch_size: int, *, order: np.ndarray | None = None
) -> StrategyStats:
    """Online minibatch flattening: ``batch_size`` samples per step, concatenated without padding.

    No token is padding, but the step size in tokens varies with the samples drawn, so memory must
    be provisioned for the largest step: ``slot_tokens = steps x max_step_tokens``. Its efficiency
    measures how steady the steps are (``mean / max`` tokens per step).

    >>> s = online_minibatches([4, 1, 1, 1], batch_size=2)
    >>> s.max_step_tokens, s.slot_tokens, s.efficiency
    (5, 10, 0.7)
    """
    lengths, starts = _steps_of(lengths, batch_size, order)
    if lengths.size == 0:
        return StrategyStats("online", 0, 0, 0, 0, note="samples flattened per step, no padding")
    largest = int(np.add.reduceat(lengths, starts).max())
    note = f"{batch_size} samples per step, flattened; memory sized for the largest step"
    return StrategyStats("online", starts.size, int(lengths.sum()), starts.size * largest, largest, note=note)


def fixed_length_packing(
    lengths: LengthsLike, max_length: int, *, split: bool = False, order: np.ndarray | None = None
) -> StrategyStats:
    """Offline fixed-length rows of ``max_length`` tokens, filled greedily in order.

    ``split=False``: a sample that does not fit the current row starts the next one (next-fit);
    samples longer than ``max_length`` are truncated (counted in ``truncated_tokens``).
    ``split=True``: samples are concatenated and cut every ``max_length`` tokens (TRL's
    ``"wrapped"``): rows are full, but ``split_samples`` samples are cut across rows.

    >>> fixed_length_packing([3, 3, 3], 4).steps, fixed_length_packing([3, 3, 3], 4, split=True).steps
    (3, 3)
    >>> fixed_length_packing([3, 3, 3], 6, split=True).split_samples
    0
    """
    max_length = check_budget(max_length, "max_length")
    lengths = _ordered(lengths, order)
    if split:
        total = int(lengths.sum())
        rows = -(-total // max_length)
        ends = np.cumsum(lengths)
        # a sample is cut when a row boundary falls strictly inside it
        crossing = (ends - lengths) // max_length != (ends - 1) // max_length
        return _budget_rows(
            "fixed-split",
            rows,
            total,
            max_length,
            split_samples=int(crossing.sum()),
            note=f"concatenated and cut every {max_length:,} tokens (samples cut across rows)",
        )
    note = f"greedy in order into rows of {max_length:,} tokens (next-fit), long samples truncated"
    return _truncated_rows("fixed", lengths, max_length, pack_next_fit, note)


def _budget_rows(
    strategy: str, steps: int, real_tokens: int, budget: int, **counts: int | str
) -> StrategyStats:
    """The stats of ``steps`` rows provisioned at ``budget`` tokens each (fixed-length rows, multipack)."""
    return StrategyStats(
        strategy,
        steps=steps,
        real_tokens=real_tokens,
        slot_tokens=steps * budget,
        max_step_tokens=budget if steps else 0,
        **counts,
    )


def _truncated_rows(
    strategy: str, lengths: np.ndarray, budget: int, pack: Callable[[np.ndarray, int], Any], note: str
) -> StrategyStats:
    """Samples cut to ``budget`` (the cut tokens counted), then packed by ``pack`` into rows of ``budget``."""
    kept = np.minimum(lengths, budget)
    steps = pack(kept, budget).num_bins
    return _budget_rows(
        strategy, steps, int(kept.sum()), budget, truncated_tokens=int((lengths - kept).sum()), note=note
    )


def multipack(lengths: LengthsLike, max_tokens_per_batch: int) -> StrategyStats:
    """Multipack: best-fit decreasing bins of ``max_tokens_per_batch`` (long samples truncated, counted).

    >>> multipack([3, 3, 2, 2, 4], 7).steps
    2
    """
    max_tokens_per_batch = check_budget(max_tokens_per_batch, "max_tokens_per_batch")
    lengths = as_lengths(lengths)
    bound = lower_bound_l2(np.minimum(lengths, max_tokens_per_batch), max_tokens_per_batch)
    note = f"best-fit decreasing bins; L2 lower bound {bound} batches"
    return _truncated_rows("multipack", lengths, max_tokens_per_batch, pack_best_fit_decreasing, note)


def compare_strategies(
    lengths: LengthsLike, max_tokens_per_batch: int, *, batch_size: int | None = None, seed: int = 0
) -> list[StrategyStats]:
    """All strategies on one dataset, at the same average tokens per step.

    Args:
        lengths: ``(n,)`` token count of every sample.
        max_tokens_per_batch: the token budget (row length for fixed-length packing).
        batch_size: samples per step for padded / online batches; default
            ``max(1, round(max_tokens_per_batch / mean length))``, so that every strategy moves about
            the same number of real tokens per step.
        seed: seed of the shuffled order used for padded / online batches.

    Returns:
        ``[padded, online, fixed, fixed-split, multipack]`` as :class:`StrategyStats`.

    >>> [s.strategy for s in compare_strategies([5, 3, 8, 2, 7, 1], 10)]
    ['padded', 'online', 'fixed', 'fixed-split', 'multipack']
    """
    max_tokens_per_batch = check_budget(max_tokens_per_batch, "max_tokens_per_batch")
    lengths = as_lengths(lengths)
    if lengths.size == 0:
        raise ValueError("lengths is empty: there is nothing to compare")
    if batch_size is None:
        batch_size = max(1, round(max_tokens_per_batch / float(lengths.mean())))
    order = np.random.default_rng(seed).permutation(lengths.size)
    return [
        padded_batches(lengths, batch_size, order=order),
        online_minibatches(lengths, batch_size, order=order),
        fixed_length_packing(lengths, max_tokens_per_batch),
        fixed_length_packing(lengths, max_tokens_per_batch, split=True),
        multipack(lengths, max_tokens_per_batch),
    ]
