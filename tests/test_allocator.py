"""Pins the CUDA caching-allocator simulator to PyTorch's rules with exact numbers."""

from __future__ import annotations

import pandas as pd
import pytest

from boom_ml.errors import InvalidInputError
from boom_ml.memory.allocator import (
    AllocatorConfig,
    BlockIdError,
    CachingAllocatorSim,
    MiB,
    allocation_size,
    round_size,
    simulate,
)

KiB = 1024


def blocks_of(sim: CachingAllocatorSim) -> list[list[tuple[int, bool]]]:
    return [list(s.blocks) for s in sim.segments()]


# -- rounding and segment sizes ------------------------------------------------


@pytest.mark.parametrize(
    ("nbytes", "rounded"),
    [(1, 512), (511, 512), (512, 512), (513, 1024), (MiB + 1, MiB + 512), (10 * MiB, 10 * MiB)],
)
def test_round_size(nbytes: int, rounded: int) -> None:
    assert round_size(nbytes) == rounded


@pytest.mark.parametrize(
    ("size", "segment"),
    [
        (512, 2 * MiB),
        (MiB, 2 * MiB),
        (MiB + 512, 20 * MiB),
        (10 * MiB - 512, 20 * MiB),
        (10 * MiB, 10 * MiB),
        (10 * MiB + 512, 12 * MiB),
        (33 * MiB, 34 * MiB),
    ],
)
def test_allocation_size(size: int, segment: int) -> None:
    assert allocation_size(size) == segment


def test_one_byte_uses_512_bytes_of_a_2mib_small_segment() -> None:
    sim = CachingAllocatorSim()
    assert sim.malloc(0, 1)
    assert (sim.allocated, sim.reserved, sim.requested) == (512, 2 * MiB, 1)
    [seg] = sim.segments()
    assert seg.is_small and seg.size == 2 * MiB
    assert seg.blocks == ((512, True), (2 * MiB - 512, False))


def test_one_mib_is_still_small_pool() -> None:
    sim = CachingAllocatorSim()
    sim.malloc(0, MiB)
    sim.malloc(1, MiB)  # the other half of the same 2 MiB segment
    assert (sim.allocated, sim.reserved, sim.num_cudamalloc) == (2 * MiB, 2 * MiB, 1)
    assert all(s.is_small for s in sim.segments())


def test_just_over_one_mib_gets_a_20mib_large_segment() -> None:
    sim = CachingAllocatorSim()
    sim.malloc(0, MiB + 1)
    assert (sim.allocated, sim.reserved) == (MiB + 512, 20 * MiB)
    [seg] = sim.segments()
    assert not seg.is_small
    assert seg.blocks == ((MiB + 512, True), (19 * MiB - 512, False))


def test_over_10mib_gets_own_segment_rounded_to_2mib() -> None:
    sim = CachingAllocatorSim()
    sim.malloc(0, 10 * MiB + 1)
    assert sim.reserved == 12 * MiB
    # remainder 2 MiB - 512 is > 1 MiB, so the segment is split
    assert blocks_of(sim) == [[(10 * MiB + 512, True), (2 * MiB - 512, False)]]
    assert sim.allocated == 10 * MiB + 512


def test_600kib_allocations_share_a_small_segment() -> None:
    sim = CachingAllocatorSim()
    for i in range(3):  # 3 x 600 KiB = 1800 KiB fit into 2048 KiB
        sim.malloc(i, 600 * KiB)
    assert (sim.reserved, sim.num_cudamalloc) == (2 * MiB, 1)
    sim.malloc(3, 600 * KiB)
    assert (sim.reserved, sim.num_cudamalloc) == (4 * MiB, 2)
    assert sim.allocated == 4 * 600 * KiB


# -- splitting -----------------------------------------------------------------


