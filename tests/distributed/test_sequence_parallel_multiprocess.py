"""Ulysses sequence parallelism over packed rows on 4 CPU processes (gloo, fp32): the loss and every parameter
gradient of one optimizer step equal one process on the same whole rows (1e-5 relative) at sp=4 and at
data parallel 2 x sequence parallel 2 (gradient accumulation, gradient checkpointing), with samples cut by
shard edges, a sample longer than a shard, a shard holding only a tail, ``"sample"`` and ``"token"``
normalisation with ``loss_weights``, a sliding window, a row shorter than the group, and a prefix-tree row
(``prefix_seq_idx``, depth 3, children on other ranks than their parents); a prefix-tree row's target pairs
(``PrefixTreeCollator``: branch rows ending a shard, predicting children's first tokens on two other ranks), each
rank computing its shard's pairs, equal to the same samples flat; the negative controls (every shard attending
within its own tokens; a tree branch reading its sibling as its parent; tree pairs not re-indexed to the shard)
fail the same comparison. ``packing_hf.Trainer``, ``SFTTrainer``
and ``DPOTrainer`` (a live or a precomputed reference) with ``ParallelismConfig(sp_size=2)`` on 2 processes equal
the same trainer on one (loss, gradients, ``evaluate()``'s ``eval_loss`` run on shards), on the rows one process
trains on; ``Trainer(share_prefixes=True)`` cut over the group equals the tree and the samples flat on one process; a stream under SP resumes with the next batches; DPO whose per-token log-probs are not summed over the
group (negative control) fails the comparison. One launch runs every case: ``_sp_worker.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("_sp_worker.py")
LAUNCH_TIMEOUT_S = 420  # 2 launches of 4 + 2 processes and 8 one-process trainers on a loaded 2-core machine
RELATIVE_TOLERANCE = 1e-5

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def results(run_once, launch, free_port):
    import sys

    def run(folder: Path) -> None:
        command = [sys.executable, str(WORKER), str(folder), str(free_port())]
        launch(command, LAUNCH_TIMEOUT_S, "4-process sequence-parallel run")

    folder = run_once("sequence-parallel", run)
    found = torch.load(folder / "sp_results.pt", weights_only=False)
    trainer = torch.load(folder / "sp_trainer.pt", weights_only=False)
    reference = torch.load(folder / "sp_trainer_reference.pt", weights_only=False)
    for kind, got in trainer.items():
        found[f"{kind}_sp2"] = (reference[kind.removesuffix("_alone")], got)
    found["tree_flat"] = reference["tree_flat"]
    return found


@pytest.mark.parametrize(
    "case",
    [
        "sp4_sample",
        "dp2_sp2_token",
        "sp4_sliding",
        "sp4_short_row",
        "sp4_tree",
        "trainer_sp2",
        "sft_sp2",
        "dpo_sp2",
        "dpo_precompute_sp2",
        "stream_sp2",
        "sp4_tree_pairs",
        "tree_sp2",
    ],
)
def test_sequence_parallel_equals_one_process(results, case, assert_close):
    if case.endswith("_sp2"):  # a trainer: its step next to the same trainer's on one process
        reference, got = results[case]
        results = {case: (reference["step"], got["step"])}
    (ref_loss, ref_grads), (loss, grads) = results[case]
    assert_close(loss, ref_loss, f"{case}: loss", rel=RELATIVE_TOLERANCE)
    assert sorted(grads) == sorted(ref_grads)
    for name, want in ref_grads.items():
        assert float(want.abs().max()) > 0, f"{case}: {name} has no gradient to compare"
        assert_close(grads[name], want, f"{case}: grad of {name}", rel=RELATIVE_TOLERANCE)


@pytest.mark.parametrize("case", ["trainer_sp2", "sft_sp2", "tree_sp2"])
def test_sequence_parallel_counts_the_packing_metrics_once_per_row(results, case):
    """Every rank of an SP group gets the whole micro-batch: its tokens and FLOPs are logged as one process logs
    them, not once per rank of the group; the MFU divides them by the devices that share them (the plan's)."""
    reference, got = results[case]
    assert reference["metrics"]["real_tokens_per_step"] > 0
    assert got["metrics"] == reference["metrics"]
    assert (reference["mfu_devices"], got["mfu_devices"]) == (1, 2)


@pytest.mark.parametrize("case", ["trainer_sp2", "sft_sp2", "stream_sp2"])
def test_sequence_parallel_shards_use_the_chunked_head(results, case):
    """With ``chunked_loss`` (default) a shard's loss comes from the chunked LM head, not the shard's full logits
    (the exactness above then holds for it)."""
    reference, got = results[case]
    assert got["sp_chunked"] is True and reference["sp_chunked"] is None


@pytest.mark.parametrize("case", ["trainer_sp2", "dpo_sp2"])
def test_evaluation_under_sequence_parallelism_equals_one_process(results, case, assert_close):
    """The eval loss of a sequence-parallel trainer, evaluated on shards (the attention ran on them), equals the
    same trainer's on one process."""
    reference, got = results[case]
    assert got["eval_shard_calls"] > 0 and reference["eval_shard_calls"] == 0
    assert_close(got["eval"], reference["eval"], f"{case}: eval_loss", rel=RELATIVE_TOLERANCE)


@pytest.mark.parametrize("case", ["trainer_sp2", "dpo_sp2", "stream_sp2", "tree_sp2"])
def test_one_row_per_sequence_parallel_group(results, case):
    """Both ranks of the SP group train on the same rows (the sampler's or the stream's replica is the group),
    the rows one process trains on."""
    reference, got = results[case]
    first, second = got["ranks"]
    assert first["batches"] == second["batches"] == reference["batches"]
    assert len(reference["batches"]) == (2 if case == "stream_sp2" else 1)


def test_resume_under_sequence_parallelism_gives_the_next_batches(results):
    """A streamed run resumed from its checkpoint after step 1 trains on the batches step 2 of the uninterrupted
    run trained on, on every rank of the SP group."""
    reference, got = results["stream_sp2"]
    assert reference["resumed"] == reference["batches"][1:]
    for rank in got["ranks"]:
        assert rank["resumed"] == rank["batches"][1:] == reference["batches"][1:]


def test_share_prefixes_under_sequence_parallelism_equals_the_samples_flat(results, assert_close):
    """``packing_hf.Trainer(share_prefixes=True)`` with ``sp_size=2``: its tree row (20 tokens, a branch row ending
    shard 0 whose children start on rank 1) cut over the group, each rank's target pairs computed by the chunked LM
    head, equals the same samples packed flat on one process (``"sample"`` normalisation), as ``tree_sp2`` equals
    the tree on one process."""
    reference, got = results["tree_sp2"]
    assert got["shard_tokens"] == 10 and reference["shard_tokens"] is None  # rank 0 held half the row
    assert got["tree_chunked"] is True and reference["tree_chunked"] is True
    flat = results["tree_flat"]
    assert flat["tree_chunked"] is None and len(flat["batches"][0][0]) == 43  # one flat row of every sample
    (ref_loss, ref_grads), (loss, grads) = flat["step"], got["step"]
    assert_close(loss, ref_loss, "tree_sp2 vs flat: loss", rel=RELATIVE_TOLERANCE)
    for name, want in ref_grads.items():
        assert_close(grads[name], want, f"tree_sp2 vs flat: grad of {name}", rel=RELATIVE_TOLERANCE)


def test_an_evaluation_call_on_a_tree_row_under_sequence_parallelism_equals_one_process(results, assert_close):
    """``compute_loss`` of the trained ``share_prefixes`` model in evaluation mode on its tree row, cut over the SP
    group (each rank's pairs, the shares summed over the group), equals the same call on one process."""
    reference, got = results["tree_sp2"]
    assert got["tree_eval_cut"] == 10 and reference["tree_eval_cut"] is None
    assert_close(got["tree_eval"], reference["tree_eval"], "tree eval loss", rel=RELATIVE_TOLERANCE)


def _caught(reference: tuple, got: tuple, assert_close, what: str) -> None:
    """The comparison of the exactness tests fails on the loss and on most gradients."""
    (ref_loss, ref_grads), (loss, grads) = reference, got
    with pytest.raises(AssertionError):
        assert_close(loss, ref_loss, "loss", rel=RELATIVE_TOLERANCE)
    failures = 0
    for name, want in ref_grads.items():
        try:
            assert_close(grads[name], want, name, rel=RELATIVE_TOLERANCE)
        except AssertionError:
            failures += 1
    assert failures > len(ref_grads) // 2, f"{what} went unnoticed"


def test_negative_control_dpo_without_reduced_sums_is_caught(results, assert_close):
    """DPO whose per-sample log-prob sums are not reduced over the SP group (each rank sees its own tokens'
    log-probs only) fails the comparison that ``dpo_sp2`` passes."""
    reference, got = results["dpo_alone_sp2"]
    _caught(reference["step"], got["step"], assert_close, "unreduced per-sample sums")


def test_negative_control_shards_attending_alone_are_caught(results, assert_close):
    _caught(*results["sp4_local_only"], assert_close, "attention cut at the shard edges")


def test_negative_control_a_tree_branch_reading_its_sibling_is_caught(results, assert_close):
    """The tree row of ``sp4_tree`` with the shards' ``prefix_seq_idx`` giving a branch its sibling as parent
    fails the comparison ``sp4_tree`` passes."""
    _caught(
        *results["sp4_tree_sibling_leak"], assert_close, "a sibling leak in a tree row cut over the ranks"
    )


def test_negative_control_tree_pairs_not_reindexed_are_caught(results, assert_close):
    """The tree row of ``sp4_tree_pairs`` with each rank reading the row's target pairs at the whole row's indices
    (not those of its shard: :func:`packing_hf.shard_loss.shard_tree_pairs` skipped) fails the comparison
    ``sp4_tree_pairs`` passes."""
    _caught(*results["sp4_tree_pairs_not_reindexed"], assert_close, "tree pairs not re-indexed to the shard")
