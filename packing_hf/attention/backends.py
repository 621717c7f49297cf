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
import importlib
import inspect
import math
import sys
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..varlen import check_cu_seqlens, check_int32_tokens

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


# --------------------------------------------------------------------------------------------------
# host copies of cu_seqlens
# --------------------------------------------------------------------------------------------------

# The per-segment loop needs the boundaries as Python ints. Every layer of a model receives the very same
# cu_seqlens tensor object from the collator, so the device -> host copy is made once per tensor (per
# step) instead of once per layer: a tiny cache keyed on the tensor's identity and version. The padded
# path (``_run_sdpa_padded``) and the flash kernels never read the values at all.
# An entry also remembers the row lengths its values were checked against, so each layer does not check again.
_HOST_CACHE: list[tuple[weakref.ref, int, list[int], set[int]]] = []
_HOST_CACHE_SIZE = 4


def _host_values(tensor: torch.Tensor) -> list[int]:
    """The values of ``tensor`` as Python ints: one host read per tensor object and version, then cached."""
    values = _cached_host_values(tensor)
    if values is not None:
        return values
    values = tensor.tolist()
    _remember_host_values(tensor, values)
    return values


def _remember_host_values(tensor: torch.Tensor, values: list[int]) -> None:
    """Record host ``values`` already read from ``tensor`` (by :func:`packing_hf.validate_packed_batch`)."""
    _HOST_CACHE.insert(0, (weakref.ref(tensor), tensor._version, values, set()))
    del _HOST_CACHE[_HOST_CACHE_SIZE:]


def _cached_host_values(tensor: torch.Tensor) -> list[int] | None:
    """Host values only when they were read before (no host read now), else ``None``."""
    if torch.compiler.is_compiling():  # a traced tensor has no values; dynamo cannot follow weakrefs either
        return None
    entry = _cache_entry(tensor)
    return None if entry is None else entry[2]


def _cache_entry(tensor: torch.Tensor) -> tuple[weakref.ref, int, list[int], set[int]] | None:
    for entry in _HOST_CACHE:
        if entry[0]() is tensor and entry[1] == tensor._version:
            return entry
    return None


def _reads_are_free(tensor: torch.Tensor) -> bool:
    """Whether reading ``tensor``'s values costs nothing: a CPU tensor in eager mode (under ``torch.compile``
    a read is a graph break, on an accelerator a device sync)."""
    return tensor.device.type == "cpu" and not torch.compiler.is_compiling()


# --------------------------------------------------------------------------------------------------
# masks shared by the reference and per-segment SDPA paths
# --------------------------------------------------------------------------------------------------


def _allowed(
    lq: int, lk: int, causal: bool, window: tuple[int, int], device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Boolean ``(Lq, Lk)`` mask of allowed (query, key) pairs (``None`` = all) and the relative offsets."""
    rel = torch.arange(lk, device=device)[None, :] - torch.arange(lq, device=device)[:, None] - (lk - lq)
    allowed = None  # rel = j - i', i.e. <= 0 for keys in the past
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    if left >= 0:
        allowed = rel >= -left
    if right >= 0:
        allowed = (rel <= right) if allowed is None else allowed & (rel <= right)
    return allowed, rel


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(..., Hkv, L, D) -> (..., Hkv * groups, L, D); query head h reads kv head h // groups."""
    if groups == 1:
        return x
    return x.unsqueeze(-3).expand(*x.shape[:-2], groups, *x.shape[-2:]).flatten(-4, -3)


def _explicit_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor | None,
    rel: torch.Tensor,
    *,
    scale: float,
    softcap: float,
    dropout_p: float,
    alibi_slopes: torch.Tensor | None,
    s_aux: torch.Tensor | None,
    extra_mask: torch.Tensor | None,
) -> torch.Tensor:
    """Attention written out (matmul, mask, softmax in fp32) on ``(..., H, L, D)`` tensors.

    Used for the features SDPA lacks (softcap, sinks) and by the reference backend.
    """
    k = _repeat_kv(k, q.shape[-3] // k.shape[-3])
    v = _repeat_kv(v, q.shape[-3] // v.shape[-3])
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # (..., H, Lq, Lk)
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    if alibi_slopes is not None:
        scores = scores - alibi_slopes.float()[:, None, None] * rel.abs()
    keep = allowed
    if extra_mask is not None:
        if extra_mask.dtype == torch.bool:
            keep = extra_mask if keep is None else keep & extra_mask
        else:
            scores = scores + extra_mask.float()
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    if s_aux is not None:
        sink = s_aux.float()[:, None, None].expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink], dim=-1)
    # rows without any allowed key (a query before the first key when Lq > Lk) give 0, as FlashAttention does
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - row_max)
    weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    if s_aux is not None:
        weights = weights[..., :-1]
    if dropout_p > 0:
        weights = F.dropout(weights, p=dropout_p)
    return torch.matmul(weights.to(v.dtype), v)


