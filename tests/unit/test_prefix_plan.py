"""Planning by computed tokens: prefix groups (packing_hf.prefix_plan) and the sampler packing them.

Every group's tokens are checked against the tree ``build_prefix_tree`` makes of its members (the row the
collator builds); the sampler's batches against the budget, the ranks and resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from packing_hf.cost import CostModel
from packing_hf.prefix_plan import PrefixGroups, find_prefix_groups
from packing_hf.prefix_tree import build_prefix_tree
from packing_hf.sampler import MultipackBatchSampler


def _tree_figures(samples, min_shared_tokens):
    """``(tokens, attention)`` of the row ``build_prefix_tree`` makes: a node of ``l`` tokens under ``a``
    ancestor tokens adds ``(a + l)**2 - a**2``."""
    tree = build_prefix_tree(samples, min_shared_tokens=min_shared_tokens)
    cu = tree.cu_seqlens.long()
    start = tree.position_ids[cu[:-1]]  # ancestor tokens of every node
    return tree.input_ids.numel(), float(((start + torch.diff(cu)) ** 2 - start**2).sum())


def _conversations(rng, n, *, system=6, vocab=40):
    """Per-turn samples of multi-turn conversations under one system prompt (each turn's sample holds the
    earlier turns), some turns answered twice (branches), some samples repeated."""
    prompt = rng.integers(0, vocab, system).tolist()
    samples = []
    while len(samples) < n:
        conversation = list(prompt)
        for _ in range(int(rng.integers(1, 4))):
            conversation = conversation + rng.integers(0, vocab, int(rng.integers(1, 9))).tolist()
            samples.append(conversation)
            if rng.random() < 0.2:  # another answer to the same turn
                samples.append(conversation[:-1] + rng.integers(0, vocab, 2).tolist())
        if rng.random() < 0.1:
            samples.append(list(samples[-1]))
    return samples[:n]


def _check_groups(samples, groups, budget, min_shared_tokens):
    members = np.concatenate(groups.members)
    assert sorted(members.tolist()) == list(range(len(samples)))  # every sample exactly once
    for g, index in enumerate(groups.members):
        tokens, attention = _tree_figures([samples[i] for i in index], min_shared_tokens)
        assert groups.unique_tokens[g] == tokens
        assert groups.attention[g] == pytest.approx(attention)
        assert groups.sample_tokens[g] == sum(len(samples[i]) for i in index)
        assert tokens <= budget or len(index) == 1  # only a sample over the budget is a group over it


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 30),
    budget=st.integers(4, 80),
    min_shared_tokens=st.integers(1, 4),
)
def test_groups_are_the_trees_build_prefix_tree_makes(seed, n, budget, min_shared_tokens):
    rng = np.random.default_rng(seed)
    samples = _conversations(rng, n, vocab=int(rng.integers(2, 40)))
    groups = find_prefix_groups(samples, max_tokens_per_batch=budget, min_shared_tokens=min_shared_tokens)
    _check_groups(samples, groups, budget, min_shared_tokens)


def test_node_boundaries_of_min_shared_tokens_are_build_prefix_tree_s():
    """With ``min_shared_tokens=2`` the third sample's branch after 2 tokens cuts the first two's shared run of 3
    into a node of 2 and repeats the third token: 7 tokens, where neighbours' common prefixes count 6 (the
    negative control: the count of ``min_shared_tokens=1``)."""
    samples = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6]]
    assert _tree_figures(samples, 2)[0] == 7 and _tree_figures(samples, 1)[0] == 6
    assert find_prefix_groups(
        samples, max_tokens_per_batch=64, min_shared_tokens=2
    ).unique_tokens.tolist() == [7]
    assert find_prefix_groups(samples, max_tokens_per_batch=64).unique_tokens.tolist() == [6]
    # fewer shared leading tokens than min_shared_tokens: separate groups
    apart = find_prefix_groups([[1, 2, 3], [1, 2, 4], [1, 5]], max_tokens_per_batch=64, min_shared_tokens=3)
    assert [m.tolist() for m in apart.members] == [[0], [1], [2]]


def test_a_tree_over_the_budget_is_cut_into_subtrees_not_dropped():
    prompt = list(range(100, 110))  # 10 tokens every sample shares
    samples = [prompt + [i, i + 1, i + 2] for i in range(0, 60, 3)] + [
        prompt
    ]  # 20 answers and the prompt alone
    whole = _tree_figures(samples, 1)[0]
    assert whole == 10 + 20 * 3
    groups = find_prefix_groups(samples, max_tokens_per_batch=25)
    _check_groups(samples, groups, 25, 1)
    # every piece repeats the prompt: 10 + 5 answers x 3, the prompt alone in the first
    assert groups.unique_tokens.tolist() == [25, 25, 25, 25] and groups.members[0].tolist() == [
        0,
        1,
        2,
        3,
        4,
        20,
    ]
    assert groups.token_ratio == pytest.approx(sum(map(len, samples)) / 100)
    # a sample over the budget is a group of its own, for the sampler's overflow policy
    long = find_prefix_groups([prompt * 3, prompt + [1]], max_tokens_per_batch=25)
    assert [m.tolist() for m in long.members] == [[0], [1]] and long.unique_tokens.tolist() == [30, 11]


def test_inputs_cost_and_refusals():
    datasets = pytest.importorskip("datasets")
    rng = np.random.default_rng(0)
    samples = _conversations(rng, 40)
    dataset = datasets.Dataset.from_dict({"input_ids": samples}).shuffle(seed=1)
    from_dataset = find_prefix_groups(dataset, max_tokens_per_batch=48)
    from_lists = find_prefix_groups(dataset["input_ids"], max_tokens_per_batch=48)
    assert [m.tolist() for m in from_dataset.members] == [m.tolist() for m in from_lists.members]
    assert from_dataset.unique_tokens.tolist() == from_lists.unique_tokens.tolist()
    cost = CostModel(3.0, 0.5)
    priced = find_prefix_groups(samples, max_tokens_per_batch=48, cost_model=cost)
    np.testing.assert_allclose(priced.cost, 3.0 * priced.unique_tokens + 0.5 * priced.attention)
    with pytest.raises(ValueError, match="sample 1 has no tokens"):
        find_prefix_groups([[1], []], max_tokens_per_batch=8)
    with pytest.raises(ValueError, match="min_shared_tokens=0"):
        find_prefix_groups([[1]], max_tokens_per_batch=8, min_shared_tokens=0)
    with pytest.raises(TypeError, match=r"token_ids\[0\] must be a 1-D sequence of token ids"):
        find_prefix_groups([[1.5]], max_tokens_per_batch=8)
    with pytest.raises(TypeError, match="cost_model must be a packing_hf.CostModel"):
        find_prefix_groups([[1]], max_tokens_per_batch=8, cost_model=(1, 2))


BUDGET = 160


@pytest.fixture(scope="module")
def planned():
    samples = _conversations(np.random.default_rng(3), 300)
    return samples, [len(s) for s in samples], find_prefix_groups(samples, max_tokens_per_batch=BUDGET)


@pytest.mark.parametrize("replicas", [2, 3])
def test_sampler_yields_every_sample_once_in_equal_steps_within_the_budget(planned, replicas):
    samples, lengths, groups = planned
    group_of = np.empty(len(samples), np.int64)
    for g, index in enumerate(groups.members):
        group_of[index] = g
    samplers = [
        MultipackBatchSampler(lengths, BUDGET, num_replicas=replicas, rank=r, prefix_groups=groups, seed=5)
        for r in range(replicas)
    ]
    mixes = []
    for epoch in (0, 1):
        for sampler in samplers:
            sampler.set_epoch(epoch)
        batches = [list(sampler) for sampler in samplers]
        assert {len(b) for b in batches} == {len(samplers[0])}  # equal steps, exact len()
        flat = sorted(i for rank in batches for batch in rank for i in batch)
        assert flat == list(range(len(samples)))  # every sample exactly once per epoch
        mix = set()
        for batch in (batch for rank in batches for batch in rank):
            held = set(group_of[batch].tolist())
            assert sum(groups.members[g].size for g in held) == len(batch)  # whole groups only
            assert _tree_figures([samples[i] for i in batch], 1)[0] <= BUDGET  # the collator's row fits
            mix.add(frozenset(held))
        mixes.append(mix)
    assert mixes[0] != mixes[1]  # a new mix of groups every epoch
    stats = samplers[0].stats()
    assert stats["tree_token_ratio"] == pytest.approx(groups.token_ratio)
    assert stats["prefix_groups"] == groups.num_groups


def test_sampler_resumes_and_refuses_another_plan(planned):
    samples, lengths, groups = planned
    sampler = MultipackBatchSampler(lengths, BUDGET, num_replicas=2, rank=1, prefix_groups=groups, seed=2)
    sampler.set_epoch(1)
    full = list(sampler)
    it = iter(sampler)
    for _ in range(3):
        next(it)
    state = sampler.state_dict()
    resumed = MultipackBatchSampler(lengths, BUDGET, num_replicas=2, rank=1, prefix_groups=groups, seed=2)
    resumed.load_state_dict(state)
    assert list(resumed) == full[3:]
    plain = MultipackBatchSampler(lengths, BUDGET, num_replicas=2, rank=1, seed=2)
    with pytest.raises(ValueError, match="prefix_groups_sha1"):
        plain.load_state_dict(state)


def _groups(members, unique, sample_tokens):
    n = len(members)
    return PrefixGroups(
        members=tuple(np.asarray(m, np.int64) for m in members),
        unique_tokens=np.asarray(unique, np.int64),
        sample_tokens=np.asarray(sample_tokens, np.int64),
        cost=np.zeros(n),
        attention=np.zeros(n),
    )


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        (_groups([[0, 1], [1, 2]], [4, 4], [5, 5]), "sample 1 is in 2 prefix groups"),
        (_groups([[0, 1]], [4], [5]), "sample 2 is in 0 prefix groups"),
        (_groups([[0, 1, 2], [3]], [6, 1], [8, 1]), "names sample 3, but there are 3 samples"),
        (_groups([[0, 1], [2]], [4, 3], [6, 3]), "its samples hold 5 tokens by these lengths"),
        (_groups([[0, 1], [2]], [2, 3], [5, 3]), "unique_tokens=2, outside"),
        (_groups([[0, 1, 2]], [7], [8]), "in a tree of 7 tokens > max_tokens_per_batch=6"),
        ([[0, 1, 2]], "prefix_groups must be a packing_hf.prefix_plan.PrefixGroups"),
    ],
)
def test_sampler_refuses_groups_that_are_not_these_samples(groups, message):
    with pytest.raises((ValueError, TypeError), match=message):
        MultipackBatchSampler([2, 3, 3], 6, prefix_groups=groups)


def test_sampler_applies_overflow_to_a_group_over_the_budget():
    samples = [[1, 2, 3], [1, 2, 4], list(range(20, 32))]  # the last is over the budget of 8
    groups = find_prefix_groups(samples, max_tokens_per_batch=8)
    lengths = [len(s) for s in samples]
    with pytest.raises(ValueError, match="sample 2 has 12 tokens > max_tokens_per_batch=8"):
        MultipackBatchSampler(lengths, 8, prefix_groups=groups)
    sampler = MultipackBatchSampler(lengths, 8, prefix_groups=groups, overflow="split", seed=0)
    sampler.wrap_dataset(samples)
    assert sorted(sorted(b) for b in sampler) == [
        [0, 1, 4],
        [3],
    ]  # pieces 3 and 4 (8 + 4 tokens), the tree of 4


def test_pieces_built_as_one_tree_with_min_shared_tokens_over_one_can_exceed_their_sum():
    """The documented limit (docs/prefix_trees.md): with ``min_shared_tokens=2`` the ten samples sharing 4
    tokens and the one sharing 3 with them are cut apart; built together, the shorter common run (3) moves the
    node boundary and the ten repeat a token each, so the row holds more than the two pieces' sum. With
    ``min_shared_tokens=1`` a batch's tree never holds more (the sampler test checks every batch)."""
    branch = [[9, 9, 1, 5, 10 + i, 50, 51] for i in range(10)]
    samples = [*branch, [9, 9, 1, 6, *range(100, 130)], [9, 9, 2, *range(200, 230)]]
    groups = find_prefix_groups(samples, max_tokens_per_batch=60, min_shared_tokens=2)
    assert [m.tolist() for m in groups.members] == [list(range(10)), [10], [11]]
    together = [samples[i] for i in range(11)]
    assert _tree_figures(together, 2)[0] > groups.unique_tokens[:2].sum()
