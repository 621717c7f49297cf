"""Hybrid models on CPU: packed rows (mixers split per sample) vs padded batches of the same samples.

Three small hybrids built from their transformers configs (hidden 256, 4 layers, the SmolLM2 vocabulary):
Qwen3.5-text (gated DeltaNet + attention), Bamba (Mamba2 + attention) and LFM2 (short convolutions +
attention), transformers' torch paths (no CUDA kernel). Each step trains on GSM8K samples filling a
budget of ``--tokens`` tokens (default 4096), forward + next-token loss + backward, three ways:

- ``packed``: one ``[1, T]`` row from ``PaddingFreeCollator``, the model prepared by
  ``packing_hf.prepare_model_for_packing`` (every mixer runs on the row's samples as a right-padded
  batch, attention within each sample): exact;
- ``padded``: the same samples as a right-padded ``(n, L)`` batch with an attention mask (what one trains
  without packing);
- ``packed_leak``: the same packed row with the per-sample split turned off (``split_mixers = False``):
  the mixers run over the whole row, samples leak into each other. Not a valid way to train; it is the
  floor, what a packed row costs without the boundary resets.

Timing: the three contenders run interleaved on the same steps (``compare_calls``), wall clock, median.
Figures: real (non-padding) tokens per second, the packed / padded speedup, and what the resets cost
(packed / packed_leak time). Peak memory: each (model, contender) runs a few steps in a fresh
subprocess; the figure is the resident-set high-water mark minus the resident set before the first step.

Run: ``python benchmarks/bench_hybrid.py`` (``--quick``: fewer steps and repeats).
"""

from __future__ import annotations

import json
import subprocess
import sys

from _common import base_parser, compare_calls, gsm8k_token_ids, load_tokenizer, print_table, write_json

MODELS = ("qwen3_5_text", "bamba", "lfm2")
CONTENDERS = ("packed", "padded", "packed_leak")
HIDDEN = 256


def model_config(model_type: str, vocab_size: int):
    """A 4-layer, 256-wide config of ``model_type`` with both of its layer kinds (mixer and attention)."""
    from packing_hf.architectures import tiny_config

    common = dict(
        hidden_size=HIDDEN,
        intermediate_size=4 * HIDDEN,
        vocab_size=vocab_size,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=HIDDEN // 4,
    )
    if model_type == "qwen3_5_text":
        return tiny_config(
            model_type,
            **common,
            layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            linear_num_key_heads=4,
            linear_num_value_heads=8,
            linear_key_head_dim=32,
            linear_value_head_dim=32,
        )
    if model_type == "bamba":
        return tiny_config(
            model_type,
            **common,
            attn_layer_indices=[3],
            mamba_n_heads=8,
            mamba_d_head=64,
            mamba_d_state=32,
            mamba_chunk_size=64,
        )
    if model_type == "lfm2":
        return tiny_config(
            model_type,
            **common,
            block_ff_dim=4 * HIDDEN,
            layer_types=["conv", "conv", "full_attention", "conv"],
            full_attn_idxs=[2],
        )
    raise ValueError(f"unknown model {model_type!r}; choose from {MODELS}")


def build(model_type: str, vocab_size: int):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config(model_type, vocab_size), attn_implementation="sdpa")
    return model.float().train()


def steps_of(samples: list[list[int]], tokens: int, steps: int) -> list[list[list[int]]]:
    """``steps`` consecutive groups of samples, each filling at most ``tokens`` tokens."""
    out, current, used = [], [], 0
    for sample in samples:
        sample = sample[:tokens]
        if used + len(sample) > tokens:
            out.append(current)
            current, used = [], 0
            if len(out) == steps:
                break
        current.append(sample)
        used += len(sample)
    return out


def batches(group: list[list[int]]):
    """The packed row and the right-padded batch of the same samples (labels -100 on padding)."""
    import torch

    from packing_hf import PaddingFreeCollator

    packed = PaddingFreeCollator()([{"input_ids": s} for s in group])
    longest = max(len(s) for s in group)
    ids = torch.zeros(len(group), longest, dtype=torch.long)
    mask = torch.zeros(len(group), longest, dtype=torch.long)
    for i, s in enumerate(group):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return packed, {"input_ids": ids, "attention_mask": mask, "labels": labels}


def step_fn(model, handle, contender: str, packed: dict, padded: dict):
    def step():
        model.zero_grad(set_to_none=True)
        if contender == "padded":
            loss = model(**padded, use_cache=False).loss
        else:
            handle.split_mixers = contender == "packed"
            loss = model(**packed).loss
        loss.backward()

    return step