def test_small_pool_splits_a_512_byte_remainder() -> None:
    sim = CachingAllocatorSim()
    sim.malloc(0, MiB)
    sim.malloc(1, MiB - 512)  # takes the free 1 MiB block, leaving exactly 512 B
    assert blocks_of(sim) == [[(MiB, True), (MiB - 512, True), (512, False)]]
    sim.malloc(2, 1)  # the 512 B sliver serves a tiny request
    assert (sim.reserved, sim.num_cudamalloc) == (2 * MiB, 1)
    assert blocks_of(sim) == [[(MiB, True), (MiB - 512, True), (512, True)]]


def test_large_pool_keeps_a_1mib_remainder_unsplit() -> None:
    sim = CachingAllocatorSim()
    sim.malloc(0, 19 * MiB)  # own 20 MiB segment, remainder exactly 1 MiB: not split
    assert blocks_of(sim) == [[(20 * MiB, True)]]
    assert (sim.allocated, sim.requested) == (20 * MiB, 19 * MiB)


def test_large_pool_splits_a_remainder_over_1mib() -> None:
    sim = CachingAllocatorSim()
    sim.malloc(0, 19 * MiB - 512)  # remainder 1 MiB + 512 > 1 MiB: split
    assert blocks_of(sim) == [[(19 * MiB - 512, True), (MiB + 512, False)]]
    assert sim.allocated == 19 * MiB - 512


def test_large_cached_block_is_split_for_a_smaller_request() -> None:
    sim = CachingAllocatorSim()
    sim.malloc(0, 5 * MiB)
    sim.malloc(1, 7 * MiB)
    sim.malloc(2, 8 * MiB)  # 5 + 7 + 8 = 20: fills the segment exactly
    assert blocks_of(sim) == [[(5 * MiB, True), (7 * MiB, True), (8 * MiB, True)]]
    assert sim.num_cudamalloc == 1


# -- reuse, best fit and coalescing ---------------------------------------------


def test_free_then_realloc_reuses_the_cached_block() -> None:
    sim = CachingAllocatorSim()
    sim.malloc(0, 5 * MiB)
    sim.free(0)
    assert (sim.allocated, sim.reserved) == (0, 20 * MiB)
    sim.malloc(1, 5 * MiB)
    assert (sim.num_cudamalloc, sim.reserved) == (1, 20 * MiB)


def test_free_neighbours_coalesce() -> None:
    sim = CachingAllocatorSim()
    for i in range(3):
        sim.malloc(i, 4 * MiB)
    assert blocks_of(sim) == [[(4 * MiB, True)] * 3 + [(8 * MiB, False)]]
    sim.free(0)
    sim.free(1)  # merges with the freed block before it
    assert blocks_of(sim) == [[(8 * MiB, False), (4 * MiB, True), (8 * MiB, False)]]
    sim.free(2)  # merges on both sides: the segment is whole again
    assert blocks_of(sim) == [[(20 * MiB, False)]]
    sim.empty_cache()
    assert (sim.reserved, sim.segments()) == (0, [])


def test_equal_size_blocks_tie_break_on_lower_address() -> None:
    sim = CachingAllocatorSim()
    for i in range(3):
        sim.malloc(i, 4 * MiB)
    sim.free(0)
    sim.free(1)
    sim.malloc(3, 8 * MiB)  # 8 MiB free at the start and at the end: takes the start
    assert blocks_of(sim) == [[(8 * MiB, True), (4 * MiB, True), (8 * MiB, False)]]


def test_best_fit_picks_the_smallest_sufficient_block() -> None:
    sim = CachingAllocatorSim()
    for i, mb in enumerate((12, 16, 14)):
        sim.malloc(i, mb * MiB)
    for i in range(3):
        sim.free(i)
    sim.malloc(10, 13 * MiB)  # 14 MiB is the best fit; 1 MiB remainder stays attached
    assert (sim.allocated, sim.num_cudamalloc) == (14 * MiB, 3)
    sim.malloc(11, 11 * MiB)
    assert sim.allocated == 14 * MiB + 12 * MiB
    sim.malloc(12, 15 * MiB)
    assert (sim.allocated, sim.num_cudamalloc) == (42 * MiB, 3)


