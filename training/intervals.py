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

How wide: the p10/p90 of the calibration GPUs' errors hold 80 % of *their* rows, but a GPU none
of them is has an error of its own on top (a run's bias, an architecture the heads read
wrongly), so those percentiles hold fewer of its rows. The quantile level is therefore chosen
by the same leave-one-GPU-out inside the calibration set (``choose_level``): the narrowest
central level on LEVEL_GRID whose intervals, each calibrated without one of the calibration
GPUs, hold at least TARGET of that GPU's rows, pooled over them. The held-out coverage of GPU g
nests it: g's level is chosen on the other GPUs alone. (Rule fixed before it was scored, 21st
session; the plain 10th/90th percentiles had covered 69.1 % of held-out steps.)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from boom_ml.timing.gnn_artifact import interval_for

LEVELS = (0.1, 0.9)  # the plain percentiles: the narrowest interval choose_level may pick
# The share of a GPU's steps the interval is meant to hold when no fold saw that GPU.
TARGET = 0.8
# Central levels choose_level tries, narrowest first: 80 % to 98 % in steps of one point.
LEVEL_GRID = tuple(round(0.80 + 0.01 * k, 2) for k in range(19))
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


def quantile_levels(level: float) -> tuple[float, float]:
    """The lower and upper quantile of a central ``level`` (0.8 -> 0.1, 0.9)."""
    return round((1 - level) / 2, 4), round((1 + level) / 2, 4)


def fit(log_ratio: np.ndarray, gpu: np.ndarray, level: float = TARGET) -> dict[str, float]:
    """The interval's (log lower, log upper) multipliers of measured / estimated: its central
    ``level`` quantiles, each GPU weighing the same (stored as log_p10 / log_p90, the keys the
    predictor reads, whatever the level)."""
    w = _equal_gpu_weights(gpu)
    lo, hi = weighted_quantiles(np.asarray(log_ratio, float), w, quantile_levels(level))
    return {"log_p10": float(lo), "log_p90": float(hi), "level": float(level),
            "rows": int(len(log_ratio)), "gpus": int(len(set(gpu)))}  # fmt: skip


def chosen(p: pd.DataFrame, use: dict[str, bool]) -> pd.DataFrame:
    """Per prediction row: the method the predictor would use in its cell, and its ms."""
    gnn = p["cell"].map(lambda c: bool(use.get(c, False))).to_numpy()
    return p.assign(method=np.where(gnn, "gnn", "per-op"),
                    used_ms=np.where(gnn, p["gnn_ms"], p["baseline_ms"]))  # fmt: skip


def _per_method(p: pd.DataFrame, level: float) -> dict[str, Any]:
    """The per-op interval from every row's baseline, the GNN's from the rows that use it."""
    out: dict[str, Any] = {}
    true = p["target_ms"].to_numpy()
    gpu = p["held_out"].astype(str).to_numpy()
    out["per-op"] = fit(np.log(true / p["baseline_ms"].to_numpy()), gpu, level)
    g = (p["method"] == "gnn").to_numpy()
    if g.any():
        out["gnn"] = fit(np.log(true[g] / p["gnn_ms"].to_numpy()[g]), gpu[g], level)
    return out


def calibrate(p: pd.DataFrame, use: dict[str, bool], level: float | None = None) -> dict[str, Any]:
    """Per method, the interval fitted on held-out-GPU rows ``p`` (kind == "gpu"), and under
    "by_family" per family and method where that family's rows span MIN_GPUS GPUs; at the
    central ``level``, by default the one ``choose_level`` finds on ``p``'s GPUs."""
    p = chosen(p[p["kind"] == "gpu"], use)
    if level is None:
        level = choose_level(p, use)
    out = _per_method(p, level)
    by_family = {}
    for family, rows in p.groupby("family", sort=True):
        own = {m: c for m, c in _per_method(rows, level).items() if c["gpus"] >= MIN_GPUS}
        if own:
            by_family[str(family)] = own
    return {**out, "by_family": by_family}


def _inside(p: pd.DataFrame, cal: dict[str, Any]) -> np.ndarray:
    """Which rows of ``p`` (with method / used_ms) lie inside the bounds the predictor picks."""
    inside = np.zeros(len(p), dtype=bool)
    manifest = {"interval": cal}
    for (method, family), idx in p.groupby(["method", "family"], sort=False).indices.items():
        # no GNN calibration (no training row used it): the per-op bounds, as the predictor
        lo, hi = interval_for(manifest, method, str(family)) or interval_for(
            manifest, "per-op", str(family)
        )
        est, true = p["used_ms"].to_numpy()[idx], p["target_ms"].to_numpy()[idx]
        inside[idx] = (est * np.exp(lo) <= true) & (true <= est * np.exp(hi))
    return inside


def held_out_coverage(
    p: pd.DataFrame, use: dict[str, bool], level: float | None = None
) -> pd.DataFrame:
    """Per held-out GPU: which of its rows lie inside the interval calibrated without it, for
    the method the predictor uses on each row; at ``level``, or (None) at the level
    ``choose_level`` finds on the other GPUs alone."""
    p = chosen(p[p["kind"] == "gpu"], use)
    inside = np.zeros(len(p), dtype=bool)
    gpus = p["held_out"].astype(str).to_numpy()
    for g in np.unique(gpus):
        mine = gpus == g
        inside[mine] = _inside(p[mine], calibrate(p[~mine], use, level))
    return p.assign(inside=inside)


def choose_level(p: pd.DataFrame, use: dict[str, bool]) -> float:
    """The narrowest central level on LEVEL_GRID whose leave-one-GPU-out intervals among
    ``p``'s GPUs hold at least TARGET of their held-out rows (pooled); the widest where none
    does, TARGET where fewer than two GPUs leave nothing to hold out."""
    p = chosen(p[p["kind"] == "gpu"], use)
    if p["held_out"].nunique() < 2:
        return TARGET
    for level in LEVEL_GRID:
        if held_out_coverage(p, use, level)["inside"].mean() >= TARGET:
            return level
    return LEVEL_GRID[-1]


def coverage_table(cov: pd.DataFrame) -> pd.DataFrame:
    """Held-out coverage (``held_out_coverage``'s rows) per GPU and per source, and pooled
    (rows and GPU-mean)."""
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
        q = quantile_levels(c.get("level", TARGET))
        return (f"  {scope:<22} x{lo:.3f} .. x{hi:.3f}  (quantiles {q[0]:.3f}-{q[1]:.3f} of "
                f"{c['rows']} rows, {c['gpus']} GPUs)")  # fmt: skip

    lines = [line(m, c) for m, c in interval.items() if m in ("per-op", "gnn")]
    for family, methods in interval.get("by_family", {}).items():
        lines += [line(f"{family} / {m}", c) for m, c in methods.items()]
    return "\n".join(lines)
