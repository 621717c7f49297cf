"""No failure after training loses the trained model: it and its summary are saved before any diagnostic."""

from __future__ import annotations

import json
from pathlib import Path

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
