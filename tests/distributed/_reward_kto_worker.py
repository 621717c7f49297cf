"""One rank of the 2-process reward-model and KTO runs launched by ``test_reward_kto_multiprocess.py``.

Run as ``torchrun --nproc_per_node 2 _reward_kto_worker.py OUT_DIR MODES`` (``use_cpu=True``: gloo on
CPU), ``MODES`` one of ``reward``, ``kto`` or both (``reward,kto``: one launch runs them one after the other,
each in ``OUT_DIR/MODE``). Every rank trains the same tiny llama one optimizer step with the stock TRL trainer (padded batches,
sdpa) and one with the packing_hf trainer (packed rows, varlen attention) on the same data, and saves both
DDP-averaged gradients and the metrics the trainers logged. It also recomputes, outside DDP, the gradient
of the batch this rank saw in the stock step from the same initial weights (the rank-local gradient, whose
mean over the ranks DDP must give). Then it runs one multipack epoch (``max_tokens_per_batch``) and records
what every collated batch held. Writes ``OUT_DIR/MODE/rank{r}.pt``. Importing this module does nothing (pytest collects
it for doctests).

- ``reward``: ``trl.RewardTrainer`` vs ``packing_hf.RewardTrainer`` on chosen/rejected GSM8K pairs, an
  ``AutoModelForSequenceClassification`` with one score.
- ``kto``: ``trl.KTOTrainer`` vs ``packing_hf.KTOTrainer`` on desirable/undesirable GSM8K completions,
  with a reference model unlike the policy (its log-probs computed by packed forwards in the packed run)
  and TRL's KL completions (rotated within every ``per_device_train_batch_size`` block of the dataset).
"""

from __future__ import annotations

import os
import sys

NUM_ROWS = 11
BATCH = 2
REWARD_MAX_LENGTH = 256
KTO_MAX_LENGTH = 128
REWARD_TOKENS_PER_BATCH = 600
KTO_TOKENS_PER_BATCH = 600
SEED = 1  # the policy's; the KTO reference model is seeded with SEED - 1 (its KL estimate is then > 0)


