"""DeepSpeed ZeRO-2 and ZeRO-3 (``DS_ACCELERATOR=cpu``, gloo) through ``packing_hf.Trainer`` and ``SFTTrainer`` equal
gloo DDP on the same 2 processes: the loss of every step and every parameter after an epoch of SGD (fp32
rounding), every sample trained exactly once per epoch across the ranks; sequence parallelism (``sp_size=2``)
inside ZeRO-3 equals it beside DDP (whose equality with one process is ``test_sequence_parallel_multiprocess.py``'s);
``DPOTrainer`` with a ZeRO-3 reference model equals DDP (losses); the ZeRO-3 model partitioned at
construction with no false pre-flight refusal, ``check_packing`` of the partitioned model measured (not "failed"),
and DeepSpeed on CPU without ``use_cpu=True`` (accelerate counts one process of two) refused by name. One launch
runs every case: ``_deepspeed_worker.py``. Skipped without ``deepspeed`` (``pip install packing_hf[deepspeed]``).
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


@pytest.fixture(scope="module")
def ranks(run_once, launch, torchrun_command) -> list[dict]:
    def run(folder: Path) -> None:
        command = [*torchrun_command(2), str(WORKER), str(folder)]
        launch(command, LAUNCH_TIMEOUT_S, "2-process DeepSpeed run", DS_ACCELERATOR="cpu")

    folder = run_once("deepspeed", run)
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in (0, 1)]


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


def test_zero3_partitioned_at_construction_is_checked_not_refused(ranks):
    for case in ("zero3", "sft_zero3"):
        for rank in ranks:
            record = rank[case]
            assert record["partitioned"], "the ZeRO-3 model was not built partitioned (deepspeed.zero.Init)"
            # check_packing gathered the partitioned parameters and measured: no failed forward, no leak
            assert record["check"]["error"] is None and not record["check"]["leaked"]
            assert record["check"]["diff"] < 1e-5


def test_deepspeed_on_cpu_without_use_cpu_is_refused_by_name(ranks):
    for rank in ranks:
        message = rank["refused_without_cpu"]
        assert "accelerate counts 1" in message and "use_cpu=True" in message
