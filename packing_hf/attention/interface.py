"""packing_hf's attention implementation for transformers' ``AttentionInterface``.

:func:`register_attention` adds :data:`ATTENTION_NAME` to ``AttentionInterface`` and
``AttentionMaskInterface``; a model loaded with ``attn_implementation=ATTENTION_NAME`` then runs
:func:`varlen_attention_forward` in every attention layer, and mask creation returns at most a 2-D
padding mask (never a dense ``(T, T)`` one). Nothing in transformers is replaced: registering only adds keys.

How a batch is split into independent segments, in order of precedence:

1. ``cu_seq_lens_q/k`` (+ ``max_length_q/k``) from :class:`packing_hf.PaddingFreeCollator`: used as is,
   nothing recomputed per layer, no host sync (one packed row, batch size 1);
2. otherwise packed ``position_ids`` (a sample starts wherever the position does not continue the previous
   one by +1, and at every row start), combined with the padding mask if any;
3. otherwise the padding mask alone (one segment per row, like ``flash_attention_2``), or whole rows.

>>> from transformers import AttentionInterface
>>> name = register_attention()
>>> name, name in AttentionInterface()
('packing_hf_varlen', True)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .._cache import IdentityCache
from ..multimodal import refuse_unprepared_media
from ..padding import PackedLayout
from ..varlen import PADDING_KEY, check_int32_tokens, position_restarts
from . import host
from .admission import (
    check_served_config,
    config_has_split_model,
    preparation_of,
    refuse_prefix_tree,
    served_config_key,
)
from .backends import _varlen_attention_masked, check_backend_name, varlen_attention
from .chunks import chunk_position_ids
from .host import cached_host_values, host_values
from .prefix import PREFIX_KEY, gather_prefix_keys
from .ulysses import SHARD_KEY

__all__ = ["ATTENTION_NAME", "register_attention", "varlen_attention_forward", "varlen_attention_mask"]

# The name is deliberate. transformers treats any implementation whose name contains "flash" as a
# FlashAttention flavour (`is_flash_attention_requested`): at load time it would try to import a flash
# package or a hub kernel of that name and fail, some models swap it for their preferred flash kernel, and
# generation/masking take flash-specific branches. Names containing "sdpa" or "flex_attention" trigger
# those backends' dispatch checks, and "org/name" patterns are taken for hub kernels. A plain name with
# none of these is validated only against the AttentionInterface keys, which is what we want.
ATTENTION_NAME = "packing_hf_varlen"

_BACKEND = "auto"


# --------------------------------------------------------------------------------------------------
# segment boundaries of a (B, T) batch
# --------------------------------------------------------------------------------------------------


class _Layout:
    """Where the tokens of a ``(B, Tq)`` query / ``(B, Tk)`` key batch go in the flat varlen call."""

    __slots__ = ("cu_k", "cu_q", "grid_k", "grid_q", "max_k", "max_q")

    def __init__(self, cu_q, cu_k, max_q, max_k, grid_q=None, grid_k=None):
        self.cu_q, self.cu_k = cu_q, cu_k  # (n + 1,) int32
        self.max_q, self.max_k = max_q, max_k  # ints
        # the batch's real tokens in the (B, T) grid (PackedLayout), or None = every token of the batch
        self.grid_q: PackedLayout | None = grid_q
        self.grid_k: PackedLayout | None = grid_k


def _grid(index: torch.Tensor | None, batch: int, width: int) -> PackedLayout | None:
    """The real tokens ``index`` (flat, ascending) of a ``(batch, width)`` padded batch; None for all."""
    return None if index is None else PackedLayout(index, (index.numel(),), batch, width, complete=True)


# Every layer receives the same position_ids / mask tensor objects, so the layout (which needs a host
# sync when it is derived from values) is computed once per forward.
_LAYOUTS = IdentityCache(size=4)


def _uniform_layout(batch: int, tq: int, tk: int, device: torch.device) -> _Layout:
    cu_q = torch.arange(0, (batch + 1) * tq, tq, dtype=torch.int32, device=device)
    cu_k = cu_q if tq == tk else torch.arange(0, (batch + 1) * tk, tk, dtype=torch.int32, device=device)
    return _Layout(cu_q, cu_k, tq, tk)


def _longest_segment(cu: torch.Tensor) -> int:
    """Longest segment of ``(n + 1,)`` boundaries, from their (cached) host copy; 0 for none."""
    bounds = host_values(cu)
    return max((b - a for a, b in zip(bounds[:-1], bounds[1:], strict=False)), default=0)


def _starts_to_layout(starts: torch.Tensor, total: int, grid: PackedLayout | None) -> _Layout:
    begin = torch.nonzero(starts).flatten()
    cu = torch.cat([begin, torch.tensor([total], device=begin.device)]).to(torch.int32)
    max_len = _longest_segment(cu)
    return _Layout(cu, cu, max_len, max_len, grid, grid)


def _rows_layout(valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(B, L) bool -> (flat indices of valid tokens, cu_seqlens of the rows, longest row)."""
    counts = valid.sum(dim=-1, dtype=torch.int32)
    cu = torch.nn.functional.pad(torch.cumsum(counts, 0, dtype=torch.int32), (1, 0))
    index = torch.nonzero(valid.flatten()).flatten()
    return index, cu, int(counts.max()) if counts.numel() else 0


