"""check_packing: does a packed row give the same results as every sample alone?

A padding-free batch is one row ``[1, T]`` holding ``n`` samples back to back, with ``position_ids``
restarting at 0 for every sample and ``cu_seq_lens_q/k`` / ``max_length_q/k`` marking the boundaries
(exactly what ``PaddingFreeCollator`` emits). Packing is *exact* when each sample's logits and each
sample's parameter gradients equal those of the sample run alone; otherwise information leaked
across the boundary (cross-contamination) and training on packed rows silently changes the model.

:func:`check_packing` measures this on any causal LM. The architecture layer builds on it
(:mod:`packing_hf.architectures`: tiny copies, the pre-flight check, the sweep) and the ``packing-hf verify``
command on top of that (:mod:`packing_hf.app.verify`); nothing here imports them.

>>> import torch
>>> from transformers import AutoConfig, AutoModelForCausalLM
>>> torch.manual_seed(0)  # doctest: +ELLIPSIS
<torch._C.Generator object at ...>
>>> config = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
...                               num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
>>> model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
>>> report = check_packing(model, lengths=(5, 3))
>>> report.leaked, len(report.logits_max_abs_diff)
(False, 2)
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from .attention import ATTENTION_NAME, last_backend
from .collator import PaddingFreeCollator
from .errors import PackingRefused

__all__ = [
    "DEFAULT_LENGTHS",
    "DEFAULT_TOLERANCE",
    "NOISE_MARGIN",
    "PackingReport",
    "build_packed_batch",
    "check_packing",
]

# Three samples of different lengths: long enough to cross a tiny sliding window / attention chunk (4),
# different enough that a wrong boundary shows up in every sample.
DEFAULT_LENGTHS: tuple[int, ...] = (7, 12, 5)

# fp32 on CPU: a packed row and a lone sample go through different matmul shapes, so they differ by
# rounding (~1e-7 relative on tiny models); a leak moves logits by orders of magnitude more. This is the
# floor of the verdict; on real weights the model's own rounding noise raises it (see NOISE_MARGIN).
DEFAULT_TOLERANCE = 1e-5

# With noise_floor=True a difference is rounding while it stays within NOISE_MARGIN times the model's own
# rounding noise: each sample alone in the model's dtype vs alone in fp64 (the rule flash-attention's tests
# use, with a wider margin: the packed and the lone run both carry that noise, in different matmul shapes).
NOISE_MARGIN = 8.0


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
        logits_noise, grads_noise: per sample, the model's own rounding noise (alone in its dtype vs alone
            in fp64), when measured (``noise_floor=True``); empty otherwise. A sample leaks when its
            difference exceeds ``max(tolerance, NOISE_MARGIN x noise)``.

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
    refusal: str | None = None  # the .reason of a PackingRefused raised by the packed forward
    logits_noise: tuple[float, ...] = field(default=())
    grads_noise: tuple[float, ...] = field(default=())

    def limit(self, noise: tuple[float, ...], i: int) -> float:
        """The largest difference of sample ``i`` still taken for rounding."""
        return max(self.tolerance, NOISE_MARGIN * noise[i]) if i < len(noise) else self.tolerance

    @property
    def leaked_samples(self) -> tuple[int, ...]:
        """Indices of the samples whose logits or gradients differ by more than rounding explains."""
        bad = set()
        for diffs, noise in (
            (self.logits_max_abs_diff, self.logits_noise),
            (self.grads_max_abs_diff, self.grads_noise),
        ):
            bad.update(
                i for i, d in enumerate(diffs) if not d <= self.limit(noise, i)
            )  # NaN counts as a leak
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
        if self.logits_noise:
            noise = f"logits {max(self.logits_noise):.2e}"
            if self.grads_noise:
                noise += f", grads {max(self.grads_noise):.2e}"
            bound = f"rounding noise {noise}; limit max(tol {self.tolerance:g}, {NOISE_MARGIN:g}x noise)"
        else:
            bound = f"tol {self.tolerance:g}"
        return f"{head}: max |diff| logits {self.max_logits_diff:.2e}{grads} ({bound}): {verdict}"

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
            "refusal": self.refusal,
            "notes": list(self.notes),
            "logits_noise": list(self.logits_noise),
            "grads_noise": list(self.grads_noise),
            "leaked": self.leaked,
        }


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
    # the check runs exactly what training feeds the model; labels are not needed (the loss is per sample)
    batch = PaddingFreeCollator()([{"input_ids": s.reshape(-1).tolist()} for s in samples])
    batch.pop("labels", None)
    return batch


def _random_samples(config, lengths: Sequence[int], seed: int) -> list[torch.Tensor]:
    """Token ids drawn from the vocabulary, avoiding every special token id of the config."""
    # a multimodal wrapper keeps the vocabulary in its text config, and its image/video token ids in its own
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text_config, "vocab_size", None)
    if not isinstance(vocab, int) or vocab < 8:
        raise ValueError(f"config.vocab_size = {vocab!r}: pass input_ids explicitly to check this model")
    special = set()
    for cfg in {id(config): config, id(text_config): text_config}.values():
        for key, value in cfg.to_dict().items():
            if key.endswith(("_token_id", "_token_index")):
                special.update(
                    v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int)
                )
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


@contextlib.contextmanager
def _whole_parameters(model) -> Iterator[None]:
    """DeepSpeed ZeRO-3 partitioned parameters (they carry ``ds_id``) gathered whole for the duration, and
    partitioned again after; a no-op for any other model. Gathering is collective: under ZeRO-3 every process of
    the group must run the check together (as the trainers' ranks do)."""
    partitioned = [p for p in model.parameters() if hasattr(p, "ds_id")]
    if not partitioned:
        yield
        return
    import deepspeed  # only a model DeepSpeed partitioned gets here

    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None):
        yield


