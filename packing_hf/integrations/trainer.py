"""``packing_hf.Trainer``: ``transformers.Trainer`` that trains on packed batches, exactly.

Change one import and set one field::

    from packing_hf import PaddingFreeCollator, Trainer, TrainingArguments

    args = TrainingArguments("out", max_tokens_per_batch=4096)
    Trainer(model=model, args=args, train_dataset=dataset, data_collator=PaddingFreeCollator()).train()

What the subclass adds to the stock Trainer (each item is something stock gets wrong or lacks):

- ``max_tokens_per_batch``: training batches come from :class:`~packing_hf.MultipackBatchSampler`, which
  is rank-aware, so accelerate's own sharding of the batch sampler is turned into a pass-through (as stock
  does for its ``BatchRebalanceSampler``): no double sharding, the same number of steps on every rank.
  ``len(train_dataloader)`` is the exact number of batches of an epoch, so ``max_steps``,
  ``num_train_epochs`` and the LR schedule agree; ``set_epoch`` reaches the sampler every epoch.
- Exact mid-epoch resume: the sampler's position (epoch, batches consumed) and what its plan depends on
  are saved in every checkpoint (``packing_hf_sampler.json``). On resume the sampler is put back in the
  saved epoch and the Trainer's own ``skip_first_batches`` skips the consumed batches, once (it only
  walks the sampler's index lists, no data is loaded). A checkpoint whose plan cannot be reproduced
  (another world size, budget, seed or dataset) is refused instead of replaying or skipping samples.
- ``remove_unused_columns`` keeps the columns the collator consumes (``completion_mask``,
  ``assistant_masks``, ``seq_lengths``): stock drops them because the model's ``forward`` does not take
  them, which silently trains on prompt tokens.
- A pre-flight check before training (``packing_preflight``): packed samples must not see each other with
  this model's architecture and attention implementation, else switch to packing_hf's varlen attention or
  refuse (:mod:`packing_hf.integrations.preflight`).
- Packing metrics in the logs (:mod:`packing_hf.integrations.callbacks`).
- Streaming datasets (a ``torch`` / ``datasets`` ``IterableDataset``, a
  :class:`~packing_hf.streaming.TokenizedStream` or :class:`~packing_hf.streaming.PackedStream`) with
  ``max_tokens_per_batch`` and ``max_steps``: batches come from a rank-aware ``PackedStream`` (bounded
  shuffle buffer + best fit), passes follow one another without a break, and every checkpoint holds each
  rank's stream position and buffer (``packing_hf_stream_rank{r}.json``), so a resumed run sees exactly
  the batches the uninterrupted run would have (see ``docs/streaming.md``).

The default loss (``loss_normalization="token"``, no weights) needs no change: the collator masks the first
label of every sample, so the count stock takes over ``labels[..., 1:]`` (``num_items_in_batch``, gathered
across ranks) is the same number of predicted tokens as for the padded batch, and the per-token loss is the
same. ``loss_normalization="sample"`` / ``"sample_sum"`` and a per-token ``loss_weights`` column are computed
by :mod:`packing_hf.integrations.loss`, with the same invariance (``docs/loss.md``).

>>> import packing_hf
>>> packing_hf.Trainer.__mro__[1].__name__, packing_hf.TrainingArguments.__name__
('PackingTrainerMixin', 'TrainingArguments')
"""

from __future__ import annotations

import logging
import math
from typing import Any

import transformers
from transformers.trainer_utils import get_last_checkpoint

from .._loss import LOSS_WEIGHTS_KEY
from ..collator import PaddingFreeCollator
from ..streaming import PackedStream
from .accelerator import gather_uneven_rows
from .args import PackingArguments, TrainingArguments
from .callbacks import STATS_KEY, PackingMetrics, StepClock
from .dataloaders import PackingDataMixin, is_packing_collator
from .evaluation import PackingEvalMixin
from .loss import PackingLossMixin
from .peft_models import apply_peft
from .prefix_trees import PrefixTreeMixin
from .refusals import PackingRefused
from .resume import SAMPLER_STATE_NAME, STREAM_STATE_NAME, PackingResumeMixin
from .sequence_parallel import PackingSequenceParallelMixin
from .skeleton import PackedTrainerSkeleton
from .stream_data import is_stream

