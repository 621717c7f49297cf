"""DeepSpeed ZeRO-2 / ZeRO-3 through packing_hf's trainers next to gloo DDP, on the same 2 CPU processes
(``DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 _deepspeed_worker.py OUT_DIR``), and the SP cases on 4
(``torchrun --nproc_per_node 4 _deepspeed_worker.py OUT_DIR --world 4``: ``sp2_ddp`` and ``sp2_zero3`` only, at
dp 2 x sp 2); both launched by ``test_deepspeed_multiprocess.py``.

Every case trains a tiny Llama on packing_hf's attention with ``max_tokens_per_batch`` for one epoch of SGD steps
with momentum (``use_cpu=True``: gloo; DeepSpeed's engine when a config is given) and writes, per rank, the loss and
number of every step, the dataset indices each step of each rank trained on (counted in ``training_step``) and, on
rank 0, every parameter after the epoch (gathered whole under ZeRO-3):

- ``ddp``, ``zero2``, ``zero3``: ``packing_hf.Trainer``; under ZeRO-3 the model is built after the arguments, so
  transformers partitions it at construction (``deepspeed.zero.Init``) and the pre-flight check runs next to
  partitioned parameters; ``check_packing`` of the partitioned model is recorded too. ``zero2`` and ``zero3``
  save a checkpoint after ``SAVE_STEPS`` steps, in the middle of the epoch.
- ``resumed_zero2``, ``resumed_zero3``: a new ``packing_hf.Trainer`` (its model from other weights) resumed from
  that checkpoint (``train(resume_from_checkpoint=...)``): the rest of the epoch; ``resumed_unskipped_zero2`` (the
  negative control) resumes with ``ignore_data_skip=True``, so trains the epoch's first batches again;
  ``resumed_lost_momentum_zero2`` and ``_zero3`` (negative controls) resume from a copy of the checkpoint whose
  momentum buffers rank 0 zeroed in every rank's optimizer partition (the weights and the data order come back, the
  optimizer state does not), and record how many it zeroed.
- ``sft_ddp``, ``sft_zero2``, ``sft_zero3``: ``packing_hf.SFTTrainer`` on the same tokenized rows.
- ``sp2_ddp``, ``sp2_zero3``: ``packing_hf.Trainer`` with ``ParallelismConfig(sp_size=2)``: every packed row cut
  over the 2 processes of its SP group, next to DDP, then inside ZeRO-3 (parameters partitioned over every
  process); at 2 processes one replica (dp 1 x sp 2), at 4 two (dp 2 x sp 2).
- ``dpo_ddp``, ``dpo_zero3``: ``packing_hf.DPOTrainer`` with a live reference model (other weights than the policy),
  GSM8K pairs tokenized by TRL (the SmolLM2 vocabulary); under ZeRO-3 TRL prepares the reference model as a
  DeepSpeed engine too. Losses only (the policy's parameters are compared in the Trainer cases).
- ``kto_*``, ``reward_*`` (``ddp``, ``zero2``, ``zero3``): ``packing_hf.KTOTrainer`` with a live reference model
  (under ZeRO-3 a ZeRO-3 engine too) and ``packing_hf.RewardTrainer`` (a sequence classifier), on GSM8K rows
  tokenized by TRL, multipack batches (``max_tokens_per_batch``), one epoch; the dataset indices of every step of
  every rank (by the token ids the recording collator puts in the batch), every metric logged at every step.
- ``grpo_*``, ``rloo_*`` (``ddp``, ``zero2``, ``zero3``): ``packing_hf.GRPOTrainer`` / ``RLOOTrainer`` (packed
  rollouts; KL to TRL's reference model, a ZeRO-3 engine under ZeRO-3), 2 optimizer steps on one generation of
  ``_rl_worker.py``'s deterministic completions and reward; every logged metric and the packed forwards per rank.
  These and the KTO / reward cases save rank 0's parameters after training as ``OUT_DIR/CASE.parameters.pt`` (the
  SmolLM2 vocabulary's embeddings: too big for the JSON) and record how far training moved them.
- ``tree_flat_ddp``, ``tree_ddp``, ``tree_zero2``, ``tree_zero3`` (:func:`tree_run`): ``share_prefixes=True`` on
  ``packing_hf.Trainer``, one optimizer step over the whole epoch of ``_tree_data.py``'s per-turn samples
  (assistant-only masks, prefix-tree rows planned by the sampler), under DDP, ZeRO-2 and ZeRO-3 (its parameters
  partitioned, the LM head too), and the same step flat under DDP (``tree_flat_ddp``, share_prefixes off);
  ``tree_local_zero3`` (negative control): ZeRO-3 whose loss policy counts one process, so that each rank divides
  its tree loss by its own pairs' count (what a world of 1, as DeepSpeed's CPU accelerator reports it, would do).
- ``local_mean_zero3`` (negative control): ZeRO-3 with every rank's loss normalised by its own token count
  (``average_tokens_across_devices=False``, what a miscounted world does to the loss): not DDP's training.
- ``zero3_partitioned_head``, ``zero3_partitioned_head_full``, ``zero3_partitioned_head_outside`` (last): the
  chunked LM head under ZeRO-3 with the head's weight partitioned, the full logits, and the negative control
  (:func:`zero3_chunked_head_cases`).
- ``refused_without_cpu`` (first): DeepSpeed ZeRO-2 and ZeRO-3 without ``use_cpu=True`` on CPU, where accelerate
  counts one process of two, and no engine in the group DeepSpeed started: the error messages.
- ``ddp``, ``zero3``, ``sp2_ddp``, ``sp2_zero3`` evaluate :data:`EVAL_SAMPLES` held-out samples before training
  (``eval_before``: the loss, and how many forwards were timed as training forwards); the SP cases again with the
  group's shares not summed (``eval_before_unsummed``, the negative control).

Importing this module does nothing (pytest collects it for doctests).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass

NUM_SAMPLES = 40
VOCAB = 128
MAX_TOKENS_PER_BATCH = 128
SEED = 0
TOKENIZER = os.path.join(os.environ.get("PACKING_HF_DATA", "/work/shared/data"), "smollm2_tokenizer")
DPO_TOKENS = 600  # a packed row of 2-3 GSM8K pairs
# the KTO and reward cases: GSM8K rows, their multipack budget (3 and 5 steps an epoch); KTO's sequences cut to
# KTO_MAX_LENGTH tokens (its 4 forwards a step run the SmolLM2 vocabulary's head: the cost of these cases)
REWARD_ROWS, REWARD_TOKENS = 12, 400
KTO_ROWS, KTO_TOKENS, KTO_MAX_LENGTH = 12, 256, 64
RL_PROMPTS = 8  # GRPO / RLOO: one generation of 8 prompts x 2 completions over both ranks
RL_TOKENS = 160  # tokens per packed rollout forward: 2 forwards a micro-batch
# the KTO and reward cases' learning rate, and GRPO's and RLOO's: at the Trainer cases' 0.5 the momentum drives their
# models far (reward margins of 30, weights of 14 after 5 steps), where fp32 rounding grows with every step; RLOO's
# first gradient is 40x GRPO's (norms 19 and 0.44), and its second step at 0.05 clipped the ratio of every token (a
# zero gradient): each moves its weights by 2e-3 to 6e-3 in its 2 steps
TRL_LEARNING_RATE = 0.05
RL_LEARNING_RATES = {"grpo": 0.02, "rloo": 0.001}
MOMENTUM = 0.9  # every case's SGD keeps a momentum buffer: the optimizer state a resume must restore
# DDP first: accelerate's state is one per process, and keeps DeepSpeed's plugin once a DeepSpeed case ran
CASES = (
    "ddp", "sft_ddp", "sp2_ddp", "dpo_ddp", "kto_ddp", "reward_ddp", "grpo_ddp", "rloo_ddp",
    "tree_flat_ddp", "tree_ddp",
    "zero2", "resumed_zero2", "resumed_unskipped_zero2", "resumed_lost_momentum_zero2", "sft_zero2",
    "kto_zero2", "reward_zero2", "grpo_zero2", "rloo_zero2", "tree_zero2",
    "zero3", "resumed_zero3", "resumed_lost_momentum_zero3", "sft_zero3", "sp2_zero3", "dpo_zero3",
    "kto_zero3", "reward_zero3", "grpo_zero3", "rloo_zero3", "tree_zero3", "tree_local_zero3", "local_mean_zero3",
)  # fmt: skip
CASES_4 = ("sp2_ddp", "sp2_zero3")  # --world 4: dp 2 x sp 2
# the cases that evaluate EVAL_SAMPLES held-out samples before training (under DeepSpeed: the engine evaluate() makes,
# which training then uses)
EVALUATED_BEFORE_TRAINING = ("ddp", "zero3", "sp2_ddp", "sp2_zero3")
EVAL_SAMPLES = 12
SAVE_STEPS = 2  # the ZeRO cases save a checkpoint after this many of the epoch's steps: its middle
IDS_KEY = "packing_hf_test_sample_ids"
# the share_prefixes cases: 2 prefix-tree micro-batches per rank of this budget make the epoch; one step takes them all
TREE_TOKENS, TREE_ACCUMULATION = 48, 4


def make_samples(count: int = NUM_SAMPLES, seed: int = 1234) -> list[dict]:
    """Deterministic samples of 8..43 tokens, ids in [1, VOCAB), each with its index (the training samples; the
    eval samples, of another ``seed``, without)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    samples = [
        {"input_ids": torch.randint(1, VOCAB, (8 + (i * 13) % 36,), generator=generator).tolist(), "idx": i}
        for i in range(count)
    ]
    return samples if seed == 1234 else [{"input_ids": sample["input_ids"]} for sample in samples]


