"""The ``packing-hf train`` job of the TRL trainers: ``trainer: dpo | kto | reward | orpo | cpo | grpo | rloo``.

One YAML per run, as with ``trl dpo --config ...`` or axolotl's ``rl: dpo``: the data in TRL's formats
(:mod:`packing_hf.app.trl_data`, ``column_mapping`` for other names), the model (``model:``, a GGUF file or a
tiny ``model_type``), an optional ``peft:`` adapter, and the packed trainer of that name from
:mod:`packing_hf.integrations` with its config (every TRL option is a key). Steps: data, tokenizer, model,
reference model, train, save (model, ``packing_summary.json``, loss curve), one summary table.

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
from .config import TRL_JOB_TRAINERS, TrainConfig, check_model
from .data_first import DataFirst, read_trl_data
from .interrupt import resume_checkpoint, resumed_note, train_until_interrupted
from .modeling import load_job_model, load_tokenizer, model_source, prepare_adapter
from .processes import main_first
from .report import describe_max_length_cut, print_summary
from .rewards import resolve_reward_funcs, reward_spec
from .sharded import save_whole
from .train import (
    SUMMARY_NAME,
    _describe_model,
    _Phases,
    _restore_user_config,
    _stop_interrupted,
    _write_summary,
    run_training,
)

__all__ = ["reference_plan", "run_job", "run_trl_training"]

logger = logging.getLogger(__name__)

_CLASSES = {
    "dpo": "DPOTrainer",
    "kto": "KTOTrainer",
    "reward": "RewardTrainer",
    "orpo": "ORPOTrainer",
    "cpo": "CPOTrainer",
    "grpo": "GRPOTrainer",
    "rloo": "RLOOTrainer",
}


def run_job(cfg: TrainConfig, *, print_fn=print, data_first: DataFirst | None = None) -> dict[str, Any]:
    """The job of ``cfg.job.trainer``: :func:`run_trl_training` for the TRL trainers, else
    :func:`packing_hf.app.train.run_training` (``data_first``: the data read before the heavy imports, see
    :mod:`packing_hf.app.data_first`)."""
    if cfg.job.trainer in TRL_JOB_TRAINERS:
        return run_trl_training(cfg, print_fn=print_fn, data_first=data_first)
    return run_training(cfg, print_fn=print_fn, data_first=data_first)


def reference_plan(trainer: str, *, peft: bool, beta: float | None, loadable: bool) -> str:
    """How the reference model of ``trainer`` is made: ``"none: ..."``, ``"adapter: ..."``, ``"copy: ..."``,
    ``"trl: ..."`` (TRL loads it from the policy's name) or ``"saved: ..."`` (see the module docstring)."""
    if trainer in ("reward", "orpo", "cpo"):
        return f"none: {trainer} has no reference model"
    if trainer in ("grpo", "rloo") and not beta:
        return f"none: beta={beta or 0:g}, no KL term"
    if peft:
        return "adapter: the policy with its adapter disabled (TRL, no second model)"
    if trainer in ("dpo", "kto"):
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
    """Run the job of a TRL trainer for a parsed config; print progress and the summary, return it (under a
    launcher the main process alone prints and writes, see :mod:`packing_hf.app.processes`).

    The summary holds the model and data description, ``trainer``, ``batching``, ``reference`` (how the
    reference model was made), ``peft`` (the adapter, or None), ``global_step``, ``train_runtime``, ``losses``
    (every logged training loss), ``rewards`` (GRPO / RLOO: every logged mean reward), ``seconds`` and
    ``output_dir``.
    """
    from transformers import set_seed

    from .. import integrations

    trainer_name, training = cfg.job.trainer, cfg.training
    main = training.process_index == 0

    def say(message: str) -> None:
        if main:
            print_fn(f"[packing-hf] {message}")

    check_model(cfg.model, cfg.source)
    resume_from = resume_checkpoint(cfg.job.resume, training.resume_from_checkpoint, str(training.output_dir))
    phases = _Phases()
    set_seed(training.seed)
    for note in cfg.notes:
        say(note)
    if resume_from is not None:
        say(f"resuming from {resume_from} (model, optimizer, scheduler, data position)")

    phases.start("read")
    if data_first is not None and data_first.matches(cfg):
        dataset, records = data_first.trl_rows, data_first.trl_description  # read before the imports
    else:
        dataset, records = read_trl_data(cfg.data, trainer_name, say)

    phases.start("load")
    say(f"loading the tokenizer of {cfg.model.tokenizer_name_or_path or model_source(cfg.model)}")
    tokenizer = load_tokenizer(cfg.model)
    say(f"loading the model: {model_source(cfg.model)}")
    model = load_job_model(cfg, tokenizer, head="score" if trainer_name == "reward" else "causal")
    user_use_cache = getattr(model.config, "use_cache", None)
    user_attention = getattr(model.config, "_attn_implementation", None)
    peft_config = prepare_adapter(
        cfg, model, tokenizer, say, "SEQ_CLS" if trainer_name == "reward" else "CAUSAL_LM"
    )
    plan, kwargs = _trainer_kwargs(cfg, model, tokenizer, peft_config, say)

    phases.start("plan")
    cls = getattr(integrations, _CLASSES[trainer_name])
    trainer = cls(model=model, args=training, train_dataset=dataset, processing_class=tokenizer, **kwargs)
    summary = _summary(cfg, trainer, records, plan)
    cut = describe_max_length_cut(trainer, getattr(training, "max_length", None))
    if cut is not None:  # what TRL's max_length cut or left out (counted in the trainer: max_length_stats)
        summary["max_length_cut"] = cut
        say(f"data: {cut}")
    say(
        f"model: {summary['model']} on {summary['device']}, {summary['precision']}, attention {user_attention}"
    )

    phases.start("train")
    say(
        f"training ({_CLASSES[trainer_name]}): {training.max_steps if training.max_steps > 0 else 'all'} steps"
        + resumed_note(resume_from)
    )
    run = _train(trainer, resume_from, summary, say)

    output_dir = Path(training.output_dir)
    if run.interrupted:
        _stop_interrupted(run, summary, phases, trainer, output_dir, training.max_steps, say)
    _restore_user_config(model, user_use_cache, user_attention)
    summary["output_dir"] = None
    if cfg.job.save_model:
        phases.start("save")
        say(f"saving the {'adapter' if peft_config is not None else 'model'} to {output_dir}")
        save_whole(trainer, output_dir)  # whole under a sharding engine, checked written
        summary["output_dir"] = str(output_dir)
    phases.stop()
    if cfg.job.save_model:
        _write_summary(summary, phases, trainer, output_dir, say)
    else:
        from .train import _finish_summary

        _finish_summary(summary, phases)
    if main:
        print_summary(summary, print_fn)
    logger.debug("summary written to %s", output_dir / SUMMARY_NAME)
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
    if trainer_name in ("grpo", "rloo"):
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


def _train(trainer, resume_from: str | None, summary: dict[str, Any], say):
    """Train (a first Ctrl-C saves a checkpoint and stops: :mod:`packing_hf.app.interrupt`), and record the
    steps, runtime, losses, rewards and fill in ``summary``; returns the :class:`TrainRun`."""
    started = time.perf_counter()
    run = train_until_interrupted(trainer, resume_from, say)
    result = run.result
    # a resumed run's log history holds the earlier run's logs too: the losses and rewards are this run's
    history = [e for e in trainer.state.log_history if e.get("step", 0) > run.started_at]
    summary.update(
        **run.summary(trainer.state.global_step),
        train_runtime=float(result.metrics.get("train_runtime", time.perf_counter() - started)),
        train_loss=float(result.training_loss),
        losses=[float(e["loss"]) for e in history if "loss" in e],
        rewards=[float(e["reward"]) for e in history if "reward" in e] or None,
        logged_packing_efficiency=mean_logged(history, "packing_efficiency"),
        attn_implementation=getattr(getattr(trainer.model, "config", None), "_attn_implementation", None),
    )
    summary["packing_efficiency"] = summary["logged_packing_efficiency"]
    if summary["rewards"]:
        say(f"mean reward per logged step: {', '.join(f'{r:.3f}' for r in summary['rewards'])}")
    return run
