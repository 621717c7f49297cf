"""CUDA backends of varlen_attention (flash-attn 2/3/4, torch varlen_attn, per-segment SDPA), bf16.

Each kernel is compared with an fp32 computation of the same bf16 inputs, with an error bound relative
to the error PyTorch's own bf16 SDPA makes on the same problem (flash-attention's testing rule).
Skipped without a CUDA device (the ``gpu`` marker, see tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from packing_hf.attention import available_backends, register_attention, select_backend, varlen_attention
from packing_hf.varlen import lengths_to_cu_seqlens, lengths_to_position_ids

pytestmark = pytest.mark.gpu

LENGTHS = [130, 1, 257, 64, 511]
CUDA_BACKENDS = ["flash_attn_3", "flash_attn_4", "flash_attn", "torch_varlen"]


def cuda_backends() -> list[str]:
    if not torch.cuda.is_available():
        return []
    return [b for b in available_backends("cuda", torch.bfloat16) if b in CUDA_BACKENDS]


def inputs(hq=8, hkv=2, d=64, seed=0, requires_grad=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(LENGTHS)
    q, k, v = (
        torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for h in (hq, hkv, hkv)
    )
    if requires_grad:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    cu = lengths_to_cu_seqlens(LENGTHS).cuda()
    return q, k, v, cu


def check_close(out, fp32_ref, bf16_baseline, what):
    err = (out.float() - fp32_ref).abs().max().item()
    base = (bf16_baseline.float() - fp32_ref).abs().max().item()
    assert err <= 2 * base + 1e-3, f"{what}: max error {err:.2e} vs {base:.2e} for PyTorch's own bf16 SDPA"


@pytest.mark.parametrize("backend", CUDA_BACKENDS)
@pytest.mark.parametrize("features", [{}, {"window_size": (31, 0)}, {"causal": False}, {"softcap": 30.0}])
def test_cuda_backend_matches_fp32(backend, features):
    if backend not in cuda_backends():
        pytest.skip(f"{backend} is not installed or not supported on this GPU")
    from packing_hf.attention.backends import BACKENDS

    wanted = {"window"} if "window_size" in features else {"softcap"} if "softcap" in features else set()
    if not wanted <= BACKENDS[backend].features():
        pytest.skip(f"{backend} does not support {wanted}")
    q, k, v, cu = inputs()
    m = max(LENGTHS)
    out = varlen_attention(q, k, v, cu, cu, m, m, backend=backend, **features)
    ref = varlen_attention(q.float(), k.float(), v.float(), cu, cu, m, m, backend="sdpa", **features)
    baseline = varlen_attention(q, k, v, cu, cu, m, m, backend="sdpa", **features)
    check_close(out, ref, baseline, backend)


@pytest.mark.parametrize("backend", CUDA_BACKENDS)
def test_cuda_backend_gradients(backend):
    if backend not in cuda_backends():
        pytest.skip(f"{backend} is not installed or not supported on this GPU")
    m = max(LENGTHS)
    grads = {}
    for name, dtype in ((backend, torch.bfloat16), ("sdpa", torch.float32), ("sdpa-bf16", torch.bfloat16)):
        q, k, v, cu = inputs(requires_grad=True, seed=1)
        if dtype == torch.float32:
            q, k, v = (t.detach().float().requires_grad_() for t in (q, k, v))
        out = varlen_attention(q, k, v, cu, cu, m, m, backend=name.split("-")[0])
        out.float().square().sum().backward()
        grads[name] = (q.grad, k.grad, v.grad)
    for got, ref, base in zip(grads[backend], grads["sdpa"], grads["sdpa-bf16"], strict=True):
        check_close(got, ref.float(), base, f"{backend} gradient")


def test_auto_picks_a_cuda_kernel_in_bf16():
    choice = select_backend("cuda", torch.bfloat16)
    assert choice in cuda_backends() or (not cuda_backends() and choice == "sdpa")
    assert select_backend("cuda", torch.float32) == "sdpa"  # the flash kernels take half precision only


def test_registered_model_on_cuda_packed_equals_separate(tiny_causal_lm_factory):
    name = register_attention()
    model = tiny_causal_lm_factory("llama", attn_implementation=name).cuda().to(torch.bfloat16)
    reference = tiny_causal_lm_factory("llama", attn_implementation="sdpa").cuda().to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    samples = [torch.randint(0, 1000, (n,), generator=g) for n in (37, 80, 5)]
    ids = torch.cat(samples)[None].cuda()
    cu = lengths_to_cu_seqlens([len(s) for s in samples]).cuda()
    pos = lengths_to_position_ids([len(s) for s in samples])[None].cuda()
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=80,
                       max_length_k=80, use_cache=False).logits[0].float()  # fmt: skip
        alone = torch.cat(
            [reference(input_ids=s[None].cuda(), use_cache=False).logits[0] for s in samples]
        ).float()
    # bf16 end to end: a leak would show as O(1) differences, rounding stays far below
    assert (packed - alone).abs().max().item() < 0.1


# a prefix tree: root -> child -> two grandchildren, root -> second child, then an ordinary sample
TREE_LENGTHS = [96, 40, 17, 65, 33, 80]
TREE_PARENTS = [-1, 0, 1, 1, 0, -1]


@pytest.mark.parametrize("backend", CUDA_BACKENDS)
@pytest.mark.parametrize("features", [{}, {"window_size": (31, 0)}])
def test_cuda_backends_on_a_prefix_tree(backend, features):
    """The kernels get one causal call whose key segments are the gathered ancestor chains (Lk > Lq)."""
    if backend not in cuda_backends():
        pytest.skip(f"{backend} is not installed or not supported on this GPU")
    from packing_hf.attention import shared_prefix_attention

    g = torch.Generator(device="cuda").manual_seed(2)
    total = sum(TREE_LENGTHS)
    q, k, v = (torch.randn(total, h, 64, device="cuda", dtype=torch.bfloat16, generator=g) for h in (8, 2, 2))
    cu = lengths_to_cu_seqlens(TREE_LENGTHS).cuda()
    parents = torch.tensor(TREE_PARENTS, dtype=torch.int32, device="cuda")
    out = shared_prefix_attention(q, k, v, cu, parents, backend=backend, **features)
    ref = shared_prefix_attention(q.float(), k.float(), v.float(), cu, parents, backend="sdpa", **features)
    baseline = shared_prefix_attention(q, k, v, cu, parents, backend="sdpa", **features)
    check_close(out, ref, baseline, f"{backend} on a prefix tree")
