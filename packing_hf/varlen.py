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

from ._limits import INT32_MAX

__all__ = [
    "IGNORE_INDEX",
    "INT32_MAX",
    "check_cu_seqlens",
    "check_int32_tokens",
    "cu_seqlens_to_lengths",
    "cu_seqlens_to_position_ids",
    "cu_seqlens_to_seq_idx",
    "cu_seqlens_to_starts",
    "lengths_to_cu_seqlens",
    "lengths_to_position_ids",
    "lengths_to_seq_idx",
    "max_length_from_cu_seqlens",
    "PADDING_KEY",
    "SHARD_KEY",
    "check_row_padding",
    "mrope_position_restarts",
    "position_restarts",
    "position_ids_to_cu_seqlens",
    "seq_lengths_to_cu_seqlens",
]

# the label every Hugging Face loss ignores: what masks a sample's first token, padding and prompts
IGNORE_INDEX = -100

# Batch key of a packed row whose last ``n`` tokens are padding (``PaddingFreeCollator(pad_to_multiple_of=...)`` /
# ``length_buckets=...``): a 0-d int64 tensor ``n`` (a tensor, so that a compiled graph does not specialize on
# it). The padding is its own segment, so attention and loss never see it; a router's load-balancing loss
# would (it counts every token of the row): a prepared model consumes the key and leaves the padding out of it.
PADDING_KEY = "packing_hf_padding"

# Batch key of one rank's shard of a packed row under sequence parallelism: its
# :class:`~packing_hf.attention.ulysses.SequenceShard` (the group, where the shard sits in the row, the whole row's
# boundaries, labels and loss weights). A plain name: transformers hands it to every attention layer.
SHARD_KEY = "packing_hf_sequence_shard"


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


def check_int32_tokens(tokens: int, what: str = "a packed row") -> None:
    """Refuse a token count that int32 ``cu_seqlens`` (what every varlen kernel takes) cannot address.

    The one int32 rule of the package: the collator, the batch guards, the attention and the kernels all
    call it, so the limit and the advice read the same everywhere.

    >>> check_int32_tokens(2**31)
    Traceback (most recent call last):
    ...
    ValueError: a packed row of 2147483648 tokens overflows int32 cu_seqlens (max 2147483647); lower max_tokens_per_batch or split the row
    """
    if tokens > INT32_MAX:
        raise ValueError(
            f"{what} of {tokens} tokens overflows int32 cu_seqlens (max {INT32_MAX}); "
            "lower max_tokens_per_batch or split the row"
        )


def check_cu_seqlens(
    cu_seqlens: LengthsLike,
    name: str = "cu_seqlens",
    *,
    total: int | None = None,
    allow_empty: bool = False,
    exact_total: bool = True,
) -> list[int]:
    """The one checker of cumulative sequence lengths; returns their host values.

    The rule: 1-D integers, at least ``[0]``, starting at 0, increasing, within int32, and, when ``total``
    is given, ending at ``total`` tokens (``exact_total``) or at most there. Two options say where callers
    legitimately differ: ``allow_empty`` admits zero-length segments (``flash_attn_varlen_func``'s contract,
    which :func:`packing_hf.varlen_attention` keeps), and ``exact_total=False`` lets trailing tokens sit
    outside every segment (the same contract). Packed rows from a collator use the strict default.

    Args:
        cu_seqlens: ``(n + 1,)`` ints (tensor, array or list).
        name: how the error messages call it (``"cu_seq_lens_q"``, ...).
        total: tokens of the row they describe (``None``: not checked).
        allow_empty: accept ``cu[i + 1] == cu[i]``.
        exact_total: with ``total``, require ``cu[-1] == total`` (else ``cu[-1] <= total``).

    Returns:
        The values as a list of Python ints (one host copy).

    >>> check_cu_seqlens([0, 3, 5], total=5)
    [0, 3, 5]
    >>> check_cu_seqlens([0, 3, 3, 5], allow_empty=False)
    Traceback (most recent call last):
    ...
    ValueError: cu_seqlens must start at 0 and strictly increase, got [0, 3, 3, 5] (an empty segment ends at cu_seqlens[2] = 3); build it with packing_hf.varlen.lengths_to_cu_seqlens
    """
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype in (
            torch.bool,
            torch.complex64,
            torch.complex128,
        ):
            raise TypeError(f"{name} must hold integers (int32), got dtype {cu_seqlens.dtype}")
        if cu_seqlens.dim() != 1:
            raise ValueError(
                f"{name} must be a 1-D tensor [0, l0, l0 + l1, ...], got shape {tuple(cu_seqlens.shape)}; "
                "build it with packing_hf.varlen.lengths_to_cu_seqlens"
            )
        values = cu_seqlens.tolist()
    else:
        values = _as_int64_1d(cu_seqlens, name).tolist()
    shown = f"{values[:8]}{'...' if len(values) > 8 else ''}"
    if not values or values[0] != 0:
        raise ValueError(
            f"{name} must start at 0 and have n + 1 entries, got {shown}; "
            "build it with packing_hf.varlen.lengths_to_cu_seqlens"
        )
    for i in range(1, len(values)):
        if values[i] < values[i - 1] or (values[i] == values[i - 1] and not allow_empty):
            what = "never decrease" if allow_empty else "strictly increase"
            kind = "an empty segment" if values[i] == values[i - 1] else "a negative length"
            raise ValueError(
                f"{name} must start at 0 and {what}, got {shown} ({kind} ends at {name}[{i}] = {values[i]}); "
                "build it with packing_hf.varlen.lengths_to_cu_seqlens"
            )
    check_int32_tokens(values[-1])
    if total is not None and (values[-1] > total or (exact_total and values[-1] != total)):
        raise ValueError(
            f"{name} ends at {values[-1]} but the row holds {total} tokens; "
            + (
                "every token must belong to a sample (give padding its own segment)"
                if exact_total
                else "segments cannot reach past the row"
            )
        )
    return values


