"""The loss of a packed row cut over a sequence-parallel group (``packing_hf/shard_loss.py``), on a real tiny
llama: a shard without targets adds exactly zero (loss and gradients) under every denominator, and the share
computed from the LM head's input in chunks equals the one from the shard's logits. (The shares of a group adding
up to the one-process loss and gradients: ``tests/unit/attention/test_sequence_parallel.py`` on one rank,
``tests/distributed/test_sequence_parallel_multiprocess.py`` on 2 and 4 processes.)"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import packing_hf.shard_loss as shard_loss
from packing_hf import PaddingFreeCollator, register_attention
from packing_hf._loss import step_denominator
from packing_hf.attention.sequence_parallel import shard_packed_batch
from packing_hf.shard_loss import sequence_parallel_chunked_loss, sequence_parallel_loss, shard_loss_counts


def _llama():
    config = AutoConfig.for_model(
        "llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=register_attention()).float()


def _row(weighted: bool = False) -> dict:
    samples = [
        {"input_ids": [5, 6, 7, 8, 9], "labels": [-100, -100, 7, 8, 9]},
        {"input_ids": [3, 4, 5], "labels": [3, 4, 5]},
    ]
    if weighted:
        for sample, weights in zip(samples, ([1.0, 1.0, 0.5, 2.0, 1.0], [0.0, 1.0, 3.0]), strict=True):
            sample["loss_weights"] = weights
    return PaddingFreeCollator()(samples)


def _check_untrained_shard(normalization: str) -> None:
    """A row without targets (a prompt-only sample, a one-token sample): the shard's loss is 0 and every gradient
    exactly zero, under the denominator the Trainer passes (the step's counts through ``step_denominator``) and the
    row's own."""
    model = _llama()
    row = PaddingFreeCollator()(
        [{"input_ids": [5, 6, 7], "labels": [-100, -100, -100]}, {"input_ids": [4], "labels": [4]}]
    )
    shard = shard_packed_batch(row)
    counts = shard_loss_counts(shard)
    assert counts == (0.0, 0)
    params = [p for p in model.parameters() if p.requires_grad]
    for denominator in (step_denominator(counts, normalization), None):
        loss = sequence_parallel_loss(model(**shard).logits, shard, normalization, denominator)
        grads = torch.autograd.grad(loss, params)
        value = float(loss.detach())
        assert value == 0.0, f"{normalization}: the loss of a shard without targets is {value}"
        assert all(torch.equal(g, torch.zeros_like(g)) for g in grads), f"{normalization}: non-zero gradients"


@pytest.mark.parametrize("normalization", ["token", "sample", "sample_sum"])
def test_a_shard_without_targets_has_zero_loss_and_gradients(normalization):
    _check_untrained_shard(normalization)


def test_negative_control_a_zero_denominator_is_caught(monkeypatch):
    # the row's own count as the denominator, unguarded: 0/0
    monkeypatch.setattr(shard_loss, "step_denominator", lambda totals, normalization: float(totals[0]))
    with pytest.raises(AssertionError, match="the loss of a shard without targets is nan"):
        _check_untrained_shard("token")


@pytest.mark.parametrize("normalization", ["token", "sample", "sample_sum"])
def test_the_chunked_share_equals_the_logits_share(normalization, assert_close):
    """The shard's loss from the LM head's input in chunks (what the chunked head gives under SP) equals the one
    from its logits, and so do the gradients of the head and of the hidden states."""
    model = _llama()
    shard = shard_packed_batch(_row(weighted=True))
    model_inputs = {k: v for k, v in shard.items() if k != "shift_labels"}
    hidden = model.model(**model_inputs).last_hidden_state.detach().requires_grad_()  # (1, T, H)
    head = model.lm_head.weight
    want = sequence_parallel_loss(model.lm_head(hidden), shard, normalization, denominator=3.0)
    want_grads = torch.autograd.grad(want, (hidden, head))
    got = sequence_parallel_chunked_loss(hidden, head, shard, normalization, denominator=3.0, chunk_size=3)
    got_grads = torch.autograd.grad(got, (hidden, head))
    assert_close(got, want, "loss", rel=1e-6)
    for name, g, w in zip(("hidden", "head"), got_grads, want_grads, strict=True):
        assert float(w.abs().max()) > 0
        assert_close(g, w, f"grad of {name}", rel=1e-6)
    own = sequence_parallel_chunked_loss(hidden, head, shard, normalization)  # the row's own denominator
    assert_close(own, sequence_parallel_loss(model.lm_head(hidden), shard, normalization), "loss", rel=1e-6)
    unshifted = dict(shard, shift_labels=_row(weighted=True)["labels"])  # the same loss, targets not shifted
    with pytest.raises(AssertionError):
        assert_close(
            sequence_parallel_chunked_loss(hidden, head, unshifted, normalization, 3.0),
            want,
            "loss",
            rel=1e-6,
        )
    with pytest.raises(ValueError, match="not \\(1, 8, hidden_size\\)"):
        sequence_parallel_chunked_loss(hidden[0], head, shard)


def _tree_pairs() -> dict:
    """A 9-token prefix-tree row ``[5, 6, 7 | 8, 9 | 1, 2 | 3 | 4]``: the branch row 2 predicts 8 and 4 (rows 3
    and 8), the branch row 4 predicts 1 and 3 (rows 5 and 7)."""
    from packing_hf import PrefixTreeCollator

    samples = [[5, 6, 7, 8, 9, 1, 2], [5, 6, 7, 4], [5, 6, 7, 8, 9, 3]]
    return PrefixTreeCollator()([{"input_ids": ids} for ids in samples])


@pytest.mark.parametrize("size", [2, 3, 4])
def test_every_tree_pair_is_on_one_shard_reindexed(size):
    """Cut over ``size`` ranks, every target pair of a tree row is on exactly one rank, at its predicting row's index
    inside that rank's shard; ``tree_samples`` stays the row's."""
    from packing_hf.attention.ulysses import SequenceShard, shard_lengths
    from packing_hf.shard_loss import shard_tree_pairs

    row = _tree_pairs()
    total = int(row["input_ids"].shape[1])
    cu = row["cu_seq_lens_q"]
    found = []
    for rank in range(size):
        shard = SequenceShard(None, rank, shard_lengths(total, size), cu, row["position_ids"])
        mine = shard_tree_pairs(row, shard)
        assert int(mine["tree_samples"]) == int(row["tree_samples"]) == 3
        assert all(0 <= r < shard.length for r in mine["tree_rows"].tolist())
        found += zip(
            (mine["tree_rows"] + shard.offset).tolist(),
            mine["tree_targets"].tolist(),
            mine["tree_weights"].tolist(),
            mine["tree_sample_weights"].tolist(),
            strict=True,
        )
    whole = zip(
        *(row[key].tolist() for key in ("tree_rows", "tree_targets", "tree_weights", "tree_sample_weights")),
        strict=True,
    )
    assert sorted(found) == sorted(whole)


def test_tree_pairs_outside_the_row_are_refused():
    """A pair naming a row past the row's tokens would be on no rank (its loss lost): refused by name."""
    from packing_hf.attention.ulysses import SequenceShard
    from packing_hf.shard_loss import shard_tree_pairs

    row = _tree_pairs()
    row["tree_rows"] = row["tree_rows"] + 9
    shard = SequenceShard(None, 0, [5, 4], row["cu_seq_lens_q"], row["position_ids"])
    with pytest.raises(ValueError, match="not all among its 9 tokens"):
        shard_tree_pairs(row, shard)
