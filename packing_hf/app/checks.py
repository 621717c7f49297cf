"""Names a ``packing-hf`` config or command refers to, checked before anything loads: model types and
attention implementations (with the closest valid names, and the package a missing one needs).

>>> check_attn_implementation("sdpa")
'sdpa'
"""

from __future__ import annotations

import difflib
import importlib.util

__all__ = ["check_attn_implementation", "check_model_type"]


def check_model_type(model_type: str) -> None:
    """Refuse a ``model_type`` transformers does not know, naming the closest ones.

    >>> check_model_type("lama")
    Traceback (most recent call last):
    ...
    ValueError: unknown model_type 'lama'; did you mean 'llama' or 'mllama' or 'llama4'? (any model type of transformers' AutoConfig)
    """
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type in CONFIG_MAPPING_NAMES:
        return
    close = difflib.get_close_matches(model_type, list(CONFIG_MAPPING_NAMES), n=3, cutoff=0.6)
    hint = (
        f"; did you mean {' or '.join(map(repr, close))}?" if close else "; e.g. 'llama', 'qwen2', 'mistral'"
    )
    raise ValueError(f"unknown model_type {model_type!r}{hint} (any model type of transformers' AutoConfig)")


# attention implementation -> (the module it needs, the pip package that provides it)
_ATTENTION_PACKAGES = {
    "flash_attention_2": ("flash_attn", "flash-attn"),
    "flash_attention_3": ("flash_attn_interface", "flash-attn-3 (built from flash-attention's hopper/)"),
    "flash_attention_4": ("flash_attn.cute", "flash-attn-4"),
}


def check_attn_implementation(name: str) -> str:
    """The name transformers gets for ``name`` (``packing_hf`` / ``packing_hf_varlen`` → packing_hf's
    registered attention); refuse an implementation whose package is missing, before any model loads.

    >>> check_attn_implementation("packing_hf"), check_attn_implementation("sdpa")
    ('packing_hf_varlen', 'sdpa')
    """

    from ..attention import resolve_attn_implementation

    resolved = resolve_attn_implementation(name)
    base = resolved.split("|")[-1]  # "paged|sdpa" -> "sdpa"
    needed = _ATTENTION_PACKAGES.get(base)
    if needed is not None:
        module, package = needed
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            raise ValueError(
                f"attn_implementation: {name} needs the {module} package, which is not installed "
                f"(pip install {package}, on a CUDA machine); or use sdpa or packing_hf"
            )
    elif "/" in base:  # a Hub kernel, e.g. kernels-community/flash-attn
        if importlib.util.find_spec("kernels") is None:
            raise ValueError(f"attn_implementation: {name} is a Hub kernel and needs `pip install kernels`")
    else:
        from transformers import AttentionInterface

        known = {"eager", *AttentionInterface._global_mapping}
        if base not in known:
            close = difflib.get_close_matches(base, sorted(known | {"packing_hf"}), n=3, cutoff=0.5)
            hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
            raise ValueError(
                f"unknown attn_implementation {name!r}{hint} (choose from eager, sdpa, packing_hf, "
                "flash_attention_2, flex_attention)"
            )
    return resolved
