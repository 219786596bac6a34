"""A kernel is never faster than the same kernel on one element (one image): the size floor.

The heads learn time over a roofline (bytes / bandwidth + ``LAUNCH_MS``). NeuSight's fp32
elementwise rows are flat at the host's per-op time (about 26 µs) up to 2^20-2^21 elements on
every GPU it measured, so the head learns a ratio that falls as the roofline grows. On a GPU
with more bandwidth than any measured one that ratio meets a shorter roofline, and the flat
part shrinks with it: an fp32 ``add`` on an H100 SXM came out at 26.5 µs for 2^18 elements and
18.2 µs for 2^20, so a step with more tokens took less time.

The floor of a row is what the same model predicts, on the same GPU, for the same op on one
element (a row-wise op: on one row of its length): the op's fixed cost, which does not shrink
with a bandwidth. Nothing is fitted to make it.

A convolution's floor is the same convolution on one image (batch 1, every other field kept):
a kernel over N images does one image's work and more, so the fastest algorithm for N images
is no faster than the fastest for one. The conv head learns a ratio over the roofline that
falls from batch 1 to batch 4-8 (its fixed cost spread over more work): in bf16 a batch-1 3x3
conv came out 1.7-2.2x slower than the same conv at batch 4 (B200, H100 SXM, A100-40GB PCIe),
and resnet50 bf16 on a B200 took 16.9 ms at batch 1 and 14.1 at batch 8. GEMM and attention
heads are left alone: their shapes have several sizes and no one of them is the batch.

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
CONV_HEAD = "conv"  # its floor is the same convolution on one image
# Appended to the ``method`` of a row the floor raised: its time is its smallest copy's.
FLOOR_NOTE = " (one-element floor)"
CONV_FLOOR_NOTE = " (one-image floor)"


class Predictor(Protocol):
    def predict_features(self, feats: pd.DataFrame, median_only: bool = False) -> pd.DataFrame:
        """``pred_ms`` (and the interval) per featurised row."""
        ...


def smallest_rows(rows: pd.DataFrame) -> tuple[pd.DataFrame, np.ndarray]:
    """Each row of ``rows`` of :data:`SIZED_HEADS` cut to one element (a row-wise op to one
    row, its length kept), each convolution to one image, and, per copy, the position in
    ``rows`` of the row it was cut from. Rows already that small have no copy."""
    if rows.empty:
        return rows.iloc[:0], np.zeros(0, dtype=np.int64)
    heads = heads_of(rows)
    sized, sized_source = _one_element(rows, heads)
    convs, conv_source = _one_image(rows, heads)
    if convs.empty:
        return sized, sized_source
    if sized.empty:
        return convs, conv_source
    both = pd.concat([sized, convs], ignore_index=True)
    return both, np.concatenate([sized_source, conv_source])


def _one_image(rows: pd.DataFrame, heads: np.ndarray) -> tuple[pd.DataFrame, np.ndarray]:
    """Each convolution of ``rows`` over more than one image, cut to one (its own FLOP and
    byte counts, where it has them, scaled with its images: weights are not, but the conv
    head's features are made from the shape, not from these counts)."""
    if "batch" not in rows.columns:
        return rows.iloc[:0], np.zeros(0, dtype=np.int64)
    batch = numeric(rows, "batch")
    source = np.flatnonzero((heads == CONV_HEAD) & (batch > 1))
    small = rows.iloc[source].reset_index(drop=True).copy()
    for col in COUNTED:
        if col in small.columns:
            small[col] = numeric(small, col) / batch[source]
    small["batch"] = 1
    return small, source


def _one_element(rows: pd.DataFrame, heads: np.ndarray) -> tuple[pd.DataFrame, np.ndarray]:
    """Each row of :data:`SIZED_HEADS` cut to one element (a row-wise op to one row)."""
    if "numel" not in rows.columns:
        return rows.iloc[:0], np.zeros(0, dtype=np.int64)
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
    """The smallest copies of a frame of kernel rows, featurised once (distinct ones only)."""

    feats: pd.DataFrame  # features of the distinct copies
    codes: np.ndarray  # per copy: its distinct copy's position in ``feats``
    source: np.ndarray  # per copy: the row of the frame it was cut from
    n_rows: int
    conv: np.ndarray  # per frame row: a convolution (its floor is one image, not one element)

    @classmethod
    def of(cls, rows: pd.DataFrame, gpus: Mapping[str, GpuSpec] | GpuSpec) -> SizeFloor:
        """``rows`` as :func:`kernel_features` takes them (with ``gpu_id`` for a mapping)."""
        small, source = smallest_rows(rows)
        conv = np.zeros(len(rows), dtype=bool)
        if small.empty:
            return cls(pd.DataFrame(), np.zeros(0, np.int64), source, len(rows), conv)
        conv[source] = heads_of(small) == CONV_HEAD
        distinct, codes = distinct_rows(small)
        return cls(kernel_features(distinct, gpus), codes, source, len(rows), conv)

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
        notes = np.where(self.conv, CONV_FLOOR_NOTE, FLOOR_NOTE)
        return with_median(pred, lifted, np.where(lifted > median, notes, ""))


def with_median(pred: pd.DataFrame, median: np.ndarray, notes: np.ndarray) -> pd.DataFrame:
    """``pred`` with its ``pred_ms`` moved to ``median``: the interval moves with it, keeping
    its width in ratio, and each row's ``method`` gets its note ('' for none). Shared by the
    size floor and the anchor cap (``anchors.py``)."""
    old = pred["pred_ms"].to_numpy(dtype=float)
    ratio = np.where(old > 0, median / np.where(old > 0, old, 1), 1)
    out = pred.copy()
    # the new median itself, not a product that rounds off it, and each side of the interval
    # kept on its side where the product rounds across
    out["pred_ms"] = median
    if "p10_ms" in out.columns:
        out["p10_ms"] = np.minimum(pred["p10_ms"].to_numpy(dtype=float) * ratio, median)
        out["p90_ms"] = np.maximum(pred["p90_ms"].to_numpy(dtype=float) * ratio, median)
    if "method" in out.columns:
        changed = notes != ""
        method = out["method"].to_numpy(dtype=object).copy()
        method[changed] = [f"{m}{n}" for m, n in zip(method[changed], notes[changed], strict=True)]
        out["method"] = method
    return out
