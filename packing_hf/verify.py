"""check_packing: does a packed row give the same results as every sample alone?

A padding-free batch is one row ``[1, T]`` holding ``n`` samples back to back, with ``position_ids``
restarting at 0 for every sample and ``cu_seq_lens_q/k`` / ``max_length_q/k`` marking the boundaries
(exactly what ``PaddingFreeCollator`` emits). Packing is *exact* when each sample's logits and each
sample's parameter gradients equal those of the sample run alone; otherwise information leaked
across the boundary (cross-contamination) and training on packed rows silently changes the model.

:func:`check_packing` measures this on any causal LM; :func:`check_architecture` does it on a tiny copy
of a config (cached per architecture and attention implementation), cheap enough for a pre-flight check
before training; :func:`verify_main` is the ``packing-hf verify`` command line.

>>> import torch
>>> from transformers import AutoModelForCausalLM
>>> torch.manual_seed(0)  # doctest: +ELLIPSIS
<torch._C.Generator object at ...>
>>> model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sdpa")
>>> report = check_packing(model, lengths=(5, 3))
>>> report.leaked, len(report.logits_max_abs_diff)
(False, 2)
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import math
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

__all__ = [
    "DEFAULT_LENGTHS",
    "DEFAULT_TOLERANCE",
    "IMPLEMENTATIONS",
    "ArchitectureResult",
    "PackingReport",
    "build_packed_batch",
    "build_tiny_model",
    "check_architecture",
    "check_packing",
    "clear_architecture_cache",
    "format_table",
    "sweep_architecture",
    "tiny_config",
    "verify_main",
]

# Three samples of different lengths: long enough to cross a tiny sliding window / attention chunk (4),
# different enough that a wrong boundary shows up in every sample.
DEFAULT_LENGTHS: tuple[int, ...] = (7, 12, 5)

# fp32 on CPU: a packed row and a lone sample go through different matmul shapes, so they differ by
# rounding (~1e-7 relative); a leak moves logits by orders of magnitude more.
DEFAULT_TOLERANCE = 1e-5


# --------------------------------------------------------------------------------------------------
# the report


@dataclass(frozen=True)
class PackingReport:
    """Packed-vs-separate comparison of one model on one packed row.

    Attributes:
        model_type: ``config.model_type`` of the model checked.
        attn_implementation: ``config._attn_implementation`` during the check (``"eager"``, ``"sdpa"``,
            ``packing_hf.ATTENTION_NAME``, ...).
        backend: the varlen kernel the packing_hf attention picked (``None`` for other implementations).
        lengths: the sample lengths packed in the row.
        tolerance: largest max-abs difference accepted as rounding.
        logits_max_abs_diff: per sample, ``max |logits_packed - logits_alone|``.
        grads_max_abs_diff: per sample, the largest ``|grad_packed - grad_alone|`` over every parameter,
            for that sample's own next-token loss; empty when gradients were not checked.
        worst_parameter: per sample, the parameter holding that largest gradient difference.
        error: the exception raised by the packed forward, if any (``"TypeError: ..."``); a model that
            cannot run a packed row is reported as leaked rather than passed.
        notes: how the packed row was fed (e.g. kwargs the forward does not accept were left out).

    >>> r = PackingReport("llama", "sdpa", None, (3, 2), 1e-5, (0.0, 2e-3), (), ())
    >>> r.leaked, r.leaked_samples
    (True, (1,))
    """

    model_type: str
    attn_implementation: str
    backend: str | None
    lengths: tuple[int, ...]
    tolerance: float
    logits_max_abs_diff: tuple[float, ...]
    grads_max_abs_diff: tuple[float, ...]
    worst_parameter: tuple[str, ...]
    error: str | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def leaked_samples(self) -> tuple[int, ...]:
        """Indices of the samples whose logits or gradients differ by more than the tolerance."""
        bad = set()
        for diffs in (self.logits_max_abs_diff, self.grads_max_abs_diff):
            bad.update(i for i, d in enumerate(diffs) if not d <= self.tolerance)  # NaN counts as a leak
        return tuple(sorted(bad))

    @property
    def leaked(self) -> bool:
        """True when any sample differs from its lone run, or the packed forward could not run."""
        return self.error is not None or bool(self.leaked_samples)

    @property
    def max_logits_diff(self) -> float:
        return max(self.logits_max_abs_diff, default=math.nan)

    @property
    def max_grads_diff(self) -> float | None:
        return max(self.grads_max_abs_diff) if self.grads_max_abs_diff else None

    def summary(self) -> str:
        """One line: what was checked and the verdict."""
        impl = self.attn_implementation + (f" ({self.backend})" if self.backend else "")
        head = f"{self.model_type} / {impl}, samples {list(self.lengths)}"
        if self.error is not None:
            return f"{head}: LEAK: the packed forward failed: {self.error}"
        grads = "" if self.max_grads_diff is None else f", grads {self.max_grads_diff:.2e}"
        verdict = f"LEAK in samples {list(self.leaked_samples)}" if self.leaked else "exact"
        return (
            f"{head}: max |diff| logits {self.max_logits_diff:.2e}{grads} (tol {self.tolerance:g}): {verdict}"
        )

    def __str__(self) -> str:
        return self.summary()

    def raise_if_leaked(self) -> None:
        """Raise ``ValueError`` with the summary when packing is not exact for this model."""
        if self.leaked:
            raise ValueError(
                f"packing is not exact: {self.summary()}. Samples packed in one row would see each other; "
                "use packing_hf.prepare_model_for_packing(model) or attn_implementation=packing_hf.ATTENTION_NAME, "
                "or train without packing for this architecture"
            )

    def to_dict(self) -> dict:
        return {
            "model_type": self.model_type,
            "attn_implementation": self.attn_implementation,
            "backend": self.backend,
            "lengths": list(self.lengths),
            "tolerance": self.tolerance,
            "logits_max_abs_diff": list(self.logits_max_abs_diff),
            "grads_max_abs_diff": list(self.grads_max_abs_diff),
            "worst_parameter": list(self.worst_parameter),
            "error": self.error,
            "notes": list(self.notes),
            "leaked": self.leaked,
        }


# --------------------------------------------------------------------------------------------------
# tiny copies of configs

# Sizes of a tiny model: small enough to run the whole check in well under a second on one CPU core,
# large enough that every architectural feature is still exercised (GQA, several experts, a sliding
# window and attention chunk shorter than the test samples).
_TINY_HIDDEN = 64
_TINY_HEADS = 4
_TINY_HEAD_DIM = 16
_TINY_VOCAB = 512
_TINY_LAYERS = 2
_TINY_WINDOW = 4

# config field -> tiny value, applied to fields the config has and that are not None
_TINY_FIELDS: dict[str, int] = {
    "hidden_size": _TINY_HIDDEN,
    "num_attention_heads": _TINY_HEADS,
    "head_dim": _TINY_HEAD_DIM,
    "attention_head_dim": _TINY_HEAD_DIM,
    "intermediate_size": 128,
    "ffn_dim": 128,
    "dff": 128,
    "d_ff": 128,
    "dim_ff": 128,
    "feed_forward_size": 128,
    "word_embed_proj_dim": _TINY_HIDDEN,
    "ffn_hidden_size": 128,
    "intermediate_size_mlp": 128,
    "dense_intermediate_size": 128,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "shared_intermediate_size": 32,
    "shared_experts_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32,
    "expert_ffn_hidden_size": 32,
    "vocab_size": _TINY_VOCAB,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "num_experts_per_token": 2,
    "moe_topk": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "num_expert_group": 1,
    # multi-head latent attention (deepseek-style)
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "qk_head_dim": 16,
    "v_head_dim": 16,
    # windows and chunks shorter than the test samples, so that they actually bite
    "sliding_window": _TINY_WINDOW,
    "sliding_window_size": _TINY_WINDOW,
    "attention_window_size": _TINY_WINDOW,
    "attention_chunk_size": _TINY_WINDOW,
    "rotary_dim": 8,
    "max_window_layers": 1,
    "first_k_dense_replace": 1,
    # state-space / linear-attention layers of hybrid models
    "mamba_d_state": 16,
    "mamba_n_heads": 4,
    "mamba_d_head": 32,
    "mamba_head_dim": 32,
    "mamba_num_heads": 4,
    "mamba_n_groups": 1,
    "mamba_chunk_size": 8,
    "mamba_dt_rank": 8,
    "ssm_state_size": 16,
    "state_size": 16,
    "time_step_rank": 8,
    "n_groups": 1,
    "chunk_size": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_head_dim": 16,
    "linear_num_heads": 4,
    "index_head_dim": 16,
    "index_n_heads": 2,
    "index_topk": 8,
}

# fields counting layers, per naming scheme
_LAYER_FIELDS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")


def _config_dict(config) -> dict:
    """Constructor kwargs of ``config``: its own (non-derived) fields, resolved through attribute_map."""
    data = config.to_dict()
    for key in ("architectures", "_name_or_path", "transformers_version", "model_type", "auto_map", "dtype"):
        data.pop(key, None)
    return data


def _representative_layers(layer_types: Sequence[str], keep: int) -> list[int]:
    """Indices of ``keep`` layers covering every distinct layer type, in model order."""
    chosen: list[int] = []
    seen: set[str] = set()
    for i, kind in enumerate(layer_types):
        if kind not in seen:
            seen.add(kind)
            chosen.append(i)
    for i in range(len(layer_types)):
        if len(chosen) >= keep:
            break
        if i not in chosen:
            chosen.append(i)
    return sorted(chosen)


def tiny_config(config, **overrides):
    """A tiny copy of a causal-LM config that keeps the architecture's features.

    Shrinks width, depth, vocabulary and expert count, but keeps what decides whether packing is exact:
    the attention kind of every layer type (sliding / full / linear / Mamba: one layer of each), sliding
    windows and attention chunks (made shorter than the test samples, so they act), logit softcapping,
    attention sinks, ALiBi, MoE routing.

    Args:
        config: a ``PretrainedConfig`` (e.g. the one of the model you will train) or a ``model_type``
            string (``"llama"``), which starts from that architecture's default config.
        **overrides: config fields to set after shrinking.

    Returns:
        A new config of the same class; ``config`` itself is not modified.

    >>> cfg = tiny_config("mistral")
    >>> cfg.hidden_size, cfg.num_hidden_layers, cfg.sliding_window, cfg.vocab_size
    (64, 2, 4, 512)
    """
    from transformers import AutoConfig

    base = AutoConfig.for_model(config) if isinstance(config, str) else config
    data = _config_dict(base)
    attribute_map = getattr(type(base), "attribute_map", {}) or {}

    def present(name: str) -> str | None:
        name = attribute_map.get(name, name)
        return name if name in data else None

    new: dict = {}
    for name, value in _TINY_FIELDS.items():
        key = present(name)
        if key is not None and isinstance(data[key], int) and not isinstance(data[key], bool):
            new[key] = (
                min(value, data[key]) if name in ("n_group", "topk_group", "num_expert_group") else value
            )
    # fields some default configs leave at None although their model needs a value
    for name in ("head_dim", "num_key_value_heads"):
        key = present(name)
        if key is not None and data[key] is None:
            new[key] = _TINY_HEAD_DIM if name == "head_dim" else _TINY_HEADS
    if present("qk_rope_head_dim") and present("head_dim"):
        # multi-head latent attention: head_dim is the rotary part of the query/key heads
        new[present("head_dim")] = _TINY_FIELDS["qk_rope_head_dim"]
    experts = [
        k for k in ("num_experts", "num_local_experts", "n_routed_experts") if isinstance(data.get(k), int)
    ]
    if experts and present("num_experts_per_tok") and data[present("num_experts_per_tok")] is None:
        new[present("num_experts_per_tok")] = _TINY_FIELDS["num_experts_per_tok"]
    heads_key, kv_key = present("num_attention_heads"), present("num_key_value_heads")
    if kv_key is not None and isinstance(data[kv_key], int) and heads_key is not None:
        # keep the flavour: multi-head stays multi-head, multi-query stays multi-query, GQA gets 2 groups
        original_kv, original_heads = data[kv_key], data[heads_key]
        new[kv_key] = _TINY_HEADS if original_kv == original_heads else 1 if original_kv == 1 else 2

    # depth: one layer of each type (at least _TINY_LAYERS), and per-layer lists cut to match
    layers_key = next((k for k in map(present, _LAYER_FIELDS) if k is not None), None)
    if layers_key is not None:
        original_layers = int(data[layers_key])
        layer_types = data.get("layer_types")
        keep = _TINY_LAYERS
        if isinstance(layer_types, list) and len(layer_types) == original_layers:
            keep = max(keep, len(set(layer_types)))
            chosen = _representative_layers(layer_types, keep)
        else:
            chosen = list(range(min(keep, original_layers)))
        new[layers_key] = len(chosen)
        for key, value in data.items():
            if isinstance(value, list) and len(value) == original_layers and original_layers > len(chosen):
                new[key] = [value[i] for i in chosen]
            elif key == "per_layer_config" and isinstance(value, dict):
                # {"05": {...}} keyed by layer index: keep the chosen layers' entries under their new index
                new[key] = {
                    f"{chosen.index(int(k)):02d}": {f: _TINY_FIELDS.get(f, v) for f, v in per.items()}
                    for k, per in value.items()
                    if int(k) in chosen
                }

    vocab_key = present("vocab_size")
    vocab = new.get(vocab_key, data.get(vocab_key)) if vocab_key else None
    if isinstance(vocab, int):
        # special token ids outside the tiny vocabulary would index past the embedding table
        spare = vocab - 1
        for key, value in data.items():
            if key.endswith(("_token_id", "_token_index")) and isinstance(value, int) and value >= vocab:
                new[key] = spare
                spare -= 1
            elif key.endswith("_token_id") and isinstance(value, list):
                new[key] = [v if v < vocab else vocab - 1 for v in value]

    # nested configs: a text_config is a model of its own; attention/FFN sub-configs (dbrx, mpt) hold sizes
    for key, value in data.items():
        if key == "text_config" and isinstance(value, dict) and getattr(base, key, None) is not None:
            new[key] = tiny_config(getattr(base, key)).to_dict()
        elif key in ("attn_config", "ffn_config") and isinstance(value, dict):
            new[key] = {**value, **{k: v for k, v in _TINY_FIELDS.items() if isinstance(value.get(k), int)}}

    from .attention.models import support

    new.update(support(str(getattr(base, "model_type", ""))).tiny)
    new.update(overrides)
    return type(base)(**{**data, **new})


# --------------------------------------------------------------------------------------------------
# the packed batch and the comparison


def build_packed_batch(samples: Sequence[torch.Tensor]) -> dict[str, torch.Tensor | int]:
    """The padding-free batch of ``samples``, built by :class:`packing_hf.PaddingFreeCollator` itself.

    Args:
        samples: ``n`` 1-D int64 tensors of token ids, lengths ``l_i > 0``.

    Returns:
        ``input_ids`` ``(1, T)`` int64, ``position_ids`` ``(1, T)`` int64, ``cu_seq_lens_q/k`` ``(n + 1,)``
        int32, ``max_length_q/k`` int, with ``T = sum(l_i)``; no ``attention_mask``, no ``labels``.

    >>> batch = build_packed_batch([torch.tensor([5, 6, 7]), torch.tensor([8, 9])])
    >>> batch["position_ids"].tolist(), batch["cu_seq_lens_q"].tolist(), batch["max_length_q"]
    ([[0, 1, 2, 0, 1]], [0, 3, 5], 3)
    """
    from .collator import PaddingFreeCollator

    # the check runs exactly what training feeds the model; labels are not needed (the loss is per sample)
    batch = PaddingFreeCollator()([{"input_ids": s.reshape(-1).tolist()} for s in samples])
    batch.pop("labels", None)
    return batch


def _random_samples(config, lengths: Sequence[int], seed: int) -> list[torch.Tensor]:
    """Token ids drawn from the vocabulary, avoiding every special token id of the config."""
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int) or vocab < 8:
        raise ValueError(f"config.vocab_size = {vocab!r}: pass input_ids explicitly to check this model")
    special = set()
    for key, value in config.to_dict().items():
        if key.endswith(("_token_id", "_token_index")):
            special.update(v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int))
    allowed = torch.tensor([t for t in range(min(vocab, 4096)) if t not in special])
    generator = torch.Generator().manual_seed(seed)
    return [allowed[torch.randint(len(allowed), (int(n),), generator=generator)] for n in lengths]


def _accepted_kwargs(model) -> tuple[set[str], bool]:
    """Names the model's forward accepts, and whether it takes ``**kwargs`` as well."""
    params = inspect.signature(model.forward).parameters
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return set(params), var_kw


