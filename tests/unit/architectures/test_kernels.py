"""The fla / Triton / GPU rule of packing_hf.architectures.kernels, on versions and capabilities alone (no GPU).

fla raises in the first backward of a gated DeltaNet layer on Triton >= 3.4.0 and < 3.7.1 with a GPU of
compute capability >= 9 (fla issue #640); ``fla_triton_problem`` must name exactly that combination, and
``check_fla_triton`` must ask it only for models that run fla's gated DeltaNet.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from packing_hf.architectures import kernels
from packing_hf.architectures.kernels import check_fla_triton, fla_triton_problem, uses_fla_gated_deltanet


@pytest.mark.parametrize(
    "triton, capability",
    [
        ("3.4.0", (9, 0)),  # first bad Triton
        ("3.6.0", (9, 0)),  # torch 2.10 / 2.11's pin, H100
        ("3.7.0", (9, 0)),  # last bad release
        ("3.7.1rc1", (9, 0)),  # a pre-release of the fix: fla compares packaging versions, rc1 < 3.7.1
        ("3.5.0+git1a2b3c", (9, 0)),  # a local build
        ("3.6.0", (10, 0)),  # Blackwell: fla counts every capability >= 9 as Hopper
    ],
)
def test_the_bad_combinations_are_named_with_the_fix(triton, capability):
    message = fla_triton_problem("0.6.0", triton, capability)
    assert message is not None
    assert "fla 0.6.0" in message and f"Triton {triton}" in message
    assert f"compute capability {capability[0]}.{capability[1]}" in message
    for fix in ("upgrade Triton to >= 3.7.1", "install tilelang", "uninstall flash-linear-attention"):
        assert fix in message


@pytest.mark.parametrize(
    "fla, triton, capability, tilelang",
    [
        ("0.6.0", "3.7.1", (9, 0), False),  # fixed Triton
        ("0.6.0", "3.8.0", (9, 0), False),
        ("0.6.0", "3.3.1", (9, 0), False),  # before the miscompilation
        ("0.6.0", "3.6.0", (8, 0), False),  # A100
        ("0.6.0", "3.6.0", (8, 9), False),  # Ada
        ("0.6.0", "3.6.0", (9, 0), True),  # fla dispatches the kernel to tilelang
        (None, "3.6.0", (9, 0), False),  # no fla: transformers' torch implementation
        ("0.6.0", None, (9, 0), False),  # no Triton
        ("0.6.0", "3.6.0", None, False),  # no GPU
    ],
)
def test_every_other_combination_passes(fla, triton, capability, tilelang):
    assert fla_triton_problem(fla, triton, capability, tilelang=tilelang) is None


def test_only_gated_deltanet_models_are_checked():
    assert uses_fla_gated_deltanet(AutoConfig.for_model("qwen3_5_text"))
    assert uses_fla_gated_deltanet(AutoConfig.for_model("qwen3_next"))
    assert uses_fla_gated_deltanet(AutoConfig.for_model("qwen3_5"))  # the wrapper's text model decides
    for model_type in ("llama", "mamba", "lfm2", "bamba"):
        assert not uses_fla_gated_deltanet(AutoConfig.for_model(model_type)), model_type


def test_check_refuses_the_bad_stack_before_training(monkeypatch):
    # the stack of issue 29: fla 0.6 and Triton 3.6 on an H100, stood in for on this CPU machine
    versions = {"fla": "0.6.0", "triton": "3.6.0"}
    monkeypatch.setattr(kernels, "_version", versions.get)
    monkeypatch.setattr(kernels.importlib.util, "find_spec", lambda name: None)  # no tilelang
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with pytest.raises(ValueError, match=r"qwen3_5_text: fla 0\.6\.0 .* Triton 3\.6\.0 .* capability 9\.0"):
        check_fla_triton(AutoConfig.for_model("qwen3_5_text"))
    with pytest.raises(ValueError, match="upgrade Triton"):
        check_fla_triton(AutoConfig.for_model("qwen3_5_text"), "cuda:0")
    check_fla_triton(AutoConfig.for_model("qwen3_5_text"), "cpu")  # fla's kernels never run on CPU tensors
    check_fla_triton(AutoConfig.for_model("llama"))  # no gated DeltaNet: nothing to refuse
    versions["triton"] = "3.7.1"
    check_fla_triton(AutoConfig.for_model("qwen3_5_text"))
