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
- ``padded_batch_efficiency``: real tokens / (samples x longest), what padding the same batches would give;
- ``tree_token_ratio`` (prefix-tree rows, ``share_prefixes=True``): the samples' tokens, each alone, over the tokens
  the rows computed (2.0: every shared prefix halved the work). Real tokens are the rows' tokens there.

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
{'real_tokens': 4, 'emitted_tokens': 4, 'samples': 2, 'padded_tokens': 6, 'squared_lengths': 10}
>>> metrics = PackingMetrics(max_tokens_per_batch=8)
>>> metrics.update(batch.pop(STATS_KEY))
>>> metrics.compute(num_steps=1)
{'packing_efficiency': 0.5, 'real_tokens_per_step': 4.0, 'padding_avoided_per_step': 2.0, 'padded_batch_efficiency': 0.6667}
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from transformers import TrainerCallback

from ..flops import StepFlops, batch_sample_lengths, device_peak_tflops, flops_counter, step_time_percentiles
from ..shared_prefix import PREFIX_KEY
from ..tree_collator import tree_attended_squares

__all__ = [
    "COST_KEY",
    "SQUARES_KEY",
    "STATS_KEY",
    "TREE_TOKENS_KEY",
    "PackingMetrics",
    "PackingStatsCollator",
    "StepClock",
]

# Batch key carrying the counts from the collator to training_step, where it is popped.
STATS_KEY = "packing_hf_stats"
_FIELDS = ("real_tokens", "emitted_tokens", "samples", "padded_tokens")
COST_KEY = "predicted_cost"  # optional entry of the counts: the batch's cost under the cost model
# entry of the counts: sum of the squared lengths of the batch's samples (attention FLOPs); collators that
# cannot tell the samples apart leave it out, and no FLOPs are reported for the steps they make
SQUARES_KEY = "squared_lengths"
# entry of the counts of a prefix-tree row: its samples' tokens, each alone (real_tokens: the row's, computed once)
TREE_TOKENS_KEY = "tree_sample_tokens"


def _segment_lengths(feature: Mapping[str, Any]) -> list[int]:
    """Lengths of the samples in one feature: its ``seq_lengths`` (an offline-packed row) or its length."""
    seq_lengths = feature.get("seq_lengths")
    if seq_lengths is not None:
        return [int(n) for n in np.asarray(seq_lengths).reshape(-1)]
    return [len(feature["input_ids"])]


def _collator_stats(collator: Any) -> Any:
    """The running ``stats`` of ``collator``, or of the collator stock's ``RemoveColumnsCollator`` wraps (what the
    Trainer hands a DataLoader over a dataset that is not a ``datasets.Dataset``, e.g. a list); ``None`` without."""
    while not hasattr(collator, "stats") and hasattr(collator, "data_collator"):
        collator = collator.data_collator
    return getattr(collator, "stats", None)


