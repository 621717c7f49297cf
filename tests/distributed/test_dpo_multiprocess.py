"""Packed DPO on 2 processes (gloo on CPU, torchrun): the DDP gradient equals stock padded DPO's.

Each rank trains one step (the packed one sharing every pair's prompt) with stock ``trl.DPOTrainer`` and one with ``packing_hf.DPOTrainer`` on the same
weights and data (reference log-probs precomputed and gathered across the ranks); the DDP-averaged
gradients must agree to 1e-5 relative and be the same on both ranks. A multipack epoch over pairs must give
both ranks the same number of steps, disjoint pairs that together cover the dataset once, and batches
within the token budget counted over both sequences of every pair; in some step the ranks hold different
numbers of pairs, which TRL's gather of per-pair metrics must take (gloo aborted on it before).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")

WORKER = Path(__file__).with_name("_dpo_worker.py")
LAUNCH_TIMEOUT_S = 300
REL = 1e-5

pytestmark = pytest.mark.distributed


def test_two_process_packed_dpo_matches_stock(tmp_path, data_dir, launch, torchrun_command):
    launch(
        [*torchrun_command(), str(WORKER), str(tmp_path)],
        LAUNCH_TIMEOUT_S,
        "2-process DPO run",
        PACKING_HF_DATA=str(data_dir),
    )
    records = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]

    for rec in records:
        assert rec["world_size"] == 2
        assert rec["shared"] and rec["shared_prompt_tokens"] > 0  # the prompt held once per pair
        # reference log-probs precomputed by packed forwards on both ranks, gathered, as stock's
        want = rec["ref_logps"]["stock"]
        assert float((rec["ref_logps"]["packed"] - want).abs().max()) <= REL * float(want.abs().max())
        got, want = rec["grads"]["packed"], rec["grads"]["stock"]
        assert float((got - want).abs().max()) <= REL * float(want.abs().max()), f"rank {rec['rank']}"
    # DDP averaged the gradient: both ranks hold the same one
    assert torch.equal(records[0]["grads"]["packed"], records[1]["grads"]["packed"])

    # multipack over pairs: same step count, disjoint ranks, every pair once, budget over both sequences
    r0, r1 = records
    assert r0["global_step"] == r1["global_step"] == len(r0["batches"]) == len(r1["batches"]) > 1
    seen0 = [pair for batch in r0["batches"] for pair in batch]
    seen1 = [pair for batch in r1["batches"] for pair in batch]
    assert not set(seen0) & set(seen1)
    assert sorted(seen0 + seen1) == sorted(r0["pair_tokens"])
    for batch in r0["batches"] + r1["batches"]:
        assert sum(r0["pair_tokens"][pair] for pair in batch) <= r0["budget"]
    # in some step the ranks held different numbers of pairs: TRL's gather of per-pair rewards took them
    assert any(len(a) != len(b) for a, b in zip(r0["batches"], r1["batches"], strict=True))
    assert r0["logged"] and r0["logged"] == r1["logged"]
