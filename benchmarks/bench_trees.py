"""Prefix trees against flat packing: the same multi-turn samples, the same model and budget, tokens computed,
time per epoch and memory per step, interleaved.

Data (per data set, every sample a list of token ids and the mask of the tokens it trains on):

- ``gpteacher_roleplay``, ``gpteacher_toolformer``, ``alpaca``, ``gsm8k`` (the shipped sets in ``../shared/data``,
  SmolLM2 tokenizer, its ChatML template): conversations of K = 2-4 consecutive rows as turns (the row's
  instruction and input as the user's turn, its output or answer as the assistant's) under one system prompt
  shared by every conversation, cut into one sample per assistant turn, as SFT pipelines cut multi-turn chats:
  sample ``k`` holds the system prompt and turns 1..k and trains on the assistant's turn ``k`` alone (its
  content and ``<|im_end|>``). A conversation stops before a turn that would make it longer than the budget.
  Messages are tokenized one by one (``<|im_start|>role\\n...<|im_end|>\\n`` each: the template's special tokens
  keep the tokens of a prefix those of the whole), so sample ``k`` is a prefix of sample ``k + 1``;
- ``synthetic``: multi-turn rollouts as RL collects them, branching at 2, 3 or 4 depths (cycled): a prompt, then
  at every depth two sampled assistant turns, each followed by an environment reply before the next depth;
  every leaf is a sample (prompt and the turns on its path) that trains on its assistant turns.

The vocabulary is the ids the data uses, renumbered (``compact_vocabulary``, as bench_e2e's CPU presets); the
synthetic ids are drawn from it.

Contenders (each its own copy of one randomly initialised model, the same weights, its own AdamW; one epoch
over the same samples at ``--budget`` tokens per step, one torch thread on CPU), each computing the loss
``packing_hf.SFTTrainer`` / ``Trainer`` computes with ``share_prefixes=False`` / ``True`` and their defaults
(``loss_normalization="token"``, ``chunked_loss=True``), with the same functions, outside the trainer so that
the steps can be interleaved and each step's memory read:

- ``flat``: ``MultipackBatchSampler(lengths, budget)`` + ``PaddingFreeCollator`` (labels: -100 off the trained
  tokens), the trainers' packed route (``LossRoute.PACKED``): ``causal_lm_loss`` (the LM head in chunks of
  tokens) over ``target_coefficients``, divided by the step's trained tokens (``loss_counts``);
- ``tree``: ``find_prefix_groups(samples, max_tokens_per_batch=budget)`` + ``MultipackBatchSampler(lengths,
  budget, prefix_groups=groups)`` (the sampler of ``share_prefixes=True``) + ``PrefixTreeCollator`` (one
  prefix-tree row per batch, the targets as (row, target, weight) pairs), the trainers' ``LossRoute.PREFIX_TREE``:
  ``pairs_lm_loss`` (every pair's cross-entropy once, the head on the pairs' rows in chunks) over
  ``tree_coefficients``, divided by the step's trained tokens (``tree_loss_counts``: the same number).

Before any step three losses are computed on the samples of one tree batch with the same weights and must
agree (fp32; the run stops otherwise): the two contenders' and the tree row's full logits read back through
``PrefixTree.token_logprobs``. Steps are interleaved (the contender furthest behind in its epoch goes next)
after one untimed warm-up step each; every epoch's batches are built before the clock starts.

Reported per data set and model: tokens computed per epoch (the rows' tokens: the samples' own for ``flat``, the
trees' for ``tree``) and their ratio (deterministic: the samples, the plan and the trees do not depend on the
machine), the trees' ratio the planner predicted and the ratio of the whole data set as one tree (the most any
budget could share); steps and samples per step (a tree row holds more samples than a flat one at the same
budget); time per epoch (wall and CPU), samples per second and the ratio; the peak memory per step (as
bench_trainers: CUDA ``max_memory_allocated``; CPU the growth of the process's peak resident memory in the step;
median and max over the steps after the first). The load average at start and end goes into the JSON.

    python benchmarks/bench_trees.py                      # tiny and width-256 Llama, every data set (~4 min)
    python benchmarks/bench_trees.py --conversations 48   # the figures of docs/benchmarks.md (~8 min)
    python benchmarks/bench_trees.py --quick              # a smoke run (seconds)
    python benchmarks/bench_trees.py --device cuda --presets smollm2-135m --dtype bfloat16 --conversations 400
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from typing import Any

import numpy as np
import torch
from _common import (
    DATA_DIR,
    StepPeak,
    add_threads_argument,
    base_parser,
    compact_vocabulary,
    load_average,
    load_tokenizer,
    print_table,
    set_threads,
    spread_stats,
    write_json,
)
from bench_e2e import PRESETS, build_model, moved

import packing_hf
from packing_hf import PaddingFreeCollator, PrefixTreeCollator
from packing_hf._loss import TREE_KEYS, loss_counts, target_coefficients, tree_coefficients, tree_loss_counts
from packing_hf.integrations.chunked_head import ChunkedHead, causal_lm_loss, pairs_lm_loss, resolve_head
from packing_hf.prefix_plan import find_prefix_groups
from packing_hf.prefix_tree import build_prefix_tree
from packing_hf.sampler import MultipackBatchSampler

DATASETS = ("gpteacher_roleplay", "gpteacher_toolformer", "alpaca", "gsm8k", "synthetic")
SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"  # the template's own
CONTENDERS = ("flat", "tree")
LOSS_TOLERANCE = 1e-4  # relative: the flat and the tree loss of the same samples and weights (fp32)
NORMALIZATION = "token"  # the trainers' default loss_normalization

Sample = tuple[list[int], np.ndarray]  # token ids, (L,) bool: the tokens it trains on


def parse_args():
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--presets", nargs="+", choices=tuple(PRESETS), default=["tiny", "small"])
    parser.add_argument("--datasets", nargs="+", choices=DATASETS, default=list(DATASETS))
    parser.add_argument("--budget", type=int, default=4096, help="tokens per step (max_tokens_per_batch)")
    parser.add_argument(
        "--conversations", type=int, default=20,
        help="conversations (rollout trees for synthetic: a quarter of this) per data set",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--cpu-memory", action=argparse.BooleanOptionalAction, default=True,
        help="on CPU, measure every step's peak resident memory (pins glibc's mmap threshold: slower steps for "
        "both contenders alike)",
    )  # fmt: skip
    add_threads_argument(parser)
    args = parser.parse_args()
    if args.quick:
        args.presets, args.conversations, args.budget = ["tiny"], min(args.conversations, 8), 2048
        args.datasets = [d for d in args.datasets if d in ("gsm8k", "synthetic")] or args.datasets[:1]
    return args


# ---- data ---------------------------------------------------------------------------------------------------


def load_turns(name: str) -> list[tuple[str, str]]:
    """``(user, assistant)`` per row of a shipped data set, in file order."""
    if name == "gsm8k":
        with open(DATA_DIR / "gsm8k_train.jsonl") as f:
            return [(r["question"], r["answer"]) for r in map(json.loads, f)]
    file = {"alpaca": "alpaca_gpt4_1k.json"}.get(name, f"{name}.json")
    rows = json.loads((DATA_DIR / file).read_text())
    return [(r["instruction"] + (f"\n\n{r['input']}" if r.get("input") else ""), r["output"]) for r in rows]


def message_tokens(tokenizer, role: str, content: str) -> tuple[list[int], list[bool]]:
    """One ChatML message's tokens and which are trained (an assistant's content and ``<|im_end|>``)."""
    header = f"<|im_start|>{role}\n"
    text = f"{header}{content}<|im_end|>\n"
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    end = text.rindex("<|im_end|>") + len("<|im_end|>")
    trained = [
        role == "assistant" and start >= len(header) and stop <= end
        for start, stop in encoded["offset_mapping"]
    ]
    return encoded["input_ids"], trained


def chat_samples(
    name: str, tokenizer, conversations: int, seed: int, budget: int
) -> tuple[list[Sample], dict]:
    """Per-turn samples of ``conversations`` conversations of K (2-4) consecutive rows under one system prompt."""
    rng = np.random.default_rng(seed)
    turns = load_turns(name)
    system_ids, _ = message_tokens(tokenizer, "system", SYSTEM_PROMPT)
    samples: list[Sample] = []
    row, shortened, turn_counts = int(rng.integers(len(turns))), 0, []
    for _ in range(conversations):
        ids, k, taken = list(system_ids), int(rng.integers(2, 5)), 0
        for _ in range(k):
            user, answer = turns[row % len(turns)]
            row += 1
            user_ids, _ = message_tokens(tokenizer, "user", user)
            answer_ids, answer_mask = message_tokens(tokenizer, "assistant", answer)
            if len(ids) + len(user_ids) + len(answer_ids) > budget:
                shortened += 1
                break
            prefix = ids + user_ids  # earlier turns are context: this sample trains on its own answer alone
            samples.append((prefix + answer_ids, np.array([False] * len(prefix) + answer_mask)))
            ids = prefix + answer_ids
            taken += 1
        turn_counts.append(taken)
    return samples, {"conversations": conversations, "turns": turn_counts, "shortened_to_fit": shortened}


def synthetic_rollouts(trees: int, vocab: int, seed: int, budget: int) -> tuple[list[Sample], dict]:
    """Leaves of rollout trees branching in two at every one of 2, 3 or 4 depths (cycled)."""
    rng = np.random.default_rng(seed)
    samples: list[Sample] = []
    depths = []
    for t in range(trees):
        depth = 2 + t % 3
        depths.append(depth)
        prompt = rng.integers(0, vocab, int(rng.integers(100, 300))).tolist()
        paths = [(prompt, [False] * len(prompt))]
        for level in range(depth):
            grown = []
            for ids, mask in paths:
                for _ in range(2):
                    turn = rng.integers(0, vocab, int(rng.integers(40, 160))).tolist()
                    reply = (
                        []
                        if level == depth - 1
                        else rng.integers(0, vocab, int(rng.integers(20, 80))).tolist()
                    )
                    grown.append((ids + turn + reply, mask + [True] * len(turn) + [False] * len(reply)))
            paths = grown
        for ids, mask in paths:
            if len(ids) > budget:
                raise SystemExit(
                    f"a synthetic rollout of {len(ids)} tokens exceeds --budget {budget}; raise it"
                )
            samples.append((ids, np.array(mask)))
    return samples, {"trees": trees, "depths": depths}


# ---- batches and losses ---------------------------------------------------------------------------------------


def flat_batches(
    samples: list[Sample], budget: int, seed: int
) -> tuple[list[dict[str, Any]], list[list[int]]]:
    sampler = MultipackBatchSampler([len(ids) for ids, _ in samples], budget, seed=seed)
    collate = PaddingFreeCollator()
    indices = list(sampler)
    return [collate([_features(samples[i]) for i in batch]) for batch in indices], indices


def _features(sample: Sample) -> dict[str, list[int]]:
    ids, mask = sample
    return {"input_ids": ids, "labels": np.where(mask, ids, -100).tolist()}


def tree_batches(
    samples: list[Sample], budget: int, seed: int
) -> tuple[list[dict[str, Any]], list[list[int]], dict]:
    """The batches of ``share_prefixes=True``: the samples grouped by shared prefixes, binned by their trees' tokens,
    every batch one ``PrefixTreeCollator`` row."""
    groups = find_prefix_groups([ids for ids, _ in samples], max_tokens_per_batch=budget)
    sampler = MultipackBatchSampler([len(ids) for ids, _ in samples], budget, seed=seed, prefix_groups=groups)
    collate = PrefixTreeCollator()
    indices = list(sampler)
    batches = [collate([_features(samples[i]) for i in batch]) for batch in indices]
    return batches, indices, {"groups": groups.num_groups, "planned_ratio": groups.token_ratio}


def flat_loss(model, head: ChunkedHead, batch: dict[str, Any], device: str) -> torch.Tensor:
    """``LossRoute.PACKED`` with the chunked head: the row's summed target cross-entropy over its trained tokens."""
    inputs = moved(batch, device)
    labels = inputs.pop("labels")
    coefficients = target_coefficients(
        labels, NORMALIZATION, position_ids=inputs["position_ids"], cu_seq_lens=inputs["cu_seq_lens_q"]
    )
    total, _, _ = causal_lm_loss(model, {**inputs, "use_cache": False}, labels, coefficients, head)
    return total / loss_counts(labels)[0]


