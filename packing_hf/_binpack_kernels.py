"""The compiled kernels behind :mod:`packing_hf._binpack`: numba loops over plain int64 arrays.

Compiled lazily on first call and cached on disk next to this file. They trust their inputs: the
validation (lengths > 0, lengths <= budget, permutations) is done by the functions of ``_binpack``
that call them, which also document the algorithms.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def _counting_sort_decreasing(lengths, order, max_length):  # pragma: no cover - compiled
    """Stable counting sort: positions of ``order`` re-ordered by decreasing ``lengths[order]``."""
    counts = np.zeros(max_length + 2, np.int64)
    for i in range(order.shape[0]):
        counts[max_length - lengths[order[i]]] += 1
    start = 0
    for v in range(max_length + 2):
        c = counts[v]
        counts[v] = start
        start += c
    out = np.empty(order.shape[0], np.int64)
    for i in range(order.shape[0]):
        j = order[i]
        k = max_length - lengths[j]
        out[counts[k]] = j
        counts[k] += 1
    return out


# de Bruijn sequence for the index of the lowest set bit of a 64-bit word
_DEBRUIJN = 0x03F79D71B4CB0A89
_DEBRUIJN_TABLE = np.zeros(64, np.int64)
for _bit in range(64):
    _DEBRUIJN_TABLE[(((1 << _bit) * _DEBRUIJN) & 0xFFFFFFFFFFFFFFFF) >> 58] = _bit


# The free spaces of the open bins (best fit): a bit set over 0..budget, 63 bits to an int64 word (the sign
# bit stays clear), with a summary level above it (bit w set: word w is not empty) and so on up to one word.
# "The smallest free space >= x" is then a masked word and a lowest set bit per level, 2-3 levels at common
# budgets, where a segment tree took a dependent load per level of log2(budget) (13 at 4,096).
_WORD = 63


@njit(cache=True)
def _bitset(size):  # pragma: no cover - compiled
    """An empty set over ``[0, size)``: ``(words, starts)``, level ``k``'s words are ``words[starts[k]:starts[k + 1]]``."""
    n_levels = 1
    bits = size
    while bits > _WORD:
        bits = bits // _WORD + 1
        n_levels += 1
    starts = np.zeros(n_levels + 1, np.int64)
    bits = size
    for level in range(n_levels):
        starts[level + 1] = starts[level] + bits // _WORD + 1
        bits = bits // _WORD + 1
    return np.zeros(starts[n_levels], np.int64), starts


@njit(cache=True)
def _bit_add(words, starts, x):  # pragma: no cover - compiled
    for level in range(starts.shape[0] - 1):
        w = starts[level] + x // _WORD
        was = words[w]
        words[w] = was | (1 << (x % _WORD))
        if was != 0:
            return  # the levels above already have this word's bit
        x //= _WORD


@njit(cache=True)
def _bit_remove(words, starts, x):  # pragma: no cover - compiled
    for level in range(starts.shape[0] - 1):
        w = starts[level] + x // _WORD
        left = words[w] & ~(1 << (x % _WORD))
        words[w] = left
        if left != 0:
            return
        x //= _WORD


@njit(cache=True)
def _lowest_bit(word, table):  # pragma: no cover - compiled
    """The index of the lowest set bit of a non-zero word."""
    low = word & -word
    return table[((low * _DEBRUIJN) >> 58) & 63]


@njit(cache=True)
def _bit_next(words, starts, x, table):  # pragma: no cover - compiled
    """The smallest member ``>= x``, -1 if none."""
    n_levels = starts.shape[0] - 1
    level = 0
    while level < n_levels:
        w = x // _WORD
        if starts[level] + w >= starts[level + 1]:
            return -1
        word = words[starts[level] + w] & ~((1 << (x % _WORD)) - 1)
        if word != 0:
            x = w * _WORD + _lowest_bit(word, table)
            while level > 0:  # down to the lowest member below that summary bit
                level -= 1
                x = x * _WORD + _lowest_bit(words[starts[level] + x], table)
            return x
        x = w + 1  # no member left in this word: the next non-empty word, one level up
        level += 1
    return -1


