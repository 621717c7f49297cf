"""Packed evaluation of the packing trainers: multipack (or streamed) eval batches and ``eval_loss`` as the
token mean over the whole eval set (see :mod:`packing_hf.integrations.trainer`).

>>> PackingEvalMixin.__name__
'PackingEvalMixin'
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from ..streaming import PackedStream
from .accelerator import forget_prepared_models, taken_as_prepared
from .args import PackingArguments
from .stream_data import is_stream

__all__ = ["PackingEvalMixin", "eval_sampler"]

logger = logging.getLogger(__name__)


def eval_sampler(
    lengths: Any, max_tokens_per_batch: int, num_replicas: int, rank: int, *, overflow: str, drop_last: bool
):
    """The multipack sampler of an eval set: every sample once, in a fixed plan, the same number of batches on
    every rank. When the samples cannot give every rank the same number of batches (fewer than the ranks can
    split into a multiple of them), ``dataloader_drop_last=True`` leaves whole batches out, as the training
    sampler does, counted and logged (and ``eval_dropped_samples`` in the metrics); without it the eval set is
    refused, naming that setting. It drops nothing otherwise: an eval set that splits evenly is evaluated whole.

    >>> sampler = eval_sampler([60, 60, 60], 100, 2, 0, overflow="error", drop_last=True)
    >>> len(sampler), sampler.stats()["dropped_samples"]
    (1, 1)
    """
    from .._epoch_plan import UnevenSplitError
    from ..sampler import MultipackBatchSampler

    def build(drop: bool):
        sampler = MultipackBatchSampler(
            lengths,
            max_tokens_per_batch,
            shuffle=False,
            num_replicas=num_replicas,
            rank=rank,
            overflow=overflow,
            drop_last=drop,
        )
        len(sampler)  # plans the batches: an eval set the ranks cannot share evenly is found here
        return sampler

    try:
        return build(False)
    except UnevenSplitError as error:
        if not drop_last:
            raise ValueError(
                f"evaluation: {error} (for the Trainer: dataloader_drop_last=True, which evaluates on the samples "
                "of the batches it keeps and counts the others in eval_dropped_samples)"
            ) from None
    sampler = build(True)
    stats = sampler.stats()
    logger.warning(
        "evaluation: the %d eval samples cannot give each of the %d ranks the same number of batches; "
        "dataloader_drop_last=True leaves %d of them (%d tokens) out: the eval loss is over the other %d",
        stats["num_samples"],
        num_replicas,
        stats["dropped_samples"],
        stats["dropped_tokens"],
        stats["num_samples"] - stats["dropped_samples"],
    )
    return sampler


class PackingEvalMixin:
    """Packed evaluation; part of :class:`~packing_hf.integrations.trainer.PackingTrainerMixin`."""

    args: PackingArguments
    loss_policy: Any  # the trainer's LossPolicy (integrations/loss_policy.py): no num_items_in_batch in a packed loop

    # ---- evaluation ------------------------------------------------------------------------------

    def _packs_eval(self) -> bool:
        return self.args.max_tokens_per_batch is not None and self.args.packing_eval

    def get_eval_dataloader(self, eval_dataset: Any = None) -> DataLoader:
        """Multipack eval batches when ``max_tokens_per_batch`` is set (``packing_eval=False``: stock's).

        Every eval sample is seen once, in a fixed plan, with the same number of batches on every rank (an eval
        set too small for that: :func:`eval_sampler`)."""
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
        sampler = eval_sampler(
            self._multipack_lengths_of(dataset),
            self.args.max_tokens_per_batch,
            *self._data_parallel_world(),
            overflow=self.args.packing_overflow,
            drop_last=self.args.dataloader_drop_last,
        )
        dataloader = self._multipack_dataloader(dataset, sampler, "evaluation", self.data_collator)
        # the samples dataloader_drop_last left out, reported with the loss (evaluation_loop)
        dataloader.packing_dropped_samples = sampler.stats()["dropped_samples"]
        return dataloader

    def evaluate(
        self, eval_dataset: Any = None, ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval"
    ):
        """Stock ``evaluate`` on the prepared model; with packed eval batches ``{prefix}_loss`` is the
        token-mean over the whole eval set (what padded evaluation means by it), not a mean of batch means."""
        with self._packing_model(self.model), self._evaluation_engine():
            return super().evaluate(
                eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix
            )

    def predict(
        self, test_dataset: Any, ignore_keys: list[str] | None = None, metric_key_prefix: str = "test"
    ):
        """Stock ``predict`` on the prepared model, like :meth:`evaluate`: its collator packs the test batches
        too, and an unprepared model would run them with samples seeing each other (a hybrid's mixers, a mask
        without positions, image tokens of a multimodal-RoPE model placed by text positions)."""
        with self._packing_model(self.model), self._evaluation_engine():
            return super().predict(test_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)

    @contextlib.contextmanager
    def _evaluation_engine(self) -> Iterator[None]:
        """Around ``evaluate`` / ``predict`` before ``train()``: what accelerate prepared for the evaluation is
        forgotten after it, so that ``train()`` prepares the model for training.

        transformers prepares an unprepared model for evaluation and ``train()`` then takes it as prepared
        (transformers 5.24, accelerate 1.15): under DDP it stays unwrapped (``evaluation_mode``), and each process
        trains its own replica without a gradient all-reduce; under DeepSpeed ZeRO-3 it is an inference engine
        (``deepspeed_init(inference=True)``: no optimizer, the config's ``optimizer`` and ``scheduler`` deleted, its
        ``"auto"`` values fixed for 0 steps), which cannot train (``'NoneType' object has no attribute
        'backward'``); under FSDP2 accelerate refuses to prepare a model without its optimizer ("a model and
        optimizer must be passed together"). Here, under DDP and DeepSpeed, the engine's hooks are removed from
        the model (``engine.destroy()``), accelerate and the trainer forget what they prepared
        (:func:`~packing_hf.integrations.accelerator.forget_prepared_models`), and the DeepSpeed config is given
        back as it was; under FSDP the model, whole on every process until ``train()`` shards it, is evaluated as
        it is (:func:`~packing_hf.integrations.accelerator.taken_as_prepared`)."""
        accelerator = self.accelerator
        if self.is_in_train or accelerator._models:
            yield
            return
        if getattr(self, "is_fsdp_enabled", False):
            with taken_as_prepared(accelerator, self.model):
                yield
            return
        plugin = getattr(accelerator.state, "deepspeed_plugin", None) if self.is_deepspeed_enabled else None
        config = plugin.hf_ds_config.config if plugin is not None else None
        given = copy.deepcopy(config)
        try:
            yield
        finally:
            forget_prepared_models(accelerator, self.model)
            self.model_wrapped = self.model
            if self.is_deepspeed_enabled:
                self.deepspeed = None
            if config is not None:
                config.clear()
                config.update(given)

    def evaluation_loop(self, dataloader: DataLoader, description: str, *args: Any, **kwargs: Any):
        if not self._packs_eval():
            return super().evaluation_loop(dataloader, description, *args, **kwargs)
        self._packing_eval_sums = torch.zeros(2, dtype=torch.float64, device=self.args.device)
        try:
            with self.loss_policy.packed_evaluation():
                output = super().evaluation_loop(dataloader, description, *args, **kwargs)
            totals = self._packing_eval_sums
            if self.parallel_plan.world_size > 1:
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
        dropped = getattr(dataloader, "packing_dropped_samples", 0)
        if output.metrics is not None and dropped:
            output.metrics[f"{prefix}_dropped_samples"] = dropped
        return output

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
