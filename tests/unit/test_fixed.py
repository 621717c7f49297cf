"""pack_sequences / concatenate_and_pack: the documented greedy example, FFD, boundaries, positions,
overflow policies, empty input, and (property) no token lost or duplicated."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from packing_hf.fixed import concatenate_and_pack, pack_sequences
from packing_hf.varlen import position_ids_to_cu_seqlens

DOC_SEQUENCES = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10, 11, 12]]


def test_greedy_matches_the_documented_example():
    packed = pack_sequences(DOC_SEQUENCES, max_length=8, pad_token_id=0)
    assert packed.dtype == torch.int64
    assert packed.tolist() == [[1, 2, 3, 4, 5, 0, 0, 0], [6, 7, 8, 9, 10, 11, 12, 0]]


def test_tensors_and_arrays_pack_like_lists():
    as_tensors = [torch.tensor(s) for s in DOC_SEQUENCES]
    as_arrays = [np.array(s, dtype=np.int32) for s in DOC_SEQUENCES]
    expected = pack_sequences(DOC_SEQUENCES, 8, 0)
    assert torch.equal(pack_sequences(as_tensors, 8, 0), expected)
    assert torch.equal(pack_sequences(as_arrays, 8, 0), expected)


def test_boundaries_and_position_ids():
    packed, bounds, pos = pack_sequences(
        DOC_SEQUENCES, max_length=8, pad_token_id=0, return_boundaries=True, return_position_ids=True
    )
    assert bounds == [[(0, 3), (3, 5)], [(0, 4), (4, 7)]]
    assert pos.dtype == torch.int64
    assert pos.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 3, 0, 1, 2, 0]]
    # the boundaries can be recovered from each row's positions (padding is its own segment)
    assert position_ids_to_cu_seqlens(pos[0]).tolist() == [0, 3, 5, 8]
    only_pos = pack_sequences(DOC_SEQUENCES, 8, 0, return_position_ids=True, position_ids_start=1)
    assert isinstance(only_pos, tuple) and len(only_pos) == 2
    assert only_pos[1][1].tolist() == [1, 2, 3, 4, 1, 2, 3, 1]
    only_bounds = pack_sequences(DOC_SEQUENCES, 8, 0, True)
    assert len(only_bounds) == 2 and only_bounds[1] == bounds


def test_ffd_fills_rows_better_and_keeps_input_order_inside_a_row():
    sequences = [[1] * 6, [2] * 3, [3] * 6, [4] * 2, [5] * 2, [6] * 5]
    greedy = pack_sequences(sequences, max_length=8, pad_token_id=0)
    ffd, bounds = pack_sequences(
        sequences, max_length=8, pad_token_id=0, strategy="ffd", return_boundaries=True
    )
    assert greedy.shape[0] == 4 and ffd.shape[0] == 3
    # decreasing: 6 -> row 0, 6 -> row 1, 5 -> row 2, 3 -> row 2, 2 -> row 0, 2 -> row 1
    assert ffd.tolist() == [
        [1, 1, 1, 1, 1, 1, 4, 4],
        [3, 3, 3, 3, 3, 3, 5, 5],
        [2, 2, 2, 6, 6, 6, 6, 6],
    ]
    assert bounds == [[(0, 6), (6, 8)], [(0, 6), (6, 8)], [(0, 3), (3, 8)]]


def test_empty_input_gives_an_empty_result():
    packed = pack_sequences([], max_length=8, pad_token_id=0)
    assert packed.shape == (0, 8) and packed.dtype == torch.int64
    packed, bounds, pos = pack_sequences([], 8, 0, return_boundaries=True, return_position_ids=True)
    assert bounds == [] and pos.shape == (0, 8)
    inputs, labels, masks = concatenate_and_pack([], [], [], max_length=4, pad_token_id=0)
    assert inputs.shape == labels.shape == masks.shape == (0, 4)


def test_too_long_is_an_error_by_default():
    with pytest.raises(ValueError, match=r"sequences\[2\] has 4 tokens > max_length=3.*overflow='truncate'"):
        pack_sequences(DOC_SEQUENCES, max_length=3, pad_token_id=0)


def test_truncate_and_split_only_when_asked_and_logged(caplog):
    with caplog.at_level(logging.WARNING, logger="packing_hf.fixed"):
        truncated = pack_sequences([[1, 2, 3, 4, 5], [6]], max_length=3, pad_token_id=0, overflow="truncate")
        split, bounds = pack_sequences(
            [[1, 2, 3, 4, 5], [6]], max_length=3, pad_token_id=0, overflow="split", return_boundaries=True
        )
    assert truncated.tolist() == [[1, 2, 3], [6, 0, 0]]
    assert split.tolist() == [[1, 2, 3], [4, 5, 6]]
    assert bounds == [[(0, 3)], [(0, 2), (2, 3)]]
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "truncated 1 sequence(s)" in messages and "dropping 2 tokens" in messages
    assert "split 1 sequence(s)" in messages


@pytest.mark.parametrize(
    ("sequences", "kwargs", "error", "message"),
    [
        ([[1], []], {}, ValueError, r"sequences\[1\] is empty"),
        ([[1], [2, -3]], {}, ValueError, r"sequences\[1\] holds a negative token id"),
        ([[1], [2.5]], {}, TypeError, r"sequences\[1\]\[0\] = 2.5 is a float"),
        ([[1]], {"max_length": 0}, ValueError, "max_length must be an int >= 1"),
        ([[1]], {"strategy": "best"}, ValueError, "strategy must be"),
        ([[1]], {"overflow": "drop"}, ValueError, "overflow = .* choose one of"),
    ],
)
def test_bad_input_is_refused(sequences, kwargs, error, message):
    args = {"max_length": 4, "pad_token_id": 0, **kwargs}
    with pytest.raises(error, match=message):
        pack_sequences(sequences, **args)


def test_concatenate_and_pack_places_the_three_fields_together():
    inputs, labels, masks = concatenate_and_pack(
        [[1, 2, 3], [4, 5], [6, 7, 8, 9]],
        [[-100, 2, 3], [4, 5], [-100, -100, 8, 9]],
        [[1, 1, 1], [1, 1], [1, 1, 1, 1]],
        max_length=6,
        pad_token_id=0,
        label_pad_id=-1,
    )
    assert inputs.tolist() == [[1, 2, 3, 4, 5, 0], [6, 7, 8, 9, 0, 0]]
    # every sequence's first label is masked (the second one's 4 would be predicted from the first's 3)
    assert labels.tolist() == [[-1, 2, 3, -1, 5, -1], [-1, -100, 8, 9, -1, -1]]
    assert masks.tolist() == [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]]
    assert inputs.dtype == labels.dtype == masks.dtype == torch.int64


def test_concatenate_and_pack_with_positions_masks_first_labels():
    inputs, labels, masks, pos = concatenate_and_pack(
        [[1, 2, 3], [4, 5]],
        [[1, 2, 3], [4, 5]],
        [[1, 1, 1], [True, True]],
        max_length=6,
        pad_token_id=0,
        return_position_ids=True,
    )
    assert labels.tolist() == [[-100, 2, 3, -100, 5, -100]]
    assert pos.tolist() == [[0, 1, 2, 0, 1, 0]]


def test_concatenate_and_pack_refuses_misaligned_fields():
    with pytest.raises(ValueError, match="got 2 input, 1 label and 2 attention-mask sequences"):
        concatenate_and_pack([[1], [2]], [[1]], [[1], [1]], max_length=4, pad_token_id=0)
    with pytest.raises(ValueError, match=r"label_sequences\[1\] has 1 values but input_sequences\[1\] has 2"):
        concatenate_and_pack([[1], [2, 3]], [[1], [2]], [[1], [1, 1]], max_length=4, pad_token_id=0)
    with pytest.raises(ValueError, match=r"input_sequences\[0\] has 5 tokens > max_length=4"):
        concatenate_and_pack([[1] * 5], [[1] * 5], [[1] * 5], max_length=4, pad_token_id=0)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(min_value=1, max_value=20), min_size=0, max_size=25),
    max_length=st.integers(min_value=1, max_value=24),
    strategy=st.sampled_from(["greedy", "ffd"]),
)
def test_no_token_lost_or_duplicated(lengths, max_length, strategy):
    sequences, next_id = [], 1
    for n in lengths:  # every token id is unique, so a lost or duplicated one shows
        sequences.append(list(range(next_id, next_id + n)))
        next_id += n
    packed, bounds, pos = pack_sequences(
        sequences,
        max_length,
        pad_token_id=0,
        return_boundaries=True,
        return_position_ids=True,
        strategy=strategy,
        overflow="split",
    )
    tokens = packed[packed != 0].tolist()
    assert sorted(tokens) == list(range(1, next_id))
    # every boundary holds one contiguous piece of one sequence, with positions restarting
    pieces = []
    for row, row_bounds in enumerate(bounds):
        ends = [0] + [end for _, end in row_bounds]
        assert [start for start, _ in row_bounds] == ends[:-1]  # back to back from column 0
        for start, end in row_bounds:
            piece = packed[row, start:end].tolist()
            assert piece == list(range(piece[0], piece[0] + len(piece)))
            assert pos[row, start:end].tolist() == list(range(end - start))
            pieces.append(piece)
    assert sum(map(len, pieces)) == sum(lengths)
    if strategy == "greedy":  # in order: reading the rows gives the input back
        assert tokens == list(range(1, next_id))
