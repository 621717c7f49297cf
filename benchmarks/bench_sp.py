"""Sequence parallelism (Ulysses) over one packed row: per-rank peak memory and step time at sp = 1, 2, 4.

One packed row of 16,384 tokens (samples of a few hundred to a few thousand tokens, several cut by shard
edges), a Llama-shaped model from config (hidden 512, 8 query / 4 key-value heads, the SmolLM2 vocabulary of
49,152), fp32 on CPU, gloo. Each sp runs in ``sp`` fresh processes (spawned: nothing shared); a step is the
forward of the rank's shard, :func:`packing_hf.attention.sequence_parallel.sequence_parallel_loss`, the backward and the gradient
all-reduce DDP would do. sp = 1 is the baseline: the same row on one process through the same code.

Memory is the process's resident set (RSS, Linux ``ru_maxrss``): CPU tensors have no allocator statistics.
``step_peak_mib`` is the peak during the steps above the resident set just before the first step (model,
gradients from no earlier step, the row); ``resident_mib`` the resident set before the step (parameters,
libraries: replicated on every rank). Step time is the slowest rank's last step (``--steps 2``, the default:
the first warms up; ``--steps 1`` times a cold step).

    python benchmarks/bench_sp.py            # sp = 1, 2, 4 (minutes on a loaded 2-core machine)
    python benchmarks/bench_sp.py --quick    # a 2,048-token row, a smoke run
"""

from __future__ import annotations

import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import base_parser, environment, print_table, write_json  # noqa: E402

VOCAB = 49_152
HIDDEN = 512
SIZES = (1, 2, 4)


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _row(tokens: int):
    import torch

    from packing_hf import PaddingFreeCollator

    generator = torch.Generator().manual_seed(0)
    samples, left = [], tokens
    while left > 0:
        length = min(left, int(torch.randint(300, 3000, (1,), generator=generator)))
        ids = torch.randint(1, VOCAB, (length,), generator=generator).tolist()
        samples.append({"input_ids": ids, "labels": ids})
        left -= length
    return PaddingFreeCollator()(samples)


def _rank(rank: int, size: int, port: int, tokens: int, layers: int, steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    from packing_hf import register_attention
    from packing_hf.attention.sequence_parallel import sequence_parallel_loss, shard_packed_batch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    config = AutoConfig.for_model(
        "llama", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=tokens,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=register_attention()).float().train()
    row = _row(tokens)
    resident = _rss_mib()
    times, loss_value = [], 0.0
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        shard = shard_packed_batch(row)
        logits = model(**shard).logits
        loss = sequence_parallel_loss(logits, shard)
        del logits
        loss.backward()
        for param in model.parameters():  # what DDP does: the group's gradients summed
            dist.all_reduce(param.grad)
        dist.barrier()
        times.append(time.perf_counter() - start)
        total = loss.detach().double()
        dist.all_reduce(total)
        loss_value = float(total)
        model.zero_grad(set_to_none=True)
    record = torch.tensor([_peak_mib() - resident, resident, times[-1], loss_value], dtype=torch.float64)
    everyone = [torch.zeros_like(record) for _ in range(size)]
    dist.all_gather(everyone, record)
    if rank == 0:
        torch.save(torch.stack(everyone), out)
    dist.destroy_process_group()


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=None, help="row length (default 16,384; --quick 2,048)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2, help="steps per sp (the last is timed)")
    args = parser.parse_args()
    tokens = args.tokens or (2048 if args.quick else 16_384)

    import socket
    import tempfile

    import torch
    import torch.multiprocessing as mp

    rows = []
    baseline = None
    with tempfile.TemporaryDirectory() as folder:
        for size in SIZES:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
            out = os.path.join(folder, f"sp{size}.pt")
            mp.start_processes(
                _rank,
                args=(size, port, tokens, args.layers, args.steps, out),
                nprocs=size,
                start_method="spawn",
            )
            ranks = torch.load(out)  # (size, 4): step peak, resident, step seconds, loss
            peak = float(ranks[:, 0].max())
            seconds = float(ranks[:, 2].max())
            if baseline is None:
                baseline = (peak, seconds)
            rows.append(
                {
                    "sp": size,
                    "tokens_per_rank": -(-tokens // size),
                    "step_peak_mib": round(peak),
                    "peak_vs_sp1": round(peak / baseline[0], 3),
                    "resident_mib": round(float(ranks[:, 1].max())),
                    "step_s": round(seconds, 2),
                    "time_vs_sp1": round(seconds / baseline[1], 3),
                    "loss": round(float(ranks[0, 3]), 6),
                }
            )
    columns = [
        "sp",
        "tokens_per_rank",
        "step_peak_mib",
        "peak_vs_sp1",
        "resident_mib",
        "step_s",
        "time_vs_sp1",
    ]
    print_table(rows, [*columns, "loss"])
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs")
    payload = {"tokens": tokens, "hidden": HIDDEN, "vocab": VOCAB, "layers": args.layers, "steps": args.steps}
    payload["rows"] = rows
    payload.update(load_average=load, environment=environment())
    write_json("bench_sp", payload, args)


if __name__ == "__main__":
    main()
