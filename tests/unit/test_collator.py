"""PaddingFreeCollator: exact tensors, loss masks, offline-packed rows, overflow policies, bad input,
and equivalence with transformers' DataCollatorWithFlattening and TRL's padding-free collator on real data."""

from __future__ import annotations

import logging
import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from packing_hf import PaddingFreeCollator
from packing_hf.varlen import cu_seqlens_to_position_ids, cu_seqlens_to_seq_idx, position_ids_to_cu_seqlens

STOCK_KEYS = (
    "input_ids",
    "labels",
    "position_ids",
    "cu_seq_lens_q",
    "cu_seq_lens_k",
    "max_length_q",
    "max_length_k",
)


def as_lists(batch: dict) -> dict:
    return {k: v.tolist() if hasattr(v, "tolist") else v for k, v in batch.items()}


def assert_same_batch(expected: dict, got: dict, keys=None) -> None:
    for key in keys or expected:
        e, g = expected[key], got[key]
        if isinstance(e, torch.Tensor | np.ndarray):
            assert type(g) is type(e), key
            assert g.dtype == e.dtype, (key, g.dtype, e.dtype)
            assert g.shape == e.shape, (key, g.shape, e.shape)
            assert (g == e).all(), key
        else:
            assert type(g) is type(e) and g == e, (key, g, e)


# ---------------------------------------------------------------------------------------------------- exact


def test_two_samples_exact_tensors():
    out = PaddingFreeCollator(return_seq_idx=True)([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])
    assert set(out) == {"input_ids", "labels", "position_ids", "seq_idx", *STOCK_KEYS[3:]}
    assert "attention_mask" not in out
    assert out["input_ids"].dtype == out["labels"].dtype == out["position_ids"].dtype == torch.int64
    assert out["cu_seq_lens_q"].dtype == out["seq_idx"].dtype == torch.int32
    assert as_lists(out) == {
        "input_ids": [[1, 2, 3, 4, 5]],
        "labels": [[-100, 2, 3, -100, 5]],
        "position_ids": [[0, 1, 2, 0, 1]],
        "seq_idx": [[0, 0, 0, 1, 1]],
        "cu_seq_lens_q": [0, 3, 5],
        "cu_seq_lens_k": [0, 3, 5],
        "max_length_q": 3,
        "max_length_k": 3,
    }
    assert isinstance(out["max_length_q"], int)


def test_given_labels_keep_their_values_but_lose_their_first_token():
    out = PaddingFreeCollator(label_pad_id=-1)(
        [{"input_ids": [1, 2, 3], "labels": [7, -100, 9]}, {"input_ids": [4, 5], "labels": [8, 6]}]
    )
    assert out["labels"].tolist() == [[-1, -100, 9, -1, 6]]


def test_completion_and_assistant_masks_are_and_ed():
    features = [
        {"input_ids": [1, 2, 3, 4], "completion_mask": [0, 1, 1, 1], "assistant_masks": [1, 1, 0, 1]},
        {
            "input_ids": [5, 6, 7],
            "completion_mask": [1, 1, 1],
            "assistant_masks": np.array([True, False, True]),
        },
    ]
    out = PaddingFreeCollator()(features)
    assert out["labels"].tolist() == [[-100, 2, -100, 4, -100, -100, 7]]
    only_completion = PaddingFreeCollator()(
        [{k: v for k, v in f.items() if k != "assistant_masks"} for f in features]
    )
    assert only_completion["labels"].tolist() == [[-100, 2, 3, 4, -100, 6, 7]]


def test_masks_apply_on_top_of_given_labels():
    out = PaddingFreeCollator()(
        [{"input_ids": [1, 2, 3, 4], "labels": [1, -100, 3, 4], "completion_mask": [1, 1, 1, 0]}]
    )
    assert out["labels"].tolist() == [[-100, -100, 3, -100]]


