"""DeepSpeed ZeRO-2 and ZeRO-3 (``DS_ACCELERATOR=cpu``, gloo) through packing_hf's trainers equal gloo DDP on the same
2 processes. ``packing_hf.Trainer`` and ``SFTTrainer``: the loss of every step and every parameter after an epoch of
SGD with momentum (fp32 rounding), every sample trained exactly once per epoch across the ranks; a run resumed from
a ZeRO-2 or ZeRO-3 checkpoint saved mid-epoch finishes the epoch as the uninterrupted run does (samples per rank,
losses, parameters: the weights, the data order and the momentum buffers come back; resuming with
``ignore_data_skip=True``, or from a checkpoint whose momentum buffers were zeroed, is caught); sequence parallelism
(``sp_size=2``) inside ZeRO-3 equals it beside DDP (whose equality with one process is
``test_sequence_parallel_multiprocess.py``'s), on 2 processes (dp 1 x sp 2) and on 4 (dp 2 x sp 2: each sample once
per epoch across the 2 replicas, the same samples on the processes of an SP group). ``DPOTrainer`` with a ZeRO-3
reference model equals DDP (losses). ``KTOTrainer`` (a live reference model, ZeRO-3 under ZeRO-3) and
``RewardTrainer`` (multipack batches) and ``GRPOTrainer`` and ``RLOOTrainer`` (packed rollouts, KL to TRL's reference
model) under ZeRO-2 and ZeRO-3 equal DDP: every logged metric at every step and the parameters after training; the
KTO and reward batches the same as DDP's, each example once per epoch across the ranks; the RL ranks run as many
packed forwards. The ZeRO-3 model partitioned at construction with no false pre-flight refusal, ``check_packing`` of
the partitioned model measured (not "failed"), and DeepSpeed on CPU without ``use_cpu=True`` (accelerate counts one
process of two) refused by name; the chunked LM head under ZeRO-3 with the head partitioned equals the full logits
and DDP (reading the partition outside the head's call is caught). ``share_prefixes=True`` (prefix-tree rows of
per-turn samples) under ZeRO-2 and ZeRO-3 (the LM head partitioned) equals DDP and the same samples flat: one step's
loss and parameters, the samples split over the ranks (a tree denominator counted per process is caught). Two launches of ``_deepspeed_worker.py``: every 2-process case in one, the
4-process SP cases in the other. Skipped without ``deepspeed`` (``pip install packing_hf[deepspeed]``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")

WORKER = Path(__file__).with_name("_deepspeed_worker.py")
LAUNCH_TIMEOUT_S = 420  # DeepSpeed's CPU communication op is compiled once per machine on first use

pytestmark = pytest.mark.distributed


def _launched(run_once, launch, torchrun_command, world: int) -> tuple[Path, list[dict]]:
    """The folder of the worker's run on ``world`` processes (2: every case; 4: the SP cases) and every rank's
    results."""

    def run(folder: Path) -> None:
        mode = ["--world", "4"] if world == 4 else []
        command = [*torchrun_command(world), str(WORKER), str(folder), *mode]
        launch(command, LAUNCH_TIMEOUT_S, f"{world}-process DeepSpeed run", DS_ACCELERATOR="cpu")

    folder = run_once(f"deepspeed-{world}", run)
    return folder, [json.loads((folder / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def launched(run_once, launch, torchrun_command) -> tuple[Path, list[dict]]:
    return _launched(run_once, launch, torchrun_command, 2)


@pytest.fixture(scope="module")
def ranks(launched) -> list[dict]:
    return launched[1]


@pytest.fixture(scope="module")
def ranks4(run_once, launch, torchrun_command) -> list[dict]:
    return _launched(run_once, launch, torchrun_command, 4)[1]


def _max_difference(a: dict[str, list], b: dict[str, list]) -> float:
    assert a.keys() == b.keys()
    return max(float((torch.tensor(a[k]) - torch.tensor(b[k])).abs().max()) for k in a)


@pytest.mark.parametrize(
    ("case", "reference", "engine"),
    [
        ("ddp", None, "ddp"),
        ("sft_ddp", None, "ddp"),
        ("zero2", "ddp", "deepspeed ZeRO-2"),
        ("zero3", "ddp", "deepspeed ZeRO-3"),
        ("sft_zero2", "sft_ddp", "deepspeed ZeRO-2"),
        ("sft_zero3", "sft_ddp", "deepspeed ZeRO-3"),
        ("sp2_ddp", None, "ddp"),
        ("sp2_zero3", "sp2_ddp", "deepspeed ZeRO-3"),
    ],
)
def test_zero_equals_ddp(ranks, load_worker, case, reference, engine):
    worker = load_worker(WORKER)
    mine = [r[case] for r in ranks]
    layout = " (dp 1 x sp 2)" if case.startswith("sp2_") else ""
    assert all(m["plan"] == f"{engine}, 2 processes{layout}" and m["world_size"] == 2 for m in mine)
    # every sample once per epoch across the data-parallel replicas, counted in training_step
    seen = [m["seen"] for m in mine]
    everything = list(range(worker.NUM_SAMPLES))
    if layout:  # one replica: both processes of the SP group train on every row, cut
        assert seen[0] == seen[1] and sorted(seen[0]) == everything
    else:
        assert not set(seen[0]) & set(seen[1]) and sorted(seen[0] + seen[1]) == everything
    assert mine[0]["losses"] == mine[1]["losses"] and len(mine[0]["losses"]) > 2
    if reference is None:
        return
    want = ranks[0][reference]
    assert want["losses"] == pytest.approx(mine[0]["losses"], rel=1e-6, abs=0)
    assert _max_difference(want["parameters"], mine[0]["parameters"]) <= 1e-6, "parameters after the epoch differ"
    # and the epoch did move them: the equality is not that of untrained models
    assert _max_difference(ranks[0]["start"], mine[0]["parameters"]) > 1e-3


def test_negative_control_a_loss_normalised_per_rank_is_caught(ranks):
    """ZeRO-3 whose ranks normalise their loss by their own token count, not the step's: the comparison that the
    ZeRO cases pass fails on its parameters."""
    wrong = ranks[0]["local_mean_zero3"]
    assert wrong["plan"] == "deepspeed ZeRO-3, 2 processes"
    assert _max_difference(ranks[0]["ddp"]["parameters"], wrong["parameters"]) > 1e-4


def test_dpo_with_a_zero3_reference_model_equals_ddp(ranks):
    """``packing_hf.DPOTrainer`` with a live reference model (TRL prepares it as a ZeRO-3 engine too): the loss of
    every step equals DDP's (a loss that is not ``log 2``: the reference has other weights than the policy)."""
    ddp, zero3 = ranks[0]["dpo_ddp"], ranks[0]["dpo_zero3"]
    assert (ddp["plan"], zero3["plan"]) == ("ddp, 2 processes", "deepspeed ZeRO-3, 2 processes")
    assert len(ddp["losses"]) >= 2 and abs(ddp["losses"][0] - 0.6931) > 1e-3
    # the first step's loss is the same forward; later ones follow one optimizer step whose ZeRO-3 reduction
    # (reduce-scatter of partitions) sums in another order than DDP's all-reduce: fp32 rounding of a few 1e-6
    # (measured: 2.6e-6 relative at step 2), far below what a wrong step gives (a miscounted loss: > 1e-2)
    assert zero3["losses"][0] == pytest.approx(ddp["losses"][0], rel=1e-6, abs=0)
    assert zero3["losses"] == pytest.approx(ddp["losses"], rel=2e-5, abs=0)
    assert ranks[1]["dpo_zero3"]["losses"] == zero3["losses"]


