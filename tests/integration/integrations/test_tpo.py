"""packing_hf.TPOTrainer against TRL's experimental padded TPOTrainer: same logits, loss, gradients, metrics.

GSM8K triples (chosen: the answer; rejected: its lines reversed; reference: its final line) with an explicit
prompt, tokenized by TRL with the SmolLM2 tokenizer; one tiny llama (fp32) loaded twice with the same weights:
sdpa for the stock padded run, packing_hf's varlen attention for the packed run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import datasets
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, TrainerCallback

pytest.importorskip("trl")
from trl.experimental.tpo import TPOConfig as StockTPOConfig  # noqa: E402
from trl.experimental.tpo import TPOTrainer as StockTPOTrainer  # noqa: E402

import packing_hf  # noqa: E402
from packing_hf import loss_head  # noqa: E402
from packing_hf.integrations import chunked_head  # noqa: E402
from packing_hf.integrations.tpo import (  # noqa: E402
    PackedTripleForward,
    TPOConfig,
    TPOTrainer,
)
from packing_hf.pair_rows import PaddingFreeTripleCollator  # noqa: E402

REL = 1e-5

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# TPOTrainer's packed forward returns the padded logits and TRL computes everything after them, so the loss
# type matters to packing_hf only through how TRL reduces per-token log-probs (summed: sigmoid / hinge;
# averaged: ipo / tpo-l) and whether reference rows are packed (tpo_alpha != 0). The equality test runs
# sigmoid (summed), tpo-l (averaged) and sigmoid-no-reference; hinge would only change TRL's formula over
# sigmoid's log-probs, ipo over tpo-l's (ipo is kept for the evaluation test).
CASES = {
    "sigmoid": {"loss_type": "sigmoid", "label_smoothing": 0.1, "beta": 0.1},
    "ipo": {"loss_type": "ipo"},
    "tpo-l": {"loss_type": "tpo-l", "tpo_l_gamma": 0.3, "label_smoothing": 0.2},
    "sigmoid-no-reference": {"loss_type": "sigmoid", "tpo_alpha": 0.0},
}
_PACKED_KEYS = ("packed_input_ids", "packed_index", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k",
                "max_length_q", "max_length_k")  # fmt: skip


@pytest.fixture(scope="module")
def triples(gsm8k_rows):
    short = [r for r in gsm8k_rows(400) if len(r["question"]) < 140 and len(r["answer"]) < 180]

    def build(n: int) -> datasets.Dataset:
        rows = short[:n]
        return datasets.Dataset.from_dict(
            {
                "prompt": [f"Question: {r['question']}\nAnswer:" for r in rows],
                "chosen": [" " + r["answer"] for r in rows],
                "rejected": [" " + "\n".join(list(reversed(r["answer"].split("\n")))[1:]) for r in rows],
                "reference": [" " + r["answer"].split("\n")[-1] for r in rows],
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
        per_device_train_batch_size=3,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        max_steps=1,
        seed=0,
        bf16=False,
        gradient_checkpointing=False,
        max_length=256,
    )
    return {**defaults, **overrides}


def _build(tmp_path, tokenizer, twins, data, **config):
    stock_model, packed_model = twins()
    stock = StockTPOTrainer(
        model=stock_model,
        args=StockTPOConfig(**_common(tmp_path, "stock", **config)),
        train_dataset=data(),
        processing_class=tokenizer,
    )
    packed = TPOTrainer(
        model=packed_model,
        args=TPOConfig(**_common(tmp_path, "packed", **config), padding_free=True),
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
    cancels the chosen and rejected rewards (beta x mean log-prob, ~0.1 here), which a near-uniform tiny model
    makes almost equal, so the margin is ~1e-5 or less."""
    if key.endswith("rewards/margins"):
        prefix = key[: -len("margins")]
        return [metrics[prefix + "chosen"], metrics[prefix + "rejected"]]
    return []


def _loss_grads_metrics(trainer, batch, model=None):
    trainer.model.train()
    trainer.model.zero_grad()
    trainer._metrics["train"].clear()
    loss = trainer.compute_loss(model or trainer.model, dict(batch))
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return loss.detach(), grads, metrics


