"""PaddingFreePreferenceCollator and the padded <-> packed index maps, against TRL's padded preference collator."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from packing_hf.preference import (
    PaddingFreePreferenceCollator,
    PaddingFreeRewardCollator,
    TreeTargets,
    pack_padded_labels,
    preference_pair_lengths,
    unpack_shifted,
)

PAIRS = [
    {"prompt_ids": [5, 6, 7], "chosen_ids": [8, 9], "rejected_ids": [10]},
    {"prompt_ids": [11], "chosen_ids": [12, 13, 14, 15], "rejected_ids": [16, 17]},
    {"prompt_ids": [], "chosen_ids": [18, 19], "rejected_ids": [20, 21, 22]},
]

pair_st = st.fixed_dictionaries(
    {
        "prompt_ids": st.lists(st.integers(1, 50), max_size=6),
        "chosen_ids": st.lists(st.integers(1, 50), min_size=1, max_size=6),
        "rejected_ids": st.lists(st.integers(1, 50), min_size=1, max_size=6),
    }
)


def _trl_collator(**kwargs):
    trl_dpo = pytest.importorskip("trl.trainer.dpo_trainer")
    return trl_dpo.DataCollatorForPreference(pad_token_id=0, **kwargs)


def _segments(batch) -> list[list[int]]:
    cu = batch["cu_seq_lens_q"].tolist()
    ids = batch["packed_input_ids"][0].tolist()
    return [ids[a:b] for a, b in zip(cu[:-1], cu[1:], strict=True)]


def test_packed_row_holds_every_sequence_as_its_own_segment():
    batch = PaddingFreePreferenceCollator(return_seq_idx=True)(PAIRS)
    chosen = [p["prompt_ids"] + p["chosen_ids"] for p in PAIRS]
    rejected = [p["prompt_ids"] + p["rejected_ids"] for p in PAIRS]
    assert _segments(batch) == chosen + rejected  # TRL's row order: chosen rows, then rejected rows
    lengths = [len(s) for s in chosen + rejected]
    assert batch["position_ids"][0].tolist() == [j for n in lengths for j in range(n)]
    assert batch["seq_idx"][0].tolist() == [s for s, n in enumerate(lengths) for _ in range(n)]
    assert batch["cu_seq_lens_q"].dtype == torch.int32 and batch["max_length_q"] == max(lengths)
    assert "attention_mask" not in {k for k in batch if k.startswith("packed")}


@pytest.mark.parametrize("max_length, mode", [(None, "keep_start"), (4, "keep_start"), (4, "keep_end")])
def test_padded_layout_equals_trl_collator(max_length, mode):
    overflow = "truncate" if max_length else "error"
    ours = PaddingFreePreferenceCollator(max_length=max_length, overflow=overflow, truncation_mode=mode)(
        PAIRS
    )
    theirs = _trl_collator(max_length=max_length, truncation_mode=mode)(PAIRS)
    for key in ("input_ids", "attention_mask", "completion_mask"):
        assert torch.equal(ours[key], theirs[key]), key
    # the packed row holds exactly the real tokens of the padded layout, in row order
    assert (
        ours["packed_input_ids"][0].tolist() == theirs["input_ids"][theirs["attention_mask"].bool()].tolist()
    )


@settings(max_examples=60, deadline=None)
@given(pairs=st.lists(pair_st, min_size=1, max_size=4), multiple=st.sampled_from([None, 8]))
def test_labels_and_shifted_outputs_round_trip(pairs, multiple):
    """A per-token function of (input, next label) computed on the packed row and scattered back equals the
    same function computed on TRL's padded layout: zeros where the label is -100, values elsewhere."""
    batch = PaddingFreePreferenceCollator(pad_to_multiple_of=multiple, pad_token_id=3)(pairs)
    padded = _trl_collator()(pairs)
    labels = padded["input_ids"].masked_fill(padded["completion_mask"] == 0, -100)  # what TRL passes

    def score(
        ids: torch.Tensor, labels: torch.Tensor
    ) -> torch.Tensor:  # (R, N) -> (R, N - 1), like the fused head
        target = labels[:, 1:]
        return torch.where(target != -100, ids[:, :-1] * 100.0 + target, torch.zeros(()))

    packed_labels = pack_padded_labels(labels, batch["packed_index"])
    starts = batch["cu_seq_lens_q"][:-1].long()
    assert (packed_labels[0, starts] == -100).all()
    got = unpack_shifted(
        score(batch["packed_input_ids"], packed_labels), batch["packed_index"], *labels.shape
    )
    assert torch.equal(got, score(padded["input_ids"], labels))


