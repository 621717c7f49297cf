"""FSDP2 (torch's ``fully_shard``) with packing on real CPU processes over gloo, beside gloo DDP on the same
processes and one process on the same rows: the multipack sampler's batches of each data-parallel replica, the
loss contract's ``"token"`` normalisation over the step's global target count, the chunked LM head as the
trainers use it, packing_hf's varlen attention; 3 SGD steps of 2 micro-batches. The step losses, the first
step's gradients and the parameters after the last step are the one-process ones within float32 rounding for
DDP and FSDP2 on 2 processes, and for DDP + SP 2, FSDP2 + SP 2 (parameters sharded over all 4 processes,
activation checkpointing) and HSDP + SP 2 (sharded over each SP group) on 4; a wrong denominator and shards that
attend within their own tokens fail the same comparison.

Then the same through ``packing_hf.Trainer`` (and ``SFTTrainer``) under accelerate's FSDP2, with accelerate's device
gate stood in for on CPU (``accelerate_fsdp_on_cpu`` in the worker): one epoch of SGD equals gloo DDP on the same
processes (every step's loss, every parameter after the epoch, each sample once per epoch across the replicas, the
same samples on the 2 processes of an SP group) on 2 processes, and with ``sp_size=2`` on 4, FSDP2 over all 4 and
HSDP (``ParallelismConfig(dp_replicate_size=2, sp_size=2)``); an SP loss not scaled by the number of processes is
caught; the chunked LM head runs under FSDP2 (on the gathered ``lm_head``) and equals the full logits there, a
head without gradient is caught and a head resharded after the forward refused; FSDP asked for where accelerate runs DDP (CPU without the stand-in), and ``dp_shard_size`` beside ``sp_size``
under DDP, are refused by name. ``share_prefixes=True`` (prefix-tree rows of per-turn samples) under FSDP2 equals
DDP and the same samples flat (one step's loss and parameters, each rank its own trees); a tree loss counted per
process is caught. One launch per world, in one script: ``_fsdp_worker.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("_fsdp_worker.py")
LAUNCH_TIMEOUT_S = 300  # a world of 2 and one of 4 processes, 7 cases and 10 trainers, on 2 loaded cores
RELATIVE_TOLERANCE = 1e-5
EXACT_CASES = ("ddp", "fsdp", "ddp_sp2", "fsdp_sp2", "hsdp_sp2")
# the share of the parameters each process holds: FSDP2 over the whole world, HSDP over an SP group of 2
HELD = {"ddp": 1.0, "fsdp": 0.5, "ddp_sp2": 1.0, "fsdp_sp2": 0.25, "hsdp_sp2": 0.5}

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def results(run_once, launch):
    folder = run_once(
        "fsdp", lambda out: launch([sys.executable, str(WORKER), str(out)], LAUNCH_TIMEOUT_S, "FSDP2 run")
    )
    found = {}
    for world in (2, 4):
        found.update(torch.load(folder / f"fsdp_world{world}.pt", weights_only=False))
    return torch.load(folder / "fsdp_reference.pt", weights_only=False), found


def _compare(reference: dict, got: dict, case: str, assert_close) -> None:
    assert_close(got["losses"], reference["losses"], f"{case}: step losses", rel=RELATIVE_TOLERANCE)
    assert sorted(got["grads"]) == sorted(reference["grads"]) == sorted(got["after"])
    for name, want in reference["grads"].items():
        assert_close(got["grads"][name], want, f"{case}: step 1 grad of {name}", rel=RELATIVE_TOLERANCE)
    for name, want in reference["after"].items():
        assert_close(got["after"][name], want, f"{case}: {name} after the last step", rel=RELATIVE_TOLERANCE)


def test_the_reference_trains_every_parameter(results):
    """The comparisons below can fail: every parameter has a gradient and moves well past the tolerance."""
    reference, _ = results
    for name, before in reference["before"].items():
        assert float(reference["grads"][name].abs().max()) > 0, name
        moved = float((reference["after"][name] - before).abs().max())
        assert moved > 10 * RELATIVE_TOLERANCE * float(reference["after"][name].abs().max()), name


@pytest.mark.parametrize("case", EXACT_CASES)
def test_fsdp2_and_ddp_equal_one_process(results, case, assert_close):
    reference, found = results
    _compare(reference, found[case], case, assert_close)
    assert found[case]["held"] == pytest.approx(HELD[case], abs=0.02)  # FSDP2 did shard the parameters


@pytest.mark.parametrize("case", ["fsdp_local_denominator", "fsdp_sp2_local_only"])
def test_negative_controls_are_caught(results, case, assert_close):
    """Each process dividing by its own target count instead of the step's, and shards attending within their own
    tokens: the comparison that the exact cases pass fails on the losses and on every parameter."""
    reference, found = results
    got = found[case]
    with pytest.raises(AssertionError):
        assert_close(got["losses"], reference["losses"], "losses", rel=RELATIVE_TOLERANCE)
    for name, want in reference["after"].items():
        with pytest.raises(AssertionError):
            assert_close(got["after"][name], want, name, rel=RELATIVE_TOLERANCE)


# packing_hf.Trainer under accelerate's FSDP2 and the same trainer under DDP, on the same processes
TRAINER_PAIRS = {
    "trainer_fsdp": "trainer_ddp",
    "trainer_fsdp_full": "trainer_ddp",  # chunked_loss=False: the full logits under FSDP2
    "trainer_fsdp_sp2": "trainer_ddp_sp2",
    "trainer_hsdp_sp2": "trainer_ddp_sp2",
    "sft_fsdp_sp2": "sft_ddp_sp2",
}
TRAINER_HELD = {"trainer_fsdp": 0.5, "trainer_fsdp_full": 0.5, "trainer_fsdp_sp2": 0.25, "trainer_hsdp_sp2": 0.5, "sft_fsdp_sp2": 0.25}
# HSDP: replicated over dp_replicate, sharded inside each replica; FSDP2: sharded over every process
PLACEMENTS = {"trainer_hsdp_sp2": "(Replicate(), Shard(dim=0))"}


def _compare_trainers(got: dict, want: dict, what: str, assert_close) -> None:
    assert len(got["losses"]) == len(want["losses"]) >= 2, what
    for step, (loss, expected) in enumerate(zip(got["losses"], want["losses"], strict=True), 1):
        assert_close(loss, expected, f"{what}: loss of step {step}", rel=RELATIVE_TOLERANCE)
    assert sorted(got["after"]) == sorted(want["after"])
    for name, expected in want["after"].items():
        assert_close(got["after"][name], expected, f"{what}: {name} after the epoch", rel=RELATIVE_TOLERANCE)


def test_fsdp_that_accelerate_would_run_as_ddp_is_refused(results):
    """On CPU accelerate 1.15 drops the FSDP plugin and wraps the model in DDP: the Trainer refuses by name, with
    the reason and the fix, instead of training every process on a whole copy of the model."""
    _, found = results
    message = found["trainer_refused"]
    assert "FSDP was asked for (TrainingArguments(fsdp=..., fsdp_config=...))" in message, message
    assert "accelerate runs MULTI_CPU on cpu" in message and "(DDP)" in message, message
    assert "Run on GPUs for FSDP, or ask for DDP: drop fsdp / fsdp_config" in message, message


def test_a_sharding_layout_under_ddp_is_refused(results):
    """``dp_shard_size`` beside ``sp_size`` lays out FSDP2's sharding; DDP shards nothing, so it is refused by name
    (it was accepted and ignored)."""
    _, found = results
    message = found["ddp_layout_sp2_refused"]
    assert message.startswith("dp_replicate_size=1 and dp_shard_size=2 with sp_size=2 on 4 processes"), message
    assert "set dp_shard_size=1" in message and "or run FSDP2" in message, message


@pytest.mark.parametrize("case", sorted(TRAINER_PAIRS))
def test_trainer_under_fsdp2_equals_ddp(results, case, assert_close):
    """The Trainer's own FSDP2 path (accelerate's ``fully_shard``, DTensor parameters) trains as DDP does, with and
    without ``sp_size`` (the rows cut over the SP group; FSDP2 over every process, or HSDP)."""
    _, found = results
    got, want = found[case], found[TRAINER_PAIRS[case]]
    assert got["engine"] == "FSDPLlamaForCausalLM" and want["engine"] == "DistributedDataParallel"
    assert got["plan"] == want["plan"].replace("ddp", "fsdp2"), got["plan"]
    assert got["held"] == pytest.approx(TRAINER_HELD[case], abs=0.02)  # FSDP2 did shard the parameters
    assert got["placements"] == PLACEMENTS.get(case, "(Shard(dim=0),)")
    if case.endswith("_sp2"):  # the rows were cut: attention ran on shards, under both engines
        assert got["shard_calls"] > 0 and want["shard_calls"] > 0
    _compare_trainers(got, want, case, assert_close)


def test_evaluate_before_train_is_exact_under_fsdp2_with_sp(results, load_worker):
    """``trainer.evaluate()`` before ``train()`` (FSDP2: transformers shards the model for it and trains the sharded
    model after it; DDP: the model trains wrapped after it, which ``test_trainer_under_fsdp2_equals_ddp`` checks):
    the eval loss of FSDP2, DDP + sp 2, FSDP2 + sp 2 and HSDP + sp 2 is DDP's on 2 processes, every row whole.
    (The negative control of the SP evaluation, its shares not summed over the group, is in
    ``test_deepspeed_multiprocess.py``: the same code under another engine.)"""
    _, found = results
    assert set(load_worker(WORKER).EVALUATED) < set(found)
    want = found["trainer_ddp"]["eval_before"]
    assert 3.0 < want < 5.0  # about ln(VOCAB) = 4.16: an untrained model's, of every eval token
    for case in ("trainer_fsdp", "trainer_ddp_sp2", "trainer_fsdp_sp2", "trainer_hsdp_sp2"):
        assert found[case]["eval_before"] == pytest.approx(want, rel=1e-6), case


@pytest.mark.parametrize("case", sorted({*TRAINER_PAIRS, *TRAINER_PAIRS.values()}))
def test_trainer_trains_each_sample_once_per_epoch(results, load_worker, case):
    """Each data-parallel replica (an SP group: its processes train the same rows) trains its own samples, and the
    replicas together train every sample once per epoch: neither accelerate nor the mesh shards the data again."""
    _, found = results
    seen = found[case]["seen"]  # per rank, per micro-batch, the samples' tokens
    sp = 2 if case.endswith("_sp2") else 1
    for group in range(0, len(seen), sp):
        assert all(seen[rank] == seen[group] for rank in range(group, group + sp)), f"{case}: group {group}"
    trained = sorted(sample for replica in seen[::sp] for batch in replica for sample in batch)
    assert trained == sorted(s["input_ids"] for s in load_worker(WORKER).trainer_samples())


def test_trainer_negative_control_is_caught(results, assert_close):
    """FSDP2 with SP whose loss is not multiplied by the number of processes (the engine's average then shrinks the
    update 4 times): the comparison the exact cases pass fails on every step's loss and on the parameters."""
    _, found = results
    got, want = found["trainer_fsdp_sp2_unscaled"], found["trainer_ddp_sp2"]
    for loss, expected in zip(got["losses"], want["losses"], strict=True):
        with pytest.raises(AssertionError):
            assert_close(loss, expected, "loss", rel=RELATIVE_TOLERANCE)
    for name, expected in want["after"].items():
        with pytest.raises(AssertionError):
            assert_close(got["after"][name], expected, name, rel=RELATIVE_TOLERANCE)


