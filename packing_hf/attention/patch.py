"""Reversible patch of transformers' ``_flash_attention_forward`` onto :func:`packing_hf.varlen_attention`.

With the patch, models running ``attn_implementation="flash_attention_2"`` (or 3/4) use the collator's
``cu_seq_lens_q/k`` directly: no per-layer recomputation of boundaries from ``position_ids`` and no device
sync per layer, boundaries detected at any batch size and start position, and no dependency on the
flash-attn package (``varlen_attention`` picks FlashAttention when it is installed, torch's own
``varlen_attn`` or per-segment SDPA otherwise).

Why a patch and not a hook: ``flash_attention_forward`` (the ``AttentionInterface`` entry) and a few
legacy model files (falcon, gpt_neo, gptj, bark) call the module-level function
``_flash_attention_forward`` by name, and transformers offers no registry or hook for it. Registering a new
``AttentionInterface`` name does not change what models loaded with ``flash_attention_2`` call, so the
symbol itself is swapped, in ``transformers.modeling_flash_attention_utils`` and in every loaded module that
imported it by name. The originals are kept and restored exactly by :func:`unpatch_flash_attention`.

For new code prefer :func:`packing_hf.register_attention`, which replaces nothing. Note that transformers
refuses ``attn_implementation="flash_attention_2"`` at load time when the flash-attn package is missing or
no GPU is present (``_flash_attn_can_dispatch`` raises); the patch cannot lift that check, so on CPU or
without flash-attn the registered implementation is the way to run packing_hf's varlen attention.

>>> with flash_attention_patched():
...     flash_attention_patched_now()
True
>>> flash_attention_patched_now()
False
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch

from .backends import check_backend_name
from .interface import attend

__all__ = [
    "flash_attention_patched",
    "flash_attention_patched_now",
    "patch_flash_attention",
    "unpatch_flash_attention",
]

_SYMBOL = "_flash_attention_forward"
_SOURCE = "transformers.modeling_flash_attention_utils"

# state of the active patch: the original function and the backend the patched path uses
_ORIGINAL = None
_BACKEND = "auto"


def _patched_flash_attention_forward(
    query_states: torch.Tensor,
    key_states: torch.Tensor,
    value_states: torch.Tensor,
    attention_mask: torch.Tensor | None,
    query_length: int,
    is_causal: bool,
    dropout: float = 0.0,
    position_ids: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    sliding_window: int | None = None,
    use_top_left_mask: bool = False,
    softcap: float | None = None,
    deterministic: bool | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    target_dtype: torch.dtype | None = None,
    attn_implementation: str | None = None,
    block_table: torch.Tensor | None = None,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor:
    """Drop-in for transformers' ``_flash_attention_forward``: ``(B, T, H, D)`` in, ``(B, Tq, H, Dv)`` out."""
    if block_table is not None:
        # paged caches of continuous batching: the kv-cache kernels stay the original's business
        return _ORIGINAL(
            query_states,
            key_states,
            value_states,
            attention_mask,
            query_length,
            is_causal,
            dropout=dropout,
            position_ids=position_ids,
            softmax_scale=softmax_scale,
            sliding_window=sliding_window,
            use_top_left_mask=use_top_left_mask,
            softcap=softcap,
            deterministic=deterministic,
            cu_seq_lens_q=cu_seq_lens_q,
            cu_seq_lens_k=cu_seq_lens_k,
            max_length_q=max_length_q,
            max_length_k=max_length_k,
            target_dtype=target_dtype,
            attn_implementation=attn_implementation,
            block_table=block_table,
            k_cache=k_cache,
            v_cache=v_cache,
            **kwargs,
        )
    # as stock: PEFT may have upcast the activations to fp32; the flash kernels want the model's half dtype
    if target_dtype is not None and query_states.dtype == torch.float32:
        query_states, key_states, value_states = (
            t.to(target_dtype) for t in (query_states, key_states, value_states)
        )
    causal = is_causal and not (use_top_left_mask and query_length == 1)
    window = (sliding_window - 1, sliding_window - 1) if sliding_window else (-1, -1)
    s_aux = kwargs.get("s_aux")
    return attend(
        query_states,
        key_states,
        value_states,
        attention_mask,
        causal=causal,
        scale=softmax_scale,
        window_size=window,
        softcap=softcap or 0.0,
        dropout_p=dropout,
        s_aux=s_aux,
        position_ids=position_ids,
        cu_seq_lens_q=cu_seq_lens_q,
        cu_seq_lens_k=cu_seq_lens_k,
        max_length_q=max_length_q,
        max_length_k=max_length_k,
        backend=_BACKEND,
    )


def _modules_holding(obj) -> list[tuple[object, str]]:
    """Every loaded transformers module whose ``_flash_attention_forward`` attribute is ``obj``."""
    found = []
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("transformers"):
            continue
        if getattr(module, "__dict__", {}).get(_SYMBOL) is obj:
            found.append((module, name))
    return found


def patch_flash_attention(backend: str = "auto") -> None:
    """Route transformers' flash-attention path through :func:`packing_hf.varlen_attention`.

    Idempotent: a second call only updates ``backend``. Undo with :func:`unpatch_flash_attention`, or use
    :func:`flash_attention_patched` as a context manager.

    Args:
        backend: the ``varlen_attention`` backend the patched path uses (``"auto"``, ``"flash_attn"``, ...).

    >>> patch_flash_attention(); patch_flash_attention()  # the second call is a no-op
    >>> flash_attention_patched_now()
    True
    >>> unpatch_flash_attention()
    """
    global _ORIGINAL, _BACKEND
    _BACKEND = check_backend_name(backend)
    if _ORIGINAL is not None:
        return
    source = sys.modules.get(_SOURCE)
    if source is None:
        import importlib

        source = importlib.import_module(_SOURCE)
    # importing the integration makes sure its by-name copy exists now, so it is patched (and restored) too
    import transformers.integrations.flash_attention  # noqa: F401

    original = source._flash_attention_forward
    for module, _ in _modules_holding(original):
        setattr(module, _SYMBOL, _patched_flash_attention_forward)
    _ORIGINAL = original


def unpatch_flash_attention() -> None:
    """Restore the original ``_flash_attention_forward`` everywhere it was replaced (a no-op when unpatched).

    Modules imported while the patch was active hold the patched function; they are restored as well.

    >>> unpatch_flash_attention()
    >>> flash_attention_patched_now()
    False
    """
    global _ORIGINAL
    if _ORIGINAL is None:
        return
    for module, _ in _modules_holding(_patched_flash_attention_forward):
        setattr(module, _SYMBOL, _ORIGINAL)
    _ORIGINAL = None


def flash_attention_patched_now() -> bool:
    """Whether :func:`patch_flash_attention` is in effect.

    >>> flash_attention_patched_now()
    False
    """
    return _ORIGINAL is not None


@contextlib.contextmanager
def flash_attention_patched(backend: str = "auto") -> Iterator[None]:
    """Context manager: patched inside, restored on exit (also on error).

    If the patch was already active on entry, it stays active on exit (only the backend is restored).

    >>> with flash_attention_patched(backend="sdpa"):
    ...     flash_attention_patched_now()
    True
    """
    was_patched, previous_backend = _ORIGINAL is not None, _BACKEND
    patch_flash_attention(backend)
    try:
        yield
    finally:
        if was_patched:
            patch_flash_attention(previous_backend)
        else:
            unpatch_flash_attention()