def test_seq_lengths_rows_split_into_their_samples():
    features = [
        {"input_ids": [1, 2, 3, 4, 5], "seq_lengths": [3, 2]},  # a row packed offline (TRL bfd)
        {"input_ids": [6, 7]},  # a plain sample in the same batch
    ]
    out = PaddingFreeCollator(return_seq_idx=True)(features)
    assert out["labels"].tolist() == [[-100, 2, 3, -100, 5, -100, 7]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1]]
    assert out["cu_seq_lens_q"].tolist() == [0, 3, 5, 7]
    assert out["seq_idx"].tolist() == [[0, 0, 0, 1, 1, 2, 2]]
    assert out["max_length_q"] == 3


def test_padding_forms_its_own_segment():
    collator = PaddingFreeCollator(pad_to_multiple_of=8, pad_token_id=9, return_seq_idx=True)
    out = collator([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])
    assert out["input_ids"].tolist() == [[1, 2, 3, 4, 5, 9, 9, 9]]
    assert out["labels"].tolist() == [[-100, 2, 3, -100, 5, -100, -100, -100]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert out["cu_seq_lens_q"].tolist() == [0, 3, 5, 8]
    assert out["seq_idx"].tolist() == [[0, 0, 0, 1, 1, 2, 2, 2]]
    assert collator.stats["padding_tokens"] == 3 and collator.stats["tokens"] == 5
    # already a multiple: no padding segment at all
    out = collator([{"input_ids": [1, 2, 3, 4]}, {"input_ids": [5, 6, 7, 8]}])
    assert out["cu_seq_lens_q"].tolist() == [0, 4, 8]


def test_position_ids_start_shifts_every_segment():
    out = PaddingFreeCollator(position_ids_start=2, pad_to_multiple_of=4)(
        [{"input_ids": [1, 2]}, {"input_ids": [3]}]
    )
    assert out["position_ids"].tolist() == [[2, 3, 2, 2]]
    assert out["cu_seq_lens_q"].tolist() == [0, 2, 3, 4]


def test_optional_outputs_can_be_switched_off():
    out = PaddingFreeCollator(return_flash_attn_kwargs=False)([{"input_ids": [1, 2]}])
    assert set(out) == {"input_ids", "labels", "position_ids"}
    out = PaddingFreeCollator(return_position_ids=False)([{"input_ids": [1, 2]}])
    assert "position_ids" not in out and out["cu_seq_lens_k"].tolist() == [0, 2]
    with pytest.raises(ValueError, match="no way to see sample boundaries"):
        PaddingFreeCollator(return_position_ids=False, return_flash_attn_kwargs=False)


def test_numpy_output_has_the_same_values_and_dtypes():
    features = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}]
    pt = PaddingFreeCollator(return_seq_idx=True)(features)
    np_out = PaddingFreeCollator(return_seq_idx=True, return_tensors="np")(features)
    also_np = PaddingFreeCollator(return_seq_idx=True)(features, return_tensors="np")
    for key, value in pt.items():
        if isinstance(value, torch.Tensor):
            assert isinstance(np_out[key], np.ndarray) and np_out[key].dtype == value.numpy().dtype
            np.testing.assert_array_equal(np_out[key], value.numpy())
            np.testing.assert_array_equal(also_np[key], value.numpy())
        else:
            assert np_out[key] == value


def test_lists_arrays_and_tensors_collate_alike_and_inputs_are_not_modified():
    ids = [[3, 4, 5], [6, 7]]
    labels = [[3, 4, 5], [6, 7]]
    expected = PaddingFreeCollator()(
        [{"input_ids": i, "labels": lab} for i, lab in zip(ids, labels, strict=True)]
    )
    np_labels = [np.array(x, dtype=np.int32) for x in labels]
    t_labels = [torch.tensor(x) for x in labels]
    mixed = [
        {"input_ids": np.array(ids[0], dtype=np.int32), "labels": np_labels[0]},
        {"input_ids": torch.tensor(ids[1]), "labels": t_labels[1]},
    ]
    assert_same_batch(expected, PaddingFreeCollator()(mixed))
    assert np_labels[0].tolist() == labels[0] and t_labels[1].tolist() == labels[1]
    assert labels == [[3, 4, 5], [6, 7]]