def _batches(stock, packed, n):
    rows = [stock.train_dataset[i] for i in range(n)]
    assert rows == [packed.train_dataset[i] for i in range(n)]  # TRL's own tokenization in both
    padded, packed_batch = stock.data_collator(rows), packed.data_collator(rows)
    for key in ("input_ids", "attention_mask", "completion_mask"):  # the same padded layout as stock's
        assert torch.equal(padded[key], packed_batch[key]), key
    return stock._prepare_inputs(padded), packed._prepare_inputs(packed_batch)


def test_a_hook_on_the_lm_head_is_honoured(tmp_path, tokenizer, twins, triples, monkeypatch):
    """A temperature hook on the LM head (both models): the packed loss and gradients still equal stock's, whose
    full logits run it; packing_hf's chunked head, which reads the head's weight, keeps the full logits."""
    stock, packed = _build(tmp_path, tokenizer, twins, lambda: triples(2), **CASES["sigmoid"])
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


@pytest.mark.parametrize("case", ["sigmoid", "tpo-l", "sigmoid-no-reference"])
def test_logits_loss_gradients_and_metrics_match_stock(
    tmp_path, tokenizer, twins, triples, case, assert_close, monkeypatch
):
    stock, packed = _build(tmp_path, tokenizer, twins, lambda: triples(3), **CASES[case])
    padded_batch, packed_batch = _batches(stock, packed, 3)
    rows = 3 if CASES[case].get("tpo_alpha", 1.0) != 0 else 2
    assert padded_batch["input_ids"].shape[0] == rows * 3
    real = padded_batch["attention_mask"].bool()
    # the packed row holds the real tokens only; stock's batch also computes padding
    assert packed_batch["packed_input_ids"].numel() == int(real.sum()) < real.numel()
    packed_keys = {k: packed_batch[k] for k in _PACKED_KEYS}
    with torch.no_grad():
        want = stock.model(input_ids=padded_batch["input_ids"], attention_mask=padded_batch["attention_mask"])
        got = PackedTripleForward(packed.model, packed_keys)(padded_batch["input_ids"], real.long())
    _close(got.logits[real], want.logits[real], "logits of every real token")
    assert not got.logits[~real].any()  # padding: zeros, never read by TRL's loss

    # the chunked LM head (chunked_loss=True, the default), in chunks of 16 tokens: the head projects nothing
    monkeypatch.setattr(loss_head, "chunk_size_for", lambda vocab_size, chunk_bytes=None: 16)
    projected = []
    # the tokens the head projected: the logits the model returns (a hook on the head would keep the full logits)
    hook = packed.model.register_forward_hook(lambda m, a, out: projected.append(out.logits.shape[-2]))
    loss_p, grads_p, metrics_p = _loss_grads_metrics(packed, packed_batch)
    hook.remove()
    assert projected == [0]
    loss_s, grads_s, metrics_s = _loss_grads_metrics(stock, padded_batch)
    _close(loss_p, loss_s, "loss")
    _close(grads_p, grads_s, "gradients")
    assert set(metrics_p) == set(metrics_s) >= {"logps/chosen", "logps/rejected", "entropy", "logits/chosen"}
    for key, value in metrics_s.items():
        assert_close(metrics_p[key], value, f"metric {key}", rel=REL, terms=_terms(key, metrics_s))
    if case == "sigmoid":  # negative control of the chunked head: a chunk loop dropping a token is caught
        real = loss_head._chunks
        monkeypatch.setattr(
            loss_head, "_chunks", lambda n, size: ((s + (s > 0), e) for s, e in real(n, size))
        )
        with pytest.raises(AssertionError, match="loss"):
            _close(_loss_grads_metrics(packed, packed_batch)[0], loss_s, "loss")
        monkeypatch.setattr(loss_head, "_chunks", real)

    # negative control: the model runs the packed row as one sequence (positions running on, attention not
    # split per segment), so every sequence sees the ones before it: the same comparisons fail
    packed._metrics["train"].clear()
    with torch.no_grad():
        packed.compute_loss(_OneSequence(packed.model), dict(packed_batch))
    leaked = {k: v[-1] for k, v in packed._metrics["train"].items()}
    for key in ("logps/rejected", "logits/rejected"):  # the rejected rows follow the chosen ones in the row
        with pytest.raises(AssertionError):
            _close(leaked[key], metrics_s[key], f"{key} of a leaking row")


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


