"""Cost-balanced vs token-balanced multipack, measured: a 2-process gloo run and an 8-rank simulation.

Data: long-tail lengths built from the real samples of ``../shared/data`` (multi-turn "conversations" of real
samples, see ``bench_cost.long_tail_lengths``), capped at the budget; token ids are random (a 512-id
vocabulary: the ids do not change the time of a step). Model: a tiny Llama (``from_config``) with packing_hf's
attention. The cost model is fitted on that model first (:func:`packing_hf.fit_cost_model`, not cached), so
the plan balances the time this model really takes.

1. *2 processes (gloo, CPU)*: each balance trains its own copy of the same initial weights, the two runs
   interleaved epoch by epoch (``--epochs``, each cut to ``--steps`` steps). Per step every rank times its
   forward + backward (its compute), then the gradients are all-reduced and AdamW steps. Reported per balance:
   the slowest rank's lead per step (``max - min`` of the ranks' compute: what the faster rank waits),
   as a mean in ms and as a share of the step, by the wall clock and by CPU time (one thread per rank: the
   CPU time is the work itself, which a shared machine's load does not inflate), and real tokens/s of the
   whole run (wall clock, all ranks).
2. *8 ranks, simulated*: every batch of one epoch of both 8-rank plans (as many batches, grouped into steps
   and evened out within a step by tokens or by cost) is timed on its own (forward + backward, one thread,
   CPU time, fastest of two; one with ``--quick``), then both plans are replayed from those times: the epoch
   lasts ``sum over steps of the slowest rank's time``.

    python benchmarks/bench_balance_ddp.py            # ~6 min on 2 busy CPU cores
    python benchmarks/bench_balance_ddp.py --quick
"""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import base_parser, print_table, write_json

from packing_hf import PaddingFreeCollator, fit_cost_model, register_attention
from packing_hf.cost import rank_cost_spread
from packing_hf.sampler import MultipackBatchSampler

VOCAB = 512
BALANCES = ("tokens", "cost")


def tiny_model(seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation=register_attention()).train()


def token_ids(lengths: np.ndarray, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, int(n)).tolist() for n in lengths]


def compute_seconds(model, batch) -> tuple[float, float]:
    """Wall and CPU seconds of a forward + backward (one thread: the CPU time is the work, whatever the load)."""
    wall, cpu = time.perf_counter(), time.process_time()
    model(**batch).loss.backward()
    return time.perf_counter() - wall, time.process_time() - cpu


def worker(rank: int, world: int, init_file: str, lengths, budget, cost, epochs, steps, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    ids = token_ids(lengths)
    collate = PaddingFreeCollator()
    runs = {}
    for balance in BALANCES:
        model = tiny_model()
        sampler = MultipackBatchSampler(
            lengths, budget, num_replicas=world, rank=rank, seed=0, balance=balance, cost_model=cost
        )
        runs[balance] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4), sampler)
    computes = {b: [] for b in BALANCES}
    walls = dict.fromkeys(BALANCES, 0.0)
    for epoch in range(epochs):
        for balance, (model, optimizer, sampler) in runs.items():
            sampler.set_epoch(epoch)
            dist.barrier()
            start = time.perf_counter()
            for i, batch_ids in enumerate(sampler):
                if i == steps:
                    break
                batch = collate([{"input_ids": ids[j]} for j in batch_ids])
                computes[balance].append(compute_seconds(model, batch))
                for p in model.parameters():  # what DDP does after the backward: every rank waits here
                    dist.all_reduce(p.grad)
                    p.grad /= world
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            dist.barrier()
            walls[balance] += time.perf_counter() - start
    table = torch.tensor([computes[b] for b in BALANCES], dtype=torch.float64)  # (2, steps, wall / cpu)
    gathered = [torch.zeros_like(table) for _ in range(world)]
    dist.all_gather(gathered, table)
    if rank == 0:
        queue.put({"computes": torch.stack(gathered).numpy(), "walls": walls})
    dist.destroy_process_group()


