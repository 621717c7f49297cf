"""The chunked LM head on a Hugging Face causal LM: the model's hidden states without its logits, and the loss or
log-probs of :mod:`packing_hf.loss_head` from them.

The model is called as usual (through DDP / accelerate wrappers, so gradient synchronisation and hooks are
stock's), with a forward pre-hook on its output embeddings for the duration of the call: the hook keeps the
head's input (the final hidden states, after the final norm, whatever the architecture) and hands the head an
empty slice of it, so the model projects nothing. The hook lives only inside :func:`~packing_hf.integrations.adapters.head_inputs`.

Under an engine that holds the head's weight itself, the chunked head reads it where the engine has gathered it
(:func:`_with_head_weight`): under FSDP2 after the model's forward (the head's group stays unsharded until the
backward), under DeepSpeed ZeRO-3 (a partition outside the head's calls) in a second call of the head, its
``forward`` replaced for that call, so that DeepSpeed's hooks gather the weight for it and for its backward. The
engine is the run's :class:`~packing_hf.integrations.parallel.ParallelPlan`'s (given to :func:`resolve_head`;
none without one), and its hooks are the only hooks such a head may carry.

A model is chunked only where that is exact: its output embeddings are the ``torch.nn.Linear`` its causal-LM
``forward`` calls as ``self.lm_head``, and what the ``forward`` does to the logits between the head and the
loss is one of the known processings (none; Cohere's ``logit_scale``; Granite's ``logits_scaling``; Gemma
2/3's ``final_logit_softcapping``), read from the ``forward``'s source. Anything else (an unknown class, extra
logit processing, a LoRA-wrapped or quantized head, hooks on the head or on every module, an MoE auxiliary loss)
keeps the full-logits path; the reason is returned so the trainer can say it once.

Reward models score sequences with a ``(hidden, 1)`` head: they build no vocabulary logits and need none of this.

>>> from transformers import AutoConfig, AutoModelForCausalLM
>>> config = AutoConfig.for_model("gemma2", vocab_size=32, hidden_size=16, intermediate_size=32, head_dim=8,
...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, final_logit_softcapping=30.0)
>>> resolve_head(AutoModelForCausalLM.from_config(config))[1]
LogitHead(scale=1.0, divisor=1.0, softcap=30.0)
"""

from __future__ import annotations

import functools
import inspect
import re
from typing import Any, NamedTuple

import torch

from ..loss_head import LogitHead, LogitStats, TokenLogProbs, linear_cross_entropy, token_logprobs
from ..shard_loss import sequence_parallel_chunked_loss
from .adapters import head_inputs
from .parallel import ParallelPlan
from .preflight import base_model

__all__ = [
    "ChunkedHead",
    "causal_lm_loss",
    "model_token_logprobs",
    "pairs_lm_loss",
    "resolve_head",
    "shard_lm_loss",
]

_HEAD_CALL = re.compile(r"^logits = self\.lm_head\(hidden_states(\[:, slice_indices, :\])?\)$")
# what a causal LM's forward may do to the logits between its head and its loss, and what it means
_PROCESSINGS: dict[tuple[str, ...], str] = {
    (): "none",
    ("logits = logits * self.logit_scale",): "scale",
    ("logits = logits / self.config.logits_scaling",): "divisor",
    (
        "if self.config.final_logit_softcapping is not None:",
        "logits = logits / self.config.final_logit_softcapping",
        "logits = torch.tanh(logits)",
        "logits = logits * self.config.final_logit_softcapping",
    ): "softcap",
}