def gsm8k_rows(data_dir: str) -> list[dict]:
    """The first ``NUM_ROWS`` short GSM8K training rows."""
    import json

    rows = []
    with open(os.path.join(data_dir, "gsm8k_train.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            if len(row["question"]) < 160 and len(row["answer"]) < 250:
                rows.append(row)
            if len(rows) == NUM_ROWS:
                return rows
    return rows


def _reversed(answer: str) -> str:
    return "\n".join(reversed(answer.split("\n")))


def make_dataset(mode: str, data_dir: str):
    """Reward: pairs (reference answer vs. its lines reversed). KTO: every third completion reversed and
    undesirable, the others the reference answer and desirable."""
    import datasets

    rows = gsm8k_rows(data_dir)
    prompts = [f"Question: {r['question']}\nAnswer:" for r in rows]
    if mode == "reward":
        return datasets.Dataset.from_dict(
            {
                "prompt": prompts,
                "chosen": [" " + r["answer"] for r in rows],
                "rejected": [" " + _reversed(r["answer"]) for r in rows],
            }
        )
    return datasets.Dataset.from_dict(
        {
            "prompt": prompts,
            "completion": [
                " " + (r["answer"] if i % 3 else _reversed(r["answer"])) for i, r in enumerate(rows)
            ],
            "label": [bool(i % 3) for i in range(len(rows))],
        }
    )


def main(out_dir: str, mode: str) -> None:
    import torch
    import trl
    from accelerate import PartialState
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        TrainerCallback,
    )

    import packing_hf
    from packing_hf.integrations.kto import KTOConfig, KTOTrainer
    from packing_hf.integrations.reward import RewardConfig, RewardTrainer
    from packing_hf.preference import PaddingFreeRewardCollator
    from packing_hf.unpaired import PaddingFreeUnpairedCollator

    assert mode in ("reward", "kto"), mode
    out_dir = os.path.join(out_dir, mode)
    data_dir = os.environ["PACKING_HF_DATA"]
    PartialState(cpu=True)
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(data_dir, "smollm2_tokenizer"))
    config = AutoConfig.for_model(
        "llama",
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    auto = AutoModelForSequenceClassification if mode == "reward" else AutoModelForCausalLM

    def make_model(attn: str, seed: int = SEED):
        torch.manual_seed(seed)
        return auto.from_config(config, attn_implementation=attn).float()

    def flat_grads(model) -> torch.Tensor:
        return torch.cat([p.grad.flatten().clone() for p in model.parameters() if p.grad is not None])

    class Probe(TrainerCallback):
        def __init__(self) -> None:
            self.grads = None

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            if self.grads is None:
                self.grads = flat_grads(model)

    class FirstInputs:
        """Keeps the first batch ``compute_loss`` is given (already on the device)."""

        first_inputs = None

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if self.first_inputs is None:
                self.first_inputs = dict(inputs)
            return super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )

    def arguments(cls, name: str, **overrides):
        values = dict(
            output_dir=os.path.join(out_dir, name),
            per_device_train_batch_size=BATCH,
            max_steps=1,
            max_length=REWARD_MAX_LENGTH if mode == "reward" else KTO_MAX_LENGTH,
            learning_rate=1e-3,
            max_grad_norm=0.0,  # the recorded gradient must be the raw one
            logging_steps=1,
            bf16=False,  # TRL defaults to bf16 autocast, even on CPU; exactness is measured in fp32
            gradient_checkpointing=False,
            seed=SEED,
            report_to="none",
            save_strategy="no",
            use_cpu=True,
            ddp_backend="gloo",
            ddp_timeout=120,
            ddp_find_unused_parameters=False,
            disable_tqdm=True,
        )
        values.update(overrides)
        return cls(**values)

    def build(trainer_cls, config_cls, name: str, attn: str, **kwargs):
        extra = {"ref_model": make_model(attn, seed=SEED - 1)} if mode == "kto" else {}
        return trainer_cls(
            model=make_model(attn),
            args=arguments(config_cls, name, **kwargs.pop("args", {})),
            train_dataset=make_dataset(mode, data_dir),
            processing_class=tokenizer,
            **extra,
            **kwargs,
        )

    stock_cls, stock_config = (
        (trl.RewardTrainer, trl.RewardConfig) if mode == "reward" else (trl.KTOTrainer, trl.KTOConfig)
    )
    packed_cls, packed_config = (RewardTrainer, RewardConfig) if mode == "reward" else (KTOTrainer, KTOConfig)

    grads, logs, kl_logps = {}, {}, {}
    for name, trainer_cls, config_cls, attn in (
        ("stock", stock_cls, stock_config, "sdpa"),
        ("packed", packed_cls, packed_config, packing_hf.register_attention()),
    ):

        class Recording(FirstInputs, trainer_cls):
            kl_record = []  # one list per trainer class

            def _compute_kl_logps(self, model, batch):  # KTO only: the per-example KL log-probs
                logps = super()._compute_kl_logps(model, batch)
                self.kl_record.append(logps.detach().clone())
                return logps

        probe = Probe()
        trainer = build(Recording, config_cls, name, attn, callbacks=[probe])
        trainer.train()
        grads[name] = probe.grads
        logs[name] = next(h for h in trainer.state.log_history if "loss" in h)
        kl_logps[name] = list(trainer.kl_record)  # KTO: the policy's then the reference's, (BATCH,) each
        if name == "stock":
            # the rank-local gradient of the same batch from the same weights, without DDP's all-reduce
            # (the trainer's own module, as TRL prepared it, outside the DDP wrapper, back at its first weights)
            local = trainer.accelerator.unwrap_model(trainer.model)
            local.load_state_dict(make_model(attn).state_dict())
            local.zero_grad()
            local.train()
            trainer.compute_loss(local, trainer.first_inputs).backward()
            local_grads = flat_grads(local)

    if mode == "reward":

        class BatchRecorder(PaddingFreeRewardCollator):
            batches: list = []

            def __call__(self, features, return_tensors=None):
                batch = super().__call__(features, return_tensors)
                self.batches.append(
                    {
                        "ids": [tuple(f["chosen_ids"]) for f in features],
                        "counted": [len(f["chosen_ids"]) + len(f["rejected_ids"]) for f in features],
                        "row_tokens": int(batch["packed_input_ids"].numel()),
                    }
                )
                return batch

        collator = BatchRecorder(pad_token_id=tokenizer.pad_token_id)
    else:

        class BatchRecorder(PaddingFreeUnpairedCollator):
            batches: list = []

            def __call__(self, features, return_tensors=None):
                batch = super().__call__(features, return_tensors)
                limit = self.max_length
                self.batches.append(
                    {
                        "ids": [tuple(f["prompt_ids"] + f["completion_ids"]) for f in features],
                        "counted": [
                            min(len(f["prompt_ids"]) + len(f["completion_ids"]), limit)
                            + min(len(f["prompt_ids"]) + len(f["KL_completion_ids"]), limit)
                            for f in features
                        ],
                        "row_tokens": int(
                            batch["packed_input_ids"].numel() + batch["KL_packed_input_ids"].numel()
                        ),
                    }
                )
                return batch

        collator = BatchRecorder(
            max_length=KTO_MAX_LENGTH, overflow="truncate", pad_token_id=tokenizer.pad_token_id
        )
    budget = REWARD_TOKENS_PER_BATCH if mode == "reward" else KTO_TOKENS_PER_BATCH
    multipack = build(
        packed_cls,
        packed_config,
        "multipack",
        packing_hf.register_attention(),
        args=dict(max_steps=-1, num_train_epochs=1, max_tokens_per_batch=budget),
        data_collator=collator,
    )
    collator.batches.clear()
    multipack.train()
    rows = multipack.train_dataset
    if mode == "reward":
        every = [tuple(r["chosen_ids"]) for r in rows]
    else:
        every = [tuple(r["prompt_ids"] + r["completion_ids"]) for r in rows]

    rank = multipack.args.process_index
    # the trainer's gather of rows whose number differs between the ranks, on gloo (rank r: r + 2 rows)
    rows_of_rank = torch.arange(rank + 2, dtype=torch.float32)[:, None] + 10 * rank
    uneven_gather = multipack.accelerator.gather(rows_of_rank)
    torch.save(
        {
            "rank": rank,
            "world_size": multipack.args.world_size,
            "grads": grads,
            "local_grads": local_grads,
            "logs": logs,
            "kl_logps": kl_logps,
            "batches": collator.batches,
            "every": every,
            "multipack_lengths": [int(n) for n in multipack._multipack_lengths_of(rows)],
            "budget": budget,
            "global_step": multipack.state.global_step,
            "uneven_gather": uneven_gather,
        },
        os.path.join(out_dir, f"rank{rank}.pt"),
    )


if __name__ == "__main__":
    import torch

    for mode in sys.argv[2].split(","):
        main(sys.argv[1], mode)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()  # a clean gloo shutdown: no abort at interpreter exit
