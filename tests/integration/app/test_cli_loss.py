"""``packing-hf train`` with ``loss_normalization`` and per-turn loss weights, end to end on a tiny model."""

from __future__ import annotations

import json
from pathlib import Path

from packing_hf.app.cli import main

ROOT = Path(__file__).resolve().parents[3]


def test_train_with_sample_normalization_and_turn_weights(tmp_path, data_dir, capsys):
    rows = []
    for i in range(24):
        answer = {"role": "assistant", "content": f"The answer is {i * 7 % 13}." + " Indeed." * (i % 5)}
        if i % 3:
            answer["weight"] = [0.0, 0.5, 2.0][i % 3]
        rows.append(
            {"messages": [{"role": "user", "content": f"Question {i}: what is {i} times 7 mod 13?"}, answer]}
        )
    data = tmp_path / "weighted.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    status = main(
        [
            "train",
            str(ROOT / "configs" / "tiny_cpu.yaml"),
            f"tokenizer_name_or_path={data_dir / 'smollm2_tokenizer'}",
            f"dataset={data}",
            "num_samples=24",
            "eval_num_samples=null",
            "max_tokens_per_batch=256",
            "max_length=128",
            "baseline_batches=0",
            "gradient_accumulation_steps=2",
            "loss_normalization=sample",
            "max_steps=2",
            f"output_dir={out}",
            "disable_tqdm=true",
        ]
    )
    assert status == 0, capsys.readouterr().err[-2000:]
    summary = json.loads((out / "packing_summary.json").read_text())
    assert summary["global_step"] == 2 and len(summary["losses"]) == 2
    assert all(0 < loss < 50 for loss in summary["losses"])
