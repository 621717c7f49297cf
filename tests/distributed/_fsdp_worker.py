"""FSDP2 (torch's ``fully_shard``) with packing on CPU processes over gloo, beside gloo DDP on the same processes
and one process on the same rows (``python _fsdp_worker.py OUT_DIR``: the script imports torch and
transformers once, then forks a world of 2 processes and one of 4, which meet over gloo on 127.0.0.1; the
one-process reference runs last, in the parent).

Every case trains a tiny Llama on packing_hf's varlen attention for :data:`STEPS` SGD steps of
:data:`ACCUMULATION` packed micro-batches per data-parallel rank: the batches of a
:class:`~packing_hf.MultipackBatchSampler` with ``num_replicas`` / ``rank`` the data-parallel world and rank,
collated by :class:`~packing_hf.PaddingFreeCollator`; the loss contract's ``"token"`` normalisation, its
denominator the step's target count summed over the micro-batches and all-reduced over the processes before the
first backward, each process's loss scaled by the number of processes (DDP and FSDP average gradients). Each case
saves, on rank 0, the step losses (summed over processes), the first step's gradients and the parameters after
the last step (``full_tensor()`` of FSDP's shards); the test compares them with the reference.

- world 2 (data parallel 2): ``ddp`` (``DistributedDataParallel``) and ``fsdp`` (``fully_shard`` of every decoder
  layer and of the input embeddings, then of the root, over a 1-D mesh of the 2 processes), both with the chunked LM head as the trainers use
  it (:func:`packing_hf.integrations.chunked_head.causal_lm_loss`, on the root's gathered ``lm_head``);
  ``fsdp_local_denominator``: the negative control, each process dividing by its own target count.
- world 4 (data parallel 2 x sequence parallel 2, :func:`~packing_hf.attention.sequence_parallel.sequence_parallel_mesh`):
  each replica's rows cut over its SP group (:func:`~packing_hf.attention.sequence_parallel.shard_packed_batch`,
  the Ulysses all-to-alls in the attention); ``ddp_sp2`` (DDP over the 4 processes, full logits and
  :func:`~packing_hf.shard_loss.sequence_parallel_loss`, the groups of
  :func:`~packing_hf.attention.sequence_parallel.sequence_parallel_groups`: what ``packing_hf.Trainer`` runs with
  ``sp_size=2``), ``fsdp_sp2`` (parameters, gradients and optimizer state sharded over all 4 processes, activation
  checkpointing), ``hsdp_sp2`` (sharded over each SP group, replicated over the replicas), both with the chunked
  head on shards (:func:`~packing_hf.shard_loss.sequence_parallel_chunked_loss`);
  ``fsdp_sp2_local_only``: the negative control, every shard attending within its own tokens.

The reference: one process, the rows of both replicas whole, full logits and
:func:`packing_hf._loss.loss_numerator` (no code path of the parallel cases but the model's).

Then, in the same processes, ``packing_hf.Trainer`` (:func:`trainer_cases`), one epoch of SGD steps of
:data:`ACCUMULATION` micro-batches of :func:`trainer_samples`, under accelerate's FSDP2 (``fsdp=True``,
``fsdp_config={"version": 2}``: accelerate's ``fully_shard`` of every decoder layer, then of the root) next to
gloo DDP (``use_cpu=True``):

- world 2: ``trainer_refused`` (first): FSDP asked for on CPU, which accelerate runs as DDP: the refusal's message;
  ``resharded_head_refused``: the chunked head's error on a head whose ``fully_shard`` group reshards after the
  forward; ``trainer_ddp``, ``trainer_fsdp`` (both with the chunked head), ``trainer_fsdp_full``
  (``chunked_loss=False``), ``trainer_fsdp_head_detached`` (the negative control: the chunked head with the head's
  weight detached); ``tree_ddp``, ``tree_fsdp``: ``share_prefixes=True``, one SGD step over the epoch of
  ``_tree_data.py``'s per-turn samples (prefix-tree rows, assistant-only masks), ``tree_flat_ddp`` the same step
  flat, ``tree_fsdp_local`` (the negative control) FSDP2 whose loss policy counts one process (each rank divides its
  tree loss by its own pairs' count); these record every micro-batch's sample indices.
- world 4: ``ddp_layout_sp2_refused`` (first): ``ParallelismConfig(dp_shard_size=2, sp_size=2)`` under DDP, which
  shards nothing: the refusal's message.
- world 4 (dp 2 x sp 2): ``trainer_ddp_sp2`` (``sp_size=2``, the ``TrainingArguments`` field), ``trainer_fsdp_sp2``
  (``sp_size=2``: FSDP2 over all 4 processes), ``trainer_hsdp_sp2``
  (``ParallelismConfig(dp_replicate_size=2, sp_size=2)``: accelerate's HSDP mesh, dp_replicate 2 x dp_shard 2,
  the SP processes folded into the shard dimension); ``trainer_fsdp_sp2_unscaled``: the negative control, FSDP2
  with SP whose loss is not multiplied by the number of processes (the engine's average then divides the update);
  ``sft_ddp_sp2``, ``sft_fsdp_sp2``: ``packing_hf.SFTTrainer`` (``loss_normalization="sample"``) the same way.

accelerate 1.15 enables FSDP only on accelerators (``AcceleratorState`` sets ``DistributedType.FSDP`` for
multi-GPU-like types, never for ``MULTI_CPU``): the FSDP cases run with :func:`accelerate_fsdp_on_cpu`, the CPU
stand-in for that device gate, installed in these test processes only (after ``trainer_refused``).

Importing this module does nothing (pytest collects it for doctests).
"""

