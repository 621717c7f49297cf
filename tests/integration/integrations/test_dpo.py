"""packing_hf.DPOTrainer against stock trl.DPOTrainer on padded batches: same log-probs, losses, gradients.

Pairs are built from real GSM8K rows (reference answer vs. a truncated one), tokenized by TRL with the
SmolLM2 tokenizer; the models are one tiny llama (fp32) loaded twice with the same weights: sdpa for the
stock padded run, packing_hf's varlen attention for the packed run. The packed trainers share every
pair's prompt (``shared_prompt``, on by default where exact) unless a test says otherwise.
"""

from __future__ import annotations

import copy
import logging
import math
import types
from dataclasses import dataclass, field

import datasets
import pytest
import torch
from accelerate import ParallelismConfig
from transformers import TrainerCallback

trl = pytest.importorskip("trl")

import packing_hf  # noqa: E402
from packing_hf.integrations.adapters import PackedPreferenceForward  # noqa: E402
from packing_hf.integrations.dpo import DPOConfig, DPOTrainer  # noqa: E402
from packing_hf.integrations.refusals import PackingRefused  # noqa: E402
from packing_hf.preference import (  # noqa: E402
    PaddingFreePreferenceCollator,
    preference_pair_lengths,
)

REL = 1e-5

pytestmark = pytest.mark.usefixtures("one_torch_thread")
MAX_LENGTH = 128


@pytest.fixture(scope="module")
def pairs(gsm8k_rows):
    """``pairs(n)``: a fresh Dataset of ``n`` GSM8K preference pairs, reference answer vs. the same answer with
    its lines reversed (a new fingerprint every call, so TRL's precompute cache never serves one trainer the
    other's reference log-probs). The two completions differ from their first token: a rejected answer that
    shares a long prefix with the chosen one makes chosen - rejected a cancellation of nearly equal sums,
    whose rounding no exactness test can bound."""

    # short rows keep the 49k-vocabulary LM head cheap; their lengths still vary (about 90 to 150 tokens)
    short = [r for r in gsm8k_rows(400) if len(r["question"]) < 160 and len(r["answer"]) < 250]

    def build(n: int) -> datasets.Dataset:
        rows = short[:n]
        return datasets.Dataset.from_dict(
            {
                "prompt": [f"Question: {r['question']}\nAnswer:" for r in rows],
                "chosen": [" " + r["answer"] for r in rows],
                # the same lines in reverse order: the final "#### n" first, the reasoning after it
                "rejected": [" " + "\n".join(reversed(r["answer"].split("\n"))) for r in rows],
            }
        )

    return build


@pytest.fixture(scope="module")
def twins(tiny_llama):
    """``twins(seed=0)``: (stock sdpa model, packed varlen model) holding the same fresh weights."""

    def build(seed: int = 0):
        reference = tiny_llama(seed=seed)
        packed = tiny_llama(attn_implementation=packing_hf.register_attention())
        packed.load_state_dict(reference.state_dict())
        return reference, packed

    return build


def _common(tmp_path, name: str, **overrides) -> dict:
    defaults = dict(
        output_dir=str(tmp_path / name),
        per_device_train_batch_size=4,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        max_steps=1,
        seed=0,
        bf16=False,  # TRL defaults to bf16 autocast, even on CPU; exactness is measured in fp32
        # TRL's own per-sequence truncation, on both sides; it also keeps the 49k-vocabulary LM head cheap
        max_length=MAX_LENGTH,
    )
    return {**defaults, **overrides}


