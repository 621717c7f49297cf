"""``packing_hf.Trainer`` under accelerate's FSDP2 plugin against the same Trainer without it, on the same batches.

One run per process (accelerate's state is per process): first without FSDP, then under
``accelerate launch --use_fsdp --fsdp_version 2``, which compares itself with the first run's JSON and fails
(exit 1, the difference named) unless it ran under FSDP2 (parameters are ``DTensor`` shards), trained on the same
batches, and every step's loss is finite and equal to the first run's, as are the parameters after the last step
(1e-4 relative; one process: FSDP2's all-gather and reduce-scatter are copies, so only the order of floating-point
sums may differ). A tiny Llama on packing_hf's attention, fp32, synthetic samples packed by the multipack sampler
(``max_tokens_per_batch``), ``loss_normalization="sample"`` (packing_hf's own loss), AdamW:

    python benchmarks/check_fsdp2_trainer.py --device cuda --output OUT/plain.json
    accelerate launch --num_processes 1 --use_fsdp --fsdp_version 2 \\
        --fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP --fsdp_transformer_layer_cls_to_wrap LlamaDecoderLayer \\
        benchmarks/check_fsdp2_trainer.py --device cuda --output OUT/fsdp2.json --compare OUT/plain.json

``benchmarks/gpu_check.sh`` runs both. ``--device cpu`` runs the first on CPU; accelerate does not enable FSDP
for a CPU run (``use_cpu=True``), so the second is refused there by this script, by name (and, on several
processes, by ``packing_hf.Trainer`` itself).

``--sp-size 2`` on 2 GPUs (not run yet: the lent machines have one GPU, and NCCL takes one process per GPU) checks
FSDP2 with packing_hf's sequence parallelism (every packed row cut over the 2 processes, FSDP2 sharding over both)
against DDP with it; the JSON is written by the first process:

    torchrun --nproc_per_node 2 benchmarks/check_fsdp2_trainer.py --device cuda --sp-size 2 --output OUT/sp2.json
    accelerate launch --num_processes 2 --use_fsdp --fsdp_version 2 \\
        --fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP --fsdp_transformer_layer_cls_to_wrap LlamaDecoderLayer \\
        benchmarks/check_fsdp2_trainer.py --device cuda --sp-size 2 --output OUT/fsdp2_sp2.json \\
        --compare OUT/sp2.json

On CPU processes (gloo) the same comparison runs in ``tests/distributed/test_fsdp_multiprocess.py``, with
accelerate's device gate stood in for.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 4096
RELATIVE_TOLERANCE = 1e-4


def _samples(count: int) -> list[dict]:
    import torch

    generator = torch.Generator().manual_seed(0)
    samples = []
    for i in range(count):
        length = int(torch.randint(16, 400, (1,), generator=generator))
        ids = torch.randint(1, VOCAB, (length,), generator=generator).tolist()
        prompt = min(length - 1, 8 * (i % 4))  # a prompt of 0-24 tokens, not trained
        samples.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return samples


def _train(args) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from packing_hf import PaddingFreeCollator, Trainer, TrainingArguments, register_attention

    config = AutoConfig.for_model(
        "llama", vocab_size=VOCAB, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=register_attention()).float()
    batches: list[int] = []

    class Recording(Trainer):
        def training_step(self, model, inputs, *rest, **kwargs):
            batches.append(int(inputs["input_ids"].long().sum()))  # which batch: a checksum of its tokens
            return super().training_step(model, inputs, *rest, **kwargs)

    training = TrainingArguments(
        str(args.output.with_suffix("")), max_tokens_per_batch=2048, max_steps=args.steps, learning_rate=1e-3,
        lr_scheduler_type="constant", warmup_steps=0, logging_steps=1, report_to="none", save_strategy="no",
        disable_tqdm=True, seed=0, loss_normalization="sample", use_cpu=args.device == "cpu", bf16=False,
        sp_size=args.sp_size,
    )  # fmt: skip
    trainer = Recording(
        model=model, args=training, train_dataset=_samples(160), data_collator=PaddingFreeCollator()
    )
    if args.compare is not None and not trainer.is_fsdp_enabled:
        raise SystemExit(
            "--compare: this run is not under FSDP (trainer.is_fsdp_enabled is False); launch it with "
            "`accelerate launch --num_processes 1 --use_fsdp --fsdp_version 2 ...` on a GPU (transformers does not "
            "enable FSDP for a CPU run)"
        )
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None) if trainer.is_fsdp_enabled else None
    trainer.train()
    params = list(trainer.model.parameters())
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in params]
    return {
        "fsdp_version": getattr(plugin, "fsdp_version", None),
        "dtensor_parameters": sum(hasattr(p, "full_tensor") for p in params),
        "parameters": len(params),
        "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
        "batches": batches,
        "parameter_sums": [float(p.detach().double().abs().sum()) for p in full],
        "device": str(params[0].device),
        "plan": trainer.parallel_plan.describe(),
        "main_process": trainer.accelerator.is_main_process,
    }


def _compare(got: dict, want: dict) -> list[str]:
    """What differs between this run and the one without FSDP (empty: equal)."""
    problems = []
    if got["fsdp_version"] != 2 or got["dtensor_parameters"] != got["parameters"]:
        problems.append(
            f"not FSDP2: fsdp_version {got['fsdp_version']}, {got['dtensor_parameters']} of {got['parameters']} "
            "parameters are DTensor shards"
        )
    if got["batches"] != want["batches"]:
        problems.append(f"other batches: {got['batches']} vs {want['batches']}")
    if len(got["losses"]) != len(want["losses"]) or not all(math.isfinite(x) for x in got["losses"]):
        problems.append(f"losses {got['losses']} (want {len(want['losses'])} finite)")
    pairs = [("loss", a, b) for a, b in zip(got["losses"], want["losses"], strict=False)]
    pairs += [
        ("parameter |sum|", a, b) for a, b in zip(got["parameter_sums"], want["parameter_sums"], strict=True)
    ]
    for what, a, b in pairs:
        if abs(a - b) > RELATIVE_TOLERANCE * abs(b):
            problems.append(f"{what}: {a} under FSDP2, {b} without")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True, help="the JSON this run writes")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--compare", type=Path, default=None, help="the JSON of the run without FSDP")
    parser.add_argument("--sp-size", type=int, default=1, help="sequence parallelism: processes per packed row")
    args = parser.parse_args()
    result = _train(args)
    if not result.pop("main_process"):
        return  # the first process compares and writes
    if args.compare is not None:
        result["problems"] = _compare(result, json.loads(args.compare.read_text()))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "parameter_sums"}))
    if result.get("problems"):
        raise SystemExit("FSDP2 run differs from the run without it:\n  " + "\n  ".join(result["problems"]))


if __name__ == "__main__":
    main()
