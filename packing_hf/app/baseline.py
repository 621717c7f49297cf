"""The padded baseline of the main job: the same samples timed packed and padded, and a padded eval loss.

:func:`measure_throughput` times forward + backward of the same samples as packed batches and as stock
padded batches (interleaved, fastest of the repeats per batch); :func:`evaluate_loss` is a padded
forward (exact on any model) over fixed samples; :func:`padded_collator` is what stock ``Trainer`` +
``DataCollatorForSeq2Seq`` would feed the model.

>>> from types import SimpleNamespace
>>> padded_collator(SimpleNamespace(pad_token_id=0, padding_side="right")).label_pad_token_id
-100
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..strategies import padded_batches

__all__ = ["evaluate_loss", "measure_throughput", "padded_collator", "padded_efficiency"]


def padded_collator(tokenizer):
    """Stock padded batches: ``DataCollatorForSeq2Seq`` padding to the longest sample, labels with -100."""
    from transformers import DataCollatorForSeq2Seq

    return DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100, return_tensors="pt")


def padded_efficiency(lengths: np.ndarray, batch_size: int, seed: int) -> float:
    """Real / provisioned tokens of stock padded batches of ``batch_size`` samples in a shuffled order."""
    return padded_batches(
        lengths, batch_size, order=np.random.default_rng(seed).permutation(lengths.size)
    ).efficiency


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _autocast(device: torch.device, dtype: torch.dtype | None):
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


@contextlib.contextmanager
def _attention(model, implementation: str | None):
    """Temporarily run ``model`` with another attention implementation (restored on exit)."""
    current = getattr(model.config, "_attn_implementation", None)
    if implementation is None or implementation == current or not hasattr(model, "set_attn_implementation"):
        yield
        return
    model.set_attn_implementation(implementation)
    try:
        yield
    finally:
        model.set_attn_implementation(current)


def _time_batches(model, batches: list[dict[str, Any]], device: torch.device, autocast_dtype) -> float:
    """Seconds for forward + backward over ``batches`` (gradients discarded; weights unchanged)."""
    autocast = _autocast(device, autocast_dtype)
    _sync(device)
    start = time.perf_counter()
    for batch in batches:
        with autocast:
            loss = model(**_to_device(batch, device), use_cache=False).loss  # no KV cache in training
        loss.backward()
    _sync(device)
    elapsed = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return elapsed


def measure_throughput(
    model,
    samples: Sequence[dict[str, Any]],
    packed_groups: Sequence[Sequence[int]],
    *,
    padded_batch_size: int,
    packed_collator,
    padded_collator,
    device: torch.device | str | None = None,
    autocast_dtype: torch.dtype | None = None,
    padded_attn_implementation: str | None = "sdpa",
    repeats: int = 2,
) -> dict[str, float]:
    """Time the same samples as packed batches and as stock padded batches (forward + backward).

    Both runs see exactly ``samples``: the packed run as the batches ``packed_groups``, the padded run as
    consecutive batches of ``padded_batch_size`` samples in list order, padded to their longest sample
    (with ``attention_mask``) as stock ``Trainer`` + ``DataCollatorForSeq2Seq`` would, under
    ``padded_attn_implementation`` (stock SDPA by default, whatever the packed run uses). One short
    untimed warm-up per path comes first; then packed and padded batches are timed alternately,
    ``repeats`` times, and the fastest time of every batch counts.

    Args:
        model: a causal LM in training mode (its weights are not updated; gradients are cleared).
        samples: ``{"input_ids": [...], "labels": [...]}`` per sample, in the padded run's order.
        packed_groups: the indices into ``samples`` of every packed batch; together they hold every
            sample exactly once.
        padded_batch_size: samples per padded batch.
        packed_collator: e.g. :class:`~packing_hf.PaddingFreeCollator`.
        padded_collator: e.g. ``transformers.DataCollatorForSeq2Seq(tokenizer, padding=True)``.
        device: where to run (default: the model's device).
        autocast_dtype: e.g. ``torch.bfloat16`` for mixed precision, None for the model's dtype.
        padded_attn_implementation: attention for the padded run (None = keep the model's).
        repeats: timed passes over the batches (>= 1).

    Returns:
        ``real_tokens`` (the same for both), ``packed_tokens``/``padded_tokens`` (with padding),
        ``packed_seconds``/``padded_seconds``, ``packed_tokens_per_s``/``padded_tokens_per_s`` (real
        tokens per second) and ``speedup`` (packed / padded tokens per second).
    """
    if padded_batch_size < 1:
        raise ValueError(f"padded_batch_size must be >= 1, got {padded_batch_size}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    groups = [list(group) for group in packed_groups if len(group)]
    if not groups:
        raise ValueError("measure_throughput needs at least one non-empty packed batch")
    covered = sorted(i for group in groups for i in group)
    if covered != list(range(len(samples))):
        raise ValueError(
            f"packed_groups must hold every index of samples (0..{len(samples) - 1}) exactly once; "
            f"they hold {len(covered)} indices ({len(set(covered))} distinct)"
        )
    device = torch.device(device) if device is not None else next(model.parameters()).device
    packed = [packed_collator([samples[i] for i in group]) for group in groups]
    padded = [
        padded_collator(list(samples[start : start + padded_batch_size]))
        for start in range(0, len(samples), padded_batch_size)
    ]
    real_tokens = int(sum(len(sample["input_ids"]) for sample in samples))
    shortest = min(range(len(samples)), key=lambda i: len(samples[i]["input_ids"]))
    was_training = model.training
    model.train()
    packed_times = np.full((repeats, len(packed)), np.inf)
    padded_times = np.full((repeats, len(padded)), np.inf)
    try:
        _time_batches(model, [packed_collator([samples[shortest]])], device, autocast_dtype)
        with _attention(model, padded_attn_implementation):
            _time_batches(model, [padded_collator([samples[shortest]])], device, autocast_dtype)
        # Interleaved, batch by batch, so a load spike from another process hits both paths alike; the
        # fastest of the repeats of every batch is kept (the usual estimator on a shared machine).
        for r in range(repeats):
            for i in range(max(len(packed), len(padded))):
                if i < len(packed):
                    packed_times[r, i] = _time_batches(model, [packed[i]], device, autocast_dtype)
                if i < len(padded):
                    with _attention(model, padded_attn_implementation):
                        padded_times[r, i] = _time_batches(model, [padded[i]], device, autocast_dtype)
    finally:
        model.train(was_training)
    packed_seconds = float(packed_times.min(axis=0).sum())
    padded_seconds = float(padded_times.min(axis=0).sum())
    packed_tps = real_tokens / packed_seconds
    padded_tps = real_tokens / padded_seconds
    return {
        "real_tokens": real_tokens,
        "packed_batches": len(packed),
        "padded_batches": len(padded),
        "packed_tokens": int(sum(b["input_ids"].numel() for b in packed)),
        "padded_tokens": int(sum(b["input_ids"].numel() for b in padded)),
        "packed_seconds": packed_seconds,
        "padded_seconds": padded_seconds,
        "packed_tokens_per_s": packed_tps,
        "padded_tokens_per_s": padded_tps,
        "speedup": packed_tps / padded_tps,
    }


@torch.no_grad()
def evaluate_loss(
    model,
    samples: Sequence[dict[str, Any]],
    *,
    batch_size: int,
    collator,
    device: torch.device | str | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> float:
    """Mean next-token loss over every predicted token of ``samples`` (padded batches: exact on any model).

    Args:
        model: a causal LM; run in eval mode, its train/eval flag is restored.
        samples: ``{"input_ids": [...], "labels": [...]}`` per sample.
        batch_size: samples per forward.
        collator: builds a batch from samples, e.g. ``DataCollatorForSeq2Seq(tokenizer, padding=True)``.
        device: where to run (default: the model's device).
        autocast_dtype: e.g. ``torch.bfloat16``; None for the model's dtype.

    Returns:
        The token-weighted mean loss (each batch's mean loss weighted by its predicted tokens).
    """
    device = torch.device(device) if device is not None else next(model.parameters()).device
    autocast = _autocast(device, autocast_dtype)
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for start in range(0, len(samples), batch_size):
            batch = _to_device(collator(list(samples[start : start + batch_size])), device)
            predicted = int((batch["labels"][:, 1:] != -100).sum())
            if predicted == 0:
                continue
            with autocast:
                loss = model(**batch, use_cache=False).loss
            total += float(loss) * predicted
            count += predicted
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError("evaluate_loss: no sample has a trained (non -100) label")
    return total / count