KTO_BETA = 0.1  # TRL's KTOConfig default, which the worker keeps


def _terms(trainer: str, key: str, log: dict) -> list[float]:
    """The magnitudes a logged ``key`` is a small difference of (``assert_close``'s ``terms``; as in
    ``test_reward_kto_multiprocess.py`` and ``test_rl_multiprocess.py``): a reward model's margin and mean reward
    cancel its extreme scores; KTO's rewards and margin are beta x differences of summed log-probs, its KL one of
    log-probs; GRPO's and RLOO's loss and KL cancel per-token log-probs of size ~``entropy`` (RLOO's first loss is
    a sum of advantages that cancel to 3e-8)."""
    if trainer == "reward":
        return [log["min_reward"], log["max_reward"]] if key in ("margin", "mean_reward") else []
    if trainer == "kto":
        logps = [log[k] for k in ("logps/chosen", "logps/rejected") if k in log]
        if key in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
            return [KTO_BETA * value for value in logps]
        return logps if key == "kl" else []
    return [log["entropy"]] if key in ("loss", "kl") else []


@pytest.mark.parametrize("engine", ["zero2", "zero3"])
@pytest.mark.parametrize("trainer", ["kto", "reward", "grpo", "rloo"])
def test_trl_trainers_under_zero_equal_ddp(launched, assert_close, trainer, engine):
    """``packing_hf.KTOTrainer`` (a live reference model: under ZeRO-3 TRL prepares it as a ZeRO-3 engine too),
    ``RewardTrainer``, ``GRPOTrainer`` and ``RLOOTrainer`` (KL to TRL's reference model, ZeRO-3 under ZeRO-3;
    deterministic completions) under ZeRO-2 and ZeRO-3 train as under gloo DDP on the same 2 processes: every
    metric the trainer logged at every step (losses, rewards, log-probs, KL, ...), the parameters after the steps,
    and where packing_hf's multipack sampler draws the batches (KTO, reward) the same batches on every rank, each
    example once per epoch across the ranks; GRPO's and RLOO's ranks ran as many packed forwards (ZeRO-3 gathers
    the parameters in every forward: a rank running one more would wait for ever).

    Tolerances: ZeRO-2 at 1e-6 relative (measured: 7e-10 at most, KTO's and reward's bit for bit); ZeRO-3 the
    first step at 1e-6 (the same forward), later ones at 2e-5, as the DPO case: its reduce-scatter sums the
    gradients in another order than DDP's all-reduce (measured: 3.9e-6 for KTO's mean logits, a mean of logits of
    both signs 3e-5 in size; 4.2e-7 at most elsewhere); parameters within 1e-6 (measured: 9e-8 at most, ZeRO-2's
    KTO and reward bit for bit), while training moved them by 2e-3 to 0.4. The gradient norm is DeepSpeed's own, a
    float32 sum over its flat partitions, not DDP's torch norm: 1.4e-5 apart at most (measured, KTO, whose
    parameters are equal bit for bit under ZeRO-2), so compared at 1e-4: a gradient of another scale is caught."""
    folder, ranks = launched
    reference, case = f"{trainer}_ddp", f"{trainer}_{engine}"
    plans = ("ddp, 2 processes", f"deepspeed ZeRO-{engine[-1]}, 2 processes")
    assert all((rank[reference]["plan"], rank[case]["plan"]) == plans for rank in ranks)
    want, mine = ranks[0][reference]["logged"], ranks[0][case]["logged"]
    assert len(mine) == len(want) >= (2 if trainer in ("grpo", "rloo") else 3)
    # the logged loss is the step's, over both ranks
    assert [log["loss"] for log in ranks[1][case]["logged"]] == [log["loss"] for log in mine]
    for step, (expected, got) in enumerate(zip(want, mine, strict=True)):
        assert got.keys() == expected.keys() and "loss" in got
        rel = 1e-6 if engine == "zero2" or step == 0 else 2e-5
        for key, value in expected.items():
            tolerance = 1e-4 if key == "grad_norm" else rel
            terms = _terms(trainer, key, expected)
            assert_close(got[key], value, f"{case} step {step + 1}: {key}", rel=tolerance, terms=terms)
    if trainer in ("kto", "reward"):
        examples = list(range(ranks[0][case]["examples"]))
        for name in (reference, case):
            by_step = [rank[name]["seen_by_step"] for rank in ranks]
            assert len(by_step[0]) == len(by_step[1]) == len(want)
            seen = [[i for step in steps for i in step] for steps in by_step]
            assert not set(seen[0]) & set(seen[1]) and sorted(seen[0] + seen[1]) == examples
        assert all(rank[case]["seen_by_step"] == rank[reference]["seen_by_step"] for rank in ranks)
    else:
        forwards = [rank[name]["forwards"] for rank in ranks for name in (reference, case)]
        assert len(set(forwards)) == 1 and forwards[0] > 0
    before, after = (torch.load(folder / f"{name}.parameters.pt") for name in (reference, case))
    assert before.keys() == after.keys()
    difference = max(float((before[name] - after[name]).abs().max()) for name in before)
    assert difference <= 1e-6, f"parameters after the steps differ by {difference}"
    # and the steps did move them: the equality is not that of untrained models
    assert ranks[0][case]["moved"] > 1e-3


