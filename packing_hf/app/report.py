"""The ``packing-hf train`` report: the summary table printed at the end of the job, and its phrases.

>>> _plural(1, "step"), _plural(3, "batch", "batches")
('1 step', '3 batches')
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

__all__ = [
    "describe_max_length_cut",
    "load_average",
    "machine_note",
    "plot_losses",
    "prefix_tree_summary",
    "print_summary",
]


def _plural(count: int, word: str, plural: str | None = None) -> str:
    """``1 step``, ``2 steps``.

    >>> _plural(1, "step"), _plural(3, "batch", "batches")
    ('1 step', '3 batches')
    """
    return f"{count:,} {word if count == 1 else plural or word + 's'}"


def _describe_stream(stats: dict[str, Any]) -> str:
    """One line on a streamed run: what the training steps used (their own fill, as the step logs show it),
    then what the reader and packer had done by the end, ahead of training (``PackedStream.stats()``)."""
    overflow = [
        f"{stats[key]:,} {name}"
        for key, name in (
            ("truncated_samples", "truncated"),
            ("split_samples", "split"),
            ("overflow_dropped_samples", "dropped"),
        )
        if stats.get(key)
    ]
    fill = stats.get("fill_trained")
    return (
        f"stream: {_plural(stats['steps'], 'step')} trained on {_plural(stats['batches_trained'], 'batch', 'batches')}"
        + (f", fill {100 * fill:.1f}% (mean of the step logs)" if fill is not None else "")
        + f"; read ahead by the loader: {_plural(stats['records_read'], 'record')}, "
        f"{_plural(stats['samples'], 'sample')} packed into {_plural(stats['batches'], 'batch', 'batches')} "
        f"in pass {int(stats['epoch']) + 1} of the data; overflow of the budget: "
        + (", ".join(overflow) if overflow else "none")
    )


def describe_max_length_cut(trainer: Any, max_length: int | None) -> str | None:
    """What TRL's ``max_length`` cut from the training set (``trainer.max_length_stats`` of any packed TRL
    trainer: samples or sequences truncated, rows left out), or None when it cut nothing.

    >>> class T: max_length_stats = {"train": {"truncated_samples": 2, "truncated_tokens": 900, "dropped_samples": 1}}
    >>> describe_max_length_cut(T(), 1024)
    "TRL's max_length=1024 truncated 2 samples (900 tokens cut) and left out 1 sample"
    """
    cut = getattr(trainer, "max_length_stats", {}).get("train") or {}
    parts = []
    if cut.get("truncated_samples"):
        parts.append(
            f"truncated {_plural(cut['truncated_samples'], 'sample')} ({cut['truncated_tokens']:,} tokens cut)"
        )
    if cut.get("dropped_samples"):
        parts.append(f"left out {_plural(cut['dropped_samples'], 'sample')}")
    return f"TRL's max_length={max_length} " + " and ".join(parts) if parts else None


def prefix_tree_summary(trainer: Any) -> dict[str, Any] | None:
    """``share_prefixes``: the trained samples' tokens (each alone), the tree rows' tokens, their ratio (over the
    logged steps, every rank); None without it."""
    if not getattr(trainer.args, "share_prefixes", False):
        return None
    samples, rows = getattr(trainer, "tree_tokens_trained", (0.0, 0.0))
    return {
        "sample_tokens": int(samples),
        "tree_tokens": int(rows),
        "tree_token_ratio": samples / rows if rows else None,
        "min_shared_tokens": trainer.args.min_shared_tokens,
        "counted": bool(getattr(trainer.args, "packing_metrics", True)),
    }


def _spread(base: dict[str, Any]) -> str:
    """The spread of the speed ratio: over the pairs of batches (fastest of the rounds) and over the rounds.

    >>> _spread({"pair_speedups": [1.2, 1.5, 1.3], "round_speedups": [1.31, 1.35], "repeats": 2})
    'per batch 1.20x to 1.50x (3 batches); per round 1.31x, 1.35x'
    """
    parts = []
    pairs = base.get("pair_speedups") or []
    if pairs:
        parts.append(
            f"per batch {min(pairs):.2f}x to {max(pairs):.2f}x ({_plural(len(pairs), 'batch', 'batches')})"
        )
    rounds = base.get("round_speedups") or []
    if rounds:
        parts.append("per round " + ", ".join(f"{r:.2f}x" for r in rounds))
    return "; ".join(parts)


def _fmt_pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _fmt_seconds(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s" if minutes else f"{seconds:.1f} s"


def load_average() -> dict[str, float | int | None]:
    """The 1-minute load average now and the cores this process may use (``load`` None where the platform
    has no load average)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        cores = os.cpu_count() or 1
    try:
        load = round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        load = None
    return {"load": load, "cores": cores}


