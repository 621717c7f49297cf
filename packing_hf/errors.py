"""The exception packing_hf raises when it refuses a set-up it cannot keep exact, and the message of a
missing optional dependency (:func:`missing_extra`).

A refusal carries its reason as data (``.reason``), so callers (``packing-hf verify``, the trainers' refusal
table, tests) never parse message text.

>>> try:
...     raise PackingRefused("compute_metrics", "compute_metrics needs padded logits; unset it")
... except ValueError as error:
...     error.reason
'compute_metrics'
"""

from __future__ import annotations

__all__ = ["PackingRefused", "missing_extra"]

# optional dependency (import name) -> its name and the pip extra of packing-hf that installs it
_EXTRAS = {"trl": ("TRL", "trl"), "peft": ("PEFT", "peft")}


def missing_extra(what: str, module: str, error: ImportError) -> ImportError:
    """The ``ImportError`` for ``what`` when the optional ``module`` (``trl``, ``peft``) fails to import: one
    line naming the package and the two ways to get it (``make setup`` in a checkout, which ``make train``
    leaves out, or the pip extra in one's own environment).

    >>> print(missing_extra("packing_hf.DPOTrainer", "trl", ModuleNotFoundError("No module named 'trl'", name="trl")))
    packing_hf.DPOTrainer needs TRL, which is not installed: run `make setup` in the packing_hf checkout (make train installs neither TRL nor PEFT), or `pip install 'packing-hf[trl]'` in your own environment
    """
    package, extra = _EXTRAS[module]
    problem = (
        "which is not installed"
        if isinstance(error, ModuleNotFoundError) and error.name == module
        else f"which fails to import ({error}; packing-hf needs the version its [{extra}] extra pins)"
    )
    return ImportError(
        f"{what} needs {package}, {problem}: run `make setup` in the packing_hf checkout (make train installs "
        f"neither TRL nor PEFT), or `pip install 'packing-hf[{extra}]'` in your own environment"
    )


class PackingRefused(ValueError):
    """A set-up packing_hf refuses because the packed result would not equal the unpacked one.

    Args:
        reason: why, as data a caller can test or show: a refusal table key (``"compute_metrics"``) or the
            registry's reason for an architecture.
        message: what is refused, why, and the fix.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
