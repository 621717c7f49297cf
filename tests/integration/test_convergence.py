"""benchmarks/bench_convergence.py --quick: runs end to end, passes its harness check, writes its JSON schema."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("trl")
sys.path.insert(0, str(ROOT / "benchmarks"))  # the benchmarks import _common as scripts
from bench_convergence import CONTENDERS  # noqa: E402


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory, data_dir) -> dict:
    out = tmp_path_factory.mktemp("convergence") / "convergence.json"
    # two micro-batches per optimizer step: the harness check then also covers the step-wide token mean
    command = [sys.executable, "benchmarks/bench_convergence.py", "--quick", "--grad-accum", "2"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PACKING_HF_DATA": str(data_dir)}
    result = subprocess.run(
        [*command, "--output", str(out), "--no-plot"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(out.read_text())


def test_flattened_batches_train_exactly_like_the_same_padded_batches(quick_run):
    check = quick_run["harness_check"]
    assert check["passed"] is True
    assert check["first_step_loss_diff"] < 1e-5 and check["max_step_loss_diff"] < check["tolerance"]
    padded, flattened = (quick_run["contenders"][n]["seeds"][0] for n in ("padded", "flattened"))
    assert padded["steps"] == flattened["steps"] and padded["real_tokens"] == flattened["real_tokens"]
    assert flattened["computed_tokens"] == flattened["real_tokens"] < padded["computed_tokens"]  # no padding
    # the gradient-noise probe sees the same steps as the same gradients: flattened's equals padded's
    noise = quick_run["grad_noise"]["contenders"]
    assert noise["padded"]["grad_noise"] == pytest.approx(noise["flattened"]["grad_noise"], rel=1e-3)


def test_json_schema(quick_run):
    assert set(quick_run["contenders"]) == set(CONTENDERS)
    config = quick_run["config"]
    assert config["grad_accum"] == 2 and config["seeds"] == 1 and config["rows"] == 48
    for name, result in quick_run["contenders"].items():
        for key in (
            "final_eval",
            "final_eval_std",
            "vs_padded",
            "speedup",
            "fill",
            "batch_len_std",
            "epoch_s",
            "mixing_ratio",
            "tok_step_cv",
            "loss_jitter",
            "grad_noise",
        ):
            assert isinstance(result[key], float), (name, key)
        (seed,) = result["seeds"]
        assert len(seed["train_loss"]) == seed["steps"] > 0
        assert [e["step"] for e in seed["eval"]][0] == 0 and seed["eval"][-1]["step"] == seed["steps"]
        assert all(e["loss"] > 0 for e in seed["eval"])
        # every packed contender trains on all of the data once: the same real tokens
        assert seed["real_tokens"] == quick_run["contenders"]["padded"]["seeds"][0]["real_tokens"]
    assert {row["contender"] for row in quick_run["table"]} == set(CONTENDERS)
    # the grouped and rebalanced contenders train padded's samples per step, in padded micro-batches
    for name in ("group_by_length", "batch_rebalance"):
        result = quick_run["contenders"][name]
        assert result["fill"] < 1.0 and result["grad_noise"] > 0, name
        assert result["batching"]["real_tokens_per_step"]["cv"] == result["tok_step_cv"]
    assert set(quick_run["goal"]) == {
        "multipack_minus_padded",
        "loss_within_0.01",
        "speedup_vs_padded",
        "speedup_at_least_1.3",
    }