def _compute_layout(
    batch: int,
    tq: int,
    tk: int,
    device: torch.device,
    padding: torch.Tensor | None,
    position_ids: torch.Tensor | None,
) -> _Layout:
    if padding is not None and padding.shape[1] == tk and bool(padding.all()):
        padding = None  # an all-ones mask (passed directly, not through varlen_attention_mask) pads nothing
    if tq == tk:
        if position_ids is None:
            if padding is None:
                return _uniform_layout(batch, tq, tk, device)
            index, cu, max_len = _rows_layout(padding)
            grid = _grid(index, batch, tq)
            return _Layout(cu, cu, max_len, max_len, grid, grid)
        positions = position_ids.to(device).expand(batch, tq).reshape(-1)
        row = torch.arange(batch * tq, device=device) // tq
        if padding is None:
            index = None
        else:
            index = torch.nonzero(padding.flatten()).flatten()
            positions, row = positions[index], row[index]
        starts = position_restarts(positions)
        starts[1:] |= row[1:] != row[:-1]  # and every row starts a sample
        return _starts_to_layout(starts, positions.numel(), _grid(index, batch, tq))
    # a cache: more keys than queries (decoding, chunked prefill); packed rows are not expected here
    if padding is None:
        return _uniform_layout(batch, tq, tk, device)
    index_k, cu_k, max_k = _rows_layout(padding)
    if tq == 1:
        cu_q = torch.arange(batch + 1, dtype=torch.int32, device=device)
        return _Layout(cu_q, cu_k, 1, max_k, None, _grid(index_k, batch, tk))
    # the queries are the last tq keys of every row (left padding), as in transformers' flash path
    index_q, cu_q, max_q = _rows_layout(padding[:, -tq:])
    return _Layout(cu_q, cu_k, max_q, max_k, _grid(index_q, batch, tq), _grid(index_k, batch, tk))


def _layout(batch, tq, tk, device, padding, position_ids) -> _Layout:
    return _LAYOUTS.derive(
        (padding, position_ids),
        lambda: _compute_layout(batch, tq, tk, device, padding, position_ids),
        data=(batch, tq, tk, str(device)),
    )


def _packed_position_ids(position_ids, batch: int, tq: int) -> torch.Tensor | None:
    """position_ids usable for boundary detection: ``(B, Tq)`` or ``(1, Tq)`` ints, else ``None``.

    Multimodal rotary models pass ``(3, B, T)`` (mrope) positions: those are not used for boundaries.
    """
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2:
        return None
    if position_ids.shape[-1] != tq or position_ids.shape[0] not in (1, batch):
        return None
    return position_ids


