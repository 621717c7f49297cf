"""LoRA adapters (PEFT) on packed batches: exact for an attention model and a hybrid, prompt learning refused.

Exactness is the adapter's own gradients: one packed row (``PaddingFreeCollator``) through the ``PeftModel``
against every sample alone, logits and the gradient of every LoRA weight of the summed token loss. The
negative controls go through the same measure: the hybrid without packing_hf's preparation (its state-space
layers carry state across samples) and the attention model fed the concatenated row without packing_hf's
boundaries (positions and ``cu_seq_lens``), both far off.
"""

from __future__ import annotations

import pytest
import torch

peft = pytest.importorskip("peft")

from packing_hf import PaddingFreeCollator, TrainingArguments, prepare_model_for_packing  # noqa: E402
from packing_hf.architectures.tiny import build_tiny_model  # noqa: E402
from packing_hf.integrations import Trainer  # noqa: E402

LENGTHS = (6, 11, 4)


def lora(model):
    # init_lora_weights=False: B is not zero, so every LoRA weight (A and B) has a gradient to compare
    config = peft.LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
    return peft.get_peft_model(model, config)


def samples_for(model, seed=0):
    generator = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    return [torch.randint(3, vocab, (n,), generator=generator) for n in LENGTHS]


def lora_gradients(model, loss):
    params = [p for name, p in model.named_parameters() if p.requires_grad]
    return torch.autograd.grad(loss, params)


def packed_vs_alone(model, samples, *, boundaries=True):
    """``(packed, alone)``: the logits and the LoRA gradients of the summed token loss, flattened into one
    vector, from one packed row and from every sample alone (gradients summed over the samples)."""
    model.eval()
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    batch = PaddingFreeCollator()([{"input_ids": s.tolist()} for s in samples])
    if not boundaries:  # a plain concatenation: what packing without packing_hf's collator feeds the model
        batch = {"input_ids": batch["input_ids"], "labels": batch["labels"]}
    out = model(**batch)
    targets = int((batch["labels"][:, 1:] != -100).sum())
    packed = torch.cat(
        [out.logits[0].flatten(), *(g.flatten() for g in lora_gradients(model, out.loss * targets))]
    )
    logits, grads = [], None
    for sample in samples:
        out = model(input_ids=sample[None], labels=sample[None])
        logits.append(out.logits[0].flatten())
        new = lora_gradients(model, out.loss * (sample.numel() - 1))
        grads = new if grads is None else [a + g for a, g in zip(grads, new, strict=True)]
    alone = torch.cat([*logits, *(g.flatten() for g in grads)])
    return packed.detach(), alone.detach()


@pytest.mark.parametrize("model_type", ["llama", "bamba"])
def test_lora_gradients_are_exact_on_a_packed_row(model_type, assert_close):
    model = lora(build_tiny_model(model_type, "sdpa"))
    samples = samples_for(model)
    with prepare_model_for_packing(model):  # through the PeftModel wrapper
        packed, alone = packed_vs_alone(model, samples)
    assert_close(packed, alone, f"{model_type} + LoRA: logits and adapter gradients", rel=1e-5)

    # negative control, caught by the same comparison
    if model_type == "bamba":  # stock hybrid: the Mamba layers carry their state from one sample to the next
        packed, alone = packed_vs_alone(model, samples)
    else:  # attention model fed the row without packing_hf's boundaries: samples attend to each other
        packed, alone = packed_vs_alone(model, samples, boundaries=False)
    with pytest.raises(AssertionError, match="max error"):
        assert_close(packed, alone, f"{model_type} + LoRA, unprepared", rel=1e-2)


def test_trainer_takes_peft_config_and_trains_only_the_adapter(tmp_path):
    model = build_tiny_model("llama", "sdpa")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    data = [{"input_ids": s.tolist()} for s in samples_for(model) * 2]
    args = TrainingArguments(
        str(tmp_path),
        max_tokens_per_batch=32,
        max_steps=2,
        learning_rate=1e-2,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    trainer = Trainer(model=model, args=args, train_dataset=data, peft_config=config)
    assert isinstance(trainer.model, peft.PeftModel)
    trainer.train()  # the pre-flight check and the preparation run through the wrapper
    base = trainer.model.get_base_model()
    changed = {
        name
        for name, p in trainer.model.named_parameters()
        if (name.replace("base_model.model.", "") in before)
        and not torch.equal(p.detach(), before[name.replace("base_model.model.", "")])
    }
    assert not changed  # the base weights are frozen
    lora_b = [p for name, p in trainer.model.named_parameters() if "lora_B" in name]
    assert lora_b and any(p.abs().sum() > 0 for p in lora_b)  # B starts at zero: it trained
    assert getattr(base, "_packing_hf_preparation", None) is None or not base._packing_hf_preparation.active


@pytest.mark.parametrize(
    "config",
    [
        peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
        peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
        peft.PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=4, encoder_hidden_size=8),
    ],
    ids=["prompt_tuning", "prefix_tuning", "p_tuning"],
)
def test_prompt_learning_is_refused_by_name_with_packed_batches(config, tmp_path):
    args = TrainingArguments(str(tmp_path), max_tokens_per_batch=32, report_to="none", use_cpu=True)
    with pytest.raises(
        ValueError, match=rf"prompt-learning PEFT \({config.peft_type.value}\) prepends virtual"
    ):
        Trainer(
            model=build_tiny_model("llama"),
            args=args,
            train_dataset=[{"input_ids": [1, 2]}],
            peft_config=config,
        )
