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


class _TokenwiseLM(torch.nn.Module):
    """A causal LM whose logits depend on each token alone (packing is exact by construction), with a forward
    that takes ``input_ids`` and ``position_ids`` only and can fail on purpose: on the packed row, or in fp64 on
    a sample of length ``fail_fp64``."""

    def __init__(self, fail_packed: Exception | None = None, fail_fp64: int | None = None) -> None:
        super().__init__()
        from transformers import PretrainedConfig

        torch.manual_seed(0)
        self.config = PretrainedConfig(vocab_size=32, eos_token_id=31)
        self.embed = torch.nn.Embedding(32, 8)
        self.head = torch.nn.Linear(8, 32)
        self.fail_packed, self.fail_fp64 = fail_packed, fail_fp64

    def forward(self, input_ids, position_ids=None):
        if self.fail_packed is not None and position_ids is not None:
            raise self.fail_packed
        if input_ids.shape[-1] == self.fail_fp64 and self.head.weight.dtype == torch.float64:
            raise RuntimeError("no float64 kernel")
        return (self.head(self.embed(input_ids)),)


def test_check_packing_leaves_out_what_the_forward_does_not_take_and_says_so():
    report = check_packing(_TokenwiseLM(), lengths=(3, 4))
    left_out = {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "use_cache"}
    assert set(report.notes) == {f"forward() does not accept {key!r}: left out" for key in left_out}
    assert not report.leaked and len(report.logits_noise) == 2 and len(report.grads_noise) == 2


def test_check_packing_falls_back_to_the_fixed_tolerance_without_fp64():
    measured = check_packing(_TokenwiseLM(), lengths=(3, 4, 2))
    assert len(measured.logits_noise) == 3 and not any("fp64" in note for note in measured.notes)
    report = check_packing(_TokenwiseLM(fail_fp64=4), lengths=(3, 4, 2))  # fp64 fails on the second sample
    fp64_notes = [note for note in report.notes if "fp64" in note]
    assert fp64_notes == ["no fp64 reference (RuntimeError: no float64 kernel); fixed tolerance only"]
    # the first sample's noise is dropped too (no half-measured floor), yet every sample is still compared
    assert report.logits_noise == () and report.grads_noise == ()
    assert len(report.logits_max_abs_diff) == 3 and len(report.grads_max_abs_diff) == 3 and not report.leaked


def test_a_failing_or_refused_packed_forward_is_a_leak_with_its_reason():
    from packing_hf.errors import PackingRefused

    failed = check_packing(_TokenwiseLM(fail_packed=RuntimeError("boom")), lengths=(3, 4))
    assert failed.leaked and failed.error == "RuntimeError: boom" and failed.refusal is None
    assert failed.logits_max_abs_diff == () and failed.grads_max_abs_diff == ()
    refused = check_packing(
        _TokenwiseLM(fail_packed=PackingRefused("a_reason", "no packing here")), lengths=(3,)
    )
    assert refused.leaked and refused.refusal == "a_reason" and refused.error.startswith("PackingRefused:")
    assert refused.to_dict()["refusal"] == "a_reason"
