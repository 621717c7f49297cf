"""packing_hf.Trainer on real GSM8K data with a tiny llama (SmolLM2 tokenizer vocabulary), CPU, fp32.

What stock transformers.Trainer already does with PaddingFreeCollator, what the subclass fixes (loss
masks kept, multipack batches, exact step counts, every sample once per epoch), the packing metrics, and
the pre-flight check (refuse, switch, prepare).
"""

from __future__ import annotations

import functools
import math

import datasets
import pytest
import torch
import transformers

import packing_hf
from packing_hf.integrations.callbacks import STATS_KEY


def _args(tmp_path, **overrides) -> packing_hf.TrainingArguments:
    values = dict(
        output_dir=str(tmp_path / "out"),
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        logging_steps=1,
        seed=0,
    )
    values.update(overrides)
    return packing_hf.TrainingArguments(**values)


def _gsm8k_qa(gsm8k_rows, tokenizer, n: int, offset: int = 0) -> datasets.Dataset:
    """GSM8K rows as prompt + answer token ids with a completion_mask (0 on the question) and an idx."""
    rows = gsm8k_rows(n, offset)
    prompts = tokenizer([f"Question: {r['question']}\nAnswer:" for r in rows])["input_ids"]
    answers = tokenizer([f" {r['answer']}{tokenizer.eos_token}" for r in rows])["input_ids"]
    return datasets.Dataset.from_dict(
        {
            "input_ids": [p + a for p, a in zip(prompts, answers, strict=True)],
            "completion_mask": [[0] * len(p) + [1] * len(a) for p, a in zip(prompts, answers, strict=True)],
            "idx": list(range(n)),
        }
    )


def test_stock_trainer_accepts_padding_free_collator(gsm8k_tokenized, tiny_llama, tmp_path):
    """Plain transformers.Trainer + PaddingFreeCollator: the packed keys reach the model, and the
    num_items_in_batch it passes counts exactly the trained labels of the packed row."""
    dataset = datasets.Dataset.from_list(gsm8k_tokenized[:4])
    model = tiny_llama()
    seen = []

    def spy(module, args, kwargs):
        seen.append({k: v for k, v in kwargs.items() if k != "past_key_values"})

    model.register_forward_pre_hook(spy, with_kwargs=True)
    args = transformers.TrainingArguments(
        str(tmp_path / "stock"), per_device_train_batch_size=2, max_steps=1, report_to="none",
        save_strategy="no", use_cpu=True, disable_tqdm=True,
    )  # fmt: skip
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=dataset, data_collator=packing_hf.PaddingFreeCollator()
    )
    trainer.train()
    kwargs = seen[0]
    assert {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "position_ids"} <= kwargs.keys()
    assert "attention_mask" not in kwargs
    assert kwargs["input_ids"].shape[0] == 1
    cu = kwargs["cu_seq_lens_q"].tolist()
    assert len(cu) == 3 and cu[-1] == kwargs["input_ids"].shape[1]
    # one label per sample is masked (its first token) and the count covers exactly the others
    assert int(kwargs["num_items_in_batch"]) == int((kwargs["labels"] != -100).sum()) == cu[-1] - 2


def test_loss_mask_columns_survive(gsm8k_rows, tokenizer, tiny_llama, tmp_path):
    """Stock drops completion_mask (model.forward does not take it), training on the questions; the
    subclass keeps the columns the collator consumes."""
    dataset = _gsm8k_qa(gsm8k_rows, tokenizer, 3)
    model = tiny_llama()
    stock = transformers.Trainer(
        model=model,
        args=transformers.TrainingArguments(
            str(tmp_path / "s"), per_device_train_batch_size=3, report_to="none"
        ),
        train_dataset=dataset,
        data_collator=packing_hf.PaddingFreeCollator(),
    )
    ours = packing_hf.Trainer(
        model=model,
        args=_args(tmp_path, per_device_train_batch_size=3, packing_metrics=False),
        train_dataset=dataset,
        data_collator=packing_hf.PaddingFreeCollator(),
    )
    stock_batch = next(iter(stock.get_train_dataloader()))
    batch = next(iter(ours.get_train_dataloader()))
    assert STATS_KEY not in batch
    for b in (stock_batch, batch):
        assert sorted(b["cu_seq_lens_q"].tolist()) == b["cu_seq_lens_q"].tolist()
    # stock trains on every token but the sample starts; packing_hf only on the answers
    assert int((stock_batch["labels"] != -100).sum()) == batch["input_ids"].numel() - 3
    ids, labels, cu = batch["input_ids"][0], batch["labels"][0], batch["cu_seq_lens_q"].tolist()
    order = {tuple(dataset[i]["input_ids"]): i for i in range(len(dataset))}
    for start, end in zip(cu[:-1], cu[1:], strict=True):
        row = dataset[order[tuple(ids[start:end].tolist())]]
        expected = torch.tensor(
            [t if m else -100 for t, m in zip(row["input_ids"], row["completion_mask"], strict=True)]
        )
        expected[0] = -100
        assert torch.equal(labels[start:end], expected)


