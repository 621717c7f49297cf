"""Limits of the varlen kernels, and the one checker of int arguments, shared by numpy and torch code.

>>> INT32_MAX
2147483647
>>> check_int(8, "max_length", minimum=1)
8
"""

from __future__ import annotations

import numbers
from typing import Any

__all__ = ["INT32_MAX", "check_int"]

# cu_seqlens are int32 in every varlen kernel: a packed row (or a batch budget) past this cannot be addressed
INT32_MAX = 2**31 - 1


def check_int(
    value: Any, name: str, minimum: int | None = None, *, optional: bool = False, int32: bool = False
) -> Any:
    """``value`` as a Python int, or a ``ValueError`` naming ``name``: the one check of an int argument.

    Args:
        value: the argument (Python or numpy int; ``bool`` is refused, it is not a count).
        name: how the caller spells the argument, for the message.
        minimum: the smallest accepted value (``None``: any).
        optional: ``None`` is accepted (and returned).
        int32: refuse values past what int32 positions and ``cu_seqlens`` address.

    >>> check_int(True, "max_length", minimum=1)
    Traceback (most recent call last):
    ...
    ValueError: max_length must be an int >= 1, got True
    """
    if value is None and optional:
        return None
    is_int = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if is_int and int32 and abs(value) > INT32_MAX:
        raise ValueError(f"{name}={value} is past what int32 positions and cu_seqlens address ({INT32_MAX})")
    if not is_int or (minimum is not None and value < minimum):
        need = "an int" if minimum is None else f"an int >= {minimum}"
        raise ValueError(f"{name} must be {need}{' or None' if optional else ''}, got {value!r}")
    return int(value)