from __future__ import annotations

import os
import sys

VOCAB = 64
STEPS = 3
ACCUMULATION = 2  # micro-batches per optimizer step and data-parallel rank
DATA_PARALLEL = 2  # replicas in both worlds: world 2 = dp 2; world 4 = dp 2 x sp 2
MAX_TOKENS_PER_BATCH = 48
LEARNING_RATE = 0.5  # large: 3 steps move every parameter well past float32 rounding
CASES = {
    2: ("ddp", "fsdp", "fsdp_local_denominator"),
    4: ("ddp_sp2", "fsdp_sp2", "hsdp_sp2", "fsdp_sp2_local_only"),
}
# packing_hf.Trainer, after the cases above; DDP first in each world (the FSDP cases leave accelerate's flag set)
TRAINER_CASES = {
    2: (
        "trainer_ddp", "trainer_fsdp", "trainer_fsdp_full", "trainer_fsdp_head_detached",
        "tree_flat_ddp", "tree_ddp", "tree_fsdp", "tree_fsdp_local",
    ),
    4: (
        "trainer_ddp_sp2", "trainer_fsdp_sp2", "trainer_hsdp_sp2", "trainer_fsdp_sp2_unscaled",
        "sft_ddp_sp2", "sft_fsdp_sp2",
    ),
}  # fmt: skip
TRAINER_SAMPLES = 24
# the share_prefixes cases: one step of up to TREE_ACCUMULATION micro-batches of TREE_TOKENS takes the epoch
TREE_TOKENS, TREE_ACCUMULATION = 48, 4
# the trainer cases that evaluate the first EVAL_SAMPLES samples before training (eval_before)
EVALUATED = ("trainer_ddp", "trainer_fsdp", "trainer_ddp_sp2", "trainer_fsdp_sp2", "trainer_hsdp_sp2")
EVAL_SAMPLES = 10
TOKENIZER = os.path.join(os.environ.get("PACKING_HF_DATA", "/work/shared/data"), "smollm2_tokenizer")


