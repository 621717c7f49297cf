"""Variable-length ("varlen") attention over packed rows, with interchangeable backends.

Every backend computes the same thing: ``n`` independent attention problems laid end to end in one
``(total_tokens, heads, head_dim)`` tensor, segment ``i`` of the queries being rows
``cu_seqlens_q[i]:cu_seqlens_q[i + 1]`` and attending only to keys ``cu_seqlens_k[i]:cu_seqlens_k[i + 1]``.
The conventions are FlashAttention's, so every backend is interchangeable:

- ``causal``: query ``i`` of a segment sees key ``j`` iff ``j <= i + Lk - Lq`` (aligned bottom-right, which
  is what decoding with a cache needs; for ``Lq == Lk`` it is the usual lower triangle);
- ``window_size = (left, right)``: key ``j`` is also limited to ``[i' - left, i' + right]`` with
  ``i' = i + Lk - Lq``; ``-1`` means unbounded. transformers' ``sliding_window = W`` is ``(W - 1, W - 1)``;
- ``softcap``: scores become ``softcap * tanh(scores / softcap)`` after scaling (gemma2);
- ``alibi_slopes``: ``(heads,)`` fp32, the bias ``-slope * |i' - j|`` is added to the scores;
- ``s_aux``: ``(heads,)`` attention sinks (gpt_oss): one extra logit per head that joins the softmax
  normalisation and is then dropped, so rows may sum to less than 1.

Backends, in the order ``"auto"`` tries them (the first that is installed, runs on the tensors' device and
dtype, and supports every requested feature wins; :func:`select_backend` tells which):

==============  ========================================  =====================================
name            kernel                                    runs on
==============  ========================================  =====================================
flash_attn_3    ``flash_attn_interface`` (FA3, Hopper)     CUDA sm90, fp16/bf16
flash_attn_4    ``flash_attn.cute`` (FA4)                  CUDA sm90/sm100, fp16/bf16
flash_attn      ``flash_attn.flash_attn_varlen_func``      CUDA sm80+, fp16/bf16
torch_varlen    ``torch.nn.attention.varlen.varlen_attn``  CUDA sm80+, fp16/bf16 (recent torch)
sdpa            one SDPA call per segment (or one batched  any device and dtype, autograd
                call when all segments have one length);
                under torch.compile and off the CPU: the
                ``sdpa_padded`` layout (no host read)
sdpa_padded     one SDPA call on the segments padded into  any (never "auto": ``sdpa`` picks it
                an ``(n, H, max_len, D)`` batch            where it is the right choice)
reference       explicit dense masks (for tests)           any (O(T^2) memory; never "auto")
==============  ========================================  =====================================

No backend reads the boundary values inside a compiled graph or on an accelerator: ``sdpa_padded`` takes its
shapes from ``n`` and ``max_seqlen_q/k`` (Python ints from the collator), and the flash kernels read
``cu_seqlens`` on the device. Where a read is free (a CPU tensor, eager mode) ``cu_seqlens`` is read and
checked once per tensor object, then cached for every later layer.

>>> q = k = v = torch.randn(5, 2, 8)
>>> cu = torch.tensor([0, 3, 5], dtype=torch.int32)
>>> out = varlen_attention(q, k, v, cu, cu, 3, 3)
>>> out.shape
torch.Size([5, 2, 8])
>>> torch.allclose(out, varlen_attention(q, k, v, cu, cu, 3, 3, backend="reference"), atol=1e-5)
True
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from ..varlen import check_cu_seqlens, check_int32_tokens
from . import host
from .host import cached_host_values, host_cache_entry, host_values
from .kernels import (
    _cuda_capability,
    _flash_package_features,
    _flash_package_function,
    _run_flash_package,
    _run_torch_varlen,
    _torch_varlen_function,
)
from .sdpa import _Call, _run_reference, _run_sdpa, _run_sdpa_padded

__all__ = [
    "BACKENDS",
    "FEATURES",
    "available_backends",
    "last_backend",
    "select_backend",
    "varlen_attention",
]

# Optional features a backend may or may not support (GQA and causal masking are supported by all).
FEATURES = ("window", "softcap", "dropout", "alibi", "sinks", "head_dim_v")

_HALF_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class _Backend:
    name: str
    description: str
    is_installed: Callable[[], bool]
    features: Callable[[], frozenset[str]]
    runs_on: Callable[[torch.device, torch.dtype, int], bool]  # (device, dtype, head_dim) -> usable by "auto"
    run: Callable[[_Call], torch.Tensor]
    auto: bool = True


def _flash_runs_on(
    majors: Sequence[int], min_major: int = 0
) -> Callable[[torch.device, torch.dtype, int], bool]:
    def runs_on(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
        major = _cuda_capability(device)[0]
        ok_major = major in majors if majors else major >= min_major
        return device.type == "cuda" and dtype in _HALF_DTYPES and head_dim <= 256 and ok_major

    return runs_on


def _flash_backend(
    name: str, package: str, title: str, runs_on: Callable[[torch.device, torch.dtype, int], bool]
) -> _Backend:
    """The backend running ``package``'s ``flash_attn_varlen_func`` (flash-attn 2, 3 or 4)."""
    return _Backend(
        name,
        f"{package}.flash_attn_varlen_func ({title})",
        lambda: _flash_package_function(package) is not None,
        lambda: _flash_package_features(package),
        runs_on,
        functools.partial(_run_flash_package, package),
    )


