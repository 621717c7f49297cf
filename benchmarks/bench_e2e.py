"""End-to-end training throughput: padded batches, transformers' and TRL's padding-free collators, TRL's bfd
packing and packing_hf, on the same samples from the same initial weights, interleaved.

Every contender trains its own copy of one randomly initialised model (the same weights), with its own AdamW,
for one epoch over the same samples (real data from ``../shared/data``: GSM8K train, GPTeacher, Alpaca-GPT4,
SmolLM2 tokenizer, Alpaca template + answer + EOS, shuffled once) at a budget of ``--budget`` tokens per step:

- ``padded``: batches of the largest size whose worst case fits the budget (``budget // longest sample``, how
  a user sizes ``per_device_train_batch_size`` so no step runs out of memory), right-padded, sdpa with an
  attention mask;
- ``hf_flattening``: the same batches through ``transformers.DataCollatorWithFlattening`` (one row,
  ``position_ids``), sdpa;
- ``trl_padding_free``: the same batches through TRL's ``DataCollatorForLanguageModeling(padding_free=True)``,
  sdpa;
- ``trl_bfd``: TRL's ``pack_dataset(strategy="bfd")`` rows of ``budget`` tokens in a random order, one row
  per step, TRL's padding-free collator, sdpa;
- ``hf_group_by_length``: the padded batches of ``padded``'s size in the order of transformers'
  ``LengthGroupedSampler`` (``train_sampling_strategy="group_by_length"``, the old ``group_by_length=True``: the
  samples shuffled, mega-batches of 50 batches each sorted by length), right-padded, sdpa;
- ``hf_batch_rebalance``: transformers' ``BatchRebalanceSampler`` (``train_sampling_strategy="batch_rebalance"``)
  on one device, 4 padded micro-batches per optimizer step (gradient accumulation), the most samples per step for
  which every micro-batch fits the budget padded (searched on its own plan), sdpa;
- ``packing_hf``: ``MultipackBatchSampler(budget)`` + ``PaddingFreeCollator`` + packing_hf's attention + its
  chunked LM head (the packing trainers' default; ``--loss-head model`` takes the model's own full-logits loss).

Every contender is thus sized to the same peak memory: no micro-batch holds more than ``budget`` tokens, padding
included. Per contender the batching figures of ``_common.batching_statistics`` (real tokens per step: min /
median / max and CV; the largest padded micro-batch over the budget; how mixed the steps are against random
steps: ``mixing_ratio``, the correlation of a step's mean length with its position and with the next step's) and
the measured memory per step (CUDA: ``max_memory_allocated``; CPU: the growth of the process's peak resident
memory in the step), median and max over the steps. ``--mix`` picks the data (``_common.MIXES``).

``--threads`` (default 1 on CPU, torch's own on CUDA; see bench_trainers.py), the load average at start and end
and the cores go into the JSON; beside real tokens per wall second, per CPU second (``time.process_time`` over the
same spans); ``vs_ideal`` / ``vs_ideal_cpu`` of packing_hf against ``hf_batch_rebalance``'s tokens/s over its
real-token share, when both ran.

Steps are interleaved (the contender furthest behind in its epoch goes next), so load from other processes
hits all alike. Every epoch's batches are collated before the clock starts (collation costs well under 1% of a
step: benchmarks/bench_collator.py). Reported: real tokens per second over the epoch (forward + backward +
optimizer step; the padded contenders' padding does not count as tokens), steps, the emitted tokens per step (with
padding) and, on CUDA, the peak memory of each contender's steps (on CPU: the largest step in tokens). A contender
that runs out of GPU memory stops there and is reported as such; the others go on.

Presets: ``tiny`` (2-layer Llama, hidden 64, the vocabulary remapped to the ids the data uses, for CPU),
``small`` (the same, hidden 256: the width of a real model's attention heads' sum, still CPU-sized),
``smollm2-135m``, ``qwen3-0.6b`` and ``llama-1b`` (the shapes of those models, random init, for a GPU).

    python benchmarks/bench_e2e.py --device cpu --preset tiny --samples 600     # ~5 min on 2 busy cores
    python benchmarks/bench_e2e.py --device cuda --preset smollm2-135m --dtype bfloat16
"""

from __future__ import annotations

import copy
import time
from typing import Any

import numpy as np
import torch
from _common import (
    StepPeak,
    add_mix_and_memory_arguments,
    add_threads_argument,
    batching_row,
    batching_statistics,
    compact_vocabulary,
    equal_memory_batch_size,
    load_average,
    load_tokenizer,
    mix_token_ids,
    print_table,
    rebalance_equal_memory,
    rebalance_micro_batches,
    set_threads,
    spread_stats,
    vs_ideal,
    write_json,
)

