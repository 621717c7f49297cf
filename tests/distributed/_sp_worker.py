"""Sequence parallelism (Ulysses) over packed rows, on 4 CPU processes (gloo, fp32): every case trains one
optimizer step on packed rows cut over the ranks and saves, on rank 0, its loss and every parameter gradient
next to those of one process on the same whole rows (``python _sp_worker.py OUT_DIR PORT``: the script imports
torch and transformers once, then forks the 4 processes, which meet over gloo on 127.0.0.1:PORT).

The cases (one launch, several checks; the test compares them with ``assert_close``):

- ``sp4_sample``: sp=4 over all ranks, ``loss_normalization="sample"`` with ``loss_weights``; a 37-token row
  whose second sample (25 tokens) is longer than a shard, crosses three shard cuts and fills shard 1 alone (a
  shard holding only a tail); 4 query heads over 2 key/value heads (each repeated to one per rank).
- ``dp2_sp2_token``: data parallel 2 x sequence parallel 2, two micro-batches per rank (gradient accumulation),
  ``"token"`` normalization (counts reduced over every rank), gradient checkpointing on.
- ``sp4_sliding``: a Mistral with a 4-token sliding window at sp=4 (the window sees across shard cuts).
- ``sp4_local_only``: the negative control, each shard attending within its own tokens: the same comparison
  must fail.
- ``packing_hf.Trainer`` (``"token"``) and ``packing_hf.SFTTrainer`` (``"sample"``) with
  ``parallelism_config=ParallelismConfig(sp_size=2)``, ``max_tokens_per_batch=48`` on 2 processes, one optimizer
  step, against the same trainer on one process (stock's own loss for ``"token"``).

Importing this module does nothing (pytest collects it for doctests).
"""

from __future__ import annotations

import os
import sys

VOCAB = 64
TOKENIZER = os.path.join(os.environ.get("PACKING_HF_DATA", "/work/shared/data"), "smollm2_tokenizer")
CASES = ("sp4_sample", "dp2_sp2_token", "sp4_sliding", "sp4_local_only")


def make_model(kind: str):
    """The tiny model of a case (fp32, no dropout, seeded), on packing_hf's varlen attention."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from packing_hf import register_attention

    extra = {"sliding_window": 4} if kind == "mistral" else {}
    config = AutoConfig.for_model(
        kind,
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        **extra,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=register_attention()).float()


def make_row(lengths: list[int], seed: int, weighted: bool) -> dict:
    """One packed row of samples of ``lengths`` (first tokens of every other sample masked as a prompt)."""
    import torch

    from packing_hf import PaddingFreeCollator

    generator = torch.Generator().manual_seed(seed)
    samples = []
    for i, length in enumerate(lengths):
        ids = torch.randint(1, VOCAB, (length,), generator=generator).tolist()
        prompt = 2 if i % 2 else 0
        sample = {"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]}
        if weighted:
            sample["loss_weights"] = (torch.randint(0, 9, (length,), generator=generator) / 4).tolist()
        samples.append(sample)
    return PaddingFreeCollator()(samples)


def reference_step(model, rows: list[dict], normalization: str):
    """Loss and gradients of one process on the whole rows: the step's numerator over its denominator."""
    import torch
    import torch.nn.functional as F

    from packing_hf._loss import loss_counts, loss_numerator, step_denominator

    model.zero_grad(set_to_none=True)
    counts = [
        loss_counts(r["labels"], r.get("loss_weights"), r["position_ids"], r["cu_seq_lens_q"]) for r in rows
    ]
    denominator = step_denominator([sum(c[0] for c in counts), sum(c[1] for c in counts)], normalization)
    total = 0.0
    for row in rows:
        inputs = {k: v for k, v in row.items() if k not in ("labels", "loss_weights")}
        logits = model(**inputs).logits  # (1, T, V)
        per_target = F.cross_entropy(
            logits[0, :-1], row["labels"][0, 1:], ignore_index=-100, reduction="none"
        ).unsqueeze(0)
        numerator = loss_numerator(
            per_target,
            row["labels"],
            normalization,
            row.get("loss_weights"),
            row["position_ids"],
            row["cu_seq_lens_q"],
        )
        loss = numerator / denominator
        loss.backward()
        total += float(loss.detach())
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return torch.tensor(total, dtype=torch.float64), grads


