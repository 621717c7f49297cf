"""The compiled draws and the free-space bit set behind an epoch's plan: exact against plain Python references."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest

from packing_hf._binpack import _shuffled_long_first
from packing_hf._binpack_kernels import (
    _DEBRUIJN_TABLE,
    _bit_add,
    _bit_next,
    _bit_remove,
    _bitset,
    _long_first,
)
from packing_hf._random_kernels import _order_by_cost, _shuffle, stream_seed


def _permutation_counts(shuffle, n: int, draws: int) -> Counter:
    counts = Counter()
    for seed in range(draws):
        values = np.arange(n)
        shuffle(values, seed)
        counts[tuple(values.tolist())] += 1
    return counts


def _naive_shuffle(values: np.ndarray, seed: int) -> None:
    """The classic wrong shuffle (swap with any position): biased, the negative control."""
    rng = np.random.default_rng(seed)
    for i in range(values.size):
        j = int(rng.integers(values.size))
        values[i], values[j] = values[j], values[i]


def _uniform_enough(counts: Counter, n: int, draws: int) -> bool:
    expected = draws / len(list(itertools.permutations(range(n))))
    every = [counts.get(p, 0) for p in itertools.permutations(range(n))]
    return max(abs(c - expected) for c in every) < 5 * expected**0.5  # 5 standard deviations


def test_the_shuffle_draws_every_permutation_equally_often_and_repeats_per_seed():
    n, draws = 4, 12_000
    counts = _permutation_counts(lambda v, s: _shuffle(v, stream_seed(s)), n, draws)
    assert len(counts) == 24 and _uniform_enough(counts, n, draws)
    assert not _uniform_enough(_permutation_counts(_naive_shuffle, n, draws), n, draws)  # the check has power
    first, again, other = np.arange(1000), np.arange(1000), np.arange(1000)
    _shuffle(first, stream_seed(5, 1))
    _shuffle(again, stream_seed(5, 1))
    _shuffle(other, stream_seed(5, 2))
    assert np.array_equal(first, again) and not np.array_equal(first, other)
    assert sorted(first.tolist()) == list(range(1000))


def test_the_shuffled_visiting_order_is_the_long_first_order_of_the_same_permutation():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 4097, 5000).astype(np.int64)
    order = np.arange(lengths.size)
    _shuffle(order, stream_seed(9))
    expected = _long_first(lengths, order, 2048)
    got = _shuffled_long_first(lengths, 2048, stream_seed(9))
    assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True))
    other = _shuffled_long_first(lengths, 2048, stream_seed(10))
    assert not np.array_equal(other[0], expected[0])
    visit, visit_lengths, _ = got
    n_long = int((lengths > 2048).sum())
    assert (visit_lengths[:n_long] > 2048).all() and (visit_lengths[n_long:] <= 2048).all()
    assert np.array_equal(visit_lengths, lengths[visit])


def test_the_order_by_cost_sorts_and_breaks_ties_at_random():
    rng = np.random.default_rng(1)
    values = np.array([0.0, 1.5, -2.0, 3e10, -1e-300, 7.0, np.inf, 2.5e-310])
    for seed in range(50):
        cost = rng.choice(values, int(rng.integers(0, 60)))
        order = _order_by_cost(cost, stream_seed(seed))
        assert sorted(order.tolist()) == list(range(cost.size))
        assert (cost[order][:-1] <= cost[order][1:]).all()
    tied = np.array([1.0, 1.0, 1.0, 0.5])  # the three equal costs come in every order, each first ~1/3

    def first_of_ties(order_of):
        return Counter(int(order_of(tied, seed)[1]) for seed in range(3000))

    firsts = first_of_ties(lambda cost, seed: _order_by_cost(cost, stream_seed(seed)))
    assert sorted(firsts) == [0, 1, 2] and all(abs(c - 1000) < 150 for c in firsts.values())
    # the negative control: a stable sort without the draw puts the ties in index order every time
    assert first_of_ties(lambda cost, seed: np.argsort(cost, kind="stable")) == Counter({0: 3000})


@pytest.mark.parametrize("size", [1, 62, 63, 64, 4097, 3970, 250_048])
def test_the_bit_set_answers_the_next_member_like_a_sorted_list(size):
    rng = np.random.default_rng(size)
    words, starts = _bitset(size)
    members: set[int] = set()
    answers = []
    for _ in range(3000):
        x = int(rng.integers(size))
        if rng.random() < 0.5:
            _bit_add(words, starts, x)
            members.add(x)
        else:
            _bit_remove(words, starts, x)
            members.discard(x)
        query = int(rng.integers(size))
        got = _bit_next(words, starts, query, _DEBRUIJN_TABLE)
        assert got == min((m for m in members if m >= query), default=-1)
        answers.append(got)
    assert _bit_next(words, starts, size, _DEBRUIJN_TABLE) == -1
    # the queries were not all trivial: both found members and misses
    assert any(a >= 0 for a in answers) and (size < 64 or any(a == -1 for a in answers))
