"""Admission: which models packing_hf's varlen attention serves, and the process state that decides it.

The registry (:mod:`packing_hf.registry`) says, as data, how every ``model_type`` packs. This module is the
policy the attention applies to a model it is asked to serve: the rules over a config's layers
(:func:`unsupported_layers`, :func:`mixer_free`, :func:`bidirectional_attention`), the marks
:func:`packing_hf.prepare_model_for_packing` leaves on the configs it prepared (``_ConfigMarks``:
``mark_mixers_prepared``, ``mark_mask_prepared``), what a model still needs before it packs exactly (:func:`needs_preparation`) and
the refusal of what the attention cannot keep exact (:func:`check_served_config`, raising
:class:`~packing_hf.errors.PackingRefused` with the registry's reason as ``.reason``).

>>> from transformers import AutoConfig
>>> needs_preparation(AutoConfig.for_model("llama")) is None
True
"""

from __future__ import annotations

import weakref
from typing import Any

from ..errors import PackingRefused
from ..registry import MIXERS_BY_LAYER_TYPE, REGISTRY, support, wrapper_text_config

__all__ = [
    "bidirectional_attention",
    "check_served_config",
    "mark_mask_prepared",
    "mark_mixers_prepared",
    "mask_prepared",
    "mixer_free",
    "mixers_prepared",
    "needs_preparation",
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


class _ConfigMarks:
    """Configs marked by :func:`packing_hf.prepare_model_for_packing` (unmarked by its ``revert()``), as
    ``id(config) -> weakref``: a config is not hashable, and nothing is written on it (a saved model stays stock).

    Two marks, read by :func:`needs_preparation` (and so by :func:`packing_hf.validate_packed_batch`) and by
    :func:`check_served_config`, so that the attention name serves a prepared model and still refuses an
    unprepared one: ``mark_mixers_prepared`` / ``mixers_prepared`` (the mixers run per sample, registry
    status ``"mixers"``), ``mark_mask_prepared`` / ``mask_prepared`` (per-sample masks in the decoder layers,
    status ``"mask"`` or a hybrid's mask fix).

    >>> from transformers import AutoConfig
    >>> config = AutoConfig.for_model("bamba")
    >>> mark_mixers_prepared(config, True)
    >>> mixers_prepared(config), mask_prepared(config)
    (True, False)
    >>> mark_mixers_prepared(config, False)
    >>> mixers_prepared(config)
    False
    """

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref] = {}

    def set(self, config: Any, marked: bool) -> None:
        key = id(config)
        if marked:
            self._refs[key] = weakref.ref(config, lambda _: self._refs.pop(key, None))
        else:
            self._refs.pop(key, None)

    def __contains__(self, config: Any) -> bool:
        return (seen := self._refs.get(id(config))) is not None and seen() is config


_PREPARED_MIXERS, _PREPARED_MASKS = _ConfigMarks(), _ConfigMarks()
mark_mixers_prepared, mixers_prepared = _PREPARED_MIXERS.set, _PREPARED_MIXERS.__contains__
mark_mask_prepared, mask_prepared = _PREPARED_MASKS.set, _PREPARED_MASKS.__contains__


def needs_preparation(config: Any, *, varlen: bool = False) -> str | None:
    """Why the model of ``config``, as loaded, lets packed samples see each other until
    :func:`packing_hf.prepare_model_for_packing` prepares it; ``None`` when it needs nothing or is prepared.

    Reads the registry entry of the config (of a multimodal wrapper's language model when the wrapper is not
    registered itself) and its layers:

    - ``"mixers"``: its mixers carry state across the row unless they are split per sample
      (:func:`mixers_prepared`), or the config has no mixer (:func:`mixer_free`);
    - ``"mask"`` (or a hybrid's ``mask_fix``): its mask ignores ``position_ids`` unless its layers get per-sample
      masks (:func:`mask_prepared`), or it runs packing_hf's varlen attention (``varlen=True``: the config's
      ``_attn_implementation`` is ``packing_hf.ATTENTION_NAME``), which keeps the samples apart itself (and
      refuses a model computing attention in its own code).

    Other statuses say ``None`` here: ``"refused"`` and ``"unknown"`` are decided by
    :func:`check_served_config` and ``prepare_model_for_packing``.

    >>> from transformers import AutoConfig
    >>> needs_preparation(AutoConfig.for_model("llama")) is None
    True
    >>> needs_preparation(AutoConfig.for_model("bamba"))[:6]
    'Mamba2'
    """
    model_type = str(getattr(config, "model_type", "") or type(config).__name__)
    text = wrapper_text_config(config) if model_type not in REGISTRY else None
    rules = config if text is None else text
    entry = support(str(getattr(rules, "model_type", model_type)))
    marked = (config, rules)
    if entry.status == "mixers" and not any(mixers_prepared(c) for c in marked) and not mixer_free(rules):
        return entry.reason
    mixers_split = entry.status == "mixers" and any(mixers_prepared(c) for c in marked)
    if entry.status == "mask" or (entry.mask_fix and not mixers_split):
        if not (varlen and not entry.own_attention) and not any(mask_prepared(c) for c in marked):
            return entry.reason
    return None


def served_config_key(config: Any) -> tuple:
    """The config fields :func:`check_served_config` reads, as a hashable value: the attention checks a config
    again when this changes (a ``layer_types`` or ``attention_chunk_size`` set after the first forward).

    >>> from types import SimpleNamespace
    >>> served_config_key(SimpleNamespace(model_type="llama", layer_types=["full_attention"]))
    ('llama', ('full_attention',), None, False)
    """
    layer_types = getattr(config, "layer_types", None)
    return (
        str(getattr(config, "model_type", "") or type(config).__name__),
        tuple(str(t) for t in layer_types) if isinstance(layer_types, list | tuple) else layer_types,
        getattr(config, "attention_chunk_size", None),
        mixers_prepared(config),
    )


def check_served_config(config: Any) -> None:
    """Refuse a model that packing_hf's varlen attention (the registered name) cannot keep exact.

    Run by the attention itself, once per model config, on the first call: it is the only place that sees
    every model loaded with ``attn_implementation=packing_hf.ATTENTION_NAME``, prepared or not. Refuses
    registry entries marked ``refused``, models that compute attention themselves (the name would be
    accepted and ignored), configs with non-attention layers (:func:`unsupported_layers`) unless
    :func:`packing_hf.prepare_model_for_packing` split their mixers per sample (the attention cannot reach
    the mixers), and chunked local attention whose chunked layers are not named by ``layer_types``, each with
    the reason and what to do instead.

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
    prepared = entry.status == "mixers" and (mixers_prepared(config) or mixer_free(config))
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
