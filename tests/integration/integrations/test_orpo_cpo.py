"""packing_hf.ORPOTrainer / CPOTrainer against TRL's experimental padded trainers: same log-probs, loss, gradients.

GSM8K pairs (the reference answer vs. its lines reversed) with an explicit prompt, tokenized by TRL with the
SmolLM2 tokenizer; one tiny llama (fp32) loaded twice with the same weights: sdpa for the stock padded run,
packing_hf's varlen attention for the packed run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import datasets
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, TrainerCallback

pytest.importorskip("trl")
from trl.experimental.cpo import CPOConfig as StockCPOConfig  # noqa: E402
from trl.experimental.cpo import CPOTrainer as StockCPOTrainer  # noqa: E402
from trl.experimental.orpo import ORPOConfig as StockORPOConfig  # noqa: E402
from trl.experimental.orpo import ORPOTrainer as StockORPOTrainer  # noqa: E402

import packing_hf  # noqa: E402
from packing_hf.integrations import chunked_head  # noqa: E402
from packing_hf.integrations.orpo import (  # noqa: E402
    CPOConfig,
    CPOTrainer,
    ORPOConfig,
    ORPOTrainer,
)
from packing_hf.pair_rows import PaddingFreePairCollator  # noqa: E402

REL = 1e-5

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TRAINERS = {
    "orpo": (StockORPOTrainer, StockORPOConfig, ORPOTrainer, ORPOConfig),
    "cpo": (StockCPOTrainer, StockCPOConfig, CPOTrainer, CPOConfig),
}
# One CPO case per packing_hf branch: CPOTrainer only chooses between summed and averaged log-probs
# (``_average_log_prob``: ipo / simpo / alphapo) and whether the NLL term is computed (``_nll_mask``:
# cpo_alpha != 0); the loss formulas themselves (sigmoid / hinge / ipo / simpo, label_smoothing, simpo_gamma,
# alpha) are TRL's code, read from the same log-probs. So: sigmoid (summed, NLL), simpo (averaged, NLL),
# alphapo (averaged, no NLL: TRL turns it into simpo with cpo_alpha=0, alpha shaping the rewards) and
# sigmoid-no-nll (summed, no NLL). hinge and ipo would repeat sigmoid's and simpo's paths.
CASES = {
    "orpo": ("orpo", {"beta": 0.2}),
    "cpo-sigmoid": ("cpo", {"loss_type": "sigmoid", "label_smoothing": 0.1}),
    "cpo-simpo": ("cpo", {"loss_type": "simpo", "simpo_gamma": 0.3}),
    "cpo-alphapo": ("cpo", {"loss_type": "alphapo", "alpha": 0.2}),
    "cpo-sigmoid-no-nll": ("cpo", {"loss_type": "sigmoid", "cpo_alpha": 0.0}),
}


@pytest.fixture(scope="module")
def pairs(gsm8k_rows):
    short = [r for r in gsm8k_rows(400) if len(r["question"]) < 160 and len(r["answer"]) < 250]

    def build(n: int) -> datasets.Dataset:
        rows = short[:n]
        return datasets.Dataset.from_dict(
            {
                "prompt": [f"Question: {r['question']}\nAnswer:" for r in rows],
                "chosen": [" " + r["answer"] for r in rows],
                "rejected": [" " + "\n".join(list(reversed(r["answer"].split("\n")))[1:]) for r in rows],
            }
        )

    return build


@pytest.fixture(scope="module")
def twins(tokenizer):
    def build(seed: int = 0):
        config = AutoConfig.for_model(
            "llama", vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2,
        )  # fmt: skip
        torch.manual_seed(seed)
        stock = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()
        packed = AutoModelForCausalLM.from_config(
            config, attn_implementation=packing_hf.register_attention()
        ).float()
        packed.load_state_dict(stock.state_dict())
        return stock, packed

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
        bf16=False,
        max_length=256,
    )
    return {**defaults, **overrides}


def _build(tmp_path, tokenizer, twins, data, kind: str, packed_only: dict | None = None, **config):
    stock_trainer, stock_config, packed_trainer, packed_config = TRAINERS[kind]
    stock_model, packed_model = twins()
    stock = stock_trainer(
        model=stock_model,
        args=stock_config(**_common(tmp_path, "stock", **config)),
        train_dataset=data(),
        processing_class=tokenizer,
    )
    packed = packed_trainer(
        model=packed_model,
        args=packed_config(**_common(tmp_path, "packed", **config), padding_free=True, **(packed_only or {})),
        train_dataset=data(),
        processing_class=tokenizer,
    )
    return stock, packed


def _close(got, want, what):
    got = torch.as_tensor(got).detach().double()
    want = torch.as_tensor(want).detach().double()
    scale = float(want.abs().max()) or 1.0
    assert float((got - want).abs().max()) <= REL * scale, f"{what}: {got} vs {want}"


def _terms(key: str, metrics: dict) -> list[float]:
    """The magnitudes a logged ``key`` is a small difference of (``assert_close``'s ``terms``): a reward margin
    cancels the chosen and rejected rewards (beta x mean log-prob), ORPO's chosen log-odds the chosen and
    rejected mean log-probs (~10.8 each); a near-uniform tiny model makes them almost equal."""
    if key.endswith("rewards/margins"):
        prefix = key[: -len("margins")]
        return [metrics[prefix + "chosen"], metrics[prefix + "rejected"]]
    if key.endswith("log_odds_chosen"):
        prefix = key[: -len("log_odds_chosen")]
        return [metrics[prefix + "logps/chosen"], metrics[prefix + "logps/rejected"]]
    return []


def _loss_grads_metrics(trainer, batch):
    trainer.model.train()
    trainer.model.zero_grad()
    loss, metrics = trainer.compute_loss(trainer.model, dict(batch), return_outputs=True)
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])
    return loss.detach(), grads, metrics


def _batches(stock, packed, n):
    rows = [stock.train_dataset[i] for i in range(n)]
    assert rows == [packed.train_dataset[i] for i in range(n)]  # TRL's own tokenization in both
    padded, packed_batch = stock.data_collator(rows), packed.data_collator(rows)
    return stock._prepare_inputs(padded), packed._prepare_inputs(packed_batch)


@pytest.mark.parametrize("case", list(CASES))
def test_loss_gradients_and_metrics_match_stock(tmp_path, tokenizer, twins, pairs, case, assert_close):
    kind, config = CASES[case]
    stock, packed = _build(tmp_path, tokenizer, twins, lambda: pairs(4), kind, **config)
    padded_batch, packed_batch = _batches(stock, packed, 4)
    assert packed_batch["packed_input_ids"].numel() < 2 * 4 * max(
        padded_batch["chosen_input_ids"].shape[1], padded_batch["rejected_input_ids"].shape[1]
    )  # the batch has padding that the packed row does not compute
    logps_s = stock.concatenated_forward(stock.model, padded_batch)
    logps_p = packed.concatenated_forward(packed.model, packed_batch)
    _close(logps_p[0], logps_s[0], "chosen log-probs")
    _close(logps_p[1], logps_s[1], "rejected log-probs")
    _close(logps_p[4].detach(), logps_s[4].detach(), "nll")
    loss_p, grads_p, metrics_p = _loss_grads_metrics(packed, packed_batch)
    loss_s, grads_s, metrics_s = _loss_grads_metrics(stock, padded_batch)
    _close(loss_p, loss_s, "loss")
    _close(grads_p, grads_s, "gradients")
    assert set(metrics_p) == set(metrics_s)
    for key, want in metrics_s.items():
        if not key.startswith("logits/"):  # stock's average padding logits (see the module docstring)
            assert_close(metrics_p[key], want, f"metric {key}", rel=REL, terms=_terms(key, metrics_s))

    # negative control: the model runs the packed row as one sequence (positions running on, attention not
    # split per segment), so every sequence sees the ones before it: the same comparison fails
    with torch.no_grad():
        leaked = packed.concatenated_forward(_OneSequence(packed.model), packed_batch)
    _close(leaked[0][:1], logps_s[0][:1].detach(), "the first sequence, which has nothing before it")
    with pytest.raises(AssertionError):
        _close(leaked[1], logps_s[1].detach(), "rejected log-probs of a leaking row")


# ORPO through the chunked LM head (the default), CPO through the model's logits
@pytest.mark.parametrize(
    "kind, config, chunked", [("orpo", {"beta": 0.2}, True), ("cpo", {"loss_type": "sigmoid"}, False)]
)
def test_share_prefixes_on_multi_turn_pairs_matches_stock(
    tmp_path, tokenizer, twins, multi_turn_pairs, kind, config, chunked, branch_points_one_row_early
):
    """``share_prefixes``: the multi-turn pairs of test_dpo (two conversations cut at every turn, a shared system
    prompt, one unrelated pair) as one prefix tree; the per-sequence log-probs (ORPO: means, CPO: sums), the NLL
    term (ORPO: over every chosen token, prompt included), the loss and the gradients equal stock TRL's padded
    run. Negative control: the branch points read from the row before each node are caught."""
    stock, packed = _build(
        tmp_path, tokenizer, twins, multi_turn_pairs, kind, per_device_train_batch_size=7,
        packed_only={"share_prefixes": True, "chunked_loss": chunked}, **config,
    )  # fmt: skip
    assert (packed.loss_policy.chunked_head(packed, packed.model) is not None) is chunked
    padded_batch, packed_batch = _batches(stock, packed, 7)
    assert packed_batch["prefix_seq_idx"].max() > 1  # a tree deeper than one shared prompt
    logps_s = stock.concatenated_forward(stock.model, padded_batch)
    logps_p = packed.concatenated_forward(packed.model, packed_batch)
    for i, what in ((0, "chosen log-probs"), (1, "rejected log-probs"), (4, "nll")):
        _close(logps_p[i], logps_s[i], what)
    loss_p, grads_p, metrics_p = _loss_grads_metrics(packed, packed_batch)
    loss_s, grads_s, _ = _loss_grads_metrics(stock, padded_batch)
    _close(loss_p, loss_s, "loss")
    _close(grads_p, grads_s, "gradients")
    # tokens of the 14 sequences run alone over the tree row's
    row = packed_batch["packed_input_ids"].numel()
    alone = sum(padded_batch[f"{side}_attention_mask"].sum().item() for side in ("chosen", "rejected"))
    assert metrics_p["tree_token_ratio"] == alone / row > 1

    branch_points_one_row_early()
    with torch.no_grad():
        wrong = packed.concatenated_forward(packed.model, packed_batch)
    # (a node's first child follows it in the row, so the control's rows differ for the later siblings only:
    # the rejected answers, and the turns after them)
    with pytest.raises(AssertionError):
        _close(wrong[1], logps_s[1].detach(), "rejected log-probs with branch points read from the wrong row")


def test_a_hook_on_the_lm_head_is_honoured(tmp_path, tokenizer, twins, pairs, monkeypatch):
    """A temperature hook on the LM head (both models): the packed loss and gradients still equal stock's, whose
    full logits run it; packing_hf's chunked head, which reads the head's weight, keeps the full logits."""
    stock, packed = _build(tmp_path, tokenizer, twins, lambda: pairs(2), "orpo", beta=0.2)
    padded_batch, packed_batch = _batches(stock, packed, 2)
    for trainer in (stock, packed):
        trainer.model.lm_head.register_forward_hook(lambda module, args, out: out / 0.7)
    loss_s, grads_s, _ = _loss_grads_metrics(stock, padded_batch)
    loss_p, grads_p, _ = _loss_grads_metrics(packed, packed_batch)
    _close(loss_p, loss_s, "loss")
    _close(grads_p, grads_s, "gradients")
    # negative control: the chunked head blind to the hook
    monkeypatch.setattr(chunked_head, "_bypassed_calls", lambda head, engine: None)
    with pytest.raises(AssertionError, match="loss"):
        _close(_loss_grads_metrics(packed, packed_batch)[0], loss_s, "loss")


class _OneSequence(torch.nn.Module):
    """The model called on a packed row as if it were one sequence: no segment boundaries."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, **kwargs):
        total = int(input_ids.shape[1])
        kwargs["position_ids"] = torch.arange(total)[None]
        kwargs["cu_seq_lens_q"] = kwargs["cu_seq_lens_k"] = torch.tensor([0, total], dtype=torch.int32)
        kwargs["max_length_q"] = kwargs["max_length_k"] = total
        return self.model(input_ids=input_ids, **kwargs)


@pytest.mark.parametrize("kind", ["orpo", "cpo"])
def test_logits_metrics_equal_stock_without_padding(tmp_path, tokenizer, twins, kind):
    # one pair whose answers have the same length: the padded batch has no padding to average
    data = lambda: datasets.Dataset.from_dict({"prompt": ["1+1="], "chosen": [" 2"], "rejected": [" 3"]})  # noqa: E731
    stock, packed = _build(tmp_path, tokenizer, twins, data, kind, per_device_train_batch_size=1)
    padded_batch, packed_batch = _batches(stock, packed, 1)
    assert padded_batch["chosen_input_ids"].shape == padded_batch["rejected_input_ids"].shape
    _, _, metrics_p = _loss_grads_metrics(packed, packed_batch)
    _, _, metrics_s = _loss_grads_metrics(stock, padded_batch)
    for key in ("logits/chosen", "logits/rejected"):
        _close(metrics_p[key], metrics_s[key], f"metric {key}")


class _GradientProbe(TrainerCallback):
    def __init__(self):
        self.grads = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append(
            torch.cat([p.grad.flatten().clone() for p in model.parameters() if p.grad is not None])
        )


@pytest.mark.parametrize("case", ["orpo", "cpo-simpo"])
def test_gradient_accumulation_training_matches_stock(tmp_path, tokenizer, twins, pairs, case, assert_close):
    kind, config = CASES[case]
    stock, packed = _build(
        tmp_path, tokenizer, twins, lambda: pairs(8), kind, **config,
        per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2, optim="sgd",
        learning_rate=0.05, logging_steps=1,
    )  # fmt: skip
    probes = []
    for trainer in (stock, packed):
        probes.append(_GradientProbe())
        trainer.add_callback(probes[-1])
        trainer.train()
    grads_s, grads_p = (probe.grads for probe in probes)
    assert len(grads_s) == len(grads_p) == 2
    for step, (g_p, g_s) in enumerate(zip(grads_p, grads_s, strict=True)):
        _close(g_p, g_s, f"accumulated gradient of step {step}")
    weights = [torch.cat([p.detach().flatten() for p in t.model.parameters()]) for t in (stock, packed)]
    _close(weights[1], weights[0], "weights after 2 steps")
    logs = [[h for h in t.state.log_history if "loss" in h] for t in (stock, packed)]
    assert len(logs[0]) == len(logs[1]) == 2
    for key in ("loss", "nll_loss", "logps/chosen", "rewards/margins"):
        for step, (log_s, log_p) in enumerate(zip(*logs, strict=True)):
            what = f"logged {key} of step {step}"
            assert_close(log_p[key], log_s[key], what, rel=REL, terms=_terms(key, log_s))


@dataclass
class _Recording(PaddingFreePairCollator):
    batches: list = field(default_factory=list, init=False, repr=False)

    def __call__(self, features, return_tensors=None):
        self.batches.append([len(f["chosen_input_ids"]) + len(f["rejected_input_ids"]) for f in features])
        return super().__call__(features, return_tensors)


def test_multipack_keeps_pairs_whole_within_the_budget(tmp_path, tokenizer, twins, pairs):
    _, model = twins()
    collator = _Recording()
    budget = 600
    trainer = ORPOTrainer(
        model=model,
        args=ORPOConfig(
            **_common(tmp_path, "multipack", max_steps=-1, num_train_epochs=1, logging_steps=1),
            max_tokens_per_batch=budget,
        ),
        data_collator=collator,
        train_dataset=pairs(12),
        processing_class=tokenizer,
    )
    trainer.train()
    assert sum(len(b) for b in collator.batches) == 12  # every pair once, both sequences together
    assert all(sum(b) <= budget for b in collator.batches)
    assert len(collator.batches) == trainer.state.global_step < 12
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs and all(0 < h["packing_efficiency"] <= 1 and "nll_loss" in h for h in logs)


@pytest.mark.parametrize("kind", ["orpo", "cpo"])
def test_bad_inputs_are_named(tmp_path, tokenizer, twins, pairs, kind):
    _, _, trainer, config = TRAINERS[kind]
    _, model = twins()
    args = lambda **kw: config(**_common(tmp_path, "bad"), **kw)  # noqa: E731
    prompt_only = datasets.Dataset.from_dict({"prompt": ["1+1=", "2+2="]})
    with pytest.raises(ValueError, match=r"no \['chosen', 'rejected'\]"):
        trainer(model=model, args=args(), train_dataset=prompt_only, processing_class=tokenizer)
    small_config = AutoConfig.for_model(
        "llama", vocab_size=1000, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    small = AutoModelForCausalLM.from_config(small_config)
    with pytest.raises(ValueError, match="resize_token_embeddings"):
        trainer(model=small, args=args(), train_dataset=pairs(2), processing_class=tokenizer)
    with pytest.raises(ValueError, match="padding_free=False"):
        trainer(
            model=model, args=args(padding_free=False), train_dataset=pairs(2), processing_class=tokenizer
        )
    with pytest.raises(ValueError, match="does not pack pairs"):
        trainer(
            model=model, args=args(), train_dataset=pairs(2), processing_class=tokenizer,
            data_collator=lambda rows: rows,
        )  # fmt: skip
    with pytest.raises(ValueError, match="encoder-decoder"):
        trainer(
            model=model,
            args=args(is_encoder_decoder=True),
            train_dataset=pairs(2),
            processing_class=tokenizer,
        )
    with pytest.raises(ValueError, match="loss_normalization"):
        trainer(
            model=model, args=args(loss_normalization="sample"), train_dataset=pairs(2),
            processing_class=tokenizer,
        )  # fmt: skip
    model.config.output_router_logits = True
    try:
        with pytest.raises(ValueError, match="output_router_logits"):
            trainer(model=model, args=args(), train_dataset=pairs(2), processing_class=tokenizer)
    finally:
        model.config.output_router_logits = False


def test_collator_refuses_labels_that_are_not_the_tokens():
    collator = PaddingFreePairCollator()
    row = {"chosen_input_ids": [1, 2], "chosen_labels": [-100, 2], "rejected_input_ids": [1, 3]}
    with pytest.raises(ValueError, match="rejected_labels"):
        collator([row])
    with pytest.raises(ValueError, match="rejected_labels must be rejected_input_ids"):
        collator([{**row, "rejected_labels": [-100, 4]}])


@pytest.mark.parametrize("case", ["orpo", "cpo-sigmoid"])
def test_evaluation_matches_stock(tmp_path, tokenizer, twins, pairs, case, assert_close):
    kind, config = CASES[case]
    stock_trainer, stock_config, packed_trainer, packed_config = TRAINERS[kind]
    stock_model, packed_model = twins()
    results = []
    for trainer, conf, model in (
        (stock_trainer, stock_config, stock_model),
        (packed_trainer, packed_config, packed_model),
    ):
        trainer = trainer(
            model=model,
            args=conf(**_common(tmp_path, "eval", per_device_eval_batch_size=3, **config)),
            train_dataset=pairs(2),
            eval_dataset=pairs(6),
            processing_class=tokenizer,
        )
        results.append(trainer.evaluate())
    want, got = results
    assert set(got) == set(want)
    for key, value in want.items():
        if not (key.startswith("eval_logits/") or "time" in key or "per_second" in key):  # timings
            assert_close(got[key], value, key, rel=REL, terms=_terms(key, want))
