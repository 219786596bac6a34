"""OpGraph: one traced training step as three column tables (nodes, edges, memory events).

Columnar so that a graph stores as Parquet, loads into pandas, and batches for the GNN.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

NODE_COLUMNS = {
    "id": "int64",
    "aten_op": "string",  # e.g. "aten.mm.default" as traced on CPU
    "op": "string",  # CUDA-equivalent canonical op, e.g. "mm", "cudnn_batch_norm", "flash_attention"
    "family": "string",  # trace/families.py; "other": no op-registry entry
    "phase": "string",  # forward, backward, optimizer, recompute, loss
    "module": "string",  # owning module path ("" when outside any module)
    "input_shapes": "string",  # JSON list of shapes (tensor inputs only)
    "input_dtypes": "string",  # JSON list of dtype names
    "output_shapes": "string",
    "output_dtypes": "string",
    "flops": "int64",
    "bytes_read": "int64",
    "bytes_written": "int64",
}
EDGE_COLUMNS = {"src": "int64", "dst": "int64"}
EVENT_COLUMNS = {
    "seq": "int64",  # order of the event in the step
    "node_id": "int64",  # op running when it happened (-1: outside any op)
    "action": "string",  # alloc | free
    "block": "int64",  # one id per storage, shared by its alloc and free
    "bytes": "int64",  # storage bytes as requested (before allocator rounding)
    "category": "string",  # parameter, gradient, optimizer_state, activation, autocast_copy, input, temporary
    "phase": "string",
}
MEMORY_CATEGORIES = (
    "parameter",
    "gradient",
    "optimizer_state",
    "activation",
    "autocast_copy",
    "input",
    "temporary",
)


def reads_dtype(nodes: pd.DataFrame, dtypes: Any) -> pd.Series:
    """Whether each node takes an input of one of ``dtypes`` ("float32", ...): its
    ``input_dtypes`` JSON names it."""
    text = nodes["input_dtypes"].astype(str)
    found = pd.Series(False, index=nodes.index)
    for dtype in dtypes:
        found |= text.str.contains(f'"{dtype}"', regex=False)
    return found


def canonical_free_order(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Runs of frees outside any op in one phase, in block order.

    Such frees happen together (autocast's cache of weight copies cleared at its exit, a
    dict of tensors dropped) in an order that follows hashes of tensor addresses, which
    differ between traces. Freed at one instant, their order changes no block's life; in
    block order the same step always traces to the same events, which the max-batch
    search's affine scaling compares across batch sizes.
    """
    out: list[dict[str, Any]] = []
    run: list[dict[str, Any]] = []
    for event in events:
        loose = event["action"] == "free" and event["node_id"] == -1
        if run and not (loose and event["phase"] == run[-1]["phase"]):
            out += sorted(run, key=lambda e: e["block"])
            run = []
        (run if loose else out).append(event)
    return out + sorted(run, key=lambda e: e["block"])


def _frame(rows: list[dict[str, Any]] | pd.DataFrame, columns: dict[str, str]) -> pd.DataFrame:
    df = pd.DataFrame(rows, columns=list(columns))
    return df.astype(columns) if len(df) else df.astype(columns, errors="ignore")


@dataclass
class OpGraph:
    """A traced step. ``meta`` holds the model/step description and totals."""

    nodes: pd.DataFrame
    edges: pd.DataFrame
    mem_events: pd.DataFrame
    meta: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_records(
        cls,
        nodes: list[dict[str, Any]],
        edges: list[dict[str, Any]],
        mem_events: list[dict[str, Any]],
        meta: dict[str, Any] | None = None,
    ) -> OpGraph:
        return cls(
            _frame(nodes, NODE_COLUMNS),
            _frame(edges, EDGE_COLUMNS),
            _frame(mem_events, EVENT_COLUMNS),
            dict(meta or {}),
        )

    @property
    def num_ops(self) -> int:
        return len(self.nodes)

    @property
    def flops(self) -> int:
        # Python integers: an int64 sum wraps negative past 9.2e18 (resnet18 at batch 1e9)
        return sum(map(int, self.nodes["flops"].to_numpy()))

    @property
    def unknown_ops(self) -> dict[str, int]:
        """Calls per op without an op-registry entry (family "other"), most frequent first."""
        other = self.nodes.loc[self.nodes["family"] == "other", "op"]
        return {str(op): int(n) for op, n in other.value_counts().items()}

    def phase_nodes(self, phase: str) -> pd.DataFrame:
        return self.nodes[self.nodes["phase"] == phase]

    def save(self, path: str | Path) -> Path:
        """Write ``path/{nodes,edges,mem_events}.parquet`` and ``path/meta.json``."""
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        self.nodes.to_parquet(out / "nodes.parquet", index=False)
        self.edges.to_parquet(out / "edges.parquet", index=False)
        self.mem_events.to_parquet(out / "mem_events.parquet", index=False)
        (out / "meta.json").write_text(json.dumps(self.meta, indent=2, default=str))
        return out

    @classmethod
    def load(cls, path: str | Path) -> OpGraph:
        src = Path(path)
        return cls(
            _frame(pd.read_parquet(src / "nodes.parquet"), NODE_COLUMNS),
            _frame(pd.read_parquet(src / "edges.parquet"), EDGE_COLUMNS),
            _frame(pd.read_parquet(src / "mem_events.parquet"), EVENT_COLUMNS),
            json.loads((src / "meta.json").read_text()),
        )

    def to_json(self) -> str:
        return json.dumps(
            {
                "meta": self.meta,
                "nodes": self.nodes.to_dict(orient="list"),
                "edges": self.edges.to_dict(orient="list"),
                "mem_events": self.mem_events.to_dict(orient="list"),
            },
            default=str,
        )

    @classmethod
    def from_json(cls, text: str) -> OpGraph:
        doc = json.loads(text)
        return cls(
            _frame(pd.DataFrame(doc["nodes"]), NODE_COLUMNS),
            _frame(pd.DataFrame(doc["edges"]), EDGE_COLUMNS),
            _frame(pd.DataFrame(doc["mem_events"]), EVENT_COLUMNS),
            doc["meta"],
        )