def position_restarts(position_ids: torch.Tensor) -> torch.Tensor:
    """``(..., T)`` bool: True where a token starts a sample (it does not continue the previous position by +1).

    The first token of every row starts a sample. The one "positions restart" rule: the collator's
    boundaries, the batch guards and the attention's boundary detection all agree with it.

    >>> position_restarts(torch.tensor([[0, 1, 0, 5, 6]])).tolist()
    [[True, False, True, True, False]]
    """
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[..., 1:] = position_ids[..., 1:] != position_ids[..., :-1] + 1
    return starts


def mrope_position_restarts(temporal: torch.Tensor) -> torch.Tensor:
    """``(..., T)`` bool: where a sample starts in the temporal row of 3-row multimodal-RoPE positions.

    Within one sample the temporal position never falls (an image's tokens share one, text continues after
    the largest position so far), so a sample starts at the first token of every row and wherever the
    position falls. A restart right after a token at position 0 does not show: 3-row positions do not carry
    the boundaries (transformers reads none from them), which is why a packed row needs ``cu_seq_lens_q``
    or the 4-row layout whose first row is the text position.

    >>> mrope_position_restarts(torch.tensor([[0, 1, 2, 2, 2, 3, 0, 1]])).tolist()
    [[True, False, False, False, False, False, True, False]]
    """
    starts = torch.ones_like(temporal, dtype=torch.bool)
    starts[..., 1:] = temporal[..., 1:] < temporal[..., :-1]
    return starts


def check_row_padding(padding: int, cu_seqlens: Sequence[int], total: int) -> int:
    """``padding`` (the value of :data:`PADDING_KEY`) checked against the row it describes.

    Args:
        padding: how many tokens close the row as padding.
        cu_seqlens: host offsets of the row's segments (empty segments closing it allowed).
        total: the row's length ``T``.

    Returns:
        ``padding`` as an int.

    Raises:
        ValueError: ``padding`` is negative, or is not the row's last non-empty segment.

    >>> check_row_padding(3, [0, 4, 7, 7], 7)
    3
    """
    padding = int(padding)
    if padding == 0:
        return 0
    filled = [c for i, c in enumerate(cu_seqlens) if i == 0 or c != cu_seqlens[i - 1]]
    if padding < 0 or len(filled) < 3 or filled[-1] != total or filled[-2] != total - padding:
        raise ValueError(
            f"{PADDING_KEY} = {padding} says the last {padding} tokens of the row are padding, but they are not "
            f"the last segment of cu_seq_lens ({list(cu_seqlens[-3:])} for {total} tokens, at least one sample "
            "before it): padding is a segment of its own closing the row. Leave the key as "
            "packing_hf.PaddingFreeCollator sets it, or drop it with the padding"
        )
    return padding


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
    if dtype == torch.int32:
        check_int32_tokens(int(cu[-1]))
    return cu.to(dtype)


def cu_seqlens_to_lengths(cu_seqlens: LengthsLike) -> torch.Tensor:
    """Per-sample lengths ``(n,)`` int64 from cu_seqlens ``(n + 1,)``.

    >>> cu_seqlens_to_lengths([0, 4, 5, 7]).tolist()
    [4, 1, 2]
    """
    cu = _as_int64_1d(cu_seqlens, "cu_seqlens")
    check_cu_seqlens(cu)
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


def cu_seqlens_to_starts(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """``(1, total)`` bool, true on the first token of every segment, from ``cu_seqlens`` ``(n + 1,)``.

    Empty segments closing the row (``PaddingFreeCollator(segment_buckets=...)``) start at ``total``, past
    the row: they mark nothing. No host read (``torch.compile`` traces it without a graph break).

    >>> cu_seqlens_to_starts(torch.tensor([0, 2, 5, 5]), 5).int().tolist()
    [[1, 0, 1, 0, 0]]
    """
    starts = torch.zeros(1, total + 1, dtype=torch.bool, device=cu_seqlens.device)
    starts[0, cu_seqlens[:-1].long().clamp(max=total)] = True
    return starts[:, :total]


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
    starts = torch.nonzero(position_restarts(pos)).flatten()
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