def machine_note(machine: dict[str, Any] | None) -> tuple[bool, str]:
    """``(busy, one line)`` on the machine's load during the run: busy when the 1-minute load average at the
    start or the end of the job was above the number of cores (other processes took CPU time from this one,
    so wall times and the packed / padded ratio are noisy).

    >>> machine_note({"start": 3.1, "end": 1.2, "cores": 2})
    (True, 'busy: load average 3.10 at the start, 1.20 at the end, on 2 cores: wall times and the packed / padded speed ratio were measured on a busy machine and are noisy; rerun on an idle machine to compare them')
    >>> machine_note({"start": 0.4, "end": 1.5, "cores": 2})[0]
    False
    """
    if not machine or machine.get("start") is None or machine.get("end") is None:
        return False, "load average unknown on this platform"
    start, end, cores = machine["start"], machine["end"], machine["cores"]
    loads = f"load average {start:.2f} at the start, {end:.2f} at the end, on {_plural(cores, 'core')}"
    if max(start, end) > cores:
        return True, (
            f"busy: {loads}: wall times and the packed / padded speed ratio were measured on a busy machine "
            "and are noisy; rerun on an idle machine to compare them"
        )
    return False, f"not busy: {loads}"


def print_summary(summary: dict[str, Any], print_fn) -> None:
    """Print the job's summary: what ran, the packed vs padded table, and where its outputs and time went."""
    rule = "=" * 90
    busy, machine = machine_note(summary.get("machine_load"))
    lines = ["", rule, "packing-hf train: summary", rule, *_run_lines(summary), "-" * 90]
    lines += _table_lines(summary, busy)
    lines += ["-" * 90, *_output_lines(summary, busy), f"machine      {machine}", rule]
    print_fn("\n".join(lines))


def _run_lines(summary: dict[str, Any]) -> list[str]:
    """What ran: model, attention, data, training steps and losses (rewards for RL)."""
    lines = []
    processes = summary.get("processes") or 1
    launch = f", the main one of {processes} processes" if processes > 1 else ""
    lines.append(f"model        {summary['model']} on {summary['device']} ({summary['precision']}{launch})")
    lines.append(f"attention    {summary.get('attn_implementation')}")
    if summary.get("stream"):
        lines.append(f"data         {summary['records']}")
        lines.append(f"             {_describe_stream(summary['stream'])}")
    elif summary.get("records") and "num_samples" not in summary:
        lines.append(f"data         {summary['records']}")
    if summary.get("reference"):
        lines.append(f"reference    {summary['reference']}")
    if "num_samples" in summary:
        lines.append(
            f"data         {summary['dataset']}: {summary['num_samples']:,} samples, {summary['num_tokens']:,} "
            f"tokens ({summary['prompt_format']} format)"
        )
    if summary.get("max_length_cut"):
        lines.append(f"             {summary['max_length_cut']}")
    budget = summary.get("max_tokens_per_batch")
    losses = summary.get("losses") or []
    batching = summary["batching"] + (f", max_tokens_per_batch={budget}" if budget else "")
    lines.append(f"training     {batching}: {_steps(summary)}" + _losses(summary, losses))
    trees = summary.get("prefix_trees")
    if trees:
        lines.append(f"prefix trees {_describe_trees(trees)}")
    flops = summary.get("flops")
    if flops:
        lines.append(f"compute      {_describe_flops(flops)}")
    rewards = summary.get("rewards") or []
    if rewards:
        lines.append(
            f"reward       {rewards[0]:.4f} (first step) -> {rewards[-1]:.4f} (last step), mean per logged step"
        )
    return lines


