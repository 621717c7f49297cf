"""The training batches of the packing trainers: multipack batches of a map-style dataset, or a stream packed
online by a rank-aware :class:`~packing_hf.streaming.PackedStream` (see :mod:`packing_hf.integrations.trainer`).

>>> from packing_hf import PaddingFreeCollator
>>> is_packing_collator(PaddingFreeCollator()), is_stream([{"input_ids": [1, 2]}])
(True, False)
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from functools import partial
from typing import Any

import numpy as np
import torch
import transformers
from torch.utils.data import DataLoader
from transformers.trainer_utils import seed_worker

from ..collator import PaddingFreeCollator
from ..multimodal import MultimodalCollator
from ..streaming import PackedStream, TokenizedStream
from .args import PackingArguments
from .callbacks import PackingStatsCollator
from .preflight import base_model

__all__ = ["PackingDataMixin", "gather_uneven_rows", "is_packing_collator", "is_stream"]


def is_packing_collator(collator: Any) -> bool:
    """Whether ``collator`` flattens a batch into one packed row (so packed samples share attention calls).

    True for :class:`~packing_hf.PaddingFreeCollator`, :class:`~packing_hf.MultimodalCollator`, ``transformers.DataCollatorWithFlattening`` and TRL's
    ``DataCollatorForLanguageModeling(padding_free=True)``, also when wrapped by stock's
    ``RemoveColumnsCollator`` or by :class:`~packing_hf.integrations.callbacks.PackingStatsCollator`.

    >>> from packing_hf import PaddingFreeCollator
    >>> is_packing_collator(PaddingFreeCollator()), is_packing_collator(None)
    (True, False)
    """
    while hasattr(collator, "data_collator") or isinstance(collator, PackingStatsCollator):
        collator = collator.collator if isinstance(collator, PackingStatsCollator) else collator.data_collator
    if isinstance(
        collator, PaddingFreeCollator | MultimodalCollator | transformers.DataCollatorWithFlattening
    ):
        return True
    # TRL's collator, recognised without importing TRL
    return type(collator).__name__ == "DataCollatorForLanguageModeling" and bool(
        getattr(collator, "padding_free", 0)
    )


def _is_hf_dataset(dataset: Any) -> bool:
    try:
        import datasets
    except ImportError:  # pragma: no cover - datasets is a dependency
        return False
    return isinstance(dataset, datasets.Dataset)


def column_lengths(dataset: Any, columns: Sequence[str], what: str, fix: str) -> list[np.ndarray]:
    """The token count of every row in each of ``columns`` (lists of token ids), for the multipack plans of
    the preference trainers: read from the Arrow offsets of a ``datasets.Dataset`` (no ids are loaded), else
    row by row from any indexable dataset of dicts.

    Returns:
        One ``(N,)`` int64 array per column, in the order of ``columns``.

    Raises:
        ValueError: a ``datasets.Dataset`` without one of the columns, naming them, what is measured
            (``what``: ``"pair"``, ``"example"``) and the fix.

    >>> from datasets import Dataset
    >>> column_lengths(Dataset.from_dict({"a": [[1, 2], [3]]}), ["a"], "pair", "tokenize it")[0].tolist()
    [2, 1]
    >>> column_lengths([{"a": [1, 2, 3]}], ["a"], "pair", "tokenize it")[0].dtype
    dtype('int64')
    >>> column_lengths(Dataset.from_dict({"a": [[1]]}), ["a", "b"], "pair", "tokenize it")
    Traceback (most recent call last):
    ...
    ValueError: max_tokens_per_batch needs pair lengths, but the training dataset lacks ['b'] (columns: ['a']); tokenize it
    """
    from ..sampler import lengths_from_dataset

    if _is_hf_dataset(dataset):
        missing = [c for c in columns if c not in dataset.column_names]
        if missing:
            raise ValueError(
                f"max_tokens_per_batch needs {what} lengths, but the training dataset lacks {missing} "
                f"(columns: {dataset.column_names}); {fix}"
            )
        return [lengths_from_dataset(dataset, c) for c in columns]
    return [np.array([len(dataset[i][c]) for i in range(len(dataset))], dtype=np.int64) for c in columns]


def _is_hf_iterable(dataset: Any) -> bool:
    try:
        import datasets
    except ImportError:  # pragma: no cover - datasets is a dependency
        return False
    return isinstance(dataset, datasets.IterableDataset)


def is_stream(dataset: Any) -> bool:
    """Whether ``dataset`` is read as a stream (no length, no random access): a ``torch.utils.data.IterableDataset``
    (:class:`~packing_hf.streaming.PackedStream` included), a ``datasets.IterableDataset`` or a
    :class:`~packing_hf.streaming.TokenizedStream`. With ``max_tokens_per_batch`` the trainers pack those
    online with a :class:`~packing_hf.streaming.PackedStream`.

    >>> from packing_hf.streaming import read_stream
    >>> is_stream(read_stream([{"input_ids": [1, 2]}])), is_stream([{"input_ids": [1, 2]}])
    (True, False)
    """
    return isinstance(dataset, torch.utils.data.IterableDataset | TokenizedStream) or _is_hf_iterable(dataset)


class _Reiterable:
    """A ``torch.utils.data.IterableDataset`` as the function :class:`TokenizedStream` reads a fresh pass from."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        # named in the stream's fingerprint, which a resumed run must match
        self.__qualname__ = f"iter({type(dataset).__name__})"

    def __call__(self) -> Any:
        return iter(self.dataset)


