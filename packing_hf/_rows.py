"""Per-sample fields as flat int64 arrays: the conversions and segment arithmetic shared by the packers.

:class:`~packing_hf.PaddingFreeCollator` (one ``[1, T]`` row per batch) and :func:`~packing_hf.fixed.pack_sequences`
/ :func:`~packing_hf.fixed.concatenate_and_pack` (fixed-length rows) both turn a list of samples into one flat
array plus lengths (:func:`flatten_field`, with errors naming the sample and position), and both cut and
locate tokens inside segments (:func:`split_lengths`, :func:`offsets_in_segments`, :func:`locate`).

>>> flat, lengths = flatten_field([[1, 2, 3], [4]], "input_ids")
>>> flat.tolist(), lengths.tolist(), offsets_in_segments(lengths).tolist()
([1, 2, 3, 4], [3, 1], [0, 1, 2, 0])
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = [
    "describe",
    "flatten_field",
    "locate",
    "offsets_in_segments",
    "sample_to_array",
    "split_lengths",
]


def first_bad_element(values: Sequence[Any]) -> tuple[int, Any] | None:
    """Index and value of the first element of a list that is not an integer (error path only)."""
    for j, value in enumerate(values):
        if not isinstance(value, int | np.integer):
            return j, value
    return None


def describe(name: str, index: int, element: int | None = None, indexed: bool = False) -> str:
    """Where a bad value sits: ``sample 3: 'labels'`` / ``sample 3: labels[7]`` for a batch of features,
    ``sequences[3]`` / ``sequences[3][7]`` for a plain list of sequences (``indexed=True``)."""
    if indexed:
        return f"{name}[{index}]" + ("" if element is None else f"[{element}]")
    return f"sample {index}: " + (repr(name) if element is None else f"{name}[{element}]")


def sample_to_array(value: Any, index: int, name: str, allow_bool: bool, indexed: bool = False) -> np.ndarray:
    """One sample's field (list / tuple / numpy array / tensor of ints) as a 1-D int64 array."""
    where = describe(name, index, indexed=indexed)
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex() or (value.dtype == torch.bool and not allow_bool):
            raise TypeError(
                f"{where} is a tensor of dtype {value.dtype}; it must hold integers (cast with .long())"
            )
        value = value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in ("iu" + ("b" if allow_bool else "")):
            raise TypeError(
                f"{where} is an array of dtype {value.dtype}; it must hold integers (cast with .astype(np.int64))"
            )
        if value.ndim != 1:
            raise ValueError(
                f"{where} has shape {value.shape}, expected a 1-D sequence; drop the batch dimension "
                "(e.g. tokenize without return_tensors, or index [0])"
            )
        return value.astype(np.int64, copy=False)
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise TypeError(
            f"{where} must be a list, numpy array or tensor of ints, got {type(value).__name__}: {value!r:.80}"
        )
    try:
        return np.frombuffer(array("q", value), dtype=np.int64)
    except OverflowError:
        raise ValueError(f"{where} holds a value that does not fit in int64") from None
    except TypeError:
        bad = first_bad_element(value)
        if bad is None:  # only reachable with exotic sequence types
            raise TypeError(f"{where} holds a non-integer value; it must hold only integers") from None
        element = describe(name, index, bad[0], indexed)
        if isinstance(bad[1], list | tuple | np.ndarray | torch.Tensor):
            raise ValueError(
                f"{element} is itself a sequence ({type(bad[1]).__name__}); {name!r} must be a flat 1-D list of ints"
            ) from None
        raise TypeError(
            f"{element} = {bad[1]!r} is a {type(bad[1]).__name__}; {name!r} must hold only integers "
            "(mixed types are not accepted)"
        ) from None


def flatten_field(
    values: list[Any], name: str, allow_bool: bool = False, indexed: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate one field over the batch: ``(flat (T,) int64, lengths (n,) int64)``.

    Lists of Python ints (``datasets`` rows) take a fast path: they are appended to one typed int64
    buffer, which also rejects floats, strings and None. Any failure is re-diagnosed sample
    by sample so that the error names the sample index and position (see :func:`describe`).
    """
    buffer = array("q")
    try:
        for v in values:
            # ~10 ns per token; raises on non-lists and on floats, strings, None or nested lists inside
            buffer.fromlist(v)
    except (TypeError, OverflowError):
        pass  # arrays, tensors or a bad value: the per-sample path below converts or names it
    else:
        return np.frombuffer(buffer, dtype=np.int64), np.fromiter(map(len, values), np.int64, len(values))
    arrays = [sample_to_array(v, i, name, allow_bool, indexed) for i, v in enumerate(values)]
    lengths = np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays))
    return np.concatenate(arrays) if arrays else np.zeros(0, np.int64), lengths


def locate(token_index: int, lengths: np.ndarray) -> tuple[int, int]:
    """``(sample, offset inside it)`` of a flat token index, for samples of ``lengths`` ``(n,)`` back to back."""
    ends = np.cumsum(lengths)
    sample = int(np.searchsorted(ends, token_index, side="right"))
    return sample, token_index - int(ends[sample] - lengths[sample])


def offsets_in_segments(lengths: np.ndarray) -> np.ndarray:
    """``(T,)`` int64: the position of every token inside its segment, for segments ``(n,)`` back to back."""
    starts = np.cumsum(lengths) - lengths
    return np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(starts, lengths)


def split_lengths(lengths: np.ndarray, max_length: int) -> tuple[np.ndarray, np.ndarray]:
    """Cut every segment into ``ceil(L / max_length)`` chunks of ``max_length`` tokens, the last one
    holding the remainder: ``(chunk lengths, chunks per segment (n,))``."""
    chunks = -(-lengths // max_length)
    new_lengths = np.full(int(chunks.sum()), max_length, dtype=np.int64)
    new_lengths[np.cumsum(chunks) - 1] = lengths - (chunks - 1) * max_length
    return new_lengths, chunks
