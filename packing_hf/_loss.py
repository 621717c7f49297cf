"""Per-token loss arithmetic of the loss contract: which sample every predicted token belongs to, its weight,
and the numerator / denominator of the three normalisations.

A causal LM at position ``t`` predicts ``labels[t + 1]``; a target is a position ``t + 1`` whose label is not
``-100``. Its weight is ``loss_weights[t + 1]`` (1 without weights), and it belongs to the sample (segment)
of position ``t + 1``: the segment boundaries of a packed ``[1, T]`` row (``cu_seq_lens_q``, or where
``position_ids`` restart), or the row of a padded ``[B, T]`` batch. With ``w`` the target weights,
``l`` the per-target losses and ``W_s`` the weight of sample ``s``, over one optimizer step (every
micro-batch of every rank):

- ``"token"``: ``sum(w * l) / sum(w)``;
- ``"sample"``: ``sum_s [sum_{t in s} w * l / W_s] / N`` with ``N`` the number of samples with ``W_s > 0``;
- ``"sample_sum"``: ``sum(w * l) / N``.

Each micro-batch contributes its numerator (:func:`loss_numerator`); the denominator is summed over the
whole step first (:func:`loss_counts`), so packing, accumulation and the number of ranks change nothing.

>>> labels = torch.tensor([[-100, 5, 6, -100, 7]])           # two samples packed in one row
>>> position_ids = torch.tensor([[0, 1, 2, 0, 1]])
>>> loss_counts(labels, position_ids=position_ids)          # (sum of target weights, samples)
(3.0, 2)
>>> per_target = torch.tensor([[1.0, 3.0, 0.0, 6.0]])         # (B, T - 1) losses of targets 1..4
>>> float(loss_numerator(per_target, labels, "sample", position_ids=position_ids))  # (1 + 3) / 2 + 6 / 1
8.0
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .varlen import cu_seqlens_to_starts

__all__ = [
    "LOSS_NORMALIZATIONS",
    "LOSS_WEIGHTS_KEY",
    "TREE_KEYS",
    "check_loss_normalization",
    "check_loss_weights",
    "is_tree_batch",
    "loss_counts",
    "loss_numerator",
    "step_denominator",
    "target_coefficients",
    "target_segments",
    "tree_coefficients",
    "tree_loss_counts",
    "tree_numerator",
]

#: what ``loss_normalization=`` accepts (see the module docstring)
LOSS_NORMALIZATIONS: tuple[str, ...] = ("token", "sample", "sample_sum")
#: the per-token weight column / batch key
LOSS_WEIGHTS_KEY = "loss_weights"
_IGNORE = -100


def check_loss_normalization(value: Any, name: str = "loss_normalization") -> str:
    """``value`` if it is one of :data:`LOSS_NORMALIZATIONS`, else a ``ValueError`` naming them.

    >>> check_loss_normalization("sample")
    'sample'
    """
    if value not in LOSS_NORMALIZATIONS:
        raise ValueError(f"{name}={value!r}: it must be one of {list(LOSS_NORMALIZATIONS)}")
    return value


def check_loss_weights(value: Any, length: int, where: str) -> np.ndarray:
    """One sample's ``loss_weights`` as a float64 array ``(length,)``, or an error naming ``where``
    (e.g. ``"sample 3"`` or ``"record 17"``), the position and the fix: a weight per token of ``input_ids``,
    each finite and ``>= 0``.

    >>> check_loss_weights([1, 0.5], 2, "sample 0").tolist()
    [1.0, 0.5]
    >>> check_loss_weights([1.0, float("nan")], 2, "record 4")
    Traceback (most recent call last):
    ...
    ValueError: record 4: loss_weights[1] = nan; a loss weight must be a finite number >= 0 (0 = not trained)
    """
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    if isinstance(value, str | bytes) or not isinstance(value, Sequence | np.ndarray):
        raise TypeError(
            f"{where}: loss_weights must be a list of floats (one per token of input_ids), "
            f"got {type(value).__name__}"
        )
    try:
        weights = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise TypeError(f"{where}: loss_weights must hold only numbers (one float per token)") from None
    if weights.ndim != 1 or weights.size != length:
        got = weights.size if weights.ndim == 1 else f"shape {weights.shape}"
        raise ValueError(
            f"{where}: loss_weights has {got} values but input_ids has {length} tokens; "
            "give one weight per token of input_ids"
        )
    bad = ~np.isfinite(weights) | (weights < 0)
    if bad.any():
        pos = int(np.argmax(bad))
        raise ValueError(
            f"{where}: loss_weights[{pos}] = {weights[pos]}; a loss weight must be a finite number >= 0 "
            "(0 = not trained)"
        )
    return weights


def target_segments(
    labels: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    cu_seq_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """The sample every target belongs to: ``(B, T - 1)`` int64 ids, unique across rows.

    Args:
        labels: ``(B, T)`` int64 (only its shape and device are read).
        position_ids: ``(B, T)`` int64 or ``None``: a new sample starts where positions do not continue
            (``p[t] != p[t - 1] + 1``).
        cu_seq_lens: ``(n + 1,)`` int32 boundaries of a packed ``[1, T]`` row (preferred when given).

    Without either, every row is one sample (a padded batch).

    >>> target_segments(torch.zeros(1, 5), cu_seq_lens=torch.tensor([0, 3, 5])).tolist()
    [[0, 0, 1, 1]]
    """
    batch, length = labels.shape
    device = labels.device
    if cu_seq_lens is not None and batch == 1:
        starts = cu_seqlens_to_starts(cu_seq_lens.to(device), length)
    elif position_ids is not None:
        position_ids = position_ids.to(device).expand(batch, length)
        starts = torch.ones(batch, length, dtype=torch.bool, device=device)
        starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    else:
        starts = torch.zeros(batch, length, dtype=torch.bool, device=device)
        starts[:, 0] = True
    local = torch.cumsum(starts.long(), dim=1) - 1  # (B, T) sample index inside its row
    rows = torch.arange(batch, device=device)[:, None] * length
    return (local + rows)[:, 1:]


def _target_weights(labels: torch.Tensor, loss_weights: torch.Tensor | None) -> torch.Tensor:
    """``(B, T - 1)`` float32: the weight of every target, 0 where the label is ignored."""
    targets = labels[:, 1:]
    if loss_weights is None:
        weights = torch.ones(targets.shape, dtype=torch.float32, device=labels.device)
    else:
        weights = loss_weights[:, 1:].to(device=labels.device, dtype=torch.float32)
    return torch.where(targets != _IGNORE, weights, torch.zeros_like(weights))


def loss_counts(
    labels: torch.Tensor,
    loss_weights: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seq_lens: torch.Tensor | None = None,
) -> tuple[float, int]:
    """What one micro-batch adds to the step's denominators: ``(sum of target weights, samples)``.

    A sample counts when its targets weigh more than 0 (a sample with every label masked, a stream's padding
    batch or ``pad_to_multiple_of`` padding count nothing).

    Args:
        labels: ``(B, T)`` int64, ``-100`` = not a target.
        loss_weights: ``(B, T)`` float, aligned with ``labels``, or ``None`` (every weight 1).
        position_ids, cu_seq_lens: the sample boundaries (see :func:`target_segments`).

    >>> loss_counts(torch.tensor([[-100, 4, 4], [-100, -100, -100]]))
    (2.0, 1)
    """
    weights = _target_weights(labels, loss_weights).double()  # float64: exact sums over the step
    segments = target_segments(labels, position_ids, cu_seq_lens).flatten()
    per_sample = torch.zeros(labels.numel(), dtype=torch.float64, device=labels.device)
    per_sample.index_add_(0, segments, weights.flatten())
    return float(weights.sum()), int((per_sample > 0).sum())


def _sample_weights(
    labels: torch.Tensor,
    weights: torch.Tensor,
    position_ids: torch.Tensor | None,
    cu_seq_lens: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(segments (N,), sample_weight (B * T,))``: each target's sample, and every sample's summed weight."""
    segments = target_segments(labels, position_ids, cu_seq_lens).flatten()
    sample_weight = torch.zeros(labels.numel(), dtype=weights.dtype, device=weights.device)
    sample_weight.index_add_(0, segments, weights.flatten())
    return segments, sample_weight


