"""check_packing and its helpers: reports, tiny configs, no side effects on the model, the CLI."""

from __future__ import annotations

import pytest
import torch

from packing_hf.collator import PaddingFreeCollator
from packing_hf.verify import (
    PackingReport,
    build_packed_batch,
    build_tiny_model,
    check_architecture,
    check_packing,
    clear_architecture_cache,
    format_table,
    sweep_architecture,
    tiny_config,
    verify_main,
)

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


def test_check_architecture_is_cached_and_refuses_with_the_reason():
    clear_architecture_cache()
    first = check_architecture("qwen2", "eager")
    assert check_architecture("qwen2", "eager") is first and not first.leaked
    refused = check_architecture("jamba", "eager")
    assert refused.leaked and "jamba: hybrid Mamba layers" in refused.error
    assert check_architecture("opt", "eager", prepare=False).leaked
    assert not check_architecture("opt", "eager").leaked


def test_the_table_is_built_from_sweep_results():
    table = format_table(sweep_architecture("opt", ["eager"], gradients=False))
    header, rule, row = table.splitlines()
    assert header.startswith("| architecture | status | eager |")
    assert row.startswith("| opt | mask | leaks (") and "→ **exact**" in row


def test_cli_exit_codes(capsys):
    assert (
        verify_main(["--model-type", "opt", "--attn-implementation", "eager", "--stock", "--no-grads"]) == 1
    )
    assert "LEAK" in capsys.readouterr().out
    assert verify_main(["--model-type", "opt", "--attn-implementation", "eager", "--no-grads"]) == 0
    assert "exact" in capsys.readouterr().out
    assert verify_main(["--model-type", "zamba", "--no-grads"]) == 1
    assert "refused: zamba" in capsys.readouterr().out
    assert verify_main(["--model-type", "bloom", "--attn-implementation", "sdpa"]) == 2
    assert verify_main(["--model-type", "llama", "--lengths", "3,x"]) == 2


def test_cli_on_a_saved_model(tmp_path, capsys):
    build_tiny_model("llama", "eager").save_pretrained(tmp_path)
    assert verify_main(["--model", str(tmp_path), "--no-grads", "--json"]) == 0
    assert '"leaked": false' in capsys.readouterr().out
