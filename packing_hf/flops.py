"""Model FLOPs of a training step, with attention counted per sample, and model FLOPs utilisation (MFU).

A packed row of ``T`` tokens holding samples of lengths ``s_1 .. s_n`` costs the matmuls of ``T`` tokens
but attention only within every sample: ``sum_i s_i**2``, not ``T**2``. Counting it as one sequence of
``T`` tokens (or as ``batch x padded length``) overstates the work; this module counts what the model
really does for the real tokens (Megatron-Bridge's THD-aware count, NVIDIA-NeMo/Megatron-Bridge#3839).

**Convention** (training = forward + backward = 3 x the forward's FLOPs, 2 FLOPs per multiply-add):

- matmuls: ``6 x N x T`` for ``T`` real tokens, where ``N`` counts the weights every token is multiplied
  by: the attention projections (q, k, v, o) and the gated MLP (3 matrices) of every layer, and the output
  head (``hidden x vocab``, counted also when it is tied to the embeddings: the matmul runs). Not counted: the
  input embedding (a lookup, no matmul: torchtitan's convention), norms, biases, rotary, softmax, the loss;
- attention: per sample of ``s`` tokens, causal: the scores ``Q K^T`` and the weighted values ``A V`` cost
  ``2 x 2 x head_dim`` FLOPs per (query, key) pair per head and layer in the forward, and a causal sample has
  ``s**2 / 2`` pairs: ``6 x layers x heads x head_dim x s**2`` for forward + backward. That is the work a
  causal kernel (flash-attention, torch's ``varlen_attn``) does; PaLM, Megatron-LM and torchtitan count the
  full square (``12 x layers x heads x head_dim x s`` per token), twice this term: to compare with a figure
  under that convention, add the attention FLOPs once more;
- padding (tokens that are no sample's) and activation recomputation are not model FLOPs: MFU measures
  useful work, so a padded batch and a packed batch of the same samples count the same FLOPs.

The coefficients are :meth:`packing_hf.CostModel.from_config`'s (``linear = 6 N``, ``quadratic =
6 x layers x heads x head_dim``): one count, used both to balance ranks and to report FLOPs. On a Llama with
eager attention (which computes the full square), ``torch.utils.flop_counter`` counts exactly ``matmul + 2 x
attention`` of this convention (``tests/unit/test_flops.py``). MoE routing, sliding windows, linear-attention
layers and vision encoders are not modelled.

MFU = achieved model FLOP/s / (peak FLOP/s x devices). The peak is ``peak_tflops`` when given, else the dense
(no sparsity) bf16 tensor-core peak of a known CUDA device (:data:`PEAK_BF16_TFLOPS`), else unknown: no MFU
(on CPU, unless given).

>>> from transformers import AutoConfig
>>> config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
...     num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
>>> flops = step_flops(CostModel.from_config(config), [3, 5])  # one row of two samples
>>> flops.matmul, flops.attention  # 638976 x 8 tokens, 768 x (9 + 25)
(5111808.0, 26112.0)
>>> step_flops(CostModel.from_config(config), [8]).attention  # the same 8 tokens as one sample: 768 x 64
49152.0
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .cost import CostModel

__all__ = [
    "PEAK_BF16_TFLOPS",
    "StepFlops",
    "batch_sample_lengths",
    "device_peak_tflops",
    "flops_counter",
    "step_flops",
    "step_time_percentiles",
    "summarize_logged_flops",
]

# Dense (no sparsity) bf16 tensor-core peak per device, TFLOP/s, from the vendors' data sheets; the key is a
# part of torch.cuda.get_device_name() and the longest matching key wins ("H100 PCIe" before "H100").
PEAK_BF16_TFLOPS: dict[str, float] = {
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H100": 989.4,  # SXM ("NVIDIA H100 80GB HBM3")
    "H800": 989.4,
    "H200": 989.4,  # also GH200
    "B200": 2250.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
    "RTX 4090": 165.2,
    "RTX A6000": 154.8,
    "MI300X": 1307.4,
}


def device_peak_tflops(device: torch.device | str | None = None) -> float | None:
    """The dense bf16 peak (TFLOP/s) of a CUDA device from :data:`PEAK_BF16_TFLOPS`, ``None`` if unknown.

    Args:
        device: a CUDA device (default: the current one) or its name as ``torch.cuda.get_device_name`` gives
            it; a CPU (or anything else) has no known peak.

    >>> device_peak_tflops("NVIDIA H100 PCIe"), device_peak_tflops("NVIDIA H100 80GB HBM3"), device_peak_tflops("cpu")
    (756.0, 989.4, None)
    """
    if isinstance(device, str) and device not in ("cuda",) and not device.startswith("cuda:"):
        name = device
    else:
        device = torch.device(device if device is not None else "cuda")
        if device.type != "cuda" or not torch.cuda.is_available():
            return None
        name = torch.cuda.get_device_name(device)
    matches = [key for key in PEAK_BF16_TFLOPS if key.lower() in name.lower()]
    return PEAK_BF16_TFLOPS[max(matches, key=len)] if matches else None


def flops_counter(config: Any) -> CostModel | None:
    """The FLOPs coefficients of a model config (:meth:`CostModel.from_config`), ``None`` where the config
    lacks the sizes they are read from (then no FLOPs are reported).

    >>> flops_counter(None) is None
    True
    """
    try:
        return CostModel.from_config(config)
    except ValueError:
        return None


@dataclass(frozen=True)
class StepFlops:
    """Model FLOPs of forward + backward over some samples (the module docstring's convention).

    Args:
        matmul: ``6 x N x tokens``.
        attention: ``6 x layers x heads x head_dim x sum(s_i**2)``.
    """

    matmul: float
    attention: float

    @property
    def total(self) -> float:
        return self.matmul + self.attention


def step_flops(counter: CostModel, lengths: Sequence[int] | np.ndarray) -> StepFlops:
    """Model FLOPs of training on samples of these lengths (one micro-batch, a step, or a whole run).

    Args:
        counter: FLOPs coefficients (:func:`flops_counter` / :meth:`CostModel.from_config`).
        lengths: ``(n,)`` real tokens of every sample (every segment of ``cu_seq_lens``, padding excluded).
    """
    lengths = np.asarray(lengths, dtype=np.float64).reshape(-1)
    return StepFlops(
        float(counter.linear * lengths.sum()), float(counter.quadratic * np.square(lengths).sum())
    )


def batch_sample_lengths(batch: Mapping[str, Any], padding: int = 0) -> list[int]:
    """The lengths of the samples a collated causal-LM batch holds, as the model attends over them.

    Read from, in this order: ``cu_seq_lens_q`` (packed rows: every non-empty segment), ``position_ids`` of
    one flattened row (a new sample wherever the position restarts at 0), ``attention_mask`` (padded rows:
    the mask's count per row), else every row of ``input_ids`` whole.

    Args:
        batch: the collator's output (tensors or arrays).
        padding: tokens of padding closing a packed row (``PaddingFreeCollator(pad_to_multiple_of=...)`` adds
            them as a last segment of their own): that segment is left out.

    >>> batch_sample_lengths({"cu_seq_lens_q": torch.tensor([0, 3, 5, 8]), "input_ids": torch.zeros(1, 8)}, padding=3)
    [3, 2]
    >>> batch_sample_lengths({"attention_mask": torch.tensor([[1, 1, 1], [1, 0, 0]])})
    [3, 1]
    """

    def as_array(value: Any) -> np.ndarray:
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu().numpy()
        return np.asarray(value)

    positions = as_array(batch["position_ids"]) if batch.get("position_ids") is not None else None
    if batch.get("cu_seq_lens_q") is not None:
        lengths = np.diff(as_array(batch["cu_seq_lens_q"]).reshape(-1).astype(np.int64))
    elif positions is not None and positions.size and (positions.ndim == 1 or positions.shape[0] == 1):
        positions = positions.reshape(-1)
        starts = np.union1d([0], np.flatnonzero(positions == 0))
        lengths = np.diff(np.concatenate([starts, [positions.size]]))
    elif batch.get("attention_mask") is not None:
        mask = as_array(batch["attention_mask"])
        lengths = mask.reshape(mask.shape[0], -1).astype(bool).sum(axis=1)
    else:
        ids = as_array(batch["input_ids"])
        ids = ids.reshape(1, -1) if ids.ndim == 1 else ids
        lengths = np.full(ids.shape[0], ids.shape[1])
    lengths = [int(n) for n in lengths if n > 0]
    if padding > 0:
        if not lengths or lengths[-1] != padding:
            raise ValueError(
                f"a packed row said to end with {padding} padding tokens ends with a segment of "
                f"{lengths[-1] if lengths else 0}: the padding is not its own last segment, so its FLOPs cannot be "
                "told apart from a sample's; pass padding=0 to count it as a sample"
            )
        lengths.pop()
    return lengths


def step_time_percentiles(seconds: Sequence[float]) -> dict[str, float]:
    """``{"step_seconds_p50": ..., "step_seconds_p90": ...}`` of step times (linear interpolation, rounded to
    the microsecond), ``{}`` without any.

    >>> step_time_percentiles([1.0, 2.0, 3.0, 4.0, 10.0])
    {'step_seconds_p50': 3.0, 'step_seconds_p90': 7.6}
    """
    values = [float(s) for s in seconds if math.isfinite(s)]
    if not values:
        return {}
    p50, p90 = np.percentile(np.asarray(values), [50, 90])
    return {"step_seconds_p50": round(float(p50), 6), "step_seconds_p90": round(float(p90), 6)}


def summarize_logged_flops(log_history: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """A training run's FLOPs figures from its logs (``trainer.state.log_history``), ``None`` without any.

    Every training log covers the steps since the previous one; the run's figures weigh them by their steps:
    ``model_flops`` (all steps), ``attention_share`` (of those FLOPs), ``model_tflops_per_s`` (FLOPs over the
    timed seconds), ``mfu`` (where the logs have it), and ``step_seconds_p50`` / ``_p90``: exact percentiles
    of the steps when every log covers one step (``logging_steps=1``), else the median of the logs' own
    (``step_percentiles`` says which).

    >>> logs = [{"step": 1, "model_flops_per_step": 4e12, "attention_flops_per_step": 1e12,
    ...          "model_tflops_per_s": 2.0, "mfu": 0.5, "step_seconds_p50": 2.0, "step_seconds_p90": 2.0},
    ...         {"step": 2, "model_flops_per_step": 6e12, "attention_flops_per_step": 2e12,
    ...          "model_tflops_per_s": 2.0, "mfu": 0.5, "step_seconds_p50": 3.0, "step_seconds_p90": 3.0}]
    >>> summary = summarize_logged_flops(logs)
    >>> summary["model_flops"], summary["attention_share"], summary["model_tflops_per_s"], summary["mfu"]
    (10000000000000.0, 0.3, 2.0, 0.5)
    >>> summary["step_seconds_p50"], summary["step_percentiles"]
    (2.5, 'steps')
    """
    total = attention = seconds = 0.0
    previous, windows, mfu_per_tflops = 0, [], None
    for entry in log_history:
        if "model_flops_per_step" not in entry:
            previous = int(entry.get("step", previous))
            continue
        step = int(entry.get("step", previous + 1))
        steps, previous = max(step - previous, 1), step
        flops = float(entry["model_flops_per_step"]) * steps
        total += flops
        attention += float(entry.get("attention_flops_per_step", 0.0)) * steps
        tflops = entry.get("model_tflops_per_s")
        if tflops:
            seconds += flops / (float(tflops) * 1e12)
            if "mfu" in entry:
                mfu_per_tflops = float(entry["mfu"]) / float(tflops)
        if "step_seconds_p50" in entry:
            windows.append((steps, float(entry["step_seconds_p50"]), float(entry["step_seconds_p90"])))
    if total == 0:
        return None
    out: dict[str, Any] = {"model_flops": total, "attention_share": attention / total}
    if seconds > 0:
        out["model_tflops_per_s"] = total / seconds / 1e12
        if mfu_per_tflops is not None:
            out["mfu"] = out["model_tflops_per_s"] * mfu_per_tflops
    if windows:
        if all(steps == 1 for steps, _, _ in windows):
            out.update(step_time_percentiles([p50 for _, p50, _ in windows]), step_percentiles="steps")
        else:
            out["step_seconds_p50"] = float(np.median([p50 for _, p50, _ in windows]))
            out["step_seconds_p90"] = float(np.median([p90 for _, _, p90 in windows]))
            out["step_percentiles"] = "median of the logged windows"
    return out
