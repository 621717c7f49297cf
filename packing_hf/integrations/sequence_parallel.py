"""Sequence parallelism in the packing trainers: ``TrainingArguments(parallelism_config=ParallelismConfig(sp_size=N))``
with ``max_tokens_per_batch`` trains every packed row cut over ``N`` processes, with the one-process loss and
gradients (:mod:`packing_hf.attention.sequence_parallel`).

accelerate 1.15 and transformers 5.24 read ``sp_size > 1`` as DeepSpeed's ALST/Ulysses (``sp_backend`` accepts
only ``"deepspeed"``): they skip the device mesh, wrap the training DataLoader in DeepSpeed's
``UlyssesSPDataLoaderAdapter``, replace ``compute_loss`` and refuse any distributed type but DeepSpeed, FSDP2 and
multi-GPU. packing_hf runs its own all-to-all instead, so a trainer that declares
``packing_sequence_parallel = True`` keeps ``sp_size`` to itself: accelerate is built without it (plain DDP over
every process), the multipack sampler's (or the stream's) replicas are the ``world / sp_size`` groups, every
micro-batch is cut over its group in ``compute_loss`` (training, and evaluation of the loss alone) and the step's
denominator counts every row once. ``DPOTrainer`` keeps TRL's loss: its adapters cut the row and sum the group's
per-token log-probs back into the whole row (:class:`~packing_hf.integrations.adapters.PackedPreferenceForward`).
Trainers without the declaration leave the config to accelerate, and refuse ``sp_size`` by name.

>>> PackingSequenceParallelMixin.packing_sequence_parallel
False
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .._loss import LOSS_WEIGHTS_KEY

__all__ = ["PackingSequenceParallelMixin", "configured_parallelism", "sequence_parallel_size"]

# set by ``accelerate launch --parallelism_config_*``: accelerate then builds its ParallelismConfig from the
# environment when the Trainer hands it none
_LAUNCHER_FLAG = "ACCELERATE_USE_PARALLELISM_CONFIG"


def configured_parallelism(args: Any) -> Any:
    """The ``ParallelismConfig`` of training arguments: theirs, else the one ``accelerate launch
    --parallelism_config_*`` set up in the environment, else ``None``.

    >>> configured_parallelism(None) is None
    True
    """
    config = getattr(args, "parallelism_config", None)
    if config is None and os.environ.get(_LAUNCHER_FLAG, "false").lower() == "true":
        from accelerate import ParallelismConfig

        config = ParallelismConfig()  # reads the PARALLELISM_CONFIG_* variables the launcher set
    return config


def sequence_parallel_size(parallelism_config: Any) -> int:
    """``sp_size`` of a ``ParallelismConfig`` packing_hf can serve (1 without one), else a ``ValueError``.

    >>> from accelerate import ParallelismConfig
    >>> sequence_parallel_size(ParallelismConfig(sp_size=2)), sequence_parallel_size(None)
    (2, 1)
    """
    if parallelism_config is None:
        return 1
    size = int(getattr(parallelism_config, "sp_size", 1) or 1)
    if size == 1:
        return 1
    others = {name: int(getattr(parallelism_config, name, 1) or 1) for name in ("tp_size", "cp_size")}
    others.update(dp_shard_size=int(getattr(parallelism_config, "dp_shard_size", 1) or 1))
    clashing = {name: value for name, value in others.items() if value > 1}
    if clashing:
        raise ValueError(
            f"packing_hf's sequence parallelism (sp_size={size}) runs next to data parallelism (DDP) only, not "
            f"with {clashing}; set those to 1 (FSDP2 / tensor parallelism with SP: see docs/distributed.md)"
        )
    return size


class PackingSequenceParallelMixin:
    """``sp_size`` for the packing trainers; part of
    :class:`~packing_hf.integrations.trainer.PackingTrainerMixin`, active in trainers that declare
    ``packing_sequence_parallel = True`` (``Trainer``, ``SFTTrainer``, ``DPOTrainer``)."""

    #: whether this trainer cuts packed rows over ``sp_size`` processes (else ``sp_size`` stays accelerate's)
    packing_sequence_parallel = False

    def create_accelerator_and_postprocess(self) -> None:
        """Stock's, with ``sp_size`` kept from accelerate when this trainer serves it (see the module doc)."""
        self._packing_sp_size = 1
        self._packing_sp_group = None
        self._packing_sp_rank = 0
        config = configured_parallelism(self.args)
        if not self.packing_sequence_parallel or sequence_parallel_size(config) == 1:
            return super().create_accelerator_and_postprocess()
        self._packing_sp_size = sequence_parallel_size(config)
        # accelerate would route sp_size > 1 to DeepSpeed: it is built without it, then everything is put back
        given, self.args.parallelism_config = self.args.parallelism_config, None
        flag = os.environ.pop(_LAUNCHER_FLAG, None)
        try:
            return super().create_accelerator_and_postprocess()
        finally:
            self.args.parallelism_config = given
            if flag is not None:
                os.environ[_LAUNCHER_FLAG] = flag

    def _sequence_parallel_setup(self) -> None:
        """Called by the set-up: the SP groups (collective: every process calls it), and what SP needs."""
        size = getattr(self, "_packing_sp_size", 1)
        if size == 1:
            return
        from ..attention.sequence_parallel import sequence_parallel_groups

        if self.args.max_tokens_per_batch is None:
            raise ValueError(
                f"sp_size={size} cuts packed rows over processes; set max_tokens_per_batch (the row's token budget)"
            )
        if self.accelerator.num_processes % size:
            raise ValueError(
                f"sp_size={size} must divide the number of processes ({self.accelerator.num_processes})"
            )
        self._packing_sp_group, self._packing_sp_rank, _, _ = sequence_parallel_groups(size)

    def _sequence_parallel_loss(
        self, model: Any, inputs: dict, weights: Any, num_items_in_batch: Any, return_outputs: bool
    ) -> Any:
        """This rank's shard of the micro-batch's row through the model, and its share of the step's loss
        (times the number of processes: DDP averages the gradients); in evaluation, the row's token mean (the
        shares summed over the SP group: what one process computes on the whole row)."""
        from ..attention.sequence_parallel import (
            check_sequence_parallel_model,
            sequence_parallel_loss,
            shard_packed_batch,
        )

        training = model.training
        if training and num_items_in_batch is None:
            raise ValueError(
                "sequence parallelism divides every shard's loss by the step's denominator, which the Trainer "
                "did not count (num_items_in_batch is None); call compute_loss from the training loop"
            )
        check_sequence_parallel_model(self.accelerator.unwrap_model(model), self._packing_sp_size)
        row = dict(inputs)
        if weights is not None and training:  # eval_loss stays the unweighted token mean (docs/loss.md)
            row[LOSS_WEIGHTS_KEY] = weights
        shard = shard_packed_batch(row, self._packing_sp_group)
        outputs = model(**shard)
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]  # (1, T_rank, V)
        if not training:
            loss = sequence_parallel_loss(logits, shard, "token").detach()
            torch.distributed.all_reduce(loss, group=self._packing_sp_group)
            return (loss, outputs) if return_outputs else loss
        loss = sequence_parallel_loss(logits, shard, self.args.loss_normalization, float(num_items_in_batch))
        loss = loss * self.accelerator.num_processes
        return (loss, outputs) if return_outputs else loss
