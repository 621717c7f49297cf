"""Trainer / SFTTrainer integration: drop-in subclasses that train on packed batches exactly.

``Trainer`` and ``TrainingArguments`` need only transformers; ``SFTTrainer`` and ``SFTConfig`` import TRL
on first access, so ``packing_hf.Trainer`` works without TRL installed.

>>> from packing_hf.integrations import Trainer, TrainingArguments
>>> TrainingArguments(output_dir="out", max_tokens_per_batch=2048, report_to="none").max_tokens_per_batch
2048
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .args import PackingArguments
from .trainer import PackingTrainerMixin, Trainer, TrainingArguments

__all__ = [
    "PackingArguments",
    "PackingTrainerMixin",
    "SFTConfig",
    "SFTTrainer",
    "Trainer",
    "TrainingArguments",
]

_TRL_NAMES = ("SFTTrainer", "SFTConfig")


def __getattr__(name: str) -> Any:
    if name in _TRL_NAMES:
        try:
            from . import sft
        except ImportError as exc:
            raise ImportError(
                f"packing_hf.{name} needs TRL ({exc}); install it with `pip install 'packing-hf[trl]'`"
            ) from exc
        value = getattr(sft, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'packing_hf.integrations' has no attribute {name!r}")


if TYPE_CHECKING:
    from .sft import SFTConfig, SFTTrainer
