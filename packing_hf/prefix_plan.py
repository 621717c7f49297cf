"""Planning by computed tokens: samples grouped by shared prefixes, each group priced as the tree it becomes.

A packed row holding a prefix tree (:func:`packing_hf.prefix_tree.build_prefix_tree`) computes every shared
token once, so what a batch costs is the tokens of its trees, not the tokens of its samples.
:func:`find_prefix_groups` finds which samples share prefixes and what each group computes; the sampler
(``MultipackBatchSampler(..., prefix_groups=groups)``) then packs groups, not samples, into the token budget.

How the groups are found (the same trie as ``build_prefix_tree``, for every sample at once):

1. The samples are sorted in lexicographic token order and the common prefix of every two neighbours is
   measured (numpy, in chunks). Samples sharing a prefix are then neighbours, and the trie's nodes are runs
   of that order: with ``min_shared_tokens=1`` a sample's tokens already held by the samples before it are its
   common prefix with its predecessor; with more, the node boundaries of ``build_prefix_tree`` (a shared node
   is never shorter than ``min_shared_tokens``, a shorter common run is repeated) are walked node by node.
2. A group is a tree of the trie: the samples sharing at least ``min_shared_tokens`` leading tokens (a sample
   sharing fewer with every other one is a group of its own). Its ``unique_tokens`` are the tokens of its tree,
   exactly what ``build_prefix_tree`` of its members holds.
3. A tree over ``max_tokens_per_batch`` is cut into subtrees that fit, never dropped: a node's own samples
   (those ending there) and its children's subtrees, consecutive ones gathered while they fit and the prefix
   every piece repeats still weighs (over 1/8 of the piece); a child subtree over the budget is cut the same
   way one level down. A single sample over the budget is a group of its own, left to the sampler's
   ``overflow`` policy.

What a group costs (``cost``): ``linear * unique_tokens + quadratic * attention`` of a
:class:`~packing_hf.cost.CostModel`, where a node's queries read its ancestors' keys too: a node of ``l``
tokens after ``a`` ancestor tokens adds ``(a + l)**2 - a**2`` to ``attention`` (a sample alone: ``L**2``, as
the cost model counts it).

Groups are exact, bins are bounded: a batch of several groups built as one tree (the collator's row) holds at
most the sum of their ``unique_tokens`` with ``min_shared_tokens=1`` (pieces of one cut tree merge their common
prefix again, so the row is smaller). With ``min_shared_tokens > 1``, ``build_prefix_tree`` of two pieces cut
from one tree may place its node boundaries differently from either piece alone, so the row can differ from
the sum; build the row per group there.

>>> groups = find_prefix_groups([[1, 2, 3], [1, 2, 4], [7, 8], [1, 2, 3, 5]], max_tokens_per_batch=16)
>>> [g.tolist() for g in groups.members], groups.unique_tokens.tolist(), groups.sample_tokens.tolist()
([[0, 1, 3], [2]], [5, 2], [10, 2])
>>> round(groups.token_ratio, 2)
1.71
>>> from packing_hf.sampler import MultipackBatchSampler
>>> sampler = MultipackBatchSampler([3, 3, 2, 4], max_tokens_per_batch=16, prefix_groups=groups)
>>> [sorted(batch) for batch in sampler], sampler.stats()["tokens"]  # one batch: 7 tokens computed, 12 alone
([[0, 1, 2, 3]], 7)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .cost import CostModel

__all__ = ["PrefixGroups", "check_prefix_groups", "find_prefix_groups"]

_CHUNK = 1 << 21  # tokens compared at once when measuring neighbours' common prefixes
# cutting a tree over the budget: a piece stops gathering parts once it holds _GATHER times the prefix it
# repeats (the prefix then costs at most 1 / _GATHER of the piece's tokens)
_GATHER = 8


@dataclass(frozen=True)
class PrefixGroups:
    """Groups of samples sharing prefixes, and what the tree of each computes.

    Attributes:
        members: ``G`` arrays of int64 sample indices (ascending): every sample in exactly one group.
        unique_tokens: ``(G,)`` int64 the tokens of every group's tree (what its packed row computes).
        sample_tokens: ``(G,)`` int64 the tokens of its samples run alone.
        cost: ``(G,)`` float64 the predicted cost of every tree: ``linear * unique_tokens + quadratic *
            attention`` of the cost model given to :func:`find_prefix_groups` (without one: ``unique_tokens``).
        attention: ``(G,)`` float64 the attention term of every tree: ``sum over nodes of (a + l)**2 - a**2``
            for a node of ``l`` tokens under ``a`` ancestor tokens (``L**2`` for a sample alone).
        min_shared_tokens: what the groups were found with (the collator builds the trees with the same).
    """

    members: tuple[np.ndarray, ...]
    unique_tokens: np.ndarray
    sample_tokens: np.ndarray
    cost: np.ndarray
    attention: np.ndarray
    min_shared_tokens: int = 1

    def __post_init__(self) -> None:
        n = len(self.members)
        for name in ("unique_tokens", "sample_tokens", "cost", "attention"):
            value = getattr(self, name)
            if not isinstance(value, np.ndarray) or value.shape != (n,):
                raise ValueError(
                    f"PrefixGroups.{name} must be a numpy array of shape ({n},) (one value per group), got "
                    f"{getattr(value, 'shape', type(value).__name__)}; build the groups with find_prefix_groups"
                )
        if any(not isinstance(m, np.ndarray) or m.ndim != 1 or m.size == 0 for m in self.members):
            raise ValueError(
                "every PrefixGroups.members entry must be a non-empty 1-D numpy array of sample indices"
            )

    @property
    def num_groups(self) -> int:
        """How many groups (``G``)."""
        return len(self.members)

    @property
    def token_ratio(self) -> float:
        """Tokens of the samples alone over tokens of the trees (``>= 1``; ``2.0``: half as many computed)."""
        return float(self.sample_tokens.sum()) / max(float(self.unique_tokens.sum()), 1.0)


def _token_arrays(token_ids: Any, column: str) -> tuple[np.ndarray, np.ndarray]:
    """``(flat (T,) int64, lengths (n,) int64)`` of the samples, read from Arrow buffers for a ``datasets.Dataset``."""
    if type(token_ids).__module__.startswith("datasets") and not hasattr(token_ids, "column_names"):
        token_ids = list(token_ids)  # a dataset's column (datasets.Column): its rows
    if type(token_ids).__module__.startswith("datasets"):
        import pyarrow as pa

        if column not in token_ids.column_names:
            raise ValueError(
                f"column {column!r} is not in the dataset (columns: {token_ids.column_names}); tokenize first"
            )
        # the dataset's rows in order (select / shuffle leave an indices mapping): one Arrow take, no Python lists
        table = token_ids.with_format("arrow")[:][column]
        chunked = table if isinstance(table, pa.ChunkedArray) else pa.chunked_array([table])
        if chunked.null_count:
            raise ValueError(
                f"column {column!r} holds null rows; drop or fill them before finding prefix groups"
            )
        flats, lengths = [], []
        for chunk in chunked.chunks:
            offsets = chunk.offsets.to_numpy()
            flats.append(chunk.values.to_numpy(zero_copy_only=False)[offsets[0] : offsets[-1]])
            lengths.append(np.diff(offsets))
        flat = np.concatenate(flats) if flats else np.zeros(0, np.int64)
        lengths_array = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
        if flat.size and not np.issubdtype(flat.dtype, np.integer):
            raise TypeError(f"column {column!r} holds {flat.dtype} values; expected token ids (ints)")
        samples_desc = f"column {column!r}"
    else:
        if isinstance(token_ids, np.ndarray) or not isinstance(token_ids, Sequence):
            raise TypeError(
                f"token_ids must be a sequence of token id sequences (lists, arrays, 1-D tensors) or a "
                f"datasets.Dataset, got {type(token_ids).__name__}"
            )
        arrays = [s.cpu().numpy() if hasattr(s, "cpu") else np.asarray(s) for s in token_ids]
        # ints ("i", "u"), or an empty sample (caught below); one attribute read per sample
        wrong = [i for i, a in enumerate(arrays) if a.ndim != 1 or (a.dtype.kind not in "iu" and a.size)]
        if wrong:
            array = arrays[wrong[0]]
            raise TypeError(
                f"token_ids[{wrong[0]}] must be a 1-D sequence of token ids (ints), got shape {array.shape} of "
                f"{array.dtype}"
            )
        lengths_array = np.fromiter((a.size for a in arrays), np.int64, len(arrays))
        flat = np.concatenate(arrays) if arrays else np.zeros(0, np.int64)
        samples_desc = "token_ids"
    lengths_array = lengths_array.astype(np.int64)
    if lengths_array.size == 0:
        raise ValueError(f"{samples_desc} is empty; give at least one tokenized sample")
    empty = np.flatnonzero(lengths_array == 0)
    if empty.size:
        raise ValueError(
            f"sample {int(empty[0])} has no tokens ({empty.size} empty in all); drop empty samples first "
            "(a tree cannot hold them)"
        )
    return flat.astype(np.int64, copy=False), lengths_array


def _sorted_order(flat: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The samples in lexicographic token order (a prefix before its extensions): big-endian bytes compared by
    ``memcmp`` in Python's sort, so no comparison walks tokens in Python."""
    low = int(flat.min())
    span = int(flat.max()) - low
    width = 4 if span < 2**32 else 8
    shifted = (flat - low).astype(">u4" if width == 4 else ">u8")
    blob = shifted.tobytes()
    byte_starts = (starts * width).tolist()
    byte_ends = ((starts + lengths) * width).tolist()
    keys = [blob[a:b] for a, b in zip(byte_starts, byte_ends, strict=True)]
    return np.array(sorted(range(len(keys)), key=keys.__getitem__), dtype=np.int64)


