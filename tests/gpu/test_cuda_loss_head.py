"""The chunked LM head (``packing_hf.loss_head``) on CUDA, against the model's own full logits.

On CPU the same equalities are tested on five model families (``tests/integration/integrations/
test_chunked_loss.py``); here they run where cuBLAS does the chunk matmuls: fp32 loss, per-token log-probs and
every gradient (tied embeddings included) within 1e-5 relative, and under bf16 autocast or in a bf16 model the
chunked step no further from the fp32 step than the full-logits step's own bf16 error. Each check has a negative control (a chunk loop
dropping one token per chunk) that the same check catches. Skipped without a CUDA device (marked ``gpu``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from packing_hf import loss_head
from packing_hf.attention import register_attention
from packing_hf.collator import PaddingFreeCollator
from packing_hf.integrations.chunked_head import causal_lm_loss, model_token_logprobs

pytestmark = pytest.mark.gpu

VOCAB = 1009  # prime: no chunk divides it
CHUNK = 96
LENGTHS = (130, 1, 257, 64, 211)


def _model():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama", vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, use_cache=False, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=register_attention()).cuda().float()


def _row():
    generator = torch.Generator().manual_seed(1)
    samples = []
    for n in LENGTHS:
        ids = torch.randint(0, VOCAB, (n,), generator=generator).tolist()
        samples.append({"input_ids": ids, "labels": [-100] * (n // 3) + ids[n // 3 :]})
    batch = PaddingFreeCollator()(samples)
    inputs = {k: batch[k].cuda() for k in ("input_ids", "position_ids")}
    return inputs, batch["labels"].cuda()


def _dropping(n, size):
    for start in range(0, n, size):
        yield (start + 1 if start else 0), min(start + size, n)


def _step(model, inputs, labels, chunked: bool):
    model.zero_grad(set_to_none=True)
    if chunked:
        loss, _, _ = causal_lm_loss(model, inputs, labels, chunk_size=CHUNK)
    else:
        logits = model(**inputs).logits.float()
        loss = F.cross_entropy(logits[0, :-1], labels[0, 1:], reduction="sum")
    loss.backward()
    return loss.detach().double(), {
        n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None
    }


def _relative(got, want) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-30))


def _check_fp32() -> None:
    model = _model()
    inputs, labels = _row()
    want, want_grads = _step(model, inputs, labels, chunked=False)
    got, got_grads = _step(model, inputs, labels, chunked=True)
    assert _relative(got, want) <= 1e-5, ("loss", float(got), float(want))
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        assert _relative(got_grads[name], grad) <= 1e-5, name
    targets = torch.cat([inputs["input_ids"][:, 1:], torch.full((1, 1), -100, device="cuda")], dim=1)
    with torch.no_grad():
        log_p = model(**inputs).logits.float().log_softmax(-1)
        want_logps = torch.where(
            targets != -100, log_p.gather(-1, targets.clamp(min=0)[..., None])[..., 0], 0.0
        )
        (logps, entropy, _, _), _ = model_token_logprobs(
            model, inputs, targets, entropy=True, chunk_size=CHUNK
        )
    assert _relative(logps, want_logps) <= 1e-5, "log-probs"
    assert _relative(entropy, -(log_p.exp() * log_p).sum(-1)) <= 1e-5, "entropies"


def _check_bf16(weights: bool) -> None:
    """bf16 autocast over fp32 weights (``weights=False``) or a bf16 model (its head's weight gradient then comes
    from a bf16 matmul with fp32 accumulation): the chunked step no further from the fp32 step than the
    full-logits step."""
    model = _model()
    inputs, labels = _row()
    exact, exact_grads = _step(model, inputs, labels, chunked=False)
    results = {}
    if weights:
        model = model.to(torch.bfloat16)
    for chunked in (True, False):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=not weights):
            results[chunked] = _step(model, inputs, labels, chunked=chunked)
    (loss, grads), (full_loss, full_grads) = results[True], results[False]
    assert full_loss != exact  # bf16 did round
    bf16 = 2.0**-8
    assert _relative(loss, exact) <= 2 * _relative(full_loss, exact) + bf16, "loss"
    for name, grad in exact_grads.items():
        assert _relative(grads[name], grad) <= 2 * _relative(full_grads[name], grad) + bf16, name


@pytest.mark.parametrize("drop", [False, True])
def test_chunked_head_equals_full_logits_in_fp32_on_cuda(drop, monkeypatch):
    if drop:
        monkeypatch.setattr(loss_head, "_chunks", _dropping)
        with pytest.raises(AssertionError):
            _check_fp32()
    else:
        _check_fp32()


@pytest.mark.parametrize("weights", [False, True], ids=["autocast", "bf16_model"])
@pytest.mark.parametrize("drop", [False, True])
def test_chunked_head_in_bf16_stays_within_bf16_noise(drop, weights, monkeypatch):
    if drop:
        monkeypatch.setattr(loss_head, "_chunks", _dropping)
        with pytest.raises(AssertionError):
            _check_bf16(weights)
    else:
        _check_bf16(weights)
