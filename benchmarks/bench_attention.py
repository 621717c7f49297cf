"""Packed attention on CPU: stock transformers SDPA (dense (T, T) mask) vs packing_hf varlen attention.

One packed row of T tokens (default 16384) made of 8 samples of unequal length, forward + backward:

- ``layer``: one real ``LlamaAttention`` layer, mask creation included (``create_causal_mask`` with the
  packed ``position_ids``, as the model does). Stock: ``attn_implementation="sdpa"``, which detects the
  packing from ``position_ids`` and builds a dense ``(1, 1, T, T)`` boolean mask. packing_hf: the registered
  implementation (``packing_hf_varlen``) fed the collator's ``cu_seq_lens_q/k``; no mask is built and
  ``varlen_attention`` runs one SDPA call per sample (its "auto" choice on CPU).
- ``model``: a tiny Llama (2 layers) from ``from_config``: forward, next-token loss, backward.

What is measured, per case, in a fresh subprocess (so cases cannot share allocator state):

- time: median wall time of ``--repeat`` forward+backward steps after one warm-up step, and the median
  CPU time of the process (all threads) for the same steps, which a busy shared machine perturbs less;
- peak memory: the resident-set high-water mark (``ru_maxrss``) at the end minus the resident set just
  before the first step, i.e. the extra memory the steps needed at their peak (activations, masks,
  gradients, allocator slack). ``tracemalloc`` does not see torch's allocations, and
  ``torch.profiler``'s memory events would need a replay to find the peak; RSS sees everything the
  process really touched. Each case runs in its own process, so the high-water mark is its own.

Ratios are stock / packing_hf from the same run: time ratio = speedup, memory ratio = memory saved.

Run: ``python benchmarks/bench_attention.py`` (``--quick`` for T=4096 and fewer repeats).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

from _common import base_parser, print_table, write_json

CASES = ("layer", "model")
IMPLEMENTATIONS = ("stock_sdpa", "packing_hf")


def sample_lengths(total: int, n: int) -> list[int]:
    """``n`` unequal lengths summing to ``total`` (a fixed, deterministic spread from 0.5x to 1.5x the mean)."""
    weights = [0.5 + i / (n - 1) for i in range(n)] if n > 1 else [1.0]
    lengths = [max(1, int(total * w / sum(weights))) for w in weights]
    lengths[-1] += total - sum(lengths)
    return lengths


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def build_config(attn_implementation: str):
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        "llama",
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    config._attn_implementation = attn_implementation
    return config


def worker(case: str, implementation: str, total: int, n_samples: int, repeat: int) -> dict:
    """Run one case in this process and return its figures."""
    import torch
    from transformers.masking_utils import create_causal_mask
    from transformers.models.llama.modeling_llama import (
        LlamaAttention,
        LlamaForCausalLM,
        LlamaRotaryEmbedding,
    )

    from packing_hf import register_attention
    from packing_hf.attention import last_backend
    from packing_hf.varlen import lengths_to_cu_seqlens, lengths_to_position_ids

    name = register_attention() if implementation == "packing_hf" else "sdpa"
    lengths = sample_lengths(total, n_samples)
    cu = lengths_to_cu_seqlens(lengths)
    position_ids = lengths_to_position_ids(lengths)[None]  # (1, T)
    packed_kwargs = {}
    if implementation == "packing_hf":  # what PaddingFreeCollator adds to the batch
        packed_kwargs = dict(
            cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths), max_length_k=max(lengths)
        )
    config = build_config(name)
    torch.manual_seed(0)

    if case == "layer":
        layer = LlamaAttention(config, layer_idx=0)
        rotary = LlamaRotaryEmbedding(config)
        hidden = torch.randn(1, total, config.hidden_size, requires_grad=True)
        with torch.no_grad():
            position_embeddings = rotary(hidden, position_ids)

        def step():
            mask = create_causal_mask(
                config=config,
                inputs_embeds=hidden,
                attention_mask=None,
                past_key_values=None,
                position_ids=position_ids,
            )
            out, _ = layer(hidden, position_embeddings, mask, position_ids=position_ids, **packed_kwargs)
            out.sum().backward()
            hidden.grad = None
            layer.zero_grad(set_to_none=True)
            return mask

    else:
        model = LlamaForCausalLM(config).train()
        input_ids = torch.randint(0, config.vocab_size, (1, total))
        labels = input_ids.clone()
        labels[0, cu[:-1].long()] = -100  # no loss across sample boundaries

        def step():
            out = model(
                input_ids=input_ids,
                labels=labels,
                position_ids=position_ids,
                use_cache=False,
                **packed_kwargs,
            )
            out.loss.backward()
            model.zero_grad(set_to_none=True)

    rss_before = current_rss_bytes()
    mask = step()  # warm-up; also tells what mask the stock path built
    times, cpu_times = [], []
    for _ in range(repeat):
        start, cpu_start = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    times.sort()
    cpu_times.sort()
    return {
        "case": case,
        "implementation": implementation,
        "tokens": total,
        "samples": n_samples,
        "median_s": times[len(times) // 2],
        "min_s": times[0],
        "median_cpu_s": cpu_times[len(cpu_times) // 2],
        "peak_mib": (peak_rss_bytes() - rss_before) / 2**20,
        "mask": "none" if mask is None else f"{tuple(mask.shape)} {mask.dtype}" if case == "layer" else "",
        "backend": last_backend() if implementation == "packing_hf" else "torch sdpa (dense mask)",
        "threads": torch.get_num_threads(),
    }


def run_case(case: str, implementation: str, args) -> dict:
    command = [
        sys.executable,
        __file__,
        "--worker",
        f"{case}:{implementation}",
        "--tokens",
        str(args.tokens),
        "--samples",
        str(args.samples),
        "--repeat",
        str(args.repeat),
        "--threads",
        str(args.threads),
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        sys.exit(f"case {case}/{implementation} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=None, help="tokens in the packed row (default 16384)")
    parser.add_argument("--samples", type=int, default=8, help="samples in the packed row")
    parser.add_argument("--repeat", type=int, default=None, help="timed steps per case (default 5, quick 2)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per case (default 1: on a shared machine, a parallel region waits for any "
        "preempted thread, which turns every op into a scheduler time slice and drowns the comparison)",
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.tokens = args.tokens or (4096 if args.quick else 16384)
    args.repeat = args.repeat or (2 if args.quick else 5)

    if args.worker:
        import torch

        torch.set_num_threads(args.threads)
        case, implementation = args.worker.split(":")
        print(json.dumps(worker(case, implementation, args.tokens, args.samples, args.repeat)))
        return

    rows, summary = [], []
    for case in CASES:
        figures = {impl: run_case(case, impl, args) for impl in IMPLEMENTATIONS}
        rows.extend(figures.values())
        stock, ours = figures["stock_sdpa"], figures["packing_hf"]
        summary.append(
            {
                "case": case,
                "stock_ms": 1000 * stock["median_s"],
                "packing_hf_ms": 1000 * ours["median_s"],
                "speedup": stock["median_s"] / ours["median_s"],
                "cpu_speedup": stock["median_cpu_s"] / ours["median_cpu_s"],
                "stock_peak_mib": stock["peak_mib"],
                "packing_hf_peak_mib": ours["peak_mib"],
                "memory_ratio": stock["peak_mib"] / max(ours["peak_mib"], 1e-9),
            }
        )
    print(
        f"T={args.tokens} tokens in {args.samples} samples, forward+backward, CPU, {rows[0]['threads']} threads"
    )
    print_table(rows, ["case", "implementation", "median_s", "median_cpu_s", "peak_mib", "mask", "backend"])
    print()
    print_table(
        summary,
        [
            "case",
            "stock_ms",
            "packing_hf_ms",
            "speedup",
            "cpu_speedup",
            "stock_peak_mib",
            "packing_hf_peak_mib",
            "memory_ratio",
        ],
    )
    write_json("bench_attention", {"rows": rows, "summary": summary}, args)


if __name__ == "__main__":
    main()