def _neighbour_lcp(
    flat: np.ndarray, starts: np.ndarray, lengths: np.ndarray, order: np.ndarray
) -> np.ndarray:
    """``(n,)`` int64: ``lcp[i]`` the common prefix of the ``i - 1``-th and ``i``-th sample of ``order``
    (``lcp[0] = 0``), comparing at most ``_CHUNK`` tokens at once."""
    n = order.size
    lcp = np.zeros(n, np.int64)
    if n < 2:
        return lcp
    left, right = starts[order[:-1]], starts[order[1:]]
    span = np.minimum(lengths[order[:-1]], lengths[order[1:]])  # (n - 1,) >= 1
    ends = np.cumsum(span)
    pair = 0
    while pair < n - 1:
        last = int(np.searchsorted(ends, (ends[pair - 1] if pair else 0) + _CHUNK, side="right"))
        stop = max(last, pair + 1)
        sizes = span[pair:stop]
        total = int(sizes.sum())
        first = np.cumsum(sizes) - sizes  # (k,) where every pair starts in the chunk
        offset = np.arange(total) - np.repeat(first, sizes)  # (total,) token position within the pair
        differ = (
            flat[np.repeat(left[pair:stop], sizes) + offset]
            != flat[np.repeat(right[pair:stop], sizes) + offset]
        )
        # first differing position per pair, or the shorter length when one is a prefix of the other
        position = np.where(differ, offset, np.repeat(sizes, sizes))
        lcp[pair + 1 : stop + 1] = np.minimum.reduceat(position, first)
        pair = stop
    return lcp