def make_model():
    """The tiny Llama every case starts from (fp32, no dropout, seeded), on packing_hf's varlen attention."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from packing_hf import register_attention

    config = AutoConfig.for_model(
        "llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=register_attention()).float()


def replica_rows(dp_rank: int) -> list[dict]:
    """The ``STEPS x ACCUMULATION`` packed rows data-parallel replica ``dp_rank`` trains on, in order: the
    multipack sampler's batches for that replica of :data:`DATA_PARALLEL`, collated (samples of 4-23 tokens,
    every third one with a 3-token prompt masked)."""
    import torch

    from packing_hf import MultipackBatchSampler, PaddingFreeCollator

    generator = torch.Generator().manual_seed(11)
    samples = []
    for i in range(48):
        length = int(torch.randint(4, 24, (1,), generator=generator))
        ids = torch.randint(1, VOCAB, (length,), generator=generator).tolist()
        prompt = 3 if i % 3 == 0 else 0
        samples.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    sampler = MultipackBatchSampler(
        [len(s["input_ids"]) for s in samples], MAX_TOKENS_PER_BATCH, num_replicas=DATA_PARALLEL, rank=dp_rank
    )
    batches = list(sampler)[: STEPS * ACCUMULATION]
    if len(batches) < STEPS * ACCUMULATION:
        raise ValueError(f"the sampler planned {len(batches)} batches per replica, fewer than the run needs")
    collate = PaddingFreeCollator()
    return [collate([samples[i] for i in batch]) for batch in batches]


def _counts(row: dict):
    from packing_hf._loss import loss_counts

    return loss_counts(row["labels"], None, row["position_ids"], row["cu_seq_lens_q"])


def reference_run() -> dict:
    """One process, each step's rows of both replicas whole: full logits, :func:`loss_numerator` over the step's
    target count."""
    import torch
    import torch.nn.functional as F

    from packing_hf._loss import loss_numerator, step_denominator

    model = make_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    rows = [replica_rows(r) for r in range(DATA_PARALLEL)]
    losses, first_grads = [], None
    for step in range(STEPS):
        mine = [r for replica in rows for r in replica[step * ACCUMULATION : (step + 1) * ACCUMULATION]]
        denominator = step_denominator([sum(_counts(r)[0] for r in mine), 0], "token")
        total = 0.0
        for row in mine:
            inputs = {k: v for k, v in row.items() if k != "labels"}
            logits = model(**inputs).logits  # (1, T, V)
            per_target = F.cross_entropy(logits[0, :-1], row["labels"][0, 1:], reduction="none")[None]
            numerator = loss_numerator(
                per_target,
                row["labels"],
                "token",
                position_ids=row["position_ids"],
                cu_seq_lens=row["cu_seq_lens_q"],
            )
            loss = numerator / denominator
            loss.backward()
            total += float(loss.detach())
        if first_grads is None:
            first_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {
        "losses": torch.tensor(losses, dtype=torch.float64),
        "grads": first_grads,
        "before": before,
        "after": after,
    }


def _full(tensor):
    """A parameter or gradient whole: FSDP's ``DTensor`` shards gathered, a plain tensor as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _wrap(case: str, model, mesh):
    """The model as the case trains it: DDP, or ``fully_shard`` of every decoder layer and of the input
    embeddings (as accelerate's FSDP2 does), then of the root, which holds the final norm and ``lm_head`` and
    keeps them gathered after the forward, where the chunked head reads the head's weight."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    if case.startswith("ddp"):
        return DistributedDataParallel(model)
    if case.startswith("fsdp") and mesh.ndim == 2:
        mesh = mesh._flatten()  # every process: parameters 1 / world per process
    if case == "fsdp_sp2":
        model.activation_checkpointing_enable()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model.model.embed_tokens, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _no_sync(model, last: bool):
    """No gradient synchronisation before the step's last micro-batch (accelerate's ``no_sync``)."""
    import contextlib

    if hasattr(model, "no_sync"):
        return contextlib.nullcontext() if last else model.no_sync()
    model.set_requires_gradient_sync(last)
    return contextlib.nullcontext()


def _micro_loss(case: str, model, row: dict, denominator: float, group) -> tuple:
    """This process's share of the step's loss on ``row`` (unscaled) as the trainers compute it."""
    from packing_hf._loss import target_coefficients
    from packing_hf.attention.sequence_parallel import shard_packed_batch
    from packing_hf.integrations.adapters import head_inputs
    from packing_hf.integrations.chunked_head import causal_lm_loss, resolve_head
    from packing_hf.shard_loss import sequence_parallel_chunked_loss, sequence_parallel_loss

    resolved = resolve_head(model)
    if isinstance(resolved, str):
        raise RuntimeError(f"{case}: the chunked head refused the model: {resolved}")
    if group is None:  # data parallel: the chunked head on the whole row
        labels = row["labels"]
        inputs = {k: v for k, v in row.items() if k != "labels"}
        coefficients = target_coefficients(labels, "token", None, row["position_ids"], row["cu_seq_lens_q"])
        total, _, _ = causal_lm_loss(model, inputs, labels, coefficients, resolved)
        return total / denominator, None
    shard = shard_packed_batch(row, group, local_only=case.endswith("local_only"))
    inputs = {k: v for k, v in shard.items() if k != "shift_labels"}
    if case == "ddp_sp2":  # what packing_hf.Trainer runs with sp_size today: the shard's logits
        logits = model(**inputs).logits  # (1, T_rank, V)
        return sequence_parallel_loss(logits, shard, "token", denominator), shard
    head, logit_head = resolved.head, resolved.logit_head
    with head_inputs(head) as captured:
        model(**inputs)
    loss = sequence_parallel_chunked_loss(
        captured[0], head.weight, shard, "token", denominator, head=logit_head
    )
    return loss, shard


def run_case(case: str, world: int, mesh, dp_rank: int, group) -> dict:
    """One case's :data:`STEPS` steps on this process (see the module docstring)."""
    import torch
    import torch.distributed as dist

    from packing_hf._loss import step_denominator
    from packing_hf.attention.sequence_parallel import shard_packed_batch
    from packing_hf.shard_loss import shard_loss_counts

    model = _wrap(case, make_model(), mesh)
    inner = getattr(model, "module", model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    rows = replica_rows(dp_rank)
    losses, first_grads = [], None
    for step in range(STEPS):
        mine = rows[step * ACCUMULATION : (step + 1) * ACCUMULATION]
        if group is None:
            counts = torch.tensor([sum(_counts(r)[0] for r in mine)], dtype=torch.float64)
        else:  # every row counted once, on the first process of its group
            counts = torch.tensor(
                [sum(shard_loss_counts(shard_packed_batch(r, group))[0] for r in mine)], dtype=torch.float64
            )
        if case != "fsdp_local_denominator":  # the negative control keeps its own count
            dist.all_reduce(counts)
        denominator = step_denominator([float(counts[0]), 0], "token")
        total = torch.zeros((), dtype=torch.float64)
        for i, row in enumerate(mine):
            with _no_sync(model, last=i == ACCUMULATION - 1):
                loss, shard = _micro_loss(case, model, row, denominator, group)
                (loss * world).backward()  # DDP / FSDP average the gradients over the processes
            if shard is not None and shard["packing_hf_sequence_shard"].calls == 0:
                raise RuntimeError(f"{case}: the model never ran the sequence-parallel attention")
            total += float(loss.detach())
        if first_grads is None:
            first_grads = {n: _full(p.grad).detach().clone() for n, p in inner.named_parameters()}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(total)  # the shares of every process add up to the step's loss
        losses.append(float(total))
    # the share of the parameters this process holds (FSDP's local shards; DDP: all of them)
    held = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in inner.parameters())
    after = {n: _full(p).detach().clone() for n, p in inner.named_parameters()}
    return {
        "losses": torch.tensor(losses, dtype=torch.float64),
        "grads": first_grads,
        "after": after,
        "held": held / sum(p.numel() for p in after.values()),
    }