class _GradientProbe(TrainerCallback):
    def __init__(self):
        self.grads = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append(
            torch.cat([p.grad.flatten().clone() for p in model.parameters() if p.grad is not None])
        )


@pytest.mark.parametrize("case", ["tpo-l"])
def test_gradient_accumulation_training_matches_stock(
    tmp_path, tokenizer, twins, triples, case, assert_close
):
    stock, packed = _build(
        tmp_path, tokenizer, twins, lambda: triples(8), **CASES[case],
        per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2, optim="sgd",
        learning_rate=0.05, logging_steps=1, gradient_checkpointing=True,
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
    for key in ("loss", "logps/chosen", "rewards/margins", "entropy", "mean_token_accuracy", "num_tokens"):
        for step, (log_s, log_p) in enumerate(zip(*logs, strict=True)):
            what = f"logged {key} of step {step}"
            assert_close(log_p[key], log_s[key], what, rel=REL, terms=_terms(key, log_s))


@dataclass
class _Recording(PaddingFreeTripleCollator):
    batches: list = field(default_factory=list, init=False, repr=False)

    def __call__(self, features, return_tensors=None):
        out = super().__call__(features, return_tensors)
        self.batches.append(int(out["packed_input_ids"].numel()))
        return out


@pytest.mark.parametrize("tpo_alpha", [1.0, 0.0])
def test_multipack_keeps_examples_whole_within_the_budget(tmp_path, tokenizer, twins, triples, tpo_alpha):
    _, model = twins()
    collator = _Recording(include_reference=tpo_alpha != 0)
    budget = 700
    trainer = TPOTrainer(
        model=model,
        args=TPOConfig(
            **_common(tmp_path, "multipack", max_steps=-1, num_train_epochs=1, logging_steps=1),
            max_tokens_per_batch=budget,
            tpo_alpha=tpo_alpha,
        ),  # fmt: skip
        data_collator=collator,
        train_dataset=triples(12),
        processing_class=tokenizer,
    )
    lengths = trainer._multipack_lengths_of(trainer.train_dataset)
    trainer.train()
    assert sum(collator.batches) == int(lengths.sum())  # every sequence of every example once, whole
    assert all(0 < b <= budget for b in collator.batches)
    assert len(collator.batches) == trainer.state.global_step < 12
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs and all(0 < h["packing_efficiency"] <= 1 and "logps/chosen" in h for h in logs)


def test_bad_inputs_are_named(tmp_path, tokenizer, twins, triples):
    _, model = twins()
    args = lambda **kw: TPOConfig(**_common(tmp_path, "bad"), **kw)  # noqa: E731
    pairs_only = datasets.Dataset.from_dict({"prompt": ["1+1="], "chosen": [" 2"], "rejected": [" 3"]})
    with pytest.raises(ValueError, match=r"no \['reference'\]"):
        TPOTrainer(model=model, args=args(), train_dataset=pairs_only, processing_class=tokenizer)
    small_config = AutoConfig.for_model(
        "llama", vocab_size=1000, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    small = AutoModelForCausalLM.from_config(small_config)
    with pytest.raises(ValueError, match="resize_token_embeddings"):
        TPOTrainer(model=small, args=args(), train_dataset=triples(2), processing_class=tokenizer)
    refused = {
        "padding_free=False": dict(args=args(padding_free=False)),
        "does not pack TPO rows": dict(args=args(), data_collator=lambda rows: rows),
        "pad_to_multiple_of=8": dict(args=args(pad_to_multiple_of=8)),
        "compute_metrics": dict(args=args(), compute_metrics=lambda p: {}),
        "loss_normalization": dict(args=args(loss_normalization="sample")),
        "include_reference=True but tpo_alpha=0.0": dict(
            args=args(tpo_alpha=0.0), data_collator=PaddingFreeTripleCollator()
        ),
    }
    for message, kwargs in refused.items():
        with pytest.raises(ValueError, match=message):
            TPOTrainer(model=model, train_dataset=triples(2), processing_class=tokenizer, **kwargs)
    t5 = AutoModelForCausalLM.from_config(small_config)
    t5.config.is_encoder_decoder = True
    with pytest.raises(ValueError, match="encoder-decoder"):
        TPOTrainer(model=t5, args=args(), train_dataset=triples(2), processing_class=tokenizer)


def test_collator_truncates_as_stock_and_refuses_what_it_cannot_pack(tmp_path, tokenizer, twins, triples):
    stock, packed = _build(tmp_path, tokenizer, twins, lambda: triples(3), max_length=40)
    for mode in ("keep_start", "keep_end"):
        stock.data_collator.truncation_mode = mode
        collator = PaddingFreeTripleCollator(
            max_length=40,
            overflow="truncate",
            truncation_mode=mode,
            pad_token_id=stock.data_collator.pad_token_id,
        )
        rows = [stock.train_dataset[i] for i in range(3)]
        want, got = stock.data_collator(rows), collator(rows)
        for key in ("input_ids", "attention_mask", "completion_mask"):
            assert torch.equal(got[key], want[key]), (mode, key)
        assert collator.stats["truncated_samples"] > 0
    with pytest.raises(ValueError, match="max_length=40"):
        PaddingFreeTripleCollator(max_length=40)(rows)
    with pytest.raises(ValueError, match=r"lacks \['reference_ids'\]"):
        PaddingFreeTripleCollator()([{"prompt_ids": [1], "chosen_ids": [2], "rejected_ids": [3]}])
    with pytest.raises(ValueError, match="pad_to_multiple_of"):
        PaddingFreeTripleCollator(pad_to_multiple_of=8)


@pytest.mark.parametrize("case", ["sigmoid", "ipo"])
def test_evaluation_matches_stock(tmp_path, tokenizer, twins, triples, case, assert_close):
    stock_model, packed_model = twins()
    results = []
    for trainer, conf, model in (
        (StockTPOTrainer, StockTPOConfig, stock_model),
        (TPOTrainer, TPOConfig, packed_model),
    ):
        trainer = trainer(
            model=model,
            args=conf(**_common(tmp_path, "eval", per_device_eval_batch_size=4, **CASES[case])),
            train_dataset=triples(2),
            eval_dataset=triples(6),
            processing_class=tokenizer,
        )
        results.append(trainer.evaluate())
    want, got = results
    assert set(got) == set(want)
    for key, value in want.items():
        if "time" not in key and "per_second" not in key:  # timings
            assert_close(got[key], value, key, rel=REL, terms=_terms(key, want))


def test_multipack_evaluation_matches_stock(tmp_path, tokenizer, twins, triples, assert_close):
    # all four eval examples fit one multipack batch, as in stock's one padded batch of four: same metrics
    stock_model, packed_model = twins()
    config = _common(tmp_path, "eval-multipack", per_device_eval_batch_size=4, **CASES["tpo-l"])
    stock = StockTPOTrainer(
        model=stock_model, args=StockTPOConfig(**config), train_dataset=triples(2), processing_class=tokenizer
    )
    packed = TPOTrainer(
        model=packed_model,
        args=TPOConfig(**config, max_tokens_per_batch=4096),
        train_dataset=triples(2),
        processing_class=tokenizer,
    )
    want, got = stock.evaluate(triples(4)), packed.evaluate(triples(4))
    assert set(got) == set(want) and "eval_logps/chosen" in got
    for key, value in want.items():
        if "time" not in key and "per_second" not in key:  # timings
            assert_close(got[key], value, key, rel=REL, terms=_terms(key, want))
