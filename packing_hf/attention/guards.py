"""Guards for packed batches: every way a packed row can silently leak is fixed or refused loudly.

A padding-free batch keeps its samples apart only if the model sees it the way the collator meant it.
Stock transformers detects packing from ``position_ids`` only when there is no ``attention_mask`` and no
cache, and varlen kernels need int32 offsets. :func:`validate_packed_batch` checks one batch (cheap: a
few vectorized comparisons, at most one host sync) and returns the batch to pass on:

- ``use_cache=True`` (the default of most configs): a cache turns packed-sequence detection off, so the
  returned batch says ``use_cache=False``; a ``past_key_values`` (or ``cache``) next to a packed row is refused;
- an ``attention_mask`` next to packed inputs: all ones carries nothing and turns detection off, so it is
  dropped; one with zeros contradicts the packed boundaries and is refused;
- ``cu_seq_lens_q/k`` with more than one row: they describe one ``[1, T]`` row, refused;
- ``position_ids`` that do not restart at 0 at every sample boundary (or that disagree with
  ``cu_seq_lens_q``), or no ``position_ids`` at all next to ``cu_seq_lens_q``: refused, since eager/sdpa
  would merge the samples and rotary embeddings would be offset;
- a prefix-tree row (``prefix_seq_idx``): every segment's positions must continue its parent's, and the model
  must run packing_hf's attention (any other would ignore the layout and let siblings see each other) and
  have no non-attention token mixer (a hybrid's SSM or convolution would not start from the parent's state);
- a packed row too long for int32 offsets, ``cu_seq_lens`` that do not cover the row, a ``max_length``
  shorter than a sample: refused;
- ``labels`` at a sample start that are not ``-100``: the last token of one sample would be trained to
  predict the first token of the next, refused;
- (:func:`validate_packed_batch` given the ``model`` or its ``config``) a model that leaks until it is prepared
  (a hybrid's mixers, a mask built without ``position_ids``) and is not: refused, naming the fix; so is a
  packed row of several image samples (:data:`packing_hf.multimodal.PACKED_MEDIA_KEY`) for a model not
  prepared. Whether a model is prepared is read from the model, never from its config (two models built
  from one config object share it).

:func:`packed_forward_pre_hook` applies the same checks inside ``model.forward`` (installed by
:func:`packing_hf.attention.models.prepare_model_for_packing`).

>>> import torch
>>> batch = {"input_ids": torch.tensor([[5, 6, 7, 8]]), "position_ids": torch.tensor([[0, 1, 0, 1]]),
...          "attention_mask": torch.ones(1, 4, dtype=torch.long)}
>>> sorted(validate_packed_batch(batch))
['input_ids', 'position_ids', 'use_cache']
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..multimodal import PACKED_MEDIA_KEY
from ..shared_prefix import shared_prefix_position_ids
from ..varlen import (
    IGNORE_INDEX,
    PADDING_KEY,
    check_cu_seqlens,
    check_int32_tokens,
    check_row_padding,
    cu_seqlens_to_position_ids,
    cu_seqlens_to_starts,
    mrope_position_restarts,
    position_restarts,
)
from .admission import flat_positions_dropped_by, needs_preparation, preparation_of, refuse_prefix_tree
from .host import remember_host_values
from .interface import ATTENTION_NAME
from .prefix import PREFIX_KEY
from .ulysses import SHARD_KEY

__all__ = ["IGNORE_INDEX", "find_packed_boundaries", "packed_forward_pre_hook", "validate_packed_batch"]

_FIX_POSITIONS = "build position_ids with packing_hf.varlen.lengths_to_position_ids (or use packing_hf.PaddingFreeCollator)"


def _first_true(mask: torch.Tensor) -> int:
    return int(torch.nonzero(mask.reshape(-1))[0, 0])


def _text_positions(position_ids: Any) -> Any:
    """The ``(B, T)`` text positions the model reads: multimodal RoPE ``(4, B, T)`` positions carry them in their
    first row; 3-row ``(3, B, T)`` ones carry none (transformers builds the mask without positions): ``None``."""
    if isinstance(position_ids, torch.Tensor) and position_ids.dim() == 3:
        return position_ids[0] if position_ids.shape[0] == 4 else None
    return position_ids


def _is_mrope3(position_ids: Any) -> bool:
    """Whether ``position_ids`` are 3-row ``(3, B, T)`` multimodal-RoPE positions (temporal, height, width)."""
    return isinstance(position_ids, torch.Tensor) and position_ids.dim() == 3 and position_ids.shape[0] == 3


def find_packed_boundaries(batch: Mapping[str, Any]) -> torch.Tensor | None:
    """``(B, T)`` bool marking the first token of every sample, or ``None`` if the batch is not packed.

    A batch is packed when it carries ``cu_seq_lens_q`` (one row) or ``position_ids`` restarting inside a
    row. Padding (``attention_mask == 0``) is not part of any sample: an ordinary left- or right-padded batch,
    whose padding slots hold filler positions (``cumsum(mask) - 1`` with padding set to 1, as ``generate``
    builds them), is not packed. Costs one host sync when only ``position_ids`` tell.

    >>> find_packed_boundaries({"position_ids": torch.tensor([[0, 1, 0, 1, 2]])}).int().tolist()
    [[1, 0, 1, 0, 0]]
    >>> find_packed_boundaries({"position_ids": torch.tensor([[0, 1, 2]])}) is None
    True
    >>> left_padded = {"position_ids": torch.tensor([[1, 1, 0, 1, 2]]), "attention_mask": torch.tensor([[0, 0, 1, 1, 1]])}
    >>> find_packed_boundaries(left_padded) is None
    True
    """
    cu = batch.get("cu_seq_lens_q")
    if isinstance(cu, torch.Tensor):
        return cu_seqlens_to_starts(cu, int(cu[-1]))
    raw = batch.get("position_ids")
    # 3-row multimodal positions: a sample's temporal row never falls, so a fall is a restart
    mrope = _is_mrope3(raw)
    position_ids = raw[0] if mrope else _text_positions(raw)
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or position_ids.shape[-1] < 2:
        return None
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.shape == position_ids.shape and not bool(mask.all()):
        valid = mask.to(device=position_ids.device, dtype=torch.bool)
        starts = _restarts_among(position_ids, valid, falls=mrope)
        if not bool((starts.sum(dim=-1) > 1).any()):  # one sample per row: ordinary padding
            return None
        return starts
    starts = mrope_position_restarts(position_ids) if mrope else position_restarts(position_ids)
    if not bool(starts[:, 1:].any()):
        return None
    return starts


def _restarts_among(position_ids: torch.Tensor, valid: torch.Tensor, *, falls: bool = False) -> torch.Tensor:
    """``(B, T)`` bool: sample starts counted over the ``valid`` tokens only (padding is skipped over).

    A valid token starts a sample when it is the first valid token of its row or its position does not
    continue that of the previous *valid* token by +1 (``falls``: is lower than it, the rule of the temporal
    row of 3-row multimodal positions, :func:`packing_hf.varlen.mrope_position_restarts`).
    """
    columns = torch.arange(position_ids.shape[-1], device=position_ids.device).expand_as(position_ids)
    last_valid = torch.where(valid, columns, -1).cummax(dim=-1).values  # (B, T) latest valid column so far
    previous = torch.full_like(last_valid, -1)
    previous[:, 1:] = last_valid[:, :-1]  # (B, T) the valid column before each token, -1 if none
    prev_pos = position_ids.gather(-1, previous.clamp(min=0))
    broken = position_ids < prev_pos if falls else position_ids != prev_pos + 1
    return valid & ((previous < 0) | broken)


def _config_caches(config: Any) -> bool:
    """Whether the model would build a cache by default: its config, or a multimodal wrapper's text config
    (``Trainer`` sets ``model.config.use_cache = False`` on the wrapper only)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(config, "use_cache", True)) or bool(getattr(text, "use_cache", True))


