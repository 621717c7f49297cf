"""Where a training step of each trainer goes, on the model, data and budget of ``bench_trainers.py``:
``packing_hf.SFTTrainer`` and ``packing_hf.Trainer`` with their defaults against ``transformers.Trainer`` with
``train_sampling_strategy="batch_rebalance"`` (4 micro-batches of balanced padded cost).

Per contender: the process CPU time and wall time of every optimizer step (from one ``on_step_end`` to the next, the
first step dropped), and with ``--profile`` a cProfile of the whole epoch, its functions grouped into the parts of a
step (data: loading + collation; forward; loss head; backward; optimizer; trainer bookkeeping, callbacks, logs).

CPU time (``time.process_time``: every thread of the process) decides on a machine shared with other jobs; with more
than one intra-op thread it also counts the threads' spinning while they wait for each other, so ``--threads 1``
(the default) gives the cleanest figures. Rounds are interleaved (the order rotates).

    python benchmarks/profile_trainer_path.py                       # tiny preset, 600 samples, 4096 tokens/step
    python benchmarks/profile_trainer_path.py --profile --rounds 1  # + the per-part breakdown
"""

from __future__ import annotations

import copy
import cProfile
import pstats
import statistics
import tempfile
import time
from typing import Any

import numpy as np
import torch
from _common import base_parser, compact_vocabulary, print_table, write_json
from bench_trainers import BatchRecorder, build_model, load_samples, load_tokenizer, make_trainer
from transformers import TrainerCallback

import packing_hf

CONTENDERS = ("sft", "trainer", "batch_rebalance")
# the parts of a step, by the first matching (file fragment, function-name fragment) of a profile's function
PARTS = (
    ("loss_head", ("loss_head.py", "")),
    ("loss_head", ("chunked_head.py", "")),
    ("loss_head", ("loss_utils.py", "")),
    ("loss_head", ("sft.py", "_labelled_logit_metrics")),
    ("optimizer", ("optim", "")),
    ("backward", ("autograd", "")),
    ("backward", ("", "run_backward")),
    ("data", ("collator.py", "")),
    ("data", ("data_collator.py", "")),
    ("data", ("dataloader", "")),
    ("data", ("arrow_dataset.py", "")),
    ("data", ("sampler.py", "")),
    ("forward", ("modeling_llama.py", "")),
    ("forward", ("attention", "")),
    ("forward", ("torch/nn/modules", "")),
)


