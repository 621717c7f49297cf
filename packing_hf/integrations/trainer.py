"""``packing_hf.Trainer``: ``transformers.Trainer`` that trains on packed batches, exactly.

Change one import and set one field::

    from packing_hf import PaddingFreeCollator, Trainer, TrainingArguments

    args = TrainingArguments("out", max_tokens_per_batch=4096)
    Trainer(model=model, args=args, train_dataset=dataset, data_collator=PaddingFreeCollator()).train()

What the subclass adds to the stock Trainer (each item is something stock gets wrong or lacks):

- ``max_tokens_per_batch``: training batches come from :class:`~packing_hf.MultipackBatchSampler`, which
  is rank-aware, so accelerate's own sharding of the batch sampler is turned into a pass-through (as stock
  does for its ``BatchRebalanceSampler``): no double sharding, the same number of steps on every rank.
  ``len(train_dataloader)`` is the exact number of batches of an epoch, so ``max_steps``,
  ``num_train_epochs`` and the LR schedule agree; ``set_epoch`` reaches the sampler every epoch.
- Exact mid-epoch resume: the sampler's position (epoch, batches consumed) and what its plan depends on
  are saved in every checkpoint (``packing_hf_sampler.json``). On resume the sampler is put back in the
  saved epoch and the Trainer's own ``skip_first_batches`` skips the consumed batches, once (it only
  walks the sampler's index lists, no data is loaded). A checkpoint whose plan cannot be reproduced
  (another world size, budget, seed or dataset) is refused instead of replaying or skipping samples.
- ``remove_unused_columns`` keeps the columns the collator consumes (``completion_mask``,
  ``assistant_masks``, ``seq_lengths``): stock drops them because the model's ``forward`` does not take
  them, which silently trains on prompt tokens.
- A pre-flight check before training (``packing_preflight``): packed samples must not see each other with
  this model's architecture and attention implementation, else switch to packing_hf's varlen attention or
  refuse (:mod:`packing_hf.integrations.preflight`).
- Packing metrics in the logs (:mod:`packing_hf.integrations.callbacks`).
- Streaming datasets (a ``torch`` / ``datasets`` ``IterableDataset``, a
  :class:`~packing_hf.streaming.TokenizedStream` or :class:`~packing_hf.streaming.PackedStream`) with
  ``max_tokens_per_batch`` and ``max_steps``: batches come from a rank-aware ``PackedStream`` (bounded
  shuffle buffer + best fit), passes follow one another without a break, and every checkpoint holds each
  rank's stream position and buffer (``packing_hf_stream_rank{r}.json``), so a resumed run sees exactly
  the batches the uninterrupted run would have (see ``docs/streaming.md``).

Loss normalisation needs no change: the collator masks the first label of every sample, so the count
stock takes over ``labels[..., 1:]`` (``num_items_in_batch``, gathered across ranks) is the same number of
predicted tokens as for the padded batch, and the per-token loss is the same.

>>> import packing_hf
>>> packing_hf.Trainer.__mro__[1].__name__, packing_hf.TrainingArguments.__name__
('PackingTrainerMixin', 'TrainingArguments')
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import logging
import math
import os
from functools import partial
from typing import Any

import numpy as np
import torch
import transformers
from torch.utils.data import DataLoader
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint, seed_worker

from ..collator import PaddingFreeCollator
from ..streaming import PackedStream, TokenizedStream
from .args import PackingArguments, TrainingArguments
from .callbacks import STATS_KEY, PackingMetrics, PackingStatsCollator
from .preflight import base_model, preflight_packing

__all__ = [
    "SAMPLER_STATE_NAME",
    "STREAM_STATE_NAME",
    "PackingTrainerMixin",
    "Trainer",
    "TrainingArguments",
    "is_packing_collator",
    "is_stream",
]

logger = logging.getLogger(__name__)

# Written next to trainer_state.json in every checkpoint of a multipack run.
SAMPLER_STATE_NAME = "packing_hf_sampler.json"
# Written by every rank in every checkpoint of a streaming run (``.format(rank=r)``).
STREAM_STATE_NAME = "packing_hf_stream_rank{rank}.json"
_STATE_FORMAT = 1


def is_packing_collator(collator: Any) -> bool:
    """Whether ``collator`` flattens a batch into one packed row (so packed samples share attention calls).

    True for :class:`~packing_hf.PaddingFreeCollator`, ``transformers.DataCollatorWithFlattening`` and TRL's
    ``DataCollatorForLanguageModeling(padding_free=True)``, also when wrapped by stock's
    ``RemoveColumnsCollator`` or by :class:`~packing_hf.integrations.callbacks.PackingStatsCollator`.

    >>> from packing_hf import PaddingFreeCollator
    >>> is_packing_collator(PaddingFreeCollator()), is_packing_collator(None)
    (True, False)
    """
    while hasattr(collator, "data_collator") or isinstance(collator, PackingStatsCollator):
        collator = collator.collator if isinstance(collator, PackingStatsCollator) else collator.data_collator
    if isinstance(collator, PaddingFreeCollator | transformers.DataCollatorWithFlattening):
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


def _lengths_fingerprint(lengths: np.ndarray) -> str:
    """A short hash of the per-sample lengths: the sampler's plan depends on them."""
    return hashlib.sha1(np.ascontiguousarray(lengths, dtype=np.int64).tobytes()).hexdigest()[:16]


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


