"""packing_hf.Trainer / SFTTrainer on streaming datasets (no length, no random access), tiny llama, CPU.

A torch ``IterableDataset``, a ``datasets.IterableDataset`` or a ``TokenizedStream`` with
``max_tokens_per_batch`` and ``max_steps``: the Trainer trains on exactly the batches a ``PackedStream`` over
the same data yields (every sample once per pass, every batch within the budget, passes back to back);
the settings a stream cannot honour are refused; a run resumed from a checkpoint (in a pass, and in the
step where a new pass begins) sees exactly the batches of the uninterrupted run and ends with its weights;
a streaming eval set gives the token-mean eval loss of the map-style one.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field

import datasets
import pytest
import torch
from transformers import TrainerCallback

import packing_hf
from packing_hf.integrations.trainer import STREAM_STATE_NAME
from packing_hf.streaming import PackedStream, read_stream

BUDGET, GAS, VOCAB = 256, 3, 128


@pytest.fixture(scope="module")
def samples(gsm8k_tokenized):
    """40 real GSM8K rows cut to at most 60 tokens, ids folded into a 128-token vocabulary, with an idx."""
    return [
        {"input_ids": [t % VOCAB for t in row["input_ids"][:60]], "idx": i}
        for i, row in enumerate(gsm8k_tokenized[:40])
    ]


@dataclass
class Recorder(packing_hf.PaddingFreeCollator):
    """Records the ``idx`` of the samples of every batch it collates (a padding batch records ``[]``)."""

    batches: list = field(default_factory=list, init=False, repr=False)
    input_columns = (*packing_hf.PaddingFreeCollator.input_columns, "idx")

    def __call__(self, features, return_tensors=None):
        self.batches.append([int(f["idx"]) for f in features if "idx" in f])
        return super().__call__(
            [{k: v for k, v in f.items() if k != "idx"} for f in features], return_tensors
        )


class Rows(torch.utils.data.IterableDataset):
    """A plain torch IterableDataset over a list (what a user's own streaming reader looks like)."""

    def __init__(self, rows: list[dict]) -> None:
        self.rows = rows

    def __iter__(self):
        return iter(self.rows)


def _trainer(tiny_llama, collator, train_dataset, out_dir, **overrides) -> packing_hf.Trainer:
    """A Trainer on ``train_dataset``; the packing pre-flight check is off unless asked for (tests about data,
    not attention; the tests comparing losses or gradients of differently packed batches keep it)."""
    values = dict(
        packing_preflight="off",
        max_tokens_per_batch=BUDGET, gradient_accumulation_steps=GAS, max_steps=8, learning_rate=1e-3,
        save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True, logging_steps=1, seed=0,
    )  # fmt: skip
    values.update(overrides)
    args = packing_hf.TrainingArguments(str(out_dir), **values)
    return packing_hf.Trainer(
        model=tiny_llama(vocab_size=VOCAB), args=args, train_dataset=train_dataset, data_collator=collator
    )


def _stream_passes(samples: list[dict], passes: int) -> list[list[list[int]]]:
    """The idx of every batch of the first ``passes`` passes of a PackedStream over ``samples`` (the reference)."""
    stream = PackedStream(samples, BUDGET, seed=0)
    return [[[s["idx"] for s in batch] for batch in stream] for _ in range(passes)]


@pytest.mark.parametrize("kind", ["torch", "datasets"])
def test_trains_on_a_stream(kind, samples, tiny_llama, tmp_path):
    """max_steps optimizer steps of GAS micro-batches each: the batches of consecutive passes of the stream,
    every sample once per pass, each batch within the budget; the loss goes down."""
    if kind == "torch":
        data = Rows(samples)
    else:
        data = datasets.Dataset.from_list(samples).to_iterable_dataset(num_shards=2)
    collator = Recorder()
    trainer = _trainer(tiny_llama, collator, data, tmp_path, learning_rate=3e-3, packing_preflight="switch")
    result = trainer.train()

    assert result.global_step == 8
    assert trainer.lr_scheduler.get_last_lr()[0] == 0.0  # the schedule was planned for max_steps
    passes = _stream_passes(samples, 3)
    per_pass = len(passes[0])
    assert 8 * GAS > 2 * per_pass and per_pass % GAS  # spans passes, and one step holds the end of a pass
    assert collator.batches == [b for p in passes for b in p][: 8 * GAS]
    lengths = {s["idx"]: len(s["input_ids"]) for s in samples}
    for p in range(2):
        window = collator.batches[p * per_pass : (p + 1) * per_pass]
        assert sorted(i for b in window for i in b) == list(range(len(samples))), f"pass {p}"
        assert all(sum(lengths[i] for i in b) <= BUDGET for b in window)
    assert collator.batches[:per_pass] != collator.batches[per_pass : 2 * per_pass]  # new draws every pass
    stats = trainer.packing_stream.stats()
    assert stats["batches_yielded"] == 8 * GAS and stats["epoch"] == 2 and stats["padding_batches"] == 0
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 8 and logs[-1]["loss"] < logs[0]["loss"]
    assert sum(h["real_tokens_per_step"] for h in logs) == sum(
        lengths[i] for b in collator.batches for i in b
    )


def test_gradient_of_a_step_across_passes(samples, tiny_llama, right_padded_batch, tmp_path):
    """The step that holds the last batches of pass 0 and the first of pass 1 has the gradient of the mean
    token loss over exactly those samples (no carried gradient, one normalisation)."""
    passes = _stream_passes(samples, 2)
    per_pass = len(passes[0])
    step = per_pass // GAS  # 0-based optimizer step where pass 1 begins
    batches = [b for p in passes for b in p][step * GAS : (step + 1) * GAS]
    grads = {}

    class Grab(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            if state.global_step == step:
                grads.update({n: p.grad.double().clone() for n, p in model.named_parameters()})

    trainer = _trainer(
        tiny_llama, packing_hf.PaddingFreeCollator(), Rows(samples), tmp_path, max_steps=step + 1,
        learning_rate=0.0, max_grad_norm=0.0, lr_scheduler_type="constant", packing_preflight="switch",
    )  # fmt: skip
    trainer.add_callback(Grab())
    trainer.train()
    reference = tiny_llama(vocab_size=VOCAB)
    rows = [samples[i]["input_ids"] for b in batches for i in b]
    reference(**right_padded_batch(rows)).loss.backward()
    for name, param in reference.named_parameters():
        torch.testing.assert_close(grads[name], param.grad.double(), rtol=1e-4, atol=1e-7, msg=name)


def test_exact_resume(samples, tiny_llama, tmp_path):
    """Resumed from a checkpoint inside pass 0 and from the one after the step where pass 1 begins: the
    batches after the resume are the uninterrupted run's, and so are the final weights."""
    full = Recorder()
    trainer = _trainer(
        tiny_llama, full, Rows(samples), tmp_path / "full", save_strategy="steps", save_steps=1
    )
    trainer.train()
    final = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    per_pass = len(_stream_passes(samples, 1)[0])
    for step in (2, per_pass // GAS + 1):
        checkpoint = tmp_path / "full" / f"checkpoint-{step}"
        saved = json.loads((checkpoint / STREAM_STATE_NAME.format(rank=0)).read_text())
        assert saved["batches_consumed"] == step * GAS
        resumed = Recorder()
        again = _trainer(tiny_llama, resumed, Rows(samples), tmp_path / f"resumed{step}")
        again.train(resume_from_checkpoint=str(checkpoint))
        assert resumed.batches == full.batches[step * GAS :], f"resume from step {step}: other batches"
        assert again.state.global_step == 8
        for name, param in again.model.named_parameters():
            torch.testing.assert_close(param, final[name], rtol=0, atol=1e-6, msg=f"{name} after resume")

    # a checkpoint without this rank's stream state is refused; ignore_data_skip restarts the stream
    bare = tmp_path / "bare"
    shutil.copytree(tmp_path / "full" / "checkpoint-2", bare)
    (bare / STREAM_STATE_NAME.format(rank=0)).unlink()
    missing = _trainer(tiny_llama, Recorder(), Rows(samples), tmp_path / "missing")
    with pytest.raises(ValueError, match="has no packing_hf_stream_rank0.json"):
        missing.train(resume_from_checkpoint=str(bare))
    other = _trainer(tiny_llama, Recorder(), Rows(samples), tmp_path / "other", max_tokens_per_batch=300)
    with pytest.raises(ValueError, match="cannot resume the stream.*max_tokens_per_batch"):
        other.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))
    restarted = Recorder()
    fresh = _trainer(tiny_llama, restarted, Rows(samples), tmp_path / "fresh", ignore_data_skip=True)
    fresh.train(resume_from_checkpoint=str(bare))
    assert restarted.batches == full.batches[: len(restarted.batches)]


def test_refuses_what_a_stream_cannot_honour(samples, gsm8k_rows, tiny_llama, tmp_path):
    collator = packing_hf.PaddingFreeCollator()
    with pytest.raises(ValueError, match="dataloader_num_workers=2.*set dataloader_num_workers=0"):
        _trainer(tiny_llama, collator, Rows(samples), tmp_path, dataloader_num_workers=2)
    with pytest.raises(ValueError, match="max_steps"):  # stock's refusal: a stream has no length
        _trainer(tiny_llama, collator, Rows(samples), tmp_path, max_steps=-1)
    # assigned after construction: refused when the loader is built
    trainer = _trainer(tiny_llama, collator, samples, tmp_path, max_steps=-1)
    trainer.train_dataset = Rows(samples)
    with pytest.raises(ValueError, match="max_steps=-1.*set max_steps > 0"):
        trainer.get_train_dataloader()
    text = datasets.Dataset.from_list(gsm8k_rows(4)).to_iterable_dataset()
    with pytest.raises(ValueError, match="no 'input_ids' column.*dataset.map.*read_stream"):
        _trainer(tiny_llama, collator, text, tmp_path).get_train_dataloader()
    other_budget = PackedStream(samples, BUDGET * 2)
    with pytest.raises(
        ValueError, match=f"max_tokens_per_batch={BUDGET * 2} but max_tokens_per_batch={BUDGET}"
    ):
        _trainer(tiny_llama, collator, other_budget, tmp_path).get_train_dataloader()


def test_packed_stream_and_tokenized_stream(samples, tiny_llama, tmp_path):
    """A PackedStream given by the user is used as is (its own buffer settings); a TokenizedStream is packed."""
    own = PackedStream(samples, BUDGET, buffer_size=8, open_batches=2, seed=3)
    expected = [
        [s["idx"] for s in b] for b in PackedStream(samples, BUDGET, buffer_size=8, open_batches=2, seed=3)
    ]
    collator = Recorder()
    trainer = _trainer(tiny_llama, collator, own, tmp_path / "own", max_steps=2)
    trainer.train()
    assert trainer.packing_stream is own
    assert collator.batches == expected[: 2 * GAS]

    collator = Recorder()
    trainer = _trainer(tiny_llama, collator, read_stream(samples), tmp_path / "reader", max_steps=2)
    trainer.train()
    assert collator.batches == [b for p in _stream_passes(samples, 1) for b in p][: 2 * GAS]


def test_streaming_eval_loss_is_the_token_mean(samples, tiny_llama, tmp_path):
    """packing_eval on a streaming eval set: one pass, eval_loss equal to the map-style packed evaluation."""
    trainer = _trainer(
        tiny_llama, packing_hf.PaddingFreeCollator(), Rows(samples), tmp_path, packing_preflight="switch"
    )
    streamed = trainer.evaluate(eval_dataset=Rows(samples))
    mapped = trainer.evaluate(eval_dataset=datasets.Dataset.from_list(samples))
    assert streamed["eval_loss"] == pytest.approx(mapped["eval_loss"], rel=1e-6)


def test_sft_trainer_on_a_streaming_dataset(gsm8k_rows, tokenizer, tiny_llama, tmp_path):
    """TRL tokenizes a datasets.IterableDataset lazily (completion-only labels); packing_hf.SFTTrainer packs the
    result online. Its torch-side streams (PackedStream, TokenizedStream) are refused with the alternative."""
    pytest.importorskip("trl")
    rows = gsm8k_rows(12)
    data = datasets.Dataset.from_dict(
        {
            "prompt": [f"Question: {r['question']}\nAnswer:" for r in rows],
            "completion": [f" {r['answer']}" for r in rows],
        }
    ).to_iterable_dataset()
    seen = []

    class Spy(packing_hf.PaddingFreeCollator):
        def __call__(self, features, return_tensors=None):
            seen.append([dict(f) for f in features])
            return super().__call__(features, return_tensors)

    config = packing_hf.SFTConfig(
        str(tmp_path / "sft"), max_tokens_per_batch=512, max_steps=3, report_to="none", save_strategy="no",
        use_cpu=True, disable_tqdm=True, logging_steps=1, seed=0,
    )  # fmt: skip
    trainer = packing_hf.SFTTrainer(
        model=tiny_llama(), args=config, train_dataset=data, processing_class=tokenizer,
        data_collator=Spy(pad_token_id=tokenizer.pad_token_id),
    )  # fmt: skip
    result = trainer.train()
    assert result.global_step == 3 and trainer.packing_stream is not None
    assert len(seen) == 3
    for batch in seen:
        assert sum(len(f["input_ids"]) for f in batch) <= 512
        for f in batch:  # completion-only: the prompt's labels are masked
            assert f["labels"][0] == -100 and f["labels"][-1] != -100
    with pytest.raises(TypeError, match="packing_hf.Trainer"):
        packing_hf.SFTTrainer(
            model=tiny_llama(), args=config, train_dataset=read_stream([{"input_ids": [1, 2]}]),
            processing_class=tokenizer,
        )  # fmt: skip


def test_an_empty_streaming_eval_set_is_refused_like_a_map_style_one(samples, tiny_llama, tmp_path):
    """An empty eval stream used to return metrics without eval_loss, silently."""
    trainer = _trainer(
        tiny_llama, packing_hf.PaddingFreeCollator(), Rows(samples), tmp_path, packing_preflight="switch"
    )
    with pytest.raises(ValueError, match="the dataset is empty"):
        trainer.evaluate(eval_dataset=datasets.Dataset.from_list(samples).select([]))
    with pytest.raises(ValueError, match="the dataset is empty"):
        trainer.evaluate(eval_dataset=Rows([]))


@pytest.mark.parametrize("coefficient", [0.5, 0.0])
def test_a_router_loss_is_refused_for_a_stream_on_several_processes(
    samples, tiny_llama, tmp_path, coefficient
):
    """On several processes a rank whose shard ran out trains on one-token padding batches: their pad token adds
    nothing to the token loss but would be routed and add its router load-balancing loss to the step, so a model
    adding one (MoE, ``router_aux_loss_coef != 0``) is refused by name; ``router_aux_loss_coef=0`` (the
    control) and one process (no padding batches) are accepted."""
    from packing_hf.architectures import build_tiny_model

    trainer = _trainer(tiny_llama, packing_hf.PaddingFreeCollator(), Rows(samples), tmp_path)
    trainer.model = build_tiny_model("mixtral", packing_hf.register_attention())
    trainer.model.config.output_router_logits = True
    trainer.model.router_aux_loss_coef = coefficient
    trainer._check_stream_settings(Rows(samples))  # one process: no padding batch
    trainer._data_parallel_world = lambda: (2, 0)
    if coefficient:
        with pytest.raises(
            ValueError, match="padding batches.*router load-balancing loss.*output_router_logits"
        ):
            trainer._check_stream_settings(Rows(samples))
    else:
        trainer._check_stream_settings(Rows(samples))