_ALL_FEATURES = frozenset(FEATURES)


def _torch_backend(
    name: str, description: str, run: Callable[..., torch.Tensor], auto: bool = True
) -> _Backend:
    """A backend of plain torch ops: always available, every feature, any device, dtype and head size."""
    return _Backend(
        name,
        description,
        lambda: True,
        lambda: _ALL_FEATURES,
        lambda device, dtype, head_dim: True,
        run,
        auto=auto,
    )


# Order = preference of "auto". FA3 before FA4 on Hopper: FA3 is the mature kernel there.
BACKENDS: dict[str, _Backend] = {
    backend.name: backend
    for backend in (
        _flash_backend("flash_attn_3", "flash_attn_interface", "FlashAttention 3", _flash_runs_on((9,))),
        _flash_backend("flash_attn_4", "flash_attn.cute", "FlashAttention 4", _flash_runs_on((9, 10))),
        _flash_backend("flash_attn", "flash_attn", "FlashAttention 2", _flash_runs_on((), min_major=8)),
        _Backend(
            "torch_varlen",
            "torch.nn.attention.varlen.varlen_attn (PyTorch's flash kernel)",
            lambda: _torch_varlen_function() is not None,
            lambda: frozenset({"window"}),
            _flash_runs_on((), min_major=8),
            _run_torch_varlen,
        ),
        _torch_backend("sdpa", "torch scaled_dot_product_attention, one call per segment", _run_sdpa),
        _torch_backend(
            "sdpa_padded",
            "torch scaled_dot_product_attention on the segments padded into one batch (no host read)",
            _run_sdpa_padded,
            auto=False,
        ),
        _torch_backend(
            "reference",
            "explicit dense masks over the whole row (tests only: O(T^2) memory)",
            _run_reference,
            auto=False,
        ),
    )
}


def _check_features(features: Iterable[str]) -> frozenset[str]:
    features = frozenset(features)
    unknown = sorted(features - _ALL_FEATURES)
    if unknown:
        raise ValueError(f"unknown attention features {unknown}; known features are {list(FEATURES)}")
    return features


def available_backends(
    device: str | torch.device | None = None, dtype: torch.dtype | None = None
) -> list[str]:
    """Names of the installed backends, in the order ``"auto"`` prefers them.

    Args:
        device: if given (with ``dtype``, default bf16 on CUDA and fp32 elsewhere), keep only the backends
            ``"auto"`` would consider for tensors on that device.
        dtype: the tensors' dtype, used with ``device``.

    >>> "sdpa" in available_backends("cpu")
    True
    """
    if device is None:
        return [name for name, b in BACKENDS.items() if b.is_installed()]
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return [
        name for name, b in BACKENDS.items() if b.auto and b.runs_on(device, dtype, 128) and b.is_installed()
    ]


