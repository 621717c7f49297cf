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
- ``packing_hf``: ``MultipackBatchSampler(budget)`` + ``PaddingFreeCollator`` + packing_hf's attention + its
  chunked LM head (the packing trainers' default; ``--loss-head model`` takes the model's own full-logits loss).

Steps are interleaved (the contender furthest behind in its epoch goes next), so load from other processes
hits all alike. Every epoch's batches are collated before the clock starts (collation costs well under 1% of a
step: benchmarks/bench_collator.py). Reported: real tokens per second over the epoch (forward + backward +
optimizer step; the padded contenders' padding does not count as tokens), steps, the emitted tokens per step (with
padding) and, on CUDA, the peak memory of each contender's steps (on CPU: the largest step in tokens). A contender
that runs out of GPU memory stops there and is reported as such; the others go on.

Presets: ``tiny`` (2-layer Llama, hidden 64, the vocabulary remapped to the ids the data uses, for CPU),
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
from _common import compact_vocabulary, load_tokenizer, print_table, write_json

import packing_hf
from packing_hf import PaddingFreeCollator
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
CONTENDERS = ("padded", "hf_flattening", "trl_padding_free", "trl_bfd", "packing_hf")


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
    parser.add_argument(
        "--loss-head",
        choices=("chunked", "model"),
        default="chunked",
        help="packing_hf's loss: its chunked LM head (the packing trainers' default) or the model's own logits",
    )
    args = parser.parse_args()
    if args.quick:
        args.samples = min(args.samples, 120)
    return args


def load_samples(n: int, seed: int, budget: int) -> list[list[int]]:
    from bench_sampler import alpaca_text, real_datasets

    tokenizer = load_tokenizer()
    records = [r for rows in real_datasets(False).values() for r in rows]
    order = np.random.default_rng(seed).permutation(len(records))[:n]
    ids = tokenizer([alpaca_text(records[i], tokenizer.eos_token) for i in order])["input_ids"]
    return [x[:budget] for x in ids]  # none is longer than 1k tokens; the cut only guards small budgets


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


def epoch_batches(name: str, samples: list[list[int]], budget: int, seed: int) -> list[dict[str, Any]]:
    """The collated batches of one epoch of a contender."""
    from transformers import DataCollatorWithFlattening
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    lengths = np.array([len(x) for x in samples])
    batch_size = max(1, budget // int(lengths.max()))  # the largest batch whose worst case fits the budget
    order = np.random.default_rng(seed).permutation(len(samples))
    groups = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    trl_collator = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)
    if name == "padded":
        return [padded([samples[i] for i in g]) for g in groups]
    if name == "hf_flattening":
        collate = DataCollatorWithFlattening(return_position_ids=True)
        return [collate([{"input_ids": samples[i]} for i in g]) for g in groups]
    if name == "trl_padding_free":
        return [trl_collator([{"input_ids": samples[i]} for i in g]) for g in groups]
    if name == "trl_bfd":
        import datasets
        from trl.data_utils import pack_dataset

        rows = pack_dataset(
            datasets.Dataset.from_dict({"input_ids": samples}), budget, strategy="bfd"
        ).to_list()
        shuffled = np.random.default_rng(seed).permutation(len(rows))
        return [trl_collator([rows[i]]) for i in shuffled]
    sampler = MultipackBatchSampler(lengths, budget, seed=seed)
    collate = PaddingFreeCollator()
    return [collate([{"input_ids": samples[i]} for i in b]) for b in sampler]


class Contender:
    def __init__(self, name: str, model, batches: list[dict[str, Any]], device: str, chunked: bool) -> None:
        self.name, self.model, self.batches, self.device = name, model, batches, device
        self.chunked = (
            chunked  # the loss through packing_hf's chunked LM head (the packing trainers' default)
        )
        self.out_of_memory = None
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.done = 0
        self.seconds = 0.0
        self.real_tokens = 0
        self.emitted = []
        self.peak_bytes = 0

    def step(self) -> None:
        batch = self.batches[self.done]
        moved = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        try:
            self.loss(moved).backward()
        except torch.OutOfMemoryError as error:
            self.out_of_memory = str(error).splitlines()[0]
            self.optimizer.zero_grad(set_to_none=True)
            return
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.device == "cuda":
            torch.cuda.synchronize()
            self.peak_bytes = max(self.peak_bytes, torch.cuda.max_memory_allocated())
        self.seconds += time.perf_counter() - start
        labels_or_ids = batch["attention_mask"] if "attention_mask" in batch else None
        self.real_tokens += (
            int(labels_or_ids.sum()) if labels_or_ids is not None else int(batch["input_ids"].numel())
        )
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


def main() -> None:
    args = parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible")
    dtype = getattr(torch, args.dtype)
    samples = load_samples(args.samples, args.seed, args.budget)
    vocab = None
    if args.preset == "tiny":  # the ids the data uses, renumbered: a small LM head for a CPU run
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
        contenders.append(Contender(name, model, batches, args.device, chunked))
    del reference
    real_total = sum(map(len, samples))
    for c in contenders:  # one untimed warm-up step each (kernels, allocator): its gradients are dropped
        batch = {k: v.to(args.device) if isinstance(v, torch.Tensor) else v for k, v in c.batches[0].items()}
        try:
            c.loss(batch).backward()
        except torch.OutOfMemoryError as error:
            c.out_of_memory = str(error).splitlines()[0]
        c.model.zero_grad(set_to_none=True)
    while any(c.running for c in contenders):
        behind = min((c for c in contenders if c.running), key=lambda c: c.done / len(c.batches))
        behind.step()
    rows = []
    for c in contenders:
        if c.out_of_memory is not None:
            print(
                f"{c.name}: out of memory at step {c.done + 1} of {len(c.batches)} ({c.out_of_memory[:120]})"
            )
            rows.append({"contender": c.name, "steps": len(c.batches), "out_of_memory": c.out_of_memory})
            continue
        assert c.real_tokens == real_total, (c.name, c.real_tokens, real_total)  # the same samples, each once
        rows.append(
            {
                "contender": c.name,
                "steps": len(c.batches),
                "tokens_per_s": c.real_tokens / c.seconds,
                "mean_step_tokens": float(np.mean(c.emitted)),
                "max_step_tokens": max(c.emitted),
                "fill": c.real_tokens / sum(c.emitted),
                "epoch_s": c.seconds,
                "peak_mem_gib": c.peak_bytes / 2**30 if args.device == "cuda" else None,
            }
        )
    peers = [r["tokens_per_s"] for r in rows if r["contender"] != "packing_hf" and "tokens_per_s" in r]
    for r in rows:
        if peers and "tokens_per_s" in r:
            r["vs_best_peer"] = r["tokens_per_s"] / max(peers)
    print(
        f"\n== {args.preset} ({args.dtype}, {args.device}), budget {args.budget} tokens/step, {len(samples)} samples "
        f"({real_total:,} tokens), one epoch per contender, interleaved =="
    )
    print_table(
        rows,
        ["contender", "steps", "tokens_per_s", "vs_best_peer", "mean_step_tokens", "max_step_tokens", "fill", "epoch_s", "peak_mem_gib"],
    )  # fmt: skip
    write_json(f"bench_e2e_{args.preset}_{args.device}", {"rows": rows, "real_tokens": real_total}, args)


if __name__ == "__main__":
    main()
