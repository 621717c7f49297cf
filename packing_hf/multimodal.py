"""Image+text samples packed in one row: their images, image metadata and per-sample multimodal positions.

A vision-language sample is its token ids (image placeholders already expanded by the processor, so its
length is the true sequence length), the pixels of its images and per-image metadata. Packed in one row,
every piece must stay with its sample:

- per-image tensors (``pixel_values``, ``image_grid_thw``, ``image_sizes``, ...) are concatenated in sample
  order along their first dimension: the model consumes them in the order the image tokens appear, which
  is the order of the samples in the row;
- per-token tensors (``token_type_ids``, ``mm_token_type_ids``) are concatenated along the row ``(1, T)``;
  a sample without them (text only) gets zeros (text);
- multimodal RoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5, GLM-4V): the three (temporal, height, width)
  position rows are computed *per sample* by the model's own ``get_rope_index`` and restart at every
  sample, with a fourth, first row of plain restarting text positions that transformers reads to keep the
  samples apart (``position_ids`` of shape ``(4, 1, T)``; the 3-row ``(3, B, T)`` positions ``get_rope_index``
  returns carry no boundary, so a packed row with them needs ``cu_seq_lens_q/k``).

A model that is not prepared needs ``use_cache=False`` on packed calls (see :class:`MultimodalCollator`).

:func:`mrope_position_ids` is the pure function; :class:`MultimodalCollator` the collator over it.
``packing_hf.prepare_model_for_packing`` runs the same function inside the model when a packed row
arrives with plain ``(1, T)`` positions, so either place computes them.

>>> collator = MultimodalCollator()
>>> batch = collator([{"input_ids": [1, 2], "token_type_ids": [0, 1]}, {"input_ids": [3, 4, 5]}])
>>> batch["token_type_ids"].tolist(), batch["position_ids"].tolist()
([[0, 1, 0, 0, 0]], [[0, 1, 0, 1, 2]])
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .collator import PaddingFreeCollator
from .varlen import cu_seqlens_to_position_ids

__all__ = [
    "VisionSFTCollator",
    "IMAGE_KEYS",
    "check_media",
    "PACKED_MEDIA_KEY",
    "TOKEN_KEYS",
    "MultimodalCollator",
    "image_block_masks",
    "mm_token_types",
    "mrope_position_ids",
    "refuse_unprepared_media",
]

# one entry per image (or video) of a sample, concatenated along dim 0 in sample order
IMAGE_KEYS: tuple[str, ...] = (
    "pixel_values",
    "image_grid_thw",
    "image_sizes",
    "pixel_values_videos",
    "video_grid_thw",
    "second_per_grid_ts",
    "pixel_attention_mask",
    "image_position_ids",
)
# one entry per token of a sample, concatenated along the row
TOKEN_KEYS: tuple[str, ...] = ("token_type_ids", "mm_token_type_ids")
# Set (True) on a batch packing several samples with images or videos: only a model prepared by
# packing_hf.prepare_model_for_packing handles such a row (per-sample multimodal positions and image masks, the
# wrapper's image refusals), and its forward pre-hook consumes the key. An unprepared model passes it down to
# its attention layers, where packing_hf's attention (attn_implementation=packing_hf.ATTENTION_NAME) refuses it;
# validate_packed_batch(batch, model=model) refuses it too, and packing_hf's trainers prepare the model for train,
# evaluate and predict. A stock model under eager / sdpa ignores it: nothing of packing_hf runs in its forward
# (positions from MultimodalCollator(rope_index=...) keep such a model exact; (1, T) positions do not).
PACKED_MEDIA_KEY = "packing_hf_packed_media"


def refuse_unprepared_media(kwargs: Mapping[str, Any]) -> None:
    """Raise if an attention layer's ``kwargs`` still hold :data:`PACKED_MEDIA_KEY`, which a prepared model's
    forward pre-hook consumes: the model was not prepared, and only preparation makes packed image rows exact
    (a Qwen-VL model otherwise places the image tokens by text positions) or refuses the wrappers whose image
    rows are not.

    >>> refuse_unprepared_media({"position_ids": None})
    """
    if kwargs.get(PACKED_MEDIA_KEY):
        raise ValueError(
            "a packed row holding images (packing_hf.MultimodalCollator, several samples) reached a model that "
            "packing_hf.prepare_model_for_packing has not prepared: only a prepared model keeps their multimodal "
            "positions and image masks per sample (and refuses wrappers whose image rows it has not verified). "
            "Call packing_hf.prepare_model_for_packing(model) before the forward (packing_hf.Trainer does), or "
            "collate one sample per row"
        )


# (pixels, their grid, what they are): flattened patches of the Qwen-VL / GLM-4V layout come with a grid each
_MEDIA = (("pixel_values", "image_grid_thw", "image"), ("pixel_values_videos", "video_grid_thw", "video"))


def _dtype_and_shape(value: Any) -> tuple[Any, tuple[int, ...]]:
    if isinstance(value, torch.Tensor):
        return value.dtype, tuple(value.shape)
    array = np.asarray(value)
    return array.dtype, array.shape


def _is_float(dtype: Any) -> bool:
    return dtype.is_floating_point if isinstance(dtype, torch.dtype) else np.dtype(dtype).kind == "f"


def check_media(media: Mapping[str, Any], where: str, *, needs_grid: bool = False) -> None:
    """Refuse pixels a vision tower would misread or fail on far from the cause, naming the problem and the fix.

    - ``pixel_values`` / ``pixel_values_videos`` that are not floating point (raw ``uint8`` / ``int64`` pixels):
      the vision tower casts them to its dtype and embeds 0..255 integers as if they were the processor's
      normalised values, with no error;
    - flattened patches ``(N, D)`` next to their grid whose ``N`` is not the ``t * h * w`` patches the grid rows
      ask for (a truncated or mismatched image): the vision tower fails with a bare size mismatch;
    - ``needs_grid``: pixels without their grid (``image_grid_thw`` / ``video_grid_thw``), which a multimodal-RoPE
      model (Qwen-VL family, GLM-4V) needs to place and embed the patches.

    Args:
        media: a sample, a batch or a model call's keyword arguments.
        where: how the error names what it checked (``"sample 3"``, ``"qwen2_vl: the packed row"``).
        needs_grid: refuse pixels that come without their grid.

    >>> check_media({"pixel_values": torch.zeros(4, 6), "image_grid_thw": torch.tensor([[1, 2, 2]])}, "sample 0")
    >>> check_media({"pixel_values": torch.zeros(4, 6, dtype=torch.int64)}, "sample 0")
    Traceback (most recent call last):
    ...
    ValueError: sample 0: pixel_values are torch.int64, but a vision tower takes floating-point pixels normalised by the model's image processor (integer pixels would be cast and embedded as if normalised, silently wrong); pass the processor's pixel_values, or run the image processor on the raw pixels
    """
    for pixels_key, grid_key, kind in _MEDIA:
        pixels = media.get(pixels_key)
        if pixels is None:
            continue
        dtype, shape = _dtype_and_shape(pixels)
        if not _is_float(dtype):
            raise ValueError(
                f"{where}: {pixels_key} are {dtype}, but a vision tower takes floating-point pixels normalised by "
                "the model's image processor (integer pixels would be cast and embedded as if normalised, silently "
                f"wrong); pass the processor's {pixels_key}, or run the image processor on the raw pixels"
            )
        grid = media.get(grid_key)
        if grid is None:
            if needs_grid and shape and shape[0] > 0:
                raise ValueError(
                    f"{where}: {pixels_key} of shape {shape} come without {grid_key}, which this model needs to "
                    f"place and embed each {kind}'s patches (its multimodal positions and vision tower read it); "
                    f"keep the processor's {grid_key} with the sample (MultimodalCollator passes it on)"
                )
            continue
        grid_rows = torch.as_tensor(np.asarray(grid) if not isinstance(grid, torch.Tensor) else grid)
        patches = int(grid_rows.reshape(-1, 3).prod(-1).sum()) if grid_rows.numel() else 0
        if len(shape) == 2 and shape[0] != patches:
            raise ValueError(
                f"{where}: {pixels_key} has {shape[0]} patch rows but its {grid_key} asks for {patches} (t * h * w "
                f"summed over its {grid_rows.reshape(-1, 3).shape[0]} rows): a truncated {kind}, or one "
                f"paired with another's grid. Keep each {kind}'s {pixels_key} rows and {grid_key} row together, as "
                "the model's processor returns them"
            )


def mm_token_types(
    input_ids: torch.Tensor, image_token_id: int | None, video_token_id: int | None = None
) -> torch.Tensor:
    """``mm_token_type_ids`` from the placeholder ids: 0 text, 1 image, 2 video; same shape as ``input_ids``.

    >>> mm_token_types(torch.tensor([[5, 9, 9, 5]]), image_token_id=9).tolist()
    [[0, 1, 1, 0]]
    """
    types = torch.zeros_like(input_ids, dtype=torch.int32)
    if image_token_id is not None:
        types[input_ids == image_token_id] = 1
    if video_token_id is not None:
        types[input_ids == video_token_id] = 2
    return types


def mrope_position_ids(
    rope_index: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    input_ids: torch.Tensor,
    cu_seqlens: Sequence[int],
    mm_token_type_ids: torch.Tensor,
    **grids: torch.Tensor | None,
) -> torch.Tensor:
    """The ``(4, 1, T)`` multimodal positions of a packed row, each sample's computed alone.

    Row 0 is the text position restarting at every sample (what transformers' mask creation reads to keep
    samples apart); rows 1-3 are the (temporal, height, width) positions that ``rope_index`` gives the sample
    run on its own. All samples go through one ``rope_index`` call as a right-padded batch with an
    ``attention_mask``, which consumes the image grids in sample order.

    Args:
        rope_index: the model's ``get_rope_index`` (e.g. ``model.model.get_rope_index``): takes
            ``input_ids``, ``mm_token_type_ids``, ``attention_mask`` and the grid keywords, returns
            ``(positions (3, B, L), deltas)``.
        input_ids: ``(1, T)`` int64, image/video placeholders expanded.
        cu_seqlens: ``n + 1`` sample offsets into the row (host ints or a tensor).
        mm_token_type_ids: ``(1, T)`` int: 0 text, 1 image, 2 video (:func:`mm_token_types` builds it).
        **grids: ``image_grid_thw`` ``(n_images, 3)``, ``video_grid_thw``, ``second_per_grid_ts``: the
            whole row's, in sample order; keywords ``rope_index`` does not take are left out.

    Returns:
        ``(4, 1, T)`` int64.

    Raises:
        ValueError: a sample's image (video) placeholders are not the number its ``image_grid_thw``
            (``video_grid_thw``) rows ask for, checked before ``rope_index`` runs, as transformers' "Image
            features and image tokens do not match" (needs the model's ``vision_config.spatial_merge_size``).

    >>> def rope_index(input_ids, mm_token_type_ids, attention_mask=None, **_):  # a text-only stand-in
    ...     pos = attention_mask.long().cumsum(-1) - 1
    ...     return (pos + 10).expand(3, -1, -1), None
    >>> mrope_position_ids(rope_index, torch.tensor([[7, 8, 9]]), [0, 2, 3], torch.zeros(1, 3)).tolist()
    [[[0, 1, 0]], [[10, 11, 10]], [[10, 11, 10]], [[10, 11, 10]]]
    """
    cu = [int(c) for c in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
    total = int(input_ids.shape[-1])
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or not cu or cu[0] != 0 or cu[-1] != total:
        raise ValueError(
            f"mrope_position_ids needs one packed row (1, T) and offsets from 0 to T; got input_ids of shape "
            f"{tuple(input_ids.shape)} and cu_seqlens {cu[:3]}...{cu[-1:]}"
        )
    _check_placeholders(rope_index, cu, mm_token_type_ids, grids)
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:], strict=False)]
    longest = max(lengths)
    device = input_ids.device
    # (n, L) right-padded copies of the samples: column j of row i is token cu[i] + j of the packed row
    columns = torch.arange(longest, device=device)
    starts = torch.tensor(cu[:-1], device=device)
    valid = columns[None, :] < torch.tensor(lengths, device=device)[:, None]  # (n, L)
    index = (starts[:, None] + columns[None, :]).clamp(max=total - 1)  # (n, L)
    ids = torch.where(valid, input_ids[0][index], 0)
    types = torch.where(valid, mm_token_type_ids.reshape(1, -1)[0].to(device)[index], 0)
    params = inspect.signature(rope_index).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    extra = {k: v for k, v in grids.items() if v is not None and (k in params or takes_any)}
    positions, _ = rope_index(
        input_ids=ids, mm_token_type_ids=types, attention_mask=valid.long(), **extra
    )  # (3, n, L)
    out = torch.empty(4, 1, total, dtype=torch.long, device=device)
    out[0, 0] = cu_seqlens_to_position_ids(cu).to(device)
    out[1:, 0] = positions[:, valid].to(device=device, dtype=torch.long)
    return out


def _spatial_merge_size(rope_index: Callable[..., Any]) -> int | None:
    """``vision_config.spatial_merge_size`` of the model whose bound ``get_rope_index`` this is, else ``None``."""
    config = getattr(getattr(rope_index, "__self__", None), "config", None)
    merge = getattr(getattr(config, "vision_config", None), "spatial_merge_size", None)
    return merge if isinstance(merge, int) and merge > 0 else None


def _check_placeholders(
    rope_index: Callable[..., Any], cu: list[int], mm_token_type_ids: torch.Tensor, grids: dict[str, Any]
) -> None:
    """Refuse a sample whose image / video placeholders are not what its grid rows ask for.

    Every image (video) of the row takes ``t * h * w / spatial_merge_size**2`` placeholders; the grid rows are
    consumed in sample order, as the model consumes them. Without this check ``rope_index`` or the position
    assignment fails with a bare shape mismatch, far from the cause.
    """
    merge = _spatial_merge_size(rope_index)
    if merge is None:
        return
    types = mm_token_type_ids.reshape(-1)
    for kind, code, key in (("image", 1, "image_grid_thw"), ("video", 2, "video_grid_thw")):
        grid = grids.get(key)
        needed = [] if grid is None else (torch.as_tensor(grid).reshape(-1, 3).prod(-1) // merge**2).tolist()
        taken = 0
        for i, (a, b) in enumerate(zip(cu[:-1], cu[1:], strict=False)):
            tokens, asked, first = int((types[a:b] == code).sum()), 0, taken
            while asked < tokens and taken < len(needed):
                asked += needed[taken]
                taken += 1
            if asked != tokens:
                rows = {0: "no row left", 1: f"row {first}"}.get(
                    taken - first, f"rows {first} to {taken - 1}"
                )
                raise ValueError(
                    f"{kind.capitalize()} features and {kind} tokens do not match: sample {i} of the packed row has "
                    f"{tokens} {kind} placeholder tokens, but its {key} ({rows}) asks for {asked} (t * h * w / "
                    f"spatial_merge_size**2 per {kind}, spatial_merge_size={merge}). Expand every {kind}'s "
                    f"placeholder to that many tokens (the model's processor does) and keep each sample's {key} "
                    f"with it"
                )
        if taken != len(needed):
            raise ValueError(
                f"{kind.capitalize()} features and {kind} tokens do not match: {key} has {len(needed)} rows but the "
                f"placeholders of the packed row use only {taken}; every {kind} needs its placeholder tokens in "
                "its sample's input_ids"
            )


def image_block_masks(
    cu_seqlens: Sequence[int],
    token_type_ids: torch.Tensor,
    *,
    sliding_window: int | None = None,
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """Per-sample attention masks of a packed row whose image tokens attend bidirectionally within their image.

    Gemma 3 lets the tokens of one image see each other both ways (a block), text stays causal. Each block is
    taken within its sample (a block never continues across a sample boundary), and every pair across
    samples is masked. Built here because transformers' sliding-window mask looks the blocks up by the
    per-sample positions of a packed row, which points them at other tokens.

    Args:
        cu_seqlens: ``n + 1`` sample offsets into the row.
        token_type_ids: ``(1, T)``: 1 for image tokens, 0 for text.
        sliding_window: the window of the sliding layers (``None``: no ``"sliding_attention"`` entry).
        dtype: ``None`` for boolean masks (True = attend, for sdpa); a float dtype for additive masks (eager).

    Returns:
        ``{"full_attention": (1, 1, T, T), "sliding_attention": (1, 1, T, T)}``.

    >>> masks = image_block_masks([0, 3, 5], torch.tensor([[0, 1, 1, 1, 0]]))
    >>> masks["full_attention"][0, 0].int().tolist()
    [[1, 0, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]]
    """
    cu = [int(c) for c in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
    total = cu[-1]
    device = token_type_ids.device
    lengths = torch.tensor([b - a for a, b in zip(cu[:-1], cu[1:], strict=False)], device=device)
    sample = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)  # (T,)
    first = torch.zeros(total, dtype=torch.bool, device=device)
    first[torch.tensor(cu[:-1], device=device)] = True
    image = token_type_ids.reshape(-1)[:total] == 1
    previous_image = torch.cat([torch.zeros(1, dtype=torch.bool, device=device), image[:-1]])
    block = torch.cumsum(image & (first | ~previous_image), 0)  # a new block at every image run start
    block = torch.where(image, block, -1)  # (T,)
    index = torch.arange(total, device=device)
    same = sample[:, None] == sample[None, :]
    keep = same & (
        (index[:, None] >= index[None, :]) | ((block[:, None] == block[None, :]) & (block[:, None] >= 0))
    )
    masks = {"full_attention": keep}
    if sliding_window is not None:
        masks["sliding_attention"] = keep & (index[None, :] > index[:, None] - sliding_window)
    out = {}
    for name, mask in masks.items():
        mask = mask[None, None]  # (1, 1, T, T)
        if dtype is not None:
            mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(
                ~mask, torch.finfo(dtype).min
            )
        out[name] = mask
    return out


def _flat_tokens(value: Any) -> Any:
    """A per-token value as 1-D: processors often keep a batch dimension of one."""
    array = value if isinstance(value, torch.Tensor) else np.asarray(value)
    return array.reshape(-1) if array.ndim == 2 and array.shape[0] == 1 else array


class MultimodalCollator:
    """Collate image+text samples into one packed row ``[1, T]``, every image and position kept per sample.

    Thin over :class:`packing_hf.PaddingFreeCollator` (token ids, labels, boundaries) and
    :func:`mrope_position_ids` (multimodal RoPE). Each sample is a dict with ``input_ids`` (placeholders
    already expanded by the processor), optionally ``labels`` / TRL loss masks, and any of
    :data:`IMAGE_KEYS` (per image, concatenated along dim 0) and :data:`TOKEN_KEYS` (per token,
    concatenated into ``(1, T)``; zeros for a sample that lacks them). Sample values may carry a leading
    batch dimension of one (what a processor returns for one sample).

    Args:
        rope_index: the model's ``get_rope_index`` (Qwen-VL family): when given, ``position_ids`` are the
            ``(4, 1, T)`` multimodal positions computed per sample; otherwise ``(1, T)`` restarting positions
            (a prepared model computes the multimodal ones itself, per sample).
        image_token_id, video_token_id: placeholder ids, to build ``mm_token_type_ids`` for ``rope_index``
            when the samples do not carry them.
        max_length: longest sample accepted; a longer one raises (truncating would cut an image block).
        **kwargs: passed to :class:`packing_hf.PaddingFreeCollator` (``label_pad_id``, ``drop_keys``,
            ``return_seq_idx``, more ``passthrough_keys``); ``overflow`` other than ``"error"`` and
            ``pad_to_multiple_of`` are refused: they would cut image blocks or pad the per-token keys.

    Returns (``__call__``): the padding-free batch (``input_ids``, ``labels``, ``position_ids``,
    ``cu_seq_lens_q/k``, ``max_length_q/k``) plus the image keys and per-token keys present, and
    :data:`PACKED_MEDIA_KEY` when several samples with images share the row: such a batch is for a model prepared
    by :func:`packing_hf.prepare_model_for_packing` (``packing_hf.Trainer`` prepares it); packing_hf's attention
    and :func:`packing_hf.validate_packed_batch` (given the model) refuse it in an unprepared model. A stock model
    under eager / sdpa runs no packing_hf code to refuse it: without ``rope_index`` its image tokens get text
    positions (wrong logits, no error), so give a model you do not prepare ``rope_index``, and call it with
    ``use_cache=False``: a wrapper's text config keeps ``use_cache=True``, and with a cache transformers builds
    the mask without looking for packed samples, so they see each other (a stock ``transformers.Trainer`` turns
    the cache off on the wrapper's config only). A prepared model turns it off on packed calls itself.

    Raises (``__call__``): ``ValueError`` for a sample announcing images without their pixels, pixels that are
    not floating point, flattened patches whose count is not what their grid asks for, or pixels without their
    grid where the model needs one (:func:`check_media`).

    >>> collator = MultimodalCollator()
    >>> batch = collator([{"input_ids": [5, 9, 9], "pixel_values": torch.ones(2, 4)},
    ...                   {"input_ids": [6, 9], "pixel_values": torch.zeros(1, 4)}])
    >>> batch["pixel_values"].shape, batch["cu_seq_lens_q"].tolist()
    (torch.Size([3, 4]), [0, 3, 5])
    """

    def __init__(
        self,
        rope_index: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
        *,
        image_token_id: int | None = None,
        video_token_id: int | None = None,
        max_length: int | None = None,
        **kwargs: Any,
    ) -> None:
        padding = [k for k in ("pad_to_multiple_of", "length_buckets", "segment_buckets") if kwargs.get(k)]
        if kwargs.get("overflow", "error") != "error" or padding:
            raise ValueError(
                "MultimodalCollator keeps every sample whole: overflow must be 'error' (truncating or splitting "
                "would cut an image block away from its pixels) and pad_to_multiple_of, length_buckets and "
                f"segment_buckets are not supported (got {', '.join(padding) or 'none of them'})"
            )
        if kwargs.get("return_tensors", "pt") != "pt":
            raise ValueError("MultimodalCollator returns torch tensors only (return_tensors='pt')")
        extra = tuple(kwargs.pop("passthrough_keys", ()))
        self.rope_index = rope_index
        self.image_token_id = image_token_id
        self.video_token_id = video_token_id
        self.passthrough_keys = tuple(dict.fromkeys((*IMAGE_KEYS, *extra)))
        self._base = PaddingFreeCollator(
            max_length=max_length, passthrough_keys=self.passthrough_keys + TOKEN_KEYS, **kwargs
        )

    @property
    def input_columns(self) -> tuple[str, ...]:
        """Dataset columns this collator consumes: a ``Trainer`` must not strip them (``remove_unused_columns``).

        >>> "pixel_values" in MultimodalCollator().input_columns
        True
        """
        return (*self._base.input_columns, *self.passthrough_keys, *TOKEN_KEYS)

    @property
    def stats(self) -> dict[str, int]:
        """The token and sample counts of the underlying :class:`~packing_hf.PaddingFreeCollator`."""
        return self._base.stats

    def __call__(self, features: list[Mapping[str, Any]]) -> dict[str, Any]:
        features = [self._normalize(f) for f in features]
        # a multimodal-RoPE model (its get_rope_index given, or other samples with grids) reads every image's grid:
        # pixels without theirs would fail there, or take another sample's
        needs_grid = _spatial_merge_size(self.rope_index) is not None or any(
            f.get(g) is not None for f in features for g in ("image_grid_thw", "video_grid_thw")
        )
        for i, feature in enumerate(features):
            self._check_pixels(i, feature)
            check_media(feature, f"sample {i}", needs_grid=needs_grid)
        token_keys = [k for k in TOKEN_KEYS if any(k in f for f in features)]
        for key in token_keys:  # a text-only sample next to image samples: every token is text (0)
            features = [
                f if key in f else {**f, key: np.zeros(len(f["input_ids"]), dtype=np.int64)} for f in features
            ]
        batch = self._base(features)
        for key in token_keys:
            batch[key] = batch[key].reshape(1, -1)
        media = any(len(batch[k]) for k in ("pixel_values", "pixel_values_videos") if k in batch)
        if media and len(features) > 1:
            batch[PACKED_MEDIA_KEY] = True
        if self.rope_index is not None:
            types = batch.get("mm_token_type_ids")
            if types is None:
                types = mm_token_types(batch["input_ids"], self.image_token_id, self.video_token_id)
            batch["position_ids"] = mrope_position_ids(
                self.rope_index,
                batch["input_ids"],
                batch["cu_seq_lens_q"],
                types,
                image_grid_thw=batch.get("image_grid_thw"),
                video_grid_thw=batch.get("video_grid_thw"),
                second_per_grid_ts=batch.get("second_per_grid_ts"),
            )
        return batch

    def _check_pixels(self, index: int, feature: Mapping[str, Any]) -> None:
        """Refuse a sample announcing images (videos) without their pixels: the model would embed the placeholders
        as plain text tokens, or take the pixels of another sample, with no error."""
        ids = np.asarray(feature.get("input_ids", ()))
        types = feature.get("mm_token_type_ids")
        types = None if types is None else np.asarray(types).reshape(-1)
        for kind, pixels, grid, token, code in (
            ("image", "pixel_values", "image_grid_thw", self.image_token_id, 1),
            ("video", "pixel_values_videos", "video_grid_thw", self.video_token_id, 2),
        ):
            if feature.get(pixels) is not None:
                continue
            grid_rows = 0 if feature.get(grid) is None else np.asarray(feature[grid]).reshape(-1, 3).shape[0]
            if grid_rows:
                found = f"{grid} ({grid_rows} {kind}s) but no {pixels}"
            elif token is not None and bool((ids == token).any()):
                found = f"{int((ids == token).sum())} {kind} placeholder tokens (id {token}) but no {pixels}"
            elif types is not None and bool((types == code).any()):
                found = f"{int((types == code).sum())} {kind} tokens in mm_token_type_ids but no {pixels}"
            else:
                continue
            raise ValueError(
                f"sample {index} has {found}: the model would read its placeholders as text tokens (or take the "
                f"pixels of another sample). Keep the processor's {pixels} with the sample, or drop its {kind} "
                "placeholders and grid"
            )

    @staticmethod
    def _normalize(feature: Mapping[str, Any]) -> dict[str, Any]:
        """Drop a processor's leading batch dimension of one from per-token fields."""
        out = dict(feature)
        for key in ("input_ids", "labels", "attention_mask", *TOKEN_KEYS):
            if key in out:
                out[key] = _flat_tokens(out[key])
        return out


class VisionSFTCollator(MultimodalCollator):
    """TRL's vision-language SFT collation, one sample at a time, packed into one row by
    :class:`~packing_hf.MultimodalCollator`.

    TRL processes ``messages`` + ``images`` (or ``prompt`` / ``completion``, ``text``) samples at batch time:
    its ``DataCollatorForVisionLanguageModeling`` applies the chat template, expands the image placeholders,
    computes the pixels and the labels (assistant-only masks included) for a right-padded batch. Here it gets
    every sample alone (a batch of one: nothing padded, the same ids, labels and pixels the sample has in
    TRL's padded batch), and the samples are then packed with their images and image metadata.

    Args:
        processor_collator: TRL's ``DataCollatorForVisionLanguageModeling`` (what ``trl.SFTTrainer`` builds
            for a vision dataset).
        **kwargs: passed to :class:`~packing_hf.MultimodalCollator`.

    >>> class Stand_in:  # a processor collator: one sample in, a batch of one out
    ...     def __call__(self, examples):
    ...         ids = torch.tensor([examples[0]["ids"]])
    ...         return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    >>> batch = VisionSFTCollator(Stand_in())([{"ids": [5, 6]}, {"ids": [7]}])
    >>> batch["input_ids"].tolist(), batch["cu_seq_lens_q"].tolist()
    ([[5, 6, 7]], [0, 2, 3])
    """

    def __init__(self, processor_collator: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.processor_collator = processor_collator

    def process(self, example: Any) -> dict[str, Any]:
        """One sample as TRL's collator makes it: ``input_ids`` / ``labels`` ``(1, L)``, pixels and metadata."""
        out = dict(self.processor_collator([dict(example)]))  # a copy: TRL's collator rewrites the example
        out.pop("attention_mask", None)  # a batch of one: all ones
        return out

    def __call__(self, features: list[Any]) -> dict[str, Any]:
        return super().__call__([self.process(f) for f in features])
