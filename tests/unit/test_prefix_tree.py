"""Prefix trees built from tokenized samples: the trie, its branch-point semantics and verl's edge cases
(duplicate samples, a sample that is a strict prefix of another, shuffled order, the log-prob at the
branch point). The models' side (packed tree == every sample alone) is tests/integration/attention/
test_prefix_tree.py."""

from __future__ import annotations

import json
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from packing_hf.prefix_tree import build_prefix_tree
from packing_hf.shared_prefix import shared_prefix_plan

SYSTEM, USER_1, ANSWER_1A, ANSWER_1B = [7, 7, 3, 1], [4, 2], [9, 9, 9], [9, 5]
USER_2, ANSWER_2A, ANSWER_2B = [4, 6], [8, 1], [8]
CONVERSATIONS = [
    SYSTEM + USER_1 + ANSWER_1A + USER_2 + ANSWER_2A,
    SYSTEM + USER_1 + ANSWER_1A + USER_2 + ANSWER_2B,  # a strict prefix of the one above
    SYSTEM + USER_1 + ANSWER_1B,
    SYSTEM + USER_1 + ANSWER_1A + USER_2 + ANSWER_2A,  # a duplicate of the first
    [5, 5, 5],  # shares nothing
]


def _check_invariants(tree, samples, min_shared_tokens=1):
    """Every sample is a root-to-node path whose keys (the attention's gather) are exactly its tokens."""
    plan = shared_prefix_plan(tree.cu_seqlens, tree.prefix_seq_idx)
    keys = torch.split(plan.key_index, torch.diff(plan.cu_seqlens_k).tolist())
    ends = tree.cu_seqlens[1:].tolist()
    for sample, rows in zip(samples, tree.sample_rows(), strict=True):
        assert tree.input_ids[rows].tolist() == list(sample)
        assert tree.position_ids[rows].tolist() == list(range(len(sample)))
        last = ends.index(int(rows[-1]) + 1)  # a sample ends where a node ends, and reads that node's keys
        assert keys[last].tolist() == rows.tolist()
    # a node several samples pass through (duplicates included) holds at least min_shared_tokens tokens
    through = torch.zeros(tree.input_ids.numel(), dtype=torch.long)
    for rows in tree.sample_rows():
        through[rows] += 1
    for start, end in zip(tree.cu_seqlens[:-1].tolist(), ends, strict=True):
        assert int(through[start]) == 1 or end - start >= min_shared_tokens


def test_a_conversation_tree_stores_every_distinct_prefix_once():
    tree = build_prefix_tree(CONVERSATIONS)
    _check_invariants(tree, CONVERSATIONS)
    nodes = [
        tree.input_ids[a:b].tolist() for a, b in zip(tree.cu_seqlens[:-1], tree.cu_seqlens[1:], strict=True)
    ]
    assert nodes == [SYSTEM + USER_1 + [9], [9, 9] + USER_2 + [8], [1], [5], [5, 5, 5]]
    assert tree.prefix_seq_idx.tolist() == [-1, 0, 1, 0, -1]
    distinct_prefixes = {tuple(s[:i]) for s in CONVERSATIONS for i in range(1, len(s) + 1)}
    assert tree.input_ids.numel() == len(distinct_prefixes)
    assert tree.token_ratio == sum(map(len, CONVERSATIONS)) / len(distinct_prefixes)


def test_duplicates_and_strict_prefixes_read_the_same_rows():
    tree = build_prefix_tree(CONVERSATIONS)
    rows = tree.sample_rows()
    assert torch.equal(rows[0], rows[3])  # the duplicate reads the first sample's rows
    assert torch.equal(rows[1], rows[0][: len(CONVERSATIONS[1])])  # the strict prefix ends inside its path


