"""The packed TRL trainers and ``max_length``: a default never cuts or drops a sample silently.

TRL's configs default ``max_length`` to 1024: ``SFTTrainer`` truncates every longer sample when it prepares
the dataset and ``RewardTrainer`` leaves the pair out, both without a count. With ``max_tokens_per_batch``
the budget bounds a sample instead (a longer one follows ``packing_overflow``); a ``max_length`` the user sets
keeps TRL's meaning and what it cuts is counted (``max_length_stats``), logged and in the training logs.
Real SmolLM2 tokenizer, tiny llama, CPU.
"""

from __future__ import annotations

import logging
from pathlib import Path

import datasets
import pytest

trl = pytest.importorskip("trl")

import packing_hf  # noqa: E402


def _config(tmp_path, **overrides) -> packing_hf.SFTConfig:
    values = dict(
        output_dir=str(tmp_path / "sft"), report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True,
        logging_steps=1, seed=0, max_steps=1, per_device_train_batch_size=1,
    )  # fmt: skip
    values.update(overrides)
    return packing_hf.SFTConfig(**values)


@pytest.fixture(scope="module")
def long_data(gsm8k_rows):
    """A short prompt/completion pair, one whose completion is longer than TRL's 1024 tokens, and one whose
    prompt alone is (TRL's truncation leaves it no trained token)."""
    rows = gsm8k_rows(12)
    answers = " ".join(r["answer"] for r in rows)  # several thousand characters of real text
    return datasets.Dataset.from_dict(
        {
            "prompt": ["Question: 1+1?\nAnswer:", "Question: show every step.\nAnswer:", answers],
            "completion": [" 2", " " + answers, " 7"],
        }
    )


@pytest.fixture(scope="module")
def whole(long_data, tokenizer, tiny_llama, tmp_path_factory) -> list[list[int]]:
    """``long_data``'s samples as stock TRL prepares them with max_length=None: the reference, nothing cut (each
    row on its own: the first two of them are what stock makes of ``long_data.select([0, 1])``)."""
    args = trl.SFTConfig(str(tmp_path_factory.mktemp("stock")), max_length=None, report_to="none", use_cpu=True)
    stock = trl.SFTTrainer(model=tiny_llama(), args=args, train_dataset=long_data, processing_class=tokenizer)
    return list(stock.train_dataset["input_ids"])


CONFIGS = ["SFTConfig", "DPOConfig", "KTOConfig", "TPOConfig", "RewardConfig", "ORPOConfig", "CPOConfig"]


@pytest.mark.parametrize("name", CONFIGS)
def test_config_max_length_default_follows_the_budget(name):
    from packing_hf.integrations import orpo, tpo

    config = {"TPOConfig": tpo.TPOConfig, "ORPOConfig": orpo.ORPOConfig, "CPOConfig": orpo.CPOConfig}.get(
        name
    )
    config = config or getattr(packing_hf, name)
    common = dict(output_dir="out", report_to="none", use_cpu=True)
    assert config(**common).max_length == 1024  # TRL's default without a budget
    assert config(**common, max_tokens_per_batch=4096).max_length is None
    # a value the user sets keeps TRL's meaning, whatever the budget
    assert config(**common, max_tokens_per_batch=4096, max_length=1024).max_length == 1024
    assert config(**common, max_tokens_per_batch=4096, max_length=512).max_length == 512
    if name == "SFTConfig":  # TRL's own packing needs a row length: the budget
        assert config(**common, max_tokens_per_batch=4096, packing=True).max_length == 4096


def test_budget_without_max_length_trains_a_long_sample_whole(long_data, whole, tokenizer, tiny_llama, tmp_path, feature_recording_collator):
    data, whole = long_data.select([0, 1]), whole[:2]
    assert max(map(len, whole)) > 1024  # longer than TRL's default max_length
    collator = feature_recording_collator(pad_token_id=tokenizer.pad_token_id)
    trainer = packing_hf.SFTTrainer(
        model=tiny_llama(),
        args=_config(tmp_path, max_tokens_per_batch=4096),
        train_dataset=data,
        processing_class=tokenizer,
        data_collator=collator,
    )
    assert trainer.args.max_length is None
    trainer.train()
    trained = sorted((f["input_ids"] for f in collator.features[0]), key=len)
    assert trained == sorted(whole, key=len)  # one batch of both samples, every token of each


