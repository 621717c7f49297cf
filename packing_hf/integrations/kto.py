"""``packing_hf.KTOTrainer`` / ``packing_hf.KTOConfig``: TRL's KTO on packed rows, exactly.

``trl.KTOTrainer`` scores every example (``prompt + completion``) and, for the KL term, the same prompt with
a mismatched completion taken from a neighbouring example, each in a forward over a right-padded
``(B, L)`` batch: the policy and the reference model run both. This subclass gives each of the two
forwards a packed row instead (:class:`~packing_hf.unpaired.PaddingFreeUnpairedCollator`: ``B`` segments with
``cu_seq_lens`` and restarting positions) and leaves TRL's loss code untouched: the
:class:`~packing_hf.integrations.adapters.PackedPreferenceForward` hooks move TRL's labels onto the packed row and
scatter the per-token ``log_probs`` / ``entropy`` / ``mean_logits`` of TRL's fused LM head back into the
padded layout, so the per-sample completion log-probs, the KL log-probs, the KL estimate, every
``loss_type`` (``"kto"``, ``"apo_zero_unpaired"``), the weights and the metrics are those of stock TRL up
to floating-point reassociation inside the matmuls.

- ``max_tokens_per_batch``: micro-batches from :class:`~packing_hf.MultipackBatchSampler`, an example
  weighing ``len(prompt + completion) + len(prompt + KL completion)`` tokens. TRL draws every example's KL
  completion from its neighbours in the dataset order (batches of ``per_device_train_batch_size``) when
  it prepares the dataset, so each sequence's log-prob is stock's, but the KL estimate (a mean over the
  micro-batch) then averages over the examples multipack groups, not over stock's fixed batches. Leave
  ``max_tokens_per_batch`` unset for stock's batches exactly (each still packed into rows).
- ``precompute_ref_log_probs``: TRL computes the reference log-probs before training with its own padded
  forward (``compute_ref_log_probs``), unchanged here.

Refused with a ``ValueError``: vision datasets, prompt-learning PEFT (virtual tokens), ``compute_metrics``
(it needs padded logits), a collator that does not pack, ``pad_to_multiple_of``,
``use_liger_kernel`` and context/sequence parallelism. Packing metrics (``packing_metrics``) are not
logged for KTO batches.

>>> from packing_hf.integrations.kto import KTOConfig
>>> config = KTOConfig("out", max_tokens_per_batch=2048, report_to="none", use_cpu=True)
>>> config.max_tokens_per_batch, config.loss_type
(2048, 'kto')
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import trl

from ..unpaired import KL_PREFIX, ROW_KEYS, PaddingFreeUnpairedCollator
from .args import PackingArguments, budget_max_length
from .loss_policy import StockLoss
from .preference_kit import MaxLengthCountsMixin, PackedForwardsMixin, check_vocabulary, pad_token_id
from .refusals import WHOLE_ROW_REFUSALS, Wording
from .trainer import PackingTrainerMixin

__all__ = ["KTOConfig", "KTOTrainer"]


@dataclass
class KTOConfig(PackingArguments, trl.KTOConfig):
    """``trl.KTOConfig`` plus the packing fields of :class:`~packing_hf.integrations.args.PackingArguments`.

    ``max_length`` keeps TRL's meaning (the first ``max_length`` tokens of every sequence);
    ``max_tokens_per_batch`` is the multipack budget counted over an example's sequence and its KL twin.

    >>> KTOConfig(output_dir="out", report_to="none", use_cpu=True).packing_preflight
    'switch'
    """

    max_length: int | None = budget_max_length(
        "the first max_length tokens of every sequence, cut by the collator, counted in its stats and logged"
    )


class KTOTrainer(MaxLengthCountsMixin, PackedForwardsMixin, PackingTrainerMixin, trl.KTOTrainer):
    """``trl.KTOTrainer`` on packed rows: same per-sample and KL log-probs, losses, gradients and metrics.

    Same arguments as ``trl.KTOTrainer``; ``args`` is converted to :class:`KTOConfig` if it is a plain
    ``TrainingArguments`` / ``trl.KTOConfig``. Unless given, the collator is a
    :class:`~packing_hf.unpaired.PaddingFreeUnpairedCollator` with the config's ``max_length``. Load the
    models with an attention that keeps packed segments apart (sdpa/eager for llama-like models, or
    ``attn_implementation=packing_hf.register_attention()``); the pre-flight check (``packing_preflight``)
    verifies it for the policy and the reference model while they train or evaluate.

    >>> import datasets
    >>> from transformers import AutoModelForCausalLM, AutoTokenizer
    >>> from packing_hf.architectures.tiny import tiny_config
    >>> tokenizer = AutoTokenizer.from_pretrained(SHARED_DATA / "smollm2_tokenizer")
    >>> model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=len(tokenizer)))
    >>> data = datasets.Dataset.from_dict({"prompt": ["1+1=", "2+3="], "completion": ["2", "6"],
    ...     "label": [True, False]})
    >>> args = KTOConfig("/tmp/packing_hf_kto_doctest", per_device_train_batch_size=2, max_steps=1,
    ...     precompute_ref_log_probs=True, report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True)
    >>> trainer = KTOTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
    >>> type(trainer.data_collator).__name__
    'PaddingFreeUnpairedCollator'
    >>> trainer.train().global_step  # the Trainer prints its final metrics  # doctest: +ELLIPSIS
    {...'train_loss'...}
    1
    """

    config_class = KTOConfig
    algorithm = "KTO"
    stock = "trl.KTOTrainer"
    packing_collator = PaddingFreeUnpairedCollator
    packing_refusals = ("collator", "compute_metrics", "pad_to_multiple_of", "liger", *WHOLE_ROW_REFUSALS)
    wording = Wording("KTO examples", "KTO batches", "an example, whose sequences", "example")
    packing_loss = StockLoss.PER_EXAMPLE

    def _max_length_columns(self, args: Any) -> tuple[str, ...]:
        # prompt + completion of every example (its KL twin pairs the same completions with other prompts)
        return ("completion_ids",)

    def _before_stock_init(self, call: dict[str, Any]) -> None:
        check_vocabulary(call["processing_class"], call["model"])
        if call["data_collator"] is None:
            args = call["args"]
            call["data_collator"] = PaddingFreeUnpairedCollator(
                max_length=args.max_length,
                overflow="truncate" if args.max_length is not None else "error",
                pad_token_id=pad_token_id(call["processing_class"]),
            )
        self._kl_rows: dict[str, Any] | None = None  # TRL's __init__ may already run forwards

    @contextlib.contextmanager
    def _loss_call(self, model: Any, inputs: dict[str, Any]) -> Iterator[dict[str, Any]]:
        # TRL hands every batch key to the main forward: the KL row waits aside for _compute_kl_logps
        with super()._loss_call(model, inputs) as inputs:
            inputs = dict(inputs)
            self._kl_rows = {k: inputs.pop(KL_PREFIX + k) for k in ROW_KEYS if KL_PREFIX + k in inputs}
            try:
                yield inputs
            finally:
                self._kl_rows = None

    def _compute_kl_logps(self, model: Any, batch: dict[str, Any]):
        if self._kl_rows:  # the KL forward runs on the KL row (TRL swaps in the padded KL_ layout itself)
            batch = {**{k: v for k, v in batch.items() if k not in ROW_KEYS}, **self._kl_rows}
        return super()._compute_kl_logps(model, batch)

    def _multipack_lengths_of(self, dataset: Any) -> np.ndarray:
        """Tokens of every example in the packed rows: its sequence and its KL twin, after ``max_length``."""
        from .dataloaders import column_lengths

        columns = ["prompt_ids", "completion_ids"] + (["KL_completion_ids"] if self.calculate_KL else [])
        parts = column_lengths(dataset, columns, "example", "let KTOTrainer tokenize it")
        limit = self.data_collator.max_length
        lengths = [np.minimum(parts[0] + p, limit) if limit else parts[0] + p for p in parts[1:]]
        return np.sum(lengths, axis=0).astype(np.int64)

    def _wrap_train_collator(self, collator: Any) -> Any:
        return collator  # the packing statistics count pairs; KTO batches are not measured
