"""Block-level replay of PyTorch's CUDA caching allocator (one device, default pools).

Rules follow ``DeviceCachingAllocator`` in ``c10/cuda/CUDACachingAllocator.cpp``:
best-fit search per pool and stream, splitting, coalescing, the cudaMalloc failure
path (free oversize cached blocks, then every unsplit cached segment, retry) and
expandable segments at page granularity. Addresses are simulated: each new segment
gets fresh address space from a counter, blocks live at offsets inside it.
"""

from __future__ import annotations

from boom_ml.memory.allocator_blocks import (
    ADDR_BASE,
    ADDR_BITS,
    NO_LIMIT,
    Block,
    BlockIdError,
    Pool,
    Segment,
    SegmentInfo,
    expandable_size,
    merge_blocks,
)
from boom_ml.memory.allocator_config import (
    K_MIN_BLOCK_SIZE,
    K_SMALL_SIZE,
    AllocatorConfig,
    allocation_size,
    round_size,
)
from boom_ml.memory.allocator_expandable import ExpandableSegmentsMixin

__all__ = ["BlockIdError", "CachingAllocatorSim", "SegmentInfo"]


class CachingAllocatorSim(ExpandableSegmentsMixin):
    """Replays malloc/free like PyTorch's native CUDA caching allocator on one device.

    ``capacity_bytes`` is what the allocator may hold from the driver in total
    (None = unlimited); a new segment (or expandable page) "fails" when reserved
    plus its size would exceed it.
    """

    def __init__(
        self, capacity_bytes: int | None = None, config: AllocatorConfig | None = None
    ) -> None:
        self.config = config if config is not None else AllocatorConfig()
        self.capacity = capacity_bytes
        self._cap = NO_LIMIT if capacity_bytes is None else int(capacity_bytes)
        mss = self.config.max_split_size
        self._max_split = NO_LIMIT if mss is None else mss
        self._has_max_split = mss is not None
        self._non_split_rounding = self.config.max_non_split_rounding
        self._expandable = self.config.expandable_segments
        table = self.config.divisions_table()
        self._divisions = table if any(d > 1 for d in table) else None

        self._pools: dict[tuple[bool, int], Pool] = {}
        self._live: dict[int, Block | None] = {}  # None = zero-byte tensor (no block)
        self._segments: set[Segment] = set()  # live plain segments
        self._expandable_segs: list[Segment] = []
        self._next_addr = ADDR_BASE

        self._allocated = 0
        self._reserved = 0
        self._requested = 0
        self.peak_allocated = 0
        self.peak_reserved = 0
        self.peak_requested = 0
        self.num_cudamalloc = 0  # cudaMalloc calls, or page-range maps when expandable
        self.num_cudafree = 0
        self.num_alloc_retries = 0
        self.num_ooms = 0

    # -- public state ---------------------------------------------------------
    @property
    def allocated(self) -> int:
        """Sum of live block sizes (``torch.cuda.memory_allocated``).

        A block can exceed the rounded request: a large-pool remainder of <= 1 MiB
        (or any remainder of an oversize block) stays attached and counts as allocated.
        """
        return self._allocated

    @property
    def reserved(self) -> int:
        """Bytes held from the driver (``torch.cuda.memory_reserved``)."""
        return self._reserved

    @property
    def requested(self) -> int:
        """Sum of un-rounded request sizes of live blocks."""
        return self._requested

    def live_ids(self) -> list[int]:
        return list(self._live)

    # -- malloc ---------------------------------------------------------------
    def malloc(self, block_id: int, nbytes: int, stream: int = 0) -> bool:
        """Allocate ``nbytes`` for ``block_id`` on ``stream``.

        Returns False where PyTorch would raise OutOfMemoryError (after freeing
        cached segments and retrying); the allocator state is then left as
        PyTorch leaves it, with the cache already flushed.
        """
        if block_id in self._live:
            raise BlockIdError(f"block id {block_id} is already allocated")
        if nbytes <= 0:
            if nbytes < 0:
                raise ValueError(f"negative allocation size {nbytes} for block {block_id}")
            # torch never calls the allocator for empty tensors (null data pointer)
            self._live[block_id] = None
            return True
        if self._divisions is None:
            size = (nbytes + K_MIN_BLOCK_SIZE - 1) & ~(K_MIN_BLOCK_SIZE - 1)
        else:
            size = round_size(nbytes, self._divisions)
        small = size <= K_SMALL_SIZE
        pool = self._pools.get((small, stream))
        if pool is None:
            pool = self._pools[(small, stream)] = Pool(small, stream)

        block = self._get_free_block(pool, size)
        if block is None:
            seg_size = allocation_size(size)
            block = self._alloc_block(pool, size, seg_size)
            if block is None and self._release_available_cached_blocks(pool, size):
                block = self._alloc_block(pool, size, seg_size)
            if block is None:
                self._release_cached_blocks()
                self.num_alloc_retries += 1
                block = self._alloc_block(pool, size, seg_size)
            if block is None:
                self.num_ooms += 1
                return False

        remaining = block.size - size
        if small or self._expandable:
            split = remaining >= K_MIN_BLOCK_SIZE
        else:
            split = size < self._max_split and remaining > K_SMALL_SIZE
        if split:
            # the front part is handed out, the tail goes back to the cache
            rest = Block(block.addr + size, remaining, pool, block.seg)
            rest.next = block.next
            if rest.next is not None:
                rest.next.prev = rest
            rest.prev = block
            block.next = rest
            block.size = size
            pool.insert(rest)

        block.allocated = True
        block.requested = nbytes
        self._live[block_id] = block
        self._allocated += block.size
        self._requested += nbytes
        if self._allocated > self.peak_allocated:
            self.peak_allocated = self._allocated
        if self._requested > self.peak_requested:
            self.peak_requested = self._requested
        return True

    def _get_free_block(self, pool: Pool, size: int) -> Block | None:
        keys = pool.keys
        i = keys.bisect_left(size << ADDR_BITS)
        n = len(keys)
        if i == n:
            return None
        key = keys[i]
        b = pool.blocks[key]
        if b.seg.page:
            # A free block that can grow into unmapped pages counts with its growable
            # size for best fit, so prefer the next bigger block if its growable size
            # is smaller (PyTorch walks forward the same way).
            grow = expandable_size(b)
            while i + 1 < n:
                nb = pool.blocks[keys[i + 1]]
                ngrow = expandable_size(nb)
                if ngrow >= grow:
                    break
                i += 1
                b, grow = nb, ngrow
                if not b.seg.page:
                    break
            key = keys[i]
        if self._has_max_split:
            # never hand an oversize (unsplittable) block to a request it would waste
            if size < self._max_split and b.size >= self._max_split:
                return None
            if size >= self._max_split and b.size >= size + self._non_split_rounding:
                return None
        del keys[i]
        del pool.blocks[key]
        return b

    def _alloc_block(self, pool: Pool, size: int, seg_size: int) -> Block | None:
        if self._expandable:
            return self._try_allocate_expandable_block(pool, size)
        if self._reserved + seg_size > self._cap:
            return None
        seg = Segment(self._next_addr, seg_size, pool.small, pool.stream, 0)
        self._next_addr += seg_size
        self._segments.add(seg)
        self._reserved += seg_size
        if self._reserved > self.peak_reserved:
            self.peak_reserved = self._reserved
        self.num_cudamalloc += 1
        return Block(seg.base, seg_size, pool, seg)

    # -- free -----------------------------------------------------------------
    def free(self, block_id: int) -> None:
        """Return ``block_id``'s block to the cache, merging it with free neighbours."""
        try:
            block = self._live.pop(block_id)
        except KeyError:
            raise BlockIdError(
                f"free of block id {block_id}, which is not allocated (double free or unknown id)"
            ) from None
        if block is None:
            return
        block.allocated = False
        self._allocated -= block.size
        self._requested -= block.requested
        block.requested = 0
        pool = block.pool
        prev = block.prev
        if prev is not None and not prev.allocated and prev.mapped == block.mapped:
            merge_blocks(block, prev, pool)
        nxt = block.next
        if nxt is not None and not nxt.allocated and nxt.mapped == block.mapped:
            merge_blocks(block, nxt, pool)
        pool.insert(block)

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: release every cached block that is a whole segment."""
        self._release_cached_blocks()

    def _release_block(self, b: Block) -> None:
        """cudaFree a cached block that spans its whole (plain) segment."""
        assert b.prev is None and b.next is None and not b.seg.page, "release of a split block"
        b.pool.remove(b)
        self._segments.discard(b.seg)
        self._reserved -= b.size
        self.num_cudafree += 1

    def _release_available_cached_blocks(self, pool: Pool, size: int) -> bool:
        """Free oversize cached blocks (>= max_split_size) until ``size`` would fit."""
        if not self._has_max_split or self._expandable:
            # With expandable segments PyTorch's release_block would assert on these
            # blocks; the full release below handles them instead.
            return False
        target = size if size >= self._max_split else self._max_split
        keys = pool.keys
        i = keys.bisect_left(target << ADDR_BITS)
        if i < len(keys):
            self._release_block(pool.blocks[keys[i]])
            return True
        # no single block is big enough: free oversize blocks from the largest down
        released = 0
        j = len(keys) - 1
        while j >= 0 and released < target:
            b = pool.blocks[keys[j]]
            if b.size < self._max_split:
                break
            released += b.size
            self._release_block(b)
            j -= 1
        return released >= target

    def _release_cached_blocks(self) -> None:
        # large pools first, as PyTorch does (order only affects address reuse)
        for pool in sorted(self._pools.values(), key=lambda p: (p.small, p.stream)):
            to_unmap = []
            for key in list(pool.keys):
                b = pool.blocks[key]
                if b.seg.page:
                    to_unmap.append(b)
                elif b.prev is None and b.next is None:
                    self._release_block(b)
            for b in to_unmap:
                self._unmap_block(b)
                if not b.mapped and b.prev is None and b.next is None:
                    # the whole expandable segment is unmapped: drop it
                    del pool.unmapped[b.addr]
                    self._expandable_segs.remove(b.seg)

    def _all_blocks(self) -> list[Block]:
        out = [b for b in self._live.values() if b is not None]
        for pool in self._pools.values():
            out.extend(pool.blocks.values())
            out.extend(pool.unmapped.values())
        return out

    def segments(self) -> list[SegmentInfo]:
        """Snapshot like ``torch.cuda.memory_snapshot()``: segments in address order."""
        heads = sorted((b for b in self._all_blocks() if b.prev is None), key=lambda b: b.addr)
        out: list[SegmentInfo] = []
        for head in heads:
            b: Block | None = head
            while b is not None:
                if not b.mapped:
                    b = b.next
                    continue
                start = b.addr
                blocks = []
                while b is not None and b.mapped:
                    blocks.append((b.size, b.allocated))
                    b = b.next
                seg = head.seg
                out.append(
                    SegmentInfo(
                        address=start,
                        size=sum(s for s, _ in blocks),
                        stream=seg.stream,
                        is_small=seg.small,
                        is_expandable=bool(seg.page),
                        blocks=tuple(blocks),
                    )
                )
        return out

    def check_invariants(self) -> None:
        """Assert the internal structure is consistent (used by the tests)."""
        blocks = self._all_blocks()
        assert len({id(b) for b in blocks}) == len(blocks), "block in two places"
        live = [b for b in self._live.values() if b is not None]
        assert all(b.allocated for b in live)
        assert self._allocated == sum(b.size for b in live)
        assert self._requested == sum(b.requested for b in live)
        for pool in self._pools.values():
            assert len(pool.keys) == len(pool.blocks)
            for key, b in pool.blocks.items():
                assert key == (b.size << ADDR_BITS) | b.addr and not b.allocated and b.mapped
                assert b.pool is pool
            for addr, b in pool.unmapped.items():
                assert addr == b.addr and not b.mapped and not b.allocated
        reserved = 0
        by_seg: dict[int, list[Block]] = {}
        for b in blocks:
            by_seg.setdefault(id(b.seg), []).append(b)
        for seg_blocks in by_seg.values():
            seg_blocks.sort(key=lambda b: b.addr)
            seg = seg_blocks[0].seg
            assert seg_blocks[0].prev is None and seg_blocks[-1].next is None
            assert seg_blocks[0].addr == seg.base
            assert sum(b.size for b in seg_blocks) == seg.size
            for a, c in zip(seg_blocks, seg_blocks[1:], strict=False):
                assert a.next is c and c.prev is a and a.addr + a.size == c.addr
                # neighbours that are both free (and equally mapped) must have merged
                assert a.allocated or c.allocated or a.mapped != c.mapped
            for b in seg_blocks:
                assert b.size > 0 and b.size % K_MIN_BLOCK_SIZE == 0
                if seg.page and not b.mapped:
                    assert (b.addr - seg.base) % seg.page == 0 and b.size % seg.page == 0
            reserved += sum(b.size for b in seg_blocks if b.mapped)
        assert reserved == self._reserved, (reserved, self._reserved)
        assert len(self._segments) + len(self._expandable_segs) == len(by_seg)
