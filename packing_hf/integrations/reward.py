"""``packing_hf.RewardTrainer`` / ``packing_hf.RewardConfig``: TRL's reward-model training on packed pairs.

``trl.RewardTrainer`` pads the ``2B`` sequences of ``B`` pairs (chosen rows first) to the longest and reads
each row's score where ``AutoModelForSequenceClassification`` pools it: at the last token that is not
``config.pad_token_id``. This subclass packs the ``2B`` sequences as segments of one ``[1, T]`` row
(:class:`~packing_hf.preference.PaddingFreeRewardCollator`) and :class:`PackedRewardForward` reads the
score head's per-token output of the packed forward at the same token of every sequence, so the model's
``logits`` are the ``(2B, num_labels)`` scores stock computes, and TRL's loss (``margin``,
``center_rewards_coefficient``) and metrics run unchanged on them. ``max_tokens_per_batch`` packs pairs
with multipack (a pair weighs ``len(chosen) + len(rejected)``; TRL drops pairs over ``max_length`` when it
prepares the dataset, as stock does). Under DDP the ranks' multipack micro-batches may then hold different
numbers of pairs: the all-gather of every rank's scores behind TRL's reward metrics takes that
(:func:`~packing_hf.integrations.accelerator.gather_uneven_rows`, installed by every packing trainer).
Scores need no vocabulary head: the ``score`` head is ``(hidden, num_labels)``, so a reward model builds no
``(tokens, vocabulary)`` logits and the chunked LM head (:mod:`packing_hf.loss_head`) has nothing to do here.

Refused: a ``data_collator`` that does not pack pairs, a model without a ``score`` head (the per-token
scores must be read before pooling), and prompt-learning PEFT (virtual tokens per padded row).

>>> from packing_hf.integrations.reward import RewardConfig
>>> RewardConfig("out", max_tokens_per_batch=4096, report_to="none", use_cpu=True).max_tokens_per_batch
4096
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import trl

from ..preference import PaddingFreeRewardCollator, preference_pair_lengths
from .adapters import PackedRewardForward
from .args import PackingArguments, budget_max_length
from .loss_policy import StockLoss
from .preference_kit import MaxLengthCountsMixin, PreferenceStatsCollator, check_preference_call, pad_token_id
from .refusals import Wording
from .trainer import PackingTrainerMixin

__all__ = ["RewardConfig", "RewardTrainer"]


@dataclass
class RewardConfig(PackingArguments, trl.RewardConfig):
    """``trl.RewardConfig`` plus the packing fields of :class:`~packing_hf.integrations.args.PackingArguments`.

    ``max_tokens_per_batch`` counts both sequences of every pair. ``padding_free=True`` (if the installed
    TRL has it) means what this trainer always does: packed rows, exact.

    >>> RewardConfig(output_dir="out", report_to="none", use_cpu=True).packing_preflight
    'switch'
    """

    max_length: int | None = budget_max_length(
        "a pair whose chosen or rejected sequence is longer is left out of the dataset, counted in "
        "RewardTrainer.max_length_stats, logged and in the training logs as max_length_dropped_samples"
    )


class RewardTrainer(MaxLengthCountsMixin, PackingTrainerMixin, trl.RewardTrainer):
    """``trl.RewardTrainer`` on packed pair batches: the same scores, loss, gradients and metrics, no padding.

    Same arguments as ``trl.RewardTrainer``; ``args`` is converted to :class:`RewardConfig` if it is a plain
    ``TrainingArguments`` / ``trl.RewardConfig``. Unless given, the collator is a
    :class:`~packing_hf.preference.PaddingFreeRewardCollator`. Load the model with an attention that keeps
    packed segments apart (sdpa/eager for llama-like models, or ``packing_hf.register_attention()``); the
    pre-flight check verifies it while training.

    >>> import datasets
    >>> from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer
    >>> tokenizer = AutoTokenizer.from_pretrained(SHARED_DATA / "smollm2_tokenizer")
    >>> config = AutoConfig.for_model("llama", vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
    ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, num_labels=1)
    >>> model = AutoModelForSequenceClassification.from_config(config)
    >>> data = datasets.Dataset.from_dict({"chosen": ["1+1=2", "2+3=5"], "rejected": ["1+1=3", "2+3=6"]})
    >>> args = RewardConfig("/tmp/packing_hf_reward_doctest", max_tokens_per_batch=64, max_steps=1,
    ...     report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True)
    >>> trainer = RewardTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
    >>> trainer.train().global_step  # doctest: +ELLIPSIS
    {...}
    1
    """

    config_class = RewardConfig
    algorithm = "Reward"
    stock = "trl.RewardTrainer"
    packing_collator = PaddingFreeRewardCollator
    packing_refusals = ("collator", "prompt_learning")
    wording = Wording("reward pairs", "reward batches", "a reward pair, whose two sequences", "reward pair")
    packing_loss = StockLoss.PER_EXAMPLE

    def _before_stock_init(self, call: dict[str, Any]) -> None:
        check_preference_call(call)
        if call["data_collator"] is None:
            call["data_collator"] = PaddingFreeRewardCollator(
                pad_to_multiple_of=call["args"].pad_to_multiple_of,
                pad_token_id=pad_token_id(call["processing_class"]),
            )

    @contextlib.contextmanager
    def _during_stock_init(self, call: dict[str, Any]) -> Iterator[None]:
        args = call["args"]
        padding_free = getattr(args, "padding_free", None)
        if padding_free:
            args.padding_free = False  # what TRL would do with it is what packing does here
        try:
            yield
        finally:
            if padding_free:
                args.padding_free = padding_free

    def _install_packed_forward(self, model: Any) -> None:
        self.packing_session.adapter(self.accelerator.unwrap_model(model), PackedRewardForward)

    def remove_packing_hooks(self) -> None:
        """Remove the packed-forward hooks from the model."""
        self.packing_session.remove_adapters()

    @contextlib.contextmanager
    def _loss_call(self, model: Any, inputs: dict[str, Any]) -> Iterator[dict[str, Any]]:
        self._install_packed_forward(model)
        with super()._loss_call(model, inputs) as inputs:
            yield inputs

    def _multipack_lengths_of(self, dataset: Any) -> np.ndarray:
        """Tokens of every pair in a packed row: both sequences."""
        from .dataloaders import column_lengths

        chosen, rejected = column_lengths(
            dataset,
            ("chosen_ids", "rejected_ids"),
            "pair",
            "let RewardTrainer tokenize it (chosen / rejected columns)",
        )
        return preference_pair_lengths(np.zeros_like(chosen), chosen, rejected)

    def _wrap_train_collator(self, collator: Any) -> Any:
        if self.args.packing_metrics and isinstance(collator, PaddingFreeRewardCollator):
            return PreferenceStatsCollator(collator)
        return collator