def _attention_backend(attn_implementation: str) -> str | None:
    """The varlen kernel packing_hf's attention ran last, if that implementation is in use."""
    from .attention import ATTENTION_NAME, last_backend

    return last_backend() if attn_implementation == ATTENTION_NAME else None


def _next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of predicting ``ids[1:]`` from ``logits[:-1]``; logits (L, V), ids (L,)."""
    if ids.numel() < 2:
        return logits.sum() * 0.0
    return torch.nn.functional.cross_entropy(logits[:-1].float(), ids[1:], reduction="sum")


def _logits(output) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output[0]


@contextlib.contextmanager
def _checking_mode(model) -> Iterator[None]:
    """Eval mode (no dropout) for the duration, then the model's own train/eval flags restored."""
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        yield
    finally:
        for module, training in modes.items():
            module.training = training


def check_packing(
    model,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    *,
    input_ids: Sequence[torch.Tensor] | None = None,
    gradients: bool = True,
    tolerance: float = DEFAULT_TOLERANCE,
    use_cache: bool | None = False,
    attention_mask: bool = False,
    seed: int = 0,
) -> PackingReport:
    """Run one packed row and every sample alone through ``model``; compare logits and gradients.

    The packed row is what ``PaddingFreeCollator`` emits: ``input_ids`` and ``position_ids`` of shape
    ``(1, T)``, ``cu_seq_lens_q/k`` and ``max_length_q/k``, no attention mask. The reference is each sample
    run on its own (``input_ids`` of shape ``(1, l_i)`` and nothing else). For every sample this compares
    its logits, and, with ``gradients=True``, the gradient of every parameter with respect to that sample's
    own summed next-token cross-entropy. Any difference above ``tolerance`` is a leak.

    The model is not changed: it runs in eval mode (no dropout) and gets its train/eval flags back;
    gradients are taken with ``torch.autograd.grad``, so ``param.grad`` is untouched.

    Args:
        model: a causal LM (``...ForCausalLM``), on any device and dtype (use fp32 for a 1e-5 tolerance).
        lengths: sample lengths; token ids are drawn at random (seeded), avoiding special token ids.
        input_ids: the samples themselves, ``n`` 1-D int tensors (overrides ``lengths``).
        gradients: also compare per-sample parameter gradients (one backward per sample, both runs).
        tolerance: largest max-abs difference accepted as rounding.
        use_cache: passed to the packed forward. ``False`` is what ``Trainer``/``SFTTrainer`` pass during
            training; ``None`` leaves the model's default (``config.use_cache``, often ``True``).
        attention_mask: also pass an all-ones ``attention_mask`` ``(1, T)`` next to the packed inputs
            (what a collator that keeps the mask does).
        seed: seed of the random token ids.

    Returns:
        A :class:`PackingReport`; ``report.leaked`` says whether any sample saw another.

    >>> import torch
    >>> from transformers import AutoModelForCausalLM
    >>> model = AutoModelForCausalLM.from_config(tiny_config("opt"), attn_implementation="eager")
    >>> check_packing(model, lengths=(4, 6), gradients=False).leaked  # stock OPT ignores position_ids
    True
    """
    config = model.config
    samples = list(input_ids) if input_ids is not None else _random_samples(config, lengths, seed)
    if not samples or any(s.dim() != 1 or s.numel() == 0 for s in samples):
        raise ValueError(
            f"input_ids must be a non-empty list of non-empty 1-D tensors, got shapes "
            f"{[tuple(s.shape) for s in samples]}"
        )
    device = next(model.parameters()).device
    samples = [s.to(device=device, dtype=torch.long) for s in samples]
    lengths = tuple(int(s.numel()) for s in samples)
    attn_implementation = str(getattr(config, "_attn_implementation", None))
    names, var_kw = _accepted_kwargs(model)

    batch = build_packed_batch(samples)
    batch = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    notes = []
    if attention_mask:
        batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    if use_cache is not None:
        batch["use_cache"] = use_cache
    for key in list(batch):
        if key not in names and not var_kw:
            batch.pop(key)
            notes.append(f"forward() does not accept {key!r}: left out")
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad] if gradients else []
    tensors = [p for _, p in params]

    def grads_of(loss: torch.Tensor, retain: bool) -> list[torch.Tensor | None]:
        return list(torch.autograd.grad(loss, tensors, retain_graph=retain, allow_unused=True))

    def report(logits_diffs=(), grads_diffs=(), worst=(), error: str | None = None) -> PackingReport:
        return PackingReport(
            str(getattr(config, "model_type", type(model).__name__)),
            attn_implementation,
            _attention_backend(attn_implementation),  # read after the forward: the backend it ran
            lengths,
            tolerance,
            tuple(logits_diffs),
            tuple(grads_diffs),
            tuple(worst),
            error=error,
            notes=tuple(notes),
        )

    logits_diffs, grads_diffs, worst = [], [], []
    with _checking_mode(model), torch.set_grad_enabled(gradients):
        try:
            packed_logits = _logits(model(**batch))[0]  # (T, V)
        except Exception as exc:  # any failure of the packed path is a finding, not a crash of the check
            return report(error=f"{type(exc).__name__}: {exc}"[:500])
        start = 0
        for i, sample in enumerate(samples):
            end = start + lengths[i]
            alone = {"input_ids": sample.unsqueeze(0)}
            if "use_cache" in names or var_kw:
                alone["use_cache"] = False
            alone_logits = _logits(model(**alone))[0]  # (l_i, V)
            piece = packed_logits[start:end]
            logits_diffs.append(float((piece.detach().float() - alone_logits.detach().float()).abs().max()))
            if gradients:
                packed_grads = grads_of(_next_token_loss(piece, sample), retain=True)
                alone_grads = grads_of(_next_token_loss(alone_logits, sample), retain=False)
                best, best_name = 0.0, ""
                for (name, param), gp, ga in zip(params, packed_grads, alone_grads, strict=True):
                    if gp is None and ga is None:
                        continue
                    gp = torch.zeros_like(param) if gp is None else gp
                    ga = torch.zeros_like(param) if ga is None else ga
                    diff = float((gp.float() - ga.float()).abs().max())
                    if not diff <= best:  # NaN wins
                        best, best_name = diff, name
                grads_diffs.append(best)
                worst.append(best_name)
            start = end

    return report(logits_diffs, grads_diffs, worst)


