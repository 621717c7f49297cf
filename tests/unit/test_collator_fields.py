"""Issue 40, item 6: every field a collator accepts changes what it returns, or is refused by name.

``FIELDS`` has one row per (collator, field): the value to try, and the other settings that make it matter
(``overflow`` means something only with ``max_length``); or ``REFUSED``. For a used field, the collated probe
batch with the value must differ from the batch with the field's default (an error on one side counts as a
difference: ``passthrough_keys`` is what turns an unknown key from an error into a model input). For a
refused one, the constructor must raise a ``ValueError`` naming the field. A collator field without a row
fails :func:`test_every_field_has_a_row`.

``length_buckets`` / ``segment_buckets`` of the preference collators are also checked for exactness: the
padded row holds the same real tokens, targets and padded layout as the unbucketed one.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from packing_hf import PaddingFreeCollator
from packing_hf.pair_rows import PaddingFreePairCollator, PaddingFreeTripleCollator
from packing_hf.preference import PaddingFreePreferenceCollator, PaddingFreeRewardCollator
from packing_hf.unpaired import PaddingFreeUnpairedCollator

REFUSED = object()

SAMPLES = [{"input_ids": [5, 6, 7, 8, 9]}, {"input_ids": [10, 11]}]
PAIRS = [
    {"prompt_ids": [1, 2, 3], "chosen_ids": [4, 5], "rejected_ids": [6]},
    {"prompt_ids": [7], "chosen_ids": [8, 9, 10], "rejected_ids": [11, 12]},
]
REWARD = [
    {"chosen_ids": [1, 2, 3, 4], "rejected_ids": [5]},
    {"chosen_ids": [6, 7], "rejected_ids": [8, 9, 10]},
]
KTO = [
    {"prompt_ids": [1, 2], "completion_ids": [3, 4, 5], "label": True},
    {"prompt_ids": [6], "completion_ids": [7], "label": False},
]
ORPO = [
    {"chosen_input_ids": [1, 2, 3, 4], "chosen_labels": [-100, 2, 3, 4], "rejected_input_ids": [1, 5],
     "rejected_labels": [-100, 5]},
    {"chosen_input_ids": [6, 7], "chosen_labels": [-100, 7], "rejected_input_ids": [6, 8, 9],
     "rejected_labels": [-100, 8, 9]},
]  # fmt: skip
TPO = [
    {"prompt_ids": [1, 2], "chosen_ids": [3, 4, 5], "rejected_ids": [6], "reference_ids": [7, 8]},
    {"prompt_ids": [9], "chosen_ids": [10], "rejected_ids": [11, 12], "reference_ids": [13]},
]
EXTRA = [dict(f, extra=1) for f in SAMPLES]  # a key the collator does not read

TRUNCATE = {"overflow": "truncate"}
# the fields every PaddingFreeCollator subclass inherits: (value, the settings that make it matter)
BASE = {
    "max_length": (4, TRUNCATE),
    "overflow": ("truncate", {"max_length": 4}),
    "pad_to_multiple_of": (16, {}),
    "length_buckets": ((32, 64), {}),
    "segment_buckets": ((8, 16), {}),
    "pad_token_id": (99, {"pad_to_multiple_of": 16}),
    "label_pad_id": (-1, {}),
    "position_ids_start": (2, {}),
    "return_seq_idx": (True, {}),
    "return_flash_attn_kwargs": (False, {}),
    "return_position_ids": (False, {}),
    "return_tensors": ("np", {}),
    "passthrough_keys": (("extra",), {}),
    "drop_keys": (("extra",), {}),
}
PAIR_FIELDS = {
    **BASE,
    "max_length": (3, TRUNCATE),
    "overflow": ("truncate", {"max_length": 3}),
    "pad_to_multiple_of": (32, {}),
    "pad_token_id": (99, {}),  # it also fills TRL's padded layout
    "label_pad_id": REFUSED,  # no labels returned: the trainer derives them
    "passthrough_keys": REFUSED,  # nothing but the pair's columns reaches the model
    "drop_keys": REFUSED,
    "truncation_mode": ("keep_end", {"max_length": 3, **TRUNCATE}),
    "shared_prompt": (True, {}),
    "share_prefixes": (True, {}),
    "min_shared_tokens": (2, {"share_prefixes": True}),
}
NO_TREE = {"share_prefixes": REFUSED, "min_shared_tokens": REFUSED}
NO_PADDING = {"pad_to_multiple_of": REFUSED, "length_buckets": REFUSED, "segment_buckets": REFUSED}
# collator -> (probe features, {field: (value, settings) or REFUSED})
FIELDS = {
    PaddingFreeCollator: (SAMPLES, BASE),
    PaddingFreePreferenceCollator: (PAIRS, PAIR_FIELDS),
    PaddingFreeRewardCollator: (REWARD, {**PAIR_FIELDS, **NO_TREE, "shared_prompt": REFUSED}),
    PaddingFreeUnpairedCollator: (
        KTO,
        {**PAIR_FIELDS, **NO_PADDING, **NO_TREE, "shared_prompt": REFUSED, "truncation_mode": REFUSED},
    ),
    PaddingFreePairCollator: (ORPO, {**PAIR_FIELDS, **NO_PADDING, "shared_prompt": REFUSED}),
    PaddingFreeTripleCollator: (
        TPO,
        {
            **PAIR_FIELDS,
            **NO_PADDING,
            **NO_TREE,
            "shared_prompt": REFUSED,
            "return_flash_attn_kwargs": REFUSED,  # the boundaries keep the sequences apart
            "return_position_ids": REFUSED,
            "include_reference": (False, {}),
        },
    ),
}
ROWS = [(cls, name) for cls, (_, table) in FIELDS.items() for name in table]


def _fields(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.init]


def _outcome(cls, settings: dict, features: list[dict]):
    """What the collator returns for ``features``, comparable with ``==``: every value as (type, contents); or
    the error it raises."""
    try:
        batch = cls(**settings)(features)
    except (ValueError, TypeError) as error:
        return ("error", type(error).__name__, str(error))
    return {
        key: (type(value).__name__, value.tolist() if hasattr(value, "tolist") else value)
        for key, value in batch.items()
    }


def test_every_field_has_a_row():
    for cls, (_, table) in FIELDS.items():
        assert sorted(table) == sorted(_fields(cls)), f"{cls.__name__}: a field without a row in FIELDS"


@pytest.mark.parametrize("cls, name", ROWS, ids=[f"{c.__name__}-{n}" for c, n in ROWS])
def test_a_field_changes_the_batch_or_is_refused_by_name(cls, name):
    features, table = FIELDS[cls]
    if table[name] is REFUSED:
        default = next(f for f in dataclasses.fields(cls) if f.name == name).default
        value = {
            "label_pad_id": -1,
            "truncation_mode": "keep_end",
            "shared_prompt": True,
            "min_shared_tokens": 2,
        }.get(name, BASE.get(name, (True,))[0])
        assert value != default
        with pytest.raises(ValueError, match=name):
            cls(**{name: value})
        return
    value, settings = table[name]
    if name in ("passthrough_keys", "drop_keys"):
        features = EXTRA
    assert _outcome(cls, {**settings, name: value}, features) != _outcome(cls, settings, features)


@pytest.mark.parametrize(
    "cls, features", [(PaddingFreePreferenceCollator, PAIRS), (PaddingFreeRewardCollator, REWARD)]
)
@pytest.mark.parametrize("shared_prompt", [False, True])
def test_preference_buckets_pad_the_row_and_keep_every_sequence_exact(cls, features, shared_prompt):
    """The bucketed row is the plain row, then one padding segment (never a target) up to the length bucket and
    empty segments up to the segment bucket; TRL's padded layout is unchanged. Negative control: a row whose
    padding joined the last sequence would fail the target check."""
    if shared_prompt and cls is PaddingFreeRewardCollator:
        pytest.skip("reward pairs have no prompt to share")
    plain = cls(shared_prompt=shared_prompt, pad_token_id=99)(features)
    collator = cls(
        shared_prompt=shared_prompt, length_buckets=(32, 64), segment_buckets=(8, 16), pad_token_id=99
    )
    bucketed = collator(features)
    n, segments = plain["packed_input_ids"].shape[1], plain["cu_seq_lens_q"].numel() - 1
    assert bucketed["packed_input_ids"].shape == (1, 32) and bucketed["cu_seq_lens_q"].numel() == 8 + 1
    assert torch.equal(bucketed["packed_input_ids"][0, :n], plain["packed_input_ids"][0])
    assert (bucketed["packed_input_ids"][0, n:] == 99).all()
    cu = bucketed["cu_seq_lens_q"].tolist()
    assert cu[: segments + 1] == plain["cu_seq_lens_q"].tolist() and cu[segments + 1] == 32
    assert cu[segments + 2 :] == [32] * (8 - segments - 1)  # empty segments: no token
    for key in ("input_ids", "attention_mask", "completion_mask"):
        if key in plain:
            assert torch.equal(bucketed[key], plain[key])
    sentinel = bucketed["input_ids"].numel()
    assert torch.equal(bucketed["packed_index"][:n], plain["packed_index"])
    assert (bucketed["packed_index"][n:] == sentinel).all()  # the padding predicts nothing
    assert torch.equal(bucketed["position_ids"][0, :n], plain["position_ids"][0])
    if shared_prompt:
        idx = bucketed["prefix_seq_idx"].tolist()
        assert idx[:segments] == plain["prefix_seq_idx"].tolist() and idx[segments:] == [-1] * (8 - segments)
    assert bucketed["max_length_q"] == 32  # rounded up to a length bucket, as PaddingFreeCollator does
    assert collator.stats["padding_tokens"] == 32 - n and collator.stats["empty_segments"] == 8 - segments - 1
    assert collator.stats["tokens"] == n


def test_length_buckets_larger_than_every_bucket_is_an_error():
    with pytest.raises(ValueError, match="more than the largest of length_buckets"):
        PaddingFreePreferenceCollator(length_buckets=(4,))(PAIRS)


def test_numpy_stays_numpy():
    batch = PaddingFreePreferenceCollator(length_buckets=(32,), return_tensors="np")(PAIRS)
    assert isinstance(batch["packed_input_ids"], np.ndarray) and batch["packed_input_ids"].shape == (1, 32)


@pytest.mark.parametrize("name", ["pad_to_multiple_of", "length_buckets", "segment_buckets"])
def test_the_multimodal_collator_refuses_row_padding_by_name(name):
    """Its per-token keys (``mm_token_type_ids``) and multimodal positions cover the samples' tokens only: a
    padding segment would be silently out of step with them."""
    from packing_hf.multimodal import MultimodalCollator

    with pytest.raises(ValueError, match=f"got {name}"):
        MultimodalCollator(**{name: BASE[name][0]})
