"""Memory of one training step on one GPU, from the traced OpGraph."""

from __future__ import annotations

from boom_ml.estimates import MemoryEstimate
from boom_ml.gpus.spec import GpuSpec
from boom_ml.memory.live import live_peak
from boom_ml.trace.graph import OpGraph


def estimate_memory(graph: OpGraph, gpu: GpuSpec) -> MemoryEstimate:
    """Peak memory of the step on ``gpu`` and whether it fits."""
    live = live_peak(graph.mem_events)
    peak_op, peak_phase = _op_at(graph, live.peak_index)
    return MemoryEstimate(
        peak_allocated_bytes=live.peak_bytes,
        peak_reserved_bytes=live.peak_bytes,
        total_bytes=live.peak_bytes,
        capacity_bytes=gpu.memory_bytes,
        fits=live.peak_bytes <= gpu.memory_bytes,
        method="live-bytes",
        breakdown=live.breakdown,
        peak_op=peak_op,
        peak_phase=peak_phase,
    )


def _op_at(graph: OpGraph, event_index: int) -> tuple[str, str]:
    if event_index < 0:
        return "", ""
    event = graph.mem_events.iloc[event_index]
    node_id = int(event["node_id"])
    if node_id < 0:
        return "", str(event["phase"])
    node = graph.nodes.iloc[node_id]
    return str(node["op"]), str(node["phase"])
