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

Prefix trees (``share_prefixes=True``, opt-in): the ``2B`` sequences of a micro-batch become one prefix tree
(:func:`~packing_hf.prefix_tree.build_prefix_tree`), so prefixes shared across pairs (a system prompt, the
earlier turns of a conversation cut into pairs at every turn) are computed once. A node's first token is
predicted at its parent's last row (the branch point): the adapter hands TRL's fused head, per row, the hidden
state that predicts it (``shift_labels``) and copies every row's per-token outputs to each padded position that
reads it (:class:`~packing_hf.preference_layout.TreeTargets`), so TRL's loss code runs unchanged on the same per-token
values. ``tree_token_ratio`` (tokens of the sequences run alone over the tree row's) joins TRL's metrics.

``padding_free=True`` (TRL's own switch, which TRL 1.x disables with a warning) is accepted: this trainer
always packs. Refused with a ``ValueError`` (they cannot be exact on a packed row): vision datasets,
prompt-learning PEFT (virtual tokens), ``compute_metrics`` (it needs padded logits), a padded ``data_collator``, the deprecated ``pad_token`` option, context
parallelism (``cp_size``), and ``packing_overflow`` ``"truncate"``/``"split"`` (a pair cannot be cut).

Sequence parallelism (``parallelism_config=ParallelismConfig(sp_size=N)`` with ``max_tokens_per_batch``): every
packed row of pairs is cut over ``N`` processes; each rank runs its shard through the policy and the reference
model (packing_hf's attention, switched on for the duration), the fused head scores its targets (the label shift
across shard edges done on the whole row), and the adapters sum the group's per-token outputs back into the whole
row (:func:`~packing_hf.attention.sequence_parallel.gather_shard_tokens`), so TRL computes the per-sequence
log-probs, the loss and its metrics from the row one process computes; the gradients are the one-process
ones (``docs/distributed.md``). Training and evaluation are sharded; precomputed reference log-probs run each
rank's own batches whole. ``shared_prompt`` is off under sequence parallelism (``True`` is refused).

>>> from packing_hf.integrations.dpo import DPOConfig
>>> config = DPOConfig("out", max_tokens_per_batch=2048, report_to="none", use_cpu=True)
>>> config.max_tokens_per_batch, config.loss_type
(2048, ['sigmoid'])
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import trl

from .._limits import option
from ..attention import register_attention
from ..errors import PackingRefused
from ..preference import TREE_INDEX_KEY, PaddingFreePreferenceCollator, preference_pair_lengths
from .args import PackingArguments, budget_max_length
from .loss_policy import StockLoss
from .parallel import requested_sp_size
from .preference_kit import (
    MaxLengthCountsMixin,
    PackedForwardsMixin,
    PairTreeArguments,
    PreferenceStatsCollator,
    check_preference_call,
    check_tree_collator,
    pad_token_id,
    refuse_shared_prompt_where_inexact,
    shared_prompt_is_exact,
    tree_token_ratio,
)
from .refusals import WHOLE_ROW_REFUSALS, Wording
from .trainer import PackingTrainerMixin

__all__ = ["DPOConfig", "DPOTrainer"]

logger = logging.getLogger(__name__)


@dataclass
class DPOConfig(PairTreeArguments, PackingArguments, trl.DPOConfig):
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

    ``share_prefixes=True`` (:class:`~packing_hf.integrations.preference_kit.PairTreeArguments`) is the
    general case: every micro-batch becomes one prefix tree, so a system prompt or the earlier turns of a
    conversation (pairs cut from it at every turn) are computed once for the policy and the reference model.
    ``shared_prompt`` is then left unset (setting it too is refused). Refused with sequence parallelism and on
    models whose token mixers cannot follow a tree (hybrids), by name.

    >>> DPOConfig(output_dir="out", report_to="none", use_cpu=True).packing_preflight
    'switch'
    """

    max_length: int | None = budget_max_length(
        "every sequence, prompt + completion, truncated per truncation_mode by the collator, counted in its "
        "stats and logged"
    )

    _optional_switches: ClassVar[tuple[str, ...]] = ("shared_prompt",)
    shared_prompt: bool | None = option(
        None,
        "Hold every pair's prompt once, chosen and rejected attending to it as branches (needs "
        "packing_hf's varlen attention, switched on during packed work). None (default): on when that "
        "attention is exact for the models; True: always (refused where it cannot be exact); False: off.",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.share_prefixes and self.shared_prompt is not None:
            raise ValueError(
                f"shared_prompt={self.shared_prompt} with share_prefixes=True: the prefix tree holds every pair's "
                "prompt once already (and every longer prefix sequences share, across pairs); leave shared_prompt "
                "unset"
            )


class DPOTrainer(MaxLengthCountsMixin, PackedForwardsMixin, PackingTrainerMixin, trl.DPOTrainer):
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
    >>> from transformers import AutoModelForCausalLM, AutoTokenizer
    >>> from packing_hf.architectures.tiny import tiny_config
    >>> tokenizer = AutoTokenizer.from_pretrained(SHARED_DATA / "smollm2_tokenizer")
    >>> model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=len(tokenizer)))
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

    config_class = DPOConfig
    algorithm = "DPO"
    stock = "trl.DPOTrainer"
    packing_collator = PaddingFreePreferenceCollator
    packing_refusals = ("collator", "compute_metrics", "pad_token", *WHOLE_ROW_REFUSALS)
    wording = Wording(
        "preference pairs", "preference batches", "a preference pair, whose two sequences", "preference pair"
    )
    packing_loss = StockLoss.PER_EXAMPLE
    # sp_size cuts packed rows over processes: the adapters shard each row and gather the per-token log-probs
    packing_sequence_parallel = True

    def _max_length_columns(self, args: Any) -> tuple[str, ...]:
        return ("chosen_ids", "rejected_ids")  # prompt + chosen, prompt + rejected

    def _before_stock_init(self, call: dict[str, Any]) -> None:
        args, model, data_collator = call["args"], call["model"], call["data_collator"]
        check_preference_call(call)
        self._own_collator = data_collator is None
        if not self._own_collator and args.shared_prompt not in (None, data_collator.shared_prompt):
            raise ValueError(
                f"shared_prompt={args.shared_prompt} in the config contradicts the data_collator's "
                f"shared_prompt={data_collator.shared_prompt}; set it in one place (leave the config's at None)"
            )
        if not self._own_collator:
            check_tree_collator(args, data_collator)
        # the collator is built before the plan exists (the stock __init__ makes the accelerator, then precomputes
        # reference log-probs with it): the size the plan will hold, from parallel.py
        sequence_parallel = requested_sp_size(args) > 1
        tree_asked = args.share_prefixes if self._own_collator else data_collator.share_prefixes
        if sequence_parallel and tree_asked:
            raise PackingRefused(
                "share_prefixes",
                "share_prefixes=True with sp_size > 1: sequence parallelism cuts the packed row into plain shards, "
                "and a prefix tree (nodes attending to their ancestors) is not cut exactly; set share_prefixes=False",
            )
        if tree_asked and not isinstance(model, str):  # before TRL's __init__ precomputes reference log-probs
            refuse_shared_prompt_where_inexact([model, call["ref_model"]], "share_prefixes")
        shared_asked = args.shared_prompt if self._own_collator else data_collator.shared_prompt
        if sequence_parallel and shared_asked:
            raise PackingRefused(
                "shared_prompt",
                "shared_prompt=True with sp_size > 1: sequence parallelism cuts the packed row into plain shards, "
                "and the shared-prompt layout (answers attending to a prompt segment) is not cut exactly; set "
                "shared_prompt=False (or leave it unset: it is then off under sequence parallelism)",
            )
        if self._own_collator:
            shared = False if args.share_prefixes else args.shared_prompt
            if shared is None and sequence_parallel:
                shared = False
            if shared is None and not isinstance(model, str):
                shared = shared_prompt_is_exact([model, call["ref_model"]])
            call["data_collator"] = PaddingFreePreferenceCollator(
                max_length=args.max_length,
                overflow="truncate" if args.max_length is not None else "error",
                truncation_mode=args.truncation_mode,
                pad_to_multiple_of=args.pad_to_multiple_of,
                pad_token_id=pad_token_id(call["processing_class"]),
                shared_prompt=bool(shared),
                share_prefixes=args.share_prefixes,
                min_shared_tokens=args.min_shared_tokens,
            )

    @contextlib.contextmanager
    def _during_stock_init(self, call: dict[str, Any]) -> Iterator[None]:
        args = call["args"]
        padding_free, args.padding_free = args.padding_free, False  # TRL would only warn and pad
        try:
            yield
        finally:
            args.padding_free = padding_free

    def _after_stock_init(self, call: dict[str, Any]) -> None:
        sequence_parallel = self.parallel_plan.sequence_parallel
        if (
            self._own_collator
            and call["args"].shared_prompt is None
            and not call["args"].share_prefixes
            and isinstance(call["model"], str)
            and not sequence_parallel
        ):
            # TRL loaded the model from its name: decide now (reference log-probs were precomputed unshared)
            self.data_collator.shared_prompt = shared_prompt_is_exact([self.model, self.ref_model])
        if self.data_collator.shared_prompt:
            refuse_shared_prompt_where_inexact([self.model, self.ref_model])
        if self.data_collator.share_prefixes:
            refuse_shared_prompt_where_inexact([self.model, self.ref_model], "share_prefixes")

    @contextlib.contextmanager
    def _loss_call(self, model: Any, inputs: dict[str, Any]) -> Iterator[dict[str, Any]]:
        with super()._loss_call(model, inputs) as inputs:
            if TREE_INDEX_KEY in inputs:
                # tokens of the 2B sequences run alone over the tree row's (its padding excluded): TRL logs
                # the mean of every micro-batch's ratio, next to its own metrics
                mode = "train" if self.model.training else "eval"
                self._metrics[mode]["tree_token_ratio"].append(tree_token_ratio(inputs))
            yield inputs

    def _precompute_ref_logps(self, dataset: Any, name: str, batch_size: int) -> Any:
        # runs inside TRL's __init__ (and evaluate): check and prepare the model that computes them
        model = self.ref_model if self.ref_model is not None else self.model
        self._install_packed_forward(model)
        with self._packing_model(self.accelerator.unwrap_model(model)):
            return super()._precompute_ref_logps(dataset, name, batch_size)

    def _packing_attention(self) -> str | None:
        """packing_hf's attention while the collator shares prompts (the only attention reading
        ``prefix_seq_idx``) or rows are cut over a sequence-parallel group (its all-to-alls live there); the
        models' own otherwise."""
        collator = self.data_collator
        shared = getattr(collator, "shared_prompt", False) or getattr(collator, "share_prefixes", False)
        return register_attention() if shared or self.parallel_plan.sequence_parallel else None

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
            # a pair's own tree holds its prompt once: an upper bound of what it adds to a tree row (prefixes
            # shared with other pairs of the micro-batch only make the row shorter than the budget)
            shared_prompt=collator.shared_prompt or collator.share_prefixes,
            truncation_mode=collator.truncation_mode,
        )

    def _wrap_train_collator(self, collator: Any) -> Any:
        if self.args.packing_metrics and isinstance(collator, PaddingFreePreferenceCollator):
            return PreferenceStatsCollator(collator)
        return collator