def tree_loss(model, head: ChunkedHead, batch: dict[str, Any], device: str) -> torch.Tensor:
    """``LossRoute.PREFIX_TREE`` with the chunked head: the pairs' summed cross-entropy over the trained tokens."""
    inputs = moved(batch, device)
    pairs = {key: inputs.pop(key) for key in TREE_KEYS}
    total, _ = pairs_lm_loss(
        model,
        {**inputs, "use_cache": False},
        pairs["tree_rows"],
        pairs["tree_targets"],
        tree_coefficients(pairs, NORMALIZATION),
        head,
    )
    return total / tree_loss_counts(pairs)[0]


def logprobs_loss(model, samples: list[Sample], device: str) -> torch.Tensor:
    """The same loss from the tree row's full logits through ``PrefixTree.token_logprobs`` (the check's third)."""
    tree = build_prefix_tree([ids for ids, _ in samples])
    logits = model(**moved(tree.model_inputs(), device), use_cache=False).logits
    logprobs = torch.cat(tree.token_logprobs(logits))  # (sum of L_s - 1,) every sample's, as alone
    targets = torch.from_numpy(np.concatenate([mask[1:] for _, mask in samples])).to(device)
    return -logprobs[targets].sum() / targets.sum()


def check_losses_agree(model, head: ChunkedHead, samples: list[Sample], device: str) -> dict[str, float]:
    """The flat, the tree and the token_logprobs loss of the same samples and weights: equal, or the run stops."""
    features = [_features(s) for s in samples]
    with torch.no_grad():
        flat = flat_loss(model, head, PaddingFreeCollator()(features), device).item()
        tree = tree_loss(model, head, PrefixTreeCollator()(features), device).item()
        logprobs = logprobs_loss(model, samples, device).item()
    for name, value in (("tree", tree), ("token_logprobs", logprobs)):
        if abs(value - flat) > LOSS_TOLERANCE * abs(flat):
            raise SystemExit(
                f"the {name} loss {value!r} differs from the flat loss {flat!r} of the same samples"
            )
    return {"flat": flat, "tree": tree, "token_logprobs": logprobs, "samples": len(samples)}