# --------------------------------------------------------------------------------------------------
# the shared core: (B, T, H, D) in, (B, Tq, H, Dv) out
# --------------------------------------------------------------------------------------------------


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    causal: bool,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    dropout_p: float = 0.0,
    s_aux: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    backend: str | None = None,
    prefix_seq_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of a ``(B, T, H, D)`` batch with packed and/or padded rows kept apart.

    Shared by :func:`varlen_attention_forward` and the patched ``_flash_attention_forward``.

    Args:
        query: ``(B, Tq, Hq, D)``.
        key: ``(B, Tk, Hkv, D)``.
        value: ``(B, Tk, Hkv, Dv)``.
        attention_mask: ``None``; a ``(B, Tk)`` padding mask (1 = token, 0 = padding); or a ``(B|1, H|1,
            Tq, Tk)`` mask the model built itself (bool keep-mask or additive float), which is applied
            within every segment.
        position_ids: ``(B|1, Tq)`` positions; restarts mark packed samples.
        cu_seq_lens_q: ``(n + 1,)`` int32 boundaries of the flattened queries (requires ``B == 1``).
        cu_seq_lens_k: same for the keys (defaults to ``cu_seq_lens_q``).
        max_length_q: longest query segment (an int, symbolic under ``torch.compile``); when missing it is
            computed from the boundaries, one host read per forward (a graph break under compile).
        max_length_k: longest key segment.
        backend: a :func:`packing_hf.varlen_attention` backend; ``None`` = the one given to
            :func:`register_attention` (``"auto"`` by default).
        prefix_seq_idx: ``(n,)`` int32 next to ``cu_seq_lens_q``: the prefix-tree layout (every segment
            attends to its ancestor segments; :mod:`packing_hf.attention.prefix`). Causal self-attention only.

    Returns:
        ``(B, Tq, Hq, Dv)``; padding query positions are 0.

    >>> q = torch.randn(1, 5, 2, 4)
    >>> cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    >>> out = attend(q, q, q, None, causal=True, cu_seq_lens_q=cu, max_length_q=3)
    >>> torch.allclose(out[0, 2:], attend(q[:, 2:], q[:, 2:], q[:, 2:], None, causal=True)[0], atol=1e-6)
    True
    """
    batch, tq, hq, _ = query.shape
    backend = backend or _BACKEND
    check_int32_tokens(batch * max(tq, key.shape[1]), f"a batch of {batch} rows")
    dense, padding, key, value = _split_mask(attention_mask, key, value, batch)
    tk = key.shape[1]
    if cu_seq_lens_q is not None:
        layout = _given_layout(
            cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, batch, padding, query.device
        )
        # a prefix-tree row's segments continue their parents' positions: only its total is checked here
        positions = _packed_position_ids(position_ids, batch, tq) if prefix_seq_idx is None else None
        _check_row_boundaries(cu_seq_lens_q, positions, tq)
    else:
        positions = _packed_position_ids(position_ids, batch, tq) if tq == tk else None
        layout = _layout(batch, tq, tk, query.device, padding, positions)

    q = query.reshape(batch * tq, hq, query.shape[-1])  # (B*Tq, Hq, D)
    k = key.reshape(batch * tk, key.shape[2], key.shape[-1])  # (B*Tk, Hkv, D)
    v = value.reshape(batch * tk, value.shape[2], value.shape[-1])  # (B*Tk, Hkv, Dv)
    if layout.grid_q is not None:
        q = layout.grid_q.unpad(query)
    if layout.grid_k is not None:
        k, v = layout.grid_k.unpad(key), layout.grid_k.unpad(value)
    if prefix_seq_idx is not None:
        _check_prefix_call(cu_seq_lens_q, dense, layout, causal, tq, tk)
        k, v, cu_k, max_k = gather_prefix_keys(k, v, layout.cu_q, prefix_seq_idx)
        layout = _Layout(layout.cu_q, cu_k, layout.max_q, max_k)

    kwargs = dict(causal=causal, softmax_scale=scale, window_size=window_size, softcap=softcap)
    kwargs.update(dropout_p=dropout_p, s_aux=s_aux)
    if dense is not None:
        if alibi_slopes is not None:
            raise ValueError(
                "ALiBi slopes next to a 4-D attention mask are not supported; fold them into the mask"
            )
        if layout.grid_q is not None or layout.grid_k is not None:
            raise ValueError("a 4-D attention_mask cannot be combined with a 2-D padding mask")
        segment_mask = _dense_segment_mask(dense.to(query.device), batch, tq, tk)
        masked_backend = "reference" if backend == "reference" else "sdpa"
        out = _varlen_attention_masked(
            q, k, v, layout.cu_q, layout.cu_k, segment_mask, backend=masked_backend, **kwargs
        )
    else:
        out = varlen_attention(
            q, k, v, layout.cu_q, layout.cu_k, layout.max_q, layout.max_k,
            alibi_slopes=alibi_slopes, backend=backend, **kwargs,
        )  # fmt: skip
    if layout.grid_q is not None:  # padding queries come back as zeros
        return layout.grid_q.pad(out)
    return out.reshape(batch, tq, hq, out.shape[-1])


def _check_prefix_call(cu_seq_lens_q, dense, layout: _Layout, causal: bool, tq: int, tk: int) -> None:
    """Refuse a prefix-tree layout where it cannot be what the collator meant."""
    problem = None
    if cu_seq_lens_q is None:
        problem = "it needs cu_seq_lens_q (the segments prefix_seq_idx refers to)"
    elif dense is not None or layout.grid_q is not None:
        problem = "an attention_mask was passed next to it"
    elif not causal:
        problem = "the layer is not causal (a prefix shared by several segments is a causal notion)"
    elif tq != tk or (layout.cu_k is not layout.cu_q and not torch.equal(layout.cu_k, layout.cu_q)):
        problem = "the keys are not the row's own tokens (a cache or cross-attention)"
    if problem is not None:
        raise ValueError(
            f"prefix_seq_idx (a prefix-tree packed row) cannot be used here: {problem}. Build the batch with "
            "packing_hf.build_prefix_tree or a collator's shared-prefix option and call the model without a mask or cache"
        )


def _split_mask(
    attention_mask: torch.Tensor | None, key: torch.Tensor, value: torch.Tensor, batch: int
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``(dense 4-D mask or None, (B, Tk) bool padding or None, key, value)`` from the mask a layer got.

    A padding mask longer than the keys keeps its last ``Tk`` columns (as transformers does); a shorter one
    (static cache) cuts the key/value slots past it, which hold no tokens yet.
    """
    if attention_mask is None:
        return None, None, key, value
    if attention_mask.dim() == 4:
        return attention_mask, None, key, value
    if attention_mask.dim() != 2:
        raise ValueError(
            f"attention_mask must be (B, T) padding or a (B, H, Tq, Tk) mask, got {tuple(attention_mask.shape)}"
        )
    tk = key.shape[1]
    padding = attention_mask.to(device=key.device, dtype=torch.bool)
    if padding.shape[1] > tk:
        padding = padding[:, -tk:]
    elif padding.shape[1] < tk:
        key, value = key[:, : padding.shape[1]], value[:, : padding.shape[1]]
    if padding.shape[0] != batch:
        raise ValueError(
            f"attention_mask {tuple(attention_mask.shape)} does not match the batch of {batch} rows"
        )
    return None, padding, key, value