import packing_hf
from packing_hf import PaddingFreeCollator
from packing_hf.flops import batch_sample_lengths
from packing_hf.integrations.chunked_head import causal_lm_loss
from packing_hf.sampler import MultipackBatchSampler

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        model_type="llama", hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True,
    ),
    "small": dict(  # width 256 (issue 49: a model wider than tiny that a CPU still trains in minutes)
        model_type="llama", hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True,
    ),
    "smollm2-135m": dict(
        model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, tie_word_embeddings=True, vocab_size=49152, rope_theta=100000.0,
    ),
    "qwen3-0.6b": dict(
        model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, vocab_size=151936,
    ),
    "llama-1b": dict(
        model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, tie_word_embeddings=True, vocab_size=128256, rope_theta=500000.0,
    ),
}  # fmt: skip
CONTENDERS = (
    "padded",
    "hf_flattening",
    "trl_padding_free",
    "trl_bfd",
    "hf_group_by_length",
    "hf_batch_rebalance",
    "packing_hf",
)
COMPACT = ("tiny", "small")  # presets whose vocabulary is the ids the data uses, renumbered (CPU)
REBALANCE_MICRO_BATCHES = 4
BATCHING_COLUMNS = ["contender", "tok_step_med", "tok_step_min", "tok_step_max", "tok_step_cv", "padded_max/budget",
                    "mixing_ratio", "position_corr", "lag1_autocorr", "peak_mib_med", "peak_mib_max"]  # fmt: skip


def parse_args():
    from _common import base_parser

    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--preset", choices=tuple(PRESETS), default="tiny")
    parser.add_argument("--budget", type=int, default=4096, help="tokens per step (per device)")
    parser.add_argument(
        "--samples", type=int, default=600, help="samples in the epoch every contender trains"
    )
    parser.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=list(CONTENDERS))
    parser.add_argument("--seed", type=int, default=0)
    add_mix_and_memory_arguments(parser)
    parser.add_argument(
        "--loss-head",
        choices=("chunked", "model"),
        default="chunked",
        help="packing_hf's loss: its chunked LM head (the packing trainers' default) or the model's own logits",
    )
    add_threads_argument(parser)
    args = parser.parse_args()
    if args.quick:
        args.samples = min(args.samples, 120)
    return args


def load_samples(n: int, seed: int, budget: int, mix: str = "blend") -> list[list[int]]:
    # blend: none is longer than 1k tokens, its cut only guards small budgets; the other mixes refuse one
    return mix_token_ids(mix, load_tokenizer(), n, seed, budget)


def build_model(preset: str, vocab: int, dtype: torch.dtype, device: str, attn: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(PRESETS[preset])
    model_type = fields.pop("model_type")
    fields.setdefault("vocab_size", vocab)
    config = AutoConfig.for_model(model_type, use_cache=False, **fields)
    with torch.device(device):  # initialised where it trains (a 1B model's init on the host takes a while)
        return AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype).train()


def padded(rows: list[list[int]]) -> dict[str, torch.Tensor]:
    longest = max(map(len, rows))
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, x in enumerate(rows):
        ids[r, : len(x)] = torch.tensor(x)
        mask[r, : len(x)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def epoch_batches(name: str, samples: list[list[int]], budget: int, seed: int) -> list[list[dict[str, Any]]]:
    """The collated batches of one epoch of a contender: per optimizer step, its micro-batches (one, except
    ``hf_batch_rebalance``'s gradient accumulation)."""
    from transformers import DataCollatorWithFlattening
    from transformers.trainer_pt_utils import get_length_grouped_indices
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    lengths = np.array([len(x) for x in samples])
    batch_size = equal_memory_batch_size(
        lengths, budget
    )  # the largest batch whose worst case fits the budget
    order = np.random.default_rng(seed).permutation(len(samples))
    groups = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    trl_collator = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)
    if name == "padded":
        return [[padded([samples[i] for i in g])] for g in groups]
    if (
        name == "hf_group_by_length"
    ):  # the Trainer's LengthGroupedSampler order, cut into batches as its loader
        grouped = get_length_grouped_indices(
            lengths.tolist(), batch_size, generator=torch.Generator().manual_seed(seed)
        )
        return [
            [padded([samples[i] for i in grouped[k : k + batch_size]])]
            for k in range(0, len(grouped), batch_size)
        ]
    if name == "hf_batch_rebalance":
        micro = REBALANCE_MICRO_BATCHES
        effective = rebalance_equal_memory(lengths.tolist(), budget, micro)
        plan = rebalance_micro_batches(lengths.tolist(), effective, micro)
        return [
            [padded([samples[i] for i in b]) for b in plan[k : k + micro]] for k in range(0, len(plan), micro)
        ]
    if name == "hf_flattening":
        collate = DataCollatorWithFlattening(return_position_ids=True)
        return [[collate([{"input_ids": samples[i]} for i in g])] for g in groups]
    if name == "trl_padding_free":
        return [[trl_collator([{"input_ids": samples[i]} for i in g])] for g in groups]
    if name == "trl_bfd":
        import datasets
        from trl.data_utils import pack_dataset

        rows = pack_dataset(
            datasets.Dataset.from_dict({"input_ids": samples}), budget, strategy="bfd"
        ).to_list()
        shuffled = np.random.default_rng(seed).permutation(len(rows))
        return [[trl_collator([rows[i]])] for i in shuffled]
    sampler = MultipackBatchSampler(lengths, budget, seed=seed)
    collate = PaddingFreeCollator()
    return [[collate([{"input_ids": samples[i]} for i in b])] for b in sampler]


