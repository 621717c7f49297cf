"""The loss contract on a tiny fp32 llama: one optimizer step's gradient (and logged ``loss``) is the same, within
1e-6 relative, for padded batches, packed multipack rows, gradient accumulation 1 vs 4, a stream and samples split
by ``overflow="split"``, for every ``loss_normalization``, with and without ``loss_weights``. The padded reference
uses the model's full logits; the packed settings the chunked LM head (``chunked_loss``, the default).

The harness (data, model, padded collator, gradient capture) is ``tests/distributed/_loss_worker.py``, shared with
the 2- and 3-process test. Every setting trains one step over the whole data set (every sample once).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import packing_hf
from packing_hf import _loss
from packing_hf.integrations.loss_policy import LossRoute

_spec = importlib.util.spec_from_file_location(
    "packing_hf_loss_worker", Path(__file__).parents[2] / "distributed" / "_loss_worker.py"
)
harness = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(harness)

BUDGET = 24  # tokens per packed micro-batch: the 12 samples (124 tokens) make 6 micro-batches
TOL = harness.RELATIVE_TOLERANCE
SETTINGS = [(n, w) for n in harness.NORMALIZATIONS for w in (False, True)]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matmuls: one intra-op thread is ~10x faster than several fighting over the shared cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Padded batches of all 12 samples, one micro-batch: ``{(normalization, weighted): (grads, loss)}``."""
    cache: dict = {}
    out = str(tmp_path_factory.mktemp("loss"))

    def get(normalization: str, weighted: bool):
        if (normalization, weighted) not in cache:
            # the model's full logits (chunked_loss=False): every packed setting below runs the chunked head
            cache[normalization, weighted] = harness.one_step(
                out, harness.make_samples(weighted), normalization, chunked_loss=False
            )
        return cache[normalization, weighted]

    return get


def _same(got, expected) -> None:
    (grads, loss), (ref_grads, ref_loss) = got, expected
    assert harness.relative_difference(grads, ref_grads) < TOL
    assert loss == pytest.approx(ref_loss, rel=TOL)


@pytest.mark.parametrize(("normalization", "weighted"), SETTINGS)
def test_packed_and_accumulated_equal_padded(normalization, weighted, reference, tmp_path):
    samples = harness.make_samples(weighted)
    expected = reference(normalization, weighted)
    # padded, 4 micro-batches of 3 samples
    _same(harness.one_step(str(tmp_path), samples, normalization, gradient_accumulation_steps=4), expected)
    # packed multipack rows: 6 micro-batches of different sample and token counts in one step
    packed = harness.one_step(
        str(tmp_path), samples, normalization, gradient_accumulation_steps=16, max_tokens_per_batch=BUDGET
    )
    _same(packed, expected)


@pytest.mark.parametrize("normalization", harness.NORMALIZATIONS)
def test_stream_equals_map_style(normalization, reference, tmp_path):
    samples = harness.make_samples(weighted=True)
    passes = harness.stream_batches_per_pass(samples, BUDGET)
    assert passes > 1
    stream = packing_hf.streaming.read_stream(samples)
    got = harness.one_step(
        str(tmp_path), stream, normalization, gradient_accumulation_steps=passes, max_tokens_per_batch=BUDGET
    )
    _same(got, reference(normalization, True))


def _pieces(samples: list[dict], size: int) -> list[dict]:
    """Every sample cut into pieces of ``size`` tokens, each field sliced alike: what overflow="split" trains."""
    return [
        {key: value[start : start + size] for key, value in sample.items()}
        for sample in samples
        for start in range(0, len(sample["input_ids"]), size)
    ]


