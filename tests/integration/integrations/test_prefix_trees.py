"""``share_prefixes=True`` on packing_hf.Trainer / SFTTrainer: a real optimizer step on prefix-tree rows equals the
same samples packed flat (loss and every parameter gradient, fp32, relative error < 1e-5); the branch-point labels
counted right; negative controls (a branch point's weight collapsed to one sample, a sibling leak) caught by the
same comparison; tree_token_ratio logged with its value; the refusals by name."""

from __future__ import annotations

import datasets
import pytest
import torch
from transformers import AutoModelForCausalLM, TrainerCallback

import packing_hf
from packing_hf.architectures import tiny_config
from packing_hf.prefix_tree import build_prefix_tree

SEED = 0
SYSTEM, USER, ASSISTANT = [1, 2, 3, 4], 5, 6


def _turn(role: int, tokens: list[int]) -> tuple[list[int], list[int]]:
    return [role, *tokens], [0] + [int(role == ASSISTANT)] * len(tokens)


def _conversation(turns: list[tuple[int, list[int]]]) -> list[tuple[list[int], list[int]]]:
    return [_turn(role, tokens) for role, tokens in turns]


def _per_turn(turns: list[tuple[list[int], list[int]]]) -> list[dict]:
    """A conversation cut into one sample per assistant turn: the turns up to it, only its own answer trained
    (an earlier answer is a label in its own sample and context in the later ones)."""
    samples, ids, mask = [], list(SYSTEM), [0] * len(SYSTEM)
    for tokens, trained in turns:
        ids, mask = ids + tokens, [0] * len(mask) + trained
        if any(trained):
            samples.append({"input_ids": list(ids), "assistant_masks": list(mask)})
    return samples


def make_samples(weighted: bool = False) -> list[dict]:
    """Per-turn samples of two conversations sharing a system prompt and first exchange, which branch inside the
    second answer (the branch row predicts two different first tokens) and again after it; a duplicate; an
    unrelated sample."""
    first = [(USER, [10, 11, 12]), (ASSISTANT, [20, 21, 22, 23])]
    a = _per_turn(
        _conversation(
            [*first, (USER, [13, 14]), (ASSISTANT, [30, 31, 32]), (USER, [15]), (ASSISTANT, [40, 41])]
        )
    )
    b = _per_turn(
        _conversation([*first, (USER, [13, 14]), (ASSISTANT, [33, 31]), (USER, [16, 17]), (ASSISTANT, [42])])
    )
    c = _per_turn(_conversation([*first, (USER, [18]), (ASSISTANT, [30, 34])]))
    samples = [
        *a,
        *b[1:],
        b[1],
        *c[1:],
        {"input_ids": [50, 51, 52, 53, 54], "assistant_masks": [0, 1, 1, 1, 1]},
    ]
    if weighted:
        for i, sample in enumerate(samples):
            sample["loss_weights"] = [0.25 * ((i + j) % 5) for j in range(len(sample["input_ids"]))]
    return samples  # fmt: skip


def make_model(model_type: str = "llama", **config):
    torch.manual_seed(SEED)
    return AutoModelForCausalLM.from_config(
        tiny_config(model_type, **config), attn_implementation=packing_hf.register_attention()
    ).float()


class Capture(TrainerCallback):
    def on_pre_optimizer_step(self, args, state, control, model=None, **_):
        self.grads = {
            n: p.grad.detach().double().clone() for n, p in model.named_parameters() if p.grad is not None
        }


def _step(tmp_path, share: bool, samples=None, evaluate=False, model_type="llama", **settings):
    """One optimizer step (lr 0: the gradient is read before it): ``(grads, logged loss, log entry)``; with
    ``evaluate`` the entry also holds the ``eval_loss`` of the training samples, evaluated after the step."""
    capture = Capture()
    args = packing_hf.TrainingArguments(
        str(tmp_path / ("tree" if share else "flat")), share_prefixes=share, max_steps=1, max_grad_norm=0.0,
        learning_rate=0.0, logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True,
        seed=SEED, **settings,
    )  # fmt: skip
    extra = {} if share else {"data_collator": packing_hf.PaddingFreeCollator()}
    trainer = packing_hf.Trainer(
        model=make_model(model_type), args=args,
        train_dataset=datasets.Dataset.from_list(samples if samples is not None else make_samples()),
        callbacks=[capture], **extra,
    )  # fmt: skip
    trainer.train()
    entry = next(e for e in trainer.state.log_history if "loss" in e)
    if evaluate:
        entry["eval_loss"] = trainer.evaluate(trainer.train_dataset)["eval_loss"]
    return capture.grads, entry["loss"], entry, trainer._multipack_sampler


