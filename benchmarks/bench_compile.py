"""Compiled vs eager packed training steps on CPU (tiny Llama, 49k vocabulary, GSM8K rows).

Contenders, each with its own copy of the same initial model and its own AdamW, fed the same packed batches
(``PaddingFreeCollator``, about ``--tokens`` tokens per step, GSM8K rows in shuffled order so every step has
a new total length, sample count and longest sample):

- ``eager``: packing_hf attention, backend ``auto`` (on CPU: one SDPA call per segment);
- ``eager_padded``: the same with backend ``sdpa_padded`` (the layout a compiled graph uses, run eagerly);
- ``compiled``: ``torch.compile(model)`` (inductor, default automatic dynamic shapes), backend ``auto``
  (which, under compile, runs the padded layout: no host read, no graph break).

A second table counts dynamo graphs over ``--recompile-steps`` (50) packed batches of random shape (1 to 8
samples of 3 to 40 tokens, a 1-layer model, dynamo only): default automatic dynamic shapes,
``dynamic=True``, ``dynamic=False``, each with and without ``PaddingFreeCollator(pad_to_multiple_of=64)``.

The first ``--warmup`` steps of every contender are timed apart (compilation and recompilation live there);
then ``--steps`` steps are timed interleaved (eager, eager_padded, compiled on the same batch, in turn), so
load from other processes hits every contender alike. The losses of the contenders are compared step by
step (exactness of the compiled path), and dynamo's graph count tells how often it compiled.

    python benchmarks/bench_compile.py            # ~10 min on 2 CPU cores
    python benchmarks/bench_compile.py --quick    # a smoke run
"""

from __future__ import annotations

import copy
import itertools
import random
import statistics
import time

import torch
from _common import base_parser, gsm8k_token_ids, load_tokenizer, print_table, write_json

from packing_hf import PaddingFreeCollator, register_attention


def make_model(vocab: int, seed: int):
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
        use_cache=False,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation=register_attention()).float()


def packed_batches(rows: list[list[int]], tokens: int, count: int, seed: int) -> list[dict]:
    """``count`` packed batches of at most ``tokens`` tokens, rows drawn in a shuffled order."""
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    collator = PaddingFreeCollator()
    batches, current, used = [], [], 0
    for i in order:
        row = rows[i]
        if used + len(row) > tokens and current:
            batches.append(collator(current))
            if len(batches) == count:
                break
            current, used = [], 0
        current.append({"input_ids": row})
        used += len(row)
    return batches


class Contender:
    def __init__(self, name: str, model, backend: str, compile_model: bool) -> None:
        self.name, self.backend = name, backend
        self.model = model
        self.forward = torch.compile(model) if compile_model else model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        self.losses: list[float] = []
        self.times: list[float] = []
        self.cpu_times: list[float] = []

    def step(self, batch: dict) -> float:
        # the backend is a module-level setting of the registered attention: set it for this contender
        # (the compiled one always runs with "auto", so its guards never see a change)
        register_attention(self.backend)
        start, cpu_start = time.perf_counter(), time.process_time()
        loss = self.forward(**batch).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - start
        self.cpu_times.append(time.process_time() - cpu_start)
        self.losses.append(float(loss.detach()))
        return elapsed


