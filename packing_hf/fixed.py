"""Fixed-length packing: many variable-length sequences into rows of exactly ``max_length`` tokens.

This is the fast_axolotl-style API (``pack_sequences`` / ``concatenate_and_pack``) for pipelines that
want a rectangular ``[rows, max_length]`` tensor, e.g. to pre-pack a dataset offline. The default
strategy is greedy and keeps the input order: a sequence goes into the current row if it fits, else it
opens a new row. ``strategy="ffd"`` (first-fit decreasing) fills rows better at the cost of order.

Rows are only safe to train on if the model also gets the boundaries: ask for
``return_position_ids=True`` (positions restart for every sequence, so ``position_ids_to_cu_seqlens``
recovers them) or ``return_boundaries=True``. The padding at the end of a row is its own segment.

An MoE model routes that padding segment too, and its router load-balancing loss counts it like real tokens
(stock leaves padding out through the ``attention_mask``, which a packed row cannot carry next to its
positions). These functions return several rows and hold no model, so they cannot mark it: for a model
returning a router loss, collate with ``PaddingFreeCollator(pad_to_multiple_of=...)`` or feed one row at a time
with its padding count as :data:`packing_hf.varlen.PADDING_KEY` (``packing_hf.streaming.fixed_length_rows``
does) to a prepared model, or set ``output_router_logits=False``.

>>> pack_sequences([[1, 2, 3], [4, 5], [6, 7, 8, 9], [10, 11, 12]], max_length=8, pad_token_id=0).tolist()
[[1, 2, 3, 4, 5, 0, 0, 0], [6, 7, 8, 9, 10, 11, 12, 0]]
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch

from ._binpack import pack_next_fit, sort_decreasing
from ._limits import check_int
from ._rows import flatten_field, locate, offsets_in_segments, split_lengths
from .overflow import check_overflow

__all__ = ["concatenate_and_pack", "pack_sequences"]

logger = logging.getLogger(__name__)

Strategy = Literal["greedy", "ffd"]
Overflow = Literal["error", "truncate", "split"]


def _check_args(max_length: Any, strategy: str, overflow: str, **ints: Any) -> None:
    """Validate the shared arguments; ``ints`` are further int arguments by name (all must be ints)."""
    check_int(max_length, "max_length", minimum=1, int32=True)
    for name, value in ints.items():
        check_int(
            value, name, minimum=0 if name in ("pad_token_id", "position_ids_start") else None, int32=True
        )
    if strategy not in ("greedy", "ffd"):
        raise ValueError(
            f"strategy must be 'greedy' (in order) or 'ffd' (first-fit decreasing), got {strategy!r}"
        )
    check_overflow(overflow, "overflow", ("error", "truncate", "split"))


def _check_ids(ids: np.ndarray, lengths: np.ndarray, name: str) -> None:
    if ids.size and ids.min() < 0:
        bad, _ = locate(int(np.argmax(ids < 0)), lengths)
        raise ValueError(f"{name}[{bad}] holds a negative token id; token ids must be >= 0")


def _fit_lengths(
    flats: list[np.ndarray], lengths: np.ndarray, max_length: int, overflow: str, name: str
) -> tuple[list[np.ndarray], np.ndarray]:
    """Apply the overflow policy to sequences longer than ``max_length``; log what was changed."""
    if lengths.size and (lengths == 0).any():
        bad = int(np.argmax(lengths == 0))
        raise ValueError(f"{name}[{bad}] is empty; drop empty sequences before packing")
    too_long = lengths > max_length
    if not too_long.any():
        return flats, lengths
    bad = int(np.argmax(too_long))
    if overflow == "error":
        raise ValueError(
            f"{name}[{bad}] has {int(lengths[bad])} tokens > max_length={max_length}; pass overflow='truncate' "
            "or overflow='split', raise max_length, or filter long sequences out"
        )
    n_long = int(too_long.sum())
    if overflow == "truncate":
        keep = offsets_in_segments(lengths) < max_length
        dropped = int((~keep).sum())
        logger.warning(
            "pack_sequences truncated %d sequence(s) to max_length=%d, dropping %d tokens",
            n_long,
            max_length,
            dropped,
        )
        return [f[keep] for f in flats], np.minimum(lengths, max_length)
    new_lengths, chunks = split_lengths(lengths, max_length)
    logger.warning(
        "pack_sequences split %d sequence(s) longer than max_length=%d into %d chunks",
        n_long,
        max_length,
        int(chunks[too_long].sum()),
    )
    return flats, new_lengths


def _place(lengths: np.ndarray, max_length: int, strategy: str) -> tuple[np.ndarray, np.ndarray, int]:
    """Row ``(n,)`` and offset in the row ``(n,)`` of every sequence, and the number of rows.

    Within a row, sequences keep their input order under both strategies. ``"greedy"`` is next-fit
    (:func:`~packing_hf._binpack.pack_next_fit`); the first-fit loop runs over sequences, not tokens.
    """
    n = lengths.size
    if strategy == "greedy":
        packing = pack_next_fit(lengths, max_length)
        # next-fit bins are contiguous runs of the input, so bin b's items are the next diff(offsets)[b]
        rows = np.repeat(np.arange(packing.num_bins, dtype=np.int64), np.diff(packing.offsets))
        n_rows = packing.num_bins
    else:
        rows = np.zeros(n, dtype=np.int64)
        remaining = np.empty(n, dtype=np.int64)  # at most one row per sequence
        n_rows = 0
        for i in sort_decreasing(lengths).tolist():
            fits = np.flatnonzero(remaining[:n_rows] >= lengths[i])
            if fits.size:
                row = int(fits[0])
            else:
                row, n_rows = n_rows, n_rows + 1
                remaining[row] = max_length
            rows[i] = row
            remaining[row] -= lengths[i]
    # offsets: stable sort by row keeps input order inside each row
    order = np.argsort(rows, kind="stable")
    sorted_lengths = lengths[order]
    row_starts = np.cumsum(sorted_lengths) - sorted_lengths
    first_of_row = np.searchsorted(rows[order], rows[order], side="left")
    offsets = np.empty(n, dtype=np.int64)
    offsets[order] = row_starts - row_starts[first_of_row]
    return rows, offsets, n_rows


def _scatter(
    flat: np.ndarray,
    lengths: np.ndarray,
    rows: np.ndarray,
    offsets: np.ndarray,
    n_rows: int,
    max_length: int,
    fill: int,
) -> torch.Tensor:
    """Write the tokens ``(T,)`` of every sequence at ``(row, offset)`` of a ``[n_rows, max_length]`` grid."""
    grid = np.full(n_rows * max_length, fill, dtype=np.int64)
    inner = offsets_in_segments(lengths)
    grid[np.repeat(rows * max_length + offsets, lengths) + inner] = flat
    return torch.from_numpy(grid.reshape(n_rows, max_length))


def _position_grid(
    lengths: np.ndarray, rows: np.ndarray, offsets: np.ndarray, n_rows: int, max_length: int, start: int
) -> torch.Tensor:
    """Positions ``[n_rows, max_length]`` restarting at ``start`` for every sequence and for each row's padding."""
    used = np.bincount(rows, weights=lengths, minlength=n_rows).astype(np.int64)  # (n_rows,)
    cols = np.arange(max_length, dtype=np.int64)
    grid = np.where(cols[None, :] >= used[:, None], cols[None, :] - used[:, None], 0) + start
    flat = grid.reshape(-1)
    inner = offsets_in_segments(lengths)
    flat[np.repeat(rows * max_length + offsets, lengths) + inner] = inner + start
    return torch.from_numpy(grid)


