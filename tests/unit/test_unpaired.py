"""KTO's unpaired collator: the labels it accepts are TRL's (booleans, or the ints 0 / 1), nothing it would misread."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from packing_hf.unpaired import PaddingFreeUnpairedCollator

EXAMPLE = {"prompt_ids": [1, 2], "completion_ids": [3]}


@pytest.mark.parametrize(
    ("label", "desirable"),
    [(True, True), (False, False), (np.bool_(True), True), (1, True), (0, False), (np.int64(0), False),
     (torch.tensor(True), True)],
)  # fmt: skip
def test_booleans_and_the_ints_trl_accepts_are_read_as_booleans(label, desirable):
    batch = PaddingFreeUnpairedCollator()([{**EXAMPLE, "label": label}])
    assert batch["label"].dtype == torch.bool and batch["label"].tolist() == [desirable]


@pytest.mark.parametrize("label", ["false", "yes", "True", 2, -1, 0.0, None, [True]])
def test_any_other_label_is_refused_naming_the_sample(label):
    # bool("false") is True: before, a label read from text flipped silently
    with pytest.raises(TypeError, match=f"sample 1: 'label' is {re.escape(repr(label))}.*must be booleans"):
        PaddingFreeUnpairedCollator()([{**EXAMPLE, "label": True}, {**EXAMPLE, "label": label}])
