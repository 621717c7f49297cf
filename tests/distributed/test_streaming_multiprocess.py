"""PackedStream on 2 real processes (torchrun, gloo, CPU): disjoint shards, equal batch counts, exact resume.

Rank 0's shard is shorter in tokens than rank 1's, so rank 0 runs out first and must pad with zero-loss
batches instead of leaving rank 1 waiting; every record is seen exactly once per pass across the ranks,
and a run resumed on both ranks from a JSON state saved mid-pass (and at a pass boundary, with the loader
ahead of the training loop) continues with exactly the batches the uninterrupted run yielded.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("_streaming_worker.py")
LAUNCH_TIMEOUT_S = 180

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def records(run_once, launch, torchrun_command, load_worker):
    worker = load_worker(WORKER)

    def run(folder):
        data = folder / "data.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in worker.make_records()))
        launch(
            [*torchrun_command(), str(WORKER), str(data), str(folder)], LAUNCH_TIMEOUT_S, "2-process stream"
        )

    folder = run_once("streaming2", run)  # one launch for every test here, even over several xdist workers
    return worker, [json.loads((folder / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_disjoint_shards_equal_batch_counts_padding_at_the_end(records):
    worker, (r0, r1) = records
    lengths = {k: worker.record_length(k) for k in range(worker.NUM_RECORDS)}
    assert r0["world_size"] == r1["world_size"] == 2
    for p in range(worker.PASSES):
        b0, b1 = r0["passes"][p], r1["passes"][p]
        assert len(b0) == len(b1) > 1, "ranks yielded different numbers of batches"
        seen0 = [i for b in b0 if b for i in b]
        seen1 = [i for b in b1 if b for i in b]
        assert set(seen0).isdisjoint(seen1)
        assert sorted(seen0 + seen1) == list(range(worker.NUM_RECORDS)), "not every record exactly once"
        assert all(i % 2 == 0 for i in seen0) and all(i % 2 == 1 for i in seen1)  # striding by rank
        for b in b0 + b1:
            assert b is None or sum(lengths[i] for i in b) <= worker.MAX_TOKENS_PER_BATCH
        # rank 0 (fewer tokens) pads at the end of the pass, and only there; rank 1 never pads
        pads = [i for i, b in enumerate(b0) if b is None]
        assert pads and pads == list(range(len(b0) - len(pads), len(b0)))
        assert None not in b1
        # padding batches train no token
        assert all(t == 0 for t, b in zip(r0["trained_tokens"][p], b0, strict=True) if b is None)
    assert r0["passes"][0] != r0["passes"][1]
    assert r0["padding_batches"] == sum(b is None for p in r0["passes"] for b in p)


def test_resume_on_both_ranks_is_exact(records):
    worker, ranks = records
    for rec in ranks:
        full = [b for p in rec["passes"] for b in p]
        for run in rec["resumed"]:
            assert run["head"] + run["rest"] == full, f"rank {rec['rank']}, cut {run['cut']}"


def test_datasets_iterable_dataset_split_by_node(records):
    worker, (r0, r1) = records
    assert len(r0["hf_batches"]) == len(r1["hf_batches"])
    seen0 = [i for b in r0["hf_batches"] if b for i in b]
    seen1 = [i for b in r1["hf_batches"] if b for i in b]
    assert set(seen0).isdisjoint(seen1)
    assert sorted(seen0 + seen1) == list(range(worker.NUM_RECORDS))
