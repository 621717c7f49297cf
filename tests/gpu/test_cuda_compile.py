"""torch.compile with packing_hf's attention on CUDA: no graph break, no device sync in the layers, exact.

Skipped without a CUDA device (marked ``gpu``). On CPU the same properties are tested in
``tests/unit/attention/test_compile.py``; these tests run them where the syncs are real and the flash
kernels (flash-attn 2/3/4, torch ``varlen_attn``) or the padded SDPA layout run.
"""

from __future__ import annotations

import pytest
import torch

from packing_hf.attention import register_attention
from packing_hf.collator import PaddingFreeCollator

pytestmark = pytest.mark.gpu


def _model(dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama", vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=register_attention()).cuda().to(dtype)


def _batch(lengths):
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(1, 1000, (n,), generator=g).tolist()} for n in lengths]
    batch = PaddingFreeCollator()(rows)
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}, rows


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_cuda_model_has_no_graph_break(dtype):
    model = _model(dtype)
    batch, _ = _batch([37, 80, 5])
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model)(**batch)
    assert explanation.graph_break_count == 0, [b.reason for b in explanation.break_reasons]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_forward_backward_never_syncs_in_the_layers(dtype):
    model = _model(dtype)
    batch, _ = _batch([37, 80, 5])
    model(**batch).loss.backward()  # warm up (lazy inits may sync once)
    synced_in_layers = []
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda *_: torch.cuda.set_sync_debug_mode("error"))
        layer.register_forward_hook(lambda *_: torch.cuda.set_sync_debug_mode("default"))
    try:
        model(**batch).loss.backward()
    except RuntimeError as error:  # set_sync_debug_mode("error") raises on a synchronizing call
        synced_in_layers.append(str(error))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert synced_in_layers == []


def test_compiled_cuda_packed_equals_each_sample_alone():
    model = _model(torch.float32)
    batch, rows = _batch([37, 80, 5, 64])
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        packed = compiled(**batch).logits[0]
        cu = batch["cu_seq_lens_q"].tolist()
        for i, row in enumerate(rows):
            alone = model(input_ids=torch.tensor([row["input_ids"]], device="cuda")).logits[0]
            torch.testing.assert_close(packed[cu[i] : cu[i + 1]], alone, atol=1e-3, rtol=1e-3)
