"""Sequence parallelism in the packing trainers: ``TrainingArguments(parallelism_config=ParallelismConfig(sp_size=N))``
with ``max_tokens_per_batch`` trains every packed row cut over ``N`` processes, with the one-process loss and
gradients (the rows cut by :mod:`packing_hf.attention.sequence_parallel`, the shards' loss from
:mod:`packing_hf.shard_loss`).

accelerate 1.15 and transformers 5.24 read ``sp_size > 1`` as DeepSpeed's ALST/Ulysses (``sp_backend`` accepts
only ``"deepspeed"``): they skip the device mesh, wrap the training DataLoader in DeepSpeed's
``UlyssesSPDataLoaderAdapter``, replace ``compute_loss`` and refuse any distributed type but DeepSpeed, FSDP2 and
multi-GPU. packing_hf runs its own all-to-all instead, so a trainer that declares
``packing_sequence_parallel = True`` keeps ``sp_size`` to itself: accelerate is built without it, and the run's
:class:`~packing_hf.integrations.parallel.ParallelPlan` holds the SP group (a ``("dp", "sp")`` device mesh). The
multipack sampler's (or the stream's) replicas are the ``world / sp_size`` groups, every micro-batch is cut over
its group in ``compute_loss`` (training, and evaluation of the loss alone) and the step's denominator counts every
row once. The engine beside it holds the parameters as usual: DDP, DeepSpeed ZeRO-1/2/3 or FSDP2 (the processes
of an SP group are data-parallel for the parameters; each process's loss is its share times the number of
processes, and every one of these engines averages the gradients over all of them). ``DPOTrainer`` keeps TRL's loss: its adapters cut the row and sum
the group's per-token log-probs back into the whole row
(:class:`~packing_hf.integrations.adapters.PackedPreferenceForward`). Trainers without the declaration leave the
config to accelerate, and refuse ``sp_size`` by name.

>>> from packing_hf.integrations.skeleton import PackedTrainerSkeleton
>>> PackedTrainerSkeleton.packing_sequence_parallel
False
"""

from __future__ import annotations

from typing import Any

import torch

from .._loss import LOSS_WEIGHTS_KEY
from ..shard_loss import sequence_parallel_loss, shard_row_denominator
from .chunked_head import shard_lm_loss
from .parallel import ParallelPlan, training_mode

__all__ = ["PackingSequenceParallelMixin"]


class PackingSequenceParallelMixin:
    """The loss of a packed row cut over the run's SP group; part of
    :class:`~packing_hf.integrations.trainer.PackingTrainerMixin`, used by trainers that declare
    ``packing_sequence_parallel = True`` (``Trainer``, ``SFTTrainer``; ``DPOTrainer`` cuts in its adapters)."""

    parallel_plan: ParallelPlan

    def _sequence_parallel_loss(
        self,
        model: Any,
        inputs: dict,
        weights: Any,
        num_items_in_batch: Any,
        return_outputs: bool,
        head: Any = None,
    ) -> Any:
        """This rank's shard of the micro-batch's row through the model, and its share of the step's loss
        (times the number of processes: the engine averages the gradients); in evaluation, the row's token mean
        (the shares summed over the SP group: what one process computes on the whole row). ``head``: the
        resolved chunked LM head (:func:`~packing_hf.integrations.chunked_head.resolve_head`), or ``None`` for the
        shard's full logits."""
        plan = self.parallel_plan
        training = training_mode(model)  # an engine's own flag may say otherwise (training_mode)
        row = dict(inputs)
        if weights is not None and training:  # eval_loss stays the unweighted token mean (docs/loss.md)
            row[LOSS_WEIGHTS_KEY] = weights
        shard = self._shard_row(model, row, training, num_items_in_batch)
        normalization = self.args.loss_normalization if training else "token"
        denominator = float(num_items_in_batch) if training else shard_row_denominator(shard, "token")
        if head is not None:
            loss, outputs = shard_lm_loss(model, shard, normalization, denominator, head)
        else:
            outputs = model(**shard)
            logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]  # (1, T_rank, V)
            loss = sequence_parallel_loss(logits, shard, normalization, denominator)
        if not training:
            loss = loss.detach()
            torch.distributed.all_reduce(loss, group=plan.sp_group)
            return (loss, outputs) if return_outputs else loss
        loss = loss * plan.world_size
        return (loss, outputs) if return_outputs else loss

    def _shard_row(self, model: Any, row: dict, training: bool, num_items_in_batch: Any) -> dict:
        """This rank's shard of the packed row ``row`` (:func:`~packing_hf.attention.sequence_parallel.shard_packed_batch`
        over the run's SP group), once the model is checked to run exactly on shards; shared by the flat rows'
        route and the prefix-tree rows' (:meth:`PackingLossMixin._tree_loss`)."""
        from ..attention.sequence_parallel import (
            check_sequence_parallel_model,
            check_sequence_parallel_router_loss,
            shard_packed_batch,
        )

        plan = self.parallel_plan
        if training and num_items_in_batch is None:
            raise ValueError(
                "sequence parallelism divides every shard's loss by the step's denominator, which the Trainer "
                "did not count (num_items_in_batch is None); call compute_loss from the training loop"
            )
        unwrapped = self.accelerator.unwrap_model(model)
        check_sequence_parallel_model(unwrapped, plan.sp_size)
        # the loss is the logits' alone (also checked at set-up: a config changed since is caught here)
        check_sequence_parallel_router_loss(getattr(unwrapped, "config", None), plan.sp_size, unwrapped)
        return shard_packed_batch(row, plan.sp_group)