def test_a_sample_longer_than_the_budget_is_refused_by_name(long_data, tokenizer, tiny_llama, tmp_path):
    trainer = packing_hf.SFTTrainer(
        model=tiny_llama(),
        args=_config(tmp_path, max_tokens_per_batch=1024),
        train_dataset=long_data.select([0, 1]),
        processing_class=tokenizer,
    )
    with pytest.raises(ValueError, match=r"sample 1 has \d+ tokens > max_tokens_per_batch=1024"):
        trainer.train()


@pytest.mark.parametrize("explicit", [True, False], ids=["max_length_set", "trl_default"])
def test_max_length_truncation_is_counted_and_logged(
    explicit, long_data, whole, tokenizer, tiny_llama, tmp_path, caplog
):
    cut = [len(ids) - 1024 for ids in whole if len(ids) > 1024]
    assert len(cut) == 2
    overrides = dict(max_length=1024, max_tokens_per_batch=2048) if explicit else {}
    with caplog.at_level(logging.WARNING, logger="packing_hf.integrations"):
        trainer = packing_hf.SFTTrainer(
            model=tiny_llama(),
            args=_config(tmp_path, **overrides),
            train_dataset=long_data,
            eval_dataset=long_data.select([0, 1]),
            processing_class=tokenizer,
        )
    # TRL's meaning kept: both cut to 1024 tokens, the one left with no trained token dropped
    assert sorted(map(len, trainer.train_dataset["input_ids"])) == sorted([len(whole[0]), 1024])
    stats = {"truncated_samples": 2, "truncated_tokens": sum(cut), "dropped_samples": 1}
    assert trainer.max_length_stats["train"] == stats
    warning = [r.getMessage() for r in caplog.records if "max_length=1024" in r.getMessage()]
    assert len(warning) == 2 and "truncated (keep_start) 2 of 3 samples" in warning[0], warning
    assert "raise max_length or set it to None" in warning[0] and warning[1].startswith("eval dataset:")
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h][0]
    assert {k: logged[f"max_length_{k}"] for k in stats} == stats
    # the evaluation set's own counts, in its metrics (the one long sample of its two)
    eval_stats = {"truncated_samples": 1, "truncated_tokens": len(whole[1]) - 1024, "dropped_samples": 0}
    assert trainer.max_length_stats["eval"] == eval_stats
    metrics = trainer.evaluate()
    assert {k: metrics[f"eval_max_length_{k}"] for k in eval_stats} == eval_stats
    assert "max_length_truncated_samples" not in metrics  # the training set's are in the training logs only


def test_trl_bfd_packing_cut_is_counted(long_data, whole, tokenizer, tiny_llama, tmp_path):
    data, whole = long_data.select([0, 1]), whole[:2]
    trainer = packing_hf.SFTTrainer(
        model=tiny_llama(),
        args=_config(tmp_path, packing=True, padding_free=True, max_length=1024),
        train_dataset=data,
        processing_class=tokenizer,
    )
    long = max(map(len, whole))
    assert trainer.max_length_stats["train"] == {
        "truncated_samples": 1,
        "truncated_tokens": long - 1024,
        "dropped_samples": 0,
    }
    # TRL's bfd rows: the long sample cut to one row of 1024 tokens (what TRL itself does)
    assert sorted(n for row in trainer.train_dataset["seq_lengths"] for n in row) == sorted(
        [min(len(ids), 1024) for ids in whole]
    )


def test_reward_max_length_filter_is_counted(long_data, tokenizer, tmp_path, caplog):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.for_model(
        "llama", vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    texts = [p + c for p, c in zip(long_data["prompt"], long_data["completion"], strict=True)]
    pairs = datasets.Dataset.from_dict({"chosen": texts, "rejected": [t + " no" for t in texts]})
    lengths = [len(ids) for ids in tokenizer(texts)["input_ids"]]
    too_long = sum(n + 1 > 1024 for n in lengths)  # TRL adds the EOS token to every sequence
    assert too_long == 2
    args = packing_hf.RewardConfig(
        str(tmp_path / "reward"), max_length=1024, max_tokens_per_batch=2048, max_steps=1, logging_steps=1,
        report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True,
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="packing_hf.integrations"):
        trainer = packing_hf.RewardTrainer(
            model=AutoModelForSequenceClassification.from_config(config),
            args=args,
            train_dataset=pairs,
            processing_class=tokenizer,
        )
    assert len(trainer.train_dataset) == len(pairs) - too_long  # TRL's meaning kept: the pairs left out
    assert trainer.max_length_stats["train"] == {"dropped_samples": too_long}
    warning = [r.getMessage() for r in caplog.records if "max_length=1024" in r.getMessage()]
    assert len(warning) == 1 and f"left out {too_long} of 3 reward pairs" in warning[0], warning
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h][0]
    assert logged["max_length_dropped_samples"] == too_long