def select_backend(
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    features: Iterable[str] = (),
    *,
    head_dim: int = 128,
) -> str:
    """The backend ``varlen_attention(..., backend="auto")`` uses for these tensors and features.

    Args:
        device: where q/k/v live.
        dtype: their dtype (the CUDA kernels take fp16/bf16 only).
        features: the optional features requested, among ``FEATURES``: ``"window"``, ``"softcap"``,
            ``"dropout"``, ``"alibi"``, ``"sinks"``, ``"head_dim_v"`` (value head dim != query head dim).
        head_dim: the query/key head dimension (the flash kernels stop at 256).

    >>> select_backend("cpu", torch.float32, ["softcap", "window"])
    'sdpa'
    """
    wanted = _check_features(features)
    device = torch.device(device)
    for name, backend in BACKENDS.items():
        # runs_on first: it is cheap, and on CPU no flash package is ever imported
        if not backend.auto or not backend.runs_on(device, dtype, head_dim) or not backend.is_installed():
            continue
        if wanted <= backend.features():
            return name
    raise RuntimeError(
        "no attention backend found; the 'sdpa' backend should always be available"
    )  # unreachable


_LAST_BACKEND: str | None = None


def check_backend_name(backend: str) -> str:
    """``backend`` if it is ``"auto"`` or a known backend name, else a ``ValueError`` listing them.

    The one backend-name check: :func:`varlen_attention`, :func:`packing_hf.register_attention` and
    :func:`packing_hf.attention.patch_flash_attention` all use it.

    >>> check_backend_name("sdpa")
    'sdpa'
    """
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose 'auto' or one of {list(BACKENDS)}")
    return backend


def last_backend() -> str | None:
    """Name of the backend the most recent :func:`varlen_attention` call ran (``None`` before any call).

    >>> q = torch.randn(3, 1, 4)
    >>> cu = torch.tensor([0, 3], dtype=torch.int32)
    >>> _ = varlen_attention(q, q, q, cu, cu, 3, 3, backend="reference")
    >>> last_backend()
    'reference'
    """
    return _LAST_BACKEND


def _check_cu_seqlens(cu: torch.Tensor, name: str, total: int, device: torch.device) -> torch.Tensor:
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() < 1:
        shape = tuple(cu.shape) if isinstance(cu, torch.Tensor) else type(cu).__name__
        raise ValueError(
            f"{name} must be a 1-D tensor [0, l0, l0 + l1, ...] (n + 1 entries), got {shape}; "
            "build it with packing_hf.varlen.lengths_to_cu_seqlens"
        )
    if cu.dtype.is_floating_point or cu.dtype == torch.bool:
        raise TypeError(f"{name} must hold integers (int32), got {cu.dtype}")
    if cu.device != device:
        raise ValueError(
            f"{name} is on {cu.device} but the queries are on {device}; move it with .to({device!s})"
        )
    # value checks only when they cost no device sync and no graph break: a CPU tensor in eager mode is read
    # once (then cached for every layer), elsewhere only a host copy already made is used.
    values = host_values(cu) if host.reads_are_free(cu) else cached_host_values(cu)
    entry = host_cache_entry(cu) if values is not None else None
    # flash_attn_varlen_func's contract: empty segments allowed, trailing tokens may lie outside every one.
    if values is not None and (entry is None or total not in entry[1]):
        check_cu_seqlens(values, name, total=total, allow_empty=True, exact_total=False)
        if entry is not None:
            entry[1].add(total)
    return cu.to(torch.int32), values