def _returns_router_loss(config: Any) -> bool:
    """Whether the model of ``config`` (or a multimodal wrapper's language model) returns a router loss."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(
        getattr(config, "output_router_logits", False) or getattr(text, "output_router_logits", False)
    )


def _sequence_shape(batch: Mapping[str, Any]) -> tuple[int, int] | None:
    for key in ("input_ids", "inputs_embeds", "position_ids", "labels"):
        value = batch.get(key)
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return int(value.shape[0]), int(value.shape[1])
    return None


def _check_packed_cu_seqlens(batch: Mapping[str, Any], batch_size: int, total: int) -> list[int]:
    """Validate ``cu_seq_lens_q/k`` and ``max_length_q/k``; returns the host copy of ``cu_seq_lens_q``."""
    cu = batch["cu_seq_lens_q"]
    if batch_size != 1:
        raise ValueError(
            f"cu_seq_lens_q describes one packed row, but the batch has {batch_size} rows of {total} tokens; "
            "a padding-free batch is a single row [1, T]: build it with packing_hf.PaddingFreeCollator, or drop "
            "cu_seq_lens_q/k and keep restarting position_ids per row"
        )
    cu_k = batch.get("cu_seq_lens_k")
    if isinstance(cu_k, torch.Tensor) and cu_k is not cu and not torch.equal(cu_k.to(cu.device), cu):
        raise ValueError(
            "cu_seq_lens_k differs from cu_seq_lens_q, but a packed causal-LM row attends within the same "
            "samples for queries and keys; pass the same tensor for both"
        )
    # empty segments only at the end (PaddingFreeCollator(segment_buckets=...)): strict before them
    host = check_cu_seqlens(cu, "cu_seq_lens_q", total=total, allow_empty=True)
    check_cu_seqlens(_filled(host), "cu_seq_lens_q", total=total)
    if len(host) < 2 or host[1] == 0:
        raise ValueError("cu_seq_lens_q = [0] describes no sample; a packed row holds at least one")
    longest = max(b - a for a, b in zip(host[:-1], host[1:], strict=False))
    for key in ("max_length_q", "max_length_k"):
        value = batch.get(key)
        if value is not None and int(value) < longest:
            raise ValueError(
                f"{key} = {int(value)} but the longest sample in cu_seq_lens_q has {longest} tokens; varlen "
                f"kernels would read past it. Use packing_hf.varlen.max_length_from_cu_seqlens(cu_seq_lens_q)"
            )
    return host


def _filled(host: list[int]) -> list[int]:
    """``cu_seq_lens`` host values without the empty segments closing the row (``segment_buckets``)."""
    end = len(host)
    while end > 2 and host[end - 1] == host[end - 2]:
        end -= 1
    return host[:end]


def _check_prefix_attention(config: Any) -> None:
    """A prefix-tree row only means what it says under packing_hf's attention, which reads prefix_seq_idx, on a
    model whose every token mixer is attention."""
    refuse_prefix_tree(config)
    implementation = getattr(config, "_attn_implementation", None) if config is not None else None
    if implementation is not None and implementation != ATTENTION_NAME:
        raise ValueError(
            f"the batch has {PREFIX_KEY} (segments continuing a shared prefix segment), which attn_implementation="
            f"{implementation!r} ignores: its branches would attend to each other. Load the model with "
            "attn_implementation=packing_hf.register_attention() or collate without the shared prefix"
        )


def validate_packed_batch(
    batch: Mapping[str, Any], config: Any = None, *, model: torch.nn.Module | None = None
) -> dict[str, Any]:
    """Check a packed batch and return it ready for ``model(**batch)``; non-packed batches pass unchanged.

    Args:
        batch: model inputs: ``input_ids`` ``(B, T)``, ``position_ids`` ``(B, T)``, optionally
            ``cu_seq_lens_q/k`` ``(n + 1,)`` int32, ``max_length_q/k``, ``attention_mask`` ``(B, T)``,
            ``labels`` ``(B, T)``, ``use_cache``, ``past_key_values`` / ``cache``.
        config: the model config (optional); its ``use_cache`` decides whether ``use_cache=False`` must be
            added, and a packed batch is refused for a model type that leaks until
            :func:`packing_hf.prepare_model_for_packing` prepares it (a hybrid's mixers, a mask built without
            ``position_ids``: :func:`packing_hf.attention.admission.needs_preparation`). A config cannot say
            whether its model was prepared (twins built from one config object share it): pass ``model``.
        model: the model the batch is for (optional; ``config`` defaults to ``model.config``): a packed batch
            it would leak on is refused unless this model instance is prepared, and so is a packed row of
            several image samples (:data:`packing_hf.multimodal.PACKED_MEDIA_KEY`) for a model not prepared.

    Returns:
        A shallow copy of ``batch``: an all-ones ``attention_mask`` removed and ``use_cache=False`` set when
        the batch is packed. Tensors are not copied.

    Raises:
        ValueError: naming the problem and its fix (see the module docstring for the list).

    >>> ok = {"input_ids": torch.tensor([[5, 6, 7]]), "position_ids": torch.tensor([[0, 0, 1]]),
    ...       "labels": torch.tensor([[-100, -100, 7]])}
    >>> validate_packed_batch(ok)["use_cache"]
    False
    """
    if model is not None and config is None:
        config = getattr(model, "config", None)
    preparation = preparation_of(model) if model is not None else None
    out, starts = _validate(batch, config)
    if starts is None:
        return out
    model_type = getattr(config, "model_type", type(model if config is None else config).__name__)
    if model is not None and preparation is None and out.get(PACKED_MEDIA_KEY):
        raise ValueError(
            f"model: a packed row holding several image samples (packing_hf.MultimodalCollator) is for a "
            f"{model_type!r} model that packing_hf.prepare_model_for_packing has not prepared: only a prepared "
            "model keeps their multimodal positions and image masks per sample. Call "
            "packing_hf.prepare_model_for_packing(model) first (packing_hf.Trainer does), or collate one sample "
            "per row"
        )
    if (
        model is not None
        and preparation is None
        and out.get(PADDING_KEY) is not None
        and _returns_router_loss(config)
    ):
        raise ValueError(
            f"model: a packed row padded by pad_to_multiple_of / length_buckets is for a {model_type!r} model that "
            "returns a router load-balancing loss (output_router_logits=True) and that "
            "packing_hf.prepare_model_for_packing has not prepared: the loss would count the padding like real "
            "tokens. Call packing_hf.prepare_model_for_packing(model) first (packing_hf.Trainer does), or collate "
            "without padding"
        )
    varlen = getattr(config, "_attn_implementation", None) == ATTENTION_NAME
    if model is not None and preparation is None:
        _refuse_dropped_positions(out, model, model_type, varlen)
    reason = needs_preparation(config, varlen=varlen, preparation=preparation) if config is not None else None
    if reason is None:
        return out
    if model is None:
        raise ValueError(
            f"config: a {model_type!r} model leaks on this packed batch unless it is prepared ({reason}), and a "
            "config cannot say whether its model was (models built from one config object share it). Call "
            "packing_hf.prepare_model_for_packing(model) and pass the model: "
            "validate_packed_batch(batch, model=model)"
        )
    raise ValueError(
        f"model: a {model_type!r} model not prepared for packing leaks on this packed batch ({reason}); call "
        "packing_hf.prepare_model_for_packing(model) on this model first (packing_hf.Trainer does); a model "
        "sharing its config with a prepared one is not prepared itself"
    )


def _refuse_dropped_positions(out: Mapping[str, Any], model: Any, model_type: Any, varlen: bool) -> None:
    """Refuse a packed row that an unprepared model's language model reads without its boundaries: it hands its
    layers and its mask no positions unless they carry a text row (:func:`flat_positions_dropped_by`), so only
    ``cu_seq_lens_q`` under packing_hf's attention keep the samples apart."""
    position_ids = out.get("position_ids")
    if isinstance(position_ids, torch.Tensor) and position_ids.dim() == 3 and position_ids.shape[0] == 4:
        return  # the text row reaches the layers and the mask
    if varlen and out.get("cu_seq_lens_q") is not None:
        return
    stack = flat_positions_dropped_by(model)
    if stack is None:
        return
    raise ValueError(
        f"model: a {model_type!r} model not prepared for packing: its {stack} reads "
        f"position_ids of shape {tuple(getattr(position_ids, 'shape', ()))} as multimodal-RoPE rows without the "
        "text row and hands its layers and its mask no positions, so this packed row's samples would attend to "
        "each other. Call packing_hf.prepare_model_for_packing(model) first (packing_hf.Trainer does), or pass "
        "cu_seq_lens_q/k under attn_implementation=packing_hf.register_attention() "
        "(PaddingFreeCollator(return_flash_attn_kwargs=True))"
    )


