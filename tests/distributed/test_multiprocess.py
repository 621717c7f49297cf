"""Real 2-process multipack training (gloo on CPU), launched with torchrun and with accelerate launch.

Both ranks must run the same number of optimizer steps, see disjoint samples that together cover the
dataset exactly once per epoch, finish without hanging (every launch has a timeout), and their
DDP-averaged first-step gradient must equal the single-process gradient of the same samples' mean
per-token loss (``num_items_in_batch`` gathered across ranks). A run resumed on both ranks from a
checkpoint in the middle of epoch 1 consumes exactly the batches each rank had left. A plain accelerate
loop over a prepared ``DataLoader(batch_sampler=MultipackBatchSampler(...))`` sees every sample once across the
ranks with ``shard=False`` or a pass-through shard, and is refused by name when accelerate would shard the
rank's batches a second time.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("_train_worker.py")
LAUNCH_TIMEOUT_S = 240

pytestmark = pytest.mark.distributed


def _ranks(out_dir: Path) -> list[dict]:
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in (0, 1)]


def _reference_first_step_grads(worker, sample_ids: list[int], right_padded_batch) -> dict[str, torch.Tensor]:
    """Single process: mean per-token loss of a right-padded batch of ``sample_ids``, gradient in float64."""
    samples = worker.make_samples()
    model = worker.make_model().train()
    model(**right_padded_batch([samples[i]["input_ids"] for i in sample_ids])).loss.backward()
    return {name: p.grad.double().flatten() for name, p in model.named_parameters() if p.grad is not None}


def _check_run(worker, records: list[dict], right_padded_batch) -> None:
    r0, r1 = records
    assert r0["world_size"] == r1["world_size"] == 2
    # same number of optimizer steps and batches on both ranks, as planned from len(dataloader)
    steps_per_epoch = math.ceil(r0["batches_per_epoch"] / worker.GRADIENT_ACCUMULATION_STEPS)
    assert r0["global_step"] == r1["global_step"] == worker.EPOCHS * steps_per_epoch
    assert r0["batches_per_epoch"] == r1["batches_per_epoch"] > 1
    assert len(r0["batches"]) == len(r1["batches"]) == worker.EPOCHS * r0["batches_per_epoch"]
    assert (
        r0["epoch_starts"]
        == r1["epoch_starts"]
        == [e * r0["batches_per_epoch"] for e in range(worker.EPOCHS)]
    )

    lengths = [len(s["input_ids"]) for s in worker.make_samples()]
    per_epoch = r0["batches_per_epoch"]
    orders = []
    for epoch in range(worker.EPOCHS):
        window = slice(epoch * per_epoch, (epoch + 1) * per_epoch)
        seen0 = [i for batch in r0["batches"][window] for i in batch]
        seen1 = [i for batch in r1["batches"][window] for i in batch]
        assert not set(seen0) & set(seen1), f"epoch {epoch}: ranks share samples"
        assert sorted(seen0 + seen1) == list(range(worker.NUM_SAMPLES)), (
            f"epoch {epoch}: not every sample once"
        )
        for batch in r0["batches"][window] + r1["batches"][window]:
            assert sum(lengths[i] for i in batch) <= worker.MAX_TOKENS_PER_BATCH
        orders.append(r0["batches"][window])
    assert orders[0] != orders[1], "set_epoch did not reach the sampler: epoch 1 repeated epoch 0's order"

    # DDP-averaged first-step gradient == single-process gradient of the same samples' mean token loss
    gas = worker.GRADIENT_ACCUMULATION_STEPS
    step_samples = [i for rec in records for batch in rec["batches"][:gas] for i in batch]
    reference = _reference_first_step_grads(worker, step_samples, right_padded_batch)
    for rec in records:
        got = torch.cat([torch.tensor(rec["first_grads"][name], dtype=torch.float64) for name in reference])
        want = torch.cat(list(reference.values()))
        cosine = float(torch.nn.functional.cosine_similarity(got, want, dim=0))
        assert cosine >= 0.999999, f"rank {rec['rank']}: gradient cosine {cosine}"
        assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
    # packing metrics are summed over ranks: every real token is counted once per epoch
    logged = sum(h["real_tokens_per_step"] for h in r0["logs"])
    assert logged == worker.EPOCHS * sum(lengths)
    # the per-rank spread is gathered from both ranks: the same on both, and the first step's is the plan's
    assert [h["rank_cost_max_over_mean"] for h in r0["logs"]] == [
        h["rank_cost_max_over_mean"] for h in r1["logs"]
    ]
    assert all(
        h["rank_forward_time_max_over_mean"] >= 1.0 and h["forward_seconds_max"] > 0 for h in r0["logs"]
    )
    first = [
        [sum(n + n * n for n in (lengths[i] for i in rec["batches"][m])) for rec in records]
        for m in range(gas)
    ]
    want = sum(max(c) for c in first) / sum(sum(c) / 2 for c in first)
    assert r0["logs"][0]["rank_cost_max_over_mean"] == round(want, 4)

    # resumed mid-epoch 1 on both ranks: each rank consumes exactly the batches it had left
    steps_per_epoch = math.ceil(per_epoch / gas)
    epoch, step_in_epoch = divmod(r0["resume_step"], steps_per_epoch)
    assert epoch == 1 and step_in_epoch > 0
    already = epoch * per_epoch + step_in_epoch * gas
    for rec in records:
        assert rec["resumed_batches"] == rec["batches"][already:], (
            f"rank {rec['rank']}: resume replayed/skipped"
        )
        assert rec["resumed_global_step"] == rec["global_step"]

    # issue 40: a plain accelerate loop over a prepared DataLoader(batch_sampler=MultipackBatchSampler): with
    # shard=False, or the shard made a pass-through, the two ranks see every sample exactly once; shard=True
    # alone (accelerate shards the rank's own batches again: 2/3 of the data seen before) is refused, naming
    # both fixes
    for key in ("accelerate_shard_false", "accelerate_pass_through"):
        seen0, seen1 = r0[key], r1[key]
        assert sorted(seen0 + seen1) == list(range(worker.NUM_SAMPLES)), key
        assert seen0 and seen1, key
    for rec in records:
        error = rec["accelerate_double_shard_error"]
        assert error is not None and "shards them again over 2 processes" in error
        assert "shard=False" in error and "pass_through_batch_shard" in error


def test_torchrun_two_processes(right_padded_batch, tmp_path, launch, torchrun_command, load_worker):
    launch([*torchrun_command(), str(WORKER), str(tmp_path)], LAUNCH_TIMEOUT_S)
    _check_run(load_worker(WORKER), _ranks(tmp_path), right_padded_batch)


def test_accelerate_launch_two_processes(right_padded_batch, tmp_path, launch, free_port, load_worker):
    # `--cpu` with several processes means MPI to accelerate; the torchrun-based launcher is `--multi_gpu`,
    # and the worker's use_cpu=True selects gloo on CPU.
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    command += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    command += ["--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port())]
    launch([*command, str(WORKER), str(tmp_path)], LAUNCH_TIMEOUT_S)
    _check_run(load_worker(WORKER), _ranks(tmp_path), right_padded_batch)