@pytest.mark.parametrize(
    "keys", [{"max_tokens_per_batch": 4096}, {"sample_packing": True}], ids=["budget", "sample_packing"]
)
def test_cli_sft_multipack_max_length_follows_the_budget(keys):
    """``packing-hf train`` with ``trainer: sft``: an unset max_length is not TRL's 1024 once multipack sets a
    budget (also the one ``sample_packing: true`` derives after the config is built); a set one stays."""
    from packing_hf.app.config import load_train_config

    common = {"trainer": "sft", "output_dir": "/tmp/packing_hf_max_length", "use_cpu": True}
    cfg = load_train_config({**common, **keys})
    assert cfg.batching == "multipack" and cfg.training.max_length is None
    assert load_train_config({**common, **keys, "max_length": 2048}).training.max_length == 2048


def test_cli_sft_summary_shows_what_max_length_cut(tmp_path, data_dir, capsys):
    """``packing-hf train`` with ``trainer: sft`` and a max_length shorter than the samples: TRL truncates
    them (its meaning), and the job says so and puts it in its summary, with the trainer's own counts."""
    import json

    from packing_hf.app.cli import main

    config = Path(__file__).resolve().parents[3] / "configs" / "tiny_cpu.yaml"
    out = tmp_path / "sft"
    args = [
        "train", str(config), "trainer=sft", f"tokenizer_name_or_path={data_dir / 'smollm2_tokenizer'}",
        "num_samples=4", "max_length=96", "max_steps=1",
        f"output_dir={out}", "save_strategy=no", "disable_tqdm=true",
    ]  # fmt: skip
    assert main(args) == 0
    summary = json.loads((out / "packing_summary.json").read_text())
    said = summary["max_length_cut"]
    assert said.startswith("TRL's max_length=96 truncated 4 samples ("), said  # every GSM8K chat is longer
    assert said in capsys.readouterr().out


# ---- preference trainers: what the collator truncates / TRL's filter leaves out, and ORPO / CPO's tokenization ----

SHORT = 64  # a max_length shorter than a GSM8K answer


@pytest.fixture(scope="module")
def pairs(gsm8k_rows):
    """A short pair, one whose answers are longer than SHORT tokens, and one whose prompt alone is."""
    rows = gsm8k_rows(4)
    return datasets.Dataset.from_dict(
        {
            "prompt": ["1+1=", rows[0]["question"], " ".join(r["question"] for r in rows)],
            "chosen": [" 2", " " + rows[0]["answer"], " 7"],
            "rejected": [" 3", " " + rows[1]["answer"], " 8"],
            "reference": [" 4", " " + rows[2]["answer"], " 9"],
        }
    )


def _preference_trainer(name, pairs, tokenizer, tiny_llama, tmp_path):
    from packing_hf.integrations.tpo import TPOConfig, TPOTrainer

    common = dict(
        output_dir=str(tmp_path / name), report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True,
        logging_steps=1, seed=0, max_steps=1, max_length=SHORT, max_tokens_per_batch=1024,
        per_device_train_batch_size=2, per_device_eval_batch_size=2,
    )  # fmt: skip
    data, columns = pairs.remove_columns("reference"), ("chosen_ids", "rejected_ids")
    if name == "DPO":
        config, cls = packing_hf.DPOConfig(**common), packing_hf.DPOTrainer
    elif name == "KTO":
        config, cls = packing_hf.KTOConfig(**common), packing_hf.KTOTrainer
        n = len(pairs)
        data = datasets.Dataset.from_dict(
            {
                "prompt": list(pairs["prompt"]) * 2,
                "completion": list(pairs["chosen"]) + list(pairs["rejected"]),
                "label": [True] * n + [False] * n,
            }
        )
        columns = ("completion_ids",)
    else:
        config, cls = TPOConfig(**common), TPOTrainer
        data, columns = pairs, ("chosen_ids", "rejected_ids", "reference_ids")
    models = {"model": tiny_llama()} | ({} if name == "TPO" else {"ref_model": tiny_llama()})
    trainer = cls(**models, args=config, train_dataset=data, eval_dataset=data, processing_class=tokenizer)
    return trainer, data, columns