@pytest.mark.parametrize("normalization", ["sample", "sample_sum"])
def test_split_piece_counts_as_a_sample(normalization, tmp_path):
    """A piece of a split sample is a sample of its own (it attends only to itself, its positions restart):
    packed with overflow="split" equals padded batches of the pieces."""
    samples = harness.make_samples(weighted=True)
    budget = 8
    pieces = _pieces(samples, budget)
    assert len(pieces) > len(samples)
    expected = harness.one_step(str(tmp_path), pieces, normalization, batch_size=len(pieces))
    got = harness.one_step(
        str(tmp_path), samples, normalization, gradient_accumulation_steps=64, max_tokens_per_batch=budget,
        packing_overflow="split",
    )  # fmt: skip
    _same(got, expected)


def test_negative_control_packed_row_as_one_sample(monkeypatch, reference, tmp_path):
    """The same check catches the packing fix turned off: a packed row taken as one sample (boundaries ignored)."""
    samples = harness.make_samples(weighted=True)
    expected = reference("sample", True)
    real = _loss.target_segments
    monkeypatch.setattr(
        _loss, "target_segments", lambda labels, position_ids=None, cu_seq_lens=None: real(labels)
    )
    grads, _ = harness.one_step(
        str(tmp_path), samples, "sample", gradient_accumulation_steps=16, max_tokens_per_batch=BUDGET
    )
    assert harness.relative_difference(grads, expected[0]) > 100 * TOL


def test_normalizations_differ(reference):
    """The three normalisations are different losses on this data (so the checks above can tell them apart)."""
    grads = [reference(n, True)[0] for n in harness.NORMALIZATIONS]
    assert harness.relative_difference(grads[0], grads[1]) > 100 * TOL
    assert harness.relative_difference(grads[1], grads[2]) > 100 * TOL


def test_weights_change_the_loss_and_zero_weights_train_nothing(reference, tmp_path):
    """Weights matter (weighted != unweighted), and weights of 0 everywhere but one sample train only that sample."""
    assert harness.relative_difference(reference("token", True)[0], reference("token", False)[0]) > 100 * TOL
    samples = harness.make_samples(weighted=False)
    for i, sample in enumerate(samples):
        sample["loss_weights"] = [float(i == 2)] * len(sample["input_ids"])
    only = harness.one_step(
        str(tmp_path), samples, "sample", gradient_accumulation_steps=16, max_tokens_per_batch=BUDGET
    )
    alone = harness.one_step(str(tmp_path), [harness.make_samples(weighted=False)[2]], "sample", batch_size=1)
    _same(only, alone)


def test_default_is_stock_loss(tmp_path):
    """Nothing changes for users who set nothing: token normalisation without weights is stock's loss path."""
    trainer = packing_hf.Trainer(
        model=harness.make_model(),
        args=packing_hf.TrainingArguments(
            str(tmp_path), report_to="none", use_cpu=True, max_tokens_per_batch=BUDGET
        ),
        train_dataset=harness.make_samples(weighted=False),
    )
    batch = packing_hf.PaddingFreeCollator()(harness.make_samples(weighted=False)[:3])
    with trainer.loss_policy.counting_step():
        count = trainer._get_num_items_in_batch([batch], torch.device("cpu"))
    assert trainer.loss_policy.step_route is LossRoute.STOCK and trainer.loss_is_scaled_for_ga is None
    assert int(count) == int((batch["labels"][:, 1:] != -100).sum())


def test_named_errors(tmp_path):
    args = packing_hf.TrainingArguments
    with pytest.raises(ValueError, match="loss_normalization='mean'"):
        args(str(tmp_path), report_to="none", use_cpu=True, loss_normalization="mean")
    with pytest.raises(ValueError, match="label_smoothing_factor"):
        packing_hf.Trainer(
            model=harness.make_model(),
            args=args(
                str(tmp_path),
                report_to="none",
                use_cpu=True,
                loss_normalization="sample",
                label_smoothing_factor=0.1,
            ),
        )