def moved(batch: dict[str, Any], device: str) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def real_tokens(batch: dict[str, Any]) -> int:
    """The batch's tokens without padding (a padded batch's attention mask; a packed row is all real)."""
    mask = batch.get("attention_mask")
    return int(mask.sum()) if mask is not None else int(batch["input_ids"].numel())


class Contender:
    def __init__(
        self,
        name: str,
        model,
        steps: list[list[dict[str, Any]]],
        device: str,
        chunked: bool,
        cpu_memory: bool = True,
    ) -> None:
        self.name, self.model, self.batches, self.device = name, model, steps, device
        self.chunked = (
            chunked  # the loss through packing_hf's chunked LM head (the packing trainers' default)
        )
        self.out_of_memory = None
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.done = 0
        self.seconds = 0.0
        self.cpu_seconds = 0.0  # the process's CPU time in the same spans (every thread's)
        self.real_tokens = 0
        self.emitted = []  # per micro-batch, padding included
        self.peak_bytes = 0
        self.step_peaks: list[int] = []  # CUDA: max_memory_allocated in the step; CPU: peak resident growth
        self.meter = StepPeak(device, cpu_memory)

    def step(self) -> None:
        step = [moved(batch, self.device) for batch in self.batches[self.done]]
        self.meter.start()
        start, cpu_start = time.perf_counter(), time.process_time()
        try:
            for batch in step:  # gradient accumulation over the step's micro-batches (one but for rebalance)
                (self.loss(batch) / len(step)).backward()
        except torch.OutOfMemoryError as error:
            self.out_of_memory = str(error).splitlines()[0]
            self.optimizer.zero_grad(set_to_none=True)
            return
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        peak = self.meter.stop()
        if peak is not None:
            self.step_peaks.append(peak)
            if self.device == "cuda":
                self.peak_bytes = max(self.peak_bytes, peak)
        self.seconds += time.perf_counter() - start
        self.cpu_seconds += time.process_time() - cpu_start
        for batch in self.batches[self.done]:
            self.real_tokens += real_tokens(batch)
            self.emitted.append(int(batch["input_ids"].numel()))
        self.done += 1

    def loss(self, batch: dict[str, Any]) -> torch.Tensor:
        if not self.chunked:
            return self.model(**batch).loss
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        total, stats, _ = causal_lm_loss(self.model, inputs, batch["labels"])
        return total / stats.count  # the token mean, as the model's own loss

    @property
    def running(self) -> bool:
        return self.out_of_memory is None and self.done < len(self.batches)

    def batching(self, budget: int) -> dict[str, Any]:
        steps = [
            [(batch_sample_lengths(b), int(b["input_ids"].numel())) for b in step] for step in self.batches
        ]
        return batching_statistics(steps, budget)