class _Trie:
    """The trie of samples in sorted order: neighbours' common prefixes, node boundaries, range sums."""

    def __init__(self, lengths: np.ndarray, lcp: np.ndarray, min_shared: int) -> None:
        self.lengths, self.lcp, self.min_shared = lengths, lcp, min_shared
        n = lengths.size
        # shared[i]: tokens the i-th sample reads from nodes of the samples before it (in its group's tree);
        # with min_shared == 1 exactly the common prefix with its predecessor
        self.shared = lcp.copy() if min_shared == 1 else np.zeros(n, np.int64)
        if min_shared > 1:
            stack = [(lo, hi) for lo, hi in self._classes(0, n, 0) if hi - lo > 1]
            while stack:
                lo, hi = stack.pop()
                _, _, children = self.expand(lo, hi)
                stack.extend((a, b) for a, b in children if b - a > 1)
        self._cum_lengths = np.concatenate([[0], np.cumsum(lengths)])
        self._cum_squares = np.concatenate([[0.0], np.cumsum(lengths.astype(np.float64) ** 2)])
        self._cum_shared = np.concatenate([[0], np.cumsum(self.shared)])
        self._cum_shared_squares = np.concatenate([[0.0], np.cumsum(self.shared.astype(np.float64) ** 2)])

    def _classes(self, lo: int, hi: int, depth: int) -> list[tuple[int, int]]:
        """``[lo, hi)`` cut where neighbours share fewer than ``depth + min_shared`` tokens (the children classes)."""
        cuts = lo + 1 + np.flatnonzero(self.lcp[lo + 1 : hi] < depth + self.min_shared)
        bounds = [lo, *cuts.tolist(), hi]
        return list(zip(bounds[:-1], bounds[1:], strict=True))

    def expand(self, lo: int, hi: int) -> tuple[int, int, list[tuple[int, int]]]:
        """The node of the class ``[lo, hi)`` (``hi - lo >= 2``): ``(end, own_end, children)``.

        ``end``: where the node ends (its samples' common prefix); ``[lo, own_end)``: the samples ending there
        (prefixes of the others, they sort first); ``children``: the classes of the rest sharing at least
        ``end + min_shared`` tokens. Records the node's boundaries in ``shared``."""
        end = int(self.lcp[lo + 1 : hi].min())
        longer = np.flatnonzero(self.lengths[lo:hi] != end)
        own_end = lo + int(longer[0]) if longer.size else hi
        children = self._classes(own_end, hi, end) if own_end < hi else []
        if self.min_shared > 1:
            self.shared[lo + 1 : own_end + (own_end < hi)] = end
            self.shared[[a for a, _ in children[1:]]] = end
        return end, own_end, children

    def tokens(self, lo: Any, hi: Any) -> Any:
        """Tokens of the tree of ``[lo, hi)`` (ints or arrays of them): a class, a node's subtree, or a piece
        that keeps the node's structure (see :meth:`cut`): the first sample's tokens, then every other's
        tokens past what it shares."""
        return self._cum_lengths[hi] - self._cum_lengths[lo] - self._cum_shared[hi] + self._cum_shared[lo + 1]

    def attention(self, lo: Any, hi: Any) -> Any:
        """The attention term of the tree of ``[lo, hi)``: every sample adds ``L**2 - shared**2`` (its nodes'
        ``(a + l)**2 - a**2`` telescoped)."""
        return (
            self._cum_squares[hi]
            - self._cum_squares[lo]
            - self._cum_shared_squares[hi]
            + self._cum_shared_squares[lo + 1]
        )

    def sample_tokens(self, lo: Any, hi: Any) -> Any:
        """Tokens of the sorted samples ``lo:hi`` run alone (ints or int64 arrays of bounds, elementwise)."""
        return self._cum_lengths[hi] - self._cum_lengths[lo]

    def cut(self, lo: int, hi: int, budget: int) -> list[tuple[int, int]]:
        """Pieces of the class ``[lo, hi)`` whose trees fit ``budget``, every sample in one, in sorted order.

        A piece gathers consecutive parts of a node (its own samples, its children's subtrees) while the tree
        fits and the node's prefix, which every piece repeats, is over ``1 / _GATHER`` of the piece: a long
        prompt with short answers fills pieces to the budget, a short system prompt before long conversations
        leaves a conversation a piece of its own, which the sampler mixes anew every epoch (and a batch of
        pieces built as one tree holds their common prefix once). A child's subtree over the budget is cut the
        same way one level down. Two parts share only the node's prefix when their boundary's common prefix is
        the node's end; with ``min_shared_tokens > 1`` a boundary can share more (fewer than
        ``min_shared_tokens`` tokens past the node), and a piece made only of such parts would be another tree,
        so a piece grows past its first part only once it holds a boundary at the node's end."""
        pieces: list[tuple[int, int]] = []
        nodes = [(lo, hi)]  # classes over the budget, still to cut (a stack: trees can be deep)
        while nodes:
            first, last = nodes.pop()
            end, own_end, children = self.expand(first, last)
            current: tuple[int, int] | None = None  # a piece is a run of consecutive parts
            keeps = False  # the current piece holds a boundary at the node's end
            for a, b in ([(first, own_end)] if own_end > first else []) + children:
                if self.tokens(a, b) > budget:  # a child's subtree: cut one level down
                    nodes.append((a, b))
                    if current is not None:
                        pieces.append(current)
                    current, keeps = None, False
                    continue
                if current is not None:
                    gather = self.tokens(*current) < _GATHER * end  # its repeated prefix still weighs
                    at_node = int(self.lcp[a]) == end
                    if gather and (keeps or at_node) and self.tokens(current[0], b) <= budget:
                        current, keeps = (current[0], b), True
                        continue
                    pieces.append(current)
                current, keeps = (a, b), False
            if current is not None:
                pieces.append(current)
        return sorted(pieces)


