"""Trainer / SFTTrainer integration: drop-in subclasses that train on packed batches exactly.

``Trainer`` and ``TrainingArguments`` need only transformers; ``SFTTrainer`` / ``SFTConfig`` and
``DPOTrainer`` / ``DPOConfig``, ``KTOTrainer`` / ``KTOConfig``, ``RewardTrainer`` / ``RewardConfig``,
``ORPOTrainer`` / ``ORPOConfig``, ``CPOTrainer`` / ``CPOConfig``, ``TPOTrainer`` / ``TPOConfig``,
``GRPOTrainer`` / ``GRPOConfig``, ``RLOOTrainer`` / ``RLOOConfig`` and ``GMPOTrainer`` / ``GMPOConfig``
import TRL on first access, so ``packing_hf.Trainer`` works without TRL.

>>> from packing_hf.integrations import Trainer, TrainingArguments
>>> TrainingArguments(output_dir="out", max_tokens_per_batch=2048, report_to="none").max_tokens_per_batch
2048
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ..errors import missing_extra
from .args import PackingArguments
from .trainer import PackingTrainerMixin, Trainer, TrainingArguments

__all__ = [
    "CPOConfig",
    "CPOTrainer",
    "DPOConfig",
    "DPOTrainer",
    "GMPOConfig",
    "GMPOTrainer",
    "GRPOConfig",
    "GRPOTrainer",
    "KTOConfig",
    "KTOTrainer",
    "ORPOConfig",
    "ORPOTrainer",
    "PackingArguments",
    "PackingTrainerMixin",
    "RewardConfig",
    "RewardTrainer",
    "RLOOConfig",
    "RLOOTrainer",
    "SFTConfig",
    "SFTTrainer",
    "TPOConfig",
    "TPOTrainer",
    "Trainer",
    "TrainingArguments",
]

_TRL_NAMES = {
    "SFTTrainer": "sft",
    "SFTConfig": "sft",
    "DPOTrainer": "dpo",
    "DPOConfig": "dpo",
    "KTOTrainer": "kto",
    "KTOConfig": "kto",
    "ORPOTrainer": "orpo",
    "ORPOConfig": "orpo",
    "CPOTrainer": "orpo",
    "CPOConfig": "orpo",
    "TPOTrainer": "tpo",
    "TPOConfig": "tpo",
    "RewardTrainer": "reward",
    "RewardConfig": "reward",
    "GRPOTrainer": "rl",
    "GRPOConfig": "rl",
    "RLOOTrainer": "rl",
    "RLOOConfig": "rl",
    "GMPOTrainer": "gmpo",
    "GMPOConfig": "gmpo",
}


def _from_trl(error: ImportError) -> bool:
    """Whether an ImportError comes from TRL (or PEFT, which TRL's trainers import), not from packing_hf."""
    return (getattr(error, "name", None) or "").split(".")[0] in ("trl", "peft")


def __getattr__(name: str) -> Any:
    if name in _TRL_NAMES:
        try:
            module = importlib.import_module(f"{__name__}.{_TRL_NAMES[name]}")
        except ImportError as exc:
            if not _from_trl(exc):
                raise
            raise missing_extra(f"packing_hf.{name}", "trl", exc) from None
        value = getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'packing_hf.integrations' has no attribute {name!r}")


if TYPE_CHECKING:
    from .dpo import DPOConfig, DPOTrainer
    from .gmpo import GMPOConfig, GMPOTrainer
    from .kto import KTOConfig, KTOTrainer
    from .orpo import CPOConfig, CPOTrainer, ORPOConfig, ORPOTrainer
    from .reward import RewardConfig, RewardTrainer
    from .rl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
    from .sft import SFTConfig, SFTTrainer
    from .tpo import TPOConfig, TPOTrainer
