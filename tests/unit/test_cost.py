"""Cost-balanced multipack: the CostModel, its fit and cache, and the sampler's cost-balanced steps
(as many batches as token balance, every step evened out, every sample once, equal steps on every rank,
exact resume)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from packing_hf.cost import CostModel, _fit, fit_cost_model, rank_cost_spread
from packing_hf.sampler import MIXINGS, MultipackBatchSampler


def ranks(lengths, budget, replicas, **kwargs) -> list[MultipackBatchSampler]:
    return [
        MultipackBatchSampler(lengths, budget, num_replicas=replicas, rank=r, **kwargs)
        for r in range(replicas)
    ]


def long_tail(n: int, seed: int = 0) -> np.ndarray:
    """Multi-turn-like lengths: a lognormal number of turns of 20-400 tokens each, capped at 4096."""
    rng = np.random.default_rng(seed)
    turns = np.ceil(np.exp(rng.normal(1.0, 1.1, n))).astype(np.int64)
    tokens = rng.integers(20, 400, int(turns.sum()))
    return np.minimum(np.add.reduceat(tokens, np.concatenate([[0], np.cumsum(turns)[:-1]])), 4096)


def step_costs(samplers: list[MultipackBatchSampler], lengths: np.ndarray, cost: CostModel) -> np.ndarray:
    """``(num_steps, num_ranks)`` predicted cost of every rank's batch in the current epoch."""
    per_rank = [list(s) for s in samplers]
    return np.array([[cost.batch_cost(lengths[b]) for b in step] for step in zip(*per_rank, strict=True)])


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(1, 120), min_size=1, max_size=120),
    st.integers(1, 6),
    st.integers(0, 2**16),
    st.sampled_from(MIXINGS),
    st.booleans(),
)
def test_cost_balanced_steps_keep_the_batch_count_and_even_out_every_step(
    lengths, replicas, seed, mixing, drop_last
):
    lengths = np.array(lengths)
    cost = CostModel(3.0, 1.0)
    try:
        balanced = ranks(
            lengths, 120, replicas, seed=seed, mixing=mixing, cost_model=cost, drop_last=drop_last
        )
        by_tokens = ranks(
            lengths, 120, replicas, seed=seed, mixing=mixing, balance="tokens", drop_last=drop_last
        )
        steps = len(balanced[0])
    except ValueError as err:  # too little data for equal steps without repeating a sample
        assert "cannot give each" in str(err) or "drop_last=True every batch" in str(err)
        return
    assert balanced[0].balance == "cost" and all(len(s) == steps for s in balanced)
    per_rank = [list(s) for s in balanced]
    batches = [b for rank in per_rank for b in rank]
    assert all(lengths[b].sum() <= 120 for b in batches)  # the budget stays a hard cap
    # as many batches, as full, as token balance (the cost model moves samples between a step's batches) ...
    assert steps == len(by_tokens[0]) and balanced[0].efficiency() == by_tokens[0].efficiency()
    assert balanced[0].stats()["dropped_samples"] == by_tokens[0].stats()["dropped_samples"]
    if not drop_last:
        assert sorted(i for b in batches for i in b) == list(range(lengths.size))
    # ... until, in every step, the costliest batch is within 1% of the mean, or giving any of its samples
    # to another batch of the step (where it fits) would leave one of the two costlier than it was
    for step in zip(*per_rank, strict=True):
        costs = np.array([cost.batch_cost(lengths[b]) for b in step])
        h = int(np.argmax(costs))
        if costs[h] <= 1.01 * costs.mean():
            continue
        for other, batch in enumerate(step):
            room = 120 - lengths[batch].sum()
            for sample in step[h]:
                if other != h and lengths[sample] <= room:
                    moved = cost.batch_cost([lengths[sample]])
                    assert max(costs[h] - moved, costs[other] + moved) >= costs[h] * (1 - 1e-12)


def test_small_datasets_balance_every_step_of_the_epoch():
    # 300 long-tail conversations fill ~10 batches of 16k tokens: 5, 3 or 2 steps at 2, 4, 8 ranks, too few
    # to group batches of similar cost; every step is evened out by moving samples between its batches
    lengths = long_tail(300, seed=1)
    cost = CostModel(1.0, 1 / 2048)
    for replicas in (2, 4, 8):
        samplers = ranks(lengths, 16384, replicas, seed=0, cost_model=cost)
        for epoch in (0, 1):
            for s in samplers:
                s.set_epoch(epoch)
            costs = step_costs(samplers, lengths, cost)
            assert np.median(costs.max(axis=1) / costs.mean(axis=1)) <= 1.05
            assert rank_cost_spread(costs) == samplers[0].stats()["rank_cost_max_over_mean"] <= 1.05
        by_tokens = MultipackBatchSampler(lengths, 16384, num_replicas=replicas, balance="tokens", rank=0)
        assert len(by_tokens) == len(samplers[0]) and by_tokens.efficiency() == samplers[0].efficiency()
    # the negative control: the same steps without the moves (each step's batches as packed) wait 15-40%
    unmoved = MultipackBatchSampler(lengths, 16384, num_replicas=8, rank=0, cost_model=cost)
    unmoved._balance = lambda steps, cost, *bins: bins
    assert unmoved.stats()["rank_cost_max_over_mean"] > 1.1


