"""The compiled kernel that evens out the bins of every step across ranks (:mod:`packing_hf._epoch_plan`):
numba loops over plain arrays, compiled lazily and cached on disk like :mod:`packing_hf._binpack_kernels`.
It trusts its inputs (the plan built them).
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def _closest(prices, lo, hi, want):  # pragma: no cover - compiled
    """The position in ``[lo, hi)`` of ascending ``prices`` whose value is closest to ``want`` (-1: empty)."""
    if lo >= hi:
        return -1
    at = lo + np.searchsorted(prices[lo:hi], want)
    if at == hi:
        return hi - 1
    if at > lo and want - prices[at - 1] <= prices[at] - want:
        return at - 1
    return at


@njit(cache=True)
def _balance_steps(items, offsets, steps, lengths, prices, budget, tolerance, max_visits):
    """Even out the cost of the bins that share a step by moving and trading items between them.

    ``items`` / ``offsets``: the bins in CSR form (``items`` index ``lengths`` and ``prices``); ``steps``:
    ``(S, R)`` bins. An item of ``lengths[i]`` tokens costs ``prices[i]`` (float64): ``linear * L + quadratic *
    L**2`` for a sample, increasing in ``L``, which the search for a trade below relies on to find the best
    one; a prefix tree's price is not a function of its tokens, and there a trade found is still within the
    budget and lowers the step's costliest bin, only perhaps not the best one. In every step
    whose costliest bin ``h`` is over ``1 + tolerance`` times the step's mean cost, ``h`` gives one of its
    items to another bin ``l`` of the step: whole (if it fits), for one cheaper item of ``l``, or for two
    (full bins trade one long sample for two short ones of nearly the same tokens, which costs less) --
    the move, over every ``l``, that brings ``h`` and ``l`` closest to the same cost. Repeated until the
    step is within the tolerance or no move lowers ``h``; no bin ever exceeds ``budget`` tokens.

    Returns ``(bin of every position of items, items moved)``; ``max_visits`` bounds the work
    (deterministic: every rank computes the same bins).
    """
    n_steps, n_ranks = steps.shape
    bin_of = np.empty(items.shape[0], np.int64)
    for b in range(offsets.shape[0] - 1):
        for k in range(offsets[b], offsets[b + 1]):
            bin_of[k] = b
    visits = 0
    moved = 0
    cost = np.empty(n_ranks, np.float64)
    tokens = np.empty(n_ranks, np.int64)
    for s in range(n_steps):
        if visits > max_visits:
            break
        n_items = 0
        top = 0.0
        total = 0.0
        for r in range(n_ranks):
            b = steps[s, r]
            n_items += offsets[b + 1] - offsets[b]
            here = 0.0
            for k in range(offsets[b], offsets[b + 1]):
                here += prices[items[k]]
            top = max(top, here)
            total += here
        visits += n_items
        if top <= (1.0 + tolerance) * total / n_ranks:
            continue  # balanced already (most steps of a large dataset)
        where = np.empty(n_items, np.int64)  # position in items
        owner = np.empty(n_items, np.int64)  # which of the step's bins (0..R-1) holds it
        size = np.empty(n_items, np.int64)
        price = np.empty(n_items, np.float64)
        j = 0
        for r in range(n_ranks):
            b = steps[s, r]
            cost[r] = 0.0
            tokens[r] = 0
            for k in range(offsets[b], offsets[b + 1]):
                length = lengths[items[k]]
                where[j], owner[j], size[j] = k, r, length
                price[j] = prices[items[k]]
                cost[r] += price[j]
                tokens[r] += length
                j += 1
        total = cost.sum()
        order = np.argsort(size, kind="mergesort")  # the step's items, shortest first
        mine = np.empty(n_items, np.int64)  # h's items
        theirs = np.empty(n_items, np.int64)  # low's items, shortest first
        their_size = np.empty(n_items, np.int64)
        their_price = np.empty(n_items, np.float64)
        changed = False
        for _ in range(4 * n_items + 4):
            h = 0
            for r in range(1, n_ranks):
                if cost[r] > cost[h]:
                    h = r
            if cost[h] <= (1.0 + tolerance) * total / n_ranks or visits > max_visits:
                break
            n_mine = 0
            for j in range(n_items):
                if owner[j] == h:
                    mine[n_mine] = j
                    n_mine += 1
            best = cost[h]
            give, take, take_2, dest = -1, -1, -1, -1
            for low in range(n_ranks):
                if low == h or cost[low] >= cost[h]:
                    continue
                half = 0.5 * (cost[h] - cost[low])  # the transfer that would even out h and low
                room_low = budget - tokens[low]
                room_h = budget - tokens[h]
                n_theirs = 0
                for j in order:
                    if owner[j] == low:
                        theirs[n_theirs], their_size[n_theirs] = j, size[j]
                        their_price[n_theirs] = price[j]
                        n_theirs += 1
                visits += n_items + n_mine * (n_theirs + 1)
                for m in range(n_mine):
                    a = mine[m]
                    x = size[a]
                    if x <= room_low:  # move it whole
                        worst = max(cost[h] - price[a], cost[low] + price[a])
                        if worst < best:
                            best, give, take, take_2, dest = worst, a, -1, -1, low
                    # one of low's items back: lengths in [x - room_low, x + room_h], cheaper than a
                    lo = np.searchsorted(their_size[:n_theirs], x - room_low)
                    hi = np.searchsorted(their_size[:n_theirs], min(x - 1, x + room_h), side="right")
                    c = _closest(their_price, lo, hi, price[a] - half)
                    if c >= 0:
                        delta = price[a] - their_price[c]
                        worst = max(cost[h] - delta, cost[low] + delta)
                        if worst < best:
                            best, give, take, take_2, dest = worst, a, theirs[c], -1, low
                    # two of low's items back, together within [x - room_low, x + room_h] tokens
                    for c1 in range(n_theirs):
                        y1 = their_size[c1]
                        if y1 >= x:
                            break
                        lo = max(c1 + 1, np.searchsorted(their_size[:n_theirs], x - room_low - y1))
                        hi = np.searchsorted(their_size[:n_theirs], x + room_h - y1, side="right")
                        c2 = _closest(their_price, lo, hi, price[a] - half - their_price[c1])
                        if c2 < 0:
                            continue
                        delta = price[a] - their_price[c1] - their_price[c2]
                        if delta <= 0.0:
                            continue
                        worst = max(cost[h] - delta, cost[low] + delta)
                        if worst < best:
                            best, give, take, take_2, dest = worst, a, theirs[c1], theirs[c2], low
            if give < 0:
                break
            for j, to in ((give, dest), (take, h), (take_2, h)):
                if j < 0:
                    continue
                cost[owner[j]] -= price[j]
                tokens[owner[j]] -= size[j]
                owner[j] = to
                cost[to] += price[j]
                tokens[to] += size[j]
                moved += 1
            changed = True
        if changed:
            for j in range(n_items):
                bin_of[where[j]] = steps[s, owner[j]]
    return bin_of, moved