class PackingStatsCollator:
    """Wrap a collator so every batch carries its packing counts under :data:`STATS_KEY`.

    The counts are Python ints: ``real_tokens`` (tokens of real samples), ``emitted_tokens``
    (``input_ids.numel()``, padding included), ``samples`` (sub-samples of offline-packed rows count one
    by one) and ``padded_tokens`` (``samples x longest``, the size of a right-padded batch of the same
    samples). For :class:`~packing_hf.PaddingFreeCollator` the real token and sample counts come from its
    own ``stats`` (exact under truncation, split and ``pad_to_multiple_of``; also where stock's
    ``RemoveColumnsCollator`` wraps it); for other collators they come from the features.

    Args:
        collator: the collator to wrap; called as ``collator(features)``.
        cost_model: a :class:`~packing_hf.CostModel`: the counts also carry the batch's predicted cost
            (:data:`COST_KEY`, a float).

    The counts also hold :data:`SQUARES_KEY`: the sum of the squared lengths of the samples as the model
    attends over them (segments of ``cu_seq_lens_q`` / ``position_ids``, the padding segment left out), for
    the attention FLOPs.

    >>> from packing_hf import PaddingFreeCollator
    >>> out = PackingStatsCollator(PaddingFreeCollator(pad_to_multiple_of=8))([{"input_ids": [1, 2, 3]}])
    >>> out[STATS_KEY]["real_tokens"], out[STATS_KEY]["emitted_tokens"], out[STATS_KEY][SQUARES_KEY]
    (3, 8, 9)
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
        own = _collator_stats(self.collator)
        before = dict(own) if isinstance(own, dict) else None
        batch = self.collator(features)
        if all("input_ids" in f or "seq_lengths" in f for f in features):
            lengths = [n for feature in features for n in _segment_lengths(feature)]
        else:  # raw samples tokenized by the collator itself (VisionSFTCollator): the row's own boundaries
            lengths = torch.diff(batch["cu_seq_lens_q"].reshape(-1)).tolist()
        emitted = int(batch["input_ids"].numel()) if isinstance(batch["input_ids"], torch.Tensor) else 0
        after = _collator_stats(self.collator)
        padding = 0
        if before is not None and isinstance(after, dict) and {"tokens", "samples"} <= after.keys():
            real, samples = after["tokens"] - before["tokens"], after["samples"] - before["samples"]
            padding = after.get("padding_tokens", 0) - before.get("padding_tokens", 0)
        else:
            real, samples = min(sum(lengths), emitted), len(lengths)
        batch[STATS_KEY] = {
            "real_tokens": int(real),
            "emitted_tokens": emitted,
            "samples": int(samples),
            "padded_tokens": int(samples * max(lengths, default=0)),
        }
        if PREFIX_KEY in batch and before is not None and "sample_tokens" in after:
            # a prefix-tree row: each segment attends over its ancestors too
            batch[STATS_KEY][TREE_TOKENS_KEY] = int(after["sample_tokens"] - before["sample_tokens"])
            batch[STATS_KEY][SQUARES_KEY] = tree_attended_squares(batch["cu_seq_lens_q"], batch[PREFIX_KEY])
        else:
            try:  # the samples as the model attends over them (truncated, split)
                attended = batch_sample_lengths(batch, padding=padding)
            except ValueError:
                # padding the layout does not set apart: no FLOPs for this batch, not wrong ones
                attended = None
            if attended is not None:
                batch[STATS_KEY][SQUARES_KEY] = int(sum(n * n for n in attended))
        if self.cost_model is not None:
            batch[STATS_KEY][COST_KEY] = self.cost_model.batch_cost(lengths)
        return batch


class _Clock:
    """Marks in time: ``perf_counter`` readings, or CUDA events on a CUDA device (recorded on the current
    stream, read at logging time: no synchronisation per step)."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.cuda = device is not None and torch.device(device).type == "cuda" and torch.cuda.is_available()

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        if not self.cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1000.0


