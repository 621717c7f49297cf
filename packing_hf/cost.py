"""The compute cost of a packed batch: ``cost(L) = linear * L + quadratic * L**2`` per sample.

Under data parallelism every step waits for the slowest rank. Multipack fills every rank's batch with about
the same number of tokens, but attention grows with the square of each sample's length: a batch holding
two 4k-token samples costs more than one holding thirty-two 256-token samples. A :class:`CostModel`
predicts a batch's cost as the sum over its samples of ``linear * L + quadratic * L**2``, and
:class:`~packing_hf.MultipackBatchSampler` given one (``cost_model=``) forms every step of batches of
nearly the same predicted cost (``balance="cost"``, its default when a cost model is given).

Three ways to get one:

- given: ``CostModel(linear, quadratic)`` (only the ratio matters for balancing; verl uses
  ``24576 * L + L**2``);
- from a model config, counting FLOPs: :meth:`CostModel.from_config` (``6 x`` the matmul parameters a
  token passes through, and ``6 x layers x heads x head_dim`` per pair of tokens of a causal sample);
- measured: :func:`fit_cost_model` times a few forward + backward passes of the model itself on packed
  rows of different sample lengths (bounded: ``4 x (repeats + 1)`` passes of at most ``max_tokens``
  tokens) and caches the fit per model, dtype, device and attention in a JSON file.

>>> cost = CostModel(linear=4.0, quadratic=1.0)
>>> cost([2, 8]).tolist(), cost.batch_cost([2, 8])
([12.0, 96.0], 108.0)
>>> rank_cost_spread(np.array([[10.0, 30.0], [20.0, 20.0]]))  # (10+30 waits for 30) + (20, 20)
1.25
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

__all__ = ["CostModel", "default_cost_cache", "fit_cost_model", "rank_cost_spread", "resolve_cost_model"]


@dataclass(frozen=True)
class CostModel:
    """Predicted cost of a sample of ``L`` tokens: ``linear * L + quadratic * L**2`` (any unit).

    Args:
        linear: cost per token (the matmuls, the norms, the loss): ``>= 0``.
        quadratic: cost per pair of tokens within one sample (attention): ``>= 0``.
        source: where the figures come from (``"given"``, ``"flops"``, ``"fitted"``): reported, not used.

    Raises:
        ValueError: a coefficient is negative, not finite, or both are 0.

    >>> CostModel(24576, 1).batch_cost([4096])  # verl's cost of one 4k-token sample
    117440512.0
    """

    linear: float
    quadratic: float
    source: str = "given"

    def __post_init__(self) -> None:
        for name in ("linear", "quadratic"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value < 0
            ):
                raise ValueError(
                    f"CostModel.{name} must be a finite number >= 0, got {value!r}; pass the coefficients of "
                    "cost(L) = linear * L + quadratic * L**2, or use CostModel.from_config / fit_cost_model"
                )
        if self.linear == 0 and self.quadratic == 0:
            raise ValueError("CostModel(linear=0, quadratic=0) predicts no cost at all; one must be > 0")

    def __call__(self, lengths: Sequence[int] | np.ndarray) -> np.ndarray:
        """``(n,)`` float64: the predicted cost of every sample."""
        lengths = np.asarray(lengths, dtype=np.float64)
        return self.linear * lengths + self.quadratic * lengths**2

    def batch_cost(self, lengths: Sequence[int] | np.ndarray) -> float:
        """The predicted cost of one packed batch of samples of these lengths."""
        return float(self(lengths).sum())

    def bin_costs(self, bin_tokens: np.ndarray, bin_squares: np.ndarray) -> np.ndarray:
        """``(n_bins,)`` float64 from every bin's tokens and sum of squared sample lengths (both ``(n_bins,)``)."""
        return self.linear * np.asarray(bin_tokens, np.float64) + self.quadratic * np.asarray(
            bin_squares, np.float64
        )

    @classmethod
    def parse(cls, text: str) -> CostModel:
        """``"LINEAR,QUADRATIC"`` (a command-line option) as a cost model.

        >>> CostModel.parse("24576,1")
        CostModel(linear=24576.0, quadratic=1.0, source='given')
        """
        parts = str(text).split(",")
        try:
            linear, quadratic = (float(p) for p in parts)
        except ValueError:
            raise ValueError(
                f"cost model {text!r}: expected two numbers 'LINEAR,QUADRATIC' for "
                "cost(L) = LINEAR * L + QUADRATIC * L**2, e.g. '24576,1'"
            ) from None
        return cls(linear, quadratic)

    @classmethod
    def from_config(cls, config: Any) -> CostModel:
        """The training FLOPs of a decoder config: forward + backward = 3 x the forward's matmuls.

        Per token ``6 x`` the weights of the attention projections, a gated MLP (3 matrices) per layer and
        the output head; per pair of tokens of one causal sample (``L**2 / 2`` pairs) ``2 x 2`` FLOPs per
        head dimension for the scores and the weighted values, times 3: ``6 x layers x heads x head_dim``
        per ``L**2``. Reads ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
        ``num_key_value_heads``, ``head_dim``, ``intermediate_size`` and ``vocab_size`` (a multimodal
        config's ``text_config``); MoE routing, sliding windows and linear-attention layers are not
        modelled (fit the model instead: :func:`fit_cost_model`).

        >>> from transformers import AutoConfig
        >>> config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        ...     num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
        >>> CostModel.from_config(config)
        CostModel(linear=638976.0, quadratic=768.0, source='flops')
        """
        config = getattr(config, "text_config", None) or config
        try:
            hidden = int(config.hidden_size)
            layers = int(config.num_hidden_layers)
            heads = int(config.num_attention_heads)
        except (AttributeError, TypeError) as error:
            raise ValueError(
                f"{type(config).__name__} lacks hidden_size / num_hidden_layers / num_attention_heads, which "
                "the FLOPs cost model reads; give the coefficients (CostModel(linear, quadratic)) or fit them "
                "(fit_cost_model)"
            ) from error
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
        intermediate = int(getattr(config, "intermediate_size", None) or 4 * hidden)
        vocab = int(getattr(config, "vocab_size", 0) or 0)
        per_layer = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * intermediate
        linear = 6.0 * (layers * per_layer + hidden * vocab)
        quadratic = 6.0 * layers * heads * head_dim
        return cls(linear, quadratic, source="flops")


