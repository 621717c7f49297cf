"""Packed reward-model training and packed KTO on 2 processes (gloo on CPU, torchrun) equal stock TRL's.

Each rank trains one step with the stock padded trainer (``trl.RewardTrainer`` / ``trl.KTOTrainer``, sdpa)
and one with packing_hf's (``packing_hf.RewardTrainer`` / ``packing_hf.KTOTrainer``) from the same weights on
the same data: the DDP-averaged gradients agree to 1e-5 relative, are the same on both ranks and are the
mean of the two ranks' own gradients (a one-rank gradient fails the same tolerance: the negative control);
the metrics the trainers log agree (reward: accuracy, margin, rewards; KTO: the chosen/rejected log-probs
and rewards, the KL estimate gathered across the ranks) and, for KTO, every example's KL log-probs under
the policy and the reference model. A multipack epoch (``max_tokens_per_batch``) gives both ranks the same
number of steps, disjoint examples that together cover the dataset once, and packed rows within the token
budget, which counts what the rows hold (reward: both sequences of a pair; KTO: an example's sequence and
its KL twin, each cut to ``max_length``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")

WORKER = Path(__file__).with_name("_reward_kto_worker.py")
LAUNCH_TIMEOUT_S = 300
REL = 1e-5
NOT_COMPARED = ("learning_rate", "epoch", "train_runtime", "total_flos")
KTO_BETA = 0.1  # TRL's KTOConfig default, which the worker keeps

pytestmark = pytest.mark.distributed


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    scale = float(want.abs().max()) or 1.0
    assert float((got - want).abs().max()) <= REL * scale, f"{what}: {got} vs {want}"


@pytest.fixture(scope="module")
def run_dir(run_once, data_dir, launch, torchrun_command):
    """One launch for both tests, even when xdist runs them on different workers (each rank process imports
    torch, transformers and TRL once): the reward run, then the KTO run, each writing its own ``rank{r}.pt``;
    the tests check them separately."""
    return run_once(
        "reward_kto2",
        lambda out: launch(
            [*torchrun_command(), str(WORKER), str(out), "reward,kto"],
            LAUNCH_TIMEOUT_S,
            "2-process reward + KTO run",
            PACKING_HF_DATA=str(data_dir),
        ),
    )


def _records(run_dir, mode: str) -> list[dict]:
    records = [torch.load(run_dir / mode / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert [rec["rank"] for rec in records] == [0, 1] and all(rec["world_size"] == 2 for rec in records)
    return records


def _check_gradients(records: list[dict]) -> None:
    for rec in records:
        _close(rec["grads"]["packed"], rec["grads"]["stock"], f"DDP gradient, rank {rec['rank']}")
    # DDP averaged: both ranks hold the same gradient, the mean of the two ranks' own ones ...
    for name in ("stock", "packed"):
        assert torch.equal(records[0]["grads"][name], records[1]["grads"][name]), name
    ddp = records[0]["grads"]["stock"]
    _close((records[0]["local_grads"] + records[1]["local_grads"]) / 2, ddp, "mean of the rank gradients")
    # ... and a one-rank gradient (what a missing all-reduce leaves) fails the same check: the negative control
    for rec in records:
        with pytest.raises(AssertionError):
            _close(rec["local_grads"], ddp, f"rank {rec['rank']}'s own gradient")


def _terms(key: str, log: dict) -> list[float]:
    """The magnitudes a logged ``key`` is a small difference of (``assert_close``'s ``terms``). Reward model:
    the margin and the mean reward cancel chosen and rejected scores (the extremes bound them). KTO: a reward is
    beta x (policy - reference) summed log-probs (beta: TRL's default), the margin two rewards, the KL policy -
    reference log-probs of the mismatched completions: all cancel sums of log-probs of the logged size."""
    if key in ("margin", "mean_reward"):
        return [log["min_reward"], log["max_reward"]]
    logps = [log[k] for k in ("logps/chosen", "logps/rejected") if k in log]
    if key in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        return [KTO_BETA * value for value in logps]
    return logps if key == "kl" else []


def _check_logs(records: list[dict], expected: set[str], assert_close) -> None:
    for rec in records:
        stock, packed = rec["logs"]["stock"], rec["logs"]["packed"]
        assert expected <= stock.keys() <= packed.keys(), sorted(stock)  # packed adds packing statistics
        for key, want in stock.items():
            if isinstance(want, (int, float)) and key not in NOT_COMPARED and "per_second" not in key:
                assert_close(packed[key], want, f"logged {key}", rel=REL, terms=_terms(key, stock))


def _check_multipack(records: list[dict]) -> None:
    r0, r1 = records
    assert r0["global_step"] == r1["global_step"] == len(r0["batches"]) == len(r1["batches"]) > 1
    seen0 = [ids for batch in r0["batches"] for ids in batch["ids"]]
    seen1 = [ids for batch in r1["batches"] for ids in batch["ids"]]
    assert not set(seen0) & set(seen1)
    assert sorted(seen0 + seen1) == sorted(r0["every"])
    # in some step the ranks' micro-batches held different numbers of examples (what multipack does, stock never)
    assert any(len(a["ids"]) != len(b["ids"]) for a, b in zip(r0["batches"], r1["batches"], strict=True))
    weight = dict(zip(r0["every"], r0["multipack_lengths"], strict=True))  # what the trainer's budget counts
    for batch in r0["batches"] + r1["batches"]:
        assert [weight[ids] for ids in batch["ids"]] == batch["counted"]  # = the tokens each one puts in rows
        assert batch["row_tokens"] == sum(batch["counted"]) <= r0["budget"]


def test_two_process_packed_reward_matches_stock(run_dir, assert_close):
    records = _records(run_dir, "reward")
    _check_gradients(records)
    _check_logs(records, {"loss", "accuracy", "margin", "mean_reward", "num_tokens"}, assert_close)
    _check_multipack(
        records
    )  # with a step whose ranks held different numbers of pairs, whose scores TRL gathers
    for rec in records:  # that gather: every rank's rows, in rank order, the padding dropped
        assert rec["uneven_gather"].flatten().tolist() == [0.0, 1.0, 10.0, 11.0, 12.0]


def test_two_process_packed_kto_matches_stock(run_dir, assert_close):
    records = _records(run_dir, "kto")
    _check_gradients(records)
    _check_logs(
        records,
        {"loss", "kl", "logps/chosen", "logps/rejected", "rewards/chosen", "rewards/rejected"},
        assert_close,
    )
    for rec in records:  # every example's KL log-probs: the policy's, then the reference model's
        stock, packed = rec["kl_logps"]["stock"], rec["kl_logps"]["packed"]
        assert len(stock) == len(packed) == 2 and stock[0].shape == (2,)
        for got, want in zip(packed, stock, strict=True):
            _close(got, want, f"KL log-probs, rank {rec['rank']}")
    assert (
        records[0]["logs"]["stock"]["kl"] > 0
    )  # the KL estimate, gathered over the ranks, is not clamped away
    # the ranks scored different examples (so the gathered KL estimate mixes both)
    assert not torch.allclose(records[0]["kl_logps"]["stock"][0], records[1]["kl_logps"]["stock"][0])
    _check_multipack(records)