def test_unpack_shifted_is_differentiable_and_keeps_trailing_dims():
    batch = PaddingFreePreferenceCollator()(PAIRS[:2])
    n = batch["packed_input_ids"].shape[1]
    values = torch.arange(2 * (n - 1), dtype=torch.float32).reshape(1, n - 1, 2).requires_grad_()
    out = unpack_shifted(values, batch["packed_index"], *batch["input_ids"].shape)
    assert out.shape == (4, batch["input_ids"].shape[1] - 1, 2)
    out.sum().backward()
    # every packed prediction of a non-start token lands exactly once; predictions of segment starts nowhere
    targets_start = torch.zeros(n - 1, dtype=torch.bool)
    targets_start[(batch["cu_seq_lens_q"][1:-1] - 1).long()] = True
    assert torch.equal(values.grad[0, :, 0], (~targets_start).float())


def test_pad_to_multiple_of_adds_its_own_segment_that_is_never_a_target():
    collator = PaddingFreePreferenceCollator(pad_to_multiple_of=16, pad_token_id=2)
    batch = collator(PAIRS[:1])
    assert batch["packed_input_ids"].shape == (1, 16) and batch["cu_seq_lens_q"].tolist() == [0, 5, 9, 16]
    assert batch["packed_input_ids"][0, 9:].tolist() == [2] * 7
    sentinel = batch["input_ids"].numel()
    assert (batch["packed_index"][9:] == sentinel).all()
    assert collator.stats["padding_tokens"] == 7 and collator.stats["tokens"] == 9


def test_reference_logps_and_stats():
    features = [dict(p, ref_chosen_logps=-float(i), ref_rejected_logps=-2.0 * i) for i, p in enumerate(PAIRS)]
    collator = PaddingFreePreferenceCollator()
    batch = collator(features)
    assert batch["ref_chosen_logps"].tolist() == [0.0, -1.0, -2.0]
    assert batch["ref_rejected_logps"].dtype == torch.float32
    lengths = [len(p["prompt_ids"]) * 2 + len(p["chosen_ids"]) + len(p["rejected_ids"]) for p in PAIRS]
    assert collator.stats["pairs"] == 3 and collator.stats["samples"] == 6
    assert collator.stats["tokens"] == sum(lengths) == batch["packed_input_ids"].numel()
    assert collator.stats["padded_layout_tokens"] == batch["input_ids"].numel() == 6 * 5
    collator.reset_stats()
    assert collator.stats["tokens"] == 0


def test_numpy_output_and_tensor_inputs():
    features = [{k: torch.tensor(v, dtype=torch.long) for k, v in p.items()} for p in PAIRS[:2]]
    batch = PaddingFreePreferenceCollator(return_tensors="np")(features)
    assert isinstance(batch["packed_input_ids"], np.ndarray)
    assert batch["packed_input_ids"].tolist()[0][:5] == [5, 6, 7, 8, 9]


def test_pair_lengths_count_both_sequences_after_max_length():
    assert preference_pair_lengths([3, 0], [2, 4], [1, 5]).tolist() == [9, 9]
    assert preference_pair_lengths([3, 0], [2, 4], [1, 5], max_length=4).tolist() == [8, 8]
    with pytest.raises(ValueError, match="every pair needs all three"):
        preference_pair_lengths([1], [1, 2], [1])
    with pytest.raises(TypeError, match="1-D sequence of ints"):
        preference_pair_lengths([1.5], [1], [1])


def test_overlong_sequence_raises_by_default_naming_the_pair():
    with pytest.raises(ValueError, match=r"sample 0: prompt \+ chosen has 5 tokens > max_length=4"):
        PaddingFreePreferenceCollator(max_length=4)(PAIRS)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_length": 4, "overflow": "split"}, "overflow='split' cannot be used for preference pairs"),
        ({"truncation_mode": "middle"}, "truncation_mode must be one of"),
        ({"return_tensors": "tf"}, "return_tensors must be"),
    ],
)
def test_bad_configuration_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PaddingFreePreferenceCollator(**kwargs)


