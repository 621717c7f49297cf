"""The random draws of an epoch's plan, compiled (numba): a shuffle and an order by cost with random ties.

numpy's ``Generator.permutation`` of a million items and a ``lexsort`` with random tie keys were a third
of the time the sampler took to plan an epoch. These kernels draw from splitmix64 (Steele, Lea & Flood,
2014), seeded by the caller from ``numpy.random.SeedSequence``: integer arithmetic only, so every rank,
machine and numba version computes the same permutation from the same seed. Bounded draws use Lemire's
multiply-shift with rejection (unbiased). They trust their inputs, like :mod:`packing_hf._binpack_kernels`.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX_1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX_2 = np.uint64(0x94D049BB133111EB)
_LOW_32 = np.uint64(0xFFFFFFFF)
_TWO_32 = np.uint64(1 << 32)
_SHIFTS = (np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(32))
_RADIX_BITS = 8


def stream_seed(*key: int) -> np.uint64:
    """A 64-bit kernel seed from integer ``key`` (``SeedSequence``: stable across numpy versions).

    The same key gives the same draws on every machine (the plans of all ranks rely on it):

    >>> values = np.arange(8)
    >>> _shuffle(values, stream_seed(0, 1))
    >>> values.tolist(), _order_by_cost(np.array([2.0, 1.0, 2.0, 0.5, 2.0]), stream_seed(3)).tolist()
    ([6, 3, 7, 2, 0, 5, 1, 4], [3, 1, 4, 2, 0])
    """
    return np.random.SeedSequence([int(k) for k in key]).generate_state(1, np.uint64)[0]


@njit(cache=True)
def _below(state, bound):  # pragma: no cover - compiled
    """``(new state, a uniform draw in [0, bound))`` for ``1 <= bound <= 2**32`` (both uint64)."""
    s30, s27, s31, s32 = _SHIFTS
    while True:
        state += _GOLDEN
        z = state
        z = (z ^ (z >> s30)) * _MIX_1
        z = (z ^ (z >> s27)) * _MIX_2
        z = z ^ (z >> s31)
        product = (z >> s32) * bound  # < 2**64: the high half is the draw, the low half decides rejection
        low = product & _LOW_32
        if low >= bound or low >= (_TWO_32 - bound) % bound:
            return state, np.int64(product >> s32)


@njit(cache=True)
def _shuffle(values, seed):  # pragma: no cover - compiled
    """Fisher-Yates shuffle of ``values`` (1-D, fewer than 2**32) in place, from ``seed``."""
    state = np.uint64(seed)
    for i in range(values.shape[0] - 1, 0, -1):
        state, j = _below(state, np.uint64(i + 1))
        held = values[i]
        values[i] = values[j]
        values[j] = held


@njit(cache=True)
def _order_by_cost(cost, seed):  # pragma: no cover - compiled
    """Positions of ``cost`` (float64) in increasing order, equal costs in a random order drawn from ``seed``.

    A random permutation, then a stable LSD radix sort on the costs' bits (as integers, the order of floats;
    bytes that all costs share are skipped): O(n), where ``lexsort((random keys, cost))`` is O(n log n).
    """
    n = cost.shape[0]
    order = np.arange(n)
    _shuffle(order, seed)
    bits_of = cost.view(np.int64)
    keys = np.empty(n, np.int64)
    for i in range(n):  # an integer key with the order of the float, negative values included
        bits = bits_of[order[i]]
        if bits < 0:
            bits ^= 0x7FFFFFFFFFFFFFFF
        keys[i] = bits ^ (-0x7FFFFFFFFFFFFFFF - 1)  # flip the sign bit: unsigned order
    spare_keys = np.empty(n, np.int64)
    spare_order = np.empty(n, np.int64)
    radix = 1 << _RADIX_BITS
    counts = np.empty(radix, np.int64)
    for shift in range(0, 64, _RADIX_BITS):
        counts[:] = 0
        for i in range(n):
            counts[(keys[i] >> shift) & (radix - 1)] += 1
        if counts.max() == n:
            continue  # every key has this digit: the pass would not move anything
        start = 0
        for d in range(radix):
            c = counts[d]
            counts[d] = start
            start += c
        for i in range(n):
            d = (keys[i] >> shift) & (radix - 1)
            spare_keys[counts[d]] = keys[i]
            spare_order[counts[d]] = order[i]
            counts[d] += 1
        keys, spare_keys = spare_keys, keys
        order, spare_order = spare_order, order
    return order
