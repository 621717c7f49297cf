"""Admission: which models packing_hf's varlen attention serves, and what decides it.

The registry (:mod:`packing_hf.registry`) says, as data, how every ``model_type`` packs. This module is the
policy the attention applies to a model it is asked to serve: the rules over a config's layers
(:func:`unsupported_layers`, :func:`mixer_free`, :func:`bidirectional_attention`), how a module tells
whether the model holding it was prepared (:func:`preparation_of`: a tag on the model's modules, never on the
config, which twins may share), what a model still needs before it packs exactly (:func:`needs_preparation`)
and the refusal of what the attention cannot keep exact (:func:`check_served_config`, raising
:class:`~packing_hf.errors.PackingRefused` with the registry's reason as ``.reason``).

>>> from transformers import AutoConfig
>>> needs_preparation(AutoConfig.for_model("llama")) is None
True
"""

from __future__ import annotations

import functools
import inspect
import re
import weakref
from typing import Any

import torch

from .._cache import IdentityCache
from ..errors import PackingRefused
from ..registry import MIXERS_BY_LAYER_TYPE, PREFIX_TREE_MIXERS, REGISTRY, support, wrapper_text_config

__all__ = [
    "PREPARED_ATTRIBUTE",
    "bidirectional_attention",
    "check_served_config",
    "config_has_split_model",
    "flat_positions_dropped_by",
    "mixer_free",
    "needs_preparation",
    "note_split_config",
    "prefix_tree_refusal",
    "refuse_prefix_tree",
    "preparation_of",
    "served_config_key",
    "unsupported_layers",
]

# layer kinds (config.layer_types values) that are plain softmax attention over the sample
_ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention", "attention", "global", "local"})

_CHUNKED = (
    "chunked local attention (attention_chunk_size) without config.layer_types: which layers are chunked is not "
    "known, so packing_hf's varlen attention cannot split them into chunks; load it with "
    "attn_implementation='sdpa' or 'eager'"
)


def unsupported_layers(config: Any) -> str | None:
    """Why the layers of this *config* cannot keep packed samples apart, whatever its registry entry says.

    Reads ``config.layer_types``: any layer that is not softmax attention (``"conv"``, ``"mamba"``,
    ``"linear_attention"``, ``"hybrid"``, ...) carries information along the row. LFM2 is the example: its
    registry entry is exact for an all-attention config, but real LFM2 checkpoints interleave short
    convolutions. ``None`` when every layer is attention.

    >>> from types import SimpleNamespace
    >>> unsupported_layers(SimpleNamespace(layer_types=["conv", "full_attention"]))
    "layer types ['conv'] carry state or mix tokens along the row, across sample boundaries"
    """
    layer_types = getattr(config, "layer_types", None)
    if not isinstance(layer_types, list | tuple):
        return None
    other = sorted({str(t) for t in layer_types} - _ATTENTION_LAYERS - {"chunked_attention"})
    if other:
        return f"layer types {other} carry state or mix tokens along the row, across sample boundaries"
    return None


def mixer_free(config: Any) -> bool:
    """Whether a ``"mixers"`` model of this *config* has no mixer: its type is in ``MIXERS_BY_LAYER_TYPE`` and
    every ``config.layer_types`` entry is attention (an attention-only LFM2, say).

    >>> from types import SimpleNamespace
    >>> mixer_free(SimpleNamespace(model_type="lfm2_moe", layer_types=["full_attention", "full_attention"]))
    True
    >>> mixer_free(SimpleNamespace(model_type="lfm2_moe", layer_types=["conv", "full_attention"]))
    False
    """
    layer_types = getattr(config, "layer_types", None)
    return (
        str(getattr(config, "model_type", "")) in MIXERS_BY_LAYER_TYPE
        and isinstance(layer_types, list | tuple)
        and len(layer_types) > 0
        and unsupported_layers(config) is None
    )


def bidirectional_attention(config: Any) -> str | None:
    """Why a config's attention is not causal (``use_bidirectional_attention``), else ``None``.

    Such a decoder (PaliGemma's Gemma, embedding variants) lets every token see the whole row, the next
    samples of a packed row included, and no position or mask fix changes that.

    >>> from types import SimpleNamespace
    >>> bidirectional_attention(SimpleNamespace(use_bidirectional_attention=True)) is not None
    True
    """
    if getattr(config, "use_bidirectional_attention", None) is True:
        return (
            "its attention is bidirectional (use_bidirectional_attention=True): every token attends to the "
            "whole row, the other packed samples included"
        )
    return None