def _build(tmp_path, tokenizer, twins, data, ref: bool = True, packed_only: dict | None = None, **config):
    """(stock trainer, packed trainer) on copies of the same data and weights; ``packed_only`` holds packing_hf
    options (``shared_prompt``) given to the packed trainer alone."""
    packed_options = {
        k: v
        for k, v in (packed_only or {}).items()
        if k in ("shared_prompt", "share_prefixes", "min_shared_tokens", "precompute_ref_log_probs")
    }
    policy_stock, policy_packed = twins()
    ref_stock, ref_packed = twins(seed=1) if ref else (None, None)  # a reference unlike the policy
    stock = trl.DPOTrainer(
        model=policy_stock,
        ref_model=ref_stock,
        args=trl.DPOConfig(**_common(tmp_path, "stock", **config)),
        train_dataset=data(),
        processing_class=tokenizer,
    )
    packed = DPOTrainer(
        model=policy_packed,
        ref_model=ref_packed,
        args=DPOConfig(**_common(tmp_path, "packed", **config), **packed_options),
        train_dataset=data(),
        processing_class=tokenizer,
    )
    return stock, packed


def _batches(stock, packed, indices):
    rows = [stock.train_dataset[i] for i in indices]
    for i, row in zip(indices, rows, strict=True):  # same tokenization
        assert all(
            packed.train_dataset[i][key] == row[key] for key in ("prompt_ids", "chosen_ids", "rejected_ids")
        )
    return stock._prepare_inputs(stock.data_collator(rows)), packed._prepare_inputs(
        packed.data_collator(rows)
    )


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    scale = float(want.abs().max()) or 1.0
    assert float((got - want).abs().max()) <= REL * scale, f"{what}: {got} vs {want}"


def _loss_and_grads(trainer, batch):
    trainer.model.train()
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])
    return loss.detach(), grads


# packing_hf's DPO forward is loss-agnostic: it returns TRL's per-token outputs (log-probs, log_sum_sq_probs)
# and TRL computes every loss from them. So the cases differ in which outputs TRL reads and in the layout:
# the shared prompt with the per-token reads (ipo+wpo, hinge+sft+ld_alpha; plain sigmoid's summed log-probs
# are read by both) and the unshared layout (sigmoid-unshared).
@pytest.mark.parametrize(
    "config",
    [
        # IPO (divides by completion lengths) with WPO weights (reads log_sum_sq_probs per token)
        {"loss_type": ["ipo"], "use_weighting": True},
        # several losses at once (sft averages per-token log-probs) and LD-DPO length weighting
        {"loss_type": ["hinge", "sft"], "loss_weights": [1.0, 0.5], "ld_alpha": 0.5},
        # the same without the shared prompt: every sequence its own segment
        {"loss_type": ["sigmoid"], "shared_prompt": False},
    ],
    ids=["ipo+wpo", "hinge+sft+ld_alpha", "sigmoid-unshared"],
)
def test_logps_loss_gradients_and_metrics_match_stock(tmp_path, tokenizer, twins, pairs, config):
    shared = config.get("shared_prompt", True)
    stock_config = {k: v for k, v in config.items() if k != "shared_prompt"}
    stock, packed = _build(tmp_path, tokenizer, twins, lambda: pairs(4), **stock_config, packed_only=config)
    padded_batch, packed_batch = _batches(stock, packed, range(4))
    assert packed_batch["packed_input_ids"].numel() < padded_batch["input_ids"].numel()  # padding avoided
    assert packed.data_collator.shared_prompt is shared
    assert ("prefix_seq_idx" in packed_batch) is shared
    if shared:  # every pair holds its prompt once: [prompt[:-1] | chosen branch | rejected branch]
        assert packed_batch["prefix_seq_idx"].tolist() == [-1, 0, 0, -1, 3, 3, -1, 6, 6, -1, 9, 9]
        # negative control: the same row without the layout (branches would miss their prompt) is refused by
        # the attention, whose boundaries then contradict the branches' continuing positions
        broken = {k: v for k, v in packed_batch.items() if k != "prefix_seq_idx"}
        with pytest.raises(ValueError, match="contradict the row's position_ids"):
            packed.compute_ref_log_probs(packed.model, broken)

    # per-sequence chosen/rejected log-probs of the policy and of the reference model
    for name in ("model", "ref_model"):
        got = packed.compute_ref_log_probs(getattr(packed, name), packed_batch)
        want = stock.compute_ref_log_probs(getattr(stock, name), padded_batch)
        for g, w, side in zip(got, want, ("chosen", "rejected"), strict=True):
            assert g.shape == w.shape == (4,)
            _close(g, w, f"{name} {side} logps")

    loss_p, grads_p = _loss_and_grads(packed, packed_batch)
    loss_s, grads_s = _loss_and_grads(stock, padded_batch)
    _close(loss_p, loss_s, "loss")
    _close(grads_p, grads_s, "gradients")
    # TRL's metrics come from the scattered per-token outputs too (entropy, mean logits, top-1 accuracy).
    # Rewards are beta x (policy - reference) log-probs: a difference of sums of ~100 terms, so they get an
    # absolute tolerance on the scale of those sums rather than a relative one.
    for key, values in stock._metrics["train"].items():
        got, want = torch.tensor(packed._metrics["train"][key]), torch.tensor(values)
        assert torch.allclose(got, want, rtol=REL, atol=1e-4), f"metric {key}: {got} vs {want}"


