"""Few shapes: rows rounded up to a length bucket train exactly like the unpadded row (loss and gradients),
because the padding is its own segment and its labels are masked."""

from __future__ import annotations

import pytest
import torch

from packing_hf import PaddingFreeCollator, register_attention
from packing_hf.collator import length_buckets

SAMPLES = [[5, 9, 3, 7, 1, 2, 8], [4, 4, 6, 11, 2], [13, 1, 9, 9, 5, 6, 2, 2, 7]]  # 21 tokens


def loss_and_grads(model, batch) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch, use_cache=False).loss
    loss.backward()
    return loss.detach(), [p.grad.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("attention", ["packing_hf", "sdpa"])
def test_bucketed_rows_give_the_loss_and_gradients_of_the_unpadded_row(
    attention, tiny_causal_lm_factory, assert_close, one_torch_thread
):
    attn = register_attention() if attention == "packing_hf" else "sdpa"
    model = tiny_causal_lm_factory(
        vocab_size=32, hidden_size=32, intermediate_size=64, attn_implementation=attn
    )
    features = [{"input_ids": ids} for ids in SAMPLES]
    plain = PaddingFreeCollator()(features)
    bucketed_collator = PaddingFreeCollator(length_buckets=(16, 32, 48))
    bucketed = bucketed_collator(features)
    assert bucketed["input_ids"].shape == (1, 32) and bucketed_collator.stats["padding_tokens"] == 11
    assert bucketed["cu_seq_lens_q"].tolist() == [0, 7, 12, 21, 32]  # the padding is a segment of its own
    assert (bucketed["labels"][0, 21:] == -100).all() and bucketed["position_ids"][0, 21:].tolist() == list(
        range(11)
    )
    want_loss, want_grads = loss_and_grads(model, plain)
    got_loss, got_grads = loss_and_grads(model, bucketed)
    assert_close(got_loss, want_loss, "loss", rel=1e-6)
    for got, want in zip(got_grads, want_grads, strict=True):
        assert_close(got, want, "gradient", rel=1e-5, terms=(want.abs().max(),))
    # negative control: the same row with the padding trained on shows up in the loss
    leaky = {**bucketed, "labels": bucketed["input_ids"].clone()}
    leaky["labels"][0, :21] = bucketed["labels"][0, :21]
    leaky_loss, _ = loss_and_grads(model, leaky)
    assert abs(float(leaky_loss) - float(want_loss)) > 1e-3


def test_bucket_arguments():
    assert length_buckets(8192, count=4) == (2048, 4096, 6144, 8192)
    with pytest.raises(ValueError, match="more than the largest of length_buckets"):
        PaddingFreeCollator(length_buckets=(8, 16))([{"input_ids": list(range(1, 18))}])
    with pytest.raises(ValueError, match="give 1 to 8 row lengths"):
        PaddingFreeCollator(length_buckets=tuple(range(1, 10)))
    with pytest.raises(ValueError, match="pass one"):
        PaddingFreeCollator(length_buckets=(8,), pad_to_multiple_of=8)
    with pytest.raises(ValueError, match="at most 8 buckets"):
        length_buckets(4096, count=9)
