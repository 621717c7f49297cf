"""Sequence parallelism (Ulysses) inside FSDP2, inside DeepSpeed ZeRO-3 and beside DDP: per-process peak memory and
step time.

Each configuration is ``world`` fresh processes (spawned: nothing shared) training one AdamW step of a
Llama-shaped model from config, fp32, with ``dp = world / sp`` data-parallel replicas, each holding one packed
row of ``--tokens`` tokens cut over its ``sp`` processes
(:func:`packing_hf.attention.sequence_parallel.shard_packed_batch`, the Ulysses all-to-alls in packing_hf's
attention), the loss from the chunked LM head on the shard
(:func:`~packing_hf.shard_loss.sequence_parallel_chunked_loss`), the loss contract's
``"token"`` denominator all-reduced over the step. The engines, in the same run:

- ``ddp``: ``DistributedDataParallel`` over every process: weights, gradients (and DDP's gradient buckets) and
  AdamW's two moments replicated on every process;
- ``fsdp2``: torch's ``fully_shard`` of every decoder layer and of the input embeddings, then of the root (the
  final norm and ``lm_head``, kept gathered after the forward for the chunked head), over every process (the
  ``(dp, sp)`` mesh of :func:`~packing_hf.attention.sequence_parallel.sequence_parallel_mesh`, flattened):
  weights, gradients and AdamW's moments ``1 / world`` per process, a layer gathered while it runs;
- ``zero3``: DeepSpeed ZeRO-3 over every process (``deepspeed.initialize`` with torch's AdamW, fp32, the bucket
  sizes transformers' ``"auto"`` gives this hidden size; on CPU ``DS_ACCELERATOR=cpu`` and gloo): weights,
  gradients and AdamW's moments ``1 / world`` per process, a layer gathered while it runs. The head's weight is a
  shard outside its call, so the chunked head runs inside a call of the head
  (:func:`~packing_hf.integrations.chunked_head.shard_lm_loss` with the engine's plan, as ``packing_hf.Trainer``
  does under ZeRO-3).
  DeepSpeed's state is allocated by a first step at learning rate 0 (weights unchanged) before the peak is reset.

The default model (hidden 1024, 4 layers, MLP 4096, vocabulary 8,192 untied: 80M parameters, 16 bytes each
with AdamW) is one whose weights and optimizer state dominate a 2,048-token row's activations, so that the
replicated part (falling with the world under FSDP2) and the activations (falling with sp) both show; activation
checkpointing per decoder layer is on (``--checkpointing off``: every layer's activations are kept, and at 1,024
tokens per process they weigh as much as FSDP2's sharded state and gathered layers together).

Memory per process:

- CPU (gloo): the resident set, Linux ``VmRSS`` / ``VmHWM``; the peak is reset (``/proc/self/clear_refs``)
  once the model is wrapped and AdamW's state allocated, so a transient of the set-up (the whole model built on
  every process before ``fully_shard`` keeps its shard) is not counted. ``base`` is the resident set before
  the model (the interpreter and libraries, the same in every configuration); ``peak - base`` is what a device
  would hold. The spawned processes get a fixed ``MALLOC_MMAP_THRESHOLD_`` so that freed tensors go back to the
  OS (glibc's adaptive threshold would keep them in the heap and count them twice).
- CUDA (NCCL, one GPU per process): ``torch.cuda`` allocator statistics (``max_memory_allocated`` after
  ``reset_peak_memory_stats``); ``base`` is 0.

``state_mib``: held before the step (weights, AdamW's moments); ``step_mib``: what the step adds at its peak
(gradients, activations, gathered layers, buckets); ``vs_ddp``: the peak above base against DDP's at the same
world and sp. The step time is the slowest process's (on a 2-core CPU, 4 processes share 2 cores: indicative).

    python benchmarks/bench_sp.py                    # CPU, gloo: a few minutes on 2 idle cores, ~8 GB of RAM
    python benchmarks/bench_sp.py --quick            # a small model, a smoke run
    python benchmarks/bench_sp.py --device cuda      # NCCL: needs as many GPUs as the largest world (4)
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import base_parser, environment, print_table, write_json  # noqa: E402

#: (world, sp) of every configuration; world 1 is the one-process baseline (DDP only: nothing to shard)
CONFIGS = ((1, 1), (2, 2), (4, 4), (4, 2))
ENGINES = ("ddp", "fsdp2", "zero3")
MIB = 2**20
LEARNING_RATE = 1e-5


def _memory_line(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"/proc/self/status has no {key}")


def _reset_peak(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    with open("/proc/self/clear_refs", "w") as f:  # Linux >= 4.0: VmHWM := VmRSS
        f.write("5")


def _held(device) -> float:
    import torch

    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / MIB
    return _memory_line("VmRSS:")


def _peak(device) -> float:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / MIB
    return _memory_line("VmHWM:")


def _row(tokens: int, vocab: int, seed: int):
    """One packed row of ``tokens`` tokens: samples of 300-1,500 tokens (several cut by shard edges)."""
    import torch

    from packing_hf import PaddingFreeCollator

    generator = torch.Generator().manual_seed(seed)
    samples, left = [], tokens
    while left > 0:
        length = min(left, int(torch.randint(300, 1500, (1,), generator=generator)))
        ids = torch.randint(1, vocab, (length,), generator=generator).tolist()
        samples.append({"input_ids": ids, "labels": ids})
        left -= length
    return PaddingFreeCollator()(samples)


def _rank(rank: int, engine: str, world: int, sp: int, port: int, shape: dict, out: str) -> None:
    import torch

    device = torch.device(shape["device"])
    if device.type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    if engine == "zero3":
        # read when DeepSpeed is imported: its CPU accelerator, and the process's place in the world
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port), **({"DS_ACCELERATOR": "cpu"} if device.type == "cpu" else {}))  # fmt: skip
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel
    from transformers import AutoConfig, AutoModelForCausalLM

    from packing_hf import register_attention
    from packing_hf._loss import step_denominator
    from packing_hf.attention.sequence_parallel import sequence_parallel_mesh, shard_packed_batch
    from packing_hf.integrations.chunked_head import resolve_head, shard_lm_loss
    from packing_hf.integrations.parallel import ParallelPlan
    from packing_hf.shard_loss import shard_loss_counts

    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    if engine == "zero3":
        import importlib

        import deepspeed

        # DeepSpeed's CPU backend would JIT-compile its shared-memory all-reduce (a C++ build) and reduce through
        # it; without it DeepSpeed reduces over the gloo group, as DDP and FSDP2 do here.
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
        deepspeed.init_distributed(dist_backend=backend)
    mesh = sequence_parallel_mesh(sp, device.type)
    group, dp_rank = mesh.get_group("sp"), mesh.get_local_rank("dp")
    row = _row(shape["tokens"], shape["vocab"], seed=dp_rank)  # each replica its own row
    base = _held(device)
    config = AutoConfig.for_model(
        "llama", vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
        num_key_value_heads=shape["heads"] // 2, max_position_embeddings=shape["tokens"], tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=register_attention()).float().train()
    if shape["checkpointing"]:
        model.activation_checkpointing_enable()
    if engine == "ddp":
        model = DistributedDataParallel(
            model.to(device), device_ids=[device.index] if device.index is not None else None
        )
    elif engine == "zero3":
        model = _zero3(model, shape["hidden"])
    else:
        flat = mesh._flatten()  # every process of the world: parameters 1 / world per process
        for layer in model.model.layers:
            fully_shard(layer, mesh=flat)
        fully_shard(
            model.model.embed_tokens, mesh=flat
        )  # as accelerate does; lm_head stays in the root's group
        fully_shard(model, mesh=flat)
    # the layout a packed trainer's plan would hold: its engine's hooks are expected on the head
    engine_of_plan = {"ddp": ("ddp", None), "fsdp2": ("fsdp", 2), "zero3": ("deepspeed", 3)}[engine]
    plan = ParallelPlan(*engine_of_plan, world, rank, sp)
    head = resolve_head(model, plan)
    if isinstance(head, str):
        raise RuntimeError(f"the chunked head refused the model: {head}")
    shard = shard_packed_batch({k: v.to(device) if torch.is_tensor(v) else v for k, v in row.items()}, group)
    counts = torch.tensor([shard_loss_counts(shard)[0]], dtype=torch.float64, device=device)
    dist.all_reduce(counts)  # the step's target count, every row once
    denominator = step_denominator([float(counts[0]), 0], "token")

    def step() -> torch.Tensor:
        # the chunked head on the shard, where each engine gathers the head (ZeRO-3: inside a call of the head)
        loss, _ = shard_lm_loss(model, shard, "token", denominator, head)
        if engine == "zero3":
            model.backward(loss * world)  # ZeRO averages the gradients over the processes; the shares sum
            model.step()
            return loss
        (loss * world).backward()  # DDP / FSDP average over the processes; the shares sum
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    if engine == "zero3":
        # DeepSpeed allocates its partitioned gradients and AdamW's moments in the first step: one at learning
        # rate 0 (weights unchanged), so that the measured step holds them as every later step does
        optimizer = model.optimizer
        for group_ in optimizer.param_groups:
            group_["lr"] = 0.0
        step()
        for group_ in optimizer.param_groups:
            group_["lr"] = LEARNING_RATE
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
        # AdamW's moments, as every step after the first holds them: a step on zero gradients (moments stay 0,
        # the update is 0) allocates them without a forward
        for param in model.parameters():
            param.grad = torch.zeros_like(param)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    dist.barrier()
    state = _held(device)
    _reset_peak(device)
    start = time.perf_counter()
    loss = step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    peak = _peak(device)
    total = loss.detach().double()
    dist.all_reduce(total)
    record = torch.tensor([base, state, peak, seconds, float(total)], dtype=torch.float64, device=device)
    everyone = [torch.zeros_like(record) for _ in range(world)]
    dist.all_gather(everyone, record)
    if rank == 0:
        torch.save(torch.stack(everyone).cpu(), out)
    dist.destroy_process_group()


def _zero3(model, hidden: int):
    """``model`` as a DeepSpeed ZeRO-3 engine over every process, with torch's AdamW (fp32)."""
    import deepspeed
    import torch

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {
            "stage": 3,
            # what transformers' "auto" gives these for a model of this hidden size
            "reduce_bucket_size": hidden * hidden,
            "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
            "stage3_param_persistence_threshold": 10 * hidden,
        },
        "zero_allow_untested_optimizer": True,  # torch's AdamW, as the other engines
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def _shape(args) -> dict:
    if args.quick:
        return dict(hidden=256, layers=2, intermediate=1024, vocab=4096, heads=8, tokens=512)
    return dict(hidden=args.hidden, layers=args.layers, intermediate=args.intermediate, vocab=args.vocab,
                heads=args.heads, tokens=args.tokens)  # fmt: skip


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--tokens", type=int, default=2048, help="packed row length per data-parallel replica"
    )
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=16, help="query heads (key/value heads: half)")
    parser.add_argument(
        "--checkpointing",
        choices=("on", "off"),
        default="on",
        help="activation checkpointing per decoder layer (as long rows are trained): the activations are the "
        "layers' inputs and one layer's recomputation",
    )
    parser.add_argument(
        "--configs", default=",".join(f"{w}x{s}" for w, s in CONFIGS), help="WORLDxSP, comma-separated"
    )
    args = parser.parse_args()
    configs = [tuple(int(x) for x in item.split("x")) for item in args.configs.split(",")]
    shape = {**_shape(args), "device": args.device, "checkpointing": args.checkpointing == "on"}

    import socket
    import tempfile

    import torch
    import torch.multiprocessing as mp

    for world, sp in configs:
        if world % sp or shape["heads"] % sp:
            raise ValueError(
                f"--configs {world}x{sp}: sp must divide the world and the {shape['heads']} heads"
            )
    if args.device == "cuda" and max(w for w, _ in configs) > torch.cuda.device_count():
        raise ValueError(
            f"--device cuda runs one process per GPU: --configs needs {max(w for w, _ in configs)} GPUs, "
            f"{torch.cuda.device_count()} are visible; pass --configs with smaller worlds (e.g. 1x1)"
        )
    # spawned processes read it at start: freed tensors are unmapped (returned to the OS) at once
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for world, sp in configs:
            for engine in ENGINES if world > 1 else ENGINES[:1]:
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", 0))
                    port = probe.getsockname()[1]
                out = os.path.join(folder, f"{engine}-{world}x{sp}.pt")
                mp.start_processes(
                    _rank, args=(engine, world, sp, port, shape, out), nprocs=world, start_method="spawn"
                )
                ranks = torch.load(out)  # (world, 5): base, state, peak, seconds, loss
                base, state, peak = (float(ranks[:, i].max()) for i in range(3))
                rows.append({
                    "engine": engine, "world": world, "sp": sp, "dp": world // sp,
                    "tokens_per_process": -(-shape["tokens"] // sp),
                    "peak_mib": round(peak), "base_mib": round(base), "peak_above_base_mib": round(peak - base),
                    "state_mib": round(state - base), "step_mib": round(peak - state),
                    "step_s": round(float(ranks[:, 3].max()), 2), "loss": round(float(ranks[0, 4]), 6),
                })  # fmt: skip
    for row in rows:
        ddp = next(
            r for r in rows if r["engine"] == "ddp" and (r["world"], r["sp"]) == (row["world"], row["sp"])
        )
        row["vs_ddp"] = round(row["peak_above_base_mib"] / ddp["peak_above_base_mib"], 3)
        row["vs_ddp_absolute"] = round(row["peak_mib"] / ddp["peak_mib"], 3)
    columns = ["engine", "world", "sp", "dp", "tokens_per_process", "peak_mib", "peak_above_base_mib"]
    print_table(rows, [*columns, "state_mib", "step_mib", "vs_ddp", "vs_ddp_absolute", "step_s", "loss"])
    parameters = sum(
        p for p in (
            2 * shape["vocab"] * shape["hidden"],
            shape["layers"] * (3 * shape["hidden"] * shape["intermediate"] + 3 * shape["hidden"] ** 2),
        )
    )  # fmt: skip
    print(f"model: {parameters / 1e6:.0f}M parameters ({16 * parameters / MIB:.0f} MiB with AdamW in fp32)")
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs (uptime)")
    payload = {**shape, "parameters": parameters, "rows": rows, "load_average": load}
    payload["environment"] = environment()
    write_json("bench_sp", payload, args)


if __name__ == "__main__":
    main()