def test_zero3_partitioned_at_construction_is_checked_not_refused(ranks):
    for case in ("zero3", "sft_zero3"):
        for rank in ranks:
            record = rank[case]
            assert record["partitioned"], "the ZeRO-3 model was not built partitioned (deepspeed.zero.Init)"
            # check_packing gathered the partitioned parameters and measured: no failed forward, no leak
            assert record["check"]["error"] is None and not record["check"]["leaked"]
            assert record["check"]["diff"] < 1e-5


def test_a_miscounted_world_on_cpu_without_use_cpu_is_refused_by_name(ranks):
    """ZeRO-2 (refused by the Trainer) and ZeRO-3 (refused by the arguments, before ``deepspeed.zero.Init`` partitions
    a model over a world accelerate miscounts, where DeepSpeed's batch-size assertion would fail first) name DeepSpeed as
    the cause; with no engine (a group DeepSpeed started earlier in the process) the refusal does not blame it."""
    for rank in ranks:
        messages = rank["refused_without_cpu"]
        for engine in ("zero2", "zero3", "none"):
            message = messages[engine]
            assert message.startswith("ValueError: ") and "accelerate counts 1" in message, message
            assert "use_cpu=True" in message
            assert ("DeepSpeed" in message) == (engine != "none"), message


def test_evaluate_before_train_is_exact_and_leaves_training_as_it_was(ranks):
    """``trainer.evaluate()`` before ``train()`` (under DeepSpeed: through the inference engine transformers makes for
    it): ``eval_loss`` is the same under DDP and ZeRO-3, with ``sp_size=2`` too (each row cut over the 2 processes),
    its forwards are not timed as training forwards, and the training after it is the one ``test_zero_equals_ddp``
    compares (under DDP transformers would train unwrapped replicas after it, under ZeRO-3 the inference engine, which
    cannot train). The negative control: the SP evaluation with the group's shares not summed is caught."""
    reference = ranks[0]["ddp"]["eval_before"]["loss"]
    for rank in ranks:
        for case in ("ddp", "zero3", "sp2_ddp", "sp2_zero3"):
            got = rank[case]["eval_before"]
            assert got["loss"] == pytest.approx(reference, rel=1e-6, abs=0), case
            assert got["timed_as_training"] == 0, case
        for case in ("sp2_ddp", "sp2_zero3"):
            unsummed = rank[case]["eval_before_unsummed"]["loss"]
            assert unsummed != pytest.approx(reference, rel=1e-2), "the negative control did not change the loss"


