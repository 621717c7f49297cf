"""The backends written in plain torch, and the call every backend receives.

- ``_Call``: the validated arguments of one :func:`packing_hf.attention.varlen_attention` call;
- ``reference``: explicit dense masks over the whole row (the plainest statement of the semantics);
- ``sdpa``: one ``scaled_dot_product_attention`` call per segment (or one batched call for equal lengths);
- ``sdpa_padded``: the segments padded into one ``(n, H, max_len, D)`` batch, with no host read.

The masking conventions (causal bottom-right, windows, softcap, ALiBi, sinks) are FlashAttention's, stated
in :mod:`packing_hf.attention.backends`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..padding import PackedLayout
from . import host
from .host import host_values

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

    def explicit(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        allowed: torch.Tensor,
        rel: torch.Tensor,
        extra: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:func:`_explicit_attention` with this call's scale, softcap, dropout, ALiBi slopes and sinks."""
        return _explicit_attention(
            q,
            k,
            v,
            allowed,
            rel,
            scale=self.scale,
            softcap=self.softcap,
            dropout_p=self.dropout_p,
            alibi_slopes=self.alibi_slopes,
            s_aux=self.s_aux,
            extra_mask=extra,
        )


def _segments(call: _Call) -> list[tuple[int, int, int, int]]:
    bq = call.host_q if call.host_q is not None else host_values(call.cu_q)
    bk = call.host_k if call.host_k is not None else host_values(call.cu_k)
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
    out = call.explicit(
        call.q.transpose(0, 1), call.k.transpose(0, 1), call.v.transpose(0, 1), allowed, rel, extra
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
        return call.explicit(q, k, v, allowed, rel, extra)
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
    if call.segment_mask is None and not host.reads_are_free(call.cu_q):
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
    # segment s as row s of a right-padded batch; padding slots are zeros, never gathered back (no query of
    # a segment attends to them: the causal flag or the mask below keeps every query inside its segment)
    layout_q = PackedLayout.from_cu_seqlens(call.cu_q, call.max_q, (tq,))
    same = call.cu_k is call.cu_q
    layout_k = layout_q if same else PackedLayout.from_cu_seqlens(call.cu_k, call.max_k, (k.shape[0],))
    qp = layout_q.pad(q).transpose(1, 2)  # (n, Hq, Lq, D)
    kp = layout_k.pad(k).transpose(1, 2)  # (n, Hkv, Lk, D)
    vp = layout_k.pad(v).transpose(1, 2)  # (n, Hkv, Lk, Dv)
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
        len_q, len_k = torch.diff(call.cu_q.long()), torch.diff(call.cu_k.long())  # (n,)
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
            out = call.explicit(qp, kp, vp, allowed, rel)
        else:
            mask = allowed
            if call.alibi_slopes is not None:
                bias = -call.alibi_slopes.float()[None, :, None, None] * rel.abs()  # (n, H, Lq, Lk)
                mask = bias.masked_fill(~allowed, float("-inf")).to(q.dtype)
            out = F.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=mask, dropout_p=call.dropout_p, scale=call.scale, enable_gqa=gqa
            )
        out = out.masked_fill(no_key[:, None, :, None], 0.0)
    # back to the packed row; tokens after the last segment (or in none) get 0
    return layout_q.unpad(out.transpose(1, 2))  # (Tq, Hq, Dv)
