"""The trainer's own accelerate objects adapted to packed batches: ranks that hold different numbers of rows,
and batches a rank-aware sampler already shards; and what an evaluation before training prepared, forgotten.

Each function changes only an object the packing trainer built (its ``Accelerator``, its prepared
``DataLoader``), once, for that object's life; the layout test allows these sites here
(``docs/architecture.md``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["forget_prepared_models", "gather_uneven_rows", "pass_through_batch_shard", "taken_as_prepared"]


def pass_through_batch_shard(dataloader: Any, sampler: Any) -> Any:
    """Make accelerate's ``BatchSamplerShard`` around a rank-aware ``sampler`` a pass-through; return it.

    The sampler already gives each rank its share; the shard ``accelerator.prepare`` wraps it in would hand out
    every ``num_processes``-th of those batches again (dropping samples, and leaving ranks uneven). Stock
    ``Trainer`` treats its own rank-aware ``BatchRebalanceSampler`` the same way. The dataloader is the
    trainer's own (built for this sampler), so nothing is given back.
    """
    shard = getattr(dataloader, "batch_sampler", None)
    if shard is not None and shard is not sampler and getattr(shard, "batch_sampler", None) is sampler:
        shard.num_processes = 1
        shard.process_index = 0
    return shard


def gather_uneven_rows(accelerator: Any, plan: Any) -> None:
    """Let ``accelerator.gather`` (and ``gather_for_metrics``, which calls it) take tensors whose first dimension
    differs between the processes; a no-op with one process.

    Multipack gives every rank its own batches, so in the same step the ranks hold different numbers of
    samples, pairs or examples, and the per-row tensors that Transformers and TRL gather for their metrics
    (TRL's per-pair rewards and log-probs, the reward model's scores) differ in length: a plain all-gather
    aborts the process on gloo and may hang on NCCL. Each tensor is padded to the longest rank's rows,
    gathered and the padding dropped: every rank's rows in rank order, as a plain gather returns them when
    the lengths agree. Scalars, and the tensors inside tuples, lists and dicts, are handled alike; anything
    else goes to the plain gather. Installed once per accelerator by the packing trainers; ``plan``: the run's
    :class:`~packing_hf.integrations.parallel.ParallelPlan`.

    >>> from accelerate import Accelerator
    >>> from packing_hf.integrations.parallel import ParallelPlan
    >>> accelerator = Accelerator(cpu=True)
    >>> gather_uneven_rows(accelerator, ParallelPlan())  # one process: accelerate's own gather is kept
    >>> accelerator.gather(torch.tensor([1, 2])).tolist()
    [1, 2]
    """
    if plan.world_size == 1 or getattr(accelerator, "_packing_uneven_gather", False):
        return
    plain = accelerator.gather

    def gather(data: Any) -> Any:
        if isinstance(data, (tuple, list)):
            return type(data)(gather(d) for d in data)
        if isinstance(data, dict):
            return type(data)({k: gather(v) for k, v in data.items()})
        if not isinstance(data, torch.Tensor) or data.dim() == 0:
            return plain(data)
        rows = plain(torch.tensor([data.shape[0]], device=data.device)).tolist()  # (num_processes,)
        if len(set(rows)) == 1:
            return plain(data)
        padded = accelerator.pad_across_processes(data, dim=0)
        blocks = plain(padded).split(padded.shape[0])
        return torch.cat([block[:n] for block, n in zip(blocks, rows, strict=True)])

    accelerator.gather = gather
    accelerator._packing_uneven_gather = True


def forget_prepared_models(accelerator: Any, model: Any) -> None:
    """Forget every model ``accelerator`` prepared (the trainer's own accelerator, before training: what an evaluation
    prepared), so that the next ``prepare`` prepares ``model`` afresh: a DeepSpeed engine's hooks are removed from the
    model (``engine.destroy()``) and its backward wrapper dropped, accelerate's "already prepared" marks removed.

    >>> from accelerate import Accelerator
    >>> accelerator, layer = Accelerator(cpu=True), torch.nn.Linear(1, 1)
    >>> accelerator.prepare_model(layer, evaluation_mode=True) is layer
    True
    >>> forget_prepared_models(accelerator, layer)
    >>> accelerator._models, getattr(layer, "_is_accelerate_prepared", False)
    ([], False)
    """
    for prepared in accelerator._models:
        if prepared is not model and hasattr(prepared, "destroy"):  # a DeepSpeed engine around the model
            prepared.destroy()
        wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
        if wrapped is not None and wrapped.engine is prepared:
            accelerator.deepspeed_engine_wrapped = None
        prepared.__dict__.pop("_is_accelerate_prepared", None)
    accelerator._models.clear()
    model.__dict__.pop("_is_accelerate_prepared", None)


@contextlib.contextmanager
def taken_as_prepared(accelerator: Any, model: Any) -> Iterator[None]:
    """``model`` counted among what ``accelerator`` prepared for the block (the trainer's own accelerator, before
    training), so that an evaluation runs it as it is instead of preparing it; forgotten after.

    >>> from accelerate import Accelerator
    >>> accelerator, layer = Accelerator(cpu=True), torch.nn.Linear(1, 1)
    >>> with taken_as_prepared(accelerator, layer):
    ...     len(accelerator._models)
    1
    >>> accelerator._models
    []
    """
    accelerator._models.append(model)
    try:
        yield
    finally:
        accelerator._models[:] = [prepared for prepared in accelerator._models if prepared is not model]
