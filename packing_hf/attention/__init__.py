"""Varlen attention for packed rows: backends, the transformers registration, the flash-attention patch.

Importing this package patches and registers nothing; call :func:`register_attention` (recommended: it
only adds a name to transformers' registries) or :func:`patch_flash_attention` (swaps transformers'
``_flash_attention_forward``, reversibly).

- ``backends``: :func:`varlen_attention` and its backends, :func:`select_backend`, :func:`available_backends`;
- ``interface``: the ``AttentionInterface`` / ``AttentionMaskInterface`` functions, :func:`register_attention`
  and :func:`resolve_attn_implementation`;
- ``patch``: :func:`patch_flash_attention`, :func:`unpatch_flash_attention`, :func:`flash_attention_patched`;
- ``prefix``: :func:`shared_prefix_attention`, branches attending to a shared prefix (``prefix_seq_idx``);
- ``guards``: :func:`validate_packed_batch`, the per-forward batch checks of a prepared model.

Per-architecture fixes (which models need which hooks) live in :mod:`packing_hf.architectures`.

>>> import packing_hf.attention as attention
>>> attention.ATTENTION_NAME
'packing_hf_varlen'
"""

from __future__ import annotations

from .backends import BACKENDS, FEATURES, available_backends, last_backend, select_backend, varlen_attention
from .interface import (
    ATTENTION_NAME,
    attend,
    register_attention,
    resolve_attn_implementation,
    varlen_attention_forward,
    varlen_attention_mask,
)
from .patch import (
    flash_attention_patched,
    flash_attention_patched_now,
    patch_flash_attention,
    unpatch_flash_attention,
)
from .prefix import PREFIX_KEY, gather_prefix_keys, shared_prefix_attention

__all__ = [
    "ATTENTION_NAME",
    "BACKENDS",
    "FEATURES",
    "PREFIX_KEY",
    "attend",
    "available_backends",
    "flash_attention_patched",
    "flash_attention_patched_now",
    "gather_prefix_keys",
    "last_backend",
    "patch_flash_attention",
    "register_attention",
    "resolve_attn_implementation",
    "select_backend",
    "shared_prefix_attention",
    "unpatch_flash_attention",
    "varlen_attention",
    "varlen_attention_forward",
    "varlen_attention_mask",
]
