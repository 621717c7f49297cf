"""Host copies of boundary tensors: one device -> host read per tensor object, shared by every layer.

The backends (:mod:`packing_hf.attention.backends`, :mod:`packing_hf.attention.sdpa`), the attention
function (:mod:`packing_hf.attention.interface`) and the batch guards (:mod:`packing_hf.attention.guards`)
all read ``cu_seqlens`` through here, so a forward reads each boundary tensor at most once.

>>> cu = torch.tensor([0, 3, 5], dtype=torch.int32)
>>> host_values(cu), cached_host_values(cu) is not None, reads_are_free(cu)
([0, 3, 5], True, True)
"""

from __future__ import annotations

import torch

from .._cache import IdentityCache

__all__ = ["cached_host_values", "host_cache_entry", "host_values", "reads_are_free", "remember_host_values"]

# The per-segment loop needs the boundaries as Python ints. Every layer of a model receives the very same
# cu_seqlens tensor object from the collator, so the device -> host copy is made once per tensor (per
# step) instead of once per layer: keyed on the tensor's identity and version. The padded path
# (``_run_sdpa_padded``) and the flash kernels never read the values at all.
# An entry is ``(values, totals)``: the totals (row lengths) its values were checked against, so each layer
# does not check again.
_HOST = IdentityCache(size=4)


def host_values(tensor: torch.Tensor) -> list[int]:
    """The values of ``tensor`` as Python ints: one host read per tensor object and version, then cached."""
    values = cached_host_values(tensor)
    if values is not None:
        return values
    values = tensor.tolist()
    remember_host_values(tensor, values)
    return values


def remember_host_values(tensor: torch.Tensor, values: list[int]) -> None:
    """Record host ``values`` already read from ``tensor`` (by :func:`packing_hf.validate_packed_batch`)."""
    _HOST.put((tensor,), (values, set()))


def cached_host_values(tensor: torch.Tensor) -> list[int] | None:
    """Host values only when they were read before (no host read now), else ``None``."""
    entry = host_cache_entry(tensor)
    return None if entry is None else entry[0]


def host_cache_entry(tensor: torch.Tensor) -> tuple[list[int], set[int]] | None:
    """``(values, totals checked)`` of ``tensor`` when its values were read before, else ``None``."""
    return _HOST.get((tensor,))


def reads_are_free(tensor: torch.Tensor) -> bool:
    """Whether reading ``tensor``'s values costs nothing: a CPU tensor in eager mode (under ``torch.compile``
    a read is a graph break, on an accelerator a device sync)."""
    return tensor.device.type == "cpu" and not torch.compiler.is_compiling()
