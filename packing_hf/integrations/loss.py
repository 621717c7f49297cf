"""The loss contract of the packing trainers: ``loss_normalization`` and ``loss_weights``, the same optimizer
step whatever the packing, gradient accumulation, number of processes or streaming (see ``docs/loss.md``).

``"token"`` without a ``loss_weights`` column is stock's own loss, untouched. Otherwise the Trainer computes
the loss itself: when it gathers the micro-batches of an optimizer step (``get_batch_samples``) it sums every
micro-batch's target weight and sample count (:func:`packing_hf._loss.loss_counts`) and all-reduces the sums
over the ranks, so the denominator of the step is known before the first backward; each micro-batch's loss is
then its own numerator (:func:`packing_hf._loss.loss_numerator`) over that denominator, times the number of
processes (DDP averages gradients over ranks). The logged ``loss`` is thus the normalised loss of the step.

With ``chunked_loss=True`` (default) that loss, stock's (the model's own causal-LM loss, in training and
evaluation) and a sequence-parallel shard's share are computed from the model's hidden states in chunks
(:mod:`packing_hf.integrations.chunked_head`): the same values and gradients without the ``(tokens, vocabulary)``
logits.

Which of these computes a micro-batch's loss is one value, its :class:`~packing_hf.integrations.loss_policy.LossRoute`,
decided by the trainer's :class:`~packing_hf.integrations.loss_policy.LossPolicy` (the step's route when the step's
micro-batches are counted, the call's in :meth:`PackingLossMixin.compute_loss`); this module computes each route.

>>> PackingLossMixin.__name__
'PackingLossMixin'
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
import transformers

from .._loss import (
    LOSS_WEIGHTS_KEY,
    TREE_KEYS,
    loss_numerator,
    step_denominator,
    target_coefficients,
    tree_coefficients,
    tree_loss_counts,
    tree_numerator,
)
from ..shard_loss import shard_tree_pairs
from ..varlen import SHARD_KEY
from .args import PackingArguments
from .chunked_head import causal_lm_loss, pairs_lm_loss
from .loss_policy import LossPolicy, LossRoute, causal_labels, stock_scaled_for_ga
from .parallel import ParallelPlan, training_mode

__all__ = ["LossRoute", "PackingLossMixin"]

_UNSET = object()


def _read_scaled_for_ga(trainer: Any) -> bool | None:
    policy = trainer.__dict__.get("loss_policy")  # built with the accelerator, inside the stock __init__
    return stock_scaled_for_ga(type(trainer)) if policy is None else policy.scaled_for_ga


def _write_scaled_for_ga(trainer: Any, value: bool | None) -> None:
    raise AttributeError(
        f"loss_is_scaled_for_ga={value!r} on {type(trainer).__name__}: packing_hf's LossPolicy decides it for each "
        "step (trainer.loss_policy); declare what your compute_loss returns as a class attribute of your trainer "
        "class (loss_is_scaled_for_ga = ...): the steps on the stock route keep it"
    )


class PackingLossMixin:
    """The loss routes of :class:`~packing_hf.integrations.trainer.PackingTrainerMixin`: the trainer's
    ``loss_policy`` decides, this mixin computes."""

    args: PackingArguments
    parallel_plan: ParallelPlan
    loss_policy: LossPolicy
    _packing_metrics: Any  # the packing metrics (integrations/callbacks.py), set up by PackingTrainerMixin

    #: read by ``transformers.Trainer.training_step``: the step's, from the loss policy (the only writer)
    loss_is_scaled_for_ga = property(_read_scaled_for_ga, _write_scaled_for_ga)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        declared = cls.__dict__.get("loss_is_scaled_for_ga", _UNSET)
        if declared is not _UNSET and not isinstance(declared, property):
            # a subclass's word on its own compute_loss: what the steps on the stock route keep
            cls.stock_loss_scaled_for_ga = declared
            cls.loss_is_scaled_for_ga = PackingLossMixin.loss_is_scaled_for_ga

    # ---- the step ----------------------------------------------------------------------------------------------

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> tuple[list, Any]:
        """Stock's; the step's loss is decided while it counts (:meth:`LossPolicy.begin_step`)."""
        with self.loss_policy.counting_step():
            return super().get_batch_samples(epoch_iterator, num_batches, device)

    def _get_num_items_in_batch(self, batch_samples: list, device: Any) -> Any:
        stock = functools.partial(super()._get_num_items_in_batch, batch_samples, device)
        return self.loss_policy.count(self, batch_samples, device, stock)

    def prediction_step(
        self, model: Any, inputs: dict[str, Any], prediction_loss_only: bool, *args: Any, **kwargs: Any
    ):
        with self.loss_policy.prediction(prediction_loss_only):
            return super().prediction_step(model, inputs, prediction_loss_only, *args, **kwargs)

    # ---- the call ----------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _loss_call(self, model: Any, inputs: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """Around one ``compute_loss`` call: what a trainer sets up for it (adapters on its models, rows set
        aside); yields the inputs the loss is computed on."""
        yield inputs

    def compute_loss(
        self, model: Any, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        """This call's loss by the route the loss policy gives it (:meth:`LossPolicy.route`): stock's
        (``loss_weights`` removed: the model never sees them), the model's own (from the chunked head), SFT's plain
        loss, packing_hf's (this micro-batch's numerator over the step's denominator ``num_items_in_batch``, times
        the number of processes) or a sequence-parallel shard's share (see the module docstring)."""
        start = time.perf_counter()
        with self._loss_call(model, inputs) as inputs:
            weights = inputs.pop(LOSS_WEIGHTS_KEY, None)
            route, head = self.loss_policy.route(
                self, model, inputs, weights is not None, return_outputs, num_items_in_batch
            )
            # the one place that branches on the route
            if route is LossRoute.STOCK:
                # evaluation: eval_loss stays the unweighted token mean (see docs/loss.md)
                result = super().compute_loss(
                    model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
                )
            elif route is LossRoute.MODEL:
                loss, _, outputs = self._model_loss(model, inputs, num_items_in_batch, head)
                result = (loss, outputs) if return_outputs else loss
            elif route is LossRoute.SFT_PLAIN:
                result = self._sft_plain_loss(model, inputs, num_items_in_batch, head)
            elif route is LossRoute.PACKED:
                result = self._packed_loss(model, inputs, weights, return_outputs, num_items_in_batch, head)
            elif route is LossRoute.PREFIX_TREE:
                result = self._tree_loss(model, inputs, return_outputs, num_items_in_batch, head)
            else:  # LossRoute.SEQUENCE_PARALLEL
                result = self._sequence_parallel_loss(
                    model, inputs, weights, num_items_in_batch, return_outputs, head
                )
        if training_mode(model):
            # the forward + loss time of this rank's micro-batch (packing metrics: how long ranks wait)
            self._packing_metrics.record_time(time.perf_counter() - start)
        return result

    # ---- the routes --------------------------------------------------------------------------------------------

    def _model_loss(
        self,
        model: Any,
        inputs: dict[str, Any],
        num_items_in_batch: Any,
        head: Any,
        metrics: bool = False,
    ) -> tuple[torch.Tensor, Any, Any]:
        """The model's own causal-LM loss, scaled as ``transformers.Trainer.compute_loss`` scales it: ``(loss,
        LogitStats, outputs)`` from the chunked head ``head``, or ``(loss, None, outputs)`` from
        ``transformers.Trainer.compute_loss`` itself (``head=None``: the full logits, in ``outputs``)."""
        if head is None:
            # transformers.Trainer's, whatever the stock trainer's own compute_loss does (TRL's SFT: a fused head)
            loss, outputs = transformers.Trainer.compute_loss(
                self, model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch
            )
            return loss, None, outputs
        labels = causal_labels(inputs)
        model_inputs = {k: v for k, v in inputs.items() if k not in ("labels", "shift_labels")}
        total, stats, outputs = causal_lm_loss(model, model_inputs, labels, resolved=head, metrics=metrics)
        if self.model_accepts_loss_kwargs and num_items_in_batch is not None:
            loss = total / torch.as_tensor(num_items_in_batch, device=total.device)
            if self.args.average_tokens_across_devices:
                loss = loss * (self.parallel_plan.world_size // self.get_tp_size())
        else:
            # the model's mean over its targets; in training a micro-batch without one has the loss 0, zero
            # gradients (as the step's count), in evaluation NaN as the model's own (stock's evaluation skips it)
            count = stats.count.clamp(min=1) if training_mode(model) else stats.count
            loss = total / count
        return loss, stats, outputs

    def _packed_loss(
        self,
        model: Any,
        inputs: dict[str, Any],
        weights: Any,
        return_outputs: bool,
        num_items_in_batch: Any,
        head: Any,
    ) -> Any:
        """packing_hf's loss: this micro-batch's numerator over the step's denominator, times the processes."""
        labels = causal_labels(inputs)
        model_inputs = {k: v for k, v in inputs.items() if k not in ("labels", "shift_labels")}
        scale = self.parallel_plan.world_size / float(num_items_in_batch)
        if head is not None:
            coefficients = target_coefficients(
                labels,
                self.args.loss_normalization,
                loss_weights=weights,
                position_ids=inputs.get("position_ids"),
                cu_seq_lens=inputs.get("cu_seq_lens_q"),
            )
            total, _, outputs = causal_lm_loss(model, model_inputs, labels, coefficients, head)
            return total * scale
        outputs = model(**model_inputs)  # no labels: the model computes no loss of its own
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]  # (B, T, V)
        batch, length = labels.shape
        per_target = F.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.shape[-1]),
            labels[:, 1:].reshape(-1).to(logits.device),
            ignore_index=-100,
            reduction="none",
        ).view(batch, length - 1)
        numerator = loss_numerator(
            per_target,
            labels.to(logits.device),
            self.args.loss_normalization,
            loss_weights=weights,
            position_ids=inputs.get("position_ids"),
            cu_seq_lens=inputs.get("cu_seq_lens_q"),
        )
        loss = numerator * scale
        return (loss, outputs) if return_outputs else loss

    def _tree_loss(
        self, model: Any, inputs: dict[str, Any], return_outputs: bool, num_items_in_batch: Any, head: Any
    ) -> Any:
        """A prefix-tree row's loss (:class:`~packing_hf.tree_collator.PrefixTreeCollator`): the numerator of its
        (row, target, weight) pairs, each pair's cross-entropy computed once, over the step's denominator, times
        the processes (``num_items_in_batch``: training); alone (an evaluation call) over its own denominator.

        Under sequence parallelism the row is cut over the SP group (:meth:`_shard_row`) and this rank computes the
        pairs whose predicting rows lie in its shard (:func:`~packing_hf.shard_loss.shard_tree_pairs`): the group's
        numerators add up to the row's, over the step's denominator (each row counted once, by the group's first
        rank: :meth:`LossPolicy._tree_step`); an evaluation call's shares are summed over the group."""
        normalization = self.args.loss_normalization
        pairs = {key: inputs[key] for key in TREE_KEYS}
        model_inputs = {k: v for k, v in inputs.items() if k not in TREE_KEYS}
        model_inputs["use_cache"] = False
        if num_items_in_batch is None:  # the whole row's own denominator, before any cut
            scale = 1.0 / step_denominator(tree_loss_counts(pairs), normalization)
        else:
            scale = self.parallel_plan.world_size / float(num_items_in_batch)
        cut = self.loss_policy.cuts_rows
        if cut:
            model_inputs = self._shard_row(model, model_inputs, training_mode(model), num_items_in_batch)
            pairs = shard_tree_pairs(pairs, model_inputs[SHARD_KEY])
        if head is not None:
            rows, targets = pairs[TREE_KEYS[0]], pairs[TREE_KEYS[1]]
            coefficients = tree_coefficients(pairs, normalization)
            total, outputs = pairs_lm_loss(model, model_inputs, rows, targets, coefficients, head)
        else:
            outputs = model(**model_inputs)  # no labels: the model computes no loss of its own
            logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]  # (1, T, V)
            total = tree_numerator(logits, pairs, normalization)
        loss = total * scale
        if cut and num_items_in_batch is None:  # evaluation: the row's loss, the group's shares summed
            loss = loss.detach()
            torch.distributed.all_reduce(loss, group=self.parallel_plan.sp_group)
        return (loss, outputs) if return_outputs else loss
