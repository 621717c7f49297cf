"""packing_hf/_loss.py: the per-token arithmetic of the loss contract, and the collator's ``loss_weights``."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from packing_hf import PaddingFreeCollator
from packing_hf._loss import (
    check_loss_normalization,
    check_loss_weights,
    loss_counts,
    loss_numerator,
    step_denominator,
    target_segments,
)

SAMPLES = [
    {"input_ids": [5, 6, 7, 8], "labels": [-100, 6, 7, 8], "loss_weights": [0.0, 1.0, 0.5, 2.0]},
    {"input_ids": [9, 10], "labels": [-100, -100], "loss_weights": [1.0, 1.0]},  # nothing trained
    {"input_ids": [11, 12, 13], "labels": [11, 12, 13], "loss_weights": [1.0, 0.0, 3.0]},
]


def _padded(samples, weighted=True):
    width = max(len(s["input_ids"]) for s in samples)
    labels = torch.tensor([s["labels"] + [-100] * (width - len(s["labels"])) for s in samples])
    weights = torch.tensor([s["loss_weights"] + [0.0] * (width - len(s["labels"])) for s in samples])
    return labels, weights if weighted else None


def _losses(labels: torch.Tensor) -> torch.Tensor:
    """A deterministic per-target loss that depends only on the target token: the same packed or padded."""
    return labels[:, 1:].clamp(min=0).float() / 7 + 0.25


def _by_hand(samples, normalization, weighted):
    """The definition, sample by sample: (numerator, target weight, samples)."""
    numerator, weight_total, count = 0.0, 0.0, 0
    for s in samples:
        pairs = [
            (s["labels"][t] / 7 + 0.25, s["loss_weights"][t] if weighted else 1.0)
            for t in range(1, len(s["labels"]))
            if s["labels"][t] != -100
        ]
        w = sum(weight for _, weight in pairs)
        sum_wl = sum(loss * weight for loss, weight in pairs)
        weight_total += w
        count += w > 0
        numerator += (
            sum_wl / w
            if normalization == "sample" and w > 0
            else (0 if normalization == "sample" else sum_wl)
        )
    return numerator, weight_total, count


@pytest.mark.parametrize("normalization", ["token", "sample", "sample_sum"])
@pytest.mark.parametrize("weighted", [False, True])
def test_packed_and_padded_give_the_definition(normalization, weighted):
    expected, weight_total, count = _by_hand(SAMPLES, normalization, weighted)
    packed = PaddingFreeCollator()(
        [s if weighted else {k: v for k, v in s.items() if k != "loss_weights"} for s in SAMPLES]
    )
    p_labels, p_weights = packed["labels"], packed.get("loss_weights")
    for boundaries in ({"position_ids": packed["position_ids"]}, {"cu_seq_lens": packed["cu_seq_lens_q"]}):
        got = loss_numerator(_losses(p_labels), p_labels, normalization, p_weights, **boundaries)
        assert float(got) == pytest.approx(expected, rel=1e-6)
        assert loss_counts(p_labels, p_weights, **boundaries) == (pytest.approx(weight_total), count)
    labels, weights = _padded(SAMPLES, weighted)
    assert float(loss_numerator(_losses(labels), labels, normalization, weights)) == pytest.approx(
        expected, rel=1e-6
    )
    assert loss_counts(labels, weights) == (pytest.approx(weight_total), count)


def test_micro_batches_add_up_to_the_step():
    """Numerators and counts are sums: split over micro-batches they add to the whole batch's."""
    labels, weights = _padded(SAMPLES)
    for normalization in ("token", "sample", "sample_sum"):
        whole = loss_numerator(_losses(labels), labels, normalization, weights)
        parts = sum(
            loss_numerator(_losses(labels[i : i + 1]), labels[i : i + 1], normalization, weights[i : i + 1])
            for i in range(3)
        )
        assert float(parts) == pytest.approx(float(whole), rel=1e-6)
    counts = [loss_counts(labels[i : i + 1], weights[i : i + 1]) for i in range(3)]
    assert (sum(c[0] for c in counts), sum(c[1] for c in counts)) == loss_counts(labels, weights)