# --------------------------------------------------------------------------------------------------
# tiny copies: the pre-flight check and the architecture sweep

IMPLEMENTATIONS: tuple[str, ...] = ("eager", "sdpa", "packing_hf")


def _implementation_name(implementation: str) -> str:
    """``"packing_hf"`` (or the registered name) -> packing_hf's registered name; others unchanged."""
    from .attention import ATTENTION_NAME, register_attention

    if implementation in ("packing_hf", ATTENTION_NAME):
        return register_attention()
    return implementation


def build_tiny_model(config, attn_implementation: str = "sdpa", seed: int = 0):
    """A tiny fp32 CPU causal LM from ``tiny_config(config)``, seeded, in eval mode.

    >>> build_tiny_model("qwen2").config.hidden_size
    64
    """
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(config)
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(
            cfg, attn_implementation=_implementation_name(attn_implementation)
        )
    finally:
        torch.random.set_rng_state(generator_state)  # do not disturb the caller's random stream
    return model.float().eval()


@dataclass(frozen=True)
class ArchitectureResult:
    """One architecture under one attention implementation: stock, then prepared by packing_hf.

    Attributes:
        model_type: the architecture.
        implementation: ``"eager"``, ``"sdpa"`` or ``"packing_hf"``.
        stock: the check of the unmodified tiny model (``None`` if transformers cannot build it).
        prepared: the check after :func:`packing_hf.prepare_model_for_packing` (``None`` if refused).
        unsupported: why transformers refused to build the model with this implementation.
        refused: why :func:`packing_hf.prepare_model_for_packing` refused it.
    """

    model_type: str
    implementation: str
    stock: PackingReport | None
    prepared: PackingReport | None
    unsupported: str | None = None
    refused: str | None = None

    @property
    def verdict(self) -> str:
        """``"exact"`` (stock and prepared), ``"fixed"`` (stock leaks, prepared exact), ``"refused"``,
        ``"n/a"`` (transformers does not offer the implementation) or ``"LEAK"`` (prepared still leaks)."""
        if self.unsupported is not None:
            return "n/a"
        if self.refused is not None:
            return "refused"
        if self.prepared is None or self.prepared.leaked:
            return "LEAK"
        return "exact" if self.stock is not None and not self.stock.leaked else "fixed"


