"""The LM head and its loss in chunks of tokens: the ``(tokens, vocabulary)`` logits never exist whole.

Once padding is gone the logits are the largest tensor of a packed step (tokens x vocabulary, upcast to fp32,
plus their gradient). Here the projection ``hidden @ weight.T (+ bias)``, the model's own logit processing
(:class:`LogitHead`: Cohere's ``logit_scale``, Granite's ``logits_scaling``, Gemma 2/3's
``final_logit_softcapping``) and what is taken from the logits are computed ``chunk_size`` tokens at a time:

- :func:`linear_cross_entropy` ``reduction="sum"`` / ``"mean"``: a scalar loss, the weighted sum of the
  targets' cross-entropies; its gradients are computed in the forward, chunk by chunk (Liger-style: no
  recomputation, so no extra matmul), and scaled by the incoming gradient in backward. It also returns the
  labelled tokens' entropy sum, top-1 hits and count (TRL's SFT metrics) from the same chunks.
- :func:`token_logprobs` (and ``reduction="none"``): per-token log-probs of given targets, and optionally the
  entropy of every position, with gradients: a chunk's logits are recomputed in backward, where the incoming
  per-token gradient is known.

Peak memory holds one chunk's logits and log-probs (two ``chunk_size x vocabulary`` fp32 buffers, reused by every
chunk; a third for the probabilities with ``metrics=True`` under soft-capping, whose derivative reads the logits) and the fp32 weight gradient instead of the row's logits. Targets are already shifted (``targets[i]`` is the token predicted from ``hidden[i]``), ``-100`` = not a target. In fp32
the results equal the full-logits computation to float rounding (the sums run in another order).

>>> torch.manual_seed(0) and None
>>> hidden, weight = torch.randn(5, 4, requires_grad=True), torch.randn(11, 4, requires_grad=True)
>>> targets = torch.tensor([3, -100, 10, 0, 7])
>>> loss, _ = linear_cross_entropy(hidden, weight, targets, reduction="mean", chunk_size=2)
>>> full = torch.nn.functional.cross_entropy(hidden @ weight.T, targets)
>>> bool(torch.allclose(loss, full))
True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ._loss import target_coefficients

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "LogitHead",
    "LogitStats",
    "TokenLogProbs",
    "chunk_size_for",
    "default_chunk_size",
    "linear_cross_entropy",
    "target_coefficients",
    "token_logprobs",
]

_IGNORE = -100
#: most fp32 bytes of one chunk's logits when ``chunk_size`` is not given (off CUDA). A chunk holds two such buffers
#: (its logits and log-probs, reused by every chunk); per-chunk costs (the fp32 ``(V, H)`` weight-gradient update, the
#: small matmuls) are amortised from about 200 tokens at a 152k vocabulary (measured: ``benchmarks/bench_memory.py``)
DEFAULT_CHUNK_BYTES = 128 * 2**20
#: on CPU, within that bound: chunks of about this many fp32 bytes of logits, so that the passes after the projection
#: (log-softmax, exp, the gradient's scatter and matmuls) read the chunk from the processor's caches rather than from
#: memory, but at least :data:`CPU_MIN_CHUNK_TOKENS` tokens (the weight-gradient update per chunk). One thread,
#: 4,000 tokens, hidden 64, forward + backward: 6,531-token vocabulary 0.35 s in chunks of 512-1,024 tokens vs 0.46 s
#: in one chunk of 4,000; 49,152: 2.18 s at 256 tokens vs 2.29 s at 682 (128 MiB), 2.29-2.58 s at 64-128
CPU_CACHE_CHUNK_BYTES = 16 * 2**20
CPU_MIN_CHUNK_TOKENS = 256
#: the same on a CUDA device: fewer, larger chunks (each chunk reads the whole ``(V, H)`` weight and its fp32
#: gradient once), still a small share of a GPU's memory next to the full logits (``benchmarks/gpu_check.sh``)
DEFAULT_CUDA_CHUNK_BYTES = 512 * 2**20
#: ``torch.mm(..., out_dtype=torch.float32)`` from bf16/fp16 inputs (CUDA, torch >= 2.8): the weight gradient
#: in the model's precision with fp32 accumulation, as the full-logits path computes it (an fp32 matmul of the
#: same product is several times slower on a GPU)
_MM_OUT_DTYPE = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 8)


@dataclass(frozen=True)
class LogitHead:
    """What a model does to ``hidden @ weight.T (+ bias)`` before its loss: ``logits = raw * scale /
    divisor``, then, with ``softcap``, ``softcap * tanh(logits / softcap)`` (Gemma 2/3's
    ``final_logit_softcapping``). Cohere multiplies by ``logit_scale``; Granite divides by ``logits_scaling``
    (kept as a division: the same rounding as the model's own).

    >>> LogitHead(softcap=2.0).apply(torch.tensor([0.0, 100.0])).tolist()
    [0.0, 2.0]
    """

    scale: float = 1.0
    divisor: float = 1.0
    softcap: float | None = None

    def __post_init__(self) -> None:
        for name in ("scale", "divisor"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not (value == value) or value in (float("inf"), 0):
                raise ValueError(f"LogitHead.{name}={value!r}: it must be a finite non-zero number")
        if self.softcap is not None and not (self.softcap > 0):
            raise ValueError(f"LogitHead.softcap={self.softcap!r}: it must be > 0 (or None: no soft-capping)")

    def apply(self, raw: torch.Tensor) -> torch.Tensor:
        """The model's logits from the projection ``raw`` (any shape, float; differentiable)."""
        logits = raw
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.divisor != 1.0:
            logits = logits / self.divisor
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def apply_(self, raw: torch.Tensor) -> torch.Tensor:
        """:meth:`apply` in place (the same operations in the same order: the same rounding)."""
        if self.scale != 1.0:
            raw.mul_(self.scale)
        if self.divisor != 1.0:
            raw.div_(self.divisor)
        if self.softcap is not None:
            raw.div_(self.softcap).tanh_().mul_(self.softcap)
        return raw

    def derivative_(self, logits: torch.Tensor) -> torch.Tensor | None:
        """``d logits / d raw`` divided by :attr:`factor`, elementwise, written over ``logits`` (soft-capping:
        ``1 - tanh^2``), or ``None`` (``logits`` untouched) where it is the constant 1."""
        if self.softcap is None:
            return None
        capped = logits.div_(self.softcap)  # tanh(.)
        return capped.mul_(capped).neg_().add_(1.0)

    @property
    def factor(self) -> float:
        """The constant part of ``d logits / d raw`` (``scale / divisor``): applied to the ``(tokens, hidden)``
        side of the gradient's matmuls, never to a ``(tokens, vocabulary)`` tensor."""
        return self.scale / self.divisor


@dataclass(frozen=True)
class LogitStats:
    """TRL's SFT metrics over the labelled targets, detached: ``entropy`` (sum of the entropies of their
    next-token distributions) and ``hits`` (top-1 predictions equal to the target), ``None`` unless asked for
    (``metrics=True``: an extra pass over each chunk), and ``count`` (targets)."""

    entropy: torch.Tensor | None
    hits: torch.Tensor | None
    count: torch.Tensor


def chunk_size_for(vocab_size: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Tokens per chunk so that one chunk's fp32 logits take about ``chunk_bytes``.

    >>> chunk_size_for(49152), chunk_size_for(151936)
    (682, 220)
    """
    return max(1, int(chunk_bytes) // (4 * max(1, int(vocab_size))))


def default_chunk_size(vocab_size: int, device: torch.device | str = "cpu") -> int:
    """Tokens per chunk when ``chunk_size`` is not given: :data:`DEFAULT_CUDA_CHUNK_BYTES` of fp32 logits on CUDA; on
    CPU chunks of about :data:`CPU_CACHE_CHUNK_BYTES` (cache-sized), at least :data:`CPU_MIN_CHUNK_TOKENS` tokens, never
    more than :data:`DEFAULT_CHUNK_BYTES`; on other devices :data:`DEFAULT_CHUNK_BYTES`.

    >>> default_chunk_size(6531), default_chunk_size(49152), default_chunk_size(151936), default_chunk_size(49152, "cuda")
    (642, 256, 220, 2730)
    """
    kind = torch.device(device).type
    if kind == "cuda":
        return chunk_size_for(vocab_size, DEFAULT_CUDA_CHUNK_BYTES)
    bound = chunk_size_for(vocab_size, DEFAULT_CHUNK_BYTES)
    if kind != "cpu":
        return bound
    return min(bound, max(CPU_MIN_CHUNK_TOKENS, chunk_size_for(vocab_size, CPU_CACHE_CHUNK_BYTES)))


def _check(hidden: torch.Tensor, weight: torch.Tensor, bias, targets: torch.Tensor, chunk_size: int | None):
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden must be (tokens, hidden_size) and weight (vocab_size, hidden_size), got {tuple(hidden.shape)} "
            f"and {tuple(weight.shape)}; flatten the batch first (hidden.reshape(-1, hidden.shape[-1]))"
        )
    if targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"targets must be (tokens,) = {tuple(hidden.shape[:1])}, got {tuple(targets.shape)}; pass the labels "
            "already shifted (targets[i] is the token predicted from hidden[i])"
        )
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias must be (vocab_size,) = {tuple(weight.shape[:1])}, got {tuple(bias.shape)}")
    bad = (targets != _IGNORE) & ((targets < 0) | (targets >= weight.shape[0]))
    if bool(bad.any()):
        pos = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"targets[{pos}] = {int(targets[pos])} is not a token id of the {weight.shape[0]}-token vocabulary "
            "(nor -100, not a target); check the labels against the model's vocab_size"
        )
    if chunk_size is None:
        return default_chunk_size(weight.shape[0], weight.device)
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(
            f"chunk_size={chunk_size!r}: it must be a positive number of tokens (or None: automatic)"
        )
    return chunk_size


def _chunks(n: int, size: int):
    """``(start, end)`` of every chunk of ``size`` tokens covering ``0..n`` (the last one shorter)."""
    for start in range(0, n, size):
        yield start, min(start + size, n)


class _Buffers:
    """The ``(chunk, V)`` fp32 tensors every chunk writes into, allocated once per call: a fresh allocation of
    that size per chunk is mapped and zero-filled by the OS every time (on CPU a pass over memory as costly as
    the softmax). ``take(name, c)`` is the first ``c`` rows of buffer ``name``."""

    def __init__(self, rows: int, vocab: int, device: torch.device):
        self.shape, self.device, self.tensors = (rows, vocab), device, {}

    def take(self, name: str, rows: int) -> torch.Tensor:
        if name not in self.tensors:
            self.tensors[name] = torch.empty(self.shape, dtype=torch.float32, device=self.device)
        return self.tensors[name][:rows]


def _chunk_logits(hidden, weight, bias, head: LogitHead, out: torch.Tensor) -> torch.Tensor:
    """``(c, V)`` fp32 logits of one chunk written into ``out`` (the projection in the weight's dtype, as the
    model's own head: fp32 weights project straight into ``out``)."""
    if weight.dtype == torch.float32 and hidden.dtype == torch.float32:
        if bias is None:
            torch.mm(hidden, weight.t(), out=out)
        else:
            torch.addmm(bias.float(), hidden, weight.t(), out=out)
    else:
        out.copy_(F.linear(hidden, weight, bias))
    return head.apply_(out)


def _accumulate(grad, rows, hidden, weight, grad_hidden, grad_weight, grad_bias) -> None:
    """Adds one chunk's share to the gradients, the gradient with respect to the chunk's raw projection being
    ``rows[:, None] * grad``: ``grad`` ``(c, V)`` fp32 (its rows not yet scaled: ``rows`` ``(c,)`` fp32 is
    applied to the ``(c, H)`` side), ``grad_hidden`` the chunk's ``(c, H)`` slice (or ``None``), ``grad_weight``
    ``(V, H)`` and ``grad_bias`` ``(V,)`` fp32 accumulators (or ``None``)."""
    low_precision = weight.dtype != torch.float32
    # the weight gradient in the weight's dtype with fp32 accumulation (CUDA), else an fp32 matmul
    low_weight_grad = grad_weight is not None and low_precision and weight.is_cuda and _MM_OUT_DTYPE
    # (c, V) in the weight's dtype, copied only when a matmul reads it
    low = grad.to(weight.dtype) if low_precision and (grad_hidden is not None or low_weight_grad) else grad
    if grad_hidden is not None:
        if grad_hidden.dtype == low.dtype and grad_hidden.is_contiguous():
            torch.mm(low, weight, out=grad_hidden)
        else:
            grad_hidden.copy_(low @ weight)
        grad_hidden.mul_(rows[:, None].to(grad_hidden.dtype))
    if grad_weight is not None:
        scaled = hidden.float() * rows[:, None]
        if low_weight_grad:
            grad_weight.add_(torch.mm(low.t(), scaled.to(weight.dtype), out_dtype=torch.float32))
        else:
            grad_weight.addmm_(grad.t(), scaled)
    if grad_bias is not None:
        grad_bias.addmv_(grad.t(), rows)


class _LinearCrossEntropy(torch.autograd.Function):
    """``sum_i coefficient_i * CE_i`` with its gradients computed in forward, chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, coefficients, head, chunk_size, stats):
        needs = ctx.needs_input_grad
        grad_hidden = torch.zeros_like(hidden) if needs[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if needs[1] else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if bias is not None and needs[2] else None
        any_grad = grad_hidden is not None or grad_weight is not None or grad_bias is not None
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        entropy = torch.zeros((), dtype=torch.float32, device=hidden.device)
        hits = torch.zeros((), dtype=torch.int64, device=hidden.device)
        buffers = _Buffers(min(chunk_size, hidden.shape[0]), weight.shape[0], hidden.device)
        for start, end in _chunks(hidden.shape[0], chunk_size):
            h, t, c = hidden[start:end], targets[start:end], end - start
            valid = t != _IGNORE
            k = torch.where(valid, coefficients[start:end], torch.zeros_like(coefficients[start:end]))
            index = t.clamp(min=0)[:, None]
            logits = _chunk_logits(h, weight, bias, head, buffers.take("logits", c))  # (c, V) fp32
            # (c, V): fused, faster than logsumexp on CPU; written into a kept buffer (torch.log_softmax has no out=)
            log_p = torch._log_softmax(logits, 1, False, out=buffers.take("log_p", c))
            per_token = -log_p.gather(1, index)[:, 0]
            loss += torch.where(k != 0, per_token * k, torch.zeros_like(k)).sum()
            if stats:
                # TRL's metrics over the labelled targets: top-1 hits (log p ranks as the logits), entropy
                hits += (valid & (log_p.argmax(-1) == t)).sum()
                # p once, for the entropy and the gradient (p - onehot): the (c, V) exp is the costliest pass after
                # the log-softmax. It goes over the logits where nothing reads them again (no soft-capping)
                probs = torch.exp(log_p, out=buffers.take("logits" if head.softcap is None else "probs", c))
                # each row's sum p log p as a batched dot product: no (c, V) product is written
                plogp = torch.bmm(probs[:, None, :], log_p[:, :, None]).view(c)
                entropy -= torch.where(valid, plogp, torch.zeros_like(plogp)).sum()
            if not any_grad:
                continue
            if not stats:
                probs = log_p.exp_()
            grad = probs.scatter_add_(1, index, torch.full_like(k, -1.0)[:, None])  # p - onehot
            derivative = head.derivative_(logits)  # over the logits, no longer needed
            if derivative is not None:
                grad.mul_(derivative)
            rows = k * head.factor  # d loss / d raw = k * factor * derivative * (p - onehot)
            grad_rows = None if grad_hidden is None else grad_hidden[start:end]
            _accumulate(grad, rows, h, weight, grad_rows, grad_weight, grad_bias)
        # a call without a target (every coefficient 0) is the constant 0: its gradient is exactly zero whatever
        # the incoming one, as F.cross_entropy's over ignored targets (an incoming 0/0 would make 0 * inf = NaN)
        trains = (coefficients != 0).any()  # () bool, on the device: no host sync
        ctx.save_for_backward(
            trains, *(g if g is not None else torch.empty(0) for g in (grad_hidden, grad_weight, grad_bias))
        )
        ctx.has = (grad_hidden is not None, grad_weight is not None, grad_bias is not None)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(entropy, hits)
        return loss, entropy, hits

    @staticmethod
    def backward(ctx, grad_loss, _entropy, _hits):
        trains, grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        has_hidden, has_weight, has_bias = ctx.has
        grad_loss = torch.where(trains, grad_loss.float(), torch.zeros_like(grad_loss, dtype=torch.float32))
        return (
            (grad_hidden * grad_loss.to(grad_hidden.dtype)) if has_hidden else None,
            (grad_weight * grad_loss).to(ctx.dtypes[0]) if has_weight else None,
            (grad_bias * grad_loss).to(ctx.dtypes[1]) if has_bias else None,
            None,
            None,
            None,
            None,
            None,
        )


class _TokenLogProbs(torch.autograd.Function):
    """Per-token ``log p(target)`` and entropy; each chunk's logits are recomputed in backward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, head, chunk_size, with_entropy, with_mean, with_top1):
        n = hidden.shape[0]
        logps = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.zeros(n if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        means = torch.zeros(n if with_mean else 0, dtype=torch.float32, device=hidden.device)
        top1 = torch.zeros(n if with_top1 else 0, dtype=torch.bool, device=hidden.device)
        buffers = _Buffers(min(chunk_size, n), weight.shape[0], hidden.device)
        for start, end in _chunks(n, chunk_size):
            t = targets[start:end]
            logits = _chunk_logits(hidden[start:end], weight, bias, head, buffers.take("logits", end - start))
            log_z = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, t.clamp(min=0)[:, None])[:, 0] - log_z
            logps[start:end] = torch.where(t != _IGNORE, picked, torch.zeros_like(picked))
            if with_entropy:
                entropy[start:end] = log_z - (torch.softmax(logits, -1) * logits).sum(-1)
            if with_mean:
                means[start:end] = logits.mean(-1)
            if with_top1:
                top1[start:end] = logits.argmax(-1) == t
        ctx.save_for_backward(hidden, weight, bias if bias is not None else torch.empty(0), targets, entropy)
        ctx.head, ctx.chunk_size, ctx.has_bias = head, chunk_size, bias is not None
        ctx.mark_non_differentiable(means, top1)
        return logps, entropy, means, top1

    @staticmethod
    def backward(ctx, grad_logps, grad_entropy, _means, _top1):
        hidden, weight, bias, targets, entropy = ctx.saved_tensors
        bias = bias if ctx.has_bias else None
        needs = ctx.needs_input_grad
        grad_hidden = torch.zeros_like(hidden) if needs[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if needs[1] else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if bias is not None and needs[2] else None
        use_entropy = grad_entropy is not None and entropy.numel() > 0
        buffers = _Buffers(min(ctx.chunk_size, hidden.shape[0]), weight.shape[0], hidden.device)
        for start, end in _chunks(hidden.shape[0], ctx.chunk_size):
            h, t, c = hidden[start:end], targets[start:end], end - start
            index = t.clamp(min=0)[:, None]
            logits = _chunk_logits(h, weight, bias, ctx.head, buffers.take("logits", c))
            log_p = torch._log_softmax(logits, 1, False, out=buffers.take("log_p", c))  # (c, V)
            g = torch.zeros(c, dtype=torch.float32, device=h.device)
            if grad_logps is not None:
                g = torch.where(t != _IGNORE, grad_logps[start:end].float(), g)
            if use_entropy:
                # d H / d z_j = -p_j (log p_j + H), H from this chunk's own log p (consistent rounding)
                probs = log_p.exp()
                chunk_entropy = -(probs * log_p).sum(-1, keepdim=True)
                grad = log_p.add_(chunk_entropy).mul_(probs).mul_(-grad_entropy[start:end].float()[:, None])
                grad.addcmul_(probs, -g[:, None])  # d log p_t / d z = onehot - p
                grad.scatter_add_(1, index, g[:, None])
                rows = torch.full_like(g, ctx.head.factor)
            else:  # onehot - p, its rows scaled by g on the (c, H) side
                grad = log_p.exp_().neg_().scatter_add_(1, index, torch.ones_like(g)[:, None])
                rows = g * ctx.head.factor
            derivative = ctx.head.derivative_(logits)
            if derivative is not None:
                grad.mul_(derivative)
            grad_rows = None if grad_hidden is None else grad_hidden[start:end]
            _accumulate(grad, rows, h, weight, grad_rows, grad_weight, grad_bias)
        return (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            None,
            None,
            None,
            None,
            None,
            None,
        )


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    weights: torch.Tensor | None = None,
    reduction: str = "sum",
    head: LogitHead | None = None,
    chunk_size: int | None = None,
    metrics: bool = False,
) -> tuple[torch.Tensor, LogitStats]:
    """The cross-entropy of ``targets`` under the logits ``head.apply(hidden @ weight.T + bias)``, chunk by chunk.

    Args:
        hidden: ``(N, H)`` float, the LM head's input (after the model's final norm).
        weight: ``(V, H)``, the LM head's weight (the input embeddings when tied); ``bias``: ``(V,)`` or ``None``.
        targets: ``(N,)`` int64 token ids, already shifted; ``-100``: not a target.
        weights: ``(N,)`` float, each target's weight (the coefficients of :func:`target_coefficients`), or
            ``None`` (1 each).
        reduction: ``"sum"`` (``sum_i w_i CE_i``), ``"mean"`` (that over ``sum_i w_i``, as
            ``F.cross_entropy(..., reduction="mean")`` without weights; 0 where ``sum_i w_i`` is 0, not NaN) or
            ``"none"`` (``(N,)`` per-token losses, 0 where not a target, gradients through :func:`token_logprobs`).
            Without a target (every target -100 or weighing 0) the gradients are exactly zero, whatever the
            incoming gradient (a 0/0 upstream included).
        head: the model's logit processing (default: none).
        chunk_size: tokens per chunk (default: :func:`default_chunk_size` of the vocabulary and device).
        metrics: also compute the entropy sum and top-1 hits of the labelled targets (:class:`LogitStats`).

    Returns:
        ``(loss, stats)``: the loss (fp32, scalar or ``(N,)``) and the labelled targets' :class:`LogitStats`.

    >>> hidden, weight = torch.eye(3), torch.eye(3) * 5
    >>> loss, stats = linear_cross_entropy(hidden, weight, torch.tensor([0, 2, -100]), chunk_size=2, metrics=True)
    >>> round(float(loss), 4), int(stats.hits), int(stats.count)
    (5.0268, 1, 2)
    """
    if reduction not in ("sum", "mean", "none"):
        raise ValueError(f"reduction={reduction!r}: it must be 'sum', 'mean' or 'none'")
    chunk = _check(hidden, weight, bias, targets, chunk_size)
    head = head or LogitHead()
    valid = targets != _IGNORE
    if reduction == "none":
        logps, _, _, _ = _TokenLogProbs.apply(hidden, weight, bias, targets, head, chunk, False, False, False)
        per_token = -logps
        if weights is not None:
            weights = weights.to(per_token)
            # where, not a product: a token weighing 0 adds exactly 0, and no gradient, whatever comes back
            per_token = torch.where(weights != 0, per_token * weights, torch.zeros_like(per_token))
        if not metrics:
            return per_token, LogitStats(entropy=None, hits=None, count=valid.sum())
        with torch.no_grad():
            _, stats = linear_cross_entropy(
                hidden, weight, targets, bias, head=head, chunk_size=chunk, metrics=True
            )
        return per_token, stats
    if weights is None:
        coefficients = valid.float()
    else:
        if weights.shape != targets.shape:
            raise ValueError(
                f"weights must be (tokens,) = {tuple(targets.shape)}, got {tuple(weights.shape)}"
            )
        coefficients = torch.where(valid, weights.float(), torch.zeros_like(weights, dtype=torch.float32))
    if not torch.is_grad_enabled():  # evaluation: no gradient to compute in the forward
        hidden, weight = hidden.detach(), weight.detach()
        bias = None if bias is None else bias.detach()
    loss, entropy, hits = _LinearCrossEntropy.apply(
        hidden, weight, bias, targets, coefficients, head, chunk, metrics
    )
    if reduction == "mean":
        total = coefficients.sum()
        # no target: 0 with zero gradients (F.cross_entropy's mean is NaN there, 0/0)
        loss = loss / torch.where(total != 0, total, torch.ones_like(total))
    if not metrics:
        entropy = hits = None
    return loss, LogitStats(entropy=entropy, hits=hits, count=valid.sum())


class TokenLogProbs(NamedTuple):
    """What :func:`token_logprobs` returns: ``logps`` ``(N,)`` (differentiable), ``entropy`` ``(N,)``
    (differentiable) or ``None``, ``mean_logits`` ``(N,)`` (detached: every position's mean logit, what TRL's
    ``logits/*`` metrics average) or ``None``, ``top1`` ``(N,)`` bool (the target is the position's argmax: TRL's
    token accuracy) or ``None``."""

    logps: torch.Tensor
    entropy: torch.Tensor | None
    mean_logits: torch.Tensor | None
    top1: torch.Tensor | None = None


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    head: LogitHead | None = None,
    chunk_size: int | None = None,
    entropy: bool = False,
    mean_logits: bool = False,
    top1: bool = False,
) -> TokenLogProbs:
    """Per-token ``log p(targets[i] | hidden[i])`` under ``head.apply(hidden @ weight.T + bias)``, and the entropy
    of every position's distribution, chunk by chunk, with gradients (the chunk's logits recomputed in backward).

    Args:
        hidden, weight, targets, bias, head, chunk_size: as in :func:`linear_cross_entropy`.
        entropy: also return the ``(N,)`` entropies (differentiable).
        mean_logits: also return every position's mean logit (detached).
        top1: also return whether each target is its position's argmax (detached, ``bool``).

    Returns:
        :class:`TokenLogProbs`: ``(N,)`` fp32 log-probs, 0 where ``targets`` is -100; the entropies, the mean logits.

    >>> out = token_logprobs(torch.zeros(2, 3), torch.ones(4, 3), torch.tensor([1, -100]), entropy=True)
    >>> [round(x, 4) for x in out.logps.tolist()], [round(x, 4) for x in out.entropy.tolist()], out.mean_logits
    ([-1.3863, 0.0], [1.3863, 1.3863], None)
    """
    chunk = _check(hidden, weight, bias, targets, chunk_size)
    logps, entropies, means, hits = _TokenLogProbs.apply(
        hidden, weight, bias, targets, head or LogitHead(), chunk, entropy, mean_logits, top1
    )
    return TokenLogProbs(
        logps, entropies if entropy else None, means if mean_logits else None, hits if top1 else None
    )