def _describe_trees(trees: dict[str, Any]) -> str:
    """The ``share_prefixes`` line: tokens computed for the samples' tokens, and their ratio.

    >>> _describe_trees({"sample_tokens": 5000, "tree_tokens": 2000, "tree_token_ratio": 2.5, "min_shared_tokens": 1})
    'tree_token_ratio 2.50x: 2,000 tokens computed for 5,000 sample tokens (share_prefixes, min_shared_tokens=1)'
    """
    ratio = trees.get("tree_token_ratio")
    if ratio is None:
        why = "no training step was logged" if trees.get("counted", True) else "not counted (packing_metrics: false)"
        return f"share_prefixes, min_shared_tokens={trees['min_shared_tokens']}: {why}"
    return (
        f"tree_token_ratio {ratio:.2f}x: {trees['tree_tokens']:,} tokens computed for {trees['sample_tokens']:,} "
        f"sample tokens (share_prefixes, min_shared_tokens={trees['min_shared_tokens']})"
    )


def _steps(summary: dict[str, Any]) -> str:
    """The steps this run trained and their time; a resumed run also names its checkpoint and the total.

    >>> _steps({"global_step": 100, "steps_this_run": 90, "train_runtime": 12.0,
    ...         "resumed_from": {"checkpoint": "out/checkpoint-10", "global_step": 10}})
    '90 steps in 12.0 s, resumed from out/checkpoint-10 (10 steps before): 100 steps in all'
    """
    done = summary.get("steps_this_run", summary["global_step"])
    text = f"{_plural(done, 'step')} in {summary['train_runtime']:.1f} s"
    resumed = summary.get("resumed_from")
    if resumed:
        text += (
            f", resumed from {resumed['checkpoint']} ({_plural(resumed['global_step'], 'step')} before): "
            f"{_plural(summary['global_step'], 'step')} in all"
        )
    return text


# Why a demo's loss looks the way it does, where it would puzzle (printed beside the loss of the summary).
_LOSS_NOTES = {
    "grpo": (
        "GRPO's loss reads ~0 by design: with num_iterations=1 the policy ratio is 1 and the advantages are "
        "centred on each prompt's group (exactly 0 when the completions are equally long), so the value is ~0 "
        "while the gradient is not; beta > 0 adds a KL term. Watch the reward, not the loss"
    ),
    "rloo": (
        "RLOO's loss reads ~0 by design: with num_iterations=1 the policy ratio is 1 and the leave-one-out "
        "advantages of a prompt's completions sum to 0 (beta's KL is taken from the rewards, not added to the "
        "loss), so the value is ~0 while the gradient is not. Watch the reward, not the loss"
    ),
    "cpo": (
        "CPO's loss is -logsigmoid(beta x (log-prob of chosen - of rejected)) + cpo_alpha x the chosen answer's "
        "NLL, the log-probs summed over each answer: on an untrained model the NLL alone is about "
        "ln(vocabulary size) (10.8 for 49,152 tokens), and a pair whose chosen answer is 10 tokens longer than "
        "its rejected one adds about beta x 108; values in the tens that follow each batch's pairs more than a "
        "few steps of training"
    ),
}


def _losses(summary: dict[str, Any], losses: list[float]) -> str:
    """The first and last logged loss of this run, with a note where the trainer's loss reads oddly."""
    if not losses:
        return ""
    first = "first step" if not summary.get("resumed_from") else "first step of this run"
    text = f", train loss {losses[0]:.4f} ({first}) -> {losses[-1]:.4f} (last step)"
    note = _LOSS_NOTES.get(summary.get("trainer", ""))
    return text + (f"\n             ({note})" if note else "")


def _describe_flops(flops: dict[str, Any]) -> str:
    """The run's model FLOPs in one line (:func:`packing_hf.flops.summarize_logged_flops`).

    >>> _describe_flops({"model_flops": 3.2e15, "attention_share": 0.08, "model_tflops_per_s": 150.0,
    ...     "mfu": 0.1516, "step_seconds_p50": 0.41, "step_seconds_p90": 0.45, "step_percentiles": "steps"})
    '3.2 PFLOPs (attention 8.0%, per sample), 150 model TFLOP/s, MFU 15.2%, step 0.41 s p50 / 0.45 s p90'
    >>> _describe_flops({"model_flops": 5e9, "attention_share": 0.01, "model_tflops_per_s": 0.002})
    '5 GFLOPs (attention 1.0%, per sample), 0.002 model TFLOP/s, MFU n/a (no known peak: set peak_tflops)'
    """
    value, unit = flops["model_flops"], ""
    for scale, name in ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M")):
        if value >= scale:
            value, unit = value / scale, name
            break
    parts = [f"{value:.3g} {unit}FLOPs (attention {_fmt_pct(flops['attention_share'])}, per sample)"]
    if flops.get("model_tflops_per_s") is not None:
        parts.append(f"{flops['model_tflops_per_s']:.3g} model TFLOP/s")
        parts.append(
            f"MFU {_fmt_pct(flops['mfu'])}" if "mfu" in flops else "MFU n/a (no known peak: set peak_tflops)"
        )
    if flops.get("step_seconds_p50") is not None:
        where = "" if flops.get("step_percentiles") == "steps" else " (median of the logged windows)"
        parts.append(
            f"step {flops['step_seconds_p50']:.3g} s p50 / {flops['step_seconds_p90']:.3g} s p90{where}"
        )
    return ", ".join(parts)


