"""``packing_hf.DPOTrainer`` / ``packing_hf.DPOConfig``: TRL's DPO on packed preference batches, exactly.

TRL 1.x pads every batch of ``B`` pairs to ``2B x longest`` and has switched its own ``padding_free``
off for DPO. This subclass runs the policy and the reference model on packed rows instead
(:class:`~packing_hf.preference.PaddingFreePreferenceCollator`: the ``2B`` sequences as segments of one
``[1, T]`` row with ``cu_seq_lens`` and restarting positions) and leaves TRL's loss code untouched:

- TRL's ``_compute_loss`` builds the labels, calls the model with ``fused_lm_head=True`` and computes
  every loss type, the reference log-probs and the metrics from per-token tensors in the padded
  ``(2B, L - 1)`` layout. :class:`PackedPreferenceForward` is a pair of forward hooks on each model: before
  the forward it swaps the padded ``input_ids`` for the packed row and moves the labels there; after it, it
  scatters every per-token output (``log_probs``, ``entropy``, ``mean_logits``, ``is_top1``, ...) back into
  the padded layout, with zeros where TRL's fused head writes zeros. The per-token values are those of the
  padded forward (varlen attention keeps the segments apart), summed in the same order, so per-sequence
  log-probs, every ``loss_type``, ``ld_alpha``, ``use_weighting`` and the reference log-probs (live or
  ``precompute_ref_log_probs``) equal stock TRL's up to floating-point reassociation inside the matmuls.
- ``max_tokens_per_batch`` (from :class:`~packing_hf.integrations.PackingTrainerMixin`): micro-batches come
  from :class:`~packing_hf.MultipackBatchSampler` over *pairs*, each weighing
  ``len(prompt + chosen) + len(prompt + rejected)`` tokens, so a pair is never split across batches.
  Note that TRL's loss is a mean over the pairs of a micro-batch, so with multipack (a varying number of
  pairs per micro-batch) every micro-batch weighs the same whatever its pair count, as stock weighs its
  micro-batches.

Shared prompt (``shared_prompt``, on by default where exact): every pair becomes ``[prompt[:-1] |
prompt[-1] + chosen | prompt[-1] + rejected]``, the two answers attending to the prompt segment through
packing_hf's attention (:mod:`packing_hf.attention.prefix`), so the prompt is stored and computed once;
per-token results land in the same padded layout, so everything above holds unchanged.

``padding_free=True`` (TRL's own switch, which TRL 1.x disables with a warning) is accepted: this trainer
always packs. Refused with a ``ValueError`` (they cannot be exact on a packed row): vision datasets,
prompt-learning PEFT (virtual tokens), ``compute_metrics`` (it needs padded logits), a padded ``data_collator``, the deprecated ``pad_token`` option, context/sequence
parallelism, and ``packing_overflow`` ``"truncate"``/``"split"`` (a pair cannot be cut).

>>> from packing_hf.integrations.dpo import DPOConfig
>>> config = DPOConfig("out", max_tokens_per_batch=2048, report_to="none", use_cpu=True)
>>> config.max_tokens_per_batch, config.loss_type
(2048, ['sigmoid'])
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
import trl

from ..architectures import check_architecture
from ..attention import ATTENTION_NAME, register_attention
from ..preference import (
    PaddingFreePreferenceCollator,
    pack_padded_labels,
    preference_pair_lengths,
    unpack_shifted,
)
from ..shared_prefix import PREFIX_KEY
from .args import PackingArguments, as_config
from .callbacks import STATS_KEY, PackingStatsCollator
from .preflight import base_model, preflight_packing
from .trainer import PackingTrainerMixin

__all__ = [
    "DPOConfig",
    "DPOTrainer",
    "PackedForwardsMixin",
    "PackedPreferenceForward",
    "PreferenceStatsCollator",
]

logger = logging.getLogger(__name__)


@dataclass
class DPOConfig(PackingArguments, trl.DPOConfig):
    """``trl.DPOConfig`` plus the packing fields of :class:`~packing_hf.integrations.args.PackingArguments`.

    ``max_length`` / ``truncation_mode`` keep TRL's meaning (per sequence, applied by the collator and
    counted in its ``stats``); ``max_tokens_per_batch`` is the multipack budget counted over both sequences
    of every pair.

    ``shared_prompt`` holds every pair's prompt once in the packed row, the chosen and rejected answers
    attending to it as branches (:class:`~packing_hf.preference.PaddingFreePreferenceCollator`). ``None``
    (default) turns it on when packing_hf's varlen attention keeps the policy and the reference model exact
    (checked once per architecture); the models then run that attention during training, evaluation and
    reference precomputation and are given back as they were. ``padding_free=True`` is accepted and means
    what packing_hf always does here: packed rows, exact.

    >>> DPOConfig(output_dir="out", report_to="none", use_cpu=True).packing_preflight
    'switch'
    """

    _optional_switches: ClassVar[tuple[str, ...]] = ("shared_prompt",)
    shared_prompt: bool | None = field(
        default=None,
        metadata={
            "help": "Hold every pair's prompt once, chosen and rejected attending to it as branches (needs "
            "packing_hf's varlen attention, switched on during packed work). None (default): on when that "
            "attention is exact for the models; True: always (refused where it cannot be exact); False: off."
        },
    )


class PackedPreferenceForward:
    """Forward hooks letting ``model`` take a packed preference batch while its caller works in the padded layout.

    A call is rewritten only when its keyword arguments hold ``packed_index`` (the batches of
    :class:`~packing_hf.preference.PaddingFreePreferenceCollator`); every other call passes untouched.
    Before the forward: ``input_ids`` (padded ``(S, L)``) and ``attention_mask`` are dropped,
    ``packed_input_ids`` ``(1, T)`` becomes ``input_ids`` and the padded ``labels`` ``(S, L)`` are moved to
    the packed row (:func:`~packing_hf.preference.pack_padded_labels`). After it: every per-token output of
    shape ``(1, T - 1, ...)`` is scattered to ``(S, L - 1, ...)``
    (:func:`~packing_hf.preference.unpack_shifted`). Only TRL's fused LM head (``fused_lm_head=True``) is
    accepted: plain logits of padding positions do not exist in a packed batch.

    Args:
        model: the ``nn.Module`` the trainer calls (a ``PreTrainedModel`` or a PEFT model; not a DDP wrapper,
            whose inner module is called with the same arguments).

    >>> import torch
    >>> from packing_hf.preference import PaddingFreePreferenceCollator
    >>> class Scorer(torch.nn.Module):  # stands for a model with TRL's fused LM head
    ...     def forward(self, input_ids, labels, fused_lm_head=False, **kwargs):
    ...         return {"log_probs": (labels[:, 1:] != -100).float() * input_ids[:, 1:]}
    >>> model = Scorer()
    >>> hooks = PackedPreferenceForward(model)
    >>> batch = PaddingFreePreferenceCollator()([{"prompt_ids": [1], "chosen_ids": [2], "rejected_ids": [3, 4]}])
    >>> labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    >>> model(**batch, labels=labels, fused_lm_head=True)["log_probs"].tolist()  # padded (2, 2)
    [[2.0, 0.0], [3.0, 4.0]]
    >>> hooks.remove()
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._layout: tuple[torch.Tensor, int, int] | None = None
        # prepend: the rewrite must come before packing_hf's own guards, which check the packed inputs
        self._handles = [
            model.register_forward_pre_hook(self._before, with_kwargs=True, prepend=True),
            model.register_forward_hook(self._after, with_kwargs=True),
        ]

    def remove(self) -> None:
        """Remove both hooks (the model is as before)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _before(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        self._layout = None  # a forward that raised must not leave its layout to the next call
        if "packed_index" not in kwargs:
            return None
        kwargs = dict(kwargs)
        index = kwargs.pop("packed_index")
        packed_ids = kwargs.pop("packed_input_ids", None)
        if args or packed_ids is None:
            raise ValueError(
                "a packed preference batch must be passed as keyword arguments with 'packed_input_ids' "
                f"(got {len(args)} positional argument(s), keys {sorted(kwargs)})"
            )
        if not kwargs.get("fused_lm_head"):
            raise ValueError(
                "a packed preference batch was passed to the model without fused_lm_head=True: only TRL's fused "
                "LM head (per-token log-probs) can be mapped back to the padded layout; logits of padding "
                "positions do not exist in a packed row. Call it the way trl.DPOTrainer does, or collate with "
                "trl's DataCollatorForPreference for padded logits"
            )
        if kwargs.get("shift_labels") is not None or kwargs.get("inputs_embeds") is not None:
            raise ValueError(
                "shift_labels / inputs_embeds cannot be combined with a packed preference batch (context "
                "parallelism and embedding inputs are not supported); use trl.DPOTrainer for them"
            )
        labels = kwargs.get("labels")
        padded_ids = kwargs.pop("input_ids", None)
        if not isinstance(labels, torch.Tensor) or not isinstance(padded_ids, torch.Tensor):
            raise ValueError(
                "a packed preference batch needs the padded 'input_ids' and 'labels' of shape (2B, L) next to "
                "'packed_input_ids' (TRL's DPOTrainer derives labels from input_ids and completion_mask)"
            )
        kwargs.pop("attention_mask", None)  # it describes the padded layout; a packed row needs none
        if kwargs.get(PREFIX_KEY) is not None:
            implementation = getattr(
                getattr(base_model(module), "config", None), "_attn_implementation", None
            )
            if implementation != ATTENTION_NAME:
                raise ValueError(
                    f"a shared-prompt preference batch (prefix_seq_idx) reached a model running attn_implementation="
                    f"{implementation!r}, which ignores the layout (chosen and rejected would see each other). Run "
                    "it inside trainer.train()/evaluate() (which switch the attention), load the model with "
                    "attn_implementation=packing_hf.register_attention(), or set shared_prompt=False"
                )
        kwargs["input_ids"] = packed_ids
        kwargs["labels"] = pack_padded_labels(labels, index)
        self._layout = (index, padded_ids.shape[0], padded_ids.shape[1])
        return args, kwargs

    def _after(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        layout, self._layout = self._layout, None
        if layout is None:
            return None
        index, rows, width = layout
        shifted = (1, index.numel() - 1)
        for key, value in list(output.items()):
            if isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == shifted:
                output[key] = unpack_shifted(value, index, rows, width)
        return output


class PreferenceStatsCollator(PackingStatsCollator):
    """:class:`~packing_hf.integrations.callbacks.PackingStatsCollator` for preference batches.

    Counts sequences (two per pair) as samples and ``2B x longest`` (the right-padded batch TRL would run)
    as ``padded_tokens``, all read from the wrapped collator's ``stats``.

    >>> from packing_hf.preference import PaddingFreePreferenceCollator
    >>> out = PreferenceStatsCollator(PaddingFreePreferenceCollator())(
    ...     [{"prompt_ids": [1, 2], "chosen_ids": [3], "rejected_ids": [4, 5, 6]}])
    >>> out[STATS_KEY]
    {'real_tokens': 8, 'emitted_tokens': 8, 'samples': 2, 'padded_tokens': 10}
    """

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict:
        before = dict(self.collator.stats)
        batch = self.collator(list(features))
        after = self.collator.stats
        batch[STATS_KEY] = {
            "real_tokens": after["tokens"] - before["tokens"],
            "emitted_tokens": int(batch["packed_input_ids"].numel()),
            "samples": after["samples"] - before["samples"],
            "padded_tokens": after["padded_layout_tokens"] - before["padded_layout_tokens"],
        }
        return batch


def _shared_prompt_is_exact(models: list[Any]) -> bool:
    """Whether packing_hf's varlen attention keeps every given model exact (cached per architecture)."""
    name = register_attention()
    for model in models:
        if model is None or isinstance(model, str):
            continue
        config = getattr(base_model(model), "config", None)
        if config is None or check_architecture(config, name).leaked:
            return False
    return True