def test_extra_keys_are_refused_unless_dropped_or_passed_through_and_position_ids_recomputed():
    features = [
        {
            "input_ids": [1, 2, 3],
            "attention_mask": [1, 1, 1],
            "position_ids": [10, 11, 12],
            "text": "a",
            "messages": [],
        },
        {
            "input_ids": [4, 5],
            "attention_mask": [1, 1],
            "position_ids": [13, 14],
            "text": "b",
            "messages": [],
        },
    ]
    with pytest.raises(ValueError, match=r"the samples carry \['messages', 'text'\].*drop_keys"):
        PaddingFreeCollator()(features)
    out = PaddingFreeCollator(drop_keys=("text", "messages"))(features)
    assert "attention_mask" not in out and "text" not in out
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1]]


def test_passthrough_keys_reach_the_batch_concatenated():
    """Multimodal inputs are handed on, not lost: per-sample image tensors concatenated along dim 0."""
    features = [
        {"input_ids": [1, 2, 3], "pixel_values": torch.ones(1, 3, 2, 2)},
        {"input_ids": [4, 5]},  # a text-only sample
        {"input_ids": [6], "pixel_values": torch.zeros(2, 3, 2, 2)},
    ]
    with pytest.raises(ValueError, match="pixel_values"):
        PaddingFreeCollator()(features)
    out = PaddingFreeCollator(passthrough_keys=("pixel_values",))(features)
    assert out["pixel_values"].shape == (3, 3, 2, 2) and out["pixel_values"][0].eq(1).all()
    assert out["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6]]
    with pytest.raises(ValueError, match="read by the collator itself"):
        PaddingFreeCollator(drop_keys=("labels",))


def test_input_columns_name_every_consumed_key():
    assert set(PaddingFreeCollator.input_columns) == {
        "input_ids",
        "labels",
        "completion_mask",
        "assistant_masks",
        "seq_lengths",
        "loss_weights",
    }


# ------------------------------------------------------------------------------------------------- overflow


def test_overflow_error_names_the_sample_and_the_fixes():
    collator = PaddingFreeCollator(max_length=3)
    with pytest.raises(ValueError, match=r"sample 1 has 4 tokens > max_length=3.*overflow='truncate'"):
        collator([{"input_ids": [1, 2]}, {"input_ids": [3, 4, 5, 6]}])
    with pytest.raises(ValueError, match=r"sample 0 \(a sub-sample of its seq_lengths\) has 4 tokens"):
        collator([{"input_ids": [1, 2, 3, 4, 5], "seq_lengths": [1, 4]}])


def test_overflow_truncate_keeps_the_head_and_counts(caplog):
    collator = PaddingFreeCollator(max_length=3, overflow="truncate")
    with caplog.at_level(logging.WARNING, logger="packing_hf.collator"):
        out = collator(
            [
                {"input_ids": [1, 2, 3, 4, 5], "labels": [1, 2, 3, 4, 5]},
                {"input_ids": [6, 7], "labels": [6, 7]},
            ]
        )
        collator([{"input_ids": [1, 2, 3, 4]}])
    assert out["input_ids"].tolist() == [[1, 2, 3, 6, 7]]
    assert out["labels"].tolist() == [[-100, 2, 3, -100, 7]]
    assert out["cu_seq_lens_q"].tolist() == [0, 3, 5]
    assert collator.stats["truncated_samples"] == 2 and collator.stats["truncated_tokens"] == 3
    warnings = [r for r in caplog.records if "truncated" in r.getMessage()]
    assert len(warnings) == 1  # logged once, counted always


def test_overflow_split_makes_separate_chunks_and_counts():
    collator = PaddingFreeCollator(max_length=2, overflow="split", return_seq_idx=True)
    out = collator([{"input_ids": [1, 2, 3, 4, 5]}, {"input_ids": [6, 7]}])
    assert out["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7]]
    assert out["cu_seq_lens_q"].tolist() == [0, 2, 4, 5, 7]
    assert out["position_ids"].tolist() == [[0, 1, 0, 1, 0, 0, 1]]
    assert out["labels"].tolist() == [[-100, 2, -100, 4, -100, -100, 7]]
    assert out["max_length_q"] == 2
    assert collator.stats["split_samples"] == 1 and collator.stats["split_chunks"] == 3
    collator.reset_stats()
    assert collator.stats["split_samples"] == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_length": 0}, "max_length"),
        ({"overflow": "drop"}, "overflow"),
        ({"pad_to_multiple_of": 0}, "pad_to_multiple_of"),
        ({"return_tensors": "tf"}, "return_tensors"),
    ],
)
def test_bad_configuration_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PaddingFreeCollator(**kwargs)