def test_streams_do_not_share_cached_blocks() -> None:
    sim = CachingAllocatorSim()
    sim.malloc(0, 5 * MiB, stream=0)
    sim.free(0)
    sim.malloc(1, 5 * MiB, stream=1)
    assert (sim.num_cudamalloc, sim.reserved) == (2, 40 * MiB)
    sim.malloc(2, 5 * MiB, stream=0)  # stream 0 still finds its cached block
    assert sim.num_cudamalloc == 2


# -- OOM and the release/retry path ----------------------------------------------


def test_cache_flush_lets_a_big_request_succeed() -> None:
    sim = CachingAllocatorSim(capacity_bytes=40 * MiB)
    sim.malloc(0, 12 * MiB)
    sim.malloc(1, 12 * MiB)
    sim.free(0)
    sim.free(1)
    # 24 MiB cached + a 30 MiB segment > 40 MiB: both cached segments are freed, retry works
    assert sim.malloc(2, 30 * MiB)
    assert (sim.reserved, sim.allocated, sim.num_alloc_retries) == (30 * MiB, 30 * MiB, 1)


def test_true_oom_after_flush() -> None:
    sim = CachingAllocatorSim(capacity_bytes=40 * MiB)
    sim.malloc(0, 12 * MiB)
    sim.malloc(1, 12 * MiB)
    sim.free(1)
    assert not sim.malloc(2, 30 * MiB)  # 12 live + 30 > 40 even after the flush
    assert (sim.reserved, sim.allocated, sim.num_ooms) == (12 * MiB, 12 * MiB, 1)


def test_fragmentation_oom_that_expandable_segments_avoid() -> None:
    events = [
        ("alloc", 0, 2 * MiB),  # pins a 20 MiB segment (2 MiB used, 18 MiB free split)
        ("alloc", 1, 19 * MiB),  # 18 MiB hole too small: second 20 MiB segment
        ("free", 1, 0),
        ("alloc", 2, 21 * MiB),  # needs 22 MiB; flush frees only the unsplit segment
    ]
    plain = simulate(events, capacity_bytes=40 * MiB)
    assert plain.oom and plain.oom_at == 3
    assert (plain.final_allocated, plain.final_reserved) == (2 * MiB, 20 * MiB)
    assert plain.peak_reserved == 40 * MiB and plain.num_alloc_retries == 1

    exp = simulate(
        events, capacity_bytes=40 * MiB, config=AllocatorConfig(expandable_segments=True)
    )
    assert not exp.oom
    assert (exp.peak_reserved, exp.final_allocated) == (40 * MiB, 23 * MiB)


# -- max_split_size_mb -------------------------------------------------------------


def test_max_split_size_stops_splitting_oversize_blocks() -> None:
    for cfg, allocated in (
        (AllocatorConfig(), 25 * MiB),
        (AllocatorConfig(max_split_size_mb=20), 30 * MiB),
    ):
        sim = CachingAllocatorSim(config=cfg)
        sim.malloc(0, 30 * MiB)
        sim.free(0)
        sim.malloc(1, 25 * MiB)  # reuses the 30 MiB block; split only without the limit
        assert (sim.allocated, sim.num_cudamalloc) == (allocated, 1)


def test_max_split_size_keeps_small_requests_off_oversize_blocks() -> None:
    plain = CachingAllocatorSim()
    limited = CachingAllocatorSim(config=AllocatorConfig(max_split_size_mb=20))
    for sim in (plain, limited):
        sim.malloc(0, 30 * MiB)
        sim.free(0)
        sim.malloc(1, 5 * MiB)
    assert plain.reserved == 30 * MiB
    assert limited.reserved == 50 * MiB  # a fresh 20 MiB segment instead


