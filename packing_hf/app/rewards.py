"""Reward functions for ``trainer: grpo | rloo``: the built-in GSM8K rewards, and import paths.

A reward function has TRL's signature: ``f(completions, **columns) -> list[float]``, one reward per
completion; TRL passes every other column of the dataset (here ``answer``) as a keyword.

- ``gsm8k`` (:func:`gsm8k_answer_match`): 1.0 for the right final number, else 0.0: the real task's reward.
- ``gsm8k_shaped`` (:func:`gsm8k_shaped_reward`): a *demo* reward for tiny or untrained models, which almost
  never get an answer right, so the answer match gives every completion of a group 0.0, GRPO's advantages
  are all 0 and nothing trains (loss 0, grad norm 0). It gives partial credit below the right answer's 1.0:
  for writing a number at all, and for how close the text is to the reference solution, so the
  completions of a group differ and the run visibly learns something. Not a measure of GSM8K accuracy.

>>> gsm8k_answer_match([[{"role": "assistant", "content": "so 3 + 4 = 7"}], "no idea"], answer=["#### 7", "#### 2"])
[1.0, 0.0]
>>> [f.__name__ for f in resolve_reward_funcs("gsm8k")]
['gsm8k_answer_match']
"""

from __future__ import annotations

import difflib
import importlib
import re
from collections.abc import Callable
from typing import Any

__all__ = ["BUILT_IN", "gsm8k_answer_match", "gsm8k_shaped_reward", "resolve_reward_funcs", "reward_spec"]

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


# partial credit of gsm8k_shaped_reward: a number anywhere, and the similarity to the reference solution;
# together below 0.5, so a right answer (1.0) always beats any wrong one
_NUMBER_CREDIT = 0.1
_SIMILARITY_CREDIT = 0.3


def gsm8k_shaped_reward(completions: list[Any], answer: list[str], **columns: Any) -> list[float]:
    """A demo reward for GSM8K with partial credit (``reward_funcs: gsm8k_shaped``): 1.0 where the last
    number of the completion is the reference answer's, else ``0.1`` if the completion holds a number plus
    ``0.3 x`` its character similarity to the reference solution (``difflib``'s ratio, 0 to 1; the solution
    without its ``<<...>>`` calculator notes). Wrong answers score below 0.4, a right one 1.0.

    Made for the tiny demo runs: a random or small model is almost never right, and with the answer
    match alone every reward of a group is 0.0, so GRPO / RLOO have no advantage to learn from. This one
    varies between completions, so the loss and the gradients are not 0. It rewards text that looks like
    the reference solution, not correct reasoning: use :func:`gsm8k_answer_match` to measure accuracy.

    >>> reference = "5 + 2 = <<5+2=7>>7 apples. #### 7"
    >>> rewards = gsm8k_shaped_reward(["5 + 2 = 7 #### 7", "5 + 2 = 8", "no idea"], answer=[reference] * 3)
    >>> rewards[0], 0.1 < rewards[1] < 0.4, 0.0 < rewards[2] < 0.1
    (1.0, True, True)
    """
    rewards = []
    for completion, reference in zip(completions, answer, strict=True):
        text = _text(completion)
        target = _number(reference.split("####")[-1])
        got = _number(text)
        if got is not None and got == target:
            rewards.append(1.0)
            continue
        solution = re.sub(r"<<[^>]*>>", "", reference)
        similarity = difflib.SequenceMatcher(None, text, solution, autojunk=False).ratio()
        rewards.append(_NUMBER_CREDIT * (got is not None) + _SIMILARITY_CREDIT * similarity)
    return rewards


BUILT_IN: dict[str, Callable[..., list[float]]] = {
    "gsm8k": gsm8k_answer_match,
    "gsm8k_shaped": gsm8k_shaped_reward,
}


def reward_spec(trainer: str, reward_funcs: str | None, dataset: str) -> str:
    """The reward functions a ``trainer: grpo | rloo`` run scores with: ``reward_funcs``, or ``gsm8k`` for the
    embedded data (its answer column).

    >>> reward_spec("grpo", None, "embedded")
    'gsm8k'
    """
    spec = reward_funcs or ("gsm8k" if dataset == "embedded" else None)
    if spec is None:
        raise ValueError(
            f"trainer: {trainer} needs reward_funcs (comma-separated import paths, module:function); "
            "the built-in gsm8k applies to the embedded data (or a dataset with an answer column)"
        )
    return spec


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