def trainer_samples() -> list[dict]:
    """The :data:`TRAINER_SAMPLES` samples the trainer cases train one epoch on (4-23 tokens, every third one with
    a 3-token prompt masked; no two alike, so a sample is known by its tokens)."""
    import torch

    generator = torch.Generator().manual_seed(5)
    samples = []
    for i in range(TRAINER_SAMPLES):
        length = int(torch.randint(4, 24, (1,), generator=generator))
        ids = torch.randint(1, VOCAB, (length,), generator=generator)
        prompt = 3 if i % 3 == 0 else 0
        samples.append({"input_ids": ids.tolist(), "labels": [-100] * prompt + ids.tolist()[prompt:]})
    return samples


def accelerate_fsdp_on_cpu() -> None:
    """The CPU stand-in for accelerate's device gate (test processes only): ``AcceleratorState`` given an FSDP
    plugin on ``MULTI_CPU`` does what it does on ``MULTI_GPU``: ``distributed_type = FSDP``, the plugin kept, and
    the type shared with ``PartialState``. accelerate's and transformers' FSDP2 code then runs as on GPUs."""
    import accelerate.state as state
    from accelerate.utils import DistributedType

    original = state.AcceleratorState.__init__

    def init(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            state.PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    state.AcceleratorState.__init__ = init


def build_trainer(case: str, out_dir: str, world: int):
    """``packing_hf.Trainer`` (``SFTTrainer``: ``sft_*``) of a trainer case (see the module docstring); it records,
    in ``seen``, every micro-batch's samples (their tokens)."""
    import dataclasses
    import itertools

    import datasets
    from _tree_data import IDS_KEY, per_turn_samples, recording_collator
    from accelerate import ParallelismConfig
    from transformers import AutoTokenizer

    import packing_hf

    sft = case.startswith("sft_")

    class Recording(packing_hf.SFTTrainer if sft else packing_hf.Trainer):
        seen: list

        def training_step(self, model, inputs, *args, **kwargs):
            if IDS_KEY in inputs:  # the tree cases: the samples' indices (a tree row's segments are not samples)
                self.seen.append(inputs.pop(IDS_KEY).tolist())
                return super().training_step(model, inputs, *args, **kwargs)
            ids, cuts = inputs["input_ids"][0].tolist(), inputs["cu_seq_lens_q"].tolist()
            self.seen.append([ids[a:b] for a, b in itertools.pairwise(cuts)])
            return super().training_step(model, inputs, *args, **kwargs)

        def _sequence_parallel_loss(self, model, *args, **kwargs):
            result = super()._sequence_parallel_loss(model, *args, **kwargs)
            if not (case.endswith("_unscaled") and model.training):
                return result
            return (result[0] / world, *result[1:]) if isinstance(result, tuple) else result / world

    options = {}
    if "fsdp" in case or "hsdp" in case:
        options.update(fsdp=True, fsdp_config={"version": 2})
    if case.endswith("_full"):
        options["chunked_loss"] = False
    if "hsdp" in case:
        options["parallelism_config"] = ParallelismConfig(dp_replicate_size=2, sp_size=2)
    elif "layout" in case:
        options["parallelism_config"] = ParallelismConfig(dp_shard_size=2, sp_size=2)
    elif case.endswith(("_sp2", "_unscaled")):
        options["sp_size"] = 2
    options.update(
        max_tokens_per_batch=MAX_TOKENS_PER_BATCH, num_train_epochs=1, gradient_accumulation_steps=ACCUMULATION,
        optim="sgd", learning_rate=LEARNING_RATE, lr_scheduler_type="constant", max_grad_norm=0.0, seed=0,
        report_to="none", save_strategy="no", logging_steps=1, use_cpu=True, disable_tqdm=True,
        packing_preflight="off",
    )  # fmt: skip
    folder = os.path.join(out_dir, case)
    if sft:  # TRL's SFT in fp32 on the tokenized samples, each divided by its own target count ("sample")
        args = packing_hf.SFTConfig(
            folder, loss_normalization="sample", padding_free=True, max_length=None, bf16=False, **options
        )
        data = {"train_dataset": datasets.Dataset.from_list(trainer_samples())}
        data["processing_class"] = AutoTokenizer.from_pretrained(TOKENIZER)
    elif case.startswith("tree_"):  # one step over the epoch, every micro-batch's sample indices recorded
        options.update(
            max_tokens_per_batch=TREE_TOKENS, gradient_accumulation_steps=TREE_ACCUMULATION, max_steps=1,
            share_prefixes=case != "tree_flat_ddp",
        )  # fmt: skip
        args = packing_hf.TrainingArguments(folder, **options)
        data = {"train_dataset": per_turn_samples(VOCAB), "data_collator": recording_collator(not args.share_prefixes)}
    else:
        args = packing_hf.TrainingArguments(folder, **options)
        data = {"train_dataset": trainer_samples()}
    trainer = Recording(model=make_model(), args=args, **data)
    if case.endswith("_local"):  # the negative control: the loss policy counts this process alone
        trainer.loss_policy.plan = dataclasses.replace(trainer.loss_policy.plan, world_size=1)
    trainer.seen = []
    return trainer


def refused(case: str, out_dir: str, world: int) -> str:
    """The message of the refusal of a trainer case: ``trainer_fsdp`` without the stand-in (FSDP asked for where
    accelerate runs DDP), ``ddp_layout_sp2`` (an FSDP layout under DDP)."""
    try:
        build_trainer(case, os.path.join(out_dir, "refused"), world)
    except ValueError as error:
        return str(error)
    finally:
        os.environ.pop("ACCELERATE_USE_FSDP", None)  # set for good by an Accelerator given an FSDP plugin
    return ""


def resharded_head_refusal(mesh) -> str:
    """The chunked head's error where ``lm_head``'s ``fully_shard`` group reshards after the forward (its weight a
    shard when the chunked head would read it): accelerate's layout but for ``reshard_after_forward=True`` on the
    ``[final norm, lm_head]`` group."""
    from torch.distributed.fsdp import fully_shard

    from packing_hf.integrations.chunked_head import causal_lm_loss, resolve_head
    from packing_hf.integrations.parallel import ParallelPlan

    model = make_model()
    for module in (*model.model.layers, model.model.embed_tokens):
        fully_shard(module, mesh=mesh)
    fully_shard([model.model.norm, model.lm_head], mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh)
    row = replica_rows(0)[0]
    resolved = resolve_head(model, ParallelPlan("fsdp", 2, mesh.size(), mesh.get_rank()))  # FSDP2's hooks expected
    try:
        causal_lm_loss(model, {k: v for k, v in row.items() if k != "labels"}, row["labels"], resolved=resolved)
    except RuntimeError as error:
        return str(error)
    finally:
        model.reset_iter_state()  # the forward stopped before the backward
    return ""


def _fsdp_gathers(head) -> bool:
    """Whether FSDP2's hooks gather ``head`` around its calls (its ``fully_shard`` group holds it)."""
    modules = (str(getattr(getattr(h, "func", h), "__module__", "")) for h in head._forward_pre_hooks.values())
    return any(module.startswith("torch.distributed.fsdp.") for module in modules)


def _chunked_head_counted(chunked_head, counter: list, detached: bool):
    """``chunked_head._with_head_weight`` counting, in ``counter[0]``, the chunked head's projections where FSDP2
    gathered the head; ``detached``: the negative control, the head's weight detached (no gradient reaches it)."""
    original = chunked_head._with_head_weight

    def counted(resolved, hidden, compute):
        counter[0] += _fsdp_gathers(resolved.head)
        if detached:
            return original(resolved, hidden, lambda h, weight, bias: compute(h, weight.detach(), bias))
        return original(resolved, hidden, compute)

    return counted


def trainer_cases(rank: int, world: int, out_dir: str, mesh) -> dict:
    """The trainer cases of ``world`` (see the module docstring): per case, the plan, every step's loss, the
    parameters after the epoch (whole), each rank's micro-batches, the share of the parameters a process holds,
    how the first decoder layer's weight is placed (FSDP2's ``DTensor`` placements), how many attention calls
    ran on sequence-parallel shards, how many chunked-head projections ran on a head FSDP2 gathered, the
    chunked head's logged refusals, the eval loss of the cases of :data:`EVALUATED` before training, and the tree-token
    ratio of the first step (``None`` on flat rows)."""
    import torch.distributed as dist

    from packing_hf.attention.ulysses import SequenceShard
    from packing_hf.integrations import chunked_head

    results = {}
    if world == 2:
        results["trainer_refused"] = refused("trainer_fsdp", out_dir, world)
        results["resharded_head_refused"] = resharded_head_refusal(mesh)
    accelerate_fsdp_on_cpu()
    if world == 4:
        results["ddp_layout_sp2_refused"] = refused("ddp_layout_sp2", out_dir, world)
    original = SequenceShard.attention
    calls = [0]

    def counted(shard, *args, **kwargs):
        calls[0] += 1
        return original(shard, *args, **kwargs)

    SequenceShard.attention = counted
    original_weight, projections = chunked_head._with_head_weight, [0]
    for case in TRAINER_CASES[world]:
        os.environ.pop("ACCELERATE_USE_FSDP", None)  # an earlier FSDP case's Accelerator left it set
        calls[0] = projections[0] = 0
        chunked_head._with_head_weight = _chunked_head_counted(chunked_head, projections, "detached" in case)
        trainer = build_trainer(case, out_dir, world)
        # evaluated before training (FSDP2: transformers shards the model for it, and trains the sharded model)
        eval_before = trainer.evaluate(trainer_samples()[:EVAL_SAMPLES])["eval_loss"] if case in EVALUATED else None
        trainer.train()
        chunked_head._with_head_weight = original_weight
        model = trainer.model  # FSDP2: the fully_shard module (DTensor parameters); DDP: the module inside
        params = dict(model.named_parameters())
        weight = params["model.layers.0.mlp.up_proj.weight"]
        held = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in params.values())
        after = {n: _full(p).detach().clone() for n, p in params.items()}
        seen = [None] * world
        dist.all_gather_object(seen, trainer.seen)
        results[case] = {
            "plan": trainer.parallel_plan.describe(),
            "engine": type(trainer.model_wrapped).__name__,
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "after": after,
            "seen": seen,
            "held": held / sum(p.numel() for p in after.values()),
            "placements": str(getattr(weight, "placements", None)),
            "shard_calls": calls[0],
            "fsdp_head_projections": projections[0],
            "chunked_refusals": list(trainer.loss_policy.chunked_head_refusals),
            "eval_before": eval_before,
            "tree_token_ratio": next(h.get("tree_token_ratio") for h in trainer.state.log_history if "loss" in h),
        }
        del trainer, model, params, weight
    SequenceShard.attention = original
    return results


