"""packing_hf.tree_collator: a micro-batch as one prefix-tree row, its targets as (row, target, weight) pairs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from packing_hf import PaddingFreeCollator, PrefixTreeCollator
from packing_hf._loss import loss_counts, tree_coefficients, tree_loss_counts
from packing_hf.integrations.callbacks import STATS_KEY, TREE_TOKENS_KEY, PackingMetrics, PackingStatsCollator
from packing_hf.tree_collator import tree_attended_squares

# two turns of one conversation, cut per turn (turn 1 trained in the first sample, context in the second), a second
# answer to the first question (a branch inside the answer), a duplicate and an unrelated sample
SAMPLES = [
    {"input_ids": [1, 2, 3, 4, 5], "completion_mask": [0, 0, 1, 1, 1]},
    {"input_ids": [1, 2, 3, 4, 5, 6, 7, 8], "completion_mask": [0, 0, 0, 0, 0, 0, 1, 1]},
    {"input_ids": [1, 2, 3, 9, 9], "completion_mask": [0, 0, 1, 1, 1]},
    {"input_ids": [1, 2, 3, 9, 9], "completion_mask": [0, 0, 1, 1, 1]},
    {"input_ids": [20, 21, 22], "completion_mask": [0, 1, 1]},
]


def _pairs(batch) -> dict[tuple[int, int], float]:
    rows, targets, weights = (batch[k].tolist() for k in ("tree_rows", "tree_targets", "tree_weights"))
    return {(r, t): w for r, t, w in zip(rows, targets, weights, strict=True)}


def _reference_pairs(samples, weights=None) -> dict[tuple[int, int], float]:
    """Every sample alone: (the prefix that predicts, target) -> summed weight, keyed by the prefix's tokens."""
    out: dict[tuple, float] = {}
    for i, sample in enumerate(samples):
        ids, mask = sample["input_ids"], sample["completion_mask"]
        for j in range(1, len(ids)):
            w = mask[j] * (1.0 if weights is None else weights[i][j])
            if w:
                key = (tuple(ids[:j]), ids[j])
                out[key] = out.get(key, 0.0) + w
    return out


def _by_prefix(batch) -> dict[tuple, float]:
    """The collator's pairs keyed like :func:`_reference_pairs`: a row's token prefix read along its ancestors."""
    ids, cu, parents = (
        batch["input_ids"][0].tolist(),
        batch["cu_seq_lens_q"].tolist(),
        batch["prefix_seq_idx"].tolist(),
    )
    segment = np.searchsorted(cu, np.arange(len(ids)), side="right") - 1

    def prefix(row: int) -> tuple:
        s = int(segment[row])
        own = ids[cu[s] : row + 1]
        return (prefix(cu[parents[s] + 1] - 1) if parents[s] >= 0 else ()) + tuple(own)

    out: dict[tuple, float] = {}
    for (r, t), w in _pairs(batch).items():  # a prefix repeated in several rows (min_shared_tokens) adds up
        out[(prefix(r), t)] = out.get((prefix(r), t), 0.0) + w
    return out


def test_one_pair_per_distinct_prediction_weighted_by_the_samples_training_it():
    batch = PrefixTreeCollator()(SAMPLES)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 20, 21, 22]]
    assert batch["prefix_seq_idx"].tolist() == [-1, 0, 1, 0, -1]
    assert _by_prefix(batch) == _reference_pairs(SAMPLES)
    pairs = _pairs(batch)
    # the branch point (row 2, token 3) predicts both children's first tokens: 4 (sample 0 only: sample 1 has it as
    # context) and 9 (the duplicates: weight 2)
    assert pairs[(2, 4)] == 1.0 and pairs[(2, 9)] == 2.0
    assert (4, 6) not in pairs  # no sample trains token 6 (context of sample 1, absent elsewhere)
    # the step's denominators are the flat layout's
    flat = PaddingFreeCollator()(SAMPLES)
    assert tree_loss_counts(batch) == loss_counts(flat["labels"], cu_seq_lens=flat["cu_seq_lens_q"])
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 3, 4, 0, 1, 2]]
    # the head projects a row once per distinct target there: at most the row's tokens plus its branch edges, and
    # fewer than the samples' targets (the duplicate's three, and token 3 after the shared [1 2], are projected once)
    segments = batch["prefix_seq_idx"].numel()
    assert len(pairs) <= batch["input_ids"].numel() + segments
    assert len(pairs) == int((flat["labels"] != -100).sum()) - 4


