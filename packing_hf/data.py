"""Deprecated location: ``packing_hf.data`` moved to packing_hf.app.data.

The ``packing-hf`` app (command line, YAML config, dataset loading, the train job) lives in
:mod:`packing_hf.app`; this module re-exports its old names with a ``FutureWarning``.
Import from packing_hf.app.data instead.
"""

from __future__ import annotations

import warnings

from .app.data import *  # noqa: F403
from .app.data import __all__  # noqa: F401

warnings.warn(
    "packing_hf.data moved to packing_hf.app.data; import from there",
    FutureWarning,
    stacklevel=2,
)
