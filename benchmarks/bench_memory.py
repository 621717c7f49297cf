"""Peak memory and tokens/s of one packed training step (forward + backward) on CPU: the chunked LM head
(``packing_hf.loss_head``, what the packing trainers use by default) against the model's own full-logits loss.

The model is a small llama (hidden size 256, 2 layers, packing_hf's varlen attention) with the SmolLM2
vocabulary (49,152) or a Qwen-sized one (151,936), so the head dominates the step as it does on real models.
One row packs GSM8K samples (SmolLM2 tokenizer) to 4,096 or 16,384 tokens, every sample's first label masked
as the collator does.

How memory is measured: every (contender, size) runs in a fresh subprocess; the step's peak is the process's
maximum resident set (``resource.getrusage(RUSAGE_SELF).ru_maxrss``) after the steps minus the resident set
just before the first step (model, optimizer-free parameters and the batch already built): what the step adds.
The contenders alternate (chunked, full, chunked, full, ...), so the machine's load hits both alike; tokens/s is
the median over the timed steps of every run. A full-logits run whose fp32 logits, their log-softmax and
gradients (4 x tokens x vocabulary x 4 bytes) would exceed half the available memory (``--memory-share``) is
skipped, and said so.

On a GPU (``--device cuda``) the step's peak is ``torch.cuda.max_memory_allocated()`` during the steps minus what
was allocated before the first (the model and the batch), and the process peak is the whole maximum; a run that
runs out of GPU memory is reported as such. ``--shape qwen3-0.6b`` builds a Qwen3-0.6B-shaped model (28 layers,
hidden 1,024, random init) instead of the small one, to measure what a real model's step needs.

    python benchmarks/bench_memory.py            # 4,096 and 16,384 tokens, both vocabularies
    python benchmarks/bench_memory.py --quick    # 1,024 tokens, smoke run
    python benchmarks/bench_memory.py --device cuda --dtype bfloat16 --shape qwen3-0.6b --vocabs qwen_152k \
        --tokens 8192 16384 32768
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time

from _common import base_parser, gsm8k_token_ids, print_table, write_json

VOCABS = {"smollm2_49k": 49152, "qwen_152k": 151936}
HIDDEN, LAYERS = 256, 2
SHAPES = {
    "small": dict(
        model_type="llama", hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    ),
    "qwen3-0.6b": dict(
        model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
    ),
}  # fmt: skip


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def worker(
    mode: str,
    vocab: int,
    tokens: int,
    steps: int,
    device: str,
    dtype: str,
    shape: str,
    chunk_tokens: int | None,
) -> dict:
    """One contender at one size in this process: ``{step_peak_bytes, process_peak_bytes, tokens_per_s}``, or
    ``{"out_of_memory": ...}`` when a GPU step does not fit."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import packing_hf
    from packing_hf.integrations.chunked_head import causal_lm_loss

    torch.manual_seed(0)
    fields = dict(SHAPES[shape])
    config = AutoConfig.for_model(fields.pop("model_type"), vocab_size=vocab, use_cache=False, **fields)
    with torch.device(device):  # initialised where it runs (a 0.6B model's init on the host takes a while)
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation=packing_hf.register_attention(), dtype=getattr(torch, dtype)
        )
    samples, total = [], 0
    for ids in gsm8k_token_ids(limit=4 * tokens // 100):
        ids = ids[: tokens - total]
        samples.append({"input_ids": ids, "labels": list(ids)})
        total += len(ids)
        if total == tokens:
            break
    if total != tokens:
        raise ValueError(f"not enough GSM8K tokens for a {tokens}-token row (got {total})")
    batch = packing_hf.PaddingFreeCollator()(samples)
    inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items() if k != "labels"}
    labels = batch["labels"].to(device)
    cuda = device == "cuda"

    def step() -> None:
        if mode == "full":
            loss = model(**inputs, labels=labels).loss  # the model's own: (tokens, vocab) logits, upcast
        else:
            total, stats, _ = causal_lm_loss(model, inputs, labels, chunk_size=chunk_tokens)
            loss = total / stats.count
        loss.backward()
        model.zero_grad(set_to_none=True)

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else _rss_bytes()
    times = []
    try:
        step()  # warm-up (its peak counts: it is the same step)
        for _ in range(steps):
            start = time.perf_counter()
            step()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    except torch.OutOfMemoryError as error:
        return {"out_of_memory": str(error).splitlines()[0]}
    if cuda:
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    return {
        "step_peak_bytes": peak - before,
        "process_peak_bytes": peak,
        "tokens_per_s": tokens / statistics.median(times),
    }


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1, help="alternating runs of each contender per size")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per run (after one warm-up step)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384], help="packed row lengths")
    parser.add_argument(
        "--memory-share",
        type=float,
        default=0.5,
        help="skip a full-logits run needing more of the available memory",
    )
    parser.add_argument(
        "--vocabs", nargs="+", default=list(VOCABS), choices=list(VOCABS), help="vocabularies"
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--shape", choices=list(SHAPES), default="small", help="model shape (random init)")
    parser.add_argument(
        "--chunk-tokens", type=int, default=None, help="the chunked head's chunk (default: automatic)"
    )
    parser.add_argument(
        "--worker", nargs=4, metavar=("MODE", "VOCAB", "TOKENS", "STEPS"), help=argparse_hide()
    )
    args = parser.parse_args()
    if args.worker:
        mode, vocab, tokens, steps = args.worker
        result = worker(
            mode, int(vocab), int(tokens), int(steps), args.device, args.dtype, args.shape, args.chunk_tokens
        )
        print(json.dumps(result))
        return
    sizes = [1024] if args.quick else args.tokens
    rows = []
    for vocab_name in args.vocabs:
        vocab = VOCABS[vocab_name]
        for tokens in sizes:
            runs: dict[str, list[dict]] = {"chunked": [], "full": []}
            skipped = None
            for _ in range(args.rounds):
                for mode in ("chunked", "full"):
                    need = 4 * tokens * vocab * 4
                    host = args.device == "cpu"
                    if host and mode == "full" and need > _available_bytes() * args.memory_share:
                        skipped = f"full logits need ~{need / 2**30:.1f} GiB, {_available_bytes() / 2**30:.1f} available"
                        continue
                    command = [
                        sys.executable,
                        __file__,
                        "--worker",
                        mode,
                        str(vocab),
                        str(tokens),
                        str(args.steps),
                        *("--device", args.device, "--dtype", args.dtype, "--shape", args.shape),
                        *(("--chunk-tokens", str(args.chunk_tokens)) if args.chunk_tokens else ()),
                    ]
                    done = subprocess.run(command, capture_output=True, text=True)
                    if done.returncode != 0:
                        print(done.stderr[-3000:], file=sys.stderr)
                        raise SystemExit(f"the {mode} run at {tokens} tokens failed (its error is above)")
                    result = json.loads(done.stdout.strip().splitlines()[-1])
                    if "out_of_memory" in result:
                        skipped = f"{mode}: out of memory ({result['out_of_memory'][:80]})"
                        continue
                    runs[mode].append(result)
            row = {"vocab": vocab_name, "tokens": tokens}
            for mode, results in runs.items():
                if results:
                    row[f"{mode}_peak_GiB"] = max(r["step_peak_bytes"] for r in results) / 2**30
                    row[f"{mode}_process_GiB"] = max(r["process_peak_bytes"] for r in results) / 2**30
                    row[f"{mode}_tok_s"] = statistics.median(r["tokens_per_s"] for r in results)
            if runs["full"]:
                row["peak_ratio"] = row["full_peak_GiB"] / row["chunked_peak_GiB"]
                row["speed_ratio"] = row["chunked_tok_s"] / row["full_tok_s"]
            if skipped:
                row["note"] = skipped
            rows.append(row)
            print(json.dumps(row), flush=True)
    print_table(
        rows,
        ["vocab", "tokens", "chunked_peak_GiB", "full_peak_GiB", "peak_ratio", "chunked_process_GiB",
         "full_process_GiB", "chunked_tok_s", "full_tok_s", "speed_ratio", "note"],
    )  # fmt: skip
    load = os.getloadavg()
    print(f"load average while running (1/5/15 min): {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    name = "memory" if args.device == "cpu" else f"memory_{args.device}_{args.shape}"
    write_json(
        name, {"rows": rows, "load_average": load, "shape": SHAPES[args.shape], "dtype": args.dtype}, args
    )


def argparse_hide() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