def make_model(vocab: int = VOCAB, seed: int = SEED, pad_token_id: int | None = None):
    """A tiny Llama on packing_hf's attention: a causal LM, or with ``pad_token_id`` a sequence classifier with one
    score (the reward model)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    import packing_hf

    config = AutoConfig.for_model(
        "llama",
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_labels=1,
        pad_token_id=pad_token_id,
    )
    torch.manual_seed(seed)
    auto = AutoModelForCausalLM if pad_token_id is None else AutoModelForSequenceClassification
    return auto.from_config(config, attn_implementation=packing_hf.register_attention()).float()


def gsm8k_rows(count: int) -> list[dict]:
    """The first ``count`` short GSM8K training rows."""
    rows = []
    with open(os.path.join(os.path.dirname(TOKENIZER), "gsm8k_train.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            if len(row["question"]) < 160 and len(row["answer"]) < 250:
                rows.append(row)
            if len(rows) == count:
                break
    return rows


def _reversed(answer: str) -> str:
    return "\n".join(reversed(answer.split("\n")))


def make_pairs(count: int):
    """``count`` GSM8K preference pairs: the reference answer vs. its lines reversed."""
    import datasets

    rows = gsm8k_rows(count)
    return datasets.Dataset.from_dict(
        {
            "prompt": [f"Question: {r['question']}\nAnswer:" for r in rows],
            "chosen": [" " + r["answer"] for r in rows],
            "rejected": [" " + _reversed(r["answer"]) for r in rows],
        }
    )


def make_unpaired(count: int):
    """``count`` GSM8K KTO examples: every third completion reversed and undesirable, the others desirable."""
    import datasets

    rows = gsm8k_rows(count)
    return datasets.Dataset.from_dict(
        {
            "prompt": [f"Question: {r['question']}\nAnswer:" for r in rows],
            "completion": [
                " " + (r["answer"] if i % 3 else _reversed(r["answer"])) for i, r in enumerate(rows)
            ],
            "label": [bool(i % 3) for i in range(len(rows))],
        }
    )


def counting(base):
    """``base`` (a trainer class) counting the samples of every training step: the batch's ``IDS_KEY`` entry (put
    there by the recording collator), taken out before the trainer sees the batch."""

    class Counting(base):
        seen: list  # per training step, what identifies its samples

        def training_step(self, model, inputs, *args, **kwargs):
            ids = inputs.pop(IDS_KEY)
            self.seen.append(ids.tolist() if hasattr(ids, "tolist") else list(ids))
            return super().training_step(model, inputs, *args, **kwargs)

    return Counting


def recording(collator_class, key: str):
    """``collator_class`` (a packing preference collator) putting the token ids ``key`` of every example in the
    batch, which identify it in the trainer's tokenized dataset."""

    class Recording(collator_class):
        def __call__(self, features, return_tensors=None):
            batch = super().__call__(features, return_tensors)
            batch[IDS_KEY] = [tuple(f[key]) for f in features]
            return batch

    return Recording


