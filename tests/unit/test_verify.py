"""check_packing: reports, the packed batch it builds, no side effects on the model."""

from __future__ import annotations

import pytest
import torch

from packing_hf.architectures import build_tiny_model
from packing_hf.collator import PaddingFreeCollator
from packing_hf.verify import PackingReport, build_packed_batch, check_packing

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_report_verdicts():
    exact = PackingReport("llama", "sdpa", None, (3, 2), 1e-5, (1e-7, 2e-7), (1e-6, 3e-6), ("a", "b"))
    assert not exact.leaked and exact.leaked_samples == ()
    grads_only = PackingReport("x", "eager", None, (3, 2), 1e-5, (0.0, 0.0), (0.0, 1e-3), ("a", "b"))
    assert grads_only.leaked_samples == (1,)
    nan = PackingReport("x", "eager", None, (3,), 1e-5, (float("nan"),), (), ())
    assert nan.leaked  # NaN never passes
    failed = PackingReport("x", "eager", None, (3,), 1e-5, (), (), (), error="TypeError: boom")
    assert failed.leaked and "failed" in failed.summary()
    with pytest.raises(ValueError, match="packing is not exact.*prepare_model_for_packing"):
        grads_only.raise_if_leaked()
    exact.raise_if_leaked()
    assert exact.to_dict()["leaked"] is False


def test_the_packed_batch_is_what_the_collator_emits():
    samples = [torch.tensor([5, 6, 7]), torch.tensor([8, 9]), torch.tensor([4])]
    batch = build_packed_batch(samples)
    collated = PaddingFreeCollator()([{"input_ids": s.tolist()} for s in samples])
    assert set(batch) == set(collated) - {"labels"}
    assert "attention_mask" not in batch
    for key, value in batch.items():
        expected = collated[key]
        assert torch.equal(value, expected) if isinstance(value, torch.Tensor) else value == expected


def test_check_packing_reports_a_leak_for_every_leaking_sample():
    model = build_tiny_model("opt", "eager")
    report = check_packing(model, lengths=(4, 6, 3))
    assert report.leaked and report.leaked_samples == (1, 2)  # the first sample has nobody before it
    assert report.logits_max_abs_diff[0] <= report.tolerance
    assert len(report.grads_max_abs_diff) == 3 and report.worst_parameter[1]


def test_check_packing_does_not_touch_the_model():
    model = build_tiny_model("llama", "sdpa")
    model.train()
    model.model.layers[0].eval()  # a mixed train/eval state must come back exactly
    first = next(model.parameters())
    first.grad = torch.full_like(first, 3.0)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    report = check_packing(model, lengths=(3, 5))
    assert not report.leaked
    assert model.training and not model.model.layers[0].training and model.model.layers[1].training
    assert torch.equal(first.grad, torch.full_like(first, 3.0))
    assert all(p.grad is None for p in list(model.parameters())[1:])
    assert all(torch.equal(before[name], p) for name, p in model.named_parameters())


def test_check_packing_with_explicit_samples_and_no_gradients():
    model = build_tiny_model("gpt2", "eager")
    report = check_packing(model, input_ids=[torch.tensor([11, 12, 13]), torch.tensor([14])], gradients=False)
    assert report.lengths == (3, 1) and report.grads_max_abs_diff == () and not report.leaked
    with pytest.raises(ValueError, match="non-empty 1-D"):
        check_packing(model, input_ids=[torch.tensor([[1, 2]])])


def test_check_packing_reports_the_varlen_backend():
    model = build_tiny_model("qwen2", "packing_hf")
    report = check_packing(model, gradients=False)
    assert not report.leaked and report.backend is not None
