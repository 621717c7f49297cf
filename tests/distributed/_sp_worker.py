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
- ``sp4_short_row``: a row of 3 tokens at sp=4 (lengthened with one-token samples without a target, as a
  stream's padding batch is).
- ``sp4_local_only``: the negative control, each shard attending within its own tokens: the same comparison
  must fail.
- ``sp4_tree``: a prefix-tree row (``prefix_seq_idx``: conversations branching at three depths, a duplicate,
  a strict prefix and an unrelated sample) at sp=4: shard cuts fall inside segments and children sit on other
  ranks than their parents. ``sp4_tree_sibling_leak``, its negative control: the shards' ``prefix_seq_idx``
  gives a branch its sibling as parent (the attention gathers the sibling's keys): the comparison must fail.
- ``sp4_tree_pairs``: a prefix-tree row with its target pairs (:class:`packing_hf.PrefixTreeCollator`, per-turn
  samples, ``"sample"``) at sp=4, each rank computing the pairs of its shard
  (:func:`packing_hf.shard_loss.shard_tree_pairs`), against the same samples flat on one process: a branch row
  ends shard 0 and its children start on ranks 1 and 2. ``sp4_tree_pairs_not_reindexed``, its negative control:
  the pairs read at the whole row's indices (:func:`not_reindexed`): the comparison must fail.
- ``packing_hf.Trainer`` (``"token"``, then ``evaluate()``), ``packing_hf.SFTTrainer`` (``"sample"``),
  ``packing_hf.DPOTrainer`` (a live reference model then ``evaluate()``; precomputed reference log-probs) and
  ``packing_hf.Trainer`` on a stream (two steps, resumed from the checkpoint after the first),
  ``packing_hf.Trainer(share_prefixes=True)`` (``"tree"``: one prefix-tree row, a branch row ending shard 0; on
  one process also the same samples flat, ``"tree_flat"``) with
  ``parallelism_config=ParallelismConfig(sp_size=2)`` on 2 processes, against the same trainer on one process
  (:func:`build_trainer`); DPO with the per-token log-probs not summed over the group (the negative control,
  :func:`sum_alone`).

Importing this module does nothing (pytest collects it for doctests).
"""

from __future__ import annotations

import os
import sys

VOCAB = 64
TOKENIZER = os.path.join(os.environ.get("PACKING_HF_DATA", "/work/shared/data"), "smollm2_tokenizer")
CASES = ("sp4_sample", "dp2_sp2_token", "sp4_sliding", "sp4_short_row", "sp4_local_only", "sp4_tree")


def make_model(kind: str, vocab: int = VOCAB, seed: int = 0):
    """The tiny model of a case (fp32, no dropout, seeded), on packing_hf's varlen attention."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from packing_hf import register_attention

    extra = {"sliding_window": 4} if kind == "mistral" else {}
    config = AutoConfig.for_model(
        kind,
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        **extra,
    )
    torch.manual_seed(seed)
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


def make_tree_row(seed: int) -> dict:
    """A prefix-tree packed row: multi-turn conversations sharing a system prompt and earlier turns (depth 3),
    with a duplicate, a strict prefix and an unrelated sample; labels on every token but segment starts (the
    targets a row's shifted labels can hold: each predicted inside its own segment)."""
    import torch

    from packing_hf.prefix_tree import build_prefix_tree

    generator = torch.Generator().manual_seed(seed)

    def tokens(n: int) -> list[int]:
        return torch.randint(1, VOCAB, (n,), generator=generator).tolist()

    system, user, answer_a, answer_b, user_2, answer_2a, answer_2b = (
        tokens(n) for n in (6, 4, 5, 3, 4, 3, 5)
    )
    turn_2 = system + user + answer_a + user_2
    samples = [turn_2 + answer_2a, system + user + answer_b, turn_2 + answer_2b, turn_2 + answer_2a]
    samples += [system + user + answer_a, tokens(5)]
    tree = build_prefix_tree(samples)
    row = tree.model_inputs()
    labels = row["input_ids"].clone()
    labels[0, tree.cu_seqlens[:-1].long()] = -100
    return {**row, "labels": labels}


def sibling_leak(shard: dict) -> dict:
    """Negative control: the last branch with an earlier sibling reads that sibling as its parent."""
    import torch

    parents = shard["prefix_seq_idx"].tolist()
    leaking = max(i for i, p in enumerate(parents) if p >= 0 and parents[:i].count(p) > 0)
    parents[leaking] = max(j for j in range(leaking) if parents[j] == parents[leaking])
    return {**shard, "prefix_seq_idx": torch.tensor(parents, dtype=torch.int32)}


def make_tree_samples(lengths: tuple[int, ...], seed: int) -> list[dict]:
    """Samples sharing prefixes, as per-turn SFT data: ``S + A + A1``, ``S + B``, ``S + A + A2`` (``lengths`` of
    ``S, A, A1, A2, B``, then unrelated samples), their first 0-2 tokens masked as a prompt. As a prefix-tree row
    the last token of ``S`` predicts the first tokens of ``A`` and ``B``, the last of ``A`` those of ``A1`` and
    ``A2`` (branch rows, each with two target pairs)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    system, turn, first, second, other, *unrelated = (
        torch.randint(1, VOCAB, (n,), generator=generator).tolist() for n in lengths
    )
    token_lists = [system + turn + first, system + other, system + turn + second, *unrelated]
    return [{"input_ids": ids, "labels": [-100] * (i % 3) + ids[i % 3 :]} for i, ids in enumerate(token_lists)]


def not_reindexed(pairs: dict, shard) -> dict:
    """Negative control for :func:`packing_hf.shard_loss.shard_tree_pairs`: the row's pairs read in the shard with
    the whole row's indices (not re-indexed to it; those past the shard's tokens dropped)."""
    mine = pairs["tree_rows"] < shard.length
    return {key: value[mine] if key != "tree_samples" else value for key, value in pairs.items()}


def tree_parallel_step(model, row: dict, normalization: str, group, pick=None):
    """Loss and gradients of a prefix-tree row (:class:`packing_hf.PrefixTreeCollator`) cut over ``group``: each
    rank computes the target pairs of its shard (``pick``: :func:`packing_hf.shard_loss.shard_tree_pairs`, or a
    negative control's), over the row's denominator counted once; summed over the ranks."""
    import torch
    import torch.distributed as dist

    from packing_hf._loss import TREE_KEYS, step_denominator, tree_loss_counts, tree_numerator
    from packing_hf.attention.sequence_parallel import shard_packed_batch
    from packing_hf.shard_loss import shard_tree_pairs
    from packing_hf.varlen import SHARD_KEY

    pick = shard_tree_pairs if pick is None else pick
    model.zero_grad(set_to_none=True)
    pairs = {key: row[key] for key in TREE_KEYS}
    shard = shard_packed_batch({k: v for k, v in row.items() if k not in TREE_KEYS}, group)
    counts = torch.tensor(tree_loss_counts(pairs), dtype=torch.float64)
    if shard[SHARD_KEY].rank != 0:
        counts.zero_()
    dist.all_reduce(counts, group=group)  # the row counted once (by the first rank of its group)
    denominator = step_denominator(counts.tolist(), normalization)
    logits = model(**shard).logits  # (1, T_rank, V)
    loss = tree_numerator(logits, pick(pairs, shard[SHARD_KEY]), normalization) / denominator
    loss.backward()
    assert shard[SHARD_KEY].calls > 0, "the model never ran the sequence-parallel attention"
    total = loss.detach().double()
    dist.all_reduce(total, group=group)
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad.detach().clone()
        dist.all_reduce(grad, group=group)
        grads[name] = grad
    return total, grads


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


def parallel_step(model, rows: list[dict], normalization: str, group, local_only: bool = False, tamper=None):
    """Loss and gradients with this rank's rows cut over its SP group, summed over every rank (``tamper``: a
    negative control's change to every shard)."""
    import torch
    import torch.distributed as dist

    from packing_hf._loss import step_denominator
    from packing_hf.attention.sequence_parallel import shard_packed_batch
    from packing_hf.shard_loss import sequence_parallel_loss, shard_loss_counts

    model.zero_grad(set_to_none=True)
    shards = [shard_packed_batch(row, group, local_only=local_only) for row in rows]
    shards = [tamper(shard) for shard in shards] if tamper is not None else shards
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

    from packing_hf import PaddingFreeCollator, PrefixTreeCollator
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
    row = make_row([3], seed=5, weighted=False)  # 3 tokens over 4 ranks: lengthened with target-free tokens
    reference = reference_step(llama, [row], "token") if rank == 0 else None
    results["sp4_short_row"] = (reference, parallel_step(llama, [row], "token", everyone))
    row = make_tree_row(seed=7)  # 35 tokens in 7 segments, depth 3: shards [0, 9) [9, 18) [18, 27) [27, 35)
    reference = reference_step(llama, [row], "token") if rank == 0 else None
    results["sp4_tree"] = (reference, parallel_step(llama, [row], "token", everyone))
    leak = parallel_step(llama, [row], "token", everyone, tamper=sibling_leak)
    results["sp4_tree_sibling_leak"] = (reference, leak)
    # a tree row's target pairs (PrefixTreeCollator) against the same samples flat on one process: 36 tokens,
    # shards [0, 9) [9, 18) [18, 27) [27, 36); the branch row 8 ends shard 0 and predicts its children's first
    # tokens at 9 (rank 1) and 21 (rank 2); the branch row 13 (rank 1) those at 14 (rank 1) and 18 (rank 2)
    samples = make_tree_samples((9, 5, 4, 3, 6, 9), seed=11)
    reference = reference_step(llama, [PaddingFreeCollator()(samples)], "sample") if rank == 0 else None
    tree_row = PrefixTreeCollator()(samples)
    results["sp4_tree_pairs"] = (reference, tree_parallel_step(llama, tree_row, "sample", everyone))
    unshifted = tree_parallel_step(llama, tree_row, "sample", everyone, pick=not_reindexed)
    results["sp4_tree_pairs_not_reindexed"] = (reference, unshifted)

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


DPO_TOKENS = 600  # a packed row of 2-3 GSM8K pairs
TRAINER_KINDS = ("trainer", "sft", "dpo", "dpo_precompute", "stream", "tree")


def make_pairs(count: int, offset: int):
    """``count`` GSM8K preference pairs from row ``offset`` on: the reference answer vs. its lines reversed (the
    completions differ from their first token, so chosen - rejected is no cancellation of near-equal sums)."""
    import json

    import datasets

    rows = []
    with open(os.path.join(os.path.dirname(TOKENIZER), "gsm8k_train.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            if len(row["question"]) < 160 and len(row["answer"]) < 250:
                rows.append(row)
            if len(rows) == offset + count:
                break
    rows = rows[offset:]
    return datasets.Dataset.from_dict(
        {
            "prompt": [f"Question: {r['question']}\nAnswer:" for r in rows],
            "chosen": [" " + r["answer"] for r in rows],
            "rejected": [" " + "\n".join(reversed(r["answer"].split("\n"))) for r in rows],
        }
    )


def saved_pairs(folder: str):
    """:func:`make_pairs` saved once to ``folder`` and read back on every process: TRL caches the precomputed
    reference log-probs next to the dataset's files, which must be a folder every process reads."""
    import datasets
    from accelerate import PartialState

    state = PartialState(cpu=True)
    path = os.path.join(folder, "pairs")
    with state.main_process_first():
        if state.is_main_process:
            make_pairs(4, 0).save_to_disk(path)
    return datasets.load_from_disk(path)


def make_samples() -> list[dict]:
    """Eight tokenized samples (a prompt of 0-2 tokens masked)."""
    import torch

    generator = torch.Generator().manual_seed(7)
    data = []
    for i, length in enumerate([13, 21, 6, 9, 17, 4, 11, 8]):
        ids = torch.randint(1, VOCAB, (length,), generator=generator).tolist()
        data.append({"input_ids": ids, "labels": [-100] * (i % 3) + ids[i % 3 :]})
    return data


def build_trainer(out_dir: str, sp_size: int, kind: str, capture: dict, **overrides):
    """The trainer of a case: ``packing_hf.Trainer`` (``"trainer"``, ``"token"``, with an eval set),
    ``SFTTrainer`` (``"sft"``, ``"sample"``), ``DPOTrainer`` (``"dpo"``, a live reference model, an eval set;
    ``"dpo_precompute"``, reference log-probs precomputed) or ``Trainer`` on a stream (``"stream"``); ``capture`` receives the last step's loss, the gradients the optimizer
    sees (DDP's average) of the first step and every training batch's ``input_ids``."""
    import datasets
    from accelerate import ParallelismConfig
    from transformers import AutoTokenizer, TrainerCallback

    from packing_hf import (
        DPOConfig,
        DPOTrainer,
        PaddingFreeCollator,
        SFTConfig,
        SFTTrainer,
        Trainer,
        TrainingArguments,
    )
    from packing_hf.streaming import read_stream

    class Capture(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            if "grads" not in capture:  # the first step's (later steps also carry the optimizer's rounding)
                capture["grads"] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}

    base = {"sft": SFTTrainer, "dpo": DPOTrainer, "dpo_precompute": DPOTrainer}.get(kind, Trainer)

    class Recording(base):
        def evaluate(self, *args, **kwargs):  # counts the attention calls run on sequence-parallel shards
            from packing_hf.attention.ulysses import SequenceShard

            original = SequenceShard.attention

            def counted(shard, *call, **options):
                capture["eval_shard_calls"] = capture.get("eval_shard_calls", 0) + 1
                return original(shard, *call, **options)

            SequenceShard.attention = counted
            try:
                return super().evaluate(*args, **kwargs)
            finally:
                SequenceShard.attention = original

        def _shard_row(self, *args, **kwargs):  # the tokens of this rank's shard (the row was cut)
            shard = super()._shard_row(*args, **kwargs)
            capture["shard_tokens"] = int(shard["input_ids"].shape[1])
            return shard

        def _tree_loss(self, model, inputs, return_outputs, num_items_in_batch, head):
            capture["tree_chunked"] = head is not None  # whether the chunked LM head served the tree's pairs
            return super()._tree_loss(model, inputs, return_outputs, num_items_in_batch, head)

        def _sequence_parallel_loss(self, *args, **kwargs):  # whether the chunked LM head served the shard
            capture["sp_chunked"] = (args[5] if len(args) > 5 else kwargs.get("head")) is not None
            return super()._sequence_parallel_loss(*args, **kwargs)

        def training_step(self, model, inputs, *args, **kwargs):
            ids = inputs.get("packed_input_ids", inputs.get("input_ids"))
            capture.setdefault("batches", []).append(ids.tolist())
            loss = super().training_step(model, inputs, *args, **kwargs)
            capture.setdefault("loss", loss.detach().clone())
            return loss

    options = dict(
        max_tokens_per_batch=48, max_steps=1, learning_rate=1e-3, max_grad_norm=0.0, report_to="none",
        save_strategy="no", use_cpu=True, disable_tqdm=True, packing_preflight="off", seed=3, logging_steps=1,
        parallelism_config=ParallelismConfig(sp_size=sp_size) if sp_size > 1 else None,
    )  # fmt: skip
    options.update(overrides)
    folder = f"{out_dir}/{kind}-sp{sp_size}"
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    data = make_samples()
    extra = {"data_collator": PaddingFreeCollator(), "train_dataset": data}
    model = make_model("llama")
    if kind == "trainer":
        args = TrainingArguments(folder, loss_normalization="token", **options)
        extra["eval_dataset"] = data[::-1]
    elif kind == "stream":  # a stream packed online, two steps, a checkpoint after the first
        args = TrainingArguments(folder, loss_normalization="token", **options)
        extra["train_dataset"] = read_stream(data)
    elif kind in ("tree", "tree_flat"):  # share_prefixes: one prefix-tree row (20 tokens); or the samples flat
        # shards [0, 10) [10, 20): the branch row 9 ends shard 0, its children start at 10 and 18 (rank 1)
        options.update(max_tokens_per_batch=64)  # every sample in one micro-batch, flat (43 tokens) or as a tree
        args = TrainingArguments(folder, loss_normalization="sample", share_prefixes=kind == "tree", **options)
        extra = {"train_dataset": make_tree_samples((10, 3, 3, 2, 2), seed=11)}
        if kind == "tree_flat":
            extra["data_collator"] = PaddingFreeCollator()
    elif kind == "sft":  # TRL's SFT in fp32 (its default on CPU is bf16 autocast), data already tokenized
        args = SFTConfig(
            folder, loss_normalization="sample", padding_free=True, max_length=None, bf16=False, **options
        )
        extra.update(processing_class=tokenizer, train_dataset=datasets.Dataset.from_list(data))
    else:  # DPO: pairs tokenized by TRL, the 49k-token SmolLM2 vocabulary, a reference model
        options.update(max_tokens_per_batch=DPO_TOKENS)
        precompute = kind == "dpo_precompute"
        # shared_prompt off on one process too (it is off under SP): the same rows on both sides
        args = DPOConfig(
            folder, precompute_ref_log_probs=precompute, shared_prompt=False, bf16=False, **options
        )
        model = make_model("llama", vocab=len(tokenizer))
        extra = dict(
            ref_model=make_model("llama", vocab=len(tokenizer), seed=1),  # not the policy: a loss of its own
            processing_class=tokenizer,
            train_dataset=saved_pairs(folder) if precompute else make_pairs(4, 0),
        )
        if not precompute:
            extra["eval_dataset"] = make_pairs(3, 4)
    return Recording(model=model, args=args, callbacks=[Capture()], **extra)


def trainer_step(out_dir: str, sp_size: int, kind: str) -> dict:
    """One case (:func:`build_trainer`) with ``sp_size`` processes in one SP group or (``1``) on one process:
    ``step``: the first step's loss (summed over ranks) and gradients; ``eval``: the eval loss (``trainer``,
    ``dpo``); ``batches`` / ``resumed``: the training batches of a 2-step run with a checkpoint after step 1, and
    those of a run resumed from that checkpoint (``stream``), gathered over the ranks."""
    import torch.distributed as dist

    capture: dict = {}
    result = {}
    if kind == "stream":
        options = dict(max_steps=2, save_strategy="steps", save_steps=1, save_only_model=False)
        build_trainer(out_dir, sp_size, kind, capture, **options).train()
        again: dict = {}
        checkpoint = f"{out_dir}/{kind}-sp{sp_size}/checkpoint-1"
        build_trainer(out_dir, sp_size, kind, again, **options).train(resume_from_checkpoint=checkpoint)
        result["resumed"] = again["batches"]
    else:
        trainer = build_trainer(out_dir, sp_size, kind, capture)
        trainer.train()
        # the packing metrics of the step (counted once per data-parallel replica, not once per SP rank)
        logged = [e for e in trainer.state.log_history if "loss" in e]
        result["metrics"] = {k: logged[0].get(k) for k in ("real_tokens_per_step", "model_flops_per_step")}
        result["mfu_devices"] = trainer._packing_metrics.devices  # what the MFU divides the FLOP/s by
        if kind in ("trainer", "dpo"):
            result["eval"] = trainer.evaluate()["eval_loss"]
            result["eval_shard_calls"] = capture.get("eval_shard_calls", 0)
        if kind == "tree":  # an evaluation call on the tree row: its own loss, the group's shares summed
            import torch

            batch = trainer.data_collator(make_tree_samples((10, 3, 3, 2, 2), seed=11))
            capture.pop("shard_tokens", None)
            trainer.model.eval()
            with torch.no_grad():
                result["tree_eval"] = float(trainer.compute_loss(trainer.model, batch))
            result["tree_eval_cut"] = capture.get("shard_tokens")
    result["batches"] = capture["batches"]
    result["sp_chunked"] = capture.get("sp_chunked")
    result["tree_chunked"] = capture.get("tree_chunked")
    result["shard_tokens"] = capture.get("shard_tokens")
    loss = capture["loss"].double()
    if sp_size > 1:
        dist.all_reduce(loss)
        loss /= dist.get_world_size()  # each rank's loss is scaled by the world size (DDP averages)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, {k: result[k] for k in ("batches", "resumed") if k in result})
        result["ranks"] = everyone
    result["step"] = (loss, capture["grads"])
    return result


def sum_alone(values, shard):
    """Negative control for DPO: this rank's per-token values in the row, the other ranks' left at zero (the
    per-sample sums are not reduced over the group)."""
    import torch

    rest = tuple(values.shape[2:])
    before = values.new_zeros((1, shard.offset, *rest))
    after = values.new_zeros((1, sum(shard.lengths) - shard.offset - shard.length, *rest))
    return torch.cat([before, values, after], dim=1)


def run_trainer(rank: int, out_dir: str, port: str, world: int) -> None:
    import torch

    import packing_hf.integrations.adapters as adapters

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world)
    )
    torch.set_num_threads(1)
    results = {kind: trainer_step(out_dir, world, kind) for kind in TRAINER_KINDS}
    adapters.gather_shard_tokens = sum_alone
    results["dpo_alone"] = trainer_step(f"{out_dir}/alone", world, "dpo")
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
    import packing_hf.integrations.dpo  # noqa: F401  (TRL too)
    import packing_hf.integrations.sft  # noqa: F401
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
    reference = {kind: trainer_step(out_dir, 1, kind) for kind in (*TRAINER_KINDS, "tree_flat")}
    torch.save(reference, os.path.join(out_dir, "sp_trainer_reference.pt"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
