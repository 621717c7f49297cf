"""The loss of a packed trainer, owned by one object: :class:`LossPolicy`, built beside the run's
:class:`~packing_hf.integrations.parallel.ParallelPlan` when the trainer makes its accelerator.

A trainer class declares what its stock trainer's loss is (``packing_loss``, a :class:`StockLoss`): the model's
causal-LM token mean (``transformers.Trainer``), TRL's SFT loss (the same mean, plus TRL's logged metrics), or a
loss of the trainer's own, one term per example (DPO's pairs, KTO's examples, rollouts). The declaration is
checked once, when the class is made (:func:`check_declaration`), never searched per call.

The policy is the one writer of a step's loss state and the one place that decides a call's route:

- :meth:`LossPolicy.begin_step` (when the Trainer counts a step's micro-batches, before the first backward): the
  step's :class:`LossRoute`, its denominator (``num_items_in_batch``) and whether the loss is already scaled for
  gradient accumulation (what the trainer's ``loss_is_scaled_for_ga`` reads);
- :meth:`LossPolicy.route` (every ``compute_loss`` call): the call's route, from the step's and from the call
  (training, evaluation, the loss alone), and the chunked LM head serving it, if any.

The arithmetic of each route lives with the trainer (:mod:`packing_hf.integrations.loss`,
:mod:`packing_hf.integrations.sequence_parallel`, ``SFTTrainer``); ``docs/loss.md`` says what it computes.

>>> policy = LossPolicy(StockLoss.CAUSAL_LM, ParallelPlan())
>>> policy.step_route, policy.scaled_for_ga
(<LossRoute.STOCK: 'stock'>, None)
"""

from __future__ import annotations

import contextlib
import enum
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .._loss import LOSS_WEIGHTS_KEY, is_tree_batch, loss_counts, step_denominator, tree_loss_counts
from ..registry import router_loss_coefficient
from .chunked_head import resolve_head
from .parallel import ParallelPlan, training_mode

__all__ = [
    "LossPolicy",
    "LossRoute",
    "StockLoss",
    "causal_labels",
    "check_declaration",
    "stock_compute_loss_owner",
    "stock_scaled_for_ga",
]

logger = logging.getLogger(__name__)


class StockLoss(enum.Enum):
    """What a trainer class's stock ``compute_loss`` computes (the class attribute ``packing_loss``).

    >>> StockLoss.PER_EXAMPLE.value
    'per_example'
    """

    #: ``transformers.Trainer``'s: the model's own causal-LM loss, a token mean (packing_hf may compute it:
    #: normalised otherwise, weighted, from the chunked head, cut over a sequence-parallel group)
    CAUSAL_LM = "causal_lm"
    #: ``trl.SFTTrainer``'s: the same token mean, plus TRL's logged metrics
    SFT = "sft"
    #: the stock trainer's own loss, one term per example (a pair, a KTO example, a rollout): computed by the
    #: stock trainer alone, ``loss_normalization`` stays ``"token"``
    PER_EXAMPLE = "per_example"


class LossRoute(enum.Enum):
    """Which code computes a micro-batch's loss (one value per call; the chunked head may serve any but ``STOCK``).

    >>> LossRoute.SEQUENCE_PARALLEL.value
    'sequence_parallel'
    """

    #: the stock trainer's ``compute_loss`` (transformers', TRL's), on the model's full logits
    STOCK = "stock"
    #: the model's own causal-LM loss, scaled as ``transformers.Trainer.compute_loss`` scales it
    MODEL = "model"
    #: SFT's plain loss: the model's own causal-LM loss, with TRL's metrics from the labelled positions only
    SFT_PLAIN = "sft_plain"
    #: packing_hf's numerator over the step's denominator (``loss_normalization``, ``loss_weights``; docs/loss.md)
    PACKED = "packed"
    #: this process's shard of a row cut over the sequence-parallel group, its share of the row's loss
    SEQUENCE_PARALLEL = "sequence_parallel"
    #: a prefix-tree row (``share_prefixes=True``): its (row, target, weight) pairs' numerator over the step's
    #: denominator, the loss of the same samples run alone (``loss_normalization``, ``loss_weights``)
    PREFIX_TREE = "prefix_tree"


