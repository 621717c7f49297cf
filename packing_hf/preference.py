"""Padding-free preference batches: every pair's chosen and rejected sequences packed into one ``[1, T]`` row.

A DPO batch of ``B`` pairs holds ``2B`` sequences (``prompt + chosen`` and ``prompt + rejected`` of every
pair). A padded batch right-pads all of them to the longest one; here they become ``2B`` segments of one
packed row with restarting ``position_ids`` and ``cu_seq_lens_q/k``, so varlen attention computes only
real tokens and no sequence sees another.

The batch also carries the *padded layout* TRL's ``DPOTrainer`` reasons in: ``input_ids``,
``attention_mask`` and ``completion_mask`` of shape ``(2B, L)``, chosen rows first, exactly as
``trl.trainer.dpo_trainer.DataCollatorForPreference`` builds them. They are small integer tensors (no
model compute runs on them); they let TRL's loss code run unchanged on per-token results of the packed
forward scattered back into that layout (:func:`unpack_shifted`), with labels carried the other way
(:func:`pack_padded_labels`). ``packed_index`` links the two layouts: ``packed_index[t]`` is the flat
index into ``(2B, L)`` of packed token ``t``, or ``2B * L`` (past the end) for tokens that are never a
prediction target: the first token of every segment and the padding added by ``pad_to_multiple_of``.

>>> collator = PaddingFreePreferenceCollator()
>>> batch = collator([{"prompt_ids": [1, 2], "chosen_ids": [3], "rejected_ids": [4, 5]}])
>>> batch["packed_input_ids"].tolist(), batch["position_ids"].tolist(), batch["cu_seq_lens_q"].tolist()
([[1, 2, 3, 1, 2, 4, 5]], [[0, 1, 2, 0, 1, 2, 3]], [0, 3, 7])
>>> batch["input_ids"].tolist(), batch["completion_mask"].tolist()
([[1, 2, 3, 0], [1, 2, 4, 5]], [[0, 0, 1, 0], [0, 0, 1, 1]])
>>> batch["packed_index"].tolist()  # 8 = 2 x 4: segment starts are never targets
[8, 1, 2, 8, 5, 6, 7]
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from .collator import PaddingFreeCollator
from .preference_layout import (
    TREE_INDEX_KEY,
    TreeTargets,
    pack_padded_labels,
    padded_layout,
    row_offsets,
    row_segments,
    token_sources,
    unpack_shifted,
)
from .prefix_tree import build_prefix_tree
from .shared_prefix import PREFIX_KEY

__all__ = [
    "PACKED_KEYS",
    "TREE_INDEX_KEY",
    "PaddingFreePreferenceCollator",
    "PaddingFreeRewardCollator",
    "TreeTargets",
    "pack_padded_labels",
    "preference_pair_lengths",
    "unpack_shifted",
]

logger = logging.getLogger(__name__)

TruncationMode = Literal["keep_start", "keep_end"]
_TRUNCATION_MODES = ("keep_start", "keep_end")
_PAIR_KEYS = ("prompt_ids", "chosen_ids", "rejected_ids")
_REF_KEYS = ("ref_chosen_logps", "ref_rejected_logps")
# Batch keys that exist only in the packed layout; a model hook turns them into the model's inputs.
PACKED_KEYS = ("packed_input_ids", "packed_index", "tree_index")


def _new_stats() -> dict[str, int]:
    return {
        "batches": 0,
        "pairs": 0,
        "samples": 0,  # sequences: two per pair
        "tokens": 0,  # real tokens emitted (after truncation, before padding)
        "padding_tokens": 0,  # added by pad_to_multiple_of / length_buckets
        "empty_segments": 0,  # segment_buckets: zero-length segments closing cu_seq_lens
        "padded_layout_tokens": 0,  # 2B x longest: what a right-padded batch of the same pairs would run
        "truncated_samples": 0,
        "truncated_tokens": 0,
        "shared_prompt_tokens": 0,  # prompt tokens not repeated: the rejected branch reuses the chosen one's
        "sequence_tokens": 0,  # tokens of the sequences run alone (after truncation): tree_token_ratio's numerator
        "split_samples": 0,  # never used (a split pair cannot be scored); kept for PaddingFreeCollator's keys
        "split_chunks": 0,
    }


def _ids_array(value: Any, index: int, key: str) -> np.ndarray:
    """One pair's token ids (list / numpy array / tensor of ints) as a 1-D int64 array, naming bad input."""
    where = f"sample {index}: {key!r}"
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    if isinstance(value, str | bytes) or not isinstance(value, Sequence | np.ndarray):
        raise TypeError(f"{where} must be a list, numpy array or tensor of ints, got {type(value).__name__}")
    try:
        array = np.asarray(value)
    except ValueError:  # ragged nesting
        raise ValueError(f"{where} must be a flat 1-D list of ints, got nested lists") from None
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.ndim != 1:
        raise ValueError(f"{where} has shape {array.shape}; it must be a flat 1-D list of ints")
    if array.dtype.kind not in "iu":
        raise TypeError(
            f"{where} holds {array.dtype} values (first: {array[0].item()!r}); token ids must be integers"
        )
    if array.min() < 0:
        raise ValueError(f"{where} holds the negative id {int(array.min())}; token ids must be >= 0")
    return array.astype(np.int64, copy=False)


