"""The attention-name path (a model loaded with ``attn_implementation=packing_hf.ATTENTION_NAME``, not prepared):
boundaries that contradict the row are refused, and a config changed after the first forward is checked again."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import packing_hf
from packing_hf.architectures import tiny_config
from packing_hf.verify import build_packed_batch

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _model(model_type: str = "llama"):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(
        tiny_config(model_type), attn_implementation=packing_hf.register_attention()
    ).eval()


def _row():
    """Two samples of 7 and 5 tokens: the collator's batch (restarting positions, cu_seq_lens [0, 7, 12])."""
    return build_packed_batch([torch.arange(3, 10), torch.arange(20, 25)])


def test_the_collators_boundaries_pass_and_keep_the_samples_apart():
    model, batch = _model(), _row()
    with torch.no_grad():
        packed = model(**batch, use_cache=False).logits[0]
        alone = model(input_ids=torch.arange(20, 25)[None], use_cache=False).logits[0]
    torch.testing.assert_close(packed[7:], alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("cu", "error"),
    [
        ([0, 12], r"boundary at token 7, where position_ids restart"),  # the two samples attend to each other
        (
            [0, 7, 10],
            r"ends at token 10 but the packed row has 12 tokens: the last 2 tokens",
        ),  # 2 in no sample
        ([0, 5, 12], r"boundary at token 5 where position_ids continue"),  # contradicts position_ids
        ([0, 7, 14], r"cu_seq_lens_q"),  # past the row
    ],
)
def test_boundaries_that_contradict_the_row_are_refused(cu, error):
    """Without the fix these run: ``[0, 12]`` changes the second sample's logits by ~0.3, silently."""
    model, batch = _model(), _row()
    cu = torch.tensor(cu, dtype=torch.int32)
    batch.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=14, max_length_k=14)
    with pytest.raises(ValueError, match=error), torch.no_grad():
        model(**batch, use_cache=False)


def test_the_negative_control_a_contradicting_row_leaks_when_unchecked(monkeypatch):
    """What the check prevents: with it switched off, ``[0, 12]`` over two samples mixes them."""
    from packing_hf.attention import interface

    monkeypatch.setattr(interface, "_check_row_boundaries", lambda *args: None)
    model, batch = _model(), _row()
    with torch.no_grad():
        right = model(**batch, use_cache=False).logits[0, 7:]
        cu = torch.tensor([0, 12], dtype=torch.int32)
        batch.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=12, max_length_k=12)
        wrong = model(**batch, use_cache=False).logits[0, 7:]
    assert (right - wrong).abs().max() > 1e-2


def test_a_config_changed_after_the_first_forward_is_checked_again():
    """A config field the check reads, set after a first forward, is checked again at the next forward (the
    check was keyed on the config object alone, so the change slipped through). Llama's modeling ignores
    ``layer_types``, so naming a convolution layer there runs in transformers and only the check sees it."""
    model, batch = _model(), _row()
    with torch.no_grad():
        model(**batch, use_cache=False)  # plain attention: served
        model.config.layer_types = ["conv", "full_attention"]
        with pytest.raises(ValueError, match="llama cannot be packed exactly.*conv"):
            model(**batch, use_cache=False)


def test_chunked_layers_no_longer_named_by_layer_types_are_refused():
    """Llama 4's chunked local attention whose layers ``layer_types`` stops naming after the first forward.
    transformers 5.24 reads ``layer_types`` in the model's forward (and fails without it); earlier versions
    ran the chunked layers anyway, which only packing_hf's check caught: called here on a real layer."""
    model, batch = _model("llama4_text"), _row()
    attention = model.model.layers[0].self_attn
    with torch.no_grad():
        model(**batch, use_cache=False)  # chunked layers named by layer_types: served
        model.config.layer_types = None
        q = k = v = torch.zeros(1, 2, 12, 8)
        with pytest.raises(ValueError, match="llama4_text cannot be packed exactly.*chunked local attention"):
            packing_hf.attention.interface.varlen_attention_forward(
                attention, q, k, v, None, position_ids=batch["position_ids"]
            )
