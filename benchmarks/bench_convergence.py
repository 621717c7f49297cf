"""Convergence: does multipack train as well as random padded batches? GSM8K, tiny Llama, CPU.

The same tiny Llama (same initial weights per seed) is trained for one epoch on the first ``--rows``
GSM8K train rows (``Question: ...\\nAnswer: ...<eos>``, SmolLM2 tokenizer) under five ways of making
batches, with the same real tokens per optimizer step (a ``--budget`` of tokens), AdamW and a short
warmup + cosine schedule:

- ``padded``: random batches (a fresh permutation per seed, cut into as many batches as multipack
  makes steps, so both take the same number of steps with the same real tokens per step on
  average), right-padded, sdpa attention;
- ``flattened``: the very same batches, flattened into one packed row (``PaddingFreeCollator``,
  packing_hf's varlen attention): online minibatch packing. It must train exactly like ``padded`` (to
  float noise) - the *harness check*, which validates the loss bookkeeping of the whole benchmark
  (run on the first ``--harness-seeds`` seeds);
- ``multipack``: ``MultipackBatchSampler`` (default ``mixing="random"``) + ``PaddingFreeCollator``;
- ``multipack_sorted``: the same with ``mixing="sorted"`` (best-fit decreasing, the old default);
- ``trl_bfd``: TRL's ``pack_dataset(strategy="bfd")`` rows in a random order, one row per step,
  collated by ``PaddingFreeCollator`` (which reads their ``seq_lengths``);
- ``group_by_length``: ``padded``'s batch size (the same steps and real tokens per step on average) in the order
  of transformers' ``LengthGroupedSampler`` (``train_sampling_strategy="group_by_length"``: the samples shuffled,
  mega-batches of 50 batches each sorted by length): length-homogeneous padded batches, sdpa;
- ``batch_rebalance``: transformers' ``BatchRebalanceSampler`` (``train_sampling_strategy="batch_rebalance"``,
  one device): ``padded``'s samples per step in ``max(4, --grad-accum)`` padded micro-batches of balanced cost,
  sdpa.

Issue 49's quality question (does a batching that groups lengths train worse?) is the eval loss of
``group_by_length`` and ``batch_rebalance`` against ``padded`` and ``multipack``; beside it, for every contender,
how it shapes the steps (``_common.batching_statistics`` of its epoch: real tokens per step with their CV, the
``mixing_ratio`` of a step's mean length spread against random steps, its correlation with the step's position)
and two gradient-noise proxies: ``grad_noise``, on the first seed, the token-weighted mean over the epoch's steps
of ``|g_step - g|^2 / |g|^2`` at one set of weights for all (``padded``'s at the end of its epoch; ``g_step`` the
gradient of the step's loss, ``g`` the whole epoch's, the same for every contender; at most ``--noise-steps``
steps drawn at random), and ``loss_jitter``, the std of a step's training loss around the median of its 9
neighbours over the second half of the epoch.

The loss of a step is the sum of the token losses over every micro-batch of the step divided by the
number of label tokens in the whole step (``num_items_in_batch``, as the HF Trainer does), also under
``--grad-accum``. The eval loss (token mean over the first ``--eval-rows`` GSM8K test rows) is taken
every ``--eval-every`` steps. Contenders advance one step at a time in turn (the one furthest behind
in its epoch goes next), so load from other processes on a shared machine hits all alike; the wall
time per epoch counts training steps only (collation, forward, backward, optimizer), not evaluation.

Token ids are remapped to the ids that occur in the data (a few thousand instead of 49,152): the same
text and tokenization with a smaller embedding / LM head, identical for every contender, so that a
CPU epoch takes about a minute.

Run from the project root: ``python benchmarks/bench_convergence.py`` (full: 1,200 rows, 3 seeds, every
contender: ~15 min on 2 idle cores; writes ``benchmarks/results/convergence.json`` and ``convergence.png``)
or ``--quick`` (48 rows, one seed, ~10 steps per contender; for CI). ``--mix`` trains on another data mix
(``_common.MIXES``; its eval set: held-out samples of the same mix), ``--width 256`` a wider model.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _common import (
    MIXES,
    RESULTS_DIR,
    base_parser,
    batching_statistics,
    gsm8k_token_ids,
    load_tokenizer,
    mix_token_ids,
    print_table,
    rebalance_micro_batches,
    write_json,
)

import packing_hf
from packing_hf import PaddingFreeCollator
from packing_hf.sampler import MultipackBatchSampler

CONTENDERS = (
    "padded",
    "flattened",
    "multipack",
    "multipack_sorted",
    "trl_bfd",
    "group_by_length",
    "batch_rebalance",
)
PADDED = ("padded", "group_by_length", "batch_rebalance")  # padded batches, sdpa with a mask
REBALANCE_MICRO_BATCHES = 4
PACKED_ATTENTION = packing_hf.register_attention()
# the harness check: flattened must follow padded to float noise (fp32; the trajectories only differ
# by the order of floating-point sums in attention and the loss)
HARNESS_TOLERANCE = 2e-3


def parse_args():
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=None, help="GSM8K train rows (default 1200; quick 48)")
    parser.add_argument("--eval-rows", type=int, default=None, help="GSM8K test rows (default 128; quick 16)")
    parser.add_argument("--budget", type=int, default=None, help="tokens per step (default 2048; quick 1024)")
    parser.add_argument("--seeds", type=int, default=None, help="seeds (default 3; quick 1)")
    parser.add_argument("--eval-every", type=int, default=None, help="steps (default 20; quick 4)")
    parser.add_argument(
        "--harness-seeds", type=int, default=1, help="seeds that also train 'flattened' (the harness check)"
    )
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument(
        "--lr", type=float, default=None,
        help="peak learning rate (default 3e-3 * 64 / width: at width 256 and 3e-3 the long-tail mix trains unstably "
        "and float noise between padded and flattened grows 10x a step, failing the harness check)",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument(
        "--mix", choices=("gsm8k_qa", *MIXES[1:]), default="gsm8k_qa",
        help="gsm8k_qa (default: GSM8K as 'Question: ... Answer: ...', eval on its test split) or a mix of "
        "_common.MIXES (Alpaca template; eval on held-out samples of the mix)",
    )  # fmt: skip
    parser.add_argument("--width", type=int, default=64, help="hidden size (intermediate 4x, heads of 16)")
    parser.add_argument(
        "--noise-steps", type=int, default=None, help="steps probed for grad_noise (default 24)"
    )
    parser.add_argument("--contenders", default=",".join(CONTENDERS), help="comma-separated subset")
    parser.add_argument("--plot", type=Path, default=None, help="PNG path (default: next to the JSON)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG (no matplotlib needed)")
    parser.add_argument(
        "--replot", type=Path, default=None, help="only redraw the PNG from this JSON (no training)"
    )
    args = parser.parse_args()
    defaults = dict(
        rows=(48, 1200), eval_rows=(16, 128), budget=(1024, 2048), seeds=(1, 3), eval_every=(4, 20),
        noise_steps=(8, 24),
    )  # fmt: skip
    for key, (quick, full) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else full)
    if args.lr is None:
        args.lr = 3e-3 * 64 / args.width
    unknown = set(args.contenders.split(",")) - set(CONTENDERS)
    if unknown:
        parser.error(f"unknown contenders {sorted(unknown)}; choose from {CONTENDERS}")
    return args


# ------------------------------------------------------------------------------------------------
# data


def load_data(args) -> tuple[list[list[int]], list[list[int]], int]:
    """Train and eval token ids, remapped to the ids that occur in them, and that vocabulary's size."""
    tokenizer = load_tokenizer()
    if args.mix == "gsm8k_qa":
        train = gsm8k_token_ids("train", args.rows, tokenizer)
        evaluation = gsm8k_token_ids("test", args.eval_rows, tokenizer)
    else:  # one shuffled draw of the mix: the first rows train, the rest evaluate
        drawn = mix_token_ids(args.mix, tokenizer, args.rows + args.eval_rows, 1234, args.budget)
        train, evaluation = drawn[: args.rows], drawn[args.rows :]
    too_long = [len(ids) for ids in train if len(ids) > args.budget]
    if too_long:
        raise SystemExit(f"{len(too_long)} train rows are longer than --budget {args.budget}; raise it")
    used = np.unique(np.concatenate([np.concatenate(train), np.concatenate(evaluation)]))
    remap = np.zeros(int(used.max()) + 1, np.int64)
    remap[used] = np.arange(used.size)
    train = [remap[ids].tolist() for ids in train]
    evaluation = [remap[ids].tolist() for ids in evaluation]
    return train, evaluation, int(used.size)