@pytest.mark.parametrize(
    "features, error, match",
    [
        ([], ValueError, "empty batch"),
        ({"prompt_ids": [[1]]}, TypeError, "pass a list of rows"),
        ([{"prompt_ids": [1], "chosen_ids": [2]}], ValueError, "has no 'rejected_ids'"),
        (
            [{"prompt_ids": [], "chosen_ids": [], "rejected_ids": [1]}],
            ValueError,
            r"sample 0: prompt \+ chosen is empty",
        ),
        (
            [PAIRS[0], {"prompt_ids": [1], "chosen_ids": [-5], "rejected_ids": [2]}],
            ValueError,
            "sample 1: 'chosen_ids'",
        ),
        (
            [{"prompt_ids": [1], "chosen_ids": [2.5], "rejected_ids": [2]}],
            TypeError,
            "sample 0: .chosen_ids. holds float64 values .first: 2.5.; token ids must be integers",
        ),
    ],
)
def test_malformed_batches_are_named(features, error, match):
    with pytest.raises(error, match=match):
        PaddingFreePreferenceCollator()(features)


def test_pack_padded_labels_refuses_an_index_from_another_batch():
    with pytest.raises(ValueError, match="do not come from the same batch"):
        pack_padded_labels(torch.zeros(2, 2, dtype=torch.long), torch.tensor([0, 9]))
    with pytest.raises(ValueError, match=r"expected per-token values of shape \(1, 2, ...\)"):
        unpack_shifted(torch.zeros(1, 5), torch.tensor([4, 1, 2]), 2, 2)


@pytest.mark.parametrize("truncation_mode", ["keep_start", "keep_end"])
@pytest.mark.parametrize("max_length", [None, 9])
def test_shared_prompt_row_holds_every_sequence_and_target_once(truncation_mode, max_length):
    from packing_hf.shared_prefix import shared_prefix_position_ids

    rng = np.random.default_rng(0)
    pairs = [
        {
            "prompt_ids": rng.integers(1, 50, rng.integers(1, 8)).tolist(),
            "chosen_ids": rng.integers(1, 50, rng.integers(0, 6)).tolist(),
            "rejected_ids": rng.integers(1, 50, rng.integers(1, 6)).tolist(),
        }
        for _ in range(12)
    ]
    options = dict(max_length=max_length, overflow="truncate", truncation_mode=truncation_mode)
    plain = PaddingFreePreferenceCollator(**options)(pairs)
    collator = PaddingFreePreferenceCollator(shared_prompt=True, pad_to_multiple_of=8, **options)
    shared = collator(pairs)
    for key in ("input_ids", "attention_mask", "completion_mask"):  # TRL's padded layout is unchanged
        assert torch.equal(shared[key], plain[key])
    cu, idx = shared["cu_seq_lens_q"], shared["prefix_seq_idx"]
    assert shared["position_ids"][0].tolist() == shared_prefix_position_ids(cu, idx).tolist()
    assert (idx >= 0).sum() > 0  # some pairs share their prompt
    real = collator.stats["tokens"]
    lengths = preference_pair_lengths(
        *([len(p[k]) for p in pairs] for k in ("prompt_ids", "chosen_ids", "rejected_ids")),
        max_length=max_length,
        shared_prompt=True,
        truncation_mode=truncation_mode,
    )
    assert real == lengths.sum() == plain["packed_input_ids"].numel() - collator.stats["shared_prompt_tokens"]

    def targets(batch):
        """(padded flat index of every prediction target, packed token predicting it, its id)"""
        index, ids = batch["packed_index"], batch["packed_input_ids"][0]
        sentinel = batch["input_ids"].numel()
        found = {}
        for t in range(1, index.numel()):
            if index[t] < sentinel:
                found[int(index[t])] = int(ids[t])
        return found

    flat, completion = shared["input_ids"].flatten(), shared["completion_mask"].flatten()
    got, want = targets(shared), targets(plain)
    # every completion token is predicted once, from inside its own branch (prompt tokens are never targets;
    # the rejected sequence's shared prompt is not predicted a second time)
    assert {k: v for k, v in got.items() if completion[k]} == {k: v for k, v in want.items() if completion[k]}
    assert set(got) <= set(want) and all(flat[k] == v for k, v in got.items())


