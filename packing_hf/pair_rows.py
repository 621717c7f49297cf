"""Collators for rows TRL's ORPO, CPO and TPO trainers tokenize themselves: packed rows next to TRL's padded
layout, so TRL's loss code runs unchanged on per-token results scattered back.

- :class:`PaddingFreePairCollator`: ORPO / CPO rows (``chosen_input_ids`` / ``chosen_labels`` /
  ``rejected_input_ids`` / ``rejected_labels``) as ``2B`` prompt-less segments;
- :class:`PaddingFreeTripleCollator`: TPO rows (``prompt_ids`` and ``chosen`` / ``rejected`` / ``reference``
  answers) as ``3B`` (or ``2B``) segments.

Both are :class:`~packing_hf.preference.PaddingFreePreferenceCollator` subclasses (data layer: no TRL needed).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from .preference import PaddingFreePreferenceCollator, _ids_array
from .varlen import IGNORE_INDEX, INT32_MAX

__all__ = ["LABELS_KEY", "TRIPLE_BRANCHES", "PaddingFreePairCollator", "PaddingFreeTripleCollator"]

logger = logging.getLogger(__name__)

LABELS_KEY = "concatenated_labels"
_SEQUENCE_KEYS = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")
TRIPLE_BRANCHES = ("chosen", "rejected", "reference")


@dataclass
class PaddingFreePairCollator(PaddingFreePreferenceCollator):
    """Collate rows tokenized by TRL's ORPO / CPO trainers into one packed row of ``2B`` segments.

    Input: ``B`` feature dicts with ``chosen_input_ids``, ``chosen_labels``, ``rejected_input_ids``,
    ``rejected_labels`` (lists of ints; a sequence's labels are its own tokens, ``-100`` where not trained);
    other keys are ignored. Output (``S = 2B``, chosen first; ``L`` the longest; ``T`` the packed tokens): the
    keys of :class:`~packing_hf.preference.PaddingFreePreferenceCollator` for prompt-less pairs
    (``packed_input_ids``, ``position_ids``, ``cu_seq_lens_q/k``, ``max_length_q/k``, ``packed_index``, and
    the padded ``input_ids`` / ``attention_mask`` ``(S, L)``), plus ``concatenated_labels`` ``(S, L)`` int64:
    the labels in TRL's padded layout (``-100`` on padding).

    >>> batch = PaddingFreePairCollator()([{"chosen_input_ids": [1, 2, 3], "chosen_labels": [-100, 2, 3],
    ...     "rejected_input_ids": [1, 4], "rejected_labels": [-100, 4]}])
    >>> batch["packed_input_ids"].tolist(), batch["cu_seq_lens_q"].tolist()
    ([[1, 2, 3, 1, 4]], [0, 3, 5])
    >>> batch["concatenated_labels"].tolist()
    [[-100, 2, 3], [-100, 4, -100]]
    """

    input_columns: ClassVar[tuple[str, ...]] = _SEQUENCE_KEYS
    no_row_padding: ClassVar[str | None] = "packed ORPO / CPO rows take no padding segment"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.shared_prompt:
            raise ValueError(
                "TRL's ORPO / CPO rows hold the prompt inside both sequences; leave shared_prompt=False"
            )

    def __call__(
        self, features: Iterable[Mapping[str, Any]], return_tensors: str | None = None
    ) -> dict[str, Any]:
        features, return_tensors = self._batch_arguments(features, return_tensors, "one pair")
        missing = [k for k in _SEQUENCE_KEYS if any(k not in f for f in features)]
        if missing:
            raise ValueError(
                f"a feature lacks {missing} (keys: {sorted(features[0])}): PaddingFreePairCollator takes rows "
                "tokenized by TRL's ORPO / CPO trainers"
            )
        sides = ("chosen", "rejected")
        ids = [np.asarray(f[f"{side}_input_ids"], dtype=np.int64) for side in sides for f in features]
        labels = [np.asarray(f[f"{side}_labels"], dtype=np.int64) for side in sides for f in features]
        for s, (i, lab) in enumerate(zip(ids, labels, strict=True)):
            trained = lab != IGNORE_INDEX
            if lab.shape != i.shape or (lab[trained] != i[trained]).any():
                side = sides[s // len(features)]
                raise ValueError(
                    f"pair {s % len(features)}: {side}_labels must be {side}_input_ids with -100 on untrained "
                    f"tokens (got {lab.size} labels for {i.size} tokens, or labels that are other tokens)"
                )
        pairs = [
            {"prompt_ids": [], "chosen_ids": c, "rejected_ids": r}
            for c, r in zip(ids[: len(features)], ids[len(features) :], strict=True)
        ]
        batch = super().__call__(pairs, "np")
        del batch["completion_mask"]  # prompt-less pairs: all ones, and TRL's labels say what is trained
        padded = np.full(batch["input_ids"].shape, IGNORE_INDEX, dtype=np.int64)
        if self.max_length is not None:  # the labels cut as the ids were (overflow="truncate")
            m = self.max_length
            labels = [
                lab[:m] if self.truncation_mode == "keep_start" else lab[max(lab.size - m, 0) :]
                for lab in labels
            ]
        padded[batch["attention_mask"].astype(bool)] = np.concatenate(labels)  # row-major: sequence order
        batch[LABELS_KEY] = padded
        if return_tensors == "pt":
            batch = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in batch.items()}
        return batch


@dataclass
class PaddingFreeTripleCollator(PaddingFreePreferenceCollator):
    """Collate rows tokenized by TRL's ``TPOTrainer`` into one packed row of ``S`` segments.

    Input: ``B`` feature dicts with ``prompt_ids``, ``chosen_ids``, ``rejected_ids`` and (when
    ``include_reference``) ``reference_ids``, lists / arrays / tensors of ints; other keys are ignored. The
    sequences are ``prompt + answer``, in TRL's order: the ``B`` chosen ones, the ``B`` rejected ones, then the
    ``B`` reference ones (``S = 3B``; ``S = 2B`` without reference). Output (``L`` the longest sequence, ``T``
    the packed tokens): ``packed_input_ids`` ``(1, T)`` int64, ``position_ids`` ``(1, T)`` int64,
    ``cu_seq_lens_q/k`` ``(S + 1,)`` int32, ``max_length_q/k`` int, ``packed_index`` ``(T,)`` int64 (as
    :class:`~packing_hf.preference.PaddingFreePreferenceCollator`'s: flat index into ``(S, L)`` of every token
    that is a prediction target, ``S * L`` for segment starts), and TRL's right-padded ``input_ids``,
    ``attention_mask``, ``completion_mask`` ``(S, L)`` int64.

    Args:
        include_reference: pack the reference sequences (TRL drops them when ``tpo_alpha=0``).
        max_length, overflow, truncation_mode: a sequence longer than ``max_length``: ``"error"`` (default)
            raises; ``"truncate"`` cuts it as TRL's ``DataCollatorForTriplePreference`` does, counted in
            :attr:`stats`. Other arguments as :class:`~packing_hf.preference.PaddingFreePreferenceCollator`;
            ``shared_prompt``, ``pad_to_multiple_of``, ``length_buckets`` and ``segment_buckets`` are refused.

    >>> collator = PaddingFreeTripleCollator()
    >>> batch = collator([{"prompt_ids": [1], "chosen_ids": [2], "rejected_ids": [3, 4], "reference_ids": [5]}])
    >>> batch["packed_input_ids"].tolist(), batch["cu_seq_lens_q"].tolist()
    ([[1, 2, 1, 3, 4, 1, 5]], [0, 2, 5, 7])
    >>> batch["completion_mask"].tolist()
    [[0, 1, 0], [0, 1, 1], [0, 1, 0]]
    """

    include_reference: bool = True

    input_columns: ClassVar[tuple[str, ...]] = ("prompt_ids", "chosen_ids", "rejected_ids", "reference_ids")
    no_prefix_tree: ClassVar[str | None] = (
        "TPO scores its packed rows with a shifted forward of its own, which reads no prefix tree"
    )
    no_row_padding: ClassVar[str | None] = "packed TPO rows take no padding"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.shared_prompt:
            raise ValueError("PaddingFreeTripleCollator does not share prompts; leave shared_prompt=False")
        if not (self.return_flash_attn_kwargs and self.return_position_ids):
            raise ValueError(
                "PaddingFreeTripleCollator needs return_flash_attn_kwargs=True and return_position_ids=True: "
                "the segment boundaries are what keeps the sequences apart"
            )

    def __call__(
        self, features: Iterable[Mapping[str, Any]], return_tensors: str | None = None
    ) -> dict[str, Any]:
        features, return_tensors = self._batch_arguments(features, return_tensors, "one example")
        branches = TRIPLE_BRANCHES if self.include_reference else TRIPLE_BRANCHES[:2]
        keys = ("prompt_ids", *(f"{b}_ids" for b in branches))
        missing = [k for k in keys if any(k not in f for f in features)]
        if missing:
            raise ValueError(
                f"a feature lacks {missing} (keys: {sorted(features[0])}): PaddingFreeTripleCollator takes rows "
                "tokenized by TRL's TPOTrainer"
            )
        n = len(features)
        prompts = [_ids_array(f["prompt_ids"], i, "prompt_ids") for i, f in enumerate(features)]
        sequences, completions = [], []  # TRL's row order: branch by branch
        for branch in branches:
            for i, f in enumerate(features):
                answer = _ids_array(f[f"{branch}_ids"], i, f"{branch}_ids")
                sequences.append(np.concatenate([prompts[i], answer]))
                completions.append(
                    np.repeat(np.array([0, 1], dtype=np.int64), [prompts[i].size, answer.size])
                )
        seq_len = np.fromiter(map(len, sequences), dtype=np.int64, count=len(sequences))
        if (seq_len == 0).any():
            s = int(np.argmax(seq_len == 0))
            raise ValueError(f"example {s % n}: prompt + {branches[s // n]} is empty; drop empty examples")
        sequences, completions, seq_len = self._truncate(sequences, completions, seq_len, branches, n)
        n_seq, width = seq_len.size, int(seq_len.max())
        cu = np.zeros(n_seq + 1, dtype=np.int64)
        np.cumsum(seq_len, out=cu[1:])
        if cu[-1] > INT32_MAX or n_seq * width > INT32_MAX:
            raise ValueError(
                f"the batch holds {int(cu[-1])} tokens ({n_seq} x {width} padded), more than int32 offsets can "
                f"address ({INT32_MAX}); use fewer examples per batch"
            )
        row = np.repeat(np.arange(n_seq, dtype=np.int64), seq_len)  # (T,) sequence of every packed token
        offsets = np.arange(int(cu[-1]), dtype=np.int64) - np.repeat(cu[:-1], seq_len)  # (T,) its position
        flat = row * width + offsets  # (T,) its place in the padded layout
        packed_index = flat.copy()
        packed_index[cu[:-1]] = n_seq * width  # segment starts are never prediction targets
        ids = np.concatenate(sequences)
        padded = {
            "input_ids": np.full(n_seq * width, self.pad_token_id, dtype=np.int64),
            "attention_mask": np.zeros(n_seq * width, dtype=np.int64),
            "completion_mask": np.zeros(n_seq * width, dtype=np.int64),
        }
        padded["input_ids"][flat] = ids
        padded["attention_mask"][flat] = 1
        padded["completion_mask"][flat] = np.concatenate(completions)

        self.stats["batches"] += 1
        self.stats["pairs"] += n
        self.stats["samples"] += n_seq
        self.stats["tokens"] += int(cu[-1])
        self.stats["padded_layout_tokens"] += n_seq * width
        batch: dict[str, Any] = {
            "packed_input_ids": ids[None],
            "packed_index": packed_index,
            "position_ids": (offsets + self.position_ids_start)[None],
            **{k: v.reshape(n_seq, width) for k, v in padded.items()},
        }
        self._segment_keys(batch, cu, seq_len)  # cu_seq_lens_q/k, and seq_idx when return_seq_idx
        if return_tensors == "pt":
            batch = {k: torch.from_numpy(v) for k, v in batch.items()}
        batch["max_length_q"] = batch["max_length_k"] = width
        return batch

    def _truncate(
        self, sequences: list, completions: list, seq_len: np.ndarray, branches: tuple, n: int
    ) -> tuple[list, list, np.ndarray]:
        """``max_length`` on every sequence: raise, or cut as TRL's collator does (``truncation_mode``)."""
        too_long = self._over_max_length(seq_len, n, branches, "example", "examples")
        if too_long is None:
            return sequences, completions, seq_len
        m = self.max_length
        cut = slice(None, m) if self.truncation_mode == "keep_start" else slice(-m, None)
        self._count_truncated(too_long, int((seq_len - m)[too_long].sum()))
        return [s[cut] for s in sequences], [c[cut] for c in completions], np.minimum(seq_len, m)