def test_chunked_head_runs_under_fsdp2(results, assert_close):
    """The chunked LM head serves the Trainer under accelerate's FSDP2 (its ``[final norm, lm_head]`` group kept
    unsharded from the forward to the backward): no refusal logged, a projection on the gathered head in every
    micro-batch (DDP's run reads a plain head), and the result equals the full logits under FSDP2 (step losses,
    parameters after the epoch) as it equals DDP (``test_trainer_under_fsdp2_equals_ddp``)."""
    _, found = results
    for case in ("trainer_fsdp", "trainer_fsdp_sp2", "trainer_hsdp_sp2", "sft_fsdp_sp2"):
        got = found[case]
        assert got["chunked_refusals"] == [], (case, got["chunked_refusals"])
        assert got["fsdp_head_projections"] == len(got["seen"][0]) > 0, case
    assert found["trainer_ddp"]["chunked_refusals"] == [] and found["trainer_ddp"]["fsdp_head_projections"] == 0
    assert found["trainer_fsdp_full"]["fsdp_head_projections"] == 0  # chunked_loss=False: the model's logits
    _compare_trainers(found["trainer_fsdp"], found["trainer_fsdp_full"], "chunked vs full logits", assert_close)


def test_negative_control_a_head_without_gradient_under_fsdp2_is_caught(results, assert_close):
    """The chunked head under FSDP2 with the head's weight detached (no gradient reaches it, as if FSDP2 had not
    reduced one): the comparison the chunked case passes fails on the head after the epoch and on the later
    steps' losses."""
    _, found = results
    got, want = found["trainer_fsdp_head_detached"], found["trainer_ddp"]
    assert got["fsdp_head_projections"] == len(got["seen"][0]) > 0
    with pytest.raises(AssertionError):
        assert_close(got["after"]["lm_head.weight"], want["after"]["lm_head.weight"], "head", rel=RELATIVE_TOLERANCE)
    with pytest.raises(AssertionError):
        assert_close(got["losses"][-1], want["losses"][-1], "last loss", rel=RELATIVE_TOLERANCE)


