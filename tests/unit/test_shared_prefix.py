"""The shared-prefix layout: boundary arithmetic and the attention against each sample alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from packing_hf.attention.prefix import shared_prefix_attention
from packing_hf.shared_prefix import check_prefix_seq_idx, shared_prefix_plan, shared_prefix_position_ids


def test_positions_continue_the_prefix_and_restart_elsewhere():
    cu = [0, 4, 6, 9, 12, 13]
    idx = [-1, 0, 0, -1, 3]
    assert shared_prefix_position_ids(cu, idx, start=1).tolist() == [1, 2, 3, 4, 5, 6, 5, 6, 7, 1, 2, 3, 4]


def test_plan_puts_the_prefix_before_every_branch():
    plan = shared_prefix_plan([0, 2, 3, 4, 6], [-1, 0, 0, -1])
    assert plan.key_index.tolist() == [0, 1, 0, 1, 2, 0, 1, 3, 4, 5]
    assert plan.cu_seqlens_k.tolist() == [0, 2, 5, 8, 10] and plan.max_length_k == 3


@pytest.mark.parametrize(
    "idx, match",
    [
        ([-1, 0], "entries but"),
        ([0, -1, -1], "earlier segment"),
        ([-1, 2, -1], "earlier segment"),
        ([-1, 0, 1], "itself a branch"),
    ],
)
def test_bad_layouts_are_refused(idx, match):
    with pytest.raises(ValueError, match=match):
        check_prefix_seq_idx(idx, 3)


def _alone(q, k, v, window):
    """Causal SDPA of one sample (L, H, D), GQA expanded, optional sliding window."""
    n = q.shape[0]
    rel = torch.arange(n)[None, :] - torch.arange(n)[:, None]
    mask = rel <= 0
    if window is not None:
        mask &= rel > -window
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
    )
    return out.transpose(0, 1)


@pytest.mark.parametrize("backend", ["sdpa", "reference"])
@pytest.mark.parametrize("window", [None, 3])
def test_attention_equals_each_sample_alone_and_sums_prefix_gradients(backend, window):
    torch.manual_seed(0)
    cu = torch.tensor([0, 5, 8, 10, 14, 17], dtype=torch.int32)  # prefix | b | b | alone | ... a lone sample
    idx = torch.tensor([-1, 0, 0, -1, -1], dtype=torch.int32)
    q = torch.randn(17, 4, 8, requires_grad=True)
    k = torch.randn(17, 2, 8, requires_grad=True)
    v = torch.randn(17, 2, 8, requires_grad=True)
    w = torch.randn(17, 4, 8)
    kwargs = {"window_size": (window - 1, 0)} if window else {}
    out = shared_prefix_attention(q, k, v, cu, idx, backend=backend, **kwargs)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))

    want_out = torch.zeros_like(out)
    loss = 0.0
    for rows in ([*range(5), 5, 6, 7], [*range(5), 8, 9], list(range(10, 14)), list(range(14, 17))):
        alone = _alone(q[rows], k[rows], v[rows], window)
        own = [r for r in rows if r >= 5] if rows[0] == 0 else rows
        want_out[own] = alone[-len(own) :].detach()
        if rows[0] == 0 and rows[5] == 5:
            want_out[:5] = alone[:5].detach()
        loss = loss + (alone * w[rows]).sum() if rows[0] != 0 else loss + (alone[5:] * w[rows[5:]]).sum()
    # the prefix's own outputs are computed once; weight them once (the branches' terms above skip them)
    loss = loss + (_alone(q[:5], k[:5], v[:5], window) * w[:5]).sum()
    want_grads = torch.autograd.grad(loss, (q, k, v))
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