def _given_layout(
    cu_q: torch.Tensor,
    cu_k: torch.Tensor | None,
    max_q: int | None,
    max_k: int | None,
    batch: int,
    padding: torch.Tensor | None,
    device: torch.device,
) -> _Layout:
    """The layout of a packed row whose boundaries came with the batch (``cu_seq_lens_q/k``): used as is."""
    if batch != 1:
        raise ValueError(
            f"cu_seq_lens_q describes one packed row, but the batch has {batch} rows; a padding-free batch "
            "is a single row [1, T]: build it with packing_hf.PaddingFreeCollator"
        )
    if padding is not None and not bool(padding.all()):
        raise ValueError(
            "an attention_mask with padding was passed next to packed cu_seq_lens_q: the mask would "
            "contradict the packed boundaries. Drop the attention_mask (cu_seq_lens already keep the "
            "samples apart) or pad outside the row"
        )
    same = cu_k is None or cu_k is cu_q or _known_equal(cu_q, cu_k)
    cu_k = cu_q if same else cu_k
    if max_k is None and same:
        max_k = max_q
    # the collator's max_length_q/k are Python ints: no host read; without them the boundaries are read once
    # per forward (cached for the other layers), which under torch.compile is a graph break
    max_q = _longest_segment(cu_q) if max_q is None else max_q
    max_k = _longest_segment(cu_k) if max_k is None else max_k
    cu_q = cu_q.to(device)
    # the same object for keys and queries lets the backends take their self-attention fast paths
    return _Layout(cu_q, cu_q if same else cu_k.to(device), max_q, max_k)


