"""Where the GNN wins: the leave-one-out CV table and the per-cell choice it makes.

``cv_table`` scores the GNN and the sum of per-op times on the same held-out rows (per GPU,
per family, pooled) with the interval's held-out coverage; ``decide`` keeps the GNN for a cell
(family x AMP) only where its errors are smaller beyond chance.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from boom_ml.timing.gnn_artifact import regime

# The GNN replaces the per-op sum in a cell only where CV says it is better beyond chance: on
# 60 NeuSight rows two trainings of the same GNN differed by 0.8 points (10.6 vs 11.4 %), and
# a plain "lower MAPE" flipped that cell on 0.3 (fifth session; README, "Step time").
SIGNIFICANCE = 0.05


def mape(pred: np.ndarray, true: np.ndarray) -> float:
    return float(np.mean(np.abs(pred - true) / true) * 100) if len(true) else float("nan")


def cv_table(p: pd.DataFrame, covered: pd.DataFrame) -> pd.DataFrame:
    """MAPE of step time per held-out GPU / family, GNN vs sum of per-op, plus pooled lines;
    the 80 % interval's held-out coverage on GPU lines (``intervals.held_out_coverage``)."""
    inside = covered.set_index(["held_out", "row"])["inside"]
    lines = []

    def line(kind: str, held: str, sub: pd.DataFrame) -> None:
        base = mape(sub["baseline_ms"], sub["target_ms"])
        gnn = mape(sub["gnn_ms"], sub["target_ms"])
        cov = (
            inside.reindex(list(zip(sub["held_out"], sub["row"], strict=True)))
            if kind == "gpu"
            else None
        )
        pooled = held == "all (pooled)"
        heads = "each fold's" if pooled else ",".join(sorted(sub["heads_held_out"].unique()))
        lines.append({"held out": f"{kind}={held}", "rows": len(sub),
                      "sources": ",".join(sorted(sub["source"].unique())),
                      "per-op heads held out": heads,
                      "sum-of-per-op MAPE %": round(base, 1), "GNN MAPE %": round(gnn, 1),
                      "better": "GNN" if gnn < base else "per-op",
                      "80% coverage %": round(100 * float(cov.mean()), 1) if cov is not None else "-"})  # fmt: skip

    for (kind, held), sub in p.groupby(["kind", "held_out"], sort=False):
        line(kind, str(held), sub)
    for kind, sub in p.groupby("kind", sort=False):
        line(kind, "all (pooled)", sub)
    return pd.DataFrame(lines)


def decide(p: pd.DataFrame) -> tuple[dict[str, bool], pd.DataFrame]:
    """Per cell (family x AMP): use the GNN iff its errors on the cell's held-out-GPU rows are
    smaller than the per-op sum's, significantly (one-sided Wilcoxon signed-rank test on the
    paired absolute relative errors, p < ``SIGNIFICANCE``); otherwise the simpler per-op sum.
    Families outside the data ("other/amp", "other/no-amp") follow the leave-one-family-out
    rows, since a new kind of model is what that split simulates.
    """

    cells = [(c, sub) for c, sub in p[p["kind"] == "gpu"].groupby("cell")]
    lofo = p[p["kind"] == "family"]
    cells += [(c, sub) for c, sub in lofo.groupby([regime("other", a) for a in lofo["amp"]])]
    lines = []
    for cell, sub in cells:
        base = mape(sub["baseline_ms"], sub["target_ms"])
        gnn = mape(sub["gnn_ms"], sub["target_ms"])
        err_gnn = (sub["gnn_ms"] / sub["target_ms"] - 1).abs().to_numpy()
        err_base = (sub["baseline_ms"] / sub["target_ms"] - 1).abs().to_numpy()
        pvalue = _paired_pvalue(err_gnn, err_base)
        lines.append({"cell": cell, "rows": len(sub), "sum-of-per-op MAPE %": round(base, 1),
                      "GNN MAPE %": round(gnn, 1), "p (GNN better)": float(f"{pvalue:.2g}"),
                      "use GNN": bool(gnn < base and pvalue < SIGNIFICANCE)})  # fmt: skip
    table = pd.DataFrame(lines)
    return dict(zip(table["cell"], table["use GNN"], strict=True)), table


def _paired_pvalue(err_gnn: np.ndarray, err_base: np.ndarray) -> float:
    """One-sided p that the GNN's errors are smaller; 1 where no test is possible (fewer than
    two rows, or no row on which the two differ)."""
    from scipy.stats import wilcoxon

    if len(err_gnn) < 2 or np.all(err_gnn == err_base):
        return 1.0
    pvalue = float(wilcoxon(err_gnn, err_base, alternative="less").pvalue)
    return pvalue if np.isfinite(pvalue) else 1.0


def markdown(table: pd.DataFrame) -> str:
    cols = list(table.columns)
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(str(v) for v in r) + " |" for r in table.itertuples(index=False)]
    return "\n".join(out)
