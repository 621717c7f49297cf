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
import functools
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..collator import PaddingFreeCollator
from ..strategies import padded_batches
from .report import _fmt_seconds, _plural

if TYPE_CHECKING:
    from .config import TrainConfig
    from .record_stream import RecordStream

__all__ = [
    "baseline_groups",
    "evaluate_loss",
    "length_sorted_batches",
    "mean_logged",
    "measure_throughput",
    "padded_collator",
    "padded_efficiency",
    "plan_baseline",
    "run_baseline",
    "samples_of",
]


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


def _micro_batches(batch: dict[str, Any], max_tokens: int | None) -> list[dict[str, Any]]:
    """Split a padded batch row-wise into micro-batches of at most ``max_tokens`` tokens (at least one row).

    Every row keeps its padded length, so the work (and the padding) is that of the whole batch; only the
    peak memory is bounded, as with gradient accumulation.
    """
    rows, length = batch["input_ids"].shape
    if max_tokens is None or rows * length <= max_tokens:
        return [batch]
    per = max(1, max_tokens // length)
    return [
        {k: v[start : start + per] if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        for start in range(0, rows, per)
    ]


def _time_batches(
    model, batches: list[dict[str, Any]], device: torch.device, autocast_dtype, max_tokens: int | None = None
) -> float:
    """Seconds for forward + backward over ``batches`` (gradients discarded; weights unchanged)."""
    autocast = _autocast(device, autocast_dtype)
    _sync(device)
    start = time.perf_counter()
    for batch in batches:
        for micro in _micro_batches(batch, max_tokens):
            with autocast:
                loss = model(**_to_device(micro, device), use_cache=False).loss  # no KV cache in training
            loss.backward()
            del loss
    _sync(device)
    elapsed = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return elapsed


def _bar(total: int, desc: str | None):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=desc is None, leave=False)


def measure_throughput(
    model,
    samples: Sequence[dict[str, Any]],
    packed_groups: Sequence[Sequence[int]],
    *,
    padded_batch_size: int | None,
    packed_collator,
    padded_collator,
    device: torch.device | str | None = None,
    autocast_dtype: torch.dtype | None = None,
    padded_attn_implementation: str | None = "sdpa",
    repeats: int = 2,
    max_tokens_per_micro_batch: int | None = None,
    desc: str | None = None,
) -> dict[str, float]:
    """Time the same samples as packed batches and as stock padded batches (forward + backward).

    Both runs see exactly ``samples``: the packed run as the batches ``packed_groups``, the padded run as
    the same groups (``padded_batch_size=None``: pairs of batches holding the same samples, so every pair
    gives a ratio) or as consecutive batches of ``padded_batch_size`` samples in list order, padded to
    their longest sample
    (with ``attention_mask``) as stock ``Trainer`` + ``DataCollatorForSeq2Seq`` would, under
    ``padded_attn_implementation`` (stock SDPA by default, whatever the packed run uses). One short
    untimed warm-up per path comes first; then packed and padded batches are timed alternately,
    ``repeats`` times, and the fastest time of every batch counts.

    Args:
        model: a causal LM in training mode (its weights are not updated; gradients are cleared).
        samples: ``{"input_ids": [...], "labels": [...]}`` per sample, in the padded run's order.
        packed_groups: the indices into ``samples`` of every packed batch; together they hold every
            sample exactly once.
        padded_batch_size: samples per padded batch; None = pad each packed group (pairs).
        packed_collator: e.g. :class:`~packing_hf.PaddingFreeCollator`.
        padded_collator: e.g. ``transformers.DataCollatorForSeq2Seq(tokenizer, padding=True)``.
        device: where to run (default: the model's device).
        autocast_dtype: e.g. ``torch.bfloat16`` for mixed precision, None for the model's dtype.
        padded_attn_implementation: attention for the padded run (None = keep the model's).
        repeats: timed passes over the batches (>= 1).
        max_tokens_per_micro_batch: run a padded batch holding more tokens (padding included) in
            row-wise micro-batches of at most this many tokens, as gradient accumulation would: the
            same work, with the peak memory of training (None = whole batches).
        desc: a progress bar's label (None: no bar).

    Returns:
        ``real_tokens`` (the same for both), ``packed_tokens``/``padded_tokens`` (with padding),
        ``packed_seconds``/``padded_seconds``, ``packed_tokens_per_s``/``padded_tokens_per_s`` (real
        tokens per second), ``speedup`` (packed / padded tokens per second), ``round_speedups`` (the
        same ratio in every timed round) and, for pairs, ``pair_speedups`` (padded / packed seconds of
        every pair, fastest of the rounds).

    >>> from transformers import AutoConfig, AutoModelForCausalLM
    >>> from transformers import AutoTokenizer
    >>> from packing_hf import PaddingFreeCollator
    >>> tok = AutoTokenizer.from_pretrained(str(SHARED_DATA / "smollm2_tokenizer"))
    >>> model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", vocab_size=32, hidden_size=16,
    ...     intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    >>> samples = [{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}, {"input_ids": [4, 5], "labels": [4, 5]}]
    >>> result = measure_throughput(model, samples, [[0, 1]], padded_batch_size=2,
    ...     packed_collator=PaddingFreeCollator(), padded_collator=padded_collator(tok),
    ...     max_tokens_per_micro_batch=3)
    >>> result["real_tokens"], result["packed_tokens"], result["padded_tokens"]
    (5, 5, 6)
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    packed, padded = _both_batches(
        samples, packed_groups, padded_batch_size, packed_collator, padded_collator
    )
    real_tokens = int(sum(len(sample["input_ids"]) for sample in samples))
    shortest = min(samples, key=lambda sample: len(sample["input_ids"]))
    warm_up = (packed_collator([shortest]), padded_collator([shortest]))
    device = torch.device(device) if device is not None else next(model.parameters()).device
    run = functools.partial(_time_batches, model, device=device, autocast_dtype=autocast_dtype)
    packed_times, padded_times = _interleaved_times(
        model,
        run,
        packed,
        padded,
        warm_up,
        padded_attn_implementation,
        repeats,
        max_tokens_per_micro_batch,
        desc,
    )
    packed_seconds = float(packed_times.min(axis=0).sum())
    padded_seconds = float(padded_times.min(axis=0).sum())
    packed_tps = real_tokens / packed_seconds
    padded_tps = real_tokens / padded_seconds
    fastest_packed, fastest_padded = packed_times.min(axis=0), padded_times.min(axis=0)
    pairs = (fastest_padded / fastest_packed).tolist() if padded_batch_size is None else None
    return {
        "repeats": repeats,
        "round_speedups": (padded_times.sum(axis=1) / packed_times.sum(axis=1)).tolist(),
        "pair_speedups": pairs,
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


def _both_batches(
    samples: Sequence[dict[str, Any]],
    packed_groups: Sequence[Sequence[int]],
    padded_batch_size: int | None,
    packed_collator: Any,
    padded_collator: Any,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The packed batches of ``packed_groups`` (which must hold every sample once) and the padded batches of
    the same samples (the same groups, or ``padded_batch_size`` samples in list order)."""
    if padded_batch_size is not None and padded_batch_size < 1:
        raise ValueError(f"padded_batch_size must be >= 1, got {padded_batch_size}")
    groups = [list(group) for group in packed_groups if len(group)]
    if not groups:
        raise ValueError("measure_throughput needs at least one non-empty packed batch")
    covered = sorted(i for group in groups for i in group)
    if covered != list(range(len(samples))):
        raise ValueError(
            f"packed_groups must hold every index of samples (0..{len(samples) - 1}) exactly once; "
            f"they hold {len(covered)} indices ({len(set(covered))} distinct)"
        )
    packed = [packed_collator([samples[i] for i in group]) for group in groups]
    if padded_batch_size is None:
        padded = [padded_collator([samples[i] for i in group]) for group in groups]
    else:
        padded = [
            padded_collator(list(samples[start : start + padded_batch_size]))
            for start in range(0, len(samples), padded_batch_size)
        ]
    return packed, padded


def _interleaved_times(
    model: Any,
    run: Callable[..., float],
    packed: list[dict[str, Any]],
    padded: list[dict[str, Any]],
    warm_up: tuple[dict[str, Any], dict[str, Any]],
    padded_attn_implementation: str | None,
    repeats: int,
    limit: int | None,
    desc: str | None,
) -> tuple[np.ndarray, np.ndarray]:
    """``(repeats, batches)`` seconds of every packed and padded batch after one untimed warm-up batch each.

    Interleaved, batch by batch, so a load spike from another process hits both paths alike; the caller
    keeps the fastest of the repeats of every batch (the usual estimator on a shared machine)."""
    was_training = model.training
    model.train()
    packed_times = np.full((repeats, len(packed)), np.inf)
    padded_times = np.full((repeats, len(padded)), np.inf)
    with _bar(2 + repeats * (len(packed) + len(padded)), desc) as bar:
        try:
            run([warm_up[0]])
            bar.update()
            with _attention(model, padded_attn_implementation):
                run([warm_up[1]])
            bar.update()
            for r in range(repeats):
                for i in range(max(len(packed), len(padded))):
                    if i < len(packed):
                        packed_times[r, i] = run([packed[i]])
                        bar.update()
                    if i < len(padded):
                        with _attention(model, padded_attn_implementation):
                            padded_times[r, i] = run([padded[i]], max_tokens=limit)
                        bar.update()
        finally:
            model.train(was_training)
    return packed_times, padded_times


def length_sorted_batches(lengths: Sequence[int] | np.ndarray, max_tokens: int) -> list[list[int]]:
    """Indices in batches of similar lengths whose padded size (rows x longest) is at most ``max_tokens``
    (a longer sample gets a batch of its own): little padding, bounded memory.

    >>> length_sorted_batches([5, 2, 9, 3], max_tokens=10)
    [[1, 3], [0], [2]]
    """
    order = np.argsort(np.asarray(lengths), kind="stable")
    batches: list[list[int]] = []
    current: list[int] = []
    for index in order.tolist():
        longest = int(lengths[index])  # ascending: the newcomer is the longest
        if current and (len(current) + 1) * longest > max_tokens:
            batches.append(current)
            current = []
        current.append(index)
    if current:
        batches.append(current)
    return batches


@torch.no_grad()
def evaluate_loss(
    model,
    samples: Sequence[dict[str, Any]],
    *,
    collator,
    max_tokens_per_batch: int,
    device: torch.device | str | None = None,
    autocast_dtype: torch.dtype | None = None,
    desc: str | None = None,
) -> float:
    """Mean next-token loss over every trained token of ``samples`` (padded batches: exact on any model).

    Samples are batched by length (see :func:`length_sorted_batches`), so a batch holds at most
    ``max_tokens_per_batch`` tokens, padding included: no more memory than a training step.

    Args:
        model: a causal LM; run in eval mode, its train/eval flag is restored.
        samples: ``{"input_ids": [...], "labels": [...]}`` per sample.
        collator: builds a padded batch, e.g. ``DataCollatorForSeq2Seq(tokenizer, padding=True)``.
        max_tokens_per_batch: the largest batch, padding included.
        device: where to run (default: the model's device).
        autocast_dtype: e.g. ``torch.bfloat16``; None for the model's dtype.
        desc: a progress bar's label (None: no bar).

    Returns:
        The token-weighted mean loss (each batch's mean loss weighted by its predicted tokens).

    >>> from transformers import AutoConfig, AutoModelForCausalLM
    >>> from transformers import AutoTokenizer
    >>> tok = AutoTokenizer.from_pretrained(str(SHARED_DATA / "smollm2_tokenizer"))
    >>> model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", vocab_size=32, hidden_size=16,
    ...     intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    >>> samples = [{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}, {"input_ids": [4, 5], "labels": [4, 5]}]
    >>> collate = padded_collator(tok)
    >>> 3.0 < evaluate_loss(model, samples, collator=collate, max_tokens_per_batch=8) < 4.0  # ~ln(32)
    True
    """
    device = torch.device(device) if device is not None else next(model.parameters()).device
    autocast = _autocast(device, autocast_dtype)
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    batches = length_sorted_batches([len(s["input_ids"]) for s in samples], max_tokens_per_batch)
    try:
        for indices in _iter_bar(batches, desc):
            batch = _to_device(collator([samples[i] for i in indices]), device)
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


def _iter_bar(items: Sequence[Any], desc: str | None):
    from tqdm.auto import tqdm

    return tqdm(items, desc=desc, disable=desc is None, leave=False)


# --------------------------------------------------------------------------------------------------
# Sizing the main job's baseline
# --------------------------------------------------------------------------------------------------


def baseline_groups(cfg, lengths: np.ndarray, count: int) -> tuple[list[int], list[list[int]]]:
    """The samples the padded baseline is timed on, as ``count`` batches (fewer if the data runs out).

    The samples are a random draw, as stock ``Trainer`` would draw them (the sampler's own batches would
    not do: multipack groups similar lengths to fill the budget, which would flatter the padded run).
    With multipack every batch takes the next samples of the draw while they fit in
    ``max_tokens_per_batch`` real tokens (budget-matched: a padded batch holds the real tokens of a packed
    one, not every sample padded to the longest of a giant batch); otherwise ``per_device_train_batch_size``
    samples. Each batch is timed packed (one row) and padded to its longest sample: a pair.

    Returns:
        ``(dataset indices, the batches as positions in those indices)``.
    """
    training = cfg.training
    seed = training.data_seed if training.data_seed is not None else training.seed
    order = np.random.default_rng(seed).permutation(lengths.size).tolist()
    groups: list[list[int]] = []
    current: list[int] = []
    held = 0
    budget = getattr(training, "max_tokens_per_batch", None) if cfg.batching == "multipack" else None
    for position, index in enumerate(order):
        length = int(lengths[index])
        full = (
            held + length > budget
            if budget is not None
            else len(current) == training.per_device_train_batch_size
        )
        if current and full:
            groups.append(current)
            if len(groups) == count:
                break
            current, held = [], 0
        current.append(position)
        held += length
    else:
        if current and len(groups) < count:
            groups.append(current)
    used = sum(len(group) for group in groups)
    return order[:used], groups


def _baseline_cost(
    lengths: np.ndarray, groups: list[list[int]], repeats: int, seconds_per_token: float
) -> float:
    """Estimated seconds of the baseline: every batch packed and padded to its longest, ``repeats`` times."""
    tokens = sum(int(lengths[g].sum()) + len(g) * int(lengths[g].max()) for g in map(np.asarray, groups))
    return repeats * tokens * seconds_per_token


def plan_baseline(
    share: float, lengths: np.ndarray, groups: list[list[int]], train_seconds: float, seconds_per_token: float
) -> tuple[int, int, float, float]:
    """How many of the baseline's batches, and how many timed rounds, fit in ``share`` of the training time
    (``lengths`` of the drawn samples, by position): ``(batches, rounds, estimated seconds, allowed
    seconds)``, batches 0 when not one pair fits. More batches come before more rounds: every pair gives a
    ratio, and their spread is reported."""
    allowed = share * train_seconds
    cost = 0.0
    for count in range(len(groups), 0, -1):
        for rounds in (2, 1):
            cost = _baseline_cost(lengths, groups[:count], rounds, seconds_per_token)
            if cost <= allowed:
                return count, rounds, cost, allowed
    return 0, 0, cost, allowed


def mean_logged(log_history: list[dict[str, Any]], key: str) -> float | None:
    values = [float(entry[key]) for entry in log_history if key in entry]
    return float(np.mean(values)) if values else None


def samples_of(dataset) -> list[dict[str, Any]]:
    return dataset.select_columns(["input_ids", "labels"]).with_format(None).to_list()


def run_baseline(
    cfg: TrainConfig,
    trainer,
    tokenizer,
    prepared,
    stream,
    lengths,
    summary,
    padded,
    step_tokens,
    device,
    autocast,
    say,
    *,
    progress: bool = True,
) -> tuple[dict[str, Any] | None, str]:
    """The padded baseline, sized to fit ``baseline_time_share`` of the training time: ``(the measurement
    or None when skipped, what was decided and why)``; ``progress``: show a progress bar.

    Under a launcher every process times it on its own copy of the model, sized the same way on every rank
    (``train_runtime`` is the main process's): the figures are one process's."""
    training = cfg.training
    count = cfg.job.baseline_batches
    pool = None
    if stream is not None:
        # no lengths of the whole stream: the baseline draws its samples from the stream's first ones
        pool = _stream_pool(stream, 2 * count * training.max_tokens_per_batch)
        lengths = np.array([len(sample["input_ids"]) for sample in pool], dtype=np.int64)
    order, groups = baseline_groups(cfg, lengths, count)
    trained_tokens = _trained_tokens(cfg, trainer.state.log_history, summary, lengths)
    train_seconds = summary["train_runtime"]
    share = cfg.baseline_time_share
    if not trained_tokens or not train_seconds > 0:
        return None, "padded baseline skipped: the training steps gave no speed to size it by"
    per_token = train_seconds / trained_tokens
    by_position = lengths[np.asarray(order, dtype=np.int64)]
    batches, rounds, cost, allowed = plan_baseline(share, by_position, groups, train_seconds, per_token)
    limit = f"baseline_time_share={share:g} of the training's {_fmt_seconds(train_seconds)}"
    if batches == 0:
        note = (
            f"padded baseline skipped: one batch packed and padded would take ~{_fmt_seconds(cost)}, more than "
            f"{limit}; raise baseline_time_share to measure it (baseline_batches=0 skips it quietly)"
        )
        say(note)
        return None, note
    groups = groups[:batches]
    used = sum(len(group) for group in groups)
    order = order[:used]
    shrunk = batches < len(groups) or batches < count or rounds < 2
    note = (
        f"padded baseline: {_plural(batches, 'batch', 'batches')} of random samples"
        + (f" (of baseline_batches={count})" if batches < count else "")
        + f", each timed packed and padded to its longest, {_plural(rounds, 'round')}: ~{_fmt_seconds(cost)} "
        f"estimated, within {limit}"
        + (" (shrunk to fit)" if shrunk else "")
        + "; micro-batches of at most the token budget, so no more memory than a training step"
    )
    say(note)
    samples = [pool[i] for i in order] if pool is not None else samples_of(prepared.dataset.select(order))
    # timed after training, on the model exactly as it was trained (attention included)
    result = measure_throughput(
        trainer.model,
        samples,
        groups,
        padded_batch_size=None,
        packed_collator=PaddingFreeCollator.for_tokenizer(tokenizer),
        padded_collator=padded,
        device=device,
        autocast_dtype=autocast,
        repeats=rounds,
        max_tokens_per_micro_batch=step_tokens,
        desc="Baseline" if progress else None,
    )
    return result, note


def _trained_tokens(
    cfg: TrainConfig, log_history: list[dict[str, Any]], summary: dict[str, Any], lengths
) -> float:
    """Real tokens one process's training steps ran on: from the packing metrics of the step logs (the whole
    run's, shared by the processes), else estimated from the token budget (and fill) or the batch size and the
    mean sample length (a process's batches; a sequence-parallel group cuts each one over its processes)."""
    training = cfg.training
    per_step = mean_logged(log_history, "real_tokens_per_step")
    if per_step:
        per_step /= training.world_size
    else:
        budget = getattr(training, "max_tokens_per_batch", None)
        if budget is not None:
            per_micro = budget * (summary.get("packing_efficiency") or 1.0)
        else:
            per_micro = training.per_device_train_batch_size * float(np.mean(lengths))
        per_step = per_micro * training.gradient_accumulation_steps / (getattr(training, "sp_size", 1) or 1)
    return per_step * summary["global_step"]


def _stream_pool(stream: RecordStream, tokens: int) -> list[dict[str, Any]]:
    """The stream's first samples, until they hold ``tokens`` tokens (or the source ends), read by a fresh
    pass of their own (the training stream's position is not touched)."""
    pool, total = [], 0
    for sample in stream.stream.iterate():
        pool.append({"input_ids": list(sample["input_ids"]), "labels": list(sample["labels"])})
        total += len(sample["input_ids"])
        if total >= tokens:
            break
    return pool
