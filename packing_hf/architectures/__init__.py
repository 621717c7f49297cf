"""Which architectures pack exactly, and the per-model fixes that make them: the layer above the check.

- :mod:`packing_hf.registry` (core, below the attention): data: the support status of every ``model_type``
  and why (:func:`support`), re-exported here;
- ``tiny``: tiny copies of configs that keep what decides exactness (:func:`tiny_config`);
- ``kernels``: the optional CUDA kernels of the token mixers (fla), and :func:`check_fla_triton`, which
  names a combination fla refuses in the backward pass before training;
- ``prepare``: :func:`prepare_model_for_packing`, reversible hooks on one model instance, and
  :func:`check_architecture` (the cached tiny-model check behind the pre-flight and :func:`check_unregistered`);
- ``sweep``: :func:`sweep_architecture` (the table).

Everything here builds on :func:`packing_hf.check_packing` (:mod:`packing_hf.verify`) and
:mod:`packing_hf.attention`; neither imports this package.

>>> support("opt").status
'mask'
"""

from __future__ import annotations

from ..attention.admission import check_served_config
from ..registry import REGISTRY, UNSEEN_BY_ATTENTION, ArchitectureSupport, iter_sweep, support
from .kernels import check_fla_triton, fla_triton_problem
from .prepare import (
    PackingPreparation,
    check_architecture,
    check_unregistered,
    clear_architecture_cache,
    prepare_model_for_packing,
    revert_model_for_packing,
)
from .sweep import (
    IMPLEMENTATIONS,
    ArchitectureResult,
    sweep_architecture,
)
from .tiny import build_tiny_model, tiny_config

__all__ = [
    "IMPLEMENTATIONS",
    "REGISTRY",
    "UNSEEN_BY_ATTENTION",
    "ArchitectureResult",
    "ArchitectureSupport",
    "PackingPreparation",
    "build_tiny_model",
    "check_architecture",
    "check_fla_triton",
    "check_served_config",
    "check_unregistered",
    "clear_architecture_cache",
    "fla_triton_problem",
    "iter_sweep",
    "prepare_model_for_packing",
    "revert_model_for_packing",
    "support",
    "sweep_architecture",
    "tiny_config",
]
