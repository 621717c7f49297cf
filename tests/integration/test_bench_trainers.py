"""benchmarks/bench_trainers.py --smoke: every contender trains through its own trainer, on every sample once,
and the JSON holds the figures the README quotes (no timing is asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("trl")
sys.path.insert(0, str(ROOT / "benchmarks"))  # the benchmarks import each other and _common as scripts
import bench_trainers  # noqa: E402
from bench_trainers import CONTENDERS, build_model  # noqa: E402


def run_bench(tmp_path, data_dir, *flags: str) -> tuple[dict, str]:
    out = tmp_path / "trainers.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PACKING_HF_DATA": str(data_dir), "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "benchmarks/bench_trainers.py", *flags, "--output", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(out.read_text()), result.stdout


def run_bench_here(tmp_path, *flags: str) -> dict:
    """bench_trainers.py's ``main()`` with ``flags`` in this process, which has the interpreter and the imports
    a subprocess would pay for again: its JSON. For ``--batches-only`` runs (no model step), with
    ``--no-cpu-memory`` (the memory probe would pin this process's malloc threshold for the rest of the session;
    a batches-only run measures no memory anyway) and the tokenizer folder (the same ids as the GGUF file's)."""
    out = tmp_path / "trainers.json"
    argv = ["bench_trainers.py", *flags, "--no-cpu-memory", "--tokenizer", "folder", "--output", str(out)]
    threads = torch.get_num_threads()
    try:
        with mock.patch.object(sys, "argv", argv):
            bench_trainers.main()
    finally:
        torch.set_num_threads(threads)  # main() runs on one thread
    return json.loads(out.read_text())


def test_bench_trainers_smoke(tmp_path, data_dir):
    report, stdout = run_bench(tmp_path, data_dir, "--smoke")
    rows = {row["contender"]: row for row in report["rows"]}
    assert set(rows) == set(CONTENDERS)
    for name, row in rows.items():
        (run,) = row["runs"]  # --smoke: one run each
        assert run["steps"] >= 2 and run["tokens_per_s"] > 0 and run["model_tflops_per_s"] > 0, name
        assert row["tokens_per_s_min"] <= row["tokens_per_s"] <= row["tokens_per_s_max"]
        assert run["step_p50_s"] <= run["step_p90_s"] and row["mfu"] is None  # CPU: no known peak
        # the same samples trained once each: the same model FLOPs, whatever the batching
        assert run["model_flops_epoch"] == report["model_flops_epoch"]
    assert rows["padded"]["fill"] < 1.0 == rows["trl_padding_free"]["fill"] == rows["packing_hf"]["fill"]
    assert "vs_best_peer" in stdout and "packing_hf" in stdout
    # the run's conditions: one torch thread on CPU by default, the cores, the load before and after
    assert report["threads"]["threads"] == 1 == report["environment"]["torch_threads"]
    assert report["threads"]["cpu_count"] == os.cpu_count()
    for when in ("start", "end"):
        assert len(report["load_average"][when]) == 3 and min(report["load_average"][when]) >= 0
    assert "load average at start" in stdout
    for name, row in rows.items():
        (run,) = row["runs"]
        # tokens per CPU second beside per wall second; one timed run: no spread
        assert run["tokens_per_cpu_s"] > 0 and row["tokens_per_cpu_s"] == run["tokens_per_cpu_s"], name
        assert row["spread"] == 0.0 == row["spread_cpu"], name
        # one untimed warm-up run, from the same initial weights as the timed one, one thread on CPU: the very same
        # loss (a timed run that went on from the warm-up's trained weights would differ by ~1e-3; one whose model
        # was built from a config the warm-up's trainer wrote its pad id into, ~5e-7)
        (warmup,) = row["warmup_runs"]
        assert warmup["steps"] == run["steps"] and row["loss_spread"] == 0.0, (name, row["loss_spread"])
    # vs_ideal: packing_hf's tokens/s over batch_rebalance's divided by its real-token share, wall and CPU
    ours, base = rows["packing_hf"], rows["hf_batch_rebalance"]
    for clock, key in (("wall", "tokens_per_s"), ("cpu", "tokens_per_cpu_s")):
        expected = ours[key] * base["fill_timed"] / base[key]
        assert report["vs_ideal"][clock]["vs_ideal"] == pytest.approx(expected, rel=1e-9), clock
        assert report["vs_ideal"][clock]["rounds"] == [pytest.approx(expected, rel=1e-9)]
    assert ours["vs_ideal"] == report["vs_ideal"]["wall"]["vs_ideal"] > 0
    assert ours["vs_ideal_cpu"] == report["vs_ideal"]["cpu"]["vs_ideal"] > 0
    assert all(rows[n]["vs_ideal"] is None for n in set(CONTENDERS) - {"packing_hf"})
    assert "vs_ideal_cpu" in stdout
    # every run's batching figures, from the batches its trainer collated
    batching = {row["contender"]: row for row in report["batching"]}
    assert set(batching) == set(CONTENDERS)
    for name, row in rows.items():
        figures = row["runs"][0]["batching"]
        assert figures["steps"] == row["steps"] == batching[name]["steps"], name
        assert figures["real_tokens_per_step"]["min"] <= figures["real_tokens_per_step"]["median"]
        assert figures["real_tokens_per_step"]["median"] <= figures["real_tokens_per_step"]["max"]


def test_every_run_builds_the_same_model_whatever_a_trainer_wrote_into_its_config():
    """build_model(config=...) builds every run's model from a copy: TRL's SFTTrainer (so packing_hf's) writes the
    tokenizer's pad id into model.config, which a model built straight from the shared config would turn into
    nn.Embedding(padding_idx=pad) (no input-side gradient for that row): the second run trained another model."""
    import argparse

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    args = argparse.Namespace(device="cpu", dtype="float32")
    config = AutoConfig.for_model(
        "llama", hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=32, use_cache=False,
    )  # fmt: skip
    ids = torch.tensor([[5, 3, 7, 3, 9]])  # the pad id below among the inputs, as EOS is in a packed row

    def embedding_gradient(model, init):
        model.load_state_dict(init)
        model(input_ids=ids, labels=ids).loss.backward()
        return model.get_input_embeddings().weight.grad

    first = build_model(args, None, "sdpa", config=config)
    init = {k: v.clone() for k, v in first.state_dict().items()}
    expected = embedding_gradient(first, init)
    first.config.pad_token_id = 3  # what the first run's SFTTrainer.__init__ does (pad = the tokenizer's)
    second = build_model(args, None, "sdpa", config=config)
    assert second.get_input_embeddings().padding_idx is None
    assert torch.equal(embedding_gradient(second, init), expected)
    # negative control: a model built from the config the trainer wrote into is another model (row 3 differs)
    leaked = AutoModelForCausalLM.from_config(first.config, attn_implementation="sdpa")
    assert leaked.get_input_embeddings().padding_idx == 3
    assert not torch.equal(embedding_gradient(leaked, init)[3], expected[3])


def test_equal_memory_sizing_keeps_every_micro_batch_within_the_budget(tmp_path):
    """--sizing memory: no contender's micro-batch holds more than the budget in tokens, padding included (what
    its peak activation memory follows), on the batches each trainer's own dataloader makes; the padded ones
    then carry fewer real tokens per step than the packers. Under --sizing tokens padded batches do exceed it."""
    flags = ("--batches-only", "--mix", "gsm8k", "--samples", "96", "--budget", "2048")
    memory = run_bench_here(tmp_path, *flags, "--sizing", "memory")
    rows = {row["contender"]: row for row in memory["batching"]}
    assert set(rows) == set(CONTENDERS)
    for (run,) in memory["runs"].values():  # every sample once (the run checks it too)
        assert round(run["batching"]["samples_per_step"]["mean"] * run["steps"]) == 96
    assert all(row["padded_max/budget"] <= 1.0 for row in rows.values()), rows
    assert rows["packing_hf"]["tok_step_med"] > rows["hf_group_by_length"]["tok_step_med"]
    assert rows["hf_group_by_length"]["fill"] > rows["padded"]["fill"]  # grouping cuts padding, not underfill
    tokens = run_bench_here(tmp_path, *flags, "--sizing", "tokens", "--contenders", "padded")
    assert {row["contender"]: row for row in tokens["batching"]}["padded"]["padded_max/budget"] > 1.0
