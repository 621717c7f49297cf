"""The prefix-tree layout (one-level shared prefix = depth 1): boundary arithmetic and the attention against
each root-to-node sample alone, on every attention backend (the flash-attn call contract with a stand-in)."""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from packing_hf.attention import varlen_attention
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
        ([-1, 1, 0], "earlier segment"),  # a segment cannot be its own parent
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


# A forest: root 0 (4) -> 1 (3) -> {2 (2), 3 (3)}; 0 -> 4 (2); a lone sample 5 (3); root 6 (3) -> 7 (2)
TREE_LENGTHS = [4, 3, 2, 3, 2, 3, 3, 2]
TREE_PARENTS = [-1, 0, 1, 1, 0, -1, -1, 6]


def _tree_cu() -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(TREE_LENGTHS).cumsum(0).tolist()], dtype=torch.int32)


def test_chains_are_accepted_and_positions_continue_every_ancestor():
    assert check_prefix_seq_idx(TREE_PARENTS, len(TREE_PARENTS)) == TREE_PARENTS
    positions = shared_prefix_position_ids(_tree_cu(), TREE_PARENTS).tolist()
    assert positions == [0, 1, 2, 3, 4, 5, 6, 7, 8, 7, 8, 9, 4, 5, 0, 1, 2, 0, 1, 2, 3, 4]


def test_plan_gathers_the_ancestor_chain_root_first():
    plan = shared_prefix_plan(_tree_cu(), TREE_PARENTS)
    segments = torch.split(plan.key_index, torch.diff(plan.cu_seqlens_k).tolist())
    assert segments[2].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8]  # root, parent, own
    assert segments[3].tolist() == [0, 1, 2, 3, 4, 5, 6, 9, 10, 11]  # never its sibling 2
    assert segments[4].tolist() == [0, 1, 2, 3, 12, 13]
    assert segments[7].tolist() == [17, 18, 19, 20, 21] and plan.max_length_k == 10


def _paths(parents: list[int]) -> list[list[int]]:
    """Every segment's root-to-segment chain of segments."""
    paths: list[list[int]] = []
    for i, p in enumerate(parents):
        paths.append([i] if p < 0 else [*paths[p], i])
    return paths


def _rows(cu: torch.Tensor, segments: list[int]) -> list[int]:
    return [r for s in segments for r in range(int(cu[s]), int(cu[s + 1]))]


def _tree_inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    total = sum(TREE_LENGTHS)
    q, k, v = (torch.randn(total, h, 8, generator=g, requires_grad=True) for h in (4, 2, 2))
    return q, k, v, torch.randn(total, 4, 8, generator=g)


FEATURES = {
    "plain": {},
    "window": {"window_size": (2, 0)},
    "softcap": {"softcap": 2.0},
    "sinks": {"s_aux": torch.tensor([0.5, -1.0, 2.0, 0.0])},
    "alibi": {"alibi_slopes": torch.tensor([0.5, 0.25, 0.125, 0.0625])},
}


def _tree_errors(parents_used: list[int], backend: str, features: dict) -> tuple[float, float]:
    """Largest output and gradient error of the tree row (laid out with ``parents_used``) against every
    segment's root-to-segment path run alone (one segment, no prefix machinery, the reference backend)."""
    cu = _tree_cu()
    q, k, v, w = _tree_inputs()
    out = shared_prefix_attention(
        q, k, v, cu, torch.tensor(parents_used, dtype=torch.int32), backend=backend, **features
    )
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    want_out, loss = torch.zeros_like(out), 0.0
    for segment, path in enumerate(_paths(TREE_PARENTS)):
        rows = _rows(cu, path)
        n, own = len(rows), int(cu[segment + 1] - cu[segment])
        alone_cu = torch.tensor([0, n], dtype=torch.int32)
        alone = varlen_attention(
            q[rows], k[rows], v[rows], alone_cu, alone_cu, n, n, causal=True, backend="reference", **features
        )
        want_out[rows[-own:]] = alone[-own:].detach()
        loss = loss + (alone[-own:] * w[rows[-own:]]).sum()  # each segment's outputs weighted once
    want_grads = torch.autograd.grad(loss, (q, k, v))
    grad_error = max(float((a - b).abs().max()) for a, b in zip(grads, want_grads, strict=True))
    return float((out.detach() - want_out).abs().max()), grad_error


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("backend", ["sdpa", "sdpa_padded", "reference"])
def test_tree_attention_equals_every_path_alone_forward_and_backward(backend, feature):
    out_error, grad_error = _tree_errors(TREE_PARENTS, backend, FEATURES[feature])
    assert out_error < 1e-5 and grad_error < 1e-5, (out_error, grad_error)


