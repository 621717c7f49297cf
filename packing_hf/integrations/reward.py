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
(:func:`~packing_hf.integrations.dataloaders.gather_uneven_rows`, installed by every packing trainer).
Scores need no vocabulary head: the ``score`` head is ``(hidden, num_labels)``, so a reward model builds no
``(tokens, vocabulary)`` logits and the chunked LM head (:mod:`packing_hf.loss_head`) has nothing to do here.

Refused: a ``data_collator`` that does not pack pairs, a model without a ``score`` head (the per-token
scores must be read before pooling), and prompt-learning PEFT (virtual tokens per padded row).

>>> from packing_hf.integrations.reward import RewardConfig
>>> RewardConfig("out", max_tokens_per_batch=4096, report_to="none", use_cpu=True).max_tokens_per_batch
4096
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import trl

from ..preference import PaddingFreeRewardCollator, preference_pair_lengths
from .args import PackingArguments, as_config
from .dpo import (
    PreferenceStatsCollator,
    _check_dataset,
    _check_vocabulary,
    _is_prompt_learning,
    _pad_token_id,
)
from .preflight import base_model
from .trainer import PackingTrainerMixin

__all__ = ["PackedRewardForward", "RewardConfig", "RewardTrainer"]


@dataclass
class RewardConfig(PackingArguments, trl.RewardConfig):
    """``trl.RewardConfig`` plus the packing fields of :class:`~packing_hf.integrations.args.PackingArguments`.

    ``max_tokens_per_batch`` counts both sequences of every pair. ``padding_free=True`` (if the installed
    TRL has it) means what this trainer always does: packed rows, exact.

    >>> RewardConfig(output_dir="out", report_to="none", use_cpu=True).packing_preflight
    'switch'
    """


