"""The optional CUDA kernels behind :func:`packing_hf.attention.varlen_attention`: FlashAttention 2/3/4
(``flash_attn``, ``flash_attn_interface``, ``flash_attn.cute``) and torch's ``varlen_attn``.

Every package is imported lazily and only when asked for (never on CPU); a broken install counts as not
installed. The call contracts (argument names, window spelling, GQA) are adapted per package here.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
from collections.abc import Callable

import torch

from .sdpa import _Call

_MISSING_MODULES: set[str] = set()


def _import(name: str):
    """The module ``name`` or ``None``; looks in ``sys.modules`` first so stand-ins installed by tests count."""
    module = sys.modules.get(name)
    if module is not None:
        return module
    if name in _MISSING_MODULES:
        return None
    try:
        return importlib.import_module(name)
    except Exception:  # a broken install (e.g. a CUDA mismatch) is "not available", never a crash at import
        _MISSING_MODULES.add(name)
        return None


@functools.lru_cache(maxsize=16)
def _parameters(fn: Callable) -> frozenset[str]:
    try:
        return frozenset(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return frozenset()


@torch.compiler.assume_constant_result
def _parameter_names(module_name: str, attr: str) -> tuple[str, ...]:
    """The parameter names of ``module_name.attr`` (``()`` when absent or unknown), a constant to
    ``torch.compile``: dynamo (torch 2.11) breaks the graph at ``inspect.signature``, once per attention call."""
    module = _import(module_name)
    fn = getattr(module, attr, None) if module is not None else None
    return tuple(sorted(_parameters(fn))) if fn is not None else ()


def _flash_package_function(module_name: str) -> Callable | None:
    module = _import(module_name)
    return getattr(module, "flash_attn_varlen_func", None) if module is not None else None


def _flash_package_features(module_name: str) -> frozenset[str]:
    fn = _flash_package_function(module_name)
    if fn is None:
        return frozenset()
    params = _parameters(fn)
    features = {"window"} if "window_size" in params else set()
    for feature, names in (
        ("softcap", ("softcap",)),
        ("dropout", ("dropout_p",)),
        ("alibi", ("alibi_slopes",)),
        ("sinks", ("s_aux", "learnable_sink")),
    ):
        if any(name in params for name in names):
            features.add(feature)
    return frozenset(features)


def _run_flash_package(module_name: str, call: _Call) -> torch.Tensor:
    fn = _flash_package_function(module_name)
    params = _parameter_names(module_name, "flash_attn_varlen_func")
    kwargs = {
        "cu_seqlens_q": call.cu_q,
        "cu_seqlens_k": call.cu_k,
        "softmax_scale": call.scale,
        "causal": call.causal,
    }
    # the longest segment is a launch hint FA2/FA3 require and FA4 derives itself
    if not params or "max_seqlen_q" in params:
        kwargs.update(max_seqlen_q=call.max_q, max_seqlen_k=call.max_k)
    if call.window != (-1, -1):
        # FA4 (flash_attn.cute) spells an unbounded side None, FA2/FA3 spell it -1
        unbounded = None if module_name == "flash_attn.cute" else -1
        kwargs["window_size"] = tuple(unbounded if w < 0 else w for w in call.window)
    if call.softcap > 0:
        kwargs["softcap"] = call.softcap
    if call.dropout_p > 0:
        kwargs["dropout_p"] = call.dropout_p
    if call.alibi_slopes is not None:
        kwargs["alibi_slopes"] = call.alibi_slopes.float()
    if call.s_aux is not None:
        kwargs["s_aux" if "s_aux" in params else "learnable_sink"] = call.s_aux
    if params:
        unsupported = sorted(name for name in kwargs if name not in params)
        if unsupported:
            raise ValueError(
                f"{module_name}.flash_attn_varlen_func does not accept {unsupported}; "
                "upgrade the package or use backend='sdpa'"
            )
    out = fn(call.q, call.k, call.v, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def _torch_varlen_function() -> Callable | None:
    module = _import("torch.nn.attention.varlen")
    return getattr(module, "varlen_attn", None) if module is not None else None


def _run_torch_varlen(call: _Call) -> torch.Tensor:
    fn = _torch_varlen_function()
    params = _parameter_names("torch.nn.attention.varlen", "varlen_attn")
    k, v = call.k, call.v
    gqa = call.q.shape[1] != k.shape[1]
    kwargs: dict = {"scale": call.scale}
    if gqa:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:  # older torch: expand the kv heads ourselves (memory only, same result)
            groups = call.q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    # varlen_attn has no causal flag: causal is the window (-1, 0), and (left, 0) is causal + sliding
    left, right = call.window
    window = (left, 0 if call.causal else right)
    if window != (-1, -1):
        if "window_size" not in params:
            raise ValueError(
                "this torch's varlen_attn has no window_size (torch >= 2.10 has it); use backend='sdpa'"
            )
        kwargs["window_size"] = window
    out = fn(call.q, k, v, call.cu_q, call.cu_k, call.max_q, call.max_k, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def _cuda_capability(device: torch.device) -> tuple[int, int]:
    if device.type != "cuda" or not torch.cuda.is_available():
        return (0, 0)
    return torch.cuda.get_device_capability(device)
