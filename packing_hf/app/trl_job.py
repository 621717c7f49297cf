"""The ``packing-hf train`` job of the TRL trainers: ``trainer: dpo | kto | reward | orpo | cpo | grpo | rloo``.

One YAML per run, as with ``trl dpo --config ...`` or axolotl's ``rl: dpo``: the data in TRL's formats
(:mod:`packing_hf.app.trl_data`, ``column_mapping`` for other names), the model (``model:``, a GGUF file or a
tiny ``model_type``), an optional ``peft:`` adapter, and the packed trainer its catalogue entry names
(:mod:`packing_hf.app.catalogue`) with its config (every TRL option is a key). Steps (:class:`TrlJob`, one method
each): data, tokenizer, model, reference model, trainer, train, save (model, ``packing_summary.json``, loss
curve), one summary table.

The reference model (DPO, KTO; GRPO / RLOO when ``beta > 0``) is handled as TRL does, with the one case TRL
cannot load fixed: with a ``peft:`` adapter there is none (TRL disables the adapter for reference log-probs);
otherwise TRL loads a second copy from the policy's ``_name_or_path``, which a model built from config (an
empty name: TRL's ``OSError: Repo id must use alphanumeric chars``) or a GGUF file (no ``gguf_file`` passed) do
not have. DPO and KTO get a frozen copy of the policy as ``ref_model`` instead (what TRL would load); GRPO /
RLOO, which take no ``ref_model``, get the initial policy saved to ``<output_dir>/reference_model`` for TRL to
load.

>>> from packing_hf.app.trl_job import reference_plan
>>> reference_plan("orpo", peft=False, beta=0.1, loadable=False)
'none: orpo has no reference model'
"""

from __future__ import annotations

import copy
import logging
import time
from pathlib import Path
from typing import Any

from .baseline import mean_logged
from .catalogue import trainer_entry
from .config import TrainConfig
from .data_first import DataFirst, read_trl_data
from .interrupt import resumed_note, train_until_interrupted
from .modeling import load_job_model, load_tokenizer, model_source, prepare_adapter
from .processes import main_first
from .report import describe_max_length_cut, print_summary
from .rewards import resolve_reward_funcs, reward_spec
from .sharded import save_whole
from .train import (
    SUMMARY_NAME,
    _begin_job,
    _describe_model,
    _finish_summary,
    _Phases,
    _restore_user_config,
    _stop_interrupted,
    _write_summary,
    run_training,
)

__all__ = ["TrlJob", "reference_plan", "run_job", "run_trl_training"]

logger = logging.getLogger(__name__)


def run_job(cfg: TrainConfig, *, print_fn=print, data_first: DataFirst | None = None) -> dict[str, Any]:
    """The job of ``cfg.job.trainer``: :func:`run_trl_training` for a trainer reading one of TRL's formats, else
    :func:`packing_hf.app.train.run_training` (``data_first``: the data read before the heavy imports, see
    :mod:`packing_hf.app.data_first`)."""
    if trainer_entry(cfg.job.trainer).reads_trl_format:
        return run_trl_training(cfg, print_fn=print_fn, data_first=data_first)
    return run_training(cfg, print_fn=print_fn, data_first=data_first)


def reference_plan(trainer: str, *, peft: bool, beta: float | None, loadable: bool) -> str:
    """How the reference model of ``trainer`` is made: ``"none: ..."``, ``"adapter: ..."``, ``"copy: ..."``,
    ``"trl: ..."`` (TRL loads it from the policy's name) or ``"saved: ..."`` (see the module docstring)."""
    reference = trainer_entry(trainer).reference
    if reference == "none":
        return f"none: {trainer} has no reference model"
    if reference == "with_beta" and not beta:
        return f"none: beta={beta or 0:g}, no KL term"
    if peft:
        return "adapter: the policy with its adapter disabled (TRL, no second model)"
    if reference == "ref_model":
        return "copy: a frozen copy of the policy as it starts (ref_model)"
    if loadable:
        return "trl: TRL loads the policy's checkpoint a second time"
    return "saved: the initial policy saved to <output_dir>/reference_model, loaded by TRL"


def _loadable(model) -> bool:
    name = str(getattr(model.config, "_name_or_path", "") or "")
    return bool(name) and (Path(name) / "config.json").is_file()


def run_trl_training(
    cfg: TrainConfig, *, print_fn=print, data_first: DataFirst | None = None
) -> dict[str, Any]:
    """Run the job of a TRL trainer for a parsed config (:class:`TrlJob`); print progress and the summary, return
    it (under a launcher the main process alone prints and writes, see :mod:`packing_hf.app.processes`).

    The summary holds the model and data description, ``trainer``, ``batching``, ``reference`` (how the
    reference model was made), ``peft`` (the adapter, or None), ``global_step``, ``train_runtime``, ``losses``
    (every logged training loss), ``rewards`` (GRPO / RLOO: every logged mean reward), ``seconds`` and
    ``output_dir``.
    """
    return TrlJob(cfg, print_fn=print_fn, data_first=data_first).run()