def logged_steps(trainer) -> list[dict]:
    """The numeric metrics the trainer logged at every training step (no timings, no learning rate)."""
    skipped = ("learning_rate", "epoch", "total_flos", "train_runtime")

    def measured(key: str, value) -> bool:
        return isinstance(value, float) and key not in skipped and "second" not in key and "time" not in key

    return [{k: v for k, v in h.items() if measured(k, v)} for h in trainer.state.log_history if "loss" in h]


def save_parameters(trainer, out_dir: str, case: str, start: dict) -> float:
    """The model's parameters after training (gathered whole under ZeRO-3; collective), saved by rank 0 as
    ``OUT_DIR/CASE.parameters.pt`` (the SmolLM2 vocabulary's embeddings are too big for the JSON); how far the
    training moved them from ``start`` (the largest change of one weight)."""
    import torch

    parameters = whole_parameters(trainer.accelerator.unwrap_model(trainer.model_wrapped), as_lists=False)
    if torch.distributed.get_rank() == 0:
        torch.save(parameters, os.path.join(out_dir, f"{case}.parameters.pt"))
    return max(float((p - start[name]).abs().max()) for name, p in parameters.items())


def dpo_losses(out_dir: str, case: str, common: dict, starts: dict) -> dict:
    """DPO with a live reference model; ``common``: the case's training arguments, ``starts``: the policy's and
    the reference's weights (built whole, before any ZeRO-3 arguments)."""
    from transformers import AutoTokenizer

    import packing_hf

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    options = {**common, "max_tokens_per_batch": DPO_TOKENS}
    args = packing_hf.DPOConfig(os.path.join(out_dir, case), bf16=False, shared_prompt=False, **options)
    policy, reference = make_model(len(tokenizer)), make_model(len(tokenizer), seed=1)
    if any(hasattr(p, "ds_id") for p in policy.parameters()):  # zero.Init initialised its own weights
        load_whole(policy, starts["policy"])
        load_whole(reference, starts["reference"])
    trainer = packing_hf.DPOTrainer(
        model=policy, ref_model=reference, args=args, processing_class=tokenizer, train_dataset=make_pairs(6)
    )
    trainer.train()
    return {
        "plan": trainer.parallel_plan.describe(),
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
    }