def main() -> None:
    args = parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible")
    load_start = load_average()
    threads = set_threads(args.threads, args.device)  # before any model is built
    dtype = getattr(torch, args.dtype)
    samples = load_samples(args.samples, args.seed, args.budget, args.mix)
    vocab = None
    if args.preset in COMPACT:  # the ids the data uses, renumbered: a small LM head for a CPU run
        samples, vocab = compact_vocabulary(samples)
    torch.manual_seed(args.seed)
    reference = build_model(args.preset, vocab or 49152, dtype, args.device, "sdpa")
    init = copy.deepcopy(reference.state_dict())
    packed_attention = packing_hf.register_attention()
    contenders = []
    for name in args.contenders:
        model = build_model(
            args.preset,
            vocab or 49152,
            dtype,
            args.device,
            packed_attention if name == "packing_hf" else "sdpa",
        )
        model.load_state_dict(init)
        batches = epoch_batches(name, samples, args.budget, args.seed)
        chunked = name == "packing_hf" and args.loss_head == "chunked"
        contenders.append(Contender(name, model, batches, args.device, chunked, args.cpu_memory))
    del reference
    real_total = sum(map(len, samples))
    for c in contenders:  # one untimed warm-up step each (kernels, allocator): its gradients are dropped
        try:
            for batch in c.batches[0]:
                c.loss(moved(batch, args.device)).backward()
        except torch.OutOfMemoryError as error:
            c.out_of_memory = str(error).splitlines()[0]
        c.model.zero_grad(set_to_none=True)
    while any(c.running for c in contenders):
        behind = min((c for c in contenders if c.running), key=lambda c: c.done / len(c.batches))
        behind.step()
    rows, batching = [], []
    for c in contenders:
        figures = c.batching(args.budget)
        if c.out_of_memory is not None:
            print(
                f"{c.name}: out of memory at step {c.done + 1} of {len(c.batches)} ({c.out_of_memory[:120]})"
            )
            rows.append({"contender": c.name, "steps": len(c.batches), "out_of_memory": c.out_of_memory})
            continue
        if c.real_tokens != real_total:  # the same samples, each once
            raise RuntimeError(
                f"{c.name} trained on {c.real_tokens} real tokens, the epoch holds {real_total}"
            )
        # memory per step after the first (the optimizer's state is allocated in the first)
        peaks = spread_stats(c.step_peaks[1:] or c.step_peaks) if c.step_peaks else None
        rows.append(
            {
                "contender": c.name,
                "steps": len(c.batches),
                "tokens_per_s": c.real_tokens / c.seconds,
                "tokens_per_cpu_s": c.real_tokens / c.cpu_seconds,
                "mean_step_tokens": float(np.mean(c.emitted)),
                "max_step_tokens": max(c.emitted),
                "fill": c.real_tokens / sum(c.emitted),
                "epoch_s": c.seconds,
                "peak_mem_gib": c.peak_bytes / 2**30 if args.device == "cuda" else None,
                "step_peak_mem_mib": {k: v / 2**20 for k, v in peaks.items()} if peaks else None,
                "batching": figures,
            }
        )
        batching.append(
            batching_row(
                c.name,
                figures,
                BATCHING_COLUMNS,
                peak_mib_med=peaks["median"] / 2**20 if peaks else None,
                peak_mib_max=peaks["max"] / 2**20 if peaks else None,
            )
        )
    load_end = load_average()
    peers = [r["tokens_per_s"] for r in rows if r["contender"] != "packing_hf" and "tokens_per_s" in r]
    for r in rows:
        if peers and "tokens_per_s" in r:
            r["vs_best_peer"] = r["tokens_per_s"] / max(peers)
    ran = {r["contender"]: r for r in rows if "tokens_per_s" in r}
    if "packing_hf" in ran and "hf_batch_rebalance" in ran:  # ideal: rebalance's tokens/s / real-token share
        ours, base = ran["packing_hf"], ran["hf_batch_rebalance"]
        ours["vs_ideal"] = vs_ideal(ours["tokens_per_s"], base["tokens_per_s"], base["fill"])
        ours["vs_ideal_cpu"] = vs_ideal(ours["tokens_per_cpu_s"], base["tokens_per_cpu_s"], base["fill"])
    print(
        f"\n== {args.preset} ({args.dtype}, {args.device}), mix {args.mix}, budget {args.budget} tokens/step, "
        f"{len(samples)} samples ({real_total:,} tokens), one epoch per contender, interleaved, "
        f"{threads['threads']} thread(s) on {threads['cpu_count']} cores =="
    )
    print_table(
        rows,
        ["contender", "steps", "tokens_per_s", "tokens_per_cpu_s", "vs_best_peer", "vs_ideal", "vs_ideal_cpu", "mean_step_tokens", "max_step_tokens", "fill", "epoch_s", "peak_mem_gib"],
    )  # fmt: skip
    print(
        "\n== batching (real tokens per step, padded max over the budget, mixing) and memory per step, MiB =="
    )
    print_table(batching, BATCHING_COLUMNS)
    name = f"bench_e2e_{args.preset}_{args.device}" + (
        f"_{args.mix}_{args.budget}" if args.mix != "blend" else ""
    )
    print(f"load average at start {load_start}, at end {load_end} (1, 5, 15 min)")
    payload = {
        "rows": rows,
        "batching": batching,
        "real_tokens": real_total,
        "threads": threads,
        "load_average": {"start": load_start, "end": load_end},
    }
    write_json(name, payload, args)


if __name__ == "__main__":
    main()