def test_share_prefixes_on_multi_turn_pairs_matches_stock(
    tmp_path, tokenizer, twins, multi_turn_pairs, branch_points_one_row_early
):
    """``share_prefixes``: the 7 pairs of one micro-batch are one prefix tree (the system prompt and the earlier
    turns held once), and the policy's and the reference model's per-sequence log-probs (live, and precomputed
    on tree batches), the loss (several loss types reading per-token values) and the gradients equal stock
    TRL's unpacked run. Negative control: the
    branch points read from the row before each node (a sibling's last token, as a plain packed shift would) are
    caught by the same comparison."""
    # summed (sigmoid), length-normalised (ipo) and per-token (sft: the NLL term) log-probs, LD-DPO's split sums
    # (ld_alpha); TRL's metrics read the other per-token outputs (entropy, mean logits, top-1), mapped alike
    config = {"loss_type": ["sigmoid", "ipo", "sft"], "loss_weights": [1.0, 0.5, 0.5], "ld_alpha": 0.5}
    config["per_device_train_batch_size"] = 7
    # the packed trainer precomputes its reference log-probs (on tree batches); stock runs its reference live
    packed_only = {"share_prefixes": True, "precompute_ref_log_probs": True}
    stock, packed = _build(tmp_path, tokenizer, twins, multi_turn_pairs, **config, packed_only=packed_only)
    assert packed.data_collator.share_prefixes and not packed.data_collator.shared_prompt
    padded_batch, packed_batch = _batches(stock, packed, range(7))
    packed_batch = packed._prepare_inputs(packed.data_collator([packed.train_dataset[i] for i in range(7)]))
    row = packed_batch["packed_input_ids"].numel()
    one_level = PaddingFreePreferenceCollator(shared_prompt=True)([packed.train_dataset[i] for i in range(7)])
    assert row < one_level["packed_input_ids"].numel()  # earlier turns and the system prompt are shared too

    def logps(trainer, batch):  # (28,): chosen and rejected log-probs of the policy, then the reference model's
        return torch.cat([torch.cat(trainer.compute_ref_log_probs(m, batch)) for m in (trainer.model, trainer.ref_model)])

    want = logps(stock, padded_batch)
    _close(logps(packed, packed_batch), want, "chosen / rejected log-probs of the policy and the reference model")
    precomputed = torch.cat([packed_batch["ref_chosen_logps"], packed_batch["ref_rejected_logps"]])
    _close(precomputed, want[14:], "precomputed reference log-probs")
    loss_p, grads_p = _loss_and_grads(packed, packed_batch)
    loss_s, grads_s = _loss_and_grads(stock, padded_batch)
    _close(loss_p, loss_s, "loss")
    _close(grads_p, grads_s, "gradients")
    for key, values in stock._metrics["train"].items():
        g, w = torch.tensor(packed._metrics["train"][key]), torch.tensor(values)
        assert torch.allclose(g, w, rtol=REL, atol=1e-4), f"metric {key}: {g} vs {w}"
    # tokens of the 14 sequences run alone over the tree row's
    ratio = packed._metrics["train"]["tree_token_ratio"]
    assert ratio == [padded_batch["attention_mask"].sum().item() / row] and ratio[0] > 1

    # negative control: every token predicted at the row before it, so a node's first token is read at its
    # previous sibling's (or cousin's) last token instead of its branch point
    branch_points_one_row_early()
    with pytest.raises(AssertionError):
        _close(logps(packed, packed_batch), want, "log-probs with branch points read from the wrong row")


