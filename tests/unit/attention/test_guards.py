"""Guards on packed batches: each way a packed row could leak is fixed or refused with a clear error."""

from __future__ import annotations

import pytest
import torch

from packing_hf.attention.guards import (
    find_packed_boundaries,
    packed_forward_pre_hook,
    validate_packed_batch,
)
from packing_hf.varlen import INT32_MAX, lengths_to_cu_seqlens, lengths_to_position_ids


def packed(lengths=(3, 2, 4), **extra):
    """A PaddingFreeCollator-style batch: one row, restarting positions, cu_seq_lens, masked labels."""
    total = sum(lengths)
    cu = lengths_to_cu_seqlens(lengths)
    positions = lengths_to_position_ids(lengths)
    labels = torch.arange(10, 10 + total)
    labels[positions == 0] = -100
    batch = {
        "input_ids": torch.arange(10, 10 + total).unsqueeze(0),
        "labels": labels.unsqueeze(0),
        "position_ids": positions.unsqueeze(0),
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": max(lengths),
        "max_length_k": max(lengths),
    }
    batch.update(extra)
    return batch


def test_a_good_packed_batch_passes_and_turns_the_cache_off():
    batch = packed()
    out = validate_packed_batch(batch)
    assert out["use_cache"] is False
    assert out["input_ids"] is batch["input_ids"]  # tensors are passed through, not copied
    assert "use_cache" not in batch  # the caller's dict is not modified


@pytest.mark.parametrize("use_cache", [True, None])
def test_use_cache_true_or_default_is_switched_off(use_cache):
    batch = packed() if use_cache is None else packed(use_cache=use_cache)
    assert validate_packed_batch(batch, config=None)["use_cache"] is False


def test_a_config_without_cache_needs_no_flag():
    class Config:
        use_cache = False

    assert "use_cache" not in validate_packed_batch(packed(), Config())


@pytest.mark.parametrize("name", ["past_key_values", "cache"])  # cache: transformers 5.24's name for it
def test_a_cache_next_to_a_packed_row_is_refused(name):
    with pytest.raises(ValueError, match=f"{name} was passed with a packed row"):
        validate_packed_batch(packed(**{name: object()}))


def test_an_all_ones_attention_mask_is_dropped():
    out = validate_packed_batch(packed(attention_mask=torch.ones(1, 9, dtype=torch.long)))
    assert "attention_mask" not in out


def test_a_padding_attention_mask_is_refused():
    mask = torch.ones(1, 9, dtype=torch.long)
    mask[0, -1] = 0
    with pytest.raises(ValueError, match="attention_mask with padding.*drop attention_mask"):
        validate_packed_batch(packed(attention_mask=mask))


def test_cu_seq_lens_with_several_rows_are_refused():
    batch = packed()
    batch["input_ids"] = batch["input_ids"].expand(2, -1)
    batch["position_ids"] = batch["position_ids"].expand(2, -1)
    batch.pop("labels")
    with pytest.raises(ValueError, match="describes one packed row, but the batch has 2 rows"):
        validate_packed_batch(batch)


def test_several_packed_rows_without_cu_seq_lens_are_accepted():
    positions = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 0, 1, 2]])
    out = validate_packed_batch({"input_ids": torch.ones(2, 5, dtype=torch.long), "position_ids": positions})
    assert out["use_cache"] is False


def test_positions_not_restarting_at_cu_seq_lens_boundaries_are_refused():
    batch = packed()
    batch["position_ids"] = torch.arange(9).unsqueeze(0)  # one running count: eager/sdpa see one sample
    with pytest.raises(
        ValueError, match=r"position_ids\[0, 3\] = 3 but cu_seq_lens_q puts token 3 at position 0"
    ):
        validate_packed_batch(batch)


def test_packed_samples_starting_at_an_offset_are_refused():
    batch = {"input_ids": torch.ones(1, 5, dtype=torch.long), "position_ids": torch.tensor([[0, 1, 2, 7, 8]])}
    with pytest.raises(
        ValueError, match=r"position_ids\[0, 3\] = 7 begins a packed sample.*start at position 0"
    ):
        validate_packed_batch(batch)


def test_cu_seq_lens_without_position_ids_are_refused():
    batch = packed()
    del batch["position_ids"]
    with pytest.raises(ValueError, match="without position_ids"):
        validate_packed_batch(batch)


