"""benchmarks/bench_trees.py --quick: flat and prefix-tree packing (the trainers' losses, share_prefixes False / True)
train on every sample once, the tree rows compute fewer tokens, and the losses agreed on the same samples before any
step (no timing is asserted)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

sys.path.insert(0, str(ROOT / "benchmarks"))  # the benchmarks import each other and _common as scripts
import bench_trees  # noqa: E402


def test_bench_trees_quick(tmp_path, data_dir):
    out = tmp_path / "trees.json"
    argv = ["bench_trees.py", "--quick", "--no-cpu-memory", "--output", str(out)]
    threads = torch.get_num_threads()
    try:
        with mock.patch.object(sys, "argv", argv):
            bench_trees.main()
    finally:
        torch.set_num_threads(threads)  # main() runs on one thread
    rows = json.loads(out.read_text())["rows"]
    assert {row["dataset"] for row in rows} == {"gsm8k", "synthetic"}
    for row in rows:
        # the flat rows hold every sample once; the tree rows every sample's tokens once per tree
        assert row["flat_tokens_computed"] == row["sample_tokens"]
        assert row["tree_tokens_computed"] < row["flat_tokens_computed"]
        assert row["token_ratio"] == pytest.approx(row["flat_tokens_computed"] / row["tree_tokens_computed"])
        # no batch of trees can share more than the whole data set as one tree
        assert row["token_ratio"] <= row["whole_tree_ratio"] + 1e-9
        # the trainers' flat and prefix-tree losses and token_logprobs' agreed on the same samples and weights
        check = row["loss_check"]
        assert check["samples"] >= 2
        for name in ("tree", "token_logprobs"):
            assert check[name] == pytest.approx(check["flat"], rel=bench_trees.LOSS_TOLERANCE)
        assert row["flat_steps"] >= 1 and row["tree_steps"] >= 1
        # every sample trained once by each contender
        for contender in ("flat", "tree"):
            per_step = row[f"{contender}_samples_per_step"]
            assert per_step["mean"] * row[f"{contender}_steps"] == pytest.approx(row["samples"])
    synthetic = next(row for row in rows if row["dataset"] == "synthetic")
    assert synthetic["data"]["depths"] == [2, 3]  # rollouts branching at 2 and 3 depths


def test_the_start_check_stops_a_tree_loss_that_lost_a_target(monkeypatch):
    """Negative control of the check at start: the tree loss with one (row, target) pair dropped (a child's target
    read nowhere) is told apart from the flat loss, and the run stops."""
    samples, _ = bench_trees.synthetic_rollouts(1, vocab=64, seed=0, budget=4096)  # one tree, 4 leaves
    torch.manual_seed(0)
    model = bench_trees.build_model(
        "tiny", 64, torch.float32, "cpu", bench_trees.packing_hf.register_attention()
    )
    head = bench_trees.chunked_head(model)
    assert bench_trees.check_losses_agree(model, head, samples, "cpu")["samples"] == len(samples)
    coefficients = bench_trees.tree_coefficients

    def one_pair_dropped(pairs, normalization):
        kept = coefficients(pairs, normalization).clone()
        kept[-1] = 0.0
        return kept

    monkeypatch.setattr(bench_trees, "tree_coefficients", one_pair_dropped)
    with pytest.raises(SystemExit, match="the tree loss .* differs from the flat loss"):
        bench_trees.check_losses_agree(model, head, samples, "cpu")
