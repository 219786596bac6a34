"""Calibrated p10/p90 of the step time, from held-out-GPU cross-validation predictions.

The interval is multiplicative around the step estimate: [est * e^q10, est * e^q90], with
q10/q90 the 10th/90th percentiles of log(measured / estimated) over the predictions of the
leave-one-GPU-out folds (each row predicted by a model that never saw its GPU, per-op heads
included). Each held-out GPU weighs the same in the percentiles, so that the 298 RTX 3090
rows do not set the interval alone. One calibration per method the predictor can use:
"per-op" from the sum-of-per-op predictions of every held-out-GPU row, "gnn" from the GNN
predictions of rows in the cells where the GNN is used.

Each method is calibrated per model family as well ("by_family"): CNN rows miss by much more
than transformer rows, so one pooled interval covers too few CNN rows and nearly every
transformer row (held out, the 80 % interval covered 53 % vs 98 % of them). A family gets its
own interval for a method only where its rows of that method come from at least MIN_GPUS
held-out GPUs; otherwise the method's pooled interval applies to it.

The coverage printed per held-out GPU is itself held out: the interval that scores GPU g is
calibrated on the other GPUs' rows only (the packaged one uses all of them), and each row
is scored with the bounds the predictor would pick (``gnn_artifact.interval_for``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from boom_ml.timing.gnn_artifact import interval_for

LEVELS = (0.1, 0.9)
# A family's own interval needs rows from this many held-out GPUs: its quantiles stand for the
# error on a GPU none of its folds saw, and one or two GPUs cannot speak for an unseen GPU.
MIN_GPUS = 3


def weighted_quantiles(x: np.ndarray, w: np.ndarray, qs: tuple[float, ...]) -> np.ndarray:
    """Quantiles of ``x`` under weights ``w`` (midpoint rule on the sorted cumulative weight)."""
    order = np.argsort(x)
    x, w = x[order], w[order]
    cum = (np.cumsum(w) - 0.5 * w) / w.sum()
    return np.interp(qs, cum, x)


def _equal_gpu_weights(gpu: np.ndarray) -> np.ndarray:
    counts = pd.Series(gpu).map(pd.Series(gpu).value_counts()).to_numpy(dtype=float)
    return 1.0 / counts


def fit(log_ratio: np.ndarray, gpu: np.ndarray) -> dict[str, float]:
    """(log p10, log p90) of measured / estimated, each GPU weighing the same."""
    lo, hi = weighted_quantiles(np.asarray(log_ratio, float), _equal_gpu_weights(gpu), LEVELS)
    return {"log_p10": float(lo), "log_p90": float(hi), "rows": int(len(log_ratio)),
            "gpus": int(len(set(gpu)))}  # fmt: skip


def chosen(p: pd.DataFrame, use: dict[str, bool]) -> pd.DataFrame:
    """Per prediction row: the method the predictor would use in its cell, and its ms."""
    gnn = p["cell"].map(lambda c: bool(use.get(c, False))).to_numpy()
    return p.assign(method=np.where(gnn, "gnn", "per-op"),
                    used_ms=np.where(gnn, p["gnn_ms"], p["baseline_ms"]))  # fmt: skip


def _per_method(p: pd.DataFrame) -> dict[str, Any]:
    """The per-op interval from every row's baseline, the GNN's from the rows that use it."""
    out: dict[str, Any] = {}
    true = p["target_ms"].to_numpy()
    gpu = p["held_out"].astype(str).to_numpy()
    out["per-op"] = fit(np.log(true / p["baseline_ms"].to_numpy()), gpu)
    g = (p["method"] == "gnn").to_numpy()
    if g.any():
        out["gnn"] = fit(np.log(true[g] / p["gnn_ms"].to_numpy()[g]), gpu[g])
    return out


def calibrate(p: pd.DataFrame, use: dict[str, bool]) -> dict[str, Any]:
    """Per method, the interval fitted on held-out-GPU rows ``p`` (kind == "gpu"), and under
    "by_family" per family and method where that family's rows span MIN_GPUS GPUs."""
    p = chosen(p[p["kind"] == "gpu"], use)
    out = _per_method(p)
    by_family = {}
    for family, rows in p.groupby("family", sort=True):
        own = {m: c for m, c in _per_method(rows).items() if c["gpus"] >= MIN_GPUS}
        if own:
            by_family[str(family)] = own
    return {**out, "by_family": by_family}


def held_out_coverage(p: pd.DataFrame, use: dict[str, bool]) -> pd.DataFrame:
    """Per held-out GPU: share (%) of its rows inside the 80 % interval calibrated without
    it, for the method the predictor uses on each row."""
    p = chosen(p[p["kind"] == "gpu"], use)
    inside = np.zeros(len(p), dtype=bool)
    gpus = p["held_out"].astype(str).to_numpy()
    for g in np.unique(gpus):
        mine = np.flatnonzero(gpus == g)
        cal = {"interval": calibrate(p.iloc[np.setdiff1d(np.arange(len(p)), mine)], use)}
        for i in mine:
            method, family = p["method"].iat[i], str(p["family"].iat[i])
            # no GNN calibration (no training row used it): the per-op bounds, as before
            lo, hi = interval_for(cal, method, family) or interval_for(cal, "per-op", family)
            est, true = p["used_ms"].iat[i], p["target_ms"].iat[i]
            inside[i] = est * np.exp(lo) <= true <= est * np.exp(hi)
    return p.assign(inside=inside)


def coverage_table(p: pd.DataFrame, use: dict[str, bool]) -> pd.DataFrame:
    """Held-out coverage per GPU and per source, and pooled (rows and GPU-mean)."""
    cov = held_out_coverage(p, use)
    lines = []
    for key, col in (("gpu", "held_out"), ("source", "source")):
        for name, sub in cov.groupby(col, sort=True):
            lines.append({"rows of": f"{key}={name}", "rows": len(sub),
                          "80% interval coverage %": round(100 * sub["inside"].mean(), 1)})  # fmt: skip
    lines.append({"rows of": "all (pooled rows)", "rows": len(cov),
                  "80% interval coverage %": round(100 * cov["inside"].mean(), 1)})  # fmt: skip
    per_gpu = cov.groupby("held_out")["inside"].mean()
    lines.append({"rows of": "all (mean of GPUs)", "rows": len(cov),
                  "80% interval coverage %": round(100 * per_gpu.mean(), 1)})  # fmt: skip
    return pd.DataFrame(lines)


def describe(interval: dict[str, Any]) -> str:
    """One line per fitted interval: its scope, the multipliers of the estimate, its support."""

    def line(scope: str, c: dict[str, Any]) -> str:
        lo, hi = np.exp(c["log_p10"]), np.exp(c["log_p90"])
        return f"  {scope:<22} x{lo:.3f} .. x{hi:.3f}  ({c['rows']} rows, {c['gpus']} GPUs)"

    lines = [line(m, c) for m, c in interval.items() if m in ("per-op", "gnn")]
    for family, methods in interval.get("by_family", {}).items():
        lines += [line(f"{family} / {m}", c) for m, c in methods.items()]
    return "\n".join(lines)
