"""Hybrid, SSM, linear-attention, RG-LRU and short-convolution models: exact once prepared, leaking without.

Every registry entry with status ``"mixers"`` is built tiny (one layer of each kind, states and
convolutions small, fp32, CPU) and prepared; ``check_packing(noise_floor=True)`` compares a packed row of
three samples with every sample alone (logits and every parameter gradient). The negative control turns
the per-sample split off on the same prepared model (``handle.split_mixers = False``): the mixers then
run over the whole row, and the same check must report the leak.
"""

from __future__ import annotations

import pytest
import torch

import packing_hf
from packing_hf.architectures import build_tiny_model, iter_sweep, prepare_model_for_packing, support
from packing_hf.verify import DEFAULT_LENGTHS, build_packed_batch, check_packing

pytestmark = pytest.mark.usefixtures("one_torch_thread")

HYBRIDS = [e.model_type for e in iter_sweep() if e.status == "mixers"]


def test_every_family_of_the_issue_is_covered():
    families = (
        "bamba granitemoehybrid nemotron_h falcon_h1 zamba zamba2 jamba mamba mamba2 falcon_mamba "  # Mamba
        "qwen3_next qwen3_5_text qwen3_5_moe_text olmo_hybrid lara_mini "  # gated DeltaNet
        "lfm2 lfm2_moe lfm3 inkling_text inkling2_text "  # short convolutions
        "kimi_linear minimax bailing_hybrid recurrent_gemma"  # linear attention, RG-LRU
    )
    assert set(families.split()) <= set(HYBRIDS)


@pytest.mark.parametrize("model_type", HYBRIDS)
def test_prepared_hybrid_is_exact_and_the_split_is_what_makes_it_so(model_type):
    model = build_tiny_model(model_type, "eager")
    with prepare_model_for_packing(model) as handle:
        assert handle.mixers >= 1, f"no {support(model_type).mixers} module found"
        report = check_packing(model, noise_floor=True)
        assert report.error is None and len(report.grads_max_abs_diff) == len(DEFAULT_LENGTHS), report
        assert not report.leaked, report.summary()
        handle.split_mixers = False  # negative control: the mixers see the whole row
        control = check_packing(model, noise_floor=False, gradients=False)
        assert control.error is None, control.error
        assert control.leaked, f"the check cannot see a leak of the mixers: {control.summary()}"


@pytest.fixture(scope="module")
def qwen35():
    return build_tiny_model("qwen3_5_text", "sdpa")


def test_padded_batches_and_generate_are_unchanged_after_prepare(qwen35):
    ids = torch.tensor([[0, 0, 11, 12, 13, 14], [21, 22, 23, 24, 25, 26]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        stock_logits = qwen35(input_ids=ids, attention_mask=mask).logits
        stock_tokens = qwen35.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        with prepare_model_for_packing(qwen35):
            logits = qwen35(input_ids=ids, attention_mask=mask).logits
            tokens = qwen35.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(logits, stock_logits)
    assert torch.equal(tokens, stock_tokens)


def test_revert_restores_the_stock_model(qwen35):
    hooks = [(dict(m._forward_pre_hooks), dict(m._forward_hooks)) for m in qwen35.modules()]
    handle = prepare_model_for_packing(qwen35)
    assert not check_packing(qwen35, gradients=False, noise_floor=False).leaked
    handle.revert()
    assert [(dict(m._forward_pre_hooks), dict(m._forward_hooks)) for m in qwen35.modules()] == hooks
    # stock again: transformers' torch path refuses the packed row's cu_seq_lens (no fla)
    assert check_packing(qwen35, gradients=False, noise_floor=False).leaked


def test_several_packed_rows_without_cu_seq_lens_are_exact():
    """Batch of 2 packed rows, boundaries from position_ids only: every sample equals its lone run."""
    model = build_tiny_model("bamba", "eager")
    generator = torch.Generator().manual_seed(1)
    rows = [[5, 4], [3, 6]]
    samples = [[torch.randint(10, 500, (n,), generator=generator) for n in row] for row in rows]
    ids = torch.stack([torch.cat(row) for row in samples])
    positions = torch.stack([torch.cat([torch.arange(len(s)) for s in row]) for row in samples])
    with torch.no_grad(), prepare_model_for_packing(model):
        packed = model(input_ids=ids, position_ids=positions).logits
        for r, row in enumerate(samples):
            start = 0
            for sample in row:
                alone = model(input_ids=sample.unsqueeze(0), use_cache=False).logits[0]
                assert (packed[r, start : start + len(sample)] - alone).abs().max() < 1e-5
                start += len(sample)


def test_the_split_survives_activation_checkpointing():
    """Checkpointed layers re-run in backward: their mixers must run per sample again."""
    from transformers import AutoModelForCausalLM

    from packing_hf.architectures import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("lfm2"), attn_implementation="eager").train()
    batch = build_packed_batch([torch.arange(10, 17), torch.arange(20, 32), torch.arange(40, 45)])

    def grads(checkpointing: bool) -> torch.Tensor:
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_disable()
        model.zero_grad()
        with prepare_model_for_packing(model):
            model(**batch).logits.sum().backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    assert torch.allclose(grads(True), grads(False), atol=1e-5)


def test_the_attention_name_refuses_an_unprepared_hybrid_and_serves_a_prepared_one():
    model = build_tiny_model("qwen3_next", "packing_hf")
    batch = build_packed_batch([torch.arange(10, 17), torch.arange(20, 25)])
    with pytest.raises(
        ValueError, match="qwen3_next cannot be packed exactly.*alone.*prepare_model_for_packing"
    ):
        model(**batch)
    with prepare_model_for_packing(model) as handle:
        assert handle.mixers == 1
        assert not check_packing(model, noise_floor=False).leaked
    with pytest.raises(ValueError, match="cannot be packed exactly"):  # reverted: refused again
        model(**batch)


def test_pure_ssm_under_the_attention_name_is_exact_when_prepared():
    model = build_tiny_model("mamba", "packing_hf")
    assert check_packing(model, gradients=False, noise_floor=False).leaked  # never calls the attention
    with prepare_model_for_packing(model):
        assert not check_packing(model, noise_floor=False).leaked


def test_preparing_a_hybrid_without_its_mixers_refuses(monkeypatch):
    from packing_hf import registry

    entry = registry.REGISTRY["lfm3"]
    monkeypatch.setitem(
        registry.REGISTRY, "lfm3", type(entry)(**{**entry.__dict__, "mixers": ("NoSuchConv",)})
    )
    with pytest.raises(ValueError, match="no token-mixer module to run per sample was found.*NoSuchConv"):
        prepare_model_for_packing(build_tiny_model("lfm3", "eager"))


def test_verify_cli_checks_a_hybrid(capsys):
    from packing_hf.app.verify import verify_main

    assert verify_main(["--model-type", "lfm2", "--attn-implementation", "eager"]) == 0
    assert "lfm2" in capsys.readouterr().out


def test_split_mixers_needs_mixers():
    with prepare_model_for_packing(build_tiny_model("llama", "sdpa")) as handle:
        assert handle.mixers == 0 and not handle.split_mixers
        with pytest.raises(ValueError, match="no token mixer"):
            handle.split_mixers = False


def test_public_names():
    assert packing_hf.prepare_model_for_packing is prepare_model_for_packing
