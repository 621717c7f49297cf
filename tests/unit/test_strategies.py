"""Batching-strategy statistics: padded, online, fixed-length and multipack token use, exact on small cases."""

from __future__ import annotations

import numpy as np
import pytest

from packing_hf import _binpack as bp
from packing_hf import strategies as st


def test_padded_and_online_minibatches_exact():
    lengths = [5, 1, 2, 2, 8]
    padded = st.padded_batches(lengths, 2)
    # batches [5, 1] -> 2 x 5, [2, 2] -> 2 x 2, [8] -> 1 x 8
    assert (padded.steps, padded.real_tokens, padded.slot_tokens, padded.max_step_tokens) == (3, 18, 22, 10)
    online = st.online_minibatches(lengths, 2)
    # steps of 6, 4 and 8 tokens: memory sized for 8
    assert (online.steps, online.slot_tokens, online.max_step_tokens, online.padding_tokens) == (3, 24, 8, 6)
    reordered = st.padded_batches(lengths, 2, order=np.array([4, 0, 1, 2, 3]))
    assert reordered.slot_tokens == 2 * 8 + 2 * 2 + 1 * 2
    with pytest.raises(ValueError, match="permutation"):
        st.padded_batches(lengths, 2, order=np.array([0, 0, 1, 2, 3]))
    with pytest.raises(ValueError, match="batch_size"):
        st.online_minibatches(lengths, 0)


def test_fixed_length_packing_exact():
    lengths = [6, 3, 3, 12]
    fixed = st.fixed_length_packing(lengths, 8)
    # next-fit in order: [6], [3, 3], [8 (12 truncated)]
    assert (fixed.steps, fixed.real_tokens, fixed.truncated_tokens, fixed.slot_tokens) == (3, 20, 4, 24)
    wrapped = st.fixed_length_packing(lengths, 8, split=True)
    # 24 tokens in 3 full rows; boundaries at 8 and 16 cut the sample [6, 9) and the sample [12, 24)
    assert (wrapped.steps, wrapped.efficiency, wrapped.split_samples) == (3, 1.0, 2)


def test_compare_strategies_on_real_lengths(gsm8k_tokenized):
    lengths = np.array([len(row["input_ids"]) for row in gsm8k_tokenized])
    rows = {s.strategy: s for s in st.compare_strategies(lengths, 2048, seed=1)}
    assert list(rows) == ["padded", "online", "fixed", "fixed-split", "multipack"]
    total = int(lengths.sum())
    assert all(s.real_tokens == total for s in rows.values())
    multipack = rows["multipack"]
    assert multipack.steps == bp.pack_best_fit_decreasing(lengths, 2048).num_bins
    assert multipack.efficiency > rows["fixed"].efficiency
    assert multipack.efficiency > rows["padded"].efficiency
    assert rows["fixed-split"].efficiency >= multipack.efficiency  # it cuts samples to get there
    assert rows["fixed-split"].split_samples > 0
    assert set(multipack.as_dict()) >= {"strategy", "efficiency", "padding_tokens", "steps"}
