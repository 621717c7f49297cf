"""The shared-prefix layout of a packed row, in pure torch: one prefix segment, ``G`` branches attending to it.

A packed row is cut into segments by ``cu_seqlens`` as usual. ``prefix_seq_idx`` (``(n,)`` int32, one
entry per segment) says which earlier segment every segment continues: ``-1`` for an ordinary segment (a
sample on its own, or a prefix), ``p`` for a *branch* of the prefix segment ``p``. A branch attends to
every key of its prefix and causally to its own keys, never to its sibling branches; its positions
continue from the prefix's end. So a row ``[prompt | chosen | rejected]`` with ``prefix_seq_idx = [-1, 0,
0]`` computes exactly what ``prompt + chosen`` and ``prompt + rejected`` compute when run alone, with the
prompt stored and computed once. Several groups and ordinary segments may share one row.

A prefix cannot itself be a branch (no chains), and it comes before its branches.

>>> cu = torch.tensor([0, 3, 5, 6, 8], dtype=torch.int32)  # prefix(3) | branch(2) | branch(1) | alone(2)
>>> idx = torch.tensor([-1, 0, 0, -1], dtype=torch.int32)
>>> shared_prefix_position_ids(cu, idx).tolist()
[0, 1, 2, 3, 4, 3, 0, 1]
>>> shared_prefix_plan(cu, idx).cu_seqlens_k.tolist()  # every branch's keys: its prefix, then its own
[0, 3, 8, 12, 14]
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .varlen import LengthsLike, _as_int64_1d, check_cu_seqlens

__all__ = [
    "PREFIX_KEY",
    "SharedPrefixPlan",
    "check_prefix_seq_idx",
    "shared_prefix_plan",
    "shared_prefix_position_ids",
]

# The batch key naming the layout (next to cu_seq_lens_q/k, max_length_q/k, seq_idx).
PREFIX_KEY = "prefix_seq_idx"


def check_prefix_seq_idx(
    prefix_seq_idx: LengthsLike, n_segments: int, name: str = "prefix_seq_idx"
) -> list[int]:
    """Check a ``prefix_seq_idx`` against ``n_segments`` segments; return its host values.

    Every entry is ``-1`` or the index of an earlier segment whose own entry is ``-1``.

    Args:
        prefix_seq_idx: ``(n,)`` ints (int32 tensor from a collator, array or list).
        n_segments: ``n``, the segments of ``cu_seqlens``.
        name: how error messages call it.

    Returns:
        The entries as Python ints.

    >>> check_prefix_seq_idx([-1, 0, 0], 3)
    [-1, 0, 0]
    >>> check_prefix_seq_idx([-1, 0, 1], 3)
    Traceback (most recent call last):
    ...
    ValueError: prefix_seq_idx[2] = 1 names segment 1, which is itself a branch (prefix_seq_idx[1] = 0); a prefix must be an ordinary segment (-1)
    """
    values = _as_int64_1d(prefix_seq_idx, name).tolist()
    if len(values) != n_segments:
        raise ValueError(
            f"{name} has {len(values)} entries but cu_seq_lens_q describes {n_segments} segments; give one entry "
            "per segment (-1 for an ordinary segment)"
        )
    for i, p in enumerate(values):
        if p == -1:
            continue
        if not 0 <= p < i:
            raise ValueError(
                f"{name}[{i}] = {p}: a branch names an earlier segment (0 <= p < {i}) as its prefix, or -1"
            )
        if values[p] != -1:
            raise ValueError(
                f"{name}[{i}] = {p} names segment {p}, which is itself a branch ({name}[{p}] = {values[p]}); "
                "a prefix must be an ordinary segment (-1)"
            )
    return values


def _segments(cu_seqlens: LengthsLike, prefix_seq_idx: LengthsLike) -> tuple[list[int], list[int]]:
    bounds = check_cu_seqlens(cu_seqlens, "cu_seq_lens_q")
    return bounds, check_prefix_seq_idx(prefix_seq_idx, len(bounds) - 1)


def shared_prefix_position_ids(
    cu_seqlens: LengthsLike, prefix_seq_idx: LengthsLike, start: int = 0
) -> torch.Tensor:
    """``(T,)`` int64 positions of a shared-prefix row: restarting at ``start`` in every ordinary segment and
    continuing from the prefix's end in every branch.

    Args:
        cu_seqlens: ``(n + 1,)`` int32 segment boundaries.
        prefix_seq_idx: ``(n,)`` ints (see the module docstring).
        start: first position of a sample.

    >>> shared_prefix_position_ids([0, 2, 4, 5], [-1, 0, 0]).tolist()
    [0, 1, 2, 3, 2]
    """
    bounds, prefix = _segments(cu_seqlens, prefix_seq_idx)
    lengths = torch.tensor([b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)], dtype=torch.int64)
    offset = torch.tensor([0 if p < 0 else int(lengths[p]) for p in prefix], dtype=torch.int64) + start
    starts = torch.tensor(bounds[:-1], dtype=torch.int64)
    total = bounds[-1]
    return torch.arange(total, dtype=torch.int64) - torch.repeat_interleave(starts - offset, lengths)


class SharedPrefixPlan(NamedTuple):
    """The keys of a shared-prefix row laid out for one plain varlen call.

    Key segment ``i`` is segment ``i``'s own tokens, preceded by its prefix's tokens when it is a branch.
    With the queries left as they are (``cu_seqlens`` of the row), a causal varlen call aligned bottom-right
    (FlashAttention's rule for ``Lk > Lq``: query ``j`` of a segment sees keys up to ``j + Lk - Lq``) then
    lets every branch token see its whole prefix and its own earlier tokens: exactly what the branch
    computes when run after its prefix alone. Gathering the prefix keys once per branch costs ``G`` copies
    of the prefix's keys and values per layer, never of its queries, activations or MLP work; the backward
    of the gather sums the ``G`` key/value gradients into the prefix's tokens.
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
    """
    bounds, prefix = _segments(cu_seqlens, prefix_seq_idx)
    pieces, cu_k = [], [0]
    for i, p in enumerate(prefix):
        own = torch.arange(bounds[i], bounds[i + 1], dtype=torch.int64)
        keys = own if p < 0 else torch.cat([torch.arange(bounds[p], bounds[p + 1], dtype=torch.int64), own])
        pieces.append(keys)
        cu_k.append(cu_k[-1] + keys.numel())
    lengths = [b - a for a, b in zip(cu_k[:-1], cu_k[1:], strict=True)]
    return SharedPrefixPlan(
        torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64),
        torch.tensor(cu_k, dtype=torch.int32),
        max(lengths, default=0),
    )
