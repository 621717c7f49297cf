"""``packing_hf.Trainer`` started by ``accelerate launch --config_file`` whose ``parallelism_config`` block sets
``sp_size: 2`` (2 CPU processes, gloo, ``use_cpu=True``): the size comes from the launcher alone, the arguments
say nothing of it. Launched by ``test_accelerate_launch.py``; :func:`train` is also its one-process reference.

Per rank it writes ``rank{R}.json``: the run's plan, every step's logged loss, the dataset indices of every step's
samples (counted in ``training_step``), what the launcher put in the environment, and the launcher's own command
line as packing_hf reads it (:func:`packing_hf.integrations.launcher.launcher_command`).

Importing this module does nothing (pytest collects it for doctests).
"""

from __future__ import annotations

import json
import os
import sys

NUM_SAMPLES = 10
VOCAB = 64
MAX_TOKENS_PER_BATCH = 64
IDS_KEY = "packing_hf_test_sample_ids"
# the accelerate config file the test launches with: the torchrun-based launcher on CPU processes, SP from its
# parallelism_config block
ACCELERATE_CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
num_machines: 1
num_processes: 2
mixed_precision: 'no'
parallelism_config:
  parallelism_config_sp_size: 2
"""


def make_samples() -> list[dict]:
    """Deterministic samples of 7..30 tokens, ids in [1, VOCAB), each with its index."""
    import torch

    generator = torch.Generator().manual_seed(41)
    return [
        {"input_ids": torch.randint(1, VOCAB, (7 + (i * 11) % 24,), generator=generator).tolist(), "idx": i}
        for i in range(NUM_SAMPLES)
    ]


def train(out_dir: str) -> dict:
    """One epoch of SGD on a tiny Llama with packing_hf's attention; no ``sp_size`` in the arguments."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import packing_hf

    class Recording(packing_hf.PaddingFreeCollator):
        """Puts the indices of the batch's samples in the batch (taken out again in ``training_step``)."""

        input_columns = (*packing_hf.PaddingFreeCollator.input_columns, "idx")

        def __call__(self, features, return_tensors=None):
            batch = super().__call__(features, return_tensors)
            batch[IDS_KEY] = torch.tensor([int(f["idx"]) for f in features])
            return batch

    class Counting(packing_hf.Trainer):
        seen: list  # per training step, the indices of its samples

        def training_step(self, model, inputs, *args, **kwargs):
            self.seen.append(inputs.pop(IDS_KEY).tolist())
            return super().training_step(model, inputs, *args, **kwargs)

    config = AutoConfig.for_model(
        "llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_TOKENS_PER_BATCH,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=packing_hf.register_attention())
    args = packing_hf.TrainingArguments(
        out_dir, max_tokens_per_batch=MAX_TOKENS_PER_BATCH, num_train_epochs=1, optim="sgd", learning_rate=0.5,
        lr_scheduler_type="constant", max_grad_norm=0.0, seed=0, report_to="none", save_strategy="no",
        logging_steps=1, use_cpu=True, disable_tqdm=True, packing_preflight="off",
    )  # fmt: skip
    trainer = Counting(model=model, args=args, train_dataset=make_samples(), data_collator=Recording(drop_keys=("idx",)))
    trainer.seen = []
    trainer.train()
    return {
        "plan": trainer.parallel_plan.describe(),
        "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
        "seen": trainer.seen,
    }


def main(out_dir: str) -> None:
    from packing_hf.integrations.launcher import launch_arguments, launcher_command

    record = train(out_dir)
    launched = ("PARALLELISM_CONFIG_", "ACCELERATE_USE_PARALLELISM")
    record["environment"] = {k: v for k, v in os.environ.items() if k.startswith(launched)}
    record["launcher"] = launch_arguments(launcher_command() or [])
    with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(record, f)
    import torch

    torch.distributed.barrier()
    torch.distributed.destroy_process_group()  # a clean gloo shutdown: no abort at interpreter exit


if __name__ == "__main__":
    main(sys.argv[1])