def test_precomputed_reference_logps_match_stock(tmp_path, tokenizer, twins, pairs):
    stock, packed = _build(
        tmp_path,
        tokenizer,
        twins,
        lambda: pairs(4),
        ref=False,
        precompute_ref_log_probs=True,
        loss_type=["ipo"],
    )
    assert packed.data_collator.stats["pairs"] == 4  # the packed collator computed them (not a shared cache)
    for column in ("ref_chosen_logps", "ref_rejected_logps"):
        _close(torch.tensor(packed.train_dataset[column]), torch.tensor(stock.train_dataset[column]), column)
    padded_batch, packed_batch = _batches(stock, packed, [3, 0, 2])
    loss_p, grads_p = _loss_and_grads(packed, packed_batch)
    loss_s, grads_s = _loss_and_grads(stock, padded_batch)
    _close(loss_p, loss_s, "loss")
    _close(grads_p, grads_s, "gradients")


class _GradientProbe(TrainerCallback):
    """Keeps the accumulated gradient seen right before every optimizer step."""

    def __init__(self):
        self.grads = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append(
            torch.cat([p.grad.flatten().clone() for p in model.parameters() if p.grad is not None])
        )


def test_gradient_accumulation_training_matches_stock(tmp_path, tokenizer, twins, pairs, caplog):
    caplog.set_level(logging.INFO, logger="packing_hf.integrations.preflight")
    config = dict(
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=2,
        optim="sgd",
        learning_rate=0.05,
        logging_steps=1,
    )
    stock, packed = _build(tmp_path, tokenizer, twins, lambda: pairs(8), **config)
    probes = []
    for trainer in (stock, packed):
        probes.append(_GradientProbe())
        trainer.add_callback(probes[-1])
        trainer.train()
    (grads_s, grads_p) = (probe.grads for probe in probes)
    assert len(grads_s) == len(grads_p) == 2
    for step, (g_p, g_s) in enumerate(zip(grads_p, grads_s, strict=True)):
        _close(g_p, g_s, f"accumulated gradient of step {step}")
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (stock, packed)]
    assert len(losses[0]) == 2
    _close(torch.tensor(losses[1]), torch.tensor(losses[0]), "logged losses")
    params = [torch.cat([p.detach().flatten() for p in t.model.parameters()]) for t in (stock, packed)]
    _close(params[1], params[0], "parameters after two SGD steps")
    # packing metrics are logged next to TRL's: the padded layout would have computed more tokens
    logged = next(h for h in packed.state.log_history if "loss" in h)
    assert logged["padding_avoided_per_step"] > 0 and "rewards/margins" in logged
    # the pre-flight says which model each of its lines is about: one line each
    said = sorted(
        r.getMessage().split(":")[0] for r in caplog.records if "packing pre-flight" in r.getMessage()
    )
    assert said == ["packing pre-flight (model)", "packing pre-flight (reference model)"], said


@dataclass
class RecordingPreferenceCollator(PaddingFreePreferenceCollator):
    """Records the pairs (as ``prompt_ids + chosen_ids`` tuples) of every batch it collates."""

    batches: list = field(default_factory=list, init=False, repr=False)

    def __call__(self, features, return_tensors=None):
        self.batches.append([tuple(f["prompt_ids"] + f["chosen_ids"]) for f in features])
        return super().__call__(features, return_tensors)


