"""Fixtures shared by the trainer integration tests."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

import packing_hf


@dataclass
class RecordingCollator(packing_hf.PaddingFreeCollator):
    """Keeps the features of every batch it collates."""

    features: list = field(default_factory=list, init=False, repr=False)

    def __call__(self, features, return_tensors=None):
        self.features.append([dict(f) for f in features])
        return super().__call__(features, return_tensors)


@pytest.fixture
def feature_recording_collator() -> type[RecordingCollator]:
    """The class of a ``PaddingFreeCollator`` that keeps the features of every batch it collates."""
    return RecordingCollator


SYSTEM = "System: You are a patient maths tutor. Answer in one short sentence.\n"
# (question, chosen answer, rejected answer) per turn; every conversation continues with its chosen answers
CONVERSATIONS = [
    [
        ("What is 2 + 3?", " It is 5.", " It is 6."),
        ("And that times 4?", " That gives 20.", " That makes 24."),
        ("Half of it?", " Half of 20 is 10.", " Half is 12."),
    ],
    [
        ("Name a prime number.", " 7 is a prime.", " 9 is a prime."),
        ("The next prime after it?", " The next one is 11.", " Then comes 13."),
        ("Their sum?", " 7 + 11 = 18.", " The sum is 20."),
    ],
]


def _multi_turn_pairs() -> Any:
    """Every conversation cut into a pair at each assistant turn (the prompt: the system prompt and every earlier
    turn, answered with its chosen answer), plus one pair sharing nothing with them."""
    rows = []
    for turns in CONVERSATIONS:
        history = SYSTEM
        for question, chosen, rejected in turns:
            prompt = f"{history}User: {question}\nAssistant:"
            rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
            history = f"{prompt}{chosen}\n"
    rows.append({"prompt": "Translate 'chat' from French:", "chosen": " cat", "rejected": " hat"})
    import datasets

    return datasets.Dataset.from_list(rows)


@pytest.fixture
def multi_turn_pairs():
    """``multi_turn_pairs()``: a fresh Dataset of 7 preference pairs (prompt, chosen, rejected text): two
    conversations of three turns sharing a system prompt, cut into a pair at every assistant turn, plus one
    unrelated pair (the data of the ``share_prefixes`` tests)."""
    return _multi_turn_pairs


@pytest.fixture
def branch_points_one_row_early(monkeypatch):
    """``branch_points_one_row_early()``: the negative control of the preference trees' ``share_prefixes`` tests:
    every row token predicted at the row before it (``TreeTargets.from_index`` patched for the test), so a node's
    first token is read at its previous sibling's (or cousin's) last token instead of its branch point."""
    import torch

    from packing_hf.preference import TreeTargets

    exact = TreeTargets.from_index.__func__

    def plain_shift(cls, tree_index, labels, row_length):
        targets = exact(cls, tree_index, labels, row_length)
        shifted = (torch.arange(row_length) - 1).clamp(min=0)
        return TreeTargets(shifted, targets.row_labels, targets.gather, targets.shape)

    return lambda: monkeypatch.setattr(TreeTargets, "from_index", classmethod(plain_shift))
