"""Chunked local attention (Llama 4) on packed rows: positions restarting at every chunk of every sample, so that
the varlen attention's per-sample segments become per-chunk ones.

>>> chunk_position_ids(2, 5, 5, torch.tensor([[0, 1, 2, 0, 1]]), None, "cpu").tolist()
[[0, 1, 0, 0, 1]]
"""

from __future__ import annotations

import torch

from ..varlen import cu_seqlens_to_position_ids

__all__ = ["chunk_position_ids"]


def chunk_position_ids(
    chunk: int,
    q_length: int,
    kv_length: int,
    position_ids: torch.Tensor | None,
    cu_seq_lens_q: torch.Tensor | None,
    device: torch.device,
) -> torch.Tensor:
    """``(B|1, T)`` positions restarting at every chunk of ``chunk`` tokens counted from each sample's start.

    Chunked attention lets a token attend only within its chunk of its sample (transformers' chunked mask
    on packed rows does the same), so every chunk is a segment of its own: restarting the positions at
    each chunk start turns the varlen attention's per-sample segments into per-chunk ones. Positions come
    from ``position_ids``, else from ``cu_seq_lens_q``, else ``0 .. T - 1`` (one sample).

    Raises:
        ValueError: with a cache (more keys than queries): chunked decoding is not served by this attention.

    >>> chunk_position_ids(3, 7, 7, torch.tensor([[0, 1, 2, 3, 4, 0, 1]]), None, "cpu").tolist()
    [[0, 1, 2, 0, 1, 0, 1]]
    """
    if q_length != kv_length:
        raise ValueError(
            f"chunked attention (attention_chunk_size={chunk}) over a cache ({q_length} queries, {kv_length} "
            "keys) is not served by packing_hf's varlen attention; generate with attn_implementation='sdpa'"
        )
    if position_ids is None and cu_seq_lens_q is not None:
        position_ids = cu_seqlens_to_position_ids(cu_seq_lens_q).reshape(1, -1).to(device)
    if position_ids is None:
        position_ids = torch.arange(q_length, device=device).unsqueeze(0)
    return position_ids % chunk