# ------------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("features", "error", "message"),
    [
        ([], ValueError, "empty batch"),
        ({"input_ids": [[1, 2]]}, TypeError, r"one dict of columns \['input_ids'\].*list of rows"),
        ([{"input_ids": [1]}, {"text": "hi"}], ValueError, r"sample 1 has no 'input_ids'"),
        ([{"input_ids": [1]}, [1, 2]], TypeError, r"sample 1 is a list"),
        ([{"input_ids": [1]}, {"input_ids": []}], ValueError, r"sample 1: 'input_ids' is empty"),
        ([{"input_ids": [1, 2.5]}], TypeError, r"sample 0: input_ids\[1\] = 2.5 is a float"),
        (
            [{"input_ids": [1]}, {"input_ids": [1, "a"]}],
            TypeError,
            r"sample 1: input_ids\[1\] = 'a' is a str",
        ),
        ([{"input_ids": [1]}, {"input_ids": [None]}], TypeError, r"sample 1: input_ids\[0\] = None"),
        ([{"input_ids": [1]}, {"input_ids": "abc"}], TypeError, r"sample 1: 'input_ids' must be a list"),
        ([{"input_ids": [3, -1]}], ValueError, r"sample 0: input_ids\[1\] = -1 is negative"),
        ([{"input_ids": [1]}, {"input_ids": [2, 3, -5]}], ValueError, r"sample 1: input_ids\[2\] = -5"),
        ([{"input_ids": torch.tensor([[1, 2]])}], ValueError, r"sample 0: 'input_ids' has shape \(1, 2\)"),
        ([{"input_ids": [[1, 2]]}], ValueError, r"sample 0: input_ids\[0\] is itself a sequence"),
        (
            [{"input_ids": torch.tensor([1.0])}],
            TypeError,
            r"sample 0: 'input_ids' is a tensor of dtype torch.float32",
        ),
        ([{"input_ids": np.array([True])}], TypeError, r"sample 0: 'input_ids' is an array of dtype bool"),
        ([{"input_ids": [1]}, {"input_ids": [2**70]}], ValueError, r"sample 1: 'input_ids' holds a value"),
        (
            [{"input_ids": [1, 2], "labels": [1]}],
            ValueError,
            r"sample 0: 'labels' has 1 values but 'input_ids' has 2",
        ),
        ([{"input_ids": [1]}, {"input_ids": [2], "labels": [2]}], ValueError, r"sample 0 has no 'labels'"),
        ([{"input_ids": [1], "labels": [1.0]}], TypeError, r"sample 0: labels\[0\] = 1.0"),
        (
            [{"input_ids": [1, 2], "completion_mask": [1, 2]}],
            ValueError,
            r"sample 0: completion_mask\[1\] = 2",
        ),
        ([{"input_ids": [1]}, {"input_ids": [1, 2], "assistant_masks": [1]}], ValueError, r"sample 0 has no"),
        ([{"input_ids": [1, 2], "seq_lengths": [1, 2]}], ValueError, r"sample 0: seq_lengths sum to 3"),
        ([{"input_ids": [1, 2], "seq_lengths": [2, 0]}], ValueError, r"sample 0: seq_lengths = \[2, 0\]"),
    ],
)
def test_bad_input_names_the_sample_and_the_field(features, error, message):
    with pytest.raises(error, match=message):
        PaddingFreeCollator()(features)


