"""Packed rows for online RL: TRL's padded prompt + completion batch as segments of packed ``[1, T]`` rows.

TRL's GRPO/RLOO score a micro-batch of ``B`` rollouts as one ``(B, P + C)`` tensor: left-padded prompts of
width ``P`` next to right-padded completions of width ``C``, ``attention_mask`` 1 on real tokens. The
per-token results live in the ``(B, C)`` completion layout (``log_probs[:, -C:]`` of the fused LM head).
:func:`pack_rollouts` lays every rollout's real tokens (prompt then completion) out as one segment of a
packed row, restarting ``position_ids`` and ``cu_seq_lens``, and records where every shifted packed
position lands in the ``(B, C)`` layout; :func:`unpack_rollouts` scatters per-token outputs back there, with
zeros wherever the padded forward's fused head writes zeros (every position that is not a real completion
token). With ``max_tokens_per_batch``, rollouts are bin-packed into several rows of at most that many tokens
(a rollout is never split).

>>> import torch
>>> ids = torch.tensor([[0, 5, 6, 7, 0], [8, 9, 4, 3, 2]])  # P = 2 (left-padded), C = 3 (right-padded)
>>> mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
>>> [pack] = pack_rollouts(ids, mask, logits_to_keep=3)
>>> pack.input_ids.tolist(), pack.position_ids.tolist(), pack.cu_seq_lens.tolist()
([[5, 6, 7, 8, 9, 4, 3, 2]], [[0, 1, 2, 0, 1, 2, 3, 4]], [0, 3, 8])
>>> pack.labels.tolist()  # only completion tokens are targets
[[-100, 6, 7, -100, -100, 4, 3, 2]]
>>> unpack_rollouts([torch.arange(1.0, 8.0)[None]], [pack], batch=2, width=3).tolist()
[[1.0, 2.0, 0.0], [5.0, 6.0, 7.0]]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ._binpack import pack_best_fit_decreasing, split_bins
from .varlen import check_int32_tokens

__all__ = ["RolloutPack", "pack_rollouts", "rollout_spans", "unpack_rollouts"]

IGNORE_INDEX = -100


@dataclass
class RolloutPack:
    """One packed row of rollouts: the model inputs of one forward and the way back to ``(B, C)``.

    Attributes:
        input_ids: ``(1, T)`` int64, the rollouts' real tokens back to back.
        position_ids: ``(1, T)`` int64, restarting at 0 on every rollout.
        cu_seq_lens: ``(n + 1,)`` int32 segment offsets (pass as ``cu_seq_lens_q`` and ``cu_seq_lens_k``).
        max_length: the longest segment (``max_length_q`` / ``max_length_k``).
        labels: ``(1, T)`` int64, the token on real completion tokens, ``-100`` elsewhere.
        target: ``(T - 1,)`` int64: the flat ``(B, C)`` index the shifted packed position ``t`` (which predicts
            token ``t + 1``) lands on, ``B * C`` where it is not a target.
        rows: ``(n,)`` int64, the batch rows this pack holds, in packed order.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seq_lens: torch.Tensor
    max_length: int
    labels: torch.Tensor
    target: torch.Tensor
    rows: torch.Tensor

    def model_inputs(self) -> dict[str, object]:
        """The keyword arguments of the packed forward (``labels`` included)."""
        return {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "cu_seq_lens_q": self.cu_seq_lens,
            "cu_seq_lens_k": self.cu_seq_lens,
            "max_length_q": self.max_length,
            "max_length_k": self.max_length,
            "labels": self.labels,
        }


def rollout_spans(attention_mask: torch.Tensor, logits_to_keep: int) -> tuple[np.ndarray, np.ndarray]:
    """First and one-past-last real column of every row of TRL's ``(B, P + C)`` rollout mask.

    Args:
        attention_mask: ``(B, P + C)`` int/bool, 1 on real tokens; the real tokens of a row must be contiguous
            and hold at least one prompt token (column ``< P``).
        logits_to_keep: ``C``, the completion width.

    Returns:
        ``(starts, ends)``, two ``(B,)`` int64 arrays.

    >>> rollout_spans(torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1]]), 2)
    (array([1, 0]), array([3, 4]))
    """
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be (B, P + C), got shape {tuple(attention_mask.shape)}")
    mask = attention_mask.detach().to("cpu", torch.bool).numpy()
    width = mask.shape[1]
    prompt_width = width - int(logits_to_keep)
    if not 0 <= prompt_width < width:
        raise ValueError(f"logits_to_keep={logits_to_keep} must be in [1, {width}] (the row width)")
    counts = mask.sum(axis=1)
    starts = mask.argmax(axis=1).astype(np.int64)
    ends = starts + counts
    # contiguous: every column between the first and the last real one is real
    contiguous = mask[:, ::-1].argmax(axis=1) == width - ends
    bad = np.flatnonzero((counts == 0) | ~contiguous | (starts >= prompt_width))
    if bad.size:
        row = int(bad[0])
        raise ValueError(
            f"rollout {row}: its attention_mask {mask[row].astype(int).tolist()} is not one contiguous run "
            f"starting in the prompt (the first {prompt_width} columns); packed rollouts need a non-empty prompt "
            "followed by its completion, as TRL's GRPO/RLOO build them"
        )
    return starts, ends