@pytest.mark.parametrize(
    "wrong", [[-1, 0, 1, 2, 0, -1, -1, 6], [-1, 0, 0, 1, 0, -1, -1, 6]], ids=["sibling", "uncle"]
)
def test_a_leak_into_a_sibling_or_a_lost_ancestor_is_caught(wrong):
    """Negative controls: segment 3 reads its sibling 2, or loses its parent 1, and the same check fails."""
    out_error, grad_error = _tree_errors(wrong, "sdpa", {})
    assert out_error > 1e-2 and grad_error > 1e-2, (out_error, grad_error)


def _stand_in_flash_attn(calls: list[dict]):
    """A pure-torch ``flash_attn_varlen_func`` (FA2 keywords), written here apart from packing_hf's backends:
    causal aligned bottom-right, sliding window, softcap, ALiBi (FlashAttention's conventions)."""

    def flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
        causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
        return_attn_probs=False,
    ):  # fmt: skip
        calls.append(
            dict(
                cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k, causal=causal
            )
        )
        out = torch.zeros_like(q)
        bq, bk = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        for i in range(len(bq) - 1):
            qs, ks, vs = q[bq[i] : bq[i + 1]], k[bk[i] : bk[i + 1]], v[bk[i] : bk[i + 1]]
            groups = qs.shape[1] // ks.shape[1]
            ks, vs = ks.repeat_interleave(groups, 1), vs.repeat_interleave(groups, 1)
            scores = torch.einsum("qhd,khd->hqk", qs, ks) * softmax_scale
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            lq, lk = len(qs), len(ks)
            rel = (
                torch.arange(lk)[None, :] - torch.arange(lq)[:, None] - (lk - lq)
            )  # key - query, bottom-right
            if alibi_slopes is not None:
                scores = scores - alibi_slopes[:, None, None] * rel.abs()
            keep = rel <= 0 if causal else torch.ones_like(rel, dtype=torch.bool)
            if window_size[0] >= 0:
                keep &= rel >= -window_size[0]
            scores = scores.masked_fill(~keep, float("-inf"))
            out[bq[i] : bq[i + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs)
        return out

    return flash_attn_varlen_func


@pytest.mark.parametrize("feature", ["plain", "window", "softcap", "alibi"])
def test_flash_attn_path_gets_the_gathered_ancestors_and_equals_every_path_alone(monkeypatch, feature):
    """The flash-attn call contract on CPU: one causal call whose key segments are the ancestor chains."""
    calls: list[dict] = []
    module = types.ModuleType("flash_attn")
    module.__spec__ = importlib.machinery.ModuleSpec("flash_attn", loader=None)
    module.flash_attn_varlen_func = _stand_in_flash_attn(calls)
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    out_error, grad_error = _tree_errors(TREE_PARENTS, "flash_attn", FEATURES[feature])
    assert out_error < 1e-5 and grad_error < 1e-5, (out_error, grad_error)
    plan = shared_prefix_plan(_tree_cu(), TREE_PARENTS)
    assert len(calls) == 1 and calls[0]["causal"]
    assert calls[0]["cu_seqlens_k"].tolist() == plan.cu_seqlens_k.tolist()
    assert calls[0]["cu_seqlens_q"].tolist() == _tree_cu().tolist() and calls[0]["max_seqlen_k"] == 10