# ------------------------------------------------------------------------------------------ process safety


def test_collator_pickles_with_its_configuration():
    collator = PaddingFreeCollator(max_length=4, overflow="split", pad_to_multiple_of=2, return_seq_idx=True)
    collator([{"input_ids": [1, 2, 3, 4, 5]}])
    clone = pickle.loads(pickle.dumps(collator))
    assert clone == collator and clone.stats == collator.stats
    features = [{"input_ids": [1, 2, 3, 4, 5, 6]}, {"input_ids": [7]}]
    assert_same_batch(collator(features), clone(features))


def test_datasets_rows_through_a_dataloader_with_a_worker():
    from datasets import Dataset

    ds = Dataset.from_dict(
        {
            "input_ids": [[1, 2, 3], [4, 5], [6, 7, 8, 9]],
            "completion_mask": [[0, 1, 1], [1, 1], [0, 0, 1, 1]],
            "text": ["a", "b", "c"],
        }
    )
    collator = PaddingFreeCollator(drop_keys=("text",))
    loader = torch.utils.data.DataLoader(ds, batch_size=3, collate_fn=collator, num_workers=1)
    (batch,) = list(loader)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9]]
    assert batch["labels"].tolist() == [[-100, 2, 3, -100, 5, -100, -100, 8, 9]]
    # numpy- and torch-formatted datasets give the same batch
    for fmt in ("numpy", "torch"):
        rows = [ds.with_format(fmt, columns=["input_ids", "completion_mask"])[i] for i in range(3)]
        assert_same_batch(batch, collator(rows))


# ------------------------------------------------------------------------------- equivalence on real data


def real_batches(gsm8k_tokenized, sizes=(1, 7, 32)):
    start = 0
    for size in sizes:
        yield [dict(f) for f in gsm8k_tokenized[start : start + size]]
        start += size


def with_prompt_labels(features):
    """Labels with a prompt-like prefix masked (varying per sample), as an SFT dataset holds them."""
    return [
        {"input_ids": f["input_ids"], "labels": [-100] * (i % 17 + 3) + f["input_ids"][i % 17 + 3 :]}
        for i, f in enumerate(features)
    ]


def test_matches_transformers_data_collator_with_flattening(gsm8k_tokenized):
    from transformers import DataCollatorWithFlattening

    for start in (0, 2):
        stock = DataCollatorWithFlattening(
            return_flash_attn_kwargs=True, return_seq_idx=True, position_ids_start=start
        )
        ours = PaddingFreeCollator(return_seq_idx=True, position_ids_start=start)
        for batch in real_batches(gsm8k_tokenized):
            for features in (batch, with_prompt_labels(batch)):
                expected = stock(features)
                assert set(expected) <= set(ours(features))
                assert_same_batch(expected, ours(features))
                assert_same_batch(stock(features, return_tensors="np"), ours(features, return_tensors="np"))


def test_matches_trl_padding_free_collator(gsm8k_tokenized, tokenizer):
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    trl_collator = DataCollatorForLanguageModeling(pad_token_id=tokenizer.pad_token_id, padding_free=True)
    ours = PaddingFreeCollator(pad_token_id=tokenizer.pad_token_id, return_seq_idx=True)
    for batch in real_batches(gsm8k_tokenized):
        for features in (batch, with_prompt_labels(batch)):
            expected = trl_collator(features)
            assert set(expected) <= set(ours(features))
            assert_same_batch(expected, ours(features))


