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

Which of these computes a micro-batch's loss is one value, its :class:`LossRoute`: the step's route is decided
when the step's micro-batches are counted (:meth:`PackingLossMixin._get_num_items_in_batch`), and
:meth:`PackingLossMixin.loss_route` refines it per call (evaluation, logits wanted), together with the chunked
head that serves it, if any.

>>> PackingLossMixin.__name__
'PackingLossMixin'
"""

from __future__ import annotations

import enum
import logging
from typing import Any

import torch
import torch.nn.functional as F
import transformers

from .._loss import LOSS_WEIGHTS_KEY, loss_counts, loss_numerator, step_denominator, target_coefficients
from ..registry import router_loss_coefficient
from .args import PackingArguments
from .chunked_head import causal_lm_loss, resolve_head
from .parallel import ParallelPlan, training_mode

__all__ = ["LossRoute", "PackingLossMixin"]

logger = logging.getLogger(__name__)


def _causal_labels(batch: dict[str, Any]) -> torch.Tensor | None:
    """``labels`` ``(B, T)``, rebuilt from ``shift_labels`` (``shift_labels[t] = labels[t + 1]``) if only those
    are given."""
    labels = batch.get("labels")
    shift = batch.get("shift_labels")
    if shift is None or not isinstance(shift, torch.Tensor):
        return labels
    first = torch.full_like(shift[:, :1], -100)
    return torch.cat([first, shift[:, :-1]], dim=1)


def _step_count(count: Any) -> Any:
    """Stock's target count of a training step (``num_items_in_batch``), 1 where the step has no target.

    Every loss of such a step is a sum over no target, 0: over 1 it stays 0 with zero gradients and is logged as
    0 (as :func:`packing_hf._loss.step_denominator` makes packing_hf's own denominators), where over 0 it would be
    0/0 = NaN, whose backward turns the chunked head's zero gradients into NaN (``0 * inf``) and which the Trainer
    logs as the previous losses' mean (``logging_nan_inf_filter``).

    >>> _step_count(torch.tensor(0)), _step_count(torch.tensor(7)), _step_count(None)
    (tensor(1), tensor(7), None)
    """
    if isinstance(count, torch.Tensor):
        return torch.where(count > 0, count, torch.ones_like(count))  # on the device: no host sync
    if isinstance(count, int | float) and count <= 0:
        return 1
    return count


class LossRoute(enum.Enum):
    """Which code computes a micro-batch's loss (one value per call; the chunked head may serve any but ``STOCK``).

    >>> LossRoute.SEQUENCE_PARALLEL.value
    'sequence_parallel'
    """

    #: the next ``compute_loss`` in the class chain (stock's, TRL's), on the model's full logits
    STOCK = "stock"
    #: the model's own causal-LM loss, scaled as ``transformers.Trainer.compute_loss`` scales it
    MODEL = "model"
    #: packing_hf's numerator over the step's denominator (``loss_normalization``, ``loss_weights``; docs/loss.md)
    PACKED = "packed"
    #: this process's shard of a row cut over the sequence-parallel group, its share of the row's loss
    SEQUENCE_PARALLEL = "sequence_parallel"


class PackingLossMixin:
    """``loss_normalization`` and ``loss_weights``; part of
    :class:`~packing_hf.integrations.trainer.PackingTrainerMixin`."""

    args: PackingArguments
    parallel_plan: ParallelPlan

    def _loss_setup(self) -> None:
        """Called by the set-up: refuse what the loss contract cannot honour, each with its fix."""
        self._packing_step_route = LossRoute.STOCK  # the training step's route (set per step)
        self._packing_counting = False
        self._packing_user_loss_scaled = self.loss_is_scaled_for_ga
        if self.args.loss_normalization != "token":
            self._check_own_loss(f"loss_normalization={self.args.loss_normalization!r}")
        if self.parallel_plan.sequence_parallel and not self.wording.own_loss:
            from ..attention.sequence_parallel import check_sequence_parallel_router_loss

            # a cut row's loss is computed from its shards' logits (integrations/sequence_parallel.py)
            model = getattr(self, "model", None)
            check_sequence_parallel_router_loss(
                getattr(model, "config", None), self.parallel_plan.sp_size, model
            )

    def _check_own_loss(self, what: str) -> None:
        args = self.args
        conflicts = []
        if self.wording.own_loss:  # declared by the trainer class (PackedTrainerSkeleton)
            conflicts.append(
                f"{self.stock}, whose loss is one term per {self.wording.loss_term}: leave loss_normalization='token'"
            )
        if self.compute_loss_func is not None:
            conflicts.append("a compute_loss_func (it would replace the normalised loss): drop it")
        if args.label_smoothing_factor:
            conflicts.append(f"label_smoothing_factor={args.label_smoothing_factor}: set it to 0")
        if getattr(args, "loss_type", "nll") != "nll":
            conflicts.append(f"TRL's loss_type={args.loss_type!r}: use loss_type='nll'")
        model = getattr(self, "model", None)
        coefficient = router_loss_coefficient(getattr(model, "config", None), model)
        if coefficient or getattr(self, "aux_loss_enabled", False):
            # the loss here is the logits' alone (the model is called without labels)
            conflicts.append(
                f"a router load-balancing loss (MoE: output_router_logits=True, router_aux_loss_coef={coefficient}), "
                "which the model adds to its own loss and this one would leave out: set output_router_logits=False "
                "(or router_aux_loss_coef=0)"
            )
        if self.parallel_plan.engine == "data_parallel":
            conflicts.append(f"{args.n_gpu} GPUs in one process (DataParallel): launch one process per GPU")
        for name, size in self.parallel_plan.shards_sample_tokens.items():
            conflicts.append(f"{name}={size}: data parallelism only")
        if conflicts:
            raise ValueError(
                f"{what} computes the loss in packing_hf's Trainer, which does not support "
                + "; ".join(conflicts)
            )

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> tuple[list, Any]:
        """Stock's; the step's denominator is counted here (see :meth:`_get_num_items_in_batch`)."""
        self._packing_counting = True
        try:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        finally:
            self._packing_counting = False

    def _get_num_items_in_batch(self, batch_samples: list, device: Any) -> Any:
        """In training, the denominator of the step: stock's token count for ``"token"`` without weights, else
        the step's summed target weight (``"token"``) or sample count, all-reduced over the ranks."""
        if not self._packing_counting:
            return super()._get_num_items_in_batch(batch_samples, device)
        normalization = self.args.loss_normalization
        plan = self.parallel_plan
        single = plan.world_size == 1
        if normalization == "token" and single and not any(LOSS_WEIGHTS_KEY in b for b in batch_samples):
            # the default on one process: stock's count, nothing else to agree on
            self._packing_step_route = LossRoute.STOCK
            self.loss_is_scaled_for_ga = self._packing_user_loss_scaled
            return _step_count(super()._get_num_items_in_batch(batch_samples, device))
        # (any batch has weights, sum of target weights, samples), summed over micro-batches then ranks
        local = torch.zeros(3, dtype=torch.float64)
        for batch in batch_samples:
            labels = _causal_labels(batch)
            weights = batch.get(LOSS_WEIGHTS_KEY)
            if not isinstance(labels, torch.Tensor):
                if normalization != "token" or weights is not None:
                    raise ValueError(
                        f"loss_normalization={normalization!r} (or a loss_weights column) needs 'labels' in every "
                        f"training batch, got the keys {sorted(batch)}; use a collator that returns labels"
                    )
                continue
            target_weight, samples = loss_counts(
                labels, weights, batch.get("position_ids"), batch.get("cu_seq_lens_q")
            )
            local += torch.tensor([float(weights is not None), target_weight, samples], dtype=torch.float64)
        if not plan.counts_rows:
            local.zero_()  # sequence parallelism: the group's ranks share the row, its first rank counts it
        totals = local.to(device)
        if not single:
            # every rank must take the same path this step (a stream's padding batch carries no weights)
            totals = self.accelerator.reduce(totals, reduction="sum")
        # a cut row's loss is always computed here, unless the trainer computes its own (DPO: per pair, over the
        # group); else here when normalised otherwise than stock or weighted
        if plan.sequence_parallel and not self.wording.own_loss:
            self._packing_step_route = LossRoute.SEQUENCE_PARALLEL
        elif normalization != "token" or bool(totals[0] > 0):
            self._packing_step_route = LossRoute.PACKED
        else:
            self._packing_step_route = LossRoute.STOCK
        if self._packing_step_route is LossRoute.STOCK:
            self.loss_is_scaled_for_ga = self._packing_user_loss_scaled
            return _step_count(super()._get_num_items_in_batch(batch_samples, device))
        self._check_own_loss(f"loss_normalization={normalization!r} with loss_weights")
        # the loss below is divided by the step's denominator: the Trainer must not divide it by the steps again
        self.loss_is_scaled_for_ga = True
        return torch.tensor(
            step_denominator(totals[1:].tolist(), normalization), dtype=torch.float64, device=device
        )

    # ---- the chunked LM head ---------------------------------------------------------------------

    def _chunked_head(self, model: Any) -> Any:
        """The model's ``(lm_head, LogitHead)`` when its loss can be computed in chunks, else ``None`` (the
        reason logged once)."""
        if not getattr(self.args, "chunked_loss", False):
            return None
        reason = None
        plan = self.parallel_plan
        if self.compute_loss_func is not None:
            reason = "a compute_loss_func reads the logits"
        elif self.label_smoother is not None:
            reason = f"label_smoothing_factor={self.args.label_smoothing_factor}"
        elif plan.chunked_head_refusal is not None:
            reason = f"{plan.chunked_head_refusal} ({plan.describe()})"
        elif plan.shards_sample_tokens:
            reason = f"accelerate cuts a sample over processes ({plan.shards_sample_tokens})"
        else:
            resolved = resolve_head(model, plan)
            if not isinstance(resolved, str):
                return resolved
            reason = resolved
        logged = self.__dict__.setdefault("_chunked_refusals", set())
        if reason not in logged:
            logged.add(reason)
            logger.warning("chunked_loss: the full logits are computed for the loss, because %s", reason)
        return None

    def _stock_loss_is_causal_lm(self, inputs: dict[str, Any], return_outputs: bool) -> bool:
        """Whether stock's ``compute_loss`` would return the model's own causal-LM loss (the next
        ``compute_loss`` in the class hierarchy is ``transformers.Trainer``'s, the batch has labels, and the
        outputs' logits are not wanted)."""
        if return_outputs and not getattr(self, "_packing_loss_only", False):
            return False
        if not isinstance(_causal_labels(inputs), torch.Tensor):
            return False
        mro = type(self).__mro__
        for cls in mro[mro.index(PackingLossMixin) + 1 :]:
            if "compute_loss" in cls.__dict__:
                return cls is transformers.Trainer
        return False

    def _chunked_stock_loss(
        self,
        model: Any,
        inputs: dict[str, Any],
        num_items_in_batch: Any,
        resolved: Any,
        metrics: bool = False,
    ) -> tuple[torch.Tensor, Any, Any]:
        """Stock's loss (the model's causal-LM loss, scaled as ``transformers.Trainer.compute_loss`` scales it)
        from the chunked head: ``(loss, LogitStats, outputs)``."""
        labels = _causal_labels(inputs)
        model_inputs = {k: v for k, v in inputs.items() if k not in ("labels", "shift_labels")}
        total, stats, outputs = causal_lm_loss(
            model, model_inputs, labels, resolved=resolved, metrics=metrics
        )
        if self.model_accepts_loss_kwargs and num_items_in_batch is not None:
            loss = total / torch.as_tensor(num_items_in_batch, device=total.device)
            if self.args.average_tokens_across_devices:
                loss = loss * (self.parallel_plan.world_size // self.get_tp_size())
        else:
            # the model's mean over its targets; in training a micro-batch without one has the loss 0, zero
            # gradients (as _step_count), in evaluation NaN as the model's own (stock's evaluation skips it)
            count = stats.count.clamp(min=1) if training_mode(model) else stats.count
            loss = total / count
        return loss, stats, outputs

    def prediction_step(
        self, model: Any, inputs: dict[str, Any], prediction_loss_only: bool, *args: Any, **kwargs: Any
    ):
        # evaluation wants only the loss: the chunked head may answer (its outputs carry no logits)
        self._packing_loss_only = prediction_loss_only
        try:
            return super().prediction_step(model, inputs, prediction_loss_only, *args, **kwargs)
        finally:
            self._packing_loss_only = False

    def loss_route(
        self, model: Any, inputs: dict[str, Any], return_outputs: bool, num_items_in_batch: Any
    ) -> tuple[LossRoute, Any]:
        """``(route, head)`` of this call: the step's route (training) or the call's (evaluation), and the resolved
        chunked LM head serving it (``None``: full logits)."""
        loss_only = not return_outputs or getattr(self, "_packing_loss_only", False)
        training = training_mode(model)
        # sequence parallelism: training, and evaluation of the loss alone (logits for compute_metrics: whole rows)
        if self.parallel_plan.sequence_parallel and not self.wording.own_loss:
            if training or getattr(self, "_packing_loss_only", False):
                return LossRoute.SEQUENCE_PARALLEL, self._chunked_head(model) if loss_only else None
        if self._packing_step_route is not LossRoute.STOCK and training and num_items_in_batch is not None:
            return LossRoute.PACKED, None if return_outputs else self._chunked_head(model)
        if self._stock_loss_is_causal_lm(inputs, return_outputs):
            head = self._chunked_head(model)
            if head is not None:
                return LossRoute.MODEL, head
        return LossRoute.STOCK, None

    def compute_loss(
        self, model: Any, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        """This call's loss by its :class:`LossRoute`: stock's (``loss_weights`` removed: the model never sees
        them), the model's own from the chunked head, packing_hf's (this micro-batch's numerator over the step's
        denominator ``num_items_in_batch``, times the number of processes) or a sequence-parallel shard's share
        (see the module docstring)."""
        weights = inputs.pop(LOSS_WEIGHTS_KEY, None)
        route, head = self.loss_route(model, inputs, return_outputs, num_items_in_batch)
        if route is LossRoute.SEQUENCE_PARALLEL:
            return self._sequence_parallel_loss(
                model, inputs, weights, num_items_in_batch, return_outputs, head
            )
        if route is LossRoute.MODEL:
            loss, _, outputs = self._chunked_stock_loss(model, inputs, num_items_in_batch, head)
            return (loss, outputs) if return_outputs else loss
        if route is LossRoute.STOCK:
            # evaluation: eval_loss stays the unweighted token mean (see docs/loss.md)
            return super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        labels = _causal_labels(inputs)
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