def _refuse_shared_prompt_where_inexact(models: list[Any]) -> None:
    if not _shared_prompt_is_exact(models):
        types = sorted({getattr(base_model(m).config, "model_type", "?") for m in models if m is not None})
        raise ValueError(
            f"shared_prompt=True: packing_hf's varlen attention does not keep {types} exact, and only it reads "
            "the shared-prompt layout; set shared_prompt=False (packed pairs without sharing stay exact)"
        )


def _check_dataset(dataset: Any, name: str, needs: tuple[str, ...] = ("chosen", "rejected")) -> None:
    """A dataset lacking the columns of a preference pair, named before TRL fails on it with a KeyError."""
    for key, part in dataset.items() if isinstance(dataset, dict) else [(None, dataset)]:
        row = _first_row(part)
        if not isinstance(row, Mapping):
            continue
        missing = [c for c in needs if c not in row and f"{c}_ids" not in row]
        if missing:
            where = name if key is None else f"{name}[{key!r}]"
            raise ValueError(
                f"{where} has the columns {sorted(row)} but no {missing}: a preference trainer needs "
                f"{' and '.join(repr(c) for c in needs)} for every prompt. A prompt-only dataset is for online "
                "trainers (GRPO, RLOO); unpaired (prompt, completion, label) rows are for trl.KTOTrainer"
            )