def run_steps(model, handle, contender: str, prepared: list):
    """One call running every step of ``prepared`` (packed, padded) batches for ``contender``."""
    fns = [step_fn(model, handle, contender, p, q) for p, q in prepared]
    return lambda: [fn() for fn in fns]


def memory_case(model_type: str, contender: str, groups: list[list[list[int]]], vocab_size: int) -> int:
    """Peak extra resident memory (bytes) of a few steps of one contender, in this (fresh) process."""
    from packing_hf import prepare_model_for_packing

    model = build(model_type, vocab_size)
    handle = prepare_model_for_packing(model)
    steps = [batches(group) for group in groups]
    # ru_maxrss is the process's lifetime peak, which reading and tokenizing the data may set: reset the
    # high-water mark (Linux: "5" > clear_refs) so VmHWM holds the peak of the steps alone
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_bytes("VmRSS")
    for packed, padded in steps:
        step_fn(model, handle, contender, packed, padded)()
    return _status_bytes("VmHWM") - before


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def main() -> int:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per step (default 4096)")
    parser.add_argument("--steps", type=int, default=None, help="distinct steps (default 4, quick 2)")
    parser.add_argument("--repeat", type=int, default=None, help="timed rounds (default 5, quick 2)")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    parser.add_argument("--memory-case", default="", help=argparse_hidden())
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    steps = args.steps or (2 if args.quick else 4)
    repeat = args.repeat or (2 if args.quick else 5)
    tokenizer = load_tokenizer()
    vocab_size = len(tokenizer)
    samples = gsm8k_token_ids("train", limit=40 * steps * max(1, args.tokens // 1024), tokenizer=tokenizer)
    groups = steps_of(samples, args.tokens, steps)

    if args.memory_case:  # child process: one (model, contender), print its peak memory
        model_type, contender = args.memory_case.split(":")
        print(json.dumps({"peak_bytes": memory_case(model_type, contender, groups, vocab_size)}))
        return 0

    from packing_hf import prepare_model_for_packing

    rows = []
    for model_type in args.models.split(","):
        model = build(model_type, vocab_size)
        handle = prepare_model_for_packing(model)
        prepared = [batches(g) for g in groups]
        real = sum(len(s) for g in groups for s in g)
        padded_slots = sum(b[1]["input_ids"].numel() for b in prepared)

        stats = compare_calls(
            {c: run_steps(model, handle, c, prepared) for c in CONTENDERS}, repeat=repeat, warmup=1
        )
        handle.revert()
        row = {
            "model": model_type,
            "params_M": sum(p.numel() for p in model.parameters()) / 1e6,
            "steps": len(groups),
            "samples": sum(len(g) for g in groups),
            "real_tokens": real,
            "padded_fill": real / padded_slots,
        }
        for c in CONTENDERS:
            row[f"{c}_tok_s"] = real / stats[c]["median"]
            row[f"{c}_s"] = stats[c]["median"]
        row["packed_vs_padded"] = stats["padded"]["median"] / stats["packed"]["median"]
        row["reset_cost"] = stats["packed"]["median"] / stats["packed_leak"]["median"]
        if not args.no_memory:
            for c in CONTENDERS:
                out = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--memory-case",
                        f"{model_type}:{c}",
                        "--tokens",
                        str(args.tokens),
                        "--steps",
                        str(min(steps, 2)),
                        "--threads",
                        str(args.threads),
                    ],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                row[f"{c}_peak_MiB"] = json.loads(out.stdout.strip().splitlines()[-1])["peak_bytes"] / 2**20
        rows.append(row)
        print(f"{model_type}: done", file=sys.stderr)

    columns = ["model", "params_M", "samples", "real_tokens", "padded_fill"]
    columns += [f"{c}_tok_s" for c in CONTENDERS] + ["packed_vs_padded", "reset_cost"]
    if not args.no_memory:
        columns += [f"{c}_peak_MiB" for c in CONTENDERS]
    print_table(rows, columns)
    print(
        "packed_vs_padded = padded time / packed time (same samples, >1: packing is faster); reset_cost = "
        "packed time / packed_leak time (what the per-sample boundary resets cost over the leaking floor)"
    )
    write_json("bench_hybrid", {"rows": rows}, args)
    return 0


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    raise SystemExit(main())