def causal_labels(batch: dict[str, Any]) -> torch.Tensor | None:
    """``labels`` ``(B, T)``, rebuilt from ``shift_labels`` (``shift_labels[t] = labels[t + 1]``) if only those
    are given.

    >>> causal_labels({"shift_labels": torch.tensor([[5, 6, -100]])})
    tensor([[-100,    5,    6]])
    """
    labels = batch.get("labels")
    shift = batch.get("shift_labels")
    if shift is None or not isinstance(shift, torch.Tensor):
        return labels
    first = torch.full_like(shift[:, :1], -100)
    return torch.cat([first, shift[:, :-1]], dim=1)


def _step_count(count: Any) -> Any:
    """Stock's target count of a training step (``num_items_in_batch``), 1 where the step has no target.

    Every loss of such a step is a sum over no target, 0: over 1 it stays 0 with zero gradients and is logged as
    0 (as :func:`packing_hf._loss.step_denominator` makes packing_hf's own denominators), where over 0 it would be
    0/0 = NaN, whose backward turns the chunked head's zero gradients into NaN (``0 * inf``) and which the Trainer
    logs as the previous losses' mean (``logging_nan_inf_filter``).

    >>> _step_count(torch.tensor(0)), _step_count(torch.tensor(7)), _step_count(None)
    (tensor(1), tensor(7), None)
    """
    if isinstance(count, torch.Tensor):
        return torch.where(count > 0, count, torch.ones_like(count))  # on the device: no host sync
    if isinstance(count, int | float) and count <= 0:
        return 1
    return count


# ---- the declaration ------------------------------------------------------------------------------------------


def stock_compute_loss_owner(trainer_class: type, after: type) -> type | None:
    """The class whose ``compute_loss`` the packed trainer ``trainer_class`` falls back on: the first class past
    ``after`` (the packing skeleton) in its method order that defines one (``None``: no stock trainer yet, a mixin).

    >>> import transformers
    >>> from packing_hf.integrations import Trainer
    >>> from packing_hf.integrations.skeleton import PackedTrainerSkeleton
    >>> stock_compute_loss_owner(Trainer, PackedTrainerSkeleton) is transformers.Trainer
    True
    """
    mro = trainer_class.__mro__
    for klass in mro[mro.index(after) + 1 :]:
        if "compute_loss" in klass.__dict__:
            return klass
    return None


def check_declaration(trainer_class: type, after: type) -> None:
    """Raise ``TypeError`` when ``trainer_class.packing_loss`` is not what its stock ``compute_loss`` computes.

    Run once per class, when it is made: a class declaring the causal-LM loss on a trainer with a loss of its
    own would have that loss replaced by the model's; one declaring a loss of its own on ``transformers.Trainer``
    would refuse ``loss_normalization`` and ``loss_weights`` for nothing.
    """
    owner = stock_compute_loss_owner(trainer_class, after)
    if owner is None or owner is object:
        return  # a mixin: its stock trainer comes with the class that uses it
    import transformers

    trl = sys.modules.get("trl")  # imported already wherever a class can derive from one of its trainers
    declared = trainer_class.packing_loss
    if owner is transformers.Trainer:
        found = StockLoss.CAUSAL_LM
    elif trl is not None and issubclass(owner, trl.SFTTrainer):
        found = StockLoss.SFT
    else:
        found = StockLoss.PER_EXAMPLE
    if declared is not found:
        raise TypeError(
            f"{trainer_class.__name__} declares packing_loss={declared}, but the compute_loss it falls back on is "
            f"{owner.__module__}.{owner.__qualname__}'s, which computes {found}: declare "
            f"packing_loss = StockLoss.{found.name}"
        )


