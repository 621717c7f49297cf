"""``packing_hf.loss_head`` against the full-logits computation (fp32, 1e-6 relative): the loss under every
reduction, per-token log-probs and entropies, and every gradient (hidden states, head weight, bias), for every
logit processing, a vocabulary and a token count not divisible by the chunk, weights and ``-100`` targets; a
chunk loop that drops the first token of every chunk is caught by the same check."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from packing_hf import _loss, loss_head
from packing_hf.loss_head import LogitHead, linear_cross_entropy, target_coefficients, token_logprobs

REL = 1e-6
HEADS = {
    "plain": LogitHead(),
    "cohere_scale": LogitHead(scale=0.0625),
    "granite_divisor": LogitHead(divisor=3.0),
    "gemma_softcap": LogitHead(softcap=2.5),
}
N, H, V, CHUNK = 29, 8, 23, 6  # 29 tokens: 5 chunks, the last one short; 23 tokens of vocabulary


def _inputs(bias: bool):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=generator, requires_grad=True)
    weight = torch.randn(V, H, generator=generator, requires_grad=True)
    b = torch.randn(V, generator=generator, requires_grad=True) if bias else None
    targets = torch.randint(0, V, (N,), generator=generator)
    targets[[0, 6, 7, 20]] = -100  # chunk starts and a middle token are not targets
    weights = torch.randint(0, 9, (N,), generator=generator) / 4
    return hidden, weight, b, targets, weights


def _full(hidden, weight, bias, targets, weights, head, reduction):
    logits = head.apply(F.linear(hidden, weight, bias))  # (N, V): what the chunks avoid
    per_token = F.cross_entropy(logits, targets, reduction="none")  # 0 where -100
    log_p = logits.log_softmax(-1)
    logps = torch.where(targets != -100, log_p.gather(1, targets.clamp(min=0)[:, None])[:, 0], 0.0)
    entropy = -(log_p.exp() * log_p).sum(-1)
    if reduction == "none":
        return per_token * weights, logps, entropy
    loss = (per_token * weights).sum()
    return (loss / weights[targets != -100].sum() if reduction == "mean" else loss), logps, entropy


def _compare(assert_close, head, reduction, bias):
    """Every output and gradient of the chunked head equals the full-logits one."""
    hidden, weight, b, targets, weights = _inputs(bias)
    params = [hidden, weight] + ([b] if bias else [])
    got, _ = linear_cross_entropy(
        hidden, weight, targets, b, weights=weights, reduction=reduction, head=head, chunk_size=CHUNK
    )
    want, want_logps, want_entropy = _full(hidden, weight, b, targets, weights, head, reduction)
    assert_close(got.detach(), want.detach(), f"{reduction} loss", rel=REL)
    upstream = torch.linspace(0.5, 1.5, N) if reduction == "none" else torch.tensor(1.7)
    for g, w, name in zip(
        torch.autograd.grad((got * upstream).sum(), params),
        torch.autograd.grad((want * upstream).sum(), params, retain_graph=True),
        ("hidden", "weight", "bias"),
        strict=False,
    ):
        assert_close(g, w, f"{reduction} d/d{name}", rel=REL)
    logps, entropy, means, top1 = token_logprobs(
        hidden, weight, targets, b, head=head, chunk_size=CHUNK, entropy=True, mean_logits=True, top1=True
    )
    logits = head.apply(F.linear(hidden, weight, b)).detach()
    assert_close(means, logits.mean(-1), "mean logits", rel=REL)
    assert torch.equal(top1, logits.argmax(-1) == targets)
    assert_close(logps.detach(), want_logps.detach(), "log-probs", rel=REL)
    assert_close(entropy.detach(), want_entropy.detach(), "entropies", rel=REL)
    a, c = torch.linspace(-1, 1, N), torch.linspace(2, -0.5, N)
    for g, w, name in zip(
        torch.autograd.grad((logps * a).sum() + (entropy * c).sum(), params),
        torch.autograd.grad((want_logps * a).sum() + (want_entropy * c).sum(), params),
        ("hidden", "weight", "bias"),
        strict=False,
    ):
        assert_close(g, w, f"log-prob/entropy d/d{name}", rel=REL)


@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
@pytest.mark.parametrize("head", list(HEADS))
def test_chunked_equals_full_logits(head, reduction, assert_close):
    _compare(assert_close, HEADS[head], reduction, bias=head == "gemma_softcap")


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_a_chunk_boundary_that_drops_a_token_is_caught(reduction, assert_close, monkeypatch):
    def dropping(n, size):  # the first token of every chunk after the first is skipped
        for start in range(0, n, size):
            yield (start + 1 if start else 0), min(start + size, n)

    monkeypatch.setattr(loss_head, "_chunks", dropping)
    with pytest.raises(AssertionError):
        _compare(assert_close, HEADS["plain"], reduction, bias=False)


def test_stats_are_the_labelled_tokens_entropy_and_top1(assert_close):
    hidden, weight, _, targets, _ = _inputs(bias=False)
    with torch.no_grad():
        _, stats = linear_cross_entropy(hidden, weight, targets, chunk_size=CHUNK, metrics=True)
        logits = hidden @ weight.T
    mask = targets != -100
    log_p = logits[mask].log_softmax(-1)
    assert_close(stats.entropy, -(log_p.exp() * log_p).sum(), "entropy sum", rel=REL)
    assert int(stats.hits) == int((logits[mask].argmax(-1) == targets[mask]).sum())
    assert int(stats.count) == int(mask.sum())


@pytest.mark.parametrize("head", list(HEADS))
def test_metrics_with_gradients_equal_the_full_logits(head, assert_close):
    """``metrics=True`` in training (TRL's SFT metrics from the chunks that also give the gradient): the loss, every
    gradient and the stats equal the full-logits computation under every logit processing (soft-capping keeps its
    logits for the derivative, the others share their buffer with the probabilities)."""
    hidden, weight, b, targets, weights = _inputs(bias=True)
    params = [hidden, weight, b]
    got, stats = linear_cross_entropy(
        hidden, weight, targets, b, weights=weights, head=HEADS[head], chunk_size=CHUNK, metrics=True
    )
    want, _, _ = _full(hidden, weight, b, targets, weights, HEADS[head], "sum")
    assert_close(got.detach(), want.detach(), "loss", rel=REL)
    for g, w, name in zip(
        torch.autograd.grad(got * 1.7, params), torch.autograd.grad(want * 1.7, params), ("hidden", "weight", "bias"),
        strict=True,
    ):  # fmt: skip
        assert_close(g, w, f"d/d{name}", rel=REL)
    mask = targets != -100
    logits = HEADS[head].apply(F.linear(hidden, weight, b)).detach()[mask]
    log_p = logits.log_softmax(-1)
    assert_close(stats.entropy, -(log_p.exp() * log_p).sum(), "entropy sum", rel=REL)
    assert int(stats.hits) == int((logits.argmax(-1) == targets[mask]).sum())


def test_metrics_cost_one_exponential_pass_and_no_logit_sized_allocation():
    """With ``metrics=True`` and gradients, every chunk's ``(chunk, V)`` work goes into the chunk buffers: the
    probabilities are exponentiated once (for the entropy and for the gradient ``p - onehot``) and no ``(chunk, V)``
    tensor is allocated per chunk (a product ``p * log p`` or a fresh ``exp`` would be one more pass over memory
    the size of the logits, the costliest part of a small model's step on CPU)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class LogitSizedOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.dim() == 2 and out.shape[1] == V and out.shape[0] > 1:
                given = {a.untyped_storage().data_ptr() for a in [*args, *(kwargs or {}).values()]
                         if isinstance(a, torch.Tensor)}  # fmt: skip
                # a view, an in-place op or an out= op writes into a tensor it was given; others allocate
                self.ops.append((str(func), out.untyped_storage().data_ptr() not in given))
            return out

    hidden, weight, _, targets, _ = _inputs(bias=False)
    with LogitSizedOps() as mode:
        loss, _ = linear_cross_entropy(hidden, weight, targets, chunk_size=CHUNK, metrics=True)
    chunks = -(-N // CHUNK)
    exponentials = [op for op, _ in mode.ops if op.startswith("aten.exp")]
    assert len(exponentials) == chunks, mode.ops
    # every (chunk, V) result is written into a buffer, the buffers (logits, log-probs) allocated once per call
    allocating = [op for op, fresh in mode.ops if fresh]
    assert allocating == ["aten.empty.memory_format"] * 2, mode.ops


def test_the_default_cpu_chunk_is_cache_sized_within_the_memory_bound(assert_close):
    """Without ``chunk_size`` on CPU a chunk holds about ``CPU_CACHE_CHUNK_BYTES`` of logits, at least
    ``CPU_MIN_CHUNK_TOKENS`` tokens and never more than ``DEFAULT_CHUNK_BYTES`` (the rule is read at the call: the
    chunks really run that size), and the loss and gradients are those of the full logits."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Chunks(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.rows: list[int] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._log_softmax.out:
                self.rows.append(args[0].shape[0])
            return func(*args, **(kwargs or {}))

    vocab, tokens = 16384, 600  # 16 MiB of fp32 logits is 256 tokens of this vocabulary
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, 4, generator=generator, requires_grad=True)
    weight = torch.randn(vocab, 4, generator=generator, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,), generator=generator)
    with Chunks() as chunks:
        loss, _ = linear_cross_entropy(hidden, weight, targets)
    assert chunks.rows == [256, 256, 88]
    want = F.cross_entropy(hidden @ weight.T, targets, reduction="sum")
    assert_close(loss.detach(), want.detach(), "loss", rel=REL)
    for g, w, name in zip(
        torch.autograd.grad(loss, [hidden, weight]), torch.autograd.grad(want, [hidden, weight]), ("hidden", "weight"),
        strict=True,
    ):  # fmt: skip
        assert_close(g, w, f"d/d{name}", rel=REL)
    assert [loss_head.default_chunk_size(v) for v in (6531, 16384, 49152, 151936)] == [642, 256, 256, 220]
    assert loss_head.default_chunk_size(6531, "meta") == loss_head.chunk_size_for(
        6531
    )  # other devices: the bound


@pytest.mark.parametrize("normalization", _loss.LOSS_NORMALIZATIONS)
def test_coefficients_give_the_loss_numerator(normalization, assert_close):
    labels = torch.tensor([[-100, 3, 4, 5, -100, 6, 7, -100, -100, 2, 1]])
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3]])  # 3 samples
    weights = torch.tensor([[0, 1, 0.5, 2, 0, 1, 1, 0, 0, 0.25, 1]])
    per_target = torch.arange(1.0, 11.0)[None]
    want = _loss.loss_numerator(per_target, labels, normalization, weights, position_ids)
    coefficients = target_coefficients(labels, normalization, weights, position_ids)
    assert_close((coefficients * per_target).sum(), want, normalization, rel=REL)


def test_bad_inputs_are_named():
    hidden, weight = torch.zeros(3, 4), torch.zeros(5, 4)
    with pytest.raises(ValueError, match=r"targets\[1\] = 5 is not a token id of the 5-token vocabulary"):
        linear_cross_entropy(hidden, weight, torch.tensor([0, 5, -100]))
    with pytest.raises(ValueError, match="already shifted"):
        token_logprobs(hidden, weight, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="flatten the batch"):
        linear_cross_entropy(hidden[None], weight, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="chunk_size=0"):
        linear_cross_entropy(hidden, weight, torch.tensor([0, 1, 2]), chunk_size=0)
    with pytest.raises(ValueError, match="softcap"):
        LogitHead(softcap=0.0)


@pytest.mark.parametrize("tokens", ["ignored", "zero_weights", "none"])
@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
def test_a_call_without_targets_has_zero_gradients(tokens, reduction):
    """No target (every target -100, every weight 0, or no token at all): the loss is 0 and every gradient exactly
    zero, even under the incoming gradient of a 0/0 (a step's loss over its zero targets), as
    ``F.cross_entropy``'s over ignored targets; ``"mean"`` is 0 where ``F.cross_entropy``'s is NaN. Fails with the
    zero gradient scaled by the incoming inf (NaN, what a step without targets did to every parameter)."""
    hidden, weight, b, targets, weights = _inputs(bias=True)
    if tokens == "ignored":
        targets = torch.full_like(targets, -100)
    elif tokens == "zero_weights":
        weights = torch.zeros_like(weights)
    else:
        hidden, targets, weights = hidden[:0], targets[:0], weights[:0]
    got, stats = linear_cross_entropy(
        hidden, weight, targets, b, weights=weights, reduction=reduction, chunk_size=CHUNK
    )
    assert torch.equal(got.detach(), torch.zeros_like(got))
    upstream = got.sum() / (
        stats.count if tokens != "zero_weights" else weights.sum()
    )  # 0/0: NaN, and inf back
    params = [p for p in (hidden, weight, b) if p.requires_grad]
    grads = torch.autograd.grad(upstream, params, allow_unused=True)
    for name, grad in zip(("hidden", "weight", "bias"), grads, strict=True):
        if grad is not None:
            assert torch.equal(grad, torch.zeros_like(grad)), f"d/d{name} of a call without targets: {grad}"