class _ConsecutivePasses(torch.utils.data.IterableDataset):
    """The passes of a :class:`PackedStream`, one after another, as one endless iterable.

    The Trainer cannot know where a pass of a stream ends: were the loader to end with the pass, the last
    gradient-accumulation step of a pass would hold fewer micro-batches than the others, and the Trainer
    carries their gradient, normalised by their own token count, into the next pass's first step (two
    token means added). Here every optimizer step holds exactly ``gradient_accumulation_steps`` micro-batches
    and its loss is the token mean over them, whichever pass they come from; ``max_steps`` ends training.
    """

    def __init__(self, stream: PackedStream) -> None:
        super().__init__()
        self.stream = stream

    def __iter__(self) -> Any:
        empty_passes = 0
        while True:
            yielded = False
            for batch in self.stream:
                yielded = True
                yield batch
            # one empty pass is legitimate (a stream resumed exactly at the end of a pass); two are no data
            empty_passes = 0 if yielded else empty_passes + 1
            if empty_passes == 2:
                raise ValueError(
                    f"the training stream {self.stream!r} yielded no batch in a whole pass: it holds no samples; "
                    "check the dataset (and its shard on this rank)"
                )


def gather_uneven_rows(accelerator: Any) -> None:
    """Let ``accelerator.gather`` (and ``gather_for_metrics``, which calls it) take tensors whose first dimension
    differs between the processes; a no-op with one process.

    Multipack gives every rank its own batches, so in the same step the ranks hold different numbers of
    samples, pairs or examples, and the per-row tensors that Transformers and TRL gather for their metrics
    (TRL's per-pair rewards and log-probs, the reward model's scores) differ in length: a plain all-gather
    aborts the process on gloo and may hang on NCCL. Each tensor is padded to the longest rank's rows,
    gathered and the padding dropped: every rank's rows in rank order, as a plain gather returns them when
    the lengths agree. Scalars, and the tensors inside tuples, lists and dicts, are handled alike; anything
    else goes to the plain gather. Installed once per accelerator by the packing trainers.

    >>> from accelerate import Accelerator
    >>> accelerator = Accelerator(cpu=True)
    >>> gather_uneven_rows(accelerator)  # one process: accelerate's own gather is kept
    >>> accelerator.gather(torch.tensor([1, 2])).tolist()
    [1, 2]
    """
    if accelerator.num_processes == 1 or getattr(accelerator, "_packing_uneven_gather", False):
        return
    plain = accelerator.gather

    def gather(data: Any) -> Any:
        if isinstance(data, (tuple, list)):
            return type(data)(gather(d) for d in data)
        if isinstance(data, dict):
            return type(data)({k: gather(v) for k, v in data.items()})
        if not isinstance(data, torch.Tensor) or data.dim() == 0:
            return plain(data)
        rows = plain(torch.tensor([data.shape[0]], device=data.device)).tolist()  # (num_processes,)
        if len(set(rows)) == 1:
            return plain(data)
        padded = accelerator.pad_across_processes(data, dim=0)
        blocks = plain(padded).split(padded.shape[0])
        return torch.cat([block[:n] for block, n in zip(blocks, rows, strict=True)])

    accelerator.gather = gather
    accelerator._packing_uneven_gather = True