__all__ = [
    "SAMPLER_STATE_NAME",
    "STREAM_STATE_NAME",
    "PackingTrainerMixin",
    "Trainer",
    "TrainingArguments",
    "is_packing_collator",
    "is_stream",
]

logger = logging.getLogger(__name__)


class PackingTrainerMixin(
    PrefixTreeMixin,  # before the skeleton and the eval mixin: the attention and evaluation collator it overrides
    PackingSequenceParallelMixin,
    PackingLossMixin,  # before the skeleton: past it, compute_loss is the stock trainer's (loss_policy.py)
    PackedTrainerSkeleton,
    PackingEvalMixin,
    PackingDataMixin,
    PackingResumeMixin,
):
    """What ``packing_hf.Trainer``, ``SFTTrainer`` and the preference trainers add to their Hugging Face base
    class: multipack data, evaluation, resume, the loss contract and metrics (see the module docstring).

    Put it first in the bases (``class Trainer(PackingTrainerMixin, transformers.Trainer)``). The ``__init__``
    template, the declarations and the packing session come from
    :class:`~packing_hf.integrations.skeleton.PackedTrainerSkeleton`; the data
    (:mod:`~packing_hf.integrations.dataloaders`), evaluation (:mod:`~packing_hf.integrations.evaluation`),
    resume (:mod:`~packing_hf.integrations.resume`) and loss (:mod:`~packing_hf.integrations.loss`) parts live
    in their own modules.
    """

    args: PackingArguments

    # ---- set-up ----------------------------------------------------------------------------------

    def _packing_setup(self) -> None:
        """Called at the end of ``__init__``: validate the packing options against the rest of the set-up."""
        args = self.args
        if not isinstance(args, PackingArguments):
            raise TypeError(
                f"{type(self).__name__} needs packing_hf's arguments, got {type(args).__module__}."
                f"{type(args).__name__}; use packing_hf.TrainingArguments (or packing_hf.SFTConfig for SFTTrainer)"
            )
        self._multipack_sampler = None
        self._packing_resume_dir: str | None = None
        # the PackedStream the training batches come from (None unless training on a stream), and how many
        # of its batches the training loop used, all passes together: what a checkpoint's position is
        self.packing_stream: PackedStream | None = None
        self._stream_batches_consumed = 0
        self._packing_metrics = PackingMetrics(args.max_tokens_per_batch)
        if args.packing_metrics:
            # step times and model FLOPs in the logs; the MFU over every device of the run
            self.add_callback(StepClock(self._packing_metrics, self.parallel_plan.devices))
        self._packing_last_logged_step = 0
        #: share_prefixes: the trained samples' tokens (each alone) and the tree rows' tokens, over the run's logs
        self.tree_tokens_trained = [0.0, 0.0]
        self.loss_policy.check_setup(self)
        self._check_share_prefixes()
        # ranks' packed batches hold different numbers of samples
        gather_uneven_rows(self.accelerator, self.parallel_plan)
        if args.max_tokens_per_batch is None:
            return
        if not is_packing_collator(self.data_collator):
            raise ValueError(
                f"max_tokens_per_batch={args.max_tokens_per_batch} packs several samples in one row, but the data "
                f"collator {type(self.data_collator).__name__} does not flatten batches; pass "
                "data_collator=packing_hf.PaddingFreeCollator() (or leave data_collator unset)"
            )
        if args.auto_find_batch_size:
            raise ValueError(
                "auto_find_batch_size=True changes per_device_train_batch_size, which max_tokens_per_batch "
                "does not use; on out-of-memory errors lower max_tokens_per_batch instead"
            )
        accelerator_config = args.accelerator_config
        if getattr(accelerator_config, "split_batches", False) or getattr(
            accelerator_config, "dispatch_batches", None
        ):
            raise ValueError(
                "max_tokens_per_batch gives every rank its own packed batches; accelerator_config with "
                "split_batches=True or dispatch_batches=True would re-split or re-send them. Unset both."
            )
        if self.parallel_plan.shards_sample_tokens:
            sizes = ", ".join(
                f"{name}={size}" for name, size in self.parallel_plan.shards_sample_tokens.items()
            )
            raise PackingRefused(
                "multipack_parallelism",
                f"max_tokens_per_batch does not support {sizes}: multipack shards batches over data-parallel "
                "ranks only (DDP, FSDP, DeepSpeed ZeRO). Unset max_tokens_per_batch.",
            )
        if is_stream(self.train_dataset):
            self._check_stream_settings(self.train_dataset)
        if args.train_sampling_strategy not in ("random", None) and not is_stream(self.train_dataset):
            logger.warning(
                "train_sampling_strategy=%r is not used: with max_tokens_per_batch the batches come from "
                "MultipackBatchSampler",
                args.train_sampling_strategy,
            )

    # ---- columns ---------------------------------------------------------------------------------

    def _set_signature_columns_if_needed(self) -> None:
        # Stock keeps only the columns named in model.forward's signature, so completion_mask /
        # assistant_masks / seq_lengths would be stripped before the collator could use them.
        already_set = self._signature_columns is not None
        super()._set_signature_columns_if_needed()
        if already_set:
            return
        consumed = getattr(self.data_collator, "input_columns", ())
        # loss_weights is read by the loss whatever the collator: never stripped without a word
        self._signature_columns = list(dict.fromkeys([*self._signature_columns, *consumed, LOSS_WEIGHTS_KEY]))

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs: Any,
    ):
        """Stock ``train``, after the packing pre-flight check; also remembers the checkpoint to resume."""
        if resume_from_checkpoint is True:
            # resolved here as stock does, so the sampler state is read from the same folder
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir})")
        self._packing_resume_dir = resume_from_checkpoint or None
        self._packing_metrics.reset()
        self._packing_last_logged_step = 0
        with self._packing_model(self.model if self.model_init is None else None):
            return super().train(
                resume_from_checkpoint=resume_from_checkpoint,
                trial=trial,
                ignore_keys_for_eval=ignore_keys_for_eval,
                **kwargs,
            )

    def call_model_init(self, trial: Any = None):
        model = super().call_model_init(trial)
        if self.packing_session.active and model is not None and self._packs():
            self.packing_session.release()  # a new model per trial: the previous one goes back as it was
            self.packing_session.acquire(model, use_cache=self.packing_session.user_use_cache)
        return model

    def _packs(self) -> bool:
        return self.args.max_tokens_per_batch is not None or is_packing_collator(self.data_collator)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Stock ``_save``, with the config as the user had it (``use_cache``), not as training set it."""
        with self.packing_session.as_given(self.model):
            return super()._save(output_dir, state_dict)

    # ---- steps and logs --------------------------------------------------------------------------

    def training_step(self, model: Any, inputs: dict[str, Any], *args: Any, **kwargs: Any):
        counts = inputs.pop(STATS_KEY, None)  # never passed to the model
        if counts is not None:
            self._packing_metrics.update(counts)
        return super().training_step(model, inputs, *args, **kwargs)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        # Training logs (they carry "loss") are emitted on every rank, so the collectives below are matched.
        if self.args.packing_metrics and "loss" in logs:
            totals = self._packing_metrics.as_tensor(self.args.device)
            tables = self._packing_metrics.rank_table(self.args.device)[None]  # (1, micro_batches, 2)
            if self.parallel_plan.world_size > 1:
                totals = self.accelerator.reduce(totals, reduction="sum")
                # the ranks of a sequence-parallel group all count the one micro-batch they cut: once per row
                totals = totals / self.parallel_plan.sp_size
                # ranks may have seen different micro-batch counts (a stream's last step): pad with nan rows
                tables = self.accelerator.pad_across_processes(tables, dim=1, pad_index=math.nan)
                tables = self.accelerator.gather(tables)  # (num_ranks, micro_batches, 2)
            steps = self.state.global_step - self._packing_last_logged_step
            self._packing_last_logged_step = self.state.global_step
            # the run's prefix-tree tokens (samples each alone, rows computed), for its summary
            self.tree_tokens_trained = [
                a + float(b) for a, b in zip(self.tree_tokens_trained, totals[-2:], strict=True)
            ]
            logs.update(self._packing_metrics.compute(num_steps=steps, totals=totals, tables=tables))
        logs.update(self._max_length_logs(logs))
        super().log(logs, *args, **kwargs)

    # ---- what max_length cut ---------------------------------------------------------------------

    def _record_max_length_cut(self, dataset_name: str, stats: dict[str, int], said: str) -> None:
        """Keep what ``max_length`` cut from one dataset (``stats``: ``truncated_samples`` / ``_tokens``,
        ``dropped_samples``) in ``self.max_length_stats[dataset_name]``, where the training and evaluation logs
        (:meth:`log`) and ``packing-hf train``'s summary read it, and warn with the fix when it cut anything
        (``said``: what it did)."""
        self.max_length_stats = {**getattr(self, "max_length_stats", {}), dataset_name: stats}
        if any(stats.values()):
            logger.warning(
                "%s dataset: %s; to train them whole raise max_length or set it to None (with "
                "max_tokens_per_batch, one longer than the budget then follows packing_overflow)",
                dataset_name,
                said,
            )

    def _max_length_logs(self, logs: dict[str, float]) -> dict[str, int]:
        """What ``max_length`` cut (``self.max_length_stats``), for ``logs``: the training set's in every
        training log (``max_length_<count>``), an evaluation set's in its evaluation metrics
        (``eval_max_length_<count>``, ``eval_<name>_max_length_<count>`` for a dict of evaluation sets); the same
        totals each time. Nothing for a dataset it cut nothing from."""
        added: dict[str, int] = {}
        named = isinstance(self.eval_dataset, dict)
        for name, cut in getattr(self, "max_length_stats", {}).items():
            if not any(cut.values()):
                continue
            if name == "train":
                if "loss" in logs:
                    added.update({f"max_length_{key}": value for key, value in cut.items()})
                continue
            prefix = f"eval_{name}" if named else "eval"
            if f"{prefix}_runtime" in logs:  # stock's evaluate() metrics of that dataset
                added.update({f"{prefix}_max_length_{key}": value for key, value in cut.items()})
        return added


class Trainer(PackingTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` with multipack batches, exact resume, a packing pre-flight check and metrics.

    Takes the same arguments as ``transformers.Trainer``, plus ``peft_config`` (a ``peft.PeftConfig``: the
    model is wrapped with ``peft.get_peft_model``, as TRL's trainers do; prompt-learning methods are refused
    with packed batches, see :mod:`packing_hf.integrations.adapters`); ``args`` must be a
    :class:`packing_hf.TrainingArguments` (default: one with ``output_dir="tmp_trainer"``). When
    ``max_tokens_per_batch`` is set and no ``data_collator`` is given, a
    :class:`~packing_hf.PaddingFreeCollator` using the tokenizer's pad token is used.

    >>> import torch
    >>> from transformers import AutoConfig, AutoModelForCausalLM
    >>> from packing_hf import PaddingFreeCollator
    >>> config = AutoConfig.for_model("llama", vocab_size=32, hidden_size=16, intermediate_size=32,
    ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    >>> model = AutoModelForCausalLM.from_config(config)
    >>> data = [{"input_ids": list(range(1, n))} for n in (5, 9, 3, 7, 6, 4)]
    >>> args = TrainingArguments("/tmp/packing_hf_doctest", max_tokens_per_batch=16, max_steps=2,
    ...     report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True)
    >>> trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=PaddingFreeCollator())
    >>> result = trainer.train()  # the Trainer prints its final metrics  # doctest: +ELLIPSIS
    {...'train_loss'...}
    >>> result.global_step
    2
    """

    # sp_size cuts packed rows over processes (integrations/sequence_parallel.py)
    packing_sequence_parallel = True

    def __init__(self, model: Any = None, *args: Any, peft_config: Any = None, **kwargs: Any) -> None:
        # transformers.Trainer takes no peft_config: the model is wrapped here, as TRL's trainers do
        super().__init__(apply_peft(model, peft_config), *args, **kwargs)

    def _packing_config(self, args: Any, model: Any) -> Any:
        return TrainingArguments(output_dir="tmp_trainer") if args is None else args

    def _before_stock_init(self, call: dict[str, Any]) -> None:
        if getattr(call["args"], "share_prefixes", False):
            call["data_collator"] = self._prefix_tree_collator(call["args"], call.get("data_collator"))
        elif (
            call.get("data_collator") is None
            and getattr(call["args"], "max_tokens_per_batch", None) is not None
        ):
            call["data_collator"] = PaddingFreeCollator.for_tokenizer(call.get("processing_class"))
