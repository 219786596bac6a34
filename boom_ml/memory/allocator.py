"""Simulation of PyTorch's CUDA caching allocator (``c10/cuda/CUDACachingAllocator.cpp``).

Public entry points:

* :class:`AllocatorConfig` - the ``PYTORCH_CUDA_ALLOC_CONF`` options that matter
  (``max_split_size_mb``, ``expandable_segments``, ``roundup_power2_divisions``,
  ``max_non_split_rounding_mb``), parsed with :meth:`AllocatorConfig.from_env_string`.
* :class:`CachingAllocatorSim` - malloc/free/empty_cache on one simulated device.
* :func:`simulate` - replay a step's alloc/free events, returning an
  :class:`AllocatorResult` (peaks, fragmentation, OOM).

The implementation is split over ``allocator_config.py`` (constants, options,
rounding), ``allocator_sim.py`` (the block/segment model) and
``allocator_replay.py`` (event replay); this module only re-exports them.

Not modelled: CUDA graph private pools, cross-stream ``record_stream`` events,
``garbage_collection_threshold`` (it needs a per-process memory fraction),
free-memory callbacks, the cudaMallocAsync backend, and where the driver places
segments (addresses only break ties between equal-size cached blocks).
"""

from __future__ import annotations

from boom_ml.memory.allocator_config import (
    K_LARGE_BUFFER,
    K_MIN_BLOCK_SIZE,
    K_MIN_LARGE_ALLOC,
    K_ROUND_LARGE,
    K_SMALL_BUFFER,
    K_SMALL_SIZE,
    AllocatorConfig,
    MiB,
    allocation_size,
    round_size,
    roundup_power2_next_division,
)
from boom_ml.memory.allocator_replay import AllocatorResult, simulate
from boom_ml.memory.allocator_sim import BlockIdError, CachingAllocatorSim, SegmentInfo

__all__ = [
    "K_LARGE_BUFFER",
    "K_MIN_BLOCK_SIZE",
    "K_MIN_LARGE_ALLOC",
    "K_ROUND_LARGE",
    "K_SMALL_BUFFER",
    "K_SMALL_SIZE",
    "MiB",
    "AllocatorConfig",
    "AllocatorResult",
    "BlockIdError",
    "CachingAllocatorSim",
    "SegmentInfo",
    "allocation_size",
    "round_size",
    "roundup_power2_next_division",
    "simulate",
]
