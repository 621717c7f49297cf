"""Padding-free unpaired preference batches (KTO): the completions and the KL completions as two packed rows.

TRL's ``KTOTrainer`` scores every example's ``prompt + completion`` and, for its KL estimate, the same
prompt with a mismatched completion (``KL_completion_ids``, rotated in from a neighbouring example), in two
separate forwards over right-padded ``(B, L)`` batches. :class:`PaddingFreeUnpairedCollator` gives each of
the two its own packed ``[1, T]`` row of ``B`` segments, next to the padded layout TRL's loss code reads
(``input_ids`` / ``attention_mask`` / ``completion_mask`` and their ``KL_`` twins, the widths TRL pads
to), linked by ``packed_index`` exactly as in :mod:`packing_hf.preference`. The KL row's keys carry a
``KL_`` prefix (``KL_packed_input_ids``, ``KL_position_ids``, ``KL_cu_seq_lens_q``, ...).

>>> batch = PaddingFreeUnpairedCollator()([
...     {"prompt_ids": [1, 2], "completion_ids": [3], "KL_completion_ids": [4, 5], "label": True},
...     {"prompt_ids": [6], "completion_ids": [4, 5], "KL_completion_ids": [3], "label": False}])
>>> batch["packed_input_ids"].tolist(), batch["input_ids"].tolist(), batch["packed_index"].tolist()
([[1, 2, 3, 6, 4, 5]], [[1, 2, 3], [6, 4, 5]], [6, 1, 2, 6, 4, 5])
>>> batch["KL_packed_input_ids"].tolist(), batch["KL_cu_seq_lens_q"].tolist(), batch["label"].tolist()
([[1, 2, 4, 5, 6, 3]], [0, 4, 6], [True, False])
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from .preference import PaddingFreePreferenceCollator, _column, _reference_logps

__all__ = ["KL_PREFIX", "ROW_KEYS", "PaddingFreeUnpairedCollator"]

KL_PREFIX = "KL_"
# The keys describing one packed row (the KL row has them with KL_PREFIX).
ROW_KEYS = (
    "packed_input_ids",
    "packed_index",
    "position_ids",
    "seq_idx",
    "cu_seq_lens_q",
    "cu_seq_lens_k",
    "max_length_q",
    "max_length_k",
)
_LAYOUT_KEYS = ("input_ids", "attention_mask", "completion_mask")


@dataclass
class PaddingFreeUnpairedCollator(PaddingFreePreferenceCollator):
    """Collate KTO examples into a packed row of completions and a packed row of KL completions.

    Input: ``B`` feature dicts as TRL's ``KTOTrainer`` prepares them: ``prompt_ids``, ``completion_ids``,
    ``label`` (bool), optionally ``KL_completion_ids`` (the mismatched completion of the KL term; both rows
    are built only when every example has one) and precomputed ``ref_logps`` / ``ref_KL_logps`` (floats).

    Output (``S = B`` sequences per row, ``L`` / ``L_KL`` the longest of each, ``T`` / ``T_KL`` packed
    tokens): ``packed_input_ids`` ``(1, T)``, ``packed_index`` ``(T,)``, ``position_ids`` ``(1, T)``,
    ``cu_seq_lens_q/k`` ``(B + 1,)`` int32, ``max_length_q/k``; ``input_ids``, ``attention_mask``,
    ``completion_mask`` ``(B, L)`` int64 (TRL's right-padded layout); the same with a ``KL_`` prefix for the
    KL row; ``label`` ``(B,)`` bool; ``ref_logps``, ``ref_KL_logps`` ``(B,)`` float32 when given.

    Args: those of :class:`~packing_hf.preference.PaddingFreePreferenceCollator`. ``max_length`` with
        ``overflow="truncate"`` keeps the first ``max_length`` tokens of every sequence, as TRL's
        ``DataCollatorForUnpairedPreference`` does (``truncation_mode`` must stay ``"keep_start"``).
        Refused: ``shared_prompt`` (the two rows run in separate forwards) and ``pad_to_multiple_of``,
        ``length_buckets``, ``segment_buckets`` (they would pad only one of the rows).

    >>> collator = PaddingFreeUnpairedCollator(max_length=2, overflow="truncate")
    >>> batch = collator([{"prompt_ids": [1], "completion_ids": [2, 3], "label": False, "ref_logps": -1.0}])
    >>> batch["packed_input_ids"].tolist(), batch["completion_mask"].tolist(), batch["ref_logps"].tolist()
    ([[1, 2]], [[0, 1]], [-1.0])
    >>> "KL_packed_input_ids" in batch
    False
    """

    input_columns: ClassVar[tuple[str, ...]] = (
        "prompt_ids",
        "completion_ids",
        "KL_completion_ids",
        "label",
        "ref_logps",
        "ref_KL_logps",
    )
    # the completions and the KL completions are cut into two rows: a padding segment would end only one
    no_row_padding: ClassVar[str | None] = (
        "unpaired (KTO) batches are split into a row of completions and a row of KL completions, and padding "
        "would end only one of them"
    )
    no_prefix_tree: ClassVar[str | None] = (
        "the completions and the KL completions run in separate forwards of plain packed rows (KTO)"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.shared_prompt:
            raise ValueError(
                "shared_prompt=True: the completions and the KL completions run in separate forwards, so "
                "there is no pair to share a prompt with; leave shared_prompt=False"
            )
        if self.truncation_mode != "keep_start":
            raise ValueError(
                "TRL's KTO truncates every sequence keeping its start; truncation_mode must be 'keep_start'"
            )

    def __call__(
        self, features: Iterable[Mapping[str, Any]], return_tensors: str | None = None
    ) -> dict[str, Any]:
        features, return_tensors = self._batch_arguments(features, return_tensors, "one example")
        labels = _column(features, "label")
        with_kl = all(isinstance(f, Mapping) and "KL_completion_ids" in f for f in features)
        prompts, completions = _column(features, "prompt_ids"), _column(features, "completion_ids")
        kl_completions = _column(features, "KL_completion_ids") if with_kl else completions
        # both rows as one preference batch: sequence s < B is prompt_s + completion_s, B + s its KL twin
        pairs = [
            {"prompt_ids": p, "chosen_ids": c, "rejected_ids": k}
            for p, c, k in zip(prompts, completions, kl_completions, strict=True)
        ]
        both = super().__call__(pairs, "np")
        n = len(features)
        batch: dict[str, Any] = {}
        for prefix, rows in (("", slice(0, n)), (KL_PREFIX, slice(n, 2 * n))):
            if prefix and not with_kl:
                break
            batch.update({prefix + k: v for k, v in _split_row(both, rows, n).items()})
        if not with_kl:  # the KL twins (copies of the completions) only served to build the row
            self.stats["samples"] -= n
        batch["label"] = np.asarray([_check_label(i, v) for i, v in enumerate(labels)], dtype=bool)
        for key in ("ref_logps", "ref_KL_logps"):
            if any(key in f for f in features):
                batch[key] = _reference_logps(features, key)
        if return_tensors == "pt":
            batch = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in batch.items()}
        return batch


def _check_label(index: int, value: Any) -> bool:
    """Sample ``index``'s KTO ``label`` as a bool: what TRL accepts (a bool, or the ints 0 / 1), nothing else.

    ``bool("false")`` is True: a label read from text would flip silently, so strings (and any other type) are
    refused with the fix.

    >>> _check_label(0, np.bool_(False)), _check_label(1, 1)
    (False, True)
    >>> _check_label(2, "false")
    Traceback (most recent call last):
    ...
    TypeError: sample 2: 'label' is 'false' (a str); KTO labels must be booleans (True: desirable), or the ints 0 / 1. Convert the column, e.g. dataset.map(lambda r: {'label': r['label'] == 'true'})
    """
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool | np.bool_):
        return bool(value)
    if isinstance(value, numbers.Integral) and value in (0, 1):
        return bool(value)
    raise TypeError(
        f"sample {index}: 'label' is {value!r} (a {type(value).__name__}); KTO labels must be booleans (True: "
        "desirable), or the ints 0 / 1. Convert the column, e.g. dataset.map(lambda r: {'label': r['label'] == "
        "'true'})"
    )


def _split_row(both: dict[str, Any], rows: slice, n: int) -> dict[str, Any]:
    """One half (``rows``) of a ``2n``-sequence preference batch as its own packed row and padded layout.

    The half's padded layout is cut to its own longest sequence (what TRL pads it to) and
    ``packed_index`` is renumbered into it; its sentinel becomes ``n * width``.
    """
    attention = both["attention_mask"][rows]
    width = int(attention.sum(1).max())
    old_width = both["attention_mask"].shape[1]
    cu = np.concatenate([[0], np.cumsum(both["attention_mask"].sum(1))])  # (2n + 1,) segments in order
    start, stop = int(cu[rows.start]), int(cu[rows.stop])
    index = both["packed_index"][start:stop]
    valid = index < 2 * n * old_width
    row, column = index // old_width - rows.start, index % old_width
    out: dict[str, Any] = {key: both[key][rows, :width] for key in _LAYOUT_KEYS}
    out["packed_input_ids"] = both["packed_input_ids"][:, start:stop]
    out["packed_index"] = np.where(valid, row * width + column, n * width)
    lengths = np.diff(cu[rows.start : rows.stop + 1])
    if "position_ids" in both:
        out["position_ids"] = both["position_ids"][:, start:stop]
    if "seq_idx" in both:
        out["seq_idx"] = both["seq_idx"][:, start:stop] - rows.start
    if "cu_seq_lens_q" in both:  # (from the flash-attention kwargs)
        out["cu_seq_lens_q"] = (cu[rows.start : rows.stop + 1] - start).astype(np.int32)
        out["cu_seq_lens_k"] = out["cu_seq_lens_q"].copy()
        out["max_length_q"] = out["max_length_k"] = int(lengths.max())
    return out