def _table_lines(summary: dict[str, Any], busy: bool) -> list[str]:
    """Packed vs padded: fill, tokens/s and their ratio, and the held-out eval loss."""
    lines = [f"{'':34}{'packed':>12}{'padded':>12}  padded means"]
    base = summary.get("baseline")
    if summary.get("padded_efficiency") is not None and not summary.get("stream"):
        lines.append(
            f"{'fill (real / provisioned tokens)':34}{_fmt_pct(summary.get('packing_efficiency')):>12}"
            f"{_fmt_pct(summary['padded_efficiency']):>12}  batches of {summary['padded_batch_size']} samples "
            "in random order, each padded to its longest"
        )
        lines.append(
            f"{'':34}{'':>12}{_fmt_pct(summary['padded_to_longest_efficiency']):>12}  every sample padded "
            "to the dataset's longest"
        )
    elif summary.get("stream") and summary.get("packing_efficiency") is not None:
        lines.append(
            f"{'fill (real / provisioned tokens)':34}{_fmt_pct(summary['packing_efficiency']):>12}"
            f"{_fmt_pct(summary.get('padded_efficiency')):>12}  the trained steps' samples, each step's padded "
            "to its longest (step logs)"
        )
    elif summary.get("packing_efficiency") is not None:
        lines.append(f"{'fill (real / provisioned tokens)':34}{_fmt_pct(summary['packing_efficiency']):>12}")
    if summary.get("logged_packing_efficiency") is not None:
        lines.append(
            f"{'':34}(the step logs' packing_efficiency is each step's own fill; their padded_batch_efficiency "
            "pads that step's samples)"
        )
    if base:
        lines.append(
            f"{'tokens/s (forward+backward)':34}{base['packed_tokens_per_s']:>12.0f}{base['padded_tokens_per_s']:>12.0f}"
            f"  the same {base['real_tokens']:,} real tokens in {_plural(base['padded_batches'], 'batch', 'batches')} "
            f"({base['padded_tokens']:,} with padding)"
        )
        lines.append(f"{'  packed / padded speed':34}{base['speedup']:>11.2f}x{'':12}  {_spread(base)}")
        if busy:
            lines.append(f"{'':34}{'':>24}  taken on a busy machine (see 'machine' below): noisy")
    elif summary.get("baseline_note"):
        lines.append(f"{'tokens/s (forward+backward)':34}{'':>24}  {summary['baseline_note']}")
    if summary.get("eval_loss_before") is not None:
        lines.append(
            f"{'eval loss (held out)':34}{summary['eval_loss_before']:>12.4f} before -> "
            f"{summary['eval_loss_after']:.4f} after training, on {summary['eval_samples']} samples of "
            f"{summary['eval_dataset']} ({summary['eval_tokens']:,} trained tokens)"
        )
    return lines


def _output_lines(summary: dict[str, Any], busy: bool) -> list[str]:
    """Where the model went, peak memory, and wall and CPU time per phase."""
    lines = []
    if summary.get("output_dir"):
        lines.append(f"saved        {summary['output_dir']}")
    peaks = summary.get("peak_rss_gb") or {}
    if peaks.get("train"):
        job, trained = max(v for v in peaks.values() if v is not None), peaks["train"]
        lines.append(
            f"memory       peak RSS {job:.2f} GB for the job, {trained:.2f} GB by the end of training "
            f"(x{job / trained:.2f})"
        )
    phases = ", ".join(f"{name} {_fmt_seconds(seconds)}" for name, seconds in summary["seconds"].items())
    lines.append(f"total        {_fmt_seconds(summary['total_seconds'])} wall ({phases})")
    if summary.get("cpu_seconds"):
        cpu = ", ".join(f"{name} {_fmt_seconds(seconds)}" for name, seconds in summary["cpu_seconds"].items())
        lines.append(
            f"             {_fmt_seconds(summary['total_cpu_seconds'])} CPU, all threads ({cpu})"
            + (": steadier than wall time on a shared machine" if not busy else "")
        )
    return lines


