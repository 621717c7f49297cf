"""pack_rollouts / unpack_rollouts: TRL's padded rollout layout <-> packed rows, exact bookkeeping."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from packing_hf.rollouts import pack_rollouts, rollout_spans, unpack_rollouts
from packing_hf.shared_prefix import shared_prefix_position_ids


def _padded(prompts: list[list[int]], completions: list[list[int]], pad: int = 0):
    """TRL's layout: prompts left-padded to P, completions right-padded to C; returns ids, mask, C."""
    p_width = max(map(len, prompts))
    c_width = max(1, max(map(len, completions)))
    ids = torch.full((len(prompts), p_width + c_width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        ids[b, p_width - len(p) : p_width] = torch.tensor(p)
        mask[b, p_width - len(p) : p_width] = 1
        if c:
            ids[b, p_width : p_width + len(c)] = torch.tensor(c)
            mask[b, p_width : p_width + len(c)] = 1
    return ids, mask, c_width


def _reference_targets(ids, mask, c_width):
    """(B, C) token ids of every completion target, -1 where there is none (what TRL's labels score)."""
    out = ids[:, -c_width:].clone()
    out[mask[:, -c_width:] == 0] = -1
    return out


rollout_batches = st.integers(1, 4).flatmap(
    lambda n_prompts: st.tuples(
        st.lists(
            st.lists(st.integers(1, 50), min_size=1, max_size=6), min_size=n_prompts, max_size=n_prompts
        ),
        st.integers(1, 3),
        st.lists(st.lists(st.integers(1, 50), min_size=0, max_size=6), min_size=12, max_size=12),
    )
)


@settings(max_examples=60, deadline=None)
@given(rollout_batches, st.sampled_from([None, 12, 20]), st.booleans(), st.integers(1, 4))
def test_every_target_is_scattered_back_to_its_padded_place(batch, budget, share, min_packs):
    prompts, group, completions = batch
    rows_p = [p for p in prompts for _ in range(group)]
    rows_c = completions[: len(rows_p)]
    ids, mask, c_width = _padded(rows_p, rows_c)
    try:
        packs = pack_rollouts(ids, mask, c_width, budget, min_packs, share)
    except ValueError as exc:  # a rollout (group) over the budget: the refusal has its own test
        assert budget is not None and "max_tokens_per_batch" in str(exc)
        return
    assert sorted(torch.cat([p.rows for p in packs]).tolist()) == list(range(len(rows_p)))  # each row once
    if budget is not None:
        assert all(p.input_ids.shape[1] <= budget for p in packs)
    assert len(packs) >= min(min_packs, len(rows_p))  # enough forwards for every rank to run as many
    # the "model": predict the next token; its shifted outputs must land where TRL reads the targets
    outputs = [p.input_ids[:, 1:].float() for p in packs]
    got = unpack_rollouts(outputs, packs, len(rows_p), c_width)
    want = _reference_targets(ids, mask, c_width).float().clamp(min=0)
    assert torch.equal(got, want)
    for p in packs:
        cu = p.cu_seq_lens
        assert int(cu[-1]) == p.input_ids.shape[1] and p.max_length == int((cu[1:] - cu[:-1]).max())
        if p.prefix_seq_idx is None:  # positions restart in every segment
            starts = torch.zeros(p.input_ids.shape[1], dtype=torch.bool)
            starts[cu[:-1].long()] = True
            assert torch.equal(p.position_ids[0] == 0, starts)
        else:  # branches continue from their prefix
            assert torch.equal(p.position_ids[0], shared_prefix_position_ids(cu, p.prefix_seq_idx))
        # labels: exactly the targets, never a segment's first token
        assert (p.labels[0, cu[:-1].long()] == -100).all()


def test_shared_prompt_is_stored_once_per_group():
    ids, mask, c_width = _padded([[5, 6, 7]] * 3 + [[8, 9]], [[1, 2], [3], [4, 4, 4], [2]])
    [pack] = pack_rollouts(ids, mask, c_width, share_prompts=True)
    # prefix [5, 6] once, then three branches [7, ...]; the lone rollout [8, 9, 2] as it is
    assert pack.input_ids.tolist() == [[5, 6, 7, 1, 2, 7, 3, 7, 4, 4, 4, 8, 9, 2]]
    assert pack.prefix_seq_idx.tolist() == [-1, 0, 0, 0, -1]
    [plain] = pack_rollouts(ids, mask, c_width)
    assert (
        plain.input_ids.numel() - pack.input_ids.numel() == 2 * 2
    )  # two prompt copies saved (P - 1 = 2 each)


def test_groups_are_split_only_to_give_every_rank_as_many_forwards():
    ids, mask, c_width = _padded([[5, 6, 7]] * 4, [[1], [2], [3], [4]])
    assert len(pack_rollouts(ids, mask, c_width, share_prompts=True)) == 1
    packs = pack_rollouts(ids, mask, c_width, min_packs=2, share_prompts=True)
    assert len(packs) == 2 and all(p.prefix_seq_idx.tolist() == [-1, 0, 0] for p in packs)


def test_a_rollout_or_group_over_the_budget_is_refused():
    ids, mask, c_width = _padded([[5, 6, 7]] * 2, [[1, 2, 3], [4]])
    with pytest.raises(ValueError, match="rollout 0 holds 6 tokens .* max_tokens_per_batch=5"):
        pack_rollouts(ids, mask, c_width, max_tokens_per_batch=5)
    with pytest.raises(ValueError, match="group of 2 rollouts sharing a prompt holds 8 tokens"):
        pack_rollouts(ids, mask, c_width, max_tokens_per_batch=7, share_prompts=True)


def test_malformed_masks_are_refused():
    with pytest.raises(ValueError, match="not one contiguous run"):
        rollout_spans(torch.tensor([[1, 0, 1, 1]]), 2)
    with pytest.raises(ValueError, match="not one contiguous run"):  # no prompt token
        rollout_spans(torch.tensor([[0, 0, 1, 1]]), 2)
    with pytest.raises(ValueError, match="logits_to_keep=5"):
        rollout_spans(torch.tensor([[1, 1, 1, 1]]), 5)


def _path_model(pack) -> torch.Tensor:
    """A "model" whose output for a prediction is a hash of the whole context it was computed from (the
    tokens of the path to the predicting row token) and the token it predicts: ``(1, N)`` per slot."""
    ids, cu = pack.input_ids[0].tolist(), pack.cu_seq_lens.tolist()
    parents = [-1] * (len(cu) - 1) if pack.prefix_seq_idx is None else pack.prefix_seq_idx.tolist()
    context: list[tuple] = [()] * len(ids)
    for s, (start, end) in enumerate(zip(cu[:-1], cu[1:], strict=True)):
        path = context[cu[parents[s] + 1] - 1] if parents[s] >= 0 else ()
        for t in range(start, end):
            path = context[t] = (*path, ids[t])
    slots = zip(pack.predictors.tolist(), pack.shift_labels[0].tolist(), strict=True)
    return torch.tensor([[float(hash((*context[p], y)) % 2**20) for p, y in slots]])


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.lists(st.integers(1, 3), min_size=1, max_size=8), min_size=1, max_size=8),
    st.lists(st.lists(st.integers(1, 3), min_size=1, max_size=3), min_size=1, max_size=2),
    st.sampled_from([None, 12, 20]),
    st.integers(1, 4),
    st.integers(1, 3),
)
def test_tree_predictions_read_their_whole_context(completions, prompts, budget, min_packs, min_shared):
    """share_prefixes: every completion token (a tiny vocabulary, so rollouts branch at many depths, repeat
    and end inside each other) reads the slot whose predicting row token has exactly its rollout's earlier
    tokens as context; nothing else is read, no (B, C) place twice."""
    rows_p = [prompts[b % len(prompts)] for b in range(len(completions))]
    ids, mask, c_width = _padded(rows_p, completions)
    try:
        packs = pack_rollouts(
            ids, mask, c_width, budget, min_packs, share_prefixes=True, min_shared_tokens=min_shared
        )
    except ValueError as exc:
        assert budget is not None and "max_tokens_per_batch" in str(exc)
        return
    assert sorted(torch.cat([p.rows for p in packs]).tolist()) == list(range(len(rows_p)))
    assert len(packs) >= min(min_packs, len(rows_p))
    for p in packs:
        assert budget is None or p.input_ids.shape[1] <= budget
        if p.prefix_seq_idx is not None:
            assert torch.equal(p.position_ids[0], shared_prefix_position_ids(p.cu_seq_lens, p.prefix_seq_idx))
    got = unpack_rollouts([_path_model(p) for p in packs], packs, len(rows_p), c_width)
    want = torch.zeros(len(rows_p), c_width)
    p_width = ids.shape[1] - c_width
    for b in range(len(rows_p)):
        start = int(mask[b].argmax())
        for c in range(c_width):
            if mask[b, p_width + c]:
                want[b, c] = float(hash(tuple(ids[b, start : p_width + c + 1].tolist())) % 2**20)
    assert torch.equal(got, want)
    # sharing: no more tokens than the rollouts alone, fewer once two rollouts share min_shared tokens
    assert sum(p.input_ids.numel() for p in packs) <= int(mask.sum())
