"""One rank of the 2-process GRPO run launched by ``test_rl_multiprocess.py``.

Run as ``torchrun --nproc_per_node 2 _rl_worker.py OUT_DIR MODEL_DIR`` (``use_cpu=True``: gloo on CPU). Every
rank trains the tiny llama saved in MODEL_DIR for two optimizer steps (2 micro-batches each, 2 iterations
per generation, KL to a reference model) with stock ``trl.GRPOTrainer`` (padded rollouts, sdpa), with
``packing_hf.GRPOTrainer`` (packed rollouts under a small ``max_tokens_per_batch``, so ranks need different
numbers of packed rows and must agree on one) and with prompt sharing on top; it saves the DDP-averaged
gradient of every step, the logged metrics and the number of packed forwards. Generation is replaced by
deterministic completions. Writes ``rank{r}.pt``. Importing this module does nothing (pytest collects it
for doctests).
"""

from __future__ import annotations

import os
import random
import sys

NUM_PROMPTS = 8
G = 2
MAX_TOKENS_PER_BATCH = 72
SEED = 0


def completion(prompt_ids, index: int, eos: int) -> list[int]:
    """A deterministic completion of 1 to 20 tokens (most end in EOS), by prompt and position in the call."""
    rng = random.Random(sum(prompt_ids) * 31 + len(prompt_ids) * 7 + index)
    ids = [rng.randrange(100, 5000) for _ in range(rng.randint(1, 20))]
    if rng.random() < 0.75:
        ids[-1] = eos
    return ids


def reward(completion_ids, **kwargs):
    return [float(sum(ids) % 7) - 3.0 + 0.1 * len(ids) for ids in completion_ids]


def main(out_dir: str, model_dir: str) -> None:
    import json

    import datasets
    import torch
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    import packing_hf
    from packing_hf.integrations.rl import GRPOConfig, GRPOTrainer

    data_dir = os.environ["PACKING_HF_DATA"]
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(data_dir, "smollm2_tokenizer"))
    questions = []
    with open(os.path.join(data_dir, "gsm8k_train.jsonl")) as f:
        for line in f:
            q = json.loads(line)["question"].split(". ")[0]
            if 40 < len(q) < 160:
                questions.append(f"Q: {q}\nA:")
            if len(questions) == NUM_PROMPTS:
                break

    class Probe(TrainerCallback):
        def __init__(self) -> None:
            self.grads = []

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.grads.append(torch.cat([p.grad.flatten().clone() for p in model.parameters()]))

    eos = tokenizer.eos_token_id
    records = {}
    for name, trainer_cls, config_cls, attn, extra in (
        ("stock", trl.GRPOTrainer, trl.GRPOConfig, "sdpa", {}),
        ("packed", GRPOTrainer, GRPOConfig, packing_hf.register_attention(), {"max_tokens_per_batch": 72}),
        ("shared", GRPOTrainer, GRPOConfig, packing_hf.register_attention(), {"share_prompt": True}),
    ):
        probe = Probe()
        args = config_cls(
            output_dir=os.path.join(out_dir, name),
            num_generations=G,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
            num_iterations=2,
            max_completion_length=20,
            max_steps=2,
            beta=0.04,
            optim="sgd",
            learning_rate=0.5,
            max_grad_norm=0.0,  # the recorded gradient must be the raw one
            bf16=False,
            seed=SEED,
            logging_steps=1,
            report_to="none",
            save_strategy="no",
            use_cpu=True,
            ddp_backend="gloo",
            ddp_timeout=120,
            disable_tqdm=True,
            **extra,
        )
        model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=attn, dtype=torch.float32)
        trainer = trainer_cls(
            model=model,
            reward_funcs=reward,
            args=args,
            train_dataset=datasets.Dataset.from_dict({"prompt": questions}),
            processing_class=tokenizer,
            callbacks=[probe],
        )
        trainer._generate_single_turn = lambda prompt_ids, *a, **k: (
            [completion(p, i, eos) for i, p in enumerate(prompt_ids)],
            None,
        )
        torch.manual_seed(SEED)  # TRL shuffles every generation batch with the global generator
        trainer.train()
        records[name] = {
            "grads": probe.grads,
            "logs": [h for h in trainer.state.log_history if "loss" in h],
            "stats": dict(getattr(trainer, "packing_stats", {})),
        }

    rank = trainer.args.process_index
    torch.save(
        {"rank": rank, "world_size": trainer.args.world_size, **records},
        os.path.join(out_dir, f"rank{rank}.pt"),
    )
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()  # a clean gloo shutdown: no abort at interpreter exit


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