def test_multipack_keeps_pairs_whole_within_the_budget(tmp_path, tokenizer, twins, pairs):
    collator = RecordingPreferenceCollator(max_length=MAX_LENGTH, overflow="truncate", shared_prompt=True)
    _, model = twins()
    budget = 400
    trainer = DPOTrainer(
        model=model,
        args=DPOConfig(
            **_common(tmp_path, "multipack", max_steps=-1, num_train_epochs=1, logging_steps=1),
            max_tokens_per_batch=budget,
            precompute_ref_log_probs=True,
        ),
        data_collator=collator,
        train_dataset=pairs(12),
        processing_class=tokenizer,
    )
    collator.batches.clear()  # drop the precompute batches
    trainer.train()
    data = trainer.train_dataset
    # what a pair occupies in a packed row: both sequences, each truncated to max_length, the prompt once
    tokens = {
        tuple(row["prompt_ids"] + row["chosen_ids"]): int(
            preference_pair_lengths(
                [len(row["prompt_ids"])],
                [len(row["chosen_ids"])],
                [len(row["rejected_ids"])],
                max_length=MAX_LENGTH,
                shared_prompt=True,
            )[0]
        )
        for row in data
    }
    assert collator.stats["shared_prompt_tokens"] > 0
    seen = [key for batch in collator.batches for key in batch]
    assert sorted(seen) == sorted(tokens)  # every pair exactly once, both of its sequences in one batch
    for batch in collator.batches:
        assert sum(tokens[key] for key in batch) <= budget
    assert len(collator.batches) == len(trainer._multipack_sampler) < len(data)
    assert all(math.isfinite(h["loss"]) for h in trainer.state.log_history if "loss" in h)


def test_pair_over_the_budget_is_refused(tmp_path, tokenizer, twins, pairs):
    _, model = twins()
    trainer = DPOTrainer(
        model=model,
        args=DPOConfig(**_common(tmp_path, "tight"), max_tokens_per_batch=64, precompute_ref_log_probs=True),
        train_dataset=pairs(2),
        processing_class=tokenizer,
    )
    with pytest.raises(ValueError, match="max_tokens_per_batch"):
        trainer.get_train_dataloader()