def find_prefix_groups(
    token_ids: Any,
    *,
    max_tokens_per_batch: int,
    min_shared_tokens: int = 1,
    cost_model: CostModel | None = None,
    column: str = "input_ids",
) -> PrefixGroups:
    """Group samples that share prefixes into trees of at most ``max_tokens_per_batch`` tokens.

    Args:
        token_ids: ``n`` tokenized samples (lists, arrays or 1-D tensors of ids, each non-empty), or a
            ``datasets.Dataset`` whose ``column`` holds them.
        max_tokens_per_batch: the token budget of a packed row: a group's tree holds at most this many
            tokens (a tree over it is cut into subtrees; a single longer sample is a group of its own).
        min_shared_tokens: as in :func:`~packing_hf.prefix_tree.build_prefix_tree`: samples sharing fewer
            leading tokens are separate groups, and a shared node is never shorter.
        cost_model: prices every group's tree (``cost``); default: its unique tokens.
        column: the column of a ``datasets.Dataset`` holding the token ids.

    Returns:
        :class:`PrefixGroups`, groups ordered by their smallest sample index.

    Raises:
        ValueError / TypeError: no samples, an empty or non-integer sample, a bad budget or
            ``min_shared_tokens``, a ``cost_model`` that is not a :class:`~packing_hf.cost.CostModel`.

    >>> groups = find_prefix_groups([[1, 2, 3], [1, 2, 4], [1, 2, 5]], max_tokens_per_batch=4)
    >>> [g.tolist() for g in groups.members], groups.unique_tokens.tolist()  # a tree of 5 cut into 4 + 3
    ([[0, 1], [2]], [4, 3])
    """
    if isinstance(max_tokens_per_batch, bool) or not isinstance(max_tokens_per_batch, int | np.integer):
        raise TypeError(f"max_tokens_per_batch must be an int, got {type(max_tokens_per_batch).__name__}")
    budget = int(max_tokens_per_batch)
    if budget < 1:
        raise ValueError(f"max_tokens_per_batch={budget}: give the token budget of a packed row (>= 1)")
    if isinstance(min_shared_tokens, bool) or not isinstance(min_shared_tokens, int) or min_shared_tokens < 1:
        raise ValueError(
            f"min_shared_tokens={min_shared_tokens!r}: give an int >= 1 (1 merges every common prefix)"
        )
    if cost_model is not None and not isinstance(cost_model, CostModel):
        raise TypeError(
            f"cost_model must be a packing_hf.CostModel, got {type(cost_model).__name__}; build one with "
            "CostModel(linear, quadratic) or CostModel.from_config(model.config)"
        )
    flat, lengths = _token_arrays(token_ids, column)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    # a sample over the budget fits no tree: its own group, for the sampler's overflow policy
    long = np.flatnonzero(lengths > budget)
    fit = np.flatnonzero(lengths <= budget)
    ranges: list[tuple[int, int]] = []
    order = np.zeros(0, np.int64)
    trie = None
    if fit.size:
        order = fit[_sorted_order(flat, starts[fit], lengths[fit])]
        trie = _Trie(lengths[order], _neighbour_lcp(flat, starts, lengths, order), min_shared_tokens)
        for lo, hi in trie._classes(0, order.size, 0):
            if trie.tokens(lo, hi) <= budget:
                ranges.append((lo, hi))
            else:
                ranges.extend(trie.cut(lo, hi, budget))
    bounds = np.asarray(ranges, np.int64).reshape(-1, 2)  # (groups of the trie, 2) consecutive [lo, hi)
    lo, hi = bounds[:, 0], bounds[:, 1]
    # every range's samples in ascending index order: sort by (range, index) at once
    range_of = np.repeat(np.arange(lo.size), hi - lo)
    grouped = order[np.lexsort((order, range_of))]
    members = (np.split(grouped, hi[:-1]) if lo.size else []) + [long[i : i + 1] for i in range(long.size)]
    unique = np.concatenate([trie.tokens(lo, hi) if lo.size else lo, lengths[long]]).astype(np.int64)
    attention = np.concatenate(
        [trie.attention(lo, hi) if lo.size else lo.astype(np.float64), lengths[long].astype(np.float64) ** 2]
    )
    sample_tokens = np.concatenate([trie.sample_tokens(lo, hi) if lo.size else lo, lengths[long]])
    first = np.argsort(np.concatenate([grouped[lo], long]), kind="stable")  # by smallest member
    unique_array, attention_array = unique[first], attention[first]
    # a tree is priced as a bin: its unique tokens, and its nodes' attention in place of squared lengths
    cost = (
        unique_array.astype(np.float64)
        if cost_model is None
        else cost_model.bin_costs(unique_array, attention_array)
    )
    return PrefixGroups(
        members=tuple(members[i] for i in first.tolist()),
        unique_tokens=unique_array,
        sample_tokens=sample_tokens.astype(np.int64)[first],
        cost=np.asarray(cost, np.float64),
        attention=attention_array,
        min_shared_tokens=min_shared_tokens,
    )