def test_multipack_training_on_gsm8k(gsm8k_rows, tokenizer, tiny_llama, recording_collator, tmp_path):
    """Multipack with gradient accumulation over two epochs: exact step count and LR schedule, every sample
    once per epoch within the budget, loss decreases, parameters change, packing metrics logged."""
    budget, gas, epochs = 512, 2, 2
    dataset = _gsm8k_qa(gsm8k_rows, tokenizer, 8, offset=100)
    lengths = [len(x) for x in dataset["input_ids"]]
    model = tiny_llama()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    collator = recording_collator(pad_token_id=tokenizer.pad_token_id)
    args = _args(
        tmp_path, max_tokens_per_batch=budget, gradient_accumulation_steps=gas, num_train_epochs=epochs,
        learning_rate=3e-3, warmup_steps=0, lr_scheduler_type="linear",
    )  # fmt: skip
    trainer = packing_hf.Trainer(model=model, args=args, train_dataset=dataset, data_collator=collator)
    batches_per_epoch = len(trainer.get_train_dataloader())
    collator.batches.clear()
    result = trainer.train()

    assert batches_per_epoch >= math.ceil(sum(lengths) / budget)
    assert result.global_step == epochs * math.ceil(batches_per_epoch / gas)
    assert trainer.lr_scheduler.get_last_lr()[0] == 0.0  # the schedule was planned for exactly these steps
    assert len(collator.batches) == epochs * batches_per_epoch
    for epoch in range(epochs):
        window = collator.batches[epoch * batches_per_epoch : (epoch + 1) * batches_per_epoch]
        assert sorted(i for b in window for i in b) == list(range(len(dataset)))
        assert all(sum(lengths[i] for i in b) <= budget for b in window)
    assert collator.batches[:batches_per_epoch] != collator.batches[batches_per_epoch:]  # reshuffled

    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == result.global_step
    assert sum(h["loss"] for h in logs[-2:]) / 2 < logs[0]["loss"] - 0.1
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert sum(h["real_tokens_per_step"] for h in logs) == epochs * sum(lengths)
    assert all(0 < h["packing_efficiency"] <= 1 and h["padding_avoided_per_step"] >= 0 for h in logs)
    # the packing_efficiency over the run is the plan's
    capacity = epochs * batches_per_epoch * budget
    assert sum(h["real_tokens_per_step"] for h in logs) / capacity == pytest.approx(
        trainer._multipack_sampler.efficiency(), rel=1e-9
    )


def _small_vocab(rows: list[dict], vocab: int = 128) -> list[dict]:
    """Real GSM8K lengths, token ids folded into a small vocabulary (for tests about steps, not learning)."""
    return [{"input_ids": [t % vocab for t in row["input_ids"]]} for row in rows]