def _boundaries(
    lengths: np.ndarray, rows: np.ndarray, offsets: np.ndarray, n_rows: int
) -> list[list[tuple[int, int]]]:
    result: list[list[tuple[int, int]]] = [[] for _ in range(n_rows)]
    for row, offset, length in sorted(zip(rows.tolist(), offsets.tolist(), lengths.tolist(), strict=True)):
        result[row].append((offset, offset + length))
    return result


def pack_sequences(
    sequences: Sequence[Sequence[int] | np.ndarray | torch.Tensor],
    max_length: int,
    pad_token_id: int,
    return_boundaries: bool = False,
    *,
    strategy: Strategy = "greedy",
    overflow: Overflow = "error",
    return_position_ids: bool = False,
    position_ids_start: int = 0,
) -> torch.Tensor | tuple[Any, ...]:
    """Pack token sequences into rows of exactly ``max_length`` tokens, padding the end of each row.

    Args:
        sequences: ``n`` sequences of token ids (lists, numpy arrays or 1-D tensors), each ``(L_i,)``.
        max_length: row length in tokens.
        pad_token_id: id written after the last sequence of every row.
        return_boundaries: also return, per row, the ``(start, end)`` (end exclusive) of every sequence.
        strategy: ``"greedy"`` (default): in input order, a new row whenever the next sequence does not
            fit in the current one. ``"ffd"``: first-fit decreasing, fewer rows; inside a row sequences
            keep their input order.
        overflow: a sequence longer than ``max_length``: ``"error"`` (default), ``"truncate"`` (keep the
            first ``max_length`` tokens) or ``"split"`` (cut into ``max_length`` chunks that are packed
            as separate sequences). Truncation and splits are logged with their counts.
        return_position_ids: also return position ids restarting at ``position_ids_start`` for every
            sequence and for the padding of every row.
        position_ids_start: first position of every sequence.

    Returns:
        ``packed``: ``[rows, max_length]`` int64 tensor; ``[0, max_length]`` for no sequences. With
        ``return_boundaries`` and/or ``return_position_ids``, a tuple ``(packed, boundaries,
        position_ids)`` holding only the requested extras, in that order: ``boundaries`` is a list (one
        per row) of lists of ``(start, end)``; ``position_ids`` is ``[rows, max_length]`` int64.

    Raises:
        ValueError: an empty sequence, a negative id, or a sequence longer than ``max_length`` with
            ``overflow="error"``. TypeError: non-integer ids.

    >>> packed, bounds, pos = pack_sequences(
    ...     [[1, 2, 3], [4, 5], [6, 7, 8, 9]], max_length=6, pad_token_id=0,
    ...     return_boundaries=True, return_position_ids=True)
    >>> packed.tolist(), bounds
    ([[1, 2, 3, 4, 5, 0], [6, 7, 8, 9, 0, 0]], [[(0, 3), (3, 5)], [(0, 4)]])
    >>> pos.tolist()
    [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]]
    """
    _check_args(
        max_length, strategy, overflow, pad_token_id=pad_token_id, position_ids_start=position_ids_start
    )
    flat, lengths = flatten_field(list(sequences), "sequences", indexed=True)
    _check_ids(flat, lengths, "sequences")
    (flat,), lengths = _fit_lengths([flat], lengths, max_length, overflow, "sequences")
    rows, offsets, n_rows = _place(lengths, max_length, strategy)
    packed = _scatter(flat, lengths, rows, offsets, n_rows, max_length, pad_token_id)
    if not (return_boundaries or return_position_ids):
        return packed
    result: tuple[Any, ...] = (packed,)
    if return_boundaries:
        result += (_boundaries(lengths, rows, offsets, n_rows),)
    if return_position_ids:
        result += (_position_grid(lengths, rows, offsets, n_rows, max_length, position_ids_start),)
    return result