@njit(cache=True)
def _best_fit_sorted(sorted_lengths, budget):  # pragma: no cover - compiled
    """Best fit over lengths already in decreasing order: the bin of every item, and the bin count.

    Open bins are bucketed by their free space ``c`` (a linked list per value of ``c``); a bit set over
    ``c`` (:func:`_bitset`) finds the smallest free space that still fits an item.
    """
    n = sorted_lengths.shape[0]
    table = _DEBRUIJN_TABLE
    words, starts = _bitset(budget + 1)  # c is a member while some open bin has exactly c tokens free
    head = np.full(budget + 1, -1, np.int64)  # head[c]: an open bin with c tokens free (linked list)
    nxt = np.empty(n, np.int64)
    bin_of = np.empty(n, np.int64)
    n_bins = 0
    for i in range(n):
        length = sorted_lengths[i]
        free = _bit_next(words, starts, length, table)
        if free >= 0:
            b = head[free]
            head[free] = nxt[b]
            if head[free] == -1:
                _bit_remove(words, starts, free)
        else:
            b = n_bins
            n_bins += 1
            free = budget
        bin_of[i] = b
        free -= length
        if free > 0:
            nxt[b] = head[free]
            if head[free] == -1:
                _bit_add(words, starts, free)
            head[free] = b
    return bin_of, n_bins


@njit(cache=True)
def _next_fit(lengths, budget):  # pragma: no cover - compiled
    n = lengths.shape[0]
    bin_of = np.empty(n, np.int64)
    b = -1
    used = budget + 1
    for i in range(n):
        if used + lengths[i] > budget:
            b += 1
            used = 0
        used += lengths[i]
        bin_of[i] = b
    return bin_of, b + 1


@njit(cache=True)
def _group_by_bin(bin_of, item_ids, item_lengths, n_bins):  # pragma: no cover - compiled
    """Counting sort of items by bin (stable): ``(items, offsets, bin_tokens)``."""
    offsets = np.zeros(n_bins + 1, np.int64)
    bin_tokens = np.zeros(n_bins, np.int64)
    for i in range(bin_of.shape[0]):
        offsets[bin_of[i] + 1] += 1
        bin_tokens[bin_of[i]] += item_lengths[i]
    for b in range(n_bins):
        offsets[b + 1] += offsets[b]
    cursor = offsets[:-1].copy()
    items = np.empty(bin_of.shape[0], np.int64)
    for i in range(bin_of.shape[0]):
        b = bin_of[i]
        items[cursor[b]] = item_ids[i]
        cursor[b] += 1
    return items, offsets, bin_tokens


@njit(cache=True)
def _bin_square_sums(items, offsets, item_squares):  # pragma: no cover - compiled
    """``(n_bins,)`` float64: every bin's sum of its items' attention terms (``item_squares``, float64: a
    sample's squared length, a prefix tree's sum over nodes, see :mod:`packing_hf.prefix_plan`)."""
    n_bins = offsets.shape[0] - 1
    squares = np.zeros(n_bins, np.float64)
    for b in range(n_bins):
        total = 0.0
        for k in range(offsets[b], offsets[b + 1]):
            total += item_squares[items[k]]
        squares[b] = total
    return squares


@njit(cache=True)
def _long_first(lengths, order, long_above):  # pragma: no cover - compiled
    """The visiting order of the random-order best fit: ``(visit, lengths[visit], donors)``.

    ``visit`` is ``order`` with the items longer than ``long_above`` moved to the front (stable);
    ``donors[j]`` is where ``order[j]`` sits in ``visit`` (the leveling's donor order).
    """
    keys = np.empty(order.shape[0], np.int64)
    for j in range(order.shape[0]):
        keys[j] = (lengths[order[j]] << 32) | order[j]
    return _split_long_first(keys, long_above)


