"""varlen_attention: every CPU backend against an independent per-sample computation, in fp32."""

from __future__ import annotations

import importlib.machinery
import math
import sys
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from packing_hf.attention import (
    available_backends,
    last_backend,
    select_backend,
    varlen_attention,
)
from packing_hf.attention.interface import attend
from packing_hf.varlen import lengths_to_cu_seqlens

ATOL = 1e-5


def naive_sample(q, k, v, *, causal, scale, window, softcap, alibi, sinks):
    """One sample, written out independently of packing_hf: q (Lq, Hq, D), k/v (Lk, Hkv, D)."""
    lq, hq, _ = q.shape
    lk, hkv, _ = k.shape
    groups = hq // hkv
    out = torch.zeros(lq, hq, v.shape[-1], dtype=torch.float64)
    for h in range(hq):
        kh, vh = k[:, h // groups].double(), v[:, h // groups].double()
        for i in range(lq):
            ip = i + lk - lq  # bottom-right alignment
            logits = []
            for j in range(lk):
                ok = (not causal or j <= ip) and (window[0] < 0 or j >= ip - window[0])
                ok = ok and (window[1] < 0 or causal or j <= ip + window[1])
                if not ok:
                    logits.append(-math.inf)
                    continue
                s = float(q[i, h].double() @ kh[j]) * scale
                if softcap:
                    s = softcap * math.tanh(s / softcap)
                if alibi is not None:
                    s -= float(alibi[h]) * abs(ip - j)
                logits.append(s)
            row = torch.tensor(logits + ([float(sinks[h])] if sinks is not None else []), dtype=torch.float64)
            if torch.isinf(row).all():
                continue
            weights = torch.softmax(row, dim=0)[:lk]
            out[i, h] = weights @ vh
    return out


def make_inputs(lengths_q, lengths_k=None, hq=4, hkv=2, d=8, dv=None, seed=0, requires_grad=False):
    lengths_k = lengths_k or lengths_q
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lengths_q), hq, d, generator=g)
    k = torch.randn(sum(lengths_k), hkv, d, generator=g)
    v = torch.randn(sum(lengths_k), hkv, dv or d, generator=g)
    if requires_grad:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    return q, k, v, lengths_to_cu_seqlens(lengths_q), lengths_to_cu_seqlens(lengths_k)


def naive_packed(q, k, v, cu_q, cu_k, **features):
    pieces = []
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for i in range(len(bq) - 1):
        pieces.append(
            naive_sample(q[bq[i] : bq[i + 1]], k[bk[i] : bk[i + 1]], v[bk[i] : bk[i + 1]], **features)
        )
    return torch.cat(pieces).float()


FEATURE_CASES = {
    "causal": dict(causal=True),
    "bidirectional": dict(causal=False),
    "window": dict(causal=True, window_size=(2, 0)),
    "window_bidirectional": dict(causal=False, window_size=(2, 1)),
    "softcap": dict(causal=True, softcap=2.0),
    "softcap_window": dict(causal=True, softcap=2.0, window_size=(3, 3)),
    "alibi": dict(causal=True, alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625])),
    "sinks": dict(causal=True, s_aux=torch.tensor([0.3, -1.0, 2.0, 0.0])),
    "scale": dict(causal=True, softmax_scale=0.7),
}


def _naive_kwargs(case: dict, d: int) -> dict:
    return dict(
        causal=case.get("causal", True),
        scale=case.get("softmax_scale", 1 / math.sqrt(d)),
        window=case.get("window_size", (-1, -1)),
        softcap=case.get("softcap", 0.0),
        alibi=case.get("alibi_slopes"),
        sinks=case.get("s_aux"),
    )


@pytest.mark.parametrize("backend", ["sdpa", "reference"])
@pytest.mark.parametrize("case", list(FEATURE_CASES))
def test_backend_matches_each_sample_alone(backend, case):
    kwargs = FEATURE_CASES[case]
    lengths = [5, 1, 9, 3]
    q, k, v, cu, _ = make_inputs(lengths)
    out = varlen_attention(q, k, v, cu, cu, 9, 9, backend=backend, **kwargs)
    expected = naive_packed(q, k, v, cu, cu, **_naive_kwargs(kwargs, 8))
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    assert last_backend() == backend


@pytest.mark.parametrize("case", ["causal", "window", "alibi"])
def test_equal_length_segments_take_the_batched_path(case):
    kwargs = FEATURE_CASES[case]
    q, k, v, cu, _ = make_inputs([6, 6, 6])
    out = varlen_attention(q, k, v, cu, cu, 6, 6, backend="sdpa", **kwargs)
    torch.testing.assert_close(
        out, naive_packed(q, k, v, cu, cu, **_naive_kwargs(kwargs, 8)), atol=ATOL, rtol=0
    )


@pytest.mark.parametrize("causal", [True, False])
def test_more_keys_than_queries_is_bottom_right_aligned(causal):
    q, k, v, cu_q, cu_k = make_inputs([2, 1, 3], [5, 4, 3])
    for backend in ("sdpa", "reference"):
        out = varlen_attention(q, k, v, cu_q, cu_k, 3, 5, causal=causal, backend=backend)
        expected = naive_packed(q, k, v, cu_q, cu_k, **_naive_kwargs({"causal": causal}, 8))
        torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


