"""Every shipped trainer config (`configs/tiny_<trainer>.yaml`) runs from the command line's job: one step,
a smaller tiny model, the real SmolLM2 tokenizer and the embedded GSM8K rows; the model and its summary
saved, the reference model made as TRL would (without TRL's reload of a model it cannot name)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from packing_hf.app.config import load_train_config
from packing_hf.app.train import LOSS_CURVE_NAME, SUMMARY_NAME
from packing_hf.app.trl_job import run_job

ROOT = Path(__file__).resolve().parents[3]
SMALL = '{"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1}'
REFERENCE = {
    "dpo": "adapter",  # run with a LoRA adapter (peft:): TRL disables it for the reference log-probs
    "kto": "copy",
    "reward": "none",
    "orpo": "none",
    "cpo": "none",
    "grpo": "none",
    "rloo": "saved",
}


def cheap(data_dir: Path, out: Path, trainer: str) -> list[str]:
    overrides = [
        f"tokenizer_name_or_path={data_dir / 'smollm2_tokenizer'}",
        "gguf_file=null",
        "gguf_package=null",
        f"model_config={SMALL}",
        "num_samples=4",
        *([] if trainer in ("grpo", "rloo") else ["max_length=384"]),  # theirs: max_completion_length
        "max_steps=1",
        f"per_device_train_batch_size={2 if trainer in ('kto', 'grpo', 'rloo') else 1}",
        f"output_dir={out}",
        "disable_tqdm=true",
    ]
    if trainer in ("grpo", "rloo"):
        overrides += ["num_generations=2", "max_completion_length=8"]
    if trainer == "dpo":
        overrides.append('peft={"r": 4, "target_modules": ["q_proj", "v_proj"]}')
    return overrides


@pytest.mark.parametrize("trainer", list(REFERENCE))
def test_shipped_trainer_config_runs_and_saves(trainer, data_dir, tmp_path):
    out = tmp_path / trainer
    cfg = load_train_config(ROOT / "configs" / f"tiny_{trainer}.yaml", cheap(data_dir, out, trainer))
    assert cfg.job.trainer == trainer
    printed: list[str] = []
    summary = run_job(cfg, print_fn=printed.append)
    assert summary["global_step"] == 1 and summary["trainer"] == trainer
    assert summary["losses"] and all(math.isfinite(loss) for loss in summary["losses"])
    assert summary["reference"].startswith(REFERENCE[trainer])
    if trainer == "dpo":  # the adapter alone is saved, and only it trained
        assert (out / "adapter_model.safetensors").is_file() and "trained (adapter)" in summary["model"]
    else:
        assert (out / "model.safetensors").is_file()
    assert json.loads((out / SUMMARY_NAME).read_text())["global_step"] == 1
    assert (out / "checkpoint-1" / "trainer_state.json").is_file()  # the shipped config keeps one to resume
    assert (out / LOSS_CURVE_NAME).is_file() or "no loss curve drawn" in "\n".join(printed)
    if trainer in ("grpo", "rloo"):
        assert summary["rewards"] is not None and all(0.0 <= r <= 1.0 for r in summary["rewards"])
    if REFERENCE[trainer] == "saved":
        assert (out / "reference_model" / "config.json").is_file()


@pytest.mark.parametrize(
    "name, model_class",
    [("tiny_hybrid", "Qwen3_5ForCausalLM"), ("tiny_vlm", "Gemma3ForConditionalGeneration")],
)
@pytest.mark.usefixtures("one_torch_thread")
def test_shipped_hybrid_and_vlm_configs_run_from_the_command_line(
    name, model_class, data_dir, tmp_path, capsys
):
    """`packing-hf train configs/tiny_hybrid.yaml | tiny_vlm.yaml`, one step: the pre-flight proves the packed
    model exact, the model is saved, and the hybrid's padded baseline (which crashed a hybrid run before)
    measures instead of failing."""
    import packing_hf.app.cli as cli

    out = tmp_path / name
    status = cli.main(
        [
            "train",
            str(ROOT / "configs" / f"{name}.yaml"),
            f"tokenizer_name_or_path={data_dir / 'smollm2_tokenizer'}",
            "gguf_file=null",
            "gguf_package=null",
            "num_samples=4",
            "eval_num_samples=1",
            "max_tokens_per_batch=1024",
            "--max_steps",
            "1",
            # the hybrid's baseline: one step is too short to size it by, so measured whatever it costs
            *(
                ["baseline_batches=1", "baseline_time_share=100"]
                if name == "tiny_hybrid"
                else ["baseline_batches=0"]
            ),
            f"output_dir={out}",
            "disable_tqdm=true",
        ]
    )
    printed = capsys.readouterr().out
    assert status == 0, printed[-2000:]
    summary = json.loads((out / SUMMARY_NAME).read_text())
    assert summary["global_step"] == 1 and math.isfinite(summary["eval_loss_after"])
    assert json.loads((out / "config.json").read_text())["architectures"] == [model_class]
    if name == "tiny_hybrid":
        assert summary["baseline"] is not None and summary["baseline"]["speedup"] > 0, summary[
            "baseline_note"
        ]


def test_an_image_text_record_is_refused_by_name(tmp_path, capsys):
    import packing_hf.app.cli as cli

    data = tmp_path / "vlm.jsonl"
    messages = [{"role": "user", "content": "What is shown?"}, {"role": "assistant", "content": "A cat."}]
    data.write_text(json.dumps({"messages": messages, "images": ["cat.png"]}) + "\n")
    status = cli.main(["train", str(ROOT / "configs" / "tiny_vlm.yaml"), f"dataset={data}"])
    error = capsys.readouterr().err
    assert status != 0 and f"{data}:1: an image+text record (field images)" in error
    assert "packing_hf.SFTTrainer" in error