def check_packing(
    model,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    *,
    input_ids: Sequence[torch.Tensor] | None = None,
    gradients: bool = True,
    tolerance: float = DEFAULT_TOLERANCE,
    noise_floor: bool = True,
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
    gradients are taken with ``torch.autograd.grad``, so ``param.grad`` is untouched. Parameters DeepSpeed ZeRO-3
    partitioned over processes (a model built after ``TrainingArguments(deepspeed=...)``) are gathered whole for
    the check (a collective: every process of the group calls it), so it measures the whole model.

    Args:
        model: a causal LM (``...ForCausalLM``), on any device and dtype (use fp32 for a 1e-5 tolerance).
        lengths: sample lengths; token ids are drawn at random (seeded), avoiding special token ids.
        input_ids: the samples themselves, ``n`` 1-D int tensors (overrides ``lengths``).
        gradients: also compare per-sample parameter gradients (one backward per sample, both runs).
        tolerance: largest max-abs difference always accepted as rounding (the floor of the verdict).
        noise_floor: also measure the model's own rounding noise, each sample alone in its dtype vs alone in
            fp64 (on a float64 copy of the model), and accept differences up to ``NOISE_MARGIN`` times it:
            on real weights fp32 rounding exceeds any fixed tolerance, while a leak exceeds it by orders of
            magnitude. Costs one fp64 copy of the model; off for tiny models checked in bulk (the sweep).
        use_cache: passed to the packed forward. ``False`` is what ``Trainer``/``SFTTrainer`` pass during
            training; ``None`` leaves the model's default (``config.use_cache``, often ``True``).
        attention_mask: also pass an all-ones ``attention_mask`` ``(1, T)`` next to the packed inputs
            (what a collator that keeps the mask does).
        seed: seed of the random token ids.

    Returns:
        A :class:`PackingReport`; ``report.leaked`` says whether any sample saw another.

    >>> import torch
    >>> from packing_hf.architectures.tiny import build_tiny_model
    >>> model = build_tiny_model("opt", "eager")
    >>> check_packing(model, lengths=(4, 6), gradients=False).leaked  # stock OPT ignores position_ids
    True
    """
    with _whole_parameters(model):
        return _check_packing(
            model, lengths, input_ids, gradients, tolerance, noise_floor, use_cache, attention_mask, seed
        )


def _check_packing(
    model, lengths, input_ids, gradients, tolerance, noise_floor, use_cache, attention_mask, seed
) -> PackingReport:
    config = model.config
    samples = _samples_on_device(model, lengths, input_ids, seed)
    lengths = tuple(int(s.numel()) for s in samples)
    attn_implementation = str(getattr(config, "_attn_implementation", None))
    names, var_kw = _accepted_kwargs(model)
    notes: list[str] = []
    batch = _packed_kwargs(samples, names, var_kw, notes, attention_mask=attention_mask, use_cache=use_cache)
    reference = _float64_copy(model, notes) if noise_floor else None
    comparison = _SampleComparison(model, gradients, "use_cache" in names or var_kw, notes, reference)
    error = refusal = None
    with _checking_mode(model), torch.set_grad_enabled(gradients):
        try:
            packed_logits = _logits(model(**batch))[0]  # (T, V)
        except Exception as exc:  # any failure of the packed path is a finding, not a crash of the check
            error = f"{type(exc).__name__}: {exc}"[:500]
            refusal = exc.reason if isinstance(exc, PackingRefused) else None
        else:
            comparison.compare_all(samples, packed_logits)
    return PackingReport(
        model_type=str(getattr(config, "model_type", type(model).__name__)),
        attn_implementation=attn_implementation,
        backend=_attention_backend(attn_implementation),  # read after the forward: the backend it ran
        lengths=lengths,
        tolerance=tolerance,
        error=error,
        notes=tuple(notes),
        refusal=refusal,
        **comparison.results(),
    )


def _samples_on_device(model, lengths: Sequence[int], input_ids, seed: int) -> list[torch.Tensor]:
    """The samples to check (``input_ids``, or random ones of ``lengths``) as int64 on the model's device."""
    samples = list(input_ids) if input_ids is not None else _random_samples(model.config, lengths, seed)
    if not samples or any(s.dim() != 1 or s.numel() == 0 for s in samples):
        raise ValueError(
            f"input_ids must be a non-empty list of non-empty 1-D tensors, got shapes "
            f"{[tuple(s.shape) for s in samples]}"
        )
    device = next(model.parameters()).device
    return [s.to(device=device, dtype=torch.long) for s in samples]


def _packed_kwargs(
    samples: list[torch.Tensor],
    names: set[str],
    var_kw: bool,
    notes: list[str],
    *,
    attention_mask: bool,
    use_cache: bool | None,
) -> dict:
    """The packed row of ``samples`` as forward kwargs, on their device; keys the forward does not accept are
    left out, each with a note."""
    device = samples[0].device
    batch = build_packed_batch(samples)
    batch = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    if attention_mask:
        batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    if use_cache is not None:
        batch["use_cache"] = use_cache
    for key in list(batch):
        if key not in names and not var_kw:
            batch.pop(key)
            notes.append(f"forward() does not accept {key!r}: left out")
    return batch


class _SampleComparison:
    """Every sample alone vs its slice of the packed row, gathered sample by sample: logits, gradients of its own
    next-token loss (with ``gradients``), and the model's rounding noise against ``reference``, a float64 copy
    (while one is given and runs)."""

    def __init__(self, model, gradients: bool, alone_use_cache: bool, notes: list[str], reference) -> None:
        self.model = model
        self.gradients = gradients
        self.alone_use_cache = alone_use_cache  # whether the forward takes use_cache
        self.notes = notes
        self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad] if gradients else []
        self.tensors = [p for _, p in self.params]
        self.reference = reference  # None once it failed: fixed tolerance only
        self.ref_params = (
            [p for n, p in reference.named_parameters() if p.requires_grad] if reference is not None else []
        )
        self.logits_diffs: list[float] = []
        self.grads_diffs: list[float] = []
        self.worst: list[str] = []
        self.logits_noise: list[float] = []
        self.grads_noise: list[float] = []

    def results(self) -> dict[str, tuple]:
        """What was gathered, as the :class:`PackingReport` fields of the same names."""
        return {
            "logits_max_abs_diff": tuple(self.logits_diffs),
            "grads_max_abs_diff": tuple(self.grads_diffs),
            "worst_parameter": tuple(self.worst),
            "logits_noise": tuple(self.logits_noise),
            "grads_noise": tuple(self.grads_noise),
        }

    def compare_all(self, samples: list[torch.Tensor], packed_logits: torch.Tensor) -> None:
        """``packed_logits`` ``(T, V)``: the packed row's, cut back into the samples in order."""
        start = 0
        for sample in samples:
            end = start + int(sample.numel())
            self._compare(sample, packed_logits[start:end])
            start = end

    def _alone_kwargs(self, sample: torch.Tensor) -> dict:
        alone = {"input_ids": sample.unsqueeze(0)}
        if self.alone_use_cache:
            alone["use_cache"] = False
        return alone

    def _grads_of(self, loss: torch.Tensor, retain: bool) -> list[torch.Tensor | None]:
        return list(torch.autograd.grad(loss, self.tensors, retain_graph=retain, allow_unused=True))

    def _compare(self, sample: torch.Tensor, piece: torch.Tensor) -> None:
        alone_logits = _logits(self.model(**self._alone_kwargs(sample)))[0]  # (l_i, V)
        self.logits_diffs.append(_max_diff(piece, alone_logits))
        alone_grads = None
        if self.gradients:
            packed_grads = self._grads_of(_next_token_loss(piece, sample), retain=True)
            alone_grads = self._grads_of(_next_token_loss(alone_logits, sample), retain=False)
            best, best_name = _max_grad_diff(self.params, packed_grads, alone_grads)
            self.grads_diffs.append(best)
            self.worst.append(best_name)
        if self.reference is not None:
            self._measure_noise(sample, alone_logits, alone_grads)

    def _measure_noise(self, sample: torch.Tensor, alone_logits: torch.Tensor, alone_grads) -> None:
        """The sample alone in the model's dtype vs alone in the float64 reference."""
        try:
            with _checking_mode(self.reference):
                exact_logits = _logits(self.reference(**self._alone_kwargs(sample)))[0]  # (l_i, V) float64
                self.logits_noise.append(_max_diff(alone_logits, exact_logits))
                if self.gradients:
                    loss = _next_token_loss(exact_logits, sample)
                    exact_grads = list(torch.autograd.grad(loss, self.ref_params, allow_unused=True))
                    self.grads_noise.append(_max_grad_diff(self.params, alone_grads, exact_grads)[0])
        except Exception as exc:  # e.g. a kernel without fp64: fixed tolerance only, and say so
            self.notes.append(f"no fp64 reference ({type(exc).__name__}: {exc}); fixed tolerance only"[:300])
            self.reference, self.logits_noise, self.grads_noise = None, [], []


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max())