# On every module of a model that packing_hf.prepare_model_for_packing prepared: its PackingPreparation handle.
# Held by the modules, not by the config: two models built from one config object (``type(model)(model.config)``)
# share it, and only the prepared one may be served as prepared. A deep copy or pickle of the model carries the
# tags to its own handle; ``revert()`` removes them.
PREPARED_ATTRIBUTE = "_packing_hf_prepared_by"


def preparation_of(module: Any) -> Any | None:
    """The active :class:`~packing_hf.architectures.PackingPreparation` of the model holding ``module`` (the
    model itself or any of its submodules, e.g. the attention layer a call reaches), else ``None``.

    What the attention and the batch guards read to tell a prepared model from an unprepared one, the twin
    built from the same config object included.

    >>> import torch
    >>> preparation_of(torch.nn.Linear(2, 2)) is None
    True
    """
    handle = getattr(module, PREPARED_ATTRIBUTE, None)
    return handle if getattr(handle, "active", False) else None


class _ConfigsInUse:
    """The configs of models whose mixers a preparation splits, as ``id(config) -> weakref`` (a config is not
    hashable, and nothing is written on it): a hint for the mask function, which sees the config only. No
    prepared model uses the config: the model calling is not prepared, refused before any layer runs. One
    does: the model calling may be it or an unprepared twin sharing the config, so the attention layers decide,
    from their own model (:func:`preparation_of`). Never read as proof that a model is prepared.

    >>> from transformers import AutoConfig
    >>> config = AutoConfig.for_model("bamba")
    >>> note_split_config(config, True)
    >>> config_has_split_model(config)
    True
    >>> note_split_config(config, False)
    >>> config_has_split_model(config)
    False
    """

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref] = {}

    def set(self, config: Any, used: bool) -> None:
        key = id(config)
        if used:
            self._refs[key] = weakref.ref(config, lambda _: self._refs.pop(key, None))
        else:
            self._refs.pop(key, None)

    def __contains__(self, config: Any) -> bool:
        return (seen := self._refs.get(id(config))) is not None and seen() is config


_SPLIT_CONFIGS = _ConfigsInUse()
note_split_config, config_has_split_model = _SPLIT_CONFIGS.set, _SPLIT_CONFIGS.__contains__


def _splits_mixers(preparation: Any) -> bool:
    return preparation is not None and bool(getattr(preparation, "mixers", 0))


def _fixes_mask(preparation: Any) -> bool:
    return preparation is not None and bool(getattr(preparation, "mask_fix", False))


def _rules_of(config: Any) -> tuple[str, Any, Any]:
    """``(model_type, rules, entry)``: the config's model type, the config its rules are read from (a
    wrapper's text config when the wrapper is not in the registry itself) and its registry entry."""
    model_type = str(getattr(config, "model_type", "") or type(config).__name__)
    text = wrapper_text_config(config) if model_type not in REGISTRY else None
    rules = config if text is None else text
    return model_type, rules, support(str(getattr(rules, "model_type", model_type)))


def needs_preparation(config: Any, *, varlen: bool = False, preparation: Any = None) -> str | None:
    """Why the model of ``config``, as loaded, lets packed samples see each other until
    :func:`packing_hf.prepare_model_for_packing` prepares it; ``None`` when it needs nothing or is prepared.

    Reads the registry entry of the config (of a multimodal wrapper's language model when the wrapper is not
    registered itself) and its layers:

    - ``"mixers"``: its mixers carry state across the row unless ``preparation`` splits them per sample, or
      the config has no mixer (:func:`mixer_free`);
    - ``"mask"`` (or a hybrid's ``mask_fix``): its mask ignores ``position_ids`` unless ``preparation`` gave its
      layers per-sample masks, or it runs packing_hf's varlen attention (``varlen=True``: the config's
      ``_attn_implementation`` is ``packing_hf.ATTENTION_NAME``), which keeps the samples apart itself (and
      refuses a model computing attention in its own code).

    Other statuses say ``None`` here: ``"refused"`` and ``"unknown"`` are decided by
    :func:`check_served_config` and ``prepare_model_for_packing``.

    Args:
        config: the model's config.
        varlen: the model runs packing_hf's varlen attention.
        preparation: the model's active preparation (:func:`preparation_of`), ``None`` if it has none. A
            config alone cannot say it: several models may share one config object.

    >>> from transformers import AutoConfig
    >>> needs_preparation(AutoConfig.for_model("llama")) is None
    True
    >>> needs_preparation(AutoConfig.for_model("bamba"))[:6]
    'Mamba2'
    """
    _, rules, entry = _rules_of(config)
    mixers_split = entry.status == "mixers" and _splits_mixers(preparation)
    if entry.status == "mixers" and not mixers_split and not mixer_free(rules):
        return entry.reason
    if entry.status == "mask" or (entry.mask_fix and not mixers_split):
        if not (varlen and not entry.own_attention) and not _fixes_mask(preparation):
            return entry.reason
    return None


