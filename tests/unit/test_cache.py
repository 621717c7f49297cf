"""packing_hf._cache.IdentityCache: hits by identity, version and data; bounded; holds no source alive."""

from __future__ import annotations

import gc
import weakref

import torch

from packing_hf._cache import IdentityCache


def test_a_hit_needs_the_same_objects_versions_and_data():
    cache = IdentityCache(size=4)
    a, b = torch.tensor([0, 3]), torch.tensor([0, 3])
    cache.put((a, None), "a", data=7)
    assert cache.get((a, None), data=7) == "a"
    assert cache.get((b, None), data=7) is None  # equal values, another object
    assert cache.get((a, None), data=8) is None  # other data
    assert cache.get((a, b), data=7) is None  # None matches only None
    assert cache.get((a,), data=7) is None  # another number of sources
    a.add_(1)  # in place: a new version
    assert cache.get((a, None), data=7) is None


def test_the_oldest_entries_are_dropped_and_sources_are_not_kept_alive():
    cache = IdentityCache(size=2)
    kept = [torch.tensor([i]) for i in range(3)]
    calls = []
    for t in kept:
        cache.derive((t,), lambda t=t: calls.append(t) or len(calls))
    assert cache.derive((kept[2],), lambda: -1) == 3 and cache.derive((kept[1],), lambda: -1) == 2
    assert cache.derive((kept[0],), lambda: -1) == -1  # dropped: computed again

    class Config:  # any object with weak references works as a source (model configs do)
        pass

    config = Config()
    cache.put((config,), "checked")
    assert cache.get((config,)) == "checked"
    alive = weakref.ref(config)
    del config
    gc.collect()
    assert alive() is None  # the cache held it only weakly
    assert cache.get((Config(),)) is None