def preference_run(out_dir: str, case: str, common: dict, starts: dict) -> dict:
    """``kto_*``: KTO with a live reference model (other weights than the policy; under ZeRO-3 TRL prepares it as a
    ZeRO-3 engine); ``reward_*``: a reward model. Both on GSM8K rows tokenized by TRL, multipack batches; the samples
    of every step and rank, the logged metrics, the parameters after the epoch (``OUT_DIR/CASE.parameters.pt``).
    ``starts``: the models' weights built whole, before any ZeRO-3 arguments."""
    from transformers import AutoTokenizer

    import packing_hf

    kto = case.startswith("kto_")
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    options = {**common, "learning_rate": TRL_LEARNING_RATE, "bf16": False}
    vocab = len(tokenizer)
    if kto:
        from packing_hf.unpaired import PaddingFreeUnpairedCollator

        options.update(max_tokens_per_batch=KTO_TOKENS, max_length=KTO_MAX_LENGTH)
        args = packing_hf.KTOConfig(os.path.join(out_dir, case), **options)
        models = {"model": make_model(vocab), "ref_model": make_model(vocab, seed=1)}
        collator = recording(PaddingFreeUnpairedCollator, "prompt_ids")(
            max_length=KTO_MAX_LENGTH, overflow="truncate", pad_token_id=tokenizer.pad_token_id
        )
        trainer_class, dataset, key = packing_hf.KTOTrainer, make_unpaired(KTO_ROWS), "prompt_ids"
    else:
        options.update(max_tokens_per_batch=REWARD_TOKENS)
        args = packing_hf.RewardConfig(os.path.join(out_dir, case), **options)
        models = {"model": make_model(vocab, pad_token_id=tokenizer.pad_token_id)}
        collator = recording(packing_hf.PaddingFreeRewardCollator, "chosen_ids")(
            pad_token_id=tokenizer.pad_token_id
        )
        trainer_class, dataset, key = packing_hf.RewardTrainer, make_pairs(REWARD_ROWS), "chosen_ids"
    if any(hasattr(p, "ds_id") for p in models["model"].parameters()):  # zero.Init made its own weights
        for name, model in models.items():
            load_whole(model, starts[f"{case.split('_')[0]}_{name}"])
    trainer = counting(trainer_class)(
        **models, args=args, processing_class=tokenizer, train_dataset=dataset, data_collator=collator
    )
    trainer.seen = []
    trainer.train()
    index = {tuple(row[key]): i for i, row in enumerate(trainer.train_dataset)}
    return {
        "plan": trainer.parallel_plan.describe(),
        "moved": save_parameters(trainer, out_dir, case, starts[f"{case.split('_')[0]}_model"]),
        "logged": logged_steps(trainer),
        "seen_by_step": [[index[ids] for ids in step] for step in trainer.seen],
        "examples": len(trainer.train_dataset),
    }


def rl_run(out_dir: str, case: str, common: dict, start) -> dict:
    """``grpo_*`` / ``rloo_*``: 2 optimizer steps of 2 micro-batches on one generation (2 iterations on it, KL to
    TRL's reference model, which it loads from the policy's folder and, under ZeRO-3, prepares as a ZeRO-3 engine)
    with deterministic completions in place of generation (``_rl_worker.py``'s): the logged metrics, the number of
    packed forwards, the parameters after the 2 steps (``OUT_DIR/CASE.parameters.pt``). ``start``: the policy, built
    whole before any ZeRO-3 arguments, saved to the folder the runs load it from."""
    import datasets
    import torch
    from _rl_worker import completion, reward  # the GRPO worker's completions and reward
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import packing_hf

    grpo = case.startswith("grpo_")
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    config_class, trainer_class = (
        (packing_hf.GRPOConfig, packing_hf.GRPOTrainer)
        if grpo
        else (packing_hf.RLOOConfig, packing_hf.RLOOTrainer)
    )
    rollouts = dict(
        learning_rate=RL_LEARNING_RATES[case.split("_")[0]],
        max_tokens_per_batch=RL_TOKENS,
        num_generations=2,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_iterations=2,
        max_completion_length=20,
        max_steps=2,
        beta=0.04,
        bf16=False,
    )
    args = config_class(os.path.join(out_dir, case), **{**common, **rollouts})  # joins the process group
    folder = os.path.join(out_dir, "rl_model")
    if torch.distributed.get_rank() == 0 and not os.path.isdir(folder):
        start.save_pretrained(folder)
    torch.distributed.barrier()
    # from the folder: under ZeRO-3 transformers loads the weights into the partitioned parameters
    model = AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation=packing_hf.register_attention(), dtype=torch.float32
    )
    prompts = [f"Q: {r['question'].split('. ')[0]}\nA:" for r in gsm8k_rows(RL_PROMPTS)]
    trainer = trainer_class(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
    )
    eos = tokenizer.eos_token_id

    def generate(prompt_ids, *args, **kwargs):
        completions = [completion(p, i, eos) for i, p in enumerate(prompt_ids)]
        return (completions, None) if grpo else completions  # GRPO also returns the sampling log-probs

    trainer._generate_single_turn = generate
    torch.manual_seed(SEED)  # TRL shuffles every generation batch with the global generator
    trainer.train()
    return {
        "plan": trainer.parallel_plan.describe(),
        "moved": save_parameters(trainer, out_dir, case, start.state_dict()),
        "logged": logged_steps(trainer),
        "forwards": trainer.packing_stats["forwards"],
        "rank_sync_forwards": trainer.packing_stats["rank_sync_forwards"],
    }


