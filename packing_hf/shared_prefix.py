"""The prefix-tree layout of a packed row, in pure torch: segments that continue an earlier segment, at any depth.

A packed row is cut into segments by ``cu_seqlens`` as usual. ``prefix_seq_idx`` (``(n,)`` int32, one
entry per segment) names every segment's *parent*: ``-1`` for a root (a sample on its own, or the first
node of a tree), ``p`` for a segment that continues the earlier segment ``p``. A segment attends to every
key of its ancestors (its parent, the parent's parent, ... up to the root) and causally to its own keys,
never to its siblings, cousins or other trees; its positions continue from its parent's end. So a row
``[prompt | chosen | rejected]`` with ``prefix_seq_idx = [-1, 0, 0]`` computes exactly what ``prompt +
chosen`` and ``prompt + rejected`` compute when run alone, with the prompt stored and computed once; a row
``[system | turn 1 | turn 2a | turn 2b]`` with ``[-1, 0, 1, 1]`` computes ``system + turn 1 + turn 2a`` and
``system + turn 1 + turn 2b``, the first two segments once. Several trees and ordinary segments may share
one row. The one-level shared prefix (a prompt and its branches) is the depth-1 case.

A parent comes before its children in the row (``p < i``), so every segment's ancestors are known when it
is read. :mod:`packing_hf.prefix_tree` builds such rows from tokenized samples (a trie).

>>> cu = torch.tensor([0, 3, 5, 6, 8], dtype=torch.int32)  # root(3) | child(2) | its child(1) | alone(2)
>>> idx = torch.tensor([-1, 0, 1, -1], dtype=torch.int32)
>>> shared_prefix_position_ids(cu, idx).tolist()
[0, 1, 2, 3, 4, 5, 0, 1]
>>> shared_prefix_plan(cu, idx).cu_seqlens_k.tolist()  # every segment's keys: its ancestors', then its own
[0, 3, 8, 14, 16]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from ._cache import IdentityCache
from .varlen import LengthsLike, _as_int64_1d, check_cu_seqlens

__all__ = [
    "PREFIX_KEY",
    "SharedPrefixPlan",
    "check_prefix_seq_idx",
    "cached_shared_prefix_plan",
    "prefix_chains",
    "shared_prefix_plan",
    "shared_prefix_position_ids",
]

# The batch key naming the layout (next to cu_seq_lens_q/k, max_length_q/k, seq_idx).
PREFIX_KEY = "prefix_seq_idx"

# Every layer of a forward, its attention and its token mixers alike, receives the same boundary tensors: the
# plan (a host read) is made once (cached_shared_prefix_plan).
_PLANS = IdentityCache(size=8)  # a host plan and a device copy per forward


def check_prefix_seq_idx(
    prefix_seq_idx: LengthsLike, n_segments: int, name: str = "prefix_seq_idx"
) -> list[int]:
    """Check a ``prefix_seq_idx`` against ``n_segments`` segments; return its host values.

    Every entry is ``-1`` (a root) or the index of an earlier segment (its parent, at any depth).

    Args:
        prefix_seq_idx: ``(n,)`` ints (int32 tensor from a collator, array or list).
        n_segments: ``n``, the segments of ``cu_seqlens``.
        name: how error messages call it.

    Returns:
        The entries as Python ints.

    >>> check_prefix_seq_idx([-1, 0, 1, 1], 4)
    [-1, 0, 1, 1]
    >>> check_prefix_seq_idx([-1, 2, -1], 3)
    Traceback (most recent call last):
    ...
    ValueError: prefix_seq_idx[1] = 2: a segment names an earlier segment (0 <= p < 1) as its parent, or -1; put every parent before its children in the row
    """
    values = _as_int64_1d(prefix_seq_idx, name).tolist()
    if len(values) != n_segments:
        raise ValueError(
            f"{name} has {len(values)} entries but cu_seq_lens_q describes {n_segments} segments; give one entry "
            "per segment (-1 for an ordinary segment)"
        )
    for i, p in enumerate(values):
        if p != -1 and not 0 <= p < i:
            raise ValueError(
                f"{name}[{i}] = {p}: a segment names an earlier segment (0 <= p < {i}) as its parent, or -1; "
                "put every parent before its children in the row"
            )
    return values


def prefix_chains(prefix_seq_idx: Sequence[int]) -> list[list[int]]:
    """Every segment's ancestors, root first (``[]`` for a root), from checked ``prefix_seq_idx`` values.

    >>> prefix_chains([-1, 0, 1, 1, -1])
    [[], [0], [0, 1], [0, 1], []]
    """
    chains: list[list[int]] = []
    for p in prefix_seq_idx:
        chains.append([] if p < 0 else [*chains[p], p])
    return chains


def _segments(cu_seqlens: LengthsLike, prefix_seq_idx: LengthsLike) -> tuple[list[int], list[int]]:
    bounds = check_cu_seqlens(cu_seqlens, "cu_seq_lens_q")
    return bounds, check_prefix_seq_idx(prefix_seq_idx, len(bounds) - 1)


def shared_prefix_position_ids(
    cu_seqlens: LengthsLike, prefix_seq_idx: LengthsLike, start: int = 0
) -> torch.Tensor:
    """``(T,)`` int64 positions of a prefix-tree row: restarting at ``start`` in every root segment and
    continuing from the parent's end in every other (so a segment's first position is ``start`` plus the
    tokens of all its ancestors).

    Args:
        cu_seqlens: ``(n + 1,)`` int32 segment boundaries.
        prefix_seq_idx: ``(n,)`` ints (see the module docstring).
        start: first position of a sample.

    >>> shared_prefix_position_ids([0, 2, 4, 5], [-1, 0, 0]).tolist()
    [0, 1, 2, 3, 2]
    >>> shared_prefix_position_ids([0, 2, 4, 5], [-1, 0, 1]).tolist()
    [0, 1, 2, 3, 4]
    """
    bounds, parents = _segments(cu_seqlens, prefix_seq_idx)
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    offsets: list[int] = []  # tokens of every segment's ancestors
    for p in parents:
        offsets.append(0 if p < 0 else offsets[p] + lengths[p])
    lengths_t = torch.tensor(lengths, dtype=torch.int64)
    shift = torch.tensor(bounds[:-1], dtype=torch.int64) - torch.tensor(offsets, dtype=torch.int64) - start
    return torch.arange(bounds[-1], dtype=torch.int64) - torch.repeat_interleave(shift, lengths_t)


class SharedPrefixPlan(NamedTuple):
    """The keys of a prefix-tree row laid out for one plain varlen call.

    Key segment ``i`` is segment ``i``'s own tokens, preceded by its ancestors' tokens, root first. With the
    queries left as they are (``cu_seqlens`` of the row), a causal varlen call aligned bottom-right
    (FlashAttention's rule for ``Lk > Lq``: query ``j`` of a segment sees keys up to ``j + Lk - Lq``) then
    lets every token see all its ancestors and its own earlier tokens, at the relative positions they hold
    in the sample alone: exactly what the segment computes when run after its ancestors alone. Gathering
    the ancestors' keys costs, per layer, one copy of a segment's keys and values for every descendant (not
    of its queries, activations or MLP work); the backward of the gather sums those copies' gradients into
    the segment's tokens.
    """

    key_index: torch.Tensor  # (Tk,) int64 row token of every gathered key
    cu_seqlens_k: torch.Tensor  # (n + 1,) int32 boundaries of the gathered keys
    max_length_k: int


def shared_prefix_plan(cu_seqlens: LengthsLike, prefix_seq_idx: LengthsLike) -> SharedPrefixPlan:
    """The :class:`SharedPrefixPlan` of a row (host arithmetic on the two small inputs).

    Args:
        cu_seqlens: ``(n + 1,)`` int32 segment boundaries of the row (the queries).
        prefix_seq_idx: ``(n,)`` ints.

    Returns:
        A :class:`SharedPrefixPlan` of CPU tensors.

    >>> plan = shared_prefix_plan([0, 2, 3, 5], [-1, 0, 0])
    >>> plan.key_index.tolist(), plan.cu_seqlens_k.tolist(), plan.max_length_k
    ([0, 1, 0, 1, 2, 0, 1, 3, 4], [0, 2, 5, 9], 4)
    >>> shared_prefix_plan([0, 2, 3, 5], [-1, 0, 1]).key_index.tolist()  # a chain: root, child, grandchild
    [0, 1, 0, 1, 2, 0, 1, 2, 3, 4]
    """
    bounds, parents = _segments(cu_seqlens, prefix_seq_idx)
    starts, ends = np.asarray(bounds[:-1], dtype=np.int64), np.asarray(bounds[1:], dtype=np.int64)
    pieces, cu_k = [], [0]
    for i, chain in enumerate(prefix_chains(parents)):
        keys = np.concatenate([np.arange(starts[s], ends[s]) for s in (*chain, i)])
        pieces.append(keys)
        cu_k.append(cu_k[-1] + keys.size)
    lengths = [b - a for a, b in zip(cu_k[:-1], cu_k[1:], strict=True)]
    index = np.concatenate(pieces).astype(np.int64) if pieces else np.zeros(0, dtype=np.int64)
    return SharedPrefixPlan(
        torch.from_numpy(index), torch.tensor(cu_k, dtype=torch.int32), max(lengths, default=0)
    )


def cached_shared_prefix_plan(
    cu_seqlens: torch.Tensor, prefix_seq_idx: torch.Tensor, device: torch.device | None = None
) -> SharedPrefixPlan:
    """:func:`shared_prefix_plan` of a forward's boundary tensors, cached per tensor object and version: the
    attention (:mod:`packing_hf.attention.prefix`) and the token mixers
    (:func:`packing_hf.architectures.boundaries.tree_layout`) of every layer read one plan, one host read.
    With an accelerator ``device``: the plan's tensors there, copied once per forward too.

    >>> cu, idx = torch.tensor([0, 2, 3]), torch.tensor([-1, 0])
    >>> cached_shared_prefix_plan(cu, idx) is cached_shared_prefix_plan(cu, idx, torch.device("cpu"))
    True
    """
    plan = _PLANS.derive(
        (cu_seqlens, prefix_seq_idx), lambda: shared_prefix_plan(cu_seqlens.cpu(), prefix_seq_idx.cpu())
    )
    if device is None or torch.device(device).type == "cpu":
        return plan
    return _PLANS.derive(
        (cu_seqlens, prefix_seq_idx),
        lambda: plan._replace(key_index=plan.key_index.to(device), cu_seqlens_k=plan.cu_seqlens_k.to(device)),
        data=str(device),
    )