def test_sft_trainer_follows_the_same_contract(reference, tokenizer, tmp_path):
    """packing_hf.SFTTrainer: packed weighted "sample" step equals the padded Trainer reference."""
    import datasets
    from transformers import TrainerCallback

    class Capture(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **_):
            self.grads = {
                n: p.grad.detach().double().clone() for n, p in model.named_parameters() if p.grad is not None
            }

    capture = Capture()
    args = packing_hf.SFTConfig(
        str(tmp_path), loss_normalization="sample", gradient_accumulation_steps=16, max_tokens_per_batch=BUDGET,
        max_steps=1, max_grad_norm=0.0, logging_steps=1, report_to="none", save_strategy="no", use_cpu=True,
        disable_tqdm=True, packing_metrics=False, seed=harness.SEED, max_length=None,
        bf16=False, gradient_checkpointing=False,  # TRL's defaults; the reference is fp32
    )  # fmt: skip
    trainer = packing_hf.SFTTrainer(
        model=harness.make_model(),
        args=args,
        train_dataset=datasets.Dataset.from_list(harness.make_samples(weighted=True)),
        processing_class=tokenizer,
        data_collator=packing_hf.PaddingFreeCollator(),
        callbacks=[capture],
    )
    trainer.train()
    loss = next(entry["loss"] for entry in trainer.state.log_history if "loss" in entry)
    _same((capture.grads, loss), reference("sample", True))


# ---- steps without targets -------------------------------------------------------------------------------------

#: no target: a prompt-only sample (a filtered conversation), a one-token sample, one whose only label is its first
#: (the collator masks every sample's first label); one micro-batch each
UNTRAINED = [
    {"input_ids": [7, 8, 9, 10], "labels": [-100, -100, -100, -100], "loss_weights": [1.0] * 4},
    {"input_ids": [11], "labels": [11], "loss_weights": [1.0]},
    {"input_ids": [12, 13], "labels": [12, -100], "loss_weights": [1.0, 1.0]},
]
#: every path of the loss: stock's count (token), packing_hf's own (token with weights, sample, sample_sum)
UNTRAINED_SETTINGS = [("token", False), ("token", True), ("sample", False), ("sample_sum", False)]


def _sgd_step(out_dir: str, samples: list[dict], normalization: str, weighted: bool, **kwargs):
    """One optimizer step of plain SGD (lr 1, no weight decay, no clipping) with every sample its own micro-batch
    unless ``kwargs`` say otherwise: ``(parameters before, parameters after, logged loss)``. ``logging_nan_inf_filter``
    is off so that a NaN loss is logged as NaN, not replaced by the previous losses' mean."""
    samples = [s if weighted else {k: v for k, v in s.items() if k != "loss_weights"} for s in samples]
    model = harness.make_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    settings = dict(gradient_accumulation_steps=len(samples), per_device_train_batch_size=1)
    settings.update(kwargs)
    args = packing_hf.TrainingArguments(
        out_dir, loss_normalization=normalization, max_steps=1, max_grad_norm=0.0, logging_steps=1,
        logging_nan_inf_filter=False, report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True,
        packing_metrics=False, seed=harness.SEED, **settings,
    )  # fmt: skip
    trainer = packing_hf.Trainer(
        model=model,
        args=args,
        train_dataset=samples,
        data_collator=packing_hf.PaddingFreeCollator(),
        optimizers=(torch.optim.SGD(model.parameters(), lr=1.0), None),
    )
    trainer.train()
    loss = next(entry["loss"] for entry in trainer.state.log_history if "loss" in entry)
    return before, {n: p.detach().clone() for n, p in model.named_parameters()}, loss


