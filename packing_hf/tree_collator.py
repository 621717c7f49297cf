"""PrefixTreeCollator: a micro-batch of tokenized samples as one prefix-tree row, and the loss targets of its rows.

Samples that begin with the same tokens (a conversation cut into one sample per assistant turn, a shared system
prompt) are merged by :func:`packing_hf.prefix_tree.build_prefix_tree` into one packed row that stores and computes
every shared prefix once (``prefix_seq_idx`` names every segment's parent; packing_hf's attention lets a segment
see its ancestors, never its siblings).

The labels cannot stay one per row token. A sample's token ``j`` is predicted from the logits of its token
``j - 1`` (Hugging Face's shifted labels): at a branch point, the parent's last row predicts the first token of
*every* child, and a token shared by several samples may be a target in one sample and context in another (per-turn
SFT: an earlier assistant turn is trained in its own sample and masked in the next). So the row carries its targets
as pairs: one per distinct ``(row, target token)``, with the summed weight of the samples that train it there:

- ``tree_rows`` ``(P,)`` int64: the row token whose logits predict the target;
- ``tree_targets`` ``(P,)`` int64: the target token id;
- ``tree_weights`` ``(P,)`` float32: ``sum_s w_s`` over the samples ``s`` labelling that target at that row
  (``w`` is the sample's ``loss_weights`` value, 1 without the column; a masked token adds nothing);
- ``tree_sample_weights`` ``(P,)`` float32: ``sum_s w_s / W_s`` (``W_s``: the sample's summed target weight), the
  coefficient of ``loss_normalization="sample"``;
- ``tree_samples``: 0-d int64, the samples with ``W_s > 0`` (the denominator of ``"sample"`` / ``"sample_sum"``).

The loss of the row, ``sum_p c_p * CE(logits[tree_rows[p]], tree_targets[p])``, is then exactly the sum of every
sample's own loss, with the LM head run on the distinct pairs only (about the row's tokens plus its branch edges),
never once per sample token (:func:`packing_hf._loss.tree_coefficients`, the trainers' ``LossRoute.PREFIX_TREE``).

>>> collator = PrefixTreeCollator()
>>> batch = collator([{"input_ids": [5, 6, 7], "completion_mask": [0, 1, 1]},
...                   {"input_ids": [5, 6, 9], "completion_mask": [0, 1, 1]}])
>>> batch["input_ids"].tolist(), batch["prefix_seq_idx"].tolist(), batch["position_ids"].tolist()
([[5, 6, 7, 9]], [-1, 0, 0], [[0, 1, 2, 2]])
>>> batch["tree_rows"].tolist(), batch["tree_targets"].tolist(), batch["tree_weights"].tolist()
([0, 1, 1], [6, 7, 9], [2.0, 1.0, 1.0])
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from ._limits import check_int
from ._loss import LOSS_WEIGHTS_KEY, TREE_KEYS
from .collator import PaddingFreeCollator
from .prefix_tree import PrefixTree, build_prefix_tree

__all__ = ["PrefixTreeCollator", "tree_attended_squares"]


def tree_attended_squares(cu_seqlens: Any, prefix_seq_idx: Any) -> int:
    """The attention work of a prefix-tree row in the units of a sample's squared length: a segment of ``L``
    tokens after ``A`` ancestor tokens attends as the last ``L`` queries of a sample of ``A + L`` tokens, so it adds
    ``(A + L)**2 - A**2``; a chain computed whole sums to its length squared.

    >>> tree_attended_squares([0, 3, 5, 6], [-1, 0, 0])  # 3**2, then (3 + 2)**2 - 9, (3 + 1)**2 - 9
    32
    """
    cu = np.asarray(cu_seqlens, dtype=np.int64).reshape(-1)
    parents = np.asarray(prefix_seq_idx, dtype=np.int64).reshape(-1)
    lengths = np.diff(cu)
    ancestors = np.zeros(lengths.size, dtype=np.int64)  # tokens of every segment's ancestors
    for i, p in enumerate(parents.tolist()):
        if p >= 0:
            ancestors[i] = ancestors[p] + lengths[p]
    return int(((ancestors + lengths) ** 2 - ancestors**2).sum())


@dataclass
class PrefixTreeCollator:
    """Collate samples into one prefix-tree row ``[1, T]`` whose shared prefixes are stored and computed once.

    The samples are first laid out as :class:`~packing_hf.PaddingFreeCollator` lays them out (the same keys read
    and checked: ``input_ids``, ``labels``, TRL's ``completion_mask`` / ``assistant_masks``, ``loss_weights``,
    ``seq_lengths`` of offline-packed rows, the same ``max_length`` / ``overflow``), so every segment it would make
    (a sample, a split piece) is a sample of the tree, with the same targets: its first token is never a target.
    The segments are then merged by :func:`~packing_hf.prefix_tree.build_prefix_tree`.

    Output (``T`` tokens of the tree, ``n`` segments, ``P`` target pairs; see the module docstring for the pairs):

    - ``input_ids``, ``position_ids``: ``[1, T]`` int64 (positions continue from the parent's end);
    - ``cu_seq_lens_q``, ``cu_seq_lens_k``: ``(n + 1,)`` int32; ``max_length_q``, ``max_length_k``: ints;
    - ``prefix_seq_idx``: ``(n,)`` int32, every segment's parent (``-1``: a root);
    - ``tree_rows``, ``tree_targets``: ``(P,)`` int64; ``tree_weights``, ``tree_sample_weights``: ``(P,)`` float32;
      ``tree_samples``: 0-d int64.

    No ``labels``: a loss computed per row token (the model's own, shifted within each segment) would miss every
    child's first target and count a shared target once; the loss is the pairs' (``LossRoute.PREFIX_TREE`` of
    ``packing_hf.Trainer`` / ``SFTTrainer`` with ``share_prefixes=True``).

    Args:
        min_shared_tokens: the shortest run of tokens a node shared by several samples may hold (>= 1; see
            :func:`~packing_hf.prefix_tree.build_prefix_tree`).
        max_length, overflow: as in :class:`~packing_hf.PaddingFreeCollator` (a split piece is a sample of its own).
        position_ids_start: the first position of every sample.
        drop_keys: extra keys to drop without an error (raw text columns kept next to the tokens).

    Attributes:
        stats: running counters: ``batches``, ``samples``, ``tokens`` (tokens of the tree rows: what the model
            computes), ``sample_tokens`` (the same samples' tokens, each alone), ``padding_tokens`` (always 0),
            ``pairs`` (target pairs) and the flat layout's overflow counters.

    >>> out = PrefixTreeCollator()([{"input_ids": [1, 2, 3]}, {"input_ids": [1, 2, 3, 4]}, {"input_ids": [8]}])
    >>> out["cu_seq_lens_q"].tolist(), out["prefix_seq_idx"].tolist(), int(out["tree_samples"])
    ([0, 3, 4, 5], [-1, 0, -1], 2)
    """

    min_shared_tokens: int = 1
    max_length: int | None = None
    overflow: Literal["error", "truncate", "split"] = "error"
    position_ids_start: int = 0
    drop_keys: tuple[str, ...] = ()
    stats: dict[str, int] = field(default_factory=dict, init=False, compare=False)
    _flat: PaddingFreeCollator = field(init=False, repr=False, compare=False)

    #: dataset columns this collator consumes: a Trainer must not strip them (remove_unused_columns)
    input_columns: ClassVar[tuple[str, ...]] = PaddingFreeCollator.input_columns

    def __post_init__(self) -> None:
        check_int(self.min_shared_tokens, "min_shared_tokens", minimum=1)
        # the flat layout checks every other field (and refuses what it cannot honour) by its own rules
        self._flat = PaddingFreeCollator(
            max_length=self.max_length,
            overflow=self.overflow,
            position_ids_start=self.position_ids_start,
            drop_keys=self.drop_keys,
            return_tensors="np",
        )
        self.drop_keys = self._flat.drop_keys
        self.reset_stats()

    def reset_stats(self) -> None:
        """Zero the counters in :attr:`stats`."""
        self._flat.reset_stats()
        self.stats = {**self._flat.stats, "sample_tokens": 0, "pairs": 0}

    def __call__(self, features: Iterable[Mapping[str, Any]], return_tensors: str = "pt") -> dict[str, Any]:
        if return_tensors not in ("pt", "np"):
            raise ValueError(f"return_tensors must be 'pt' or 'np', got {return_tensors!r}")
        flat = self._flat(features)
        ids, labels = flat["input_ids"][0], flat["labels"][0]  # (S,): the samples' tokens, one after another
        weights = flat.get(LOSS_WEIGHTS_KEY)
        cu = flat["cu_seq_lens_q"].astype(np.int64)  # (s + 1,): one segment per sample of the tree
        tree = build_prefix_tree(
            [ids[a:b] for a, b in zip(cu[:-1], cu[1:], strict=True)], min_shared_tokens=self.min_shared_tokens
        )
        pairs = _target_pairs(tree, labels, None if weights is None else weights[0], cu)
        batch: dict[str, Any] = {
            **tree.model_inputs(),
            # every segment's positions continue its parent's, from position_ids_start instead of 0
            "position_ids": tree.position_ids[None] + self.position_ids_start,
            "cu_seq_lens_k": tree.cu_seqlens.clone(),
            **pairs,
        }
        self._count(tree, ids.size, pairs)
        if return_tensors == "np":
            batch = {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        return batch

    def _count(self, tree: PrefixTree, sample_tokens: int, pairs: dict[str, torch.Tensor]) -> None:
        flat = self._flat.stats
        self.stats.update({k: v for k, v in flat.items() if k not in ("tokens",)})
        self.stats["tokens"] += tree.input_ids.numel()
        self.stats["sample_tokens"] += sample_tokens
        self.stats["pairs"] += pairs["tree_rows"].numel()


def _target_pairs(
    tree: PrefixTree, labels: np.ndarray, weights: np.ndarray | None, cu: np.ndarray
) -> dict[str, torch.Tensor]:
    """The row's target pairs (see the module docstring) from the samples' flat ``labels`` ``(S,)`` (their first
    token masked, as the flat layout masks it), ``weights`` ``(S,)`` or ``None`` and boundaries ``cu`` ``(s + 1,)``."""
    index = tree.sample_index.numpy()  # (S,) the row token of every sample token
    sample_of = np.repeat(np.arange(cu.size - 1), np.diff(cu))  # (S,)
    at = np.flatnonzero(labels != -100)  # flat positions of the targets (never a sample's first token)
    w = np.ones(at.size, dtype=np.float64) if weights is None else weights[at].astype(np.float64)
    keep = w > 0  # a target weighing 0 is not trained (as a -100 label)
    at, w = at[keep], w[keep]
    samples = sample_of[at]
    per_sample = np.bincount(samples, weights=w, minlength=cu.size - 1)  # (s,) W_s
    rows, targets = index[at - 1], labels[at].astype(np.int64)
    # one pair per distinct (row, target): samples through a shared row add their weights there
    keys, inverse = np.unique(np.stack([rows, targets]), axis=1, return_inverse=True)
    inverse = inverse.reshape(-1)
    summed = np.bincount(inverse, weights=w, minlength=keys.shape[1])
    by_sample = np.bincount(inverse, weights=w / per_sample[samples], minlength=keys.shape[1])
    values = (  # in the order of TREE_KEYS: rows, targets, weights, sample weights, samples
        torch.from_numpy(np.ascontiguousarray(keys[0])),
        torch.from_numpy(np.ascontiguousarray(keys[1])),
        torch.from_numpy(summed.astype(np.float32)),
        torch.from_numpy(by_sample.astype(np.float32)),
        torch.tensor(int((per_sample > 0).sum()), dtype=torch.int64),
    )
    return dict(zip(TREE_KEYS, values, strict=True))