def _check_vocabulary(processing_class: Any, model: Any) -> None:
    """A tokenizer with more tokens than the model has embeddings, named before an IndexError in the forward."""
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    if tokenizer is None or isinstance(model, str) or not hasattr(tokenizer, "__len__"):
        return
    embeddings = getattr(base_model(model), "get_input_embeddings", lambda: None)()
    rows = getattr(embeddings, "num_embeddings", None)
    if isinstance(rows, int) and len(tokenizer) > rows:
        raise ValueError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's input embeddings only {rows} rows: token "
            f"ids >= {rows} cannot be looked up. Call model.resize_token_embeddings(len(tokenizer)) or use the "
            "model's own tokenizer"
        )


def _first_row(dataset: Any) -> Any:
    try:
        return next(iter(dataset))
    except (StopIteration, TypeError):
        return None


def _is_prompt_learning(model: Any, peft_config: Any) -> bool:
    configs = (
        [peft_config, *getattr(model, "peft_config", {}).values()]
        if not isinstance(model, str)
        else [peft_config]
    )
    return any(getattr(config, "is_prompt_learning", False) for config in configs if config is not None)


def _check_options(args: DPOConfig, model: Any, data_collator: Any, train_dataset: Any, kwargs: dict) -> None:
    """Refuse, before TRL does any work, every option a packed preference batch cannot reproduce exactly."""
    if data_collator is not None and not isinstance(data_collator, PaddingFreePreferenceCollator):
        raise ValueError(
            f"data_collator={type(data_collator).__name__} does not pack preference pairs; leave it unset (a "
            "PaddingFreePreferenceCollator is built from the config) or pass a PaddingFreePreferenceCollator"
        )
    if kwargs.get("compute_metrics") is not None:
        raise ValueError(
            "compute_metrics needs the padded logits of every position (deprecated in TRL); a packed batch "
            "only yields per-token log-probs of real tokens. Unset compute_metrics (TRL's DPO metrics are "
            "logged anyway) or use trl.DPOTrainer"
        )
    if args.pad_token is not None:
        raise ValueError(
            f"pad_token={args.pad_token!r} is deprecated in TRL and only applied with TRL's own collator; set "
            "tokenizer.pad_token and pass the tokenizer as processing_class instead"
        )
    check_whole_sequence_options(
        args,
        model,
        train_dataset,
        kwargs,
        unit="a preference pair, whose two sequences",
        what="preference",
        stock="trl.DPOTrainer",
    )