def _reference_logps(features: list[Mapping[str, Any]], key: str) -> np.ndarray:
    """``(B,)`` float32 per-pair values (precomputed reference log-probs, margins), one finite number per pair (a
    one-element list would become ``(B, 1)``, which TRL's loss broadcasts against ``(B,)`` into a silent ``(B, B)``;
    a NaN would make the whole batch's loss NaN)."""
    values = _column(features, key)
    try:
        array = np.asarray(values, dtype=np.float32)
    except (TypeError, ValueError):
        array = None
    if array is None or array.shape != (len(values),):
        bad = next((i for i, v in enumerate(values) if np.ndim(v) != 0), 0)
        raise ValueError(
            f"sample {bad}: {key!r} is {values[bad]!r}; it must be one number per pair (a float), giving shape "
            f"({len(values)},). For values saved as one-element lists: "
            f"dataset.map(lambda r: {{{key!r}: float(r[{key!r}][0])}})"
        )
    finite = np.isfinite(array)
    if not finite.all():
        bad = int(np.argmin(finite))
        # a NaN or infinite value turns the loss (and every gradient of the step) into NaN/inf silently
        raise ValueError(
            f"sample {bad}: {key!r} is {values[bad]!r}, not a finite number; the loss of the whole batch would be "
            "NaN or infinite. Recompute it (e.g. precompute_ref_log_probs with a reference model in fp32) or drop "
            "that sample"
        )
    return array


def _column(features: list[Mapping[str, Any]], key: str) -> list[Any]:
    """``[f[key] for f in features]``, naming the first feature that is not a dict or lacks the key."""
    for i, feature in enumerate(features):
        if not isinstance(feature, Mapping):
            raise TypeError(f"sample {i} is a {type(feature).__name__}, expected a dict of fields")
        if key not in feature:
            raise ValueError(
                f"sample {i} has no {key!r} (keys: {sorted(feature)}); preference pairs need prompt_ids, "
                "chosen_ids and rejected_ids (tokenize with TRL's DPOTrainer)"
            )
    return [feature[key] for feature in features]


def preference_pair_lengths(
    prompt_lengths: Any,
    chosen_lengths: Any,
    rejected_lengths: Any,
    max_length: int | None = None,
    *,
    shared_prompt: bool = False,
    truncation_mode: TruncationMode = "keep_start",
) -> np.ndarray:
    """Tokens one pair occupies in a packed row: ``len(prompt + chosen) + len(prompt + rejected)``.

    With ``max_length`` each sequence counts at most ``max_length`` tokens (what the collator keeps with
    ``overflow="truncate"``, ``truncation_mode``). With ``shared_prompt`` the prompt held once is
    counted once (see :class:`PaddingFreePreferenceCollator`). These are the lengths to give :class:`~packing_hf.MultipackBatchSampler`, so a
    pair is one item of the bin packing and is never split across batches.

    Args:
        prompt_lengths, chosen_lengths, rejected_lengths: ``(n,)`` ints (lists, arrays or tensors).
        max_length: the collator's per-sequence ``max_length``, or ``None``.
        shared_prompt, truncation_mode: the collator's.

    Returns:
        ``(n,)`` int64.

    >>> preference_pair_lengths([3, 2], [4, 1], [2, 6]).tolist()
    [12, 11]
    >>> preference_pair_lengths([3, 2], [4, 1], [2, 6], max_length=6).tolist()
    [11, 9]
    >>> preference_pair_lengths([3, 2], [4, 1], [2, 6], shared_prompt=True).tolist()
    [10, 10]
    """
    arrays = []
    for name, values in zip(_PAIR_KEYS, (prompt_lengths, chosen_lengths, rejected_lengths), strict=True):
        array = np.asarray(values.cpu() if isinstance(values, torch.Tensor) else values)
        if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
            raise TypeError(
                f"{name} lengths must be a 1-D sequence of ints, got {array.dtype} of shape {array.shape}"
            )
        arrays.append(array.astype(np.int64))
    prompt, chosen, rejected = arrays
    if not (prompt.size == chosen.size == rejected.size):
        raise ValueError(
            f"got {prompt.size} prompt, {chosen.size} chosen and {rejected.size} rejected lengths; "
            "every pair needs all three"
        )
    first, second = prompt + chosen, prompt + rejected
    kept = prompt
    shareable = np.ones(prompt.size, dtype=bool)
    if max_length is not None:
        if truncation_mode == "keep_end":
            shareable = (first <= max_length) & (second <= max_length)
        kept = np.minimum(prompt, max_length)
        first, second = np.minimum(first, max_length), np.minimum(second, max_length)
    if shared_prompt:
        return first + second - np.where(shareable & (kept >= 2), kept - 1, 0)
    return first + second


