"""Limits of the varlen kernels, the one checker of int (and of bool) arguments, shared by numpy and torch code,
and :func:`option`, the one way a config dataclass declares a field with its ``--help`` text.

>>> INT32_MAX
2147483647
>>> check_int(8, "max_length", minimum=1)
8
>>> check_bool(True, "share_prompt")
True
"""

from __future__ import annotations

import numbers
from dataclasses import field
from typing import Any

import numpy as np

__all__ = ["INT32_MAX", "check_bool", "check_int", "check_world", "option"]

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


def check_bool(value: Any, name: str, *, optional: bool = False) -> Any:
    """``value`` as a Python bool, or a ``TypeError`` naming ``name``: the one check of a switch argument.

    A string is refused, not read: ``bool("false")`` and ``bool("no")`` are True. (Command lines and YAML files
    parsed by ``HfArgumentParser`` already hand real booleans.)

    Args:
        value: the argument (``bool`` or numpy bool).
        name: how the caller spells the argument, for the message.
        optional: ``None`` is accepted (and returned): the field's default means "decide for me".

    >>> check_bool("yes", "share_prompt")
    Traceback (most recent call last):
    ...
    TypeError: share_prompt must be True or False, got 'yes' (a str); pass a bool (share_prompt=True), not a string
    """
    if value is None and optional:
        return None
    if isinstance(value, bool | np.bool_):
        return bool(value)
    allowed = "True, False or None" if optional else "True or False"
    hint = f"; pass a bool ({name}=True), not a string" if isinstance(value, str) else ""
    raise TypeError(f"{name} must be {allowed}, got {value!r} (a {type(value).__name__}){hint}")


def check_world(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """``num_replicas`` / ``rank`` checked, each from ``torch.distributed`` when ``None`` and it is initialized,
    else 1 / 0.

    >>> check_world(None, None)
    (1, 0)
    >>> check_world(2, 2)
    Traceback (most recent call last):
    ...
    ValueError: rank must be in [0, num_replicas - 1] = [0, 1], got rank=2
    """
    import torch.distributed as dist

    initialized = dist.is_available() and dist.is_initialized()
    if num_replicas is None:
        num_replicas = dist.get_world_size() if initialized else 1
    if rank is None:
        rank = dist.get_rank() if initialized else 0
    num_replicas, rank = check_int(num_replicas, "num_replicas", 1), check_int(rank, "rank", 0)
    if rank >= num_replicas:
        raise ValueError(f"rank must be in [0, num_replicas - 1] = [0, {num_replicas - 1}], got rank={rank}")
    return int(num_replicas), int(rank)


def option(default: Any, help_text: str) -> Any:
    """A config dataclass field with its ``--help`` text (``HfArgumentParser`` / ``TrlParser`` read
    ``metadata["help"]``); a mutable default is not allowed here (use ``None``)."""
    return field(default=default, metadata={"help": help_text})
