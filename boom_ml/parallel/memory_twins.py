"""A rank's memory computed once for the GPUs whose memory profiles differ in capacity alone.

A layout search asks ``rank_memory`` for every layout on every GPU; the profiles of GPUs of
one architecture (an A100 40GB and 80GB, an L4 and an RTX 4090's Ada) often hold the same
bytes and differ in the memory there is for them (Llama-3-8B on all 44 GPUs: 25 distinct
profiles). Their stages' bytes are computed once and each GPU's capacity set on a copy.
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from typing import Any

from boom_ml.identity_cache import IdentityCache
from boom_ml.parallel.layout import Layout
from boom_ml.parallel.memory import fit_verdict, rank_memory
from boom_ml.parallel.memory_profile import MemoryProfile

# the first profile seen with each capacity-free content (memory_profile's own cache keeps
# every profile alive for the process, so this grows no faster than it)
_TWINS: dict[str, MemoryProfile] = {}
_TWIN_OF: IdentityCache[MemoryProfile] = IdentityCache(1024)
_RANKS: IdentityCache[dict[str, Any]] = IdentityCache(8192)


def _twin(prof: MemoryProfile) -> MemoryProfile:
    def compute() -> MemoryProfile:
        content = json.dumps(asdict(replace(prof, capacity_bytes=0)), sort_keys=True, default=str)
        return _TWINS.setdefault(content, prof)

    return _TWIN_OF.get(prof, (), compute)


def _with_capacity(stage: dict[str, Any], capacity: int) -> dict[str, Any]:
    """A copy of a stage's (or the worst rank's) memory against ``capacity`` bytes."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in stage.items()}
    out["capacity_bytes"] = capacity
    out["headroom_bytes"] = capacity - stage["total_bytes"]
    out["fit"] = fit_verdict(stage["p10_bytes"], stage["p90_bytes"], capacity)
    out["fits"] = out["fit"] == "yes"
    if "terms" in stage:
        out["terms"] = [dict(t) for t in stage["terms"]]
    if "per_stage" in stage:
        out["per_stage"] = [_with_capacity(s, capacity) for s in stage["per_stage"]]
    return out


def shared_rank_memory(
    prof: MemoryProfile, layout: Layout, layers_per_stage: list[int]
) -> dict[str, Any]:
    """``rank_memory(prof, layout, layers_per_stage)``, its bytes shared with every profile
    that differs from ``prof`` in capacity alone."""
    twin = _twin(prof)
    rank = _RANKS.get(
        twin, (layout, tuple(layers_per_stage)), lambda: rank_memory(twin, layout, layers_per_stage)
    )
    return _with_capacity(rank, prof.capacity_bytes)
