"""The registry's config-level rules: what the attention refuses by itself, and what prepare refuses."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import packing_hf
from packing_hf.architectures import check_served_config, prepare_model_for_packing, tiny_config
from packing_hf.architectures.mixers import find_mixers
from packing_hf.attention.admission import mixer_free, unsupported_layers
from packing_hf.registry import MIXERS_BY_LAYER_TYPE, support
from packing_hf.verify import build_packed_batch, check_packing

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize(
    ("model_type", "overrides", "cause"),
    [
        ("bamba", {}, "alone: Mamba2 layers carry their scan state"),
        ("bloom", {}, "computes attention itself"),
        ("mpt", {}, "computes attention itself"),
        ("deepseek_v32", {}, "the DSA indexer"),
        (
            "lfm2",
            {"num_hidden_layers": 2, "layer_types": ["conv", "full_attention"]},
            "short causal convolutions",
        ),
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


def test_chunked_attention_without_layer_types_is_refused():
    from types import SimpleNamespace

    config = SimpleNamespace(model_type="llama4_text", attention_chunk_size=8, layer_types=None)
    with pytest.raises(ValueError, match="llama4_text cannot be packed exactly.*without config.layer_types"):
        check_served_config(config)


def test_an_lfm2_with_convolutions_leaks_stock_and_is_exact_prepared():
    """LFM2 interleaves short convolutions with attention: stock leaks, prepared runs them per sample."""
    config = tiny_config("lfm2", layer_types=["conv", "full_attention"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    assert check_packing(model, gradients=False, noise_floor=False).leaked  # the reason for the rule
    with prepare_model_for_packing(model) as handle:
        assert handle.mixers == 1
        assert not check_packing(model, noise_floor=False).leaked
    model.set_attn_implementation(packing_hf.register_attention())
    batch = build_packed_batch([torch.arange(3, 10), torch.arange(20, 25)])
    with pytest.raises(ValueError, match="lfm2 cannot be packed exactly.*alone"):  # not prepared
        model(**batch, use_cache=False)


def test_the_attention_name_splits_llama4_chunked_layers_into_chunks_per_sample(monkeypatch):
    """Chunks are counted from every sample's start: packed == alone, and one long sequence == sdpa."""
    from packing_hf.attention import interface

    torch.manual_seed(0)
    config = tiny_config("llama4_text")  # chunks of 4 tokens, one chunked and one full layer
    assert config.attention_chunk_size < 12 and "chunked_attention" in config.layer_types
    varlen = AutoModelForCausalLM.from_config(
        config, attn_implementation=packing_hf.register_attention()
    ).eval()
    sdpa = AutoModelForCausalLM.from_config(tiny_config("llama4_text"), attn_implementation="sdpa").eval()
    sdpa.load_state_dict(varlen.state_dict())
    assert not check_packing(varlen, noise_floor=False).leaked
    ids = torch.arange(3, 30).unsqueeze(0)
    with torch.no_grad():
        reference = sdpa(input_ids=ids, use_cache=False).logits
        assert (varlen(input_ids=ids, use_cache=False).logits - reference).abs().max() < 1e-5
        monkeypatch.setattr(interface, "attention_chunk", lambda module: None)  # negative control
        assert (varlen(input_ids=ids, use_cache=False).logits - reference).abs().max() > 1e-3


# --------------------------------------------------------------------------------------------------
# read the layers, not the type: an attention-only config of a "mixers" type has nothing to prepare


def _attention_only(model_type: str):
    config = tiny_config(model_type)
    config.layer_types = ["full_attention"] * config.num_hidden_layers
    if hasattr(config, "full_attn_idxs"):  # LFM2 keeps both spellings
        config.full_attn_idxs = list(range(config.num_hidden_layers))
    return config


@pytest.mark.parametrize("model_type", sorted(MIXERS_BY_LAYER_TYPE))
def test_an_attention_only_config_of_these_types_builds_no_mixer(model_type):
    # what MIXERS_BY_LAYER_TYPE claims: the mixers follow layer_types (zamba, for one, keeps them regardless)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_attention_only(model_type))
    assert find_mixers(model, support(model_type).mixers) == []
    assert mixer_free(model.config)
    stock = AutoModelForCausalLM.from_config(
        tiny_config(model_type)
    )  # control: the registered copy has mixers
    assert find_mixers(stock, support(model_type).mixers) and not mixer_free(stock.config)


def test_zamba_keeps_its_mixers_whatever_layer_types_says_so_it_is_not_listed():
    model = AutoModelForCausalLM.from_config(_attention_only("zamba"))
    assert find_mixers(model, support("zamba").mixers) and "zamba" not in MIXERS_BY_LAYER_TYPE
    with pytest.raises(ValueError, match="zamba cannot be packed exactly"):
        check_served_config(model.config)


def test_an_attention_only_lfm2_moe_is_served_by_the_attention_name_and_packs_exactly():
    config = _attention_only("lfm2_moe")
    check_served_config(config)  # was refused by type ("mixers"), although no layer mixes tokens
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation=packing_hf.register_attention()
    ).eval()
    report = check_packing(model)
    assert report.error is None and not report.leaked, report
    # negative control: one convolution layer and the same check fails (refused by the attention, with the cause)
    conv = tiny_config("lfm2_moe", layer_types=["conv", "full_attention"])
    torch.manual_seed(0)
    leaking = AutoModelForCausalLM.from_config(
        conv, attn_implementation=packing_hf.register_attention()
    ).eval()
    refused = check_packing(leaking, gradients=False)
    assert refused.leaked and "lfm2_moe cannot be packed exactly" in refused.error
    # and under sdpa, where nothing refuses it, the same comparison sees the leak
    torch.manual_seed(0)
    stock = AutoModelForCausalLM.from_config(conv, attn_implementation="sdpa").eval()
    assert check_packing(stock, gradients=False, noise_floor=False).leaked
