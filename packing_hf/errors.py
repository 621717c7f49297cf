"""The exception packing_hf raises when it refuses a set-up it cannot keep exact.

A refusal carries its reason as data (``.reason``), so callers (``packing-hf verify``, the trainers' refusal
table, tests) never parse message text.

>>> try:
...     raise PackingRefused("compute_metrics", "compute_metrics needs padded logits; unset it")
... except ValueError as error:
...     error.reason
'compute_metrics'
"""

from __future__ import annotations

__all__ = ["PackingRefused"]


class PackingRefused(ValueError):
    """A set-up packing_hf refuses because the packed result would not equal the unpacked one.

    Args:
        reason: why, as data a caller can test or show: a refusal table key (``"compute_metrics"``) or the
            registry's reason for an architecture.
        message: what is refused, why, and the fix.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