def rank_cost_spread(step_costs: np.ndarray) -> float:
    """How long the ranks run against a perfectly balanced plan: ``sum_steps max / sum_steps mean``.

    Every step lasts as long as its slowest rank; 1.0 is no wait at all, 1.25 means the job takes 25%
    longer than the same work evenly spread.

    Args:
        step_costs: ``(num_steps, num_ranks)`` predicted (or measured) cost of every rank's batch.
    """
    step_costs = np.asarray(step_costs, dtype=np.float64)
    if step_costs.ndim != 2:
        raise ValueError(f"step_costs must be (num_steps, num_ranks), got shape {step_costs.shape}")
    mean = float(step_costs.mean(axis=1).sum()) if step_costs.size else 0.0
    return float(step_costs.max(axis=1).sum()) / mean if mean > 0 else 1.0


# --------------------------------------------------------------------------------------------------
# fitting


def default_cost_cache() -> Path:
    """Where fitted cost models are cached: ``$PACKING_HF_COST_CACHE``, else ``~/.cache/packing_hf/cost_models.json``."""
    env = os.environ.get("PACKING_HF_COST_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "packing_hf" / "cost_models.json"


def _cache_key(model: torch.nn.Module, max_tokens: int) -> str:
    """What a fit depends on: the config, the parameters' dtype, the device, the attention, torch."""
    parameter = next(model.parameters())
    device = parameter.device
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    config = getattr(model, "config", None)
    described = {
        "model": type(model).__name__,
        "config": config.to_json_string(use_diff=False)
        if hasattr(config, "to_json_string")
        else repr(config),
        "attention": getattr(config, "_attn_implementation", None),
        "dtype": str(parameter.dtype),
        "device": device_name,
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
        "torch": torch.__version__,
        "max_tokens": int(max_tokens),
    }
    return hashlib.sha1(json.dumps(described, sort_keys=True).encode()).hexdigest()


def _design(max_tokens: int) -> list[tuple[int, int]]:
    """``(samples, length)`` of the timed rows: three sample lengths at the full budget, one at half.

    Rows of the same tokens but different sample lengths separate ``quadratic`` from ``linear``; the
    half-budget row of one sample has the squares of the ``(4, budget / 4)`` row, which separates
    ``linear`` from the fixed cost of a step.
    """
    points = []
    for samples, divisor in ((1, 1), (4, 4), (16, 16), (1, 2)):
        length = max(1, max_tokens // divisor)
        points.append((samples if length > 1 else 1, length))
    return points


def _fit(rows: list[tuple[int, float, float]]) -> tuple[float, float]:
    """Least squares of ``seconds = fixed + linear * tokens + quadratic * squares`` with both >= 0."""
    tokens = np.array([r[0] for r in rows], np.float64)
    squares = np.array([r[1] for r in rows], np.float64)
    seconds = np.array([r[2] for r in rows], np.float64)
    ones = np.ones_like(tokens)
    best = None
    # the unconstrained fit, then each coefficient pinned to 0 (a tiny active-set search over 2 signs)
    for use_linear, use_quadratic in ((True, True), (True, False), (False, True)):
        columns = [ones] + [tokens] * use_linear + [squares] * use_quadratic
        coef, *_ = np.linalg.lstsq(np.stack(columns, axis=1), seconds, rcond=None)
        if (coef[1:] < 0).any():
            continue
        residual = float(np.sum((np.stack(columns, axis=1) @ coef - seconds) ** 2))
        rest = iter(coef[1:].tolist())
        found = (next(rest) if use_linear else 0.0, next(rest) if use_quadratic else 0.0)
        if best is None or residual < best[0]:
            best = (residual, found)
    if best is None or best[1] == (0.0, 0.0):
        # the time did not grow with the tokens at all (a device far from saturated): tokens are the cost
        return 1.0, 0.0
    return float(best[1][0]), float(best[1][1])


def fit_cost_model(
    model: torch.nn.Module,
    max_tokens: int,
    *,
    repeats: int = 2,
    cache: str | os.PathLike | None | bool = True,
    seed: int = 0,
) -> CostModel:
    """Measure ``cost(L) = linear * L + quadratic * L**2`` (seconds) on the model as it will train.

    Times forward + backward of four packed rows (:class:`~packing_hf.PaddingFreeCollator` layout: the
    model must already use packing_hf's attention, or any that reads ``cu_seq_lens``): one sample of
    ``max_tokens``, 4 of ``max_tokens / 4``, 16 of ``max_tokens / 16``, and one of ``max_tokens / 2``.
    Each row runs once to warm up, then ``repeats`` times; the median times are fitted by least squares
    with a fixed cost per step (dropped: every rank pays it once per step). Gradients are cleared
    afterwards (call it before training, not in the middle of an accumulation). The result is cached
    under a key of the model's config, dtype, device (name), attention implementation, torch version
    and ``max_tokens``, so a second run reads it without timing anything.

    Args:
        model: a causal LM taking ``input_ids``, ``labels``, ``position_ids`` and ``cu_seq_lens_q/k``.
        max_tokens: the token budget of a batch (``max_tokens_per_batch``): the rows timed hold up to it.
        repeats: timed passes per row after the warm-up (``>= 1``).
        cache: ``True`` (default): :func:`default_cost_cache`; a path: that JSON file; ``False``/``None``:
            neither read nor written.
        seed: seed of the random token ids.

    Returns:
        A :class:`CostModel` with ``source="fitted"``.

    >>> from transformers import AutoConfig, AutoModelForCausalLM
    >>> from packing_hf import register_attention
    >>> config = AutoConfig.for_model("llama", vocab_size=64, hidden_size=16, intermediate_size=32,
    ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, use_cache=False)
    >>> model = AutoModelForCausalLM.from_config(config, attn_implementation=register_attention())
    >>> fit_cost_model(model, 64, repeats=1, cache=False).source
    'fitted'
    """
    from .collator import PaddingFreeCollator

    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an int >= 1 (the token budget of a batch), got {max_tokens!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    path = default_cost_cache() if cache is True else (Path(cache) if cache else None)
    key = _cache_key(model, max_tokens)
    stored: dict[str, Any] = {}
    if path is not None and path.is_file():
        try:
            stored = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            stored = {}  # a damaged cache is refitted and rewritten
        if isinstance(stored, dict) and isinstance(stored.get(key), dict):
            entry = stored[key]
            return CostModel(float(entry["linear"]), float(entry["quadratic"]), source="fitted")
    device = next(model.parameters()).device
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 0) or 2)
    generator = torch.Generator().manual_seed(seed)
    collate = PaddingFreeCollator()
    rows = []
    for samples, length in _design(max_tokens):
        features = [
            {"input_ids": torch.randint(0, vocab, (length,), generator=generator).tolist()}
            for _ in range(samples)
        ]
        batch = {
            k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in collate(features).items()
        }
        times = []
        for attempt in range(repeats + 1):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            model(**batch, use_cache=False).loss.backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if attempt:  # the first pass warms up kernels and allocator
                times.append(time.perf_counter() - start)
        rows.append((samples * length, float(samples * length**2), statistics.median(times)))
    model.zero_grad(set_to_none=True)
    linear, quadratic = _fit(rows)
    fitted = CostModel(linear, quadratic, source="fitted")
    if path is not None:
        stored = stored if isinstance(stored, dict) else {}
        stored[key] = {**asdict(fitted), "max_tokens": max_tokens, "points": rows}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(stored, indent=1) + "\n")
        os.replace(tmp, path)  # atomic: ranks fitting at once never leave a torn file
    return fitted


