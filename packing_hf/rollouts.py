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
from .padding import PackedLayout
from .varlen import IGNORE_INDEX, check_int32_tokens

__all__ = ["RolloutPack", "pack_rollouts", "rollout_spans", "unpack_rollouts"]


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
        rows: ``(n,)`` int64, the batch rows this pack holds (sorted).
        prefix_seq_idx: ``(n_segments,)`` int32 when rollouts share their prompt (``-1`` for an ordinary or
            prefix segment, the prefix's segment index for a branch), else ``None``.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seq_lens: torch.Tensor
    max_length: int
    labels: torch.Tensor
    target: torch.Tensor
    rows: torch.Tensor
    prefix_seq_idx: torch.Tensor | None = None

    def model_inputs(self) -> dict[str, object]:
        """The keyword arguments of the packed forward (``labels`` included)."""
        shared = {} if self.prefix_seq_idx is None else {"prefix_seq_idx": self.prefix_seq_idx}
        return {
            **shared,
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


# An item of the bin packing: segments (row, first column, end column, is_branch) kept in one packed row.
_Segment = tuple[int, int, int, bool]


def _rollout_items(
    ids: np.ndarray, starts: np.ndarray, ends: np.ndarray, prompt_width: int, share_prompts: bool
) -> list[list[_Segment]]:
    """One item per rollout, or with ``share_prompts`` one per group of rollouts with the same prompt tokens:
    the prompt but its last token as a prefix segment, then one branch per rollout (its last prompt token,
    which predicts the completion's first token, and its completion)."""
    rows = range(ids.shape[0])
    if not share_prompts:
        return [[(b, int(starts[b]), int(ends[b]), False)] for b in rows]
    groups: dict[bytes, list[int]] = {}
    for b in rows:
        groups.setdefault(ids[b, starts[b] : prompt_width].tobytes(), []).append(b)
    items = []
    for members in groups.values():
        branches = [b for b in members if ends[b] > prompt_width]  # rows with completion tokens
        lonely = [b for b in members if b not in branches]
        if len(branches) < 2 or prompt_width - starts[members[0]] < 2:  # nothing to share
            lonely = members
            branches = []
        items.extend([[(b, int(starts[b]), int(ends[b]), False)] for b in lonely])
        if branches:
            first = branches[0]
            prefix = (first, int(starts[first]), prompt_width - 1, False)
            items.append([prefix, *[(b, prompt_width - 1, int(ends[b]), True) for b in branches]])
    return items


def _split_group(item: list[_Segment]) -> list[list[_Segment]]:
    """A shared group in two halves, each with its own copy of the prefix (a lone branch is a plain rollout
    again: the rollouts of a group have the same prompt, hence the same first column)."""
    (_, first, prefix_end, _), branches = item[0], item[1:]
    out = []
    for half in (branches[: len(branches) // 2], branches[len(branches) // 2 :]):
        if len(half) == 1:
            out.append([(half[0][0], first, half[0][2], False)])
        else:
            out.append([(half[0][0], first, prefix_end, False), *half])
    return out


def _tokens(item: list[_Segment]) -> int:
    return sum(end - start for _, start, end, _ in item)


def _assign_packs(
    items: list[list[_Segment]], max_tokens_per_batch: int | None, min_packs: int
) -> list[list[list[_Segment]]]:
    while len(items) < min_packs and any(len(item) > 2 for item in items):  # ranks need more forwards
        largest = max(range(len(items)), key=lambda i: (len(items[i]), _tokens(items[i])))
        items = items[:largest] + _split_group(items[largest]) + items[largest + 1 :]
    weights = np.array([_tokens(item) for item in items], dtype=np.int64)
    budget = max_tokens_per_batch if max_tokens_per_batch is not None else int(weights.sum())
    too_long = np.flatnonzero(weights > budget)
    if too_long.size:
        item = items[int(too_long[0])]
        what = (
            f"the group of {len(item) - 1} rollouts sharing a prompt"
            if len(item) > 1
            else f"rollout {item[0][0]}"
        )
        raise ValueError(
            f"{what} holds {int(weights[too_long[0]])} tokens > max_tokens_per_batch={max_tokens_per_batch}; "
            f"rollouts (and, with prompt sharing, groups) are never split: raise max_tokens_per_batch to at least "
            f"{int(weights.max())}, shorten max_prompt_length / max_completion_length, or turn share_prompt off"
        )
    packing = pack_best_fit_decreasing(weights, budget)
    if packing.num_bins < min(min_packs, len(items)):
        packing = split_bins(packing, weights, min(min_packs, len(items)) - packing.num_bins)
    return [[items[i] for i in sorted(b)] for b in packing.bins()]


def pack_rollouts(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    max_tokens_per_batch: int | None = None,
    min_packs: int = 1,
    share_prompts: bool = False,
) -> list[RolloutPack]:
    """TRL's padded rollout batch as packed rows (see the module docstring).

    With ``share_prompts``, rollouts whose prompt tokens are identical (a GRPO group) share one copy of the
    prompt: the prompt but its last token becomes a prefix segment, and every rollout a branch holding the
    last prompt token and its completion, attending to the prefix and itself with positions continuing from
    the prefix (``prefix_seq_idx``, see :mod:`packing_hf.shared_prefix`; the model needs packing_hf's
    attention). A group is never split across rows.

    Args:
        input_ids: ``(B, P + C)`` int64, left-padded prompts then right-padded completions.
        attention_mask: ``(B, P + C)``, 1 on real tokens (see :func:`rollout_spans`).
        logits_to_keep: ``C``, the completion width; only real tokens in the last ``C`` columns are targets.
        max_tokens_per_batch: most tokens in one packed row, or ``None`` for a single row.
        min_packs: make at least ``min(min_packs, B)`` rows (by splitting bins, then groups), so that
            data-parallel ranks run as many forwards each.
        share_prompts: compute every group's prompt once (see above).

    Returns:
        The :class:`RolloutPack` rows, every batch row in exactly one of them.

    Raises:
        ValueError: a malformed mask, or a rollout (group) longer than ``max_tokens_per_batch``.

    >>> ids = torch.tensor([[7, 8, 9, 1, 2], [7, 8, 9, 3, 0]])  # one prompt, two completions
    >>> mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    >>> [pack] = pack_rollouts(ids, mask, logits_to_keep=2, share_prompts=True)
    >>> pack.input_ids.tolist(), pack.position_ids.tolist(), pack.prefix_seq_idx.tolist()
    ([[7, 8, 9, 1, 2, 9, 3]], [[0, 1, 2, 3, 4, 2, 3]], [-1, 0, 0])
    """
    if input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} differ in shape"
        )
    starts, ends = rollout_spans(attention_mask, logits_to_keep)
    batch, width = input_ids.shape
    keep = int(logits_to_keep)
    prompt_width = width - keep
    ids_cpu = input_ids.detach().cpu()
    items = _rollout_items(ids_cpu.numpy(), starts, ends, prompt_width, share_prompts)
    real = attention_mask.detach().to("cpu", torch.bool).numpy()
    device = input_ids.device
    packs = []
    for bin_items in _assign_packs(items, max_tokens_per_batch, min_packs):
        segments = [segment for item in bin_items for segment in item]
        seg = np.array([end - start for _, start, end, _ in segments], dtype=np.int64)
        prefix_of = _prefix_of(bin_items)
        total = int(seg.sum())
        check_int32_tokens(total, "a packed row of rollouts")
        row_of = np.repeat(np.array([r for r, _, _, _ in segments], dtype=np.int64), seg)  # (T,)
        offsets = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(seg) - seg, seg)  # (T,) in segment
        column = np.repeat(np.array([c for _, c, _, _ in segments], dtype=np.int64), seg) + offsets
        tokens = ids_cpu[torch.from_numpy(row_of), torch.from_numpy(column)]
        is_target = (column >= prompt_width) & real[row_of, column]
        labels = torch.where(torch.from_numpy(is_target), tokens, torch.full_like(tokens, IGNORE_INDEX))
        # the shifted position t predicts token t + 1; a segment's first token is a prompt token, never a target
        target = np.where(is_target, row_of * keep + (column - prompt_width), batch * keep)[1:]
        cu = np.concatenate([[0], np.cumsum(seg)]).astype(np.int32)
        shared = any(p >= 0 for p in prefix_of)
        packs.append(
            RolloutPack(
                input_ids=tokens[None].to(device),
                # a branch continues its prefix: every token sits at its column minus its prompt's first column
                position_ids=torch.from_numpy(column - starts[row_of])[None].to(device),
                cu_seq_lens=torch.from_numpy(cu).to(device),
                max_length=int(seg.max()),
                labels=labels[None].to(device),
                target=torch.from_numpy(target).to(device),
                rows=torch.from_numpy(np.unique(row_of)),
                prefix_seq_idx=torch.tensor(prefix_of, dtype=torch.int32, device=device) if shared else None,
            )
        )
    return packs


def _prefix_of(bin_items: list) -> list[int]:
    """For every segment of a packed row: the segment of its shared prompt, or -1 (a plain or prefix segment).
    Each item is a plain or prefix segment followed by its branches."""
    prefix_of, first_segment = [], 0
    for item in bin_items:
        prefix_of.extend([-1] + [first_segment] * (len(item) - 1))
        first_segment += len(item)
    return prefix_of


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
    for value, pack in zip(values, packs, strict=True):
        if value.shape != (1, pack.target.numel()):
            raise ValueError(
                f"a pack of {pack.input_ids.shape[1]} tokens needs outputs of shape (1, {pack.target.numel()}), "
                f"got {tuple(value.shape)}"
            )
    # the packs hold disjoint rows: one layout over all of them, one scatter
    target = torch.cat([pack.target for pack in packs])
    layout = PackedLayout(target, (target.numel(),), batch, width)
    return layout.pad(torch.cat([value[0] for value in values]))