def test_cu_seq_lens_not_covering_the_row_are_refused():
    batch = packed()
    batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = torch.tensor([0, 3, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seq_lens_q ends at 5 but the row holds 9 tokens"):
        validate_packed_batch(batch)


def test_a_max_length_shorter_than_a_sample_is_refused():
    with pytest.raises(ValueError, match="max_length_q = 2 but the longest sample.*has 4 tokens"):
        validate_packed_batch(packed(max_length_q=2))


def test_different_query_and_key_boundaries_are_refused():
    batch = packed()
    batch["cu_seq_lens_k"] = torch.tensor([0, 4, 5, 9], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seq_lens_k differs from cu_seq_lens_q"):
        validate_packed_batch(batch)


def test_an_int32_overflowing_row_is_refused_without_allocating_it():
    total = INT32_MAX + 5
    batch = {
        "input_ids": torch.empty(1, total, dtype=torch.long, device="meta"),
        "cu_seq_lens_q": torch.tensor([0, total // 2, total], dtype=torch.int64),
    }
    with pytest.raises(ValueError, match="overflows int32 cu_seqlens"):
        validate_packed_batch(batch)


def test_cu_seq_lens_past_int32_are_refused():
    # a row that fits the token budget check (one row) but whose offsets cannot be int32
    total = INT32_MAX + 1
    batch = {"cu_seq_lens_q": torch.tensor([0, total], dtype=torch.int64)}
    with pytest.raises(ValueError, match="overflows"):
        validate_packed_batch({**batch, "input_ids": torch.empty(1, total, device="meta")})


def test_labels_at_a_sample_start_are_refused():
    batch = packed()
    batch["labels"] = batch["input_ids"].clone()  # nothing masked: sample 0's last token would predict 12
    with pytest.raises(ValueError, match=r"labels\[0, 3\] = 13 at the first token of a packed sample"):
        validate_packed_batch(batch)


def test_unpacked_batches_pass_unchanged():
    batch = {"input_ids": torch.ones(2, 4, dtype=torch.long), "attention_mask": torch.ones(2, 4)}
    assert validate_packed_batch(batch) == batch
    assert find_packed_boundaries({"position_ids": torch.arange(5).unsqueeze(0)}) is None


def test_boundaries_from_cu_seq_lens_and_from_positions_agree():
    batch = packed((2, 3, 1))
    from_cu = find_packed_boundaries(batch)
    from_positions = find_packed_boundaries({"position_ids": batch["position_ids"]})
    assert from_cu.tolist() == from_positions.tolist() == [[True, False, True, False, False, True]]


def test_the_pre_hook_sees_positional_input_ids():
    batch = packed()
    ids = batch.pop("input_ids")
    batch["labels"] = ids.clone()
    with pytest.raises(ValueError, match="labels"):
        packed_forward_pre_hook(torch.nn.Module(), (ids,), batch)
    batch = packed()
    ids = batch.pop("input_ids")
    args, kwargs = packed_forward_pre_hook(torch.nn.Module(), (ids,), batch)
    assert args == (ids,) and "input_ids" not in kwargs and kwargs["use_cache"] is False


def test_flat_position_ids_of_a_packed_row_are_refused_by_name():
    # (T,) positions without the batch dimension: transformers' rotary embeddings fail on them far from the cause
    batch = packed()
    for flat in ({**batch, "position_ids": batch["position_ids"][0]},
                 {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"][0]}):  # fmt: skip
        with pytest.raises(ValueError, match=r"no batch dimension: .*position_ids\[None\]"):
            validate_packed_batch(flat)
    # negative control: the same positions with their batch dimension, and flat positions that do not restart
    validate_packed_batch(batch)
    plain = {"input_ids": torch.tensor([[5, 6, 7]]), "position_ids": torch.arange(3)}
    assert validate_packed_batch(plain) == plain


def test_three_row_multimodal_positions_are_read_as_the_model_reads_them():
    # (3, B, T) mRoPE positions carry no text row: an image sample alone (temporal row [0, 1, 2, 2, 2, 3]) is one
    # sample, not a packed row whose second sample starts at position 2
    image = torch.tensor([[0, 1, 2, 2, 2, 3], [0, 1, 2, 2, 3, 3], [0, 1, 2, 3, 2, 3]])[:, None]  # (3, 1, 6)
    alone = {"input_ids": torch.arange(6)[None], "position_ids": image}
    assert find_packed_boundaries(alone) is None and validate_packed_batch(alone) == alone
    # negative control: the temporal row read as text positions is refused as a sample starting at position 2
    with pytest.raises(ValueError, match=r"position_ids\[0, 3\] = 2 begins a packed sample"):
        validate_packed_batch({**alone, "position_ids": image[0]})
    # a right-padded batch of two (the model's own positions: padding slots at 1, as get_rope_index leaves them)
    padded = torch.stack([image[:, 0], torch.tensor([[0, 1, 2, 1, 1, 1]] * 3)], dim=1)  # (3, 2, 6)
    mask = torch.tensor([[1] * 6, [1, 1, 1, 0, 0, 0]])
    batch = {"input_ids": torch.ones(2, 6, dtype=torch.long), "position_ids": padded, "attention_mask": mask}
    assert validate_packed_batch(batch) == batch


def test_three_row_positions_of_a_packed_row_need_cu_seq_lens():
    positions = lengths_to_position_ids([3, 2])[None].expand(3, 1, 5)
    with pytest.raises(ValueError, match="restart at token 3 of row 0 .* Pass cu_seq_lens_q/k next to them"):
        validate_packed_batch({"input_ids": torch.arange(5)[None], "position_ids": positions})
    batch = packed((3, 2), position_ids=positions)
    assert validate_packed_batch(batch)["position_ids"] is positions
    late = positions.clone()
    late[2, 0, 3] = 1  # the second sample's width row does not start at 0
    with pytest.raises(
        ValueError, match=r"position_ids\[:, 0, 3\] = \[0, 0, 1\] at the start of a packed sample"
    ):
        validate_packed_batch(packed((3, 2), position_ids=late))


def test_the_padding_key_must_be_the_segment_closing_the_row():
    from packing_hf.varlen import PADDING_KEY

    validate_packed_batch(packed((3, 2, 4), **{PADDING_KEY: torch.tensor(4)}))
    validate_packed_batch(packed((3, 2), **{PADDING_KEY: torch.tensor(0)}))
    with pytest.raises(ValueError, match="says the last 3 tokens of the row are padding"):
        validate_packed_batch(packed((3, 2, 4), **{PADDING_KEY: torch.tensor(3)}))
    with pytest.raises(ValueError, match="says the last 4 tokens"):  # the row's only segment is no padding
        validate_packed_batch(packed((4,), **{PADDING_KEY: torch.tensor(4)}))