def resolve_cost_model(spec: str | CostModel | None, model: Any, max_tokens: int) -> CostModel | None:
    """The cost model a training argument names, identical on every rank.

    Args:
        spec: ``None`` (none: token balance), a :class:`CostModel`, ``"auto"`` (``"flops"`` where the config
            has the sizes it reads, else token balance, said once in the log), ``"flops"
            (:meth:`CostModel.from_config` of ``model.config``), ``"fit"`` (:func:`fit_cost_model`, cached),
            or ``"LINEAR,QUADRATIC"``.
        model: the model being trained (read for ``"flops"`` and ``"fit"``).
        max_tokens: the token budget of a batch.

    With ``"fit"`` under ``torch.distributed`` every rank measures (or reads its cache) and the
    coefficients are averaged over the ranks once, so every rank plans the same steps.

    >>> resolve_cost_model("2,1", None, 64)
    CostModel(linear=2.0, quadratic=1.0, source='given')
    """
    if spec is None or isinstance(spec, CostModel):
        return spec
    if spec == "auto":
        base = getattr(model, "get_base_model", lambda: model)()
        try:
            return CostModel.from_config(getattr(base, "config", None))
        except ValueError as error:
            logger.info("multipack balances tokens, not cost: %s", error)
            return None
    if spec == "flops":
        return CostModel.from_config(getattr(model, "config", None))
    if spec != "fit":
        return CostModel.parse(spec)
    fitted = fit_cost_model(model, max_tokens)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        device = next(model.parameters()).device
        both = torch.tensor([fitted.linear, fitted.quadratic], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(both)  # the ranks' fits differ by timing noise: one plan needs one model
        linear, quadratic = (v / torch.distributed.get_world_size() for v in both.tolist())
        fitted = CostModel(linear, quadratic, source="fitted")
    return fitted