def test_matches_trl_on_rows_packed_offline_by_trl_bfd(gsm8k_tokenized, tokenizer):
    from datasets import Dataset
    from trl.data_utils import pack_dataset
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    ds = Dataset.from_list(with_prompt_labels(gsm8k_tokenized[:64]))
    packed = pack_dataset(ds, seq_length=1024, strategy="bfd", map_kwargs={"desc": None})
    assert "seq_lengths" in packed.column_names and max(map(len, packed["seq_lengths"])) > 1
    rows = [packed[i] for i in range(min(4, len(packed)))]
    trl_collator = DataCollatorForLanguageModeling(pad_token_id=tokenizer.pad_token_id, padding_free=True)
    ours = PaddingFreeCollator(pad_token_id=tokenizer.pad_token_id, return_seq_idx=True)
    expected = trl_collator(rows)
    got = ours(rows)
    assert_same_batch(expected, got)
    assert len(got["cu_seq_lens_q"]) - 1 == sum(len(r["seq_lengths"]) for r in rows)


# ---------------------------------------------------------------------------------------------- properties

samples = st.lists(
    st.lists(st.integers(min_value=0, max_value=50_000), min_size=1, max_size=40), min_size=1, max_size=12
)


@settings(max_examples=60, deadline=None)
@given(
    samples=samples,
    max_length=st.one_of(st.none(), st.integers(min_value=1, max_value=30)),
    pad=st.one_of(st.none(), st.integers(min_value=1, max_value=16)),
    start=st.integers(min_value=0, max_value=2),
)
def test_split_loses_and_duplicates_no_token(samples, max_length, pad, start):
    collator = PaddingFreeCollator(
        max_length=max_length,
        overflow="split",
        pad_to_multiple_of=pad,
        position_ids_start=start,
        return_seq_idx=True,
    )
    out = collator([{"input_ids": s} for s in samples])
    flat = [t for s in samples for t in s]
    ids = out["input_ids"][0].tolist()
    total = len(ids)
    n_pad = total - len(flat)
    assert ids[: len(flat)] == flat and 0 <= n_pad < (pad or 1)
    assert total % (pad or 1) == 0
    cu = out["cu_seq_lens_q"]
    assert int(cu[-1]) == total
    # the numpy positions / seq_idx agree with varlen's torch reference, and round-trip to cu_seqlens
    assert torch.equal(out["position_ids"][0], cu_seqlens_to_position_ids(cu, start=start))
    assert torch.equal(out["seq_idx"][0], cu_seqlens_to_seq_idx(cu))
    assert torch.equal(position_ids_to_cu_seqlens(out["position_ids"], start=start), cu)
    assert out["max_length_q"] == int((cu[1:] - cu[:-1]).max())
    if max_length is not None:
        assert int((cu[1:] - cu[:-1])[: len(cu) - 1 - (n_pad > 0)].max()) <= max_length
    # labels: the token itself, except at every segment start and in the padding
    labels = out["labels"][0].tolist()
    starts = set(cu[:-1].tolist())
    for i, label in enumerate(labels):
        expected = -100 if (i in starts or i >= len(flat)) else ids[i]
        assert label == expected


@settings(max_examples=40, deadline=None)
@given(samples=samples, max_length=st.integers(min_value=1, max_value=30))
def test_truncate_keeps_exactly_the_head_of_every_sample(samples, max_length):
    collator = PaddingFreeCollator(max_length=max_length, overflow="truncate")
    out = collator([{"input_ids": s} for s in samples])
    assert out["input_ids"][0].tolist() == [t for s in samples for t in s[:max_length]]
    assert collator.stats["truncated_tokens"] == sum(max(0, len(s) - max_length) for s in samples)
    assert collator.stats["truncated_samples"] == sum(len(s) > max_length for s in samples)