# --------------------------------------------------------------------------------------------------
# backends
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Call:
    """Everything a backend needs, already validated by :func:`varlen_attention`."""

    q: torch.Tensor  # (Tq, Hq, D)
    k: torch.Tensor  # (Tk, Hkv, D)
    v: torch.Tensor  # (Tk, Hkv, Dv)
    cu_q: torch.Tensor  # (n + 1,) int32
    cu_k: torch.Tensor  # (n + 1,) int32
    max_q: int
    max_k: int
    causal: bool
    scale: float
    window: tuple[int, int]
    softcap: float
    dropout_p: float
    alibi_slopes: torch.Tensor | None
    s_aux: torch.Tensor | None
    # private: a dense mask ``(Hm, Lq, Lk)`` per segment, from a 4-D mask the model built itself
    segment_mask: Callable[[int, int, int, int], torch.Tensor] | None = None
    # host copies of cu_q / cu_k when already read (cu_q may be an int32 copy of the tensor that was read)
    host_q: list[int] | None = None
    host_k: list[int] | None = None


def _segments(call: _Call) -> list[tuple[int, int, int, int]]:
    bq = call.host_q if call.host_q is not None else _host_values(call.cu_q)
    bk = call.host_k if call.host_k is not None else _host_values(call.cu_k)
    return [(bq[i], bq[i + 1], bk[i], bk[i + 1]) for i in range(len(bq) - 1)]


def _run_reference(call: _Call) -> torch.Tensor:
    """Dense (Tq, Tk) masks over the whole packed row: the plainest statement of the semantics."""
    tq, tk = call.q.shape[0], call.k.shape[0]
    seg_q = torch.full((tq,), -1, dtype=torch.long, device=call.q.device)
    seg_k = torch.full((tk,), -2, dtype=torch.long, device=call.q.device)
    pos_q = torch.zeros(tq, dtype=torch.long, device=call.q.device)  # i' = local query index + Lk - Lq
    pos_k = torch.zeros(tk, dtype=torch.long, device=call.q.device)
    extra = None
    for i, (sq, eq, sk, ek) in enumerate(_segments(call)):
        seg_q[sq:eq], seg_k[sk:ek] = i, i
        pos_q[sq:eq] = torch.arange(eq - sq, device=call.q.device) + (ek - sk) - (eq - sq)
        pos_k[sk:ek] = torch.arange(ek - sk, device=call.q.device)
        if call.segment_mask is not None:
            block = call.segment_mask(sq, eq, sk, ek)
            if extra is None:
                fill = False if block.dtype == torch.bool else float("-inf")
                extra = torch.full((block.shape[0], tq, tk), fill, dtype=block.dtype, device=call.q.device)
            extra[:, sq:eq, sk:ek] = block
    rel = pos_k[None, :] - pos_q[:, None]
    allowed = seg_q[:, None] == seg_k[None, :]
    left, right = call.window
    if call.causal:
        right = 0 if right < 0 else min(right, 0)
    if left >= 0:
        allowed &= rel >= -left
    if right >= 0:
        allowed &= rel <= right
    if extra is not None and extra.dtype != torch.bool:
        # a -inf additive block outside the segments would make fully-masked rows NaN; keep it finite
        extra = extra.masked_fill(~allowed, 0.0)
    out = _explicit_attention(
        call.q.transpose(0, 1),
        call.k.transpose(0, 1),
        call.v.transpose(0, 1),
        allowed,
        rel,
        scale=call.scale,
        softcap=call.softcap,
        dropout_p=call.dropout_p,
        alibi_slopes=call.alibi_slopes,
        s_aux=call.s_aux,
        extra_mask=extra,
    )
    return out.transpose(0, 1)  # (Tq, Hq, Dv)