def sweep_architecture(
    model_type: str,
    implementations: Sequence[str] = IMPLEMENTATIONS,
    *,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    gradients: bool = True,
    tolerance: float = DEFAULT_TOLERANCE,
) -> list[ArchitectureResult]:
    """Check a tiny ``model_type`` model stock and prepared, under every implementation.

    This is the single code path behind ``docs/architectures.md`` (``tools/gen_arch_table.py``) and the
    architecture test, so the table is what the test asserts.

    >>> [r.verdict for r in sweep_architecture("opt", ["sdpa"], gradients=False)]
    ['fixed']
    """
    from .attention.models import prepare_model_for_packing

    results = []
    for implementation in implementations:
        try:
            model = build_tiny_model(model_type, implementation)
        except (ValueError, KeyError, ImportError) as exc:  # transformers: "does not support ... yet"
            results.append(
                ArchitectureResult(model_type, implementation, None, None, unsupported=_short(exc))
            )
            continue
        stock = check_packing(model, lengths, gradients=gradients, tolerance=tolerance)
        try:
            handle = prepare_model_for_packing(model, check_unknown=False)
        except ValueError as exc:
            results.append(ArchitectureResult(model_type, implementation, stock, None, refused=str(exc)))
            continue
        with handle:
            prepared = check_packing(model, lengths, gradients=gradients, tolerance=tolerance)
        results.append(ArchitectureResult(model_type, implementation, stock, prepared))
    return results


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"