# (cu_seq_lens_q, position_ids) pairs already checked against each other: every layer of a forward gets the
# same tensor objects, so the check (and its one host read) runs once per forward
_CHECKED_ROWS = IdentityCache(size=4)


def _check_row_boundaries(cu: torch.Tensor, position_ids: torch.Tensor | None, total: int) -> None:
    """Refuse ``cu_seq_lens_q`` that disagree with their row: not ending at its ``total`` tokens, or with
    boundaries where ``position_ids`` do not restart (or none where they do). Once per forward where reads
    are free (CPU, eager: the shared host copy of ``cu`` and one ``bool``); elsewhere the layers read nothing
    and :func:`packing_hf.prepare_model_for_packing`'s pre-hook checks the batch once, outside them."""
    if not isinstance(cu, torch.Tensor) or not host.reads_are_free(cu):
        return
    if _CHECKED_ROWS.get((cu, position_ids), data=total):
        return
    bounds = host_values(cu)
    if not bounds or bounds[0] != 0 or any(b < a for a, b in zip(bounds[:-1], bounds[1:], strict=False)):
        return  # malformed: the backends' check of cu_seqlens names it
    if bounds[-1] != total:
        raise ValueError(
            f"cu_seq_lens_q ends at token {bounds[-1]} but the packed row has {total} tokens: "
            f"{'the last ' + str(total - bounds[-1]) + ' tokens would be in no sample' if bounds[-1] < total else 'it points past the row'}. "
            "Build the boundaries from the samples of this row (packing_hf.PaddingFreeCollator, or "
            "packing_hf.varlen.lengths_to_cu_seqlens)"
        )
    if position_ids is not None and position_ids.shape[0] == 1:
        restarts = position_restarts(position_ids.reshape(-1))  # (T,) bool
        starts = torch.zeros_like(restarts)
        starts[[a for a, b in zip(bounds[:-1], bounds[1:], strict=False) if b > a]] = True
        wrong = starts != restarts
        if bool(wrong.any()):
            at = int(torch.nonzero(wrong)[0, 0])
            where = (
                "puts a sample boundary at token {at} where position_ids continue"
                if bool(starts[at])
                else "has no boundary at token {at}, where position_ids restart"
            ).format(at=at)
            raise ValueError(
                f"cu_seq_lens_q {where}: the boundaries contradict the row's position_ids, so samples would "
                "attend to each other (or be cut). Pass the cu_seq_lens_q and position_ids of the same samples "
                "(packing_hf.PaddingFreeCollator builds both)"
            )
    _CHECKED_ROWS.put((cu, position_ids), True, data=total)