def check_prefix_groups(groups: Any, lengths: np.ndarray, budget: int) -> None:
    """Raise unless ``groups`` holds every sample of ``lengths`` exactly once, with its samples' tokens, and
    every group of several samples fits ``budget`` (what :func:`~packing_hf.prefix_plan.find_prefix_groups`
    of the same samples and budget gives).

    >>> groups = find_prefix_groups([[1, 2], [1, 3]], max_tokens_per_batch=8)
    >>> check_prefix_groups(groups, np.array([2, 3]), 8)
    Traceback (most recent call last):
    ...
    ValueError: prefix group 0: its samples hold 5 tokens by these lengths, but the groups say 4: ...
    """
    if not isinstance(groups, PrefixGroups):
        raise TypeError(
            f"prefix_groups must be a packing_hf.prefix_plan.PrefixGroups, got {type(groups).__name__}; build it "
            "with find_prefix_groups(token_ids, max_tokens_per_batch=...)"
        )
    n = lengths.size
    fix = "build the groups with find_prefix_groups on the same samples, in the same order"
    if groups.num_groups == 0:
        raise ValueError(f"prefix_groups holds no group for the {n} samples; {fix}")
    sizes = np.fromiter((m.size for m in groups.members), np.int64, groups.num_groups)
    index = np.concatenate(groups.members)
    if not np.issubdtype(index.dtype, np.integer):
        raise TypeError(f"prefix_groups.members hold {index.dtype} values, not sample indices; {fix}")
    group_of = np.repeat(np.arange(groups.num_groups), sizes)
    outside = np.flatnonzero((index < 0) | (index >= n))
    if outside.size:
        g = int(group_of[outside[0]])
        raise ValueError(
            f"prefix group {g} names sample {int(index[outside[0]])}, but there are {n} samples; {fix}"
        )
    counts = np.bincount(index, minlength=n)
    if (counts != 1).any():
        bad = int(np.flatnonzero(counts != 1)[0])
        raise ValueError(
            f"sample {bad} is in {int(counts[bad])} prefix groups ({int((counts == 0).sum())} sample(s) in none, "
            f"{int((counts > 1).sum())} in several); every sample must be in exactly one group: {fix}"
        )
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    tokens = np.add.reduceat(lengths[index], starts)  # (G,)
    if not np.array_equal(tokens, groups.sample_tokens):
        g = int(np.flatnonzero(tokens != groups.sample_tokens)[0])
        raise ValueError(
            f"prefix group {g}: its samples hold {int(tokens[g])} tokens by these lengths, but the groups say "
            f"{int(groups.sample_tokens[g])}: they were found on other data or another tokenization; {fix}"
        )
    longest = np.maximum.reduceat(lengths[index], starts)
    unique = groups.unique_tokens
    wrong = np.flatnonzero((unique < longest) | (unique > tokens))
    if wrong.size:
        g = int(wrong[0])
        raise ValueError(
            f"prefix group {g} has unique_tokens={int(unique[g])}, outside [{int(longest[g])}, {int(tokens[g])}] "
            f"(its longest sample, its samples' tokens); {fix}"
        )
    over = np.flatnonzero((unique > budget) & (sizes > 1))
    if over.size:
        g = int(over[0])
        raise ValueError(
            f"prefix group {g} holds {int(sizes[g])} samples in a tree of {int(unique[g])} tokens > "
            f"max_tokens_per_batch={budget}: find the groups with max_tokens_per_batch={budget} "
            "(find_prefix_groups cuts every tree to fit it)"
        )
