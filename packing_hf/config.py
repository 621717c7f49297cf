"""Deprecated location: ``packing_hf.config`` moved to packing_hf.app.config.

The ``packing-hf`` app (command line, YAML config, dataset loading, the train job) lives in
:mod:`packing_hf.app`; this module re-exports its old names with a ``FutureWarning``.
Import from packing_hf.app.config instead.
"""

from __future__ import annotations

import warnings

from .app.config import *  # noqa: F403
from .app.config import __all__  # noqa: F401

warnings.warn(
    "packing_hf.config moved to packing_hf.app.config; import from there",
    FutureWarning,
    stacklevel=2,
)
