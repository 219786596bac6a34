"""Expandable segments (``expandable_segments:True``) at page granularity.

One segment per (pool, stream) reserves a huge virtual range and maps physical
pages on demand: 2 MiB pages for the small pool, 20 MiB for the large pool.
Growth maps the fewest pages that make the lowest-address free/unmapped run big
enough; on the OOM path every whole free page is unmapped again.
"""

from __future__ import annotations

from boom_ml.memory.allocator_blocks import (
    EXPANDABLE_VA,
    Block,
    Pool,
    Segment,
    try_merge,
)
from boom_ml.memory.allocator_config import K_LARGE_BUFFER, K_SMALL_BUFFER


class ExpandableSegmentsMixin:
    """Methods of :class:`CachingAllocatorSim` that handle expandable segments."""

    _reserved: int
    _cap: int
    _next_addr: int
    _expandable_segs: list[Segment]
    peak_reserved: int
    num_cudamalloc: int
    num_cudafree: int

    def _find_expandable_block(self, pool: Pool, size: int) -> Block:
        """Lowest-address spot (free and/or unmapped) with ``size`` bytes of room."""
        for addr in sorted(pool.unmapped):
            c = pool.unmapped[addr]
            if c.prev is not None and not c.prev.allocated:
                c = c.prev
            room = 0
            b: Block | None = c
            while room < size and b is not None and not b.allocated:
                room += b.size
                b = b.next
            if room >= size:
                return c
        page = K_SMALL_BUFFER if pool.small else K_LARGE_BUFFER
        va = -(-EXPANDABLE_VA // page) * page
        seg = Segment(self._next_addr, va, pool.small, pool.stream, page)
        self._next_addr += va
        self._expandable_segs.append(seg)
        c = Block(seg.base, va, pool, seg, mapped=False)
        pool.unmapped[c.addr] = c
        return c

    def _map_block(self, b: Block, size: int) -> bool:
        """Back the first ``size`` bytes of unmapped ``b`` with whole pages."""
        seg = b.seg
        page = seg.page
        off = b.addr - seg.base
        assert off % page == 0, "unmapped block not page aligned"
        mapped = -(-(off + size) // page) * page - off
        if self._reserved + mapped > self._cap:
            return False
        pool = b.pool
        del pool.unmapped[b.addr]
        b.mapped = True
        if mapped < b.size:
            rest = Block(b.addr + mapped, b.size - mapped, pool, seg, mapped=False)
            rest.prev = b
            rest.next = b.next
            if rest.next is not None:
                rest.next.prev = rest
            b.next = rest
            b.size = mapped
            pool.unmapped[rest.addr] = rest
        try_merge(b, b.prev, pool)
        try_merge(b, b.next, pool)
        pool.insert(b)
        self._reserved += mapped
        if self._reserved > self.peak_reserved:
            self.peak_reserved = self._reserved
        self.num_cudamalloc += 1
        return True

    def _try_allocate_expandable_block(self, pool: Pool, size: int) -> Block | None:
        c = self._find_expandable_block(pool, size)
        if not c.mapped and not self._map_block(c, min(c.size, size)):
            return None
        while c.size < size:
            # c is free and followed by unmapped room: map more and merge into it
            nxt = c.next
            assert nxt is not None and not nxt.mapped
            if not self._map_block(nxt, min(size - c.size, nxt.size)):
                return None
            c = nxt
        pool.remove(c)
        return c

    def _unmap_block(self, b: Block) -> None:
        """Unmap the whole pages inside free block ``b`` (expandable ``unmap_block``)."""
        seg = b.seg
        page = seg.page
        off = b.addr - seg.base
        first = -(-off // page) * page
        last = (off + b.size) // page * page
        if first >= last:
            return
        pool = b.pool
        pool.remove(b)
        before = first - off
        after = off + b.size - last
        if before > 0:
            head = Block(b.addr, before, pool, seg)
            head.prev, head.next = b.prev, b
            if b.prev is not None:
                b.prev.next = head
            b.prev = head
            pool.insert(head)
        if after > 0:
            tail = Block(seg.base + last, after, pool, seg)
            tail.prev, tail.next = b, b.next
            if b.next is not None:
                b.next.prev = tail
            b.next = tail
            pool.insert(tail)
        b.addr = seg.base + first
        b.size = last - first
        b.mapped = False
        try_merge(b, b.prev, pool)
        try_merge(b, b.next, pool)
        pool.unmapped[b.addr] = b
        self._reserved -= last - first
        self.num_cudafree += 1

    # -- inspection -----------------------------------------------------------