class PackedRewardForward:
    """Hooks letting a sequence-classification ``model`` take a packed pair batch and return per-sequence scores.

    Acts only on calls holding ``packed_index`` (batches of
    :class:`~packing_hf.preference.PaddingFreeRewardCollator`). Before the forward the padded ``input_ids``
    ``(S, L)`` give the token every sequence is scored at (stock's rule: the last token that is neither
    padding nor ``config.pad_token_id``) and are swapped for the packed row; a hook on the ``score`` head
    keeps its per-token output ``(1, T, num_labels)``; after the forward ``logits`` become that output at
    those tokens, ``(S, num_labels)``.

    Args:
        model: the ``nn.Module`` the trainer calls (a ``PreTrainedModel`` or PEFT model with a ``score`` head).

    >>> import torch
    >>> class Scorer(torch.nn.Module):  # stands for a sequence-classification model
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.config = type("C", (), {"pad_token_id": 0})()
    ...         self.score = torch.nn.Identity()
    ...     def forward(self, input_ids, **kwargs):
    ...         return {"logits": self.score(input_ids[..., None].float())[:, -1]}
    >>> from packing_hf.preference import PaddingFreeRewardCollator
    >>> model = Scorer()
    >>> hooks = PackedRewardForward(model)
    >>> batch = PaddingFreeRewardCollator()([{"chosen_ids": [5, 6], "rejected_ids": [7, 8, 9]}])
    >>> model(**batch)["logits"].tolist()  # each sequence's last token
    [[6.0], [9.0]]
    >>> hooks.remove()
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        head = getattr(base_model(model), "score", None)
        if not isinstance(head, torch.nn.Module):
            raise ValueError(
                f"{type(base_model(model)).__name__} has no `score` head: packed reward scores are read from the "
                "score head's per-token output before pooling. Use an AutoModelForSequenceClassification whose "
                "head is `score` (llama, qwen2, mistral, ...) or trl.RewardTrainer"
            )
        self._ends: torch.Tensor | None = None
        self._scores: torch.Tensor | None = None
        self._handles = [
            model.register_forward_pre_hook(self._before, with_kwargs=True, prepend=True),
            head.register_forward_hook(self._capture),
            model.register_forward_hook(self._after, with_kwargs=True),
        ]

    def remove(self) -> None:
        """Remove the hooks (the model is as before)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _before(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        self._ends, self._scores = None, None
        if "packed_index" not in kwargs:
            return None
        kwargs = dict(kwargs)
        kwargs.pop("packed_index")
        kwargs.pop("completion_mask", None)
        packed_ids = kwargs.pop("packed_input_ids", None)
        padded_ids = kwargs.pop("input_ids", None)
        mask = kwargs.pop("attention_mask", None)
        if args or packed_ids is None or padded_ids is None or kwargs.get("cu_seq_lens_q") is None:
            raise ValueError(
                "a packed reward batch must be passed as keyword arguments with packed_input_ids, input_ids and "
                "cu_seq_lens_q (build it with PaddingFreeRewardCollator)"
            )
        pad = getattr(base_model(module).config, "pad_token_id", None)
        if pad is None:
            raise ValueError(
                "config.pad_token_id is None: stock cannot score a padded batch without it (it pools at the last "
                "non-padding token); set model.config.pad_token_id = tokenizer.pad_token_id"
            )
        rows, width = padded_ids.shape
        real = padded_ids != pad
        if mask is not None:
            real &= mask.bool()
        # stock's pooling: the rightmost token that is not the pad id (0 if there is none)
        last = (torch.arange(width, device=real.device) * real).argmax(-1)  # (S,)
        starts = kwargs["cu_seq_lens_q"][:rows].to(last.device).long()  # sequences are segments, in order
        self._ends = starts + last
        kwargs["input_ids"] = packed_ids
        return args, kwargs

    def _capture(self, module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> None:
        if self._ends is not None:
            self._scores = output

    def _after(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        ends, scores = self._ends, self._scores
        self._ends, self._scores = None, None
        if ends is None:
            return None
        if scores is None or scores.dim() != 3 or scores.shape[0] != 1:
            raise ValueError(
                "the score head did not run on the packed row (expected its (1, T, num_labels) output)"
            )
        output["logits"] = scores[0].index_select(0, ends.to(scores.device))  # (S, num_labels)
        return output


class RewardTrainer(PackingTrainerMixin, trl.RewardTrainer):
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

    def __init__(
        self,
        model: Any,
        args: Any = None,
        data_collator: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        **kwargs: Any,
    ) -> None:
        args = as_config(args, model, RewardConfig, "Reward")
        if data_collator is not None and not isinstance(data_collator, PaddingFreeRewardCollator):
            raise ValueError(
                f"data_collator={type(data_collator).__name__} does not pack reward pairs; leave it unset (a "
                "PaddingFreeRewardCollator is built) or pass a PaddingFreeRewardCollator"
            )
        if _is_prompt_learning(model, kwargs.get("peft_config")):
            raise ValueError(
                "prompt-learning PEFT (prefix / prompt tuning) prepends virtual tokens to every sequence, which a "
                "packed row cannot hold per segment; use LoRA-style adapters or trl.RewardTrainer"
            )
        _check_dataset(train_dataset, "train_dataset")
        _check_dataset(eval_dataset, "eval_dataset")
        _check_vocabulary(processing_class, model)
        if data_collator is None:
            data_collator = PaddingFreeRewardCollator(
                pad_to_multiple_of=args.pad_to_multiple_of, pad_token_id=_pad_token_id(processing_class)
            )
        padding_free = getattr(args, "padding_free", None)
        if padding_free:
            args.padding_free = False  # what TRL would do with it is what packing does here
        try:
            super().__init__(
                model,
                args=args,
                data_collator=data_collator,
                train_dataset=train_dataset,
                eval_dataset=eval_dataset,
                processing_class=processing_class,
                **kwargs,
            )
        finally:
            if padding_free:
                args.padding_free = padding_free
        self._reward_forwards: dict[int, PackedRewardForward] = {}
        self._packing_setup()

    def _install_packed_forward(self, model: Any) -> None:
        unwrapped = self.accelerator.unwrap_model(model)
        if id(unwrapped) not in self._reward_forwards:
            self._reward_forwards[id(unwrapped)] = PackedRewardForward(unwrapped)

    def remove_packing_hooks(self) -> None:
        """Remove the packed-forward hooks from the model."""
        for hooks in self._reward_forwards.values():
            hooks.remove()
        self._reward_forwards.clear()

    def compute_loss(
        self, model: Any, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch=None
    ):
        self._install_packed_forward(model)
        return super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )

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