def parallel_step(model, rows: list[dict], normalization: str, group, local_only: bool = False):
    """Loss and gradients with this rank's rows cut over its SP group, summed over every rank."""
    import torch
    import torch.distributed as dist

    from packing_hf._loss import step_denominator
    from packing_hf.attention.sequence_parallel import (
        sequence_parallel_loss,
        shard_loss_counts,
        shard_packed_batch,
    )

    model.zero_grad(set_to_none=True)
    shards = [shard_packed_batch(row, group, local_only=local_only) for row in rows]
    counts = torch.zeros(2, dtype=torch.float64)
    for shard in shards:
        counts += torch.tensor(shard_loss_counts(shard), dtype=torch.float64)
    dist.all_reduce(counts)  # every row counted once (by the first rank of its group)
    denominator = step_denominator(counts.tolist(), normalization)
    total = torch.zeros((), dtype=torch.float64)
    for shard in shards:
        logits = model(**shard).logits  # (1, T_rank, V)
        loss = sequence_parallel_loss(logits, shard, normalization, denominator)
        loss.backward()
        total += float(loss.detach())
        calls = shard["packing_hf_sequence_shard"].calls
        assert calls > 0, "the model never ran the sequence-parallel attention"
    dist.all_reduce(total)
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad.detach().clone()
        dist.all_reduce(grad)  # what DDP does (its average, times the world size the loss is scaled by)
        grads[name] = grad
    return total, grads


def run(rank: int, out_dir: str, port: str, world: int) -> None:
    import torch
    import torch.distributed as dist

    from packing_hf.attention.sequence_parallel import sequence_parallel_groups

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    everyone = dist.new_group(list(range(dist.get_world_size())))
    pairs, _, dp_rank, _ = sequence_parallel_groups(2)
    results = {}

    llama = make_model("llama")
    row = make_row([5, 25, 4, 3], seed=1, weighted=True)  # shards [0, 10) [10, 19) [19, 28) [28, 37)
    reference = reference_step(llama, [row], "sample") if rank == 0 else None
    results["sp4_sample"] = (reference, parallel_step(llama, [row], "sample", everyone))
    results["sp4_local_only"] = (reference, parallel_step(llama, [row], "sample", everyone, local_only=True))

    rows = [make_row(lengths, seed=10 + i, weighted=False) for i, lengths in enumerate(
        [[7, 9, 4], [3, 14], [11, 2, 6, 5], [19]]
    )]  # fmt: skip
    reference = reference_step(llama, rows, "token") if rank == 0 else None
    llama.activation_checkpointing_enable()
    llama.train()
    mine = rows[2 * dp_rank : 2 * dp_rank + 2]  # data-parallel replica dp_rank: two micro-batches
    results["dp2_sp2_token"] = (reference, parallel_step(llama, mine, "token", pairs))

    mistral = make_model("mistral")
    row = make_row([9, 13, 6], seed=3, weighted=False)
    reference = reference_step(mistral, [row], "token") if rank == 0 else None
    results["sp4_sliding"] = (reference, parallel_step(mistral, [row], "token", everyone))

    if rank == 0:
        torch.save(results, os.path.join(out_dir, "sp_results.pt"))
    dist.barrier()
    dist.destroy_process_group()