def _resumed_against(ranks: list[dict], resumed: str, uninterrupted: str, save_steps: int) -> dict:
    """How the run ``resumed`` from ``uninterrupted``'s checkpoint after ``save_steps`` steps differs from the rest
    of that run: the steps it trained, their samples on every rank, their losses, the parameters after the epoch."""
    tails = [r[uninterrupted] for r in ranks]
    mine = [r[resumed] for r in ranks]
    return {
        "steps": (mine[0]["steps"], tails[0]["steps"][save_steps:]),
        "samples": all(m["seen_by_step"] == t["seen_by_step"][save_steps:] for m, t in zip(mine, tails, strict=True)),
        "losses": (mine[0]["losses"], tails[0]["losses"][save_steps:]),
        "parameters": _max_difference(tails[0]["parameters"], mine[0]["parameters"]),
    }


@pytest.mark.parametrize(("case", "uninterrupted"), [("resumed_zero2", "zero2"), ("resumed_zero3", "zero3")])
def test_resume_from_a_zero_checkpoint_mid_epoch_is_exact(ranks, load_worker, case, uninterrupted):
    """The ZeRO run saved a checkpoint after ``SAVE_STEPS`` of its epoch's steps (DeepSpeed's own: partitioned
    weights and optimizer states per rank, packing_hf's sampler position); a new trainer, whose model starts from
    other weights, resumed from it trains the rest of the epoch as the uninterrupted run did: the same multipack
    batches on every rank, the same losses and the same parameters after the epoch (measured: equal bit for bit
    under ZeRO-2 and ZeRO-3). The optimizer is SGD with momentum, so every step after the checkpoint also needs
    its momentum buffers back: a resume that lost them is caught by the same comparison (the negative control
    below)."""
    save_steps = load_worker(WORKER).SAVE_STEPS
    uninterrupted_steps = ranks[0][uninterrupted]["steps"]
    assert save_steps < len(uninterrupted_steps) - 1, "the checkpoint is not in the middle of the epoch"
    assert all(r[case]["plan"] == r[uninterrupted]["plan"] for r in ranks)
    difference = _resumed_against(ranks, case, uninterrupted, save_steps)
    assert difference["steps"][0] == difference["steps"][1]
    assert difference["samples"], "the resumed run trained other samples than the rest of the epoch"
    assert difference["losses"][0] == pytest.approx(difference["losses"][1], rel=1e-6, abs=0)
    assert difference["parameters"] <= 1e-6, "parameters after the resumed epoch differ"
    assert ranks[1][case]["losses"] == ranks[0][case]["losses"]


