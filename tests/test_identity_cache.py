"""The per-graph memo: one computation per (object, key), least recently used evicted."""

from __future__ import annotations

from boom_ml.identity_cache import IdentityCache


def test_computes_once_per_object_and_key():
    cache: IdentityCache[int] = IdentityCache(4)
    a, b = object(), object()
    calls: list[str] = []

    def compute(tag: str, value: int):
        return lambda: calls.append(tag) or value

    assert cache.get(a, ("x",), compute("a-x", 1)) == 1
    assert cache.get(a, ("x",), compute("again", 9)) == 1  # hit: not recomputed
    assert cache.get(a, ("y",), compute("a-y", 2)) == 2  # other key, other entry
    assert cache.get(b, ("x",), compute("b-x", 3)) == 3  # other object, other entry
    assert calls == ["a-x", "a-y", "b-x"]


def test_evicts_least_recently_used():
    cache: IdentityCache[int] = IdentityCache(2)
    owners = [object(), object(), object()]
    cache.get(owners[0], (), lambda: 0)
    cache.get(owners[1], (), lambda: 1)
    cache.get(owners[0], (), lambda: -1)  # touch 0: 1 is now the oldest
    cache.get(owners[2], (), lambda: 2)
    assert len(cache) == 2
    assert cache.get(owners[0], (), lambda: -1) == 0
    assert cache.get(owners[1], (), lambda: 11) == 11  # was evicted, computed again