class StepClock(TrainerCallback):
    """Wall and process CPU time at the end of every optimizer step."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def _mark(self) -> None:
        self.wall.append(time.perf_counter())
        self.cpu.append(time.process_time())

    def on_train_begin(self, args, state, control, **kwargs):
        self.wall, self.cpu = [], []
        self._mark()

    def on_step_end(self, args, state, control, **kwargs):
        self._mark()


def build_trainer(name: str, model, samples, tokenizer, args, output_dir: str):
    if name == "sft":
        return make_trainer("packing_hf", model, samples, tokenizer, args, output_dir)
    if name == "batch_rebalance":
        return make_trainer("hf_batch_rebalance", model, samples, tokenizer, args, output_dir)
    import datasets

    config = packing_hf.TrainingArguments(
        output_dir=output_dir, num_train_epochs=1, learning_rate=1e-4, seed=args.seed, data_seed=args.seed,
        report_to="none", save_strategy="no", logging_steps=10, disable_tqdm=True, use_cpu=True,
        dataloader_num_workers=0, max_tokens_per_batch=args.budget,
    )  # fmt: skip
    data = datasets.Dataset.from_dict({"input_ids": samples})
    return packing_hf.Trainer(model=model, args=config, train_dataset=data, processing_class=tokenizer)


def part_of(key: tuple[str, int, str]) -> str | None:
    filename, _, function = key
    for part, (file_part, function_part) in PARTS:
        if file_part in filename and function_part in function:
            return part
    return None


def breakdown(profile: cProfile.Profile) -> dict[str, float]:
    """Seconds of own time (``tottime``) per part of a step; what no part claims is ``other``."""
    stats = pstats.Stats(profile).stats
    parts: dict[str, float] = {}
    for key, (_, _, tottime, _, _) in stats.items():
        part = part_of(key) or "other"
        parts[part] = parts.get(part, 0.0) + tottime
    return parts


def run(name: str, config, init, samples, tokenizer, args) -> dict[str, Any]:
    peer = "sdpa"
    attention = packing_hf.ATTENTION_NAME if name in ("sft", "trainer") else peer
    model = build_model(args, None, attention, config=config)
    model.load_state_dict(init)
    profile = cProfile.Profile() if args.profile else None
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = build_trainer(name, model, samples, tokenizer, args, output_dir)
        recorder = trainer.data_collator = BatchRecorder(trainer.data_collator)
        clock = StepClock()
        trainer.add_callback(clock)
        if profile is not None:
            profile.enable()
        trainer.train()
        if profile is not None:
            profile.disable()
    real = sum(n for lengths, _ in recorder.batches for n in lengths)
    emitted = sum(e for _, e in recorder.batches)
    cpu, wall = np.diff(clock.cpu)[1:], np.diff(clock.wall)[1:]
    steps = len(np.diff(clock.cpu))
    result = {
        "steps": steps,
        "fill": real / emitted,
        "cpu_step_ms": 1e3 * float(np.median(cpu)),
        "wall_step_ms": 1e3 * float(np.median(wall)),
        "real_tokens_per_cpu_s": real * (steps - 1) / steps / float(cpu.sum()),
        "real_tokens_per_s": real * (steps - 1) / steps / float(wall.sum()),
    }
    if profile is not None:
        total = sum(breakdown(profile).values())
        result["parts_ms_per_step"] = {k: 1e3 * v / steps for k, v in sorted(breakdown(profile).items())}
        result["profiled_ms_per_step"] = 1e3 * total / steps
        if args.top:
            print(f"--- {name}: top {args.top} functions by own time")
            pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)
    return result


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=4096)
    parser.add_argument("--samples", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (torch.set_num_threads)"
    )
    parser.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=list(CONTENDERS))
    parser.add_argument("--profile", action="store_true", help="cProfile every run, per-part breakdown")
    parser.add_argument("--top", type=int, default=0, help="with --profile: print the top N functions")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    # what build_model / make_trainer read from bench_trainers' arguments
    vars(args).update(
        preset="tiny", device="cpu", dtype="float32", smoke=False, activation_checkpointing=False
    )
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer("folder")
    samples, vocab = compact_vocabulary(load_samples(tokenizer, args.samples, args.seed, args.budget))
    torch.manual_seed(args.seed)
    reference = build_model(args, vocab, "sdpa")
    config, init = copy.deepcopy(reference.config), copy.deepcopy(reference.state_dict())
    del reference
    print(f"vocabulary {vocab}, {len(samples)} samples, {args.threads} thread(s)")
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in args.contenders}
    for r in range(args.rounds):
        order = args.contenders[r % len(args.contenders) :] + args.contenders[: r % len(args.contenders)]
        for name in order:
            runs[name].append(run(name, config, init, samples, tokenizer, args))
            done = runs[name][-1]
            print(f"round {r + 1} {name}: cpu {done['cpu_step_ms']:.1f} ms/step, wall {done['wall_step_ms']:.1f} "
                  f"ms/step, {done['real_tokens_per_cpu_s']:,.0f} real tokens per CPU s", flush=True)  # fmt: skip
            if "parts_ms_per_step" in done:
                print("   parts (ms/step):", {k: round(v, 1) for k, v in done["parts_ms_per_step"].items()})
    rows = []
    for name, done in runs.items():
        rows.append({
            "contender": name, "steps": done[0]["steps"], "fill": done[0]["fill"],
            "cpu_step_ms": statistics.median(d["cpu_step_ms"] for d in done),
            "cpu_step_ms_spread": (max(d["cpu_step_ms"] for d in done) - min(d["cpu_step_ms"] for d in done))
            / statistics.median(d["cpu_step_ms"] for d in done),
            "wall_step_ms": statistics.median(d["wall_step_ms"] for d in done),
            "real_tokens_per_cpu_s": statistics.median(d["real_tokens_per_cpu_s"] for d in done),
            "real_tokens_per_s": statistics.median(d["real_tokens_per_s"] for d in done),
        })  # fmt: skip
    if "batch_rebalance" in runs:
        base = next(r for r in rows if r["contender"] == "batch_rebalance")
        ideal = base["real_tokens_per_cpu_s"] / base["fill"]
        for r in rows:
            r["vs_ideal_cpu"] = r["real_tokens_per_cpu_s"] / ideal
    print_table(rows, list(rows[0]))
    write_json("profile_trainer_path", {"rows": rows, "runs": runs}, args)


if __name__ == "__main__":
    main()