def test_negative_control_a_resume_that_does_not_skip_the_consumed_batches_is_caught(ranks, load_worker):
    """Resumed from the same ZeRO-2 checkpoint with ``ignore_data_skip=True``: the epoch's first batches again,
    which the comparison the resumed runs pass catches (samples, losses and parameters)."""
    save_steps = load_worker(WORKER).SAVE_STEPS
    difference = _resumed_against(ranks, "resumed_unskipped_zero2", "zero2", save_steps)
    assert difference["steps"][0] == difference["steps"][1]  # as many steps, from the same checkpoint
    assert not difference["samples"]
    assert difference["losses"][0] != pytest.approx(difference["losses"][1], rel=1e-6, abs=0)
    assert difference["parameters"] > 1e-4


@pytest.mark.parametrize(
    ("case", "uninterrupted"),
    [("resumed_lost_momentum_zero2", "zero2"), ("resumed_lost_momentum_zero3", "zero3")],
)
def test_negative_control_a_resume_that_loses_the_optimizer_state_is_caught(
    ranks, load_worker, case, uninterrupted
):
    """Resumed from a copy of the same ZeRO checkpoint whose momentum buffers (in every rank's optimizer partition)
    are zeroed: the weights and the data order come back, the optimizer state does not. The first resumed step
    is the same forward (its loss equal), the steps after it follow other updates, which the comparison the
    resumed runs pass catches (measured: the next loss 2.4e-4 relative apart, parameters 3e-2)."""
    save_steps = load_worker(WORKER).SAVE_STEPS
    assert ranks[0][case]["momentum_buffers_zeroed"] > 0, "the checkpoint held no momentum: the control is void"
    difference = _resumed_against(ranks, case, uninterrupted, save_steps)
    assert difference["steps"][0] == difference["steps"][1] and difference["samples"]
    (first, *later), (want_first, *want_later) = difference["losses"]
    assert first == pytest.approx(want_first, rel=1e-6, abs=0) and later
    assert later != pytest.approx(want_later, rel=1e-6, abs=0)
    assert difference["parameters"] > 1e-4


def test_sp_inside_zero3_on_4_processes_equals_ddp(ranks4, load_worker):
    """dp 2 x sp 2 on 4 processes: ZeRO-3 (parameters partitioned over all 4) with every packed row cut over the 2
    processes of its SP group equals DDP + sp 2 on the same processes (the loss of every step, every parameter
    after the epoch: measured 1.2e-7); the SP group of a replica trains the same samples, the 2 replicas
    different ones, every sample once per epoch."""
    everything = list(range(load_worker(WORKER).NUM_SAMPLES))
    for case, engine in (("sp2_ddp", "ddp"), ("sp2_zero3", "deepspeed ZeRO-3")):
        mine = [r[case] for r in ranks4]
        assert all(m["plan"] == f"{engine}, 4 processes (dp 2 x sp 2)" and m["world_size"] == 4 for m in mine)
        # SP groups of consecutive ranks: (0, 1) and (2, 3)
        assert mine[0]["seen_by_step"] == mine[1]["seen_by_step"]
        assert mine[2]["seen_by_step"] == mine[3]["seen_by_step"]
        assert not set(mine[0]["seen"]) & set(mine[2]["seen"]) and sorted(mine[0]["seen"] + mine[2]["seen"]) == everything
        assert all(m["losses"] == mine[0]["losses"] for m in mine) and len(mine[0]["losses"]) > 2
    ddp, zero3 = ranks4[0]["sp2_ddp"], ranks4[0]["sp2_zero3"]
    assert zero3["losses"] == pytest.approx(ddp["losses"], rel=1e-6, abs=0)
    assert _max_difference(ddp["parameters"], zero3["parameters"]) <= 1e-6, "parameters after the epoch differ"
    assert _max_difference(ranks4[0]["start"], zero3["parameters"]) > 1e-3


