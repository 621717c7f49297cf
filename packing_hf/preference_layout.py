"""How per-token results of a packed preference row map to TRL's padded ``(S, L)`` layout, and back.

TRL's preference trainers reason in a right-padded batch of ``S`` sequences (``S = 2B`` for ``B`` pairs, chosen
rows first); packing_hf runs them as one packed row. Two maps link the layouts:

- ``packed_index`` ``(T,)`` (plain rows and ``shared_prompt``: every packed token is one token of one sequence):
  :func:`pack_padded_labels` moves the padded labels to the row, :func:`unpack_shifted` scatters the shifted
  per-token outputs back;
  :func:`row_segments`, :func:`token_sources` and :func:`padded_layout` build the row, the index and the padded
  layout from the sequences;
- ``tree_index`` ``(S, L)`` (``share_prefixes``: one prefix tree, a row token shared by every sequence passing
  through it): :class:`TreeTargets` says which row predicts each row token (a node's first token: its parent's
  last row, the branch point) and gathers each row's value into every padded position reading it.

>>> unpack_shifted(torch.tensor([[1.0, 2.0, 3.0, 4.0]]), torch.tensor([6, 1, 6, 4, 5]), 2, 3).tolist()
[[1.0, 0.0], [3.0, 4.0]]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .padding import PackedLayout
from .varlen import IGNORE_INDEX, INT32_MAX

__all__ = [
    "TREE_INDEX_KEY",
    "TreeTargets",
    "pack_padded_labels",
    "padded_layout",
    "row_offsets",
    "row_segments",
    "token_sources",
    "unpack_shifted",
]

# share_prefixes batches: (S, L) int64, the row token holding every token of the padded layout (padding: T)
TREE_INDEX_KEY = "tree_index"


def row_segments(
    seq_len: np.ndarray, shared: np.ndarray, shared_prompt: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The packed row's segments as :func:`_pair_segments` returns them, with or without shared prompts."""
    if shared_prompt:
        return _pair_segments(seq_len, shared)
    n_seq = seq_len.size  # the sequences in TRL's row order, each its own segment
    return seq_len, np.arange(n_seq, dtype=np.int64), np.zeros(n_seq, dtype=np.int64), np.full(n_seq, -1)


def row_offsets(seg_lengths: np.ndarray, n_seq: int, width: int) -> np.ndarray:
    """``(segments + 1,)`` int64 offsets of the packed row; they and the ``(n_seq, width)`` layout must fit int32."""
    cu = np.zeros(seg_lengths.size + 1, dtype=np.int64)
    np.cumsum(seg_lengths, out=cu[1:])
    if cu[-1] > INT32_MAX or n_seq * width > INT32_MAX:
        raise ValueError(
            f"the batch holds {int(cu[-1])} tokens ({n_seq} x {width} padded), more than int32 offsets can "
            f"address ({INT32_MAX}); use fewer pairs per batch"
        )
    return cu