@functools.cache
def _processing_of(cls: type) -> str:
    """The logit processing of ``cls.forward`` (a key of :data:`_PROCESSINGS`' values), or why it is not known."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return f"the source of {cls.__name__}.forward cannot be read"
    lines = [line.split("#")[0].strip() for line in source.splitlines()]
    lines = [line for line in lines if line]
    heads = [i for i, line in enumerate(lines) if line.startswith("logits = self.lm_head(")]
    if len(heads) != 1 or not _HEAD_CALL.match(lines[heads[0]]):
        return f"{cls.__name__}.forward does not call its head once as `logits = self.lm_head(hidden_states)`"
    try:
        end = lines.index("loss = None", heads[0])
    except ValueError:
        return f"{cls.__name__}.forward has no `loss = None` after its head"
    between = tuple(lines[heads[0] + 1 : end])
    if between not in _PROCESSINGS:
        return (
            f"{cls.__name__}.forward processes its logits in a way packing_hf does not know ({between[0]!r})"
        )
    return _PROCESSINGS[between]


#: where the hooks of the engines that gather the head's weight around its calls are defined, by the plan's engine
#: (FSDP2's ``FSDPState`` methods and group hooks; DeepSpeed ZeRO-3's parameter-offload closures, some wrapped by
#: ``deepspeed.utils.nvtx``): they do not change what the head computes, and the chunked head reads the weight where
#: they have gathered it (:func:`_with_head_weight`)
_ENGINE_HOOK_MODULES = {"fsdp": "torch.distributed.fsdp.", "deepspeed": "deepspeed."}


class ChunkedHead(NamedTuple):
    """A causal LM's head that can be chunked exactly (:func:`resolve_head`).

    Attributes:
        head: the ``lm_head`` module (its weight ``(V, H)`` read by the chunked head).
        logit_head: what the model's ``forward`` does to its logits (:class:`~packing_hf.loss_head.LogitHead`).
        in_calls: whether the run's engine holds the weight gathered only inside the head's calls (DeepSpeed
            ZeRO-3, :attr:`ParallelPlan.gathers_in_module_calls
            <packing_hf.integrations.parallel.ParallelPlan.gathers_in_module_calls>`): the chunked head then runs as
            a call of the head.
    """

    head: torch.nn.Linear
    logit_head: LogitHead
    in_calls: bool = False


def _is_engine_hook(hook: Any, engine: str) -> bool:
    """Whether ``hook`` is one of ``engine``'s (the plan's engine; a key of :data:`_ENGINE_HOOK_MODULES`)."""
    prefix = _ENGINE_HOOK_MODULES.get(engine)
    module = str(getattr(getattr(hook, "func", hook), "__module__", ""))  # .func: a functools.partial
    return prefix is not None and module.startswith(prefix)


def _is_linear(head: torch.nn.Module) -> bool:
    """A ``torch.nn.Linear``, or FSDP2's subclass of one (``FSDPLinear``: ``fully_shard`` of the head itself)."""
    if type(head) is torch.nn.Linear:
        return True
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return type(head).__bases__ == (FSDPModule, torch.nn.Linear)


def _bypassed_calls(head: torch.nn.Module, engine: str) -> str | None:
    """What a call of ``head`` runs besides ``F.linear(x, weight, bias)``, which the chunked head (reading the
    weight itself) would skip, or ``None``: hooks registered on it (a temperature, a vocabulary mask, an
    adapter's wrapper), hooks registered on every module (``torch.nn.modules.module.register_module_*_hook``),
    or a ``forward`` replaced on the instance (accelerate's device hooks). The hooks of the run's ``engine``
    (FSDP2, DeepSpeed ZeRO-3 gather the weight: :func:`_is_engine_hook`) are not counted: the chunked head reads
    the weight where they have gathered it (:func:`_with_head_weight`).

    Such a head keeps the full logits, even where the hook is row-wise (a temperature, a mask) and would be exact
    per chunk of tokens: nothing says which hooks are; one sees the ``(B, T, V)`` logits of the whole call, holds
    state across calls, or changes the gradient (a backward hook), and each would silently compute something
    else on ``(chunk, V)`` slices (the chunked head's projection also runs in backward, without the module)."""
    from torch.nn.modules import module as torch_module

    kinds = {"forward_pre": "forward pre-hooks", "forward": "forward hooks", "backward_pre": "backward pre-hooks",
             "backward": "backward hooks"}  # fmt: skip
    found = [
        what
        for kind, what in kinds.items()
        if any(not _is_engine_hook(h, engine) for h in getattr(head, f"_{kind}_hooks").values())
    ]
    found += [
        f"global {what} (on every module)"
        for kind, what in kinds.items()
        if getattr(torch_module, f"_global_{kind}_hooks")
    ]
    if "forward" in vars(head):
        found.append("a forward of its own (set on the module)")
    return ", ".join(found) if found else None