def _max_grad_diff(params, grads_a, grads_b) -> tuple[float, str]:
    """The largest ``|a - b|`` over every parameter's gradient, and the parameter holding it (NaN wins)."""
    best, best_name = 0.0, ""
    for (name, param), ga, gb in zip(params, grads_a, grads_b, strict=True):
        if ga is None and gb is None:
            continue
        ga = torch.zeros_like(param) if ga is None else ga
        gb = torch.zeros_like(param) if gb is None else gb
        diff = _max_diff(ga, gb)
        if not diff <= best:
            best, best_name = diff, name
    return best, best_name


def _float64_copy(model, notes: list[str]):
    """A float64 copy of ``model`` (the rounding reference), or None with a note when it cannot be made."""
    try:
        reference = copy.deepcopy(model).to(torch.float64)
    except Exception as exc:  # quantized or exotic modules: fall back to the fixed tolerance, and say so
        notes.append(f"no fp64 reference ({type(exc).__name__}: {exc}); fixed tolerance only"[:300])
        return None
    experts = getattr(getattr(reference, "config", None), "_experts_implementation", None)
    if experts not in (None, "eager") and hasattr(reference, "set_experts_implementation"):
        # grouped matmul kernels (MoE experts) take no float64; the per-expert loop computes the same thing
        try:
            reference.set_experts_implementation("eager")
        except (ValueError, TypeError) as exc:
            notes.append(f"fp64 reference keeps experts {experts!r} ({exc})"[:300])
    return reference