def _check_untrained(before: dict, after: dict, loss: float, what: str) -> None:
    for name, value in after.items():
        assert torch.isfinite(value).all(), f"{what}: {name} is not finite after a step without targets"
        assert torch.equal(value, before[name]), f"{what}: {name} moved in a step without targets"
    assert loss == 0.0, f"{what}: a step without targets logged the loss {loss}"


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize(("normalization", "weighted"), UNTRAINED_SETTINGS)
def test_a_step_without_targets_trains_nothing(normalization, weighted, chunked, tmp_path):
    """Three micro-batches without a target accumulated in one SGD step (lr 1): every parameter finite and
    unchanged, the logged loss 0. Failed with the chunked head's zero gradients times the incoming inf of
    ``0 / 0`` (every parameter NaN, the loss logged 0.0 by the NaN filter) and stock's loss 0/0 logged as NaN."""
    what = f"{normalization} weighted={weighted} chunked_loss={chunked}"
    _check_untrained(
        *_sgd_step(str(tmp_path), UNTRAINED, normalization, weighted, chunked_loss=chunked), what
    )


def test_a_packed_step_without_targets_trains_nothing_by_default(tmp_path):
    """The default settings (packed rows, chunked head, token normalisation), one micro-batch without a target."""
    got = _sgd_step(
        str(tmp_path), UNTRAINED, "token", False, max_tokens_per_batch=BUDGET, gradient_accumulation_steps=1
    )
    _check_untrained(*got, "packed, defaults")


@pytest.mark.parametrize(("normalization", "weighted"), [("token", False), ("sample", False)])
def test_a_micro_batch_without_targets_adds_nothing(normalization, weighted, tmp_path, assert_close):
    """A step whose micro-batches include ones without a target is the same step without them: the same
    parameters after SGD and the same logged loss (stock's count, and packing_hf's sample count, which is what
    a micro-batch without targets could change)."""
    trained = harness.make_samples(weighted=True)[:2]
    _, alone, alone_loss = _sgd_step(str(tmp_path), trained, normalization, weighted)
    _, mixed, mixed_loss = _sgd_step(str(tmp_path), [*trained, *UNTRAINED], normalization, weighted)
    assert alone_loss > 0
    assert_close(mixed_loss, alone_loss, f"{normalization} logged loss", rel=TOL)
    for name, value in alone.items():
        assert_close(mixed[name], value, f"{normalization} {name} after the step", rel=TOL)


def test_negative_control_a_micro_batch_without_targets_counted_as_a_sample(
    monkeypatch, tmp_path, assert_close
):
    """The same check catches a denominator that counts the samples without targets."""
    real = _loss.loss_counts

    def counting_every_sample(labels, *args, **kwargs):
        weight, _ = real(labels, *args, **kwargs)
        segments = _loss.target_segments(labels, *args[1:], **kwargs)
        return weight, int(segments.unique().numel()) if segments.numel() else 1

    monkeypatch.setattr(packing_hf.integrations.loss_policy, "loss_counts", counting_every_sample)
    with pytest.raises(AssertionError, match="logged loss"):
        test_a_micro_batch_without_targets_adds_nothing("sample", False, tmp_path, assert_close)


def test_an_sft_step_without_targets_trains_nothing(tokenizer, tmp_path):
    """packing_hf.SFTTrainer with its defaults (token normalisation, chunked head, TRL's metrics), SGD lr 1."""
    import datasets

    model = harness.make_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = packing_hf.SFTConfig(
        str(tmp_path), max_tokens_per_batch=BUDGET, max_steps=1, max_grad_norm=0.0, logging_steps=1,
        logging_nan_inf_filter=False, report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True,
        packing_metrics=False, seed=harness.SEED, max_length=None, bf16=False, gradient_checkpointing=False,
    )  # fmt: skip
    samples = [{k: v for k, v in s.items() if k != "loss_weights"} for s in UNTRAINED]
    trainer = packing_hf.SFTTrainer(
        model=model,
        args=args,
        train_dataset=datasets.Dataset.from_list(samples),
        processing_class=tokenizer,
        data_collator=packing_hf.PaddingFreeCollator(),
        optimizers=(torch.optim.SGD(model.parameters(), lr=1.0), None),
    )
    trainer.train()
    loss = next(entry["loss"] for entry in trainer.state.log_history if "loss" in entry)
    after = {n: p.detach() for n, p in model.named_parameters()}
    _check_untrained(before, after, loss, "SFTTrainer")