def resolve_head(model: Any, plan: ParallelPlan | None = None) -> ChunkedHead | str:
    """The :class:`ChunkedHead` of a causal LM whose head can be chunked exactly, else why not (a sentence).

    ``model`` may be wrapped (DDP, PEFT): the ``PreTrainedModel`` inside is read. ``plan``: the run's layout, whose
    engine may hold the head's weight (its hooks on the head are then expected); ``None``: no engine.
    """
    plan = ParallelPlan() if plan is None else plan
    inner = base_model(model)
    head = getattr(inner, "lm_head", None)
    get = getattr(inner, "get_output_embeddings", None)
    if head is None or get is None or get() is not head:
        return f"{type(inner).__name__} has no `lm_head` output embeddings"
    if not _is_linear(head):
        return (
            f"its lm_head is a {type(head).__name__}, not a torch.nn.Linear (an adapter or a quantized head)"
        )
    bypassed = _bypassed_calls(head, plan.engine)
    if bypassed is not None:
        return f"its lm_head has {bypassed}, which computing the logits in chunks would skip"
    config = getattr(inner, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text_config, "output_router_logits", False):
        return "it adds a router auxiliary loss to the model's own loss (output_router_logits=True)"
    processing = _processing_of(type(inner))
    if processing == "none":
        logit_head = LogitHead()
    elif processing == "scale":
        logit_head = LogitHead(scale=float(inner.logit_scale))
    elif processing == "divisor":
        logit_head = LogitHead(divisor=float(config.logits_scaling))
    elif processing == "softcap":
        logit_head = LogitHead(softcap=config.final_logit_softcapping)
    else:
        return processing  # why not
    return ChunkedHead(head, logit_head, plan.gathers_in_module_calls)


def _hidden_states(
    model: Any, inputs: dict[str, Any], resolved: ChunkedHead | None
) -> tuple[ChunkedHead, torch.Tensor, Any]:
    """``(resolved, hidden (B, T, H), outputs)``: the model called on ``inputs``, its head's input kept, no logits
    made; ``resolved`` is :func:`resolve_head` of the model (looked up, without an engine, when ``None``)."""
    if resolved is None:
        resolved = resolve_head(model)
        if isinstance(resolved, str):
            raise ValueError(f"the LM head of this model cannot be chunked exactly: {resolved}")
    with head_inputs(resolved.head) as captured:
        outputs = model(**inputs)
    if len(captured) != 1:
        raise RuntimeError(
            f"the model called its lm_head {len(captured)} times in one forward; the chunked loss needs one call. "
            "Set chunked_loss=False"
        )
    return resolved, captured[0], outputs


def _with_head_weight(resolved: ChunkedHead, hidden: torch.Tensor, compute: Any) -> Any:
    """``compute(hidden, weight, bias)`` (a tensor, or a tuple of tensors and ``None``) with the head's weight whole,
    after the model's forward.

    - Without an engine gathering the weight, and under FSDP2: the weight as the head holds it. FSDP2 keeps the
      head's group unsharded from the forward to the backward where it is not resharded after the forward (the
      root's group; accelerate's ``[final norm, lm_head]`` group, ``reshard_after_forward=False``), and reduces
      the head's gradient when the backward reaches the group's input, after the chunked head's backward. A head
      resharded after the forward (a ``DTensor`` weight) is refused. (Running ``compute`` as a second call of
      the head instead, as for ZeRO-3, crashes FSDP2's backward: that call's post-backward reshards the whole
      group, the final norm's weight included, before the norm's backward.)
    - DeepSpeed ZeRO-3 (``resolved.in_calls``), which holds a partition of the weight outside the head's calls:
      ``compute`` runs as a call of the head (its ``forward`` set on the instance for the call, removed after
      it). DeepSpeed's hooks gather the weight before it, attach their pre-backward hook to what it returns (the
      weight gathered again for its backward, where its gradient is reduced), and release the weight after the
      call and after its backward, as for the head's own call. No hook can do this: what DeepSpeed hooks must be
      the call's output, and a forward hook's replacement of it comes after the projection.
    """
    head = resolved.head
    if not resolved.in_calls:
        weight = head.weight
        if hasattr(weight, "placements"):  # a DTensor: FSDP2's shard
            raise RuntimeError(
                f"the LM head's weight is an FSDP2 shard after the model's forward ({tuple(weight.shape)} of "
                f"{weight.placements}): its fully_shard group reshards after the forward. Give lm_head's group "
                "reshard_after_forward=False (as accelerate does) or set chunked_loss=False"
            )
        return compute(hidden, weight, head.bias)
    if "forward" in vars(head):
        raise RuntimeError("the LM head has a forward of its own (set on the module); set chunked_loss=False")
    head.forward = lambda x: compute(x, head.weight, head.bias)
    try:
        return head(hidden)
    finally:
        del head.forward


