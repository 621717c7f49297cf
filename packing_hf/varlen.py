"""Boundary bookkeeping for packed ("varlen") rows, in pure torch.

A packed row holds ``n`` samples back to back, ``T = sum(lengths)`` tokens in all. The same boundaries
have four interchangeable spellings, and this module converts between them:

- ``lengths``: ``(n,)`` int64, the token count of every sample (all > 0);
- ``cu_seqlens``: ``(n + 1,)`` int32, cumulative lengths starting at 0 (FlashAttention's format,
  ``cu_seq_lens_q/k`` in transformers);
- ``position_ids``: ``(T,)`` int64, restarting at ``start`` (usually 0) for every sample;
- ``seq_idx``: ``(T,)`` int32, the sample index of every token (Mamba-style kernels).

Every function is vectorized (no Python loop over tokens) and validates its input, raising
``ValueError``/``TypeError`` that name the bad value and how to fix it.

>>> lengths_to_cu_seqlens([3, 2]).tolist()
[0, 3, 5]
>>> lengths_to_position_ids([3, 2]).tolist()
[0, 1, 2, 0, 1]
>>> position_ids_to_cu_seqlens(torch.tensor([[0, 1, 2, 0, 1]])).tolist()
[0, 3, 5]
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = [
    "INT32_MAX",
    "cu_seqlens_to_lengths",
    "cu_seqlens_to_position_ids",
    "cu_seqlens_to_seq_idx",
    "lengths_to_cu_seqlens",
    "lengths_to_position_ids",
    "lengths_to_seq_idx",
    "max_length_from_cu_seqlens",
    "position_ids_to_cu_seqlens",
    "seq_lengths_to_cu_seqlens",
]

# cu_seqlens are int32 in every varlen kernel; a packed row longer than this cannot be addressed.
INT32_MAX = 2**31 - 1

LengthsLike = Sequence[int] | np.ndarray | torch.Tensor


def _as_int64_1d(values: LengthsLike, name: str) -> torch.Tensor:
    """Turn a list / numpy array / tensor of ints into a 1-D int64 CPU-or-same-device tensor."""
    if isinstance(values, torch.Tensor):
        tensor = values
    else:
        array = np.asarray(values)
        if array.size == 0:
            array = array.astype(np.int64)
        if array.dtype == object:
            raise TypeError(f"{name} must be a flat sequence of ints, got ragged or mixed values: {values!r}")
        tensor = torch.from_numpy(np.ascontiguousarray(array))
    if tensor.dtype == torch.bool or tensor.is_floating_point() or tensor.is_complex():
        raise TypeError(f"{name} must hold integers, got dtype {tensor.dtype}; cast with .long() first")
    if tensor.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(tensor.shape)}")
    return tensor.to(torch.int64)


def _check_lengths(lengths: torch.Tensor, name: str = "lengths") -> None:
    if lengths.numel() and bool((lengths <= 0).any()):
        bad = int(torch.nonzero(lengths <= 0)[0, 0])
        raise ValueError(
            f"{name}[{bad}] = {int(lengths[bad])}: every sample needs at least one token; "
            "drop empty samples before packing"
        )


def _check_cu_seqlens(cu_seqlens: torch.Tensor) -> None:
    if cu_seqlens.numel() == 0 or int(cu_seqlens[0]) != 0:
        raise ValueError(
            f"cu_seqlens must start with 0 and have n + 1 entries, got {cu_seqlens.tolist()[:8]}; "
            "build it with lengths_to_cu_seqlens(lengths)"
        )
    steps = cu_seqlens[1:] - cu_seqlens[:-1]
    if steps.numel() and bool((steps <= 0).any()):
        bad = int(torch.nonzero(steps <= 0)[0, 0])
        raise ValueError(
            f"cu_seqlens must be strictly increasing, but cu_seqlens[{bad + 1}] = {int(cu_seqlens[bad + 1])} "
            f"<= cu_seqlens[{bad}] = {int(cu_seqlens[bad])} (an empty or negative-length segment)"
        )


def lengths_to_cu_seqlens(lengths: LengthsLike, *, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """Cumulative sequence lengths of a packed row.

    Args:
        lengths: ``(n,)`` ints > 0, the length of every sample.
        dtype: ``torch.int32`` (what varlen kernels take) or ``torch.int64``.

    Returns:
        ``(n + 1,)`` tensor of ``dtype``: ``[0, l0, l0 + l1, ...]``.

    Raises:
        ValueError: a length is <= 0, or the total does not fit in int32.

    >>> lengths_to_cu_seqlens([4, 1, 2]).tolist()
    [0, 4, 5, 7]
    """
    lengths = _as_int64_1d(lengths, "lengths")
    _check_lengths(lengths)
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, dim=0, out=cu[1:])
    if dtype == torch.int32 and int(cu[-1]) > INT32_MAX:
        raise ValueError(
            f"a packed row of {int(cu[-1])} tokens overflows int32 cu_seqlens (max {INT32_MAX}); "
            "split the batch into several rows or lower max_tokens_per_batch"
        )
    return cu.to(dtype)


def cu_seqlens_to_lengths(cu_seqlens: LengthsLike) -> torch.Tensor:
    """Per-sample lengths ``(n,)`` int64 from cu_seqlens ``(n + 1,)``.

    >>> cu_seqlens_to_lengths([0, 4, 5, 7]).tolist()
    [4, 1, 2]
    """
    cu = _as_int64_1d(cu_seqlens, "cu_seqlens")
    _check_cu_seqlens(cu)
    return cu[1:] - cu[:-1]


def max_length_from_cu_seqlens(cu_seqlens: LengthsLike) -> int:
    """Length of the longest sample, as a Python int (``max_length_q/k``; 0 for an empty row).

    >>> max_length_from_cu_seqlens([0, 4, 5, 7])
    4
    """
    lengths = cu_seqlens_to_lengths(cu_seqlens)
    return int(lengths.max()) if lengths.numel() else 0


def lengths_to_position_ids(lengths: LengthsLike, start: int = 0) -> torch.Tensor:
    """Position ids ``(T,)`` int64 that restart at ``start`` for every sample.

    >>> lengths_to_position_ids([2, 3], start=1).tolist()
    [1, 2, 1, 2, 3]
    """
    lengths = _as_int64_1d(lengths, "lengths")
    _check_lengths(lengths)
    total = int(lengths.sum())
    starts = torch.cumsum(lengths, 0) - lengths  # (n,) offset of every sample
    offsets = torch.repeat_interleave(starts, lengths, output_size=total)  # (T,)
    return torch.arange(total, dtype=torch.int64, device=lengths.device) - offsets + start


def lengths_to_seq_idx(lengths: LengthsLike) -> torch.Tensor:
    """Sample index ``(T,)`` int32 of every token.

    >>> lengths_to_seq_idx([2, 3]).tolist()
    [0, 0, 1, 1, 1]
    """
    lengths = _as_int64_1d(lengths, "lengths")
    _check_lengths(lengths)
    total = int(lengths.sum())
    index = torch.arange(lengths.numel(), dtype=torch.int32, device=lengths.device)
    return torch.repeat_interleave(index, lengths, output_size=total)


def cu_seqlens_to_position_ids(cu_seqlens: LengthsLike, start: int = 0) -> torch.Tensor:
    """Position ids ``(T,)`` int64 from cu_seqlens ``(n + 1,)``.

    >>> cu_seqlens_to_position_ids([0, 2, 5]).tolist()
    [0, 1, 0, 1, 2]
    """
    return lengths_to_position_ids(cu_seqlens_to_lengths(cu_seqlens), start=start)


def cu_seqlens_to_seq_idx(cu_seqlens: LengthsLike) -> torch.Tensor:
    """Sample index ``(T,)`` int32 of every token from cu_seqlens ``(n + 1,)``.

    >>> cu_seqlens_to_seq_idx([0, 2, 5]).tolist()
    [0, 0, 1, 1, 1]
    """
    return lengths_to_seq_idx(cu_seqlens_to_lengths(cu_seqlens))


def position_ids_to_cu_seqlens(
    position_ids: torch.Tensor | LengthsLike, start: int | None = 0
) -> torch.Tensor:
    """Recover sample boundaries from the position ids of one packed row.

    A new sample begins at the first token and wherever the position does not continue the previous
    one by +1. Unlike transformers' own detection (``position_ids == 0``), this also finds boundaries
    when samples do not start at 0.

    Args:
        position_ids: ``(T,)`` or ``(1, T)`` ints. A batch of several rows is refused: flatten it first.
        start: if not ``None``, every sample must begin at this position (``ValueError`` otherwise),
            which catches rows that were truncated mid-sample or are continuations of a longer context.

    Returns:
        ``(n + 1,)`` int32 cu_seqlens.

    >>> position_ids_to_cu_seqlens([0, 1, 2, 0, 1, 0]).tolist()
    [0, 3, 5, 6]
    >>> position_ids_to_cu_seqlens([5, 6, 0, 1], start=None).tolist()
    [0, 2, 4]
    """
    if isinstance(position_ids, torch.Tensor) and position_ids.dim() == 2:
        if position_ids.shape[0] != 1:
            raise ValueError(
                f"position_ids of shape {tuple(position_ids.shape)} hold {position_ids.shape[0]} rows; "
                "a packed batch is a single row [1, T]: flatten it with PaddingFreeCollator"
            )
        position_ids = position_ids[0]
    pos = _as_int64_1d(position_ids, "position_ids")
    if pos.numel() == 0:
        return torch.zeros(1, dtype=torch.int32, device=pos.device)
    is_start = torch.ones_like(pos, dtype=torch.bool)
    is_start[1:] = pos[1:] != pos[:-1] + 1
    starts = torch.nonzero(is_start).flatten()
    if start is not None and bool((pos[starts] != start).any()):
        bad = int(starts[pos[starts] != start][0])
        raise ValueError(
            f"position_ids[{bad}] = {int(pos[bad])} begins a sample but samples must start at {start}; "
            "pass start=None to accept offset positions, or rebuild position_ids with lengths_to_position_ids"
        )
    end = torch.tensor([pos.numel()], dtype=starts.dtype, device=pos.device)
    return torch.cat([starts, end]).to(torch.int32)


def seq_lengths_to_cu_seqlens(
    seq_lengths: Sequence[Sequence[int]] | Sequence[int] | np.ndarray | torch.Tensor,
    row_lengths: Sequence[int] | None = None,
) -> torch.Tensor:
    """cu_seqlens for rows that were packed offline with a ``seq_lengths`` column (TRL's bfd packing).

    Args:
        seq_lengths: per row, the lengths of the samples it holds (a list of lists), or one row's lengths.
        row_lengths: optional token count of every row; each row's ``seq_lengths`` must sum to it.

    Returns:
        ``(n + 1,)`` int32 cu_seqlens over the rows concatenated in order.

    >>> seq_lengths_to_cu_seqlens([[3, 2], [4]], row_lengths=[5, 4]).tolist()
    [0, 3, 5, 9]
    """
    if isinstance(seq_lengths, torch.Tensor | np.ndarray) or (
        len(seq_lengths) > 0 and not isinstance(seq_lengths[0], Sequence | np.ndarray | torch.Tensor)
    ):
        rows = [seq_lengths]
    else:
        rows = list(seq_lengths)
    per_row = [_as_int64_1d(row, f"seq_lengths[{i}]") for i, row in enumerate(rows)]
    if row_lengths is not None:
        if len(row_lengths) != len(per_row):
            raise ValueError(f"got {len(per_row)} seq_lengths rows but {len(row_lengths)} row lengths")
        for i, (lens, expected) in enumerate(zip(per_row, row_lengths, strict=True)):
            if int(lens.sum()) != int(expected):
                raise ValueError(
                    f"seq_lengths[{i}] sums to {int(lens.sum())} but the row holds {int(expected)} tokens; "
                    "the seq_lengths column must describe every token of its row"
                )
    flat = torch.cat(per_row) if per_row else torch.zeros(0, dtype=torch.int64)
    for i, lens in enumerate(per_row):
        _check_lengths(lens, f"seq_lengths[{i}]")
    return lengths_to_cu_seqlens(flat)