def check_whole_sequence_options(
    args: Any, model: Any, train_dataset: Any, kwargs: dict, *, unit: str, what: str, stock: str
) -> None:
    """The refusals every trainer scoring whole sequences shares (DPO, KTO): an overflow policy that would cut
    ``unit``, vision data (image features are tied to padded rows), prompt-learning PEFT (virtual tokens)."""
    if args.max_tokens_per_batch is not None and args.packing_overflow in ("truncate", "split"):
        raise ValueError(
            f"packing_overflow={args.packing_overflow!r} would cut {unit} must be scored whole; use 'error' "
            "(default) or 'drop', raise max_tokens_per_batch, or lower max_length"
        )
    row = _first_row(train_dataset)
    if isinstance(row, Mapping) and ("image" in row or "images" in row):
        raise ValueError(
            f"the training dataset has 'image'/'images' columns: vision-language {what} batches are not packed "
            f"(image features are tied to padded rows); use {stock} for vision data"
        )
    if _is_prompt_learning(model, kwargs.get("peft_config")):
        raise ValueError(
            "prompt-learning PEFT (prefix / prompt tuning) prepends virtual tokens to every sequence, which a "
            f"packed row cannot hold per segment; use LoRA-style adapters or {stock}"
        )


@contextlib.contextmanager
def _prepared_once(model: Any, mode: str):
    """``model`` checked and prepared for packed batches for the duration, then given back as it was."""
    attn_implementation = getattr(model.config, "_attn_implementation", None)
    preparation = preflight_packing(model, mode=mode)
    try:
        yield
    finally:
        if preparation is not None:
            preparation.revert()
        if attn_implementation is not None and model.config._attn_implementation != attn_implementation:
            model.set_attn_implementation(attn_implementation)  # the pre-flight switched it