def _attend_block(call: _Call, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extra: torch.Tensor | None):
    """Attention for one segment ``(H, L, D)`` or a batch of equal-length segments ``(n, H, L, D)``."""
    if q.dim() == 3:
        # SDPA dispatches 3-D inputs to its math kernel (~10x slower on CPU, O(L^2) memory); 4-D reaches flash
        extra = extra[None] if extra is not None else None
        return _attend_block(call, q[None], k[None], v[None], extra)[0]
    lq, lk = q.shape[-2], k.shape[-2]
    gqa = q.shape[-3] != k.shape[-3]
    if call.softcap > 0 or call.s_aux is not None or (call.causal and lq > lk):
        allowed, rel = _allowed(lq, lk, call.causal, call.window, q.device)
        return _explicit_attention(
            q,
            k,
            v,
            allowed,
            rel,
            scale=call.scale,
            softcap=call.softcap,
            dropout_p=call.dropout_p,
            alibi_slopes=call.alibi_slopes,
            s_aux=call.s_aux,
            extra_mask=extra,
        )
    plain_window = call.window[0] < 0 and (call.causal or call.window[1] < 0)
    if plain_window and call.alibi_slopes is None and extra is None and (lq == lk or not call.causal):
        # the fast path: SDPA's own causal flag lets it pick its flash kernel (O(L) memory, CPU included)
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=call.dropout_p, is_causal=call.causal, scale=call.scale, enable_gqa=gqa
        )
    allowed, rel = _allowed(lq, lk, call.causal, call.window, q.device)
    mask = allowed
    if extra is not None:
        if extra.dtype == torch.bool:
            mask = extra if mask is None else mask & extra
        else:
            mask = extra.to(q.dtype) if mask is None else extra.to(q.dtype).masked_fill(~mask, float("-inf"))
    if call.alibi_slopes is not None:
        bias = -call.alibi_slopes.float()[:, None, None] * rel.abs()  # (H, Lq, Lk)
        if mask is not None:
            bias = bias.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else bias + mask.float()
        mask = bias.to(q.dtype)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=call.dropout_p, scale=call.scale, enable_gqa=gqa
    )


def _run_sdpa(call: _Call) -> torch.Tensor:
    """SDPA over the segments: a loop of one call per segment where the boundaries are free to read (CPU,
    eager), else the padded batch of :func:`_run_sdpa_padded` (compiled graphs, accelerators: no host read)."""
    if call.segment_mask is None and not _reads_are_free(call.cu_q):
        return _run_sdpa_padded(call)
    return _run_sdpa_loop(call)