def _validate(batch: Mapping[str, Any], config: Any) -> tuple[dict[str, Any], torch.Tensor | None]:
    """:func:`validate_packed_batch`, also returning the ``(B, T)`` sample starts it found (``None``: not packed)."""
    out = dict(batch)
    if out.get(SHARD_KEY) is not None:  # one rank's part of a sequence-parallel row, checked whole when cut
        return out[SHARD_KEY].check_call(out), None
    _refuse_flat_packed_positions(out)
    starts = find_packed_boundaries(out)
    if starts is None:
        return out, None
    shape = _sequence_shape(out)
    if shape is None:
        raise ValueError("a packed batch needs input_ids or inputs_embeds of shape (1, T)")
    batch_size, total = shape
    check_int32_tokens(batch_size * total, f"a packed batch of {batch_size} rows")

    raw = out.get("position_ids")
    position_ids = _text_positions(raw)
    has_cu = out.get("cu_seq_lens_q") is not None
    if _is_mrope3(raw):
        _check_mrope3_starts(raw, starts, has_cu)
    if has_cu:
        _check_cu_seqlens_positions(out, None if _is_mrope3(raw) else position_ids, batch_size, total, config)
    elif isinstance(position_ids, torch.Tensor):
        _check_sample_starts_at_zero(position_ids, starts)
        if out.get(PADDING_KEY) is not None:
            host = torch.nonzero(starts[0]).reshape(-1).tolist() + [total] if batch_size == 1 else [0, total]
            check_row_padding(out[PADDING_KEY], host, total)
    _drop_all_ones_mask(out)
    _turn_cache_off(out, config)
    labels = out.get("labels")
    if isinstance(labels, torch.Tensor) and labels.shape[:2] == (batch_size, total):
        _check_labels_at_starts(labels, starts, total)
    return out, starts


