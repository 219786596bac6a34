"""A kernel is never faster than the same kernel on one element: the size floor.

The heads learn time over a roofline (bytes / bandwidth + ``LAUNCH_MS``). NeuSight's fp32
elementwise rows are flat at the host's per-op time (about 26 µs) up to 2^20-2^21 elements on
every GPU it measured, so the head learns a ratio that falls as the roofline grows. On a GPU
with more bandwidth than any measured one that ratio meets a shorter roofline, and the flat
part shrinks with it: an fp32 ``add`` on an H100 SXM came out at 26.5 µs for 2^18 elements and
18.2 µs for 2^20, so a step with more tokens took less time.

The floor of a row is what the same model predicts, on the same GPU, for the same op on one
element (a row-wise op: on one row of its length): the op's fixed cost, which does not shrink
with a bandwidth. Nothing is fitted to make it. Matrix heads (GEMM, convolution, attention) are
left alone: their shape has more than one size.

Why one element and not every smaller size: a floor at the most the model gives any smaller
power of two makes a step monotone in size, but it is the maximum of some twenty noisy
predictions, biased upward: on the packaged heads' own training rows it raised 66 % of the
A100-40GB's elementwise rows and took their error from 3.4 to 6.1 %, where the one-element floor
raises 0.3 % and leaves 3.4 % (README, "Per-op time").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import pandas as pd

from boom_ml.gpus.spec import GpuSpec
from boom_ml.timing.features import distinct_rows, heads_of, kernel_features, numeric, row_count

# Heads whose rows are sized by one count (elements, or rows of a row-wise op).
SIZED_HEADS = frozenset({"elementwise", "norm", "softmax", "optimizer", "copy"})
ROW_WISE_HEADS = frozenset({"norm", "softmax"})
COUNTED = ("flops", "bytes")  # a node's own counts, scaled with its elements
# Appended to the ``method`` of a row the floor raised: its time is its one-element copy's.
FLOOR_NOTE = " (one-element floor)"


class Predictor(Protocol):
    def predict_features(self, feats: pd.DataFrame, median_only: bool = False) -> pd.DataFrame:
        """``pred_ms`` (and the interval) per featurised row."""
        ...


def smallest_rows(rows: pd.DataFrame) -> tuple[pd.DataFrame, np.ndarray]:
    """Each row of ``rows`` of :data:`SIZED_HEADS` cut to one element (a row-wise op to one
    row, its length kept), and, per copy, the position in ``rows`` of the row it was cut from.
    Rows already that small have no copy."""
    if rows.empty or "numel" not in rows.columns:
        return rows.iloc[:0], np.zeros(0, dtype=np.int64)
    heads = heads_of(rows)
    numel, n_rows, cols = numeric(rows, "numel"), row_count(rows), numeric(rows, "cols")
    row_wise = np.isin(heads, list(ROW_WISE_HEADS)) & (n_rows >= 1) & np.isfinite(cols)
    count = np.where(row_wise, n_rows, numel)
    source = np.flatnonzero(np.isin(heads, list(SIZED_HEADS)) & (count > 1) & (numel > 0))
    small = rows.iloc[source].reset_index(drop=True).copy()
    wise, length = row_wise[source], cols[source]
    new_numel = np.where(wise, length, 1.0)
    # a stream's copy is one row of one column; a row-wise op's one row of its length
    small["rows"] = np.where(wise | ~np.isnan(length), 1.0, np.nan)
    small["cols"] = np.where(wise | np.isnan(length), length, 1.0)
    for col in COUNTED:
        if col in small.columns:
            small[col] = numeric(small, col) * new_numel / numel[source]
    small["numel"] = new_numel
    return small, source


@dataclass(frozen=True)
class SizeFloor:
    """The one-element copies of a frame of kernel rows, featurised once (distinct ones only)."""

    feats: pd.DataFrame  # features of the distinct copies
    codes: np.ndarray  # per copy: its distinct copy's position in ``feats``
    source: np.ndarray  # per copy: the row of the frame it was cut from
    n_rows: int

    @classmethod
    def of(cls, rows: pd.DataFrame, gpus: Mapping[str, GpuSpec] | GpuSpec) -> SizeFloor:
        """``rows`` as :func:`kernel_features` takes them (with ``gpu_id`` for a mapping)."""
        small, source = smallest_rows(rows)
        if small.empty:
            return cls(pd.DataFrame(), np.zeros(0, np.int64), source, len(rows))
        distinct, codes = distinct_rows(small)
        return cls(kernel_features(distinct, gpus), codes, source, len(rows))

    def lift(self, pred: pd.DataFrame, model: Predictor) -> pd.DataFrame:
        """``pred`` (one row per frame row) with each row raised to its floor; the interval
        moves with the median, keeping its width in ratio, and ``method`` says the floor."""
        if not len(self.source):
            return pred
        small_ms = model.predict_features(self.feats, median_only=True)["pred_ms"].to_numpy()
        floor = np.zeros(self.n_rows)
        floor[self.source] = small_ms[self.codes]
        median = pred["pred_ms"].to_numpy(dtype=float)
        lifted = np.maximum(median, floor)
        raise_by = np.where(median > 0, lifted / np.where(median > 0, median, 1), 1)
        out = pred.copy()
        # the floor itself as the median, not a product that rounds below it, and each side
        # of the interval kept on its side where the product rounds across
        out["pred_ms"] = lifted
        if "method" in out.columns:
            raised = lifted > median
            out.loc[raised, "method"] = out.loc[raised, "method"].astype(str) + FLOOR_NOTE
        out["p10_ms"] = np.minimum(pred["p10_ms"].to_numpy(dtype=float) * raise_by, lifted)
        out["p90_ms"] = np.maximum(pred["p90_ms"].to_numpy(dtype=float) * raise_by, lifted)
        return out
