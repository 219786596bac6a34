"""A small bounded cache of results computed from one object, keyed by that object's identity.

One prediction over many GPUs reuses per-graph work (node rows, allocator replays, batch
searches) that depends on the graph but not on the GPU. Graphs and node tables are
mutable pandas-backed objects, so they are keyed by ``id``; each entry keeps its object
alive, so the id cannot be reused by another object while the entry exists.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class IdentityCache(Generic[V]):
    """Least-recently-used results per (object identity, extra key), at most ``size`` of them."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._entries: OrderedDict[tuple, tuple[object, V]] = OrderedDict()

    def get(self, owner: object, key: tuple[Hashable, ...], compute: Callable[[], V]) -> V:
        """The cached value for ``owner`` and ``key``, computed (and stored) on a miss."""
        full = (id(owner), *key)
        hit = self._entries.get(full)
        if hit is not None and hit[0] is owner:
            self._entries.move_to_end(full)
            return hit[1]
        value = compute()
        self._entries[full] = (owner, value)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)
        return value

    def peek(self, owner: object, key: tuple[Hashable, ...]) -> V | None:
        """The cached value for ``owner`` and ``key``, or None (nothing is computed)."""
        hit = self._entries.get((id(owner), *key))
        return hit[1] if hit is not None and hit[0] is owner else None

    def __len__(self) -> int:
        return len(self._entries)