def _check_cu_seqlens_positions(
    out: dict[str, Any], position_ids: Any, batch_size: int, total: int, config: Any
) -> None:
    """Check ``cu_seq_lens_q/k`` and that ``position_ids`` restart at every boundary they mark (or continue the
    prefix in a shared-prefix branch); ``out`` gets one boundary tensor for queries and keys."""
    host = _check_packed_cu_seqlens(out, batch_size, total)
    # the attention layers reuse this host copy instead of reading the boundaries again, and get one
    # tensor for queries and keys (checked equal above), which is their self-attention fast path
    remember_host_values(out["cu_seq_lens_q"], host)
    if out.get("cu_seq_lens_k") is not None:
        out["cu_seq_lens_k"] = out["cu_seq_lens_q"]
    if out.get(PADDING_KEY) is not None:
        check_row_padding(out[PADDING_KEY], host, total)
    if _is_mrope3(out.get("position_ids")):  # checked against the starts by _check_mrope3_starts
        return
    if position_ids is None:
        raise ValueError(
            "cu_seq_lens_q is given without position_ids: eager/sdpa attention and rotary embeddings would "
            f"treat the whole row as one sample. Pass restarting position_ids ({_FIX_POSITIONS})"
        )
    position_ids = position_ids.reshape(1, -1)
    prefix = out.get(PREFIX_KEY)
    if prefix is not None:
        _check_prefix_attention(config)
        # branches continue their prefix's positions (checked against the segments as well)
        expected = shared_prefix_position_ids(host, prefix).to(position_ids.device)  # (T,) int64
    else:
        # from the host copy already made: no further device sync
        expected = cu_seqlens_to_position_ids(_filled(host)).to(position_ids.device)  # (T,) int64
    wrong = position_ids[0] != expected
    if bool(wrong.any()):
        bad = _first_true(wrong)
        raise ValueError(
            f"position_ids[0, {bad}] = {int(position_ids[0, bad])} but cu_seq_lens_q puts token {bad} at "
            f"position {int(expected[bad])} of its sample: positions must restart at 0 at every boundary "
            "of cu_seq_lens_q (and continue the prefix in a shared-prefix branch), or eager/sdpa would "
            f"merge samples; {_FIX_POSITIONS}"
        )