def test_reference_logps_of_the_wrong_shape_are_named():
    pair = {"prompt_ids": [1, 2], "chosen_ids": [3], "rejected_ids": [4]}
    ok = PaddingFreePreferenceCollator()([{**pair, "ref_chosen_logps": -1.0, "ref_rejected_logps": -2.0}] * 2)
    assert ok["ref_chosen_logps"].shape == (2,)
    with pytest.raises(
        ValueError, match="sample 0: 'ref_chosen_logps' is \\[-1.0\\]; it must be one number per pair"
    ):
        PaddingFreePreferenceCollator()(
            [{**pair, "ref_chosen_logps": [-1.0], "ref_rejected_logps": -2.0}] * 2
        )


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_reference_logps_and_margins_are_refused(bad):
    from packing_hf.preference import PaddingFreeRewardCollator
    from packing_hf.unpaired import PaddingFreeUnpairedCollator

    pair = {"prompt_ids": [1, 2], "chosen_ids": [3], "rejected_ids": [4]}
    dpo = [{**pair, "ref_chosen_logps": -1.0, "ref_rejected_logps": -2.0}] * 2
    PaddingFreePreferenceCollator()(dpo)  # control: finite values pass
    with pytest.raises(ValueError, match="sample 1: 'ref_rejected_logps' is .*, not a finite number"):
        PaddingFreePreferenceCollator()([dpo[0], {**dpo[1], "ref_rejected_logps": bad}])
    kto = {"prompt_ids": [1], "completion_ids": [2], "label": True, "ref_logps": -1.0}
    with pytest.raises(ValueError, match="sample 0: 'ref_logps' is .*, not a finite number"):
        PaddingFreeUnpairedCollator()([{**kto, "ref_logps": bad}, kto])
    reward = {"chosen_ids": [1, 2], "rejected_ids": [3], "margin": 0.5}
    with pytest.raises(ValueError, match="sample 0: 'margin' is .*, not a finite number"):
        PaddingFreeRewardCollator()([{**reward, "margin": bad}])


def _multi_turn_pairs(rng: np.random.Generator) -> list[dict]:
    """Pairs cut from 3 conversations at every turn (sharing a system prompt and their earlier turns), plus one
    unrelated pair; turns of random tokens."""
    system = rng.integers(1, 50, 5).tolist()
    pairs = []
    for _ in range(3):
        history = list(system)
        for _ in range(3):
            prompt = history + rng.integers(1, 50, rng.integers(1, 4)).tolist()
            chosen, rejected = (rng.integers(1, 50, rng.integers(1, 4)).tolist() for _ in range(2))
            pairs.append({"prompt_ids": prompt, "chosen_ids": chosen, "rejected_ids": rejected})
            history = prompt + chosen
    pairs.append({"prompt_ids": [60, 61], "chosen_ids": [62], "rejected_ids": [63, 64]})
    return pairs


@pytest.mark.parametrize("truncation_mode", ["keep_start", "keep_end"])
@pytest.mark.parametrize("max_length", [None, 11])
def test_share_prefixes_row_is_one_tree_holding_every_sequence(truncation_mode, max_length):
    from packing_hf.shared_prefix import shared_prefix_position_ids

    pairs = _multi_turn_pairs(np.random.default_rng(0))
    options = dict(max_length=max_length, overflow="truncate", truncation_mode=truncation_mode)
    plain = PaddingFreePreferenceCollator(**options)(pairs)
    collator = PaddingFreePreferenceCollator(share_prefixes=True, pad_to_multiple_of=8, **options)
    tree = collator(pairs)
    for key in ("input_ids", "attention_mask", "completion_mask"):  # TRL's padded layout is unchanged
        assert torch.equal(tree[key], plain[key])
    assert "packed_index" not in tree
    ids, positions = tree["packed_input_ids"][0], tree["position_ids"][0]
    total = ids.numel()
    assert total % 8 == 0 and tree["cu_seq_lens_q"][-1] == total
    cu, parents = tree["cu_seq_lens_q"], tree["prefix_seq_idx"]
    assert positions.tolist() == shared_prefix_position_ids(cu, parents).tolist()
    index, mask = tree["tree_index"], tree["attention_mask"].bool()
    # every sequence is its tokens at its rows, at positions 0, 1, ..., padding points past the row
    assert torch.equal(ids[index[mask]], tree["input_ids"][mask]) and (index[~mask] == total).all()
    assert torch.equal(positions[index[mask]], mask.long().cumsum(1)[mask] - 1)
    # and each token's previous one is in the same node or the last token of an ancestor node
    node = torch.bucketize(torch.arange(total), cu.long(), right=True) - 1
    prev, cur = index[:, :-1][mask[:, 1:]], index[:, 1:][mask[:, 1:]]
    inside = node[prev] == node[cur]
    assert torch.equal(prev[inside] + 1, cur[inside])
    branch_point = cu.long()[parents.long()[node[cur[~inside]]] + 1] - 1  # the parent node's last token
    assert torch.equal(prev[~inside], branch_point)
    real = collator.stats["tokens"]
    assert real == int(index[mask].max()) + 1 < int(mask.sum()) == collator.stats["sequence_tokens"]
    one_level = PaddingFreePreferenceCollator(shared_prompt=True, **options)(pairs)
    if max_length is None:  # the system prompt and earlier turns are shared across pairs, not only prompts
        assert real < one_level["packed_input_ids"].numel()


