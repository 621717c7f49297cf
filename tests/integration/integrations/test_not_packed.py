"""Every trainer class of the installed TRL is either packed by packing_hf or refused by name.

A TRL upgrade that adds a trainer fails here until it is packed (and tested) or listed with its reason in
``packing_hf._NOT_PACKED``; a listed name must exist where the message sends the user.
"""

from __future__ import annotations

import importlib
import pkgutil
import warnings

import pytest

import packing_hf

trl = pytest.importorskip("trl")


def _trl_trainer_names() -> set[str]:
    """Names of the ``*Trainer`` classes exported by ``trl`` and by every ``trl.experimental`` subpackage."""
    import trl.experimental

    names = {n for n in dir(trl) if n.endswith("Trainer") and not n.startswith("_")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for info in pkgutil.iter_modules(trl.experimental.__path__):
            if not info.ispkg:
                continue
            try:
                module = importlib.import_module(f"trl.experimental.{info.name}")
            except ImportError:  # an optional dependency of that trainer is not installed
                continue
            names |= {n for n in getattr(module, "__all__", dir(module)) if n.endswith("Trainer")}
    return names


def test_every_trl_trainer_is_packed_or_refused_by_name():
    trainers = _trl_trainer_names()
    assert {"DPOTrainer", "GRPOTrainer", "OnlineDPOTrainer"} <= trainers  # the enumeration sees both places
    packed = {n for n in packing_hf.__all__ if n.endswith("Trainer")}
    uncovered = trainers - packed - set(packing_hf._NOT_PACKED)
    assert not uncovered, f"TRL trainers neither packed nor refused by name: {sorted(uncovered)}"
    assert not packed & set(packing_hf._NOT_PACKED)


@pytest.mark.parametrize("name", sorted(packing_hf._NOT_PACKED))
def test_refused_trainer_names_the_reason_and_the_stock_class(name):
    where, why = packing_hf._NOT_PACKED[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert isinstance(getattr(importlib.import_module(where), name), type)  # the advice is real
    with pytest.raises(AttributeError, match=f"packing_hf has no {name}: .*Use {where}.{name} with padded"):
        getattr(packing_hf, name)
    assert not hasattr(packing_hf, name)
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchTrainer'"):
        packing_hf.NoSuchTrainer  # noqa: B018
