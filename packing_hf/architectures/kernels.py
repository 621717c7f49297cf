"""The optional CUDA kernels that hybrid models' token mixers run on, and the known-bad combinations of them.

transformers runs a gated DeltaNet layer (Qwen3-Next, Qwen3.5, OLMo-Hybrid, ...) through fla
(flash-linear-attention) whenever ``fla`` imports, and through its own torch code otherwise. fla's Triton
kernel for the gated backward (``chunk_bwd_dqkwg``) is miscompiled by Triton >= 3.4.0 and < 3.7.1 on
Hopper GPUs (fla issue #640); fla refuses it and raises in the first backward pass, after the model is
loaded and the first forward has run. :func:`check_fla_triton` says so, and what to do, before any training;
:func:`fla_triton_problem` is the rule itself, on version strings and a compute capability.

>>> fla_triton_problem("0.6.0", "3.6.0", (9, 0)) is not None  # H100, the Triton torch 2.11 pins
True
>>> fla_triton_problem("0.6.0", "3.7.1", (9, 0)) is None  # fixed Triton
True
>>> fla_triton_problem("0.6.0", "3.6.0", (8, 0)) is None  # A100: not affected
True
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import torch

from ..registry import support, wrapper_text_config

__all__ = ["check_fla_triton", "fla_triton_problem", "uses_fla_gated_deltanet"]

# Triton versions [first bad, first fixed) that miscompile fla's gated chunk_bwd_dqkwg on Hopper (fla #640),
# compared as fla compares them (packaging versions: 3.7.1rc1 is still bad, 3.5.0+git... a 3.5.0)
_BAD_TRITON = ("3.4.0", "3.7.1")


def fla_triton_problem(
    fla_version: str | None,
    triton_version: str | None,
    capability: tuple[int, int] | None,
    *,
    tilelang: bool = False,
) -> str | None:
    """What is wrong with running fla's gated DeltaNet backward on this stack, and the fix; ``None`` when fine.

    Mirrors fla's own guard in ``fla.ops.common.chunk_o.chunk_bwd_dqkwg``: a GPU of compute capability 9.x
    or above (fla counts every capability >= 9 as "Hopper"), Triton in [3.4.0, 3.7.1), and fla's Triton
    backend. With tilelang installed fla dispatches this kernel to its tilelang backend instead, so that
    case passes here; tilelang without a usable ``nvcc`` still makes fla raise, with its own message.

    Args:
        fla_version: the installed fla version, ``None`` when fla does not import (transformers then runs
            its torch implementation, which is unaffected).
        triton_version: the installed Triton version, ``None`` when Triton is not installed.
        capability: ``(major, minor)`` CUDA compute capability of the training GPU, ``None`` without one.
        tilelang: whether tilelang is installed (fla's alternative backend for this kernel).

    Returns:
        A message naming the versions and what to do, or ``None``.

    >>> print(fla_triton_problem("0.6.0", "3.5.1", (9, 0)))  # doctest: +ELLIPSIS
    fla 0.6.0 (flash-linear-attention) with Triton 3.5.1 on a GPU of compute capability 9.0: ...
    >>> fla_triton_problem(None, "3.5.1", (9, 0)) is None  # no fla: transformers' torch path
    True
    >>> fla_triton_problem("0.6.0", "3.5.1", (9, 0), tilelang=True) is None
    True
    """
    if fla_version is None or triton_version is None or capability is None or tilelang:
        return None
    from packaging.version import Version

    if capability[0] < 9 or not Version(_BAD_TRITON[0]) <= Version(triton_version) < Version(_BAD_TRITON[1]):
        return None
    major, minor = capability
    return (
        f"fla {fla_version} (flash-linear-attention) with Triton {triton_version} on a GPU of compute capability "
        f"{major}.{minor}: Triton >= 3.4.0 and < 3.7.1 computes wrong gradients in fla's gated DeltaNet "
        "backward on Hopper GPUs (chunk_bwd_dqkwg, fla issue #640), so fla raises in the first backward pass. "
        "Before training, do one of: upgrade Triton to >= 3.7.1 (e.g. a torch release that pins it); install "
        "tilelang and a CUDA nvcc (fla's other backend for this kernel); or uninstall flash-linear-attention, "
        "and transformers runs its torch implementation (exact, much slower)"
    )


def uses_fla_gated_deltanet(config: Any) -> bool:
    """Whether transformers runs ``config``'s model with gated DeltaNet layers (fla's ``chunk_gated_delta_rule``
    when fla is installed): its registry entry's token mixers are gated DeltaNet modules.

    >>> from transformers import AutoConfig
    >>> uses_fla_gated_deltanet(AutoConfig.for_model("qwen3_5_text")), uses_fla_gated_deltanet(AutoConfig.for_model("llama"))
    (True, False)
    """
    text = wrapper_text_config(config)
    model_type = str(getattr(text if text is not None else config, "model_type", ""))
    return any(name.endswith("GatedDeltaNet") for name in support(model_type).mixers)


def _version(module_name: str) -> str | None:
    """``module.__version__`` of an importable module, ``None`` when it is missing or broken."""
    if importlib.util.find_spec(module_name) is None:
        return None
    try:
        return str(importlib.import_module(module_name).__version__)
    except Exception:  # a broken install (e.g. a CUDA mismatch): transformers falls back to torch too
        return None


def check_fla_triton(config: Any, device: torch.device | str | None = None) -> None:
    """Refuse a gated DeltaNet model on a stack where fla's backward raises (see :func:`fla_triton_problem`).

    A no-op for models without gated DeltaNet layers, without fla or off CUDA.

    Args:
        config: the model's config (a multimodal wrapper's text config decides).
        device: the device the model runs on: a CUDA device is checked, any other is not (fla's kernels run
            on CUDA tensors only); ``None`` checks the current CUDA device, if there is one.

    Raises:
        ValueError: fla, Triton and the GPU are a combination fla refuses in the backward pass; the message
            names the versions and the fixes.

    >>> from transformers import AutoConfig
    >>> check_fla_triton(AutoConfig.for_model("qwen3_5_text"))  # no fla, no GPU here: nothing to refuse
    """
    if not uses_fla_gated_deltanet(config):
        return
    if device is None:
        if not torch.cuda.is_available():
            return
        device = torch.device("cuda", torch.cuda.current_device())
    if torch.device(device).type != "cuda":
        return
    fla_version = _version("fla")
    if fla_version is None:
        return
    problem = fla_triton_problem(
        fla_version,
        _version("triton"),
        tuple(torch.cuda.get_device_capability(device)),
        tilelang=importlib.util.find_spec("tilelang") is not None,
    )
    if problem is not None:
        raise ValueError(f"{getattr(config, 'model_type', type(config).__name__)}: {problem}")