def run(rank: int, out_dir: str, port: str, world: int) -> None:
    import torch
    import torch.distributed as dist

    from packing_hf.attention.sequence_parallel import sequence_parallel_groups, sequence_parallel_mesh

    torch.set_num_threads(1)
    # the launcher's variables, for the trainer cases (transformers and accelerate join this process group)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world)
    )
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    sp = world // DATA_PARALLEL
    results = {}
    if sp == 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh, dp_rank, groups = init_device_mesh("cpu", (world,)), rank, {}
    else:
        mesh = sequence_parallel_mesh(sp)
        dp_rank = mesh.get_local_rank("dp")
        group, sp_rank, dp_of_group, _ = sequence_parallel_groups(sp)  # a second mesh's groups, the same layout
        if (sp_rank, dp_of_group) != (mesh.get_local_rank("sp"), dp_rank):
            raise RuntimeError(
                "sequence_parallel_mesh and sequence_parallel_groups lay the ranks out differently"
            )
        groups = {"ddp_sp2": group}
    for case in CASES[world]:
        group = groups.get(case, mesh.get_group("sp") if sp > 1 else None)
        results[case] = run_case(case, world, mesh, dp_rank, group)
    results.update(trainer_cases(rank, world, out_dir, mesh))
    if rank == 0:
        torch.save(results, os.path.join(out_dir, f"fsdp_world{world}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def main(out_dir: str) -> None:
    import socket

    import torch
    import torch.multiprocessing as mp
    import transformers.models.llama.modeling_llama  # noqa: F401  (imported once, before the fork)
    from torch.distributed.fsdp import fully_shard  # noqa: F401

    import packing_hf
    import packing_hf.attention.sequence_parallel  # noqa: F401
    import packing_hf.integrations.chunked_head  # noqa: F401
    import packing_hf.integrations.sft  # noqa: F401  (TRL, transformers' Trainer and accelerate too)

    torch.set_num_threads(1)
    packing_hf.register_attention()  # resolved before the fork too
    for world in CASES:
        with socket.socket() as probe:  # a fresh port per world: the last one's may linger in TIME_WAIT
            probe.bind(("127.0.0.1", 0))
            port = str(probe.getsockname()[1])
        # fork: the children start with everything imported (spawn would import torch and transformers again)
        mp.start_processes(run, args=(out_dir, port, world), nprocs=world, start_method="fork")
    torch.save(reference_run(), os.path.join(out_dir, "fsdp_reference.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
