"""Packing metrics for the Trainer's logs: how full the packed batches are and how much padding they avoid.

Two pieces, so the numbers are exact per batch even with ``dataloader_num_workers > 0``:

- :class:`PackingStatsCollator` wraps the data collator and attaches a few counts to every training batch
  under :data:`STATS_KEY` (plain ints, computed where the batch is built, in the worker if there is one);
- :class:`PackingMetrics` accumulates those counts between two logging steps and turns them into
  metrics; the trainers pop the counts in ``training_step`` (they never reach the model) and add the
  metrics in ``log``, so every reporting integration (TensorBoard, W&B, ...) receives them.

Metrics (summed over data-parallel ranks, averaged over the optimizer steps since the last log):

- ``packing_efficiency``: real tokens / token capacity of the micro-batches, where the capacity of a
  micro-batch is ``max_tokens_per_batch`` with multipack, else the tokens the collator emitted;
- ``real_tokens_per_step``: real (non-padding) tokens per optimizer step;
- ``padding_avoided_per_step``: tokens a right-padded batch of the same samples would have added
  (``samples x longest - emitted``) per optimizer step;
- ``padded_batch_efficiency``: real tokens / (samples x longest), what padding the same batches would give.

Per micro-batch and rank (gathered from every rank at logging time; 1.0 on one process):

- ``rank_cost_max_over_mean``: with a cost model (``multipack_cost_model``), the slowest rank's predicted
  cost over the ranks' mean, summed over the micro-batches since the last log (1.0: no rank waits);
- ``rank_forward_time_max_over_mean`` and ``forward_seconds_max``: the same for the measured time of the
  forward pass + loss on every rank, and the slowest rank's mean forward time. The forward is timed, not the
  whole step, because under DDP the backward ends with the gradient all-reduce, where a fast rank waits for
  the slowest: its step time would hide the imbalance.

>>> from packing_hf import PaddingFreeCollator
>>> collate = PackingStatsCollator(PaddingFreeCollator())
>>> batch = collate([{"input_ids": [1, 2, 3]}, {"input_ids": [4]}])
>>> batch[STATS_KEY]
{'real_tokens': 4, 'emitted_tokens': 4, 'samples': 2, 'padded_tokens': 6}
>>> metrics = PackingMetrics(max_tokens_per_batch=8)
>>> metrics.update(batch.pop(STATS_KEY))
>>> metrics.compute(num_steps=1)
{'packing_efficiency': 0.5, 'real_tokens_per_step': 4.0, 'padding_avoided_per_step': 2.0, 'padded_batch_efficiency': 0.6667}
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["COST_KEY", "STATS_KEY", "PackingMetrics", "PackingStatsCollator"]

# Batch key carrying the counts from the collator to training_step, where it is popped.
STATS_KEY = "packing_hf_stats"
_FIELDS = ("real_tokens", "emitted_tokens", "samples", "padded_tokens")
COST_KEY = "predicted_cost"  # optional entry of the counts: the batch's cost under the cost model


def _segment_lengths(feature: Mapping[str, Any]) -> list[int]:
    """Lengths of the samples in one feature: its ``seq_lengths`` (an offline-packed row) or its length."""
    seq_lengths = feature.get("seq_lengths")
    if seq_lengths is not None:
        return [int(n) for n in np.asarray(seq_lengths).reshape(-1)]
    return [len(feature["input_ids"])]


class PackingStatsCollator:
    """Wrap a collator so every batch carries its packing counts under :data:`STATS_KEY`.

    The counts are Python ints: ``real_tokens`` (tokens of real samples), ``emitted_tokens``
    (``input_ids.numel()``, padding included), ``samples`` (sub-samples of offline-packed rows count one
    by one) and ``padded_tokens`` (``samples x longest``, the size of a right-padded batch of the same
    samples). For :class:`~packing_hf.PaddingFreeCollator` the real token and sample counts come from its
    own ``stats`` (exact under truncation, split and ``pad_to_multiple_of``); for other collators they
    come from the features.

    Args:
        collator: the collator to wrap; called as ``collator(features)``.
        cost_model: a :class:`~packing_hf.CostModel`: the counts also carry the batch's predicted cost
            (:data:`COST_KEY`, a float).

    >>> from packing_hf import PaddingFreeCollator
    >>> out = PackingStatsCollator(PaddingFreeCollator(pad_to_multiple_of=8))([{"input_ids": [1, 2, 3]}])
    >>> out[STATS_KEY]["real_tokens"], out[STATS_KEY]["emitted_tokens"]
    (3, 8)
    """

    def __init__(self, collator: Callable[[list[dict]], dict], cost_model: Any = None) -> None:
        self.collator = collator
        self.cost_model = cost_model

    @property
    def input_columns(self) -> tuple[str, ...]:
        """The dataset columns the wrapped collator consumes (kept by the trainers' column removal)."""
        return tuple(getattr(self.collator, "input_columns", ()))

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict:
        features = list(features)
        own = getattr(self.collator, "stats", None)
        before = dict(own) if isinstance(own, dict) else None
        batch = self.collator(features)
        if all("input_ids" in f or "seq_lengths" in f for f in features):
            lengths = [n for feature in features for n in _segment_lengths(feature)]
        else:  # raw samples tokenized by the collator itself (VisionSFTCollator): the row's own boundaries
            lengths = torch.diff(batch["cu_seq_lens_q"].reshape(-1)).tolist()
        emitted = int(batch["input_ids"].numel()) if isinstance(batch["input_ids"], torch.Tensor) else 0
        after = getattr(self.collator, "stats", None)
        if before is not None and isinstance(after, dict) and {"tokens", "samples"} <= after.keys():
            real, samples = after["tokens"] - before["tokens"], after["samples"] - before["samples"]
        else:
            real, samples = min(sum(lengths), emitted), len(lengths)
        batch[STATS_KEY] = {
            "real_tokens": int(real),
            "emitted_tokens": emitted,
            "samples": int(samples),
            "padded_tokens": int(samples * max(lengths, default=0)),
        }
        if self.cost_model is not None:
            batch[STATS_KEY][COST_KEY] = self.cost_model.batch_cost(lengths)
        return batch


class PackingMetrics:
    """Accumulate per-batch packing counts and turn them into log metrics.

    Args:
        max_tokens_per_batch: the multipack token budget (capacity of every micro-batch), or ``None``
            when batches are flattened by the collator alone (capacity = emitted tokens).

    >>> m = PackingMetrics(None)
    >>> m.update({"real_tokens": 6, "emitted_tokens": 8, "samples": 2, "padded_tokens": 10})
    >>> m.compute(num_steps=2)["real_tokens_per_step"]
    3.0
    """

    def __init__(self, max_tokens_per_batch: int | None) -> None:
        self.max_tokens_per_batch = max_tokens_per_batch
        self.reset()

    def reset(self) -> None:
        """Forget everything accumulated since the last :meth:`compute`."""
        self.totals = dict.fromkeys(_FIELDS, 0)
        self.micro_batches = 0
        self.per_batch: list[list[float]] = []  # [predicted cost (nan: none), forward seconds (nan: none)]

    def update(self, counts: Mapping[str, int]) -> None:
        """Add one micro-batch's counts (a dict built by :class:`PackingStatsCollator`)."""
        for key in _FIELDS:
            self.totals[key] += int(counts[key])
        self.micro_batches += 1
        self.per_batch.append([float(counts.get(COST_KEY, math.nan)), math.nan])

    def record_time(self, seconds: float) -> None:
        """The measured forward time of the micro-batch last given to :meth:`update`."""
        if self.per_batch:
            self.per_batch[-1][1] = float(seconds)

    def rank_table(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """``(micro_batches, 2)`` float64: every micro-batch's predicted cost and forward seconds, to gather."""
        return torch.tensor(self.per_batch, dtype=torch.float64, device=device).reshape(-1, 2)

    @staticmethod
    def rank_metrics(tables: torch.Tensor) -> dict[str, float]:
        """Spread across ranks from the gathered ``(num_ranks, micro_batches, 2)`` tables (rows of nan: none).

        >>> tables = torch.tensor([[[3.0, 0.2], [1.0, 0.1]], [[1.0, 0.1], [1.0, 0.1]]], dtype=torch.float64)
        >>> PackingMetrics.rank_metrics(tables)
        {'rank_cost_max_over_mean': 1.3333, 'rank_forward_time_max_over_mean': 1.2, 'forward_seconds_max': 0.15}
        """
        out = {}
        tables = tables.detach().double().cpu()
        for index, name in ((0, "rank_cost_max_over_mean"), (1, "rank_forward_time_max_over_mean")):
            values = tables[:, :, index]  # (num_ranks, micro_batches)
            values = values[:, ~torch.isnan(values).any(dim=0)]
            if values.numel() and float(values.mean(dim=0).sum()) > 0:
                out[name] = round(float(values.max(dim=0).values.sum() / values.mean(dim=0).sum()), 4)
                if index == 1:
                    out["forward_seconds_max"] = round(float(values.max(dim=0).values.mean()), 4)
        return out

    def as_tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """``(5,)`` float64: the totals and the micro-batch count, for an all-reduce across ranks."""
        values = [self.totals[key] for key in _FIELDS] + [self.micro_batches]
        return torch.tensor(values, dtype=torch.float64, device=device)

    def compute(
        self, num_steps: int, totals: torch.Tensor | None = None, tables: torch.Tensor | None = None
    ) -> dict[str, float]:
        """Metrics over the last ``num_steps`` optimizer steps, then :meth:`reset`.

        Args:
            num_steps: optimizer steps since the previous call (> 0).
            totals: the :meth:`as_tensor` vector summed over ranks; default: this process's own.
            tables: the :meth:`rank_table` of every rank, stacked ``(num_ranks, micro_batches, 2)``; default:
                this process's own (the rank metrics are then 1.0).

        Returns:
            ``{}`` when no batch was seen, else the four metrics of the module docstring (rounded to 4
            significant decimals, as they are meant for logs).
        """
        vector = self.as_tensor() if totals is None else totals.detach().double().cpu()
        real, emitted, samples, padded, micro_batches = (float(v) for v in vector.tolist())
        rank_metrics = self.rank_metrics(self.rank_table()[None] if tables is None else tables)
        self.reset()
        if micro_batches == 0 or num_steps <= 0:
            return {}
        capacity = micro_batches * self.max_tokens_per_batch if self.max_tokens_per_batch else emitted
        return {
            "packing_efficiency": round(real / capacity, 4) if capacity else 0.0,
            "real_tokens_per_step": round(real / num_steps, 4),
            "padding_avoided_per_step": round(max(padded - emitted, 0.0) / num_steps, 4),
            "padded_batch_efficiency": round(real / padded, 4) if padded else 0.0,
            **rank_metrics,
        }
