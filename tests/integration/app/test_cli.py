"""The packing-hf command line: train on the tiny CPU config, stats on real data, errors, dispatch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from packing_hf.app.cli import main

ROOT = Path(__file__).resolve().parents[3]
TINY_CONFIG = str(ROOT / "configs" / "tiny_cpu.yaml")


def test_train_tiny_cpu_config_with_overrides(tmp_path, data_dir, capsys):
    out = tmp_path / "run"
    status = main(
        [
            "train",
            TINY_CONFIG,
            f"tokenizer_name_or_path={data_dir / 'smollm2_tokenizer'}",
            f"dataset={data_dir / 'gsm8k_test.jsonl'}",
            "num_samples=40",
            "--max_steps",
            "2",
            "max_tokens_per_batch=null",  # unset the YAML's budget: axolotl's key derives it
            "sample_packing=true",
            "max_length=384",
            "--per_device_train_batch_size",
            "2",
            "baseline_batches=1",
            "baseline_time_share=1000",  # timed whatever it costs against the tiny model's training
            "eval_dataset=null",
            f"--output_dir={out}",
            "--disable_tqdm",
        ]
    )
    assert status == 0
    printed = capsys.readouterr().out
    for line in (
        "fill (real / provisioned tokens)",
        "tokens/s (forward+backward)",
        "training     multipack",
        "saved",
    ):
        assert line in printed
    summary = json.loads((out / "packing_summary.json").read_text())
    assert summary["global_step"] == 2 and summary["batching"] == "multipack"
    # sample_packing: true -> multipack with axolotl's budget, sequence_len x micro_batch_size = 384 x 2
    assert summary["max_tokens_per_batch"] == 768 and summary["num_samples"] == 40
    assert summary["dataset"].endswith("gsm8k_test.jsonl")
    assert len(summary["losses"]) == 2 and all(loss > 0 for loss in summary["losses"])
    assert summary["packing_efficiency"] > summary["padded_efficiency"]
    assert (
        summary["baseline"]["real_tokens"] > 0
        and summary["baseline"]["padded_tokens"] >= summary["baseline"]["real_tokens"]
    )
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()


def test_train_config_errors_exit_2_with_the_reason(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model_type: llama\nmax_tokns_per_batch: 512\n")
    assert main(["train", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"unknown config key 'max_tokns_per_batch' in {bad}. Did you mean 'max_tokens_per_batch'?" in err
    assert main(["train", TINY_CONFIG, "sample_packing=false"]) == 2  # the YAML sets max_tokens_per_batch
    assert "needs multipack batching" in capsys.readouterr().err
    assert main(["train", str(tmp_path / "missing.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["train", "--max_steps", "3"]) == 2


def test_stats_on_real_data_prints_the_table_and_writes_plot_and_json(tmp_path, data_dir, capsys):
    png, report = tmp_path / "lengths.png", tmp_path / "stats.json"
    status = main(
        [
            "stats",
            str(data_dir / "gpteacher_roleplay.json"),
            "--max-tokens-per-batch",
            "2048",
            "--tokenizer",
            str(data_dir / "smollm2_tokenizer"),
            "--num-samples",
            "600",
            "--plot",
            str(png),
            "--mixed-formats",
            "--json",
            str(report),
            "--world-size",
            "2",
            "4",
            "--cost-model",
            "100,1",
        ]
    )
    assert status == 0
    printed = capsys.readouterr().out
    for strategy in ("padded", "online", "fixed", "fixed-split", "multipack"):
        assert f"\n{strategy} " in printed
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    (result,) = json.loads(report.read_text())["results"]
    rows = {row["strategy"]: row for row in result["strategies"]}
    assert result["lengths"]["samples"] == 600
    assert len({row["real_tokens"] for row in rows.values()}) == 1  # nothing truncated at this budget
    assert rows["multipack"]["steps"] >= result["lower_bound_l2"]
    assert rows["multipack"]["efficiency"] > rows["online"]["efficiency"] > rows["padded"]["efficiency"]
    # the ranks' wait per step, token-balanced vs cost-balanced, for every world size asked
    assert [s["world_size"] for s in result["rank_spread"]] == [2, 4]
    assert all(1.0 <= s["cost_balanced"] <= s["token_balanced"] for s in result["rank_spread"])
    assert "4 ranks, slowest rank / mean predicted cost per step (100,1): token-balanced" in printed


def test_stats_bad_input(tmp_path, capsys):
    assert main(["stats", str(tmp_path / "none.jsonl"), "--max-tokens-per-batch", "64"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["stats", "x.jsonl"]) == 2  # --max-tokens-per-batch is required
    assert main(["stats", "x.jsonl", "--max-tokens-per-batch", "64", "--cost-model", "a,b"]) == 2
    assert "--cost-model: cost model 'a,b': expected two numbers" in capsys.readouterr().err


def test_verify_is_dispatched(capsys):
    assert main(["verify", "--model-type", "llama", "--no-grads"]) == 0
    assert "exact" in capsys.readouterr().out


def test_unknown_command_and_help(capsys):
    assert main(["bogus"]) == 2
    assert "unknown command 'bogus'" in capsys.readouterr().err
    assert main(["--help"]) == 0
    assert "train CONFIG.yaml" in capsys.readouterr().out
    assert main(["train", "--help"]) == 0
    assert "max_tokens_per_batch" in capsys.readouterr().out


@pytest.mark.skipif(
    not (Path(sys.executable).parent / "packing-hf").exists(), reason="console script not installed"
)
def test_console_script_is_installed():
    script = Path(sys.executable).parent / "packing-hf"
    result = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.startswith("packing-hf ")


def test_train_sft_trainer_config_with_a_tiny_model(tmp_path, data_dir, capsys):
    out = tmp_path / "sft"
    tiny = '{"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1}'
    status = main(
        [
            "train",
            str(ROOT / "configs" / "sft_trainer.yaml"),
            "model_type=llama",
            f"model_config={tiny}",
            f"tokenizer_name_or_path={data_dir / 'smollm2_tokenizer'}",
            "num_samples=24",
            "max_length=256",
            "per_device_train_batch_size=1",
            "max_steps=2",
            f"output_dir={out}",
            "disable_tqdm=true",
        ]
    )
    assert status == 0
    summary = json.loads((out / "packing_summary.json").read_text())
    assert (
        summary["trainer"] == "sft" and summary["batching"] == "padding_free" and summary["global_step"] == 2
    )
    assert summary["baseline"] is None  # TRL tokenizes and packs itself: no padded timing on this path
    assert 0 < summary["packing_efficiency"] <= 1 and len(summary["losses"]) == 2
    assert "packing-hf train: summary" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("overrides", "batching"),
    [(["sample_packing=false"], "padded"), (["batching=padding_free"], "padding_free")],
)
def test_train_without_multipack(overrides, batching, tmp_path, data_dir, capsys):
    out = tmp_path / batching
    args = [
        "train",
        TINY_CONFIG,
        f"tokenizer_name_or_path={data_dir / 'smollm2_tokenizer'}",
        "max_tokens_per_batch=null",
        *overrides,
        "num_samples=32",
        "per_device_train_batch_size=4",
        "max_steps=2",
        "baseline_time_share=1000",
        f"output_dir={out}",
        "disable_tqdm=true",
    ]
    assert main(args) == 0
    summary = json.loads((out / "packing_summary.json").read_text())
    assert summary["batching"] == batching and summary["max_tokens_per_batch"] is None
    assert summary["global_step"] == 2 and summary["padded_batch_size"] == 4
    assert summary["eval_loss_after"] > 0 and summary["eval_samples"] == 8  # tiny_cpu.yaml's eval_num_samples
    # padded-vs-flattened timing of the same 4 samples, whatever the training batches were
    baseline = summary["baseline"]
    assert baseline["packed_batches"] == baseline["padded_batches"] == 1
    assert baseline["packed_tokens"] == baseline["real_tokens"] <= baseline["padded_tokens"]
    assert f"training     {batching}:" in capsys.readouterr().out