def test_the_branch_point_row_predicts_every_childs_first_token():
    """Labels: a sample's token j is predicted at its token j - 1, so a child's first token is predicted at
    its parent's last row (shared by every child), each child reading its own token there."""
    tree = build_prefix_tree([[1, 2, 3], [1, 2, 4], [1, 2]])
    assert tree.cu_seqlens.tolist() == [0, 2, 3, 4] and tree.prefix_seq_idx.tolist() == [-1, 0, 0]
    logits = torch.randn(4, 6)
    logprobs = torch.log_softmax(logits, dim=-1)
    got = tree.token_logprobs(logits[None])
    assert torch.allclose(got[0], logprobs[[0, 1], [2, 3]])  # token 3 predicted at row 1, the branch point
    assert torch.allclose(got[1], logprobs[[0, 1], [2, 4]])  # token 4 predicted at the same row
    assert torch.allclose(got[2], logprobs[[0], [2]])
    assert [v.tolist() for v in tree.sample_values(torch.arange(4))] == [[0, 1, 2], [0, 1, 3], [0, 1]]


def test_shuffled_order_changes_the_row_never_a_samples_values():
    order = list(range(len(CONVERSATIONS)))
    random.Random(0).shuffle(order)
    tree = build_prefix_tree(CONVERSATIONS)
    shuffled = build_prefix_tree([CONVERSATIONS[i] for i in order])
    _check_invariants(shuffled, [CONVERSATIONS[i] for i in order])
    assert shuffled.input_ids.numel() == tree.input_ids.numel()
    # what a causal model computes at a token depends on its prefix only: every sample reads the same prefixes
    for new, old in enumerate(order):
        rows_new, rows_old = shuffled.sample_rows()[new], tree.sample_rows()[old]
        prefix_new = [tuple(shuffled.input_ids[rows_new[: j + 1]].tolist()) for j in range(len(rows_new))]
        prefix_old = [tuple(tree.input_ids[rows_old[: j + 1]].tolist()) for j in range(len(rows_old))]
        assert prefix_new == prefix_old
    assert shuffled.input_ids.tolist() != tree.input_ids.tolist()  # the order did change the row


def test_min_shared_tokens_repeats_a_short_common_run():
    samples = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 9]]
    merged = build_prefix_tree(samples)
    assert merged.prefix_seq_idx.tolist() == [-1, 0, 1, 1, 0]  # [1, 2] | [3, 4] | [5] | [6] | [9]
    tree = build_prefix_tree(samples, min_shared_tokens=3)
    assert tree.input_ids.tolist() == [1, 2, 3, 4, 5, 6, 1, 2, 9]
    assert tree.prefix_seq_idx.tolist() == [-1, 0, 0, -1]
    _check_invariants(tree, samples, 3)
    assert build_prefix_tree(samples, min_shared_tokens=5).prefix_seq_idx.tolist() == [-1, -1, -1]


@pytest.mark.parametrize(
    "samples, kwargs, error, match",
    [
        ([], {}, ValueError, "samples is empty"),
        ([[1, 2], []], {}, ValueError, r"samples\[1\] has no tokens"),
        ([[1.5, 2.0]], {}, TypeError, r"samples\[0\] must be a 1-D sequence of token ids"),
        (torch.ones(2, 3, dtype=torch.long), {}, TypeError, "sequence of token id sequences"),
        ([[1, 2]], {"min_shared_tokens": 0}, ValueError, "min_shared_tokens=0"),
        ([[1, 2]], {"min_shared_tokens": True}, ValueError, "min_shared_tokens=True"),
    ],
)
def test_malformed_input_is_refused_by_name(samples, kwargs, error, match):
    with pytest.raises(error, match=match):
        build_prefix_tree(samples, **kwargs)


def test_values_of_another_row_are_refused():
    tree = build_prefix_tree([[1, 2], [1, 3]])
    with pytest.raises(ValueError, match="does not match the tree's row of 3 tokens"):
        tree.token_logprobs(torch.randn(4, 5))


# samples drawn from a small alphabet over a few shared stems: many duplicates, prefixes and branch points
_stems = st.lists(st.integers(0, 3), min_size=1, max_size=6)
_samples = st.lists(st.tuples(st.integers(0, 2), _stems), min_size=1, max_size=8)


