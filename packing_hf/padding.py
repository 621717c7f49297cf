"""The padded <-> packed layout: where every token of packed rows sits in a right-padded batch, and back.

One index serves every conversion between the two layouts (as flash-attn's ``bert_padding.py`` serves its
``unpad_input`` / ``pad_input``): the *padded* layout is a grid ``(rows, width, ...)`` of right-padded
sequences (TRL's DPO rows, the samples a token mixer runs on, SDPA's padded batch); the *packed* layout is
the same tokens back to back, ``packed_shape + (...)`` (one row ``(1, T)``, several rows ``(B, T)``, or a
flat ``(N,)``). :class:`PackedLayout` holds, for every packed token, its flat slot ``row * width + column``
in the grid, or ``rows * width`` (the *sentinel*) for a packed token with no slot (padding of the packed
row, a token that is no prediction target).

- :meth:`PackedLayout.unpad`: padded ``(rows, width, ...)`` -> packed ``(*packed_shape, ...)`` (a gather;
  tokens without a slot get ``fill``).
- :meth:`PackedLayout.pad`: packed -> padded (a scatter into a grid of ``fill``; tokens without a slot are
  left out).
- :meth:`PackedLayout.shifted`: the layout of per-token results of a causal LM's shifted forward (packed
  position ``t`` predicts token ``t + 1``; it lands where a right-padded forward puts the prediction of the
  same token: column ``j - 1`` of a ``(rows, width - 1)`` grid).
- :meth:`PackedLayout.from_paths`: a grid whose rows *repeat* packed tokens (every segment of a prefix-tree
  row after its ancestors' tokens): :meth:`PackedLayout.pad` then gathers (a token fills several slots, the
  backward sums their gradients), :meth:`PackedLayout.unpad` reads every token from its own segment's row.

Both directions are differentiable in the tensor they move and read no value back to the host, except the
constructors that say so (:meth:`PackedLayout.from_starts` needs the longest sample;
:meth:`PackedLayout.from_index` checks the index's range).

>>> cu = torch.tensor([0, 3, 5])  # two samples of 3 and 2 tokens, packed in one row
>>> layout = PackedLayout.from_cu_seqlens(cu, width=3, packed_shape=(1, 5))
>>> layout.index.tolist()  # flat slot in the (2, 3) grid of every packed token
[0, 1, 2, 3, 4]
>>> x = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]])
>>> layout.pad(x).tolist()
[[1.0, 2.0, 3.0], [4.0, 5.0, 0.0]]
>>> torch.equal(layout.unpad(layout.pad(x)), x)
True
>>> layout.shifted().pad(torch.tensor([[12.0, 23.0, 34.0, 45.0]])).tolist()  # predictions of tokens 2, 3, 5
[[12.0, 23.0], [45.0, 0.0]]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PackedLayout"]


@dataclass(frozen=True)
class PackedLayout:
    """Where every packed token sits in a right-padded grid of ``rows`` sequences of ``width`` slots.

    Attributes:
        index: ``(prod(packed_shape),)`` int64: the flat grid slot ``row * width + column`` of every packed
            token, or ``rows * width`` (:attr:`sentinel`) for a packed token with no slot. No two tokens share
            a slot.
        packed_shape: the leading shape of a packed tensor: ``(N,)``, ``(1, T)`` or ``(B, T)``.
        rows, width: the padded grid.
        complete: every packed token has a slot (no sentinel in ``index``): :meth:`pad` and :meth:`unpad`
            then skip the sentinel's handling. Set by the constructors that know it.
        source: ``None``, or ``(rows * width,)`` int64 for a grid whose rows repeat packed tokens
            (:meth:`from_paths`): the packed token every slot holds, ``prod(packed_shape)`` for an empty slot.
            :meth:`pad` then gathers from it; ``index`` still names the one slot every token is read back from.

    >>> layout = PackedLayout.from_starts(torch.tensor([[True, False, True]]))  # samples of 2 and 1 tokens
    >>> layout.rows, layout.width, layout.packed_shape, layout.index.tolist()
    (2, 2, (1, 3), [0, 1, 2])
    """

    index: torch.Tensor
    packed_shape: tuple[int, ...]
    rows: int
    width: int
    complete: bool = False
    source: torch.Tensor | None = None

    @property
    def sentinel(self) -> int:
        """``rows * width``: the index of a packed token with no slot in the grid."""
        return self.rows * self.width

    @classmethod
    def from_index(
        cls, index: torch.Tensor, rows: int, width: int, packed_shape: tuple[int, ...] | None = None
    ) -> PackedLayout:
        """A layout from a given index (one host read: its range is checked).

        Args:
            index: ``(N,)`` int64 flat slots, ``rows * width`` where a token has no slot.
            rows, width: the padded grid.
            packed_shape: the leading shape of a packed tensor, ``(N,)`` by default.

        >>> PackedLayout.from_index(torch.tensor([4, 1, 3]), rows=2, width=2).unpad(torch.tensor([[1, 2], [3, 4]]))
        tensor([0, 2, 4])
        >>> PackedLayout.from_index(torch.tensor([5]), rows=2, width=2)
        Traceback (most recent call last):
        ...
        ValueError: the layout index reaches 5 but a (2, 2) grid has slots 0..3 (4 marks a token without a slot): the index and the padded tensors do not come from the same batch
        """
        index = index.reshape(-1).long()
        packed_shape = tuple(packed_shape) if packed_shape is not None else (index.numel(),)
        if _numel(packed_shape) != index.numel():
            raise ValueError(f"packed_shape {packed_shape} does not hold the {index.numel()} indexed tokens")
        sentinel = rows * width
        if index.numel():
            low, high = int(index.min()), int(index.max())
            if low < 0 or high > sentinel:
                raise ValueError(
                    f"the layout index reaches {low if low < 0 else high} but a ({rows}, {width}) grid has slots "
                    f"0..{sentinel - 1} ({sentinel} marks a token without a slot): the index and the padded "
                    "tensors do not come from the same batch"
                )
            complete = high < sentinel
        else:
            complete = True
        return cls(index, packed_shape, rows, width, complete)

    @classmethod
    def from_cu_seqlens(
        cls, cu_seqlens: torch.Tensor, width: int, packed_shape: tuple[int, ...] | None = None
    ) -> PackedLayout:
        """Segment ``s`` of a packed row as row ``s`` of the grid; tokens after the last segment get no slot.

        No host read (the shapes come from ``cu_seqlens``'s size, ``width`` and ``packed_shape``), so
        ``torch.compile`` traces it without a graph break.

        Args:
            cu_seqlens: ``(n + 1,)`` int32/int64 segment offsets into the packed tokens.
            width: at least the longest segment (the caller's contract: a longer one would spill into the next
                row).
            packed_shape: the leading shape of a packed tensor, ``(cu_seqlens[-1],)`` by default (one host read).

        >>> PackedLayout.from_cu_seqlens(torch.tensor([0, 1, 3]), width=2, packed_shape=(4,)).index.tolist()
        [0, 2, 3, 4]
        """
        cu = cu_seqlens.long()
        if packed_shape is None:
            packed_shape = (int(cu[-1]),)
        total, rows = _numel(packed_shape), cu.numel() - 1
        tokens = torch.arange(total, device=cu.device)  # (N,)
        # (N,) in [0, n]: n past the last segment (cu[0] = 0; the whole cu is searched, not cu[1:]: inductor of
        # torch 2.11 cannot lower searchsorted over a slice)
        segment = torch.searchsorted(cu, tokens, right=True) - 1
        inside = segment < rows
        offset = tokens - cu[:-1][segment.clamp(max=max(rows - 1, 0))] if rows else tokens
        index = torch.where(inside, segment * width + offset, rows * width)
        return cls(index, tuple(packed_shape), rows, width)

    @classmethod
    def from_starts(cls, starts: torch.Tensor) -> PackedLayout:
        """Every sample of packed rows ``(B, T)`` as a row of the grid, ``width`` the longest sample (one host
        read). ``starts`` is ``(B, T)`` bool, true on every sample's first token; every row starts a sample at
        its first token, marked or not.

        >>> PackedLayout.from_starts(torch.tensor([[True, False, False], [False, True, False]])).index.tolist()
        [0, 1, 2, 3, 6, 7]
        """
        first = starts.clone()
        first[:, 0] = True
        flat = first.reshape(-1)
        sample = torch.cumsum(flat.long(), dim=0) - 1  # (B*T,) sample of every token
        begin = torch.nonzero(flat).reshape(-1)  # (n,) flat index of every sample's first token
        lengths = torch.diff(begin, append=begin.new_tensor([flat.numel()]))
        longest = int(lengths.max())
        offset = torch.arange(flat.numel(), device=flat.device) - begin[sample]
        return cls(sample * longest + offset, tuple(starts.shape), int(begin.numel()), longest, True)

    @classmethod
    def from_paths(
        cls,
        cu_seqlens: torch.Tensor,
        path_index: torch.Tensor,
        cu_paths: torch.Tensor,
        packed_shape: tuple[int, ...],
    ) -> PackedLayout:
        """Segment ``s`` as row ``s`` of the grid, *after* other packed tokens: the row holds
        ``path_index[cu_paths[s]:cu_paths[s + 1]]``, whose last ``cu_seqlens[s + 1] - cu_seqlens[s]`` entries are
        the segment's own tokens (a prefix tree's root-to-segment path: the ancestors' tokens, then its own; see
        :func:`packing_hf.shared_prefix.shared_prefix_plan`). :meth:`pad` gathers every row's tokens (a token in
        several rows is copied into each, and the backward sums the copies' gradients); :meth:`unpad` reads every
        packed token from its own segment's row. Host arithmetic on the small boundary tensors; the index
        tensors are built on ``path_index``'s device.

        Args:
            cu_seqlens: ``(n + 1,)`` int32/int64 the segments of the packed tokens.
            path_index: ``(Tk,)`` int64 the packed token of every slot of every row, row after row.
            cu_paths: ``(n + 1,)`` int32/int64 where each row starts in ``path_index``.
            packed_shape: the leading shape of a packed tensor (``(1, T)`` for one row); tokens past the last
                segment get no slot.

        >>> layout = PackedLayout.from_paths(  # a root of 2 tokens, two children of 1: rows [0 1], [0 1 2], [0 1 3]
        ...     torch.tensor([0, 2, 3, 4]), torch.tensor([0, 1, 0, 1, 2, 0, 1, 3]), torch.tensor([0, 2, 5, 8]), (1, 4)
        ... )
        >>> layout.pad(torch.tensor([[1.0, 2.0, 3.0, 4.0]])).tolist()
        [[1.0, 2.0, 0.0], [1.0, 2.0, 3.0], [1.0, 2.0, 4.0]]
        >>> layout.index.tolist(), layout.unpad(layout.pad(torch.tensor([[1.0, 2.0, 3.0, 4.0]]))).tolist()
        ([0, 1, 5, 8], [[1.0, 2.0, 3.0, 4.0]])
        """
        cu = [int(v) for v in cu_seqlens.tolist()]
        paths = [int(v) for v in cu_paths.tolist()]
        if len(cu) != len(paths) or paths[-1] != path_index.numel():
            raise ValueError(
                f"cu_paths {paths} does not describe one row per segment of cu_seqlens {cu} over the "
                f"{path_index.numel()} path tokens: the paths and the segments do not come from the same row"
            )
        rows = len(cu) - 1
        own = [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)]
        lengths = [b - a for a, b in zip(paths[:-1], paths[1:], strict=True)]
        if any(o > n for o, n in zip(own, lengths, strict=True)):
            raise ValueError(f"a path of cu_paths {paths} is shorter than its segment of cu_seqlens {cu}")
        width = max(lengths, default=0)
        total = _numel(packed_shape)
        device = path_index.device
        # every slot's packed token (total: an empty slot, which pad fills)
        source = torch.full((rows * width,), total, dtype=torch.int64, device=device)
        row = torch.repeat_interleave(torch.arange(rows), torch.tensor(lengths, dtype=torch.int64))
        column = torch.arange(paths[-1]) - torch.tensor(paths[:-1], dtype=torch.int64)[row]
        source[(row * width + column).to(device)] = path_index.long()
        # every packed token's own slot: its segment's row, after the segment's ancestors
        index = torch.full((total,), rows * width, dtype=torch.int64)
        for s in range(rows):
            begin = s * width + lengths[s] - own[s]
            index[cu[s] : cu[s + 1]] = torch.arange(begin, begin + own[s])
        return cls(index.to(device), tuple(packed_shape), rows, width, cu[-1] == total, source)

    def matches(self, tensor: object) -> bool:
        """Whether ``tensor`` is laid out as the packed tokens: ``(*packed_shape, ...)``."""
        n = len(self.packed_shape)
        return isinstance(tensor, torch.Tensor) and tuple(tensor.shape[:n]) == self.packed_shape

    def unpad(self, padded: torch.Tensor, fill: float | int = 0) -> torch.Tensor:
        """``(rows, width, ...)`` padded -> ``(*packed_shape, ...)`` packed; tokens without a slot get ``fill``.

        Differentiable in ``padded``; same dtype and device.
        """
        if tuple(padded.shape[:2]) != (self.rows, self.width):
            raise ValueError(
                f"expected a padded tensor of shape ({self.rows}, {self.width}, ...), got {tuple(padded.shape)}: "
                "it does not come from the batch this layout was built for"
            )
        rest = padded.shape[2:]
        flat = padded.reshape(self.rows * self.width, *rest)
        index = self.index.to(flat.device)
        if self.complete:
            return flat.index_select(0, index).reshape(*self.packed_shape, *rest)
        if not flat.shape[0]:  # an empty grid: no token has a slot
            return flat.new_full((*self.packed_shape, *rest), fill)
        outside = index == self.sentinel
        gathered = flat.index_select(0, index.clamp(max=self.sentinel - 1))
        gathered = gathered.masked_fill(outside.reshape(-1, *([1] * len(rest))), fill)
        return gathered.reshape(*self.packed_shape, *rest)

    def pad(self, packed: torch.Tensor, fill: float | int = 0) -> torch.Tensor:
        """``(*packed_shape, ...)`` packed -> ``(rows, width, ...)`` padded with ``fill``; tokens without a slot
        are left out. Differentiable in ``packed``; same dtype and device.
        """
        if not self.matches(packed):
            raise ValueError(
                f"expected a packed tensor of shape ({', '.join(map(str, self.packed_shape))}, ...), got "
                f"{tuple(packed.shape)}: it does not come from the batch this layout was built for"
            )
        rest = packed.shape[len(self.packed_shape) :]
        flat = packed.reshape(-1, *rest)
        if self.source is not None:  # rows repeat tokens: a gather, whose backward sums every copy's gradient
            spare = flat.new_zeros((1, *rest)) if fill == 0 else flat.new_full((1, *rest), fill)
            grid = torch.cat([flat, spare]).index_select(0, self.source.to(flat.device))
            return grid.reshape(self.rows, self.width, *rest)
        index = self.index.to(flat.device)
        slots = self.sentinel if self.complete else self.sentinel + 1  # one spare slot takes the sentinel's
        grid = flat.new_zeros((slots, *rest)) if fill == 0 else flat.new_full((slots, *rest), fill)
        grid = grid.index_copy(0, index, flat)
        if not self.complete:  # no slice when there is no spare slot: its backward would copy the gradient
            grid = grid[: self.sentinel]
        return grid.reshape(self.rows, self.width, *rest)

    def shifted(self) -> PackedLayout:
        """The layout of a shifted forward's per-token results: packed ``(..., T - 1)``, grid ``(rows, width -
        1)``. Result ``t`` (the prediction of packed token ``t + 1``, in ``[r, j]``) goes to ``[r, j - 1]``;
        tokens in column 0 or without a slot predict nothing that the padded forward keeps.

        >>> layout = PackedLayout.from_index(torch.tensor([6, 1, 6, 4, 5]), rows=2, width=3, packed_shape=(1, 5))
        >>> layout.shifted().index.tolist()
        [0, 4, 2, 3]
        """
        if self.source is not None:
            raise ValueError(
                "shifted() of a layout whose rows repeat packed tokens (from_paths): a token's prediction would "
                "be read from several rows; shift the per-token results of the packed row instead"
            )
        *lead, tokens = self.packed_shape
        index = self.index.reshape(*lead, tokens)[..., 1:].reshape(-1)
        column = index % self.width
        width = self.width - 1
        slot = (index // self.width) * width + column - 1
        sentinel = self.rows * width
        index = torch.where((index < self.sentinel) & (column > 0), slot, sentinel)
        return PackedLayout(index, (*lead, tokens - 1), self.rows, width)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n