class TrlJob:
    """The job of a TRL trainer for a parsed config, one method per phase, run in order by :meth:`run`:

    :meth:`read` (the rows in TRL's format) -> :meth:`load` (tokenizer, model, adapter, reference model, reward
    functions) -> :meth:`plan` (the trainer, the summary so far) -> :meth:`train` -> :meth:`save` (the model,
    whole under a sharding engine and checked written) -> :meth:`finish` (``packing_summary.json``, the table).
    Each phase reads what the earlier ones left on the job.

    >>> [name for name in ("read", "load", "plan", "train", "save", "finish") if callable(getattr(TrlJob, name))]
    ['read', 'load', 'plan', 'train', 'save', 'finish']
    """

    def __init__(self, cfg: TrainConfig, *, print_fn=print, data_first: DataFirst | None = None) -> None:
        self.cfg = cfg
        self.entry = trainer_entry(cfg.job.trainer)
        if not self.entry.reads_trl_format:
            raise ValueError(
                f"run_trl_training runs the trainers of TRL's data formats; trainer: {cfg.job.trainer} is run by "
                "packing_hf.app.train.run_training"
            )
        self.print_fn = print_fn
        self.data_first = data_first
        self.training = cfg.training
        # under a launcher: the process that prints and writes (global rank 0); the others run the same steps
        self.main = self.training.process_index == 0
        self.output_dir = Path(self.training.output_dir)
        self.phases = _Phases()
        self.resume_from: str | None = None
        self.dataset = None
        self.records = ""
        self.tokenizer = None
        self.model = None
        self.user_use_cache = None
        self.user_attention: str | None = None
        self.peft_config = None
        self.reference = ""
        self.trainer_kwargs: dict[str, Any] = {}
        self.trainer = None
        self.summary: dict[str, Any] = {}

    def say(self, message: str) -> None:
        if self.main:
            self.print_fn(f"[packing-hf] {message}")

    def run(self) -> dict[str, Any]:
        """Every phase in order; returns the summary (see :func:`run_trl_training`)."""
        self.resume_from = _begin_job(self.cfg, self.say)
        self.read()
        self.load()
        self.plan()
        self.train()
        self.save()
        return self.finish()

    def read(self) -> None:
        """The training rows in TRL's format, checked (those read before the heavy imports when they are this
        config's)."""
        first, cfg = self.data_first, self.cfg
        self.phases.start("read")
        if first is not None and first.matches(cfg):
            self.dataset, self.records = first.trl_rows, first.trl_description  # read before the imports
        else:
            self.dataset, self.records = read_trl_data(cfg.data, cfg.job.trainer, self.say)

    def load(self) -> None:
        """The tokenizer, the model with the trainer's head (its config as loaded, restored before saving), the
        adapter, and the reference model and reward functions the trainer gets (:func:`_trainer_kwargs`)."""
        cfg, say = self.cfg, self.say
        self.phases.start("load")
        say(f"loading the tokenizer of {cfg.model.tokenizer_name_or_path or model_source(cfg.model)}")
        tokenizer = self.tokenizer = load_tokenizer(cfg.model)
        say(f"loading the model: {model_source(cfg.model)}")
        model = self.model = load_job_model(cfg, tokenizer, head=self.entry.head)
        self.user_use_cache = getattr(model.config, "use_cache", None)
        self.user_attention = getattr(model.config, "_attn_implementation", None)
        self.peft_config = prepare_adapter(cfg, model, tokenizer, say, self.entry.peft_task_type)
        self.reference, self.trainer_kwargs = _trainer_kwargs(cfg, model, tokenizer, self.peft_config, say)

    def plan(self) -> None:
        """The packed trainer (its sampler plans the batches) and the summary so far, with what TRL's
        ``max_length`` cut."""
        cfg, training, say = self.cfg, self.training, self.say
        self.phases.start("plan")
        trainer = self.trainer = self.entry.trainer_class()(
            model=self.model,
            args=training,
            train_dataset=self.dataset,
            processing_class=self.tokenizer,
            **self.trainer_kwargs,
        )
        summary = self.summary = _summary(cfg, trainer, self.records, self.reference)
        cut = describe_max_length_cut(trainer, getattr(training, "max_length", None))
        if cut is not None:  # what TRL's max_length cut or left out (counted in the trainer: max_length_stats)
            summary["max_length_cut"] = cut
            say(f"data: {cut}")
        say(
            f"model: {summary['model']} on {summary['device']}, {summary['precision']}, "
            f"attention {self.user_attention}"
        )

    def train(self) -> None:
        """Training (a first Ctrl-C saves a checkpoint and stops: :mod:`packing_hf.app.interrupt`), then its
        figures in the summary: steps, runtime, this run's losses and rewards."""
        training, trainer, summary, say = self.training, self.trainer, self.summary, self.say
        self.phases.start("train")
        say(
            f"training ({self.entry.trainer_name}): {training.max_steps if training.max_steps > 0 else 'all'} "
            "steps" + resumed_note(self.resume_from)
        )
        started = time.perf_counter()
        run = train_until_interrupted(trainer, self.resume_from, say)
        # a resumed run's log history holds the earlier run's logs too: the losses and rewards are this run's
        history = [e for e in trainer.state.log_history if e.get("step", 0) > run.started_at]
        summary.update(
            **run.summary(trainer.state.global_step),
            train_runtime=float(run.result.metrics.get("train_runtime", time.perf_counter() - started)),
            train_loss=float(run.result.training_loss),
            losses=[float(e["loss"]) for e in history if "loss" in e],
            rewards=[float(e["reward"]) for e in history if "reward" in e] or None,
            logged_packing_efficiency=mean_logged(history, "packing_efficiency"),
            attn_implementation=getattr(getattr(trainer.model, "config", None), "_attn_implementation", None),
        )
        summary["packing_efficiency"] = summary["logged_packing_efficiency"]
        if summary["rewards"]:
            say(f"mean reward per logged step: {', '.join(f'{r:.3f}' for r in summary['rewards'])}")
        if run.interrupted:  # the summary so far written, then TrainingInterrupted
            _stop_interrupted(run, summary, self.phases, trainer, self.output_dir, training.max_steps, say)

    def save(self) -> None:
        """The model (the adapter with ``peft:``) with the user's config (``use_cache``, attention) restored,
        unless ``save_model: false``."""
        _restore_user_config(self.model, self.user_use_cache, self.user_attention)
        self.summary["output_dir"] = None
        if not self.cfg.job.save_model:
            return
        self.phases.start("save")
        self.say(f"saving the {'adapter' if self.peft_config is not None else 'model'} to {self.output_dir}")
        save_whole(self.trainer, self.output_dir)  # whole under a sharding engine, checked written
        self.summary["output_dir"] = str(self.output_dir)

    def finish(self) -> dict[str, Any]:
        """Where the time and memory went, ``packing_summary.json`` and the loss curve (with ``save_model``),
        the table; returns the summary."""
        summary, phases = self.summary, self.phases
        phases.stop()
        if self.cfg.job.save_model:
            _write_summary(summary, phases, self.trainer, self.output_dir, self.say)
        else:
            _finish_summary(summary, phases)
        if self.main:
            print_summary(summary, self.print_fn)
        logger.debug("summary written to %s", self.output_dir / SUMMARY_NAME)
        return summary


