"""A real (tiny, from_config) LlamaForCausalLM on real GSM8K tokens: a batch collated by
PaddingFreeCollator gives the same logits as every sample run alone and the same loss as the usual
padded batch (fp32, CPU, sdpa and eager)."""

from __future__ import annotations

import pytest
import torch

from packing_hf import PaddingFreeCollator

ATOL = 1e-5
# varied lengths, one of a single token, cut from real samples to keep the forward cheap
LENGTHS = (37, 64, 1, 50, 23, 9)


@pytest.fixture(scope="module")
def features(gsm8k_tokenized):
    picked = []
    for i, n in enumerate(LENGTHS):
        ids = gsm8k_tokenized[i]["input_ids"][:n]
        # a prompt-like prefix is not trained, as in SFT
        picked.append({"input_ids": ids, "completion_mask": [0] * min(5, n - 1) + [1] * (n - min(5, n - 1))})
    return picked


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def model(request, tiny_causal_lm_factory):
    return tiny_causal_lm_factory("llama", attn_implementation=request.param)


def padded_batch(features, pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """The usual right-padded batch: attention_mask, labels -100 on padding and untrained tokens."""
    longest = max(len(f["input_ids"]) for f in features)
    input_ids = torch.full((len(features), longest), pad_token_id)
    labels = torch.full((len(features), longest), -100)
    attention_mask = torch.zeros((len(features), longest), dtype=torch.long)
    for row, f in enumerate(features):
        ids, mask = torch.tensor(f["input_ids"]), torch.tensor(f["completion_mask"])
        input_ids[row, : ids.numel()] = ids
        labels[row, : ids.numel()] = torch.where(mask == 1, ids, -100)
        attention_mask[row, : ids.numel()] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


@pytest.mark.parametrize("pad_to_multiple_of", [None, 16])
@torch.no_grad()
def test_packed_logits_equal_each_sample_alone(model, features, pad_to_multiple_of):
    batch = PaddingFreeCollator(pad_to_multiple_of=pad_to_multiple_of, return_seq_idx=True)(features)
    packed = model(**batch, use_cache=False).logits[0]  # (T, V)
    cu = batch["cu_seq_lens_q"].tolist()
    for i, f in enumerate(features):
        alone = model(input_ids=torch.tensor([f["input_ids"]]), use_cache=False).logits[0]
        diff = (packed[cu[i] : cu[i + 1]] - alone).abs().max().item()
        assert diff <= ATOL, f"sample {i}: max abs diff {diff:.2e}"


@torch.no_grad()
def test_without_boundaries_the_samples_contaminate_each_other(model, features):
    # negative control: the same row with one running position sequence is one long sample
    batch = PaddingFreeCollator()(features)
    packed = model(input_ids=batch["input_ids"], use_cache=False).logits[0]
    cu = batch["cu_seq_lens_q"].tolist()
    alone = model(input_ids=torch.tensor([features[1]["input_ids"]]), use_cache=False).logits[0]
    assert (packed[cu[1] : cu[2]] - alone).abs().max().item() > 1e-3


@pytest.mark.parametrize("pad_to_multiple_of", [None, 16])
@torch.no_grad()
def test_packed_loss_equals_padded_batch_loss(model, features, pad_to_multiple_of):
    # transformers' causal-LM loss is a mean over every trained (token, next token) pair of the whole
    # batch, not a mean of per-sample means; packing keeps exactly the same pairs (each sample's first
    # label is masked, so no pair crosses a boundary), hence the same sum and the same count.
    packed = PaddingFreeCollator(pad_to_multiple_of=pad_to_multiple_of)(features)
    packed_loss = model(**packed, use_cache=False).loss
    padded_loss = model(**padded_batch(features), use_cache=False).loss
    assert abs(packed_loss.item() - padded_loss.item()) <= ATOL

    # and both equal the token-weighted mean of the per-sample losses computed one by one
    total, count = 0.0, 0
    for f in features:
        single = padded_batch([f])
        n_pairs = int((single["labels"][0, 1:] != -100).sum())
        if n_pairs:
            total += model(**single, use_cache=False).loss.item() * n_pairs
            count += n_pairs
    assert count == int((packed["labels"] != -100).sum())
    assert abs(packed_loss.item() - total / count) <= ATOL


def test_packed_gradients_equal_padded_batch_gradients(tiny_causal_lm_factory, features):
    model = tiny_causal_lm_factory("llama", attn_implementation="sdpa")
    model(**PaddingFreeCollator()(features), use_cache=False).loss.backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model(**padded_batch(features), use_cache=False).loss.backward()
    for name, param in model.named_parameters():
        assert torch.allclose(packed_grads[name], param.grad, atol=ATOL, rtol=1e-4), name