def _relative(a: dict, b: dict) -> float:
    num = sum(float((a[n] - b[n]).pow(2).sum()) for n in b)
    return (num / sum(float(g.pow(2).sum()) for g in b.values())) ** 0.5


def _check_same(tree, flat, bound=1e-5) -> None:
    (grads, loss), (ref_grads, ref_loss) = tree[:2], flat[:2]
    assert set(grads) == set(ref_grads)
    assert abs(loss - ref_loss) <= bound * abs(ref_loss), (loss, ref_loss)
    assert _relative(grads, ref_grads) < bound


@pytest.mark.parametrize(
    ("normalization", "weighted", "settings"),
    [
        ("token", False, {"per_device_train_batch_size": 16}),  # one micro-batch: one tree per step
        # multipack micro-batches, accumulated: the step's denominator spans trees
        ("sample", True, {"max_tokens_per_batch": 64, "gradient_accumulation_steps": 3}),
        ("sample_sum", False, {"max_tokens_per_batch": 64, "gradient_accumulation_steps": 3}),
    ],
)
def test_trainer_step_equals_the_samples_flat(tmp_path, normalization, weighted, settings):
    samples = make_samples(weighted)
    one_tree = "per_device_train_batch_size" in settings
    run = {"samples": samples, "loss_normalization": normalization, "evaluate": one_tree, **settings}
    tree, flat = _step(tmp_path, True, **run), _step(tmp_path, False, **run)
    _check_same(tree, flat)
    if one_tree:  # the whole step is one tree: its ratio is the row's
        expected = build_prefix_tree([s["input_ids"] for s in samples]).token_ratio
        assert tree[2]["tree_token_ratio"] == pytest.approx(expected, abs=1e-4) and expected > 1.5
        # evaluation runs on flat rows: the eval loss is the samples' token mean, as without trees
        assert tree[2]["eval_loss"] == pytest.approx(flat[2]["eval_loss"], rel=1e-6)
    else:  # multipack: the sampler packed the prefix groups; the step's ratio is that of its trees
        sampler = tree[3]
        assert sampler.prefix_groups is not None and flat[3].prefix_groups is None
        sampler.set_epoch(0)
        batches = list(sampler)
        assert len(batches) <= settings["gradient_accumulation_steps"]  # one step: the whole epoch
        rows = sum(build_prefix_tree([samples[i]["input_ids"] for i in b]).input_ids.numel() for b in batches)
        expected = sum(len(s["input_ids"]) for s in samples) / rows
        assert tree[2]["tree_token_ratio"] == pytest.approx(expected, abs=1e-4) and expected > 1.5
    assert "tree_token_ratio" not in flat[2]


def test_sft_trainer_step_equals_the_samples_flat(tmp_path, tokenizer):
    """The tree run with TRL's default activation checkpointing (layers re-run in backward on the tree row), the
    flat reference without; the sampler plans the tree run by prefix groups, the step covers the epoch."""

    def step(share):
        model = make_model(vocab_size=len(tokenizer))
        capture = Capture()
        args = packing_hf.SFTConfig(
            str(tmp_path / str(share)), share_prefixes=share, max_steps=1, max_grad_norm=0.0, learning_rate=0.0,
            logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True, seed=SEED,
            max_tokens_per_batch=128, gradient_accumulation_steps=4, bf16=False, gradient_checkpointing=share,
        )  # fmt: skip
        trainer = packing_hf.SFTTrainer(
            model=model, args=args, train_dataset=datasets.Dataset.from_list(make_samples()),
            processing_class=tokenizer, callbacks=[capture],
        )  # fmt: skip
        if share:
            assert isinstance(trainer.data_collator, packing_hf.PrefixTreeCollator)
        trainer.train()
        entry = next(e for e in trainer.state.log_history if "loss" in e)
        return capture.grads, entry["loss"], entry

    _check_same(step(True), step(False))


