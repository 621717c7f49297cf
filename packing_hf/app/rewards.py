"""Reward functions for ``trainer: grpo | rloo``: the built-in GSM8K answer match, and import paths.

A reward function has TRL's signature: ``f(completions, **columns) -> list[float]``, one reward per
completion; TRL passes every other column of the dataset (here ``answer``) as a keyword.

>>> gsm8k_answer_match([[{"role": "assistant", "content": "so 3 + 4 = 7"}], "no idea"], answer=["#### 7", "#### 2"])
[1.0, 0.0]
>>> [f.__name__ for f in resolve_reward_funcs("gsm8k")]
['gsm8k_answer_match']
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import Any

__all__ = ["BUILT_IN", "gsm8k_answer_match", "resolve_reward_funcs"]

_NUMBER = re.compile(r"-?\d[\d,]*\.?\d*")


def _text(completion: Any) -> str:
    return completion if isinstance(completion, str) else str(completion[-1]["content"])


def _number(text: str) -> str | None:
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "").rstrip(".") if numbers else None


def gsm8k_answer_match(completions: list[Any], answer: list[str], **columns: Any) -> list[float]:
    """1.0 where the last number of the completion is the reference answer's (the number after ``####``),
    else 0.0."""
    rewards = []
    for completion, reference in zip(completions, answer, strict=True):
        target = _number(reference.split("####")[-1])
        got = _number(_text(completion))
        rewards.append(float(got is not None and got == target))
    return rewards


BUILT_IN: dict[str, Callable[..., list[float]]] = {"gsm8k": gsm8k_answer_match}


def resolve_reward_funcs(spec: str) -> list[Callable[..., list[float]]]:
    """The reward functions of ``reward_funcs``: comma-separated built-in names (``gsm8k``) or import paths
    (``package.module:function`` or ``package.module.function``).

    Raises:
        ValueError: an empty spec, a module that does not import, or a name that is not a callable in it.
    """
    funcs = []
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        if item in BUILT_IN:
            funcs.append(BUILT_IN[item])
            continue
        module_name, sep, name = item.partition(":") if ":" in item else item.rpartition(".")
        if not module_name or not name:
            raise ValueError(
                f"reward_funcs: {item!r} is neither a built-in ({', '.join(BUILT_IN)}) nor an import path "
                "(package.module:function)"
            )
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            raise ValueError(f"reward_funcs: cannot import {module_name!r} for {item!r}: {error}") from None
        func = getattr(module, name, None)
        if not callable(func):
            raise ValueError(f"reward_funcs: {module_name} has no function {name!r} (from {item!r})")
        funcs.append(func)
    if not funcs:
        raise ValueError("reward_funcs is empty: name at least one (gsm8k, or package.module:function)")
    return funcs
