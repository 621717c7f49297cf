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
from ..varlen import cu_seqlens_to_starts

__all__ = ["LAYOUT_KEY", "call_starts", "derived"]

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
