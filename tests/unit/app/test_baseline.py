"""packing_hf.app.baseline: the padded baseline's batches are budget-matched, and it is sized to fit a share
of the training time (shrunk, or skipped when not one batch fits)."""

from __future__ import annotations

import numpy as np

from packing_hf.app.baseline import baseline_groups, plan_baseline
from packing_hf.app.config import load_train_config


def test_baseline_batches_hold_at_most_the_budget_of_real_tokens():
    cfg = load_train_config({"model_type": "llama", "max_tokens_per_batch": 100, "max_length": 100})
    lengths = np.random.default_rng(0).integers(5, 60, size=200)
    order, groups = baseline_groups(cfg, lengths, 4)
    assert len(groups) == 4 and sorted(p for g in groups for p in g) == list(range(len(order)))
    drawn = lengths[np.asarray(order)]
    real = [int(drawn[g].sum()) for g in groups]
    assert all(r <= 100 for r in real) and min(real) > 100 - 60  # full as a stock token-budget batch
    assert len(set(order)) == len(order)  # a random draw without repeats, not the first samples
    assert order != list(range(len(order)))


def test_the_baseline_shrinks_to_fit_its_share_of_the_training_time_or_is_skipped():
    lengths = np.array([10, 30, 30, 10, 10, 30])  # by position: 3 batches of two
    groups = [[0, 1], [2, 3], [4, 5]]
    # per batch: packed 40 + padded 60 tokens, per round; 1 s per token
    assert plan_baseline(1.0, lengths, groups, train_seconds=600, seconds_per_token=1.0) == (3, 2, 600, 600)
    assert plan_baseline(1.0, lengths, groups, 500, 1.0)[:2] == (3, 1)  # more batches before more rounds
    assert plan_baseline(1.0, lengths, groups, 250, 1.0)[:2] == (2, 1)
    assert plan_baseline(1.0, lengths, groups, 150, 1.0)[:2] == (1, 1)
    batches, rounds, cost, allowed = plan_baseline(0.15, lengths, groups, 600, 1.0)
    assert (batches, rounds, allowed) == (0, 0, 90) and cost == 100  # not one batch fits: skipped


def test_the_default_share_is_the_demos_or_the_bound_for_own_data():
    demo = load_train_config({"model_type": "llama"})
    own = load_train_config({"model_type": "llama", "dataset": "my.jsonl"})
    explicit = load_train_config({"model_type": "llama", "baseline_time_share": 0.3})
    assert (demo.baseline_time_share, own.baseline_time_share, explicit.baseline_time_share) == (
        1.0,
        0.15,
        0.3,
    )