def padded_batch(rows: list[list[int]]) -> dict[str, torch.Tensor]:
    """Right-padded batch: ``(B, L)`` input_ids / attention_mask / labels (-100 on padding)."""
    longest = max(map(len, rows))
    input_ids = torch.zeros(len(rows), longest, dtype=torch.long)
    labels = torch.full((len(rows), longest), -100, dtype=torch.long)
    mask = torch.zeros(len(rows), longest, dtype=torch.long)
    for r, ids in enumerate(rows):
        input_ids[r, : len(ids)] = torch.tensor(ids)
        labels[r, : len(ids)] = input_ids[r, : len(ids)]
        mask[r, : len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def plans(
    name: str, train: list[list[int]], budget: int, seed: int, grad_accum: int = 1
) -> list[tuple[str, list[Any]]]:
    """The micro-batches of one epoch: ``("padded", rows)`` or ``("packed", features)`` each."""
    lengths = np.array([len(ids) for ids in train])
    steps = len(MultipackBatchSampler(lengths, budget, seed=seed))
    if name in ("padded", "flattened"):
        # as many random batches as multipack has steps: the same number of steps, each with the same
        # real tokens on average (a batch holds ~budget / mean length samples)
        groups = np.array_split(np.random.default_rng(seed).permutation(lengths.size), steps)
    elif name == "group_by_length":  # padded's samples per step, in the Trainer's LengthGroupedSampler order
        from transformers.trainer_pt_utils import get_length_grouped_indices

        size = max(1, round(lengths.size / steps))
        order = get_length_grouped_indices(
            lengths.tolist(), size, generator=torch.Generator().manual_seed(seed)
        )
        groups = [order[i : i + size] for i in range(0, len(order), size)]
    elif name == "batch_rebalance":  # padded's samples per step, in `micro` micro-batches of balanced cost
        micro = rebalance_accumulation(grad_accum)
        size = rebalance_step_size(lengths.size, max(1, round(steps / grad_accum)), micro)  # optimizer steps
        plan = rebalance_micro_batches(lengths.tolist(), size, micro, seed=seed)
        return [("padded", [train[i] for i in b]) for b in plan]
    elif name in ("multipack", "multipack_sorted"):
        mixing = "random" if name == "multipack" else "sorted"
        groups = list(MultipackBatchSampler(lengths, budget, seed=seed, mixing=mixing))
    else:  # trl_bfd: TRL's packed rows, shuffled as the Trainer's random sampler would
        import datasets
        from trl.data_utils import pack_dataset

        packed = pack_dataset(
            datasets.Dataset.from_dict({"input_ids": train}), seq_length=budget, strategy="bfd"
        )
        rows = packed.to_list()
        order = np.random.default_rng(seed).permutation(len(rows))
        return [("packed", [rows[i]]) for i in order]
    if name in PADDED:
        return [("padded", [train[i] for i in group]) for group in groups]
    return [("packed", [{"input_ids": train[i]} for i in group]) for group in groups]


def rebalance_accumulation(grad_accum: int) -> int:
    """``batch_rebalance``'s micro-batches per step: at least 4 (one is random batches, sorted inside)."""
    return max(REBALANCE_MICRO_BATCHES, grad_accum)


def rebalance_step_size(n: int, steps: int, micro: int) -> int:
    """The samples per step nearest ``n / steps`` whose last step still has a micro-batch for every slot (a
    smaller tail would make ``BatchRebalanceSampler`` repeat samples)."""
    target = max(micro, round(n / steps))
    valid = [s for s in range(micro, n + 1) if n % s == 0 or n % s >= micro]
    return min(valid, key=lambda s: (abs(s - target), s))


def batch_lengths(micro_batch: tuple[str, list[Any]]) -> list[int]:
    kind, payload = micro_batch
    if kind == "padded":
        return [len(ids) for ids in payload]
    return [n for row in payload for n in row.get("seq_lengths", [len(row["input_ids"])])]


# ------------------------------------------------------------------------------------------------
# training


def make_model(vocab: int, seed: int, attn: str, width: int = 64):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama",
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=4 * width,
        num_hidden_layers=2,
        num_attention_heads=width // 16,
        num_key_value_heads=width // 32,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn).float()


class Run:
    """One contender under one seed, advanced one optimizer step at a time."""

    def __init__(self, name: str, micro_batches, init_state, vocab: int, seed: int, args) -> None:
        self.name = name
        self.attn = "sdpa" if name in PADDED else PACKED_ATTENTION
        self.model = make_model(vocab, seed, self.attn, args.width)
        self.model.load_state_dict(init_state)
        self.model.train()
        accum = rebalance_accumulation(args.grad_accum) if name == "batch_rebalance" else args.grad_accum
        self.steps = [micro_batches[i : i + accum] for i in range(0, len(micro_batches), accum)]
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0
        )
        total, warmup = len(self.steps), max(1, len(self.steps) // 20)

        def schedule(step: int) -> float:  # linear warmup, cosine to 0 at the end of the epoch
            if step < warmup:
                return (step + 1) / warmup
            return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))

        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)
        self.collator = PaddingFreeCollator()
        self.done = 0
        self.train_seconds = 0.0
        self.losses: list[float] = []
        self.evals: list[dict[str, float]] = []
        self.real_tokens = 0
        self.computed_tokens = 0  # positions the model ran, padding included
        step_lengths = [[n for mb in step for n in batch_lengths(mb)] for step in self.steps]
        self.step_tokens = [sum(s) for s in step_lengths]
        self.step_mean_lengths = [float(np.mean(s)) for s in step_lengths]
        self.budget = args.budget

    def batching(self) -> dict[str, Any]:
        """The epoch's steps through ``_common.batching_statistics`` (a padded micro-batch emits rows x longest)."""
        steps = [
            [(batch_lengths(mb), len(mb[1]) * max(map(len, mb[1])) if mb[0] == "padded" else sum(batch_lengths(mb)))
             for mb in step]
            for step in self.steps
        ]  # fmt: skip
        return batching_statistics(steps, self.budget)

    def loss_jitter(self) -> float:
        """The std of a step's training loss around the median of its 9 neighbours, over the second half of the
        epoch: how much the loss jumps from step to step (length-homogeneous steps have different losses)."""
        losses = np.asarray(self.losses)
        half = range(max(4, losses.size // 2), losses.size - 4)
        residuals = [losses[t] - np.median(np.delete(losses[t - 4 : t + 5], 4)) for t in half]
        return float(np.std(residuals)) if residuals else 0.0

    def step_gradient(self, micro_batches) -> tuple[torch.Tensor, int]:
        """The gradient of one step's loss (its token mean over the step) at the current weights, flattened,
        and the step's label tokens; the weights are not changed."""
        batches = [self.collate(mb) for mb in micro_batches]
        items = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
        for batch in batches:
            self.model(**batch, num_items_in_batch=items).loss.backward()
        grad = torch.cat([p.grad.reshape(-1) for p in self.model.parameters() if p.grad is not None])
        self.model.zero_grad(set_to_none=True)
        return grad, items

    @property
    def progress(self) -> float:
        return self.done / len(self.steps)

    def collate(self, micro_batch) -> dict[str, Any]:
        kind, payload = micro_batch
        return padded_batch(payload) if kind == "padded" else self.collator(payload)

    def step(self) -> None:
        start = time.perf_counter()
        batches = [self.collate(mb) for mb in self.steps[self.done]]
        # the token mean over the whole optimizer step, as the Trainer's num_items_in_batch
        items = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
        total = 0.0
        for batch in batches:
            loss = self.model(**batch, num_items_in_batch=items).loss
            loss.backward()
            total += loss.item()
            self.computed_tokens += batch["input_ids"].numel()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.train_seconds += time.perf_counter() - start
        self.losses.append(total)
        self.real_tokens += self.step_tokens[self.done]
        self.done += 1

    @torch.no_grad()
    def evaluate(self, eval_batches: list[dict[str, Any]]) -> None:
        """Token-mean loss over the eval set (packed batches, the same computation for every contender)."""
        self.model.eval()
        if self.attn != PACKED_ATTENTION:
            self.model.set_attn_implementation(PACKED_ATTENTION)
        total = sum(int((b["labels"][:, 1:] != -100).sum()) for b in eval_batches)
        loss = sum(self.model(**b, num_items_in_batch=total).loss.item() for b in eval_batches)
        if self.attn != PACKED_ATTENTION:
            self.model.set_attn_implementation(self.attn)
        self.model.train()
        self.evals.append({"step": self.done, "seconds": self.train_seconds, "loss": loss})


def run_seed(seed: int, names: list[str], train, evaluation, vocab: int, args) -> dict[str, Run]:
    init_state = {k: v.clone() for k, v in make_model(vocab, seed, "sdpa", args.width).state_dict().items()}
    runs = {
        name: Run(name, plans(name, train, args.budget, seed, args.grad_accum), init_state, vocab, seed, args)
        for name in names
    }
    eval_lengths = np.array([len(ids) for ids in evaluation])
    eval_sampler = MultipackBatchSampler(eval_lengths, args.budget, shuffle=False, mixing="sorted")
    collator = PaddingFreeCollator()
    eval_batches = [collator([{"input_ids": evaluation[i]} for i in batch]) for batch in eval_sampler]
    for run in runs.values():
        run.evaluate(eval_batches)
    pending = dict(runs)
    while pending:  # the contender furthest behind in its epoch steps next
        run = min(pending.values(), key=lambda r: (r.progress, names.index(r.name)))
        run.step()
        if run.done % args.eval_every == 0 or run.done == len(run.steps):
            run.evaluate(eval_batches)
        if run.done == len(run.steps):
            del pending[run.name]
        if run.done % 25 == 0 or run.done == len(run.steps):
            print(
                f"  seed {seed} {run.name:17s} step {run.done:4d}/{len(run.steps)}  loss {run.losses[-1]:.4f}",
                flush=True,
            )
    return runs


def gradient_noise(runs: dict[str, Run], train: list[list[int]], args) -> dict[str, Any]:
    """``grad_noise`` of every contender (see the module's docstring) at ``padded``'s final weights (else the first
    contender's): the token-weighted mean of ``|g_step - g|^2 / |g|^2`` over at most ``--noise-steps`` of its steps
    drawn at random, ``g`` the gradient of the whole epoch's token mean. Run after training: it overwrites the
    contenders' weights."""
    reference = runs.get("padded") or next(iter(runs.values()))
    weights = {k: v.detach().clone() for k, v in reference.model.state_dict().items()}
    lengths = np.array([len(ids) for ids in train])
    kind = "packed" if reference.attn == PACKED_ATTENTION else "padded"
    whole = [
        (kind, [{"input_ids": train[i]} for i in b] if kind == "packed" else [train[i] for i in b])
        for b in MultipackBatchSampler(lengths, args.budget, shuffle=False, mixing="sorted")
    ]
    full, _ = reference.step_gradient(whole)
    norm = float(full.square().sum())
    result = {"weights": f"{reference.name}'s at the end of its epoch", "contenders": {}}
    for name, run in runs.items():
        run.model.load_state_dict(weights)
        picked = np.random.default_rng(0).permutation(len(run.steps))[: args.noise_steps]
        noise, tokens = 0.0, 0
        for t in sorted(picked):
            grad, items = run.step_gradient(run.steps[t])
            noise += items * float((grad - full).square().sum()) / norm
            tokens += items
        result["contenders"][name] = {"grad_noise": noise / tokens, "steps_probed": len(picked)}
    return result


# ------------------------------------------------------------------------------------------------
# report


def summarize(results: dict[str, list[Run]]) -> tuple[list[dict], dict[str, Any]]:
    padded = results.get("padded")
    rows, detail = [], {}
    for name, runs in results.items():
        finals = [r.evals[-1]["loss"] for r in runs]
        seconds = [r.train_seconds for r in runs]
        row = {
            "contender": name,
            "final_eval": statistics.mean(finals),
            "final_eval_std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
            "steps": statistics.mean(len(r.steps) for r in runs),
            "tokens_per_step": statistics.mean(r.real_tokens / len(r.steps) for r in runs),
            "fill": statistics.mean(r.real_tokens / r.computed_tokens for r in runs),
            "batch_len_std": statistics.mean(float(np.std(r.step_mean_lengths)) for r in runs),
            "epoch_s": statistics.mean(seconds),
        }
        if padded is not None:
            # per seed, against padded of the same seed (same init, same load on the machine)
            deltas = [r.evals[-1]["loss"] - p.evals[-1]["loss"] for r, p in zip(runs, padded, strict=False)]
            row["vs_padded"] = statistics.mean(deltas)
            row["vs_padded_std"] = statistics.stdev(deltas) if len(deltas) > 1 else 0.0
            row["speedup"] = statistics.mean(
                p.train_seconds / r.train_seconds for r, p in zip(runs, padded, strict=False)
            )
        rows.append(row)
        detail[name] = {
            **row,
            "seeds": [
                {
                    "steps": len(r.steps),
                    "train_seconds": r.train_seconds,
                    "real_tokens": r.real_tokens,
                    "computed_tokens": r.computed_tokens,
                    "train_loss": r.losses,
                    "eval": r.evals,
                    "step_mean_length_std": float(np.std(r.step_mean_lengths)),
                }
                for r in runs
            ],
        }
    return rows, detail


def harness_check(results: dict[str, list[Run]]) -> dict[str, Any] | None:
    if "padded" not in results or "flattened" not in results:
        return None
    step_diff = max(
        max(abs(a - b) for a, b in zip(p.losses, f.losses, strict=True))
        for p, f in zip(results["padded"], results["flattened"], strict=False)
    )
    eval_diff = max(
        max(abs(a["loss"] - b["loss"]) for a, b in zip(p.evals, f.evals, strict=True))
        for p, f in zip(results["padded"], results["flattened"], strict=False)
    )
    first_diff = max(
        abs(p.losses[0] - f.losses[0]) for p, f in zip(results["padded"], results["flattened"], strict=False)
    )
    return {
        "first_step_loss_diff": first_diff,
        "max_step_loss_diff": step_diff,
        "max_eval_loss_diff": eval_diff,
        "tolerance": HARNESS_TOLERANCE,
        "passed": bool(first_diff < 1e-5 and step_diff < HARNESS_TOLERANCE and eval_diff < HARNESS_TOLERANCE),
    }


def plot(detail: dict[str, Any], path: Path, title: str) -> None:
    """Eval loss vs step and vs training wall time, and each contender minus padded (same seed) vs step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    padded = detail.get("padded")
    for name, result in detail.items():
        seeds = result["seeds"]
        points = min(len(s["eval"]) for s in seeds)

        def mean(key: str, k: int, seeds=seeds) -> float:
            return statistics.mean(s["eval"][k][key] for s in seeds)

        step = [mean("step", k) for k in range(points)]
        loss = [mean("loss", k) for k in range(points)]
        style = {"linestyle": "--"} if name == "flattened" else {}
        axes[0].plot(step, loss, label=name, **style)
        axes[1].plot([mean("seconds", k) for k in range(points)], loss, label=name, **style)
        if padded is not None:
            pairs = list(zip(seeds, padded["seeds"], strict=False))  # flattened may have fewer seeds
            points = min(points, *(len(p["eval"]) for _, p in pairs))
            delta = [
                statistics.mean(s["eval"][k]["loss"] - p["eval"][k]["loss"] for s, p in pairs)
                for k in range(points)
            ]
            axes[2].plot(step[:points], delta, label=name, **style)
    labels = ("optimizer step", "training wall time (s)", "optimizer step")
    for ax, xlabel in zip(axes, labels, strict=True):
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    for ax in axes[:2]:
        ax.set_ylabel("eval loss (GSM8K test)")
        ax.set_ylim(top=min(ax.get_ylim()[1], 8.5))
    axes[2].set_ylabel("eval loss minus padded's (same seed)")
    axes[2].axhline(0.0, color="black", linewidth=0.8)
    axes[2].set_ylim(-0.08, 0.08)
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


def plot_title(config: dict[str, Any]) -> str:
    return (
        f"Llama ({config.get('model', 'hidden 64').split(',')[0]}) on {config['rows']} "
        f"{config.get('mix', 'gsm8k_qa')} rows, 1 epoch, {config['budget']} tokens/step, "
        f"mean of {config['seeds']} seed(s)"
    )


def main() -> None:
    args = parse_args()
    if args.replot is not None:
        document = json.loads(args.replot.read_text())
        plot(
            document["contenders"],
            args.plot or args.replot.with_suffix(".png"),
            plot_title(document["config"]),
        )
        return
    torch.set_num_threads(args.threads)
    names = [n for n in CONTENDERS if n in args.contenders.split(",")]
    train, evaluation, vocab = load_data(args)
    mean_length = float(np.mean([len(ids) for ids in train]))
    print(
        f"{args.mix}: {len(train)} train rows (mean {mean_length:.0f} tokens), {len(evaluation)} eval rows, "
        f"vocabulary {vocab}, budget {args.budget} tokens/step, {args.seeds} seed(s), {args.threads} thread(s)"
    )
    results: dict[str, list[Run]] = {name: [] for name in names}
    noise = None
    for seed in range(args.seeds):
        these = [n for n in names if n != "flattened" or seed < args.harness_seeds]
        runs = run_seed(seed, these, train, evaluation, vocab, args)
        for name, run in runs.items():
            results[name].append(run)
        if seed == 0 and args.noise_steps > 0:
            noise = gradient_noise(runs, train, args)
    rows, detail = summarize(results)
    for row in rows:
        name = row["contender"]
        batching = results[name][0].batching()  # the first seed's epoch
        row["mixing_ratio"] = batching["mixing_ratio"]
        row["position_corr"] = batching["position_corr"]
        row["tok_step_cv"] = batching["real_tokens_per_step"]["cv"]
        row["loss_jitter"] = statistics.mean(r.loss_jitter() for r in results[name])
        row["grad_noise"] = noise["contenders"][name]["grad_noise"] if noise else None
        detail[name].update(
            {k: row[k] for k in ("mixing_ratio", "position_corr", "tok_step_cv", "loss_jitter", "grad_noise")}
        )
        detail[name]["batching"] = batching
    print_table(
        rows,
        ["contender", "final_eval", "final_eval_std", "vs_padded", "vs_padded_std", "steps", "tokens_per_step",
         "fill", "batch_len_std", "epoch_s", "speedup"],
    )  # fmt: skip
    print(
        "\nhow each batching shapes the steps (first seed): tok_step_cv, mixing_ratio (~1: mixed like random "
        "steps), position_corr; gradient-noise proxies: grad_noise (|g_step - g|^2 / |g|^2 at one set of weights), "
        "loss_jitter"
    )
    print_table(
        rows, ["contender", "tok_step_cv", "mixing_ratio", "position_corr", "grad_noise", "loss_jitter"]
    )
    check = harness_check(results)
    if check is not None:
        verdict = "passed" if check["passed"] else "FAILED"
        print(
            f"harness check (flattened = padded to float noise): {verdict}; first step |diff| "
            f"{check['first_step_loss_diff']:.2e}, max step |diff| {check['max_step_loss_diff']:.2e}, max eval |diff| "
            f"{check['max_eval_loss_diff']:.2e} (tolerance {HARNESS_TOLERANCE})"
        )
    goal = None
    if "multipack" in detail and "padded" in detail:
        mp = detail["multipack"]
        goal = {
            "multipack_minus_padded": mp["vs_padded"],
            "loss_within_0.01": mp["vs_padded"] <= 0.01,
            "speedup_vs_padded": mp["speedup"],
            "speedup_at_least_1.3": mp["speedup"] >= 1.3,
        }
        print(
            f"goal: multipack - padded final eval loss {mp['vs_padded']:+.4f} (target <= 0.01), "
            f"epoch speed-up {mp['speedup']:.2f}x (target >= 1.3x)"
        )
    payload = {
        "config": {
            "rows": len(train),
            "eval_rows": len(evaluation),
            "mean_length": mean_length,
            "vocab": vocab,
            "budget": args.budget,
            "seeds": args.seeds,
            "grad_accum": args.grad_accum,
            "lr": args.lr,
            "eval_every": args.eval_every,
            "threads": args.threads,
            "mix": args.mix,
            "noise_steps": args.noise_steps,
            "model": f"llama: hidden {args.width}, intermediate {4 * args.width}, 2 layers, {args.width // 16} heads / "
            f"{args.width // 32} kv heads, tied embeddings",
        },
        "grad_noise": noise,
        "table": rows,
        "harness_check": check,
        "goal": goal,
        "contenders": detail,
    }
    output = write_json("convergence", payload, args)
    if not args.no_plot:
        path = args.plot or (output.with_suffix(".png") if args.output else RESULTS_DIR / "convergence.png")
        plot(detail, path, plot_title(payload["config"]))
    if check is not None and not check["passed"]:
        raise SystemExit("harness check failed: flattened batches did not train like the same padded batches")


if __name__ == "__main__":
    main()
