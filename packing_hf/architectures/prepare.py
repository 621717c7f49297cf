"""``prepare_model_for_packing``: make one model instance exact on packed rows, or refuse it; reversible.

Driven by the registry (:mod:`packing_hf.registry`): every prepared model gets the batch
guards of :mod:`packing_hf.attention.guards` (a forward pre-hook); architectures whose mask ignores
``position_ids`` get per-sample masks in their decoder layers under eager/sdpa; refused architectures
raise with the reason; an architecture the registry does not know is checked once on a tiny copy of its
config (:func:`packing_hf.check_packing`, cached per config and attention implementation).

:func:`prepare_model_for_packing` returns a handle whose ``revert()`` removes every hook (PEFT-style), and
works as a context manager. Nothing here is global: no transformers symbol is replaced.

>>> from packing_hf.architectures.tiny import build_tiny_model
>>> with prepare_model_for_packing(build_tiny_model("opt", "eager")) as handle:
...     handle.mask_fix, handle.layers
(True, 2)
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..attention import ATTENTION_NAME, resolve_attn_implementation
from ..attention.admission import (
    bidirectional_attention,
    check_served_config,
    unsupported_layers,
)
from ..registry import REGISTRY, support, wrapper_text_config
from ..verify import DEFAULT_TOLERANCE, PackingReport, check_packing
from .kernels import check_fla_triton
from .mixers import find_mixers
from .preparation import PackingPreparation
from .tiny import build_tiny_model, tiny_config

__all__ = [
    "PackingPreparation",
    "check_architecture",
    "check_unregistered",
    "clear_architecture_cache",
    "prepare_model_for_packing",
    "revert_model_for_packing",
]

logger = logging.getLogger(__name__)

# The one cache of tiny-model checks: the pre-flight (prepared), check_unregistered (stock) and the CLI share it.
_TINY_CHECKS: dict[tuple[str, str, bool], PackingReport] = {}


def clear_architecture_cache() -> None:
    """Forget the reports cached by :func:`check_architecture`.

    >>> clear_architecture_cache()
    """
    _TINY_CHECKS.clear()


def check_architecture(config, attn_implementation: str = "sdpa", *, prepare: bool = True) -> PackingReport:
    """Pre-flight check: does this architecture pack exactly? Runs on a tiny copy, cached.

    Builds ``tiny_config(config)`` with ``attn_implementation`` (fp32, CPU), optionally prepares it with
    :func:`packing_hf.prepare_model_for_packing` (what the trainers do to the real model), and runs
    :func:`check_packing`. The result is cached per (tiny config, implementation, prepare): the first call
    for an architecture costs well under a second, later ones nothing.

    Args:
        config: the ``PretrainedConfig`` of the model to train, or a ``model_type`` string.
        attn_implementation: ``"eager"``, ``"sdpa"``, ``"packing_hf"`` / ``packing_hf.ATTENTION_NAME``, ...
        prepare: check the model as prepared by packing_hf (``True``) or stock (``False``).

    Returns:
        A :class:`PackingReport`. When preparation refuses the architecture, ``report.error`` holds the
        reason (and ``report.leaked`` is ``True``).

    >>> check_architecture("mistral", "sdpa").leaked
    False
    >>> "DSA" in check_architecture("deepseek_v32", "sdpa").error
    True
    >>> check_architecture("bamba", "sdpa").leaked  # prepared: its Mamba2 layers run per sample
    False
    """
    cfg = tiny_config(config)
    implementation = resolve_attn_implementation(attn_implementation)
    key = (cfg.to_json_string(use_diff=False), implementation, prepare)
    if key in _TINY_CHECKS:
        return _TINY_CHECKS[key]
    model = build_tiny_model(config, implementation)
    handle = None
    if prepare:
        try:
            handle = prepare_model_for_packing(model, check_unknown=False)
        except ValueError as exc:
            report = PackingReport(
                cfg.model_type,
                implementation,
                None,
                (),
                DEFAULT_TOLERANCE,
                (),
                (),
                (),
                error=f"refused: {exc}",
            )
            _TINY_CHECKS[key] = report
            return report
    try:
        # the noise-floor verdict: a tiny copy's own fp32 rounding can pass a fixed 1e-5 (Gemma 4 did)
        report = check_packing(model)
    finally:
        if handle is not None:
            handle.revert()
    _TINY_CHECKS[key] = report
    return report


def check_unregistered(config: Any, attn_implementation: str) -> PackingReport:
    """The stock check of an architecture the registry does not know, on a tiny copy (cached).

    :func:`check_architecture` with ``prepare=False``: a tiny copy of ``config`` with ``attn_implementation``,
    checked unprepared with the noise-floor verdict; cached with the other tiny-model checks.

    >>> check_unregistered("llama", "sdpa").leaked
    False
    """
    return check_architecture(config, attn_implementation, prepare=False)


def prepare_model_for_packing(model: torch.nn.Module, *, check_unknown: bool = True) -> PackingPreparation:
    """Make ``model`` exact on packed rows, or refuse it; reversible (``handle.revert()`` / ``with``).

    What it installs, on this model instance only:

    - a forward pre-hook running :func:`packing_hf.attention.guards.validate_packed_batch` on every call:
      packed calls get ``use_cache=False`` and lose an all-ones ``attention_mask``; a padding mask, a
      cache, several rows with ``cu_seq_lens_q``, positions not restarting at 0, int32 overflow and labels
      not masked at sample starts raise ``ValueError``. Unpacked calls (e.g. ``generate``) pass unchanged.
      Models with layer hooks (below) get it on their decoder too (called on its own, e.g. by TRL's fused LM
      head), and a packed one-row call gets ``cu_seq_lens_q/k`` from its positions: the layers read it.
    - for architectures whose mask ignores ``position_ids`` (registry status ``"mask"``) and that run
      eager/sdpa attention: pre-hooks on the decoder layers restricting their attention mask to same-sample
      pairs.
    - for hybrid and recurrent architectures (registry status ``"mixers"``: Mamba/Mamba2, gated DeltaNet,
      KDA, lightning attention, RG-LRU, short convolutions): hooks on every token-mixer module named by the
      registry that run it on the samples of a packed row as a right-padded batch
      (:mod:`packing_hf.architectures.mixers`), so no state or convolution window crosses a boundary;
      pure state-space stacks (``split_stack``) run their whole block stack on the padded samples instead.

    Every hook reads the boundaries of its own call (:mod:`packing_hf.architectures.preparation`), so it stays
    exact under activation checkpointing, several packed forwards before one backward, ``copy.deepcopy`` /
    ``pickle`` of the model (the copy carries its own handle) and direct calls of the decoder. Calling it twice
    returns the same handle. Keep the model prepared until the backward pass is done: a checkpoint wrapper
    that runs module hooks inside the checkpoint re-runs them during backward.

    Args:
        model: a transformers causal LM.
        check_unknown: for architectures not in the registry, run :func:`check_unregistered` on a tiny copy
            of the config and refuse on a leak; ``False`` trusts them (guards only), e.g. because the caller
            has just checked them itself.

    Returns:
        A :class:`PackingPreparation`.

    Raises:
        ValueError: the architecture cannot be packed exactly (the message says why), or its attention is
            computed by the model itself while ``attn_implementation`` is packing_hf's varlen one, or its gated
            DeltaNet layers sit on a CUDA stack whose fla + Triton backward is wrong
            (:func:`packing_hf.architectures.kernels.check_fla_triton`).

    >>> import torch
    >>> from transformers import AutoModelForCausalLM
    >>> from packing_hf.architectures.tiny import tiny_config
    >>> model = AutoModelForCausalLM.from_config(tiny_config("opt"), attn_implementation="sdpa")
    >>> with prepare_model_for_packing(model) as handle:
    ...     check_packing(model).leaked
    False
    >>> check_packing(model).leaked  # reverted: stock OPT again
    True
    """
    existing = getattr(model, "_packing_hf_preparation", None)
    if isinstance(existing, PackingPreparation) and existing.active:
        return existing
    config = model.config
    model_type = str(getattr(config, "model_type", type(model).__name__))
    impl = str(getattr(config, "_attn_implementation", None))
    varlen = impl == ATTENTION_NAME
    # a vision-language wrapper: its language model is a text decoder whose own entry decides
    text_config = wrapper_text_config(config) if model_type not in REGISTRY else None
    rules_config = config if text_config is None else text_config
    entry = support(str(getattr(rules_config, "model_type", model_type)))
    name = model_type if text_config is None else f"{model_type} (language model {entry.model_type})"

    if entry.status == "refused":
        raise ValueError(f"{name}: {entry.reason}; train it without packing (or with padding)")
    bidirectional = bidirectional_attention(rules_config)
    if bidirectional is not None:
        raise ValueError(f"{name}: {bidirectional}; train it without packing (or with padding)")
    mixers = find_mixers(model, entry.mixers) if entry.mixers else []
    layers = unsupported_layers(rules_config)
    if layers is not None and not mixers:
        names = f" (looked for {', '.join(entry.mixers)})" if entry.mixers else ""
        raise ValueError(
            f"{name}: {layers}, and no token-mixer module to run per sample was found{names}; train it "
            "without packing (or with padding)"
        )
    if mixers:  # fla refuses its gated DeltaNet backward on some Triton/GPU stacks: say so before training
        check_fla_triton(rules_config, next(model.parameters()).device)
    if varlen:  # the rules the attention itself applies (own attention, chunked attention, ...)
        check_served_config(rules_config, mixers_split=bool(mixers))
    if entry.status == "unknown" and check_unknown and text_config is not None:
        report = check_architecture(config, impl, prepare=True)
        if report.leaked:
            raise ValueError(
                f"{name}: its language model is not in packing_hf's architecture registry and a check of a tiny "
                f"copy of the wrapper, prepared, leaks: {report.summary()}. Train it without packing, or pass "
                "check_unknown=False if you verified it yourself with packing_hf.check_packing(model)"
            )
    elif entry.status == "unknown" and check_unknown:
        report = check_unregistered(config, impl)
        if report.leaked:
            raise ValueError(
                f"{model_type} is not in packing_hf's architecture registry and a check on a tiny copy of its "
                f"config leaks: {report.summary()}. Train it without packing, or pass check_unknown=False if you "
                "verified it yourself with packing_hf.check_packing(model)"
            )
    mask_fix = (entry.status == "mask" or entry.mask_fix) and not varlen
    handle = PackingPreparation(model, entry, mask_fix, mixers)
    model._packing_hf_preparation = handle
    if mask_fix:
        logger.info(
            "%s: %s; restricting the mask per sample in %d layers", model_type, entry.reason, handle.layers
        )
    if mixers:
        logger.info("%s: %s; running %d token mixers per sample", model_type, entry.reason, len(mixers))
    return handle


def revert_model_for_packing(model: torch.nn.Module) -> bool:
    """Undo :func:`prepare_model_for_packing` on ``model``; returns whether anything was prepared.

    >>> revert_model_for_packing(torch.nn.Linear(2, 2))
    False
    """
    handle = getattr(model, "_packing_hf_preparation", None)
    if not isinstance(handle, PackingPreparation):
        return False
    handle.revert()
    return True
