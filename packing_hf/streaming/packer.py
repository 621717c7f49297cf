"""StreamPacker: token-budget batches from a stream of samples, in memory bounded by a buffer.

The map-style :class:`~packing_hf.MultipackBatchSampler` plans a whole epoch from every length up front.
A stream reveals lengths one sample at a time, so the packer works online, in two stages:

1. *Shuffle buffer* (``buffer_size`` samples): every incoming sample joins the buffer; once it is full,
   one sample drawn uniformly at random leaves it. This decorrelates batches from the stream order
   (files are often sorted by source or length) exactly like ``datasets.IterableDataset.shuffle``.
2. *Open batches* (at most ``open_batches``): the sample leaving the buffer goes into the open batch it
   fills most tightly (best fit: the least free space that still holds it). When none can hold it, a
   new batch opens; if ``open_batches`` are already open, the fullest one is emitted first. A batch is
   emitted as soon as its free space is smaller than the shortest sample seen so far (nothing could
   fill it). At the end of the stream the buffer drains the same way and the open batches, the tail,
   are shuffled and placed again by best fit without a limit on open batches, so the tail costs as few
   batches as possible and is no less random than the rest.

Why this shape: samples reach the open batches in a uniformly random order, so a batch is a random
set of samples (its mean length spreads like that of random batches), unlike best-fit *decreasing*,
whose first batches hold all the long samples and last ones all the short. Best fit among a few dozen
open batches still fills them to 99 %+ because short samples plug the gaps the long ones leave.

Memory: at most ``buffer_size`` samples in the buffer plus ``open_batches`` batches of at most
``max_tokens_per_batch`` tokens, whatever the length of the stream.

Determinism and resume: the random draws come in blocks from ``numpy.random.default_rng([seed, epoch,
rank, block])``, so the packer's whole state is the buffer, the open and ready batches, a draw counter
and a few counters: :meth:`state_dict` returns it (JSON-serialisable) and :meth:`load_state_dict` puts
a fresh packer exactly where the saved one was.

>>> packer = StreamPacker(10, buffer_size=2, open_batches=2, seed=0)
>>> for ids in ([1] * 6, [2] * 4, [3] * 5, [4] * 5, [5] * 3):
...     packer.push({"input_ids": ids})
>>> packer.finish()
>>> batches = list(packer.drain())
>>> sorted(sum(len(s["input_ids"]) for s in b) for b in batches), packer.stats()["samples"]
([5, 8, 10], 5)
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from .._limits import check_int
from ..overflow import OverflowPolicy, check_overflow

__all__ = ["StreamPacker", "slice_sample", "to_plain"]

logger = logging.getLogger(__name__)

_DRAWS_PER_BLOCK = 4096  # random numbers generated at once (one numpy call instead of one per sample)
STATE_FORMAT = 1
# configuration that changes which batches come out: a state saved under one cannot be loaded under another
_CONFIG_KEYS = ("max_tokens_per_batch", "buffer_size", "open_batches", "seed", "overflow", "column")


def _new_counts() -> dict[str, int]:
    return {
        "samples_in": 0,  # samples pushed (before the overflow policy)
        "batches": 0,  # batches emitted
        "samples": 0,  # samples (or pieces) emitted in batches
        "tokens": 0,  # real tokens emitted
        "truncated_samples": 0,
        "truncated_tokens": 0,  # tokens cut off by overflow="truncate"
        "split_samples": 0,
        "split_pieces": 0,
        "overflow_dropped_samples": 0,  # left out by overflow="drop"
        "overflow_dropped_tokens": 0,
        "peak_buffered_samples": 0,  # most samples held at once (buffer + open batches)
    }


def check_state(state: Any, owner: str, config: Mapping[str, Any], same: str) -> None:
    """Refuse a saved ``state`` that is not ``owner``'s (``format``) or was saved under another ``config``;
    ``same`` names the settings a resume must keep.

    >>> check_state({"format": STATE_FORMAT, "seed": 1}, "StreamPacker", {"seed": 2}, "seed")
    Traceback (most recent call last):
    ...
    ValueError: the StreamPacker state was saved under other settings (seed: saved 1, now 2); resume with the same seed
    """
    if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
        raise ValueError(
            f"not a {owner} state (format {STATE_FORMAT} expected); pass what state_dict() returned"
        )
    differ = [f"{k}: saved {state.get(k)!r}, now {v!r}" for k, v in config.items() if state.get(k) != v]
    if differ:
        raise ValueError(
            f"the {owner} state was saved under other settings ({'; '.join(differ)}); resume with the same {same}"
        )


def to_plain(value: Any, where: str = "sample") -> Any:
    """``value`` with numpy arrays/scalars and tensors turned into Python lists/numbers (for JSON).

    >>> to_plain({"input_ids": np.array([1, 2]), "n": np.int64(3)})
    {'input_ids': [1, 2], 'n': 3}
    """
    if isinstance(value, dict):
        return {k: to_plain(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_plain(v, where) for v in value]
    if isinstance(value, np.ndarray | np.generic | torch.Tensor):
        return value.tolist()
    if value is None or isinstance(value, str | int | float | bool):
        return value
    raise TypeError(
        f"{where} holds a {type(value).__name__}, which a stream state cannot store; keep samples to "
        "lists, numbers and strings (e.g. drop that column before streaming)"
    )


def slice_sample(sample: Mapping[str, Any], column: str, start: int, stop: int) -> dict[str, Any]:
    """``sample`` with every field aligned with ``column`` (same length) cut to ``[start:stop]``.

    >>> slice_sample({"input_ids": [1, 2, 3], "labels": [1, 2, 3], "id": "a"}, "input_ids", 1, 3)
    {'input_ids': [2, 3], 'labels': [2, 3], 'id': 'a'}
    """
    full = len(sample[column])
    return {
        key: value[start:stop]
        if hasattr(value, "__len__") and not isinstance(value, str | bytes) and len(value) == full
        else value
        for key, value in sample.items()
    }


class StreamPacker:
    """Online packer: push samples one by one, take token-budget batches out (see the module docstring).

    Args:
        max_tokens_per_batch: token budget of one batch.
        buffer_size: samples held in the shuffle buffer (more: batches less tied to the stream order).
        open_batches: batches kept open for best fit (more: fuller batches, more memory).
        seed: seed of the random draws (with ``epoch`` and ``rank`` from :meth:`start`).
        overflow: a sample longer than ``max_tokens_per_batch``: ``"error"`` (default, a ``ValueError``
            naming the sample), ``"truncate"`` (keep the first ``max_tokens_per_batch`` tokens of every
            field aligned with ``column``), ``"split"`` (cut into pieces of at most the budget, each its
            own sample) or ``"drop"`` (leave it out). All are counted
            in :meth:`stats`, with the names :class:`~packing_hf.MultipackBatchSampler` uses.
        column: the token-id field whose length counts against the budget.

    A batch is a ``list`` of the samples (dicts) as pushed, ready for
    ``PaddingFreeCollator()(batch)``; its ``column`` lengths sum to at most ``max_tokens_per_batch``.
    """

    def __init__(
        self,
        max_tokens_per_batch: int,
        *,
        buffer_size: int = 2048,
        open_batches: int = 32,
        seed: int = 0,
        overflow: OverflowPolicy = "error",
        column: str = "input_ids",
    ) -> None:
        self.max_tokens_per_batch = check_int(max_tokens_per_batch, "max_tokens_per_batch", 1)
        self.buffer_size = check_int(buffer_size, "buffer_size", 1)
        self.open_batches = check_int(open_batches, "open_batches", 1)
        self.seed = check_int(seed, "seed", 0)
        self.overflow: OverflowPolicy = check_overflow(overflow, "StreamPacker(overflow=...)")
        if not isinstance(column, str):
            raise TypeError(f"column must be a str (the token-id field), got {type(column).__name__}")
        self.column = column
        self._warned = False
        self.start()

    # ---- a pass -----------------------------------------------------------------------------------

    def start(self, epoch: int = 0, rank: int = 0) -> None:
        """Forget everything held and begin a pass whose random draws are keyed by ``(seed, epoch, rank)``."""
        self.epoch = check_int(epoch, "epoch", 0)
        self.rank = check_int(rank, "rank", 0)
        self._pool: list[tuple[int, Any]] = []  # (length, sample) waiting in the shuffle buffer
        self._free: list[int] = []  # free tokens of every open batch, ascending
        self._open: list[list[Any]] = []  # the open batches, in the order of _free
        self._open_samples = 0
        self._ready: deque[list[Any]] = deque()  # emitted, not yet taken
        self._min_length = self.max_tokens_per_batch  # shortest sample seen in this pass
        self._draws = 0
        self._block_id = -1
        self._block: list[float] = []
        self._finished = False
        self._counts = _new_counts()

    def _uniform(self) -> float:
        """The next uniform number in [0, 1) of this pass (draw ``k`` is a pure function of the seed key)."""
        block_id, pos = divmod(self._draws, _DRAWS_PER_BLOCK)
        if block_id != self._block_id:
            rng = np.random.default_rng([self.seed, self.epoch, self.rank, block_id])
            self._block = rng.random(_DRAWS_PER_BLOCK).tolist()
            self._block_id = block_id
        self._draws += 1
        return self._block[pos]

    def push(self, sample: Mapping[str, Any]) -> None:
        """Add one sample; batches it completes become available from :meth:`pop`.

        Raises:
            ValueError: the sample has no ``column``, an empty one, or (``overflow="error"``) more
                tokens than ``max_tokens_per_batch``. The message counts samples from 0 in push order;
                :class:`~packing_hf.streaming.PackedStream` adds the record's position in the source.
            RuntimeError: :meth:`finish` was called (start a new pass first).
        """
        if self._finished:
            raise RuntimeError("push() after finish(): call start() to begin a new pass")
        index = self._counts["samples_in"]
        try:
            length = len(sample[self.column])
        except (KeyError, TypeError, IndexError):
            raise ValueError(
                f"sample {index} has no {self.column!r} sequence (got {type(sample).__name__}"
                f"{' with keys ' + repr(sorted(sample))[:120] if isinstance(sample, Mapping) else ''}); "
                f"tokenize it first or set column="
            ) from None
        self._counts["samples_in"] = index + 1
        if length == 0:
            raise ValueError(f"sample {index}: {self.column!r} is empty; drop empty samples from the stream")
        budget = self.max_tokens_per_batch
        if length > budget:
            pieces = self._overflow(sample, length, index)
        else:
            pieces = ((length, sample),)
        for item in pieces:
            if item[0] < self._min_length:
                self._min_length = item[0]
            pool = self._pool
            pool.append(item)
            if len(pool) > self.buffer_size:
                j = int(self._uniform() * len(pool))
                pool[j], pool[-1] = pool[-1], pool[j]
                self._place(*pool.pop())
        held = len(self._pool) + self._open_samples
        if held > self._counts["peak_buffered_samples"]:
            self._counts["peak_buffered_samples"] = held

    def _overflow(self, sample: Mapping[str, Any], length: int, index: int) -> list[tuple[int, Any]]:
        budget = self.max_tokens_per_batch
        if self.overflow == "error":
            raise ValueError(
                f"sample {index} has {length} tokens > max_tokens_per_batch={budget}; raise "
                "max_tokens_per_batch, filter it out, or pass overflow='truncate', 'split' or 'drop'"
            )
        if not self._warned:
            self._warned = True
            logger.warning(
                "StreamPacker: sample %d has %d tokens > max_tokens_per_batch=%d, handled with overflow=%r "
                "(this and later ones are counted in stats())",
                index,
                length,
                budget,
                self.overflow,
            )
        counts = self._counts
        if self.overflow == "drop":
            counts["overflow_dropped_samples"] += 1
            counts["overflow_dropped_tokens"] += length
            return []
        if self.overflow == "truncate":
            counts["truncated_samples"] += 1
            counts["truncated_tokens"] += length - budget
            return [(budget, slice_sample(sample, self.column, 0, budget))]
        starts = range(0, length, budget)
        counts["split_samples"] += 1
        counts["split_pieces"] += len(starts)
        return [(min(budget, length - a), slice_sample(sample, self.column, a, a + budget)) for a in starts]

    def _place(self, length: int, sample: Any, limit: int | None = None) -> None:
        """Best fit of one sample among the open batches (at most ``limit``, default ``open_batches``)."""
        free, open_ = self._free, self._open
        i = bisect_left(free, length)
        if i < len(free):
            left = free.pop(i) - length
            batch = open_.pop(i)
            batch.append(sample)
        else:
            if len(free) >= (
                limit or self.open_batches
            ):  # none fits and no room to open one: emit the fullest
                self._emit(open_.pop(0), self.max_tokens_per_batch - free.pop(0))
            left = self.max_tokens_per_batch - length
            batch = [sample]
        self._open_samples += 1
        if left < self._min_length:  # no sample seen so far would fit: done
            self._emit(batch, self.max_tokens_per_batch - left)
        else:
            j = bisect_left(free, left)
            free.insert(j, left)
            open_.insert(j, batch)

    def _emit(self, batch: list[Any], tokens: int) -> None:
        self._open_samples -= len(batch)
        self._ready.append(batch)
        counts = self._counts
        counts["batches"] += 1
        counts["samples"] += len(batch)
        counts["tokens"] += tokens

    def finish(self) -> None:
        """End of the stream: drain the buffer into the open batches, then close the open batches (the tail).

        The buffer drains in random order, as during the stream. The tail's samples are then shuffled and
        placed by best fit with no limit on open batches: as few batches as best-fit decreasing needs on
        such small tails (the tests check), without sorting them by length. Nothing is dropped; afterwards
        :meth:`pop` returns the remaining batches, then ``None``.
        """
        if self._finished:
            return
        pool = self._pool
        while pool:
            j = int(self._uniform() * len(pool))
            pool[j], pool[-1] = pool[-1], pool[j]
            self._place(*pool.pop())
        tail = [sample for batch in self._open for sample in batch]
        self._open, self._free, self._open_samples = [], [], 0
        for i in range(len(tail) - 1, 0, -1):  # Fisher-Yates with this pass's draws
            j = int(self._uniform() * (i + 1))
            tail[i], tail[j] = tail[j], tail[i]
        for sample in tail:
            self._place(len(sample[self.column]), sample, limit=len(tail))
        for batch, free in zip(self._open, self._free, strict=True):
            self._emit(batch, self.max_tokens_per_batch - free)
        self._open, self._free = [], []
        self._finished = True

    def pop(self) -> list[Any] | None:
        """The oldest emitted batch not yet taken, or ``None``."""
        return self._ready.popleft() if self._ready else None

    def drain(self) -> Iterator[list[Any]]:
        """Take every emitted batch (:meth:`pop` until ``None``)."""
        while self._ready:
            yield self._ready.popleft()

    @property
    def finished(self) -> bool:
        """Whether :meth:`finish` ran in this pass."""
        return self._finished

    @property
    def buffered_samples(self) -> int:
        """Samples held now: in the shuffle buffer and in open batches (ready batches not counted)."""
        return len(self._pool) + self._open_samples

    # ---- reporting and resume ---------------------------------------------------------------------

    def stats(self) -> dict[str, int | float]:
        """Counters of this pass (flat dict): ``samples_in``, ``batches``, ``samples``, ``tokens``,
        ``fill`` (tokens / (batches x budget)), ``buffered_samples``, ``peak_buffered_samples``,
        ``truncated_samples`` / ``truncated_tokens``, ``split_samples`` / ``split_pieces``,
        ``overflow_dropped_samples`` / ``overflow_dropped_tokens``."""
        counts = dict(self._counts)
        batches = counts["batches"]
        counts["fill"] = counts["tokens"] / (batches * self.max_tokens_per_batch) if batches else 1.0
        counts["buffered_samples"] = self.buffered_samples
        return counts

    def config(self) -> dict[str, Any]:
        """The settings that decide the batches (checked by :meth:`load_state_dict`)."""
        return {key: getattr(self, key) for key in _CONFIG_KEYS}

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue this pass exactly: settings, draw counter, buffer, open and
        ready batches, counters. Samples are stored as plain lists/numbers (JSON-serialisable)."""
        return {
            "format": STATE_FORMAT,
            **self.config(),
            "epoch": self.epoch,
            "rank": self.rank,
            "draws": self._draws,
            "min_length": self._min_length,
            "finished": self._finished,
            "pool": [to_plain(sample) for _, sample in self._pool],
            "open": [[free, to_plain(batch)] for free, batch in zip(self._free, self._open, strict=True)],
            "ready": [to_plain(batch) for batch in self._ready],
            "counts": dict(self._counts),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Put this packer exactly where the packer that wrote ``state`` was.

        Raises:
            ValueError: ``state`` is not a packer state, or was saved with other settings (budget,
                buffer, seed, ...), which would give other batches.
        """
        check_state(
            state,
            "StreamPacker",
            self.config(),
            "max_tokens_per_batch, buffer_size, open_batches, seed, overflow and column",
        )
        self.start(state["epoch"], state["rank"])
        column = self.column
        self._draws = int(state["draws"])
        self._min_length = int(state["min_length"])
        self._finished = bool(state["finished"])
        self._pool = [(len(sample[column]), sample) for sample in state["pool"]]
        self._free = [int(free) for free, _ in state["open"]]
        self._open = [list(batch) for _, batch in state["open"]]
        self._open_samples = sum(map(len, self._open))
        self._ready = deque(list(batch) for batch in state["ready"])
        self._counts = {**_new_counts(), **state["counts"]}

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(max_tokens_per_batch={self.max_tokens_per_batch}, buffer_size="
            f"{self.buffer_size}, open_batches={self.open_batches}, seed={self.seed}, overflow={self.overflow!r})"
        )