@settings(max_examples=60, deadline=None)
@given(_samples, st.integers(1, 4))
def test_every_sample_is_a_path_whose_keys_are_its_tokens(drawn, min_shared_tokens):
    stems = [[1, 2, 3], [1, 2], [0]]
    samples = [stems[s] + tail for s, tail in drawn]
    tree = build_prefix_tree(samples, min_shared_tokens=min_shared_tokens)
    _check_invariants(tree, samples, min_shared_tokens)
    if min_shared_tokens == 1:
        distinct = {tuple(s[:i]) for s in samples for i in range(1, len(s) + 1)}
        assert tree.input_ids.numel() == len(distinct)


# ---- token_logprobs: the target's logit minus its row's log-sum-exp, no (T, V) log-softmax --------------------


def _log_softmax_reference(tree, logits):
    """The formula token_logprobs replaces: the whole row's log-softmax (fp32), read at every sample's targets."""
    rows, targets = tree._predictions()
    return torch.log_softmax(logits.float(), dim=-1)[rows, targets]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [2, 1000])  # several chunks with pairs at their edges, and one chunk
def test_token_logprobs_and_gradients_equal_the_log_softmax(monkeypatch, dtype, chunk):
    monkeypatch.setattr(
        "packing_hf.prefix_tree.default_chunk_size", lambda vocab, device: chunk, raising=False
    )
    tree = build_prefix_tree(CONVERSATIONS)
    torch.manual_seed(0)
    logits = (torch.randn(tree.input_ids.numel(), 11) * 3).to(dtype)
    got_logits, want_logits = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    got = torch.cat(tree.token_logprobs(got_logits[None]))
    want = _log_softmax_reference(tree, want_logits)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    weights = torch.randn(got.numel())  # a shared row's pairs add their gradients there
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    assert got_logits.grad.dtype == dtype
    torch.testing.assert_close(got_logits.grad.float(), want_logits.grad.float(), rtol=0, atol=1e-6)
    # negative control: a pair's gradient dropped at a branch point (the row read by several children) is caught
    rows, targets = tree._predictions()
    at = int(torch.bincount(rows).argmax())  # the row most pairs read
    pair = int(torch.nonzero(rows == at)[-1])
    broken = got_logits.grad.float().clone()
    broken[at, targets[pair]] -= weights[pair]
    assert not torch.allclose(broken, want_logits.grad.float(), rtol=0, atol=1e-6)


def _peak_bytes(fn, trace) -> int:
    """The most bytes torch's CPU allocator held above its level at the start of ``fn()`` (the profiler's
    allocation and free events summed in order)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    prof.export_chrome_trace(str(trace))
    level = peak = 0
    for event in json.loads(trace.read_text())["traceEvents"]:
        if event.get("name") == "[memory]":
            level += event["args"]["Bytes"]
            peak = max(peak, level)
    return peak


def test_token_logprobs_hold_one_logits_sized_tensor(monkeypatch, tmp_path):
    """Forward and backward allocate the logits' gradient and a chunk, no (T, V) log-softmax or its temporaries."""
    monkeypatch.setattr("packing_hf.prefix_tree.default_chunk_size", lambda vocab, device: 32, raising=False)
    torch.manual_seed(0)
    stem = list(range(100))
    tree = build_prefix_tree([stem + torch.randint(0, 512, (150,)).tolist() for _ in range(3)])  # 550 rows
    logits = torch.randn(tree.input_ids.numel(), 512, requires_grad=True)  # (T, V) fp32: 1.1 MB

    def tree_step():
        torch.cat(tree.token_logprobs(logits)).sum().backward()
        logits.grad = None

    def log_softmax_step():  # negative control: the formula replaced, measured the same way
        _log_softmax_reference(tree, logits).sum().backward()
        logits.grad = None

    # the gradient (1x), a 32-row chunk (0.06x) and the pairs' small tensors; the log-softmax's take 3x
    assert _peak_bytes(tree_step, tmp_path / "tree.json") < 1.5 * logits.nbytes
    assert _peak_bytes(log_softmax_step, tmp_path / "reference.json") >= 2 * logits.nbytes
