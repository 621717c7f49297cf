"""Every script in examples/ runs for a few steps (tiny model, real GSM8K rows) and trains."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def common_args(data_dir: Path, tmp_path: Path) -> list[str]:
    return [
        "--tiny",
        "--tokenizer",
        str(data_dir / "smollm2_tokenizer"),
        "--data",
        str(data_dir / "gsm8k_train.jsonl"),
        "--num-samples",
        "48",
        "--max-steps",
        "3",
    ]


def parameters(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("name", ["train_trainer", "train_sft"])
def test_trainer_examples_train(name, data_dir, tmp_path):
    result = load_example(name).main(
        [*common_args(data_dir, tmp_path), "--output-dir", str(tmp_path / name)]
        + (
            ["--max-tokens-per-batch", "1024"]
            if name == "train_trainer"
            else ["--max-length", "512", "--batch-size", "1"]
        )
    )
    assert result["global_step"] == 3
    assert len(result["losses"]) == 3 and all(math.isfinite(loss) for loss in result["losses"])
    assert (tmp_path / name / "model.safetensors").is_file()
    trainer = result["trainer"]
    assert type(trainer).__module__.startswith("packing_hf")
    assert type(trainer.data_collator).__name__ == "PaddingFreeCollator"


def test_plain_loop_example_trains_and_changes_the_weights(data_dir, tmp_path, capsys):
    module = load_example("train_loop")
    result = module.main([*common_args(data_dir, tmp_path), "--max-tokens-per-batch", "1024", "--lr", "1e-3"])
    assert result["global_step"] == 3 and len(result["losses"]) == 3
    printed = capsys.readouterr().out
    assert "batches per epoch" in printed and "tokens/s" in printed
    # the same seed and data with lr=0 leave the weights where they started: the loop really updates them
    untouched = module.main(
        [*common_args(data_dir, tmp_path), "--max-tokens-per-batch", "1024", "--lr", "0", "--max-steps", "1"]
    )
    trained, initial = parameters(result["model"]), parameters(untouched["model"])
    assert any(not torch.equal(a, b) for a, b in zip(trained, initial, strict=True))


@pytest.mark.parametrize("name", ["train_trainer", "train_sft", "train_loop", "train_grpo"])
def test_examples_use_only_the_public_api(name):
    """A user's script: transformers, datasets, torch and packing_hf's top-level names, no internals."""
    import ast

    tree = ast.parse((ROOT / "examples" / f"{name}.py").read_text())
    modules = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    modules |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    # the one module below the top level an example may use: the CLI's built-in rewards (reward_funcs: gsm8k,
    # gsm8k_shaped), so the GRPO demo and `packing-hf train` score completions alike
    assert not {m for m in modules if m.startswith("packing_hf.") and m != "packing_hf.app.rewards"}, modules
    public = __import__("packing_hf").__all__
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "packing_hf":
            assert {alias.name for alias in node.names} <= set(public)


def test_grpo_example_trains_on_shared_prompts(data_dir, tmp_path):
    module = load_example("train_grpo")
    result = module.main(
        [
            "--tiny",
            "--tokenizer",
            str(data_dir / "smollm2_tokenizer"),
            "--data",
            str(data_dir / "gsm8k_train.jsonl"),
            "--num-samples",
            "8",
            "--num-generations",
            "2",
            "--max-completion-length",
            "6",
            "--max-steps",
            "1",
            "--output-dir",
            str(tmp_path / "grpo"),
        ]
    )
    assert result["global_step"] == 1 and len(result["logs"]) == 1
    # the demo reward differs between a tiny model's completions: GRPO gets advantages, so it trains (with the
    # answer match alone every reward is 0.0 and so are the loss and the gradient: tests/unit/app/test_rewards.py)
    (log,) = result["logs"]
    assert log["reward_std"] > 0 and log["grad_norm"] > 0, log
    trainer = result["trainer"]
    assert type(trainer).__module__.startswith("packing_hf")
    stats = trainer.packing_stats
    assert stats["shared_prompts"] > 0 and stats["packed_tokens"] < stats["padded_tokens"]
    assert (tmp_path / "grpo" / "model.safetensors").is_file()
