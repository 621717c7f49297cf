"""The preference kit: what every packed trainer scoring whole sequences shares (DPO, KTO, ORPO, CPO, TPO,
reward).

- :class:`PackedForwardsMixin`: the policy and the reference model run packed rows through
  :class:`~packing_hf.integrations.adapters.PackedPreferenceForward` adapters, both prepared by the trainer's
  :class:`~packing_hf.integrations.session.PackingSession` while it trains, evaluates or precomputes
  reference log-probs;
- :class:`PreferenceStatsCollator`: the packing metrics of preference batches;
- :class:`MaxLengthCountsMixin`: what TRL's ``max_length`` leaves out of a dataset, or its collator will cut,
  counted (DPO, KTO, TPO, reward);
- the input checks that name a problem before TRL fails on it (:func:`check_preference_call`, :func:`check_preference_dataset`,
  :func:`check_vocabulary`), :func:`pad_token_id`, and whether the shared-prompt layout is exact for given
  models (:func:`shared_prompt_is_exact`).

>>> from packing_hf.preference import PaddingFreePreferenceCollator
>>> out = PreferenceStatsCollator(PaddingFreePreferenceCollator())(
...     [{"prompt_ids": [1, 2], "chosen_ids": [3], "rejected_ids": [4, 5, 6]}])
>>> out[STATS_KEY]
{'real_tokens': 8, 'emitted_tokens': 8, 'samples': 2, 'padded_tokens': 10}
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._limits import option
from ..architectures import check_architecture
from ..attention import register_attention
from ..attention.admission import prefix_tree_refusal
from ..preference_layout import TREE_INDEX_KEY
from .adapters import SEQUENCE_PARALLEL_KEY, PackedPreferenceForward
from .callbacks import STATS_KEY, PackingStatsCollator
from .preflight import base_model
from .refusals import PackingRefused, first_row

__all__ = [
    "MaxLengthCountsMixin",
    "PairTreeArguments",
    "PackedForwardsMixin",
    "PreferenceStatsCollator",
    "check_preference_call",
    "check_preference_dataset",
    "check_tree_collator",
    "check_vocabulary",
    "pad_token_id",
    "refuse_shared_prompt_where_inexact",
    "shared_prompt_is_exact",
    "tree_token_ratio",
]


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


@dataclass
class PairTreeArguments:
    """The prefix-tree options of the pair trainers (DPO, ORPO, CPO; the causal-LM trainers' are
    :class:`~packing_hf.integrations.args.PrefixTreeArguments`, whose trees packing_hf's own loss reads), mixed
    into their configs before
    :class:`~packing_hf.integrations.args.PackingArguments`: ``share_prefixes`` and ``min_shared_tokens``
    (:class:`~packing_hf.preference.PaddingFreePreferenceCollator`'s meaning)."""

    share_prefixes: bool = option(
        False,
        "Lay every micro-batch out as one prefix tree: whatever token prefix sequences share (a system prompt, "
        "earlier turns of a conversation, a pair's prompt) is computed once, across pairs; every log-prob and the "
        "loss stay TRL's. Needs packing_hf's varlen attention (switched on during packed work); refused where it "
        "cannot be exact (hybrid models, sequence parallelism).",
    )
    min_shared_tokens: int = option(
        1,
        "With share_prefixes: the shortest run of tokens several sequences share as one tree node (shorter "
        "common runs are repeated). Refused without share_prefixes.",
    )

    def __post_init__(self) -> None:
        super().__post_init__()  # type: ignore[misc]
        if not isinstance(self.share_prefixes, bool):
            raise TypeError(f"share_prefixes must be true or false, got {self.share_prefixes!r}")
        if not self.share_prefixes and self.min_shared_tokens != 1:
            raise ValueError(
                f"min_shared_tokens={self.min_shared_tokens} only applies to the prefix tree of "
                "share_prefixes=True; set share_prefixes=True or leave min_shared_tokens unset"
            )


def check_tree_collator(args: PairTreeArguments, collator: Any) -> None:
    """A given ``data_collator`` whose prefix tree contradicts the config's ``share_prefixes`` /
    ``min_shared_tokens`` (the collator decides; the config may leave them at their defaults)."""
    name = type(collator).__name__
    if args.share_prefixes and not getattr(collator, "share_prefixes", False):
        raise ValueError(
            f"share_prefixes=True in the config, but the data_collator ({name}) builds no prefix tree; set "
            "share_prefixes=True on the collator or leave the data_collator unset"
        )
    if args.min_shared_tokens != 1 and args.min_shared_tokens != getattr(collator, "min_shared_tokens", None):
        raise ValueError(
            f"min_shared_tokens={args.min_shared_tokens} in the config contradicts the data_collator's "
            f"({name}: {getattr(collator, 'min_shared_tokens', None)}); set it in one place (on the collator)"
        )


def tree_token_ratio(batch: Mapping[str, Any]) -> float:
    """Tokens of a prefix-tree batch's sequences run alone over the tokens of its row (padding excluded): how many
    times fewer tokens the tree computes (``share_prefixes``; the metric ``tree_token_ratio``).

    >>> from packing_hf.preference import PaddingFreePreferenceCollator
    >>> tree_token_ratio(PaddingFreePreferenceCollator(share_prefixes=True, pad_to_multiple_of=8)(
    ...     [{"prompt_ids": [1, 2, 3], "chosen_ids": [4], "rejected_ids": [5, 6]}]))
    1.5
    """
    index = batch[TREE_INDEX_KEY]  # (S, L): every row token is some sequence's, padding points past the row
    row = int(index[index < batch["packed_input_ids"].shape[-1]].max()) + 1
    return int(batch["attention_mask"].sum()) / row


class MaxLengthCountsMixin:
    """TRL's ``_prepare_dataset(dataset, processing_class, args, dataset_name)`` (DPO, KTO, TPO, reward), with
    what a set ``max_length`` does to the dataset counted, never silent: the rows TRL's filter leaves out
    (reward: a pair with a longer sequence; DPO / KTO with ``keep_start``: a prompt that fills
    ``max_length``), and the sequences the collator will truncate (``prompt_ids`` + each of
    :meth:`_max_length_columns` longer than ``max_length``, once per sequence of the dataset, not per epoch).
    Kept in ``max_length_stats[dataset_name]`` with a warning
    (:meth:`~packing_hf.integrations.trainer.PackingTrainerMixin._record_max_length_cut`): the training and
    evaluation logs and ``packing-hf train``'s summary read them there. A streamed dataset is not counted.
    """

    def _max_length_columns(self, args: Any) -> tuple[str, ...]:
        """The answer columns whose ``prompt_ids + answer`` the collator cuts to ``max_length`` (none here)."""
        return ()

    def _prepare_dataset(self, dataset: Any, processing_class: Any, args: Any, dataset_name: str) -> Any:
        import datasets

        from .dataloaders import column_lengths

        prepared = super()._prepare_dataset(dataset, processing_class, args, dataset_name)  # type: ignore[misc]
        if args.max_length is None or not isinstance(dataset, datasets.Dataset):
            return prepared
        limit, unit = args.max_length, self.wording.unit  # type: ignore[attr-defined]
        stats, said = {}, []
        columns = self._max_length_columns(args)
        if columns:
            prompt, *answers = column_lengths(prepared, ("prompt_ids", *columns), "sequence", "")
            lengths = np.concatenate([prompt + answer for answer in answers])
            over = lengths > limit
            stats = {
                "truncated_samples": int(over.sum()),
                "truncated_tokens": int((lengths[over] - limit).sum()),
            }
            if over.any():
                mode = getattr(args, "truncation_mode", "keep_start")
                said.append(
                    f"truncates ({mode}) {stats['truncated_samples']} of {lengths.size} sequences "
                    f"({stats['truncated_tokens']} tokens cut, the longest has {int(lengths.max())} tokens)"
                )
        # TRL's filter is the only step that drops a row
        stats["dropped_samples"] = len(dataset) - len(prepared)
        if stats["dropped_samples"]:
            why = "a sequence longer than max_length" if not columns else "the prompt alone fills max_length"
            said.append(f"left out {stats['dropped_samples']} of {len(dataset)} {unit} ({why})")
        self._record_max_length_cut(  # type: ignore[attr-defined]
            dataset_name, stats, f"TRL's max_length={limit} " + " and ".join(said)
        )
        return prepared


def _shared_prompt_obstacle(models: list[Any]) -> str | None:
    """Why a shared-prompt row (a prefix and its branches) would not be exact on one of ``models``; ``None`` if it is."""
    name = register_attention()
    for model in models:
        if model is None or isinstance(model, str):
            continue
        config = getattr(base_model(model), "config", None)
        if config is None:
            return "a model without a config"
        if check_architecture(config, name).leaked:
            kind = getattr(config, "model_type", "?")
            return f"packing_hf's varlen attention does not keep {kind!r} exact, and only it reads the shared-prompt layout"
        why = prefix_tree_refusal(config)
        if why is not None:
            return why
    return None


def shared_prompt_is_exact(models: list[Any]) -> bool:
    """Whether a shared-prompt row keeps every given model exact: packing_hf's varlen attention keeps it exact
    (cached per architecture) and every token mixer is attention or follows the tree (``prefix_tree_refusal``:
    other mixers would start each branch from a zero state instead of its prompt's)."""
    return _shared_prompt_obstacle(models) is None


def refuse_shared_prompt_where_inexact(models: list[Any], option: str = "shared_prompt") -> None:
    """Refuse ``option=True`` (``shared_prompt``, or the prefix tree of ``share_prefixes``) where a row of
    prefixes and branches would not keep every model exact."""
    why = _shared_prompt_obstacle(models)
    if why is not None:
        raise PackingRefused(
            option, f"{option}=True: {why}; set {option}=False (packed pairs without sharing stay exact)"
        )


def check_preference_dataset(
    dataset: Any, name: str, needs: tuple[str, ...] = ("chosen", "rejected")
) -> None:
    """A dataset lacking the columns of a preference pair, named before TRL fails on it with a KeyError."""
    for key, part in dataset.items() if isinstance(dataset, dict) else [(None, dataset)]:
        row = first_row(part)
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


def check_preference_call(call: Mapping[str, Any], needs: tuple[str, ...] = ("chosen", "rejected")) -> None:
    """A preference trainer's arguments (``call``: the stock ``__init__``'s, by name): both datasets carry
    ``needs`` and the tokenizer fits the model's embeddings."""
    check_preference_dataset(call["train_dataset"], "train_dataset", needs)
    check_preference_dataset(call["eval_dataset"], "eval_dataset", needs)
    check_vocabulary(call["processing_class"], call["model"])


def check_vocabulary(processing_class: Any, model: Any) -> None:
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


def pad_token_id(processing_class: Any) -> int:
    """The id padding positions get in a packed trainer's padded layout (pad, else eos, else 0)."""
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    return 0  # only the embedding lookup of pad_to_multiple_of padding reads it: any valid id is exact


class PackedForwardsMixin:
    """The packed-forward plumbing of the preference trainers scored by TRL's fused LM head (DPO, KTO): put it
    first in the bases.

    :class:`~packing_hf.integrations.adapters.PackedPreferenceForward` adapters go on the policy and the
    reference model the first time each is called (they only act on packed batches); the reference model is
    prepared like the policy while training or evaluating (``_packing_attention`` names the attention both
    need, if any), then given back as it was.
    """

    def _packs(self) -> bool:
        return True  # every batch of these trainers is packed, reference precomputation included

    @property
    def _packed_forwards(self) -> dict[int, PackedPreferenceForward]:
        return {
            id(a.model): a for a in self.packing_session.adapters() if isinstance(a, PackedPreferenceForward)
        }

    def _install_packed_forward(self, model: Any) -> None:
        """The packed-forward adapter on ``model`` (once): it stays, and only acts on packed preference batches."""
        self.packing_session.adapter(self.accelerator.unwrap_model(model), PackedPreferenceForward)

    def _install_packed_forwards(self) -> None:
        self._install_packed_forward(self.model)
        if self.ref_model is not None:
            self._install_packed_forward(self.ref_model)

    def remove_packing_hooks(self) -> None:
        """Remove the packed-forward hooks from the policy and the reference model."""
        self.packing_session.remove_adapters()

    @contextlib.contextmanager
    def _packing_model(self, model: Any) -> Iterator[None]:
        """``model`` and the reference model prepared for the duration (nested calls prepare once)."""
        with self.packing_session.open():
            attention = self._packing_attention()
            if model is not None:
                self.packing_session.acquire(
                    model, attention=attention, use_cache=self.packing_session.user_use_cache
                )
            if getattr(self, "ref_model", None) is not None:
                self.packing_session.acquire(
                    self.accelerator.unwrap_model(self.ref_model), attention=attention, role="reference model"
                )
            yield

    def train(self, *args: Any, **kwargs: Any):
        self._install_packed_forwards()
        return super().train(*args, **kwargs)

    def evaluate(self, *args: Any, **kwargs: Any):
        self._install_packed_forwards()
        return super().evaluate(*args, **kwargs)

    def compute_ref_log_probs(self, model: Any, inputs: dict[str, Any]):
        self._install_packed_forward(model)
        return super().compute_ref_log_probs(model, inputs)

    @contextlib.contextmanager
    def _loss_call(self, model: Any, inputs: dict[str, Any]) -> Iterator[dict[str, Any]]:
        self._install_packed_forward(model)
        if self.ref_model is not None:
            self._install_packed_forward(self.ref_model)
        plan = self.parallel_plan
        if plan.sequence_parallel:  # the adapters cut the row over the SP group
            inputs = {**inputs, SEQUENCE_PARALLEL_KEY: plan.sp_group}
        with super()._loss_call(model, inputs) as inputs:
            yield inputs
