"""Prepared hybrid models on CUDA: the per-sample split of the token mixers stays exact on the GPU.

On CUDA transformers runs the mixers through whatever kernel it finds for a padded batch (mamba-ssm,
causal-conv1d, fla, or its torch fallback); the split hands them right-padded rows, which every such
kernel supports, so packed == alone must hold there too, and turning the split off must leak.
The CUDA test is skipped without a CUDA device (the ``gpu`` marker, see tests/conftest.py); what it needs
besides the device, that every model builds with the attention implementation it is given, is tested on
every machine, so a wrong case cannot hide until a GPU run.
"""

from __future__ import annotations

import pytest

from packing_hf.architectures import build_tiny_model, check_fla_triton, prepare_model_for_packing
from packing_hf.verify import check_packing

# (model_type, attention implementation): sdpa where the model has one; Mamba has no attention layer and
# transformers refuses it any implementation but eager
CASES = [
    ("bamba", "sdpa"),
    ("qwen3_5_text", "sdpa"),
    ("lfm2", "sdpa"),
    ("mamba", "eager"),
    ("falcon_h1", "sdpa"),
]
IDS = [model_type for model_type, _ in CASES]


@pytest.mark.parametrize("model_type, implementation", CASES, ids=IDS)
def test_every_cuda_case_builds_with_its_implementation(model_type, implementation):
    model = build_tiny_model(model_type, implementation)
    assert model.config.model_type == model_type
    assert model.config._attn_implementation == implementation


@pytest.mark.gpu
@pytest.mark.parametrize("model_type, implementation", CASES, ids=IDS)
def test_prepared_hybrid_is_exact_on_cuda(model_type, implementation):
    model = build_tiny_model(model_type, implementation).cuda()
    try:
        check_fla_triton(model.config, model.device)
    except ValueError as exc:  # fla would raise in the first backward: the stack, not packing_hf, is wrong
        pytest.skip(str(exc))
    with prepare_model_for_packing(model) as handle:
        report = check_packing(model, noise_floor=True)
        assert not report.leaked, report.summary()
        handle.split_mixers = False
        assert check_packing(model, gradients=False, noise_floor=False).leaked
