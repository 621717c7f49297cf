"""What ``packing-hf train`` does for a model a sharding engine holds (DeepSpeed ZeRO-3, FSDP): count it whole,
evaluate it before training, save it whole and check that the save wrote it.

Under ZeRO-3 the model is partitioned at construction (``deepspeed.zero.Init``), so a parameter holds this
process's part of the tensor; under FSDP2 the model is whole until ``train()`` shards it. Every function here is
called on every process of a launch (the gathers are collectives), :func:`check_saved` on the main one. Every job
of ``packing-hf train`` (``trainer: trainer | sft`` and the TRL trainers) saves through :func:`save_whole`.

>>> import torch
>>> whole_numel(torch.nn.Parameter(torch.zeros(2, 3)))
6
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

__all__ = [
    "ModelNotSaved",
    "check_saved",
    "save_whole",
    "whole_before_training",
    "whole_numel",
    "whole_zero3_save",
]


def whole_numel(parameter) -> int:
    """Elements of a parameter whole: a ZeRO-3 partition (built under ``deepspeed.zero.Init``) holds this process's
    part of it, an empty tensor or a slice; ``ds_numel`` is the whole's (an FSDP2 ``DTensor`` counts its whole)."""
    return int(getattr(parameter, "ds_numel", parameter.numel()))


# DeepSpeed's switch for saving a ZeRO-3 model whole, and its older name
_ZERO3_GATHER = ("stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save")


def whole_zero3_save(cfg: Any, origin) -> None:
    """A ZeRO-3 ``deepspeed`` config saves the trained model whole: ``stage3_gather_16bit_weights_on_model_save``
    set true where it is not set (with a note), refused by name where it is false, since the job saves a model
    that loads with ``from_pretrained`` (without it the save writes DeepSpeed's partitioned checkpoint, with a
    warning, and no model). Nothing to do with ``save_model: false`` or another stage.
    """
    ds_config = getattr(cfg.training, "hf_deepspeed_config", None)
    if ds_config is None or not ds_config.is_zero3() or not cfg.job.save_model:
        return
    zero = ds_config.config.setdefault("zero_optimization", {})
    given = {name: zero[name] for name in _ZERO3_GATHER if name in zero}
    refused = [name for name, value in given.items() if str(value).lower() == "false"]
    if refused:
        name = refused[0]
        raise ValueError(
            f"{origin('deepspeed')}: deepspeed: {name}: false saves DeepSpeed's partitioned checkpoint instead of "
            "the model, which packing-hf train saves whole (it loads with from_pretrained): set it true (or leave "
            "it out), or save_model: false to keep only the checkpoints (zero_to_fp32.py recovers their weights)"
        )
    if not given:
        zero[_ZERO3_GATHER[0]] = True
        cfg.notes.append(
            f"deepspeed: {_ZERO3_GATHER[0]}: true (ZeRO-3: the trained model is gathered whole on saving, so that "
            "it loads with from_pretrained; the checkpoints hold it too)"
        )


@contextlib.contextmanager
def whole_before_training(trainer):
    """A ZeRO-3 model's parameters gathered whole for the block, before training (every process: collective).

    Under ZeRO-3 the model is partitioned at construction (``deepspeed.zero.Init``) and no engine gathers its layers
    before ``train()`` makes one: the eval before training runs on the whole parameters, one copy per process for the
    eval. Once trained, the engine's hooks gather each layer for its call, and nothing is done here."""
    params = [p for p in trainer.model.parameters() if hasattr(p, "ds_id")]
    if not params or getattr(trainer, "deepspeed", None) is not None:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        yield


# what a saved model or adapter holds its weights in (transformers' and PEFT's file names, sharded or not)
_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
    "adapter_model.safetensors",
    "adapter_model.bin",
)


def save_whole(trainer, output_dir: Path) -> None:
    """``trainer.save_model`` with the weights whole, on every process (collective under a sharding engine), then
    :func:`check_saved` on the main process: FSDP saves a full state dict (accelerate's way of saving a model trained
    with ``SHARDED_STATE_DICT`` whole; the checkpoints stay sharded); ZeRO-3 gathers the partitions
    (``stage3_gather_16bit_weights_on_model_save``, which the config sets: :func:`whole_zero3_save`)."""
    started = time.time()
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None) if trainer.is_fsdp_enabled else None
    if plugin is not None and "FULL_STATE_DICT" not in str(plugin.state_dict_type):
        plugin.set_state_dict_type("FULL_STATE_DICT")
    trainer.save_model(str(output_dir))
    if trainer.is_world_process_zero():
        check_saved(output_dir, started, trainer)


class ModelNotSaved(RuntimeError):
    """The save of the trained model wrote no weights file (:func:`check_saved`); the command line reports it in
    one line, as its other errors."""


def check_saved(output_dir: Path, started: float, trainer) -> None:
    """The save wrote the model's weights (a file of :data:`_WEIGHT_FILES` written since ``started``), else
    :class:`ModelNotSaved`: a run never ends successfully without its trained model (an engine that saves a
    partitioned checkpoint instead, with a warning, would)."""
    output_dir = Path(output_dir)
    written = [name for name in _WEIGHT_FILES if (output_dir / name).is_file()]
    if any((output_dir / name).stat().st_mtime >= started - 1 for name in written):
        return
    engine = trainer.parallel_plan.describe()
    raise ModelNotSaved(
        f"the trained model was not saved to {output_dir} ({engine}): no weights file ({', '.join(_WEIGHT_FILES[:2])}, "
        f"...) was written{' since the save began' if written else ''}, the engine saved no whole model. The trained "
        "weights are in the latest checkpoint-* folder (a partitioned one: DeepSpeed's zero_to_fp32.py, or "
        "accelerate merge-weights for FSDP, makes them a model); please report this with the config"
    )