# ---- the run ---------------------------------------------------------------------------------------------------


class Contender:
    def __init__(
        self, name: str, model, batches: list[dict[str, Any]], device: str, cpu_memory: bool
    ) -> None:
        self.name, self.model, self.batches, self.device = name, model, batches, device
        self.head = chunked_head(model)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.done, self.seconds, self.cpu_seconds = 0, 0.0, 0.0
        self.step_peaks: list[int] = []
        self.meter = StepPeak(device, cpu_memory)

    def loss(self, batch: dict[str, Any]) -> torch.Tensor:
        return (tree_loss if self.name == "tree" else flat_loss)(self.model, self.head, batch, self.device)

    def step(self) -> None:
        batch = self.batches[self.done]
        self.meter.start()
        start, cpu_start = time.perf_counter(), time.process_time()
        self.loss(batch).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        peak = self.meter.stop()
        if peak is not None:
            self.step_peaks.append(peak)
        self.seconds += time.perf_counter() - start
        self.cpu_seconds += time.process_time() - cpu_start
        self.done += 1

    @property
    def running(self) -> bool:
        return self.done < len(self.batches)


def chunked_head(model) -> ChunkedHead:
    head = resolve_head(model)
    if isinstance(head, str):
        raise SystemExit(f"the trainers' chunked LM head cannot serve this model: {head}")
    return head