@pytest.mark.parametrize(
    "config, extra, match",
    [
        ({}, {"prompt_only": True}, "no \\['chosen', 'rejected'\\]: a preference trainer needs"),
        ({}, {"big_tokenizer": True}, "the tokenizer has \\d+ tokens but the model's input embeddings only"),
        ({}, {"compute_metrics": lambda p: {}}, "compute_metrics needs the padded logits"),
        (
            {"max_tokens_per_batch": 512, "packing_overflow": "split"},
            {},
            "packing_overflow='split' would cut",
        ),
        ({}, {"data_collator": "trl"}, "does not pack preference pairs"),
        ({"shared_prompt": False}, {"data_collator": "shared"}, "contradicts the data_collator's"),
        ({}, {"images": True}, "vision-language preference batches are not packed"),
        (
            {
                "max_tokens_per_batch": 512,
                "shared_prompt": True,
                "parallelism_config": ParallelismConfig(sp_size=2),
            },
            {},
            "shared_prompt=True with sp_size > 1",
        ),
        (
            {"max_tokens_per_batch": 512, "share_prefixes": True, "parallelism_config": ParallelismConfig(sp_size=2)},
            {},
            "share_prefixes=True with sp_size > 1",
        ),
        ({"share_prefixes": True, "shared_prompt": True}, {}, "leave shared_prompt unset"),
        ({"min_shared_tokens": 4}, {}, "only applies to the prefix tree of share_prefixes=True"),
        ({"share_prefixes": True}, {"data_collator": "shared"}, r"data_collator \(\w+\) builds no prefix tree"),
        ({"share_prefixes": True, "min_shared_tokens": 4}, {"data_collator": "tree"}, "contradicts the data_collator's"),
    ],
    ids=[
        "prompt_only",
        "tokenizer_too_big",
        "compute_metrics",
        "overflow_split",
        "padded_collator",
        "shared_prompt_contradiction",
        "vision",
        "shared_prompt_sequence_parallel",
        "share_prefixes_sequence_parallel",
        "share_prefixes_and_shared_prompt",
        "min_shared_tokens_without_tree",
        "share_prefixes_collator_contradiction",
        "min_shared_tokens_collator_contradiction",
    ],
)
def test_inexact_options_are_refused(tmp_path, tokenizer, twins, pairs, config, extra, match):
    _, model = twins()
    data = pairs(2)
    if extra.pop("images", False):
        data = data.add_column("images", [[]] * len(data))
    if extra.pop("prompt_only", False):
        data = data.remove_columns(["chosen", "rejected"])
    if extra.pop("big_tokenizer", False):
        tokenizer = copy.deepcopy(tokenizer)
        tokenizer.add_tokens(["<an_added_token>"])
    if extra.get("data_collator") == "shared":
        extra["data_collator"] = PaddingFreePreferenceCollator(shared_prompt=True)
    if extra.get("data_collator") == "tree":
        extra["data_collator"] = PaddingFreePreferenceCollator(share_prefixes=True)
    if extra.get("data_collator") == "trl":
        extra["data_collator"] = trl.trainer.dpo_trainer.DataCollatorForPreference(pad_token_id=0)
    with pytest.raises(ValueError, match=match):
        DPOTrainer(
            model=model,
            args=DPOConfig(**_common(tmp_path, "refused", **config), precompute_ref_log_probs=True),
            train_dataset=data,
            processing_class=tokenizer,
            **extra,
        )


