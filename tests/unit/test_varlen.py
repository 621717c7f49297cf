"""Property and error tests for packing_hf.varlen: every spelling of the boundaries round-trips."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from packing_hf.varlen import (
    cu_seqlens_to_lengths,
    cu_seqlens_to_position_ids,
    cu_seqlens_to_seq_idx,
    lengths_to_cu_seqlens,
    lengths_to_position_ids,
    lengths_to_seq_idx,
    max_length_from_cu_seqlens,
    position_ids_to_cu_seqlens,
    seq_lengths_to_cu_seqlens,
)

lengths_lists = st.lists(st.integers(min_value=1, max_value=40), min_size=1, max_size=30)
SETTINGS = settings(max_examples=60, deadline=None)


def reference_position_ids(lengths: list[int], start: int = 0) -> list[int]:
    return [start + j for n in lengths for j in range(n)]


@SETTINGS
@given(lengths=lengths_lists, start=st.integers(min_value=0, max_value=3))
def test_lengths_round_trip_through_every_spelling(lengths, start):
    cu = lengths_to_cu_seqlens(lengths)
    assert cu.dtype == torch.int32 and cu.shape == (len(lengths) + 1,)
    assert cu.tolist() == [0, *np.cumsum(lengths).tolist()]
    assert cu_seqlens_to_lengths(cu).tolist() == lengths

    pos = lengths_to_position_ids(lengths, start=start)
    assert pos.dtype == torch.int64
    assert pos.tolist() == reference_position_ids(lengths, start)
    assert torch.equal(cu_seqlens_to_position_ids(cu, start=start), pos)
    # back from positions: exact when samples start at `start`
    assert torch.equal(position_ids_to_cu_seqlens(pos, start=start), cu)
    assert torch.equal(position_ids_to_cu_seqlens(pos[None], start=start), cu)

    seq_idx = lengths_to_seq_idx(lengths)
    assert seq_idx.dtype == torch.int32
    assert seq_idx.tolist() == [i for i, n in enumerate(lengths) for _ in range(n)]
    assert torch.equal(cu_seqlens_to_seq_idx(cu), seq_idx)
    assert max_length_from_cu_seqlens(cu) == max(lengths)


@SETTINGS
@given(rows=st.lists(lengths_lists, min_size=1, max_size=6))
def test_seq_lengths_rows_concatenate_in_order(rows):
    row_lengths = [sum(r) for r in rows]
    cu = seq_lengths_to_cu_seqlens(rows, row_lengths=row_lengths)
    flat = [n for r in rows for n in r]
    assert torch.equal(cu, lengths_to_cu_seqlens(flat))


@SETTINGS
@given(
    lengths=lengths_lists, offsets=st.lists(st.integers(min_value=0, max_value=50), min_size=30, max_size=30)
)
def test_position_ids_with_offsets_need_start_none(lengths, offsets):
    # samples continuing a longer context start anywhere; boundaries are where +1 stops
    pos = torch.cat([torch.arange(n) + offsets[i] for i, n in enumerate(lengths)])
    cu = position_ids_to_cu_seqlens(pos, start=None)
    # two neighbours merge when the next one happens to continue the previous by +1
    starts = set(cu[:-1].tolist())
    true_starts = set(lengths_to_cu_seqlens(lengths)[:-1].tolist())
    assert starts <= true_starts
    for s in true_starts - starts:
        assert int(pos[s]) == int(pos[s - 1]) + 1


def test_inputs_as_numpy_and_tensor_agree():
    expected = [0, 2, 5]
    assert lengths_to_cu_seqlens(np.array([2, 3], dtype=np.int32)).tolist() == expected
    assert lengths_to_cu_seqlens(torch.tensor([2, 3])).tolist() == expected
    assert lengths_to_cu_seqlens([2, 3], dtype=torch.int64).dtype == torch.int64


def test_empty_lengths_give_empty_row():
    assert lengths_to_cu_seqlens([]).tolist() == [0]
    assert lengths_to_position_ids([]).numel() == 0
    assert position_ids_to_cu_seqlens([]).tolist() == [0]
    assert max_length_from_cu_seqlens([0]) == 0


@pytest.mark.parametrize("bad", [[3, 0, 2], [1, -4]])
def test_non_positive_lengths_are_refused_with_their_index(bad):
    index = next(i for i, n in enumerate(bad) if n <= 0)
    with pytest.raises(ValueError, match=rf"lengths\[{index}\] = {bad[index]}"):
        lengths_to_cu_seqlens(bad)
    with pytest.raises(ValueError, match=rf"lengths\[{index}\]"):
        lengths_to_position_ids(bad)


@pytest.mark.parametrize(
    ("cu", "message"),
    [
        ([1, 3], "start at 0"),
        ([], "start at 0"),
        ([0, 3, 3], r"empty segment ends at cu_seqlens\[2\] = 3"),
        ([0, 5, 2], r"negative length ends at cu_seqlens\[2\] = 2"),
    ],
)
def test_malformed_cu_seqlens_are_refused(cu, message):
    with pytest.raises(ValueError, match=message):
        cu_seqlens_to_lengths(cu)


@pytest.mark.parametrize(
    "bad", [[1.5, 2.0], torch.tensor([1.0, 2.0]), torch.tensor([True, False]), np.array([1.0]), [[1, 2], [3]]]
)
def test_non_integer_lengths_are_type_errors(bad):
    with pytest.raises((TypeError, ValueError)):
        lengths_to_cu_seqlens(bad)


def test_two_dimensional_lengths_are_refused():
    with pytest.raises(ValueError, match="1-D"):
        lengths_to_cu_seqlens(torch.ones(2, 2, dtype=torch.long))


def test_int32_overflow_is_refused():
    with pytest.raises(ValueError, match="overflows int32"):
        lengths_to_cu_seqlens([2**30, 2**30])
    assert int(lengths_to_cu_seqlens([2**30, 2**30], dtype=torch.int64)[-1]) == 2**31


def test_position_ids_of_several_rows_are_refused():
    with pytest.raises(ValueError, match="2 rows"):
        position_ids_to_cu_seqlens(torch.zeros(2, 4, dtype=torch.long))


def test_position_ids_not_starting_at_start_are_refused():
    with pytest.raises(ValueError, match=r"position_ids\[2\] = 5"):
        position_ids_to_cu_seqlens([0, 1, 5, 6], start=0)


def test_seq_lengths_must_cover_their_row():
    with pytest.raises(ValueError, match=r"seq_lengths\[1\] sums to 3 but the row holds 4"):
        seq_lengths_to_cu_seqlens([[2], [1, 2]], row_lengths=[2, 4])
    with pytest.raises(ValueError, match="2 seq_lengths rows but 1 row lengths"):
        seq_lengths_to_cu_seqlens([[2], [3]], row_lengths=[2])
    with pytest.raises(ValueError, match=r"seq_lengths\[0\]\[1\] = 0"):
        seq_lengths_to_cu_seqlens([[2, 0]])
    # one flat row of lengths is accepted too
    assert seq_lengths_to_cu_seqlens([2, 3]).tolist() == [0, 2, 5]