def test_tree_targets_score_each_row_once_and_copy_it_to_every_sequence():
    pairs = _multi_turn_pairs(np.random.default_rng(1))
    batch = PaddingFreePreferenceCollator(share_prefixes=True, pad_to_multiple_of=8)(pairs)
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    total = batch["packed_input_ids"].numel()
    targets = TreeTargets.from_index(batch["tree_index"], labels, total)
    ids = batch["packed_input_ids"][0]
    scored = targets.row_labels[0] != -100
    assert torch.equal(targets.row_labels[0][scored], ids[scored])
    # a value per row (here: its id) lands where the padded layout's shifted labels are
    values = torch.where(scored, ids, 0).double()[None]
    got = targets.unpack(values)
    assert torch.equal(got, torch.where(labels[:, 1:] == -100, 0, labels[:, 1:]).double())
    # rows holding a chosen answer that a later turn's prompt continues are scored (for the answer's sequence
    # only: the later sequences read zeros there, as their labels are -100)
    prompt_rows = batch["tree_index"][(batch["completion_mask"] == 0) & batch["attention_mask"].bool()]
    assert scored[prompt_rows].any()
    with pytest.raises(ValueError, match="does not match the padded labels"):
        TreeTargets.from_index(batch["tree_index"][:, 1:], labels, total)
    with pytest.raises(ValueError, match=rf"expected per-token values of shape \(1, {total}, ...\)"):
        targets.unpack(values[:, 1:])


@pytest.mark.parametrize(
    "make, match",
    [
        (
            lambda: PaddingFreePreferenceCollator(share_prefixes=True, shared_prompt=True),
            "set shared_prompt=False",
        ),
        (lambda: PaddingFreePreferenceCollator(min_shared_tokens=3), "only applies to the prefix tree"),
        (lambda: PaddingFreePreferenceCollator(share_prefixes=True, min_shared_tokens=0), "give an int >= 1"),
        (
            lambda: PaddingFreePreferenceCollator(share_prefixes=True, return_seq_idx=True),
            "know no prefix tree",
        ),
        (lambda: PaddingFreeRewardCollator(share_prefixes=True), "share_prefixes=True: reward pairs"),
        (
            lambda: PaddingFreePreferenceCollator(share_prefixes=True, segment_buckets=(8,)),
            "takes no empty segment",
        ),
    ],
    ids=[
        "with_shared_prompt",
        "min_shared_tokens_alone",
        "min_shared_tokens_0",
        "seq_idx",
        "reward",
        "segments",
    ],
)
def test_share_prefixes_refusals(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_min_shared_tokens_repeats_short_common_runs():
    pairs = [
        {"prompt_ids": [1, 2, 3, 4], "chosen_ids": [5], "rejected_ids": [6]},
        {"prompt_ids": [1, 2, 7, 8], "chosen_ids": [9], "rejected_ids": [10]},
    ]
    merged = PaddingFreePreferenceCollator(share_prefixes=True)(pairs)["packed_input_ids"].numel()
    apart = PaddingFreePreferenceCollator(share_prefixes=True, min_shared_tokens=3)(pairs)
    # [1, 2] is shared by the pairs only with min_shared_tokens <= 2; each pair's own prompt stays shared
    assert apart["packed_input_ids"].numel() == merged + 2 == 2 * 6