def tree_run(out_dir: str, case: str, common: dict, start: dict) -> dict:
    """``tree_*``: ``share_prefixes=True`` (``tree_flat_ddp``: off, flat rows) on ``packing_hf.Trainer``,
    one SGD step over the epoch of ``_tree_data.py``'s per-turn samples: the step's loss, its samples on this rank
    (counted in ``training_step``), the tree-token ratio it logged, the size of this rank's LM head between calls
    (0: partitioned), the chunked head's logged refusals and, on rank 0, every parameter after the step (whole).
    ``start``: the model's weights built whole, before any ZeRO-3 arguments. Under ZeRO-3 every parameter is
    partitioned (``stage3_param_persistence_threshold=0``: else DeepSpeed keeps a tiny model's parameters whole), so
    the tree loss's chunked LM head runs on a head DeepSpeed gathers for its call."""
    import dataclasses

    import datasets
    from _tree_data import per_turn_samples, recording_collator

    import packing_hf

    share = case != "tree_flat_ddp"
    options = {**common, "max_tokens_per_batch": TREE_TOKENS, "gradient_accumulation_steps": TREE_ACCUMULATION}
    options.update(max_steps=1, share_prefixes=share, save_strategy="no")
    if options["deepspeed"] and options["deepspeed"]["zero_optimization"]["stage"] == 3:
        options["deepspeed"] = deepspeed_config(3)
        options["deepspeed"]["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    args = packing_hf.TrainingArguments(os.path.join(out_dir, case), **options)
    model = make_model()  # after the arguments: under ZeRO-3 partitioned at construction
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        load_whole(model, start)  # zero.Init initialised its own weights
    trainer = counting(packing_hf.Trainer)(
        model=model,
        args=args,
        train_dataset=datasets.Dataset.from_list(per_turn_samples(VOCAB)),
        data_collator=recording_collator(flat=not share),
    )
    if case == "tree_local_zero3":  # the negative control: the loss policy counts this process alone
        trainer.loss_policy.plan = dataclasses.replace(trainer.loss_policy.plan, world_size=1)
    trainer.seen = []
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    parameters = whole_parameters(trainer.accelerator.unwrap_model(trainer.model_wrapped))
    return {
        "plan": trainer.parallel_plan.describe(),
        "losses": [h["loss"] for h in logged],
        "tree_token_ratio": logged[0].get("tree_token_ratio"),
        "seen_by_step": trainer.seen,
        "head_numel": model.lm_head.weight.numel(),
        "refusals": list(trainer.loss_policy.chunked_head_refusals),
        "parameters": parameters if int(os.environ["RANK"]) == 0 else None,
    }


def lose_momentum(checkpoint: str, copy: str) -> int:
    """``checkpoint`` copied to ``copy`` with every SGD momentum buffer of its ZeRO optimizer partitions zeroed (a
    resume that lost the optimizer state but kept the weights and the data order); the number of buffers zeroed."""
    import shutil

    import torch

    shutil.copytree(checkpoint, copy)
    zeroed = 0

    def zero(state):
        nonlocal zeroed
        if isinstance(state, dict):
            for key, value in state.items():
                if key == "momentum_buffer" and torch.is_tensor(value):
                    value.zero_()
                    zeroed += 1
                else:
                    zero(value)
        elif isinstance(state, (list, tuple)):
            for value in state:
                zero(value)

    for root, _, files in os.walk(copy):
        for name in files:
            if name.endswith("optim_states.pt"):
                path = os.path.join(root, name)
                state = torch.load(path, weights_only=False)
                zero(state)
                torch.save(state, path)
    return zeroed


def deepspeed_config(stage: int) -> dict:
    return {
        "zero_optimization": {"stage": stage},
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_allow_untested_optimizer": True,  # the Trainer's own torch SGD
    }


def load_whole(model, state: dict) -> None:
    """``state`` into ``model``, whose parameters ZeRO-3 partitioned at construction (collective)."""
    import deepspeed
    import torch

    params = dict(model.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=0):
        if torch.distributed.get_rank() == 0:
            for name, p in params.items():
                p.data.copy_(state[name])


def refused_without_cpu(out_dir: str) -> dict:
    """The messages of the refusals of a world accelerate miscounts on CPU without ``use_cpu=True`` (it counts 1
    process of 2): DeepSpeed ZeRO-2 (refused by the Trainer), ZeRO-3 (refused by the arguments, before the model is
    built: ``deepspeed.zero.Init`` would partition it over 2 processes) and, in the process group DeepSpeed started,
    no engine at all. accelerate's state is reset after each, for the cases."""
    from accelerate.state import AcceleratorState

    import packing_hf

    messages = {}
    for name, stage in (("zero2", 2), ("zero3", 3), ("none", None)):
        try:
            args = packing_hf.TrainingArguments(
                os.path.join(out_dir, "refused"),
                max_tokens_per_batch=MAX_TOKENS_PER_BATCH,
                report_to="none",
                deepspeed=deepspeed_config(stage) if stage else None,
            )
            packing_hf.Trainer(model=make_model(), args=args, train_dataset=make_samples())
            messages[name] = ""
        except (ValueError, AssertionError) as error:  # AssertionError: DeepSpeed's own, not a refusal
            messages[name] = f"{type(error).__name__}: {error}"
        finally:
            AcceleratorState._reset_state(reset_partial_state=True)
            os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)  # set for good by the Accelerator given a plugin
    return messages


