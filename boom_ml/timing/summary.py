"""Fold per-node times into a TimeEstimate: sums by family, phase, op and module."""

from __future__ import annotations

import numpy as np
import pandas as pd

from boom_ml.estimates import TimeEstimate
from boom_ml.identity_cache import IdentityCache
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
    which model timed it (the one most of its nodes used). ``top_n`` 0: the totals alone
    (step, p10, p90), no breakdown (a GPU timed only to bound another: ``dominance.py``).
    """
    if top_n == 0:
        return TimeEstimate(
            step_ms=float(per_node_ms.sum()),
            method=method,
            p10_ms=float(p10.sum()) if p10 is not None else None,
            p90_ms=float(p90.sum()) if p90 is not None else None,
        )
    groups = _GROUPS.get(nodes, (), lambda: _Groups(nodes))
    by_family = groups.sums("family", per_node_ms).sort_values(ascending=False)
    by_op = pd.DataFrame({"sum": groups.sums(OP_PHASE, per_node_ms), "count": groups.counts})
    by_op = by_op.nlargest(top_n, "sum")
    per_module = groups.sums("module", per_node_ms)
    by_module = per_module.nlargest(top_n)
    if methods is None:
        methods_of: dict[tuple[str, str], str] = {}
    else:
        # the same methods on most GPUs of a call: counted once per distinct list
        key = ("methods", "\x00".join(map(str, methods)))
        methods_of = _GROUPS.get(nodes, key, lambda: _top_methods(nodes.assign(method=methods)))
    by_phase = groups.sums("phase", per_node_ms)
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
                "ms": round(float(ms), 4),
                "calls": int(calls),
                **({"method": methods_of[op, phase]} if (op, phase) in methods_of else {}),
            }
            for (op, phase), ms, calls in zip(
                by_op.index, by_op["sum"].to_numpy(), by_op["count"].to_numpy(), strict=True
            )
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


OP_PHASE = ("op", "phase")


class _Groups:
    """A graph's nodes numbered by family, (op, phase), module and phase, once per graph:
    a prediction over many GPUs sums each GPU's node times by the same groups, and
    grouping strings is most of a summary's cost. Sums group integer codes as pandas
    groups the strings (the same order, the same summation), so the totals are the same."""

    def __init__(self, nodes: pd.DataFrame) -> None:
        self._codes: dict[object, np.ndarray] = {}
        self._labels: dict[object, pd.Index] = {}
        for by in ("family", OP_PHASE, "module", "phase"):
            grouped = nodes.groupby(list(by) if isinstance(by, tuple) else by)
            self._codes[by] = grouped.ngroup().to_numpy()
            sizes = grouped.size()
            self._labels[by] = sizes.index
            if by == OP_PHASE:
                self.counts = sizes.to_numpy()  # calls per (op, phase)

    def sums(self, by: object, values: np.ndarray) -> pd.Series:
        codes = self._codes[by]
        keep = codes >= 0  # a node without a key is in no group, as in pandas
        total = pd.Series(values[keep]).groupby(codes[keep]).sum()
        return pd.Series(total.to_numpy(), index=self._labels[by][total.index.to_numpy()])


_GROUPS: IdentityCache[object] = IdentityCache(64)


def _top_methods(frame: pd.DataFrame) -> dict[tuple[str, str], str]:
    """Per (op, phase), the method most of its nodes used (one count over all)."""
    if "method" not in frame.columns:
        return {}
    out: dict[tuple[str, str], str] = {}
    counts = frame.value_counts(["op", "phase", "method"])  # most frequent first
    for op, phase, method in counts.index:
        if (op, phase) not in out:
            out[op, phase] = str(method)
    return out