@pytest.mark.parametrize("name", ["DPO", "KTO", "TPO"])
def test_preference_max_length_cut_reaches_the_logs(name, pairs, tokenizer, tiny_llama, tmp_path, caplog):
    """DPO / KTO / TPO truncate in their collator (and DPO / KTO leave out a row whose prompt alone fills
    max_length): counted once per dataset in max_length_stats, warned, in the training logs and in the
    evaluation metrics."""
    with caplog.at_level(logging.WARNING, logger="packing_hf.integrations"):
        trainer, data, columns = _preference_trainer(name, pairs, tokenizer, tiny_llama, tmp_path)
    rows = list(trainer.train_dataset)
    lengths = [len(row["prompt_ids"]) + len(row[column]) for column in columns for row in rows]
    over = [n - SHORT for n in lengths if n > SHORT]
    prompt_fills = sum(len(ids) >= SHORT for ids in tokenizer(list(data["prompt"]))["input_ids"])
    dropped = 0 if name == "TPO" else prompt_fills  # TRL's DPO / KTO filter (keep_start); TPO has none
    assert over and prompt_fills and len(rows) == len(data) - dropped
    stats = {"truncated_samples": len(over), "truncated_tokens": sum(over), "dropped_samples": dropped}
    assert trainer.max_length_stats == {"train": stats, "eval": stats}
    if name != "KTO":  # the collator itself cuts exactly that (KTO's collates each completion twice)
        trainer.data_collator(rows)
        assert {k: trainer.data_collator.stats[k] for k in ("truncated_samples", "truncated_tokens")} == {
            "truncated_samples": len(over),
            "truncated_tokens": sum(over),
        }
    warning = [r.getMessage() for r in caplog.records if f"TRL's max_length={SHORT}" in r.getMessage()]
    assert [w.split(":")[0] for w in warning] == ["train dataset", "eval dataset"], warning
    assert f"truncates (keep_start) {len(over)} of {len(lengths)} sequences" in warning[0]
    assert "raise max_length or set it to None" in warning[0]
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h][0]
    assert {k: logged[f"max_length_{k}"] for k in stats} == stats
    metrics = trainer.evaluate()
    assert {k: metrics[f"eval_max_length_{k}"] for k in stats} == stats


def _orpo_classes(kind):
    from trl.experimental.cpo import CPOConfig as StockCPOConfig
    from trl.experimental.cpo import CPOTrainer as StockCPOTrainer
    from trl.experimental.orpo import ORPOConfig as StockORPOConfig
    from trl.experimental.orpo import ORPOTrainer as StockORPOTrainer

    from packing_hf.integrations import orpo

    if kind == "orpo":
        return StockORPOConfig, StockORPOTrainer, orpo.ORPOConfig, orpo.ORPOTrainer
    return StockCPOConfig, StockCPOTrainer, orpo.CPOConfig, orpo.CPOTrainer


def _orpo_common(tmp_path, name, **overrides):
    return dict(
        output_dir=str(tmp_path / name), report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True,
        logging_steps=1, seed=0, max_steps=1, per_device_train_batch_size=3, per_device_eval_batch_size=3,
        **overrides,
    )  # fmt: skip


def _orpo_trainer(kind, stock, data, tokenizer, tiny_llama, tmp_path, **config):
    """TRL's (``stock``) or packing_hf's ORPO / CPO trainer on ``data`` (also its evaluation set)."""
    stock_config, stock_trainer, packed_config, packed_trainer = _orpo_classes(kind)
    config_class, trainer_class = (stock_config, stock_trainer) if stock else (packed_config, packed_trainer)
    args = config_class(**_orpo_common(tmp_path, "stock" if stock else "packed", **config))
    return trainer_class(
        model=tiny_llama(), args=args, train_dataset=data, eval_dataset=data, processing_class=tokenizer
    )


def _stock_rows(kind, max_length, data, tokenizer, tiny_llama, tmp_path):
    return _orpo_trainer(
        kind, True, data, tokenizer, tiny_llama, tmp_path, max_length=max_length
    ).train_dataset


