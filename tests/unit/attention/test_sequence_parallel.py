"""Sequence parallelism on one process: the shard arithmetic, the shard of a one-rank group is the row itself,
and every refusal names its fix. The multi-process exactness (sp=2, sp=4, DP x SP) is in
``tests/distributed/test_sequence_parallel_multiprocess.py``."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

import packing_hf.attention.sequence_parallel as sequence_parallel
from packing_hf import ATTENTION_NAME, PaddingFreeCollator, prepare_model_for_packing, register_attention
from packing_hf._loss import loss_counts, loss_numerator, step_denominator
from packing_hf.attention.sequence_parallel import (
    SHARD_KEY,
    check_sequence_parallel_model,
    shard_lengths,
    shard_packed_batch,
)
from packing_hf.attention.ulysses import SequenceShard, _spread_kv_heads
from packing_hf.shard_loss import sequence_parallel_loss


def _llama(heads: int = 4, kv_heads: int = 2):
    config = AutoConfig.for_model(
        "llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=heads, num_key_value_heads=kv_heads,
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


def test_shard_lengths_cover_the_row_without_padding():
    for total in range(4, 40):
        for size in (1, 2, 3, 4):
            lengths = shard_lengths(total, size)
            assert sum(lengths) == total and max(lengths) - min(lengths) <= 1
    with pytest.raises(ValueError, match="raise max_tokens_per_batch or lower sp_size"):
        shard_lengths(3, 4)


@pytest.mark.parametrize("normalization", ["token", "sample", "sample_sum"])
def test_a_one_rank_group_trains_the_row_itself(normalization, assert_close):
    model = _llama()
    row = _row(weighted=True)
    shard = shard_packed_batch(row)
    assert shard["input_ids"].shape == row["input_ids"].shape and SHARD_KEY in shard
    assert "labels" not in shard  # the model computes no loss of its own on a shard
    logits = model(**shard).logits
    inputs = {k: v for k, v in row.items() if k not in ("labels", "loss_weights")}
    want_logits = model(**inputs).logits
    assert_close(logits, want_logits, "logits", rel=1e-6)
    assert shard[SHARD_KEY].calls == model.config.num_hidden_layers
    per_target = F.cross_entropy(want_logits[0, :-1], row["labels"][0, 1:], reduction="none")[None]
    args = (row["labels"], normalization, row["loss_weights"], row["position_ids"], row["cu_seq_lens_q"])
    counts = loss_counts(row["labels"], row["loss_weights"], row["position_ids"], row["cu_seq_lens_q"])
    want = loss_numerator(per_target, *args) / step_denominator(counts, normalization)
    assert_close(sequence_parallel_loss(logits, shard, normalization), want, "loss", rel=1e-6)
    # the same loss without the global shift (each token predicting itself) is caught
    unshifted = dict(shard, shift_labels=row["labels"])
    with pytest.raises(AssertionError):
        assert_close(sequence_parallel_loss(logits, unshifted, normalization), want, "loss", rel=1e-6)


def test_the_model_check_refuses_by_name():
    sdpa = AutoConfig.for_model("llama")
    sdpa._attn_implementation = "sdpa"
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        check_sequence_parallel_model(SimpleNamespace(config=sdpa), 2)
    hybrid = AutoConfig.for_model("bamba")
    hybrid._attn_implementation = ATTENTION_NAME
    with pytest.raises(ValueError, match="token mixers"):
        check_sequence_parallel_model(SimpleNamespace(config=hybrid), 2)
    llama = AutoConfig.for_model("llama", hidden_size=48, num_attention_heads=6, num_key_value_heads=3)
    llama._attn_implementation = ATTENTION_NAME
    with pytest.raises(ValueError, match="sp_size=4 must divide the 6 query heads"):
        check_sequence_parallel_model(SimpleNamespace(config=llama), 4)
    check_sequence_parallel_model(SimpleNamespace(config=llama), 3)  # 3 divides both


def test_key_value_heads_repeated_or_refused():
    key = torch.arange(2.0).view(1, 2, 1, 1).expand(1, 2, 3, 1)  # (1, Hkv=2, T, D)
    spread, _ = _spread_kv_heads(key, key, heads=8, kv_heads=2, size=4)
    assert spread[0, :, 0, 0].tolist() == [0.0, 0.0, 1.0, 1.0]  # rank r gets the head of its query heads
    with pytest.raises(ValueError, match="cannot split the model's 3 key/value heads"):
        _spread_kv_heads(key, key, heads=6, kv_heads=3, size=2)
    with pytest.raises(ValueError, match="choose an sp_size dividing 6"):
        _spread_kv_heads(key, key, heads=6, kv_heads=2, size=4)


def test_shards_refuse_what_they_cannot_cut_or_a_changed_call():
    row = _row()
    with pytest.raises(ValueError, match="'token_type_ids' .* is per token"):
        shard_packed_batch({**row, "token_type_ids": torch.zeros_like(row["input_ids"])})
    with pytest.raises(ValueError, match="already has 'shift_labels'"):
        shard_packed_batch({**row, "shift_labels": row["labels"]})
    with pytest.raises(ValueError, match="labels\\[0, 5\\]"):  # the whole row is checked first
        shard_packed_batch({**row, "labels": torch.where(row["labels"] < 0, 1, row["labels"])})
    shard = shard_packed_batch(row)
    model = _llama()
    moved = dict(shard, position_ids=shard["position_ids"] + 1)
    with pytest.raises(ValueError, match="rotary embeddings would be offset"):
        model(**moved)
    cut = SequenceShard(None, 1, [4, 4], row["cu_seq_lens_q"], row["position_ids"])
    with prepare_model_for_packing(model):  # the model pre-hook checks the shard's call
        with pytest.raises(ValueError, match="not this shard's \\(1, 4\\)"):
            model(**dict(shard, **{SHARD_KEY: cut}))
        with pytest.raises(ValueError, match="attention_mask was passed next to a sequence-parallel shard"):
            model(**shard, attention_mask=torch.ones_like(shard["input_ids"]))


def test_each_shard_carries_its_part_of_the_padding_closing_the_row(monkeypatch):
    """``PADDING_KEY`` (the padding of pad_to_multiple_of / length_buckets) counts the tail of the whole row: every
    rank's shard gets the count of its own tail, which is padding (the rank's group is faked: one process)."""
    from packing_hf.varlen import PADDING_KEY

    row = PaddingFreeCollator(pad_to_multiple_of=16)(
        [{"input_ids": list(range(1, 8))}, {"input_ids": [3, 4, 5]}]
    )
    assert row["input_ids"].shape[1] == 16 and int(row[PADDING_KEY]) == 6
    monkeypatch.setattr(
        sequence_parallel, "_check_same_row", lambda *args: None
    )  # the all-gather of the group
    monkeypatch.setattr(sequence_parallel.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(sequence_parallel.dist, "get_world_size", lambda group=None: 3)
    counts, tails = [], []
    for rank in range(3):
        monkeypatch.setattr(sequence_parallel.dist, "get_rank", lambda group=None, rank=rank: rank)
        shard = shard_packed_batch(row)
        counts.append(int(shard[PADDING_KEY]))
        ids = shard["input_ids"][0]
        tails.append(ids[ids.numel() - counts[-1] :].tolist())
    assert counts == [0, 1, 5]  # shards of 6, 5, 5 tokens: the row's last 6 are padding
    assert all(all(t == 0 for t in tail) for tail in tails)  # pad_token_id 0: exactly the padding


def _mixtral(coefficient: float):
    config = AutoConfig.for_model(
        "mixtral", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        output_router_logits=True, router_aux_loss_coef=coefficient,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=register_attention()).float()


@pytest.mark.parametrize("coefficient", [0.5, 0.0])
def test_a_router_loss_is_refused_at_set_up_and_in_the_loss_route(coefficient):
    """The SP loss is the shards' logits' alone: a router load-balancing loss (not a sum over shards) would be
    left out of the step, so a model adding one to its loss is refused by name, where the trainer sets up SP and
    in the loss route; ``router_aux_loss_coef=0`` (nothing left out) is the negative control and runs."""
    from packing_hf.integrations.loss_policy import LossPolicy, StockLoss
    from packing_hf.integrations.sequence_parallel import PackingSequenceParallelMixin

    model = _mixtral(coefficient)
    plan = SimpleNamespace(sequence_parallel=True, sp_size=2, sp_group=None, world_size=1)
    trainer = SimpleNamespace(
        args=SimpleNamespace(loss_normalization="token"), parallel_plan=plan, model=model,
        accelerator=SimpleNamespace(unwrap_model=lambda m: m),
    )  # fmt: skip
    trainer._shard_row = lambda *args: PackingSequenceParallelMixin._shard_row(trainer, *args)

    def refused():
        message = r"sp_size=2.*router load-balancing loss.*output_router_logits=False"
        return pytest.raises(ValueError, match=message) if coefficient else contextlib.nullcontext()

    with refused():
        LossPolicy(StockLoss.CAUSAL_LM, plan).check_setup(trainer)
    model.train()
    batch = _row()
    with refused():
        loss = PackingSequenceParallelMixin._sequence_parallel_loss(trainer, model, batch, None, 6, False)
    if not coefficient:
        assert torch.isfinite(loss)


def test_a_prefix_tree_row_is_cut_with_its_parents(assert_close):
    """A prefix-tree row's shard carries ``prefix_seq_idx`` (segments of the whole row, which the attention
    holds) and the row's tree positions: on a one-rank group its logits are the row's. A row shorter than the
    group gets root segments for the tokens added; a label at a child's first token is refused (the row's
    shifted labels would train the previous row token to predict it)."""
    from packing_hf.prefix_tree import build_prefix_tree

    tree = build_prefix_tree([[5, 6, 7, 8, 9], [5, 6, 7, 3], [5, 6, 4, 4]])
    labels = tree.input_ids[None].clone()
    labels[0, tree.cu_seqlens[:-1].long()] = -100
    row = {**tree.model_inputs(), "labels": labels}
    shard = shard_packed_batch(row)
    assert torch.equal(shard["prefix_seq_idx"], tree.prefix_seq_idx)
    assert torch.equal(shard["position_ids"], tree.position_ids[None])
    model = _llama()
    want = model(**tree.model_inputs()).logits
    assert_close(model(**shard).logits, want, "logits", rel=1e-6)
    short = sequence_parallel._lengthen_row(sequence_parallel._checked_row(row), 10)
    assert short["prefix_seq_idx"].tolist() == [*tree.prefix_seq_idx.tolist(), -1, -1]
    labels[0, int(tree.cu_seqlens[2])] = 3
    with pytest.raises(ValueError, match="at the first token of a packed sample"):
        shard_packed_batch({**row, "labels": labels})
