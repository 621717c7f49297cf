"""Which architectures pack exactly, and the per-model fixes that make them: the layer above the check.

- ``registry``: data: the support status of every ``model_type`` and why (:func:`support`);
- ``tiny``: tiny copies of configs that keep what decides exactness (:func:`tiny_config`);
- ``prepare``: :func:`prepare_model_for_packing`, reversible hooks on one model instance;
- ``sweep``: :func:`check_architecture` (cached pre-flight check) and :func:`sweep_architecture` (the table).

Everything here builds on :func:`packing_hf.check_packing` (:mod:`packing_hf.verify`) and
:mod:`packing_hf.attention`; neither imports this package.

>>> support("opt").status
'mask'
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> module. Lazy, like the top-level package: the registry is data the attention layer reads
# (importing packing_hf.architectures.registry must not pull in prepare -> verify -> attention).
_LAZY = {
    "IMPLEMENTATIONS": "sweep",
    "ArchitectureResult": "sweep",
    "check_architecture": "sweep",
    "clear_architecture_cache": "sweep",
    "sweep_architecture": "sweep",
    "PackingPreparation": "prepare",
    "check_unregistered": "prepare",
    "prepare_model_for_packing": "prepare",
    "revert_model_for_packing": "prepare",
    "REGISTRY": "registry",
    "UNSEEN_BY_ATTENTION": "registry",
    "ArchitectureSupport": "registry",
    "check_served_config": "registry",
    "iter_sweep": "registry",
    "support": "registry",
    "build_tiny_model": "tiny",
    "tiny_config": "tiny",
}

__all__ = [
    "IMPLEMENTATIONS",
    "REGISTRY",
    "UNSEEN_BY_ATTENTION",
    "ArchitectureResult",
    "ArchitectureSupport",
    "PackingPreparation",
    "build_tiny_model",
    "check_architecture",
    "check_served_config",
    "check_unregistered",
    "clear_architecture_cache",
    "iter_sweep",
    "prepare_model_for_packing",
    "revert_model_for_packing",
    "support",
    "sweep_architecture",
    "tiny_config",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'packing_hf.architectures' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:
    from .prepare import (
        PackingPreparation,
        check_unregistered,
        prepare_model_for_packing,
        revert_model_for_packing,
    )
    from .registry import (
        REGISTRY,
        UNSEEN_BY_ATTENTION,
        ArchitectureSupport,
        check_served_config,
        iter_sweep,
        support,
    )
    from .sweep import (
        IMPLEMENTATIONS,
        ArchitectureResult,
        check_architecture,
        clear_architecture_cache,
        sweep_architecture,
    )
    from .tiny import build_tiny_model, tiny_config