def test_hooks_touch_only_packed_calls_and_are_removable(tmp_path, tokenizer, twins, pairs):
    reference, model = twins()
    trainer = DPOTrainer(
        model=model,
        args=DPOConfig(**_common(tmp_path, "hooks"), precompute_ref_log_probs=True),
        train_dataset=pairs(2),
        processing_class=tokenizer,
    )
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, reference(input_ids=ids).logits, atol=1e-6)
        batch = trainer.data_collator([trainer.train_dataset[0]])
        labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
        with pytest.raises(ValueError, match="without fused_lm_head=True"):
            model(**batch)
        out = model(**batch, labels=labels, fused_lm_head=True)
    assert out.log_probs.shape == (2, batch["input_ids"].shape[1] - 1)
    assert any(isinstance(h, PackedPreferenceForward) for h in trainer._packed_forwards.values())
    trainer.remove_packing_hooks()
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_padding_free_means_packed_and_shared_prompt_switches_an_sdpa_model(
    tmp_path, tokenizer, twins, pairs
):
    """``padding_free=True`` is accepted; on an sdpa model the shared prompt runs packing_hf's attention while
    training (the model is given back on sdpa) and a direct call outside training is refused by name."""
    model, _ = twins()  # sdpa
    trainer = DPOTrainer(
        model=model,
        args=DPOConfig(**_common(tmp_path, "sdpa"), padding_free=True, precompute_ref_log_probs=True),
        train_dataset=pairs(4),
        processing_class=tokenizer,
    )
    assert trainer.args.padding_free and trainer.data_collator.shared_prompt
    assert model.config._attn_implementation == "sdpa"
    batch = trainer._prepare_inputs(trainer.data_collator([trainer.train_dataset[i] for i in range(2)]))
    with pytest.raises(ValueError, match="ignores the layout"):
        trainer.compute_loss(model, batch)
    trainer.train()
    assert trainer.state.global_step == 1 and math.isfinite(trainer.state.log_history[-1]["train_loss"])
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("leak", [False, True], ids=["exact", "negative_control"])
def test_reference_made_by_create_reference_model_from_a_prepared_policy(tmp_path, tokenizer, pairs, leak):
    """Issue 29: ``trl.create_reference_model`` deep-copies a prepared hybrid policy. The copy carries a
    preparation of its own, so the packed reference log-probs, the loss and every gradient equal stock TRL's.
    Negative control: the copy with its mixer split off (its Mamba2 layer runs over the whole packed row,
    as the copy of a closure-based preparation did) is caught by the same comparison."""
    from transformers import AutoModelForCausalLM
    from trl import create_reference_model

    from packing_hf.architectures.tiny import tiny_config

    config = tiny_config("bamba", vocab_size=len(tokenizer))
    torch.manual_seed(0)
    policy_stock = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa").train()
    policy_packed = AutoModelForCausalLM.from_config(
        copy.deepcopy(config), attn_implementation=packing_hf.register_attention()
    )
    policy_packed.load_state_dict(policy_stock.state_dict())
    policy_packed.train()
    handle = packing_hf.prepare_model_for_packing(policy_packed)
    ref_packed = create_reference_model(policy_packed)
    if leak:
        ref_packed._packing_hf_preparation.split_mixers = False
    common = dict(loss_type=["sigmoid"], shared_prompt=False)
    stock = trl.DPOTrainer(
        model=policy_stock,
        ref_model=create_reference_model(policy_stock),
        args=trl.DPOConfig(**_common(tmp_path, "stock", loss_type=["sigmoid"])),
        train_dataset=pairs(4),
        processing_class=tokenizer,
    )
    packed = DPOTrainer(
        model=policy_packed,
        ref_model=ref_packed,
        args=DPOConfig(**_common(tmp_path, "packed", **common)),
        train_dataset=pairs(4),
        processing_class=tokenizer,
    )
    padded_batch, packed_batch = _batches(stock, packed, range(4))

    def compare():
        with torch.no_grad():
            got = packed.compute_ref_log_probs(packed.ref_model, packed_batch)
            want = stock.compute_ref_log_probs(stock.ref_model, padded_batch)
        for g, w, side in zip(got, want, ("chosen", "rejected"), strict=True):
            _close(g, w, f"reference {side} logps")
        loss_p, grads_p = _loss_and_grads(packed, packed_batch)
        loss_s, grads_s = _loss_and_grads(stock, padded_batch)
        _close(loss_p, loss_s, "loss")
        _close(grads_p, grads_s, "gradients")

    if leak:
        with pytest.raises(AssertionError, match="reference"):
            compare()
    else:
        compare()
    handle.revert()


class _Scorer(torch.nn.Module):
    """Stands for a model with TRL's fused LM head (per-token log-probs of the labels), on packing_hf's attention."""

    def __init__(self):
        super().__init__()
        self.config = types.SimpleNamespace(_attn_implementation=packing_hf.ATTENTION_NAME)

    def forward(self, input_ids, labels, fused_lm_head=False, **kwargs):
        return {"log_probs": (labels[:, 1:] != -100).float() * input_ids[:, 1:]}


@pytest.mark.parametrize(
    "collator", [{"pad_to_multiple_of": 8}, {"length_buckets": [16]}, {"shared_prompt": True}]
)
def test_a_router_loss_over_other_tokens_than_stocks_is_refused(collator):
    """TRL's DPO/KTO ``aux_loss`` (``output_router_logits=True``) counts every token of the packed row; stock's
    counts the padded batch's real tokens. A row with padding, or with each prompt held once, holds others:
    refused by name. Controls: the same row without the router loss, and a row of exactly the real tokens."""
    model = _Scorer()
    hooks = PackedPreferenceForward(model)
    pair = {"prompt_ids": [1, 2], "chosen_ids": [3], "rejected_ids": [4, 5]}
    for options, router_loss, refused in (
        (collator, True, True),
        (collator, False, False),
        ({}, True, False),
    ):
        batch = PaddingFreePreferenceCollator(**options)([pair])
        labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
        call = dict(batch, labels=labels, fused_lm_head=True, output_router_logits=router_loss)
        if refused:
            with pytest.raises(ValueError, match="router load-balancing loss.*pad_to_multiple_of"):
                model(**call)
        else:
            assert model(**call)["log_probs"].shape == (2, batch["input_ids"].shape[1] - 1)
    hooks.remove()