def test_more_queries_than_keys_gives_zero_rows_without_keys():
    q, k, v, cu_q, cu_k = make_inputs([4], [2])
    out = varlen_attention(q, k, v, cu_q, cu_k, 4, 2, backend="sdpa")
    torch.testing.assert_close(
        out, naive_packed(q, k, v, cu_q, cu_k, **_naive_kwargs({}, 8)), atol=ATOL, rtol=0
    )
    assert torch.equal(out[:2], torch.zeros_like(out[:2]))


def test_value_head_dim_may_differ():
    q, k, v, cu, _ = make_inputs([3, 4], dv=5)
    out = varlen_attention(q, k, v, cu, cu, 4, 4)
    assert out.shape == (7, 4, 5)
    torch.testing.assert_close(out, naive_packed(q, k, v, cu, cu, **_naive_kwargs({}, 8)), atol=ATOL, rtol=0)


def test_tokens_after_the_last_segment_are_zero():
    q, k, v, _, _ = make_inputs([3, 4])
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    for backend in ("sdpa", "reference"):
        out = varlen_attention(q, k, v, cu, cu, 3, 3, backend=backend)
        assert torch.equal(out[5:], torch.zeros_like(out[5:]))
        torch.testing.assert_close(out[:5], naive_packed(q[:5], k[:5], v[:5], cu, cu, **_naive_kwargs({}, 8)))


@pytest.mark.parametrize("case", ["causal", "window", "softcap", "sinks", "alibi"])
def test_gradients_match_reference(case):
    kwargs = FEATURE_CASES[case]
    lengths = [4, 7, 2]
    grads = {}
    for backend in ("sdpa", "reference"):
        q, k, v, cu, _ = make_inputs(lengths, requires_grad=True, seed=3)
        out = varlen_attention(q, k, v, cu, cu, 7, 7, backend=backend, **kwargs)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads[backend] = (q.grad, k.grad, v.grad)
    for got, want in zip(grads["sdpa"], grads["reference"], strict=True):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_dropout_is_applied_only_when_asked():
    q, k, v, cu, _ = make_inputs([8, 8])
    plain = varlen_attention(q, k, v, cu, cu, 8, 8)
    torch.manual_seed(0)
    dropped = varlen_attention(q, k, v, cu, cu, 8, 8, dropout_p=0.5)
    assert not torch.allclose(plain, dropped)
    with pytest.raises(ValueError, match="dropout_p"):
        varlen_attention(q, k, v, cu, cu, 8, 8, dropout_p=1.0)


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=5),
    causal=st.booleans(),
    left=st.integers(-1, 4),
    softcap=st.sampled_from([0.0, 3.0]),
    gqa=st.sampled_from([1, 2, 4]),
)
def test_sdpa_equals_reference_property(lengths, causal, left, softcap, gqa):
    q, k, v, cu, _ = make_inputs(lengths, hq=4, hkv=4 // gqa)
    kwargs = dict(causal=causal, window_size=(left, -1 if causal else left), softcap=softcap)
    m = max(lengths)
    out = varlen_attention(q, k, v, cu, cu, m, m, backend="sdpa", **kwargs)
    ref = varlen_attention(q, k, v, cu, cu, m, m, backend="reference", **kwargs)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


def test_segments_never_see_each_other():
    """Changing one sample's keys and values changes only that sample's outputs."""
    q, k, v, cu, _ = make_inputs([4, 6, 3])
    out = varlen_attention(q, k, v, cu, cu, 6, 6, causal=False)
    k2, v2 = k.clone(), v.clone()
    k2[4:10] += 5.0
    v2[4:10] -= 3.0
    out2 = varlen_attention(q, k2, v2, cu, cu, 6, 6, causal=False)
    assert torch.equal(out2[:4], out[:4]) and torch.equal(out2[10:], out[10:])
    assert not torch.allclose(out2[4:10], out[4:10])


def test_auto_selection_on_cpu_is_sdpa_for_every_feature():
    for features in ([], ["window"], ["softcap", "dropout"], ["alibi", "sinks", "head_dim_v"]):
        assert select_backend("cpu", torch.float32, features) == "sdpa"
    assert "sdpa" in available_backends("cpu") and "reference" not in available_backends("cpu")
    with pytest.raises(ValueError, match="unknown attention features"):
        select_backend("cpu", torch.float32, ["bogus"])


def test_flash_stand_in_is_listed_but_auto_keeps_cpu_fp32_on_sdpa(monkeypatch):
    module = types.ModuleType("flash_attn")
    module.__spec__ = importlib.machinery.ModuleSpec("flash_attn", loader=None)  # find_spec() reads it
    module.flash_attn_varlen_func = (
        lambda q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kw: q
    )
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    assert "flash_attn" in available_backends()
    assert select_backend("cpu", torch.float32) == "sdpa"
    q, k, v, cu, _ = make_inputs([3])
    with pytest.raises(ValueError, match="does not support"):
        varlen_attention(q, k, v, cu, cu, 3, 3, softcap=1.0, backend="flash_attn")


def test_named_backend_errors_name_the_problem():
    q, k, v, cu, _ = make_inputs([3, 2])
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        varlen_attention(q, k, v, cu, cu, 3, 3, backend="nope")
    if "torch_varlen" in available_backends():
        with pytest.raises(ValueError, match=r"does not support \['softcap'\]"):
            varlen_attention(q, k, v, cu, cu, 3, 3, softcap=5.0, backend="torch_varlen")


def test_input_validation():
    q, k, v, cu, _ = make_inputs([3, 2])
    with pytest.raises(ValueError, match="total_tokens, heads, head_dim"):
        varlen_attention(q[None], k, v, cu, cu, 3, 3)
    with pytest.raises(ValueError, match="not a multiple"):
        varlen_attention(torch.randn(5, 3, 8), k, v, cu, cu, 3, 3)
    with pytest.raises(ValueError, match="must start at 0"):
        varlen_attention(q, k, v, torch.tensor([1, 3, 5], dtype=torch.int32), cu, 3, 3)
    with pytest.raises(ValueError, match="ends at 9 but the row holds 5 tokens"):
        varlen_attention(q, k, v, torch.tensor([0, 3, 9], dtype=torch.int32), cu, 3, 3)
    with pytest.raises(ValueError, match="entries"):
        varlen_attention(q, k, v, cu, torch.tensor([0, 5], dtype=torch.int32), 3, 3)
    with pytest.raises(TypeError, match="integers"):
        varlen_attention(q, k, v, cu.float(), cu, 3, 3)
    with pytest.raises(ValueError, match="one value per query head"):
        varlen_attention(q, k, v, cu, cu, 3, 3, s_aux=torch.zeros(2))


def test_int32_overflow_is_refused_before_any_work():
    big = torch.empty(2**31, 1, 1, device="meta")
    cu = torch.tensor([0, 2**31], dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match="overflows int32 cu_seqlens"):
        varlen_attention(big, big, big, cu, cu, 2**31, 2**31)


def test_attend_applies_a_dense_mask_inside_each_segment():
    """A 4-D mask a model built itself (here: causal, blind to packing) is intersected with the segments."""
    lengths = [3, 5]
    q, k, v, cu, _ = make_inputs(lengths, hq=2, hkv=2)
    causal = torch.ones(8, 8, dtype=torch.bool).tril()[None, None]
    out = attend(q[None], k[None], v[None], causal, causal=False, cu_seq_lens_q=cu, max_length_q=5)
    expected = naive_packed(q, k, v, cu, cu, **_naive_kwargs({}, 8))
    torch.testing.assert_close(out[0], expected, atol=ATOL, rtol=0)
    additive = torch.zeros(1, 1, 8, 8).masked_fill(~causal, float("-inf"))
    out = attend(
        q[None],
        k[None],
        v[None],
        additive,
        causal=True,
        position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]]),
    )
    torch.testing.assert_close(out[0], expected, atol=ATOL, rtol=0)


