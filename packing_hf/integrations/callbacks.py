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

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["STATS_KEY", "PackingMetrics", "PackingStatsCollator"]

# Batch key carrying the counts from the collator to training_step, where it is popped.
STATS_KEY = "packing_hf_stats"
_FIELDS = ("real_tokens", "emitted_tokens", "samples", "padded_tokens")


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

    >>> from packing_hf import PaddingFreeCollator
    >>> out = PackingStatsCollator(PaddingFreeCollator(pad_to_multiple_of=8))([{"input_ids": [1, 2, 3]}])
    >>> out[STATS_KEY]["real_tokens"], out[STATS_KEY]["emitted_tokens"]
    (3, 8)
    """

    def __init__(self, collator: Callable[[list[dict]], dict]) -> None:
        self.collator = collator

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

    def update(self, counts: Mapping[str, int]) -> None:
        """Add one micro-batch's counts (a dict built by :class:`PackingStatsCollator`)."""
        for key in _FIELDS:
            self.totals[key] += int(counts[key])
        self.micro_batches += 1

    def as_tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """``(5,)`` float64: the totals and the micro-batch count, for an all-reduce across ranks."""
        values = [self.totals[key] for key in _FIELDS] + [self.micro_batches]
        return torch.tensor(values, dtype=torch.float64, device=device)

    def compute(self, num_steps: int, totals: torch.Tensor | None = None) -> dict[str, float]:
        """Metrics over the last ``num_steps`` optimizer steps, then :meth:`reset`.

        Args:
            num_steps: optimizer steps since the previous call (> 0).
            totals: the :meth:`as_tensor` vector summed over ranks; default: this process's own.

        Returns:
            ``{}`` when no batch was seen, else the four metrics of the module docstring (rounded to 4
            significant decimals, as they are meant for logs).
        """
        vector = self.as_tensor() if totals is None else totals.detach().double().cpu()
        real, emitted, samples, padded, micro_batches = (float(v) for v in vector.tolist())
        self.reset()
        if micro_batches == 0 or num_steps <= 0:
            return {}
        capacity = micro_batches * self.max_tokens_per_batch if self.max_tokens_per_batch else emitted
        return {
            "packing_efficiency": round(real / capacity, 4) if capacity else 0.0,
            "real_tokens_per_step": round(real / num_steps, 4),
            "padding_avoided_per_step": round(max(padded - emitted, 0.0) / num_steps, 4),
            "padded_batch_efficiency": round(real / padded, 4) if padded else 0.0,
        }
