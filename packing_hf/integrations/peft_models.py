"""PEFT adapters (LoRA and the other weight-space tuners) on packed batches.

A LoRA-style adapter adds trainable weights next to existing layers: the token mixing of the model is
untouched, so a packed row stays exact once the base model is prepared (:func:`prepare_model_for_packing`
finds the hooked modules inside a ``PeftModel``; the pre-flight check looks through it to the base model).
Prompt-learning methods (prefix tuning, prompt tuning, p-tuning, multitask prompt tuning, ...) are refused:
they prepend virtual tokens (or per-layer key/value prefixes) to every *row*, so in a packed row only the
first sample would get them and the others would attend to a prefix that is not theirs.

``transformers.Trainer`` takes no ``peft_config``; ``packing_hf.Trainer`` wraps the model with
:func:`apply_peft` (the TRL trainers take ``peft_config`` themselves; their refusal table,
:mod:`packing_hf.integrations.refusals`, refuses prompt learning before TRL wraps).

>>> from peft import LoraConfig, PromptTuningConfig
>>> refuse_prompt_learning(None, LoraConfig(r=4), stock="transformers.Trainer")  # fine: weight-space
>>> refuse_prompt_learning(None, PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4), stock="x")
Traceback (most recent call last):
...
ValueError: prompt-learning PEFT (PROMPT_TUNING) prepends virtual tokens to every row, and a packed row holds several samples: only the first would get them and the others would attend to a prefix that is not theirs; use a weight-space adapter (LoRA, DoRA, IA3, ...) or x without packing
"""

from __future__ import annotations

from typing import Any

from ..errors import missing_extra

__all__ = ["apply_peft", "is_peft_model", "peft_configs", "refuse_prompt_learning"]


def is_peft_model(model: Any) -> bool:
    """Whether ``model`` is a ``peft.PeftModel`` (checked without importing peft when it is not loaded)."""
    import sys

    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def peft_configs(model: Any, peft_config: Any = None) -> list[Any]:
    """The adapter configs in play: ``peft_config`` (about to be applied) and those already on ``model``."""
    configs = [peft_config] if peft_config is not None else []
    if not isinstance(model, str):
        configs += list((getattr(model, "peft_config", None) or {}).values())
    return configs


def refuse_prompt_learning(model: Any, peft_config: Any = None, *, stock: str) -> None:
    """Raise ``ValueError`` naming the method when an adapter of ``model`` or ``peft_config`` is prompt
    learning (virtual tokens prepended to every row); ``stock`` names the unpacked trainer to use instead."""
    for config in peft_configs(model, peft_config):
        if getattr(config, "is_prompt_learning", False):
            method = getattr(config, "peft_type", None)
            method = getattr(method, "value", method) or type(config).__name__
            raise ValueError(
                f"prompt-learning PEFT ({method}) prepends virtual tokens to every row, and a packed row holds "
                "several samples: only the first would get them and the others would attend to a prefix that is "
                "not theirs; use a weight-space adapter (LoRA, DoRA, IA3, ...) or "
                f"{stock} without packing"
            )


def apply_peft(model: Any, peft_config: Any, *, stock: str = "transformers.Trainer") -> Any:
    """``model`` wrapped with ``peft.get_peft_model(model, peft_config)``, after refusing prompt learning.

    Args:
        model: a ``PreTrainedModel`` (a ``PeftModel`` gets ``peft_config`` as an added adapter: refused,
            since the trainer would train only the active one; pass the model unwrapped instead).
        peft_config: a ``peft.PeftConfig`` (``LoraConfig(...)``), or None to return ``model`` unchanged.
        stock: the unpacked trainer named in the refusal.

    Returns:
        A ``peft.PeftModel`` whose adapter weights are the only trainable parameters.

    >>> from peft import LoraConfig
    >>> from packing_hf.architectures.tiny import build_tiny_model
    >>> model = apply_peft(build_tiny_model("llama"), LoraConfig(r=2, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    >>> type(model).__name__, all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    ('PeftModelForCausalLM', True)
    """
    if peft_config is None:
        return model
    refuse_prompt_learning(model, peft_config, stock=stock)
    try:
        from peft import PeftConfig, get_peft_model
    except ImportError as error:
        raise missing_extra("peft_config", "peft", error) from None
    if not isinstance(peft_config, PeftConfig):
        raise TypeError(
            f"peft_config must be a peft.PeftConfig (e.g. peft.LoraConfig(r=16)), got {type(peft_config).__name__}"
        )
    if is_peft_model(model):
        raise ValueError(
            "the model already is a PeftModel and peft_config was given too; pass the base model with "
            "peft_config, or the PeftModel alone"
        )
    return get_peft_model(model, peft_config)