@njit(cache=True)
def _item_keys(lengths):  # pragma: no cover - compiled
    """``(n,)`` int64 keys ``(length << 32) | item`` in item order (fewer than 2**32 items), for
    :func:`_split_long_first` once shuffled: items move with their lengths, nothing reads them at random."""
    keys = np.empty(lengths.shape[0], np.int64)
    for i in range(lengths.shape[0]):
        keys[i] = (lengths[i] << 32) | i
    return keys


@njit(cache=True)
def _split_long_first(keys, long_above):  # pragma: no cover - compiled
    """:func:`_long_first` of the items in ``keys`` order, each key ``(length << 32) | item``."""
    n = keys.shape[0]
    n_long = 0
    for j in range(n):
        if keys[j] >> 32 > long_above:
            n_long += 1
    visit = np.empty(n, np.int64)
    visit_lengths = np.empty(n, np.int64)
    donors = np.empty(n, np.int64)
    at_long, at_short = 0, n_long
    for j in range(n):
        length = keys[j] >> 32
        if length > long_above:
            at = at_long
            at_long += 1
        else:
            at = at_short
            at_short += 1
        visit[at] = keys[j] & 0xFFFFFFFF
        visit_lengths[at] = length
        donors[j] = at
    return visit, visit_lengths, donors


@njit(cache=True)
def _level_light_bins(bin_of, lengths, n_bins, budget, visit):  # pragma: no cover - compiled
    """Top up bins under half the mean fill with items taken from other bins (in place on ``bin_of``).

    Best fit in a random order ends with a nearly empty bin holding what fitted nowhere else: the
    longest of the last items, so its mean length stands out. Items visited in ``visit`` (a random
    order) move into it, at most one from each donor bin and only while the donor stays over half
    the mean fill, until it reaches 90% of the mean fill: its content becomes a random sample too,
    and the bin count does not change.
    """
    tokens = np.zeros(n_bins, np.int64)
    for i in range(lengths.shape[0]):
        tokens[bin_of[i]] += lengths[i]
    mean = tokens.sum() / n_bins
    light = tokens < 0.5 * mean
    donated = np.zeros(n_bins, np.bool_)
    for x in range(n_bins):
        if not light[x]:
            continue
        for j in range(visit.shape[0]):
            if tokens[x] >= 0.9 * mean:
                break
            i = visit[j]
            b = bin_of[i]
            y = lengths[i]
            if light[b] or donated[b] or tokens[x] + y > budget or tokens[b] - y < 0.5 * mean:
                continue
            bin_of[i] = x
            tokens[b] -= y
            tokens[x] += y
            donated[b] = True
    return bin_of


