"""One rank of the 2-process multipack training run launched by ``test_multiprocess.py``.

Run as ``torchrun --nproc_per_node 2 _train_worker.py OUT_DIR`` or ``accelerate launch --multi_gpu
--num_processes 2 _train_worker.py OUT_DIR`` (``use_cpu=True``: gloo on CPU). Every rank trains a tiny
llama with ``packing_hf.Trainer(max_tokens_per_batch=...)`` for two epochs, then resumes a second run from
the checkpoint saved in the middle of epoch 1, and writes ``rank{r}.json``: the dataset indices of every
micro-batch it collated (in both runs), where each epoch started, its step count, and the (DDP-averaged)
gradient of the first optimizer step, for the test to compare with a single-process reference; and the
indices each rank sees in one epoch of plain accelerate loops over a ``MultipackBatchSampler`` (``shard=False``,
a pass-through shard, and the double sharding that is refused). Importing this module does nothing (pytest
collects it for doctests).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field

# what the test and this worker share: data, model, budget
NUM_SAMPLES = 36
VOCAB = 128
MAX_TOKENS_PER_BATCH = 160
GRADIENT_ACCUMULATION_STEPS = 2
EPOCHS = 2
SEED = 0


def make_samples() -> list[dict]:
    """Deterministic samples of varied lengths (10..59 tokens), ids in [1, VOCAB)."""
    import torch

    generator = torch.Generator().manual_seed(1234)
    samples = []
    for i in range(NUM_SAMPLES):
        length = 10 + (i * 17) % 50
        ids = torch.randint(1, VOCAB, (length,), generator=generator).tolist()
        samples.append({"input_ids": ids, "idx": i})
    return samples


def make_model():
    """The tiny llama both ranks and the reference start from (fp32, no dropout).

    conftest's ``tiny_llama`` shape, built here because this script runs outside pytest (under torchrun).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama",
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(SEED)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()


def _plain_accelerate_loops() -> dict:
    """The dataset indices this rank sees in one epoch of a plain accelerate loop over
    ``accelerator.prepare(DataLoader(batch_sampler=MultipackBatchSampler(...)))``: with ``shard=False``, with
    ``shard=True`` and the shard made a pass-through, and (refused) with ``shard=True`` alone."""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    import packing_hf
    from packing_hf.integrations.accelerator import pass_through_batch_shard

    lengths = [len(s["input_ids"]) for s in make_samples()]
    accelerator = Accelerator(cpu=True)

    def epoch(shard: bool, pass_through: bool = False) -> list[int]:
        sampler = packing_hf.MultipackBatchSampler(lengths, MAX_TOKENS_PER_BATCH, seed=SEED, shard=shard)
        loader = accelerator.prepare(DataLoader(list(range(NUM_SAMPLES)), batch_sampler=sampler))
        if pass_through:
            pass_through_batch_shard(loader, sampler)
        return [int(i) for batch in loader for i in batch]

    try:
        epoch(shard=True)
        refused = None
    except ValueError as error:
        refused = str(error)
    return {
        "accelerate_shard_false": epoch(shard=False),
        "accelerate_pass_through": epoch(shard=True, pass_through=True),
        "accelerate_double_shard_error": refused,
    }


def main(out_dir: str) -> None:
    import datasets
    import torch
    from transformers import TrainerCallback

    import packing_hf

    # a copy of tests/conftest.py's `recording_collator` fixture: this script runs under torchrun, not pytest
    @dataclass
    class RecordingCollator(packing_hf.PaddingFreeCollator):
        """Records the ``idx`` of the samples of every batch it collates (in consumption order)."""

        batches: list = field(default_factory=list, init=False, repr=False)
        drop_keys: tuple = ("idx",)  # recorded, not collated
        input_columns = (*packing_hf.PaddingFreeCollator.input_columns, "idx")

        def __call__(self, features, return_tensors=None):
            self.batches.append([int(f["idx"]) for f in features])
            return super().__call__(features, return_tensors)

    class Probe(TrainerCallback):
        """Where every epoch starts (in collated batches) and the gradient of the first optimizer step."""

        def __init__(self, collator: RecordingCollator) -> None:
            self.collator = collator
            self.epoch_starts: list[int] = []
            self.first_grads: dict[str, list[float]] | None = None

        def on_epoch_begin(self, args, state, control, **kwargs):
            self.epoch_starts.append(len(self.collator.batches))

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            if self.first_grads is None:
                self.first_grads = {
                    name: p.grad.double().flatten().tolist()
                    for name, p in model.named_parameters()
                    if p.grad is not None
                }

    def arguments(output_dir: str, **overrides) -> packing_hf.TrainingArguments:
        values = dict(
            max_tokens_per_batch=MAX_TOKENS_PER_BATCH,
            gradient_accumulation_steps=GRADIENT_ACCUMULATION_STEPS,
            num_train_epochs=EPOCHS,
            learning_rate=1e-3,
            max_grad_norm=0.0,  # the recorded gradient must be the raw one
            seed=SEED,
            report_to="none",
            save_strategy="no",
            logging_steps=1,
            use_cpu=True,
            ddp_backend="gloo",
            ddp_timeout=120,
            ddp_find_unused_parameters=False,
            disable_tqdm=True,
            multipack_cost_model="1,1",  # steps balanced by sum(L + L**2); the spread is logged per step
        )
        values.update(overrides)
        return packing_hf.TrainingArguments(output_dir, **values)

    dataset = datasets.Dataset.from_list(make_samples())
    collator = RecordingCollator()
    probe = Probe(collator)
    planner = packing_hf.Trainer(
        model=make_model(), args=arguments(out_dir), train_dataset=dataset, data_collator=RecordingCollator()
    )
    batches_per_epoch = len(planner.get_train_dataloader())
    steps_per_epoch = -(-batches_per_epoch // GRADIENT_ACCUMULATION_STEPS)
    resume_step = steps_per_epoch + 1  # a checkpoint in the middle of epoch 1
    args = arguments(out_dir, save_strategy="steps", save_steps=resume_step, save_only_model=False)
    trainer = packing_hf.Trainer(
        model=make_model(), args=args, train_dataset=dataset, data_collator=collator, callbacks=[probe]
    )
    result = trainer.train()

    # resume in the same 2-process group from the mid-epoch-1 checkpoint
    resumed = RecordingCollator()
    again = packing_hf.Trainer(
        model=make_model(),
        args=arguments(os.path.join(out_dir, "resumed")),
        train_dataset=dataset,
        data_collator=resumed,
    )
    again.train(resume_from_checkpoint=os.path.join(out_dir, f"checkpoint-{resume_step}"))

    rank = trainer.args.process_index
    record = {
        **_plain_accelerate_loops(),
        "rank": rank,
        "world_size": trainer.args.world_size,
        "global_step": result.global_step,
        "batches_per_epoch": batches_per_epoch,
        "batches": collator.batches,
        "epoch_starts": probe.epoch_starts,
        "first_grads": probe.first_grads,
        "logs": [h for h in trainer.state.log_history if "loss" in h],
        "resume_step": resume_step,
        "resumed_batches": resumed.batches,
        "resumed_global_step": again.state.global_step,
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()  # a clean gloo shutdown: no abort at interpreter exit


if __name__ == "__main__":
    main(sys.argv[1])
