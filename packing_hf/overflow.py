"""The overflow vocabulary: what to do with a sample longer than the limit, one set of words everywhere.

- ``"error"`` (the default everywhere): raise, naming the sample, its length and the fix;
- ``"truncate"``: keep its first ``limit`` tokens (the cut tokens are counted);
- ``"split"``: cut it into pieces of at most ``limit`` tokens, each trained as its own sample (counted);
- ``"drop"``: leave the whole sample out (counted).

Each component accepts the subset it can carry out (the collator cannot drop a sample it was handed; the
dataset preparation of the app does not split), and :func:`check_overflow` names that subset in its error.
A word from an earlier release (``"skip"``, renamed ``"drop"``) is refused with the word that replaced it.

>>> check_overflow("truncate", "PaddingFreeCollator.overflow", ("error", "truncate", "split"))
'truncate'
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

__all__ = ["OVERFLOW_POLICIES", "OverflowPolicy", "check_overflow"]

OverflowPolicy = Literal["error", "truncate", "split", "drop"]
OVERFLOW_POLICIES: tuple[str, ...] = ("error", "truncate", "split", "drop")
# words of earlier releases -> the policy that replaced them (refused, never mapped silently: the error says it)
_RENAMED = {"skip": "'drop' (leave the whole sample out, counted)"}


def check_overflow(value: str, owner: str, allowed: Sequence[str] = OVERFLOW_POLICIES) -> str:
    """``value`` as a policy of ``allowed``, or a ``ValueError`` naming ``owner``.

    >>> check_overflow("pad", "MultipackBatchSampler(overflow=...)")
    Traceback (most recent call last):
    ...
    ValueError: MultipackBatchSampler(overflow=...) = 'pad' is not an overflow policy; choose one of 'error', 'truncate', 'split', 'drop'
    >>> check_overflow("skip", "packing_overflow")
    Traceback (most recent call last):
    ...
    ValueError: packing_overflow = 'skip' is not an overflow policy; 'skip' was renamed 'drop' (leave the whole sample out, counted); choose one of 'error', 'truncate', 'split', 'drop'
    """
    if value not in allowed:
        choices = ", ".join(repr(p) for p in allowed)
        known = " is not an overflow policy" if value not in OVERFLOW_POLICIES else " is not supported here"
        if value in _RENAMED:
            known += f"; {value!r} was renamed {_RENAMED[value]}"
        raise ValueError(f"{owner} = {value!r}{known}; choose one of {choices}")
    return value
