"""Bin packing of sample lengths into token budgets, in numpy + numba (no torch, no HF).

A *bin* is one batch: a set of samples whose lengths sum to at most ``budget`` tokens
(``max_tokens_per_batch``). Everything here works on plain integer arrays:

- :func:`pack_best_fit_decreasing`: near-optimal packing (best-fit decreasing with a bit set over
  free space, then a repair step that empties the least-filled bins when it can). On real and
  synthetic length distributions it reaches the Martello-Toth lower bound or comes within a bin of it.
- :func:`pack_best_fit_random_order`: the same best fit and repair, but over the items in a given
  (random) order, with only the items longer than half the budget placed first. Its bins are a
  random mix of lengths (what the sampler uses by default) and come within a fraction of a percent
  of best-fit decreasing on real length distributions.
- :func:`pack_next_fit`: the naive baseline (fill a bin in order, open a new one when the next sample
  does not fit).
- :func:`lower_bound_l1`, :func:`lower_bound_l2`: lower bounds on the number of bins any packing
  needs; L2 (Martello & Toth, 1990) is much tighter than ``ceil(sum / budget)`` when many samples are
  longer than half the budget.
- :func:`packing_efficiency`: real tokens / (bins x budget).
- :func:`sort_decreasing` (stable counting sort with a tie order) and :func:`split_bins` (make the bin
  count a multiple of the number of ranks), the pieces :class:`~packing_hf.MultipackBatchSampler` uses.

A :class:`Packing` holds the result in CSR form: ``items`` (the sample indices, grouped by bin) and
``offsets`` (where every bin starts in ``items``).

>>> packing = pack_best_fit_decreasing([5, 3, 4, 2, 6], budget=10)
>>> packing.bins(), packing.num_bins, lower_bound_l2([5, 3, 4, 2, 6], 10)
([[4, 2], [0, 1, 3]], 2, 2)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ._binpack_kernels import (
    _DEBRUIJN_TABLE,
    _best_fit_exchange,
    _best_fit_sorted,
    _best_fit_sparse,
    _counting_sort_decreasing,
    _empty_bin,
    _group_by_bin,
    _item_keys,
    _level_light_bins,
    _long_first,
    _next_fit,
    _split_long_first,
)
from ._limits import INT32_MAX, check_int
from ._random_kernels import _shuffle

__all__ = [
    "Packing",
    "as_lengths",
    "lower_bound_l1",
    "lower_bound_l2",
    "pack_best_fit_decreasing",
    "pack_best_fit_random_order",
    "pack_next_fit",
    "packing_efficiency",
    "sort_decreasing",
    "split_bins",
]

LengthsLike = Sequence[int] | np.ndarray

# The repair step runs only while best-fit decreasing is more than this fraction above the L2 lower
# bound (on fewer than 10,000 bins: while it is above at all). Best-fit decreasing alone is typically
# 0.005% above L2 on a million lognormal lengths, where bins are all but exactly full and the repair
# would spend longer than the packing to (maybe) save a few bins.
REPAIR_TOLERANCE = 1e-4


# --------------------------------------------------------------------------------------------------
# validation


def as_lengths(lengths: LengthsLike, name: str = "lengths") -> np.ndarray:
    """Validate ``lengths`` and return them as a 1-D int64 array (a view when already int64).

    Raises:
        TypeError: the values are not integers (floats, bools, strings, ragged lists).
        ValueError: not 1-D, or a length is <= 0 (the error names the first bad index and value).

    >>> as_lengths([3, 1, 2]).tolist()
    [3, 1, 2]
    """
    if hasattr(lengths, "detach") and hasattr(lengths, "cpu"):  # a torch tensor, without importing torch
        lengths = lengths.detach().cpu().numpy()
    array = np.asarray(lengths)
    if array.size == 0:
        array = array.astype(np.int64)
    if array.dtype == object or array.dtype.kind not in "iu":
        raise TypeError(
            f"{name} must hold integers, got dtype {array.dtype} (first values {array.ravel()[:5].tolist()}); "
            "pass token counts such as [len(ids) for ids in dataset['input_ids']]"
        )
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D (one length per sample), got shape {array.shape}")
    if array.size and array.min() <= 0:
        bad = int(np.argmax(array <= 0))
        raise ValueError(
            f"{name}[{bad}] = {int(array[bad])}: every sample needs at least one token; "
            "drop empty samples from the dataset before packing"
        )
    return array.astype(np.int64, copy=False)


def check_budget(budget: int, name: str = "budget") -> int:
    budget = check_int(budget, name, 1)
    if budget > INT32_MAX:
        raise ValueError(
            f"{name}={budget} is more tokens than int32 cu_seqlens can address in one batch ({INT32_MAX}); "
            "lower it"
        )
    return int(budget)


def _tree_budget(lengths: np.ndarray, budget: int) -> int:
    """The budget the best-fit kernels index their free-space bit set by: at most the total of the lengths.

    A budget above the total holds everything in one bin, which a bin of exactly the total does too, so the
    plan is the same while memory stays bounded by the data, not by the budget (2**26 tokens of budget would
    otherwise allocate gigabytes for three samples)."""
    return int(min(budget, max(int(lengths.sum()), 1)))


# The best-fit bit set, the counting sort and the L2 histogram are tables indexed by token counts. Up to this
# size (or a few slots per item) they are the fast path; past it the same results come from sorted arrays,
# so memory follows the number of samples, never the lengths or the budget ([2**31 - 1, 2**31 - 1, 5] would
# otherwise ask for tens of GiB).
_TABLE_LIMIT = 1 << 20


def _table_fits(size: int, n_items: int) -> bool:
    return size <= max(_TABLE_LIMIT, 4 * n_items)


def _best_fit(sorted_lengths: np.ndarray, budget: int) -> tuple[np.ndarray, int]:
    """Best fit over the items in the given order: ``(bin of every item, bin count)``, in memory O(n)."""
    capacity = _tree_budget(sorted_lengths, budget)
    if _table_fits(capacity, sorted_lengths.size):
        return _best_fit_sorted(sorted_lengths, capacity)
    return _best_fit_sparse(sorted_lengths, capacity)


# The exchange step of the random-order best fit (:func:`_best_fit_exchange`) closes bins with up to
# budget // _EXCHANGE_GAP_DIVISOR tokens free (256 at a 4,096 budget: the gaps random-order best fit leaves grow
# with the lengths, hence with the budget; a gap of 64 closed lognormal lengths of median 500 and sigma 1.0 to
# the L2 bound, but left 0.25% more bins than it on sigma 0.7, which has few samples under 100 tokens: 256
# reaches 0.001% on a million of either, and lowered the count at a 2,048 budget on long-tail lengths, with
# the same recurring-batch share and batch mean-length spread, bench_cost.py); its index has
# (budget + 1) x (gap + 1) slots, kept under _EXCHANGE_TABLE_LIMIT by lowering the gap on huge budgets. Only
# bins of _EXCHANGE_MIN_ITEMS items or more are closed: closing bins of two raised the share of batches that
# recur in the next epoch from 3.9% to 6.4% (lognormal lengths of median 1,200 at a 2,048 budget, bench_cost.py)
# for no fill (the fill gain is in bins of many short samples).
_EXCHANGE_GAP_DIVISOR = 16
_EXCHANGE_TABLE_LIMIT = 1 << 23
_EXCHANGE_MIN_ITEMS = 3


def _best_fit_any_order(lengths: np.ndarray, budget: int) -> tuple[np.ndarray, int]:
    """Best fit over the items in the given order, closing nearly full bins by exchange: ``(bin of every
    item, bin count)``; plain best fit (:func:`_best_fit`) where the budget is too large for the tables."""
    capacity = _tree_budget(lengths, budget)
    if not _table_fits(capacity, lengths.size):
        return _best_fit_sparse(lengths, capacity)
    small_gap = min(capacity // _EXCHANGE_GAP_DIVISOR, _EXCHANGE_TABLE_LIMIT // (capacity + 1) - 1)
    return _best_fit_exchange(lengths, capacity, max(small_gap, 0), _EXCHANGE_MIN_ITEMS, _DEBRUIJN_TABLE)


def _check_fits(lengths: np.ndarray, budget: int) -> None:
    if lengths.size and lengths.max() > budget:
        bad = int(np.argmax(lengths > budget))
        n_bad = int((lengths > budget).sum())
        raise ValueError(
            f"lengths[{bad}] = {int(lengths[bad])} > budget {budget} ({n_bad} sample(s) too long); no bin can "
            "hold it: raise the budget, or truncate/split long samples first"
        )


# --------------------------------------------------------------------------------------------------
# packings


@dataclass(frozen=True)
class Packing:
    """A packing of ``n`` items into bins, in CSR form.

    Attributes:
        items: ``(n_packed,)`` int64, item indices grouped by bin (bin ``b`` holds
            ``items[offsets[b]:offsets[b + 1]]``).
        offsets: ``(num_bins + 1,)`` int64, starts at 0, non-decreasing.
        bin_tokens: ``(num_bins,)`` int64, tokens in every bin.
        budget: tokens a bin may hold.

    >>> p = pack_next_fit([3, 3, 3], budget=7)
    >>> p.bins(), p.bin_tokens.tolist(), round(p.efficiency(), 3)
    ([[0, 1], [2]], [6, 3], 0.643)
    """

    items: np.ndarray
    offsets: np.ndarray
    bin_tokens: np.ndarray
    budget: int

    @property
    def num_bins(self) -> int:
        return int(self.offsets.size - 1)

    def bins(self) -> list[list[int]]:
        """The bins as Python lists of item indices."""
        items = self.items.tolist()
        bounds = self.offsets.tolist()
        return [items[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]

    def efficiency(self) -> float:
        """Real tokens / (bins x budget); 1.0 for an empty packing."""
        return packing_efficiency(int(self.bin_tokens.sum()), self.num_bins, self.budget)


def _packing_from_bin_of(
    bin_of: np.ndarray, item_ids: np.ndarray, item_lengths: np.ndarray, n_bins: int, budget: int
):
    """Group ``item_ids`` (with their lengths) by ``bin_of``, keeping their order inside a bin."""
    items, offsets, bin_tokens = _group_by_bin(bin_of, item_ids, item_lengths, n_bins)
    return Packing(items=items, offsets=offsets, bin_tokens=bin_tokens, budget=budget)


def sort_decreasing(lengths: LengthsLike, order: np.ndarray | None = None) -> np.ndarray:
    """Item indices sorted by decreasing length, ties kept in the order given by ``order``.

    A stable counting sort, O(n + max length). Passing a random permutation as ``order`` randomizes
    which of several equal-length samples comes first, and nothing else.

    Args:
        lengths: ``(n,)`` ints > 0.
        order: ``(n,)`` a permutation of ``range(n)`` (default: the identity).

    Returns:
        ``(n,)`` int64 indices into ``lengths``.

    >>> sort_decreasing([2, 5, 2, 7], order=np.array([2, 1, 0, 3])).tolist()
    [3, 1, 2, 0]
    """
    lengths = as_lengths(lengths)
    if order is None:
        order = np.arange(lengths.size, dtype=np.int64)
    else:
        order = np.asarray(order, dtype=np.int64)
        if order.shape != lengths.shape:
            raise ValueError(f"order must have shape {lengths.shape} like lengths, got {order.shape}")
    if lengths.size == 0:
        return order.copy()
    longest = int(lengths.max())
    if not _table_fits(longest, lengths.size):  # the same stable order without a table of every length
        return order[np.argsort(-lengths[order], kind="stable")]
    return _counting_sort_decreasing(lengths, order, longest)


def pack_best_fit_decreasing(
    lengths: LengthsLike, budget: int, *, order: np.ndarray | None = None, repair: bool = True
) -> Packing:
    """Pack items into as few bins of ``budget`` tokens as possible (best-fit decreasing + repair).

    Items are visited longest first; each goes into the open bin it fills most tightly (the one with
    the least free space that still fits it), or a new bin. Then, when the bin count is above the L2
    lower bound, :func:`_repair` tries to empty the least-filled bins into the gaps of the others.
    O(n log budget); ~0.1 s for a million items.

    The result depends only on the multiset of lengths, except for *which* of several equal-length
    items lands where: that follows ``order`` (ties are taken in ``order``'s order), so a random
    ``order`` reshuffles equal-length samples between bins without changing the bin structure.

    Args:
        lengths: ``(n,)`` ints in ``[1, budget]``.
        budget: tokens per bin.
        order: optional ``(n,)`` permutation used to break ties between equal lengths.
        repair: run the repair step (on by default; off gives plain best-fit decreasing).

    Returns:
        A :class:`Packing`; bins are in creation order, items in a bin longest first.

    Raises:
        ValueError: budget <= 0, a length <= 0, or a length > budget.

    >>> pack_best_fit_decreasing([6, 6, 4, 4], budget=10).bins()
    [[0, 3], [1, 2]]
    """
    budget = check_budget(budget)
    lengths = as_lengths(lengths)
    _check_fits(lengths, budget)
    if lengths.size == 0:
        return Packing(np.zeros(0, np.int64), np.zeros(1, np.int64), np.zeros(0, np.int64), budget)
    sorted_ids = sort_decreasing(lengths, order)
    sorted_lengths = lengths[sorted_ids]
    bin_of, n_bins = _best_fit(sorted_lengths, budget)
    if repair:
        bin_of, n_bins = _repair(sorted_lengths, bin_of, int(n_bins), budget)
    return _packing_from_bin_of(bin_of, sorted_ids, sorted_lengths, int(n_bins), budget)


def pack_best_fit_random_order(
    lengths: LengthsLike,
    budget: int,
    order: np.ndarray | None = None,
    *,
    long_above: int | None = None,
    repair: bool = True,
    level: bool = True,
    exchange: bool = True,
    repair_to: int | None = None,
) -> Packing:
    """Best fit over the items in the order given (long items first), then the same repair step.

    Best-fit decreasing fills bins almost perfectly, but because it visits items longest first, every
    bin holds samples of nearly the same length. Here items are visited in ``order`` (a random
    permutation, for a random mix), except that the items longer than ``long_above`` come first
    (in ``order``'s order among themselves): items over half the budget can never share a bin, and
    opening their bins first leaves their gaps to be filled by the rest, which is where a purely
    random order loses most of its fill. Each item goes into a bin it fills exactly, else (``exchange``)
    takes the place of a shorter item in a bin a few tokens short of full, which that closes (the item
    it displaces is placed next), else into the open bin it fills most tightly; then :func:`_repair`
    empties the least-filled bins when the count is above the L2 lower bound, and nearly empty bins are
    topped up with items from the others (``level``).

    Plain best fit in a random order leaves about half the bins a few tokens short (0.25% over the L2
    bound on a million lognormal lengths); with the exchange it reaches the bound or one bin over on
    the lognormal, long-tailed and real length distributions of the tests, as close as best-fit
    decreasing, with bins whose mean sample length varies as much as in random batches.
    O(n log budget) like :func:`pack_best_fit_decreasing`.

    Args:
        lengths: ``(n,)`` ints in ``[1, budget]``.
        budget: tokens per bin.
        order: ``(n,)`` a permutation of ``range(n)``: the visiting order (default: the identity).
        long_above: items longer than this many tokens are placed first (default ``budget // 2``,
            the items that cannot share a bin with each other; lower values also place the upper
            mode of bimodal data first). ``long_above >= budget`` places nothing first.
        repair: run the repair step (on by default).
        level: top up the bins left under half the mean fill (the last bins opened, holding what fitted
            nowhere else, which are mostly long samples) with items from other bins, at most one per
            bin, visited in ``order``: their content is then as random as the others' (on by default).
        exchange: close nearly full bins by exchanging items (:func:`_best_fit_exchange`; on by default,
            off: plain best fit).
        repair_to: repair only while there are more bins than this (default: the L2 lower bound, and
            only when the count is more than ``REPAIR_TOLERANCE`` above it); the sampler passes the bin
            count of its epoch, so a draw that already fits is not repaired.

    Returns:
        A :class:`Packing`; bins in creation order, items in a bin in placement order.

    Raises:
        ValueError: budget <= 0, a length <= 0 or > budget, ``order`` not a permutation of ``range(n)``,
            or ``long_above`` < 0.

    >>> order = np.array([0, 2, 4, 3, 1, 5])  # the 6 and the 5 (> 8 // 2) still go first: 3, then 1
    >>> pack_best_fit_random_order([2, 6, 3, 5, 1, 4], 8, order).bins()
    [[3, 2], [1, 0], [4, 5]]
    """
    budget = check_budget(budget)
    lengths = as_lengths(lengths)
    _check_fits(lengths, budget)
    n = lengths.size
    if order is None:
        order = np.arange(n, dtype=np.int64)
    else:
        order = np.asarray(order)
        if order.shape != (n,) or order.dtype.kind not in "iu" or not _is_permutation(order):
            raise ValueError(
                f"order must be a permutation of range({n}) (one visiting position per item), got shape "
                f"{order.shape} dtype {order.dtype}; pass e.g. numpy.random.default_rng(seed).permutation(n)"
            )
        order = order.astype(np.int64, copy=False)
    if long_above is None:
        long_above = budget // 2
    long_above = check_int(long_above, "long_above", 0)
    if n == 0:
        return Packing(np.zeros(0, np.int64), np.zeros(1, np.int64), np.zeros(0, np.int64), budget)
    visit, visit_lengths, donors = _long_first(lengths, order, long_above)  # (n,) each
    return _pack_visit(visit, visit_lengths, donors, budget, repair, level, exchange, repair_to)


def _pack_drawn(
    lengths: np.ndarray, budget: int, seed: np.uint64 | None, long_above: int, repair_to: int | None
) -> Packing:
    """The sampler's draw: :func:`pack_best_fit_random_order` of a uniformly random order drawn from ``seed``
    (:func:`~packing_hf._random_kernels.stream_seed`), or of the dataset order (``None``); ``(n,)`` int64,
    ``1 <= n < 2**32``, already checked."""
    visit, visit_lengths, donors = _shuffled_long_first(lengths, long_above, seed)  # (n,) each
    return _pack_visit(visit, visit_lengths, donors, budget, repair_to=repair_to)


def _shuffled_long_first(
    lengths: np.ndarray, long_above: int, seed: np.uint64 | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`_long_first` of a uniformly random order drawn from ``seed`` (``None``: the items' own order).

    The items are shuffled with their lengths (a random ``order`` then ``lengths[order]`` took three times
    as long). The kernels are called from here, not from each other: numba's disk cache does not see a
    change in a kernel of another file."""
    keys = _item_keys(lengths)  # (n,)
    if seed is not None:
        _shuffle(keys, seed)
    return _split_long_first(keys, long_above)


def _pack_visit(
    visit: np.ndarray,
    visit_lengths: np.ndarray,
    donors: np.ndarray,
    budget: int,
    repair: bool = True,
    level: bool = True,
    exchange: bool = True,
    repair_to: int | None = None,
) -> Packing:
    """Best fit (+ exchange, repair, leveling) of the items in visiting order (see :func:`_long_first`)."""
    if exchange:
        bin_of, n_bins = _best_fit_any_order(visit_lengths, budget)
    else:
        bin_of, n_bins = _best_fit(visit_lengths, budget)
    if repair:
        bin_of, n_bins = _repair(visit_lengths, bin_of, int(n_bins), budget, target=repair_to)
    if level:
        # donors visited in the given order, long items included (positions in ``visit``)
        bin_of = _level_light_bins(bin_of, visit_lengths, int(n_bins), budget, donors)
    return _packing_from_bin_of(bin_of, visit, visit_lengths, int(n_bins), budget)


def _is_permutation(order: np.ndarray) -> bool:
    n = order.size
    if n == 0:
        return True
    if order.min() < 0 or order.max() >= n:
        return False
    return bool((np.bincount(order, minlength=n) == 1).all())


def _repair(
    sorted_lengths: np.ndarray,
    bin_of: np.ndarray,
    n_bins: int,
    budget: int,
    max_bins: int = 2048,
    target: int | None = None,
) -> tuple[np.ndarray, int]:
    """Empty the least-filled bins into the others while the count is above the L2 lower bound
    (or above ``target`` bins, when given).

    Best-fit decreasing ends with bins a few tokens short of full (no remaining item fits the gap);
    trading items between bins concentrates that slack until a whole bin's items fit elsewhere.
    Runs only when the count exceeds the bound by more than ``REPAIR_TOLERANCE``. Only the
    ``max_bins`` least-filled bins take part (a full bin can neither give nor take), which
    keeps the work bounded on millions of items. Stops at the lower bound, at the first bin that
    cannot be emptied, or when a deterministic work budget is spent (so every rank of a distributed
    job computes the same packing).
    """
    if target is not None:
        if n_bins <= target:
            return bin_of, n_bins
        bound = target
    else:
        bound = lower_bound_l2(sorted_lengths, budget)
        if n_bins - bound <= REPAIR_TOLERANCE * bound:
            return bin_of, n_bins
    tokens = np.bincount(bin_of, weights=sorted_lengths, minlength=n_bins).astype(np.int64)
    work_bins = np.sort(np.argsort(tokens, kind="stable")[:max_bins])  # (m,) global ids of the working set
    local = np.full(n_bins, -1, np.int64)
    local[work_bins] = np.arange(work_bins.size)
    work_items = np.nonzero(local[bin_of] >= 0)[0]  # (k,) positions of the items in those bins
    lengths = sorted_lengths[work_items]
    local_bin_of = local[bin_of[work_items]]
    alive = np.ones(work_bins.size, dtype=bool)
    budget_visits = 2000 * lengths.size + 1_000_000
    n_removed = 0
    while n_bins - n_removed > bound and budget_visits > 0:
        local_tokens = np.bincount(local_bin_of, weights=lengths, minlength=work_bins.size).astype(np.int64)
        target = int(np.argmin(np.where(alive, local_tokens, np.iinfo(np.int64).max)))
        gap = np.where(alive, budget - local_tokens, -1)
        if local_tokens[target] > gap.sum() - gap[target]:
            break  # not enough room left in the other bins, whatever the moves
        trial = local_bin_of.copy()
        ok, visits = _empty_bin(lengths, trial, gap, target, budget, budget_visits)
        budget_visits -= visits
        if not ok:
            break
        local_bin_of = trial
        alive[target] = False
        n_removed += 1
    if n_removed == 0:
        return bin_of, n_bins
    bin_of = bin_of.copy()
    bin_of[work_items] = work_bins[local_bin_of]
    used = np.bincount(bin_of, minlength=n_bins) > 0
    renumber = np.cumsum(used) - 1
    return renumber[bin_of], int(used.sum())


def split_bins(packing: Packing, lengths: LengthsLike, extra: int) -> Packing:
    """Add ``extra`` bins by splitting the bins that hold the most items in two.

    Used to make a bin count a multiple of the number of data-parallel ranks without repeating or
    dropping an item. A split bin keeps its items at even positions and the new bin (appended at the
    end) takes those at odd positions, so with items longest first both halves get long and short ones.

    Args:
        packing: the packing to split (``items`` index into ``lengths``).
        lengths: ``(n,)`` lengths of the items.
        extra: number of bins to add (``>= 0``).

    Raises:
        ValueError: ``extra`` bins cannot be made: there are fewer items than ``num_bins + extra``.

    >>> p = pack_best_fit_decreasing([5, 4, 3, 2, 1], 15)
    >>> p.bins(), split_bins(p, [5, 4, 3, 2, 1], 2).bins()
    ([[0, 1, 2, 3, 4]], [[0, 4], [1, 3], [2]])
    """
    lengths = as_lengths(lengths)
    extra = check_int(extra, "extra", 0)
    n_bins = packing.num_bins
    if packing.items.size < n_bins + extra:
        raise ValueError(
            f"cannot make {n_bins + extra} bins out of {packing.items.size} items: every bin needs at least one"
        )
    if extra == 0:
        return packing
    # Rounds: each splits (at once) the bins holding the most items, as many as are still needed and
    # hold >= 2 items; one split at a time would cost O(extra x n) on a million items. A round moves the
    # odd positions of the chosen bins to new bins at the end and compacts the rest: no regrouping.
    items, offsets, bin_tokens = packing.items, packing.offsets, packing.bin_tokens
    sizes = np.diff(offsets)  # (n_bins,)
    while extra:
        take = min(extra, int((sizes >= 2).sum()))
        chosen = _fullest_bins(sizes, take)  # (take,)
        moving = sizes[chosen] // 2  # (take,) items each gives to its new bin
        first = np.repeat(np.cumsum(moving) - moving, moving)  # (moved,) where each new bin's items start
        pos = np.repeat(offsets[chosen], moving) + 2 * (np.arange(first.size) - first) + 1  # odd positions
        keep = np.ones(items.size, dtype=bool)
        keep[pos] = False
        moved_tokens = np.add.reduceat(lengths[items[pos]], np.cumsum(moving) - moving)  # (take,)
        items = np.concatenate([items[keep], items[pos]])
        sizes = np.concatenate([sizes, moving])
        sizes[chosen] -= moving
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        bin_tokens = np.concatenate([bin_tokens, moved_tokens])
        bin_tokens[chosen] -= moved_tokens
        n_bins += take
        extra -= take
    return Packing(items=items, offsets=offsets, bin_tokens=bin_tokens, budget=packing.budget)


def _fullest_bins(sizes: np.ndarray, take: int) -> np.ndarray:
    """The ``take`` (>= 1) bins holding the most items, most first, ties lowest id first.

    ``np.argsort(-sizes, kind="stable")[:take]`` without sorting every bin (a tenth of a million-sample
    plan): the ``take``-th largest size is found by partition, only the bins above it are sorted.
    """
    threshold = np.partition(sizes, sizes.size - take)[sizes.size - take]
    above = np.flatnonzero(sizes > threshold)  # (< take,)
    above = above[np.argsort(-sizes[above], kind="stable")]
    return np.concatenate([above, np.flatnonzero(sizes == threshold)[: take - above.size]])


def pack_next_fit(lengths: LengthsLike, budget: int) -> Packing:
    """Naive next-fit in the given order: fill the current bin; open a new one when the next item does not fit.

    The baseline to beat (and what greedy in-order "fixed-length row" packing does).

    Args:
        lengths: ``(n,)`` ints in ``[1, budget]``.
        budget: tokens per bin.

    >>> pack_next_fit([4, 4, 4, 1], budget=8).bins()
    [[0, 1], [2, 3]]
    """
    budget = check_budget(budget)
    lengths = as_lengths(lengths)
    _check_fits(lengths, budget)
    if lengths.size == 0:
        return Packing(np.zeros(0, np.int64), np.zeros(1, np.int64), np.zeros(0, np.int64), budget)
    bin_of, n_bins = _next_fit(lengths, budget)
    return _packing_from_bin_of(bin_of, np.arange(lengths.size, dtype=np.int64), lengths, int(n_bins), budget)


# --------------------------------------------------------------------------------------------------
# bounds and efficiency


def lower_bound_l1(lengths: LengthsLike, budget: int) -> int:
    """``ceil(sum(lengths) / budget)``: the trivial lower bound on the number of bins.

    >>> lower_bound_l1([6, 6, 6], 10)
    2
    """
    budget = check_budget(budget)
    lengths = as_lengths(lengths)
    return int(-(-int(lengths.sum()) // budget))


def lower_bound_l2(lengths: LengthsLike, budget: int) -> int:
    """Martello-Toth L2 lower bound on the number of bins of ``budget`` tokens.

    For every threshold ``a`` in ``[0, budget / 2]``, items longer than ``budget - a`` (J1) and items in
    ``(budget / 2, budget - a]`` (J2) each need their own bin, and items in ``[a, budget / 2]`` (J3) can
    only use the space J2 leaves free or new bins::

        L(a) = |J1| + |J2| + max(0, ceil((sum(J3) - (|J2| * budget - sum(J2))) / budget))
        L2 = max over a of L(a)   (>= L1 = ceil(sum / budget), reached at a = 0)

    Computed for all ``a`` at once from a length histogram: O(n + budget).

    Raises:
        ValueError: budget <= 0, a length <= 0, or a length > budget.

    >>> lower_bound_l1([6, 6, 6], 10), lower_bound_l2([6, 6, 6], 10)
    (2, 3)
    """
    budget = check_budget(budget)
    lengths = as_lengths(lengths)
    _check_fits(lengths, budget)
    if lengths.size == 0:
        return 0
    if int(lengths.sum()) <= budget:  # everything fits in one bin (and the tables below stay small)
        return 1
    if not _table_fits(budget, lengths.size):
        return _lower_bound_l2_sorted(lengths, budget)
    count = np.bincount(lengths, minlength=budget + 2).astype(np.int64)  # (budget + 2,) by length
    tokens = count * np.arange(budget + 2, dtype=np.int64)
    # count_ge[x] / tokens_ge[x]: number / tokens of items with length >= x, for x in [0, budget + 1]
    count_ge = np.cumsum(count[::-1])[::-1]
    tokens_ge = np.cumsum(tokens[::-1])[::-1]
    half = budget // 2  # items > budget / 2 are exactly those >= half + 1
    a = np.arange(0, half + 1, dtype=np.int64)
    big = budget - a + 1  # J1: length >= budget - a + 1
    n1 = count_ge[big]
    n2 = count_ge[half + 1] - n1
    s2 = tokens_ge[half + 1] - tokens_ge[big]
    s3 = tokens_ge[a] - tokens_ge[half + 1]
    rest = s3 - (n2 * budget - s2)
    extra = np.where(rest > 0, -(-rest // budget), 0)
    return int((n1 + n2 + extra).max())


def _lower_bound_l2_sorted(lengths: np.ndarray, budget: int) -> int:
    """:func:`lower_bound_l2` from the sorted lengths, O(n log n) time and O(n) memory, for large budgets.

    ``L(a)`` only changes where ``a`` passes a length (``a = l + 1`` drops ``l`` from J3) or where
    ``budget - a + 1`` does (``a = budget - l + 1`` moves ``l`` into J1), so its maximum over
    ``[0, budget / 2]`` is reached at 0 or at one of those points.
    """
    ordered = np.sort(lengths)  # (n,)
    tokens = np.concatenate([[0], np.cumsum(ordered)])  # (n + 1,) tokens of the shortest i items
    n, total = ordered.size, int(tokens[-1])

    def count_ge(x: np.ndarray) -> np.ndarray:
        return n - np.searchsorted(ordered, x, side="left")

    def tokens_ge(x: np.ndarray) -> np.ndarray:
        return total - tokens[np.searchsorted(ordered, x, side="left")]

    half = budget // 2
    a = np.unique(np.concatenate([[0], ordered + 1, budget - ordered + 1]))
    a = a[(a >= 0) & (a <= half)]  # (k,) the points where L(a) may change
    big = budget - a + 1
    n1 = count_ge(big)
    n2 = count_ge(np.array([half + 1]))[0] - n1
    s2 = tokens_ge(np.array([half + 1]))[0] - tokens_ge(big)
    s3 = tokens_ge(a) - tokens_ge(np.array([half + 1]))[0]
    rest = s3 - (n2 * budget - s2)
    extra = np.where(rest > 0, -(-rest // budget), 0)
    return int((n1 + n2 + extra).max())


def packing_efficiency(real_tokens: int, num_bins: int, budget: int) -> float:
    """Fraction of the provisioned tokens that hold data: ``real_tokens / (num_bins * budget)``.

    >>> packing_efficiency(3000, 1, 4096)
    0.732421875
    """
    if num_bins == 0:
        return 1.0
    return real_tokens / (num_bins * budget)