def trainer_step(out_dir: str, sp_size: int, kind: str) -> tuple:
    """One optimizer step of ``packing_hf.Trainer`` (``kind="trainer"``, ``"token"``) or ``SFTTrainer``
    (``"sft"``, ``"sample"``) with ``max_tokens_per_batch=48``: the loss summed over ranks and the gradients the
    optimizer sees (DDP's average), with ``sp_size`` processes in one SP group or (``1``) on one process."""
    import datasets
    import torch
    from accelerate import ParallelismConfig
    from transformers import AutoTokenizer, TrainerCallback

    from packing_hf import PaddingFreeCollator, SFTConfig, SFTTrainer, Trainer, TrainingArguments

    grads: dict = {}

    class Capture(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            grads.update({n: p.grad.detach().clone() for n, p in model.named_parameters()})

    class Recording(Trainer if kind == "trainer" else SFTTrainer):
        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            grads["__loss__"] = loss.detach().clone()
            return loss

    generator = torch.Generator().manual_seed(7)
    data = []
    for i, length in enumerate([13, 21, 6, 9, 17, 4, 11, 8]):
        ids = torch.randint(1, VOCAB, (length,), generator=generator).tolist()
        data.append({"input_ids": ids, "labels": [-100] * (i % 3) + ids[i % 3 :]})
    options = dict(
        max_tokens_per_batch=48, max_steps=1, learning_rate=1e-3, max_grad_norm=0.0, report_to="none",
        save_strategy="no", use_cpu=True, disable_tqdm=True, packing_preflight="off", seed=3,
        parallelism_config=ParallelismConfig(sp_size=sp_size) if sp_size > 1 else None,
    )  # fmt: skip
    extra = {}
    if kind == "trainer":
        args = TrainingArguments(f"{out_dir}/trainer-sp{sp_size}", loss_normalization="token", **options)
    else:  # TRL's SFT in fp32 (its default on CPU is bf16 autocast), data already tokenized
        args = SFTConfig(
            f"{out_dir}/sft-sp{sp_size}", loss_normalization="sample", padding_free=True, max_length=None,
            bf16=False, **options,
        )  # fmt: skip
        data = datasets.Dataset.from_list(data)
        extra["processing_class"] = AutoTokenizer.from_pretrained(TOKENIZER)
    trainer = Recording(
        model=make_model("llama"), args=args, train_dataset=data, data_collator=PaddingFreeCollator(),
        callbacks=[Capture()], **extra,
    )  # fmt: skip
    trainer.train()
    loss = grads.pop("__loss__").double()
    if sp_size > 1:
        import torch.distributed as dist

        dist.all_reduce(loss)
        loss /= dist.get_world_size()  # each rank's loss is scaled by the world size (DDP averages)
    return loss, grads


def run_trainer(rank: int, out_dir: str, port: str, world: int) -> None:
    import torch

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world)
    )
    torch.set_num_threads(1)
    results = {kind: trainer_step(out_dir, world, kind) for kind in ("trainer", "sft")}
    if rank == 0:
        torch.save(results, os.path.join(out_dir, "sp_trainer.pt"))


def main(out_dir: str, port: str) -> None:
    import socket

    import torch
    import torch.multiprocessing as mp
    import transformers.models.llama.modeling_llama  # noqa: F401  (imported once, before the fork)
    import transformers.models.mistral.modeling_mistral  # noqa: F401

    import packing_hf
    import packing_hf.attention.sequence_parallel  # noqa: F401
    import packing_hf.integrations.sft  # noqa: F401  (TRL too)
    import packing_hf.integrations.trainer  # noqa: F401

    torch.set_num_threads(1)
    (
        packing_hf.attention.sequence_parallel.shard_packed_batch,
        packing_hf.register_attention(),
    )  # resolved before the fork too
    # fork: the children start with everything imported (spawn would import torch and transformers 4 times)
    mp.start_processes(run, args=(out_dir, port, 4), nprocs=4, start_method="fork")
    # packing_hf.Trainer with ParallelismConfig(sp_size=2) on 2 processes, then on this one without
    with socket.socket() as probe:  # a second free port: the first group's may linger in TIME_WAIT
        probe.bind(("127.0.0.1", 0))
        second = str(probe.getsockname()[1])
    mp.start_processes(run_trainer, args=(out_dir, second, 2), nprocs=2, start_method="fork")
    reference = {kind: trainer_step(out_dir, 1, kind) for kind in ("trainer", "sft")}
    torch.save(reference, os.path.join(out_dir, "sp_trainer_reference.pt"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
