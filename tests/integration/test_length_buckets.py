"""Few shapes: rows rounded up to a length bucket train exactly like the unpadded row (loss and gradients),
because the padding is its own segment and its labels are masked."""

from __future__ import annotations

import pytest
import torch

from packing_hf import PaddingFreeCollator, register_attention
from packing_hf._loss import loss_counts
from packing_hf.architectures import build_tiny_model, prepare_model_for_packing
from packing_hf.attention.guards import validate_packed_batch
from packing_hf.collator import length_buckets, segment_buckets

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


@pytest.mark.parametrize("backend", ["auto", "sdpa_padded"])
def test_empty_segments_closing_cu_seq_lens_change_nothing(
    backend, tiny_causal_lm_factory, assert_close, one_torch_thread
):
    """``segment_buckets``: cu_seq_lens padded with empty segments trains like the unpadded row, through the
    batch guard, packing_hf's attention (per-segment SDPA, and the padded batch) and the loss counts."""
    name = register_attention(backend)
    try:
        model = tiny_causal_lm_factory(
            vocab_size=32, hidden_size=32, intermediate_size=64, attn_implementation=name
        )
        features = [{"input_ids": ids} for ids in SAMPLES]
        plain = PaddingFreeCollator(length_buckets=(32,))(features)
        collator = PaddingFreeCollator(length_buckets=(32,), segment_buckets=(8, 16))
        padded = collator(features)
        assert padded["cu_seq_lens_q"].tolist() == [0, 7, 12, 21, 32, 32, 32, 32, 32]  # 4 segments -> 8
        assert collator.stats["empty_segments"] == 4 and padded["input_ids"].shape == (1, 32)
        assert padded["max_length_q"] == 32 and plain["max_length_q"] == 11  # rounded up to the length bucket
        for key in ("input_ids", "labels", "position_ids"):
            assert torch.equal(padded[key], plain[key])
        assert validate_packed_batch(padded)["cu_seq_lens_q"] is padded["cu_seq_lens_q"]
        assert loss_counts(padded["labels"], cu_seq_lens=padded["cu_seq_lens_q"]) == loss_counts(
            plain["labels"], cu_seq_lens=plain["cu_seq_lens_q"]
        )
        want_loss, want_grads = loss_and_grads(model, plain)
        got_loss, got_grads = loss_and_grads(model, padded)
        assert_close(got_loss, want_loss, "loss", rel=1e-6)
        for got, want in zip(got_grads, want_grads, strict=True):
            assert_close(got, want, "gradient", rel=1e-5, terms=(want.abs().max(),))
        # negative control: one more boundary, inside the second sample (the same shapes) shows up in the loss
        split = [{"input_ids": ids} for ids in (SAMPLES[0], SAMPLES[1][:2], SAMPLES[1][2:], SAMPLES[2])]
        cut = collator(split)
        assert cut["cu_seq_lens_q"].tolist() == [0, 7, 9, 12, 21, 32, 32, 32, 32]
        cut_loss, _ = loss_and_grads(model, cut)
        assert abs(float(cut_loss) - float(want_loss)) > 1e-4
    finally:
        register_attention()


def test_empty_segments_only_close_the_row():
    batch = PaddingFreeCollator(segment_buckets=(4,))([{"input_ids": ids} for ids in SAMPLES])
    assert batch["cu_seq_lens_q"].tolist() == [0, 7, 12, 21, 21]
    validate_packed_batch(batch)
    inside = {**batch, "cu_seq_lens_q": torch.tensor([0, 7, 7, 12, 21], dtype=torch.int32)}
    inside["cu_seq_lens_k"] = inside["cu_seq_lens_q"]
    with pytest.raises(ValueError, match="an empty segment ends at cu_seq_lens_q"):
        validate_packed_batch(inside)
    with pytest.raises(ValueError, match="more than the largest of segment_buckets"):
        PaddingFreeCollator(segment_buckets=(2,))([{"input_ids": ids} for ids in SAMPLES])
    with pytest.raises(ValueError, match="give 1 to 8 segment counts"):
        PaddingFreeCollator(segment_buckets=())
    assert segment_buckets(3, count=4) == (1, 3)