_ARCHITECTURE_CACHE: dict[tuple[str, str, bool], PackingReport] = {}


def clear_architecture_cache() -> None:
    """Forget the reports cached by :func:`check_architecture`.

    >>> clear_architecture_cache()
    """
    _ARCHITECTURE_CACHE.clear()


def check_architecture(config, attn_implementation: str = "sdpa", *, prepare: bool = True) -> PackingReport:
    """Pre-flight check: does this architecture pack exactly? Runs on a tiny copy, cached.

    Builds ``tiny_config(config)`` with ``attn_implementation`` (fp32, CPU), optionally prepares it with
    :func:`packing_hf.prepare_model_for_packing` (what the trainers do to the real model), and runs
    :func:`check_packing`. The result is cached per (tiny config, implementation, prepare): the first call
    for an architecture costs well under a second, later ones nothing.

    Args:
        config: the ``PretrainedConfig`` of the model to train, or a ``model_type`` string.
        attn_implementation: ``"eager"``, ``"sdpa"``, ``"packing_hf"`` / ``packing_hf.ATTENTION_NAME``, ...
        prepare: check the model as prepared by packing_hf (``True``) or stock (``False``).

    Returns:
        A :class:`PackingReport`. When preparation refuses the architecture, ``report.error`` holds the
        reason (and ``report.leaked`` is ``True``).

    >>> check_architecture("mistral", "sdpa").leaked
    False
    >>> "Mamba" in check_architecture("bamba", "sdpa").error
    True
    """
    from .attention.models import prepare_model_for_packing

    cfg = tiny_config(config)
    implementation = _implementation_name(attn_implementation)
    key = (cfg.to_json_string(use_diff=False), implementation, prepare)
    if key in _ARCHITECTURE_CACHE:
        return _ARCHITECTURE_CACHE[key]
    model = build_tiny_model(config, implementation)
    handle = None
    if prepare:
        try:
            handle = prepare_model_for_packing(model, check_unknown=False)
        except ValueError as exc:
            report = PackingReport(
                cfg.model_type,
                implementation,
                None,
                (),
                DEFAULT_TOLERANCE,
                (),
                (),
                (),
                error=f"refused: {exc}",
            )
            _ARCHITECTURE_CACHE[key] = report
            return report
    try:
        report = check_packing(model)
    finally:
        if handle is not None:
            handle.revert()
    _ARCHITECTURE_CACHE[key] = report
    return report


