"""The loss of a packed row cut over a sequence-parallel (SP) group: each rank's share, and what the step counts.

Under sequence parallelism every rank of a group holds one contiguous shard of the same packed ``[1, T]`` row
(:func:`packing_hf.attention.sequence_parallel.shard_packed_batch` cuts it, the attention's all-to-all lets each
shard see the whole row). The loss arithmetic is that of :mod:`packing_hf._loss`, computed on the *whole* row
and cut: :func:`shard_target_coefficients` gives every target of this rank's shard its factor in the row's
numerator (a sample cut by a shard edge is normalised by its whole weight), :func:`sequence_parallel_loss` (from
the logits) and :func:`sequence_parallel_chunked_loss` (from the LM head's input, in chunks of tokens) divide
this rank's part of the numerator by the step's denominator, and :func:`shard_loss_counts` counts each row once
toward that denominator (on the group's first rank). A prefix-tree row
(:class:`~packing_hf.tree_collator.PrefixTreeCollator`) carries its targets as (row, target, weight) pairs
instead of labels: :func:`shard_tree_pairs` gives each rank the pairs whose predicting row lies in its shard,
re-indexed to the shard (a branch row predicting several children's first tokens keeps all its pairs, on the
rank that holds it, wherever the children sit). The shares of a group's ranks add up to the loss of the row
on one process, for every ``loss_normalization`` / ``loss_weights``; summed over the group, the gradients are
the one-process gradients (DDP averages them: scale the loss by the number of processes, as packing_hf's
Trainer does).

What a shard batch carries, read here (set by ``shard_packed_batch``): ``shift_labels`` ``(1, T_rank)`` (this
rank's targets) and, under :data:`~packing_hf.varlen.SHARD_KEY`, the rank's
:class:`~packing_hf.attention.ulysses.SequenceShard`: ``rank``, ``offset`` / ``length`` (where its tokens sit
in the row), and the whole row's ``labels``, ``loss_weights``, ``position_ids`` and ``cu_seq_lens``.

>>> from packing_hf import PaddingFreeCollator
>>> from packing_hf.attention.sequence_parallel import shard_packed_batch
>>> shard = shard_packed_batch(PaddingFreeCollator()([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}]))
>>> shard_loss_counts(shard), shard_row_denominator(shard, "sample")  # one process: the whole row
((3.0, 2), 2.0)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ._loss import TREE_KEYS, loss_counts, step_denominator, target_coefficients
from .loss_head import LogitHead, linear_cross_entropy
from .varlen import IGNORE_INDEX, SHARD_KEY

__all__ = [
    "sequence_parallel_chunked_loss",
    "sequence_parallel_loss",
    "shard_loss_counts",
    "shard_row_denominator",
    "shard_target_coefficients",
    "shard_tree_pairs",
]


def shard_loss_counts(batch: dict) -> tuple[float, int]:
    """``(target weight, samples)`` of a shard's whole row (:func:`packing_hf._loss.loss_counts`), on the first
    rank of its group only (``(0.0, 0)`` on the others): summed over every rank of a step, each row counts once.

    >>> from packing_hf import PaddingFreeCollator
    >>> from packing_hf.attention.sequence_parallel import shard_packed_batch
    >>> shard = shard_packed_batch(PaddingFreeCollator()([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}]))
    >>> shard_loss_counts(shard)  # 3 targets, 2 samples
    (3.0, 2)
    """
    shard = batch[SHARD_KEY]
    if shard.rank != 0 or shard.labels is None:
        return 0.0, 0
    return _row_counts(shard)


def _row_counts(shard: Any) -> tuple[float, int]:
    return loss_counts(shard.labels, shard.loss_weights, shard.position_ids, shard.cu_seq_lens)


def sequence_parallel_loss(
    logits: torch.Tensor,
    batch: dict,
    normalization: str = "token",
    denominator: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """This rank's share of the loss of a sequence-parallel row: its targets' numerator over ``denominator``.

    The shares of the group's ranks add up to the loss of the whole row computed on one process, for every
    ``loss_normalization`` (a sample cut by a shard edge is normalised by its whole weight); sum the gradients
    over the group (DDP averages them: scale the loss by the number of processes, as packing_hf's Trainer does).

    Args:
        logits: ``(1, T_rank, V)`` the model's output on the shard.
        batch: what :func:`~packing_hf.attention.sequence_parallel.shard_packed_batch` returned (its
            ``shift_labels`` and shard).
        normalization: ``"token"``, ``"sample"`` or ``"sample_sum"`` (``docs/loss.md``).
        denominator: the step's denominator (its summed :func:`shard_loss_counts`, through
            :func:`packing_hf._loss.step_denominator`); ``None``: this row's own.

    Returns:
        A scalar that keeps the graph.

    >>> from packing_hf import PaddingFreeCollator
    >>> from packing_hf.attention.sequence_parallel import shard_packed_batch
    >>> shard = shard_packed_batch(PaddingFreeCollator()([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}]))
    >>> logits = torch.zeros(1, 5, 10)  # uniform over 10 tokens: every target costs log(10)
    >>> round(float(sequence_parallel_loss(logits, shard)), 4)
    2.3026
    """
    coefficients = shard_target_coefficients(batch, normalization).to(logits.device)
    targets = batch["shift_labels"].to(logits.device)
    per_token = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]),
        targets.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    ).view_as(coefficients)
    # where, not a product: an ignored target's loss must add exactly 0
    numerator = torch.where(coefficients > 0, per_token * coefficients, torch.zeros_like(per_token)).sum()
    if denominator is None:
        denominator = shard_row_denominator(batch, normalization)
    return numerator / denominator


def shard_target_coefficients(batch: dict, normalization: str = "token") -> torch.Tensor:
    """``(1, T_rank)`` float: the factor of each target of this rank's shard (``shift_labels``) in the row's loss
    numerator, computed on the whole row (a sample cut by a shard edge is normalised by its whole weight).

    >>> from packing_hf import PaddingFreeCollator
    >>> from packing_hf.attention.sequence_parallel import shard_packed_batch
    >>> shard = shard_packed_batch(PaddingFreeCollator()([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}]))
    >>> shard_target_coefficients(shard, "sample").tolist()  # 2 targets in sample 0, 1 in sample 1
    [[0.5, 0.5, 0.0, 1.0, 0.0]]
    """
    shard = batch[SHARD_KEY]
    if shard.labels is None:
        raise ValueError("the sharded row had no labels, so it has no loss; collate with labels")
    coefficients = target_coefficients(
        shard.labels, normalization, shard.loss_weights, shard.position_ids, shard.cu_seq_lens
    )  # (1, T - 1): the factor of the target of every token but the last
    return F.pad(coefficients, (0, 1))[:, shard.offset : shard.offset + shard.length]


def shard_row_denominator(batch: dict, normalization: str = "token") -> float:
    """The denominator of the loss of this shard's whole row alone (its target weight, or sample count).

    >>> from packing_hf import PaddingFreeCollator
    >>> from packing_hf.attention.sequence_parallel import shard_packed_batch
    >>> shard = shard_packed_batch(PaddingFreeCollator()([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}]))
    >>> shard_row_denominator(shard), shard_row_denominator(shard, "sample")
    (3.0, 2.0)
    """
    return float(step_denominator(_row_counts(batch[SHARD_KEY]), normalization))


def sequence_parallel_chunked_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    batch: dict,
    normalization: str = "token",
    denominator: float | torch.Tensor | None = None,
    *,
    bias: torch.Tensor | None = None,
    head: LogitHead | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """:func:`sequence_parallel_loss` from the LM head's input instead of its logits: the shard's targets are
    projected chunk by chunk (:func:`packing_hf.loss_head.linear_cross_entropy`), so the ``(T_rank, V)`` logits
    never exist whole. The same share of the row's loss, to float rounding.

    Args:
        hidden: ``(1, T_rank, H)`` the model's final hidden states on the shard (what its LM head receives).
        weight: ``(V, H)`` the LM head's weight (unsharded: under FSDP2, read it while the head's parameters are
            gathered, e.g. right after the forward of a root that keeps them); ``bias``: ``(V,)`` or ``None``.
        batch, normalization, denominator: as in :func:`sequence_parallel_loss`.
        head: the model's logit processing (:class:`~packing_hf.loss_head.LogitHead`; default none).
        chunk_size: tokens per chunk (default: automatic).

    Returns:
        A scalar that keeps the graph.

    >>> from packing_hf import PaddingFreeCollator
    >>> from packing_hf.attention.sequence_parallel import shard_packed_batch
    >>> shard = shard_packed_batch(PaddingFreeCollator()([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}]))
    >>> hidden, weight = torch.zeros(1, 5, 4), torch.ones(10, 4)  # uniform over 10 tokens: log(10) per target
    >>> round(float(sequence_parallel_chunked_loss(hidden, weight, shard)), 4)
    2.3026
    """
    shard = batch[SHARD_KEY]
    if hidden.dim() != 3 or tuple(hidden.shape[:2]) != (1, shard.length):
        raise ValueError(
            f"{shard!r}: hidden states of shape {tuple(hidden.shape)} are not (1, {shard.length}, hidden_size), "
            "the LM head's input on this rank's shard"
        )
    coefficients = shard_target_coefficients(batch, normalization)[0].to(hidden.device)  # (T_rank,)
    targets = batch["shift_labels"][0].to(hidden.device)
    mask = (targets != IGNORE_INDEX) & (coefficients > 0)  # only the targets are projected
    numerator, _ = linear_cross_entropy(
        hidden[0][mask],
        weight,
        targets[mask],
        bias,
        weights=coefficients[mask],
        head=head,
        chunk_size=chunk_size,
    )
    if denominator is None:
        denominator = shard_row_denominator(batch, normalization)
    return numerator / denominator


def shard_tree_pairs(pairs: dict, shard: Any) -> dict:
    """The target pairs of a prefix-tree row (:data:`packing_hf._loss.TREE_KEYS`) that this rank's shard predicts:
    those whose row lies in ``[shard.offset, shard.offset + shard.length)``, the rows re-indexed to the shard.

    Every pair is on exactly one rank of the group, so the group's numerators add up to the whole row's (a pair is
    computed from its predicting row's logits alone; the attention gave that row its ancestors' keys from the whole
    row). ``tree_samples`` is the whole row's (the step's denominator counts each row once:
    :func:`shard_loss_counts`'s rule, through :func:`packing_hf._loss.tree_loss_counts` on the group's first rank).

    Args:
        pairs: the row's ``tree_rows`` / ``tree_targets`` / ``tree_weights`` / ``tree_sample_weights`` ``(P,)``
            and ``tree_samples`` (0-d), as :class:`~packing_hf.tree_collator.PrefixTreeCollator` built them.
        shard: this rank's :class:`~packing_hf.attention.ulysses.SequenceShard` (``batch[SHARD_KEY]`` of
            :func:`~packing_hf.attention.sequence_parallel.shard_packed_batch`).

    Returns:
        The same keys, the first four cut to this shard's ``(P_rank,)`` pairs (``tree_rows`` in ``[0, T_rank)``).

    Raises:
        ValueError: a pair whose row is not a token of the row (it would be on no rank, its loss lost).

    >>> from packing_hf import PrefixTreeCollator
    >>> from packing_hf.attention.ulysses import SequenceShard
    >>> row = PrefixTreeCollator()([{"input_ids": [5, 6, 7]}, {"input_ids": [5, 6, 9]}])  # rows [5, 6, 7, 9]
    >>> row["tree_rows"].tolist(), row["tree_targets"].tolist()
    ([0, 1, 1], [6, 7, 9])
    >>> second = SequenceShard(None, 1, [2, 2], torch.tensor([0, 2, 3, 4]), row["position_ids"])  # tokens 2, 3
    >>> shard_tree_pairs(row, second)["tree_rows"].tolist()  # token 1, the branch row, is on the first rank
    []
    >>> first = SequenceShard(None, 0, [2, 2], torch.tensor([0, 2, 3, 4]), row["position_ids"])
    >>> shard_tree_pairs(row, first)["tree_targets"].tolist()
    [6, 7, 9]
    """
    rows = pairs[TREE_KEYS[0]]
    total = sum(shard.lengths)
    lowest, highest = torch.stack(torch.aminmax(rows)).tolist() if rows.numel() else (0, -1)  # one host read
    if lowest < 0 or highest >= total:
        raise ValueError(
            f"{shard!r}: the prefix-tree row's target pairs name rows {lowest}..{highest}, not all "
            f"among its {total} tokens; pass the pairs PrefixTreeCollator built with the row"
        )
    mine = (rows >= shard.offset) & (rows < shard.offset + shard.length)
    out = {key: pairs[key][mine] for key in TREE_KEYS[1:4]}
    out[TREE_KEYS[0]] = rows[mine] - shard.offset
    out[TREE_KEYS[4]] = pairs[TREE_KEYS[4]]
    return out
