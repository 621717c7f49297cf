"""One rank of the 2-process DPO run launched by ``test_dpo_multiprocess.py``.

Run as ``torchrun --nproc_per_node 2 _dpo_worker.py OUT_DIR`` (``use_cpu=True``: gloo on CPU). Every rank
trains the same tiny llama one optimizer step with stock ``trl.DPOTrainer`` (padded batches, sdpa) and one
with ``packing_hf.DPOTrainer`` (packed batches, varlen attention), both with reference log-probs
precomputed across the two ranks, and saves both DDP-averaged gradients; then it runs one multipack epoch
(``max_tokens_per_batch``) and records which pairs every collated batch held. Writes ``rank{r}.pt``.
Importing this module does nothing (pytest collects it for doctests).
"""

from __future__ import annotations

import os
import sys

NUM_PAIRS = 12
BATCH_PAIRS = 2
MAX_LENGTH = 128
MAX_TOKENS_PER_BATCH = 520  # the ranks' batches then hold different numbers of pairs
SEED = 0


def make_pairs(data_dir: str):
    """``NUM_PAIRS`` GSM8K preference pairs: reference answer vs. the same lines in reverse order."""
    import json

    import datasets

    rows = []
    with open(os.path.join(data_dir, "gsm8k_train.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            if len(row["question"]) < 160 and len(row["answer"]) < 250:
                rows.append(row)
            if len(rows) == NUM_PAIRS:
                break
    return datasets.Dataset.from_dict(
        {
            "prompt": [f"Question: {r['question']}\nAnswer:" for r in rows],
            "chosen": [" " + r["answer"] for r in rows],
            "rejected": [" " + "\n".join(reversed(r["answer"].split("\n"))) for r in rows],
        }
    )


def main(out_dir: str) -> None:
    from dataclasses import dataclass, field

    import datasets
    import torch
    import trl
    from accelerate import PartialState
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    import packing_hf
    from packing_hf.integrations.dpo import DPOConfig, DPOTrainer
    from packing_hf.preference import PaddingFreePreferenceCollator, preference_pair_lengths

    data_dir = os.environ["PACKING_HF_DATA"]
    state = PartialState(cpu=True)

    def shared_pairs(name: str):
        """The pairs saved once to a folder both ranks read: TRL caches the precomputed reference log-probs
        next to the dataset's files, which in-memory datasets keep in a per-process temporary folder. One
        folder per trainer, so no trainer reads another's cache."""
        path = os.path.join(out_dir, f"pairs-{name}")
        with state.main_process_first():
            if state.is_main_process:
                make_pairs(data_dir).save_to_disk(path)
        return datasets.load_from_disk(path)

    tokenizer = AutoTokenizer.from_pretrained(os.path.join(data_dir, "smollm2_tokenizer"))
    config = AutoConfig.for_model(
        "llama",
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )

    def make_model(attn: str):
        torch.manual_seed(SEED)
        return AutoModelForCausalLM.from_config(config, attn_implementation=attn).float()

    class Probe(TrainerCallback):
        def __init__(self) -> None:
            self.grads = None

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            if self.grads is None:
                self.grads = torch.cat(
                    [p.grad.flatten().clone() for p in model.parameters() if p.grad is not None]
                )

    @dataclass
    class Recording(PaddingFreePreferenceCollator):
        batches: list = field(default_factory=list, init=False, repr=False)

        def __call__(self, features, return_tensors=None):
            self.batches.append([tuple(f["prompt_ids"] + f["chosen_ids"]) for f in features])
            return super().__call__(features, return_tensors)

    def arguments(cls, name: str, **overrides):
        values = dict(
            output_dir=os.path.join(out_dir, name),
            per_device_train_batch_size=BATCH_PAIRS,
            max_steps=1,
            max_length=MAX_LENGTH,
            precompute_ref_log_probs=True,
            learning_rate=1e-3,
            max_grad_norm=0.0,  # the recorded gradient must be the raw one
            bf16=False,
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

    grads, ref_logps = {}, {}
    for name, trainer_cls, config_cls, attn in (
        ("stock", trl.DPOTrainer, trl.DPOConfig, "sdpa"),
        ("packed", DPOTrainer, DPOConfig, packing_hf.register_attention()),
    ):
        probe = Probe()
        trainer = trainer_cls(
            model=make_model(attn),
            args=arguments(config_cls, name),
            train_dataset=shared_pairs(name),
            processing_class=tokenizer,
            callbacks=[probe],
        )
        ref_logps[name] = torch.tensor(
            list(trainer.train_dataset["ref_chosen_logps"])
            + list(trainer.train_dataset["ref_rejected_logps"])
        )
        trainer.train()
        grads[name] = probe.grads
        shared = getattr(trainer.data_collator, "shared_prompt", False)  # packed: on by default

    collator = Recording(max_length=MAX_LENGTH, overflow="truncate", shared_prompt=True)
    multipack = DPOTrainer(
        model=make_model(packing_hf.register_attention()),
        args=arguments(
            DPOConfig,
            "multipack",
            max_steps=-1,
            num_train_epochs=1,
            max_tokens_per_batch=MAX_TOKENS_PER_BATCH,
        ),
        data_collator=collator,
        train_dataset=shared_pairs("multipack"),
        processing_class=tokenizer,
    )
    collator.batches.clear()  # the precompute batches
    multipack.train()
    rows = multipack.train_dataset
    pair_tokens = {  # both sequences truncated to max_length, the shared prompt counted once
        tuple(r["prompt_ids"] + r["chosen_ids"]): int(
            preference_pair_lengths(
                [len(r["prompt_ids"])],
                [len(r["chosen_ids"])],
                [len(r["rejected_ids"])],
                max_length=MAX_LENGTH,
                shared_prompt=True,
            )[0]
        )
        for r in rows
    }

    rank = multipack.args.process_index
    torch.save(
        {
            "rank": rank,
            "world_size": multipack.args.world_size,
            "grads": grads,
            "ref_logps": ref_logps,
            "batches": collator.batches,
            "pair_tokens": pair_tokens,
            "global_step": multipack.state.global_step,
            "budget": MAX_TOKENS_PER_BATCH,
            "logged": [  # TRL's metrics gathered over both ranks' pairs: the same on both
                {k: v for k, v in log.items() if k.startswith(("rewards/", "logps/"))}
                for log in multipack.state.log_history
                if "rewards/margins" in log
            ],
            "shared": shared,
            "shared_prompt_tokens": collator.stats["shared_prompt_tokens"],
        },
        os.path.join(out_dir, f"rank{rank}.pt"),
    )
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()  # a clean gloo shutdown: no abort at interpreter exit


if __name__ == "__main__":
    main(sys.argv[1])