def test_a_head_resharded_after_the_forward_is_refused(results):
    """Where ``lm_head``'s FSDP2 group reshards after the forward, the chunked head would read a shard: an error
    naming the setting, not a wrong loss."""
    _, found = results
    message = found["resharded_head_refused"]
    assert message.startswith("the LM head's weight is an FSDP2 shard after the model's forward"), message
    assert "reshard_after_forward=False" in message and "chunked_loss=False" in message, message


def _samples_of(found: dict, case: str) -> list[list[int]]:
    """Per rank, the indices of the samples its micro-batches trained (recorded by the tree cases' collators)."""
    return [[i for batch in rank for i in batch] for rank in found[case]["seen"]]


def test_share_prefixes_under_fsdp2_equals_ddp_and_flat(results, load_worker, assert_close):
    """``share_prefixes=True`` (prefix-tree rows of per-turn samples, assistant-only masks) through
    ``packing_hf.Trainer`` under accelerate's FSDP2 (parameters sharded, the chunked head on the gathered
    ``lm_head``): one SGD step over the epoch equals the same step under gloo DDP and the same samples packed flat
    under DDP (the step's loss, every parameter after it); each rank trains its own trees, every sample once."""
    _, found = results
    samples = len(load_worker(WORKER.with_name("_tree_data.py")).per_turn_samples(load_worker(WORKER).VOCAB))
    tree, ddp, flat = found["tree_fsdp"], found["tree_ddp"], found["tree_flat_ddp"]
    assert tree["engine"] == "FSDPLlamaForCausalLM" and ddp["engine"] == flat["engine"] == "DistributedDataParallel"
    assert tree["plan"] == "fsdp2, 2 processes" and tree["held"] == pytest.approx(0.5, abs=0.02)
    for case in ("tree_flat_ddp", "tree_ddp", "tree_fsdp"):
        seen = _samples_of(found, case)
        assert all(seen) and not set(seen[0]) & set(seen[1]) and sorted(seen[0] + seen[1]) == list(range(samples))
    assert tree["seen"] == ddp["seen"]  # the same trees on every rank
    # the rows were trees (shared prefixes computed once), the flat run's were not
    assert tree["tree_token_ratio"] == ddp["tree_token_ratio"] > 1.5 and flat["tree_token_ratio"] is None
    assert tree["chunked_refusals"] == [] and tree["fsdp_head_projections"] == len(tree["seen"][0]) > 0
    for want, what in ((ddp, "FSDP2 vs DDP"), (flat, "FSDP2 vs the samples flat")):
        assert len(tree["losses"]) == len(want["losses"]) == 1 and sorted(tree["after"]) == sorted(want["after"])
        assert_close(tree["losses"][0], want["losses"][0], f"share_prefixes, {what}: the loss", rel=RELATIVE_TOLERANCE)
        for name, expected in want["after"].items():
            assert_close(tree["after"][name], expected, f"share_prefixes, {what}: {name}", rel=RELATIVE_TOLERANCE)


def test_negative_control_a_tree_loss_counted_on_one_process_is_caught_under_fsdp2(results, assert_close):
    """FSDP2 whose tree loss is divided by each process's own count (the loss policy told of one process): the
    comparison the tree case passes fails on the loss and on the parameters."""
    _, found = results
    got, want = found["tree_fsdp_local"], found["tree_ddp"]
    assert got["seen"] == want["seen"]
    with pytest.raises(AssertionError):
        assert_close(got["losses"][0], want["losses"][0], "loss", rel=RELATIVE_TOLERANCE)
    for name, expected in want["after"].items():
        with pytest.raises(AssertionError):
            assert_close(got["after"][name], expected, name, rel=RELATIVE_TOLERANCE)
