"""Model FLOPs with attention counted per sample (packing_hf.flops) and the packing metrics that log them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from packing_hf import PaddingFreeCollator
from packing_hf.flops import (
    batch_sample_lengths,
    device_peak_tflops,
    flops_counter,
    step_flops,
    step_time_percentiles,
)
from packing_hf.integrations.args import TrainingArguments
from packing_hf.integrations.callbacks import SQUARES_KEY, STATS_KEY, PackingMetrics, PackingStatsCollator

SHAPES = dict(
    hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
    vocab_size=97,
)  # fmt: skip


@pytest.fixture
def config():
    return AutoConfig.for_model("llama", **SHAPES)


def test_matmul_flops_are_six_times_the_weights_every_token_is_multiplied_by(config):
    """``linear`` is 6 x the weights of the model's Linear modules (projections, MLP, head), counted from the
    built model, not from the formula: the embedding lookup is left out, a tied head counted."""
    for tied in (False, True):
        config.tie_word_embeddings = tied
        model = AutoModelForCausalLM.from_config(config)
        linear_weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
        counter = flops_counter(model.config)
        assert counter.linear == 6 * linear_weights
        with_embedding = linear_weights + model.get_input_embeddings().weight.numel()
        assert counter.linear != 6 * with_embedding  # negative control: the lookup is no matmul


@pytest.mark.parametrize("length", [16, 40])
def test_counts_match_torch_flop_counter_with_causal_attention_halved(config, length):
    """torch's FlopCounterMode over forward + backward of eager attention (which computes every (query, key)
    pair, the full square) counts ``linear * s + 2 * quadratic * s**2``: the counter's matmuls exactly, and
    its attention as half the full square (causal). Two lengths pin both coefficients."""
    from torch.utils.flop_counter import FlopCounterMode

    config.tie_word_embeddings = False
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    ids = torch.randint(0, config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counted:
        model(input_ids=ids, labels=ids).loss.backward()
    flops = step_flops(flops_counter(config), [length])
    assert counted.get_total_flops() == flops.matmul + 2 * flops.attention
    assert counted.get_total_flops() != flops.total  # negative control: eager does the full square


def test_two_packings_of_the_same_tokens_differ_by_the_sum_of_squares(config):
    counter = flops_counter(config)
    many, few = [10, 20, 30, 40], [30, 70]  # the same 100 tokens cut into samples two ways
    a, b = step_flops(counter, many), step_flops(counter, few)
    assert a.matmul == b.matmul == counter.linear * 100
    assert b.attention - a.attention == counter.quadratic * (
        (30**2 + 70**2) - (10**2 + 20**2 + 30**2 + 40**2)
    )
    assert a.total == a.matmul + a.attention
    # negative control: counting the row as one sequence (T**2) gives both packings the same attention
    assert counter.quadratic * 100**2 not in (a.attention, b.attention)


def test_sample_lengths_from_every_batch_layout():
    collated = PaddingFreeCollator(pad_to_multiple_of=8)([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])
    assert collated["cu_seq_lens_q"].tolist() == [0, 3, 5, 8]  # the padding is a segment of its own
    assert batch_sample_lengths(collated, padding=3) == [3, 2]
    assert batch_sample_lengths(collated) == [3, 2, 3]
    with pytest.raises(ValueError, match="padding is not its own last segment"):
        batch_sample_lengths(collated, padding=2)
    positions = {"position_ids": torch.tensor([[0, 1, 2, 0, 1, 0]]), "input_ids": torch.zeros(1, 6)}
    assert batch_sample_lengths(positions) == [3, 2, 1]
    padded = {"input_ids": torch.zeros(2, 4), "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])}
    assert batch_sample_lengths(padded) == [4, 2]
    assert batch_sample_lengths({"input_ids": np.zeros((3, 5))}) == [5, 5, 5]
    # empty segments (segment buckets) hold no sample
    assert batch_sample_lengths({"cu_seq_lens_q": torch.tensor([0, 4, 6, 6, 6])}) == [4, 2]


def test_peak_table_prefers_the_longest_name_and_knows_no_cpu():
    assert device_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert device_peak_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert device_peak_tflops("NVIDIA L40S") == 362.0 and device_peak_tflops("NVIDIA L4") == 121.0
    assert device_peak_tflops("Some Future Accelerator") is None
    assert device_peak_tflops("cpu") is None and device_peak_tflops(torch.device("cpu")) is None


def test_step_time_percentiles():
    assert step_time_percentiles([]) == {}
    assert step_time_percentiles([2.0, 1.0, 3.0]) == {"step_seconds_p50": 2.0, "step_seconds_p90": 2.8}


def test_metrics_count_flops_per_step_and_mfu_from_the_given_peak(config):
    """Two micro-batches over one step, timed by a fake clock of 2 s: FLOPs, TFLOP/s and MFU as counted."""
    collate = PackingStatsCollator(PaddingFreeCollator())
    metrics = PackingMetrics(None)
    metrics.configure_flops(config, peak_tflops=1e-6, device="cpu", devices=2)
    metrics._clock.mark = iter([10.0, 12.0]).__next__  # start, end of the one step
    metrics.start_step()
    for rows in ([[1] * 3, [2] * 5], [[3] * 4]):
        counts = collate([{"input_ids": r} for r in rows])[STATS_KEY]
        metrics.update(counts)
    metrics.end_step()
    counter = flops_counter(config)
    out = metrics.compute(num_steps=1)
    assert out["attention_flops_per_step"] == counter.quadratic * (9 + 25 + 16)
    assert out["model_flops_per_step"] == counter.linear * 12 + counter.quadratic * 50
    assert out["step_seconds_p50"] == out["step_seconds_p90"] == 2.0
    assert out["model_tflops_per_s"] == out["model_flops_per_step"] / 2.0 / 1e12
    assert out["mfu"] == pytest.approx(out["model_flops_per_step"] / 2.0 / 1e12 / (1e-6 * 2), rel=1e-12)


def test_no_flops_for_uncounted_batches_and_the_peak_is_refused_there(config):
    metrics = PackingMetrics(None)
    metrics.configure_flops(config, device="cpu")
    counts = {"real_tokens": 6, "emitted_tokens": 6, "samples": 2, "padded_tokens": 8}  # no SQUARES_KEY
    metrics.update(counts)
    metrics.update({**counts, SQUARES_KEY: 20})
    out = metrics.compute(num_steps=1)
    assert "model_flops_per_step" not in out and out["real_tokens_per_step"] == 12  # none rather than wrong
    assert "mfu" not in out  # CPU: no known peak
    metrics.configure_flops(config, peak_tflops=100.0, device="cpu")
    metrics.start_step()
    metrics.update(counts)
    with pytest.raises(ValueError, match="peak_tflops is set, but"):
        metrics.end_step()
    with pytest.raises(ValueError, match="peak_tflops=100.0: the model config"):
        metrics.configure_flops(None, peak_tflops=100.0)


def test_peak_tflops_argument_is_checked():
    assert TrainingArguments("out", report_to="none", peak_tflops=312).peak_tflops == 312.0
    for bad in (0, -1.0, float("nan"), True, "312"):
        with pytest.raises(ValueError, match="peak_tflops must be a number > 0"):
            TrainingArguments("out", report_to="none", peak_tflops=bad)
    with pytest.raises(ValueError, match="packing_metrics=False turns off"):
        TrainingArguments("out", report_to="none", peak_tflops=312.0, packing_metrics=False)
