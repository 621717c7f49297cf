"""One rank of the 2-process streaming run launched by ``test_streaming_multiprocess.py``.

Run as ``torchrun --nproc_per_node 2 _streaming_worker.py DATA.jsonl OUT_DIR`` (gloo on CPU). Every rank
streams its shard of the JSON Lines file through :class:`~packing_hf.streaming.PackedStream` for two
passes (uninterrupted), then again with a checkpoint at several cuts (the loader fetched a few batches
past the cut, the state goes through JSON) and a resumed stream; then one pass over a sharded
``datasets.IterableDataset``. It writes ``rank{r}.json``: every batch as the list of its samples' ``idx``
(``None`` for a padding batch), per pass and per resumed run. Importing this module does nothing.
"""

from __future__ import annotations

import json
import sys
from itertools import chain, islice
from pathlib import Path

MAX_TOKENS_PER_BATCH = 100
NUM_RECORDS = 120
PASSES = 2
CUTS = ((7, 2), (-1, 3))  # (batches consumed, batches the loader fetched beyond); -1: last of pass 0
STREAM_KWARGS = dict(buffer_size=16, open_batches=4, seed=0, history=8)


def record_length(k: int) -> int:
    """Even records (rank 0's shard) are short, odd ones (rank 1's) long: rank 0 runs out first."""
    return 3 + (k * 7) % 12 if k % 2 == 0 else 15 + (k * 11) % 25


def make_records() -> list[dict]:
    return [{"input_ids": [1 + k % 50] * record_length(k), "idx": k} for k in range(NUM_RECORDS)]


def _ids(batch):
    if "idx" not in batch[0]:  # the one-token padding batch
        return None
    return [s["idx"] for s in batch]


def main(data_path: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from packing_hf import PaddingFreeCollator
    from packing_hf.streaming import PackedStream

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    collator = PaddingFreeCollator(drop_keys=("idx",))  # the test records idx from the stream itself

    def make():
        return PackedStream(data_path, MAX_TOKENS_PER_BATCH, **STREAM_KWARGS)

    stream = make()
    passes, trained_tokens = [], []
    for _ in range(PASSES):
        batches = list(stream)
        passes.append([_ids(b) for b in batches])
        # a padding batch trains no token: its labels are all masked after collation
        trained_tokens.append([int((collator(b)["labels"] != -100).sum()) for b in batches])
    per_pass = len(passes[0])

    resumed = []
    for cut, lag in CUTS:
        cut = per_pass - 1 if cut < 0 else cut
        first = make()
        loop = chain.from_iterable(iter(first) for _ in range(PASSES))
        fetched = [_ids(b) for b in islice(loop, cut + lag)]
        state = json.loads(json.dumps(first.state_dict(batches_consumed=cut)))
        second = make()
        second.load_state_dict(state)
        rest = [_ids(b) for _ in range(PASSES - state["epoch"]) for b in second]
        resumed.append({"cut": cut, "head": fetched[:cut], "rest": rest})

    import datasets

    iterable = datasets.Dataset.from_list(make_records()).to_iterable_dataset(num_shards=4)
    hf_batches = [_ids(b) for b in PackedStream(iterable, MAX_TOKENS_PER_BATCH, **STREAM_KWARGS)]

    out = {
        "rank": rank,
        "world_size": dist.get_world_size(),
        "passes": passes,
        "trained_tokens": trained_tokens,
        "padding_batches": stream.stats()["padding_batches"],
        "resumed": resumed,
        "hf_batches": hf_batches,
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()
    del torch


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
