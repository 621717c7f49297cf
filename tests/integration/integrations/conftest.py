"""Fixtures shared by the trainer integration tests."""

from __future__ import annotations

from dataclasses import dataclass, field

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