@pytest.mark.parametrize("kind", ["orpo", "cpo"])
def test_orpo_cpo_tokenization_cut_is_counted(kind, pairs, tokenizer, tiny_llama, tmp_path, caplog):
    """TRL's ORPO / CPO cut the end of a longer answer when they tokenize: counted against stock's
    untruncated tokenization, warned with the fix, in the training logs and the evaluation metrics."""
    data = pairs.remove_columns("reference")
    whole = _stock_rows(kind, 10**6, data, tokenizer, tiny_llama, tmp_path)
    cut = _stock_rows(kind, SHORT, data, tokenizer, tiny_llama, tmp_path)
    over = [
        len(w[f"{side}_input_ids"]) - len(c[f"{side}_input_ids"])
        for w, c in zip(whole, cut, strict=True)
        for side in ("chosen", "rejected")
    ]
    over = [n for n in over if n]
    assert len(over) >= 3  # both answers of the long pair, both of the one whose prompt fills max_length
    with caplog.at_level(logging.WARNING, logger="packing_hf.integrations"):
        trainer = _orpo_trainer(kind, False, data, tokenizer, tiny_llama, tmp_path, max_length=SHORT)
    assert trainer.train_dataset["chosen_input_ids"] == cut["chosen_input_ids"]  # TRL's meaning kept
    stats = {"truncated_samples": len(over), "truncated_tokens": sum(over)}
    assert trainer.max_length_stats == {"train": stats, "eval": stats}
    warning = [r.getMessage() for r in caplog.records if f"TRL's max_length={SHORT}" in r.getMessage()]
    assert [w.split(":")[0] for w in warning] == ["train dataset", "eval dataset"], warning
    assert f"cut the answer of {len(over)} of {2 * len(data)} sequences ({sum(over)} tokens cut" in warning[0]
    assert "left with no answer token" in warning[0] and "raise max_length or set it to None" in warning[0]
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h][0]
    assert {k: logged[f"max_length_{k}"] for k in stats} == stats
    metrics = trainer.evaluate()
    assert {k: metrics[f"eval_max_length_{k}"] for k in stats} == stats


@pytest.mark.parametrize("kind", ["orpo", "cpo"])
def test_orpo_cpo_budget_without_max_length_cuts_nothing(kind, gsm8k_rows, tokenizer, tiny_llama, tmp_path):
    """Unset max_length with max_tokens_per_batch: not TRL's 1024 (or its 512 for None), the budget bounds a
    pair; every pair is tokenized as stock's untruncated rows are, and trains with stock's loss."""
    answers: list[str] = []
    for row in gsm8k_rows(40):  # real text, just longer than TRL's default max_length (1024 tokens)
        answers.append(row["answer"])
        if len(tokenizer(" ".join(answers))["input_ids"]) > 1024:
            break
    data = datasets.Dataset.from_dict(
        {
            "prompt": ["1+1=", "Question: show every step.\nAnswer:"],
            "chosen": [" 2", " " + " ".join(answers)],
            "rejected": [" 3", " " + " ".join(reversed(answers))],
        }
    )
    stock = _orpo_trainer(kind, True, data, tokenizer, tiny_llama, tmp_path, max_length=10**6)
    whole = stock.train_dataset
    assert max(map(len, whole["chosen_input_ids"])) > 1024  # longer than TRL's default max_length
    # both pairs in one batch, as in stock's batch of 3 (ORPO's NLL term is a token mean over the batch)
    budget = sum(map(len, [*whole["chosen_input_ids"], *whole["rejected_input_ids"]]))
    trainer = _orpo_trainer(kind, False, data, tokenizer, tiny_llama, tmp_path, max_tokens_per_batch=budget)
    assert trainer.args.max_length is None and trainer.max_length is None
    for column in ("chosen_input_ids", "rejected_input_ids", "chosen_labels", "rejected_labels"):
        assert trainer.train_dataset[column] == whole[column], column
    assert trainer.max_length_stats["train"] == {"truncated_samples": 0, "truncated_tokens": 0}
    if kind == "cpo":
        return  # the same rows and the same packed forward as ORPO's (test_orpo_cpo.py: both equal stock's)
    # the loss of the whole pairs, forward only (the same weights): stock's with a max_length nothing reaches
    assert trainer.evaluate()["eval_loss"] == pytest.approx(stock.evaluate()["eval_loss"], rel=1e-5)


def test_cli_dpo_summary_shows_what_the_collator_cuts(tmp_path, data_dir):
    """``packing-hf train`` with ``trainer: dpo`` and a max_length shorter than the pairs: the collator's
    truncation (TRL's meaning) is said and in the summary, as SFT's and reward's are."""
    from packing_hf.app.config import load_train_config
    from packing_hf.app.trl_job import run_job

    root = Path(__file__).resolve().parents[3]
    small = '{"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1}'  # fmt: skip
    overrides = [
        f"tokenizer_name_or_path={data_dir / 'smollm2_tokenizer'}", "gguf_file=null", "gguf_package=null",
        f"model_config={small}", "num_samples=4", "max_length=96", "max_steps=1", f"output_dir={tmp_path}",
        "disable_tqdm=true", "save_strategy=no",
    ]  # fmt: skip
    printed: list[str] = []
    summary = run_job(
        load_train_config(root / "configs" / "tiny_dpo.yaml", overrides), print_fn=printed.append
    )
    said = summary["max_length_cut"]
    assert said.startswith("TRL's max_length=96 truncated "), said  # every GSM8K answer pair is longer
    assert any(said in line for line in printed), printed