# ---- the branch point and negative controls, through the trainer's own loss -----------------------------------


def _loss_and_grads(trainer, model, batch):
    model.zero_grad()
    loss = trainer.compute_loss(model, {k: v.clone() if torch.is_tensor(v) else v for k, v in batch.items()})
    loss.backward()
    return loss.item(), {n: p.grad.detach().double().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("chunked", [True, False])
def test_branch_point_labels_and_negative_controls(tmp_path, chunked):
    samples = make_samples()
    tree_batch = packing_hf.PrefixTreeCollator()(samples)
    # the branch inside the second answer: one row predicts 30 ("a") and 33 ("b") for every sample through it
    rows, targets, weights = (tree_batch[k] for k in ("tree_rows", "tree_targets", "tree_weights"))
    branch = rows[targets == 33]
    assert branch.numel() == 1
    at_branch = {
        int(t): float(w) for t, w in zip(targets[rows == branch], weights[rows == branch], strict=True)
    }
    # 30: a's second sample trains it, a's third has it as context (not counted); 33: b's sample and its duplicate
    assert at_branch == {30: 1.0, 33: 2.0}
    model = make_model()
    args = packing_hf.TrainingArguments(
        str(tmp_path), share_prefixes=True, chunked_loss=chunked, report_to="none", use_cpu=True
    )
    trainer = packing_hf.Trainer(model=model, args=args, train_dataset=samples)
    flat = _loss_and_grads(trainer, model, packing_hf.PaddingFreeCollator()(samples))
    tree = _loss_and_grads(trainer, model, tree_batch)
    assert abs(tree[0] - flat[0]) < 1e-5 * abs(flat[0]) and _relative(tree[1], flat[1]) < 1e-5
    # negative control 1: the branch point's weights collapsed to one sample each
    collapsed = dict(tree_batch, tree_weights=tree_batch["tree_weights"].clamp(max=1.0))
    caught = _loss_and_grads(trainer, model, collapsed)
    assert _relative(caught[1], flat[1]) > 1e-3
    # negative control 2: a sibling leak (the "b" branch made a child of the "a" branch)
    parents = tree_batch["prefix_seq_idx"].clone()
    siblings = (parents == parents[parents >= 0].mode().values).nonzero().flatten()
    parents[siblings[1]] = siblings[0]
    leak = dict(tree_batch, prefix_seq_idx=parents)
    leak["position_ids"] = packing_hf.shared_prefix.shared_prefix_position_ids(
        leak["cu_seq_lens_q"], parents
    )[None]
    caught = _loss_and_grads(trainer, model, leak)
    assert _relative(caught[1], flat[1]) > 1e-3


# ---- what is refused -------------------------------------------------------------------------------------------


def _trainer(tmp_path, model=None, **settings):
    args = packing_hf.TrainingArguments(str(tmp_path), report_to="none", use_cpu=True, **settings)
    return packing_hf.Trainer(
        model=model if model is not None else make_model(), args=args, train_dataset=make_samples()[:2]
    )


def test_refusals_by_name(tmp_path):
    with pytest.raises(ValueError, match="data_collator=PaddingFreeCollator lays samples out flat"):
        args = packing_hf.TrainingArguments(
            str(tmp_path), share_prefixes=True, report_to="none", use_cpu=True
        )
        packing_hf.Trainer(model=make_model(), args=args, train_dataset=make_samples(),
                           data_collator=packing_hf.PaddingFreeCollator())  # fmt: skip
    with pytest.raises(ValueError, match="min_shared_tokens=2 in the config contradicts"):
        args = packing_hf.TrainingArguments(
            str(tmp_path), share_prefixes=True, min_shared_tokens=2, report_to="none", use_cpu=True
        )
        packing_hf.Trainer(model=make_model(), args=args, train_dataset=make_samples(),
                           data_collator=packing_hf.PrefixTreeCollator())  # fmt: skip
    with pytest.raises(ValueError, match="needs share_prefixes=True"):
        args = packing_hf.TrainingArguments(str(tmp_path), report_to="none", use_cpu=True)
        packing_hf.Trainer(model=make_model(), args=args, train_dataset=make_samples(),
                           data_collator=packing_hf.PrefixTreeCollator())  # fmt: skip
    with pytest.raises(
        ValueError, match="share_prefixes=True computes the loss .* label_smoothing_factor=0.1"
    ):
        _trainer(tmp_path, share_prefixes=True, label_smoothing_factor=0.1)
    with pytest.raises(ValueError, match="min_shared_tokens=3 sets how long"):
        packing_hf.TrainingArguments(str(tmp_path), min_shared_tokens=3, report_to="none", use_cpu=True)


def test_sft_settings_a_tree_cannot_honour_are_refused(tmp_path, tokenizer):
    data = datasets.Dataset.from_list(make_samples()[:2])
    for setting, match in (
        ({"logit_metrics": "trl"}, "logit_metrics='trl'"),
        ({"pad_to_multiple_of": 8}, "a prefix-tree row is not padded"),
    ):
        args = packing_hf.SFTConfig(
            str(tmp_path), share_prefixes=True, report_to="none", use_cpu=True, bf16=False, **setting
        )
        with pytest.raises(ValueError, match=match):
            packing_hf.SFTTrainer(
                model=make_model(), args=args, train_dataset=data, processing_class=tokenizer
            )


def test_a_hybrid_tree_step_equals_the_samples_flat_and_a_pure_ssm_is_refused(tmp_path):
    """A hybrid whose mixers follow the tree (Bamba: each segment's Mamba2 starts from its parent's final state,
    docs/prefix_trees.md "Hybrid models on trees") trains on trees exactly; a pure Mamba2 stack is refused by
    name."""
    run = {"model_type": "bamba", "per_device_train_batch_size": 16}
    _check_same(_step(tmp_path, True, **run), _step(tmp_path, False, **run))
    torch.manual_seed(SEED)
    mamba2 = AutoModelForCausalLM.from_config(tiny_config("mamba2"))
    with pytest.raises(packing_hf.errors.PackingRefused, match="share_prefixes=True: mamba2") as refused:
        _trainer(tmp_path, model=mamba2, share_prefixes=True)
    assert refused.value.reason == "prefix_seq_idx"


@pytest.mark.parametrize("chunked", [True, False])
def test_a_row_without_targets_trains_nothing(tmp_path, chunked):
    """Every label masked (a sample's first token is never a target): no pair, the loss 0, every gradient zero
    (not NaN), on both heads."""
    samples = [
        {"input_ids": [1, 2, 3], "assistant_masks": [1, 0, 0]},
        {"input_ids": [1, 2, 4], "assistant_masks": [0, 0, 0]},
        {"input_ids": [7], "assistant_masks": [1]},
    ]
    batch = packing_hf.PrefixTreeCollator()(samples)
    assert batch["tree_rows"].numel() == 0 and int(batch["tree_samples"]) == 0
    model = make_model()
    args = packing_hf.TrainingArguments(
        str(tmp_path), share_prefixes=True, chunked_loss=chunked, report_to="none", use_cpu=True
    )
    trainer = packing_hf.Trainer(model=model, args=args, train_dataset=samples)
    loss, grads = _loss_and_grads(trainer, model, batch)
    assert loss == 0.0 and all(not g.any() for g in grads.values())


def test_accelerates_sequence_parallelism_refused_by_name():
    """accelerate's own sequence parallelism (``sp_size`` told to accelerate, which would cut a tree row without its
    ancestors' keys) is refused with the reason ``share_prefixes``; packing_hf's ``sp_size`` cuts it exactly
    (``tests/distributed/test_sequence_parallel_multiprocess.py``, ``tree_sp2``)."""
    from types import SimpleNamespace

    from packing_hf.integrations.parallel import ParallelPlan
    from packing_hf.integrations.prefix_trees import PrefixTreeMixin

    trainer = SimpleNamespace(
        args=SimpleNamespace(share_prefixes=True),
        parallel_plan=ParallelPlan("ddp", None, 2, 0, accelerate_sizes={"sp_size": 2}),
        data_collator=packing_hf.PrefixTreeCollator(),
    )
    trainer._trains_prefix_trees = lambda: True
    with pytest.raises(
        packing_hf.errors.PackingRefused, match="share_prefixes=True with accelerate's sequence/context"
    ) as refused:
        PrefixTreeMixin._check_share_prefixes(trainer)
    assert refused.value.reason == "share_prefixes"
