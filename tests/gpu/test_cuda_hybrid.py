"""Prepared hybrid models on CUDA: the per-sample split of the token mixers stays exact on the GPU.

On CUDA transformers runs the mixers through whatever kernel it finds for a padded batch (mamba-ssm,
causal-conv1d, fla, or its torch fallback); the split hands them right-padded rows, which every such
kernel supports, so packed == alone must hold there too, and turning the split off must leak.
The CUDA test is skipped without a CUDA device (the ``gpu`` marker, see tests/conftest.py); the same cases
and check run on the CPU on every machine (transformers' torch paths, < 1 s a case), so a case that cannot
run, e.g. an attention implementation its model does not have, shows before a GPU run.
Sizes are already the check's smallest (tiny configs, samples of 7, 12 and 5 tokens): on CUDA the time goes
to the CUDA start and, with fla installed, to compiling its Triton kernels on the first call.
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


def _check_prepared_hybrid(model) -> None:
    with prepare_model_for_packing(model) as handle:
        report = check_packing(model, noise_floor=True)
        assert report.error is None and not report.leaked, report.summary()
        handle.split_mixers = False  # negative control: the mixers see the whole row
        assert check_packing(model, gradients=False, noise_floor=False).leaked


@pytest.mark.parametrize("model_type, implementation", CASES, ids=IDS)
def test_every_cuda_case_runs_on_cpu(model_type, implementation, one_torch_thread):
    model = build_tiny_model(model_type, implementation)
    assert model.config._attn_implementation == implementation
    _check_prepared_hybrid(model)


@pytest.mark.gpu
@pytest.mark.parametrize("model_type, implementation", CASES, ids=IDS)
def test_prepared_hybrid_is_exact_on_cuda(model_type, implementation):
    model = build_tiny_model(model_type, implementation).cuda()
    try:
        check_fla_triton(model.config, model.device)
    except ValueError as exc:  # fla would raise in the first backward: the stack, not packing_hf, is wrong
        pytest.skip(str(exc))
    _check_prepared_hybrid(model)