def two_processes(lengths, budget, cost, epochs, steps) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as folder:
        init_file = os.path.join(folder, "init")
        procs = [
            ctx.Process(target=worker, args=(r, 2, init_file, lengths, budget, cost, epochs, steps, queue))
            for r in range(2)
        ]
        for p in procs:
            p.start()
        result = queue.get(timeout=3600)
        for p in procs:
            p.join()
    computes = result["computes"]  # (ranks, balances, steps, wall / cpu)
    rows = []
    for index, balance in enumerate(BALANCES):
        # every rank's batches of the steps run (shard=False: step-major, batch i is rank i % 2's)
        everything = MultipackBatchSampler(
            lengths, budget, num_replicas=2, shard=False, seed=0, balance=balance, cost_model=cost
        )
        real_tokens = 0
        for epoch in range(epochs):
            everything.set_epoch(epoch)
            real_tokens += sum(int(lengths[b].sum()) for i, b in enumerate(everything) if i < 2 * steps)
        row = {"balance": balance, "steps": int(computes.shape[2])}
        for clock, which in (("wall", 0), ("cpu", 1)):
            times = computes[:, index, :, which].T  # (steps, ranks)
            lead = times.max(axis=1) - times.min(axis=1)
            row[f"lead_ms_{clock}"] = 1e3 * float(lead.mean())
            row[f"lead_share_{clock}"] = float(lead.sum() / times.max(axis=1).sum())
            row[f"max_over_mean_{clock}"] = rank_cost_spread(times)
        rows.append(
            {
                **row,
                "wall_s": result["walls"][balance],
                "real_tokens": real_tokens,
                "tokens_per_s": real_tokens / result["walls"][balance],
            }
        )
    return rows


def simulated(lengths, budget, cost, ranks: int, passes: int) -> dict:
    torch.set_num_threads(1)  # CPU time of one thread: the work of a batch, steady under load
    model = tiny_model()
    ids = token_ids(lengths)
    collate = PaddingFreeCollator()
    plans = {
        b: MultipackBatchSampler(
            lengths, budget, num_replicas=ranks, shard=False, seed=0, balance=b, cost_model=cost
        )
        for b in BALANCES
    }
    seconds = {}
    # both plans have as many batches, but cost balance moves samples between the batches of a step:
    # every batch of either plan is timed (once when both have it)
    for batch_ids in [b for plan in plans.values() for b in plan]:
        key = frozenset(batch_ids)
        if key in seconds:
            continue
        batch = collate([{"input_ids": ids[j]} for j in batch_ids])
        seconds[key] = min(compute_seconds(model, batch)[1] for _ in range(passes))
        model.zero_grad(set_to_none=True)
    out = {"ranks": ranks, "batches": len(plans["tokens"]), "batches_timed": len(seconds)}
    for balance, plan in plans.items():
        batches = list(plan)
        times = np.array([seconds[frozenset(b)] for b in batches]).reshape(-1, ranks)  # (steps, ranks)
        out[f"{balance}_epoch_s"] = float(times.max(axis=1).sum())
        out[f"{balance}_max_over_mean"] = rank_cost_spread(times)
        predicted = np.array([cost.batch_cost(lengths[b]) for b in batches]).reshape(-1, ranks)
        out[f"{balance}_predicted_max_over_mean"] = rank_cost_spread(predicted)
    out["speedup"] = out["tokens_epoch_s"] / out["cost_epoch_s"]
    return out


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=600)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60, help="steps per epoch of the 2-process run")
    args = parser.parse_args()
    if args.quick:
        args.samples, args.epochs, args.steps = 120, 1, 12
    from bench_cost import long_tail_lengths, real_turn_lengths

    lengths = np.minimum(long_tail_lengths(real_turn_lengths(), args.samples, seed=3), args.budget)
    print(
        f"{lengths.size} long-tail samples capped at {args.budget}: median {np.median(lengths):.0f}, "
        f"mean {lengths.mean():.0f}, at the cap {(lengths == args.budget).sum()}"
    )
    start = time.perf_counter()
    cost = fit_cost_model(tiny_model(), args.budget, repeats=1 if args.quick else 3, cache=False)
    print(f"fitted in {time.perf_counter() - start:.1f} s: {cost}")
    rows = two_processes(lengths, args.budget, cost, args.epochs, args.steps)
    print(
        f"\n== 2 processes (gloo, 1 thread each), {args.epochs} epoch(s) x {args.steps} steps, interleaved =="
    )
    print_table(rows, ["balance", "steps", "lead_ms_wall", "lead_share_wall", "lead_ms_cpu", "lead_share_cpu", "max_over_mean_cpu", "real_tokens", "wall_s", "tokens_per_s"])  # fmt: skip
    print(
        f"tokens/s cost-balanced vs token-balanced: {rows[1]['tokens_per_s'] / rows[0]['tokens_per_s']:.3f}x"
    )
    sim = simulated(lengths, args.budget, cost, 8, passes=1 if args.quick else 2)
    print("\n== 8 ranks simulated from the measured time of every batch of an epoch ==")
    print_table([sim], list(sim))
    write_json(
        "bench_balance_ddp", {"cost_model": str(cost), "two_processes": rows, "simulated_8": sim}, args
    )


if __name__ == "__main__":
    main()