class PackingMetrics:
    """Accumulate per-batch packing counts and step times and turn them into log metrics.

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
        self.flops = None  # the FLOPs coefficients (a CostModel), set by configure_flops
        self.peak_tflops: float | None = None
        self.peak_given = False  # peak_tflops came from the user: FLOPs must be countable, else refused
        self.devices = 1
        self._clock = _Clock()
        self._step_start: Any = None
        self._first_step_checked = False
        self.reset()

    def reset(self) -> None:
        """Forget everything accumulated since the last :meth:`compute`."""
        self.totals = dict.fromkeys(_FIELDS, 0)
        self.micro_batches = 0
        self.squares = 0  # sum of the squared sample lengths of the counted micro-batches
        self.counted = 0  # micro-batches whose counts held SQUARES_KEY
        self.tree_tokens = [0, 0]  # prefix-tree rows: their samples' tokens (each alone), the rows' tokens
        self.per_batch: list[list[float]] = []  # [predicted cost (nan: none), forward seconds (nan: none)]
        self.steps: list[tuple[Any, Any]] = []  # (start, end) marks of the optimizer steps since the last log

    def configure_flops(
        self,
        config: Any,
        *,
        peak_tflops: float | None = None,
        device: torch.device | str | None = None,
        devices: int = 1,
    ) -> None:
        """Count model FLOPs for ``config`` (no FLOPs where it lacks the sizes) and time steps on ``device``.

        Args:
            config: the trained model's config (:meth:`packing_hf.CostModel.from_config` reads it).
            peak_tflops: one device's peak (TFLOP/s) for the MFU; ``None``: a known CUDA device's dense bf16
                peak, else no MFU.
            device: where the steps run (CUDA: timed with events).
            devices: how many devices train together (the MFU divides by ``peak x devices``).
        """
        self.flops = flops_counter(config)
        self.peak_given = peak_tflops is not None
        if self.peak_given and self.flops is None:
            raise ValueError(
                f"peak_tflops={peak_tflops}: the model config ({type(config).__name__}) lacks hidden_size / "
                "num_hidden_layers / num_attention_heads, so no model FLOPs and no MFU can be counted; unset peak_tflops"
            )
        self.peak_tflops = peak_tflops if self.peak_given else device_peak_tflops(device) if device else None
        self.devices = max(1, int(devices))
        self._clock = _Clock(device)
        self._first_step_checked = False

    def start_step(self) -> None:
        """The next optimizer step starts now (training began, an epoch began, a log / save / eval ended)."""
        self._step_start = self._clock.mark()

    def end_step(self) -> None:
        """An optimizer step ended now; the next one starts here unless :meth:`start_step` says otherwise."""
        if self.peak_given and not self._first_step_checked:
            self._first_step_checked = True
            if self.counted == 0:
                raise ValueError(
                    "peak_tflops is set, but this trainer's training batches carry no per-sample lengths (a "
                    "collator packing_hf does not count, or preference pairs): no model FLOPs and no MFU can be "
                    "computed; unset peak_tflops (step times are still logged)"
                )
        end = self._clock.mark()
        if self._step_start is not None:
            self.steps.append((self._step_start, end))
        self._step_start = end

    def update(self, counts: Mapping[str, int]) -> None:
        """Add one micro-batch's counts (a dict built by :class:`PackingStatsCollator`)."""
        for key in _FIELDS:
            self.totals[key] += int(counts[key])
        self.micro_batches += 1
        if SQUARES_KEY in counts:
            self.squares += int(counts[SQUARES_KEY])
            self.counted += 1
        if TREE_TOKENS_KEY in counts:
            self.tree_tokens[0] += int(counts[TREE_TOKENS_KEY])
            self.tree_tokens[1] += int(counts["real_tokens"])
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
        """``(9,)`` float64: the totals, the micro-batch count, the squared sample lengths and the micro-batches
        counting them, the prefix-tree rows' sample and row tokens, for an all-reduce across ranks."""
        values = [self.totals[key] for key in _FIELDS] + [self.micro_batches, self.squares, self.counted]
        values += self.tree_tokens
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
            ``{}`` when no batch was seen, else the metrics of the module docstring (the packing ratios
            rounded to 4 decimals, as they are meant for logs; the FLOPs, TFLOP/s and MFU unrounded).
        """
        vector = self.as_tensor() if totals is None else totals.detach().double().cpu()
        real, emitted, samples, padded, micro_batches, squares, counted, tree_samples, tree_rows = (
            float(v) for v in vector.tolist()
        )
        rank_metrics = self.rank_metrics(self.rank_table()[None] if tables is None else tables)
        seconds = [self._clock.seconds(start, end) for start, end in self.steps]
        self.reset()
        if micro_batches == 0 or num_steps <= 0:
            return step_time_percentiles(seconds)
        capacity = micro_batches * self.max_tokens_per_batch if self.max_tokens_per_batch else emitted
        metrics = {
            "packing_efficiency": round(real / capacity, 4) if capacity else 0.0,
            "real_tokens_per_step": round(real / num_steps, 4),
            "padding_avoided_per_step": round(max(padded - emitted, 0.0) / num_steps, 4),
            "padded_batch_efficiency": round(real / padded, 4) if padded else 0.0,
            **rank_metrics,
            **step_time_percentiles(seconds),
        }
        if tree_rows:
            metrics["tree_token_ratio"] = round(tree_samples / tree_rows, 4)
        if self.flops is None or counted != micro_batches:
            # some micro-batch could not tell its samples apart: no FLOPs rather than wrong ones
            return metrics
        flops = StepFlops(self.flops.linear * real, self.flops.quadratic * squares)
        metrics["model_flops_per_step"] = flops.total / num_steps
        metrics["attention_flops_per_step"] = flops.attention / num_steps
        if len(seconds) == num_steps and sum(seconds) > 0:  # every step of the window timed
            tflops = flops.total / sum(seconds) / 1e12
            metrics["model_tflops_per_s"] = tflops
            if self.peak_tflops:
                metrics["mfu"] = tflops / (self.peak_tflops * self.devices)
        return metrics


class StepClock(TrainerCallback):
    """Times every optimizer step into a :class:`PackingMetrics` and sets up its FLOPs count when training
    begins (from the model's config, ``args.peak_tflops``, ``args.device`` and ``devices``: the devices that
    train together, :attr:`ParallelPlan.devices <packing_hf.integrations.parallel.ParallelPlan.devices>`).

    A step runs from the end of the previous one (or of the log, save or evaluation after it, or the start of
    the epoch) to its own end: what is timed is data loading, forwards, backwards and the optimizer step.

    >>> metrics = PackingMetrics(None)
    >>> clock = StepClock(metrics)
    >>> metrics.start_step(); metrics.end_step(); len(metrics.steps)
    1
    """

    def __init__(self, metrics: PackingMetrics, devices: int = 1) -> None:
        self.metrics = metrics
        self.devices = devices

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        # PEFT forwards .config; DDP wraps the model in .module
        config = getattr(getattr(model, "module", model), "config", None)
        self.metrics.configure_flops(
            config,
            peak_tflops=getattr(args, "peak_tflops", None),
            device=args.device,
            devices=self.devices,
        )
        self.metrics.start_step()

    def _restart(self, *args: Any, **kwargs: Any) -> None:
        self.metrics.start_step()

    on_epoch_begin = on_log = on_save = on_evaluate = _restart

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.metrics.end_step()