def prefix_tree_refusal(config: Any) -> str | None:
    """Why a prefix-tree row (``prefix_seq_idx``: segments continuing earlier segments) cannot be exact on the
    model of ``config``; ``None`` when it can: its every token mixer is attention, or it is a hybrid whose
    prepared mixers carry their state along the tree (``PREFIX_TREE_MIXERS`` in :mod:`packing_hf.registry`).

    A child segment must start from its parent's end. The attention does that by gathering the ancestors'
    keys (:mod:`packing_hf.attention.prefix`). A hybrid's non-attention mixers (SSM scans, linear attention,
    short convolutions) need their parent's final state: :func:`packing_hf.prepare_model_for_packing` runs
    every segment on a row holding its root-to-segment path (``packing_hf.architectures.boundaries.
    tree_layout``), which reaches the segment in exactly that state. The hybrids where this is proven (every
    sample alone, fp32 logits, losses and gradients) are accepted; they still need the preparation, as on
    flat rows (:func:`needs_preparation`). Refused: the other hybrids, pure state-space stacks, and configs
    with non-attention layers of a model type with no registered mixers.

    >>> from transformers import AutoConfig
    >>> prefix_tree_refusal(AutoConfig.for_model("llama")) is None
    True
    >>> prefix_tree_refusal(AutoConfig.for_model("bamba")) is None  # its Mamba2 states follow the tree
    True
    >>> prefix_tree_refusal(AutoConfig.for_model("mamba2"))[:31]  # a pure state-space stack: per sample only
    'mamba2: a prefix-tree row (pref'
    """
    model_type, rules, entry = _rules_of(config)
    mixers = entry.status == "mixers" and not mixer_free(rules)
    if mixers and entry.model_type in PREFIX_TREE_MIXERS and not entry.split_stack:
        return None
    why = entry.reason if mixers else unsupported_layers(rules)
    if why is None:
        return None
    return (
        f"{model_type}: a prefix-tree row (prefix_seq_idx: segments that continue a shared prefix) cannot be exact "
        f"on this model: {why}, and a child segment would have to start from its parent's final state, which "
        "packing_hf carries along the tree only for the hybrids where it is proven exact "
        f"({', '.join(sorted(PREFIX_TREE_MIXERS))}; its per-sample split starts every segment of any other from a "
        "zero state). Pack these samples without shared prefixes (flat rows stay exact), or use an attention-only "
        "model"
    )


_TREES_SERVED = IdentityCache(size=16)


def refuse_prefix_tree(config: Any) -> None:
    """Raise :class:`~packing_hf.errors.PackingRefused` (reason ``"prefix_seq_idx"``) where
    :func:`prefix_tree_refusal` says why; the batch guards and the attention (every layer) both call it, so an
    accepted config is remembered until a field the check reads (:func:`served_config_key`) changes."""
    if config is None:
        return
    key = served_config_key(config)
    if _TREES_SERVED.get((config,), data=key):
        return
    refusal = prefix_tree_refusal(config)
    if refusal is not None:
        raise PackingRefused("prefix_seq_idx", refusal)
    _TREES_SERVED.put((config,), True, data=key)


def served_config_key(config: Any) -> tuple:
    """The config fields :func:`check_served_config` reads, as a hashable value: the attention checks a config
    again when this changes (a ``layer_types`` or ``attention_chunk_size`` set after the first forward).

    >>> from types import SimpleNamespace
    >>> served_config_key(SimpleNamespace(model_type="llama", layer_types=["full_attention"]))
    ('llama', ('full_attention',), None)
    """
    layer_types = getattr(config, "layer_types", None)
    return (
        str(getattr(config, "model_type", "") or type(config).__name__),
        tuple(str(t) for t in layer_types) if isinstance(layer_types, list | tuple) else layer_types,
        getattr(config, "attention_chunk_size", None),
    )


