"""A small cache of values derived from objects, keyed by their identity (and a tensor's version).

Every layer of one forward receives the very same boundary tensors (``cu_seq_lens_q``, ``position_ids``,
the mask), so what is derived from them (host copies, layouts, plans: often a device -> host read) is
worth computing once per forward, not once per layer. A key holds weak references to its source objects
(never keeping a batch alive), the ``_version`` of every tensor among them (an in-place change misses), and
plain data; a hit needs the same objects, versions and data. The newest entries are kept, the oldest
dropped. Under ``torch.compile`` nothing is cached (a traced tensor has no identity to key on, and dynamo
cannot follow weak references).

>>> cache = IdentityCache(size=2)
>>> cu = torch.tensor([0, 2, 5])
>>> cache.derive((cu,), lambda: cu.diff()) is cache.derive((cu,), lambda: None)  # the second call is a hit
True
>>> _ = cu.add_(0)  # an in-place change (same values, new version): a miss
>>> cache.derive((cu,), lambda: "again")
'again'
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

__all__ = ["IdentityCache"]

_MISSING = object()


def _source_key(source: Any) -> tuple[Any, Any]:
    if source is None:
        return None, None
    return weakref.ref(source), source._version if isinstance(source, torch.Tensor) else None


def _same_sources(key: tuple, sources: Sequence[Any]) -> bool:
    for (ref, version), source in zip(key, sources, strict=True):
        if source is None or ref is None:
            if source is not ref:
                return False
        elif ref() is not source or version != (
            source._version if isinstance(source, torch.Tensor) else None
        ):
            return False
    return True


class IdentityCache:
    """The newest ``size`` values derived from ``(sources, data)``: sources by identity and version, ``data``
    (hashable plain values) by equality. ``None`` is a valid source (it matches only ``None``).

    Args:
        size: entries kept; a few suffice when every layer of a forward reads the same objects.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._entries: list[tuple[tuple, Hashable, Any]] = []

    def get(self, sources: Sequence[Any], data: Hashable = ()) -> Any:
        """The cached value, or ``None`` on a miss (always under ``torch.compile``)."""
        value = self._find(sources, data)
        return None if value is _MISSING else value

    def put(self, sources: Sequence[Any], value: Any, data: Hashable = ()) -> Any:
        """Remember ``value`` for ``(sources, data)`` (nothing under ``torch.compile``); returns it."""
        if not torch.compiler.is_compiling():
            self._entries.insert(0, (tuple(map(_source_key, sources)), data, value))
            del self._entries[self.size :]
        return value

    def derive(self, sources: Sequence[Any], compute: Callable[[], Any], data: Hashable = ()) -> Any:
        """The cached value for ``(sources, data)``, else ``compute()``, remembered."""
        value = self._find(sources, data)
        return self.put(sources, compute(), data) if value is _MISSING else value

    def clear(self) -> None:
        self._entries.clear()

    def _find(self, sources: Sequence[Any], data: Hashable) -> Any:
        if torch.compiler.is_compiling():
            return _MISSING
        for key, entry_data, value in self._entries:
            if len(key) == len(sources) and entry_data == data and _same_sources(key, sources):
                return value
        return _MISSING