def _pad_token_id(processing_class: Any) -> int:
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    return 0  # only the embedding lookup of pad_to_multiple_of padding reads it: any valid id is exact


class PackedForwardsMixin:
    """The packed-forward plumbing of packing_hf's preference trainers (DPO, KTO): put it first in the bases.

    :class:`PackedPreferenceForward` hooks go on the policy and the reference model the first time each is
    called (they only act on packed batches), and the reference model is checked and prepared like the policy
    while training or evaluating, then given back as it was. The subclass sets ``_packed_forwards = {}`` and
    ``_reference_prepared = False`` before TRL's ``__init__``.
    """

    # ---- packed forwards -------------------------------------------------------------------------

    def _install_packed_forward(self, model: Any) -> None:
        """The packed-forward hooks on ``model`` (once): they stay, and only act on packed preference batches."""
        unwrapped = self.accelerator.unwrap_model(model)
        if id(unwrapped) not in self._packed_forwards:
            self._packed_forwards[id(unwrapped)] = PackedPreferenceForward(unwrapped)

    def remove_packing_hooks(self) -> None:
        """Remove the packed-forward hooks from the policy and the reference model."""
        for hooks in self._packed_forwards.values():
            hooks.remove()
        self._packed_forwards.clear()

    @contextlib.contextmanager
    def _shared_attention(self, model: Any):
        """Attention switched for the duration where the layout needs it (see ``DPOTrainer``); none here."""
        yield

    @contextlib.contextmanager
    def _packed_reference(self):
        """The reference model prepared like the policy (pre-flight check, guards) for the duration, then given
        back as it was; the policy is handled by the mixin's own ``_packing_model``. Nested calls (evaluation
        during training) prepare once."""
        ref = self.accelerator.unwrap_model(self.ref_model) if self.ref_model is not None else None
        if ref is None or self._reference_prepared:
            yield
            return
        self._reference_prepared = True
        try:
            with _prepared_once(ref, self.args.packing_preflight), self._shared_attention(ref):
                yield
        finally:
            self._reference_prepared = False

    def train(self, *args: Any, **kwargs: Any):
        self._install_packed_forward(self.model)
        if self.ref_model is not None:
            self._install_packed_forward(self.ref_model)
        with self._packed_reference():
            return super().train(*args, **kwargs)

    def evaluate(self, *args: Any, **kwargs: Any):
        self._install_packed_forward(self.model)
        if self.ref_model is not None:
            self._install_packed_forward(self.ref_model)
        with self._packed_reference():
            return super().evaluate(*args, **kwargs)

    def compute_ref_log_probs(self, model: Any, inputs: dict[str, Any]):
        self._install_packed_forward(model)
        return super().compute_ref_log_probs(model, inputs)

    def compute_loss(
        self, model: Any, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch=None
    ):
        self._install_packed_forward(model)
        if self.ref_model is not None:
            self._install_packed_forward(self.ref_model)
        return super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )


class DPOTrainer(PackedForwardsMixin, PackingTrainerMixin, trl.DPOTrainer):
    """``trl.DPOTrainer`` on packed preference batches: same log-probs, losses and gradients, no padding.

    Same arguments as ``trl.DPOTrainer``; ``args`` is converted to :class:`DPOConfig` if it is a plain
    ``TrainingArguments`` / ``trl.DPOConfig``. Unless given, the collator is a
    :class:`~packing_hf.preference.PaddingFreePreferenceCollator` with the config's ``max_length`` (TRL's
    per-sequence truncation, ``truncation_mode``; counted in the collator's ``stats``) and
    ``pad_to_multiple_of``. Load the models with an attention that keeps packed segments apart (sdpa/eager
    for llama-like models, or ``attn_implementation=packing_hf.register_attention()``); the pre-flight check
    (``packing_preflight``) verifies it for the policy and the reference model while they train, evaluate
    or precompute reference log-probs, and gives them back as they were afterwards.

    >>> import datasets
    >>> from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    >>> tokenizer = AutoTokenizer.from_pretrained(SHARED_DATA / "smollm2_tokenizer")
    >>> config = AutoConfig.for_model("llama", vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
    ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    >>> model = AutoModelForCausalLM.from_config(config)
    >>> data = datasets.Dataset.from_dict({"prompt": ["1+1=", "2+3="], "chosen": ["2", "5"], "rejected": ["3", "6"]})
    >>> args = DPOConfig("/tmp/packing_hf_dpo_doctest", max_tokens_per_batch=64, max_steps=1, report_to="none",
    ...     precompute_ref_log_probs=True, save_strategy="no", use_cpu=True, disable_tqdm=True)
    >>> trainer = DPOTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
    >>> type(trainer.data_collator).__name__
    'PaddingFreePreferenceCollator'
    >>> result = trainer.train()  # the Trainer prints its final metrics  # doctest: +ELLIPSIS
    {...'train_loss'...}
    >>> result.global_step
    1
    """

    def __init__(
        self,
        model: Any,
        ref_model: Any = None,
        args: Any = None,
        data_collator: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        **kwargs: Any,
    ) -> None:
        args = as_config(args, model, DPOConfig, "DPO")
        _check_options(args, model, data_collator, train_dataset, kwargs)
        _check_dataset(train_dataset, "train_dataset")
        _check_dataset(eval_dataset, "eval_dataset")
        _check_vocabulary(processing_class, model)
        own_collator = data_collator is None
        if (
            not own_collator
            and args.shared_prompt is not None
            and args.shared_prompt != data_collator.shared_prompt
        ):
            raise ValueError(
                f"shared_prompt={args.shared_prompt} in the config contradicts the data_collator's "
                f"shared_prompt={data_collator.shared_prompt}; set it in one place (leave the config's at None)"
            )
        if own_collator:
            shared = args.shared_prompt
            if shared is None and not isinstance(model, str):
                shared = _shared_prompt_is_exact([model, ref_model])
            data_collator = PaddingFreePreferenceCollator(
                max_length=args.max_length,
                overflow="truncate" if args.max_length is not None else "error",
                truncation_mode=args.truncation_mode,
                pad_to_multiple_of=args.pad_to_multiple_of,
                pad_token_id=_pad_token_id(processing_class),
                shared_prompt=bool(shared),
            )
        # Set before TRL's __init__, which may already run packed forwards (precompute_ref_log_probs).
        self._packed_forwards: dict[int, PackedPreferenceForward] = {}
        self._reference_prepared = False
        padding_free, args.padding_free = args.padding_free, False  # TRL would only warn and pad
        try:
            super().__init__(
                model,
                ref_model=ref_model,
                args=args,
                data_collator=data_collator,
                train_dataset=train_dataset,
                eval_dataset=eval_dataset,
                processing_class=processing_class,
                **kwargs,
            )
        finally:
            args.padding_free = padding_free
        if own_collator and args.shared_prompt is None and isinstance(model, str):
            # TRL loaded the model from its name: decide now (reference log-probs were precomputed unshared)
            self.data_collator.shared_prompt = _shared_prompt_is_exact([self.model, self.ref_model])
        if self.data_collator.shared_prompt:
            _refuse_shared_prompt_where_inexact([self.model, self.ref_model])
        parallelism = getattr(self.accelerator, "parallelism_config", None)
        for name in ("cp_size", "sp_size"):
            if parallelism is not None and (getattr(parallelism, name, 1) or 1) > 1:
                raise ValueError(
                    f"{name}={getattr(parallelism, name)}: context/sequence parallelism shards sequences, which "
                    "a packed preference row does not support; unset it or use trl.DPOTrainer"
                )
        self._packing_setup()

    def _precompute_ref_logps(self, dataset: Any, name: str, batch_size: int) -> Any:
        # runs inside TRL's __init__ (and evaluate): check and prepare the model that computes them
        model = self.ref_model if self.ref_model is not None else self.model
        self._install_packed_forward(model)
        with self._packing_model(self.accelerator.unwrap_model(model)):
            return super()._precompute_ref_logps(dataset, name, batch_size)

    @contextlib.contextmanager
    def _packing_model(self, model: Any):
        if not hasattr(self, "_multipack_sampler"):  # before _packing_setup (precompute in TRL's __init__)
            prepared = _prepared_once(model, self.args.packing_preflight)
        else:
            prepared = super()._packing_model(model)
        with prepared, self._shared_attention(model):
            yield

    @contextlib.contextmanager
    def _shared_attention(self, model: Any):
        """``model`` on packing_hf's attention for the duration when the collator shares prompts (the only
        attention reading ``prefix_seq_idx``), then on its own again."""
        base = base_model(model) if model is not None else None
        config = getattr(base, "config", None)
        current = getattr(config, "_attn_implementation", None)
        collator = getattr(self, "data_collator", None)
        if not getattr(collator, "shared_prompt", False) or current is None or current == ATTENTION_NAME:
            yield
            return
        base.set_attn_implementation(register_attention())
        try:
            yield
        finally:
            if config._attn_implementation == ATTENTION_NAME:
                base.set_attn_implementation(current)

    # ---- multipack over pairs --------------------------------------------------------------------

    def _multipack_lengths_of(self, dataset: Any) -> np.ndarray:
        """Tokens of every pair in a packed row: both sequences, after the collator's ``max_length``."""
        from .dataloaders import column_lengths

        collator = self.data_collator
        max_length = collator.max_length if collator.overflow == "truncate" else None
        parts = column_lengths(
            dataset,
            ("prompt_ids", "chosen_ids", "rejected_ids"),
            "pair",
            "let DPOTrainer tokenize it (prompt / chosen / rejected columns)",
        )
        return preference_pair_lengths(
            *parts,
            max_length=max_length,
            shared_prompt=collator.shared_prompt,
            truncation_mode=collator.truncation_mode,
        )

    def _wrap_train_collator(self, collator: Any) -> Any:
        if self.args.packing_metrics and isinstance(collator, PaddingFreePreferenceCollator):
            return PreferenceStatsCollator(collator)
        return collator