_UNSET = object()


def stock_scaled_for_ga(trainer_class: type) -> bool | None:
    """The ``loss_is_scaled_for_ga`` the stock trainer (or a subclass, for its own ``compute_loss``) declares: the
    first value up ``trainer_class``'s method order that is not packing_hf's view of the policy (a property).

    >>> import trl
    >>> stock_scaled_for_ga(trl.KTOTrainer), stock_scaled_for_ga(object)
    (False, None)
    """
    for klass in trainer_class.__mro__:
        for name in ("stock_loss_scaled_for_ga", "loss_is_scaled_for_ga"):
            value = klass.__dict__.get(name, _UNSET)
            if value is not _UNSET and not isinstance(value, property):
                return value
    return None


# ---- the policy -----------------------------------------------------------------------------------------------


class LossPolicy:
    """The loss of one trainer's run: its declaration, the current step's route, denominator and scaling, and the
    route of every call (see the module docstring).

    Args:
        declared: what the trainer's stock loss is (its class's ``packing_loss``).
        plan: the run's parallel layout.
        stock_scaled_for_ga: the stock trainer's ``loss_is_scaled_for_ga`` (what a step on the stock route keeps).
    """

    def __init__(
        self, declared: StockLoss, plan: ParallelPlan, stock_scaled_for_ga: bool | None = None
    ) -> None:
        self.declared = declared
        self.plan = plan
        self.stock_scaled_for_ga = stock_scaled_for_ga
        #: the current training step's route (``STOCK`` until a step is counted)
        self.step_route = LossRoute.STOCK
        #: whether the step's loss is already scaled for gradient accumulation (``loss_is_scaled_for_ga``)
        self.scaled_for_ga = stock_scaled_for_ga
        self._counting = False  # inside the Trainer's count of a training step's micro-batches
        self._prediction_loss_only = False  # inside an evaluation step that wants the loss alone
        self._packed_evaluation = False  # inside a packed evaluation loop (batch means weighed by their counts)
        self._chunked_refusals: set[str] = set()  # why the chunked head did not serve, each logged once

    @classmethod
    def of(cls, trainer: Any, plan: ParallelPlan) -> LossPolicy:
        """The policy of ``trainer``, from its class's declarations (``packing_loss``, ``loss_is_scaled_for_ga``)."""
        return cls(type(trainer).packing_loss, plan, stock_scaled_for_ga(type(trainer)))

    @property
    def chunked_head_refusals(self) -> tuple[str, ...]:
        """Why the chunked LM head did not serve a call so far (each reason once, sorted)."""
        return tuple(sorted(self._chunked_refusals))

    @property
    def cuts_rows(self) -> bool:
        """Whether packing_hf computes a cut row's loss (sequence parallelism on a causal-LM loss; a per-example
        loss is cut by the trainer's own adapters, if at all)."""
        return self.plan.sequence_parallel and self.declared is not StockLoss.PER_EXAMPLE

    # ---- set-up ---------------------------------------------------------------------------------------------

    def check_setup(self, trainer: Any) -> None:
        """Refuse what the loss contract cannot honour, each with its fix (the end of the trainer's set-up)."""
        if trainer.args.loss_normalization != "token":
            self.check_own_loss(trainer, f"loss_normalization={trainer.args.loss_normalization!r}")
        if getattr(trainer.args, "share_prefixes", False) and self.declared is not StockLoss.PER_EXAMPLE:
            # a tree row's targets are pairs: packing_hf computes their loss, whatever the normalisation (the
            # pair and RL trainers lay their own trees out under their stock per-example loss)
            self.check_own_loss(trainer, "share_prefixes=True")
        if self.cuts_rows:
            from ..attention.sequence_parallel import check_sequence_parallel_router_loss

            # a cut row's loss is computed from its shards' logits (integrations/sequence_parallel.py)
            model = getattr(trainer, "model", None)
            check_sequence_parallel_router_loss(getattr(model, "config", None), self.plan.sp_size, model)

    def check_own_loss(self, trainer: Any, what: str) -> None:
        """Raise ``ValueError`` naming every part of the set-up that packing_hf's own loss (``what``) cannot keep."""
        args = trainer.args
        conflicts = []
        if self.declared is StockLoss.PER_EXAMPLE:
            conflicts.append(
                f"{trainer.stock}, whose loss is one term per {trainer.wording.loss_term}: leave "
                "loss_normalization='token'"
            )
        if trainer.compute_loss_func is not None:
            conflicts.append("a compute_loss_func (it would replace the normalised loss): drop it")
        if args.label_smoothing_factor:
            conflicts.append(f"label_smoothing_factor={args.label_smoothing_factor}: set it to 0")
        if getattr(args, "loss_type", "nll") != "nll":
            conflicts.append(f"TRL's loss_type={args.loss_type!r}: use loss_type='nll'")
        model = getattr(trainer, "model", None)
        coefficient = router_loss_coefficient(getattr(model, "config", None), model)
        if coefficient or getattr(trainer, "aux_loss_enabled", False):
            # the loss here is the logits' alone (the model is called without labels)
            conflicts.append(
                f"a router load-balancing loss (MoE: output_router_logits=True, router_aux_loss_coef={coefficient}), "
                "which the model adds to its own loss and this one would leave out: set output_router_logits=False "
                "(or router_aux_loss_coef=0)"
            )
        if self.plan.engine == "data_parallel":
            conflicts.append(f"{self.plan.local_devices} GPUs in one process (DataParallel): launch one process per GPU")
        for name, size in self.plan.shards_sample_tokens.items():
            conflicts.append(f"{name}={size}: data parallelism only")
        if conflicts:
            raise ValueError(
                f"{what} computes the loss in packing_hf's Trainer, which does not support "
                + "; ".join(conflicts)
            )

    # ---- the step -------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def counting_step(self) -> Iterator[None]:
        """The Trainer's count of a training step's micro-batches (``get_batch_samples``) runs inside."""
        self._counting = True
        try:
            yield
        finally:
            self._counting = False

    @contextlib.contextmanager
    def packed_evaluation(self) -> Iterator[None]:
        """A packed evaluation loop runs inside (:mod:`~packing_hf.integrations.evaluation`): it weighs each batch's
        mean loss by the batch's own token count, so its batches get no ``num_items_in_batch``."""
        self._packed_evaluation = True
        try:
            yield
        finally:
            self._packed_evaluation = False

    def count(self, trainer: Any, batch_samples: list, device: Any, stock_count: Callable[[], Any]) -> Any:
        """``num_items_in_batch`` of ``batch_samples``: a training step's denominator (:meth:`begin_step`) while
        the Trainer counts one; ``None`` in a packed evaluation (stock's count is gathered over ranks in evaluation
        too, which would make each rank's loss its share of a global mean, times the number of processes, instead
        of its own mean); else stock's count (``stock_count()``, an unpacked evaluation batch's)."""
        if self._counting:
            return self.begin_step(trainer, batch_samples, device, stock_count)
        if self._packed_evaluation:
            return None
        return stock_count()

    def begin_step(
        self, trainer: Any, batch_samples: list, device: Any, stock_count: Callable[[], Any]
    ) -> Any:
        """Decide the training step of ``batch_samples`` (its micro-batches): its route, whether its loss is
        scaled for accumulation, and its denominator, returned: stock's token count for ``"token"`` without
        weights, else the step's summed target weight (``"token"``) or sample count, all-reduced over the ranks.
        Collective on several processes (every rank counts the same step)."""
        normalization = trainer.args.loss_normalization
        single = self.plan.world_size == 1
        if any(is_tree_batch(batch) for batch in batch_samples):
            return self._tree_step(trainer, batch_samples, device, normalization)
        if normalization == "token" and single and not any(LOSS_WEIGHTS_KEY in b for b in batch_samples):
            # the default on one process: stock's count, nothing else to agree on
            return self._stock_step(stock_count)
        # (any batch has weights, sum of target weights, samples), summed over micro-batches then ranks
        local = torch.zeros(3, dtype=torch.float64)
        for batch in batch_samples:
            labels = causal_labels(batch)
            weights = batch.get(LOSS_WEIGHTS_KEY)
            if not isinstance(labels, torch.Tensor):
                if normalization != "token" or weights is not None:
                    raise ValueError(
                        f"loss_normalization={normalization!r} (or a loss_weights column) needs 'labels' in every "
                        f"training batch, got the keys {sorted(batch)}; use a collator that returns labels"
                    )
                continue
            target_weight, samples = loss_counts(
                labels, weights, batch.get("position_ids"), batch.get("cu_seq_lens_q")
            )
            local += torch.tensor([float(weights is not None), target_weight, samples], dtype=torch.float64)
        # every rank must take the same path this step (a stream's padding batch carries no weights)
        totals = self._step_totals(trainer, local, device)
        # a cut row's loss is always computed here; else here when normalised otherwise than stock or weighted
        if self.cuts_rows:
            route = LossRoute.SEQUENCE_PARALLEL
        elif normalization != "token" or bool(totals[0] > 0):
            route = LossRoute.PACKED
        else:
            return self._stock_step(stock_count)
        self.check_own_loss(trainer, f"loss_normalization={normalization!r} with loss_weights")
        return self._own_step(route, totals[1:], normalization, device)

    def _tree_step(self, trainer: Any, batch_samples: list, device: Any, normalization: str) -> Any:
        """:meth:`begin_step` of prefix-tree rows: the step's summed pair weights and samples, all-reduced (the
        same totals as the samples packed flat), on the :attr:`LossRoute.PREFIX_TREE` route (under sequence
        parallelism each row counted by its group's first rank, its pairs cut over the group in the call)."""
        local = torch.zeros(2, dtype=torch.float64)
        for i, batch in enumerate(batch_samples):
            if not is_tree_batch(batch):
                raise ValueError(
                    f"micro-batch {i} of this step is not a prefix-tree row (keys {sorted(batch)}) while others are; "
                    "with share_prefixes=True every training batch comes from packing_hf.PrefixTreeCollator"
                )
            local += torch.tensor(tree_loss_counts(batch), dtype=torch.float64)
        totals = self._step_totals(trainer, local, device)
        return self._own_step(LossRoute.PREFIX_TREE, totals, normalization, device)

    def _step_totals(self, trainer: Any, local: torch.Tensor, device: Any) -> torch.Tensor:
        """This rank's per-step counts ``local`` summed over the ranks, on ``device`` (under sequence parallelism
        only the group's first rank counts: the group's ranks share the row)."""
        if not self.plan.counts_rows:
            local.zero_()
        totals = local.to(device)
        if self.plan.world_size > 1:
            totals = trainer.accelerator.reduce(totals, reduction="sum")
        return totals

    def _own_step(
        self, route: LossRoute, totals: torch.Tensor, normalization: str, device: Any
    ) -> torch.Tensor:
        """A step on packing_hf's own loss ``route``: its denominator from the step's ``(target weight, samples)``
        ``totals``; the loss is divided by it, so the Trainer must not divide it by the steps again."""
        self.step_route = route
        self.scaled_for_ga = True
        return torch.tensor(
            step_denominator(totals.tolist(), normalization), dtype=torch.float64, device=device
        )

    def _stock_step(self, stock_count: Callable[[], Any]) -> Any:
        self.step_route = LossRoute.STOCK
        self.scaled_for_ga = self.stock_scaled_for_ga
        return _step_count(stock_count())

    # ---- the call -------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def prediction(self, loss_only: bool) -> Iterator[None]:
        """An evaluation step (``prediction_step``) runs inside; ``loss_only``: it wants the loss alone (the chunked
        head may answer, its outputs carry no logits; a cut row's loss may be computed)."""
        self._prediction_loss_only = loss_only
        try:
            yield
        finally:
            self._prediction_loss_only = False

    def route(
        self,
        trainer: Any,
        model: Any,
        inputs: dict[str, Any],
        weighted: bool,
        return_outputs: bool,
        num_items_in_batch: Any,
    ) -> tuple[LossRoute, Any]:
        """``(route, head)`` of one ``compute_loss`` call: the step's route (training) or the call's (evaluation),
        and the resolved chunked LM head serving it (``None``: full logits). ``weighted``: the batch had a
        ``loss_weights`` column."""
        loss_only = not return_outputs or self._prediction_loss_only
        training = training_mode(model)
        if is_tree_batch(inputs):
            # a tree row has no labels: only its pairs give its loss, in training and evaluation alike
            return LossRoute.PREFIX_TREE, self.chunked_head(trainer, model) if loss_only else None
        # sequence parallelism: training, and evaluation of the loss alone (logits for compute_metrics: whole rows)
        if self.cuts_rows and (training or self._prediction_loss_only):
            return LossRoute.SEQUENCE_PARALLEL, self.chunked_head(trainer, model) if loss_only else None
        if self.step_route is not LossRoute.STOCK and training and num_items_in_batch is not None:
            return LossRoute.PACKED, None if return_outputs else self.chunked_head(trainer, model)
        if self.declared is StockLoss.SFT and self._sft_plain(trainer, inputs, weighted, return_outputs):
            return LossRoute.SFT_PLAIN, self.chunked_head(trainer, model)
        if (
            self.declared is StockLoss.CAUSAL_LM
            and loss_only
            and isinstance(causal_labels(inputs), torch.Tensor)
        ):
            head = self.chunked_head(trainer, model)
            if head is not None:
                return LossRoute.MODEL, head
        return LossRoute.STOCK, None

    def _sft_plain(self, trainer: Any, inputs: dict[str, Any], weighted: bool, return_outputs: bool) -> bool:
        """Whether an SFT call's loss is the model's own (TRL's default SFT loss: the mean negative log-likelihood
        of the labelled tokens), so that its logits (or the chunked head) can give TRL's metrics."""
        args = trainer.args
        return (
            getattr(args, "logit_metrics", "labelled") == "labelled"
            # packing_hf's own loss (loss_normalization sample/sample_sum, loss_weights, a cut row) is not plain
            and self.step_route is LossRoute.STOCK
            and not self.plan.sequence_parallel
            and getattr(args, "loss_normalization", "token") == "token"
            and not weighted
            and not return_outputs
            and trainer.compute_loss_func is None
            and trainer.label_smoother is None
            and args.loss_type == "nll"
            and not trainer.aux_loss_enabled
            and "shift_labels" not in inputs
            and "labels" in inputs
            and not self.plan.shards_sample_tokens
        )

    def chunked_head(self, trainer: Any, model: Any) -> Any:
        """The model's ``(lm_head, LogitHead)`` when its loss can be computed in chunks, else ``None`` (the
        reason logged once)."""
        args = trainer.args
        if not getattr(args, "chunked_loss", False):
            return None
        plan = self.plan
        if trainer.compute_loss_func is not None:
            reason = "a compute_loss_func reads the logits"
        elif trainer.label_smoother is not None:
            reason = f"label_smoothing_factor={args.label_smoothing_factor}"
        elif plan.chunked_head_refusal is not None:
            reason = f"{plan.chunked_head_refusal} ({plan.describe()})"
        elif plan.shards_sample_tokens:
            reason = f"accelerate cuts a sample over processes ({plan.shards_sample_tokens})"
        else:
            resolved = resolve_head(model, plan)
            if not isinstance(resolved, str):
                return resolved
            reason = resolved
        if reason not in self._chunked_refusals:
            self._chunked_refusals.add(reason)
            logger.warning("chunked_loss: the full logits are computed for the loss, because %s", reason)
        return None
