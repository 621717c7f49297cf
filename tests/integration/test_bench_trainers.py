"""benchmarks/bench_trainers.py --smoke: every contender trains through its own trainer, on every sample once,
and the JSON holds the figures the README quotes (no timing is asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONTENDERS = {"packing_hf", "trl_bfd", "trl_padding_free", "hf_batch_rebalance", "padded"}

pytest.importorskip("trl")


def test_bench_trainers_smoke(tmp_path, data_dir):
    out = tmp_path / "trainers.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PACKING_HF_DATA": str(data_dir), "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "benchmarks/bench_trainers.py", "--smoke", "--output", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {row["contender"]: row for row in report["rows"]}
    assert set(rows) == CONTENDERS
    for name, row in rows.items():
        (run,) = row["runs"]  # --smoke: one run each
        assert run["steps"] >= 2 and run["tokens_per_s"] > 0 and run["model_tflops_per_s"] > 0, name
        assert row["tokens_per_s_min"] <= row["tokens_per_s"] <= row["tokens_per_s_max"]
        assert run["step_p50_s"] <= run["step_p90_s"] and row["mfu"] is None  # CPU: no known peak
        # the same samples trained once each: the same model FLOPs, whatever the batching
        assert run["model_flops_epoch"] == report["model_flops_epoch"]
    assert rows["padded"]["fill"] < 1.0 == rows["trl_padding_free"]["fill"] == rows["packing_hf"]["fill"]
    assert "vs_best_peer" in result.stdout and "packing_hf" in result.stdout