def concatenate_and_pack(
    input_sequences: Sequence[Sequence[int] | np.ndarray | torch.Tensor],
    label_sequences: Sequence[Sequence[int] | np.ndarray | torch.Tensor],
    attention_masks: Sequence[Sequence[int] | np.ndarray | torch.Tensor],
    max_length: int,
    pad_token_id: int,
    label_pad_id: int = -100,
    *,
    strategy: Strategy = "greedy",
    overflow: Overflow = "error",
    return_position_ids: bool = False,
    position_ids_start: int = 0,
) -> tuple[torch.Tensor, ...]:
    """Pack inputs, labels and attention masks together into ``[rows, max_length]`` tensors.

    The three fields of sequence ``i`` must have the same length; they are placed exactly like
    :func:`pack_sequences` places ``input_sequences`` (same ``strategy`` and ``overflow``).

    Args:
        input_sequences: ``n`` sequences of token ids ``(L_i,)``.
        label_sequences: ``n`` label sequences ``(L_i,)`` (``-100`` = not trained).
        attention_masks: ``n`` mask sequences ``(L_i,)``, copied as given.
        max_length: row length.
        pad_token_id: input id of the padding; padding gets label ``label_pad_id`` and mask 0.
        label_pad_id: label of padding and of every sequence's first token.
        strategy, overflow, position_ids_start: as in :func:`pack_sequences`.
        return_position_ids: also return restarting position ids ``[rows, max_length]``, for a model that
            keeps the sequences of a row apart (varlen attention). Without them the ``attention_masks`` are
            copied as given, so an all-ones mask lets the sequences of a row attend to each other (classic
            concatenation packing); either way the first label of every sequence is ``label_pad_id``, so no
            sequence is trained to predict across a boundary.

    Returns:
        ``(packed_inputs, packed_labels, packed_masks)``, each ``[rows, max_length]`` int64, plus
        ``position_ids`` last if ``return_position_ids``.

    >>> inputs, labels, masks = concatenate_and_pack(
    ...     [[1, 2, 3], [4, 5, 6, 7]], [[-100, 2, 3], [-100, -100, 6, 7]], [[1, 1, 1], [1, 1, 1, 1]],
    ...     max_length=5, pad_token_id=0)
    >>> inputs.tolist(), labels.tolist(), masks.tolist()
    ([[1, 2, 3, 0, 0], [4, 5, 6, 7, 0]], [[-100, 2, 3, -100, -100], [-100, -100, 6, 7, -100]], [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]])
    """
    _check_args(
        max_length, strategy, overflow, pad_token_id=pad_token_id, label_pad_id=label_pad_id,
        position_ids_start=position_ids_start,
    )  # fmt: skip
    if not (len(input_sequences) == len(label_sequences) == len(attention_masks)):
        raise ValueError(
            f"got {len(input_sequences)} input, {len(label_sequences)} label and {len(attention_masks)} "
            "attention-mask sequences; pass one of each per sequence"
        )
    ids, lengths = flatten_field(list(input_sequences), "input_sequences", indexed=True)
    labels, label_lengths = flatten_field(list(label_sequences), "label_sequences", indexed=True)
    masks, mask_lengths = flatten_field(
        list(attention_masks), "attention_masks", allow_bool=True, indexed=True
    )
    for name, other in (("label_sequences", label_lengths), ("attention_masks", mask_lengths)):
        if not np.array_equal(other, lengths):
            bad = int(np.argmax(other != lengths))
            raise ValueError(
                f"{name}[{bad}] has {int(other[bad])} values but input_sequences[{bad}] has {int(lengths[bad])}; "
                "they must align token by token"
            )
    _check_ids(ids, lengths, "input_sequences")
    (ids, labels, masks), lengths = _fit_lengths(
        [ids, labels, masks], lengths, max_length, overflow, "input_sequences"
    )
    # Every sequence's first label is masked: in a row it follows another sequence, and even with its own
    # position ids its logit would come from that sequence's last token.
    labels = labels.copy()
    labels[np.cumsum(lengths) - lengths] = label_pad_id
    rows, offsets, n_rows = _place(lengths, max_length, strategy)
    result = tuple(
        _scatter(values, lengths, rows, offsets, n_rows, max_length, fill)
        for values, fill in ((ids, pad_token_id), (labels, label_pad_id), (masks, 0))
    )
    if return_position_ids:
        result += (_position_grid(lengths, rows, offsets, n_rows, max_length, position_ids_start),)
    return result