def _refuse_flat_packed_positions(out: Mapping[str, Any]) -> None:
    """Refuse ``(T,)`` position_ids of a packed row: no batch dimension, which transformers' rotary embeddings
    and masks need (they fail far from the cause, or the row would be read as unpacked)."""
    position_ids = out.get("position_ids")
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 1 or position_ids.numel() < 2:
        return
    restarts = position_restarts(position_ids)[1:]
    if out.get("cu_seq_lens_q") is not None or bool(restarts.any()):
        raise ValueError(
            f"position_ids of shape {tuple(position_ids.shape)} describe a packed row (they restart, or "
            "cu_seq_lens_q is given) but have no batch dimension: transformers' rotary embeddings and masks read "
            "(B, T) positions. Pass position_ids[None], of shape (1, T) (packing_hf.PaddingFreeCollator does)"
        )


def _check_mrope3_starts(position_ids: torch.Tensor, starts: torch.Tensor, has_cu: bool) -> None:
    """3-row multimodal positions ``(3, B, T)`` on a packed row: transformers reads no sample boundaries from
    them, so the row needs ``cu_seq_lens_q``; every row must be 0 at each sample start."""
    if not has_cu:
        inner = starts & (starts.long().cumsum(dim=-1) > 1)  # every start but the first of its row
        row, col = divmod(_first_true(inner), starts.shape[-1])
        raise ValueError(
            f"position_ids of shape {tuple(position_ids.shape)} (3-row multimodal RoPE) restart at token {col} of "
            f"row {row} (a packed row), but transformers reads no sample boundaries from 3-row positions: the "
            "samples would attend to each other. Pass cu_seq_lens_q/k next to them (packing_hf.MultimodalCollator "
            "returns them), or (4, B, T) positions whose first row is the text position restarting per sample"
        )
    not_zero = starts & (position_ids != 0).any(dim=0)
    if bool(not_zero.any()):
        row, col = divmod(_first_true(not_zero), starts.shape[-1])
        raise ValueError(
            f"position_ids[:, {row}, {col}] = {position_ids[:, row, col].tolist()} at the start of a packed sample "
            "(cu_seq_lens_q): every sample's multimodal positions start at 0 (its get_rope_index run alone); "
            "compute them per sample (packing_hf.multimodal.mrope_position_ids)"
        )


