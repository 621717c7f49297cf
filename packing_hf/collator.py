"""PaddingFreeCollator: flatten a batch of samples into one packed row ``[1, T]`` with exact boundaries.

The model sees every sample of the batch back to back in a single row, with no padding, and the
boundaries travel with the batch (restarting ``position_ids``, ``cu_seq_lens_q/k``, ``max_length_q/k``
and optionally ``seq_idx``), so a varlen-aware attention never lets one sample attend to another.

It is a drop-in, vectorized replacement for ``transformers.DataCollatorWithFlattening(
return_flash_attn_kwargs=True)`` and TRL's ``DataCollatorForLanguageModeling(padding_free=True)``: on
the keys they share the output is identical, and it adds TRL's loss masks, offline-packed rows
(``seq_lengths``), an explicit policy for over-long samples and padding that keeps its own segment.

>>> collator = PaddingFreeCollator()
>>> batch = collator([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])
>>> batch["input_ids"].tolist(), batch["labels"].tolist(), batch["position_ids"].tolist()
([[1, 2, 3, 4, 5]], [[-100, 2, 3, -100, 5]], [[0, 1, 2, 0, 1]])
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from ._limits import check_int
from ._loss import LOSS_WEIGHTS_KEY, check_loss_weights
from ._rows import flatten_field, locate, offsets_in_segments, sample_to_array, split_lengths
from .overflow import check_overflow
from .varlen import PADDING_KEY, check_int32_tokens

__all__ = ["MAX_LENGTH_BUCKETS", "PaddingFreeCollator", "length_buckets", "segment_buckets"]

#: most row lengths ``length_buckets=`` accepts: every one is a shape a compiled graph may specialize on
MAX_LENGTH_BUCKETS = 8


def length_buckets(max_tokens: int, count: int = MAX_LENGTH_BUCKETS, multiple: int = 64) -> tuple[int, ...]:
    """``count`` evenly spaced row lengths up to ``max_tokens`` (rounded up to ``multiple``), the last one it.

    Multipack rows are nearly full, so most land in the last bucket and the padding stays small; the
    smaller buckets catch the last, partly filled batches and split ones.

    >>> length_buckets(4096)
    (512, 1024, 1536, 2048, 2560, 3072, 3584, 4096)
    >>> length_buckets(1000, count=3)
    (384, 704, 1000)
    """
    _check_bucket_count(max_tokens, count)
    check_int(multiple, "multiple", minimum=1)
    sizes = {
        min(max_tokens, -(-(max_tokens * k // count) // multiple) * multiple) for k in range(1, count + 1)
    }
    return tuple(sorted(sizes))


def segment_buckets(max_tokens: int, count: int = MAX_LENGTH_BUCKETS) -> tuple[int, ...]:
    """``count`` segment counts halving down from ``max_tokens`` (a row of ``max_tokens`` tokens never holds
    more samples than that, so the last bucket always fits).

    For ``PaddingFreeCollator(segment_buckets=...)``: ``cu_seq_lens`` is padded with empty segments up to the
    smallest count that holds the batch's samples, so a compiled model sees at most ``count`` boundary shapes.
    An empty segment costs no token, and no attention work in the varlen kernels or the per-segment SDPA (packing_hf's
    padded layout, used under ``torch.compile`` without a varlen kernel, computes a row of ``max_length`` slots
    for it).

    >>> segment_buckets(4096)
    (32, 64, 128, 256, 512, 1024, 2048, 4096)
    >>> segment_buckets(100, count=3)
    (25, 50, 100)
    """
    _check_bucket_count(max_tokens, count)
    return tuple(sorted({max(1, max_tokens >> k) for k in range(count)}))


def _check_bucket_count(max_tokens: int, count: int) -> None:
    check_int(max_tokens, "max_tokens", minimum=1, int32=True)
    check_int(count, "count", minimum=1)
    if count > MAX_LENGTH_BUCKETS:
        raise ValueError(f"count={count}: at most {MAX_LENGTH_BUCKETS} buckets (each is a compiled shape)")


def _check_buckets(value: Any, name: str, what: str) -> tuple[int, ...]:
    """``length_buckets`` / ``segment_buckets`` as a sorted tuple of 1 to ``MAX_LENGTH_BUCKETS`` ints >= 1."""
    buckets = tuple(value) if not isinstance(value, str | int) else ()
    for bucket in buckets:
        check_int(bucket, f"{name}[...]", minimum=1, int32=True)
    if not 1 <= len(set(buckets)) <= MAX_LENGTH_BUCKETS:
        raise ValueError(
            f"{name}={value!r}: give 1 to {MAX_LENGTH_BUCKETS} {what}, e.g. "
            f"packing_hf.collator.{name}(max_tokens_per_batch)"
        )
    return tuple(sorted(set(buckets)))


logger = logging.getLogger(__name__)

# "drop" is not offered: a collator cannot leave out a sample the sampler already counted in the batch
_OVERFLOWS = ("error", "truncate", "split")
# TRL's loss-mask columns: 1 = train on this token. Both present -> a token is trained only if both say so.
_MASK_KEYS = ("completion_mask", "assistant_masks")
_OPTIONAL_KEYS = frozenset(("labels", *_MASK_KEYS, "seq_lengths", LOSS_WEIGHTS_KEY))
# read by the collator, or dropped by design (attention_mask would merge samples, position_ids are rebuilt)
_KNOWN_KEYS = ("input_ids", *_OPTIONAL_KEYS, "attention_mask", "position_ids")
_KNOWN_KEYS_SET = frozenset(_KNOWN_KEYS)


def _concatenate(values: list[Any], key: str, return_tensors: str) -> Any:
    """Pass-through values of one key: arrays concatenated along dim 0, scalars stacked."""
    try:
        tensors = [torch.as_tensor(np.asarray(v) if not isinstance(v, torch.Tensor) else v) for v in values]
        out = torch.cat(tensors) if tensors[0].dim() else torch.stack(tensors)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(
            f"passthrough key {key!r}: cannot concatenate the samples' values along the first dimension ({exc})"
        ) from None
    return out if return_tensors == "pt" else out.numpy()


def _new_stats() -> dict[str, int]:
    return {
        "batches": 0,
        "samples": 0,  # samples seen (the sub-samples of offline-packed rows count one by one)
        "tokens": 0,  # real tokens emitted (after truncation, before padding)
        "padding_tokens": 0,
        "empty_segments": 0,  # segment_buckets: zero-length segments closing cu_seq_lens
        "truncated_samples": 0,
        "truncated_tokens": 0,  # tokens dropped by overflow="truncate"
        "split_samples": 0,
        "split_chunks": 0,  # segments those samples became under overflow="split"
    }


def _raise_for_bad_feature(features: list[Any]) -> None:
    """Name the first feature that is not a dict holding ``input_ids`` (error path only)."""
    for i, feature in enumerate(features):
        if not isinstance(feature, Mapping):
            raise TypeError(f"sample {i} is a {type(feature).__name__}, expected a dict of fields")
        if "input_ids" not in feature:
            raise ValueError(
                f"sample {i} has no 'input_ids' (keys: {sorted(feature)}); tokenize the dataset first"
            )


def _keys_present(features: list[Mapping[str, Any]]) -> frozenset[str]:
    """The optional keys this collator reads that at least one feature has."""
    return _OPTIONAL_KEYS.intersection(set().union(*features))  # one C-level pass over all keys


def _flat_input_ids(raw_ids: list[Any]) -> tuple[np.ndarray, np.ndarray]:
    """The samples' ``input_ids`` as one flat ``(T,)`` int64 array and their lengths ``(n,)``; every sample
    non-empty, every id ``>= 0``."""
    if any(type(v[0]) is bool for v in raw_ids if isinstance(v, list) and v):
        bad = next(i for i, v in enumerate(raw_ids) if isinstance(v, list) and v and type(v[0]) is bool)
        raise TypeError(f"sample {bad}: 'input_ids' holds bools; token ids must be ints")
    ids, lengths = flatten_field(raw_ids, "input_ids")
    if (lengths == 0).any():
        bad = int(np.argmax(lengths == 0))
        raise ValueError(f"sample {bad}: 'input_ids' is empty; drop empty samples from the dataset")
    if ids.min() < 0:
        pos = int(np.argmax(ids < 0))
        i, offset = locate(pos, lengths)
        raise ValueError(
            f"sample {i}: input_ids[{offset}] = {int(ids[pos])} is negative; token ids must be "
            ">= 0 (padding or -100 belong in labels, not input_ids)"
        )
    return ids, lengths


def _cu_seqlens(seg_lengths: np.ndarray) -> np.ndarray:
    """``(n + 1,)`` int64 offsets of the segments, checked to fit int32."""
    # Boundaries in numpy: the same formulas as varlen.lengths_to_cu_seqlens / lengths_to_position_ids /
    # lengths_to_seq_idx (the tests check they agree), because in a data loader's main process torch's
    # per-call overhead and intra-op threads make these small ops cost more than the whole collation.
    cu = np.zeros(seg_lengths.size + 1, dtype=np.int64)  # (n + 1,)
    np.cumsum(seg_lengths, out=cu[1:])
    check_int32_tokens(int(cu[-1]), "the batch")
    return cu


@dataclass
class PaddingFreeCollator:
    """Collate samples into one packed row ``[1, T]`` with restarting positions and varlen boundaries.

    Every sample becomes its own segment: ``position_ids`` restart at ``position_ids_start``, its first
    label is ``label_pad_id`` (so no sample is trained to predict across a boundary), and
    ``cu_seq_lens_q/k`` mark where it starts and ends. No ``attention_mask`` is returned: with one,
    transformers would ignore ``position_ids`` and let samples attend to each other.

    Input: a list of feature dicts (``datasets`` rows work as they are). Keys read
    (:attr:`input_columns`):

    - ``input_ids`` (required): list, numpy array or tensor of ints ``>= 0``, ``(L_i,)``.
    - ``labels`` (optional): same length; default is a copy of ``input_ids``.
    - ``completion_mask`` / ``assistant_masks`` (optional, TRL): 1 = train on this token, 0 = set its
      label to ``label_pad_id``; when both are present a token is trained only if both are 1. Unlike
      TRL, ``completion_mask`` is always applied when present.
    - ``seq_lengths`` (optional): the row was already packed offline (e.g. TRL's ``bfd`` packing) and
      holds several samples of these lengths; each becomes its own segment.
    - ``loss_weights`` (optional): one float ``>= 0`` per token, the weight of that token as a target
      (see ``docs/loss.md``); every sample of the batch has it or none. A wrong length, a negative or NaN
      value raises a ``ValueError`` naming the sample and position.

    ``attention_mask`` is dropped and ``position_ids`` is recomputed from the boundaries (a tokenizer's
    ``position_ids`` would run across samples). Any other key raises a ``ValueError`` naming it, rather than
    being lost without a word (``pixel_values`` of a multimodal dataset, say): list it in
    ``passthrough_keys`` to hand it to the model, or in ``drop_keys`` to drop it knowingly.

    With ``sdpa``/``eager`` attention, transformers finds the boundaries from ``position_ids`` only when
    no KV cache exists: call the model with ``use_cache=False`` (``Trainer`` sets
    ``model.config.use_cache = args.use_cache``, False by default), else samples attend to each other.

    Output (``return_tensors="pt"``; ``"np"`` gives numpy arrays of the same dtypes), with
    ``T`` = total tokens including padding and ``n`` = number of segments:

    - ``input_ids``: ``[1, T]`` int64; ``labels``: ``[1, T]`` int64;
    - ``position_ids``: ``[1, T]`` int64 (if ``return_position_ids``);
    - ``cu_seq_lens_q``, ``cu_seq_lens_k``: ``(n + 1,)`` int32 and ``max_length_q``, ``max_length_k``:
      Python ints (if ``return_flash_attn_kwargs``);
    - ``seq_idx``: ``[1, T]`` int32, the segment index of every token (if ``return_seq_idx``);
    - ``loss_weights``: ``[1, T]`` float32 (if the samples carry it; 0 on padding).

    Args:
        max_length: longest sample accepted, in tokens (``None``: no limit). It bounds each *sample*,
            not the batch: batch size in tokens is the sampler's job.
        overflow: what to do with a sample longer than ``max_length``: ``"error"`` (default) raises,
            ``"truncate"`` keeps its first ``max_length`` tokens, ``"split"`` cuts it into chunks of
            ``max_length`` that become separate segments (each chunk's first label is masked, since it
            cannot see the previous chunk). Truncated/split samples and tokens are counted in
            :attr:`stats` and the first occurrence is logged as a warning.
        pad_to_multiple_of: pad ``T`` up to a multiple of this. The padding forms its own segment
            (own ``cu_seqlens`` entry, positions restarting, labels ``label_pad_id``, ids
            ``pad_token_id``), so it never merges into a real sample. With this or ``length_buckets`` every
            batch also carries :data:`packing_hf.varlen.PADDING_KEY`: the padding's token count, a 0-d int64
            tensor, which a model prepared by :func:`packing_hf.prepare_model_for_packing` consumes to keep the
            padding out of a router's load-balancing loss (MoE models; an unprepared one asking for that loss
            is refused by packing_hf's attention and :func:`packing_hf.validate_packed_batch`).
        length_buckets: round ``T`` up to the smallest of these row lengths (at most
            :data:`MAX_LENGTH_BUCKETS`; see :func:`length_buckets`), so a compiled model sees few shapes. The
            padding is its own segment, as with ``pad_to_multiple_of`` (which it replaces); a batch longer
            than the largest bucket raises a ``ValueError`` (make the largest ``max_tokens_per_batch``).
        segment_buckets: pad ``cu_seq_lens_q/k`` with empty segments at the end (repeats of ``T``) up to the
            smallest of these segment counts (at most :data:`MAX_LENGTH_BUCKETS`; see :func:`segment_buckets`),
            so that, with ``length_buckets``, a compiled model sees few boundary shapes too (with both,
            ``max_length_q/k`` is rounded up to a length bucket as well: an int a graph specializes on). An
            empty segment holds no token: attention, positions, labels and the loss are those of the unpadded
            batch (``flash_attn_varlen_func``'s contract; :func:`packing_hf.varlen_attention` skips them).
            Counted in ``stats["empty_segments"]``.
        pad_token_id: input id of padding tokens.
        label_pad_id: label of untrained tokens (first token of a segment, masked tokens, padding).
        position_ids_start: first position of every segment (2 for RoBERTa-like models).
        return_seq_idx: also return ``seq_idx``.
        return_flash_attn_kwargs: also return ``cu_seq_lens_q/k`` and ``max_length_q/k``.
        return_position_ids: also return ``position_ids``.
        return_tensors: ``"pt"`` or ``"np"``.
        passthrough_keys: extra keys the model consumes: the values of the samples that have the key are
            concatenated along their first dimension (e.g. ``pixel_values`` ``(n_images, C, H, W)`` per sample
            -> ``(total_images, C, H, W)``; scalars are stacked) and returned under the same key.
        drop_keys: extra keys to drop without an error (e.g. raw text columns kept next to the tokens).

    Attributes:
        stats: running counters (``batches``, ``samples``, ``tokens``, ``padding_tokens``, ``empty_segments``,
            ``truncated_samples``, ``truncated_tokens``, ``split_samples``, ``split_chunks``). With a
            ``DataLoader`` using ``num_workers > 0`` each worker counts in its own copy.

    >>> collator = PaddingFreeCollator(pad_to_multiple_of=4, return_seq_idx=True)
    >>> features = [{"input_ids": [5, 6, 7], "completion_mask": [0, 1, 1]},
    ...             {"input_ids": [8, 9], "completion_mask": [1, 1]}]
    >>> out = collator(features)
    >>> out["labels"].tolist(), out["position_ids"].tolist()
    ([[-100, 6, 7, -100, 9, -100, -100, -100]], [[0, 1, 2, 0, 1, 0, 1, 2]])
    >>> out["cu_seq_lens_q"].tolist(), out["max_length_q"], out["seq_idx"].tolist()
    ([0, 3, 5, 8], 3, [[0, 0, 0, 1, 1, 2, 2, 2]])
    """

    max_length: int | None = None
    overflow: Literal["error", "truncate", "split"] = "error"
    pad_to_multiple_of: int | None = None
    length_buckets: tuple[int, ...] | None = None
    segment_buckets: tuple[int, ...] | None = None
    pad_token_id: int = 0
    label_pad_id: int = -100
    position_ids_start: int = 0
    return_seq_idx: bool = False
    return_flash_attn_kwargs: bool = True
    return_position_ids: bool = True
    return_tensors: str = "pt"
    passthrough_keys: tuple[str, ...] = ()
    drop_keys: tuple[str, ...] = ()
    stats: dict[str, int] = field(default_factory=_new_stats, init=False, compare=False)
    _warned_overflow: bool = field(default=False, init=False, repr=False, compare=False)

    # Dataset columns this collator consumes: a Trainer must not strip them (remove_unused_columns).
    input_columns: ClassVar[tuple[str, ...]] = (
        "input_ids",
        "labels",
        *_MASK_KEYS,
        "seq_lengths",
        LOSS_WEIGHTS_KEY,
    )

    def __post_init__(self) -> None:
        check_int(self.max_length, "max_length", minimum=1, optional=True, int32=True)
        check_int(self.pad_to_multiple_of, "pad_to_multiple_of", minimum=1, optional=True, int32=True)
        if self.length_buckets is not None:
            buckets = _check_buckets(self.length_buckets, "length_buckets", "row lengths")
            if self.pad_to_multiple_of is not None:
                raise ValueError("length_buckets and pad_to_multiple_of both decide the row length; pass one")
            self.length_buckets = buckets
        if self.segment_buckets is not None:
            self.segment_buckets = _check_buckets(self.segment_buckets, "segment_buckets", "segment counts")
        check_int(self.position_ids_start, "position_ids_start", minimum=0, int32=True)
        check_int(self.label_pad_id, "label_pad_id", minimum=None, int32=True)
        if self.pad_token_id is None:
            raise ValueError(
                "pad_token_id=None: the collator needs an id for padding (pad_to_multiple_of); set the "
                "tokenizer's pad token, or use PaddingFreeCollator.for_tokenizer(tokenizer), which falls back to 0"
            )
        check_int(self.pad_token_id, "pad_token_id", minimum=0, int32=True)
        for name in ("passthrough_keys", "drop_keys"):
            value = getattr(self, name)
            if isinstance(value, str) or not all(isinstance(k, str) for k in value):
                raise TypeError(f"{name} must be a tuple of key names, got {value!r}")
            setattr(self, name, tuple(value))
        clash = (set(self.passthrough_keys) | set(self.drop_keys)) & set(_KNOWN_KEYS)
        if clash:
            raise ValueError(
                f"{sorted(clash)} are read by the collator itself; remove them from passthrough_keys/drop_keys"
            )
        self.overflow = check_overflow(self.overflow, "PaddingFreeCollator(overflow=...)", _OVERFLOWS)
        if self.return_tensors not in ("pt", "np"):
            raise ValueError(f"return_tensors must be 'pt' or 'np', got {self.return_tensors!r}")
        if not (self.return_position_ids or self.return_flash_attn_kwargs):
            raise ValueError(
                "return_position_ids=False with return_flash_attn_kwargs=False leaves the model no way to "
                "see sample boundaries, so packed samples would attend to each other; enable one of them"
            )

    def _row_padding(self, n_tokens: int) -> int:
        """Padding tokens that end a row of ``n_tokens``: up to its length bucket, or to a multiple of
        ``pad_to_multiple_of``; 0 without either."""
        if self.length_buckets is not None:
            return self._bucket_padding(n_tokens)
        return (-n_tokens) % self.pad_to_multiple_of if self.pad_to_multiple_of else 0

    def _with_empty_segments(
        self, seg_lengths: np.ndarray, cu: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """``seg_lengths`` ``(n,)`` and ``cu`` ``(n + 1,)`` closed with the empty segments of ``segment_buckets``
        (repeats of ``T`` in ``cu``), and how many were added."""
        n_empty = self._empty_segments(seg_lengths.size) if self.segment_buckets is not None else 0
        if n_empty:
            seg_lengths = np.concatenate([seg_lengths, np.zeros(n_empty, seg_lengths.dtype)])
            cu = np.concatenate([cu, np.full(n_empty, cu[-1], cu.dtype)])
        return seg_lengths, cu, n_empty

    def _bucket_padding(self, n_tokens: int) -> int:
        """Tokens to add so the row is the smallest bucket that holds ``n_tokens``."""
        index = bisect.bisect_left(self.length_buckets, n_tokens)
        if index == len(self.length_buckets):
            raise ValueError(
                f"the batch has {n_tokens} tokens, more than the largest of length_buckets={self.length_buckets}; "
                "make the largest bucket max_tokens_per_batch (packing_hf.collator.length_buckets(budget))"
            )
        return self.length_buckets[index] - n_tokens

    def _empty_segments(self, n_segments: int) -> int:
        """Empty segments to add so ``cu_seq_lens`` has the smallest bucketed size that holds ``n_segments``."""
        index = bisect.bisect_left(self.segment_buckets, n_segments)
        if index == len(self.segment_buckets):
            raise ValueError(
                f"the batch has {n_segments} segments, more than the largest of segment_buckets="
                f"{self.segment_buckets}; make the largest bucket max_tokens_per_batch "
                "(packing_hf.collator.segment_buckets(budget))"
            )
        return self.segment_buckets[index] - n_segments

    @classmethod
    def for_tokenizer(cls, processing_class: Any, **kwargs: Any) -> PaddingFreeCollator:
        """The collator a trainer builds by default: padding (if it ever pads) with the tokenizer's pad token.

        ``processing_class`` is a tokenizer or a processor holding one (``.tokenizer``); a tokenizer without a
        pad token pads with id 0, which is harmless: padding only appears with ``pad_to_multiple_of``, as its
        own segment with label ``label_pad_id``. ``kwargs`` are the other fields.

        >>> from types import SimpleNamespace
        >>> PaddingFreeCollator.for_tokenizer(SimpleNamespace(pad_token_id=7)).pad_token_id
        7
        """
        tokenizer = getattr(processing_class, "tokenizer", processing_class)
        pad_token_id = getattr(tokenizer, "pad_token_id", None)
        return cls(pad_token_id=pad_token_id if pad_token_id is not None else 0, **kwargs)

    def reset_stats(self) -> None:
        """Zero the counters in :attr:`stats`."""
        self.stats = _new_stats()

    def _batch_arguments(
        self, features: Iterable[Mapping[str, Any]], return_tensors: str | None, unit: str
    ) -> tuple[list[Mapping[str, Any]], str]:
        """The features as a non-empty list and the output format, or an error saying what was passed."""
        return_tensors = self.return_tensors if return_tensors is None else return_tensors
        if return_tensors not in ("pt", "np"):
            raise ValueError(f"return_tensors must be 'pt' or 'np', got {return_tensors!r}")
        if isinstance(features, Mapping):
            raise TypeError(
                f"got one dict of columns {sorted(features)[:6]} (a dataset slice such as ds[:8]); "
                "pass a list of rows instead, e.g. [ds[i] for i in range(8)]"
            )
        features = features if isinstance(features, list) else list(features)
        if not features:
            raise ValueError(f"got an empty batch (no features); a packed batch needs at least {unit}")
        return features, return_tensors

    def __call__(
        self, features: Iterable[Mapping[str, Any]], return_tensors: str | None = None
    ) -> dict[str, Any]:
        features, return_tensors = self._batch_arguments(features, return_tensors, "one sample")
        try:
            raw_ids = [f["input_ids"] for f in features]
        except (KeyError, TypeError, IndexError):
            _raise_for_bad_feature(features)
            raise
        keys = _keys_present(features)
        present = self._check_known_keys(features)
        ids, lengths = _flat_input_ids(raw_ids)

        labels = self._labels(features, keys, ids, lengths)
        weights = self._loss_weights(features, lengths) if LOSS_WEIGHTS_KEY in keys else None
        seg_lengths = self._segment_lengths(features, keys, lengths)
        ids, labels, seg_lengths, weights = self._apply_max_length(
            ids, labels, seg_lengths, features, lengths, weights
        )
        n_tokens = ids.size
        n_pad = self._row_padding(n_tokens)
        if n_pad:
            ids, labels, seg_lengths, weights = self._pad(n_pad, ids, labels, seg_lengths, weights)
        cu = _cu_seqlens(seg_lengths)  # (n + 1,)
        # Every segment's first label is masked: its logit would come from the previous sample's last token.
        labels[cu[:-1]] = self.label_pad_id
        # after the labels: an empty segment has no first token to mask
        seg_lengths, cu, n_empty = self._with_empty_segments(seg_lengths, cu)

        self.stats["batches"] += 1
        self.stats["tokens"] += n_tokens
        self.stats["padding_tokens"] += n_pad
        self.stats["empty_segments"] += n_empty

        batch = self._packed_batch(ids, labels, weights, seg_lengths, cu, return_tensors)
        if self.pad_to_multiple_of is not None or self.length_buckets is not None:
            # every batch of a padding collator, 0 included (a steady set of keys for compiled graphs)
            batch[PADDING_KEY] = torch.tensor(n_pad) if return_tensors == "pt" else np.array(n_pad)
        for key in self.passthrough_keys:
            if key in present:
                batch[key] = _concatenate([f[key] for f in features if key in f], key, return_tensors)
        return batch

    def _check_known_keys(self, features: list[Mapping[str, Any]]) -> set[str]:
        """Every key the features carry (read, passed through or dropped); an error names any other."""
        present = set().union(*features)  # one C-level pass over all keys
        unknown = present - _KNOWN_KEYS_SET - set(self.passthrough_keys) - set(self.drop_keys)
        if unknown:
            raise ValueError(
                f"the samples carry {sorted(unknown)}, which PaddingFreeCollator does not use and would lose "
                "(multimodal inputs such as pixel_values, say); pass passthrough_keys=(...) to hand them to the "
                "model (concatenated along the first dimension), drop_keys=(...) to drop them knowingly, or "
                "remove the columns from the dataset"
            )
        return present

    def _pad(
        self,
        n_pad: int,
        ids: np.ndarray,
        labels: np.ndarray,
        seg_lengths: np.ndarray,
        weights: np.ndarray | None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        """``n_pad`` padding tokens appended as their own segment (label ``label_pad_id``, weight 0)."""
        ids = np.concatenate([ids, np.full(n_pad, self.pad_token_id, dtype=np.int64)])
        labels = np.concatenate([labels, np.full(n_pad, self.label_pad_id, dtype=np.int64)])
        seg_lengths = np.append(seg_lengths, n_pad)
        if weights is not None:
            weights = np.concatenate([weights, np.zeros(n_pad, dtype=weights.dtype)])
        return ids, labels, seg_lengths, weights

    def _packed_batch(
        self,
        ids: np.ndarray,
        labels: np.ndarray,
        weights: np.ndarray | None,
        seg_lengths: np.ndarray,
        cu: np.ndarray,
        return_tensors: str,
    ) -> dict[str, Any]:
        """The output row ``[1, T]`` and its boundaries (see :func:`_cu_seqlens` for why in numpy)."""
        batch: dict[str, Any] = {"input_ids": ids[None], "labels": labels[None]}
        if weights is not None:
            batch[LOSS_WEIGHTS_KEY] = weights[None]  # [1, T] float32
        if self.return_position_ids:
            position_ids = np.repeat(cu[:-1] - self.position_ids_start, seg_lengths)  # (T,) segment offsets
            np.subtract(np.arange(ids.size, dtype=np.int64), position_ids, out=position_ids)
            batch["position_ids"] = position_ids[None]  # [1, T]
        self._segment_keys(batch, cu, seg_lengths)
        return self._as_returned(batch, seg_lengths, return_tensors)

    def _segment_keys(self, batch: dict[str, Any], cu: np.ndarray, seg_lengths: np.ndarray) -> None:
        """Add the row's ``seq_idx`` and ``cu_seq_lens_q/k`` (numpy), where this collator returns them."""
        if self.return_seq_idx:
            batch["seq_idx"] = np.repeat(np.arange(seg_lengths.size, dtype=np.int32), seg_lengths)[None]
        if self.return_flash_attn_kwargs:
            batch["cu_seq_lens_q"] = cu.astype(np.int32)
            batch["cu_seq_lens_k"] = batch["cu_seq_lens_q"].copy()

    def _as_returned(
        self, batch: dict[str, Any], seg_lengths: np.ndarray, return_tensors: str
    ) -> dict[str, Any]:
        """``batch`` as tensors for ``"pt"``, plus ``max_length_q/k`` where this collator returns them."""
        if return_tensors == "pt":
            batch = {k: torch.from_numpy(v) for k, v in batch.items()}
        if self.return_flash_attn_kwargs:
            longest = int(seg_lengths.max())
            if self.segment_buckets is not None and self.length_buckets is not None:
                # a compiled graph specializes on this int too: round it up to a length bucket (an upper
                # bound is what the varlen kernels take; the padded layout pads segments to it)
                longest = self.length_buckets[bisect.bisect_left(self.length_buckets, longest)]
            batch["max_length_q"] = batch["max_length_k"] = longest
        return batch

    def _labels(
        self, features: list[Mapping[str, Any]], keys: frozenset[str], ids: np.ndarray, lengths: np.ndarray
    ) -> np.ndarray:
        """Flat labels ``(T,)`` int64: the given labels (or a copy of the ids) with TRL masks applied."""
        if "labels" in keys:
            values = self._column(features, "labels")
            labels, label_lengths = flatten_field(values, "labels")
            self._check_same_lengths("labels", label_lengths, lengths)
            # -100 is the ignore index of every Hugging Face loss, whatever label_pad_id the padding uses
            bad_label = (labels < 0) & (labels != self.label_pad_id) & (labels != -100)
            if bad_label.any():
                pos = int(np.argmax(bad_label))
                i, offset = locate(pos, lengths)
                raise ValueError(
                    f"sample {i}: labels[{offset}] = {int(labels[pos])}; a label is a token id (>= 0), or -100 "
                    f"(or label_pad_id={self.label_pad_id}) for an untrained token"
                )
        else:
            labels = ids.copy()
        for key in _MASK_KEYS:
            if key not in keys:
                continue
            mask, mask_lengths = flatten_field(self._column(features, key), key, allow_bool=True)
            self._check_same_lengths(key, mask_lengths, lengths)
            if ((mask != 0) & (mask != 1)).any():
                pos = int(np.argmax((mask != 0) & (mask != 1)))
                i, offset = locate(pos, lengths)
                raise ValueError(
                    f"sample {i}: {key}[{offset}] = {int(mask[pos])}; a loss mask holds only 0 and 1"
                )
            labels[mask == 0] = self.label_pad_id
        return labels

    @staticmethod
    def _column(features: list[Mapping[str, Any]], key: str) -> list[Any]:
        """``[f[key] for f in features]``, naming the first sample that lacks the key."""
        try:
            return [f[key] for f in features]
        except KeyError:
            bad = next(i for i, f in enumerate(features) if key not in f)
            raise ValueError(
                f"sample {bad} has no {key!r} but other samples of the batch do; give every sample a "
                f"{key!r} or none"
            ) from None

    @staticmethod
    def _check_same_lengths(name: str, got: np.ndarray, expected: np.ndarray) -> None:
        if not np.array_equal(got, expected):
            bad = int(np.argmax(got != expected))
            raise ValueError(
                f"sample {bad}: {name!r} has {int(got[bad])} values but 'input_ids' has {int(expected[bad])} "
                f"tokens; {name!r} must align with input_ids token by token"
            )

    def _segment_lengths(
        self, features: list[Mapping[str, Any]], keys: frozenset[str], lengths: np.ndarray
    ) -> np.ndarray:
        """Lengths ``(n,)`` of the segments: one per sample, or the ``seq_lengths`` of offline-packed rows."""
        if "seq_lengths" not in keys:
            self.stats["samples"] += lengths.size
            return lengths
        parts = []
        for i, feature in enumerate(features):
            if "seq_lengths" not in feature:
                parts.append(lengths[i : i + 1])
                continue
            sub = sample_to_array(feature["seq_lengths"], i, "seq_lengths", allow_bool=False)
            if sub.size == 0 or (sub <= 0).any():
                raise ValueError(
                    f"sample {i}: seq_lengths = {sub.tolist()[:16]} must be non-empty and all > 0 "
                    "(every packed sub-sample needs at least one token)"
                )
            if int(sub.sum()) != int(lengths[i]):
                raise ValueError(
                    f"sample {i}: seq_lengths sum to {int(sub.sum())} but the row has {int(lengths[i])} "
                    "input_ids; seq_lengths must describe every token of its row"
                )
            parts.append(sub)
        seg_lengths = np.concatenate(parts)
        self.stats["samples"] += seg_lengths.size
        return seg_lengths

    def _apply_max_length(
        self,
        ids: np.ndarray,
        labels: np.ndarray,
        seg_lengths: np.ndarray,
        features: list[Mapping[str, Any]],
        lengths: np.ndarray,
        weights: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        """Enforce ``max_length`` on every segment according to ``overflow``; count what changes."""
        if self.max_length is None:
            return ids, labels, seg_lengths, weights
        too_long = seg_lengths > self.max_length
        if not too_long.any():
            return ids, labels, seg_lengths, weights
        m = self.max_length
        if self.overflow == "error":
            seg = int(np.argmax(too_long))
            # map the segment back to its row (rows with seq_lengths hold several segments)
            row, _ = locate(int(seg_lengths[:seg].sum()), lengths)
            where = f"sample {row}" + (
                " (a sub-sample of its seq_lengths)" if "seq_lengths" in features[row] else ""
            )
            raise ValueError(
                f"{where} has {int(seg_lengths[seg])} tokens > max_length={m}; set overflow='truncate' or "
                "overflow='split', raise max_length, or filter long samples out of the dataset"
            )
        n_long = int(too_long.sum())
        if self.overflow == "truncate":
            keep = offsets_in_segments(seg_lengths) < m  # (T,)
            dropped = int(ids.size - keep.sum())
            ids, labels, seg_lengths = ids[keep], labels[keep], np.minimum(seg_lengths, m)
            weights = None if weights is None else weights[keep]
            self.stats["truncated_samples"] += n_long
            self.stats["truncated_tokens"] += dropped
            action = f"truncated {n_long} sample(s) to max_length={m}, dropping {dropped} tokens"
        else:
            seg_lengths, chunks = split_lengths(seg_lengths, m)
            n_chunks = int(chunks[too_long].sum())
            self.stats["split_samples"] += n_long
            self.stats["split_chunks"] += n_chunks
            action = f"split {n_long} sample(s) longer than max_length={m} into {n_chunks} chunks"
        if not self._warned_overflow:
            self._warned_overflow = True
            logger.warning(
                "PaddingFreeCollator %s (overflow=%r); further cases are only counted in collator.stats",
                action,
                self.overflow,
            )
        return ids, labels, seg_lengths, weights

    def _loss_weights(self, features: list[Mapping[str, Any]], lengths: np.ndarray) -> np.ndarray:
        """Flat ``loss_weights`` ``(T,)`` float32, each sample's checked against its ``input_ids``."""
        values = self._column(features, LOSS_WEIGHTS_KEY)
        return np.concatenate(
            [
                check_loss_weights(v, int(n), f"sample {i}")
                for i, (v, n) in enumerate(zip(values, lengths, strict=True))
            ]
        ).astype(np.float32)