def test_oversize_block_reused_only_within_20mib() -> None:
    sim = CachingAllocatorSim(config=AllocatorConfig(max_split_size_mb=20))
    sim.malloc(0, 50 * MiB)
    sim.free(0)
    sim.malloc(1, 30 * MiB)  # 50 >= 30 + 20: not reused
    assert sim.num_cudamalloc == 2
    sim.malloc(2, 31 * MiB)  # 50 < 31 + 20: reused whole
    assert (sim.num_cudamalloc, sim.allocated) == (2, 30 * MiB + 50 * MiB)


def test_oom_path_first_frees_just_enough_oversize_blocks() -> None:
    sim = CachingAllocatorSim(capacity_bytes=60 * MiB, config=AllocatorConfig(max_split_size_mb=20))
    sim.malloc(0, 30 * MiB)
    sim.malloc(1, 24 * MiB)
    sim.free(0)
    sim.free(1)
    # a 10 MiB request may not use oversize blocks; 54 + 10 > 60, so the smallest
    # cached block >= max_split_size (24 MiB) is released and the retry succeeds
    assert sim.malloc(2, 10 * MiB)
    assert (sim.reserved, sim.num_alloc_retries) == (40 * MiB, 0)
    assert sorted(s.size for s in sim.segments()) == [10 * MiB, 30 * MiB]


# -- expandable segments -------------------------------------------------------------


def test_expandable_segments_grow_in_pages() -> None:
    sim = CachingAllocatorSim(config=AllocatorConfig(expandable_segments=True))
    sim.malloc(0, 1)
    assert sim.reserved == 2 * MiB  # one small-pool page
    sim.malloc(1, MiB + 1)
    assert sim.reserved == 2 * MiB + 20 * MiB  # one large-pool page
    sim.malloc(2, 30 * MiB)  # grows the same segment by one more 20 MiB page
    assert sim.reserved == 2 * MiB + 40 * MiB
    assert sim.allocated == 512 + MiB + 512 + 30 * MiB
    large = [s for s in sim.segments() if not s.is_small]
    assert len(large) == 1 and large[0].size == 40 * MiB and large[0].is_expandable
    for i in range(3):
        sim.free(i)
    assert sim.reserved == 42 * MiB
    sim.empty_cache()
    assert (sim.reserved, sim.segments()) == (0, [])


def test_expandable_segments_reduce_fragmentation_when_sizes_grow() -> None:
    events = [("alloc", i, 30 * MiB) for i in range(8)]
    events += [("free", i, 0) for i in range(8)]
    events += [("alloc", 100 + i, 31 * MiB) for i in range(8)]
    plain = simulate(events)
    exp = simulate(events, config=AllocatorConfig(expandable_segments=True))
    assert (plain.peak_reserved, plain.peak_allocated) == (496 * MiB, 256 * MiB)
    assert (exp.peak_reserved, exp.peak_allocated) == (260 * MiB, 248 * MiB)
    assert exp.fragmentation < 0.05 < 0.45 < plain.fragmentation


# -- roundup_power2_divisions ---------------------------------------------------------


def test_roundup_power2_divisions() -> None:
    table = AllocatorConfig(roundup_power2_divisions=4).divisions_table()
    assert round_size(1200, table) == 1536  # below 4 x 512 B: plain 512 B rounding
    assert round_size(5000, table) == 5120  # 4096 + one 1024 B step
    assert round_size(MiB + 1, table) == MiB + 256 * KiB
    assert round_size(4 * MiB, table) == 4 * MiB  # powers of two stay
    sim = CachingAllocatorSim(config=AllocatorConfig(roundup_power2_divisions=4))
    sim.malloc(0, 5 * MiB + 1)
    assert sim.allocated == 6 * MiB


# -- config parsing -----------------------------------------------------------------


