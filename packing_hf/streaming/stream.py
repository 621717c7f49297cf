"""PackedStream: a ``torch.utils.data.IterableDataset`` of token-budget batches from a stream, rank-aware.

It joins a :class:`~packing_hf.streaming.TokenizedStream` (this rank's disjoint shard of the records) and
a :class:`~packing_hf.streaming.StreamPacker` (bounded shuffle buffer + best fit), and yields lists of
samples for :class:`~packing_hf.PaddingFreeCollator`::

    stream = PackedStream(read_stream("train.jsonl", tokenizer, text_column="text"), max_tokens_per_batch=4096)
    loader = DataLoader(stream, batch_size=None, collate_fn=PaddingFreeCollator())

Passes: each complete iteration is one pass over the data (an epoch); the next iteration starts the next
pass, with other random draws. There is deliberately no ``set_epoch``: the HF Trainer numbers epochs
from 0 again when it resumes, which would overwrite the resumed pass.

End of the stream with several ranks: every rank must yield the same number of batches, or the ranks
that finish first would leave the others waiting in a collective forever. Lengths are only known as
records arrive, so no rule fixed in advance can equalise the counts: before each batch the ranks agree,
with one all-reduce of a 0/1 flag, whether any of them still has a batch. While one does, a rank that
has run out yields a *padding batch* ``[{column: [pad_token_id], "labels": [-100]}]``: one token, no
trained label, so it adds nothing to the loss or to ``num_items_in_batch`` (the Trainer's gradient is
exact). No sample is dropped and none is repeated; padding batches are counted in :meth:`stats`. (A
hand-written loop must not average a per-rank mean loss over such a batch: its mean over zero tokens
is NaN; sum the token losses and divide by the global token count, as the Trainer does.)

Resume: :meth:`state_dict` holds the pass, how many records of the shard were read, the packer's
buffer and open batches, and the batches emitted but not yet consumed. A ``DataLoader`` (and
accelerate) fetch batches ahead of the training loop, so pass ``batches_consumed`` = the number of
batches the loop really used (counted over all passes): the batches fetched after it are put back in
the state, to be yielded first after a resume. A resumed stream then yields exactly the batches the
uninterrupted one would have.

Workers: the stream must be iterated in the main process (``num_workers=0``); its state lives there.
Tokenization is already batched (fast tokenizers run a batch on several threads). With
``num_workers > 0`` iterating raises a ``RuntimeError`` instead of silently duplicating the data in
every worker.

>>> from packing_hf import PaddingFreeCollator
>>> data = [{"input_ids": list(range(1, n + 1))} for n in (5, 3, 6, 2, 4, 7)]
>>> stream = PackedStream(data, max_tokens_per_batch=10, buffer_size=4, seed=0)
>>> batches = list(stream)
>>> sorted(len(s["input_ids"]) for b in batches for s in b), all(
...     sum(len(s["input_ids"]) for s in b) <= 10 for b in batches)
([2, 3, 4, 5, 6, 7], True)
>>> PaddingFreeCollator()(batches[0])["input_ids"].shape[1] <= 10
True
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from .._limits import check_int, check_world
from ..fixed import concatenate_and_pack
from ..overflow import OverflowPolicy
from ..varlen import PADDING_KEY
from .packer import STATE_FORMAT, StreamPacker, check_state, to_plain
from .reader import TokenizedStream

__all__ = ["PackedStream", "fixed_length_rows"]


class PackedStream(IterableDataset):
    """Token-budget batches from a stream of samples, one disjoint shard per rank (see the module docstring).

    Args:
        source: a :class:`TokenizedStream` (its own sharding is replaced by this rank's), or anything
            :class:`TokenizedStream` reads without tokenizing: paths of JSON Lines / Parquet files
            holding ``input_ids``, a ``datasets.IterableDataset`` / ``Dataset``, a list of dicts, a
            function returning a fresh iterator of dicts.
        max_tokens_per_batch: token budget of one batch (per rank).
        buffer_size, open_batches, seed, overflow: as in :class:`StreamPacker` (``overflow`` is
            ``"error"``, ``"truncate"``, ``"split"`` or ``"drop"``, counted in :meth:`stats`).
        column: the token-id field.
        num_replicas, rank: data-parallel ranks (default: from ``torch.distributed`` when initialized,
            else 1 / 0). With ``num_replicas > 1`` iterating needs the initialized process group.
        pad_token_id: input id of the one-token padding batches (see the module docstring).
        history: how many batches back :meth:`state_dict` can place the resume point (the prefetch depth
            of the loader must stay below it).
        process_group: the ``torch.distributed`` group of the data-parallel ranks (default: the world).

    Yields:
        ``list[dict]``: the samples of one batch, their ``column`` lengths summing to at most
        ``max_tokens_per_batch``. Collate with ``DataLoader(stream, batch_size=None, collate_fn=...)``.
    """

    def __init__(
        self,
        source: Any,
        max_tokens_per_batch: int,
        *,
        buffer_size: int = 2048,
        open_batches: int = 32,
        seed: int = 0,
        overflow: OverflowPolicy = "error",
        column: str = "input_ids",
        num_replicas: int | None = None,
        rank: int | None = None,
        pad_token_id: int = 0,
        history: int = 64,
        process_group: Any = None,
    ) -> None:
        super().__init__()
        self.packer = StreamPacker(
            max_tokens_per_batch,
            buffer_size=buffer_size,
            open_batches=open_batches,
            seed=seed,
            overflow=overflow,
            column=column,
        )
        self.max_tokens_per_batch = self.packer.max_tokens_per_batch
        self.num_replicas, self.rank = check_world(num_replicas, rank)
        if not isinstance(source, TokenizedStream):
            source = TokenizedStream(source, column=column)
        self.source = source.shard(self.num_replicas, self.rank)
        self.column = column
        self.pad_token_id = check_int(pad_token_id, "pad_token_id", 0)
        history = check_int(history, "history", 0)
        self.process_group = process_group
        self.epoch = 0  # the pass the next iteration runs (or the running one)
        self._records = 0  # records of this rank's shard read in the running pass
        self._yielded = 0  # batches yielded, all passes together
        self._in_pass = False
        self._pending: deque[list[Any] | None] = deque()  # yielded first (None: a padding batch)
        self._recent: deque[tuple[int, list[Any] | None]] = deque(maxlen=history)
        self._resume: dict[str, Any] | None = None
        self._padding_batches = 0

    # ---- iteration --------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[list[Any]]:
        if get_worker_info() is not None:
            raise RuntimeError(
                "PackedStream must run in the main process (DataLoader num_workers=0): its position and buffer "
                "are what a checkpoint saves, and every worker would read the same shard. Tokenization is "
                "already batched; use num_workers=0"
            )
        distributed = self.num_replicas > 1
        if distributed and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            raise RuntimeError(
                f"PackedStream with num_replicas={self.num_replicas} needs torch.distributed initialized (the ranks "
                "agree at every batch whether one still has data); launch with torchrun / accelerate"
            )
        self._begin_pass()
        records = self.source.iterate(self._records, self.epoch)
        while True:
            batch = self._next_local(records)
            if distributed:
                if not self._any_rank_has(batch is not None):
                    break
                if batch is None:
                    self._padding_batches += 1
            elif batch is None:
                break
            self._yielded += 1
            self._recent.append((self.epoch, batch))
            yield batch if batch is not None else self._padding_batch()
        self._in_pass = False
        self.epoch += 1

    def _begin_pass(self) -> None:
        state, self._resume = self._resume, None
        self._pending.clear()
        if self._in_pass:  # the previous iteration was abandoned: its batches are not a resume point
            self._recent.clear()
        if state is not None and state["in_pass"]:
            self.epoch = state["epoch"]
            self.packer.load_state_dict(state["packer"])
            self._records = state["records"]
            self._pending.extend(state["pending"])
        else:
            if state is not None:
                self.epoch = state["epoch"]
            self.packer.start(self.epoch, self.rank)
            self._records = 0
        self._in_pass = True

    def _next_local(self, records: Iterator[dict[str, Any]]) -> list[Any] | None:
        """This rank's next batch, or ``None`` when its shard is exhausted (or a pending padding batch)."""
        if self._pending:
            return self._pending.popleft()
        packer = self.packer
        while True:
            batch = packer.pop()
            if batch is not None or packer.finished:
                return batch
            sample = next(records, None)
            if sample is None:
                packer.finish()
                continue
            self._records += 1
            try:
                packer.push(sample)
            except ValueError as exc:
                raise ValueError(f"{self.source.where()}: {exc}") from None

    def _any_rank_has(self, flag: bool) -> bool:
        group = self.process_group
        device = "cpu"
        if torch.distributed.get_backend(group) == "nccl":  # NCCL reduces device tensors only
            device = torch.device("cuda", torch.cuda.current_device())
        value = torch.tensor([int(flag)], dtype=torch.int32, device=device)
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX, group=group)
        return bool(value.item())

    def _padding_batch(self) -> list[dict[str, list[int]]]:
        return [{self.column: [self.pad_token_id], "labels": [-100]}]

    # ---- resume -----------------------------------------------------------------------------------

    def _config(self) -> dict[str, Any]:
        return {
            **self.packer.config(),
            "num_replicas": self.num_replicas,
            "rank": self.rank,
            "source": self.source.fingerprint(),
        }

    def state_dict(self, batches_consumed: int | None = None) -> dict[str, Any]:
        """Where the stream is, so that :meth:`load_state_dict` continues exactly from there (JSON-serialisable).

        Args:
            batches_consumed: batches the training loop used, counted over all passes (e.g. optimizer
                steps x gradient accumulation). Default: every batch yielded so far. Batches yielded
                after that point (prefetched by the loader) go into the state's pending batches.

        Raises:
            ValueError: ``batches_consumed`` is beyond the batches yielded, or further back than the
                ``history`` this stream remembers.
        """
        if self._resume is not None and batches_consumed in (None, self._resume["batches_yielded"]):
            return self._resume  # loaded and not iterated yet
        yielded = self._yielded
        consumed = yielded if batches_consumed is None else batches_consumed
        lag = yielded - consumed
        if isinstance(consumed, bool) or not isinstance(consumed, int) or not 0 <= lag <= len(self._recent):
            raise ValueError(
                f"batches_consumed={batches_consumed!r}, but this stream yielded {yielded} batches and can go back "
                f"{len(self._recent)} (history); pass a count in [{yielded - len(self._recent)}, {yielded}] "
                "or raise history"
            )
        lagging = list(self._recent)[len(self._recent) - lag :]
        state: dict[str, Any] = {
            "format": STATE_FORMAT,
            **self._config(),
            "batches_yielded": consumed,
            "padding_batches": self._padding_batches - sum(b is None for _, b in lagging),
        }
        if lagging and (lagging[0][0] != self.epoch or not self._in_pass):
            # the loop is still in an earlier pass, which the stream finished: resume at its end, with the
            # batches of it the loop has not used; the later pass restarts from scratch (it is deterministic)
            epoch = lagging[0][0]
            finished = StreamPacker(**{k: v for k, v in self.packer.config().items()})
            finished.start(epoch, self.rank)
            finished.finish()
            pending = [to_plain(b) for e, b in lagging if e == epoch]
            state.update(epoch=epoch, in_pass=True, records=0, packer=finished.state_dict(), pending=pending)
            return state
        if not self._in_pass:
            return {**state, "epoch": self.epoch, "in_pass": False}
        pending = [b for _, b in lagging] + list(self._pending)
        return {
            **state,
            "epoch": self.epoch,
            "in_pass": True,
            "records": self._records,
            "packer": self.packer.state_dict(),
            "pending": [to_plain(b) for b in pending],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` at the next iteration (same data, settings and rank required).

        Raises:
            ValueError: not a stream state, or saved with other settings, ranks or data.
        """
        check_state(
            state,
            "PackedStream",
            self._config(),
            "data, max_tokens_per_batch, buffer_size, open_batches, seed, overflow and ranks",
        )
        self._resume = dict(state)
        self._yielded = int(state["batches_yielded"])
        self._padding_batches = int(state["padding_batches"])
        self.epoch = int(state["epoch"])
        self._recent.clear()
        self._in_pass = False

    # ---- reporting --------------------------------------------------------------------------------

    def stats(self) -> dict[str, int | float]:
        """The packer's counters for the running pass (see :meth:`StreamPacker.stats`) plus ``epoch``,
        ``records_read`` (this rank), ``batches_yielded`` (all passes) and ``padding_batches``."""
        return {
            **self.packer.stats(),
            "epoch": self.epoch,
            "records_read": self._records,
            "batches_yielded": self._yielded,
            "padding_batches": self._padding_batches,
        }

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.source!r}, max_tokens_per_batch={self.max_tokens_per_batch}, "
            f"buffer_size={self.packer.buffer_size}, open_batches={self.packer.open_batches}, seed={self.packer.seed}, "
            f"rank {self.rank}/{self.num_replicas})"
        )


def fixed_length_rows(
    batches: Iterable[list[Mapping[str, Any]]],
    max_length: int,
    pad_token_id: int,
    *,
    label_pad_id: int = -100,
    column: str = "input_ids",
) -> Iterator[dict[str, torch.Tensor]]:
    """Each batch of a :class:`PackedStream` as one row of exactly ``max_length`` tokens (``pack_sequences`` style).

    The samples are laid end to end and the rest of the row is padding (``pad_token_id``, label
    ``label_pad_id``, attention mask 0); ``position_ids`` restart at every sample and every sample's first
    label is ``label_pad_id``. Use ``max_length = max_tokens_per_batch``.

    Yields:
        ``{"input_ids", "labels", "attention_mask", "position_ids"}``, each ``[1, max_length]`` int64, and
        :data:`packing_hf.varlen.PADDING_KEY`: how many tokens close the row as padding (0-d int64). Labels are
        the sample's ``labels`` when present, else its ids. For a model keeping packed samples apart, drop
        ``attention_mask`` (its zeros are the padding segment, which the positions already keep apart) and keep
        the padding count: a model prepared by :func:`packing_hf.prepare_model_for_packing` leaves the padding
        out of an MoE router's load-balancing loss with it, as stock leaves a padded batch's padding out.

    >>> rows = fixed_length_rows([[{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}]], 8, pad_token_id=0)
    >>> row = next(rows)
    >>> row["input_ids"].tolist(), row["position_ids"].tolist()
    ([[5, 6, 7, 8, 9, 0, 0, 0]], [[0, 1, 2, 0, 1, 0, 1, 2]])
    """
    for batch in batches:
        ids = [sample[column] for sample in batch]
        labels = [sample.get("labels", sample[column]) for sample in batch]
        masks = [[1] * len(x) for x in ids]
        total = sum(map(len, ids))
        if total > max_length:
            raise ValueError(
                f"a batch holds {total} tokens > max_length={max_length}; use max_length = the stream's "
                "max_tokens_per_batch"
            )
        inputs, labels_, masks_, positions = concatenate_and_pack(
            ids, labels, masks, max_length, pad_token_id, label_pad_id, return_position_ids=True
        )
        yield {
            "input_ids": inputs,
            "labels": labels_,
            "attention_mask": masks_,
            "position_ids": positions,
            PADDING_KEY: torch.tensor(max_length - total),
        }
