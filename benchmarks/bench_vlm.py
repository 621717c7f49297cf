"""A vision-language model trained packed vs padded: real tokens per second and peak memory, CPU.

The model is a tiny Qwen2-VL (``packing_hf.architectures.tiny_config("qwen2_vl")`` widened to
``--hidden``), sdpa attention, fp32. Every sample is one GSM8K question + answer (SmolLM2 tokenizer, ids
folded into the tiny vocabulary) with one synthetic image of a random size: a grid of 4x4 to 16x16 patches,
i.e. 4 to 64 image tokens after the 2x2 merge, random ``pixel_values`` of the right shape, placeholders
expanded, so every sample's length is its true sequence length.

- ``packed``: ``MultipackBatchSampler`` (``--budget`` tokens per batch) + ``MultimodalCollator``, the model
  loaded with packing_hf's varlen attention and prepared by ``prepare_model_for_packing`` (mRoPE positions
  computed per sample); the same initial weights as ``padded``;
- ``padded``: the same samples in the same seeded order, ``--batch-size`` per batch, right-padded with an
  ``attention_mask`` (the model computes its own mRoPE positions): what a plain VLM SFT loop does.

One epoch of forward + backward + SGD step over the same samples is one round; contenders alternate
round by round (interleaved), and the median round time gives real tokens/s (padding not counted). Peak
memory: each contender runs one epoch in a fresh subprocess that builds only its own batches; the
resident-set high-water mark is reset just before the epoch (Linux ``clear_refs``) and the epoch's peak
minus the resident set before it is reported (RSS sees torch's allocations, tracemalloc does not).

    python benchmarks/bench_vlm.py            # default sizes
    python benchmarks/bench_vlm.py --quick    # smoke run
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

import numpy as np
import torch
from _common import base_parser, gsm8k_token_ids, print_table, write_json

from packing_hf import (
    ATTENTION_NAME,
    MultimodalCollator,
    MultipackBatchSampler,
    prepare_model_for_packing,
    register_attention,
)
from packing_hf.architectures import tiny_config
from packing_hf.multimodal import mm_token_types

VOCAB_FOLD = 480  # tiny vocabulary 512; its special / image ids sit above 490


def build_model(hidden: int, layers: int, attn_implementation: str = "sdpa"):
    from transformers import AutoModelForImageTextToText

    config = tiny_config("qwen2_vl")
    config.text_config.hidden_size = hidden
    config.text_config.intermediate_size = 4 * hidden
    config.text_config.num_hidden_layers = layers
    config.text_config.num_attention_heads = hidden // 16  # head_dim 16: the tiny mRoPE sections
    config.text_config.layer_types = ["full_attention"] * layers
    config.vision_config.hidden_size = hidden  # Qwen2-VL: the tower's output width
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, attn_implementation=attn_implementation).float()
    return model.train()


def build_samples(model, count: int, seed: int = 0) -> list[dict]:
    config, vision = model.config, model.config.vision_config
    patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    rng = np.random.default_rng(seed)
    samples = []
    for ids in gsm8k_token_ids("train", count):
        h, w = (2 * rng.integers(2, 9, size=2)).tolist()  # 4..16 patches a side
        text = [t % VOCAB_FOLD for t in ids]
        cut = min(len(text), int(rng.integers(5, 40)))  # the image sits inside the question
        image = [config.image_token_id] * (h * w // vision.spatial_merge_size**2)
        samples.append(
            {
                "input_ids": text[:cut] + image + text[cut:],
                "pixel_values": torch.from_numpy(rng.standard_normal((h * w, patch), dtype=np.float32)),
                "image_grid_thw": torch.tensor([[1, h, w]]),
            }
        )
    return samples


def padded_batches(model, samples: list[dict], batch_size: int) -> list[dict]:
    batches = []
    image_token = model.config.image_token_id
    for start in range(0, len(samples), batch_size):
        chunk = samples[start : start + batch_size]
        longest = max(len(s["input_ids"]) for s in chunk)
        ids = torch.zeros(len(chunk), longest, dtype=torch.long)
        mask = torch.zeros(len(chunk), longest, dtype=torch.long)
        labels = torch.full((len(chunk), longest), -100)
        for i, s in enumerate(chunk):
            n = len(s["input_ids"])
            ids[i, :n] = torch.tensor(s["input_ids"])
            mask[i, :n] = 1
            labels[i, :n] = ids[i, :n]
        batches.append(
            {
                "input_ids": ids,
                "attention_mask": mask,
                "labels": labels,
                "mm_token_type_ids": mm_token_types(ids, image_token),
                "pixel_values": torch.cat([s["pixel_values"] for s in chunk]),
                "image_grid_thw": torch.cat([s["image_grid_thw"] for s in chunk]),
                "use_cache": False,
            }
        )
    return batches


def packed_batches(samples: list[dict], budget: int) -> list[dict]:
    sampler = MultipackBatchSampler(
        [len(s["input_ids"]) for s in samples], max_tokens_per_batch=budget, seed=0
    )
    collator = MultimodalCollator()
    return [collator([samples[i] for i in indices]) for indices in sampler]


def run_epoch(model, batches: list[dict], optimizer) -> float:
    start = time.perf_counter()
    for batch in batches:
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def setup(args, which=("padded", "packed")):
    """The two contenders: the same weights, sdpa for the padded batches, packing_hf's varlen attention
    (prepared) for the packed rows."""
    register_attention()
    models = {
        "padded": build_model(args.hidden, args.layers),
        "packed": build_model(args.hidden, args.layers, ATTENTION_NAME),
    }
    samples = build_samples(models["padded"], args.samples)
    makers = {
        "padded": lambda: padded_batches(models["padded"], samples, args.batch_size),
        "packed": lambda: packed_batches(samples, args.budget),
    }
    return models, samples, {name: makers[name]() for name in which}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def memory_child(args) -> None:
    """One epoch of one contender in this fresh process; prints the extra resident memory its epoch needed.

    The resident-set high-water mark is reset just before the epoch (``/proc/self/clear_refs``, Linux), so
    the peak is the epoch's own (activations, gradients, masks), not the setup's (tokenizer, data)."""
    models, _, batches = setup(args, (args.memory_of,))
    model = models[args.memory_of]
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    handle = prepare_model_for_packing(model)
    run_epoch(model, batches[args.memory_of][:1], optimizer)  # optimizer state and allocator warmed up
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident set
    before = _status_kib("VmRSS")
    run_epoch(model, batches[args.memory_of], optimizer)
    peak = _status_kib("VmHWM")
    handle.revert()
    print(json.dumps({"peak_mib": (peak - before) / 1024}))


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--budget", type=int, default=2048, help="packed: tokens per batch")
    parser.add_argument("--batch-size", type=int, default=8, help="padded: samples per batch")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--memory-of", choices=["packed", "padded"], default=None, help=argparse_hidden())
    args = parser.parse_args()
    if args.quick:
        args.samples, args.rounds = 24, 2
    if args.memory_of:
        memory_child(args)
        return
    torch.set_num_threads(1)
    models, samples, batches = setup(args)
    real = sum(len(s["input_ids"]) for s in samples)
    slots = {
        "padded": sum(b["input_ids"].numel() for b in batches["padded"]),
        "packed": sum(b["input_ids"].numel() for b in batches["packed"]),
    }
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=1e-4) for name, m in models.items()}
    handles = [
        prepare_model_for_packing(m) for m in models.values()
    ]  # padded calls pass its guards unchanged
    times = {"padded": [], "packed": []}
    for name in ("padded", "packed"):  # warm-up
        run_epoch(models[name], batches[name][:1], optimizers[name])
    for _ in range(args.rounds):
        for name in ("padded", "packed"):
            times[name].append(run_epoch(models[name], batches[name], optimizers[name]))
    for handle in handles:
        handle.revert()

    memory = {}
    for name in ("padded", "packed"):
        command = [sys.executable, __file__, "--memory-of", name, *_forwarded(args)]
        out = (
            subprocess.run(command, capture_output=True, text=True, check=True)
            .stdout.strip()
            .splitlines()[-1]
        )
        memory[name] = json.loads(out)["peak_mib"]

    rows = []
    for name in ("padded", "packed"):
        median = statistics.median(times[name])
        rows.append(
            {
                "contender": name,
                "batches": len(batches[name]),
                "token_slots": slots[name],
                "real_tokens": real,
                "epoch_s": median,
                "real_tokens_per_s": real / median,
                "peak_mib": memory[name],
            }
        )
    speedup = statistics.median(times["padded"]) / statistics.median(times["packed"])
    print_table(
        rows,
        ["contender", "batches", "token_slots", "real_tokens", "epoch_s", "real_tokens_per_s", "peak_mib"],
    )
    print(f"packed / padded real tokens/s: {speedup:.2f}x; peak memory padded / packed: "
          f"{memory['padded'] / max(memory['packed'], 1e-9):.2f}x")  # fmt: skip
    write_json("bench_vlm", {"rows": rows, "speedup": speedup, "times": times}, args)


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


def _forwarded(args) -> list[str]:
    return [
        f"--samples={args.samples}",
        f"--budget={args.budget}",
        f"--batch-size={args.batch_size}",
        f"--hidden={args.hidden}",
        f"--layers={args.layers}",
    ]


if __name__ == "__main__":
    main()
