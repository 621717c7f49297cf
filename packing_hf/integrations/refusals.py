"""The refusal table: every set-up a packed trainer cannot keep exact, with one wording each.

A trainer declares which refusals it owes (``packing_refusals``, names from :data:`REFUSALS`) and names
itself for the messages (``stock``: the unpacked trainer to use instead, ``wording``: a :class:`Wording`
of what one packed row holds). :func:`check_refusals` runs them on the trainer's arguments before the stock
``__init__`` does any work, or on the built trainer for the refusals that need its accelerator or
loaded model. A refusal raises :class:`PackingRefused`, a ``ValueError`` whose ``reason`` is the table
key, so callers (``packing-hf verify``, tests) read the reason as data, never from the message text.

>>> from types import SimpleNamespace
>>> trainer = SimpleNamespace(stock="trl.DPOTrainer",
...     wording=Wording("preference pairs", "preference batches", "a preference pair, whose two sequences"))
>>> call = {"args": SimpleNamespace(padding_free=False), "model": None}
>>> try:
...     check_refusals(("padding_free_false",), trainer, call)
... except PackingRefused as refused:
...     print(refused.reason)
padding_free_false
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import PackingRefused

__all__ = [
    "REFUSALS",
    "PackingRefused",
    "Refusal",
    "WHOLE_ROW_REFUSALS",
    "Wording",
    "check_refusals",
    "first_row",
    "is_prompt_learning",
]


# owed by every trainer whose packed row holds several sequences scored as one example (pairs, triples, KTO)
WHOLE_ROW_REFUSALS = ("cut_overflow", "vision_data", "prompt_learning", "sequence_parallelism")


@dataclass(frozen=True)
class Wording:
    """What a packed trainer's refusal messages call its packed things.

    >>> Wording("reward pairs", "reward batches", "a reward pair, whose two sequences", "reward pair").loss_term
    'reward pair'
    """

    unit: str = "samples"  # "data_collator=X does not pack <unit>"
    batches: str = "batches"  # "vision-language <batches> are not packed"
    whole: str = "a sample, whose tokens"  # "<overflow> would cut <whole> must be scored whole"
    # "the loss of <stock> is one term per <loss_term>" (trainers declaring StockLoss.PER_EXAMPLE)
    loss_term: str | None = None


def first_row(dataset: Any) -> Any:
    """The first row of ``dataset`` (``None`` when it has none or cannot be iterated)."""
    try:
        return next(iter(dataset))
    except (StopIteration, TypeError):
        return None


def is_prompt_learning(model: Any, peft_config: Any = None) -> bool:
    """Whether ``model`` (or the ``peft_config`` about to be applied) is prompt-learning PEFT (virtual tokens)."""
    configs = [peft_config]
    if model is not None and not isinstance(model, str):
        configs += list((getattr(model, "peft_config", None) or {}).values())
    return any(getattr(config, "is_prompt_learning", False) for config in configs if config is not None)


def _model_config(model: Any) -> Any:
    from .preflight import base_model

    return None if model is None or isinstance(model, str) else getattr(base_model(model), "config", None)


# ---- the checks: each returns its message (or None); ``t`` is the trainer class, ``c`` the call -----------


def _collator(t: Any, c: Mapping[str, Any]) -> str | None:
    collator, wanted = c.get("data_collator"), t.packing_collator
    if collator is None or isinstance(collator, wanted):
        return None
    return (
        f"data_collator={type(collator).__name__} does not pack {t.wording.unit}; leave it unset (a "
        f"{wanted.__name__} is built from the config) or pass a {wanted.__name__}"
    )


def _compute_metrics(t: Any, c: Mapping[str, Any]) -> str | None:
    if c.get("compute_metrics") is None:
        return None
    return (
        "compute_metrics needs the padded logits of every position (deprecated in TRL); a packed batch only "
        f"yields per-token log-probs of real tokens. Unset compute_metrics (TRL's metrics are logged anyway) "
        f"or use {t.stock}"
    )


def _pad_token(t: Any, c: Mapping[str, Any]) -> str | None:
    value = getattr(c["args"], "pad_token", None)
    if value is None:
        return None
    return (
        f"pad_token={value!r} is deprecated in TRL and only applied with TRL's own collator; set "
        "tokenizer.pad_token and pass the tokenizer as processing_class instead"
    )


def _argument_set(
    name: str, message: str, when: Callable[[Any], bool] = bool
) -> Callable[[Any, Mapping[str, Any]], str | None]:
    """The check refusing training argument ``name`` where ``when(value)`` (default: set, truthy);
    ``message`` may name ``{value}``, ``{stock}`` and ``{wording}``."""

    def check(t: Any, c: Mapping[str, Any]) -> str | None:
        value = getattr(c["args"], name, None)
        return message.format(value=value, stock=t.stock, wording=t.wording) if when(value) else None

    return check


_pad_to_multiple_of = _argument_set(
    "pad_to_multiple_of",
    "pad_to_multiple_of={value} pads TRL's padded batches; a packed row has none. Unset it, or use {stock}",
)
_liger = _argument_set(
    "use_liger_kernel",
    "use_liger_kernel=True swaps in Liger's kernels, which are not checked against packed rows (positions "
    "restart per segment); unset it, or use {stock}",
)
_generate_during_eval = _argument_set(
    "generate_during_eval",
    "generate_during_eval=True generates from padded prompts, which packed batches do not carry; unset it "
    "or use {stock}",
)


def _cut_overflow(t: Any, c: Mapping[str, Any]) -> str | None:
    args = c["args"]
    if args.max_tokens_per_batch is None or args.packing_overflow not in ("truncate", "split"):
        return None
    return (
        f"packing_overflow={args.packing_overflow!r} would cut {t.wording.whole} must be scored whole; use 'error' "
        "(default) or 'drop', raise max_tokens_per_batch, or lower max_length"
    )


def _vision_data(t: Any, c: Mapping[str, Any]) -> str | None:
    row = first_row(c.get("train_dataset"))
    if not isinstance(row, Mapping) or not ("image" in row or "images" in row):
        return None
    return (
        f"the training dataset has 'image'/'images' columns: vision-language {t.wording.batches} are not packed "
        f"(image features are tied to padded rows); use {t.stock} for vision data"
    )


def _prompt_learning(t: Any, c: Mapping[str, Any]) -> str | None:
    if not is_prompt_learning(c.get("model"), c.get("peft_config")):
        return None
    return (
        "prompt-learning PEFT (prefix / prompt tuning) prepends virtual tokens to every sequence, which a packed "
        f"row cannot hold per segment; use LoRA-style adapters or {t.stock}"
    )


_padding_free_false = _argument_set(
    "padding_free",
    "padding_free=False asks for padded batches, which packing_hf's trainer never runs; use {stock}",
    when=lambda value: value is False,
)
_own_loss = _argument_set(
    "loss_normalization",
    "loss_normalization={value!r}: the loss of {stock} is one term per {wording.loss_term}, not a token "
    "mean; leave loss_normalization='token'",
    when=lambda value: value not in (None, "token"),
)


def _encoder_decoder(t: Any, c: Mapping[str, Any]) -> str | None:
    config = _model_config(c.get("model"))
    if not getattr(c["args"], "is_encoder_decoder", False) and not getattr(
        config, "is_encoder_decoder", False
    ):
        return None
    return (
        "an encoder-decoder model: its answers run through the decoder as padded labels, which packing_hf "
        f"does not pack. Use {t.stock} for encoder-decoder models"
    )


def _router_message(t: Any) -> str:
    return (
        "the model returns a router load-balancing loss (config.output_router_logits=True): it would be "
        "computed over the packed tokens, not over stock's padded rows, so the loss would differ. Set "
        f"model.config.output_router_logits=False (or router_aux_loss_coef=0.0) or use {t.stock}"
    )


def _router_loss(t: Any, c: Mapping[str, Any]) -> str | None:
    enabled = getattr(_model_config(c.get("model")), "output_router_logits", False)
    return _router_message(t) if enabled else None


def _router_aux_loss(t: Any, c: Mapping[str, Any]) -> str | None:
    return _router_message(t) if getattr(c.get("trainer"), "aux_loss_enabled", False) else None


def _sequence_parallelism(t: Any, c: Mapping[str, Any]) -> str | None:
    # the sizes accelerate was given (a trainer that cuts rows itself keeps sp_size from it: not refused here)
    split = next(iter(c["trainer"].parallel_plan.shards_sequences.items()), None)
    if split is None:
        return None
    name, size = split
    return (
        f"{name}={size}: context/sequence parallelism shards sequences, which a packed row of this trainer does "
        f"not support; unset it or use {t.stock}"
    )


@dataclass(frozen=True)
class Refusal:
    """One row of the table: ``check(trainer_class, call)`` gives the message, or ``None`` when it does not
    apply; ``built`` refusals run on the built trainer (its accelerator, its loaded model)."""

    check: Callable[[Any, Mapping[str, Any]], str | None]
    built: bool = False
    needs_model: bool = False  # re-run on the loaded model when the trainer was given a model name


REFUSALS: dict[str, Refusal] = {
    "collator": Refusal(_collator),
    "compute_metrics": Refusal(_compute_metrics),
    "pad_token": Refusal(_pad_token),
    "pad_to_multiple_of": Refusal(_pad_to_multiple_of),
    "liger": Refusal(_liger),
    "cut_overflow": Refusal(_cut_overflow),
    "vision_data": Refusal(_vision_data),
    "prompt_learning": Refusal(_prompt_learning, needs_model=True),
    "padding_free_false": Refusal(_padding_free_false),
    "own_loss": Refusal(_own_loss),
    "generate_during_eval": Refusal(_generate_during_eval),
    "encoder_decoder": Refusal(_encoder_decoder, needs_model=True),
    "router_loss": Refusal(_router_loss, needs_model=True),
    "router_aux_loss": Refusal(
        _router_aux_loss, built=True
    ),  # the trainer's own switch (TRL's online trainers)
    "sequence_parallelism": Refusal(_sequence_parallelism, built=True),
}


def check_refusals(
    names: Iterable[str], trainer: Any, call: Mapping[str, Any], *, built: bool = False
) -> None:
    """Raise :class:`PackingRefused` for the first refusal in ``names`` that applies to ``call``.

    Args:
        names: keys of :data:`REFUSALS` the trainer declares.
        trainer: the trainer class (or instance): ``stock``, ``wording`` and the other names the
            messages use.
        call: the trainer's arguments (``args``, ``model``, ``data_collator``, ``train_dataset``, the other stock arguments
            by name); for ``built=True`` also ``trainer``, the built trainer.
        built: run the refusals that need the built trainer (and the model ones again on its loaded model).
    """
    for name in names:
        refusal = REFUSALS[name]
        if built != refusal.built and not (
            built and refusal.needs_model and isinstance(call.get("given"), str)
        ):
            continue
        message = refusal.check(trainer, call)
        if message is not None:
            raise PackingRefused(name, message)