def run_interleaved(contenders: list[Contender]) -> None:
    for c in contenders:  # one untimed warm-up step each (kernels, allocator): its gradients are dropped
        c.loss(c.batches[0]).backward()
        c.model.zero_grad(set_to_none=True)
    while any(c.running for c in contenders):
        behind = min((c for c in contenders if c.running), key=lambda c: c.done / len(c.batches))
        behind.step()


def data_sets(args) -> dict[str, tuple[list[Sample], dict]]:
    """Every data set's samples, the vocabulary of them all renumbered (the synthetic ids drawn from it)."""
    tokenizer = load_tokenizer()
    real = {
        name: chat_samples(name, tokenizer, args.conversations, args.seed, args.budget)
        for name in args.datasets
        if name != "synthetic"
    }
    ids = [ids for samples, _ in real.values() for ids, _ in samples]
    vocab = tokenizer.vocab_size
    if ids:
        renumbered, vocab = compact_vocabulary(ids)
        at = 0
        for name, (samples, info) in real.items():
            real[name] = ([(renumbered[at + i], mask) for i, (_, mask) in enumerate(samples)], info)
            at += len(samples)
    if "synthetic" in args.datasets:
        real["synthetic"] = synthetic_rollouts(max(args.conversations // 4, 1), vocab, args.seed, args.budget)
    return {name: (*real[name], vocab) for name in args.datasets}


def measure(name: str, samples: list[Sample], vocab: int, preset: str, args, dtype) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    attention = packing_hf.register_attention()
    reference = build_model(preset, vocab, dtype, args.device, attention)
    init = copy.deepcopy(reference.state_dict())
    flat, flat_indices = flat_batches(samples, args.budget, args.seed)
    trees, tree_indices, plan = tree_batches(samples, args.budget, args.seed)
    first = [samples[i] for i in tree_indices[0]]
    agreement = (
        check_losses_agree(reference, chunked_head(reference), first, args.device)
        if args.dtype == "float32"
        else None
    )
    indices = {"flat": flat_indices, "tree": tree_indices}
    contenders = []
    for contender, batches in zip(CONTENDERS, (flat, trees), strict=True):
        model = (
            reference if contender == "tree" else build_model(preset, vocab, dtype, args.device, attention)
        )
        model.load_state_dict(init)
        contenders.append(Contender(contender, model, batches, args.device, args.cpu_memory))
    run_interleaved(contenders)
    rows = {}
    for c in contenders:
        peaks = spread_stats(c.step_peaks[1:] or c.step_peaks) if c.step_peaks else {}
        mib = {k: v if k == "cv" else v / 2**20 for k, v in peaks.items()}  # cv has no unit
        rows[c.name] = {
            "steps": len(c.batches),
            "samples_per_step": spread_stats([len(batch) for batch in indices[c.name]]),
            "tokens_computed": sum(int(b["input_ids"].numel()) for b in c.batches),
            "epoch_s": c.seconds,
            "epoch_cpu_s": c.cpu_seconds,
            "samples_per_s": len(samples) / c.seconds,
            "step_peak_mem_mib": mib or None,
        }
    flat_row, tree_row = rows["flat"], rows["tree"]
    whole = build_prefix_tree([ids for ids, _ in samples]).token_ratio
    return {
        "dataset": name,
        "preset": preset,
        "samples": len(samples),
        "sample_tokens": sum(len(ids) for ids, _ in samples),
        "token_ratio": flat_row["tokens_computed"] / tree_row["tokens_computed"],
        "planned_ratio": plan["planned_ratio"],
        "whole_tree_ratio": whole,
        "groups": plan["groups"],
        "time_ratio": flat_row["epoch_s"] / tree_row["epoch_s"],
        "cpu_time_ratio": flat_row["epoch_cpu_s"] / tree_row["epoch_cpu_s"],
        "loss_check": agreement,
        **{f"{k}_{key}": value for k, row in rows.items() for key, value in row.items()},
    }


def main() -> None:
    args = parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible")
    load_start = load_average()
    threads = set_threads(args.threads, args.device)
    dtype = getattr(torch, args.dtype)
    results, sets = [], data_sets(args)
    for name, (samples, info, vocab) in sets.items():
        for preset in args.presets:
            row = measure(name, samples, vocab, preset, args, dtype)
            row["data"] = info
            results.append(row)
            print(
                f"{name:>20} {preset:>6}: tokens flat {row['flat_tokens_computed']:,} tree "
                f"{row['tree_tokens_computed']:,} ({row['token_ratio']:.2f}x), epoch {row['flat_epoch_s']:.1f} s / "
                f"{row['tree_epoch_s']:.1f} s ({row['time_ratio']:.2f}x)",
                flush=True,
            )
    load_end = load_average()
    columns = ["dataset", "preset", "samples", "flat_tokens_computed", "tree_tokens_computed", "token_ratio",
               "planned_ratio", "whole_tree_ratio", "flat_steps", "tree_steps", "flat_epoch_s", "tree_epoch_s",
               "time_ratio", "cpu_time_ratio", "flat_samples_per_s", "tree_samples_per_s"]  # fmt: skip
    print(
        f"\n== flat vs prefix-tree packing, budget {args.budget} tokens/step, one epoch each, interleaved, "
        f"{threads['threads']} thread(s) on {threads['cpu_count']} cores, {args.device} {args.dtype} =="
    )
    print_table(results, columns)
    memory = [
        {
            "dataset": r["dataset"],
            "preset": r["preset"],
            **{f"{c}_samples_step_med": r[f"{c}_samples_per_step"]["median"] for c in CONTENDERS},
            **{
                f"{c}_mib_{k}": (r[f"{c}_step_peak_mem_mib"] or {}).get(k)
                for c in CONTENDERS
                for k in ("median", "max")
            },
        }
        for r in results
    ]
    print(
        "\n== peak memory per step (MiB; CPU: growth of the peak resident memory in the step), at the same token "
        "budget: a tree row holds more samples =="
    )
    print_table(memory, list(memory[0]) if memory else [])
    print(f"load average at start {load_start}, at end {load_end} (1, 5, 15 min)")
    payload = {"rows": results, "threads": threads, "load_average": {"start": load_start, "end": load_end}}
    write_json("bench_trees" + ("_quick" if args.quick else ""), payload, args)


if __name__ == "__main__":
    main()
