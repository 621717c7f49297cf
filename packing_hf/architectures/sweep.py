"""The architecture sweep: every registered architecture, tiny, stock and prepared, under each implementation.

:func:`sweep_architecture` is the single code path behind ``docs/architectures.md``
(``tools/gen_arch_table.py``) and the architecture test, so the table is what the test asserts;
:func:`check_architecture` (re-exported from :mod:`packing_hf.architectures.prepare`, which holds the one cache of
tiny-model checks) is the one-architecture check the trainers' pre-flight runs. Both use
the check (:func:`packing_hf.check_packing`) and the model fixes
(:func:`packing_hf.prepare_model_for_packing`); nothing there points back here.

>>> [r.verdict for r in sweep_architecture("opt", ["sdpa"], gradients=False)]
['fixed']
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..verify import DEFAULT_LENGTHS, DEFAULT_TOLERANCE, PackingReport, check_packing
from .prepare import check_architecture, clear_architecture_cache, prepare_model_for_packing
from .tiny import build_tiny_model

__all__ = [
    "IMPLEMENTATIONS",
    "ArchitectureResult",
    "check_architecture",
    "clear_architecture_cache",
    "describe_error",
    "sweep_architecture",
]

IMPLEMENTATIONS: tuple[str, ...] = ("eager", "sdpa", "packing_hf")


@dataclass(frozen=True)
class ArchitectureResult:
    """One architecture under one attention implementation: stock, then prepared by packing_hf.

    Attributes:
        model_type: the architecture.
        implementation: ``"eager"``, ``"sdpa"`` or ``"packing_hf"``.
        stock: the check of the unmodified tiny model (``None`` if transformers cannot build it).
        prepared: the check after :func:`packing_hf.prepare_model_for_packing` (``None`` if refused).
        unsupported: why transformers refused to build the model with this implementation.
        refused: why :func:`packing_hf.prepare_model_for_packing` refused it.
    """

    model_type: str
    implementation: str
    stock: PackingReport | None
    prepared: PackingReport | None
    unsupported: str | None = None
    refused: str | None = None

    @property
    def verdict(self) -> str:
        """``"exact"`` (stock and prepared), ``"fixed"`` (stock leaks, prepared exact), ``"refused"``,
        ``"n/a"`` (transformers does not offer the implementation) or ``"LEAK"`` (prepared still leaks)."""
        if self.unsupported is not None:
            return "n/a"
        if self.refused is not None:
            return "refused"
        if self.prepared is None or self.prepared.leaked:
            return "LEAK"
        return "exact" if self.stock is not None and not self.stock.leaked else "fixed"


def sweep_architecture(
    model_type: str,
    implementations: Sequence[str] = IMPLEMENTATIONS,
    *,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    gradients: bool = True,
    tolerance: float = DEFAULT_TOLERANCE,
) -> list[ArchitectureResult]:
    """Check a tiny ``model_type`` model stock and prepared, under every implementation.

    >>> [r.verdict for r in sweep_architecture("llama", ["eager"], gradients=False)]
    ['exact']
    """
    results = []
    for implementation in implementations:
        try:
            model = build_tiny_model(model_type, implementation)
        except (ValueError, KeyError, ImportError) as exc:  # transformers: "does not support ... yet"
            results.append(
                ArchitectureResult(model_type, implementation, None, None, unsupported=describe_error(exc))
            )
            continue
        stock = check_packing(model, lengths, gradients=gradients, tolerance=tolerance)
        try:
            handle = prepare_model_for_packing(model, check_unknown=False)
        except ValueError as exc:
            results.append(ArchitectureResult(model_type, implementation, stock, None, refused=str(exc)))
            continue
        with handle:
            prepared = check_packing(model, lengths, gradients=gradients, tolerance=tolerance)
        results.append(ArchitectureResult(model_type, implementation, stock, prepared))
    return results


def describe_error(exc: BaseException) -> str:
    """``"TypeError: first line of the message"`` (at most 200 characters of it)."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