def _check_max_seqlen(value, name: str, host: list[int] | None):
    """``max_seqlen_q/k`` as an int (a ``SymInt`` under ``torch.compile`` stays symbolic: ``int()`` would
    specialize the graph on it); checked against the longest segment when the boundaries' values are known."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.dtype.is_floating_point:
        value = int(
            value
        )  # a host read: pass a Python int (PaddingFreeCollator's max_length_q/k) to avoid it
    if isinstance(value, bool) or not isinstance(value, int | torch.SymInt):
        raise TypeError(
            f"{name} must be an int (the longest segment, e.g. max_length_q from PaddingFreeCollator), got "
            f"{value!r}"
        )
    if host is not None:
        longest = max((b - a for a, b in zip(host[:-1], host[1:], strict=False)), default=0)
        if value < longest:
            raise ValueError(
                f"{name} = {value} but the longest segment has {longest} tokens; the kernels would skip the "
                "tokens past it. Use packing_hf.varlen.max_length_from_cu_seqlens(cu_seqlens)"
            )
    return value


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    dropout_p: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    s_aux: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention over packed segments that never attend across segment boundaries.

    Args:
        q: ``(Tq, Hq, D)`` queries of all segments, back to back.
        k: ``(Tk, Hkv, D)`` keys; ``Hq`` must be a multiple of ``Hkv`` (GQA/MQA).
        v: ``(Tk, Hkv, Dv)`` values.
        cu_seqlens_q: ``(n + 1,)`` int32 query boundaries ``[0, ..., <= Tq]`` (int64 is converted).
        cu_seqlens_k: ``(n + 1,)`` int32 key boundaries (same ``n``).
        max_seqlen_q: longest query segment, or more (a Python int; a tensor costs a device sync). The
            padded layout uses it as the width of every segment; checked when the boundaries are read.
        max_seqlen_k: longest key segment.
        causal: causal masking, aligned bottom-right when a segment has more keys than queries.
        softmax_scale: defaults to ``1 / sqrt(D)``.
        window_size: ``(left, right)`` local attention, ``-1`` = unbounded.
        softcap: ``> 0`` applies ``softcap * tanh(score / softcap)``.
        dropout_p: dropout on the attention weights (pass 0.0 in eval).
        alibi_slopes: ``(Hq,)`` fp32 ALiBi slopes, bias ``-slope * |i - j|``.
        s_aux: ``(Hq,)`` attention-sink logits (gpt_oss ``sinks``).
        backend: ``"auto"`` or a name from :data:`BACKENDS`. ``"auto"`` picks the first installed backend that
            runs on the tensors' device/dtype and supports the features; a named backend is used as asked.

    Returns:
        ``(Tq, Hq, Dv)`` in q's dtype. Query rows outside every segment are 0.

    Raises:
        ValueError: mismatched shapes, bad boundaries, too many tokens for int32 offsets, an unknown or
            uninstalled backend, or a feature the named backend does not support.

    >>> q, k, v = torch.randn(6, 4, 8), torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    >>> cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    >>> out = varlen_attention(q, k, v, cu, cu, 4, 4, window_size=(1, 0), softcap=30.0)
    >>> out.shape
    torch.Size([6, 4, 8])
    """
    global _LAST_BACKEND
    _check_qkv(q, k, v)
    cu_q, host_q = _check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q.shape[0], q.device)
    if cu_seqlens_k is cu_seqlens_q:
        cu_k, host_k = cu_q, host_q
    else:
        cu_k, host_k = _check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", k.shape[0], q.device)
    if cu_q.numel() != cu_k.numel():
        raise ValueError(
            f"cu_seqlens_q has {cu_q.numel()} entries but cu_seqlens_k has {cu_k.numel()}: both describe the "
            "same segments"
        )
    window = _check_options(q.shape[1], window_size, dropout_p, alibi_slopes, s_aux)
    features = _requested_features(q, v, causal, window, softcap, dropout_p, alibi_slopes, s_aux)
    name = _resolve_backend(backend, q, features)
    call = _Call(
        q=q,
        k=k,
        v=v,
        cu_q=cu_q,
        cu_k=cu_k,
        max_q=_check_max_seqlen(max_seqlen_q, "max_seqlen_q", host_q),
        max_k=_check_max_seqlen(max_seqlen_k, "max_seqlen_k", host_k),
        causal=bool(causal),
        scale=float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1]),
        window=window,
        softcap=float(softcap or 0.0),
        dropout_p=float(dropout_p),
        alibi_slopes=alibi_slopes,
        s_aux=s_aux,
        host_q=host_q,
        host_k=host_k,
    )
    _LAST_BACKEND = name
    return BACKENDS[name].run(call)


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """``q`` ``(Tq, Hq, D)``, ``k`` ``(Tk, Hkv, D)``, ``v`` ``(Tk, Hkv, Dv)`` with ``Hkv`` dividing ``Hq``."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be (total_tokens, heads, head_dim), got {shape}")
    if k.shape[:2] != v.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"k {tuple(k.shape)} and v {tuple(v.shape)} must share tokens and heads, and q {tuple(q.shape)} "
            "and k must share head_dim"
        )
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")
    check_int32_tokens(max(q.shape[0], k.shape[0]), "a varlen call")


def _check_options(
    heads: int,
    window_size: tuple[int, int],
    dropout_p: float,
    alibi_slopes: torch.Tensor | None,
    s_aux: torch.Tensor | None,
) -> tuple[int, int]:
    """Check the optional features of a call (``heads`` query heads); returns the window as two ints."""
    if len(window_size) != 2:
        raise ValueError(f"window_size must be (left, right), got {window_size!r}")
    window = (int(window_size[0]), int(window_size[1]))
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    for name, t in (("alibi_slopes", alibi_slopes), ("s_aux", s_aux)):
        if t is not None and tuple(t.shape) != (heads,):
            raise ValueError(f"{name} must be ({heads},), one value per query head, got {tuple(t.shape)}")
    return window


def _requested_features(
    q: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    window: tuple[int, int],
    softcap: float,
    dropout_p: float,
    alibi_slopes: torch.Tensor | None,
    s_aux: torch.Tensor | None,
) -> set[str]:
    """The optional :data:`FEATURES` a call uses (what a backend must support to run it)."""
    features = set()
    if window[0] >= 0 or (window[1] >= 0 and not causal):
        features.add("window")
    if softcap and softcap > 0:
        features.add("softcap")
    if dropout_p > 0:
        features.add("dropout")
    if alibi_slopes is not None:
        features.add("alibi")
    if s_aux is not None:
        features.add("sinks")
    if v.shape[-1] != q.shape[-1]:
        features.add("head_dim_v")
    return features


def _resolve_backend(backend: str, q: torch.Tensor, features: set[str]) -> str:
    """The backend to run: ``"auto"``'s pick for ``q``'s device and dtype, or the named one if it can."""
    if backend == "auto":
        return select_backend(q.device, q.dtype, features, head_dim=q.shape[-1])
    check_backend_name(backend)
    if not BACKENDS[backend].is_installed():
        raise ValueError(
            f"attention backend {backend!r} is not installed here; installed: {available_backends()}"
        )
    missing = sorted(features - BACKENDS[backend].features())
    if missing:
        raise ValueError(
            f"attention backend {backend!r} does not support {missing}; use backend='auto' to pick one "
            f"that does (select_backend tells which)"
        )
    return backend


def _varlen_attention_masked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    segment_mask: Callable[[int, int, int, int], torch.Tensor],
    *,
    causal: bool,
    softmax_scale: float | None,
    window_size: tuple[int, int],
    softcap: float,
    dropout_p: float,
    s_aux: torch.Tensor | None,
    backend: str = "sdpa",
) -> torch.Tensor:
    """Per-segment attention that also applies a dense mask block per segment (a model's own 4-D mask).

    Only the per-segment SDPA and the reference backend can take such a mask; the flash kernels cannot.
    """
    global _LAST_BACKEND
    if backend not in ("sdpa", "reference"):
        raise ValueError(f"a dense attention mask needs backend 'sdpa' or 'reference', got {backend!r}")
    call = _Call(
        q=q,
        k=k,
        v=v,
        cu_q=cu_seqlens_q,
        cu_k=cu_seqlens_k,
        max_q=0,
        max_k=0,
        causal=causal,
        scale=float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1]),
        window=(int(window_size[0]), int(window_size[1])),
        softcap=float(softcap or 0.0),
        dropout_p=float(dropout_p),
        alibi_slopes=None,
        s_aux=s_aux,
        segment_mask=segment_mask,
    )
    _LAST_BACKEND = backend
    return BACKENDS[backend].run(call)
