"""What packing_hf's trainers cost on top of the collator: stock Trainer vs packing_hf.Trainer vs SFTTrainer.

Every contender trains the same tiny Llama (49k vocabulary, SmolLM2 tokenizer) on the same packed batches:
the GSM8K rows are packed offline into rows of at most ``--tokens`` tokens (a ``seq_lengths`` column), so
with ``per_device_train_batch_size=1`` and one seed every trainer's data loader yields the same rows in the
same order, and ``PaddingFreeCollator`` turns each into the same ``[1, T]`` batch (own segments per sample).

- ``stock``: ``transformers.Trainer`` + ``PaddingFreeCollator`` (attention: packing_hf's registered varlen);
- ``packing_hf``: ``packing_hf.Trainer`` with the same collator (pre-flight, guards, metrics);
- ``sft``: ``packing_hf.SFTTrainer`` as it comes (``logit_metrics="labelled"``: the model's own loss, TRL's
  ``entropy`` / ``mean_token_accuracy`` from its logits at the labelled tokens only, every step), with the same
  precision and no gradient checkpointing, as the others;
- ``sft_trl_metrics``: the same with ``logit_metrics="trl"``: TRL's ``compute_loss``, a chunked fused LM head
  computing log-probs, entropy and top-1 accuracy at every position over the whole vocabulary;
- ``trl_stock``: stock ``trl.SFTTrainer`` with its own padding-free collator (``seq_lengths`` -> position_ids)
  on the same rows: what TRL costs without packing_hf;
- ``sft_trl_defaults``: ``packing_hf.SFTTrainer`` with TRL's own ``SFTConfig`` defaults left as they are
  (``gradient_checkpointing=True``, ``bf16=True``), which is what a user gets without setting them.

Rounds are interleaved: each round trains every contender for ``--steps`` steps from the same initial
weights; a step's time is the wall time between two ``on_step_end`` callbacks (data loading, forward,
backward, optimizer, logging: everything the trainer does). The first step of each run is dropped.
``--profile`` adds one cProfile run per contender and prints the functions whose cumulative time differs.

    python benchmarks/bench_trainer_overhead.py           # ~10 min on 2 CPU cores
    python benchmarks/bench_trainer_overhead.py --quick
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import tempfile
import time

import torch
import transformers
from _common import base_parser, gsm8k_token_ids, load_tokenizer, print_table, write_json

from packing_hf import PaddingFreeCollator, register_attention


def make_model(vocab: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama",
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=register_attention()).float()


def packed_dataset(rows: list[list[int]], tokens: int, count: int):
    """``count`` offline-packed rows: ``input_ids`` of at most ``tokens`` tokens and their ``seq_lengths``."""
    import datasets

    packed, current, lengths = [], [], []
    for row in rows:
        if len(current) + len(row) > tokens and current:
            packed.append({"input_ids": current, "seq_lengths": lengths})
            if len(packed) == count:
                break
            current, lengths = [], []
        current = current + row
        lengths = lengths + [len(row)]
    return datasets.Dataset.from_list(packed)


def build_trainer(name: str, dataset, tokenizer, steps: int, output_dir: str, callback):
    from packing_hf import SFTConfig, SFTTrainer, Trainer, TrainingArguments

    common = dict(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=1,
        learning_rate=1e-3,
        logging_steps=1,  # every step logs: the per-step cost of the metrics is part of what is measured
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
    )
    model = make_model(len(tokenizer))
    collator = PaddingFreeCollator.for_tokenizer(tokenizer)
    if name == "stock":
        args = transformers.TrainingArguments(remove_unused_columns=False, **common)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset, data_collator=collator)
    elif name == "packing_hf":
        args = TrainingArguments(**common)
        trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=collator)
    elif name == "trl_stock":
        import trl

        args = trl.SFTConfig(
            padding_free=True,
            max_length=None,
            dataset_kwargs={"skip_prepare_dataset": True},
            gradient_checkpointing=False,
            bf16=False,
            **common,
        )
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    else:
        # TRL's SFTConfig turns gradient checkpointing and bf16 on by default; the stock contenders have neither
        matched = {} if name == "sft_trl_defaults" else {"gradient_checkpointing": False, "bf16": False}
        args = SFTConfig(
            padding_free=True,
            max_length=None,
            dataset_kwargs={"skip_prepare_dataset": True},
            logit_metrics="trl" if name == "sft_trl_metrics" else "labelled",
            **matched,
            **common,
        )
        trainer = SFTTrainer(
            model=model, args=args, train_dataset=dataset, processing_class=tokenizer, data_collator=collator
        )
    trainer.add_callback(callback)
    return trainer


class StepClock(transformers.TrainerCallback):
    """Records the wall time between consecutive ``on_step_end`` calls."""

    def __init__(self) -> None:
        self.times: list[float] = []  # wall seconds
        self.cpu_times: list[float] = []  # CPU seconds of this process (all threads)
        self._last: tuple[float, float] | None = None

    def on_train_begin(self, *args, **kwargs):
        self._last = None

    def on_step_end(self, *args, **kwargs):
        now = (time.perf_counter(), time.process_time())
        if self._last is not None:
            self.times.append(now[0] - self._last[0])
            self.cpu_times.append(now[1] - self._last[1])
        self._last = now


def profile_once(name, dataset, tokenizer, steps, top: int = 12) -> list[dict]:
    clock = StepClock()
    with tempfile.TemporaryDirectory() as out:
        trainer = build_trainer(name, dataset, tokenizer, steps, out, clock)
        profiler = cProfile.Profile()
        profiler.enable()
        trainer.train()
        profiler.disable()
    stats = pstats.Stats(profiler)
    rows = []
    for (filename, line, function), (_, calls, _, cumulative, _) in stats.stats.items():
        if any(
            part in filename for part in ("packing_hf/", "/trl/", "transformers/trainer", "masking_utils")
        ):
            rows.append(
                {
                    "contender": name,
                    "function": f"{filename.split('site-packages/')[-1].split('/main/')[-1]}:{line}({function})",
                    "calls": calls,
                    "cumulative_ms_per_step": round(cumulative / steps * 1e3, 2),
                }
            )
    rows.sort(key=lambda r: -r["cumulative_ms_per_step"])
    return rows[:top]


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per packed step")
    parser.add_argument("--steps", type=int, default=None, help="steps per contender per round")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds")
    parser.add_argument("--profile", action="store_true", help="also profile one run per contender")
    args = parser.parse_args()
    steps = args.steps or (3 if args.quick else 4)
    rounds = args.rounds or (1 if args.quick else 4)

    transformers.logging.set_verbosity_error()
    tokenizer = load_tokenizer()
    rows = gsm8k_token_ids("train", limit=600 if args.quick else 1200, tokenizer=tokenizer)
    dataset = packed_dataset(rows, args.tokens, steps)
    if len(dataset) < steps:
        raise SystemExit(f"only {len(dataset)} packed rows; lower --steps or --tokens")

    names = ["stock", "packing_hf", "sft", "sft_trl_metrics", "trl_stock", "sft_trl_defaults"]
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu_times: dict[str, list[float]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as out:
        for round_ in range(rounds):
            # the order rotates every round, so no contender always runs right after the same other one
            for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                clock = StepClock()
                build_trainer(name, dataset, tokenizer, steps, out, clock).train()
                times[name].extend(clock.times)
                cpu_times[name].extend(clock.cpu_times)

    def median_ms(values: list[float]) -> float:
        return statistics.median(values) * 1e3

    table = []
    for name in names:
        table.append(
            {
                "contender": name,
                "step_ms": round(median_ms(times[name]), 1),
                "min_ms": round(min(times[name]) * 1e3, 1),
                "cpu_ms": round(median_ms(cpu_times[name]), 1),
                # CPU time is the steadier figure on a machine shared with other jobs (waiting is not counted)
                "cpu_speed_vs_stock": round(median_ms(cpu_times["stock"]) / median_ms(cpu_times[name]), 3),
                "cpu_speed_vs_packing_hf": round(
                    median_ms(cpu_times["packing_hf"]) / median_ms(cpu_times[name]), 3
                ),
                "wall_speed_vs_stock": round(median_ms(times["stock"]) / median_ms(times[name]), 3),
                "steps_timed": len(times[name]),
            }
        )
    columns = ["contender", "step_ms", "min_ms", "cpu_ms", "cpu_speed_vs_stock", "cpu_speed_vs_packing_hf"]
    print_table(table, [*columns, "wall_speed_vs_stock", "steps_timed"])
    profile = []
    if args.profile:
        for name in names:
            profile.extend(profile_once(name, dataset, tokenizer, steps))
        print_table(profile, ["contender", "function", "calls", "cumulative_ms_per_step"])
    write_json(
        "trainer_overhead",
        {
            "rows": table,
            "profile": profile,
            "steps_per_round": steps,
            "rounds": rounds,
            "tokens_per_step": [len(r) for r in dataset["input_ids"]],
            "threads": torch.get_num_threads(),
        },
        args,
    )


if __name__ == "__main__":
    main()
