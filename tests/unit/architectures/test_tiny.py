"""tiny_config: tiny copies keep the features that decide exactness, and leave the given config alone."""

from __future__ import annotations

import pytest

from packing_hf.architectures.tiny import tiny_config


@pytest.mark.parametrize(
    ("model_type", "feature", "expected"),
    [
        ("mistral", "sliding_window", 4),
        ("gemma2", "attn_logit_softcapping", 50.0),  # kept: softcapping is an architectural feature
        ("gemma2", "final_logit_softcapping", 30.0),
        ("mixtral", "num_local_experts", 4),
        ("qwen3_next", "layer_types", ["linear_attention", "full_attention"]),  # one layer of each type
        ("gemma3_text", "layer_types", ["sliding_attention", "full_attention"]),
        ("deepseek_v3", "head_dim", 8),  # MLA: head_dim is the rotary part
    ],
)
def test_tiny_config_keeps_the_architecture_features(model_type, feature, expected):
    config = tiny_config(model_type)
    assert getattr(config, feature) == expected
    assert config.hidden_size == 64 and config.vocab_size == 512


def test_tiny_config_does_not_modify_the_given_config():
    from transformers import AutoConfig

    config = AutoConfig.for_model("llama", hidden_size=256, num_hidden_layers=6)
    tiny = tiny_config(config, vocab_size=300)
    assert (config.hidden_size, config.num_hidden_layers) == (256, 6)
    assert (tiny.hidden_size, tiny.num_hidden_layers, tiny.vocab_size) == (64, 2, 300)