def _assign_packs(lengths: np.ndarray, max_tokens_per_batch: int | None, min_packs: int) -> list[np.ndarray]:
    n = lengths.size
    if max_tokens_per_batch is None:
        bins = [np.arange(n, dtype=np.int64)]
        if min_packs > 1:  # equal shares of rows, so ranks can stay in step
            bins = [b for b in np.array_split(np.arange(n, dtype=np.int64), min(min_packs, n)) if b.size]
        return bins
    too_long = np.flatnonzero(lengths > max_tokens_per_batch)
    if too_long.size:
        row = int(too_long[0])
        raise ValueError(
            f"rollout {row} holds {int(lengths[row])} tokens (prompt + completion) > max_tokens_per_batch="
            f"{max_tokens_per_batch}; a rollout is never split: raise max_tokens_per_batch to at least "
            f"{int(lengths.max())} (or shorten max_prompt_length / max_completion_length)"
        )
    packing = pack_best_fit_decreasing(lengths, max_tokens_per_batch)
    if packing.num_bins < min(min_packs, n):
        packing = split_bins(packing, lengths, min(min_packs, n) - packing.num_bins)
    return [np.sort(np.asarray(b, dtype=np.int64)) for b in packing.bins()]


def pack_rollouts(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    max_tokens_per_batch: int | None = None,
    min_packs: int = 1,
) -> list[RolloutPack]:
    """TRL's padded rollout batch as packed rows (see the module docstring).

    Args:
        input_ids: ``(B, P + C)`` int64, left-padded prompts then right-padded completions.
        attention_mask: ``(B, P + C)``, 1 on real tokens (see :func:`rollout_spans`).
        logits_to_keep: ``C``, the completion width; only real tokens in the last ``C`` columns are targets.
        max_tokens_per_batch: most tokens in one packed row, or ``None`` for a single row.
        min_packs: make at least ``min(min_packs, B)`` rows (by splitting bins), so that data-parallel ranks
            run as many forwards each.

    Returns:
        The :class:`RolloutPack` rows, every batch row in exactly one of them.

    Raises:
        ValueError: a malformed mask, or a rollout longer than ``max_tokens_per_batch``.
    """
    if input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} differ in shape"
        )
    starts, ends = rollout_spans(attention_mask, logits_to_keep)
    batch, width = input_ids.shape
    prompt_width = width - int(logits_to_keep)
    lengths = ends - starts
    ids_cpu = input_ids.detach().cpu()
    real = attention_mask.detach().to("cpu", torch.bool).numpy()
    packs = []
    for rows in _assign_packs(lengths, max_tokens_per_batch, min_packs):
        seg = lengths[rows]
        total = int(seg.sum())
        check_int32_tokens(total, "a packed row of rollouts")
        offsets = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(seg) - seg, seg)  # (T,) in segment
        row_of = np.repeat(rows, seg)  # (T,) batch row of every packed token
        column = starts[row_of] + offsets  # (T,) column in the padded layout
        tokens = ids_cpu[torch.from_numpy(row_of), torch.from_numpy(column)]
        is_target = (column >= prompt_width) & real[row_of, column]
        labels = torch.where(torch.from_numpy(is_target), tokens, torch.full_like(tokens, IGNORE_INDEX))
        # the shifted position t predicts token t + 1; a segment's first token is a prompt token, never a target
        flat = row_of * int(logits_to_keep) + (column - prompt_width)
        target = np.where(is_target, flat, batch * int(logits_to_keep))[1:]
        cu = np.zeros(seg.size + 1, dtype=np.int32)
        np.cumsum(seg, out=cu[1:])
        device = input_ids.device
        packs.append(
            RolloutPack(
                input_ids=tokens[None].to(device),
                position_ids=torch.from_numpy(offsets)[None].to(device),
                cu_seq_lens=torch.from_numpy(cu).to(device),
                max_length=int(seg.max()),
                labels=labels[None].to(device),
                target=torch.from_numpy(target).to(device),
                rows=torch.from_numpy(rows),
            )
        )
    return packs


def unpack_rollouts(
    values: list[torch.Tensor], packs: list[RolloutPack], batch: int, width: int
) -> torch.Tensor:
    """Per-token outputs of the packed forwards scattered to TRL's ``(B, C)`` completion layout.

    Args:
        values: one ``(1, T_i - 1)`` tensor per pack (the fused head's shifted ``log_probs``, ``entropy``, ...).
        packs: the packs they were computed on (same order).
        batch, width: ``B`` and ``C``.

    Returns:
        ``(B, C)``, differentiable in ``values``; 0 on every position that is not a real completion token.
    """
    if len(values) != len(packs):
        raise ValueError(f"got {len(values)} outputs for {len(packs)} packs")
    first = values[0]
    out = first.new_zeros(batch * width)
    for value, pack in zip(values, packs, strict=True):
        if value.shape != (1, pack.target.numel()):
            raise ValueError(
                f"a pack of {pack.input_ids.shape[1]} tokens needs outputs of shape (1, {pack.target.numel()}), "
                f"got {tuple(value.shape)}"
            )
        keep = pack.target < batch * width
        out = out.index_put((pack.target[keep],), value[0, keep])
    return out.view(batch, width)
