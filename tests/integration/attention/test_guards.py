"""validate_packed_batch with a model (or its config): a packed batch for a model that leaks until it is prepared
is refused, naming the fix; the same model prepared (or one that needs nothing) passes, and is exact. Whether a
model is prepared is read from the model: a config, which twins may share, cannot tell."""

from __future__ import annotations

import pytest
import torch

import packing_hf
from packing_hf.architectures import build_tiny_model, prepare_model_for_packing
from packing_hf.verify import build_packed_batch, check_packing

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BATCH = build_packed_batch([torch.arange(3, 10), torch.arange(20, 25)])


# hybrids and recurrent models under sdpa, and the pure state-space models loaded with packing_hf's attention,
# whose layers never call it (so it cannot refuse them): validate_packed_batch is where packing_hf sees them
@pytest.mark.parametrize(
    ("model_type", "implementation"),
    [
        ("bamba", "sdpa"),
        ("qwen3_5_text", "sdpa"),
        ("lfm2", "sdpa"),
        ("mamba", "packing_hf"),
        ("mamba2", "packing_hf"),
        ("falcon_mamba", "packing_hf"),
    ],
)
def test_a_model_whose_mixers_leak_is_refused_until_prepared(model_type, implementation):
    model = build_tiny_model(model_type, implementation).eval()
    # negative control: the batch the old check passed leaks on the model as loaded
    assert check_packing(model, gradients=False, noise_floor=False).leaked
    with pytest.raises(
        ValueError, match=f"'{model_type}' model not prepared for packing leaks.*prepare_model_for"
    ):
        packing_hf.validate_packed_batch(BATCH, model=model)
    with prepare_model_for_packing(model):
        packing_hf.validate_packed_batch(BATCH, model=model)
        assert not check_packing(model, noise_floor=False).leaked
        # its config alone cannot say that this model (and not a twin sharing the config) is the prepared one
        with pytest.raises(ValueError, match="a config cannot say whether its model was.*model=model"):
            packing_hf.validate_packed_batch(BATCH, model.config)
    with pytest.raises(ValueError, match="not prepared for packing"):  # reverted: refused again
        packing_hf.validate_packed_batch(BATCH, model=model)


def test_a_mask_model_is_refused_under_sdpa_and_served_under_the_attention_name():
    stock = build_tiny_model("opt", "sdpa").eval()
    assert check_packing(stock, gradients=False, noise_floor=False).leaked  # the leak the refusal stands for
    with pytest.raises(ValueError, match="'opt' model not prepared for packing leaks.*without position_ids"):
        packing_hf.validate_packed_batch(BATCH, model=stock)
    with pytest.raises(ValueError, match="'opt' model leaks on this packed batch unless it is prepared"):
        packing_hf.validate_packed_batch(BATCH, stock.config)
    varlen = build_tiny_model(
        "opt", "packing_hf"
    ).eval()  # the varlen attention keeps the samples apart itself
    packing_hf.validate_packed_batch(BATCH, varlen.config)
    assert not check_packing(varlen, noise_floor=False).leaked


def test_a_prepared_mask_model_passes():
    model = build_tiny_model("opt", "sdpa").eval()
    with prepare_model_for_packing(model):
        packing_hf.validate_packed_batch(BATCH, model=model)


def test_a_model_needing_nothing_passes_with_its_config():
    model = build_tiny_model("llama", "sdpa").eval()
    assert packing_hf.validate_packed_batch(BATCH, model.config)["use_cache"] is False
    assert packing_hf.validate_packed_batch(BATCH, model=model)["use_cache"] is False
    assert not check_packing(model, noise_floor=False).leaked