class PackingTrainerMixin:
    """What ``packing_hf.Trainer`` and ``packing_hf.SFTTrainer`` add to their Hugging Face base class.

    Put it first in the bases (``class Trainer(PackingTrainerMixin, transformers.Trainer)``); ``args`` must be
    a :class:`~packing_hf.integrations.args.PackingArguments` subclass. See the module docstring.
    """

    args: PackingArguments

    # ---- set-up ----------------------------------------------------------------------------------

    def _packing_setup(self) -> None:
        """Called at the end of ``__init__``: validate the packing options against the rest of the set-up."""
        args = self.args
        if not isinstance(args, PackingArguments):
            raise TypeError(
                f"{type(self).__name__} needs packing_hf's arguments, got {type(args).__module__}."
                f"{type(args).__name__}; use packing_hf.TrainingArguments (or packing_hf.SFTConfig for SFTTrainer)"
            )
        self._multipack_sampler = None
        self._packing_resume_dir: str | None = None
        # the PackedStream the training batches come from (None unless training on a stream), and how many
        # of its batches the training loop used, all passes together: what a checkpoint's position is
        self.packing_stream: PackedStream | None = None
        self._stream_batches_consumed = 0
        # handle of prepare_model_for_packing on the model while it trains or evaluates (None otherwise)
        self.packing_preparation = None
        self._packing_depth = 0  # nested train -> evaluate: prepare once, give the model back once
        self._packing_metrics = PackingMetrics(args.max_tokens_per_batch)
        self._packing_last_logged_step = 0
        if args.max_tokens_per_batch is None:
            return
        if not is_packing_collator(self.data_collator):
            raise ValueError(
                f"max_tokens_per_batch={args.max_tokens_per_batch} packs several samples in one row, but the data "
                f"collator {type(self.data_collator).__name__} does not flatten batches; pass "
                "data_collator=packing_hf.PaddingFreeCollator() (or leave data_collator unset)"
            )
        if args.auto_find_batch_size:
            raise ValueError(
                "auto_find_batch_size=True changes per_device_train_batch_size, which max_tokens_per_batch "
                "does not use; on out-of-memory errors lower max_tokens_per_batch instead"
            )
        accelerator_config = args.accelerator_config
        if getattr(accelerator_config, "split_batches", False) or getattr(
            accelerator_config, "dispatch_batches", None
        ):
            raise ValueError(
                "max_tokens_per_batch gives every rank its own packed batches; accelerator_config with "
                "split_batches=True or dispatch_batches=True would re-split or re-send them. Unset both."
            )
        parallelism = getattr(self.accelerator, "parallelism_config", None)
        for name in ("tp_size", "cp_size", "sp_size"):
            if parallelism is not None and (getattr(parallelism, name, 1) or 1) > 1:
                raise ValueError(
                    f"max_tokens_per_batch does not support {name}={getattr(parallelism, name)}: multipack shards "
                    "batches over data-parallel ranks only (DDP, FSDP, DeepSpeed ZeRO). Unset max_tokens_per_batch."
                )
        if is_stream(self.train_dataset):
            self._check_stream_settings(self.train_dataset)
        if args.train_sampling_strategy not in ("random", None) and not is_stream(self.train_dataset):
            logger.warning(
                "train_sampling_strategy=%r is not used: with max_tokens_per_batch the batches come from "
                "MultipackBatchSampler",
                args.train_sampling_strategy,
            )

    # ---- columns ---------------------------------------------------------------------------------

    def _set_signature_columns_if_needed(self) -> None:
        # Stock keeps only the columns named in model.forward's signature, so completion_mask /
        # assistant_masks / seq_lengths would be stripped before the collator could use them.
        already_set = self._signature_columns is not None
        super()._set_signature_columns_if_needed()
        if already_set:
            return
        consumed = getattr(self.data_collator, "input_columns", ())
        self._signature_columns = list(dict.fromkeys([*self._signature_columns, *consumed]))

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
        )

    def _wrap_train_collator(self, collator: Any) -> Any:
        return (
            PackingStatsCollator(collator)
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

    def _init_training_state(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
        epochs_trained, steps_trained_in_current_epoch = super()._init_training_state(*args, **kwargs)
        if self.packing_stream is not None:
            # The stream resumes from its own saved state; stock's skip_first_batches would then skip (and
            # read) that many batches of the already resumed stream.
            steps_trained_in_current_epoch = 0
        return epochs_trained, steps_trained_in_current_epoch

    def _save_stream_state(self, output_dir: str) -> None:
        """Every rank writes its stream's position and buffer (``STREAM_STATE_NAME``) into ``output_dir``."""
        stream = self.packing_stream
        consumed = self._stream_batches_consumed
        state = {
            "format": _STATE_FORMAT,
            "global_step": self.state.global_step,
            "gradient_accumulation_steps": self.args.gradient_accumulation_steps,
            "batches_consumed": consumed,
            "stream": stream.state_dict(batches_consumed=consumed),
        }
        os.makedirs(output_dir, exist_ok=True)
        with open(os.path.join(output_dir, STREAM_STATE_NAME.format(rank=stream.rank)), "w") as f:
            json.dump(state, f)

    def _restore_stream(self, stream: PackedStream) -> None:
        """On resume: put ``stream`` where the checkpoint's run left this rank's stream."""
        checkpoint = self._packing_resume_dir
        if checkpoint is None or self.args.ignore_data_skip:
            return  # ignore_data_skip: the user asked for the data to restart from the stream's beginning
        name = STREAM_STATE_NAME.format(rank=stream.rank)
        fix = (
            "resume with the data, world size, max_tokens_per_batch, seed and packing_overflow of that run, or pass "
            "ignore_data_skip=True to restart the stream from its beginning"
        )
        path = os.path.join(checkpoint, name)
        if not os.path.isfile(path):
            raise ValueError(
                f"resuming from {checkpoint} with a streaming train_dataset, but the checkpoint has no {name} (it "
                f"was not saved by a streaming run on {stream.num_replicas} process(es)), so the stream's position "
                f"is unknown; {fix}"
            )
        with open(path) as f:
            state = json.load(f)
        try:
            stream.load_state_dict(state["stream"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"cannot resume the stream of {checkpoint} ({name}): {exc}; {fix}") from None

    # ---- evaluation ------------------------------------------------------------------------------

    def _packs_eval(self) -> bool:
        return self.args.max_tokens_per_batch is not None and self.args.packing_eval

    def get_eval_dataloader(self, eval_dataset: Any = None) -> DataLoader:
        """Multipack eval batches when ``max_tokens_per_batch`` is set (``packing_eval=False``: stock's).

        Every eval sample is seen once, in a fixed plan, with the same number of batches on every rank."""
        if not self._packs_eval():
            return super().get_eval_dataloader(eval_dataset)
        if eval_dataset is None and self.eval_dataset is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")
        if isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset[eval_dataset]
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if is_stream(dataset):
            # one pass of a stream, each eval sample once; ranks that run out first yield padding batches,
            # which add nothing to the token sums of prediction_step
            return self._stream_dataloader(
                self._packed_stream_of(dataset, "evaluation"), "evaluation", self.data_collator
            )
        if not hasattr(dataset, "__len__"):
            raise ValueError(
                f"packing_eval needs a map-style eval dataset with known sample lengths or a stream, got "
                f"{type(dataset).__name__}; materialise it or set packing_eval=False"
            )
        from ..sampler import MultipackBatchSampler

        num_replicas, rank = self._data_parallel_world()
        sampler = MultipackBatchSampler(
            self._multipack_lengths_of(dataset),
            self.args.max_tokens_per_batch,
            shuffle=False,
            num_replicas=num_replicas,
            rank=rank,
            overflow=self.args.packing_overflow,
        )
        return self._multipack_dataloader(dataset, sampler, "evaluation", self.data_collator)

    def evaluate(
        self, eval_dataset: Any = None, ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval"
    ):
        """Stock ``evaluate`` on the prepared model; with packed eval batches ``{prefix}_loss`` is the
        token-mean over the whole eval set (what padded evaluation means by it), not a mean of batch means."""
        with self._packing_model(self.model):
            return super().evaluate(
                eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix
            )

    def evaluation_loop(self, dataloader: DataLoader, description: str, *args: Any, **kwargs: Any):
        if not self._packs_eval():
            return super().evaluation_loop(dataloader, description, *args, **kwargs)
        self._packing_eval_sums = torch.zeros(2, dtype=torch.float64, device=self.args.device)
        try:
            output = super().evaluation_loop(dataloader, description, *args, **kwargs)
            totals = self._packing_eval_sums
            if self.accelerator.num_processes > 1:
                totals = self.accelerator.reduce(totals, reduction="sum")
        finally:
            self._packing_eval_sums = None
        if float(totals[1]) == 0 and isinstance(dataloader.dataset, PackedStream):
            # as a map-style eval set with no sample (the sampler refuses it), never metrics without the loss
            raise ValueError(
                "the dataset is empty (the evaluation stream yielded no labelled token): there is nothing to evaluate"
            )
        prefix = kwargs.get("metric_key_prefix", args[2] if len(args) > 2 else "eval")
        key = f"{prefix}_loss"
        if output.metrics is not None and key in output.metrics and float(totals[1]) > 0:
            output.metrics[key] = float(totals[0] / totals[1])
        return output

    def _get_num_items_in_batch(self, batch_samples: list, device: Any) -> Any:
        if getattr(self, "_packing_eval_sums", None) is not None:
            # Packed evaluation weighs each batch's mean loss by the batch's own token count (prediction_step).
            # Stock's count is gathered over ranks in evaluation too, which would make each rank's loss its
            # share of a global mean (times the number of processes) instead of its own mean.
            return None
        return super()._get_num_items_in_batch(batch_samples, device)

    def prediction_step(
        self, model: Any, inputs: dict[str, Any], prediction_loss_only: bool, *args: Any, **kwargs: Any
    ):
        sums = getattr(self, "_packing_eval_sums", None)
        labels = inputs.get("labels")
        # predicted tokens: what the causal loss averages over (stock's num_items_in_batch counts the same)
        count = (labels[..., 1:] != -100).sum() if isinstance(labels, torch.Tensor) else None
        loss, logits, out_labels = super().prediction_step(
            model, inputs, prediction_loss_only, *args, **kwargs
        )
        if sums is not None and loss is not None and count is not None:
            count = count.to(sums.device)
            weighted = loss.detach().double().to(sums.device) * count
            # a batch without labels (a stream's padding batch) has a NaN mean loss and weighs nothing
            sums[0] += torch.where(count > 0, weighted, torch.zeros_like(weighted))
            sums[1] += count
        return loss, logits, out_labels

    def get_total_train_batch_size(self, args: transformers.TrainingArguments) -> int:
        # With multipack, per_device_train_batch_size means nothing: report the mean samples per optimizer
        # step (used for the "Total train batch size" line and the samples/s metrics).
        sampler = self._multipack_sampler
        if self.args.max_tokens_per_batch is None or sampler is None:
            return super().get_total_train_batch_size(args)
        steps_per_epoch = max(1, math.ceil(len(sampler) / args.gradient_accumulation_steps))
        return max(1, round(len(sampler.lengths) / steps_per_epoch))

    # ---- checkpoints and resume ------------------------------------------------------------------

    def _sampler_position(self, global_step: int) -> tuple[int, int]:
        """``(epoch, batches consumed in it)`` after ``global_step`` optimizer steps, computed the way the
        Trainer computes where to resume (``skip_first_batches`` count included)."""
        gas = self.args.gradient_accumulation_steps
        steps_per_epoch = max(1, math.ceil(len(self._multipack_sampler) / gas))
        return global_step // steps_per_epoch, (global_step % steps_per_epoch) * gas

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        if self.packing_stream is not None:
            self._save_stream_state(os.path.join(self._get_output_dir(trial=trial), folder))
        if self._multipack_sampler is not None and self.args.should_save:
            # The sampler's own counter runs ahead of training (the DataLoader prefetches): the position
            # saved is the Trainer's, from its step count.
            epoch, consumed = self._sampler_position(self.state.global_step)
            sampler_state = {
                **self._multipack_sampler.state_dict(),
                "epoch": epoch,
                "batches_consumed": consumed,
            }
            state = {
                "format": _STATE_FORMAT,
                "global_step": self.state.global_step,
                "gradient_accumulation_steps": self.args.gradient_accumulation_steps,
                "batches_per_epoch": len(self._multipack_sampler),
                "lengths_sha1": _lengths_fingerprint(self._multipack_sampler.lengths),
                "sampler": sampler_state,
            }
            output_dir = os.path.join(self._get_output_dir(trial=trial), folder)
            os.makedirs(output_dir, exist_ok=True)
            with open(os.path.join(output_dir, SAMPLER_STATE_NAME), "w") as f:
                json.dump(state, f, indent=2, sort_keys=True)
        super()._save_checkpoint(model, trial)

    def _restore_sampler_epoch(self, sampler: Any) -> None:
        """On resume: check that the checkpoint's data order is reproducible, and put the sampler in its epoch.

        The Trainer skips the consumed batches itself (``skip_first_batches``, which only walks the sampler's
        index lists), so the sampler restarts the epoch from its first batch: loading its position as well
        would skip them twice. Under several processes that skipping wrapper also hides the sampler from the
        Trainer's ``set_epoch`` call, hence the epoch is set here.
        """
        checkpoint = self._packing_resume_dir
        if checkpoint is None or self.args.ignore_data_skip:
            return  # ignore_data_skip: the user asked for the data order to restart
        path = os.path.join(checkpoint, SAMPLER_STATE_NAME)
        fix = (
            "resume with the dataset, world size, max_tokens_per_batch, seed and gradient_accumulation_steps of "
            "that run, or pass ignore_data_skip=True to restart the data order from the checkpoint's epoch"
        )
        if not os.path.isfile(path):
            raise ValueError(
                f"resuming from {checkpoint} with max_tokens_per_batch={self.args.max_tokens_per_batch}, but the "
                f"checkpoint has no {SAMPLER_STATE_NAME} (it was not saved by a multipack run), so the batches "
                f"it consumed cannot be skipped exactly; {fix}"
            )
        with open(path) as f:
            state = json.load(f)
        saved = state["sampler"]
        now = {
            "batches_per_epoch": len(sampler),
            "lengths_sha1": _lengths_fingerprint(sampler.lengths),
            "gradient_accumulation_steps": self.args.gradient_accumulation_steps,
        }
        different = [
            f"{k}: checkpoint {state.get(k)!r}, now {v!r}" for k, v in now.items() if state.get(k) != v
        ]
        # where the Trainer will resume, with the current arguments, must be where the checkpoint stopped
        position = self._sampler_position(int(state["global_step"]))
        if not different and position != (saved["epoch"], saved["batches_consumed"]):
            different.append(
                f"position: checkpoint {(saved['epoch'], saved['batches_consumed'])}, now {position}"
            )
        if different:
            raise ValueError(
                f"cannot resume the multipack data order of {checkpoint}: it changed ({'; '.join(different)}); {fix}"
            )
        try:
            # validates seed, budget, number of ranks, ... and sets the epoch; position 0: the Trainer skips
            sampler.load_state_dict({**saved, "batches_consumed": 0})
        except ValueError as exc:
            raise ValueError(
                f"cannot resume the multipack data order of {checkpoint}: {exc}; {fix}"
            ) from None

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs: Any,
    ):
        """Stock ``train``, after the packing pre-flight check; also remembers the checkpoint to resume."""
        if resume_from_checkpoint is True:
            # resolved here as stock does, so the sampler state is read from the same folder
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir})")
        self._packing_resume_dir = resume_from_checkpoint or None
        self._packing_metrics.reset()
        self._packing_last_logged_step = 0
        with self._packing_model(self.model if self.model_init is None else None):
            return super().train(
                resume_from_checkpoint=resume_from_checkpoint,
                trial=trial,
                ignore_keys_for_eval=ignore_keys_for_eval,
                **kwargs,
            )

    def call_model_init(self, trial: Any = None):
        model = super().call_model_init(trial)
        if self._packing_depth and model is not None and self._packs():
            self._packing_give_back()  # a new model per trial: the previous one goes back as it was
            self._packing_remember(model)
            self.packing_preparation = preflight_packing(model, mode=self.args.packing_preflight)
        return model

    def _packs(self) -> bool:
        return self.args.max_tokens_per_batch is not None or is_packing_collator(self.data_collator)

    def _packing_remember(self, model: Any) -> None:
        """What the user's model looked like before packing_hf touched it (given back after train/evaluate)."""
        config = getattr(base_model(model), "config", None)
        self._packing_user = (
            base_model(model),
            getattr(config, "_attn_implementation", None),
            getattr(self, "_packing_user_use_cache", getattr(config, "use_cache", None)),
        )

    @contextlib.contextmanager
    def _packing_model(self, model: Any):
        """The model prepared for packed batches for the duration (pre-flight check, guards, per-sample masks),
        then given back as the user passed it: hooks removed, attention implementation and ``use_cache`` as
        they were, so ``generate`` on padded batches, padded evaluation and ``save_pretrained`` behave as
        stock. Nested calls (evaluation during training) prepare once."""
        self._packing_depth += 1
        try:
            if self._packing_depth == 1 and model is not None and self._packs():
                self._packing_remember(model)
                self.packing_preparation = preflight_packing(model, mode=self.args.packing_preflight)
            yield
        finally:
            self._packing_depth -= 1
            if self._packing_depth == 0:
                self._packing_give_back()

    def _packing_give_back(self) -> None:
        if self.packing_preparation is not None:
            self.packing_preparation.revert()
            self.packing_preparation = None
        user = getattr(self, "_packing_user", None)
        if user is None:
            return
        model, attn_implementation, use_cache = user
        current = getattr(model.config, "_attn_implementation", None)
        if attn_implementation is not None and current != attn_implementation:
            model.set_attn_implementation(attn_implementation)  # the pre-flight switched it for training
        if use_cache is not None:
            model.config.use_cache = use_cache  # stock Trainer sets args.use_cache (False) on the model
        self._packing_user = None

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Stock ``_save``, with the config as the user had it (``use_cache``), not as training set it."""
        config = getattr(base_model(self.model), "config", None)
        use_cache = getattr(self, "_packing_user_use_cache", None)
        if config is None or use_cache is None or config.use_cache == use_cache:
            return super()._save(output_dir, state_dict)
        training_value, config.use_cache = config.use_cache, use_cache
        try:
            return super()._save(output_dir, state_dict)
        finally:
            config.use_cache = training_value

    # ---- steps and logs --------------------------------------------------------------------------

    def training_step(self, model: Any, inputs: dict[str, Any], *args: Any, **kwargs: Any):
        counts = inputs.pop(STATS_KEY, None)  # never passed to the model
        if counts is not None:
            self._packing_metrics.update(counts)
        return super().training_step(model, inputs, *args, **kwargs)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        # Training logs (they carry "loss") are emitted on every rank, so the all-reduce below is matched.
        if self.args.packing_metrics and "loss" in logs:
            totals = self._packing_metrics.as_tensor(self.args.device)
            if self.accelerator.num_processes > 1:
                totals = self.accelerator.reduce(totals, reduction="sum")
            steps = self.state.global_step - self._packing_last_logged_step
            self._packing_last_logged_step = self.state.global_step
            logs.update(self._packing_metrics.compute(num_steps=steps, totals=totals))
        super().log(logs, *args, **kwargs)


class Trainer(PackingTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` with multipack batches, exact resume, a packing pre-flight check and metrics.

    Takes the same arguments as ``transformers.Trainer``; ``args`` must be a
    :class:`packing_hf.TrainingArguments` (default: one with ``output_dir="tmp_trainer"``). When
    ``max_tokens_per_batch`` is set and no ``data_collator`` is given, a
    :class:`~packing_hf.PaddingFreeCollator` using the tokenizer's pad token is used.

    >>> import torch
    >>> from transformers import AutoConfig, AutoModelForCausalLM
    >>> from packing_hf import PaddingFreeCollator
    >>> config = AutoConfig.for_model("llama", vocab_size=32, hidden_size=16, intermediate_size=32,
    ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    >>> model = AutoModelForCausalLM.from_config(config)
    >>> data = [{"input_ids": list(range(1, n))} for n in (5, 9, 3, 7, 6, 4)]
    >>> args = TrainingArguments("/tmp/packing_hf_doctest", max_tokens_per_batch=16, max_steps=2,
    ...     report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True)
    >>> trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=PaddingFreeCollator())
    >>> result = trainer.train()  # the Trainer prints its final metrics  # doctest: +ELLIPSIS
    {...'train_loss'...}
    >>> result.global_step
    2
    """

    def __init__(
        self,
        model: Any = None,
        args: TrainingArguments | None = None,
        data_collator: Any = None,
        *a: Any,
        **kw: Any,
    ):
        if args is None:
            args = TrainingArguments(output_dir="tmp_trainer")
        if data_collator is None and getattr(args, "max_tokens_per_batch", None) is not None:
            data_collator = PaddingFreeCollator.for_tokenizer(kw.get("processing_class"))
        # stock __init__ sets model.config.use_cache = args.use_cache; the user's value is given back later
        self._packing_user_use_cache = getattr(getattr(model, "config", None), "use_cache", None)
        super().__init__(model, args, data_collator, *a, **kw)
        self._packing_setup()