def plot_losses(log_history: list[dict[str, Any]], path: Path) -> str | None:
    """Draw the logged training losses (and eval losses, if any) against the step into ``path`` (a PNG), with
    a second panel of the model TFLOP/s (and MFU) where the logs have them (packing metrics); return its
    path, or None when matplotlib is missing (the curve is optional: nothing else needs it).

    >>> import tempfile, pathlib
    >>> out = pathlib.Path(tempfile.mkdtemp()) / "loss.png"
    >>> plot_losses([{"loss": 2.0, "step": 1}, {"loss": 1.5, "step": 2}], out) in (str(out), None)
    True
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    throughput = [
        (entry.get("step", i + 1), float(entry["model_tflops_per_s"]), entry.get("mfu"))
        for i, entry in enumerate(log_history)
        if "model_tflops_per_s" in entry
    ]
    figure, panels = plt.subplots(1, 2 if throughput else 1, figsize=(11 if throughput else 6, 3.5))
    axes = panels[0] if throughput else panels
    for key, label in (("loss", "train loss"), ("eval_loss", "eval loss")):
        points = [
            (entry.get("step", i + 1), float(entry[key]))
            for i, entry in enumerate(log_history)
            if key in entry
        ]
        if points:
            steps = [step for step, _ in points]
            values = [value for _, value in points]
            axes.plot(steps, values, marker="o" if len(points) < 30 else None, label=label)
    axes.set_xlabel("step")
    axes.set_ylabel("loss")
    axes.legend()
    axes.grid(alpha=0.3)
    if throughput:
        # model FLOPs with attention counted per sample (packing_hf.flops), over each logged window's step time
        steps = [step for step, _, _ in throughput]
        speed = panels[1]
        speed.plot(steps, [t for _, t, _ in throughput], marker="o" if len(steps) < 30 else None)
        speed.set_xlabel("step")
        speed.set_ylabel("model TFLOP/s")
        speed.grid(alpha=0.3)
        if all(mfu is not None for _, _, mfu in throughput):
            ratio = throughput[0][2] / throughput[0][1] if throughput[0][1] else 0.0
            if ratio:
                mfu_axis = speed.secondary_yaxis(
                    "right", functions=(lambda t: 100 * t * ratio, lambda m: m / 100 / ratio)
                )
                mfu_axis.set_ylabel("MFU (%)")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return str(path)


def _peak_rss_gb() -> float | None:
    """The process's peak resident memory so far, in GB (None where ``resource`` is missing: Windows)."""
    try:
        import resource
        import sys
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 1e9 if sys.platform == "darwin" else peak * 1024 / 1e9  # bytes on macOS, KiB on Linux


class _Phases:
    """Wall and CPU seconds per phase of the job, and the peak memory by the end of each (where the time
    and the memory went: the diagnostics after training must not raise the peak of training). CPU seconds
    (all threads of this process) are the steadier figure on a machine shared with other jobs."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.cpu_seconds: dict[str, float] = {}
        self.peak_rss_gb: dict[str, float | None] = {}
        self._started = (time.perf_counter(), time.process_time())
        self.load_at_start = load_average()
        self._phase: tuple[str, float, float] | None = None

    def start(self, name: str) -> None:
        self.stop()
        self._phase = (name, time.perf_counter(), time.process_time())

    def stop(self) -> None:
        if self._phase is not None:
            name, began, began_cpu = self._phase
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - began
            self.cpu_seconds[name] = self.cpu_seconds.get(name, 0.0) + time.process_time() - began_cpu
            self.peak_rss_gb[name] = _peak_rss_gb()
            self._phase = None

    @property
    def total(self) -> float:
        return time.perf_counter() - self._started[0]

    @property
    def total_cpu(self) -> float:
        return time.process_time() - self._started[1]
