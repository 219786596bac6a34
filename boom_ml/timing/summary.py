"""Fold per-node times into a TimeEstimate: sums by family, phase, op and module."""

from __future__ import annotations

import numpy as np
import pandas as pd

from boom_ml.estimates import TimeEstimate
from boom_ml.trace.module_paths import block_totals, group_by_block


def summarise(
    nodes: pd.DataFrame,
    per_node_ms: np.ndarray,
    method: str,
    top_n: int = 10,
    p10: np.ndarray | None = None,
    p90: np.ndarray | None = None,
    methods: np.ndarray | None = None,
) -> TimeEstimate:
    """Fold per-node times into a TimeEstimate (sums, and the top ops and modules).

    ``methods``: each node's per-op method (``per_op.predict_nodes``); a top op then says
    which model timed it (the one most of its nodes used).
    """
    frame = nodes.assign(ms=per_node_ms)
    if methods is not None:
        frame = frame.assign(method=methods)
    by_family = frame.groupby("family")["ms"].sum().sort_values(ascending=False)
    by_op = frame.groupby(["op", "phase"])["ms"].agg(["sum", "count"]).nlargest(top_n, "sum")
    per_module = frame.groupby("module")["ms"].sum()
    by_module = per_module.nlargest(top_n)
    methods_of = _top_methods(frame, set(by_op.index))
    by_phase = frame.groupby("phase")["ms"].sum()
    return TimeEstimate(
        step_ms=float(per_node_ms.sum()),
        method=method,
        p10_ms=float(p10.sum()) if p10 is not None else None,
        p90_ms=float(p90.sum()) if p90 is not None else None,
        by_family={k: round(float(v), 4) for k, v in by_family.items()},
        by_phase={k: round(float(v), 4) for k, v in by_phase.items()},
        top_ops=[
            {
                "op": op,
                "phase": phase,
                "ms": round(float(r["sum"]), 4),
                "calls": int(r["count"]),
                **({"method": methods_of[op, phase]} if (op, phase) in methods_of else {}),
            }
            for (op, phase), r in by_op.iterrows()
        ],
        top_modules=[
            {"module": m or "(top level)", "ms": round(float(v), 4)} for m, v in by_module.items()
        ],
        top_module_groups=[
            {**g, "module": g["module"] or "(top level)", "ms": round(float(g["ms"]), 4)}
            for g in group_by_block(per_module.items(), "ms", top_n)
        ],
        block_totals=[
            {**b, "ms": round(float(b["ms"]), 4)} for b in block_totals(per_module.items(), "ms")
        ],
    )


def _top_methods(frame: pd.DataFrame, keys: set[tuple[str, str]]) -> dict[tuple[str, str], str]:
    """Per (op, phase) of ``keys``, the method most of its nodes used (one count over all)."""
    if "method" not in frame.columns:
        return {}
    out: dict[tuple[str, str], str] = {}
    counts = frame.value_counts(["op", "phase", "method"])  # most frequent first
    for op, phase, method in counts.index:
        if (op, phase) in keys and (op, phase) not in out:
            out[op, phase] = str(method)
    return out
