"""Replay a step's alloc/free event list through the caching-allocator simulator."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from boom_ml.errors import InvalidInputError
from boom_ml.memory.allocator_blocks import ReplayFreeError
from boom_ml.memory.allocator_config import AllocatorConfig
from boom_ml.memory.allocator_sim import BlockIdError, CachingAllocatorSim


@dataclass
class AllocatorResult:
    """What a replay produced.

    ``peak_index`` is the index of the event after which ``peak_reserved`` was
    first reached (-1 for an empty event list). ``num_segments`` counts segments
    alive at the end of the replay (for expandable segments: contiguous mapped
    ranges, as ``torch.cuda.memory_snapshot`` reports them). Timelines hold one
    value after each replayed event; with ``stop_on_oom`` they end at the
    failing event.
    """

    peak_allocated: int  # torch.cuda.max_memory_allocated
    peak_reserved: int  # torch.cuda.max_memory_reserved
    peak_requested: int  # max of the sum of un-rounded live request sizes
    final_allocated: int
    final_reserved: int
    oom: bool
    oom_at: int | None  # index of the first event whose malloc failed
    peak_index: int
    num_segments: int
    num_cudamalloc: int
    timeline_allocated: np.ndarray = field(repr=False)
    timeline_reserved: np.ndarray = field(repr=False)
    num_ooms: int = 0  # failed mallocs (more than one only with stop_on_oom=False)
    num_alloc_retries: int = 0  # times every cached segment was freed to retry a malloc

    @property
    def fragmentation(self) -> float:
        """1 - peak_allocated / peak_reserved: share of the reserved peak not holding data."""
        if self.peak_reserved == 0:
            return 0.0
        return 1.0 - self.peak_allocated / self.peak_reserved


def _columns(events: Any) -> tuple[list[bool], list[int], list[int], list[int]]:
    """Turn the events into plain lists once, so the replay loop does no pandas work."""
    if hasattr(events, "is_alloc") and hasattr(events, "block"):
        # a memory.replay.Replay: its arrays go to lists directly, not through a tuple per
        # event and back (a third of a Llama-3-8B replay's time)
        blocks_list = events.block.tolist()
        return (events.is_alloc.tolist(), blocks_list, events.nbytes.tolist(),
                [0] * len(blocks_list))  # fmt: skip
    if hasattr(events, "columns") and hasattr(events, "__getitem__"):
        missing = {"action", "block", "bytes"} - set(events.columns)
        if missing:
            raise InvalidInputError(f"allocator events lack column(s): {sorted(missing)}")
        actions = np.asarray(events["action"].to_numpy(), dtype=object)
        is_alloc = actions == "alloc"
        bad = ~(is_alloc | (actions == "free"))
        if bad.any():
            first = int(np.flatnonzero(bad)[0])
            raise InvalidInputError(
                f"event {first}: action must be 'alloc' or 'free', got {actions[first]!r}"
            )
        blocks = events["block"].to_numpy().astype(np.int64).tolist()
        nbytes = events["bytes"].fillna(0).to_numpy().astype(np.int64).tolist()
        if "stream" in events.columns:
            streams = events["stream"].fillna(0).to_numpy().astype(np.int64).tolist()
        else:
            streams = [0] * len(blocks)
        return is_alloc.tolist(), blocks, nbytes, streams

    is_alloc_l: list[bool] = []
    blocks_l: list[int] = []
    bytes_l: list[int] = []
    streams_l: list[int] = []
    for i, ev in enumerate(events):
        action = ev[0]
        if action == "alloc":
            is_alloc_l.append(True)
        elif action == "free":
            is_alloc_l.append(False)
        else:
            raise InvalidInputError(f"event {i}: action must be 'alloc' or 'free', got {action!r}")
        blocks_l.append(int(ev[1]))
        bytes_l.append(int(ev[2]) if len(ev) > 2 and ev[2] is not None else 0)
        streams_l.append(int(ev[3]) if len(ev) > 3 and ev[3] is not None else 0)
    return is_alloc_l, blocks_l, bytes_l, streams_l


def simulate(
    events: Any | Iterable[tuple],
    capacity_bytes: int | None = None,
    config: AllocatorConfig | None = None,
    stop_on_oom: bool = True,
    optional: frozenset[int] | set[int] = frozenset(),
) -> AllocatorResult:
    """Replay ``events`` and report peaks, fragmentation and whether the step OOMs.

    ``events`` is a DataFrame with columns ``action`` ('alloc'|'free'), ``block``,
    ``bytes`` and optionally ``stream``, a :class:`boom_ml.memory.replay.Replay`, or an
    iterable of ``(action, block, bytes)`` (optionally ``(..., stream)``) tuples, in
    program order. ``capacity_bytes`` is
    what the allocator may reserve in total. With ``stop_on_oom=False`` a failed
    malloc is skipped (its later free too) and the replay goes on. A failed malloc of a
    block in ``optional`` is always skipped and is no OOM: a cuDNN workspace that cannot
    be allocated makes PyTorch fall back to an engine that needs less.
    """
    is_alloc, blocks, nbytes, streams = _columns(events)
    sim = CachingAllocatorSim(capacity_bytes, config)
    malloc = sim.malloc
    free = sim.free
    failed: set[int] = set()
    t_alloc: list[int] = []
    t_res: list[int] = []
    peak_res = -1
    peak_index = -1
    oom_at: int | None = None

    for i in range(len(is_alloc)):
        b = blocks[i]
        if is_alloc[i]:
            if not malloc(b, nbytes[i], streams[i]):
                if b in optional:
                    failed.add(b)
                    t_alloc.append(sim._allocated)
                    t_res.append(sim._reserved)
                    continue
                if oom_at is None:
                    oom_at = i
                failed.add(b)
                if stop_on_oom:
                    t_alloc.append(sim._allocated)
                    t_res.append(sim._reserved)
                    break
            elif failed:
                failed.discard(b)
        elif failed and b in failed:
            failed.discard(b)  # the tensor never existed; its free is a no-op
        else:
            try:
                free(b)
            except BlockIdError as err:
                raise ReplayFreeError(
                    f"event {i}: {err}; a model that replaces a tensor living across steps"
                    " in its forward (a buffer or parameter assigned anew, self.x = ...) does"
                    " this: update it in place (self.x.mul_(...), .copy_(...))"
                ) from None
        r = sim._reserved
        t_alloc.append(sim._allocated)
        t_res.append(r)
        if r > peak_res:
            peak_res = r
            peak_index = i

    return AllocatorResult(
        peak_allocated=sim.peak_allocated,
        peak_reserved=sim.peak_reserved,
        peak_requested=sim.peak_requested,
        final_allocated=sim.allocated,
        final_reserved=sim.reserved,
        oom=oom_at is not None,
        oom_at=oom_at,
        peak_index=peak_index,
        num_segments=len(sim.segments()),
        num_cudamalloc=sim.num_cudamalloc,
        timeline_allocated=np.asarray(t_alloc, dtype=np.int64),
        timeline_reserved=np.asarray(t_res, dtype=np.int64),
        num_ooms=sim.num_ooms,
        num_alloc_retries=sim.num_alloc_retries,
    )