@pytest.mark.parametrize("model_type", ["qwen3_5_text"])
def test_empty_segments_reach_the_token_mixers_of_a_prepared_hybrid_as_nothing(model_type, one_torch_thread):
    """The per-sample mixers (here gated DeltaNet and its short convolution) read the boundaries from their layer's call:
    the empty segments closing ``cu_seq_lens`` add no sample there either."""
    model = build_tiny_model(model_type, register_attention())
    features = [{"input_ids": ids} for ids in SAMPLES]
    plain = PaddingFreeCollator(length_buckets=(32,))(features)
    padded = PaddingFreeCollator(length_buckets=(32,), segment_buckets=(8,))(features)
    split = PaddingFreeCollator(length_buckets=(32,), segment_buckets=(8,))(
        [{"input_ids": ids} for ids in (SAMPLES[0], SAMPLES[1][:2], SAMPLES[1][2:], SAMPLES[2])]
    )
    with prepare_model_for_packing(model), torch.no_grad():
        want, got, control = (model(**batch, use_cache=False).logits for batch in (plain, padded, split))
    assert torch.equal(got, want)
    assert not torch.allclose(control[0, 9:12], want[0, 9:12])  # a real boundary there changes the logits


def _router_loss_and_grads(model, batch) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(**batch, use_cache=False, output_router_logits=True)
    out.loss.backward()
    return out.loss.detach(), out.aux_loss.detach(), [p.grad.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("padding", [{"pad_to_multiple_of": 16}, {"length_buckets": (16, 32, 48)}])
def test_padding_stays_out_of_the_router_load_balancing_loss(
    model_type, padding, assert_close, one_torch_thread
):
    """MoE: the padding segment is routed (its own outputs, unused), but a prepared model leaves it out of the
    load-balancing loss, as stock does: loss, router loss and gradients of the unpadded row, run stock."""
    model = build_tiny_model(model_type, register_attention())
    model.router_aux_loss_coef = 0.5  # the router loss weighs in the gradients
    features = [{"input_ids": ids} for ids in SAMPLES]
    plain = PaddingFreeCollator()(features)
    padded = PaddingFreeCollator(**padding)(features)
    assert padded["input_ids"].shape[1] > 21
    want_loss, want_aux, want_grads = _router_loss_and_grads(model, plain)  # stock: no packing_hf hook runs
    with prepare_model_for_packing(model):
        got_loss, got_aux, got_grads = _router_loss_and_grads(model, padded)
    assert_close(got_aux, want_aux, "router loss", rel=1e-6)
    assert_close(got_loss, want_loss, "loss", rel=1e-6)
    for got, want in zip(got_grads, want_grads, strict=True):
        assert_close(got, want, "gradient", rel=1e-5, terms=(want.abs().max(),))
    # negative control: the same row with the padding not marked is routed and counted like real tokens
    from packing_hf.varlen import PADDING_KEY

    assert int(padded[PADDING_KEY]) == padded["input_ids"].shape[1] - 21
    unmarked = {k: v for k, v in padded.items() if k != PADDING_KEY}
    with prepare_model_for_packing(model):
        _, leaky_aux, leaky_grads = _router_loss_and_grads(model, unmarked)
    assert abs(float(leaky_aux) - float(want_aux)) > 1e-4
    assert max(float((g - w).abs().max()) for g, w in zip(leaky_grads, want_grads, strict=True)) > 1e-4


def test_a_padded_row_is_refused_by_an_unprepared_model_returning_a_router_loss(one_torch_thread):
    model = build_tiny_model("mixtral", register_attention())
    model.config.output_router_logits = True
    padded = PaddingFreeCollator(pad_to_multiple_of=16)([{"input_ids": ids} for ids in SAMPLES])
    with pytest.raises(ValueError, match="would count the padding like real tokens"):
        validate_packed_batch(padded, model=model)
    with pytest.raises(ValueError, match="would count the padding like real tokens"), torch.no_grad():
        model(**padded, use_cache=False)
    # without the router loss the padding is harmless: accepted
    model.config.output_router_logits = False
    validate_packed_batch(padded, model=model)
    with torch.no_grad():
        model(**padded, use_cache=False)


def test_a_router_loss_not_computed_from_the_attention_mask_is_refused_on_padded_rows(one_torch_thread):
    """A forward computing its router loss some other way cannot be handed the padding: refused by name when a
    padded row asks for that loss; the unpadded row, or no router loss, pass."""
    from transformers import MixtralForCausalLM

    class OwnRouterLoss(MixtralForCausalLM):
        def forward(self, input_ids=None, labels=None, **kwargs):
            out = super().forward(input_ids=input_ids, labels=labels, **kwargs)
            out.aux_loss = out.aux_loss  # stands for a router loss of its own, blind to any mask
            return out

    stock = build_tiny_model("mixtral", register_attention())
    model = OwnRouterLoss(stock.config)
    features = [{"input_ids": ids} for ids in SAMPLES]
    padded = PaddingFreeCollator(pad_to_multiple_of=16)(features)
    with prepare_model_for_packing(model), torch.no_grad():
        with pytest.raises(
            ValueError, match="does not compute from an attention_mask packing_hf could hand it"
        ):
            model(**padded, output_router_logits=True)
        model(**PaddingFreeCollator()(features), output_router_logits=True)
        model(**padded, output_router_logits=False)


def test_a_router_mask_that_never_reaches_the_base_model_is_refused(one_torch_thread):
    """A forward that hands its router loss its own ``attention_mask`` but calls its base model without it: the
    mask packing_hf hands it for the padding is never dropped by the base model's hook, so where the padding
    sits in the router loss is not known: refused by name after the call. Control: the same forward passing the
    mask on (the stock forward's shape) runs."""
    from transformers import MixtralForCausalLM
    from transformers.modeling_outputs import MoeCausalLMOutputWithPast
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    class RouterLossOfItsOwnMask(MixtralForCausalLM):
        passes_mask = False

        def forward(
            self, input_ids=None, attention_mask=None, position_ids=None, output_router_logits=None, **kwargs
        ):
            handed = {"attention_mask": attention_mask} if self.passes_mask else {}
            out = self.model(
                input_ids=input_ids, position_ids=position_ids, output_router_logits=True, **handed, **kwargs
            )
            logits = self.lm_head(out.last_hidden_state)
            aux_loss = load_balancing_loss_func(
                out.router_logits, self.num_experts, self.num_experts_per_tok, attention_mask
            )
            return MoeCausalLMOutputWithPast(logits=logits, aux_loss=aux_loss)

    model = RouterLossOfItsOwnMask(build_tiny_model("mixtral", register_attention()).config).eval()
    padded = PaddingFreeCollator(pad_to_multiple_of=16)([{"input_ids": ids} for ids in SAMPLES])
    with prepare_model_for_packing(model), torch.no_grad():
        with pytest.raises(ValueError, match="never reached MixtralModel"):
            model(**padded, output_router_logits=True, use_cache=False)
        model.passes_mask = True
        model(**padded, output_router_logits=True, use_cache=False)


def test_a_fixed_length_stream_row_keeps_its_padding_out_of_the_router_loss(assert_close, one_torch_thread):
    """``fixed_length_rows`` closes a row with padding (its own segment): with the padding count it yields, a
    prepared MoE model's router loss, loss and gradients are the unpadded row's; the negative control (the same
    row without the count) routes the padding and counts it."""
    from packing_hf.streaming import fixed_length_rows
    from packing_hf.varlen import PADDING_KEY

    model = build_tiny_model("mixtral", register_attention())
    model.router_aux_loss_coef = 0.5
    features = [{"input_ids": ids} for ids in SAMPLES]
    row = next(fixed_length_rows([features], 32, pad_token_id=0))
    row.pop("attention_mask")  # the positions keep the padding apart; a packed row carries no mask
    want_loss, want_aux, want_grads = _router_loss_and_grads(model, PaddingFreeCollator()(features))
    with prepare_model_for_packing(model):
        got_loss, got_aux, got_grads = _router_loss_and_grads(model, row)
        unmarked = {k: v for k, v in row.items() if k != PADDING_KEY}
        _, leaky_aux, _ = _router_loss_and_grads(model, unmarked)
    assert_close(got_aux, want_aux, "router loss", rel=1e-6)
    assert_close(got_loss, want_loss, "loss", rel=1e-6)
    for got, want in zip(got_grads, want_grads, strict=True):
        assert_close(got, want, "gradient", rel=1e-5, terms=(want.abs().max(),))
    assert int(row[PADDING_KEY]) == 32 - 21
    assert abs(float(leaky_aux) - float(want_aux)) > 1e-4
