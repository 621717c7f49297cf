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

With ``share_prefixes``, the rollouts of a row are laid out as a prefix tree over prompt and completion
(:func:`~packing_hf.prefix_tree.build_prefix_tree`): rollouts that share a prompt, earlier turns or tool
calls store and compute those tokens once, at any depth. A tree row's predictions are *slots*: the hidden
state of the row token that predicts a completion token (``predictors``) and that token
(``shift_labels``); the first token of a branch is predicted at its parent's last token, one slot per
distinct next token, and rollouts reading the same slot (identical prefixes, duplicates) read one value.

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
from .prefix_tree import build_prefix_tree
from .varlen import IGNORE_INDEX, check_int32_tokens

__all__ = ["RolloutPack", "pack_rollouts", "rollout_spans", "unpack_rollouts"]


@dataclass
class RolloutPack:
    """One packed row of rollouts: the model inputs of one forward and the way back to ``(B, C)``.

    Attributes:
        input_ids: ``(1, T)`` int64, the rollouts' real tokens back to back (each shared token once in a tree).
        position_ids: ``(1, T)`` int64, restarting at 0 on every rollout (continuing the parent in a tree).
        cu_seq_lens: ``(n + 1,)`` int32 segment offsets (pass as ``cu_seq_lens_q`` and ``cu_seq_lens_k``).
        max_length: the longest segment (``max_length_q`` / ``max_length_k``).
        labels: ``(1, T)`` int64, the token on real completion tokens, ``-100`` elsewhere.
        target: ``(T - 1,)`` int64: the flat ``(B, C)`` index the shifted packed position ``t`` (which predicts
            token ``t + 1``) lands on, ``B * C`` where it is not a target.
        rows: ``(n,)`` int64, the batch rows this pack holds (sorted).
        prefix_seq_idx: ``(n_segments,)`` int32 when rollouts share tokens (``-1`` for a root segment, the
            parent segment's index for a branch), else ``None``.
        predictors: ``(N,)`` int64, a prefix-tree pack's (``share_prefixes``, whose ``labels`` and ``target``
            are ``None``): the row token whose hidden state predicts each slot (a branch point appears once per
            distinct next token); ``None`` otherwise, as the next two.
        shift_labels: ``(1, N)`` int64, the token each slot predicts (already shifted).
        reads: ``(2, K)`` int64, for every real completion token of the pack's rollouts: its slot, and its flat
            ``(B, C)`` index (several tokens may read one slot; every ``(B, C)`` index appears once).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seq_lens: torch.Tensor
    max_length: int
    labels: torch.Tensor | None
    target: torch.Tensor | None
    rows: torch.Tensor
    prefix_seq_idx: torch.Tensor | None = None
    predictors: torch.Tensor | None = None
    shift_labels: torch.Tensor | None = None
    reads: torch.Tensor | None = None

    @property
    def num_predictions(self) -> int:
        """How many per-token outputs the pack's forward yields (``T - 1`` shifted, or ``N`` slots)."""
        return self.target.numel() if self.predictors is None else self.predictors.numel()

    def model_inputs(self) -> dict[str, object]:
        """The keyword arguments of the packed forward: ``labels``, or a tree pack's ``shift_labels``, which are
        read from the backbone's hidden states gathered at :attr:`predictors` (the caller gathers them;
        :class:`packing_hf.integrations.rl.PackedRolloutsMixin` does)."""
        shared = {} if self.prefix_seq_idx is None else {"prefix_seq_idx": self.prefix_seq_idx}
        targets = {"labels": self.labels} if self.predictors is None else {"shift_labels": self.shift_labels}
        return {
            **shared,
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "cu_seq_lens_q": self.cu_seq_lens,
            "cu_seq_lens_k": self.cu_seq_lens,
            "max_length_q": self.max_length,
            "max_length_k": self.max_length,
            **targets,
        }

    def _reads(self, batch: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(slots, flat (B, C) indices)`` of every completion token this pack's outputs hold."""
        if self.reads is not None:
            return self.reads[0], self.reads[1]
        valid = self.target < batch * width
        return torch.nonzero(valid).reshape(-1), self.target[valid]


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
    share_prefixes: bool = False,
    min_shared_tokens: int = 1,
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
        share_prefixes: lay every row out as a prefix tree over the rollouts' prompts and completions
            (see the module docstring): every token shared by several rollouts, at any depth, computed
            once. The general case of ``share_prompts`` (which cannot be combined with it). Rollouts sharing a
            root are kept in one row while their tree fits ``max_tokens_per_batch``; a larger tree is cut into
            subtrees (halves of its rollouts) that fit, never a rollout.
        min_shared_tokens: with ``share_prefixes``, the shortest run of tokens a node shared by several
            rollouts may hold (see :func:`~packing_hf.prefix_tree.build_prefix_tree`).

    Returns:
        The :class:`RolloutPack` rows, every batch row in exactly one of them.

    Raises:
        ValueError: a malformed mask, or a rollout (group) longer than ``max_tokens_per_batch``.

    >>> ids = torch.tensor([[7, 8, 9, 1, 2], [7, 8, 9, 3, 0]])  # one prompt, two completions
    >>> mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    >>> [pack] = pack_rollouts(ids, mask, logits_to_keep=2, share_prompts=True)
    >>> pack.input_ids.tolist(), pack.position_ids.tolist(), pack.prefix_seq_idx.tolist()
    ([[7, 8, 9, 1, 2, 9, 3]], [[0, 1, 2, 3, 4, 2, 3]], [-1, 0, 0])
    >>> ids = torch.tensor([[7, 8, 1, 2, 3], [7, 8, 1, 4, 0], [7, 8, 5, 0, 0]])  # branching at two depths
    >>> mask = (ids > 0).long()
    >>> [tree] = pack_rollouts(ids, mask, logits_to_keep=3, share_prefixes=True)
    >>> tree.input_ids.tolist(), tree.prefix_seq_idx.tolist()  # [7 8 | 1 | 2 3 | 4 | 5]
    ([[7, 8, 1, 2, 3, 4, 5]], [-1, 0, 1, 1, 0])
    >>> tree.predictors.tolist(), tree.shift_labels.tolist()  # token 8 predicts 1 and 5, token 1 predicts 2 and 4
    ([1, 1, 2, 2, 3], [[1, 5, 2, 4, 3]])
    """
    if share_prompts and share_prefixes:
        raise ValueError(
            "share_prompts and share_prefixes were both set: share_prefixes already shares every prompt (the "
            "depth-1 case of its prefix tree); pass only share_prefixes=True"
        )
    if input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} differ in shape"
        )
    starts, ends = rollout_spans(attention_mask, logits_to_keep)
    batch, width = input_ids.shape
    keep = int(logits_to_keep)
    prompt_width = width - keep
    ids_cpu = input_ids.detach().cpu()
    if share_prefixes:
        sequences = [ids_cpu[b, starts[b] : ends[b]].numpy() for b in range(batch)]
        groups = _tree_groups(sequences, max_tokens_per_batch, min_packs, min_shared_tokens)
        return [
            _tree_pack(sequences, members, starts, prompt_width, keep, min_shared_tokens, input_ids.device)
            for members in groups
        ]
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


def _tree_tokens(sequences: list[np.ndarray], members: list[int], min_shared_tokens: int) -> int:
    """Tokens of the prefix tree over the rollouts ``members``."""
    trie = build_prefix_tree([sequences[b] for b in members], min_shared_tokens=min_shared_tokens)
    return trie.input_ids.numel()


def _tree_groups(
    sequences: list[np.ndarray], max_tokens_per_batch: int | None, min_packs: int, min_shared_tokens: int
) -> list[list[int]]:
    """The rollouts of every packed tree row: rollouts sharing a root stay together unless their tree is over
    the budget or ranks need more rows (then the largest tree is cut into halves of its rollouts)."""
    whole = build_prefix_tree(sequences, min_shared_tokens=min_shared_tokens)
    first = whole.sample_index[whole.sample_cu[:-1]]  # row token of every rollout's first token
    root = torch.searchsorted(whole.cu_seqlens.long(), first, right=True) - 1
    trees: dict[int, list[int]] = {}
    for b, r in enumerate(root.tolist()):
        trees.setdefault(r, []).append(b)
    # the tree of one root's rollouts is that root's subtree of the whole: its tokens are the row tokens under it
    token_root = torch.empty(whole.input_ids.numel(), dtype=torch.int64)
    token_root[whole.sample_index] = torch.repeat_interleave(root, torch.diff(whole.sample_cu))
    tokens = torch.bincount(token_root, minlength=whole.cu_seqlens.numel()).tolist()
    items = [(members, tokens[r]) for r, members in trees.items()]
    budget = max_tokens_per_batch if max_tokens_per_batch is not None else sum(t for _, t in items)

    def cut(i: int) -> None:
        members = items[i][0]
        halves = [members[: len(members) // 2], members[len(members) // 2 :]]
        items[i : i + 1] = [(h, _tree_tokens(sequences, h, min_shared_tokens)) for h in halves]

    i = 0
    while i < len(items):  # a tree over the budget is cut until its subtrees fit (or are one rollout)
        if items[i][1] > budget and len(items[i][0]) > 1:
            cut(i)
        else:
            i += 1
    for members, tokens in items:
        if tokens > budget:
            raise ValueError(
                f"rollout {members[0]} holds {tokens} tokens > max_tokens_per_batch={max_tokens_per_batch}; a "
                "rollout is never split: raise max_tokens_per_batch to at least that, or shorten "
                "max_prompt_length / max_completion_length"
            )
    while len(items) < min_packs and any(len(m) > 1 for m, _ in items):  # ranks need more forwards
        cut(max(range(len(items)), key=lambda j: (len(items[j][0]), items[j][1])))
    weights = np.array([tokens for _, tokens in items], dtype=np.int64)
    packing = pack_best_fit_decreasing(weights, budget)
    if packing.num_bins < min(min_packs, len(items)):
        packing = split_bins(packing, weights, min(min_packs, len(items)) - packing.num_bins)
    return [sorted(b for i in bin_items for b in items[i][0]) for bin_items in packing.bins()]


def _tree_pack(
    sequences: list[np.ndarray],
    members: list[int],
    starts: np.ndarray,
    prompt_width: int,
    keep: int,
    min_shared_tokens: int,
    device: torch.device,
) -> RolloutPack:
    """One packed tree row of the rollouts ``members`` (batch rows, sorted) and its prediction slots."""
    trie = build_prefix_tree([sequences[b] for b in members], min_shared_tokens=min_shared_tokens)
    total = trie.input_ids.numel()
    lengths = torch.diff(trie.sample_cu)
    member = torch.repeat_interleave(torch.tensor(members, dtype=torch.int64), lengths)  # batch row per token
    offset = torch.arange(trie.sample_index.numel()) - torch.repeat_interleave(trie.sample_cu[:-1], lengths)
    column = torch.from_numpy(starts)[member] + offset  # (sum L,) padded column of every rollout token
    # a completion token (never a rollout's first token: a rollout starts in its prompt) is predicted by the
    # row token holding the rollout's previous token: at a branch, its parent's last token
    is_target = column >= prompt_width
    predictor = torch.roll(trie.sample_index, 1)[is_target]
    predicted = trie.sample_index[is_target]
    flat = member[is_target] * keep + (column[is_target] - prompt_width)
    # one slot per (predicting row token, predicted row token): rollouts through the same tokens share it
    keys, slot = torch.unique(predictor * total + predicted, return_inverse=True)
    predictors, next_tokens = keys // total, keys % total
    if not keys.numel():  # no completion token: one slot nobody reads keeps the head's output non-empty
        predictors = next_tokens = torch.zeros(1, dtype=torch.int64)
    shared = bool((trie.prefix_seq_idx >= 0).any())
    return RolloutPack(
        input_ids=trie.input_ids[None].to(device),
        position_ids=trie.position_ids[None].to(device),
        cu_seq_lens=trie.cu_seqlens.to(device),
        max_length=int(torch.diff(trie.cu_seqlens).max()),
        labels=None,
        target=None,
        rows=torch.tensor(members, dtype=torch.int64),
        prefix_seq_idx=trie.prefix_seq_idx.to(device) if shared else None,
        predictors=predictors.to(device),
        shift_labels=trie.input_ids[next_tokens][None].to(device),
        reads=torch.stack([slot, flat]).to(device),
    )


def unpack_rollouts(
    values: list[torch.Tensor], packs: list[RolloutPack], batch: int, width: int
) -> torch.Tensor:
    """Per-token outputs of the packed forwards scattered to TRL's ``(B, C)`` completion layout.

    Args:
        values: one ``(1, T_i - 1)`` tensor per pack (the fused head's shifted ``log_probs``, ``entropy``, ...),
            ``(1, N_i)`` for a prefix-tree pack (its slots).
        packs: the packs they were computed on (same order).
        batch, width: ``B`` and ``C``.

    Returns:
        ``(B, C)``, differentiable in ``values``; 0 on every position that is not a real completion token.
    """
    if len(values) != len(packs):
        raise ValueError(f"got {len(values)} outputs for {len(packs)} packs")
    for value, pack in zip(values, packs, strict=True):
        if value.shape != (1, pack.num_predictions):
            raise ValueError(
                f"a pack of {pack.input_ids.shape[1]} tokens needs outputs of shape (1, {pack.num_predictions}), "
                f"got {tuple(value.shape)}"
            )
    flat = torch.cat([value[0] for value in values])
    if all(pack.reads is None for pack in packs):
        # the packs hold disjoint rows, each output one target at most: one layout over all of them, one scatter
        target = torch.cat([pack.target for pack in packs])
        return PackedLayout(target, (target.numel(),), batch, width).pad(flat)
    # tree slots may serve several rollouts: every (B, C) place gathers its slot (the backward sums them)
    source = torch.full((batch * width,), flat.numel(), dtype=torch.int64, device=flat.device)
    first = 0
    for pack in packs:
        slots, places = pack._reads(batch, width)
        source[places.to(flat.device)] = slots.to(flat.device) + first
        first += pack.num_predictions
    return PackedLayout(source, (batch, width), 1, flat.numel()).unpad(flat[None])