# --------------------------------------------------------------------------------------------------
# the command line: packing-hf verify


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="packing-hf verify",
        description="Check that packed rows give the same logits and gradients as every sample alone.",
    )
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument(
        "--model-type", help="an architecture (e.g. llama): checked on a tiny from_config model"
    )
    target.add_argument("--model", help="a local model folder: checked as is (fp32 recommended)")
    target.add_argument(
        "--all", action="store_true", help="sweep every registered architecture, print the table"
    )
    parser.add_argument(
        "--attn-implementation",
        default="sdpa",
        help="eager, sdpa, packing_hf (packing_hf's varlen attention), ... (default: sdpa)",
    )
    parser.add_argument(
        "--lengths", default=",".join(map(str, DEFAULT_LENGTHS)), help="sample lengths, e.g. 7,12,5"
    )
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE)
    parser.add_argument("--no-grads", action="store_true", help="compare logits only")
    parser.add_argument("--stock", action="store_true", help="do not apply prepare_model_for_packing first")
    parser.add_argument("--json", action="store_true", help="print the report(s) as JSON")
    return parser


def verify_main(argv: Sequence[str] | None = None) -> int:
    """``packing-hf verify``: exit status 0 when packing is exact, 1 on a leak or refusal, 2 on bad usage.

    >>> verify_main(["--model-type", "qwen2", "--no-grads"])  # doctest: +ELLIPSIS
    qwen2 / sdpa, samples [7, 12, 5]: max |diff| logits ...: exact
    0
    """
    from .attention.models import prepare_model_for_packing

    args = _parser().parse_args(argv)
    try:
        lengths = tuple(int(x) for x in args.lengths.split(",") if x.strip())
    except ValueError:
        print(f"--lengths must be comma-separated integers, got {args.lengths!r}", file=sys.stderr)
        return 2
    if args.all:
        from .attention.models import iter_sweep

        results = []
        for entry in iter_sweep():
            results.extend(sweep_architecture(entry.model_type, lengths=lengths, gradients=not args.no_grads))
        if args.json:
            print(json.dumps([_result_dict(r) for r in results], indent=1))
        else:
            print(format_table(results))
        return 0

    implementation = _implementation_name(args.attn_implementation)
    if args.model_type is not None:
        try:
            model = build_tiny_model(args.model_type, implementation)
        except (ValueError, KeyError) as exc:
            print(
                f"cannot build a tiny {args.model_type} model with {implementation}: {_short(exc)}",
                file=sys.stderr,
            )
            return 2
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            args.model, attn_implementation=implementation, dtype=torch.float32
        ).eval()
    handle = None
    if not args.stock:
        try:
            handle = prepare_model_for_packing(model)
        except ValueError as exc:
            print(f"refused: {exc}")
            return 1
    try:
        report = check_packing(model, lengths, gradients=not args.no_grads, tolerance=args.tolerance)
    finally:
        if handle is not None:
            handle.revert()
    print(json.dumps(report.to_dict(), indent=1) if args.json else report.summary())
    return 1 if report.leaked else 0