def _check_sample_starts_at_zero(position_ids: torch.Tensor, starts: torch.Tensor) -> None:
    """Without ``cu_seq_lens_q``: every sample start found in ``position_ids`` ``(B, T)`` must be position 0."""
    not_zero = starts & (position_ids != 0)
    if bool(not_zero.any()):
        row, col = divmod(_first_true(not_zero), position_ids.shape[-1])
        raise ValueError(
            f"position_ids[{row}, {col}] = {int(position_ids[row, col])} begins a packed sample, but packed "
            "samples must start at position 0: a sample continuing the previous one's positions would be "
            f"merged with it, and rotary positions would be offset; {_FIX_POSITIONS}"
        )


def _drop_all_ones_mask(out: dict[str, Any]) -> None:
    """Remove an all-ones ``attention_mask`` from ``out``; refuse any other mask next to packed inputs."""
    mask = out.get("attention_mask")
    if mask is None:
        return
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and bool(mask.all()):
        # all ones says nothing, but its presence switches transformers' packed-sequence detection off
        del out["attention_mask"]
    else:
        raise ValueError(
            "an attention_mask with padding (or a 4-D mask) was passed next to packed inputs: it would "
            "replace the packed boundaries and let samples attend to each other. A padding-free batch "
            "needs no mask: drop attention_mask (PaddingFreeCollator does not emit one)"
        )