def test_from_env_string() -> None:
    cfg = AllocatorConfig.from_env_string("max_split_size_mb:128,expandable_segments:True")
    assert cfg == AllocatorConfig(max_split_size_mb=128, expandable_segments=True)
    assert AllocatorConfig.from_env_string("") == AllocatorConfig()
    assert (
        AllocatorConfig.from_env_string(" roundup_power2_divisions : 4 ").roundup_power2_divisions
        == 4
    )
    assert AllocatorConfig.from_env_string("garbage_collection_threshold:0.6") == AllocatorConfig()
    cfg = AllocatorConfig.from_env_string("roundup_power2_divisions:[64:8,256:4,1024:4,>:1]")
    # the first entry also fills smaller intervals; '>' overwrites from the last entry on
    assert cfg.roundup_power2_divisions == (8,) * 7 + (0, 4, 0) + (1,) * 6


@pytest.mark.parametrize(
    "text",
    [
        "max_split_size_mb:10",
        "bogus:1",
        "expandable_segments:yes",
        "roundup_power2_divisions:3",
        "backend:cudaMallocAsync",
        "max_split_size_mb",
    ],
)
def test_from_env_string_rejects(text: str) -> None:
    with pytest.raises(InvalidInputError):
        AllocatorConfig.from_env_string(text)


# -- bookkeeping and replay -------------------------------------------------------------


def test_double_free_and_unknown_id_raise() -> None:
    sim = CachingAllocatorSim()
    sim.malloc(0, 100)
    sim.free(0)
    with pytest.raises(KeyError, match="double free"):
        sim.free(0)
    with pytest.raises(BlockIdError):
        sim.free(42)
    sim.malloc(1, 100)
    with pytest.raises(BlockIdError):
        sim.malloc(1, 100)


def test_zero_byte_tensors_take_no_memory() -> None:
    sim = CachingAllocatorSim()
    assert sim.malloc(0, 0)
    assert (sim.allocated, sim.reserved) == (0, 0)
    sim.free(0)


def test_simulate_dataframe_matches_tuples_and_timelines() -> None:
    events = [
        ("alloc", 0, 3 * MiB),
        ("alloc", 1, 100),
        ("free", 0, 3 * MiB),
        ("alloc", 2, 40 * MiB),
    ]
    df = pd.DataFrame(events, columns=["action", "block", "bytes"])
    a, b = simulate(events), simulate(df)
    assert a.timeline_reserved.tolist() == b.timeline_reserved.tolist()
    assert a.timeline_allocated.tolist() == [3 * MiB, 3 * MiB + 512, 512, 40 * MiB + 512]
    assert a.timeline_reserved.tolist() == [20 * MiB, 22 * MiB, 22 * MiB, 62 * MiB]
    assert (a.peak_reserved, a.peak_index, a.num_segments, a.num_cudamalloc) == (62 * MiB, 3, 3, 3)
    assert a.peak_requested == 40 * MiB + 100 and not a.oom
    assert a.fragmentation == pytest.approx(1 - (40 * MiB + 512) / (62 * MiB))


def test_simulate_continues_after_oom_when_asked() -> None:
    events = [
        ("alloc", 0, 30 * MiB),
        ("alloc", 1, 30 * MiB),
        ("free", 1, 0),
        ("free", 0, 0),
        ("alloc", 2, 5 * MiB),
    ]
    stopped = simulate(events, capacity_bytes=40 * MiB)
    assert stopped.oom_at == 1 and len(stopped.timeline_reserved) == 2
    go_on = simulate(events, capacity_bytes=40 * MiB, stop_on_oom=False)
    assert go_on.oom_at == 1 and go_on.num_ooms == 1 and len(go_on.timeline_reserved) == 5
    assert go_on.final_allocated == 5 * MiB


def test_simulate_names_the_event_of_a_double_free() -> None:
    with pytest.raises(BlockIdError, match="event 2"):
        simulate([("alloc", 0, 10), ("free", 0, 0), ("free", 0, 0)])
