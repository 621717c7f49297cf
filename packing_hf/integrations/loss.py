"""The loss contract of the packing trainers: ``loss_normalization`` and ``loss_weights``, the same optimizer
step whatever the packing, gradient accumulation, number of processes or streaming (see ``docs/loss.md``).

``"token"`` without a ``loss_weights`` column is stock's own loss, untouched. Otherwise the Trainer computes
the loss itself: when it gathers the micro-batches of an optimizer step (``get_batch_samples``) it sums every
micro-batch's target weight and sample count (:func:`packing_hf._loss.loss_counts`) and all-reduces the sums
over the ranks, so the denominator of the step is known before the first backward; each micro-batch's loss is
then its own numerator (:func:`packing_hf._loss.loss_numerator`) over that denominator, times the number of
processes (DDP averages gradients over ranks). The logged ``loss`` is thus the normalised loss of the step.

>>> PackingLossMixin.__name__
'PackingLossMixin'
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .._loss import LOSS_WEIGHTS_KEY, loss_counts, loss_numerator, step_denominator
from .args import PackingArguments

__all__ = ["PackingLossMixin"]


def _causal_labels(batch: dict[str, Any]) -> torch.Tensor | None:
    """``labels`` ``(B, T)``, rebuilt from ``shift_labels`` (``shift_labels[t] = labels[t + 1]``) if only those
    are given."""
    labels = batch.get("labels")
    shift = batch.get("shift_labels")
    if shift is None or not isinstance(shift, torch.Tensor):
        return labels
    first = torch.full_like(shift[:, :1], -100)
    return torch.cat([first, shift[:, :-1]], dim=1)


class PackingLossMixin:
    """``loss_normalization`` and ``loss_weights``; part of
    :class:`~packing_hf.integrations.trainer.PackingTrainerMixin`."""

    args: PackingArguments

    def _loss_setup(self) -> None:
        """Called by the set-up: refuse what the loss contract cannot honour, each with its fix."""
        self._packing_loss_active = False  # this step's loss is computed here (set per step)
        self._packing_counting = False
        self._packing_user_loss_scaled = self.loss_is_scaled_for_ga
        if self.args.loss_normalization != "token":
            self._check_own_loss(f"loss_normalization={self.args.loss_normalization!r}")

    def _check_own_loss(self, what: str) -> None:
        args = self.args
        conflicts = []
        if self.own_loss:  # declared by the trainer class (PackingTrainerMixin)
            conflicts.append(
                f"{self.stock}, whose loss is one term per {self.loss_term}: leave loss_normalization='token'"
            )
        if self.compute_loss_func is not None:
            conflicts.append("a compute_loss_func (it would replace the normalised loss): drop it")
        if args.label_smoothing_factor:
            conflicts.append(f"label_smoothing_factor={args.label_smoothing_factor}: set it to 0")
        if getattr(args, "loss_type", "nll") != "nll":
            conflicts.append(f"TRL's loss_type={args.loss_type!r}: use loss_type='nll'")
        if args.n_gpu > 1:
            conflicts.append(f"{args.n_gpu} GPUs in one process (DataParallel): launch one process per GPU")
        parallelism = getattr(self.accelerator, "parallelism_config", None)
        for name in ("tp_size", "cp_size", "sp_size"):
            if parallelism is not None and (getattr(parallelism, name, 1) or 1) > 1:
                conflicts.append(f"{name}={getattr(parallelism, name)}: data parallelism only")
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
        single = self.accelerator.num_processes == 1
        if normalization == "token" and single and not any(LOSS_WEIGHTS_KEY in b for b in batch_samples):
            # the default on one process: stock's count, nothing else to agree on
            self._packing_loss_active = False
            self.loss_is_scaled_for_ga = self._packing_user_loss_scaled
            return super()._get_num_items_in_batch(batch_samples, device)
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
        totals = local.to(device)
        if not single:
            # every rank must take the same path this step (a stream's padding batch carries no weights)
            totals = self.accelerator.reduce(totals, reduction="sum")
        self._packing_loss_active = normalization != "token" or bool(totals[0] > 0)
        if not self._packing_loss_active:
            self.loss_is_scaled_for_ga = self._packing_user_loss_scaled
            return super()._get_num_items_in_batch(batch_samples, device)
        self._check_own_loss(f"loss_normalization={normalization!r} with loss_weights")
        # the loss below is divided by the step's denominator: the Trainer must not divide it by the steps again
        self.loss_is_scaled_for_ga = True
        return torch.tensor(
            step_denominator(totals[1:].tolist(), normalization), dtype=torch.float64, device=device
        )

    def compute_loss(
        self, model: Any, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        """Stock's (``loss_weights`` removed: the model never sees them), or, when this step's loss is packing_hf's,
        this micro-batch's numerator over the step's denominator ``num_items_in_batch``, times the number of
        processes."""
        weights = inputs.pop(LOSS_WEIGHTS_KEY, None)
        if not (self._packing_loss_active and model.training and num_items_in_batch is not None):
            # evaluation: eval_loss stays the unweighted token mean (see docs/loss.md)
            return super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        labels = _causal_labels(inputs)
        model_inputs = {k: v for k, v in inputs.items() if k not in ("labels", "shift_labels")}
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
        loss = numerator * (self.accelerator.num_processes / float(num_items_in_batch))
        return (loss, outputs) if return_outputs else loss