def _run_sdpa_loop(call: _Call) -> torch.Tensor:
    """One SDPA call per segment: O(max segment length^2) at worst, never O(T^2), autograd on any device."""
    segments = _segments(call)
    q, k, v = call.q, call.k, call.v
    hq, dv = q.shape[1], v.shape[-1]
    lengths = {(eq - sq, ek - sk) for sq, eq, sk, ek in segments}
    if call.segment_mask is None and len(lengths) == 1 and segments:
        (lq, lk) = lengths.pop()
        if lq and lk and segments[0][0] == 0 and segments[0][2] == 0:
            n = len(segments)
            # every segment has the same length: one batched call, no Python loop
            qb = q[: n * lq].view(n, lq, hq, -1).transpose(1, 2)
            kb = k[: n * lk].view(n, lk, k.shape[1], -1).transpose(1, 2)
            vb = v[: n * lk].view(n, lk, v.shape[1], -1).transpose(1, 2)
            out = _attend_block(call, qb, kb, vb, None).transpose(1, 2).reshape(n * lq, hq, dv)
            if n * lq < q.shape[0]:  # tokens after the last segment: no keys, zero output
                out = torch.cat([out, out.new_zeros(q.shape[0] - n * lq, hq, dv)])
            return out
    # torch.split, not slicing: the backward of n slices writes n zero-filled full-size gradients and adds
    # them up (O(n * T) memory traffic, most of the step time on CPU); split's backward is one concatenation
    bq = [segments[0][0]] + [eq for _, eq, _, _ in segments] if segments else [0]
    bk = [segments[0][2]] + [ek for _, _, _, ek in segments] if segments else [0]
    q_parts = torch.split(q, [b - a for a, b in zip(bq[:-1], bq[1:], strict=True)] + [q.shape[0] - bq[-1]])
    k_parts = torch.split(k, [b - a for a, b in zip(bk[:-1], bk[1:], strict=True)] + [k.shape[0] - bk[-1]])
    v_parts = torch.split(v, [b - a for a, b in zip(bk[:-1], bk[1:], strict=True)] + [v.shape[0] - bk[-1]])
    pieces = []
    for i, (sq, eq, sk, ek) in enumerate(segments):
        if eq == sq:
            continue
        if ek == sk:  # no keys: FlashAttention's output is 0
            pieces.append(q.new_zeros(eq - sq, hq, dv))
            continue
        extra = call.segment_mask(sq, eq, sk, ek) if call.segment_mask is not None else None
        out = _attend_block(
            call, q_parts[i].transpose(0, 1), k_parts[i].transpose(0, 1), v_parts[i].transpose(0, 1), extra
        )
        pieces.append(out.transpose(0, 1))
    if q.shape[0] > bq[-1]:  # tokens after the last segment: no keys, zero output
        pieces.append(q.new_zeros(q.shape[0] - bq[-1], hq, dv))
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def _padded_index(cu: torch.Tensor, width, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(n, width)`` row of every (segment, offset) slot, clamped into ``[0, total)``, and the ``(n,)`` lengths."""
    starts = cu[:-1].long()  # (n,)
    lengths = cu[1:].long() - starts  # (n,)
    offsets = torch.arange(width, device=cu.device)  # (width,)
    # slots past a segment's end read some real token (finite values); their outputs are never gathered back
    return (starts[:, None] + offsets).clamp(max=max(total - 1, 0)), lengths


def _run_sdpa_padded(call: _Call) -> torch.Tensor:
    """The segments as one right-padded ``(n, H, max_len, D)`` batch: one SDPA call, no host read.

    Every tensor shape comes from ``n`` (the size of ``cu_seqlens``) and ``max_seqlen_q/k`` (Python ints),
    never from the boundary values, so ``torch.compile`` traces it without a graph break and with dynamic
    shapes, and an accelerator never waits for a device -> host copy. The cost: attention over
    ``n * max_len^2`` score slots instead of ``sum(len_i^2)`` (about 1.5x the per-segment loop on CPU for
    GSM8K rows).
    """
    q, k, v = call.q, call.k, call.v
    tq, hq, dv = q.shape[0], q.shape[1], v.shape[-1]
    n = call.cu_q.shape[0] - 1
    if n == 0 or tq == 0 or k.shape[0] == 0 or call.max_q == 0:
        return q.new_zeros(tq, hq, dv)
    index_q, len_q = _padded_index(call.cu_q, call.max_q, tq)  # (n, Lq), (n,)
    same = call.cu_k is call.cu_q
    index_k, len_k = (index_q, len_q) if same else _padded_index(call.cu_k, call.max_k, k.shape[0])
    qp = q[index_q].transpose(1, 2)  # (n, Hq, Lq, D)
    kp, vp = k[index_k].transpose(1, 2), v[index_k].transpose(1, 2)  # (n, Hkv, Lk, D), (n, Hkv, Lk, Dv)
    lq, lk = qp.shape[-2], kp.shape[-2]
    gqa = hq != kp.shape[1]
    plain_window = call.window[0] < 0 and (call.causal or call.window[1] < 0)
    plain = plain_window and call.alibi_slopes is None and call.softcap == 0 and call.s_aux is None
    no_key = None
    if same and plain and call.causal:
        # the fast path: the keys of a valid query i are 0..i, all inside its segment; padding queries see
        # padding keys but are dropped. SDPA's causal flag lets it pick its flash kernel.
        out = F.scaled_dot_product_attention(
            qp, kp, vp, dropout_p=call.dropout_p, is_causal=True, scale=call.scale, enable_gqa=gqa
        )
    else:
        offsets_q = torch.arange(lq, device=q.device)
        offsets_k = torch.arange(lk, device=q.device)
        # rel = j - i' with i' = i + Lk - Lq (bottom-right alignment per segment): (n, Lq, Lk)
        rel = offsets_k[None, None, :] - offsets_q[None, :, None] - (len_k - len_q)[:, None, None]
        allowed = (offsets_k < len_k[:, None])[:, None, :]  # (n, 1, Lk) keys inside the segment
        left, right = call.window
        if call.causal:
            right = 0 if right < 0 else min(right, 0)
        if left >= 0:
            allowed = allowed & (rel >= -left)
        if right >= 0:
            allowed = allowed & (rel <= right)
        allowed = allowed.expand(-1, lq, -1)  # (n, Lq, Lk)
        # a valid query without any key (more queries than keys, an empty key segment) gives 0, as
        # FlashAttention does; it and every padding query get all keys so that no softmax row is empty
        # (an empty row is NaN, and NaN would reach the gradients of real tokens through the gather)
        padding_query = offsets_q[None, :] >= len_q[:, None]  # (n, Lq)
        no_key = ~allowed.any(dim=-1) | padding_query  # (n, Lq)
        allowed = (allowed | no_key[..., None])[:, None]  # (n, 1, Lq, Lk)
        rel = rel[:, None]
        if call.softcap > 0 or call.s_aux is not None:
            out = _explicit_attention(
                qp, kp, vp, allowed, rel, scale=call.scale, softcap=call.softcap, dropout_p=call.dropout_p,
                alibi_slopes=call.alibi_slopes, s_aux=call.s_aux, extra_mask=None,
            )  # fmt: skip
        else:
            mask = allowed
            if call.alibi_slopes is not None:
                bias = -call.alibi_slopes.float()[None, :, None, None] * rel.abs()  # (n, H, Lq, Lk)
                mask = bias.masked_fill(~allowed, float("-inf")).to(q.dtype)
            out = F.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=mask, dropout_p=call.dropout_p, scale=call.scale, enable_gqa=gqa
            )
        out = out.masked_fill(no_key[:, None, :, None], 0.0)
    out = out.transpose(1, 2).reshape(n * lq, hq, dv)  # (n * Lq, Hq, Dv)
    # back to the packed row: token t of segment s sits in slot s * Lq + (t - cu_q[s]); tokens after the
    # last segment (or in none) get 0
    tokens = torch.arange(tq, device=q.device)
    segment = torch.searchsorted(call.cu_q[1:].long(), tokens, right=True)  # (Tq,) in [0, n]
    inside = segment < n
    segment = segment.clamp(max=n - 1)
    slot = segment * lq + (tokens - call.cu_q[:-1].long()[segment])
    return out[slot.clamp(max=n * lq - 1)] * inside[:, None, None].to(out.dtype)


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
    params = _parameters(fn)
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
    params = _parameters(fn)
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


_ALL_FEATURES = frozenset(FEATURES)

# Order = preference of "auto". FA3 before FA4 on Hopper: FA3 is the mature kernel there.
BACKENDS: dict[str, _Backend] = {
    backend.name: backend
    for backend in (
        _Backend(
            "flash_attn_3",
            "flash_attn_interface.flash_attn_varlen_func (FlashAttention 3)",
            lambda: _flash_package_function("flash_attn_interface") is not None,
            lambda: _flash_package_features("flash_attn_interface"),
            _flash_runs_on((9,)),
            functools.partial(_run_flash_package, "flash_attn_interface"),
        ),
        _Backend(
            "flash_attn_4",
            "flash_attn.cute.flash_attn_varlen_func (FlashAttention 4)",
            lambda: _flash_package_function("flash_attn.cute") is not None,
            lambda: _flash_package_features("flash_attn.cute"),
            _flash_runs_on((9, 10)),
            functools.partial(_run_flash_package, "flash_attn.cute"),
        ),
        _Backend(
            "flash_attn",
            "flash_attn.flash_attn_varlen_func (FlashAttention 2)",
            lambda: _flash_package_function("flash_attn") is not None,
            lambda: _flash_package_features("flash_attn"),
            _flash_runs_on((), min_major=8),
            functools.partial(_run_flash_package, "flash_attn"),
        ),
        _Backend(
            "torch_varlen",
            "torch.nn.attention.varlen.varlen_attn (PyTorch's flash kernel)",
            lambda: _torch_varlen_function() is not None,
            lambda: frozenset({"window"}),
            _flash_runs_on((), min_major=8),
            _run_torch_varlen,
        ),
        _Backend(
            "sdpa",
            "torch scaled_dot_product_attention, one call per segment",
            lambda: True,
            lambda: _ALL_FEATURES,
            lambda device, dtype, head_dim: True,
            _run_sdpa,
        ),
        _Backend(
            "sdpa_padded",
            "torch scaled_dot_product_attention on the segments padded into one batch (no host read)",
            lambda: True,
            lambda: _ALL_FEATURES,
            lambda device, dtype, head_dim: True,
            _run_sdpa_padded,
            auto=False,
        ),
        _Backend(
            "reference",
            "explicit dense masks over the whole row (tests only: O(T^2) memory)",
            lambda: True,
            lambda: _ALL_FEATURES,
            lambda device, dtype, head_dim: True,
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
    :func:`packing_hf.patch_flash_attention` all use it.

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
            "build it with packing_hf.lengths_to_cu_seqlens"
        )
    if cu.dtype.is_floating_point or cu.dtype == torch.bool:
        raise TypeError(f"{name} must hold integers (int32), got {cu.dtype}")
    if cu.device != device:
        raise ValueError(
            f"{name} is on {cu.device} but the queries are on {device}; move it with .to({device!s})"
        )
    # value checks only when they cost no device sync and no graph break: a CPU tensor in eager mode is read
    # once (then cached for every layer), elsewhere only a host copy already made is used.
    values = _host_values(cu) if _reads_are_free(cu) else _cached_host_values(cu)
    entry = _cache_entry(cu) if values is not None else None
    # flash_attn_varlen_func's contract: empty segments allowed, trailing tokens may lie outside every one.
    if values is not None and (entry is None or total not in entry[3]):
        check_cu_seqlens(values, name, total=total, allow_empty=True, exact_total=False)
        if entry is not None:
            entry[3].add(total)
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
                "tokens past it. Use packing_hf.max_length_from_cu_seqlens(cu_seqlens)"
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
    if len(window_size) != 2:
        raise ValueError(f"window_size must be (left, right), got {window_size!r}")
    window = (int(window_size[0]), int(window_size[1]))
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    for name, t in (("alibi_slopes", alibi_slopes), ("s_aux", s_aux)):
        if t is not None and tuple(t.shape) != (q.shape[1],):
            raise ValueError(
                f"{name} must be ({q.shape[1]},), one value per query head, got {tuple(t.shape)}"
            )

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

    if backend == "auto":
        name = select_backend(q.device, q.dtype, features, head_dim=q.shape[-1])
    else:
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
        name = backend

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