def _trainer_kwargs(cfg: TrainConfig, model, tokenizer, peft_config, say) -> tuple[str, dict[str, Any]]:
    """The reference plan, and the trainer kwargs it and the config give (reference model, adapter, rewards)."""
    trainer_name, training = cfg.job.trainer, cfg.training
    plan = reference_plan(
        trainer_name,
        peft=peft_config is not None,
        beta=getattr(training, "beta", None),
        loadable=_loadable(model),
    )
    say(f"reference model: {plan}")
    kwargs: dict[str, Any] = {"peft_config": peft_config} if peft_config is not None else {}
    if plan.startswith("copy"):
        kwargs["ref_model"] = copy.deepcopy(model).eval().requires_grad_(False)
    elif plan.startswith("saved"):
        folder = Path(training.output_dir) / "reference_model"
        # written once (the saving process), read by TRL on every process once it is there
        with main_first(training, "saving the reference model", local=training.save_on_each_node):
            if training.should_save:
                model.save_pretrained(folder)
                tokenizer.save_pretrained(folder)
        model.config._name_or_path = str(folder)
    if trainer_entry(trainer_name).generates:
        spec = reward_spec(trainer_name, cfg.job.reward_funcs, cfg.data.dataset)  # checked when parsed
        kwargs["reward_funcs"] = resolve_reward_funcs(spec)
        say(f"reward functions: {', '.join(f.__name__ for f in kwargs['reward_funcs'])}")
    return plan, kwargs


def _summary(cfg: TrainConfig, trainer, records: str, plan: str) -> dict[str, Any]:
    """The run's summary before training: model, device, data, reference model and adapter."""
    training, trainer_name = cfg.training, cfg.job.trainer
    data = cfg.data
    device = training.device
    precision = "bf16" if training.bf16 else "fp16" if training.fp16 else "fp32"
    return {
        "config": cfg.source,
        "model": _describe_model(cfg.model, trainer.model),
        "device": str(device),
        "processes": training.world_size,
        "precision": precision,
        "trainer": trainer_name,
        "batching": cfg.batching,
        "max_tokens_per_batch": getattr(training, "max_tokens_per_batch", None),
        "dataset": data.dataset,
        "records": records,
        "reference": plan,
        "peft": cfg.model.peft,
        "baseline": None,
        "baseline_note": f"no padded baseline with trainer: {trainer_name} (benchmarks/ compares it with TRL's padded trainer)",
    }