def causal_lm_loss(
    model: Any,
    inputs: dict[str, Any],
    labels: torch.Tensor,
    coefficients: torch.Tensor | None = None,
    resolved: ChunkedHead | None = None,
    chunk_size: int | None = None,
    metrics: bool = False,
) -> tuple[torch.Tensor, LogitStats, Any]:
    """The summed causal-LM cross-entropy of a batch, chunked: ``(loss, stats, outputs)``.

    Args:
        model: the model as the trainer calls it (wrappers included).
        inputs: its keyword arguments, without ``labels``.
        labels: ``(B, T)`` int64, unshifted (position ``t`` predicts ``labels[:, t + 1]``), -100 = not a target.
        coefficients: ``(B, T - 1)`` float, each target's weight in the sum
            (:func:`packing_hf.loss_head.target_coefficients`), or ``None`` (1 per target).
        resolved: :func:`resolve_head` of the model with the run's plan (looked up without an engine when ``None``).
        chunk_size: tokens per chunk (default: automatic).
        metrics: also the labelled targets' entropy sum and top-1 hits (TRL's SFT metrics).

    Returns:
        the fp32 sum ``sum c * CE`` over the targets, the labelled targets' :class:`LogitStats`, and the model's
        outputs (their ``logits`` are empty).
    """
    resolved, hidden, outputs = _hidden_states(model, inputs, resolved)

    def compute(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
        loss, stats = _summed_cross_entropy(
            hidden[:, :-1], weight, bias, resolved.logit_head, labels[:, 1:], coefficients, chunk_size, metrics
        )
        return loss, stats.entropy, stats.hits, stats.count  # tensors: what the engines' hooks see through

    loss, entropy, hits, count = _with_head_weight(resolved, hidden, compute)
    return loss, LogitStats(entropy, hits, count), outputs


def pairs_lm_loss(
    model: Any,
    inputs: dict[str, Any],
    rows: torch.Tensor,
    targets: torch.Tensor,
    coefficients: torch.Tensor,
    resolved: ChunkedHead | None = None,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, Any]:
    """``(sum_p c_p * CE_p, outputs)``: the cross-entropy of the target pairs of a one-row batch (a prefix-tree
    row: :class:`packing_hf.tree_collator.PrefixTreeCollator`), chunked: only the pairs' rows are projected, a row
    predicting several targets (a branch point) once per pair.

    Args:
        model, inputs, resolved, chunk_size: as in :func:`causal_lm_loss` (``inputs`` of one row, ``[1, T]``).
        rows: ``(P,)`` int64, the row token whose logits predict each pair's target.
        targets: ``(P,)`` int64 token ids.
        coefficients: ``(P,)`` float, each pair's factor in the sum.
    """
    resolved, hidden, outputs = _hidden_states(model, inputs, resolved)

    def compute(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        picked = hidden[0].index_select(0, rows.to(hidden.device))  # (P, H): backward sums a row's pairs
        loss, _ = linear_cross_entropy(
            picked,
            weight,
            targets.to(hidden.device),
            bias,
            weights=coefficients.to(hidden.device),
            head=resolved.logit_head,
            chunk_size=chunk_size,
        )
        return loss

    return _with_head_weight(resolved, hidden, compute), outputs


def shard_lm_loss(
    model: Any,
    shard: dict[str, Any],
    normalization: str,
    denominator: float | torch.Tensor,
    resolved: ChunkedHead | None = None,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, Any]:
    """``(loss, outputs)``: this rank's share of the loss of a row cut over a sequence-parallel group, from the LM
    head in chunks: :func:`packing_hf.shard_loss.sequence_parallel_chunked_loss` on the model's
    hidden states (no ``(T_rank, V)`` logits).

    Args:
        model, resolved, chunk_size: as in :func:`causal_lm_loss`.
        shard: what :func:`packing_hf.attention.sequence_parallel.shard_packed_batch` returned for this rank
            (the model gets it without its ``shift_labels``).
        normalization, denominator: as in :func:`~packing_hf.shard_loss.sequence_parallel_loss`.
    """
    inputs = {k: v for k, v in shard.items() if k != "shift_labels"}
    resolved, hidden, outputs = _hidden_states(model, inputs, resolved)

    def compute(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return sequence_parallel_chunked_loss(
            hidden,
            weight,
            shard,
            normalization,
            denominator,
            bias=bias,
            head=resolved.logit_head,
            chunk_size=chunk_size,
        )

    return _with_head_weight(resolved, hidden, compute), outputs


def _summed_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    logit_head: LogitHead,
    targets: torch.Tensor,
    coefficients: torch.Tensor | None,
    chunk_size: int | None,
    metrics: bool,
) -> tuple[torch.Tensor, LogitStats]:
    """``sum c * CE`` of the targets of ``hidden`` ``(B, T, H)`` (position ``t`` predicts ``targets[:, t]``) under
    the head ``weight`` ``(V, H)`` and ``bias`` ``(V,)`` (or ``None``)."""
    targets = targets.to(hidden.device)
    mask = targets != -100
    weights = coefficients.to(hidden.device)[mask] if coefficients is not None else None
    # only the targets are projected: prompt tokens and sample boundaries cost nothing
    return linear_cross_entropy(
        hidden[mask],
        weight,
        targets[mask],
        bias,
        weights=weights,
        head=logit_head,
        chunk_size=chunk_size,
        metrics=metrics,
    )


def model_token_logprobs(
    model: Any,
    inputs: dict[str, Any],
    targets: torch.Tensor,
    resolved: ChunkedHead | None = None,
    entropy: bool = False,
    mean_logits: bool = False,
    chunk_size: int | None = None,
    top1: bool = False,
    rows: torch.Tensor | None = None,
) -> tuple[TokenLogProbs, Any]:
    """Per-token log-probs of ``targets`` under the model, chunked, for the preference and RL trainers (what
    ``selective_log_softmax(model(**inputs).logits, targets)`` gives): ``(TokenLogProbs, outputs)``.

    Args:
        model, inputs, resolved, chunk_size: as in :func:`causal_lm_loss`.
        targets: ``(B, T)`` int64, the token scored at every position (already shifted: position ``t`` scores
            ``targets[:, t]``), -100 = not scored (log-prob 0).
        entropy, mean_logits, top1: also the ``(B, T)`` entropies / mean logits of every position / whether each
            target is its position's argmax.
        rows: ``(T',)`` int64, the position of the model's output that each of ``T'`` targets is scored at
            (``targets`` is then ``(B, T')``); a prefix tree's branch point serves the first token of each of its
            children. ``None``: position ``t`` scores ``targets[:, t]``.

    Returns:
        :class:`~packing_hf.loss_head.TokenLogProbs` of ``(B, T)`` (``(B, T')``) fp32 tensors, and the model's
        outputs.
    """
    resolved, hidden, outputs = _hidden_states(model, inputs, resolved)
    if rows is not None:
        hidden = hidden.index_select(1, rows.to(hidden.device))  # (B, T', H)

    def compute(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> TokenLogProbs:
        return token_logprobs(
            hidden.reshape(-1, hidden.shape[-1]),
            weight,
            targets.reshape(-1).to(hidden.device),
            bias,
            head=resolved.logit_head,
            entropy=entropy,
            mean_logits=mean_logits,
            chunk_size=chunk_size,
            top1=top1,
        )

    out = _with_head_weight(resolved, hidden, compute)
    shape = hidden.shape[:-1]
    return TokenLogProbs(*(None if x is None else x.view(shape) for x in out)), outputs
