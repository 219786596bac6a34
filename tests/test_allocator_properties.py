"""Property tests of the CUDA caching-allocator simulator: invariants over random sequences.

The exact-number rules are pinned in test_allocator.py.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from boom_ml.memory.allocator import (
    AllocatorConfig,
    BlockIdError,
    CachingAllocatorSim,
    MiB,
    round_size,
    simulate,
)

# -- property tests ---------------------------------------------------------------------

CONFIGS = [
    AllocatorConfig(),
    AllocatorConfig(max_split_size_mb=20),
    AllocatorConfig(max_split_size_mb=64, roundup_power2_divisions=4),
    AllocatorConfig(expandable_segments=True),
    AllocatorConfig(expandable_segments=True, max_split_size_mb=32),
]

sizes = st.one_of(
    st.integers(1, MiB),  # small pool
    st.integers(MiB + 1, 12 * MiB),  # 20 MiB large segments
    st.integers(12 * MiB, 80 * MiB),  # dedicated segments
)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), sizes, st.integers(0, 1)),
        st.tuples(st.just("free"), st.integers(0, 10**6), st.just(0)),
        st.tuples(st.just("empty"), st.just(0), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=ops,
    cfg=st.sampled_from(CONFIGS),
    capacity=st.one_of(st.none(), st.integers(20, 300).map(lambda m: m * MiB)),
)
def test_invariants_hold_for_random_sequences(ops, cfg, capacity) -> None:
    sim = CachingAllocatorSim(capacity, cfg)
    table = cfg.divisions_table() if cfg.roundup_power2_divisions else None
    live: dict[int, int] = {}
    next_id = 0
    for kind, arg, stream in ops:
        if kind == "alloc":
            if sim.malloc(next_id, arg, stream):
                live[next_id] = arg
            next_id += 1
        elif kind == "free" and live:
            victim = sorted(live)[arg % len(live)]
            sim.free(victim)
            del live[victim]
        elif kind == "empty":
            sim.empty_cache()
        sim.check_invariants()
        assert sim.reserved >= sim.allocated >= sim.requested >= 0
        assert sim.requested == sum(live.values())
        # a block is at least the rounded request (more when the remainder stayed attached)
        assert sim.allocated >= sum(round_size(n, table) for n in live.values())
        assert sim.allocated == sum(s.allocated_size for s in sim.segments())
        if capacity is not None:
            assert sim.reserved <= capacity

    reserved_before = sim.reserved
    for block_id in list(live):
        sim.free(block_id)
        with pytest.raises(BlockIdError):
            sim.free(block_id)
    assert (sim.allocated, sim.requested, sim.reserved) == (0, 0, reserved_before)
    # every segment is one free block again (or, expandable, free mapped ranges)
    assert all(len(s.blocks) == 1 and not s.blocks[0][1] for s in sim.segments())
    sim.empty_cache()
    assert (sim.reserved, sim.segments()) == (0, [])
    sim.check_invariants()


@settings(max_examples=50, deadline=None)
@given(ops=ops, cfg=st.sampled_from(CONFIGS))
def test_replay_is_deterministic_and_matches_simulator(ops, cfg) -> None:
    events, live, next_id = [], [], 0
    for kind, arg, stream in ops:
        if kind == "alloc":
            events.append(("alloc", next_id, arg, stream))
            live.append(next_id)
            next_id += 1
        elif kind == "free" and live:
            events.append(("free", live.pop(arg % len(live)), 0, 0))
    r1, r2 = simulate(events, config=cfg), simulate(events, config=cfg)
    assert r1.timeline_reserved.tolist() == r2.timeline_reserved.tolist()
    assert r1.peak_reserved == (max(r1.timeline_reserved.tolist()) if events else 0)
    assert r1.peak_allocated == (max(r1.timeline_allocated.tolist()) if events else 0)
    assert (r1.timeline_reserved >= r1.timeline_allocated).all()
