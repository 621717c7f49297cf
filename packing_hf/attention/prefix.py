"""Prefix-tree attention: segments of a packed row that attend to their ancestor segments (a shared prefix
at any depth).

A batch carries the layout as ``prefix_seq_idx`` (``(n,)`` int32, one entry per segment of
``cu_seq_lens_q``; see :mod:`packing_hf.shared_prefix`): ``-1`` for a root, ``p`` for a segment continuing
the earlier segment ``p`` (its parent; a one-level shared prefix is a tree of depth 1). The attention then
gathers, for every segment, its ancestors' keys and values (root first) in front of its own and runs one
ordinary causal varlen call whose key segments are longer than its query segments: every backend aligns
causality bottom-right (FlashAttention's rule), so query ``j`` of a segment sees all its ancestors and its
own keys ``0..j``, which is what it sees when it runs after its ancestors alone, for every backend, sliding
windows, softcaps, sinks and ALiBi included (the gathered keys sit at the same relative positions as in
the sample alone). Siblings, cousins and other trees are never gathered, so never seen. Gradients of a
segment's keys and values are the sum over its descendants' copies (the backward of the gather), equal to
running every root-to-leaf sample separately.

Why a gather and not one varlen call per ancestor merged by their log-sum-exp: FlashAttention's and
torch's varlen kernels return the log-sum-exp but do not differentiate through it, so the merged output's
gradient would be wrong in training. The gather costs, per layer, one copy of a segment's keys and values
for every descendant (not of its queries, hidden states or MLP work) and is exact forward and backward.

>>> q = torch.randn(5, 2, 4)  # (T, H, D): prefix of 2, branches of 2 and 1 tokens
>>> out = shared_prefix_attention(q, q, q, torch.tensor([0, 2, 4, 5]), torch.tensor([-1, 0, 0]))
>>> alone = shared_prefix_attention(q[[0, 1, 4]], q[[0, 1, 4]], q[[0, 1, 4]], torch.tensor([0, 3]), torch.tensor([-1]))
>>> torch.allclose(out[4], alone[2], atol=1e-6)  # the second branch, as if run after its prefix alone
True
"""

from __future__ import annotations

import torch

from ..shared_prefix import PREFIX_KEY, cached_shared_prefix_plan
from .backends import varlen_attention

__all__ = ["PREFIX_KEY", "gather_prefix_keys", "shared_prefix_attention"]


def gather_prefix_keys(
    key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor, prefix_seq_idx: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Keys and values of a prefix-tree row laid out per segment: ``[ancestors' keys (root first), own keys]``.

    Args:
        key: ``(T, Hkv, D)`` keys of the packed row.
        value: ``(T, Hkv, Dv)`` values.
        cu_seqlens: ``(n + 1,)`` int32 segment boundaries of the row.
        prefix_seq_idx: ``(n,)`` int32 (``-1`` or the parent segment of every segment).

    Returns:
        ``(key (Tk, Hkv, D), value (Tk, Hkv, Dv), cu_seqlens_k (n + 1,) int32, max_seqlen_k)`` on the
        inputs' device.

    >>> k = torch.arange(3.0).view(3, 1, 1)
    >>> gathered, _, cu_k, max_k = gather_prefix_keys(k, k, torch.tensor([0, 1, 2, 3]), torch.tensor([-1, 0, 0]))
    >>> gathered.flatten().tolist(), cu_k.tolist(), max_k
    ([0.0, 0.0, 1.0, 0.0, 2.0], [0, 1, 3, 5], 2)
    """
    # one host read per forward: the token mixers' tree layout reads the same plan
    plan = cached_shared_prefix_plan(cu_seqlens, prefix_seq_idx)
    if plan.cu_seqlens_k[-1] and int(plan.key_index[-1]) >= key.shape[0]:
        raise ValueError(
            f"cu_seq_lens_q covers {int(cu_seqlens[-1])} tokens but the keys hold {key.shape[0]}; the "
            "prefix-tree layout describes one packed row of self-attention"
        )
    on_device = cached_shared_prefix_plan(cu_seqlens, prefix_seq_idx, key.device)  # copied once per forward
    return (
        key.index_select(0, on_device.key_index),
        value.index_select(0, on_device.key_index),
        on_device.cu_seqlens_k,
        plan.max_length_k,
    )


def shared_prefix_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    prefix_seq_idx: torch.Tensor,
    max_seqlen: int | None = None,
    *,
    backend: str = "auto",
    **kwargs,
) -> torch.Tensor:
    """Causal attention over a packed prefix-tree row: every segment attends to its ancestors and to itself.

    Args:
        query: ``(T, Hq, D)``.
        key: ``(T, Hkv, D)``.
        value: ``(T, Hkv, Dv)``.
        cu_seqlens: ``(n + 1,)`` int32 segment boundaries.
        prefix_seq_idx: ``(n,)`` int32, see the module docstring.
        max_seqlen: longest query segment (computed from ``cu_seqlens`` when ``None``).
        backend: a :func:`packing_hf.varlen_attention` backend.
        **kwargs: ``softmax_scale``, ``window_size``, ``softcap``, ``dropout_p``, ``alibi_slopes``, ``s_aux``
            as in :func:`packing_hf.varlen_attention` (applied per segment, positions as in the sample alone).

    Returns:
        ``(T, Hq, Dv)``.
    """
    k, v, cu_k, max_k = gather_prefix_keys(key, value, cu_seqlens, prefix_seq_idx)
    if max_seqlen is None:
        bounds = cu_seqlens.tolist()
        max_seqlen = max((b - a for a, b in zip(bounds[:-1], bounds[1:], strict=False)), default=0)
    return varlen_attention(
        query,
        k,
        v,
        cu_seqlens.to(torch.int32),
        cu_k,
        max_seqlen,
        max_k,
        causal=True,
        backend=backend,
        **kwargs,
    )
