"""Prepared hybrid models on CUDA: the per-sample split of the token mixers stays exact on the GPU.

On CUDA transformers runs the mixers through whatever kernel it finds for a padded batch (mamba-ssm,
causal-conv1d, fla, or its torch fallback); the split hands them right-padded rows, which every such
kernel supports, so packed == alone must hold there too, and turning the split off must leak.
Skipped without a CUDA device (the ``gpu`` marker, see tests/conftest.py). Never run so far: the
development machine has no GPU.
"""

from __future__ import annotations

import pytest

from packing_hf.architectures import build_tiny_model, prepare_model_for_packing
from packing_hf.verify import check_packing

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("model_type", ["bamba", "qwen3_5_text", "lfm2", "mamba", "falcon_h1"])
def test_prepared_hybrid_is_exact_on_cuda(model_type):
    model = build_tiny_model(model_type, "sdpa").cuda()
    with prepare_model_for_packing(model) as handle:
        report = check_packing(model, noise_floor=True)
        assert not report.leaked, report.summary()
        handle.split_mixers = False
        assert check_packing(model, gradients=False, noise_floor=False).leaked