def check_served_config(config: Any, *, mixers_split: bool | None = False) -> None:
    """Refuse a model that packing_hf's varlen attention (the registered name) cannot keep exact.

    Run by the attention itself, once per model config, on the first call: it is the only place that sees
    every model loaded with ``attn_implementation=packing_hf.ATTENTION_NAME``, prepared or not. Refuses
    registry entries marked ``refused``, models that compute attention themselves (the name would be
    accepted and ignored), configs with non-attention layers (:func:`unsupported_layers`) unless
    :func:`packing_hf.prepare_model_for_packing` split their mixers per sample (the attention cannot reach
    the mixers), and chunked local attention whose chunked layers are not named by ``layer_types``, each with
    the reason and what to do instead.

    Args:
        config: the config of the model (of its language model for a wrapper) the attention serves.
        mixers_split: the model calling the attention has its mixers split per sample by its preparation
            (:func:`preparation_of`); read from the model, since another model may share ``config``. ``None``:
            not known here (the mask function sees the config only), so what depends on it is left to the
            attention layers, which see their model.

    Raises:
        PackingRefused: a ``ValueError`` naming the architecture and the fix; ``.reason`` is the why.

    >>> from transformers import AutoConfig
    >>> check_served_config(AutoConfig.for_model("llama"))
    >>> check_served_config(AutoConfig.for_model("bamba"))
    Traceback (most recent call last):
    ...
    packing_hf.errors.PackingRefused: bamba cannot be packed exactly with attn_implementation='packing_hf_varlen' alone: Mamba2 layers carry their scan state and convolution window across the row (transformers' torch path takes no seq_idx), which the attention cannot reach; call packing_hf.prepare_model_for_packing(model) (packing_hf.Trainer does), which runs those layers per sample
    """
    model_type = str(getattr(config, "model_type", "") or type(config).__name__)
    entry = support(model_type)
    head = f"{model_type} cannot be packed exactly with attn_implementation='packing_hf_varlen': "
    if entry.status == "refused":
        raise PackingRefused(
            entry.reason, head + entry.reason + "; train it without packing (padded batches)"
        )
    # an attention-only config of a type whose mixers follow layer_types has nothing to prepare
    prepared = entry.status == "mixers" and (mixers_split is not False or mixer_free(config))
    if entry.status == "mixers" and not prepared:
        raise PackingRefused(
            entry.reason,
            head[:-2] + " alone: " + entry.reason + ", which the attention cannot reach; call "
            "packing_hf.prepare_model_for_packing(model) (packing_hf.Trainer does), which runs those layers "
            "per sample",
        )
    if entry.own_attention:
        raise PackingRefused(
            "it computes attention itself",
            head + "it computes attention itself instead of calling the registered attention, so the name "
            "would be accepted and ignored; load it with attn_implementation='eager' and call "
            "packing_hf.prepare_model_for_packing(model) (or use packing_hf.Trainer, which does)",
        )
    layers = None if prepared else unsupported_layers(config)
    if layers is not None:
        raise PackingRefused(layers, head + layers + "; train it without packing (padded batches)")
    layer_types = getattr(config, "layer_types", None) or ()
    # chunked layers named by layer_types are split into chunks counted from every sample's start by the
    # attention itself (packing_hf.attention.interface); without layer_types it cannot tell which layers
    if getattr(config, "attention_chunk_size", None) and not layer_types:
        raise PackingRefused("chunked local attention without layer_types", head + _CHUNKED)


# a decoder stack that reads (B, T) position_ids as its multimodal-RoPE rows (all equal) and, with fewer than
# 4 rows (no text row), hands its layers and its mask no positions (transformers 5: Qwen2-VL, GLM-4V, ...)
_EXPANDS_FLAT_POSITIONS = re.compile(
    r"position_ids\.ndim == 2:\s*position_ids = position_ids\[None, \.\.\.\]\.expand\((\w+),"
)


@functools.cache
def _drops_flat_positions(cls: type) -> bool:
    try:
        source = inspect.getsource(inspect.unwrap(cls.forward))
    except (OSError, TypeError, AttributeError):
        return False
    found = _EXPANDS_FLAT_POSITIONS.search(source)
    return found is not None and found.group(1) != "4" and "text_position_ids = None" in source


def flat_positions_dropped_by(model: Any) -> str | None:
    """The class name of the decoder stack in ``model`` that hands its layers no ``position_ids`` when given
    ``(B, T)`` ones, or ``None``.

    Such a stack (the language model of Qwen2-VL, Qwen2.5-VL, GLM-4V in transformers 5) expands ``(B, T)``
    positions to its 3 multimodal-RoPE rows, which carry no text row, and builds its mask and calls its layers
    without positions: neither a mask nor packing_hf's attention sees where the packed samples restart. Only
    ``cu_seq_lens_q`` (read by packing_hf's attention) or the text row of a prepared model keep them apart.
    Read from the stack's source (feature detection, not a list of model types).

    >>> flat_positions_dropped_by(torch.nn.Linear(2, 2)) is None
    True
    """
    if not isinstance(model, torch.nn.Module):
        return None
    for module in model.modules():
        if _drops_flat_positions(type(module)):
            return type(module).__name__
    return None