def loss_numerator(
    per_target_loss: torch.Tensor,
    labels: torch.Tensor,
    normalization: str,
    loss_weights: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seq_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """One micro-batch's share of the step's loss numerator (a scalar that keeps the graph).

    Args:
        per_target_loss: ``(B, T - 1)`` float, the loss of predicting ``labels[:, 1:]`` (any value where the
            label is ignored: it adds exactly 0).
        labels: ``(B, T)`` int64.
        normalization: one of :data:`LOSS_NORMALIZATIONS`.
        loss_weights, position_ids, cu_seq_lens: as in :func:`loss_counts`.

    Divide by :func:`step_denominator` of the step's summed :func:`loss_counts` to get the normalised loss.

    >>> labels = torch.tensor([[-100, 1, 1, 1]])
    >>> float(loss_numerator(torch.tensor([[2.0, 4.0, 6.0]]), labels, "sample_sum"))
    12.0
    """
    check_loss_normalization(normalization, "normalization")
    weights = _target_weights(labels, loss_weights)
    # where, not a product: an ignored target's loss may be inf/nan and must add exactly 0
    weighted = torch.where(weights > 0, per_target_loss.float() * weights, torch.zeros_like(weights))
    if normalization != "sample":
        return weighted.sum()
    segments, sample_weight = _sample_weights(labels, weights, position_ids, cu_seq_lens)
    sample_loss = torch.zeros(labels.numel(), dtype=weighted.dtype, device=weighted.device)
    sample_loss = sample_loss.index_add(0, segments, weighted.flatten())
    safe = torch.where(sample_weight > 0, sample_weight, torch.ones_like(sample_weight))
    return (sample_loss / safe).sum()


def target_coefficients(
    labels: torch.Tensor,
    normalization: str,
    loss_weights: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seq_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(B, T - 1)`` float32 ``c`` with ``loss_numerator(l, ...) == sum(c * l)``: the factor of every target's
    loss in the numerator (its weight, over its sample's weight for ``"sample"``; 0 where ignored).

    Computed on a whole row, then cut, it lets every shard of the row add its own targets' share exactly
    (sequence parallelism: :func:`packing_hf.shard_loss.sequence_parallel_loss`).

    >>> target_coefficients(torch.tensor([[-100, 1, 1, -100, 1]]), "sample", cu_seq_lens=torch.tensor([0, 3, 5])).tolist()
    [[0.5, 0.5, 0.0, 1.0]]
    """
    check_loss_normalization(normalization, "normalization")
    weights = _target_weights(labels, loss_weights)
    if normalization != "sample":
        return weights
    segments, sample_weight = _sample_weights(labels, weights, position_ids, cu_seq_lens)
    per_target = sample_weight[segments].view_as(weights)
    return torch.where(weights > 0, weights / torch.where(weights > 0, per_target, 1.0), 0.0)


def step_denominator(totals: Sequence[float], normalization: str) -> float:
    """The step's denominator from the ``(target weight, samples)`` summed over all its micro-batches and
    ranks; 1 when nothing is trained, so that such a step has a zero loss rather than NaN.

    >>> step_denominator((10.0, 3), "sample")
    3.0
    """
    normalization = check_loss_normalization(normalization, "normalization")
    value = float(totals[0] if normalization == "token" else totals[1])
    return value if value > 0 and math.isfinite(value) else 1.0


# ---- prefix-tree rows: targets as (row, target token, weight) pairs --------------------------------------------

#: the batch keys of a prefix-tree row's targets (:class:`packing_hf.tree_collator.PrefixTreeCollator`): per pair
#: the predicting row, the target token, its summed weight and its ``"sample"`` coefficient; and the samples counted
TREE_KEYS: tuple[str, ...] = (
    "tree_rows",
    "tree_targets",
    "tree_weights",
    "tree_sample_weights",
    "tree_samples",
)


def is_tree_batch(batch: Any) -> bool:
    """Whether ``batch`` is a prefix-tree row carrying its targets as pairs (:data:`TREE_KEYS`).

    >>> is_tree_batch({"tree_rows": None}), is_tree_batch({"labels": None})
    (True, False)
    """
    return hasattr(batch, "keys") and TREE_KEYS[0] in batch


def tree_loss_counts(batch: Any) -> tuple[float, int]:
    """What one prefix-tree micro-batch adds to the step's denominators: ``(sum of target weights, samples)``,
    the same numbers :func:`loss_counts` gives for the same samples packed flat (every sample's targets counted,
    a shared target once per sample training it).

    >>> loss_counts(torch.tensor([[-100, 4, 4], [-100, 4, 5]]))
    (4.0, 2)
    >>> tree_loss_counts({"tree_weights": torch.tensor([2.0, 1.0, 1.0]), "tree_samples": torch.tensor(2)})
    (4.0, 2)
    """
    weights = batch[TREE_KEYS[2]]
    return float(weights.double().sum()), int(batch[TREE_KEYS[4]])


def tree_coefficients(batch: Any, normalization: str) -> torch.Tensor:
    """``(P,)`` float32: the factor of every pair's cross-entropy in the micro-batch's numerator (the pairs' version
    of :func:`target_coefficients`): its summed weight, or for ``"sample"`` its summed ``w / W_s``.

    >>> batch = {"tree_weights": torch.tensor([2.0, 1.0]), "tree_sample_weights": torch.tensor([1.0, 0.5])}
    >>> tree_coefficients(batch, "sample").tolist(), tree_coefficients(batch, "sample_sum").tolist()
    ([1.0, 0.5], [2.0, 1.0])
    """
    check_loss_normalization(normalization, "normalization")
    return batch[TREE_KEYS[3] if normalization == "sample" else TREE_KEYS[2]].float()


def tree_numerator(logits: torch.Tensor, batch: Any, normalization: str) -> torch.Tensor:
    """``sum_p c_p * CE(logits[0, tree_rows[p]], tree_targets[p])``: the loss numerator of a prefix-tree row's pairs
    (:data:`TREE_KEYS`, or this rank's of a row cut over a sequence-parallel group:
    :func:`packing_hf.shard_loss.shard_tree_pairs`), ``c`` from :func:`tree_coefficients`.

    Args:
        logits: ``(1, T, V)`` the model's output on the row (or on the shard whose pairs ``batch`` holds).
        batch: the pairs; ``normalization``: as in :func:`tree_coefficients`.

    Returns:
        A float32 scalar that keeps the graph (a pair of coefficient 0 adds exactly 0).

    >>> pairs = {"tree_rows": torch.tensor([0, 0]), "tree_targets": torch.tensor([1, 2]),
    ...          "tree_weights": torch.tensor([2.0, 1.0]), "tree_sample_weights": torch.tensor([1.0, 0.5])}
    >>> round(float(tree_numerator(torch.zeros(1, 1, 4), pairs, "sample")), 4)  # 1.5 * log(4)
    2.0794
    """
    coefficients = tree_coefficients(batch, normalization).to(logits.device)
    picked = logits[0].index_select(0, batch[TREE_KEYS[0]].to(logits.device)).float()  # (P, V)
    per_pair = torch.nn.functional.cross_entropy(picked, batch[TREE_KEYS[1]].to(logits.device), reduction="none")
    return torch.where(coefficients != 0, per_pair * coefficients, torch.zeros_like(per_pair)).sum()
