"""MoE router losses on padded packed rows: which forwards compute a load-balancing loss, and from what.

``PaddingFreeCollator(pad_to_multiple_of=...)`` / ``length_buckets=...`` close a packed row with a padding segment
(:data:`packing_hf.varlen.PADDING_KEY` says how long). Attention and the loss never see it, but an MoE router
routes it, and a load-balancing loss counts every routed token. Stock leaves a padded batch's padding out of that
loss through the forward's ``attention_mask``; a prepared model hands its forward such a mask for the padding
(:meth:`packing_hf.architectures.preparation.PackingPreparation._router_padding`), which these functions tell
the forward reads.

>>> router_loss_reads_mask(torch.nn.Linear(2, 2)) is None
True
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import torch

from ..registry import wrapper_text_config

__all__ = ["ROUTER_MASK_TAG", "router_loss_reads_mask", "router_loss_requested"]

# the tag of the (1, T) mask a prepared model hands its own forward for the router loss: the module the
# forward passes it on to (its base model) drops it before any attention mask is built from it
ROUTER_MASK_TAG = "_packing_hf_router_mask"


def _call_arguments(source: str, call: str) -> str | None:
    """The text between the parentheses of the first ``call(`` in ``source`` (balanced), or ``None``.

    >>> _call_arguments("x = f(a, g(b), c) + 1", "f(")
    'a, g(b), c'
    """
    start = source.find(call)
    if start < 0:
        return None
    depth, begin = 0, start + len(call) - 1
    for index in range(begin, len(source)):
        depth += {"(": 1, ")": -1}.get(source[index], 0)
        if depth == 0:
            return source[begin + 1 : index]
    return None


def router_loss_reads_mask(model: torch.nn.Module) -> bool | None:
    """How the forward of ``model`` computes a router load-balancing loss (MoE): ``None`` when it computes
    none; ``True`` when it hands ``load_balancing_loss_func`` the forward's own ``attention_mask`` (the MoE
    causal LMs of transformers 5: padding is left out of the loss); ``False`` when it computes one otherwise.

    Read from the forward's source: feature detection (the call), not a list of model types.
    """
    forward = inspect.unwrap(type(model).forward)
    try:
        source = inspect.getsource(forward)
    except (OSError, TypeError):
        return None
    if "aux_loss" not in source:
        return None
    arguments = _call_arguments(source, "load_balancing_loss_func(")
    return arguments is not None and re.search(r"\battention_mask\b", arguments) is not None


def router_loss_requested(config: Any, kwargs: dict) -> bool:
    """Whether a call returns a router loss: ``output_router_logits`` of the call, else of the config (or of a
    multimodal wrapper's text config).

    >>> from types import SimpleNamespace
    >>> router_loss_requested(SimpleNamespace(output_router_logits=True), {"output_router_logits": False})
    False
    """
    requested = kwargs.get("output_router_logits")
    if requested is not None:
        return bool(requested)
    text = wrapper_text_config(config)
    return bool(
        getattr(config, "output_router_logits", False) or getattr(text, "output_router_logits", False)
    )