def test_a_hybrid_shares_its_prompts_exactly_and_a_model_that_cannot_is_refused(tmp_path, tokenizer, pairs):
    """``shared_prompt`` left unset follows :func:`packing_hf.attention.admission.prefix_tree_refusal`: a prepared
    hybrid (Bamba: its Mamba2 mixer runs every branch after its prompt, from the prompt's final state) shares its
    prompts, and its chosen and rejected log-probs equal stock TRL's on the padded pairs. A model whose mixers do
    not follow the tree (a pure Mamba2 stack) keeps its prompts unshared, and ``shared_prompt=True`` is refused
    naming the model and why."""
    from transformers import AutoModelForCausalLM

    from packing_hf.architectures.tiny import tiny_config

    def twins(seed: int = 0):
        config = tiny_config("bamba", vocab_size=len(tokenizer))
        torch.manual_seed(seed)
        stock = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa")
        packed = AutoModelForCausalLM.from_config(config, attn_implementation=packing_hf.register_attention())
        packed.load_state_dict(stock.state_dict())
        return stock, packed

    stock, packed = _build(tmp_path, tokenizer, twins, lambda: pairs(4), loss_type=["sigmoid"])
    assert packed.data_collator.shared_prompt is True
    padded_batch, packed_batch = _batches(stock, packed, range(4))
    assert packed_batch["prefix_seq_idx"].tolist() == [-1, 0, 0, -1, 3, 3, -1, 6, 6, -1, 9, 9]
    # prepared as the trainer's packing session prepares it at its first step (the gradients of a tree row on
    # a prepared Bamba are compared in tests/integration/attention/test_prefix_tree.py; the policy's forward is
    # what this trainer adds)
    with packing_hf.prepare_model_for_packing(packed.model):
        got = packed.compute_ref_log_probs(packed.model, packed_batch)
    want = stock.compute_ref_log_probs(stock.model, padded_batch)
    for g, w, side in zip(got, want, ("chosen", "rejected"), strict=True):
        _close(g, w, f"{side} logps")
    # the pairs as one prefix tree (share_prefixes): the same log-probs on the hybrid
    stock, packed = _build(
        tmp_path, tokenizer, twins, lambda: pairs(4), loss_type=["sigmoid"], packed_only={"share_prefixes": True}
    )
    padded_batch, packed_batch = _batches(stock, packed, range(4))
    assert "tree_index" in packed_batch
    with packing_hf.prepare_model_for_packing(packed.model):
        got = packed.compute_ref_log_probs(packed.model, packed_batch)
    want = stock.compute_ref_log_probs(stock.model, padded_batch)
    for g, w, side in zip(got, want, ("chosen", "rejected"), strict=True):
        _close(g, w, f"{side} logps (tree)")

    def trainer(model_type, **options):
        config = tiny_config(model_type, vocab_size=len(tokenizer))
        model = AutoModelForCausalLM.from_config(config, attn_implementation=packing_hf.register_attention())
        return DPOTrainer(
            model=model,
            ref_model=copy.deepcopy(model),
            args=DPOConfig(**_common(tmp_path, model_type, loss_type=["sigmoid"], **options)),
            train_dataset=pairs(4),
            processing_class=tokenizer,
        )

    assert trainer("mamba2").data_collator.shared_prompt is False
    with pytest.raises(PackingRefused, match=r"shared_prompt=True: .*mamba2"):
        trainer("mamba2", shared_prompt=True)
    with pytest.raises(PackingRefused, match=r"share_prefixes=True: .*mamba2"):
        trainer("mamba2", share_prefixes=True)
