"""Packed GRPO on 2 processes (gloo on CPU, torchrun): the DDP gradients equal stock padded GRPO's.

Each rank trains two optimizer steps with stock ``trl.GRPOTrainer``, with ``packing_hf.GRPOTrainer`` under a
token budget small enough that ranks need different numbers of packed rows (they must agree on one, or DDP
would hang), and with prompt sharing. The DDP-averaged gradient of every step must agree with stock's to
1e-5 relative and be the same on both ranks; the logged metrics must agree too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")

WORKER = Path(__file__).with_name("_rl_worker.py")
LAUNCH_TIMEOUT_S = 300
REL = 1e-5
TIMING = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos")

pytestmark = pytest.mark.distributed


def _terms(key: str, log: dict) -> list[float]:
    """The magnitudes a logged ``key`` is a small difference of (``assert_close``'s ``terms``): the loss and the
    KL cancel per-token log-probs (the importance ratio, the KL term), of size ~``entropy`` for a near-uniform
    tiny policy; see tests/integration/integrations/test_rl.py."""
    return [log["entropy"]] if key in ("loss", "kl") and "entropy" in log else []


def test_two_process_packed_grpo_matches_stock(
    tmp_path, data_dir, launch, torchrun_command, tiny_llama, assert_close
):
    model_dir = tmp_path / "model"
    tiny_llama(seed=0).save_pretrained(model_dir)
    launch(
        [*torchrun_command(), str(WORKER), str(tmp_path), str(model_dir)],
        LAUNCH_TIMEOUT_S,
        "2-process GRPO run",
        PACKING_HF_DATA=str(data_dir),
    )
    records = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    for rec in records:
        assert rec["world_size"] == 2
        want = rec["stock"]["grads"]
        assert len(want) == 2
        for name in ("packed", "shared"):
            got = rec[name]["grads"]
            assert len(got) == 2
            for step, (g, w) in enumerate(zip(got, want, strict=True)):
                err = float((g - w).abs().max())
                assert err <= REL * float(w.abs().max()), f"{name} step {step} rank {rec['rank']}: {err}"
            for log_s, log_p in zip(rec["stock"]["logs"], rec[name]["logs"], strict=True):
                for key, value in log_s.items():
                    if key not in TIMING and isinstance(value, float):
                        terms = _terms(key, log_s)
                        assert_close(log_p[key], value, f"{name} {key}", rel=REL, terms=terms)
        assert rec["shared"]["stats"]["shared_prompts"] > 0
    # DDP averaged the gradients: both ranks hold the same ones; and the ranks ran as many packed forwards
    for name in ("packed", "shared"):
        for g0, g1 in zip(records[0][name]["grads"], records[1][name]["grads"], strict=True):
            assert torch.equal(g0, g1)
        assert records[0][name]["stats"]["forwards"] == records[1][name]["stats"]["forwards"]
    # the budget made the ranks disagree at least once: a rank split its rows to run as many forwards
    assert (
        records[0]["packed"]["stats"]["rank_sync_forwards"]
        + records[1]["packed"]["stats"]["rank_sync_forwards"]
        > 0
    )