def test_attend_padded_batch_matches_rows_alone():
    q, k, v, _, _ = make_inputs([6, 6], hq=2, hkv=1)
    qb, kb, vb = (t.view(2, 6, *t.shape[1:]) for t in (q, k, v))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    out = attend(qb, kb, vb, mask, causal=True)
    alone = attend(qb[:1, 2:], kb[:1, 2:], vb[:1, 2:], None, causal=True)
    torch.testing.assert_close(out[0, 2:], alone[0], atol=ATOL, rtol=0)
    assert torch.equal(out[0, :2], torch.zeros_like(out[0, :2]))
    torch.testing.assert_close(
        out[1], attend(qb[1:], kb[1:], vb[1:], None, causal=True)[0], atol=ATOL, rtol=0
    )


def test_attend_packed_rows_in_a_batch_of_several_rows():
    """Two rows, each packing two samples, told apart by position_ids alone (no cu_seq_lens)."""
    q, k, v, _, _ = make_inputs([7, 7], hq=2, hkv=2)
    qb, kb, vb = (t.view(2, 7, *t.shape[1:]) for t in (q, k, v))
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 0, 1]])
    out = attend(qb, kb, vb, None, causal=True, position_ids=positions)
    cu = torch.tensor([0, 3, 7, 12, 14], dtype=torch.int32)
    expected = naive_packed(q, k, v, cu, cu, **_naive_kwargs({}, 8))
    torch.testing.assert_close(out.reshape(14, 2, 8), expected, atol=ATOL, rtol=0)


def test_attend_guards():
    q = torch.randn(2, 4, 2, 8)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="single row"):
        attend(q, q, q, None, causal=True, cu_seq_lens_q=cu, max_length_q=4)
    with pytest.raises(ValueError, match="contradict the packed boundaries"):
        attend(
            q[:1], q[:1], q[:1], torch.tensor([[1, 1, 1, 0]]), causal=True, cu_seq_lens_q=cu, max_length_q=4
        )