def test_cost_balance_evens_out_long_tail_steps_where_tokens_do_not():
    lengths = long_tail(6000)
    cost = CostModel(2048.0, 1.0)  # a small model: attention is a large share
    for replicas in (2, 8):
        balanced = MultipackBatchSampler(
            lengths, 4096, num_replicas=replicas, rank=0, cost_model=cost
        ).stats()
        tokens = MultipackBatchSampler(
            lengths, 4096, num_replicas=replicas, rank=0, cost_model=cost, balance="tokens"
        ).stats()
        assert balanced["rank_cost_max_over_mean"] <= 1.05
        assert tokens["rank_cost_max_over_mean"] > 1.05  # the negative control: token balance waits
        assert balanced["batches"] == tokens["batches"] and balanced["efficiency"] == tokens["efficiency"]


@pytest.mark.parametrize("mixing", MIXINGS)
def test_cost_balanced_resume_yields_exactly_the_remaining_batches(mixing):
    lengths = long_tail(400, seed=3)
    kwargs = dict(num_replicas=2, rank=1, seed=5, mixing=mixing, cost_model=CostModel(100.0, 1.0))
    first = MultipackBatchSampler(lengths, 4096, **kwargs)
    first.set_epoch(2)
    full = list(first)
    it = iter(first)
    consumed = [next(it) for _ in range(5)]
    resumed = MultipackBatchSampler(lengths, 4096, **kwargs)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    resumed.set_epoch(2)
    assert consumed + list(resumed) == full
    other = MultipackBatchSampler(lengths, 4096, **{**kwargs, "cost_model": CostModel(1.0, 1.0)})
    with pytest.raises(ValueError, match="cost_model: saved"):
        other.load_state_dict(first.state_dict())
    with pytest.raises(ValueError, match="balance: saved 'cost', now 'tokens'"):
        MultipackBatchSampler(lengths, 4096, **{**kwargs, "balance": "tokens"}).load_state_dict(
            first.state_dict()
        )


def test_bad_cost_arguments_say_how_to_fix_them():
    with pytest.raises(ValueError, match="needs a cost_model"):
        MultipackBatchSampler([3, 4], 8, balance="cost")
    with pytest.raises(TypeError, match="must be a packing_hf.CostModel"):
        MultipackBatchSampler([3, 4], 8, cost_model=(1.0, 2.0))
    for linear, quadratic in ((-1.0, 1.0), (float("nan"), 1.0), (1.0, float("inf")), (True, 1.0)):
        with pytest.raises(ValueError, match="must be a finite number >= 0"):
            CostModel(linear, quadratic)
    with pytest.raises(ValueError, match="predicts no cost"):
        CostModel(0, 0)
    with pytest.raises(ValueError, match="expected two numbers"):
        CostModel.parse("1;2")
    with pytest.raises(ValueError, match="lacks hidden_size"):
        CostModel.from_config(object())
    with pytest.raises(ValueError, match=r"num_steps, num_ranks"):
        rank_cost_spread(np.ones(3))


def test_rank_cost_spread_is_the_time_against_perfect_balance():
    assert rank_cost_spread(np.array([[1.0, 1.0], [2.0, 2.0]])) == 1.0
    assert rank_cost_spread(np.array([[1.0, 3.0]])) == 1.5
    assert rank_cost_spread(np.zeros((0, 4))) == 1.0


def test_fit_recovers_the_coefficients_and_keeps_them_non_negative():
    tokens = np.array([1024.0, 1024.0, 1024.0, 512.0])
    squares = np.array([1024.0**2, 1024.0**2 / 4, 1024.0**2 / 16, 512.0**2])
    exact = [(t, s, 0.01 + 2e-5 * t + 3e-9 * s) for t, s in zip(tokens, squares, strict=True)]
    linear, quadratic = _fit(exact)
    assert linear == pytest.approx(2e-5, rel=1e-6) and quadratic == pytest.approx(3e-9, rel=1e-6)
    # a time that falls with the squares would need a negative quadratic term: pinned to 0 instead
    falling = [(t, s, 0.01 + 2e-5 * t - 3e-9 * s) for t, s in zip(tokens, squares, strict=True)]
    linear, quadratic = _fit(falling)
    assert quadratic == 0.0 and linear > 0


def test_fit_cost_model_times_the_model_once_then_reads_the_cache(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from packing_hf import register_attention

    config = AutoConfig.for_model(
        "llama",
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        use_cache=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=register_attention())
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    path = tmp_path / "costs.json"
    fitted = fit_cost_model(model, 64, repeats=1, cache=path)
    assert fitted.source == "fitted" and fitted.linear >= 0 and fitted.quadratic >= 0
    assert len(calls) == 8 and all(p.grad is None for p in model.parameters())  # 4 rows x (warm-up + 1)
    assert fit_cost_model(model, 64, repeats=1, cache=path) == fitted and len(calls) == 8  # from the cache
    (entry,) = json.loads(path.read_text()).values()
    assert entry["max_tokens"] == 64 and len(entry["points"]) == 4
    fit_cost_model(model, 32, repeats=1, cache=path)  # another budget is another key
    assert len(calls) == 16 and len(json.loads(path.read_text())) == 2
    with pytest.raises(ValueError, match="max_tokens must be an int >= 1"):
        fit_cost_model(model, 0)
