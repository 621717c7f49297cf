"""The skeleton every packed trainer shares: its declarations, one ``__init__`` with named hooks, and the
packing session its models live in.

A packed trainer subclasses a stock trainer (``transformers.Trainer``, a TRL trainer) through this class and
writes only what is really its own:

- declarations (class attributes): ``config_class`` (``args`` is converted to it), ``stock`` (the unpacked
  trainer refusals point to), ``packing_collator``, ``packing_refusals`` (keys of
  :data:`~packing_hf.integrations.refusals.REFUSALS`), the nouns the refusal wordings use, and ``packing_loss``
  (what its stock loss is: :class:`~packing_hf.integrations.loss_policy.StockLoss`, checked when the class is
  made);
- hooks, named for when they run: :meth:`~PackedTrainerSkeleton._packing_config` (first),
  :meth:`~PackedTrainerSkeleton._before_stock_init` (own checks, the collator),
  :meth:`~PackedTrainerSkeleton._during_stock_init` (around the stock ``__init__``),
  :meth:`~PackedTrainerSkeleton._after_stock_init`, then ``_packing_setup``;
- its own forward / loss code.

``__init__`` binds the caller's arguments with the stock ``__init__``'s own signature, so a packed trainer
takes exactly the stock arguments. Its models are prepared for packed batches by one
:class:`~packing_hf.integrations.session.PackingSession` (``packing_session``) while it trains or evaluates,
and given back as they came.

>>> from packing_hf.integrations import Trainer
>>> Trainer.stock, Trainer.packing_refusals
('transformers.Trainer', ('prompt_learning',))
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any, ClassVar

from ..collator import PaddingFreeCollator
from .args import TrainingArguments, as_config
from .loss_policy import LossPolicy, StockLoss, check_declaration
from .parallel import ParallelPlan, hidden_sequence_parallelism
from .refusals import Wording, check_refusals
from .session import PackingSession

__all__ = ["PackedTrainerSkeleton"]


class PackedTrainerSkeleton:
    """Declarations, the ``__init__`` template and the packing session (see the module docstring). Put it
    first in the bases of a packed trainer's mixin, before the stock trainer."""

    # ---- what a packed trainer declares -----------------------------------------------------------
    config_class: ClassVar[type] = TrainingArguments  # ``args`` is converted to it
    algorithm: ClassVar[str] = ""  # TRL's default output folder suffix (``<model>-<algorithm>``)
    stock: ClassVar[str] = "transformers.Trainer"  # what to use instead, named in refusals
    packing_collator: ClassVar[type | tuple[type, ...]] = PaddingFreeCollator  # the collators it packs with
    packing_refusals: ClassVar[tuple[str, ...]] = ("prompt_learning",)
    wording: ClassVar[Wording] = Wording()  # what the refusal messages call its packed things
    #: whether this trainer cuts packed rows over ``sp_size`` processes itself (else ``sp_size`` stays accelerate's)
    packing_sequence_parallel: ClassVar[bool] = False
    #: what the stock trainer's ``compute_loss`` computes (:mod:`~packing_hf.integrations.loss_policy`)
    packing_loss: ClassVar[StockLoss] = StockLoss.CAUSAL_LM
    #: the run's parallel layout, built once with the accelerator (:mod:`~packing_hf.integrations.parallel`)
    parallel_plan: ParallelPlan
    #: the run's loss: the step's route, denominator and scaling, each call's route (built beside the plan)
    loss_policy: LossPolicy

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        check_declaration(cls, PackedTrainerSkeleton)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        stock_init = super().__init__
        signature = inspect.signature(stock_init)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        call = dict(bound.arguments)
        for parameter in signature.parameters.values():
            if parameter.kind is inspect.Parameter.VAR_KEYWORD:
                call.update(call.pop(parameter.name, None) or {})  # the stock trainer's **kwargs, flat
            elif parameter.kind is inspect.Parameter.VAR_POSITIONAL and call.pop(parameter.name, ()):
                raise TypeError(
                    f"{type(self).__name__} takes the stock arguments by name past {parameter.name}"
                )
        given = call.get("model")
        call["args"] = self._packing_config(call.get("args"), given)
        self.packing_session = PackingSession(call["args"].packing_preflight)
        # stock __init__ sets model.config.use_cache = args.use_cache; the user's value is given back later
        self.packing_session.user_use_cache = getattr(getattr(given, "config", None), "use_cache", None)
        check_refusals(self.packing_refusals, self, call)
        self._before_stock_init(call)
        with self._during_stock_init(call):
            stock_init(**call)
        self._after_stock_init(call)
        check_refusals(self.packing_refusals, self, {**call, "trainer": self, "model": self.model, "given": given},
                       built=True)  # fmt: skip
        self._packing_setup()

    def create_accelerator_and_postprocess(self) -> None:
        """Stock's, then the run's :class:`~packing_hf.integrations.parallel.ParallelPlan` (``sp_size`` kept
        from accelerate where this trainer serves it) and its
        :class:`~packing_hf.integrations.loss_policy.LossPolicy`."""
        with hidden_sequence_parallelism(self.args, self.packing_sequence_parallel) as sp_size:
            result = super().create_accelerator_and_postprocess()
        self.parallel_plan = ParallelPlan.of(self, sp_size)
        self.loss_policy = LossPolicy.of(self, self.parallel_plan)
        return result

    def _packing_setup(self) -> None:
        """Last in ``__init__``: the packing set-up of the built trainer."""

    def _packing_config(self, args: Any, model: Any) -> Any:
        """``args`` as this trainer's ``config_class`` (runs first)."""
        return as_config(args, model, self.config_class, self.algorithm)

    def _before_stock_init(self, call: dict[str, Any]) -> None:
        """Own checks and the collator, after the declared refusals and before the stock ``__init__``: ``call``
        holds the stock arguments by name and may be changed (e.g. ``call["data_collator"]``)."""

    @contextlib.contextmanager
    def _during_stock_init(self, call: dict[str, Any]) -> Iterator[None]:
        """Around the stock ``__init__`` (e.g. hide a switch stock would act on)."""
        yield

    def _after_stock_init(self, call: dict[str, Any]) -> None:
        """After the stock ``__init__``, before the built-trainer refusals and the packing set-up."""

    def _packs(self) -> bool:
        """Whether this trainer's batches are packed (its models are then prepared while it works)."""
        return True

    def _packing_attention(self) -> str | None:
        """The attention implementation the models must run while packing (None: the one they have)."""
        return None

    @property
    def packing_preparation(self) -> Any:
        """The :class:`~packing_hf.architectures.PackingPreparation` of the model while it trains or evaluates (else None)."""
        return self.packing_session.preparation(self.model)

    @contextlib.contextmanager
    def _packing_model(self, model: Any) -> Iterator[None]:
        """The model prepared for packed batches for the duration (pre-flight check, guards, per-sample masks),
        then given back as the user passed it: hooks removed, attention implementation and ``use_cache`` as
        they were, so ``generate`` on padded batches, padded evaluation and ``save_pretrained`` behave as
        stock. Nested calls (evaluation during training) prepare once."""
        with self.packing_session.open():
            if model is not None and self._packs():
                self.packing_session.acquire(
                    model, attention=self._packing_attention(), use_cache=self.packing_session.user_use_cache
                )
            yield
