"""``packing-hf train`` under a launcher (``torchrun``, ``accelerate launch``): N processes run the one job.

Every process runs every phase (training, the eval loss and the padded baseline run the same model calls on
every rank, which sharded engines need); only the main process (global rank 0) prints the job's lines and
writes its files. The other processes wait where they read what it wrote (the tokenized-dataset cache, a
reference model for TRL) and never write a file it writes. The summary's counts are the whole run's.

>>> launch_rank({"RANK": "1", "WORLD_SIZE": "2"}), launch_rank({})
(1, 0)
>>> combine_stream_stats([{"samples": 3, "tokens": 30, "batches": 2, "epoch": 0, "peak_buffered_samples": 4},
...                       {"samples": 2, "tokens": 20, "batches": 2, "epoch": 0, "peak_buffered_samples": 5}],
...                      sp_size=1, max_tokens_per_batch=20)
{'samples': 5, 'tokens': 50, 'batches': 4, 'epoch': 0, 'peak_buffered_samples': 5, 'fill': 0.625}
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

__all__ = ["close_process_group", "combine_stream_stats", "from_main", "gather", "launch_rank", "main_first"]

# counters of PackedStream.stats() that are not summed over ranks: the pass (the same on every rank), a
# per-rank peak, and the fill (recomputed from the summed tokens and batches)
_NOT_SUMMED = {"epoch": max, "peak_buffered_samples": max}


def launch_rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's global rank as the launcher set it (``RANK``: torchrun, ``accelerate launch``, the
    DeepSpeed launcher); 0 for a plain run. Read before torch is imported, for the command line's own lines."""
    environ = os.environ if environ is None else environ
    return int(environ.get("RANK", "0") or 0)


@contextlib.contextmanager
def main_first(training: Any, desc: str, *, local: bool = False) -> Iterator[bool]:
    """The block runs on the main process first, then (after a barrier) on the others; yields whether this
    process is the main one, i.e. the one that may write what the others then read. ``local``: the main process
    of each node (files every node writes for itself: ``save_on_each_node``). One process: no barrier."""
    main = (training.local_process_index if local else training.process_index) == 0
    if training.world_size <= 1:
        yield main
        return
    with training.main_process_first(local=local, desc=desc):
        yield main


def from_main(training: Any, value: Any) -> Any:
    """``value`` as the main process has it (a broadcast; one process: ``value``). Decisions taken from a
    process's own timing (the baseline's size) must be the same on every rank, whose model calls must match."""
    if training.world_size <= 1:
        return value
    from accelerate.utils import broadcast_object_list

    return broadcast_object_list([value], from_process=0)[0]


def gather(training: Any, value: Any) -> list[Any]:
    """``value`` of every process, in rank order (one process: ``[value]``)."""
    if training.world_size <= 1:
        return [value]
    from accelerate.utils import gather_object

    return gather_object([value])


def combine_stream_stats(
    per_rank: Sequence[Mapping[str, Any]], *, sp_size: int, max_tokens_per_batch: int
) -> dict[str, Any]:
    """The counters of every rank's stream (``PackedStream.stats()``) as the whole run's: summed over the ranks,
    once per sequence-parallel group (its ``sp_size`` ranks read and count the same shard), the pass and the
    peak buffer the largest of any rank, the fill recomputed from the sums."""
    keys = list(per_rank[0])
    combined: dict[str, Any] = {}
    for key in keys:
        if key == "fill":
            continue
        values = [rank[key] for rank in per_rank]
        if key in _NOT_SUMMED:
            combined[key] = _NOT_SUMMED[key](values)
        else:
            total = sum(values)
            combined[key] = total // sp_size if isinstance(total, int) else total / sp_size
    batches = combined.get("batches", 0)
    combined["fill"] = combined.get("tokens", 0) / (batches * max_tokens_per_batch) if batches else 1.0
    return combined


def close_process_group() -> None:
    """Destroy the process group the run started (the launcher's processes over gloo or NCCL), if any: left to the
    interpreter's exit, gloo's threads are torn down while still joinable and a process can abort (SIGABRT,
    "terminate called without an active exception") after a run that succeeded. Not collective."""
    torch = sys.modules.get("torch")  # never imported: no group to close
    if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
