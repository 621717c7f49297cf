"""The overflow vocabulary: every component refuses the word of an earlier release and names its replacement."""

from __future__ import annotations

import pytest

from packing_hf import MultipackBatchSampler, PaddingFreeCollator, TrainingArguments
from packing_hf.overflow import OVERFLOW_POLICIES, check_overflow


def test_skip_is_refused_and_the_error_names_drop_which_replaced_it():
    assert "skip" not in OVERFLOW_POLICIES
    with pytest.raises(
        ValueError, match=r"'skip' was renamed 'drop' \(leave the whole sample out, counted\)"
    ):
        check_overflow("skip", "overflow")


@pytest.mark.parametrize(
    "build",
    [
        lambda: PaddingFreeCollator(max_length=8, overflow="skip"),
        lambda: MultipackBatchSampler([3, 4], 8, overflow="skip"),
        lambda: TrainingArguments(output_dir="out", report_to="none", use_cpu=True, packing_overflow="skip"),
    ],
    ids=["collator", "sampler", "training_arguments"],
)
def test_every_entry_point_refuses_skip_naming_drop(build):
    with pytest.raises(ValueError, match="'skip' is not an overflow policy; 'skip' was renamed 'drop'"):
        build()


def test_a_word_that_was_never_a_policy_gets_no_rename_hint():
    with pytest.raises(ValueError) as info:
        check_overflow("pad", "overflow")
    assert "renamed" not in str(info.value)
