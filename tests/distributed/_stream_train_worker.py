"""One rank of the 2-process streaming training run launched by ``test_stream_train_multiprocess.py``.

Run as ``torchrun --nproc_per_node 2 _stream_train_worker.py OUT_DIR`` (``use_cpu=True``: gloo on CPU).
Every rank trains a tiny llama with ``packing_hf.Trainer(max_tokens_per_batch=..., max_steps=...)`` on a
torch ``IterableDataset`` whose even samples (rank 0's shard) are short and odd ones (rank 1's) long, so
rank 0 runs out first in every pass and trains on padding batches while rank 1 finishes; then resumes a
second run from the checkpoint in the middle of pass 1, and evaluates it on the stream. It writes
``rank{r}.json``: the ``idx`` of every micro-batch it collated (``[]`` for a padding batch) in both runs,
the batches of a standalone ``PackedStream`` over the same data (the reference), the (DDP-averaged)
gradient of the first optimizer step, the largest weight difference between the resumed and the
uninterrupted run, and the streamed eval loss next to the mean token loss of a padded batch of every
sample. Importing this module does nothing (pytest collects it for doctests).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field

# what the test and this worker share: data, model, budget
NUM_SAMPLES = 24
VOCAB = 128
MAX_TOKENS_PER_BATCH = 160
GRADIENT_ACCUMULATION_STEPS = 2
MAX_STEPS = 6
RESUME_STEP = 3
SEED = 0


def sample_length(i: int) -> int:
    """Even samples (rank 0's shard) 10-12 tokens, odd ones (rank 1's) 45-49: rank 0 runs out first."""
    return 10 + i % 3 if i % 2 == 0 else 45 + i % 5


def make_samples() -> list[dict]:
    """Deterministic samples, ids in [1, VOCAB), with their index as ``idx``."""
    import torch

    generator = torch.Generator().manual_seed(1234)
    return [
        {"input_ids": torch.randint(1, VOCAB, (sample_length(i),), generator=generator).tolist(), "idx": i}
        for i in range(NUM_SAMPLES)
    ]


def make_model():
    """The tiny llama both ranks and the reference start from (fp32, no dropout)."""
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


def main(out_dir: str) -> None:
    import torch
    from transformers import TrainerCallback

    import packing_hf
    from packing_hf.streaming import PackedStream

    @dataclass
    class Recorder(packing_hf.PaddingFreeCollator):
        """Records the ``idx`` of the samples of every batch it collates (``[]``: a padding batch)."""

        batches: list = field(default_factory=list, init=False, repr=False)
        input_columns = (*packing_hf.PaddingFreeCollator.input_columns, "idx")

        def __call__(self, features, return_tensors=None):
            self.batches.append([int(f["idx"]) for f in features if "idx" in f])
            rows = [{k: v for k, v in f.items() if k != "idx"} for f in features]
            return super().__call__(rows, return_tensors)

    class Rows(torch.utils.data.IterableDataset):
        """A user's plain torch IterableDataset: every rank iterates all of it, the stream shards it."""

        def __iter__(self):
            return iter(make_samples())

    class FirstGrads(TrainerCallback):
        def __init__(self) -> None:
            self.grads: dict[str, list[float]] | None = None

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            if self.grads is None:
                self.grads = {
                    n: p.grad.double().flatten().tolist()
                    for n, p in model.named_parameters()
                    if p.grad is not None
                }

    def arguments(output_dir: str, **overrides) -> packing_hf.TrainingArguments:
        values = dict(
            max_tokens_per_batch=MAX_TOKENS_PER_BATCH,
            gradient_accumulation_steps=GRADIENT_ACCUMULATION_STEPS,
            max_steps=MAX_STEPS,
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
        )
        values.update(overrides)
        return packing_hf.TrainingArguments(output_dir, **values)

    args = arguments(out_dir, save_strategy="steps", save_steps=RESUME_STEP, save_only_model=False)
    collator, probe = Recorder(), FirstGrads()
    trainer = packing_hf.Trainer(
        model=make_model(), args=args, train_dataset=Rows(), data_collator=collator, callbacks=[probe]
    )
    result = trainer.train()
    rank, world_size = trainer.args.process_index, trainer.args.world_size

    # the reference: a standalone PackedStream over the same data, built as the Trainer builds it
    reference = PackedStream(
        make_samples(), MAX_TOKENS_PER_BATCH, seed=SEED, num_replicas=world_size, rank=rank
    )
    passes = [[[s["idx"] for s in b if "idx" in s] for b in reference] for _ in range(3)]

    resumed = Recorder()
    again = packing_hf.Trainer(
        model=make_model(),
        args=arguments(os.path.join(out_dir, "resumed")),
        train_dataset=Rows(),
        data_collator=resumed,
    )
    again.train(resume_from_checkpoint=os.path.join(out_dir, f"checkpoint-{RESUME_STEP}"))
    weight_diff = max(
        float((p - q).abs().max())
        for p, q in zip(trainer.model.parameters(), again.model.parameters(), strict=True)
    )
    resumed_batches = list(resumed.batches)  # evaluation collates with the same collator
    eval_loss = again.evaluate(eval_dataset=Rows())["eval_loss"]
    # the token mean over every sample, from a right-padded batch of all of them on the same weights
    samples = make_samples()
    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for r, s in enumerate(samples):
        n = len(s["input_ids"])
        ids[r, :n] = labels[r, :n] = torch.tensor(s["input_ids"])
        mask[r, :n] = 1
    with torch.no_grad():
        padded_loss = float(again.model.eval()(input_ids=ids, attention_mask=mask, labels=labels).loss)

    record = {
        "rank": rank,
        "world_size": world_size,
        "global_step": result.global_step,
        "batches": collator.batches,
        "reference_passes": passes,
        "padding_batches": trainer.packing_stream.stats()["padding_batches"],
        "first_grads": probe.grads,
        "resumed_batches": resumed_batches,
        "resumed_global_step": again.state.global_step,
        "weight_diff": weight_diff,
        "eval_loss": eval_loss,
        "padded_loss": padded_loss,
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()  # a clean gloo shutdown: no abort at interpreter exit


if __name__ == "__main__":
    main(sys.argv[1])