@njit(cache=True)
def _empty_bin(lengths, bin_of, gap, target, budget, max_visits):  # pragma: no cover - compiled
    """Try to move every item of bin ``target`` into the other bins: ``(success, visits)``.

    Works in place on ``bin_of`` / ``gap`` (the caller passes copies and keeps them only on success).
    The items of ``target`` form a pool; the longest pool item ``x`` is placed by the first move that
    works, each choosing the candidate that leaves the least slack:

    1. into the bin with the least free space that fits it;
    2. 1-for-1: into a bin in place of a shorter item ``y`` (``gap + y >= x``); ``y`` joins the pool;
    3. 2-for-1: with another pool item ``p``, in place of an item ``y < x + p``;
    4. consolidate: grow the largest gap until ``x`` fits there, by moving items of that bin into
       other bins' gaps or swapping them for shorter ones.

    Every move lowers the pool's token count, so this terminates; ``max_visits`` bounds the work
    (a deterministic budget, so that every rank computes the same answer).
    """
    n = lengths.shape[0]
    n_bins = gap.shape[0]
    pool = np.empty(n, np.int64)
    n_pool = 0
    for i in range(n):
        if bin_of[i] == target:
            pool[n_pool] = i
            n_pool += 1
            bin_of[i] = -1
    gap[target] = -1  # never a destination
    visits = 0
    while n_pool > 0:
        if visits > max_visits:
            return False, visits
        k = 0  # the longest item of the pool first: it is the hardest to place
        for j in range(1, n_pool):
            if lengths[pool[j]] > lengths[pool[k]]:
                k = j
        item = pool[k]
        x = lengths[item]

        # 1. direct
        best_bin = -1
        for b in range(n_bins):
            if gap[b] >= x and (best_bin == -1 or gap[b] < gap[best_bin]):
                best_bin = b
        visits += n_bins
        if best_bin >= 0:
            bin_of[item] = best_bin
            gap[best_bin] -= x
            n_pool -= 1
            pool[k] = pool[n_pool]
            continue

        # 2. 1-for-1
        best_i = -1
        best_slack = budget + 1
        for i in range(n):
            b = bin_of[i]
            y = lengths[i]
            if b < 0 or y >= x:
                continue
            slack = gap[b] + y - x
            if slack >= 0 and (slack < best_slack or (slack == best_slack and y < lengths[best_i])):
                best_slack = slack
                best_i = i
        visits += n
        if best_i >= 0:
            b = bin_of[best_i]
            bin_of[item] = b
            bin_of[best_i] = -1
            gap[b] = best_slack
            pool[k] = best_i
            continue

        # 3. 2-for-1 (the endgame: pool items too short to make room on their own)
        best_p = -1
        for j in range(n_pool):
            if j == k:
                continue
            xp = x + lengths[pool[j]]
            for i in range(n):
                b = bin_of[i]
                y = lengths[i]
                if b < 0 or y >= xp:
                    continue
                slack = gap[b] + y - xp
                if slack >= 0 and (slack < best_slack or (slack == best_slack and y < lengths[best_i])):
                    best_slack = slack
                    best_i = i
                    best_p = j
        visits += n * n_pool
        if best_i >= 0:
            b = bin_of[best_i]
            bin_of[item] = b
            bin_of[pool[best_p]] = b
            bin_of[best_i] = -1
            gap[b] = best_slack
            pool[k] = best_i
            n_pool -= 1
            pool[best_p] = pool[n_pool]
            continue

        # 4. consolidate: each transfer moves delta > 0 tokens of slack from bin b2 into bin c,
        # preferring the delta closest to what x still needs
        c = 0
        for b in range(n_bins):
            if gap[b] > gap[c]:
                c = b
        while gap[c] < x:
            need = x - gap[c]
            best_key = 2 * budget + 2
            best_1 = -1
            best_2 = -1
            best_b = -1
            for i1 in range(n):
                if bin_of[i1] != c:
                    continue
                y1 = lengths[i1]
                for i2 in range(n):  # swap y1 for a shorter y2 of a bin with room for the difference
                    b2 = bin_of[i2]
                    if b2 < 0 or b2 == c:
                        continue
                    delta = y1 - lengths[i2]
                    if delta <= 0 or delta > gap[b2]:
                        continue
                    key = delta - need if delta >= need else budget + need - delta
                    if key < best_key:
                        best_key, best_1, best_2, best_b = key, i1, i2, b2
                for b2 in range(n_bins):  # or move y1 out whole
                    if b2 == c or gap[b2] < y1:
                        continue
                    key = y1 - need if y1 >= need else budget + need - y1
                    if key < best_key:
                        best_key, best_1, best_2, best_b = key, i1, -1, b2
                visits += n + n_bins
            if best_1 < 0 or visits > max_visits:
                return False, visits
            delta = lengths[best_1] - (lengths[best_2] if best_2 >= 0 else 0)
            bin_of[best_1] = best_b
            if best_2 >= 0:
                bin_of[best_2] = c
            gap[best_b] -= delta
            gap[c] += delta
        bin_of[item] = c
        gap[c] -= x
        n_pool -= 1
        pool[k] = pool[n_pool]
    return True, visits


