"""Event sizes affine in the batch: a step traced at two batch sizes gives the memory events
of any batch size without tracing (``max_batch.py``'s probes). Most models' memory events keep
the same structure when only the batch size changes, each event's size ``a + b * batch``
(activations scale, weights and optimizer state do not); :class:`BatchScaling` checks the
structure is identical and every slope a whole number of bytes per sample."""

from __future__ import annotations

import numpy as np

from boom_ml.memory.estimate import share_build
from boom_ml.memory.replay import sizes_only_change
from boom_ml.trace.graph import OpGraph

# Event columns that must agree between traces for their sizes to be comparable.
STRUCTURE = ("action", "block", "category", "phase", "node_id")


class BatchScaling:
    """Per-event ``bytes = intercept + slope * batch`` from traces at two batch sizes."""

    def __init__(self, g1: OpGraph, b1: int, g2: OpGraph, b2: int) -> None:
        if b1 == b2 or not same_structure(g1, g2):
            raise ValueError("traces differ in structure; sizes cannot be interpolated")
        s1 = g1.mem_events["bytes"].to_numpy(dtype=np.int64)
        s2 = g2.mem_events["bytes"].to_numpy(dtype=np.int64)
        diff = s2 - s1
        if np.any(diff % (b2 - b1)):
            raise ValueError("event sizes are not affine in the batch size")
        self.slope = diff // (b2 - b1)
        self.intercept = s1 - self.slope * b1
        self.template = g1
        # Trusted from the smaller traced batch up: below it the structure may change (HF
        # decoders take another mask path at batch 1).
        self.low = min(b1, b2)
        self.batch_dependent = bool(np.any(self.slope))
        # the allocator events of any batch are the template's with other sizes: the
        # replays of the search's probes reuse the template's build
        self.shares_build = sizes_only_change(g1, self.slope)
        # Nodes' traffic sizes cuDNN workspaces (overheads.py): scaled the same way.
        self._traffic = {}
        if len(g1.nodes) == len(g2.nodes):
            for col in ("bytes_read", "bytes_written"):
                t1 = g1.nodes[col].to_numpy(dtype=np.float64)
                slope = (g2.nodes[col].to_numpy(dtype=np.float64) - t1) / (b2 - b1)
                self._traffic[col] = (t1 - slope * b1, slope)

    def bytes_at(self, batch: int) -> np.ndarray:
        return self.intercept + self.slope * int(batch)

    def matches(self, graph: OpGraph, batch: int) -> bool:
        """Whether ``graph`` (traced at ``batch``) is exactly what the model predicts."""
        return same_structure(self.template, graph) and bool(
            np.array_equal(graph.mem_events["bytes"].to_numpy(dtype=np.int64), self.bytes_at(batch))
        )

    def graph_at(self, batch: int) -> OpGraph:
        """The template graph with its memory events resized to ``batch``.

        ``mem_events`` and the nodes' traffic (which sizes cuDNN workspaces) are
        rescaled; shapes and FLOPs stay the template's, so use the result for memory only.
        """
        sizes = self.bytes_at(batch)
        if np.any(sizes < 0):
            raise ValueError(f"batch size {batch} gives negative event sizes")
        events = self.template.mem_events.copy()
        events["bytes"] = sizes
        nodes = self.template.nodes
        if self._traffic:
            nodes = nodes.copy()
            for col, (intercept, slope) in self._traffic.items():
                nodes[col] = np.ceil(np.maximum(intercept + slope * batch, 0)).astype(np.int64)
        meta = dict(self.template.meta)
        meta["step"] = {**meta.get("step", {}), "batch_size": int(batch)}
        graph = OpGraph(nodes, self.template.edges, events, meta)
        if self.shares_build:
            share_build(graph, self.template, sizes)
        return graph


def scaling_pairs(batch: int) -> list[tuple[int, int]]:
    """The batch sizes whose traces :class:`BatchScaling` is taken from, in order of trial.

    Half rather than twice: a trace costs the same at any batch, and a step that does not
    fit makes the advisor ask for half the micro-batch anyway (the session traces each step
    once). Never down to batch 1, whose structure can differ; from batch 1, the model comes
    from batches 2 and 4 when 1 and 2 disagree.
    """
    other = batch // 2 if batch >= 4 else batch * 2
    return [(batch, other)] + ([(2, 4)] if batch == 1 else [])


def same_structure(g1: OpGraph, g2: OpGraph) -> bool:
    e1, e2 = g1.mem_events, g2.mem_events
    if len(e1) != len(e2):
        return False
    return all(np.array_equal(e1[c].to_numpy(), e2[c].to_numpy()) for c in STRUCTURE)