def evaluated_before_training(trainer, dataset, plan_group_sums: bool = True) -> dict:
    """``trainer.evaluate(dataset)`` before ``train()`` (under DeepSpeed: the engine ``evaluate`` makes): its
    ``eval_loss``, and how many of its forwards were timed as training forwards in the packing metrics.
    ``plan_group_sums=False`` (the negative control): the shares of the sequence-parallel group not summed."""
    import torch

    timed = [0]
    record_time = trainer._packing_metrics.record_time

    def counted(seconds):
        timed[0] += 1
        record_time(seconds)

    trainer._packing_metrics.record_time = counted
    all_reduce = torch.distributed.all_reduce
    if not plan_group_sums:
        sp_group = trainer.parallel_plan.sp_group
        torch.distributed.all_reduce = lambda tensor, *a, group=None, **k: (
            None if group is sp_group else all_reduce(tensor, *a, group=group, **k)
        )
    try:
        loss = trainer.evaluate(dataset)["eval_loss"]
    finally:
        torch.distributed.all_reduce = all_reduce
        trainer._packing_metrics.record_time = record_time
    return {"loss": loss, "timed_as_training": timed[0]}


def whole_parameters(model, as_lists: bool = True) -> dict:
    """Every parameter of ``model`` as lists, or as tensors (gathered whole when ZeRO-3 partitioned it; collective)."""
    import contextlib

    params = dict(model.named_parameters())
    context = contextlib.nullcontext()
    if any(hasattr(p, "ds_id") for p in params.values()):
        import deepspeed

        context = deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None)
    with context:
        if not as_lists:
            return {name: p.detach().clone() for name, p in params.items()}
        return {name: p.detach().double().flatten().tolist() for name, p in params.items()}


