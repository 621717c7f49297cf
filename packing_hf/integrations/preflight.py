"""Pre-flight check before training on packed batches: no sample may see another.

Whether packing is exact depends on the architecture and the attention implementation (stock OPT, Bloom,
Falcon, ... leak on eager/sdpa; llama does not). :func:`preflight_packing` asks
:func:`packing_hf.check_architecture` (a packed-vs-separate comparison on a tiny copy of the
model's config, cached per architecture and attention implementation, so it costs well under a second
once per process) checked as packing_hf prepares it, and acts on the answer:

- ``"switch"``: if it leaks, register packing_hf's varlen attention and switch the model to it
  (``model.set_attn_implementation``), then check again and refuse to train if it still leaks (e.g.
  hybrid Mamba layers that need seq_idx kernels);
- ``"error"``: refuse to train if it leaks;
- ``"off"``: do nothing.

Unless ``"off"``, the model is then prepared with :func:`packing_hf.prepare_model_for_packing`
(on this instance only, reversible): batch guards on every forward (no cache, no attention mask next to
packed inputs, ...) and per-sample masks for architectures whose mask ignores ``position_ids``.

>>> from packing_hf.architectures.tiny import tiny_config
>>> from transformers import AutoModelForCausalLM
>>> model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sdpa")
>>> handle = preflight_packing(model, mode="error")  # llama/sdpa is exact: guards only
>>> handle.mask_fix
False
>>> handle.revert()
"""

from __future__ import annotations

import logging
from typing import Any

from ..architectures import check_architecture, prepare_model_for_packing
from ..attention import register_attention

__all__ = ["base_model", "preflight_packing"]

logger = logging.getLogger(__name__)


def base_model(model: Any) -> Any:
    """The ``PreTrainedModel`` under PEFT / accelerate wrappers."""
    for _ in range(4):
        inner = model.get_base_model() if hasattr(model, "get_base_model") else getattr(model, "module", None)
        if inner is None or inner is model:
            break
        model = inner
    return model


def _finding(config: Any, implementation: str, report: Any) -> str:
    """What a failed check found: a measured leak, or a packed forward that could not run (no leak measured)."""
    if report.error is not None:
        return (
            f"the pre-flight check could not run a tiny {config.model_type} / {implementation} on a packed row "
            f"({report.error}), so whether packed samples stay apart was not measured"
        )
    return f"packed samples would see each other with {config.model_type} / {implementation}: {report.summary()}"


def preflight_packing(model: Any, mode: str = "switch", role: str = "model"):
    """Check that ``model`` keeps packed samples apart, switch its attention or refuse, then prepare it.

    Args:
        model: the model about to be trained (a ``PreTrainedModel``, possibly wrapped by PEFT).
        mode: ``"switch"``, ``"error"`` or ``"off"`` (see the module docstring).
        role: what the model is to the trainer, named in the log line (``"model"``, ``"reference model"``).

    Returns:
        The :class:`~packing_hf.architectures.PackingPreparation` handle of the prepared model
        (``handle.revert()`` removes its hooks), or ``None`` for ``mode="off"``.

    Raises:
        ValueError: ``mode="error"`` and the model leaks; or ``mode="switch"`` and it leaks even with
            packing_hf's attention; or an unknown ``mode``.
    """
    if mode == "off":
        return None
    if mode not in ("switch", "error"):
        raise ValueError(f"packing_preflight={mode!r}: it must be 'switch', 'error' or 'off'")
    base = base_model(model)
    config = base.config
    implementation = str(getattr(config, "_attn_implementation", None) or "eager")
    # checked as packing_hf prepares it (guards, per-sample masks where the architecture needs them)
    report = check_architecture(config, implementation)
    if report.leaked:
        fix = (
            "set packing_preflight='switch' to use packing_hf's varlen attention, load the model with "
            "attn_implementation=packing_hf.ATTENTION_NAME, or train without packing"
        )
        if mode == "error":
            raise ValueError(f"{_finding(config, implementation, report)}; {fix}")
        name = register_attention()
        switched = check_architecture(config, name)
        if switched.leaked:
            raise ValueError(
                f"{_finding(config, implementation, report)}, and with packing_hf's attention: "
                f"{_finding(config, name, switched)}; train this architecture without packing "
                "(max_tokens_per_batch=None and a padding collator)"
            )
        base.set_attn_implementation(name)
        logger.warning(
            "packing pre-flight (%s): %s / %s lets packed samples see each other (%s); switched it to "
            "attn_implementation=%r, which keeps them apart (%s)",
            role,
            config.model_type,
            implementation,
            report.summary(),
            name,
            switched.summary(),
        )
        report = switched
    logger.info("packing pre-flight (%s): %s", role, report.summary())
    # the check above already covered an architecture the registry does not know: do not check it twice
    return prepare_model_for_packing(base, check_unknown=False)