def test_chunked_head_under_zero3_with_the_head_partitioned(ranks):
    """The chunked LM head under ZeRO-3 with the head's weight partitioned between calls (``head_numel`` 0 on every
    rank; ``stage3_param_persistence_threshold=0``): it runs inside a call of the head (DeepSpeed's hooks gather the
    weight for it and for its backward) in every micro-batch, logs no refusal, and equals the full logits under
    ZeRO-3 and DDP's run (its head chunked): every step's loss, every parameter after the epoch. The negative
    control reads the weight after the model's call instead: this rank's empty partition, an error."""
    chunked, full = ranks[0]["zero3_partitioned_head"], ranks[0]["zero3_partitioned_head_full"]
    for rank in ranks:
        mine = rank["zero3_partitioned_head"]
        assert mine["head_numel"] == 0 and mine["refusals"] == []
        assert mine["inside"] == len(rank["ddp"]["seen_by_step"]) > 0  # one micro-batch per step here
        assert rank["zero3_partitioned_head_full"]["inside"] == 0
    ddp = ranks[0]["ddp"]
    for got in (chunked, full):
        assert got["plan"] == "deepspeed ZeRO-3, 2 processes"
        assert got["losses"] == pytest.approx(ddp["losses"], rel=1e-6, abs=0)
        assert _max_difference(ddp["parameters"], got["parameters"]) <= 1e-6, "parameters after the epoch differ"
    assert _max_difference(ranks[0]["start"], chunked["parameters"]) > 1e-3
    for rank in ranks:
        error = rank["zero3_partitioned_head_outside"]["error"]
        assert "weight (vocab_size, hidden_size)" in error and "and (0,)" in error, error


TREE_DATA = Path(__file__).with_name("_tree_data.py")


@pytest.mark.parametrize(
    ("case", "engine"),
    [("tree_ddp", "ddp"), ("tree_zero2", "deepspeed ZeRO-2"), ("tree_zero3", "deepspeed ZeRO-3")],
)
def test_share_prefixes_step_under_zero_equals_ddp_and_flat(ranks, load_worker, case, engine):
    """``share_prefixes=True`` (prefix-tree rows of per-turn samples, assistant-only masks) through
    ``packing_hf.Trainer`` under gloo DDP, ZeRO-2 and ZeRO-3 (every parameter partitioned, the LM head too): one SGD
    step over the epoch, each rank's trees its own samples, every sample once across the ranks; the step's loss and
    every parameter after it equal the same step under DDP and the same samples packed flat (the tree loss's
    denominator is the step's over both ranks: measured 2e-8 apart at most, while the step moved them by 0.1)."""
    samples = len(load_worker(TREE_DATA).per_turn_samples(load_worker(WORKER).VOCAB))
    mine = [rank[case] for rank in ranks]
    assert all(m["plan"] == f"{engine}, 2 processes" for m in mine)
    # the flat step and the tree step each train the epoch, split over the ranks; the tree ranks the same trees
    for name in ("tree_flat_ddp", case):
        seen = [[i for batch in rank[name]["seen_by_step"] for i in batch] for rank in ranks]
        assert all(seen) and not set(seen[0]) & set(seen[1]) and sorted(seen[0] + seen[1]) == list(range(samples))
    assert all(m["seen_by_step"] == r["tree_ddp"]["seen_by_step"] for m, r in zip(mine, ranks, strict=True))
    # the rows were trees (shared prefixes computed once), the flat run's were not
    assert mine[0]["tree_token_ratio"] > 1.5 and ranks[0]["tree_flat_ddp"]["tree_token_ratio"] is None
    assert all(m["refusals"] == [] for m in mine)  # the chunked head served the tree loss
    if case == "tree_zero3":
        assert all(m["head_numel"] == 0 for m in mine), "ZeRO-3 kept the LM head whole: not partitioned"
    assert mine[0]["losses"] == mine[1]["losses"] and len(mine[0]["losses"]) == 1
    for reference in ("tree_ddp", "tree_flat_ddp"):
        want = ranks[0][reference]
        assert mine[0]["losses"] == pytest.approx(want["losses"], rel=1e-6, abs=0), reference
        assert _max_difference(want["parameters"], mine[0]["parameters"]) <= 1e-6, reference
    assert _max_difference(ranks[0]["start"], mine[0]["parameters"]) > 1e-2  # the step moved them


def test_negative_control_a_tree_loss_counted_on_one_process_is_caught(ranks):
    """ZeRO-3 with the tree loss's denominator counted on each process alone (its loss policy told of one process,
    as DeepSpeed's CPU accelerator reports the world): the comparison the tree cases pass fails on the loss and on
    the parameters."""
    wrong, want = ranks[0]["tree_local_zero3"], ranks[0]["tree_ddp"]
    assert wrong["plan"] == "deepspeed ZeRO-3, 2 processes" and wrong["seen_by_step"] == want["seen_by_step"]
    assert wrong["losses"] != pytest.approx(want["losses"], rel=1e-2)
    assert _max_difference(want["parameters"], wrong["parameters"]) > 1e-3
