"""Deprecated location: ``packing_hf.train`` moved to packing_hf.app.

The ``packing-hf`` app (command line, YAML config, dataset loading, the train job) lives in
:mod:`packing_hf.app`; this module re-exports its old names with a ``FutureWarning``.
Import from :mod:`packing_hf.app.train` (the job), :mod:`packing_hf.app.modeling` (``load_model``,
``load_tokenizer``) and :mod:`packing_hf.app.baseline` instead.
"""

from __future__ import annotations

import warnings

from .app.baseline import evaluate_loss, measure_throughput
from .app.modeling import load_model, load_tokenizer, resolve_model_source
from .app.train import SUMMARY_NAME, run_training, train_from_config

__all__ = [
    "SUMMARY_NAME",
    "evaluate_loss",
    "load_model",
    "load_tokenizer",
    "measure_throughput",
    "resolve_model_source",
    "run_training",
    "train_from_config",
]

warnings.warn(
    "packing_hf.train moved: load_model/load_tokenizer to packing_hf.app.modeling, the job to "
    "packing_hf.app.train, measure_throughput/evaluate_loss to packing_hf.app.baseline",
    FutureWarning,
    stacklevel=2,
)