@njit(cache=True)
def _best_fit_sparse(sorted_lengths, budget):  # pragma: no cover - compiled
    """:func:`_best_fit_sorted` in memory set by the number of items, not by ``budget``: the same bins.

    The open bins' free spaces are kept as one sorted array (O(log bins) search, O(open bins) insertion),
    for budgets too large for a table indexed by free space. Among bins with the same free space the one
    filled last is taken first, as the table kernel's per-value stacks do, so both kernels give identical bins.
    """
    n = sorted_lengths.shape[0]
    frees = np.empty(n, np.int64)  # free space of every open bin, ascending; equal values by insertion order
    bins = np.empty(n, np.int64)
    m = 0
    bin_of = np.empty(n, np.int64)
    n_bins = 0
    for i in range(n):
        length = sorted_lengths[i]
        at = np.searchsorted(frees[:m], length)  # the smallest free space >= length
        if at < m:
            free = frees[at]
            j = np.searchsorted(frees[:m], free, side="right") - 1  # the last bin left with that space
            b = bins[j]
            for k in range(j, m - 1):
                frees[k] = frees[k + 1]
                bins[k] = bins[k + 1]
            m -= 1
        else:
            b = n_bins
            n_bins += 1
            free = budget
        bin_of[i] = b
        free -= length
        if free > 0:
            k = np.searchsorted(frees[:m], free, side="right")
            for j in range(m, k, -1):
                frees[j] = frees[j - 1]
                bins[j] = bins[j - 1]
            frees[k] = free
            bins[k] = b
            m += 1
    return bin_of, n_bins


@njit(cache=True)
def _lowest_gap(words, table):  # pragma: no cover - compiled
    """The lowest ``g`` whose bit is set in ``words`` (63 bits a word), -1 if none."""
    for w in range(words.shape[0]):
        word = words[w]
        if word != 0:
            return _WORD * w + _lowest_bit(word, table)
    return -1


# The exchange kernel keeps what it reads together about an item and about a bin in one int32 record each
# (one cache line instead of four: the lists below are walked in random order over a million items).
_NEXT, _KEY_NEXT, _KEY_PREV, _LENGTH = 0, 1, 2, 3  # item: next item of its bin, neighbours in its key list
_BIN_NEXT, _BIN_PREV, _FIRST, _COUNT = 0, 1, 2, 3  # bin: neighbours among bins as free, first item, count


