"""No failure after training loses the trained model: it and its summary are saved before any diagnostic."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from packing_hf.app import cli, train

ROOT = Path(__file__).resolve().parents[3]


def test_a_failing_baseline_keeps_the_saved_model_and_exits_0(tmp_path, data_dir, monkeypatch, capsys):
    out = tmp_path / "run"
    saved_before = []

    def broken_baseline(*args, **kwargs):
        saved_before.append((out / "model.safetensors").is_file() and (out / train.SUMMARY_NAME).is_file())
        # what transformers' chunk_gated_delta_rule raised on a hybrid model's packed baseline
        raise ValueError("`chunk_gated_delta_rule` can't keep packed sequences apart")

    monkeypatch.setattr(train, "run_baseline", broken_baseline)
    status = cli.main(
        [
            "train",
            str(ROOT / "configs" / "tiny_cpu.yaml"),
            f"tokenizer_name_or_path={data_dir / 'smollm2_tokenizer'}",
            "gguf_file=null",
            "gguf_package=null",
            "num_samples=16",
            "eval_num_samples=2",
            "--max_steps",
            "1",
            f"output_dir={out}",
            "disable_tqdm=true",
        ]
    )
    printed = capsys.readouterr().out
    assert status == 0 and saved_before == [True]
    assert (out / "model.safetensors").is_file()
    summary = json.loads((out / train.SUMMARY_NAME).read_text())
    assert summary["baseline"] is None and summary["global_step"] == 1
    assert "padded baseline failed (ValueError: `chunk_gated_delta_rule`" in summary["baseline_note"]
    assert f"saved in {out}" in summary["baseline_note"]
    # the eval value is printed where it is announced
    assert f"eval loss after training: {summary['eval_loss_after']:.4f}" in printed
    assert "padded baseline failed" in printed


# every job saves through one path (packing_hf.app.sharded.save_whole): the Trainer's and a TRL trainer's
SAVE_NO_MODEL_RUNS = {
    "trainer": [
        "tiny_cpu.yaml",
        "gguf_file=null",
        "gguf_package=null",
        "num_samples=16",
        "eval_dataset=none",
    ],
    "dpo": [
        "tiny_dpo.yaml",
        "gguf_file=null",
        "gguf_package=null",
        "num_samples=4",
        "max_length=384",
        "per_device_train_batch_size=1",
        'model_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, '
        '"num_attention_heads": 2, "num_key_value_heads": 1}',
    ],
}


@pytest.mark.parametrize("trainer", sorted(SAVE_NO_MODEL_RUNS))
def test_a_save_that_writes_no_model_fails_the_command(trainer, tmp_path, data_dir, monkeypatch, capsys):
    """What transformers does under ZeRO-3 without stage3_gather_16bit_weights_on_model_save (a warning and DeepSpeed's
    partitioned checkpoint, no model file) or under FSDP with SHARDED_STATE_DICT (nothing): the run must not end
    successfully without its trained model, whichever trainer ran, and says so in one line, as the command's other
    errors, naming what is missing and where the trained weights are. (The engine runs themselves:
    tests/distributed/test_cli_launch.py.)"""
    import transformers

    out = tmp_path / "run"
    out.mkdir()
    earlier = out / "model.safetensors"
    earlier.write_bytes(b"an earlier run's model")  # older than this run's save: not its model
    an_hour_ago = time.time() - 3600
    os.utime(earlier, (an_hour_ago, an_hour_ago))

    def save_without_weights(self, output_dir=None, _internal_call=False):
        (Path(output_dir) / "config.json").write_text("{}")

    monkeypatch.setattr(transformers.Trainer, "save_model", save_without_weights)
    monkeypatch.setattr(train, "run_baseline", lambda *args, **kwargs: (None, "not measured here"))
    monkeypatch.delenv("PACKING_HF_TRACEBACK", raising=False)
    config, *overrides = SAVE_NO_MODEL_RUNS[trainer]
    status = cli.main(
        [
            "train",
            str(ROOT / "configs" / config),
            f"tokenizer_name_or_path={data_dir / 'smollm2_tokenizer'}",
            *overrides,
            "--max_steps",
            "1",
            f"output_dir={out}",
            "disable_tqdm=true",
        ]
    )
    errors = [
        line for line in capsys.readouterr().err.splitlines() if line.startswith("packing-hf train: error")
    ]
    assert status == 1
    assert len(errors) == 1 and errors[0].startswith(
        f"packing-hf train: error: the trained model was not saved to {out} ("
    ), errors
    assert "no weights file (model.safetensors" in errors[0] and "checkpoint-* folder" in errors[0]
    assert not (out / train.SUMMARY_NAME).exists()
