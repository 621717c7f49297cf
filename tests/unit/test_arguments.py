"""Arguments of the public packers, drawn at random: accepted => the output keeps every invariant,
refused => a ValueError/TypeError that names the argument.

Values are drawn from what users actually pass by mistake (negative numbers, bools, None, floats, strings,
huge numbers) next to valid ones; each argument is perturbed on its own, the rest stay valid.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from packing_hf import MultipackBatchSampler, PaddingFreeCollator
from packing_hf.fixed import concatenate_and_pack, pack_sequences

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

ODD_VALUES = st.one_of(
    st.integers(-3, 70),
    st.just(2**40),
    st.booleans(),
    st.none(),
    st.floats(-2, 80),
    st.just(float("nan")),
    st.sampled_from(["", "8", "error", "truncate", "split", "drop", "skip", "bogus"]),
)


def samples_strategy(max_len: int = 12, max_n: int = 6):
    return st.lists(st.lists(st.integers(0, 50), min_size=1, max_size=max_len), min_size=1, max_size=max_n)


def assert_refusal_names(exc: BaseException, name: str) -> None:
    assert isinstance(exc, ValueError | TypeError), f"{name}: {type(exc).__name__}: {exc}"
    assert name in str(exc), f"the error for a bad {name} does not name it: {exc}"


# --------------------------------------------------------------------------------------------------
# PaddingFreeCollator


COLLATOR_FIELDS = ["max_length", "overflow", "pad_to_multiple_of", "pad_token_id", "position_ids_start"]


def assert_collated(out: dict, samples: list[list[int]], collator: PaddingFreeCollator) -> None:
    ids, labels, pos = out["input_ids"][0], out["labels"][0], out["position_ids"][0]
    cu = out["cu_seq_lens_q"].tolist()
    assert cu[0] == 0 and cu[-1] == ids.numel() and all(b > a for a, b in zip(cu, cu[1:], strict=False))
    for start, end in zip(cu, cu[1:], strict=False):
        assert labels[start] == collator.label_pad_id  # no prediction across a boundary
        expected = torch.arange(end - start) + collator.position_ids_start
        assert torch.equal(pos[start:end], expected)
    kept = collator.stats["tokens"]
    real = sum(map(len, samples))
    # tokens are only lost under an explicit policy, and then counted
    assert kept + collator.stats["truncated_tokens"] == real
    if collator.pad_to_multiple_of:
        assert ids.numel() % collator.pad_to_multiple_of == 0


@SETTINGS
@given(samples_strategy(), st.sampled_from(COLLATOR_FIELDS), ODD_VALUES)
def test_collator_arguments(samples, name, value):
    valid = {"max_length": None, "overflow": "error", "pad_to_multiple_of": None, "pad_token_id": 0}
    try:
        collator = PaddingFreeCollator(**{**valid, name: value})
        out = collator([{"input_ids": s} for s in samples])
    except Exception as exc:
        if name == "max_length" and "longer" in str(exc) or "> max_length" in str(exc):
            assert isinstance(exc, ValueError)  # an over-long sample under overflow="error": named
            return
        assert_refusal_names(exc, name)
        return
    assert_collated(out, samples, collator)


# --------------------------------------------------------------------------------------------------
# pack_sequences / concatenate_and_pack


PACK_ARGS = ["max_length", "pad_token_id", "strategy", "overflow", "position_ids_start"]


@SETTINGS
@given(samples_strategy(), st.sampled_from(PACK_ARGS), ODD_VALUES)
def test_pack_sequences_arguments(samples, name, value):
    valid = {
        "max_length": 16,
        "pad_token_id": 0,
        "strategy": "greedy",
        "overflow": "error",
        "position_ids_start": 0,
    }
    args = {**valid, name: value}
    try:
        packed, bounds, pos = pack_sequences(
            samples, return_boundaries=True, return_position_ids=True, **args
        )
    except Exception as exc:
        if "longer than max_length" in str(exc) or "> max_length" in str(exc):
            assert isinstance(exc, ValueError)
            return
        assert_refusal_names(exc, name)
        return
    width = args["max_length"]
    assert packed.shape[1] == width and pos.shape == packed.shape
    pieces = [packed[r, a:b].tolist() for r, row in enumerate(bounds) for a, b in row]
    if args["overflow"] == "error":
        assert sorted(pieces) == sorted(samples)  # every sequence once, whole
    else:
        assert sum(map(len, pieces)) <= sum(map(len, samples))
        assert all(len(p) <= width for p in pieces)


@SETTINGS
@given(samples_strategy(), st.sampled_from(["max_length", "pad_token_id", "label_pad_id"]), ODD_VALUES)
def test_concatenate_and_pack_arguments(samples, name, value):
    valid = {"max_length": 16, "pad_token_id": 0, "label_pad_id": -100}
    args = {**valid, name: value}
    try:
        inputs, labels, masks = concatenate_and_pack(
            samples, samples, [[1] * len(s) for s in samples], **args
        )
    except Exception as exc:
        if "> max_length" in str(exc) or "longer than max_length" in str(exc):
            assert isinstance(exc, ValueError)
            return
        assert_refusal_names(exc, name)
        return
    assert inputs.shape == labels.shape == masks.shape
    assert int(masks.sum()) == sum(map(len, samples))  # every token kept, padding masked
    # every sequence's first label is masked
    assert int((labels == args["label_pad_id"]).sum()) >= len(samples)


# --------------------------------------------------------------------------------------------------
# MultipackBatchSampler


SAMPLER_ARGS = ["max_tokens_per_batch", "seed", "num_replicas", "rank", "overflow", "balance", "mixing"]


@SETTINGS
@given(
    st.lists(st.integers(1, 40), min_size=4, max_size=40),
    st.sampled_from(SAMPLER_ARGS),
    ODD_VALUES,
)
def test_sampler_arguments(lengths, name, value):
    valid = {"max_tokens_per_batch": 64, "seed": 0, "num_replicas": 1, "rank": 0}
    args = {**valid, name: value}
    try:
        with _no_warning_check():
            sampler = MultipackBatchSampler(lengths, **args)
        batches = list(sampler)
    except Exception as exc:
        if "tokens > max_tokens_per_batch" in str(exc) or "cannot give each of the" in str(exc):
            assert isinstance(exc, ValueError)
            return
        assert_refusal_names(exc, name)
        return
    assert len(batches) == len(sampler)
    budget = sampler.max_tokens_per_batch
    if sampler.num_replicas == 1 and sampler.overflow in ("error", "drop"):
        seen = sorted(i for b in batches for i in b)
        dropped = sampler.stats().get("overflow_dropped_samples", 0)
        assert len(seen) == len(set(seen)) == len(lengths) - dropped
        assert all(sum(lengths[i] for i in b) <= budget for b in batches)


class _no_warning_check:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_the_sampler_refuses_lengths_from_another_run():
    """A state saved for other lengths (same count) is refused, not silently resumed on another plan."""
    sampler = MultipackBatchSampler([5, 3, 8, 2, 7, 1], 10)
    next(iter(sampler))
    state = sampler.state_dict()
    other = MultipackBatchSampler([5, 3, 8, 2, 7, 2], 10)
    with pytest.raises(ValueError, match="lengths"):
        other.load_state_dict(state)


def test_the_sampler_refuses_a_budget_past_int32_and_a_huge_one_costs_no_memory():
    with pytest.raises(ValueError, match="max_tokens_per_batch=2147483648 .*int32"):
        MultipackBatchSampler(np.array([3, 4, 5]), 2**31)
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for mixing in ("random", "sorted"):
        sampler = MultipackBatchSampler(np.array([3, 4, 5]), 2**26, mixing=mixing)
        assert [sorted(b) for b in sampler] == [[0, 1, 2]]
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 64, f"the plan of three samples grew the peak RSS by {grown_mib:.0f} MiB"


# --------------------------------------------------------------------------------------------------
# the switches of the packing configs: a string is refused, never read (bool("no") is True)


def _configs():
    import packing_hf

    return [
        (packing_hf.GRPOConfig, "share_prompt", False),
        (packing_hf.RLOOConfig, "share_prompt", False),
        (packing_hf.TrainingArguments, "packing_eval", False),
        (packing_hf.TrainingArguments, "packing_metrics", False),
        (packing_hf.DPOConfig, "shared_prompt", True),
        (packing_hf.ORPOConfig, "padding_free", True),
        (packing_hf.CPOConfig, "padding_free", True),
        (packing_hf.TPOConfig, "padding_free", True),
    ]


@pytest.mark.parametrize("index", range(8))
def test_packing_config_switches_take_booleans_only(index, tmp_path):
    config_class, name, optional = _configs()[index]
    common = {"output_dir": str(tmp_path), "report_to": "none", "use_cpu": True}
    assert getattr(config_class(**common, **{name: True}), name) is True  # control: a bool is kept
    if optional:
        assert getattr(config_class(**common, **{name: None}), name) is None
    for bad in ("yes", "false", 1):
        with pytest.raises(TypeError, match=f"{name} must be True.*got {bad!r}"):
            config_class(**common, **{name: bad})
