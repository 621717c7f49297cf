"""Ulysses sequence parallelism inside packing_hf's attention: one rank's shard of a packed row, and the
all-to-alls that give every rank the whole row for a share of the heads.

A packed ``[1, T]`` row is cut into ``sp`` contiguous shards (:func:`shard_lengths`); each rank runs the
embeddings, norms and MLPs of its ``T_r`` tokens. Around attention, an all-to-all trades the sequence shard
for a head shard: ``(H, T_r, D)`` on every rank becomes ``(H / sp, T, D)``, the whole row for ``H / sp``
heads; the exact varlen attention then runs with the row's *global* ``cu_seq_lens`` (every sample whole,
wherever the shard cuts fell), and a second all-to-all gives every rank its tokens back for all heads. Both
all-to-alls are autograd functions whose backward is the other one, so gradients are exact too.

The :class:`SequenceShard` travels with the call (the batch key :data:`SHARD_KEY`, handed by transformers to
every attention layer, and saved with a checkpointed layer's arguments): it holds the process group and the
row's boundaries, never model state. Building shards: :mod:`packing_hf.attention.sequence_parallel`; the loss
over them: :mod:`packing_hf.shard_loss`.

>>> shard_lengths(10, 4)
[3, 3, 2, 2]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..varlen import SHARD_KEY  # the batch key carrying a rank's SequenceShard (beside the other batch keys)

__all__ = ["SHARD_KEY", "SequenceShard", "shard_lengths"]



def shard_lengths(total: int, size: int) -> list[int]:
    """Token counts of the ``size`` contiguous shards of a ``total``-token row: as even as possible, the first
    ``total % size`` shards one token longer (no padding, no token dropped).

    >>> shard_lengths(8, 2)
    [4, 4]
    """
    if size < 1 or total < size:
        raise ValueError(
            f"a packed row of {total} tokens cannot be split into {size} sequence-parallel shards of at least one "
            "token; raise max_tokens_per_batch or lower sp_size"
        )
    base, extra = divmod(total, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


def _exchange(send: torch.Tensor, send_splits: list[int], recv_splits: list[int], group: Any) -> torch.Tensor:
    """``all_to_all_single`` of a flat tensor: ``send_splits[r]`` elements go to rank ``r``, ``recv_splits[r]``
    come from it."""
    recv = send.new_empty(sum(recv_splits))
    dist.all_to_all_single(recv, send.contiguous(), recv_splits, send_splits, group=group)
    return recv


def _seq_to_heads(x: torch.Tensor, lengths: list[int], rank: int, group: Any) -> torch.Tensor:
    """``(H, T_rank, D)`` (this rank's tokens, every head) -> ``(H / sp, T, D)`` (every token, this rank's heads)."""
    size = len(lengths)
    heads, local, dim = x.shape
    share = heads // size
    send = x.reshape(size, share, local, dim).reshape(-1)  # chunk r = heads of rank r, my tokens
    recv = _exchange(send, [share * local * dim] * size, [share * n * dim for n in lengths], group)
    parts = recv.split([share * n * dim for n in lengths])
    return torch.cat([p.view(share, n, dim) for p, n in zip(parts, lengths, strict=True)], dim=1)


def _heads_to_seq(y: torch.Tensor, lengths: list[int], rank: int, group: Any) -> torch.Tensor:
    """``(H / sp, T, D)`` -> ``(H, T_rank, D)``: the inverse (and the adjoint) of :func:`_seq_to_heads`."""
    size = len(lengths)
    share, _, dim = y.shape
    local = lengths[rank]
    send = torch.cat([part.reshape(-1) for part in y.split(lengths, dim=1)])  # chunk r = tokens of rank r
    recv = _exchange(send, [share * n * dim for n in lengths], [share * local * dim] * size, group)
    return recv.view(size, share, local, dim).reshape(size * share, local, dim)


class _AllToAll(torch.autograd.Function):
    """``there(x, lengths, rank, group)`` forward; its adjoint ``back`` on the gradient."""

    @staticmethod
    def forward(ctx, x, there, back, lengths, rank, group):
        ctx.back, ctx.lengths, ctx.rank, ctx.group = back, lengths, rank, group
        return there(x, lengths, rank, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.back(grad.contiguous(), ctx.lengths, ctx.rank, ctx.group), None, None, None, None, None


class SequenceShard:
    """One rank's contiguous shard of a packed ``[1, T]`` row, and what its attention needs of the whole row.

    Built by :func:`packing_hf.attention.sequence_parallel.shard_packed_batch`; it rides in the batch under :data:`SHARD_KEY`.

    Args:
        group: the sequence-parallel process group (``None``: the default group).
        rank: this process's rank in ``group``.
        lengths: ``(sp,)`` token counts of the shards (:func:`shard_lengths`).
        cu_seq_lens: ``(n + 1,)`` int32 boundaries of the *whole* row's samples.
        position_ids: ``(1, T)`` int64 positions of the whole row.
        local_only: negative control: attend only within this rank's own tokens (wrong across shard cuts).

    Attributes:
        offset: index of this shard's first token in the row.
        calls: attention calls served (a caller can check that the model ran this path at all).

    >>> shard = SequenceShard(None, 1, [3, 2], torch.tensor([0, 4, 5], dtype=torch.int32), torch.tensor([[0, 1, 2, 3, 0]]))
    >>> shard.offset, shard.length, shard.size
    (3, 2, 2)
    """

    def __init__(
        self,
        group: Any,
        rank: int,
        lengths: list[int],
        cu_seq_lens: torch.Tensor,
        position_ids: torch.Tensor,
        *,
        local_only: bool = False,
    ) -> None:
        self.group, self.rank, self.lengths = group, int(rank), [int(n) for n in lengths]
        self.size = len(self.lengths)
        self.offset = sum(self.lengths[: self.rank])
        self.length = self.lengths[self.rank]
        self.cu_seq_lens = cu_seq_lens
        bounds = cu_seq_lens.tolist()
        self.longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:], strict=False))
        self.position_ids = position_ids
        self.local_only = local_only
        self.calls = 0
        self._copies: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        # the whole row's (1, T) labels and loss weights, for the loss (set by shard_packed_batch)
        self.labels: torch.Tensor | None = None
        self.loss_weights: torch.Tensor | None = None

    def __repr__(self) -> str:
        return (
            f"SequenceShard(rank {self.rank}/{self.size}, tokens {self.offset}..{self.offset + self.length})"
        )

    # a copy of the batch (deepcopy of kwargs by a wrapper) keeps the same process group and row
    def __deepcopy__(self, memo: dict) -> SequenceShard:
        return self

    def check_call(self, batch: dict) -> dict:
        """The model pre-hook's check of this rank's call: its tokens and positions are this shard's, there is
        no mask or cache; returns the batch with ``use_cache=False``."""
        self._check_positions(batch.get("position_ids"))
        for name in ("attention_mask", "past_key_values", "cache", "cu_seq_lens_q", "cu_seq_lens_k"):
            if batch.get(name) is not None:
                raise ValueError(
                    f"{self!r}: {name} was passed next to a sequence-parallel shard, whose boundaries are the "
                    "whole row's (carried by the shard); drop it"
                )
        out = dict(batch)
        out["use_cache"] = False
        return out

    def _on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The row's positions and boundaries on ``device``, copied once per shard (every layer reuses them,
        and the same tensor objects let the attention's per-forward caches hit)."""
        if device not in self._copies:
            self._copies[device] = (self.position_ids.to(device), self.cu_seq_lens.to(device))
        return self._copies[device]

    def _check_positions(self, positions: Any) -> None:
        """The call's ``position_ids`` must be this shard's slice of the row's (else rotary is offset)."""
        expected = self.position_ids[:, self.offset : self.offset + self.length]
        if not isinstance(positions, torch.Tensor) or tuple(positions.shape) != tuple(expected.shape):
            shape = tuple(positions.shape) if isinstance(positions, torch.Tensor) else None
            raise ValueError(
                f"{self!r}: the call's position_ids have shape {shape}, not this shard's {tuple(expected.shape)}; "
                "pass the batch packing_hf.attention.sequence_parallel.shard_packed_batch returned, unchanged"
            )
        if not torch.equal(positions.to(expected.device), expected):
            raise ValueError(
                f"{self!r}: the call's position_ids are not the row's positions {self.offset}.."
                f"{self.offset + self.length} (rotary embeddings would be offset); pass the batch "
                "packing_hf.attention.sequence_parallel.shard_packed_batch returned, unchanged"
            )

    def attention(
        self,
        function: Callable,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        """Run the attention ``function`` (packing_hf's ``varlen_attention_forward``) on the whole row for this
        rank's heads.

        Args:
            query: ``(1, H, T_rank, D)`` this rank's tokens.
            key, value: ``(1, Hkv, T_rank, D)``.
            **kwargs: the layer's keywords; ``s_aux`` / ``alibi_slopes`` ``(H,)`` are cut to this rank's heads.

        Returns:
            ``((1, T_rank, H, Dv), None)``, as the attention interface returns.
        """
        if self.calls == 0:  # a model not prepared for packing has no pre-hook: check the call once here
            self._check_positions(kwargs.get("position_ids"))
        self.calls += 1
        if attention_mask is not None:
            raise ValueError(
                f"{self!r}: the layer got an attention mask; a sequence-parallel packed row needs none (the row's "
                "boundaries travel with the shard)"
            )
        if query.shape[0] != 1 or query.shape[2] != self.length or key.shape[2] != self.length:
            raise ValueError(
                f"{self!r}: the layer's queries {tuple(query.shape)} / keys {tuple(key.shape)} are not one row of "
                f"this shard's {self.length} tokens (a cache, cross-attention or a model that changes the length)"
            )
        if self.local_only:  # negative control: the shard's tokens alone, cut samples restarting at its edge
            kwargs["position_ids"] = self.position_ids[:, self.offset : self.offset + self.length]
            return function(module, query, key, value, None, **kwargs)
        positions, cu = self._on(query.device)
        kwargs.update(position_ids=positions, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
        kwargs.update(max_length_q=self.longest, max_length_k=self.longest)
        if self.size == 1:  # the shard is the whole row
            return function(module, query, key, value, None, **kwargs)
        heads, kv_heads = query.shape[1], key.shape[1]
        key, value = _spread_kv_heads(key, value, heads, kv_heads, self.size)
        args = (self.lengths, self.rank, self.group)
        q = _AllToAll.apply(query[0], _seq_to_heads, _heads_to_seq, *args)[None]  # (1, H / sp, T, D)
        k = _AllToAll.apply(key[0], _seq_to_heads, _heads_to_seq, *args)[None]  # (1, Hkv' / sp, T, D)
        v = _AllToAll.apply(value[0], _seq_to_heads, _heads_to_seq, *args)[None]
        share = heads // self.size
        for name in ("s_aux", "alibi_slopes"):  # per-head terms follow their heads
            if kwargs.get(name) is not None:
                kwargs[name] = kwargs[name].narrow(0, self.rank * share, share)
        out, _ = function(module, q, k, v, None, **kwargs)  # (1, T, H / sp, Dv)
        out = _AllToAll.apply(
            out[0].transpose(0, 1).contiguous(), _heads_to_seq, _seq_to_heads, *args
        )  # (H, T_rank, Dv)
        return out.transpose(0, 1).unsqueeze(0), None


def _spread_kv_heads(
    key: torch.Tensor, value: torch.Tensor, heads: int, kv_heads: int, size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Key/value heads ready to be split over ``size`` ranks next to ``heads`` query heads: as they are when
    ``size`` divides them, each repeated ``size / kv_heads`` times when ``kv_heads`` divides ``size`` (the query
    heads of a rank then share one key/value head, as in the model), else refused."""
    if heads % size:
        raise ValueError(
            f"sequence parallelism over {size} ranks splits the attention heads between them, but the model has "
            f"{heads} query heads; choose an sp_size dividing {heads}"
        )
    if kv_heads % size == 0:
        return key, value
    if size % kv_heads == 0 and heads % kv_heads == 0:
        repeat = size // kv_heads
        return key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    raise ValueError(
        f"sequence parallelism over {size} ranks cannot split the model's {kv_heads} key/value heads (it neither "
        f"divides nor is divided by sp_size={size}); choose an sp_size that divides {kv_heads} or a multiple of it "
        f"dividing {heads}"
    )