class PackingDataMixin:
    """The training DataLoader of the packing trainers (multipack or stream); part of
    :class:`~packing_hf.integrations.trainer.PackingTrainerMixin`."""

    args: PackingArguments

    # ---- data ------------------------------------------------------------------------------------

    def _data_parallel_world(self) -> tuple[int, int]:
        """``(num_replicas, rank)`` of the data-parallel group (TP/CP/SP are refused in set-up)."""
        return max(1, self.accelerator.num_processes), self.accelerator.process_index

    def _multipack_lengths_of(self, dataset: Any) -> np.ndarray:
        """Token length of every training sample: the ``length_column_name`` column if the dataset has
        one, else read from the Arrow offsets of ``input_ids`` (no token ids are loaded)."""
        from ..sampler import lengths_from_dataset

        if _is_hf_dataset(dataset):
            names = dataset.column_names
            column = self.args.length_column_name if self.args.length_column_name in names else "input_ids"
            if column not in names:
                raise ValueError(
                    f"max_tokens_per_batch needs sample lengths, but the training dataset has neither "
                    f"{self.args.length_column_name!r} nor 'input_ids' (columns: {names}); tokenize it first"
                )
            return lengths_from_dataset(dataset, column)
        lengths = np.empty(len(dataset), dtype=np.int64)
        for i in range(len(dataset)):
            sample = dataset[i]
            if not isinstance(sample, dict) or "input_ids" not in sample:
                raise ValueError(
                    f"max_tokens_per_batch needs sample lengths, but training sample {i} has no 'input_ids' "
                    f"(got {type(sample).__name__}); tokenize the dataset first"
                )
            lengths[i] = len(sample["input_ids"])
        return lengths

    def _build_multipack_sampler(self, lengths: np.ndarray):
        from ..sampler import MultipackBatchSampler

        num_replicas, rank = self._data_parallel_world()
        args = self.args
        return MultipackBatchSampler(
            lengths,
            args.max_tokens_per_batch,
            shuffle=True,
            seed=args.data_seed if args.data_seed is not None else args.seed,
            num_replicas=num_replicas,
            rank=rank,
            drop_last=args.dataloader_drop_last,
            overflow=args.packing_overflow,
            mixing=args.multipack_mixing,
            cost_model=self._multipack_cost_model(),
        )

    def _multipack_cost_model(self):
        """The cost model ``multipack_cost_model`` names (resolved once: a fit times the model)."""
        from ..cost import resolve_cost_model

        spec = self.args.multipack_cost_model
        cached = getattr(self, "_packing_cost", None)
        if cached is None or cached[0] != spec:
            cached = self._packing_cost = (
                spec,
                resolve_cost_model(spec, self.model, self.args.max_tokens_per_batch),
            )
        return cached[1]

    def _wrap_train_collator(self, collator: Any) -> Any:
        return (
            PackingStatsCollator(
                collator, cost_model=self._multipack_cost_model() if self.args.max_tokens_per_batch else None
            )
            if self.args.packing_metrics and is_packing_collator(collator)
            else collator
        )

    def get_train_dataloader(self) -> DataLoader:
        """The training DataLoader: multipack batches when ``max_tokens_per_batch`` is set, else stock's.

        With multipack, ``len(dataloader)`` is the exact number of batches this rank yields per epoch, the
        same on every rank. A streaming training dataset (see :func:`is_stream`) is packed online by a
        :class:`~packing_hf.streaming.PackedStream` instead: no ``len()``, ``max_steps`` ends training.
        """
        self._multipack_sampler = self.packing_stream = None  # the loader built now decides which one is used
        if self.args.max_tokens_per_batch is None:
            # stock's loader; only the collator is wrapped (for the metrics) for the duration of the call
            original = self.data_collator
            self.data_collator = self._wrap_train_collator(original)
            try:
                return super().get_train_dataloader()
            finally:
                self.data_collator = original
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        dataset = self.train_dataset
        if is_stream(dataset):
            return self._stream_train_dataloader(dataset)
        if not hasattr(dataset, "__len__"):
            raise ValueError(
                f"max_tokens_per_batch needs a map-style dataset with known sample lengths or a stream (an "
                f"IterableDataset), got {type(dataset).__name__}; materialise it (e.g. datasets.Dataset.from_list) "
                "or unset max_tokens_per_batch"
            )
        lengths = self._multipack_lengths_of(dataset)  # before unused columns (e.g. "length") are removed
        sampler = self._build_multipack_sampler(lengths)
        dataloader = self._multipack_dataloader(dataset, sampler, "training", self.data_collator)
        self._multipack_sampler = sampler
        self._restore_sampler_epoch(sampler)
        return dataloader

    def _multipack_dataloader(
        self, dataset: Any, sampler: Any, description: str, collator: Any
    ) -> DataLoader:
        """A DataLoader over ``sampler``'s batches, prepared by accelerate without sharding them a second time."""
        args = self.args
        if _is_hf_dataset(dataset):
            dataset = self._remove_unused_columns(dataset, description=description)
        else:
            collator = self._get_collator_with_removed_columns(collator, description=description)
        # overflow="split"/"truncate": the sampler yields indices of pieces that only its view can serve
        dataset = sampler.wrap_dataset(dataset)
        loader_kwargs: dict[str, Any] = {
            "batch_sampler": sampler,
            "collate_fn": self._wrap_train_collator(collator) if description == "training" else collator,
            "num_workers": args.dataloader_num_workers,
            "pin_memory": args.dataloader_pin_memory,
            "persistent_workers": args.dataloader_persistent_workers,
            "multiprocessing_context": args.dataloader_multiprocessing_context,
            "prefetch_factor": args.dataloader_prefetch_factor,
            "worker_init_fn": partial(
                seed_worker, num_workers=args.dataloader_num_workers, rank=args.process_index
            ),
        }
        if "in_order" in inspect.signature(DataLoader).parameters:
            loader_kwargs["in_order"] = args.dataloader_in_order
        dataloader = self.accelerator.prepare(DataLoader(dataset, **loader_kwargs))

        # The sampler already gives each rank its share; accelerate's BatchSamplerShard would hand out
        # every num_processes-th of those batches again (dropping samples, and leaving ranks uneven).
        # Turn it into a pass-through, the way stock treats its own rank-aware BatchRebalanceSampler.
        shard = getattr(dataloader, "batch_sampler", None)
        if shard is not None and shard is not sampler and getattr(shard, "batch_sampler", None) is sampler:
            shard.num_processes = 1
            shard.process_index = 0
        if len(dataloader) != len(sampler):
            raise RuntimeError(
                f"the prepared DataLoader yields {len(dataloader)} batches per epoch but the multipack sampler "
                f"plans {len(sampler)}; accelerate re-sharded it ({type(shard).__name__})"
            )
        return dataloader

    # ---- streams ---------------------------------------------------------------------------------

    def _check_stream_settings(self, dataset: Any) -> None:
        """Refuse the settings a streaming training dataset cannot honour, each with its fix."""
        args = self.args
        name = type(dataset).__name__
        if args.dataloader_num_workers > 0:
            raise ValueError(
                f"dataloader_num_workers={args.dataloader_num_workers} with a streaming train_dataset ({name}): "
                "the stream's position and buffer live in the main process (a checkpoint saves them) and every "
                "worker would read the same shard again; set dataloader_num_workers=0 (tokenization is batched)"
            )
        if args.max_steps <= 0:
            raise ValueError(
                f"max_steps={args.max_steps} with a streaming train_dataset ({name}): a stream has no length, so "
                "the number of optimizer steps (and the learning-rate schedule) must be given; set max_steps > 0"
            )
        collator = self.data_collator
        columns = getattr(collator, "input_columns", None)
        if columns is not None and "input_ids" not in columns:
            raise ValueError(
                f"a streaming train_dataset ({name}) is packed by the length of each sample's 'input_ids', but "
                f"the collator {type(collator).__name__} does not take 'input_ids' (it takes {list(columns)}); "
                "materialise the dataset (e.g. datasets.Dataset.from_generator) to pack it with the multipack sampler"
            )
        if self._data_parallel_world()[0] > 1:
            # A rank whose shard ran out yields one-token batches without a trained label while another rank
            # still has data: exact only if each loss is divided by the token count of all ranks.
            counts_tokens = (
                getattr(self, "model_accepts_loss_kwargs", False) or self.compute_loss_func is not None
            )
            if not args.average_tokens_across_devices:
                raise ValueError(
                    "average_tokens_across_devices=False with a streaming train_dataset on several processes: a "
                    "rank whose shard ran out trains on padding batches (no labels) while the others finish the "
                    "pass, which is exact only when the loss is divided by the token count of all ranks; set "
                    "average_tokens_across_devices=True"
                )
            if not counts_tokens:
                raise ValueError(
                    f"{type(base_model(self.model)).__name__}.forward takes no loss kwargs (num_items_in_batch), so "
                    "the Trainer averages the loss of every micro-batch on its own: a padding batch of a streaming "
                    "train_dataset (no labels) would give a NaN loss on several processes; pass compute_loss_func "
                    "(summed token losses / num_items_in_batch) or use one process"
                )

    def _packed_stream_of(self, dataset: Any, description: str) -> PackedStream:
        """``dataset`` as this rank's :class:`PackedStream` (a ``PackedStream`` given by the user is checked, not rebuilt)."""
        args = self.args
        num_replicas, rank = self._data_parallel_world()
        if isinstance(dataset, PackedStream):
            different = [
                f"{key}={have} but {want_name}={want}"
                for key, have, want_name, want in (
                    (
                        "max_tokens_per_batch",
                        dataset.max_tokens_per_batch,
                        "max_tokens_per_batch",
                        args.max_tokens_per_batch,
                    ),
                    ("num_replicas", dataset.num_replicas, "the number of processes", num_replicas),
                    ("rank", dataset.rank, "this process's rank", rank),
                )
                if have != want
            ]
            if different:
                raise ValueError(
                    f"the {description} PackedStream was built with {'; '.join(different)}; build it after "
                    "TrainingArguments (whose set-up starts torch.distributed) with the Trainer's "
                    "max_tokens_per_batch, or pass a TokenizedStream / IterableDataset and let the Trainer pack it"
                )
            return dataset
        if _is_hf_iterable(dataset):
            columns = dataset.column_names  # None when the features are not known before reading
            if columns is not None and "input_ids" not in columns:
                raise ValueError(
                    f"the {description} datasets.IterableDataset has no 'input_ids' column (columns: {columns}), so "
                    "its samples cannot be packed by token count; tokenize it first (dataset.map(tokenize, "
                    "batched=True)) or read it with packing_hf.streaming.read_stream(dataset, tokenizer, "
                    "text_column=...)"
                )
            source = dataset
        elif isinstance(dataset, TokenizedStream):
            source = dataset
        else:  # any other torch IterableDataset: each pass is a fresh iteration, sharded by the stream
            source = _Reiterable(dataset)
        collator = self.data_collator
        return PackedStream(
            source,
            args.max_tokens_per_batch,
            seed=args.data_seed if args.data_seed is not None else args.seed,
            overflow=args.packing_overflow,
            pad_token_id=int(getattr(collator, "pad_token_id", 0) or 0),
            # explicit: the stream would read the world size at construction, the Trainer's is authoritative
            num_replicas=num_replicas,
            rank=rank,
        )

    def _stream_dataloader(self, dataset: Any, description: str, collator: Any) -> DataLoader:
        """A DataLoader over the batches of ``dataset`` (already lists of samples), left out of
        ``accelerator.prepare``: with several processes prepare would read on rank 0 and broadcast, or shard
        the batches again, while the stream already gives each rank its own. The Trainer moves the inputs
        to the device itself (``_prepare_inputs``)."""
        args = self.args
        collator = self._get_collator_with_removed_columns(collator, description=description)
        if description == "training":
            collator = self._wrap_train_collator(collator)
        return DataLoader(
            dataset,
            batch_size=None,
            collate_fn=collator,
            num_workers=0,
            pin_memory=args.dataloader_pin_memory,
            # its own generator: creating the iterator draws a seed, which must not come from the global RNG that
            # a resumed run restores (dropout would shift by one draw)
            generator=torch.Generator().manual_seed(
                args.data_seed if args.data_seed is not None else args.seed
            ),
        )

    def _stream_train_dataloader(self, dataset: Any) -> DataLoader:
        self._check_stream_settings(dataset)
        stream = self._packed_stream_of(dataset, "training")
        self._restore_stream(stream)
        self.packing_stream = stream
        self._stream_batches_consumed = int(stream.stats()["batches_yielded"])
        return self._stream_dataloader(_ConsecutivePasses(stream), "training", self.data_collator)

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> tuple[list, Any]:
        """Stock's, counting the micro-batches the training loop takes from a stream (the checkpoint's position)."""
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self.packing_stream is not None:
            self._stream_batches_consumed += len(batch_samples)
        return batch_samples, num_items_in_batch

    def get_total_train_batch_size(self, args: transformers.TrainingArguments) -> int:
        # With multipack, per_device_train_batch_size means nothing: report the mean samples per optimizer
        # step (used for the "Total train batch size" line and the samples/s metrics).
        sampler = self._multipack_sampler
        if self.args.max_tokens_per_batch is None or sampler is None:
            return super().get_total_train_batch_size(args)
        steps_per_epoch = max(1, math.ceil(len(sampler) / args.gradient_accumulation_steps))
        return max(1, round(len(sampler.lengths) / steps_per_epoch))
