"""Deprecated location: per-architecture support moved to :mod:`packing_hf.architectures`.

``from packing_hf.attention.models import prepare_model_for_packing`` keeps working (with a
``FutureWarning``); import from ``packing_hf`` (``packing_hf.prepare_model_for_packing``) or from
:mod:`packing_hf.architectures` instead.
"""

from __future__ import annotations

import warnings

from ..architectures.prepare import PackingPreparation, prepare_model_for_packing, revert_model_for_packing
from ..architectures.registry import REGISTRY, ArchitectureSupport, iter_sweep, support

__all__ = [
    "REGISTRY",
    "ArchitectureSupport",
    "PackingPreparation",
    "iter_sweep",
    "prepare_model_for_packing",
    "revert_model_for_packing",
    "support",
]

warnings.warn(
    "packing_hf.attention.models moved to packing_hf.architectures (registry, prepare); "
    "import prepare_model_for_packing from packing_hf",
    FutureWarning,
    stacklevel=2,
)