def count_graphs(steps: int) -> list[dict]:
    """Dynamo graphs built over ``steps`` packed batches of random shape, per compile mode and bucketing."""
    from torch._dynamo.utils import counters
    from transformers import AutoConfig, AutoModelForCausalLM

    rows = []
    for dynamic, pad in itertools.product((None, True, False), (None, 64)):
        torch._dynamo.reset()
        counters.clear()
        rng = random.Random(0)
        config = AutoConfig.for_model(
            "llama", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, use_cache=False,
        )  # fmt: skip
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=register_attention())
        compiled = torch.compile(model, backend="eager", dynamic=dynamic)
        collator = PaddingFreeCollator(pad_to_multiple_of=pad)
        lengths = set()
        for _ in range(steps):
            features = [
                {"input_ids": [rng.randrange(1, 128) for _ in range(rng.randint(3, 40))]}
                for _ in range(rng.randint(1, 8))
            ]
            batch = collator(features)
            lengths.add(batch["input_ids"].shape[1])
            compiled(**batch).loss.backward()
        rows.append(
            {
                "dynamic": {None: "auto (default)", True: "True", False: "False"}[dynamic],
                "pad_to_multiple_of": pad or "-",
                "distinct_T": len(lengths),
                "graphs": counters["stats"]["unique_graphs"],
                # dynamo gives up compiling a frame after config.recompile_limit graphs and runs it eagerly
                "hit_recompile_limit": counters["stats"]["unique_graphs"]
                >= torch._dynamo.config.recompile_limit,
            }
        )
    return rows


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per packed step")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per contender")
    parser.add_argument(
        "--warmup", type=int, default=3, help="untimed-apart steps (compilation) per contender"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument(
        "--recompile-steps", type=int, default=50, help="batches of the graph count (0: skip)"
    )
    args = parser.parse_args()
    steps = args.steps or (4 if args.quick else 30)
    if args.threads:
        torch.set_num_threads(args.threads)

    from torch._dynamo.utils import counters

    tokenizer = load_tokenizer()
    rows = gsm8k_token_ids("train", limit=1500 if args.quick else 4000, tokenizer=tokenizer)
    batches = packed_batches(rows, args.tokens, args.warmup + steps, seed=0)
    if len(batches) < args.warmup + steps:
        raise SystemExit(f"only {len(batches)} batches of {args.tokens} tokens; lower --steps or --tokens")
    base = make_model(len(tokenizer), seed=0)
    contenders = [
        Contender("eager", copy.deepcopy(base), "auto", compile_model=False),
        Contender("eager_padded", copy.deepcopy(base), "sdpa_padded", compile_model=False),
        Contender("compiled", copy.deepcopy(base), "auto", compile_model=True),
    ]
    torch._dynamo.reset()
    counters.clear()

    warmup_s = {c.name: 0.0 for c in contenders}
    for batch in batches[: args.warmup]:
        for c in contenders:
            warmup_s[c.name] += c.step(batch)
    graphs_after_warmup = counters["stats"]["unique_graphs"]
    for batch in batches[args.warmup :]:
        for c in contenders:
            c.times.append(c.step(batch))
    graphs = counters["stats"]["unique_graphs"]

    eager = contenders[0]
    eager_ms = statistics.median(eager.times) * 1e3
    timed = batches[args.warmup :]
    mean_tokens = statistics.mean(b["input_ids"].shape[1] for b in timed)
    out_rows = []
    for c in contenders:
        median_ms = statistics.median(c.times) * 1e3
        cpu_ms = statistics.median(c.cpu_times[args.warmup :]) * 1e3
        eager_cpu_ms = statistics.median(eager.cpu_times[args.warmup :]) * 1e3
        loss_diff = max(abs(a - b) for a, b in zip(c.losses, eager.losses, strict=True))
        out_rows.append(
            {
                "contender": c.name,
                "step_ms": round(median_ms, 1),
                "min_ms": round(min(c.times) * 1e3, 1),
                "speed_vs_eager": round(eager_ms / median_ms, 3),
                # CPU time (all threads) is the steadier figure on a machine shared with other jobs
                "cpu_ms": round(cpu_ms, 1),
                "cpu_speed_vs_eager": round(eager_cpu_ms / cpu_ms, 3),
                "tokens_per_s": round(mean_tokens / (median_ms / 1e3)),
                "warmup_s": round(warmup_s[c.name], 1),
                "max_loss_diff_vs_eager": float(f"{loss_diff:.2e}"),
            }
        )
    print_table(
        out_rows,
        [
            "contender",
            "step_ms",
            "min_ms",
            "speed_vs_eager",
            "cpu_ms",
            "cpu_speed_vs_eager",
            "tokens_per_s",
            "warmup_s",
            "max_loss_diff_vs_eager",
        ],
    )
    lengths = [b["input_ids"].shape[1] for b in batches]
    samples = [b["cu_seq_lens_q"].numel() - 1 for b in batches]
    print(
        f"{len(batches)} steps of {min(lengths)}..{max(lengths)} tokens, {min(samples)}..{max(samples)} samples; "
        f"dynamo graphs: {graphs_after_warmup} after the warmup, {graphs} after all steps"
    )
    graph_rows = count_graphs(args.recompile_steps) if args.recompile_steps else []
    if graph_rows:
        print(f"\ndynamo graphs over {args.recompile_steps} packed batches of random shape")
        print_table(
            graph_rows, ["dynamic", "pad_to_multiple_of", "distinct_T", "graphs", "hit_recompile_limit"]
        )
    write_json(
        "compile",
        {
            "rows": out_rows,
            "graphs_by_mode": graph_rows,
            "recompile_steps": args.recompile_steps,
            "steps": steps,
            "warmup_steps": args.warmup,
            "tokens_per_step": args.tokens,
            "step_tokens": lengths,
            "step_samples": samples,
            "dynamo_graphs_after_warmup": graphs_after_warmup,
            "dynamo_graphs_total": graphs,
            "threads": torch.get_num_threads(),
        },
        args,
    )


if __name__ == "__main__":
    main()