def token_sources(
    cu: np.ndarray,
    seg_lengths: np.ndarray,
    seg_len: np.ndarray,
    seg_seq: np.ndarray,
    seg_offset: np.ndarray,
    n_tokens: int,
    n_seq: int,
    width: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Where every token of the row of ``seg_lengths`` comes from (its first ``len(seg_len)`` segments hold the
    ``n_tokens`` real tokens, a last one may be padding); ``(n_seq, width)`` is the padded layout ``(S, L)``.

    Returns ``in_segment`` ``(T,)``, every token's offset in its segment; ``seq`` and ``offsets``
    ``(n_tokens,)``, the sequence of every real token and its offset there (its position); ``packed_index``
    ``(T,)``, see the module docstring.
    """
    starts = cu[:-1]
    in_segment = np.arange(int(cu[-1]), dtype=np.int64) - np.repeat(starts, seg_lengths)  # (T,)
    seq = np.repeat(seg_seq, seg_len)  # (n_tokens,)
    offsets = in_segment[:n_tokens] + np.repeat(seg_offset, seg_len)  # (n_tokens,)
    # packed token -> flat index into the (S, L) padded layout; starts and padding -> S * L (never targets)
    sentinel = n_seq * width
    packed_index = np.full(int(cu[-1]), sentinel, dtype=np.int64)
    packed_index[:n_tokens] = seq * width + offsets
    packed_index[starts] = sentinel
    return in_segment, seq, offsets, packed_index


def padded_layout(
    ids: np.ndarray,
    is_completion: np.ndarray,
    seq_len: np.ndarray,
    seq_start: np.ndarray,
    width: int,
    pad_token_id: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """TRL's right-padded layout of the sequences, every one whole (shared prompt or not): ``input_ids``,
    ``attention_mask`` and ``completion_mask``, ``(S, width)`` int64."""
    n_seq = seq_len.size
    row = np.repeat(np.arange(n_seq, dtype=np.int64), seq_len)
    real_flat = row * width + (np.arange(ids.size, dtype=np.int64) - np.repeat(seq_start, seq_len))
    padded_ids = np.full(n_seq * width, pad_token_id, dtype=np.int64)
    attention = np.zeros(n_seq * width, dtype=np.int64)
    completion = np.zeros(n_seq * width, dtype=np.int64)
    padded_ids[real_flat] = ids
    attention[real_flat] = 1
    completion[real_flat] = is_completion
    return padded_ids.reshape(n_seq, width), attention.reshape(n_seq, width), completion.reshape(n_seq, width)


def _pair_segments(
    seq_len: np.ndarray, shared: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The row's segments, pair by pair: ``[prefix, chosen branch, rejected branch]`` for a shared pair,
    ``[chosen, rejected]`` otherwise.

    Returns ``(n,)`` arrays: segment lengths, the sequence every segment's tokens come from (``i`` chosen,
    ``B + i`` rejected), the offset in that sequence where it starts, and ``prefix_seq_idx`` (``-1``, or
    the prefix segment of a branch).
    """
    n_pairs = shared.size
    chosen, rejected = seq_len[:n_pairs], seq_len[n_pairs:]
    pair = np.arange(n_pairs, dtype=np.int64)
    lengths = np.stack([shared, chosen - shared, rejected - shared], axis=1).reshape(-1)  # (3B,)
    source = np.stack([pair, pair, pair + n_pairs], axis=1).reshape(-1)
    offset = np.stack([np.zeros_like(shared), shared, shared], axis=1).reshape(-1)
    keep = lengths > 0  # unshared pairs have no prefix segment
    index = np.cumsum(keep) - 1  # new index of every kept segment
    prefix = np.where(shared > 0, index[0::3], -1)  # (B,) prefix segment of every pair
    prefix_idx = np.stack([np.full(n_pairs, -1), prefix, prefix], axis=1).reshape(-1)
    return lengths[keep], source[keep], offset[keep], prefix_idx[keep]


def pack_padded_labels(labels: torch.Tensor, packed_index: torch.Tensor) -> torch.Tensor:
    """Labels of the padded layout ``(S, L)`` moved to the packed row ``(1, T)``.

    Tokens whose ``packed_index`` is the sentinel ``S * L`` (segment starts, padding) get ``-100``: after
    the causal shift a segment's first token would be predicted from the previous segment's last one.

    Args:
        labels: ``(S, L)`` int64, ``-100`` on untrained tokens.
        packed_index: ``(T,)`` int64 from :class:`PaddingFreePreferenceCollator`.

    Returns:
        ``(1, T)`` int64.

    >>> pack_padded_labels(torch.tensor([[-100, 7, -100], [-100, 8, 9]]), torch.tensor([6, 1, 6, 4, 5])).tolist()
    [[-100, 7, -100, 8, 9]]
    """
    layout = PackedLayout.from_index(packed_index, *labels.shape, packed_shape=(1, packed_index.numel()))
    return layout.unpad(labels, fill=IGNORE_INDEX)


def unpack_shifted(
    values: torch.Tensor, packed_index: torch.Tensor, num_rows: int, width: int
) -> torch.Tensor:
    """Per-token results of a shifted packed forward ``(1, T - 1, ...)`` in the padded layout ``(S, L - 1, ...)``.

    ``values[0, t]`` belongs to the prediction of packed token ``t + 1``; it lands where a right-padded
    forward puts the prediction of the same token (row ``s``, column ``j - 1`` for token ``j`` of sequence
    ``s``). Every other entry is zero, as TRL's fused LM head returns on ``-100`` labels. Differentiable.

    Args:
        values: ``(1, T - 1, ...)`` any dtype.
        packed_index: ``(T,)`` int64 from :class:`PaddingFreePreferenceCollator`.
        num_rows, width: ``S`` and ``L`` of the padded layout.

    Returns:
        ``(S, L - 1, ...)``, same dtype and device as ``values``.

    >>> unpack_shifted(torch.tensor([[1.0, 2.0, 3.0, 4.0]]), torch.tensor([6, 1, 6, 4, 5]), 2, 3).tolist()
    [[1.0, 0.0], [3.0, 4.0]]
    """
    if values.dim() < 2 or values.shape[0] != 1 or values.shape[1] != packed_index.numel() - 1:
        raise ValueError(
            f"expected per-token values of shape (1, {packed_index.numel() - 1}, ...) for a packed row of "
            f"{packed_index.numel()} tokens, got {tuple(values.shape)}"
        )
    layout = PackedLayout.from_index(packed_index, num_rows, width, packed_shape=(1, packed_index.numel()))
    return layout.shifted().pad(values)


@dataclass(frozen=True)
class TreeTargets:
    """How the predictions of a prefix-tree preference row (``share_prefixes``) map to TRL's padded layout.

    In a tree row a token's prediction is not always read at the row before it: the first token of a node is
    predicted at its parent's last token (the branch point), whose one row serves every child. So the row's
    per-token head is run *per target row* (TRL's fused head with ``shift_labels``): the hidden state at
    ``predictor[t]`` scores the token at row ``t``. Each row token is a target at most once, however many
    sequences pass through it; :meth:`unpack` copies its value to every padded position that reads it.

    Attributes:
        predictor: ``(T,)`` int64, the row whose hidden state predicts row ``t`` (``t`` itself where row ``t`` is
            no target).
        row_labels: ``(1, T)`` int64, the label every row is scored against as a target (``-100``: none).
        gather: ``(S * (L - 1),)`` int64, for every position of the shifted padded layout ``(S, L - 1)`` the
            target row it reads, or ``T`` (a zero) where the padded labels hold ``-100``.
        shape: ``(S, L - 1)``.

    >>> index = torch.tensor([[0, 1, 2, 4], [0, 1, 3, 4]])  # two sequences sharing rows 0-1 of a 4-token row
    >>> labels = torch.tensor([[-100, -100, 7, -100], [-100, -100, 8, -100]])
    >>> targets = TreeTargets.from_index(index, labels, 4)
    >>> targets.predictor.tolist(), targets.row_labels.tolist()  # rows 2 and 3 are both predicted at row 1
    ([0, 0, 1, 1], [[-100, -100, 7, 8]])
    >>> targets.unpack(torch.tensor([[0.0, 0.0, -1.0, -2.0]])).tolist()
    [[0.0, -1.0, 0.0], [0.0, -2.0, 0.0]]
    """

    predictor: torch.Tensor
    row_labels: torch.Tensor
    gather: torch.Tensor
    shape: tuple[int, int]

    @classmethod
    def from_index(cls, tree_index: torch.Tensor, labels: torch.Tensor, row_length: int) -> TreeTargets:
        """Build them from the collator's ``tree_index`` and TRL's padded ``labels``.

        Args:
            tree_index: ``(S, L)`` int64 from :class:`PaddingFreePreferenceCollator` (``share_prefixes``).
            labels: ``(S, L)`` int64, ``-100`` where no prediction is scored (prompt, padding).
            row_length: ``T``, the packed row's tokens (padding included).
        """
        if tree_index.shape != labels.shape or tree_index.dim() != 2:
            raise ValueError(
                f"tree_index of shape {tuple(tree_index.shape)} does not match the padded labels "
                f"{tuple(labels.shape)}; pass the batch of PaddingFreePreferenceCollator(share_prefixes=True) whole"
            )
        index = tree_index.to(torch.int64).cpu()
        labels = labels.cpu()
        rows, width = index.shape
        real = index < row_length  # (S, L)
        predicted = real[:, 1:] & real[:, :-1]  # token j has a token j - 1 in the same sequence
        predictor = torch.arange(row_length, dtype=torch.int64)
        predictor[index[:, 1:][predicted]] = index[:, :-1][predicted]
        scored = predicted & (labels[:, 1:] != IGNORE_INDEX)  # (S, L - 1)
        row_labels = torch.full((row_length,), IGNORE_INDEX, dtype=torch.int64)
        row_labels[index[:, 1:][scored]] = labels[:, 1:][scored].to(torch.int64)
        gather = torch.where(scored, index[:, 1:], row_length).reshape(-1)
        return cls(predictor, row_labels[None], gather, (rows, width - 1))

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """Per-target-row values ``(1, T, ...)`` in the shifted padded layout ``(S, L - 1, ...)``: every padded
        position gets its target row's value, zero where its label is ``-100`` (as TRL's fused head writes).
        Differentiable (a shared row's gradient is the sum over the positions reading it)."""
        row_length = self.predictor.numel()
        if values.dim() < 2 or tuple(values.shape[:2]) != (1, row_length):
            raise ValueError(
                f"expected per-token values of shape (1, {row_length}, ...) for a tree row of {row_length} tokens, "
                f"got {tuple(values.shape)}"
            )
        # (T + 1, ...): the row past the end is the zero of positions without a target
        flat = torch.cat([values[0], values.new_zeros((1, *values.shape[2:]))])
        picked = flat.index_select(0, self.gather.to(values.device))
        return picked.reshape(*self.shape, *values.shape[2:])
