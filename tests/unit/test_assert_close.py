"""The ``assert_close`` fixture of tests/conftest.py: equality to the resolution of the computation.

The values are the ones two integration tests logged on a 2-core machine, where a bound relative to the
value alone failed on rounding: they pass against the magnitude of the terms they were computed from, and
a mismatch of the size a packing bug makes still fails.
"""

from __future__ import annotations

import pytest
import torch

REL = 1e-5

# TPO-L, step 2 (tests/integration/integrations/test_tpo.py): a margin of two rewards of ~0.108 that a
# near-uniform tiny model makes almost equal
MARGIN_STOCK, MARGIN_PACKED = -6.612372398376465e-07, -6.631016731262207e-07
REWARDS = (-0.10814777761697769, -0.10814711451530457)
# RLOO with shared prompts, step 1 (tests/integration/integrations/test_rl.py): importance ratios of 1 and
# advantages that cancel; the ratios cancel per-token log-probs of size ~entropy
LOSS_STOCK, LOSS_PACKED = 0.0, -1.3113021850585938e-06
ENTROPY = 10.796286582946777


def test_rounding_of_cancelled_terms_passes(assert_close):
    assert_close(MARGIN_PACKED, MARGIN_STOCK, "rewards/margins", rel=REL, terms=REWARDS)
    assert_close(LOSS_PACKED, LOSS_STOCK, "loss", rel=REL, terms=[ENTROPY])


def test_a_bound_relative_to_the_value_alone_fails_on_that_rounding(assert_close):
    with pytest.raises(AssertionError, match="rewards/margins"):
        assert_close(MARGIN_PACKED, MARGIN_STOCK, "rewards/margins", rel=REL)
    with pytest.raises(AssertionError, match="loss"):
        assert_close(LOSS_PACKED, LOSS_STOCK, "loss", rel=REL)  # a zero wants an exact zero


@pytest.mark.parametrize(
    "got, want, terms, what",
    [
        # a chosen reward off by 1e-4 of itself (its mean log-prob off by 1e-3 nats: far less than a sample
        # seeing another one's tokens)
        (MARGIN_STOCK + 1e-4 * REWARDS[0], MARGIN_STOCK, REWARDS, "rewards/margins"),
        # one completion token of ~100 missing from the loss: its ratio x advantage (~1.65) / 100
        (LOSS_STOCK + 1.65 / 100, LOSS_STOCK, [ENTROPY], "loss"),
        # importance ratios off by 1e-4 (log-probs 1e-4 nats apart) on advantages of ~1.65
        (LOSS_STOCK + 1.65e-4, LOSS_STOCK, [ENTROPY], "loss"),
    ],
    ids=["margin", "loss-token-dropped", "loss-ratio"],
)
def test_a_mismatch_of_a_bugs_size_still_fails(assert_close, got, want, terms, what):
    with pytest.raises(AssertionError, match=what):
        assert_close(got, want, what, rel=REL, terms=terms)


def test_tensors_use_their_largest_element(assert_close):
    want = torch.tensor([1.0, -2.0, 3.0])
    assert_close(want + 2.9e-5, want, "vector", rel=REL)  # within 1e-5 x 3
    with pytest.raises(AssertionError, match="vector: max error"):
        assert_close(want + 3.1e-5, want, "vector", rel=REL)
    assert_close(torch.zeros(3), torch.zeros(3), "zeros", rel=REL)