def main(out_dir: str, cases: tuple[str, ...] = CASES) -> None:
    import gc
    import importlib

    import datasets
    import torch

    # DeepSpeed's CPU backend would JIT-compile its shared-memory all-reduce (a C++ build of a minute on a fresh
    # machine) and reduce through it; without it DeepSpeed reduces over the gloo group, as the DDP cases do.
    # (import_module: `import deepspeed.comm.torch` binds the package's attribute `torch`, which is torch itself)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    from accelerate import ParallelismConfig
    from transformers import AutoTokenizer

    import packing_hf

    @dataclass
    class Recording(packing_hf.PaddingFreeCollator):
        """Puts the indices of the batch's samples in the batch (taken out again in ``training_step``)."""

        drop_keys: tuple = ("idx",)
        input_columns = (*packing_hf.PaddingFreeCollator.input_columns, "idx")

        def __call__(self, features, return_tensors=None):
            batch = super().__call__(features, return_tensors)
            if all("idx" in f for f in features):  # the eval samples carry none
                batch[IDS_KEY] = torch.tensor([int(f["idx"]) for f in features])
            return batch

    rank = int(os.environ["RANK"])
    dataset = datasets.Dataset.from_list(make_samples())
    eval_dataset = datasets.Dataset.from_list(make_samples(EVAL_SAMPLES, seed=4321))
    results = {"refused_without_cpu": refused_without_cpu(out_dir)} if "ddp" in cases else {}
    start = make_model().state_dict()  # before any ZeRO-3 arguments: built whole
    results["start"] = {name: p.double().flatten().tolist() for name, p in start.items()}
    if any(case.startswith(("dpo_", "kto_", "reward_", "grpo_", "rloo_")) for case in cases):
        tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
        vocab = len(tokenizer)
        policy, reference = make_model(vocab).state_dict(), make_model(vocab, seed=1).state_dict()
        dpo_starts = {"policy": policy, "reference": reference}
        preference_starts = {
            "kto_model": policy,
            "kto_ref_model": reference,
            "reward_model": make_model(vocab, pad_token_id=tokenizer.pad_token_id).state_dict(),
        }
        rl_start = make_model(vocab)  # GRPO's and RLOO's policy
    for case in cases:
        # transformers' train() (accelerate's free_memory) and DeepSpeed's ZeRO-3 engine call gc.collect(), which
        # walks every object of the imported libraries (0.24 s a call here, ~40 calls in this launch): what lives
        # now (imports, earlier results) is frozen, so that they walk only what the case made
        gc.collect()
        gc.freeze()
        stage = {"zero2": 2, "zero3": 3}.get(case.split("_")[-1])
        sft = case.startswith("sft_")
        sequence_parallel = case.startswith("sp2_")
        # zero2 / zero3 save a checkpoint mid-epoch; resumed_*: a new trainer resumes from it (the unskipped
        # one, the negative control, with ignore_data_skip=True: the epoch's batches from its first again)
        saving = case in ("zero2", "zero3")
        resumed = case.startswith("resumed_")
        common = dict(
            max_tokens_per_batch=MAX_TOKENS_PER_BATCH,
            num_train_epochs=1,
            optim="sgd",
            optim_args=f"momentum={MOMENTUM}",
            learning_rate=0.5,
            lr_scheduler_type="constant",
            max_grad_norm=0.0,
            seed=SEED,
            report_to="none",
            save_strategy="steps" if saving else "no",
            save_steps=SAVE_STEPS,
            ignore_data_skip="_unskipped_" in case,
            logging_steps=1,
            use_cpu=True,
            ddp_backend="gloo",
            ddp_timeout=120,
            disable_tqdm=True,
            deepspeed=deepspeed_config(stage) if stage else None,
            parallelism_config=ParallelismConfig(sp_size=2) if sequence_parallel else None,
            # the negative control: each rank's loss over its own token count (not the step's, over both ranks)
            average_tokens_across_devices=not case.startswith("local_mean_"),
        )
        if case.startswith("dpo_"):
            results[case] = dpo_losses(out_dir, case, common, dpo_starts)
            continue
        if case.startswith(("kto_", "reward_")):
            results[case] = preference_run(out_dir, case, common, preference_starts)
            continue
        if case.startswith(("grpo_", "rloo_")):
            results[case] = rl_run(out_dir, case, common, rl_start)
            continue
        if case.startswith("tree_"):
            results[case] = tree_run(out_dir, case, common, start)
            continue
        output = os.path.join(out_dir, case)
        args = (
            packing_hf.SFTConfig(output, bf16=False, **common)
            if sft
            else packing_hf.TrainingArguments(output, **common)
        )
        # built after the arguments: under ZeRO-3, partitioned at construction; a resumed run's weights are
        # other than the start's, the checkpoint's only reach it from the checkpoint
        model = make_model(seed=SEED + 7 if resumed else SEED)
        record = {}
        if stage == 3 and not resumed:
            record["partitioned"] = all(hasattr(p, "ds_id") for p in model.parameters())
            load_whole(model, start)  # zero.Init initialised its own weights
            report = packing_hf.check_packing(model, gradients=False, noise_floor=False)
            record["check"] = {"leaked": report.leaked, "error": report.error, "diff": report.max_logits_diff}
        trainer_class = counting(packing_hf.SFTTrainer if sft else packing_hf.Trainer)
        extra = {"processing_class": AutoTokenizer.from_pretrained(TOKENIZER)} if sft else {}
        trainer = trainer_class(
            model=model, args=args, train_dataset=dataset, data_collator=Recording(), **extra
        )
        trainer.seen = []
        if case in EVALUATED_BEFORE_TRAINING:
            record["eval_before"] = evaluated_before_training(trainer, eval_dataset)
            if sequence_parallel:  # the negative control: the same evaluation, the group's shares not summed
                record["eval_before_unsummed"] = evaluated_before_training(trainer, eval_dataset, False)
        checkpoint = os.path.join(out_dir, f"zero{stage}", f"checkpoint-{SAVE_STEPS}") if resumed else None
        if case.startswith("resumed_lost_momentum_"):  # negative control: the checkpoint's momentum zeroed
            copy = os.path.join(out_dir, f"{case}-checkpoint")
            if rank == 0:
                record["momentum_buffers_zeroed"] = lose_momentum(checkpoint, copy)
            torch.distributed.barrier()
            checkpoint = copy
        trainer.train(resume_from_checkpoint=checkpoint)
        # a resumed run's log history starts with the checkpoint's: the steps it trained itself follow
        logged = [h for h in trainer.state.log_history if "loss" in h][-len(trainer.seen) :]
        record.update(
            plan=trainer.parallel_plan.describe(),
            losses=[h["loss"] for h in logged],
            steps=[h["step"] for h in logged],
            seen_by_step=trainer.seen,
            seen=[i for step in trainer.seen for i in step],
            world_size=trainer.args.world_size,
        )
        parameters = whole_parameters(trainer.accelerator.unwrap_model(trainer.model_wrapped))
        if rank == 0:
            record["parameters"] = parameters
        results[case] = record
        del trainer, model
    if "ddp" in cases:
        results.update(zero3_chunked_head_cases(out_dir, dataset, Recording(), start, counting(packing_hf.Trainer)))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def zero3_chunked_head_cases(out_dir: str, dataset, collator, start: dict, trainer_class) -> dict:
    """The chunked LM head under ZeRO-3 with the head's weight really partitioned
    (``stage3_param_persistence_threshold=0``: without it DeepSpeed keeps a tiny model's parameters whole on every
    rank), ``packing_hf.Trainer`` as in ``zero3`` otherwise (``ddp`` is the reference, its head chunked):

    - ``zero3_partitioned_head``: ``chunked_loss=True`` (the default); ``zero3_partitioned_head_full``:
      ``chunked_loss=False``, the full logits under the same engine;
    - ``zero3_partitioned_head_outside`` (negative control): the chunked head reading the weight after the model's
      call, outside a call of the head (as it does where the plan names no engine holding the weight), where it
      is this rank's empty partition: the error.

    Each records the losses, the parameters after the epoch (rank 0), how many chunked-head projections ran inside
    a call of the head with DeepSpeed's hooks, the chunked head's logged refusals, and the head weight's size on
    this rank between calls. ``collator`` and ``trainer_class``: ``main``'s (the samples' indices recorded and
    taken out of the batch)."""
    import packing_hf
    from packing_hf.integrations import chunked_head

    config = deepspeed_config(3)
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    inside, outside, original = [0], [False], chunked_head._with_head_weight

    def deepspeed_gathers(head) -> bool:  # DeepSpeed's ZeRO-3 hooks gather the head around its calls
        modules = (str(getattr(getattr(h, "func", h), "__module__", "")) for h in head._forward_pre_hooks.values())
        return any(module.startswith("deepspeed.") for module in modules)

    def counted(resolved, hidden, compute):
        if outside[0]:
            resolved = resolved._replace(in_calls=False)
        inside[0] += resolved.in_calls and deepspeed_gathers(resolved.head)
        return original(resolved, hidden, compute)

    chunked_head._with_head_weight = counted
    results = {}
    for case in ("zero3_partitioned_head", "zero3_partitioned_head_full", "zero3_partitioned_head_outside"):
        inside[0] = 0
        outside[0] = case.endswith("_outside")
        args = packing_hf.TrainingArguments(
            os.path.join(out_dir, case), max_tokens_per_batch=MAX_TOKENS_PER_BATCH, num_train_epochs=1, optim="sgd",
            optim_args=f"momentum={MOMENTUM}", learning_rate=0.5, lr_scheduler_type="constant", max_grad_norm=0.0,
            seed=SEED, report_to="none", save_strategy="no", logging_steps=1, use_cpu=True, ddp_backend="gloo",
            ddp_timeout=120, disable_tqdm=True, deepspeed=config, chunked_loss=not case.endswith("_full"),
        )  # fmt: skip
        model = make_model()  # partitioned at construction: the start's weights loaded into the partitions
        load_whole(model, start)
        trainer = trainer_class(model=model, args=args, train_dataset=dataset, data_collator=collator)
        trainer.seen = []
        record = {"head_numel": model.lm_head.weight.numel()}
        try:
            trainer.train()
        except (RuntimeError, ValueError) as error:
            results[case] = {**record, "error": str(error)}
            continue
        parameters = whole_parameters(trainer.accelerator.unwrap_model(trainer.model_wrapped))
        results[case] = {
            **record,
            "plan": trainer.parallel_plan.describe(),
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "parameters": parameters if int(os.environ["RANK"]) == 0 else None,
            "inside": inside[0],
            "refusals": list(trainer.loss_policy.chunked_head_refusals),
        }
        del trainer, model
    chunked_head._with_head_weight = original
    return results


if __name__ == "__main__":
    main(sys.argv[1], CASES_4 if sys.argv[2:] == ["--world", "4"] else CASES)
