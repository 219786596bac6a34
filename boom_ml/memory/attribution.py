"""What holds the memory at the peak: bytes by category, by module, and the running op.

Works on the multi-step replay of ``replay.py``: the live blocks just after the peak
event are walked back to the traced events (and through them to the op and module that
allocated them). Bytes are counted after the allocator's 512-byte rounding; the rest
of the reserved peak is "fragmentation" (cached but unused bytes of reserved segments,
plus each block's rounding slack inside large segments).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from boom_ml.identity_cache import IdentityCache
from boom_ml.memory.live import round_block
from boom_ml.memory.replay import Replay
from boom_ml.trace.graph import MEMORY_CATEGORIES, OpGraph
from boom_ml.trace.module_paths import group_by_block

PARAMETER_STATE = ("parameter", "gradient", "optimizer_state")
CATEGORIES = (*MEMORY_CATEGORIES, "workspace", "fragmentation")
# what runs at a peak reached as the optimizer's state is created (its first step)
LAZY_STATE_OP = "state init (first step)"


@dataclass
class PeakAttribution:
    by_category: dict[str, int]  # category → bytes at the peak (sums to peak_reserved)
    by_module: list[dict[str, Any]] = field(default_factory=list)  # top-N, largest first
    by_module_group: list[dict[str, Any]] = field(default_factory=list)  # blocks summed, top-N
    op: str = ""
    phase: str = ""
    module: str = ""
    step: int = 0  # which replayed step the peak falls in (1 = first)
    # of by_category["temporary"]: bytes by the phase that allocated them (the optimizer's own
    # temporaries are what ZeRO / FSDP shard with its state)
    temporary_by_phase: dict[str, int] = field(default_factory=dict)


def live_at(replay: Replay, index: int) -> dict[int, int]:
    """Replay-event index of each block's alloc, for the blocks alive just after ``index``."""
    live: dict[int, int] = {}
    alloc = replay.is_alloc[: index + 1].tolist()
    blocks = replay.block[: index + 1].tolist()
    for i, (a, b) in enumerate(zip(alloc, blocks, strict=True)):
        if a:
            live[b] = i
        else:
            live.pop(b, None)
    return live


def attribute_peak(
    graph: OpGraph, replay: Replay, index: int | None, peak_reserved: int, top_n: int = 10
) -> PeakAttribution:
    """Break the reserved peak reached at replay event ``index`` down."""
    if index is None or index < 0 or not len(replay.block):
        return PeakAttribution({c: 0 for c in CATEGORIES})
    ev = graph.mem_events
    categories = ev["category"].to_numpy().astype(str)
    phases = ev["phase"].to_numpy().astype(str)
    temporary_by_phase: dict[str, int] = {}
    ev_nodes = ev["node_id"].to_numpy()
    node_module = graph.nodes["module"].astype(str).to_numpy() if len(graph.nodes) else np.array([])
    by_cat = dict.fromkeys(CATEGORIES, 0)
    by_mod: dict[str, dict[str, int]] = {}
    for block, i in live_at(replay, index).items():
        size = int(round_block(int(replay.nbytes[i])))
        src = int(replay.src[i])
        if src < 0:
            cat, module = replay.synthetic.get(block, "workspace"), "(workspace)"
        else:
            cat = categories[src]
            nid = int(ev_nodes[src])
            if cat in PARAMETER_STATE:
                module = "(parameters, gradients, optimizer state)"
            else:
                module = str(node_module[nid]) if 0 <= nid < len(node_module) else ""
        cat = str(cat)  # numpy's str_ from the event table: to_dict() holds plain str keys
        by_cat[cat] = by_cat.get(cat, 0) + size
        if cat == "temporary" and src >= 0:
            phase = str(phases[src])
            temporary_by_phase[phase] = temporary_by_phase.get(phase, 0) + size
        entry = by_mod.setdefault(module or "(top level)", {})
        entry[cat] = entry.get(cat, 0) + size
    by_cat["fragmentation"] = max(peak_reserved - sum(by_cat.values()), 0)
    modules = sorted(by_mod.items(), key=lambda kv: -sum(kv[1].values()))[:top_n]
    op, phase, module = op_at(graph, replay, index)
    return PeakAttribution(
        by_category=by_cat,
        by_module=[
            {"module": m, "bytes": sum(c.values()), "by_category": dict(c)} for m, c in modules
        ],
        by_module_group=group_by_block(
            ((m, sum(c.values())) for m, c in by_mod.items()), "bytes", top_n, _modules(graph)
        ),
        op=op,
        phase=phase,
        module=module,
        step=int(replay.step[index]),
        temporary_by_phase=temporary_by_phase,
    )


def _modules(graph: OpGraph) -> tuple[str, ...]:
    """Every module the step's ops ran in: which numbered modules are blocks with children
    (once per graph: a prediction attributes one graph's peak per GPU and level)."""
    return _MODULES.get(
        graph,
        (),
        lambda: tuple(pd.unique(graph.nodes["module"].astype(str))) if len(graph.nodes) else (),
    )


_MODULES: IdentityCache[tuple[str, ...]] = IdentityCache(64)


def op_at(graph: OpGraph, replay: Replay, index: int) -> tuple[str, str, str]:
    """Op, phase and module running at replay event ``index``: the row in whose place of the
    loop it happens (:attr:`Replay.at`), so a workspace is its op's and a loop-head free the
    ``zero_grad``'s."""
    at = int(replay.at[index])
    if at < 0:
        return "", "", ""
    src = int(replay.src[index])
    phases = graph.mem_events["phase"].to_numpy()
    if src >= 0 and src != at and str(phases[src]) == "optimizer_state":
        # state made inside the step, where a first optimizer.step() would (replay.py), in
        # the place of that step's first row: the state's own op, not the row's
        return LAZY_STATE_OP, "optimizer", ""
    node_id = int(graph.mem_events["node_id"].iat[at])
    if node_id < 0 or node_id >= len(graph.nodes):
        return "", str(phases[at]), ""
    node = graph.nodes.iloc[node_id]
    return str(node["op"]), str(node["phase"]), str(node["module"])