def _turn_cache_off(out: dict[str, Any], config: Any) -> None:
    """Refuse a cache next to a packed row, and set ``use_cache=False`` where the model would build one."""
    for name in ("past_key_values", "cache"):  # transformers 5.24 renamed past_key_values to cache
        if out.get(name) is not None:
            raise ValueError(
                f"{name} was passed with a packed row: a cache turns off packed-sequence masking and would mix "
                "samples; packed rows are for training, call the model without a cache"
            )
    if out.get("use_cache") or (out.get("use_cache") is None and _config_caches(config)):
        out["use_cache"] = False  # a cache disables packed-sequence detection in transformers' mask creation


def _check_labels_at_starts(labels: torch.Tensor, starts: torch.Tensor, total: int) -> None:
    """``labels`` ``(B, T)`` must be ``IGNORE_INDEX`` at every sample start but a row's first token."""
    inner = starts.clone()
    inner[:, 0] = False  # the very first token of a row is never a prediction target after the shift
    bad = inner & (labels != IGNORE_INDEX)
    if bool(bad.any()):
        row, col = divmod(_first_true(bad), total)
        raise ValueError(
            f"labels[{row}, {col}] = {int(labels[row, col])} at the first token of a packed sample: after "
            "the causal shift the previous sample's last token would be trained to predict it. Set labels "
            f"to {IGNORE_INDEX} at every sample start (PaddingFreeCollator does)"
        )


def packed_forward_pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``register_forward_pre_hook(..., with_kwargs=True)`` hook running :func:`validate_packed_batch`.

    Positional ``input_ids`` (``model(ids, ...)``) are taken into account; other positional arguments are
    left alone.

    >>> hook_args, hook_kwargs = packed_forward_pre_hook(
    ...     torch.nn.Module(), (torch.tensor([[1, 2, 3]]),), {"position_ids": torch.tensor([[0, 0, 1]])})
    >>> hook_kwargs["use_cache"]
    False
    """
    args, checked, _ = check_forward_call(module, args, kwargs)
    return args, checked


def check_forward_call(
    module: torch.nn.Module, args: tuple, kwargs: dict
) -> tuple[tuple, dict, torch.Tensor | None]:
    """:func:`packed_forward_pre_hook`, also returning the ``(B, T)`` sample starts (``None``: not packed)."""
    view = dict(kwargs)
    if args and isinstance(args[0], torch.Tensor) and "input_ids" not in view:
        view["input_ids"] = args[0]
    if preparation_of(module) is not None:
        # the packed image rows of MultimodalCollator are this model's to handle (per-sample positions and
        # masks, the wrapper's image refusals): consumed here, so that the attention does not refuse them
        view.pop(PACKED_MEDIA_KEY, None)
    checked, starts = _validate(view, getattr(module, "config", None))
    if args and "input_ids" not in kwargs:
        checked.pop("input_ids", None)
    return args, checked, starts
