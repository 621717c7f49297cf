"""Streaming training data of the packing trainers: a stream (no length, no random access) packed online by a
rank-aware :class:`~packing_hf.streaming.PackedStream`, its passes one after another, its settings checked.

>>> is_stream([{"input_ids": [1, 2]}])
False
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader

from ..registry import router_loss_coefficient
from ..streaming import PackedStream, TokenizedStream
from .preflight import base_model

__all__ = ["PackingStreamMixin", "is_hf_iterable", "is_stream"]


def is_hf_iterable(dataset: Any) -> bool:
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
    return isinstance(dataset, torch.utils.data.IterableDataset | TokenizedStream) or is_hf_iterable(dataset)


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


class PackingStreamMixin:
    """The streaming half of :class:`~packing_hf.integrations.dataloaders.PackingDataMixin`."""

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
            model = base_model(self.model)
            if router_loss_coefficient(getattr(model, "config", None), model) or getattr(
                self, "aux_loss_enabled", False
            ):
                # the padding batch's pad token is routed: the loss the model adds for it is not a sum over tokens
                raise ValueError(
                    "a streaming train_dataset on several processes: a rank whose shard ran out trains on padding "
                    "batches (one pad token, no label) while the others finish the pass, and this model adds a "
                    "router load-balancing loss (MoE: output_router_logits=True, router_aux_loss_coef != 0) to its "
                    "loss, which would route that token and add its load-balancing loss to the step. Set "
                    "output_router_logits=False (or router_aux_loss_coef=0), materialise the dataset (the "
                    "multipack sampler gives every rank real batches), or use one process"
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
        if is_hf_iterable(dataset):
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