@dataclass
class PaddingFreePreferenceCollator(PaddingFreeCollator):
    """Collate preference pairs into one packed row of ``2B`` segments, plus TRL's padded layout.

    Input: a list of ``B`` feature dicts as TRL's ``DPOTrainer`` prepares them:

    - ``prompt_ids``, ``chosen_ids``, ``rejected_ids``: lists / arrays / tensors of ints ``>= 0``;
      ``prompt + chosen`` and ``prompt + rejected`` must not be empty;
    - ``ref_chosen_logps``, ``ref_rejected_logps`` (optional, precomputed reference log-probs): floats.

    Output (``return_tensors="pt"``; ``S = 2B`` sequences, chosen ones first, ``L`` the longest, ``T`` the
    packed tokens):

    - ``packed_input_ids`` ``(1, T)`` int64, ``position_ids`` ``(1, T)`` int64 restarting at
      ``position_ids_start``, ``cu_seq_lens_q/k`` ``(S + 1,)`` int32 (one more entry when
      ``pad_to_multiple_of`` adds a padding segment), ``max_length_q/k`` int, ``seq_idx`` ``(1, T)`` int32
      if ``return_seq_idx``;
    - ``packed_index`` ``(T,)`` int64: see the module docstring;
    - ``input_ids``, ``attention_mask``, ``completion_mask`` ``(S, L)`` int64: TRL's right-padded layout
      (``pad_token_id`` / 0 / 0 on padding);
    - ``ref_chosen_logps``, ``ref_rejected_logps`` ``(B,)`` float32, when the features have them.

    Args:
        max_length: per-sequence length limit (``prompt + completion``), or ``None``.
        overflow: a sequence longer than ``max_length``: ``"error"`` (default) raises naming the pair;
            ``"truncate"`` cuts it as TRL's ``DataCollatorForPreference`` does (``truncation_mode``),
            counted in :attr:`stats` and logged once. ``"split"`` is refused: half a sequence cannot be
            scored.
        truncation_mode: ``"keep_start"`` (default) keeps the first ``max_length`` tokens, ``"keep_end"``
            the last ones (TRL's meaning).
        shared_prompt: hold every pair's prompt once: the row becomes, pair by pair, ``[prompt[:-1] |
            prompt[-1] + chosen | prompt[-1] + rejected]``, the two branches attending to the prefix
            segment (``prefix_seq_idx`` ``(n,)`` int32 in the batch, positions continuing the prompt's; see
            :mod:`packing_hf.shared_prefix`). Needs packing_hf's attention. Pairs whose two sequences kept
            different prompt tokens (``keep_end`` truncation) or a one-token prompt are packed unshared.
        share_prefixes: lay the whole batch out as ONE prefix tree
            (:func:`~packing_hf.prefix_tree.build_prefix_tree` over the ``2B`` sequences as kept after
            ``max_length``): every run of tokens that sequences begin with (a system prompt, a conversation's
            earlier turns, a pair's prompt) is held and computed once, across pairs too. The general case of
            ``shared_prompt`` (which it replaces: both ``True`` is refused). Instead of ``packed_index`` the
            batch holds ``tree_index`` ``(S, L)`` int64: the row token of every token of the padded layout
            (``T``, the row's length, on padding); the prediction of a sequence's token ``j`` is read at the
            row of its token ``j - 1`` (a branch point's row serves every child), see
            :class:`~packing_hf.integrations.adapters.PackedPreferenceForward`. Needs packing_hf's attention.
        min_shared_tokens: with ``share_prefixes``, the shortest run of tokens that several sequences share as
            one node (``>= 1``; shorter common runs are repeated), as in
            :func:`~packing_hf.prefix_tree.build_prefix_tree`. Refused without ``share_prefixes``.
        pad_to_multiple_of, length_buckets, segment_buckets, pad_token_id, position_ids_start, return_seq_idx,
            return_flash_attn_kwargs, return_position_ids, return_tensors: as in
            :class:`~packing_hf.PaddingFreeCollator` (``pad_token_id`` also fills the padded layout's
            ``input_ids``; the padding of ``length_buckets`` is its own segment, never a target, and the empty
            segments of ``segment_buckets`` hold no token). ``label_pad_id``, ``passthrough_keys`` and
            ``drop_keys`` are refused: labels are derived by the trainer from ``input_ids`` and
            ``completion_mask``, and no other key reaches the model.

    Attributes:
        stats: running counters: ``batches``, ``pairs``, ``samples`` (sequences), ``tokens``,
            ``padding_tokens``, ``padded_layout_tokens`` (``S x L``, what a right-padded batch would
            compute), ``truncated_samples``, ``truncated_tokens``, ``shared_prompt_tokens`` (prompt tokens
            held once instead of twice), ``sequence_tokens`` (tokens of the sequences run alone; over
            ``tokens`` it is the tree token ratio of ``share_prefixes``).

    >>> shared = PaddingFreePreferenceCollator(shared_prompt=True)
    >>> batch = shared([{"prompt_ids": [1, 2, 3], "chosen_ids": [4], "rejected_ids": [5, 6]}])
    >>> batch["packed_input_ids"].tolist(), batch["position_ids"].tolist(), batch["prefix_seq_idx"].tolist()
    ([[1, 2, 3, 4, 3, 5, 6]], [[0, 1, 2, 3, 2, 3, 4]], [-1, 0, 0])
    >>> tree = PaddingFreePreferenceCollator(share_prefixes=True)  # turn 2 continues turn 1's chosen answer
    >>> batch = tree([{"prompt_ids": [1, 2], "chosen_ids": [3], "rejected_ids": [4]},
    ...               {"prompt_ids": [1, 2, 3, 5], "chosen_ids": [6], "rejected_ids": [7]}])
    >>> batch["packed_input_ids"].tolist(), batch["prefix_seq_idx"].tolist()
    ([[1, 2, 3, 5, 6, 7, 4]], [-1, 0, 1, 2, 2, 0])
    >>> batch["tree_index"].tolist()  # rows: chosen 1, chosen 2, rejected 1, rejected 2; 7 = padding
    [[0, 1, 2, 7, 7], [0, 1, 2, 3, 4], [0, 1, 6, 7, 7], [0, 1, 2, 3, 5]]
    >>> collator = PaddingFreePreferenceCollator(max_length=3, overflow="truncate")
    >>> batch = collator([{"prompt_ids": [1, 2], "chosen_ids": [3, 4], "rejected_ids": [5],
    ...                    "ref_chosen_logps": -1.5, "ref_rejected_logps": -2.0}])
    >>> batch["packed_input_ids"].tolist(), batch["ref_chosen_logps"].tolist()
    ([[1, 2, 3, 1, 2, 5]], [-1.5])
    >>> collator.stats["truncated_samples"], collator.stats["truncated_tokens"]
    (1, 1)
    """

    truncation_mode: TruncationMode = "keep_start"
    shared_prompt: bool = False
    share_prefixes: bool = False
    min_shared_tokens: int = 1
    stats: dict[str, int] = field(default_factory=_new_stats, init=False, compare=False)

    input_columns: ClassVar[tuple[str, ...]] = (*_PAIR_KEYS, *_REF_KEYS)
    # why a subclass's rows take no padding (pad_to_multiple_of, length_buckets, segment_buckets), or None
    no_row_padding: ClassVar[str | None] = None
    # why a subclass's batches cannot be one prefix tree (share_prefixes), or None
    no_prefix_tree: ClassVar[str | None] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__name__
        if self.no_row_padding is not None:
            for key in ("pad_to_multiple_of", "length_buckets", "segment_buckets"):
                if getattr(self, key):
                    raise ValueError(f"{key}={getattr(self, key)}: {self.no_row_padding}; leave it unset")
        # fields of PaddingFreeCollator that a pair's rows have no use for: refused rather than ignored
        if self.label_pad_id != -100:
            raise ValueError(
                f"label_pad_id={self.label_pad_id}: {name} returns no labels (the trainer derives them from "
                "input_ids and completion_mask); leave it unset"
            )
        if self.passthrough_keys or self.drop_keys:
            raise ValueError(
                f"passthrough_keys={self.passthrough_keys} / drop_keys={self.drop_keys}: {name} reads only its "
                f"input_columns {self.input_columns} and hands no other key to the model; leave them unset"
            )
        if self.overflow == "split":
            raise ValueError(
                "overflow='split' cannot be used for preference pairs: a sequence cut into pieces has no single "
                "log-probability to compare; use overflow='truncate' (TRL's max_length behaviour) or 'error'"
            )
        self._check_share_prefixes()
        if self.shared_prompt and self.return_seq_idx:
            raise ValueError(
                "shared_prompt=True cannot be combined with return_seq_idx=True: seq_idx kernels (Mamba-style "
                "layers) know no shared prefix; set shared_prompt=False for these models"
            )
        if self.shared_prompt and not (self.return_flash_attn_kwargs and self.return_position_ids):
            raise ValueError(
                "shared_prompt=True needs return_flash_attn_kwargs=True and return_position_ids=True: the "
                "attention reads the prefix layout from cu_seq_lens_q and prefix_seq_idx"
            )
        if self.truncation_mode not in _TRUNCATION_MODES:
            raise ValueError(
                f"truncation_mode must be one of {_TRUNCATION_MODES}, got {self.truncation_mode!r}"
            )

    def _check_share_prefixes(self) -> None:
        """``share_prefixes`` / ``min_shared_tokens``: honoured together, or refused by name."""
        if not isinstance(self.share_prefixes, bool):
            raise TypeError(f"share_prefixes must be True or False, got {self.share_prefixes!r}")
        if self.share_prefixes and self.no_prefix_tree is not None:
            raise ValueError(f"share_prefixes=True: {self.no_prefix_tree}; leave share_prefixes=False")
        if not self.share_prefixes:
            if self.min_shared_tokens != 1 or isinstance(self.min_shared_tokens, bool):
                raise ValueError(
                    f"min_shared_tokens={self.min_shared_tokens!r} only applies to the prefix tree of "
                    "share_prefixes=True; set share_prefixes=True or leave min_shared_tokens unset"
                )
            return
        if self.shared_prompt:
            raise ValueError(
                "shared_prompt=True and share_prefixes=True: the prefix tree of share_prefixes already holds every "
                "pair's prompt once (and every longer prefix that sequences share, across pairs); set "
                "shared_prompt=False"
            )
        if (
            isinstance(self.min_shared_tokens, bool)
            or not isinstance(self.min_shared_tokens, int)
            or self.min_shared_tokens < 1
        ):
            raise ValueError(
                f"min_shared_tokens={self.min_shared_tokens!r}: give an int >= 1 (1 merges every common prefix)"
            )
        if self.segment_buckets:
            raise ValueError(
                f"share_prefixes=True with segment_buckets={self.segment_buckets}: the prefix-tree attention takes no "
                "empty segment (every node holds tokens); leave segment_buckets unset (length_buckets and "
                "pad_to_multiple_of are accepted)"
            )
        if self.return_seq_idx:
            raise ValueError(
                "share_prefixes=True cannot be combined with return_seq_idx=True: seq_idx kernels (Mamba-style "
                "layers) know no prefix tree; set share_prefixes=False for these models"
            )
        if not (self.return_flash_attn_kwargs and self.return_position_ids):
            raise ValueError(
                "share_prefixes=True needs return_flash_attn_kwargs=True and return_position_ids=True: the "
                "attention reads the tree from cu_seq_lens_q, prefix_seq_idx and position_ids"
            )

    def reset_stats(self) -> None:
        """Zero the counters in :attr:`stats`."""
        self.stats = _new_stats()

    def __call__(
        self, features: Iterable[Mapping[str, Any]], return_tensors: str | None = None
    ) -> dict[str, Any]:
        features, return_tensors = self._batch_arguments(features, return_tensors, "one pair")
        flat, lengths = _pair_columns(features)
        n_pairs = len(features)
        prompt_len, completion_len, seq_len = _sequence_lengths(lengths, n_pairs)
        truncated = seq_len > self.max_length if self.max_length is not None else np.zeros(seq_len.size, bool)
        ids, is_completion = self._interleave(flat, lengths, prompt_len, completion_len)
        ids, is_completion, seq_len = self._apply_max_length(ids, is_completion, seq_len, n_pairs)
        n_seq, width = seq_len.size, int(seq_len.max())
        seq_start = np.cumsum(seq_len) - seq_len  # (S,) where every sequence starts in `ids`
        self.stats["sequence_tokens"] += int(seq_len.sum())
        if self.share_prefixes:
            return self._tree_batch(features, ids, is_completion, seq_len, seq_start, return_tensors)
        shared = self._shared_lengths(is_completion, seq_start, truncated, n_pairs)  # (B,)
        seg_len, seg_seq, seg_offset, prefix_idx = row_segments(seq_len, shared, self.shared_prompt)
        n_tokens = int(seg_len.sum())

        n_pad = self._row_padding(n_tokens)
        seg_lengths = np.append(seg_len, n_pad) if n_pad else seg_len
        cu = row_offsets(seg_lengths, n_seq, width)  # (segments + 1,)
        in_segment, seq, offsets, packed_index = token_sources(
            cu, seg_lengths, seg_len, seg_seq, seg_offset, n_tokens, n_seq, width
        )
        seg_lengths, cu, n_empty = self._with_empty_segments(seg_lengths, cu)
        padded_ids, attention, completion = padded_layout(
            ids, is_completion, seq_len, seq_start, width, self.pad_token_id
        )

        self.stats["batches"] += 1
        self.stats["pairs"] += n_pairs
        self.stats["samples"] += n_seq
        self.stats["tokens"] += n_tokens
        self.stats["padding_tokens"] += n_pad
        self.stats["empty_segments"] += n_empty
        self.stats["padded_layout_tokens"] += n_seq * width
        self.stats["shared_prompt_tokens"] += int(shared.sum())

        row_ids = ids[seq_start[seq] + offsets]
        packed_ids = (
            np.concatenate([row_ids, np.full(n_pad, self.pad_token_id, dtype=np.int64)]) if n_pad else row_ids
        )
        batch: dict[str, Any] = {
            "packed_input_ids": packed_ids[None],
            "packed_index": packed_index,
            "input_ids": padded_ids,
            "attention_mask": attention,
            "completion_mask": completion,
        }
        if self.return_position_ids:
            positions = np.concatenate([offsets, in_segment[n_tokens:]])  # padding restarts at 0
            batch["position_ids"] = (positions + self.position_ids_start)[None]
        self._segment_keys(batch, cu, seg_lengths)
        if self.shared_prompt:  # padding and empty segments are no branch: -1
            extra = seg_lengths.size - prefix_idx.size
            batch[PREFIX_KEY] = np.append(prefix_idx, np.full(extra, -1)).astype(np.int32)
        for key in _REF_KEYS:
            if any(key in f for f in features):
                batch[key] = _reference_logps(features, key)
        return self._as_returned(batch, seg_lengths, return_tensors)

    def _tree_batch(
        self,
        features: list[Mapping[str, Any]],
        ids: np.ndarray,
        is_completion: np.ndarray,
        seq_len: np.ndarray,
        seq_start: np.ndarray,
        return_tensors: str,
    ) -> dict[str, Any]:
        """The batch of ``share_prefixes``: the ``S`` sequences (as kept) merged into one prefix tree.

        The tree is built over the kept sequences themselves, so truncation (either mode) cannot make a shared
        node wrong: a node is shared only by sequences holding the same tokens at the same positions.
        """
        n_seq, width = seq_len.size, int(seq_len.max())
        tree = build_prefix_tree(np.split(ids, seq_start[1:]), min_shared_tokens=self.min_shared_tokens)
        seg_len = np.diff(tree.cu_seqlens.numpy()).astype(np.int64)
        n_tokens = int(seg_len.sum())
        n_pad = self._row_padding(n_tokens)
        seg_lengths = np.append(seg_len, n_pad) if n_pad else seg_len
        cu = row_offsets(seg_lengths, n_seq, width)  # no empty segments: segment_buckets is refused
        padded_ids, attention, completion = padded_layout(
            ids, is_completion, seq_len, seq_start, width, self.pad_token_id
        )
        # every token of the padded layout -> its row token; padding -> the row's length (past the end)
        total = n_tokens + n_pad
        tree_index = np.full(n_seq * width, total, dtype=np.int64)
        column = np.arange(ids.size, dtype=np.int64) - np.repeat(seq_start, seq_len)
        flat = np.repeat(np.arange(n_seq, dtype=np.int64), seq_len) * width + column
        tree_index[flat] = tree.sample_index.numpy()

        self.stats["batches"] += 1
        self.stats["pairs"] += n_seq // 2
        self.stats["samples"] += n_seq
        self.stats["tokens"] += n_tokens
        self.stats["padding_tokens"] += n_pad
        self.stats["padded_layout_tokens"] += n_seq * width

        row_ids = tree.input_ids.numpy()
        positions = tree.position_ids.numpy()
        prefix_idx = tree.prefix_seq_idx.numpy().astype(np.int64)
        if n_pad:  # the padding segment restarts at position 0 and is no branch
            row_ids = np.concatenate([row_ids, np.full(n_pad, self.pad_token_id, dtype=np.int64)])
            positions = np.concatenate([positions, np.arange(n_pad, dtype=np.int64)])
        batch: dict[str, Any] = {
            "packed_input_ids": row_ids[None],
            TREE_INDEX_KEY: tree_index.reshape(n_seq, width),
            "input_ids": padded_ids,
            "attention_mask": attention,
            "completion_mask": completion,
            "position_ids": (positions + self.position_ids_start)[None],
        }
        self._segment_keys(batch, cu, seg_lengths)
        extra = seg_lengths.size - prefix_idx.size  # the padding segment: -1
        batch[PREFIX_KEY] = np.append(prefix_idx, np.full(extra, -1)).astype(np.int32)
        for key in _REF_KEYS:
            if any(key in f for f in features):
                batch[key] = _reference_logps(features, key)
        return self._as_returned(batch, seg_lengths, return_tensors)

    def _shared_lengths(
        self, is_completion: np.ndarray, seq_start: np.ndarray, truncated: np.ndarray, n_pairs: int
    ) -> np.ndarray:
        """``(B,)`` tokens of every pair's prompt held once, as the prefix segment (0: the pair is not shared).

        The prefix is the kept prompt minus its last token: each branch starts with that token, so the
        prediction of its first completion token stays inside the branch. A pair is shared only when both
        sequences kept the same prompt tokens: always with ``keep_start``; with ``keep_end`` only if neither
        sequence was truncated (cutting the start leaves two different prompt tails).
        """
        if not self.shared_prompt:
            return np.zeros(n_pairs, dtype=np.int64)
        prompt_kept = np.add.reduceat(1 - is_completion, seq_start)  # (S,) prompt tokens of every sequence
        chosen, rejected = prompt_kept[:n_pairs], prompt_kept[n_pairs:]
        same = chosen == rejected
        if self.truncation_mode == "keep_end":
            same &= ~(truncated[:n_pairs] | truncated[n_pairs:])
        return np.where(same & (chosen >= 2), chosen - 1, 0).astype(np.int64)

    @staticmethod
    def _interleave(
        flat: dict[str, np.ndarray],
        lengths: dict[str, np.ndarray],
        prompt_len: np.ndarray,
        completion_len: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        """The ``2B`` sequences back to back, ``(T,)`` ids and ``(T,)`` completion flags, by vectorized gathers.

        Every packed token is either a prompt token (copied from ``prompt_ids``, once per sequence of its
        pair) or a completion token (from ``chosen_ids`` then ``rejected_ids``, which concatenate in order).
        """
        n_pairs = lengths["prompt_ids"].size
        seq_len = prompt_len + completion_len
        seq_start = np.cumsum(seq_len) - seq_len
        offsets = np.arange(int(seq_len.sum()), dtype=np.int64) - np.repeat(seq_start, seq_len)  # (T,)
        seq = np.repeat(np.arange(seq_len.size), seq_len)  # (T,) sequence of every token
        is_completion = offsets >= prompt_len[seq]

        prompt_start = np.cumsum(lengths["prompt_ids"]) - lengths["prompt_ids"]  # (B,)
        completions = np.concatenate([flat["chosen_ids"], flat["rejected_ids"]])
        completion_start = np.cumsum(completion_len) - completion_len  # (S,) in `completions`
        pair = seq % n_pairs
        ids = np.empty(seq.size, dtype=np.int64)
        p = ~is_completion
        ids[p] = flat["prompt_ids"][prompt_start[pair[p]] + offsets[p]]
        c = is_completion
        ids[c] = completions[completion_start[seq[c]] + offsets[c] - prompt_len[seq[c]]]
        return ids, is_completion.astype(np.int64)

    def _apply_max_length(
        self, ids: np.ndarray, is_completion: np.ndarray, seq_len: np.ndarray, n_pairs: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Enforce ``max_length`` on every sequence: raise, or truncate as TRL does; count what changes."""
        too_long = self._over_max_length(seq_len, n_pairs, ("chosen", "rejected"), "sample", "pairs")
        if too_long is None:
            return ids, is_completion, seq_len
        m = self.max_length
        seq_start = np.cumsum(seq_len) - seq_len
        offsets = np.arange(ids.size, dtype=np.int64) - np.repeat(seq_start, seq_len)
        if self.truncation_mode == "keep_start":
            keep = offsets < m
        else:
            keep = offsets >= np.repeat(seq_len - m, seq_len)
        self._count_truncated(too_long, int(ids.size - keep.sum()))
        return ids[keep], is_completion[keep], np.minimum(seq_len, m)

    def _over_max_length(
        self, seq_len: np.ndarray, n: int, branches: Sequence[str], unit: str, units: str
    ) -> np.ndarray | None:
        """Which sequences (``branches`` of ``n`` examples, branch-major) are longer than ``max_length``;
        ``None`` when none is. With ``overflow="error"`` the first one raises, named as ``unit`` and branch."""
        m = self.max_length
        if m is None or not (too_long := seq_len > m).any():
            return None
        if self.overflow == "error":
            s = int(np.argmax(too_long))
            raise ValueError(
                f"{unit} {s % n}: prompt + {branches[s // n]} has {int(seq_len[s])} tokens > max_length={m}; set "
                f"overflow='truncate' (TRL's truncation, truncation_mode={self.truncation_mode!r}), raise "
                f"max_length, or filter long {units} out of the dataset"
            )
        return too_long

    def _count_truncated(self, too_long: np.ndarray, dropped: int) -> None:
        """Count the truncated sequences and their dropped tokens in ``stats``; warn the first time."""
        self.stats["truncated_samples"] += int(too_long.sum())
        self.stats["truncated_tokens"] += dropped
        if not self._warned_overflow:
            self._warned_overflow = True
            logger.warning(
                "%s truncated %d sequence(s) to max_length=%d (%s), dropping %d tokens; further cases are only "
                "counted in collator.stats",
                type(self).__name__, int(too_long.sum()), self.max_length, self.truncation_mode, dropped,
            )  # fmt: skip


def _pair_columns(features: list[Mapping[str, Any]]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Per pair key (prompt, chosen, rejected): every pair's ids back to back, and their lengths ``(B,)``."""
    flat: dict[str, np.ndarray] = {}
    lengths: dict[str, np.ndarray] = {}
    for key in _PAIR_KEYS:
        arrays = [_ids_array(v, i, key) for i, v in enumerate(_column(features, key))]
        flat[key] = np.concatenate(arrays)
        lengths[key] = np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays))
    return flat, lengths