def test_loss_weights_and_the_sample_coefficients():
    weights = [[0.5 * ((i + j) % 4) for j in range(len(s["input_ids"]))] for i, s in enumerate(SAMPLES)]
    samples = [dict(s, loss_weights=w) for s, w in zip(SAMPLES, weights, strict=True)]
    batch = PrefixTreeCollator()(samples)
    assert _by_prefix(batch) == _reference_pairs(SAMPLES, weights)
    flat = PaddingFreeCollator()(samples)
    expected = loss_counts(flat["labels"], flat["loss_weights"], cu_seq_lens=flat["cu_seq_lens_q"])
    assert tree_loss_counts(batch) == expected
    # "sample": every sample's coefficients sum to 1, so the pairs' sum is the samples' count
    assert float(tree_coefficients(batch, "sample").sum()) == pytest.approx(expected[1])
    assert torch.equal(tree_coefficients(batch, "token"), batch["tree_weights"])


def test_min_shared_tokens_is_honoured_and_stats_count_both_sides():
    collator = PrefixTreeCollator(min_shared_tokens=4)
    batch = collator(SAMPLES)
    # [1 2 3] is shorter than 4 tokens: the two groups continuing it each hold their own copy
    assert batch["prefix_seq_idx"].tolist() == [-1, 0, -1, -1]
    assert _by_prefix(batch) == _reference_pairs(SAMPLES)
    sample_tokens = sum(len(s["input_ids"]) for s in SAMPLES)
    assert (
        collator.stats["sample_tokens"] == sample_tokens
        and collator.stats["tokens"] == batch["input_ids"].numel()
    )
    assert collator.stats["samples"] == len(SAMPLES)


def test_tree_token_ratio_in_the_packing_metrics():
    collate = PackingStatsCollator(PrefixTreeCollator())
    batch = collate(SAMPLES)
    counts = batch[STATS_KEY]
    assert counts[TREE_TOKENS_KEY] == 26 and counts["real_tokens"] == 13
    assert counts["squared_lengths"] == tree_attended_squares(batch["cu_seq_lens_q"], batch["prefix_seq_idx"])
    metrics = PackingMetrics(None)
    metrics.update(counts)
    metrics.update(
        PackingStatsCollator(PrefixTreeCollator())(SAMPLES[4:])[STATS_KEY]
    )  # an unshared row: 3 / 3
    assert metrics.compute(num_steps=1)["tree_token_ratio"] == round(29 / 16, 4)


def test_packing_metrics_of_a_tree_row_behind_stock_column_removal():
    """The Trainer wraps the collator in stock's ``RemoveColumnsCollator`` over a dataset that is not a
    ``datasets.Dataset`` (a list): the counts are still the tree row's (its samples' tokens, its attention), not
    those of a flat row of the same samples."""
    from transformers.trainer_utils import RemoveColumnsCollator

    columns = ["input_ids", "completion_mask"]
    want = PackingStatsCollator(PrefixTreeCollator())(SAMPLES)[STATS_KEY]
    got = PackingStatsCollator(RemoveColumnsCollator(PrefixTreeCollator(), columns))(SAMPLES)[STATS_KEY]
    assert got == want and got[TREE_TOKENS_KEY] == 26 and got["real_tokens"] == 13


def test_malformed_input_is_named():
    with pytest.raises(ValueError, match="min_shared_tokens"):
        PrefixTreeCollator(min_shared_tokens=0)
    with pytest.raises(ValueError, match="sample 1: 'completion_mask' has 2 values"):
        PrefixTreeCollator()([SAMPLES[0], {"input_ids": [1, 2, 3], "completion_mask": [1, 1]}])
    with pytest.raises(ValueError, match="pixel_values"):
        PrefixTreeCollator()([{"input_ids": [1, 2], "pixel_values": [0.0]}])


def test_max_length_overflow_and_positions_are_honoured():
    """``overflow="split"``: every piece is a sample of the tree, as it is a segment of the flat layout (its first
    token no target); ``position_ids_start`` shifts every root's positions."""
    long = {"input_ids": [1, 2, 3, 4, 5, 6, 7], "completion_mask": [1] * 7}
    samples = [long, {"input_ids": [1, 2, 3, 9], "completion_mask": [1] * 4}]
    collator = PrefixTreeCollator(max_length=4, overflow="split", position_ids_start=2)
    batch = collator(samples)
    flat = PaddingFreeCollator(max_length=4, overflow="split")(samples)
    assert tree_loss_counts(batch) == loss_counts(flat["labels"], cu_seq_lens=flat["cu_seq_lens_q"])
    # pieces [1 2 3 4] [5 6 7] and the sample [1 2 3 9]: [1 2 3] shared, [5 6 7] a root of its own
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 9, 5, 6, 7]]
    assert batch["position_ids"].tolist() == [[2, 3, 4, 5, 5, 2, 3, 4]]
    assert collator.stats["split_samples"] == 1
    with pytest.raises(ValueError, match="max_length=4"):
        PrefixTreeCollator(max_length=4)(samples)  # overflow="error" (default) names the sample