def test_multipack_max_steps_spans_epochs(gsm8k_tokenized, tiny_llama, tmp_path):
    """max_steps beyond one epoch: the Trainer re-plans each epoch and the schedule ends exactly at max_steps."""
    dataset = datasets.Dataset.from_list(_small_vocab(gsm8k_tokenized[:6]))
    trainer = packing_hf.Trainer(
        model=tiny_llama(vocab_size=128),
        args=_args(
            tmp_path,
            max_tokens_per_batch=600,
            max_steps=5,
            learning_rate=1e-3,
            per_device_eval_batch_size=3,
            multipack_cost_model="flops",
        ),
        train_dataset=dataset,
        eval_dataset=dataset,
    )
    assert isinstance(trainer.data_collator, packing_hf.PaddingFreeCollator)  # the default with a budget
    per_epoch = len(trainer.get_train_dataloader())
    assert per_epoch < 5
    result = trainer.train()
    assert result.global_step == 5
    assert trainer.lr_scheduler.get_last_lr()[0] == 0.0
    assert trainer.state.epoch == pytest.approx(5 / per_epoch)
    # a cost model: the sampler balances by cost; every log has the (single-rank) spread and forward time
    assert trainer._multipack_sampler.balance == "cost"
    assert trainer._multipack_sampler.cost_model == packing_hf.CostModel.from_config(trainer.model.config)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert all(h["rank_cost_max_over_mean"] == h["rank_forward_time_max_over_mean"] == 1.0 for h in logs)
    assert all(h["forward_seconds_max"] > 0 for h in logs)
    # evaluation keeps stock's loader (per_device_eval_batch_size samples flattened per batch)
    metrics = trainer.evaluate()
    assert math.isfinite(metrics["eval_loss"]) and "packing_efficiency" not in metrics


def test_bad_packing_arguments(gsm8k_tokenized, tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="max_tokens_per_batch must be an int >= 1 or None, got 0"):
        _args(tmp_path, max_tokens_per_batch=0)
    with pytest.raises(ValueError, match="packing_preflight='maybe'"):
        _args(tmp_path, packing_preflight="maybe")
    with pytest.raises(ValueError, match="multipack_cost_model: cost model 'quadratic'"):
        _args(tmp_path, multipack_cost_model="quadratic")
    with pytest.raises(ValueError, match="does not flatten batches"):
        packing_hf.Trainer(
            model=tiny_llama(),
            args=_args(tmp_path, max_tokens_per_batch=512),
            train_dataset=gsm8k_tokenized[:4],
            data_collator=transformers.default_data_collator,
        )
    too_long = [{"input_ids": list(range(1, 300))}, {"input_ids": [1, 2, 3]}]
    trainer = packing_hf.Trainer(
        model=tiny_llama(), args=_args(tmp_path, max_tokens_per_batch=128), train_dataset=too_long
    )
    with pytest.raises(ValueError, match="299"):
        trainer.get_train_dataloader()


