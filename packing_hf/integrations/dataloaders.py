"""The training batches of the packing trainers: multipack batches of a map-style dataset (here), or a stream
packed online by a rank-aware :class:`~packing_hf.streaming.PackedStream`
(:mod:`packing_hf.integrations.stream_data`).

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
import transformers
from torch.utils.data import DataLoader
from transformers.trainer_utils import seed_worker

from ..collator import PaddingFreeCollator
from ..multimodal import MultimodalCollator
from ..tree_collator import PrefixTreeCollator
from .accelerator import pass_through_batch_shard
from .args import PackingArguments
from .callbacks import PackingStatsCollator
from .stream_data import PackingStreamMixin, is_stream

__all__ = ["PackingDataMixin", "column_lengths", "is_packing_collator", "is_stream"]


def is_packing_collator(collator: Any) -> bool:
    """Whether ``collator`` flattens a batch into one packed row (so packed samples share attention calls).

    True for :class:`~packing_hf.PaddingFreeCollator`, :class:`~packing_hf.MultimodalCollator`,
    :class:`~packing_hf.PrefixTreeCollator`, ``transformers.DataCollatorWithFlattening`` and TRL's
    ``DataCollatorForLanguageModeling(padding_free=True)``, also when wrapped by stock's
    ``RemoveColumnsCollator`` or by :class:`~packing_hf.integrations.callbacks.PackingStatsCollator`.

    >>> from packing_hf import PaddingFreeCollator
    >>> is_packing_collator(PaddingFreeCollator()), is_packing_collator(None)
    (True, False)
    """
    while hasattr(collator, "data_collator") or isinstance(collator, PackingStatsCollator):
        collator = collator.collator if isinstance(collator, PackingStatsCollator) else collator.data_collator
    if isinstance(
        collator,
        PaddingFreeCollator
        | MultimodalCollator
        | PrefixTreeCollator
        | transformers.DataCollatorWithFlattening,
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


class PackingDataMixin(PackingStreamMixin):
    """The training DataLoader of the packing trainers (multipack or stream); part of
    :class:`~packing_hf.integrations.trainer.PackingTrainerMixin`."""

    args: PackingArguments

    # ---- data ------------------------------------------------------------------------------------

    def _data_parallel_world(self) -> tuple[int, int]:
        """``(num_replicas, rank)`` the training and evaluation data are sharded over: the run's data-parallel
        replicas, from its process group (:attr:`~packing_hf.integrations.parallel.ParallelPlan.data_parallel`)."""
        return self.parallel_plan.data_parallel

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

    def _multipack_prefix_groups(self, dataset: Any, lengths: np.ndarray) -> Any:
        """The samples' prefix groups the sampler packs (``share_prefixes``: groups sharing prefixes), or ``None``:
        samples are packed one by one."""
        return None

    def _build_multipack_sampler(self, lengths: np.ndarray, prefix_groups: Any = None):
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
            prefix_groups=prefix_groups,
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
        sampler = self._build_multipack_sampler(lengths, self._multipack_prefix_groups(dataset, lengths))
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
                seed_worker, num_workers=args.dataloader_num_workers, rank=self.parallel_plan.rank
            ),
        }
        if "in_order" in inspect.signature(DataLoader).parameters:
            loader_kwargs["in_order"] = args.dataloader_in_order
        dataloader = self.accelerator.prepare(DataLoader(dataset, **loader_kwargs))

        shard = pass_through_batch_shard(dataloader, sampler)
        if len(dataloader) != len(sampler):
            raise RuntimeError(
                f"the prepared DataLoader yields {len(dataloader)} batches per epoch but the multipack sampler "
                f"plans {len(sampler)}; accelerate re-sharded it ({type(shard).__name__})"
            )
        return dataloader

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