def _known_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two boundary tensors are known equal without reading them (host copies made earlier, e.g. by
    :func:`packing_hf.validate_packed_batch`, which checks that ``cu_seq_lens_k`` equals ``cu_seq_lens_q``)."""
    host_a = cached_host_values(a)
    return host_a is not None and host_a == cached_host_values(b)


def _dense_segment_mask(dense: torch.Tensor, batch: int, tq: int, tk: int):
    """``segment_mask(sq, eq, sk, ek)``: the block of a model-built ``(B|1, H|1, Tq, Tk)`` mask for one segment."""
    if dense.shape[-2] != tq or dense.shape[-1] != tk or dense.shape[0] not in (1, batch):
        raise ValueError(
            f"a 4-D attention_mask {tuple(dense.shape)} does not match {batch} rows of {tq} queries and "
            f"{tk} keys"
        )

    def segment_mask(sq: int, eq: int, sk: int, ek: int) -> torch.Tensor:
        row = sq // tq
        block = dense[row if dense.shape[0] > 1 else 0]
        return block[:, sq - row * tq : eq - row * tq, sk - row * tk : ek - row * tk]

    return segment_mask


# --------------------------------------------------------------------------------------------------
# transformers glue
# --------------------------------------------------------------------------------------------------

_WARNED_ATTENTIONS = False

# the configs checked, with the fields check_served_config read and whether the calling model's mixers were split:
# one check per model config and state of those, so a config changed after the first forward (e.g. layer_types)
# is checked again, and so is a model sharing the config of another one that is prepared differently
_SERVED = IdentityCache(size=16)


def _check_served(config: Any, module: torch.nn.Module | None = None) -> None:
    """Refuse a model this attention cannot keep exact (see ``check_served_config``): once per config, and
    again whenever a field the check reads, or the preparation of the model calling, has changed.

    ``module`` is the attention layer called. Without it (the mask function sees the config only), the model
    calling is unprepared when no prepared model splits mixers under this config; otherwise it is not known
    here (an unprepared twin may share the config), and that part of the check is left to the layers.
    """
    if config is None:
        return
    mixers_split = None if config_has_split_model(config) else False
    if module is not None:
        preparation = preparation_of(module)  # the model's own, not its config's: twins share a config object
        mixers_split = preparation is not None and bool(preparation.mixers)
    key = (served_config_key(config), mixers_split)
    if _SERVED.get((config,), data=key):
        return
    check_served_config(config, mixers_split=mixers_split)
    # a reverted hybrid, or an unprepared twin of a prepared one, is checked (and refused) again
    _SERVED.put((config,), True, data=key)


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    s_aux: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers ``AttentionInterface`` function running :func:`packing_hf.varlen_attention`.

    Args:
        module: the attention layer (``is_causal`` is read from it unless passed).
        query: ``(B, Hq, Tq, D)``.
        key: ``(B, Hkv, Tk, D)``.
        value: ``(B, Hkv, Tk, Dv)``.
        attention_mask: what :func:`varlen_attention_mask` returned (``None`` or ``(B, Tk)`` padding), or a
            4-D mask a model built itself.
        scaling: softmax scale (default ``1 / sqrt(D)``).
        dropout: attention dropout (models pass 0.0 in eval).
        sliding_window: ``W`` = attend to the last ``W`` tokens (itself included).
        softcap: logit soft-capping (gemma2).
        is_causal: overrides ``module.is_causal``.
        s_aux: ``(Hq,)`` attention sinks (gpt_oss).
        alibi_slopes: ``(Hq,)`` ALiBi slopes.
        **kwargs: ``cu_seq_lens_q/k``, ``max_length_q/k``, ``position_ids``, ``prefix_seq_idx`` (see
            :func:`attend`); a sequence-parallel shard (:mod:`packing_hf.attention.ulysses`); others ignored.

    Returns:
        ``((B, Tq, Hq, Dv) output, None)``: attention weights are never materialised.

    >>> module = torch.nn.Module()
    >>> q = torch.randn(1, 2, 6, 4)
    >>> out, weights = varlen_attention_forward(module, q, q, q, None, position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]))
    >>> out.shape, weights
    (torch.Size([1, 6, 2, 4]), None)
    """
    global _WARNED_ATTENTIONS
    # sequence parallelism (attention/ulysses.py): the shard calls this function again, on the whole row
    shard = kwargs.pop(SHARD_KEY, None)
    if shard is not None:
        named = dict(scaling=scaling, dropout=dropout, sliding_window=sliding_window, softcap=softcap, is_causal=is_causal, s_aux=s_aux, alibi_slopes=alibi_slopes)  # fmt: skip
        return shard.attention(
            varlen_attention_forward, module, query, key, value, attention_mask, **named, **kwargs
        )
    _check_served(getattr(module, "config", None), module)
    if kwargs.get(PREFIX_KEY) is not None:
        refuse_prefix_tree(getattr(module, "config", None))
    refuse_unprepared_media(kwargs)  # packed image rows in a model that was not prepared
    if getattr(getattr(module, "config", None), "output_router_logits", False) and PADDING_KEY in kwargs:
        # a prepared model consumes the key: this one would count the padding in its router loss
        raise ValueError(
            "a packed row padded by pad_to_multiple_of / length_buckets reached an MoE model returning a router "
            "load-balancing loss (output_router_logits=True) that packing_hf.prepare_model_for_packing has not "
            "prepared: the loss would count the padding like real tokens. Call "
            "packing_hf.prepare_model_for_packing(model) first (packing_hf.Trainer does), or collate without padding"
        )
    if kwargs.get("cache") is not None:
        raise ValueError(
            f"{ATTENTION_NAME} does not drive transformers' paged cache (continuous batching); load the model "
            "with attn_implementation='sdpa' or a flash_attention_* implementation for continuous batching"
        )
    if kwargs.get("output_attentions") and not _WARNED_ATTENTIONS:
        import warnings

        warnings.warn(
            f"{ATTENTION_NAME} never materialises attention weights (output_attentions=True returns None); "
            "use attn_implementation='eager' to inspect them",
            stacklevel=2,
        )
        _WARNED_ATTENTIONS = True
    position_ids = kwargs.get("position_ids")
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    chunk = attention_chunk(module)
    if chunk is not None:
        position_ids = chunk_position_ids(
            chunk, query.shape[2], key.shape[2], position_ids, cu_q, query.device
        )
        cu_q = cu_k = max_q = max_k = None  # the chunks, finer than the samples, come from the positions
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    window = (sliding_window - 1, sliding_window - 1) if sliding_window else (-1, -1)
    out = attend(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        attention_mask,
        causal=bool(causal),
        scale=scaling,
        window_size=window,
        softcap=softcap or 0.0,
        dropout_p=dropout,
        s_aux=s_aux.to(query.dtype) if s_aux is not None else None,
        alibi_slopes=alibi_slopes,
        position_ids=position_ids,
        cu_seq_lens_q=cu_q,
        cu_seq_lens_k=cu_k,
        max_length_q=max_q,
        max_length_k=max_k,
        prefix_seq_idx=kwargs.get(PREFIX_KEY),
    )
    return out, None


