"""Sample boundaries read from the arguments of one call: what lets a hooked layer stay exact per step.

A prepared model's layer hooks never keep the boundaries of "the forward in flight" in model state: a
trainer may run several packed forwards before one backward, activation checkpointing re-runs layers
during backward, and a deep copy of the model runs its own forwards. Each hook instead reads the
boundaries from the arguments of *its own call*:

``cu_seq_lens_q`` ``(n + 1,)`` among its keyword arguments (one ``(1, T)`` row), or ``seq_idx`` ``(B, T)``
(the sample index of every token, for several packed rows): the prepared model adds them to every packed
call, and transformers hands keyword arguments down to the decoder layers.
``position_ids`` alone are not read here: a left-padded batch of ``generate()`` has positions that restart
at 0 too (``[0, 0, 0, 1, 2]``), and only the model-level check, which sees the attention mask, tells them
apart. A layer that gets neither (a model that does not hand keyword arguments down: BLOOM, MPT) is served
by the prepared call in flight instead (:mod:`packing_hf.architectures.preparation`).

A prefix-tree row (``prefix_seq_idx`` next to ``cu_seq_lens_q``, :mod:`packing_hf.shared_prefix`) is read the
same way: :func:`mixer_layout` gives a layer's token mixers one grid row per segment holding its
root-to-segment path, from the call's own ``cu_seq_lens_q`` and ``prefix_seq_idx``.

Activation checkpointing saves a layer's arguments and re-runs it with the same ones, so the re-run sees
the same boundaries; a copy's layers read their own calls. Derived tensors (the starts, the right-padded
layout) are cached per argument tensor object and version, so the layers of one forward, which all get
the same ``position_ids`` object, derive them once.

>>> kwargs = {"cu_seq_lens_q": torch.tensor([0, 3, 5], dtype=torch.int32)}
>>> call_starts(("hidden_states",), (torch.zeros(1, 5, 4),), kwargs).int().tolist()
[[1, 0, 0, 1, 0]]
>>> call_starts(("hidden_states",), (torch.zeros(2, 3, 4),), {"seq_idx": torch.tensor([[0, 0, 1], [0, 1, 1]])}).int().tolist()
[[1, 0, 1], [1, 1, 0]]
>>> call_starts(("hidden_states",), (torch.zeros(1, 5, 4),), {"position_ids": torch.tensor([[0, 1, 2, 0, 1]])}) is None
True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._cache import IdentityCache
from ..padding import PackedLayout
from ..shared_prefix import PREFIX_KEY, cached_shared_prefix_plan
from ..varlen import cu_seqlens_to_starts

__all__ = ["LAYOUT_KEY", "call_starts", "derived", "mixer_layout", "tree_layout"]

# the keyword argument a prepared decoder layer passes on to its mixers: the right-padded layout of the
# packed row it runs on (see packing_hf.architectures.mixers); checkpointing saves it with the layer's call
LAYOUT_KEY = "packing_hf_layout"

# every layer of one forward reads the same position_ids / cu_seq_lens_q object: a few entries suffice
_DERIVED = IdentityCache(size=8)


def derived(source: torch.Tensor, kind: str, compute: Callable[[], Any]) -> Any:
    """``compute()``, cached per ``source`` tensor object, its version and ``kind`` (no host sync on a hit).

    >>> cu = torch.tensor([0, 2, 5])
    >>> derived(cu, "doc", lambda: cu.diff()) is derived(cu, "doc", lambda: None)  # the second call is a hit
    True
    """
    return _DERIVED.derive((source,), compute, data=kind)


def _starts_from_seq_idx(seq_idx: torch.Tensor) -> torch.Tensor:
    starts = torch.ones_like(seq_idx, dtype=torch.bool)
    starts[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
    return starts


def call_starts(names: Sequence[str], args: tuple, kwargs: dict) -> torch.Tensor | None:
    """``(B, T)`` bool sample starts of a packed call, from its own arguments; ``None`` if it shows none.

    Args:
        names: the parameter names of the called ``forward``, in order.
        args: the positional arguments of the call; ``args[0]`` (or ``kwargs["hidden_states"]``) is the
            ``(B, T, ...)`` hidden states.
        kwargs: the keyword arguments of the call.
    """
    hidden = args[0] if args else kwargs.get(names[0] if names else "hidden_states")
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 2 or hidden.shape[1] < 2:
        return None
    rows, tokens = int(hidden.shape[0]), int(hidden.shape[1])
    cu = kwargs.get("cu_seq_lens_q")
    if isinstance(cu, torch.Tensor) and cu.dim() == 1 and rows == 1:
        return derived(cu, f"starts:{tokens}", lambda: cu_seqlens_to_starts(cu, tokens))
    seq_idx = kwargs.get("seq_idx")
    if isinstance(seq_idx, torch.Tensor) and tuple(seq_idx.shape) == (rows, tokens):
        return derived(seq_idx, "starts", lambda: _starts_from_seq_idx(seq_idx))
    return None


def tree_layout(
    cu_seqlens: torch.Tensor, prefix_seq_idx: torch.Tensor, packed_shape: tuple[int, ...]
) -> PackedLayout:
    """The layout a token mixer runs a prefix-tree row on: segment ``s`` as row ``s`` of the grid, holding its
    ancestors' tokens (root first) and then its own (:meth:`PackedLayout.from_paths`; one host read).

    A mixer (SSM scan, gated DeltaNet, short convolution) that runs such a row from a zero state reaches the
    segment's first token in the state its parent ends in, exactly as in the sample alone: nothing in the
    mixer changes, the ancestors' tokens are only read again. Taking back from each row its own tokens'
    outputs, and summing the gradients of the ancestors' copies (the gather's backward), gives every token's
    output and gradient of the samples run alone. The attention gathers the same chains of keys
    (:mod:`packing_hf.attention.prefix`).

    Args:
        cu_seqlens: ``(n + 1,)`` int32 the segments of the row.
        prefix_seq_idx: ``(n,)`` int32 every segment's parent, ``-1`` for a root.
        packed_shape: ``(1, T)``.

    >>> layout = tree_layout(torch.tensor([0, 2, 3, 4]), torch.tensor([-1, 0, 0]), (1, 4))
    >>> layout.pad(torch.tensor([[1, 2, 3, 4]])).tolist()  # the root, and each child after it
    [[1, 2, 0], [1, 2, 3], [1, 2, 4]]
    """
    # the attention's plan of the same forward, and its copy on the row's device
    plan = cached_shared_prefix_plan(cu_seqlens, prefix_seq_idx)
    key_index = cached_shared_prefix_plan(cu_seqlens, prefix_seq_idx, cu_seqlens.device).key_index
    return PackedLayout.from_paths(cu_seqlens.cpu(), key_index, plan.cu_seqlens_k, packed_shape)


def mixer_layout(kwargs: dict, starts: torch.Tensor) -> PackedLayout:
    """The right-padded layout the token mixers of a packed call run on, cached per forward: one grid row per
    sample (``starts``, ``(B, T)`` bool), or, for a prefix-tree row (``prefix_seq_idx`` among ``kwargs``), one
    row per segment holding its root-to-segment path (:func:`tree_layout`).

    >>> starts = torch.tensor([[True, False, True, False]])
    >>> mixer_layout({}, starts).rows, mixer_layout({}, starts).width
    (2, 2)
    >>> cu = torch.tensor([0, 2, 4], dtype=torch.int32)
    >>> tree = mixer_layout({"cu_seq_lens_q": cu, "prefix_seq_idx": torch.tensor([-1, 0])}, starts)
    >>> tree.rows, tree.width, tree.index.tolist()
    (2, 4, [0, 1, 6, 7])
    """
    prefix = kwargs.get(PREFIX_KEY)
    if prefix is None:
        return derived(starts, "layout", lambda: PackedLayout.from_starts(starts))
    cu = kwargs.get("cu_seq_lens_q")
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or starts.shape[0] != 1:
        raise ValueError(
            f"a prefix-tree row ({PREFIX_KEY}) reached a token mixer without its one-row cu_seq_lens_q (rows of "
            f"shape {tuple(starts.shape)}): the mixers cannot tell which segment continues which. Pass the row as "
            "PrefixTree.model_inputs() builds it: input_ids (1, T), cu_seq_lens_q and prefix_seq_idx"
        )
    shape = tuple(starts.shape)
    return _DERIVED.derive((cu, prefix), lambda: tree_layout(cu, prefix, shape), data=("tree", shape))
