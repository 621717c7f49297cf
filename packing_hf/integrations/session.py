"""One packing session per trainer: its models prepared for packed batches while it works, then given back.

Every packed trainer runs the same life cycle for each model it calls (the policy, a reference model,
a model built per trial): before the first packed forward the model is checked and prepared
(:func:`~packing_hf.integrations.preflight.preflight_packing`: the pre-flight check, the attention switch
where needed, guards and per-model fixes), and when the trainer's outermost ``train`` / ``evaluate`` /
reference pass ends it is given back as the user passed it: hooks removed, ``attn_implementation`` and
``use_cache`` as they were. :class:`PackingSession` is that life cycle, written once:

- ``with session.open():`` brackets packed work; nested opens (evaluation during training) share it and
  only the outermost close gives the models back, also when the work raised.
- ``session.acquire(model, attention=...)`` prepares ``model`` once per session (later calls return the
  same handle); ``attention`` switches it to that implementation first (the shared-prompt layouts are
  read by packing_hf's attention only). A preparation that fails gives the model back before raising.
- ``session.hold(model)``: ``open`` + ``acquire`` for one block.
- ``session.adapter(model, factory)``: a model adapter (forward hooks translating a trainer's packed batch,
  :mod:`~packing_hf.integrations.adapters`) installed once per model; they stay (they only act on packed
  batches) until :meth:`remove_adapters`.

>>> from transformers import AutoModelForCausalLM
>>> from packing_hf.architectures.tiny import tiny_config
>>> model = AutoModelForCausalLM.from_config(tiny_config("opt"), attn_implementation="sdpa")
>>> session = PackingSession("switch")
>>> with session.hold(model) as preparation:  # opt builds its mask without position_ids: per-sample masks
...     preparation.mask_fix, session.preparation(model) is preparation
(True, True)
>>> session.preparation(model) is None  # given back: hooks removed
True
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from .preflight import base_model, preflight_packing

__all__ = ["PackingSession"]


@dataclass
class _Lease:
    model: Any  # the PreTrainedModel under any wrapper
    attn_implementation: str | None  # the user's, given back
    use_cache: bool | None  # the user's (None: leave it)
    preparation: Any = None


class PackingSession:
    """The models a trainer packs with, prepared while it works and given back after (see the module docstring).

    Args:
        mode: the pre-flight mode (``"switch"``, ``"error"`` or ``"off"``: ``packing_preflight``).
    """

    def __init__(self, mode: str = "switch") -> None:
        self.mode = mode
        self.user_use_cache: bool | None = None  # the policy's, read before the stock trainer overrides it
        self._leases: dict[int, _Lease] = {}
        self._adapters: dict[tuple[int, Any], Any] = {}
        self._depth = 0

    @property
    def active(self) -> bool:
        """Whether packed work is going on (inside an ``open``)."""
        return self._depth > 0

    @contextlib.contextmanager
    def open(self) -> Iterator[PackingSession]:
        """Packed work for the duration; the outermost close gives every acquired model back."""
        self._depth += 1
        try:
            yield self
        finally:
            self._depth -= 1
            if self._depth == 0:
                self.release()

    def acquire(
        self, model: Any, *, attention: str | None = None, use_cache: bool | None = None, role: str = "model"
    ) -> Any:
        """``model`` checked and prepared for packed batches until the session closes (once per model).

        Args:
            model: a ``PreTrainedModel``, possibly wrapped (PEFT, DDP, accelerate).
            attention: switch the model to this attention implementation first (given back after).
            use_cache: the user's ``config.use_cache``, given back after (``None``: the model's current value).
            role: what the model is to the trainer, named in the pre-flight's log line.

        Returns:
            The :class:`~packing_hf.architectures.PackingPreparation` handle (``None`` with ``packing_preflight="off"``).
        """
        base = base_model(model)
        lease = self._leases.get(id(base))
        if lease is not None:
            return lease.preparation
        config = base.config
        lease = _Lease(
            base,
            getattr(config, "_attn_implementation", None),
            use_cache if use_cache is not None else getattr(config, "use_cache", None),
        )
        try:
            if attention is not None and lease.attn_implementation != attention:
                base.set_attn_implementation(attention)
            lease.preparation = preflight_packing(base, mode=self.mode, role=role)
        except BaseException:
            self._give_back(lease)
            raise
        self._leases[id(base)] = lease
        return lease.preparation

    @contextlib.contextmanager
    def hold(self, model: Any, **options: Any) -> Iterator[Any]:
        """``open`` + :meth:`acquire` for one block; yields the preparation handle."""
        with self.open():
            yield self.acquire(model, **options)

    def preparation(self, model: Any) -> Any:
        """The preparation handle of ``model`` in this session (``None`` when it is not held)."""
        lease = self._leases.get(id(base_model(model))) if model is not None else None
        return None if lease is None else lease.preparation

    def release(self, model: Any = None) -> None:
        """Give ``model`` (default: every held model) back as it was before the session prepared it."""
        keys = list(self._leases) if model is None else [id(base_model(model))]
        for key in keys:
            lease = self._leases.pop(key, None)
            if lease is not None:
                self._give_back(lease)

    @staticmethod
    def _give_back(lease: _Lease) -> None:
        if lease.preparation is not None:
            lease.preparation.revert()
            lease.preparation = None
        config = lease.model.config
        if lease.attn_implementation is not None and config._attn_implementation != lease.attn_implementation:
            lease.model.set_attn_implementation(lease.attn_implementation)  # switched for packed work
        if lease.use_cache is not None:
            config.use_cache = lease.use_cache  # stock trainers set args.use_cache on the model

    @contextlib.contextmanager
    def as_given(self, model: Any) -> Iterator[None]:
        """``model``'s config as the user gave it (``use_cache``) for the duration, e.g. while it is saved."""
        config = getattr(base_model(model), "config", None)
        wanted = self.user_use_cache
        if config is None or wanted is None or getattr(config, "use_cache", None) == wanted:
            yield
            return
        training_value, config.use_cache = config.use_cache, wanted
        try:
            yield
        finally:
            config.use_cache = training_value

    def adapter(self, model: Any, factory: Callable[[Any], Any]) -> Any:
        """The adapter ``factory(model)`` on ``model``, installed once (kept until :meth:`remove_adapters`)."""
        key = (id(model), factory)
        if key not in self._adapters:
            self._adapters[key] = factory(model)
        return self._adapters[key]

    def adapters(self) -> list[Any]:
        """The adapters installed so far."""
        return list(self._adapters.values())

    def remove_adapters(self) -> None:
        """Remove every adapter's hooks (the models are as before)."""
        for adapter in self._adapters.values():
            adapter.remove()
        self._adapters.clear()