def _sequence_lengths(
    lengths: dict[str, np.ndarray], n_pairs: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(S,)`` prompt, completion and total lengths of the ``S = 2B`` sequences; none may be empty."""
    # Sequence s < B is prompt_s + chosen_s, sequence B + s is prompt_s + rejected_s (TRL's row order).
    prompt_len = np.concatenate([lengths["prompt_ids"], lengths["prompt_ids"]])  # (S,)
    completion_len = np.concatenate([lengths["chosen_ids"], lengths["rejected_ids"]])  # (S,)
    seq_len = prompt_len + completion_len
    if (seq_len == 0).any():
        s = int(np.argmax(seq_len == 0))
        raise ValueError(
            f"sample {s % n_pairs}: prompt + {'chosen' if s < n_pairs else 'rejected'} is empty; drop empty "
            "pairs from the dataset"
        )
    return prompt_len, completion_len, seq_len


@dataclass
class PaddingFreeRewardCollator(PaddingFreePreferenceCollator):
    """Collate reward-model pairs (``chosen_ids``, ``rejected_ids``, optional ``margin``) into one packed row.

    The pairs of TRL's ``RewardTrainer`` carry no separate prompt (it is already part of both sequences):
    they are packed as :class:`PaddingFreePreferenceCollator` packs prompt-less pairs, with TRL's padded
    layout ``input_ids`` / ``attention_mask`` ``(2B, L)`` next to the packed row (chosen rows first, as
    ``trl.trainer.reward_trainer.DataCollatorForPreference`` builds them) and ``margin`` ``(B,)`` float32
    when the features have one.

    >>> batch = PaddingFreeRewardCollator()([{"chosen_ids": [1, 2], "rejected_ids": [3], "margin": 0.5}])
    >>> batch["packed_input_ids"].tolist(), batch["cu_seq_lens_q"].tolist(), batch["margin"].tolist()
    ([[1, 2, 3]], [0, 2, 3], [0.5])
    """

    input_columns: ClassVar[tuple[str, ...]] = ("chosen_ids", "rejected_ids", "margin")
    no_prefix_tree: ClassVar[str | None] = (
        "reward pairs are scored at each sequence's last token by the score head (PackedRewardForward), which "
        "reads a plain packed row"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.shared_prompt:
            raise ValueError("reward pairs carry no separate prompt to share; leave shared_prompt=False")

    def __call__(
        self, features: Iterable[Mapping[str, Any]], return_tensors: str | None = None
    ) -> dict[str, Any]:
        features, return_tensors = self._batch_arguments(features, return_tensors, "one pair")
        chosen, rejected = _column(features, "chosen_ids"), _column(features, "rejected_ids")
        pairs = [
            {"prompt_ids": [], "chosen_ids": c, "rejected_ids": r}
            for c, r in zip(chosen, rejected, strict=True)
        ]
        batch = super().__call__(pairs, return_tensors)
        if any("margin" in f for f in features):
            margin = _reference_logps(features, "margin")
            batch["margin"] = torch.from_numpy(margin) if return_tensors == "pt" else margin
        return batch
