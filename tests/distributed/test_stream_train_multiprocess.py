"""packing_hf.Trainer on a stream in 2 real processes (torchrun, gloo, CPU).

Rank 0's shard is short in tokens, so in every pass it runs out first and trains on padding batches while
rank 1 finishes. Both ranks must run the same number of steps, train on exactly the batches of a
standalone ``PackedStream`` (disjoint shards, every sample once per pass, passes back to back), and the
DDP-averaged gradient of the first step, which holds a padding batch on rank 0, must equal the
single-process gradient of the mean token loss over that step's samples. A run resumed on both ranks from
the checkpoint in the middle of pass 1 sees exactly the batches each rank had left and ends with the same
weights; evaluation on the stream gives the token-mean loss over every sample.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("_stream_train_worker.py")
LAUNCH_TIMEOUT_S = 240

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def records(run_once, launch, torchrun_command, load_worker):
    # one launch for every test here, even when xdist spreads them over its workers
    out_dir = run_once(
        "stream_train2", lambda out: launch([*torchrun_command(), str(WORKER), str(out)], LAUNCH_TIMEOUT_S)
    )
    return load_worker(WORKER), [json.loads((out_dir / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_disjoint_shards_equal_steps_padding(records):
    worker, (r0, r1) = records
    gas, steps = worker.GRADIENT_ACCUMULATION_STEPS, worker.MAX_STEPS
    assert r0["world_size"] == r1["world_size"] == 2
    assert r0["global_step"] == r1["global_step"] == steps
    for rec in (r0, r1):
        consecutive = [b for p in rec["reference_passes"] for b in p]
        assert len(consecutive) >= steps * gas
        assert rec["batches"] == consecutive[: steps * gas], f"rank {rec['rank']}: not the stream's batches"
    per_pass = len(r0["reference_passes"][0])
    assert per_pass == len(r1["reference_passes"][0]) and steps * gas > 2 * per_pass  # passes back to back
    for p in range(2):
        b0, b1 = (rec["batches"][p * per_pass : (p + 1) * per_pass] for rec in (r0, r1))
        seen0, seen1 = [i for b in b0 for i in b], [i for b in b1 for i in b]
        assert not set(seen0) & set(seen1), f"pass {p}: ranks share samples"
        assert sorted(seen0 + seen1) == list(range(worker.NUM_SAMPLES)), f"pass {p}: not every sample once"
        for b in b0 + b1:
            assert sum(worker.sample_length(i) for i in b) <= worker.MAX_TOKENS_PER_BATCH
        assert [] in b0 and [] not in b1  # rank 0 ran out first and padded; rank 1 never did
    assert r0["padding_batches"] == sum(b == [] for b in r0["batches"]) > 0
    assert [] in r0["batches"][:gas], "the first step was meant to hold a padding batch"


def test_first_step_gradient_with_a_padding_batch_is_exact(records):
    """DDP-averaged gradient of a step where rank 0 trains on one real and one padding batch == the
    single-process gradient of the mean token loss over the step's samples of both ranks."""
    worker, ranks = records
    gas = worker.GRADIENT_ACCUMULATION_STEPS
    samples = worker.make_samples()
    step = [samples[i]["input_ids"] for rec in ranks for b in rec["batches"][:gas] for i in b]
    longest = max(map(len, step))
    ids = torch.zeros(len(step), longest, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for r, row in enumerate(step):
        ids[r, : len(row)] = labels[r, : len(row)] = torch.tensor(row)
        mask[r, : len(row)] = 1
    model = worker.make_model().train()
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    want = torch.cat([p.grad.double().flatten() for _, p in model.named_parameters()])
    for rec in ranks:
        got = torch.cat(
            [torch.tensor(rec["first_grads"][n], dtype=torch.float64) for n, _ in model.named_parameters()]
        )
        assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max()), f"rank {rec['rank']}"


def test_resume_on_both_ranks_is_exact(records):
    worker, ranks = records
    consumed = worker.RESUME_STEP * worker.GRADIENT_ACCUMULATION_STEPS
    per_pass = len(ranks[0]["reference_passes"][0])
    assert per_pass < consumed < 2 * per_pass  # the checkpoint is in the middle of pass 1
    for rec in ranks:
        assert rec["resumed_batches"] == rec["batches"][consumed:], (
            f"rank {rec['rank']}: resume replayed/skipped"
        )
        assert rec["resumed_global_step"] == worker.MAX_STEPS
        assert rec["weight_diff"] <= 1e-6


def test_streaming_eval_is_the_token_mean(records):
    """One pass of the eval stream on both ranks (rank 0 pads), reduced over ranks: the padded token mean."""
    _, (r0, r1) = records
    assert r0["eval_loss"] == pytest.approx(r1["eval_loss"], rel=1e-9)
    assert r0["eval_loss"] == pytest.approx(r0["padded_loss"], rel=1e-5)