def attention_chunk(module: torch.nn.Module) -> int | None:
    """The chunk size of a chunked local-attention layer (Llama 4), ``None`` for any other layer.

    A layer is chunked when its config has ``attention_chunk_size`` and names the layer
    ``"chunked_attention"`` in ``layer_types`` (read at ``module.layer_idx``), as transformers decides.

    >>> from types import SimpleNamespace
    >>> config = SimpleNamespace(attention_chunk_size=4, layer_types=["chunked_attention", "full_attention"])
    >>> layer = torch.nn.Module(); layer.config, layer.layer_idx = config, 0
    >>> attention_chunk(layer)
    4
    """
    config = getattr(module, "config", None)
    chunk = getattr(config, "attention_chunk_size", None)
    layer_types = getattr(config, "layer_types", None)
    index = getattr(module, "layer_idx", None)
    if not chunk or not isinstance(layer_types, list | tuple) or not isinstance(index, int):
        return None
    return int(chunk) if layer_types[index] == "chunked_attention" else None


def varlen_attention_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """transformers ``AttentionMaskInterface`` function: no dense mask for the varlen implementation.

    Returns ``None`` when there is no padding and the ``(B, kv_length)`` boolean padding mask otherwise (the
    attention then drops padding tokens, as ``flash_attention_2`` does). Causality, sliding windows and
    packed boundaries are applied by the attention itself. When a model overlays its own pattern
    (``or_mask_function``/``and_mask_function``, e.g. bidirectional image tokens), which boundaries cannot
    express, the dense mask is built with transformers' ``sdpa_mask`` so the result stays exact.

    >>> varlen_attention_mask(1, 4, 4, attention_mask=torch.ones(1, 4, dtype=torch.bool)) is None
    True
    >>> varlen_attention_mask(1, 3, 3, attention_mask=torch.tensor([[0, 1, 1]])).tolist()
    [[False, True, True]]
    """
    # mask creation runs before any layer, also in models that then compute attention themselves
    _check_served(kwargs.get("config"))
    if kwargs.get("use_vmap"):
        from transformers.masking_utils import sdpa_mask

        return sdpa_mask(
            batch_size=batch_size,
            q_length=q_length,
            kv_length=kv_length,
            q_offset=q_offset,
            kv_offset=kv_offset,
            mask_function=mask_function,
            attention_mask=attention_mask,
            allow_is_causal_skip=False,
            use_vmap=True,
            device=kwargs.get("device", "cpu"),
        )
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:].bool()
    # a mask shorter than the keys (static cache) must stay, to tell which key slots hold tokens
    if attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
        return None
    return attention_mask