def test_ignored_targets_add_exactly_zero_and_keep_the_graph():
    labels = torch.tensor([[-100, 3, -100, -100]])
    losses = torch.tensor([[2.0, math.inf, math.nan]], requires_grad=True)
    for normalization in ("token", "sample", "sample_sum"):
        out = loss_numerator(losses, labels, normalization)
        assert float(out.detach()) == 2.0
        (grad,) = torch.autograd.grad(out, losses)
        assert grad.tolist() == [[1.0, 0.0, 0.0]]


def test_a_padding_batch_counts_nothing():
    labels = torch.tensor([[-100]])  # a stream's padding batch: one token, no label
    assert loss_counts(labels) == (0.0, 0)
    assert float(loss_numerator(torch.zeros(1, 0), labels, "sample")) == 0.0
    assert step_denominator((0.0, 0), "sample") == 1.0


def test_target_segments_boundaries():
    cu = torch.tensor([0, 2, 5, 6], dtype=torch.int32)
    position_ids = torch.tensor([[0, 1, 0, 1, 2, 0]])
    assert target_segments(torch.zeros(1, 6), cu_seq_lens=cu).tolist() == [[0, 1, 1, 1, 2]]
    assert target_segments(torch.zeros(1, 6), position_ids=position_ids).tolist() == [[0, 1, 1, 1, 2]]
    assert target_segments(torch.zeros(2, 3)).tolist() == [[0, 0], [3, 3]]


def test_check_loss_weights_names_the_problem():
    assert check_loss_weights(np.array([0.5, 0.0]), 2, "x").dtype == np.float64
    with pytest.raises(ValueError, match=r"record 7: loss_weights has 3 values but input_ids has 2 tokens"):
        check_loss_weights([1, 1, 1], 2, "record 7")
    with pytest.raises(ValueError, match=r"record 2: loss_weights\[1\] = -0.5"):
        check_loss_weights([1.0, -0.5], 2, "record 2")
    with pytest.raises(ValueError, match=r"loss_weights\[0\] = nan"):
        check_loss_weights([float("nan")], 1, "sample 0")
    with pytest.raises(ValueError, match=r"loss_weights\[0\] = inf"):
        check_loss_weights([float("inf")], 1, "sample 0")
    with pytest.raises(TypeError, match="list of floats"):
        check_loss_weights("1.0", 1, "sample 0")
    with pytest.raises(ValueError, match="one of"):
        check_loss_normalization("mean")


def test_collator_carries_weights():
    collator = PaddingFreeCollator(pad_to_multiple_of=4)
    out = collator(
        [
            {"input_ids": [1, 2, 3], "loss_weights": [0.5, 1.0, 2.0]},
            {"input_ids": [4, 5], "loss_weights": [3.0, 0.0]},
        ]
    )
    assert out["loss_weights"].dtype == torch.float32
    assert out["loss_weights"].tolist() == [[0.5, 1.0, 2.0, 3.0, 0.0, 0.0, 0.0, 0.0]]  # padding weighs 0
    assert "loss_weights" not in PaddingFreeCollator()([{"input_ids": [1, 2]}])
    truncated = PaddingFreeCollator(max_length=2, overflow="truncate")(
        [{"input_ids": [1, 2, 3], "loss_weights": [1.0, 2.0, 3.0]}]
    )
    assert truncated["loss_weights"].tolist() == [[1.0, 2.0]]
    split = PaddingFreeCollator(max_length=2, overflow="split")(
        [{"input_ids": [1, 2, 3], "loss_weights": [1.0, 2.0, 3.0]}]
    )
    assert split["loss_weights"].tolist() == [[1.0, 2.0, 3.0]] and split["cu_seq_lens_q"].tolist() == [
        0,
        2,
        3,
    ]


def test_collator_weight_errors_name_the_sample():
    collator = PaddingFreeCollator()
    with pytest.raises(ValueError, match=r"sample 1: loss_weights has 1 values but input_ids has 2 tokens"):
        collator([{"input_ids": [1], "loss_weights": [1.0]}, {"input_ids": [1, 2], "loss_weights": [1.0]}])
    with pytest.raises(ValueError, match=r"sample 0: loss_weights\[1\] = nan"):
        collator([{"input_ids": [1, 2], "loss_weights": [1.0, float("nan")]}])
    with pytest.raises(ValueError, match=r"sample 1 has no 'loss_weights'"):
        collator([{"input_ids": [1], "loss_weights": [1.0]}, {"input_ids": [1, 2]}])