def _result_dict(result: ArchitectureResult) -> dict:
    return {
        "model_type": result.model_type,
        "implementation": result.implementation,
        "verdict": result.verdict,
        "stock": result.stock.to_dict() if result.stock else None,
        "prepared": result.prepared.to_dict() if result.prepared else None,
        "unsupported": result.unsupported,
        "refused": result.refused,
    }


def _cell(result: ArchitectureResult) -> str:
    verdict = result.verdict
    if verdict == "n/a":
        return "n/a"
    stock = result.stock
    leak = ""
    if stock is not None and stock.leaked:
        leak = "error" if stock.error else f"{max(stock.max_logits_diff, stock.max_grads_diff or 0.0):.0e}"
    if verdict == "exact":
        return "exact"
    if verdict == "fixed":
        return f"leaks ({leak}) → **exact**"
    if verdict == "refused":
        return f"leaks ({leak}) → refused" if leak else "exact → refused"
    return f"**LEAK** ({leak})"


def format_table(results: Sequence[ArchitectureResult]) -> str:
    """Markdown table of sweep results: one row per architecture, one column per implementation.

    A cell reads ``stock → prepared``: ``exact`` (stock already exact), ``leaks (max diff) → exact``
    (fixed by packing_hf), ``... → refused`` (prepare_model_for_packing raises), ``n/a`` (transformers does
    not offer that implementation for the architecture).
    """
    from .attention.models import support

    by_type: dict[str, dict[str, ArchitectureResult]] = {}
    for result in results:
        by_type.setdefault(result.model_type, {})[result.implementation] = result
    implementations = [i for i in IMPLEMENTATIONS if any(i in row for row in by_type.values())]
    lines = [
        "| architecture | status | " + " | ".join(implementations) + " | why |",
        "|---|---|" + "---|" * len(implementations) + "---|",
    ]
    for model_type in sorted(by_type):
        entry = support(model_type)
        cells = [_cell(by_type[model_type][i]) if i in by_type[model_type] else "" for i in implementations]
        lines.append(f"| {model_type} | {entry.status} | " + " | ".join(cells) + f" | {entry.reason} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(verify_main())