def register_attention(backend: str = "auto") -> str:
    """Register packing_hf's varlen attention with transformers and return its name.

    Afterwards ``from_pretrained(..., attn_implementation=ATTENTION_NAME)``, ``from_config(...)`` and
    ``model.set_attn_implementation(ATTENTION_NAME)`` select it. Calling again is a no-op (apart from
    changing the backend). Registering adds keys to ``AttentionInterface`` / ``AttentionMaskInterface``;
    it replaces nothing, so other models and implementations are unaffected.

    Args:
        backend: the :func:`packing_hf.varlen_attention` backend every layer uses (``"auto"``: the fastest
            installed one supporting the layer's features; see :func:`packing_hf.attention.select_backend`).

    Returns:
        :data:`ATTENTION_NAME`.

    >>> register_attention() == register_attention() == ATTENTION_NAME
    True
    """
    global _BACKEND
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    _BACKEND = check_backend_name(backend)
    if AttentionInterface._global_mapping.get(ATTENTION_NAME) is not varlen_attention_forward:
        AttentionInterface.register(ATTENTION_NAME, varlen_attention_forward)
    if AttentionMaskInterface._global_mapping.get(ATTENTION_NAME) is not varlen_attention_mask:
        AttentionMaskInterface.register(ATTENTION_NAME, varlen_attention_mask)
    return ATTENTION_NAME


def resolve_attn_implementation(name: str) -> str:
    """The ``attn_implementation`` to hand transformers for ``name``.

    ``"packing_hf"`` and :data:`ATTENTION_NAME` mean packing_hf's varlen attention: it is registered (see
    :func:`register_attention`) and its registered name returned. Every other name is transformers' own
    (``"eager"``, ``"sdpa"``, ``"flash_attention_2"``, ...) and is returned unchanged.

    >>> resolve_attn_implementation("packing_hf"), resolve_attn_implementation("sdpa")
    ('packing_hf_varlen', 'sdpa')
    """
    if name in ("packing_hf", ATTENTION_NAME):
        return register_attention()
    return name
