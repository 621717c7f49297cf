"""The registry's config-level rules: what the attention refuses by itself, and what prepare refuses."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import packing_hf
from packing_hf.architectures import check_served_config, prepare_model_for_packing, tiny_config
from packing_hf.registry import unsupported_layers
from packing_hf.verify import build_packed_batch, check_packing

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize(
    ("model_type", "overrides", "cause"),
    [
        ("bamba", {}, "hybrid Mamba2 layers"),
        ("bloom", {}, "computes attention itself"),
        ("mpt", {}, "computes attention itself"),
        ("llama4_text", {}, "chunked local attention"),
        ("lfm2", {"num_hidden_layers": 2, "layer_types": ["conv", "full_attention"]}, "layer types ['conv']"),
    ],
)
def test_the_attention_refuses_what_it_cannot_keep_exact(model_type, overrides, cause):
    config = AutoConfig.for_model(model_type, **overrides)
    with pytest.raises(ValueError, match=f"{model_type} cannot be packed exactly.*{re.escape(cause)}"):
        check_served_config(config)


def test_plain_attention_models_pass():
    for model_type in ("llama", "qwen2", "mistral", "gemma3_text", "opt"):
        check_served_config(AutoConfig.for_model(model_type))
    assert unsupported_layers(AutoConfig.for_model("gemma3_text")) is None


def test_an_lfm2_with_convolutions_leaks_and_is_refused_on_every_path():
    """LFM2's registry entry is exact for an all-attention config; real checkpoints interleave convolutions."""
    config = tiny_config("lfm2", layer_types=["conv", "full_attention"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    assert check_packing(model, gradients=False).leaked  # the reason for the rule
    with pytest.raises(ValueError, match=r"lfm2: layer types \['conv'\]"):
        prepare_model_for_packing(model)
    model.set_attn_implementation(packing_hf.register_attention())
    batch = build_packed_batch([torch.arange(3, 10), torch.arange(20, 25)])
    with pytest.raises(ValueError, match="lfm2 cannot be packed exactly"):
        model(**batch, use_cache=False)


def test_the_attention_name_path_refuses_llama4_chunked_attention_at_the_first_forward():
    model = AutoModelForCausalLM.from_config(
        tiny_config("llama4_text"), attn_implementation=packing_hf.register_attention()
    )
    batch = build_packed_batch([torch.arange(3, 10), torch.arange(20, 25)])
    with pytest.raises(ValueError, match="llama4_text cannot be packed exactly.*sdpa"):
        model(**batch, use_cache=False)