def _naive_causal_attention(module, query, key, value, attention_mask, **kwargs):
    """A custom attention that ignores every mask: one causal attention over the whole packed row."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kwargs = {k: v for k, v in kwargs.items() if k in ("dropout", "scaling")}
    return sdpa_attention_forward(module, query, key, value, None, is_causal=True, **kwargs)


def test_preflight_refuses_or_switches_a_leaking_attention(gsm8k_tokenized, tiny_llama, tmp_path):
    transformers.AttentionInterface.register("packing_hf_test_naive_causal", _naive_causal_attention)
    data = _small_vocab(gsm8k_tokenized[:4])

    def trainer(mode):
        model = tiny_llama(vocab_size=128)
        model.set_attn_implementation("packing_hf_test_naive_causal")
        args = _args(tmp_path, max_tokens_per_batch=1024, max_steps=1, packing_preflight=mode)
        return packing_hf.Trainer(model=model, args=args, train_dataset=data)

    with pytest.raises(ValueError, match="packed samples would see each other"):
        trainer("error").train()
    switched = trainer("switch")
    seen = []
    switched.model.register_forward_pre_hook(
        lambda module, args: seen.append(module.config._attn_implementation), with_kwargs=False
    )
    switched.train()
    assert seen == [packing_hf.ATTENTION_NAME]  # trained on the varlen attention
    # and given back as the user passed it
    assert switched.model.config._attn_implementation == "packing_hf_test_naive_causal"
    assert switched.packing_preparation is None


def test_preflight_refuses_dsa_trains_a_hybrid_and_prepares_opt(tmp_path):
    from transformers import AutoModelForCausalLM

    from packing_hf.architectures import tiny_config

    data = [{"input_ids": list(range(1, n))} for n in (9, 14, 6, 11)]
    dsa = AutoModelForCausalLM.from_config(tiny_config("deepseek_v32"))
    for mode in ("switch", "error"):
        args = _args(tmp_path, max_tokens_per_batch=64, max_steps=1, packing_preflight=mode)
        with pytest.raises(ValueError, match="without packing"):
            packing_hf.Trainer(model=dsa, args=args, train_dataset=data).train()

    # hybrid Mamba2: the pre-flight judges the prepared tiny copy (exact), prepares the model (its Mamba
    # mixers run per sample) and trains one step; the model is given back stock
    bamba = AutoModelForCausalLM.from_config(tiny_config("bamba"), attn_implementation="sdpa")
    args = _args(tmp_path, max_tokens_per_batch=64, max_steps=1, packing_preflight="error")
    trainer = packing_hf.Trainer(model=bamba, args=args, train_dataset=data)
    split = []
    bamba.register_forward_pre_hook(
        lambda module, args: split.append(trainer.packing_preparation.split_mixers)
    )
    result = trainer.train()
    assert split == [True] and math.isfinite(result.training_loss)
    assert packing_hf.check_packing(bamba, lengths=(5, 9), gradients=False).leaked  # given back: stock again

    # stock OPT ignores position_ids in its mask; the pre-flight prepares it (per-sample masks) and trains
    opt = AutoModelForCausalLM.from_config(tiny_config("opt"), attn_implementation="sdpa")
    args = _args(tmp_path, max_tokens_per_batch=64, max_steps=1, packing_preflight="error")
    trainer = packing_hf.Trainer(model=opt, args=args, train_dataset=data)
    fixed = []
    opt.register_forward_pre_hook(lambda module, args: fixed.append(trainer.packing_preparation.mask_fix))
    trainer.train()
    assert fixed == [True]
    assert opt.config._attn_implementation == "sdpa"
    assert packing_hf.check_packing(opt, lengths=(5, 9)).leaked  # given back: stock OPT again


# --------------------------------------------------------------------------------------------------
# the model after training: a normal model again (padding, generate, save -> stock load)


def _left_padded(rows: list[list[int]], pad: int = 0) -> dict[str, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize(("model_type", "attn"), [("llama", "sdpa"), ("opt", "eager")])
def test_a_prepared_model_still_pads_and_generates(model_type, attn):
    """Prepared for packing, a model still takes ordinary left-padded batches and generates as stock."""
    from packing_hf.architectures import build_tiny_model

    model = build_tiny_model(model_type, attn)
    model.generation_config.pad_token_id = 0
    batch = _left_padded([[5, 6, 7, 8, 9], [11, 12], [13, 14, 15]])
    with torch.no_grad():
        stock_logits = model(**batch).logits
        stock = model.generate(**batch, max_new_tokens=6, do_sample=False)
        with packing_hf.prepare_model_for_packing(model):
            assert torch.equal(model(**batch).logits, stock_logits)
            assert torch.equal(model.generate(**batch, max_new_tokens=6, do_sample=False), stock)
            # and a packed row still gets its guards
            with pytest.raises(ValueError, match="attention_mask with padding"):
                model(
                    input_ids=torch.arange(3, 12)[None],
                    position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0, 1]]),
                    attention_mask=torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1, 0]]),
                )


def test_after_train_the_model_generates_saves_and_loads_as_stock(gsm8k_tokenized, tmp_path):
    """After packing_hf.Trainer.train(): hooks gone, use_cache as the user had it, greedy generation equal to
    an unprepared copy of the trained weights, and the saved folder loads with stock transformers alone."""
    import json
    import subprocess
    import sys

    from packing_hf.architectures import build_tiny_model

    model = build_tiny_model("opt", "sdpa").train()
    assert model.config.use_cache
    data = _small_vocab(gsm8k_tokenized[:12], vocab=512)
    args = _args(tmp_path, max_tokens_per_batch=1024, max_steps=2)
    trainer = packing_hf.Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    assert getattr(model, "_packing_hf_preparation", None) is None and not model._forward_pre_hooks
    assert model.config.use_cache and model.config._attn_implementation == "sdpa"

    model.eval().generation_config.pad_token_id = 0
    batch = _left_padded([[5, 6, 7, 8, 9], [11, 12]])
    with torch.no_grad():
        after = model.generate(**batch, max_new_tokens=5, do_sample=False)
    copy = build_tiny_model("opt", "sdpa")
    copy.load_state_dict(model.state_dict())
    copy.generation_config.pad_token_id = 0
    with torch.no_grad():
        assert torch.equal(copy.generate(**batch, max_new_tokens=5, do_sample=False), after)

    saved = tmp_path / "saved"
    trainer.save_model(str(saved))
    assert json.loads((saved / "config.json").read_text())["use_cache"] is True
    # a clean interpreter that never imports packing_hf loads it and gets the same greedy tokens
    script = (
        "import sys, torch, transformers\n"
        "m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], attn_implementation='sdpa').eval()\n"
        "m.generation_config.pad_token_id = 0\n"
        "ids = torch.tensor([[0, 0, 0, 5, 6, 7, 8, 9][-5:], [0, 0, 0, 11, 12]])\n"
        "mask = (torch.arange(5)[None] >= torch.tensor([[0], [3]])).long()\n"
        "print(m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False).tolist())\n"
        "assert 'packing_hf' not in sys.modules\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(saved)], capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == after.tolist()


def test_an_uneven_eval_set_takes_dataloader_drop_last_which_counts_what_it_leaves_out(caplog):
    """Three samples that fill a batch each cannot give 2 ranks the same number of batches without repeating one:
    refused, naming dataloader_drop_last (the sampler's own advice, drop_last=True, was not taken by the eval
    sampler); with it, one batch is left out, counted and logged, and each kept sample is seen once. Negative
    control: an eval set that splits evenly loses nothing to dataloader_drop_last."""
    from packing_hf.integrations.evaluation import eval_sampler

    lengths = [200, 180, 190]
    with pytest.raises(
        ValueError, match=r"evaluation: cannot give each of the 2 ranks .*dataloader_drop_last=True"
    ):
        eval_sampler(lengths, 300, 2, 0, overflow="error", drop_last=False)
    with caplog.at_level("WARNING", logger="packing_hf"):
        ranks = [eval_sampler(lengths, 300, 2, rank, overflow="error", drop_last=True) for rank in (0, 1)]
    seen = [i for sampler in ranks for batch in sampler for i in batch]
    dropped = ranks[0].stats()
    assert len(ranks[0]) == len(ranks[1]) == 1 and len(set(seen)) == len(seen) == 2
    (left,) = set(range(3)) - set(seen)
    assert (dropped["dropped_samples"], dropped["dropped_tokens"]) == (1, lengths[left])
    assert f"leaves 1 of them ({lengths[left]} tokens) out: the eval loss is over the other 2" in caplog.text

    even = [eval_sampler([200, 180, 190, 100], 300, 2, r, overflow="error", drop_last=True) for r in (0, 1)]
    assert sorted(i for sampler in even for batch in sampler for i in batch) == [0, 1, 2, 3]
    assert even[0].stats()["dropped_samples"] == 0


def test_evaluate_reports_the_eval_samples_dataloader_drop_last_left_out(tiny_llama, tmp_path):
    """The count reaches the metrics (eval_dropped_samples), and eval_loss is the token mean over the kept samples
    of this rank: rank 0 of 2 (the data-parallel world given to the trainer; the sampler is the one above)."""
    generator = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(0, 128, (n,), generator=generator).tolist()} for n in (200, 180, 190)]
    model = tiny_llama(vocab_size=128).eval()
    args = _args(tmp_path, max_tokens_per_batch=300, dataloader_drop_last=True)
    trainer = packing_hf.Trainer(model=model, args=args, train_dataset=rows, eval_dataset=rows)
    trainer._data_parallel_world = lambda: (2, 0)
    metrics = trainer.evaluate()
    assert metrics["eval_dropped_samples"] == 1
    (kept,) = [
        i for batch in trainer.get_eval_dataloader().batch_sampler for i in batch
    ]  # rank 0's one sample
    ids = torch.tensor([rows[kept]["input_ids"]])
    with torch.no_grad():
        assert metrics["eval_loss"] == pytest.approx(float(model(input_ids=ids, labels=ids).loss), rel=1e-5)
    trainer.args.dataloader_drop_last = False
    with pytest.raises(ValueError, match="dataloader_drop_last=True"):
        trainer.evaluate()


def test_eval_is_packed_and_its_loss_is_the_padded_token_mean(gsm8k_tokenized, tiny_llama, tmp_path):
    data = _small_vocab(gsm8k_tokenized[:24], vocab=128)
    eval_rows = _small_vocab(gsm8k_tokenized[24:40], vocab=128)
    model = tiny_llama(vocab_size=128).eval()
    seen = []
    model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    args = _args(tmp_path, max_tokens_per_batch=512, max_steps=1, per_device_eval_batch_size=3)
    trainer = packing_hf.Trainer(model=model, args=args, train_dataset=data, eval_dataset=eval_rows)
    packed = trainer.evaluate()["eval_loss"]
    assert all(shape[0] == 1 for shape in seen) and sum(shape[1] for shape in seen) == sum(
        len(r["input_ids"]) for r in eval_rows
    )

    # the reference: every eval sample alone, summed token losses / predicted tokens
    total, count = 0.0, 0
    with torch.no_grad():
        for row in eval_rows:
            ids = torch.tensor([row["input_ids"]])
            n = ids.shape[1] - 1
            total += float(model(input_ids=ids, labels=ids, use_cache=False).loss) * n
            count += n
    assert packed == pytest.approx(total / count, rel=1e-5)

    stock = packing_hf.Trainer(
        model=model, args=_args(tmp_path, max_tokens_per_batch=512, packing_eval=False), train_dataset=data,
        eval_dataset=eval_rows, data_collator=packing_hf.PaddingFreeCollator(),
    )  # fmt: skip
    seen.clear()
    stock.evaluate()
    assert len(seen) == math.ceil(len(eval_rows) / 8)  # stock: per_device_eval_batch_size samples per batch


def test_a_padding_collator_leaves_the_router_loss_of_an_moe_model_as_stock(right_padded_batch, tmp_path):
    """Mixtral with router_aux_loss_coef=0.5 through packing_hf.Trainer and PaddingFreeCollator(pad_to_multiple_of):
    the first step's loss is stock's on the same samples right-padded (the model's loss with their attention_mask:
    the padding is not counted by the router's load-balancing loss). Negative control: the same padded rows
    without the padding's count differ."""
    from packing_hf.architectures import build_tiny_model

    generator = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, 500, (n,), generator=generator).tolist() for n in (13, 29, 7, 21)]
    dataset = datasets.Dataset.from_dict({"input_ids": rows})

    def moe():
        torch.manual_seed(0)
        model = build_tiny_model("mixtral", "sdpa").train()
        model.config.output_router_logits = True
        model.router_aux_loss_coef = 0.5
        return model

    def first_loss(collator) -> float:
        args = _args(tmp_path, per_device_train_batch_size=4, max_steps=1, remove_unused_columns=False)
        trainer = packing_hf.Trainer(model=moe(), args=args, train_dataset=dataset, data_collator=collator)
        trainer.train()
        return next(h["loss"] for h in trainer.state.log_history if "loss" in h)

    padding = packing_hf.PaddingFreeCollator(pad_to_multiple_of=64)

    def unmarked(features):
        from packing_hf.varlen import PADDING_KEY

        return {k: v for k, v in padding(features).items() if k != PADDING_KEY}

    with torch.no_grad():  # stock's first step: the loss of the initial weights on the padded batch
        stock = float(moe()(**right_padded_batch(rows), use_cache=False).loss)
    packed = first_loss(padding)
    assert padding.stats["padding_tokens"] > 0
    assert math.isclose(packed, stock, rel_tol=1e-6), (packed, stock)
    leaky = first_loss(unmarked)
    assert abs(leaky - stock) > 1e-4, (leaky, stock)


@pytest.mark.parametrize("coefficient", [0.5, 0.0])
def test_packing_hfs_own_loss_refuses_a_router_loss_it_would_leave_out(tmp_path, coefficient):
    """loss_normalization='sample' (or loss_weights) computes the loss from the logits (no labels to the model),
    which would leave out the router load-balancing loss an MoE model adds to its own: refused by name at
    set-up. Control: router_aux_loss_coef=0 leaves nothing out and is accepted."""
    from packing_hf.architectures import build_tiny_model

    model = build_tiny_model("mixtral", "sdpa")
    model.config.output_router_logits = True
    model.router_aux_loss_coef = coefficient
    dataset = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5, 6, 7]]})
    args = _args(tmp_path, max_steps=1, loss_normalization="sample", remove_unused_columns=False)
    build = functools.partial(packing_hf.Trainer, model=model, args=args, train_dataset=dataset)
    if coefficient:
        with pytest.raises(ValueError, match="router load-balancing loss.*output_router_logits=False"):
            build()
    else:
        build()