@njit(cache=True)
def _reindex_bin(b, g, add, bins, items, key_head, mask, width):  # pragma: no cover - compiled
    """The items of bin ``b`` (``g`` tokens free) enter (``add``) or leave the index under ``(length + g, g)``."""
    i = bins[b, _FIRST]
    while i != -1:
        t = items[i, _LENGTH] + g
        key = t * width + g
        if add:  # push on the key's list
            first = key_head[key]
            items[i, _KEY_NEXT] = first
            items[i, _KEY_PREV] = -1
            if first != -1:
                items[first, _KEY_PREV] = i
            key_head[key] = i
            mask[t, g // 63] |= 1 << (g % 63)
        else:  # unlink from it
            before, after = items[i, _KEY_PREV], items[i, _KEY_NEXT]
            if before == -1:
                key_head[key] = after
                if after == -1:
                    mask[t, g // 63] &= ~(1 << (g % 63))
            else:
                items[before, _KEY_NEXT] = after
            if after != -1:
                items[after, _KEY_PREV] = before
        i = items[i, _NEXT]


@njit(cache=True)
def _best_fit_exchange(lengths, budget, small_gap, min_items, table):  # pragma: no cover - compiled
    """Best fit in the given order that also closes nearly full bins: ``(bin of every item, bin count)``.

    Best fit in a random order leaves about half the bins a few tokens short of full (on lognormal lengths
    of median 500 at a 4,096 budget: 1-70 tokens), gaps only the rare very short samples could fill, and
    ends ~0.25% above the lower bound. Here an arriving item ``x`` goes, in this order of preference:

    1. into a bin with exactly ``x`` tokens free;
    2. into a bin with ``g <= small_gap`` tokens free (``g < x``) and at least ``min_items`` items, in place of
       one of its items of length ``x - g``: that bin is then full, and the displaced item (``g`` tokens
       shorter) is placed next, by the same rules (each exchange shortens the item in hand, so this ends).
       Bins of fewer items are left out: closing a bin of two exactly pairs a sample with one of the few of
       its complement length, and the same pairs would come back epoch after epoch;
    3. into the bin with the least free space that fits it (a bit set over free space, as
       :func:`_best_fit_sorted`), or a new bin.

    Step 2 finds its candidate in O(1): the items of every such bin with ``1..small_gap`` tokens free are
    indexed by ``(length + free, free)``, with a bit mask per ``length + free`` of the ``free`` values present.
    Which item moves depends only on lengths and order, so the result is deterministic.
    """
    n = lengths.shape[0]
    width = small_gap + 1
    words, starts = _bitset(budget + 1)  # c is a member while some open bin has exactly c tokens free
    head = np.full(budget + 1, -1, np.int32)  # head[c]: bins with c tokens free (doubly linked)
    bins = np.empty((n, 4), np.int32)  # bin records (_BIN_NEXT, ...), set when a bin opens
    items = np.empty((n, 4), np.int32)  # item records (_NEXT, ...); the items of a bin are singly linked
    items[:, _LENGTH] = lengths
    key_head = np.full((budget + 1) * width, -1, np.int32)
    mask = np.zeros((budget + 1, small_gap // 63 + 1), np.int64)
    bin_of = np.empty(n, np.int64)
    n_bins = 0
    for start in range(n):
        i = start
        while True:
            x = lengths[i]
            free = -1
            g = -1
            if head[x] != -1:
                free = x
            elif small_gap > 0:
                g = _lowest_gap(mask[x], table)
            if g > 0:  # 2. exchange: a nearly full bin closes, the item it held is placed next
                out = key_head[x * width + g]
                b = bin_of[out]
                before, after = bins[b, _BIN_PREV], bins[b, _BIN_NEXT]  # b leaves the bins with g free
                if before == -1:
                    head[g] = after
                    if after == -1:
                        _bit_remove(words, starts, g)
                else:
                    bins[before, _BIN_NEXT] = after
                if after != -1:
                    bins[after, _BIN_PREV] = before
                _reindex_bin(b, g, False, bins, items, key_head, mask, width)
                k = bins[b, _FIRST]  # out leaves b's items, i joins them
                if k == out:
                    bins[b, _FIRST] = items[out, _NEXT]
                else:
                    while items[k, _NEXT] != out:
                        k = items[k, _NEXT]
                    items[k, _NEXT] = items[out, _NEXT]
                items[i, _NEXT] = bins[b, _FIRST]
                bins[b, _FIRST] = i
                bin_of[i] = b
                i = out
                continue
            if free < 0:
                free = _bit_next(words, starts, x, table)
            if free >= 0:
                b = head[free]
                after = bins[b, _BIN_NEXT]
                head[free] = after
                if after == -1:
                    _bit_remove(words, starts, free)
                else:
                    bins[after, _BIN_PREV] = -1
                if free <= small_gap and bins[b, _COUNT] >= min_items:
                    _reindex_bin(b, free, False, bins, items, key_head, mask, width)
            else:
                b = n_bins
                n_bins += 1
                free = budget
                bins[b, _FIRST] = -1
                bins[b, _COUNT] = 0
            bin_of[i] = b
            items[i, _NEXT] = bins[b, _FIRST]
            bins[b, _FIRST] = i
            bins[b, _COUNT] += 1
            free -= x
            if free > 0:
                first = head[free]
                bins[b, _BIN_NEXT] = first
                bins[b, _BIN_PREV] = -1
                if first == -1:
                    _bit_add(words, starts, free)
                else:
                    bins[first, _BIN_PREV] = b
                head[free] = b
                if free <= small_gap and bins[b, _COUNT] >= min_items:
                    _reindex_bin(b, free, True, bins, items, key_head, mask, width)
            break
    return bin_of, n_bins
