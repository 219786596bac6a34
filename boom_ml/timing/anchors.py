"""No kernel is timed slower on a GPU than on a measured GPU it beats on every spec number.

The heads and the GEMM tile model are trees over a handful of measured GPUs: on a GPU they
never measured they can time a kernel slower than on a measured GPU that is worse on every
number of its spec sheet (fewer SMs, a lower clock, less bandwidth, L2, peak and power).
Such a GPU does at least as well on any kernel the worse one runs, so its time is capped at
the worse GPU's: the model's own prediction there, which sits on that GPU's measurements.

A GPU *dominates* another when it is at least as good on every field of
:data:`DOMINANCE_FIELDS` (a field the other GPU leaves blank is not compared; one this GPU
leaves blank, where the other gives it, is not "at least as good"), of the same or a newer
architecture. The anchors of a kernel row are the GPUs with measurements for the model that
times it (its head's training GPUs; a stream timed on the bandwidth curve, the elementwise
head's; a GEMM on the tile model, the GEMM head's, which learned from the same rows), and a
row is capped only on a GPU that its model never measured: a GPU's own measurements speak
for it. Nothing is fitted; in a cross-validation fold the held-out GPU is not an anchor (the
fold's heads never measured it) and its rows are capped by the fold's anchors alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd

from boom_ml.gpus.spec import GpuSpec
from boom_ml.timing.bandwidth import METHOD as CURVE_METHOD
from boom_ml.timing.features import heads_of, per_gpu
from boom_ml.timing.gemm import METHOD as GEMM_METHOD
from boom_ml.timing.gemm import override_gemm
from boom_ml.timing.size_floor import with_median

# Spec-sheet numbers where more is never slower (the fields the models read, and the peaks
# of every dtype); the architecture (sm_version) is compared the same way.
DOMINANCE_FIELDS = ("sm_count", "boost_clock_mhz", "memory_bandwidth_gbs", "l2_cache_mb",
                    "fp32_tflops", "tf32_tflops", "fp16_tflops", "bf16_peak_tflops", "tdp_w",
                    "sm_version")  # fmt: skip
CAP_NOTE = " (capped at {gpu})"  # appended to the method of a row the cap lowered


def dominates(a: GpuSpec, b: GpuSpec) -> bool:
    """``a`` is at least as good as ``b`` on every field of :data:`DOMINANCE_FIELDS` (and
    is not ``b``: a user's spec that took a packaged GPU's id but changed a number is another
    GPU)."""
    if a == b:
        return False
    for name in DOMINANCE_FIELDS:
        theirs = getattr(b, name)
        if theirs is None:
            continue
        ours = getattr(a, name)
        if ours is None or float(ours) < float(theirs):
            return False
    return True


def measured_by(rows: pd.DataFrame, pred: pd.DataFrame, model: Any) -> list[frozenset[str]]:
    """Per row: the GPUs with measurements for the model that timed it (empty for a
    calibrated roofline, which no GPU's rows fit)."""
    heads = getattr(model, "heads", {})

    def gpus(name: str) -> frozenset[str]:
        head = heads.get(name)
        return frozenset(head.gpus) if head is not None else frozenset()

    methods = pred["method"].astype(str).to_numpy()
    out = []
    for head, method in zip(heads_of(rows), methods, strict=True):
        if method.startswith(GEMM_METHOD):
            out.append(gpus("gemm"))
        elif method.startswith(CURVE_METHOD):
            out.append(gpus("elementwise"))
        elif method.startswith("per-op"):
            out.append(gpus(str(head)))
        else:
            out.append(frozenset())
    return out


def cap(
    rows: pd.DataFrame,
    gpus: list[GpuSpec],
    pred: pd.DataFrame,
    model: Any,
    time_on: Callable[[list[GpuSpec]], pd.DataFrame],
) -> pd.DataFrame:
    """``pred`` for ``rows`` repeated once per GPU (GPU-major) with each row lowered to the
    least its model gives it on an anchor the GPU dominates; the interval moves with the
    median (its width kept in ratio) and ``method`` names the anchor. ``time_on(specs)``:
    the uncapped predictions of ``rows`` on other GPUs, GPU-major (only medians are read)."""
    from boom_ml.gpus import get_gpu

    n = len(rows)
    if not n or not gpus:
        return pred
    measured = measured_by(rows, pred.iloc[:n], model)
    ids = sorted(set().union(*measured))
    specs = {a: get_gpu(a) for a in ids}
    need = [[a for a in ids if dominates(g, specs[a])] for g in gpus]
    used = sorted(set().union(*map(set, need)))
    if not used:
        return pred
    anchor_ms = time_on([specs[a] for a in used])["pred_ms"].to_numpy(dtype=float)
    anchor_ms = anchor_ms.reshape(len(used), n)
    has = np.array([[a in m for m in measured] for a in used])  # (anchors, rows)
    median = pred["pred_ms"].to_numpy(dtype=float).reshape(len(gpus), n)
    capped, by = median.copy(), np.full((len(gpus), n), -1)
    for k, gpu in enumerate(gpus):
        # the packaged GPU the rows' model measured, not a user spec that took its id
        packaged = gpu.id in specs and specs[gpu.id] == gpu
        own = np.array([packaged and gpu.id in m for m in measured])
        for a in need[k]:
            j = used.index(a)
            lower = has[j] & ~own & (anchor_ms[j] < capped[k])
            capped[k, lower], by[k, lower] = anchor_ms[j, lower], j
    if (by < 0).all():
        return pred
    notes = np.array([CAP_NOTE.format(gpu=used[j]) if j >= 0 else "" for j in by.ravel()])
    return with_median(pred, capped.ravel(), notes)


def time_kernel_rows(rows: pd.DataFrame, gpu: GpuSpec, per_op: Any, gemm: Any) -> pd.DataFrame:
    """Canonical kernel rows on ``gpu`` as a step times them: the heads (with the size
    floor), GEMM rows by the tile/wave model ``gemm`` (if any), then the cap."""
    pred = override_gemm(rows, gpu, per_op.predict_rows(rows, gpu), gemm)
    return cap(rows, [gpu], pred, per_op, lambda specs: time_uncapped(rows, specs, per_op, gemm))


def time_uncapped(rows: pd.DataFrame, gpus: list[GpuSpec], per_op: Any, gemm: Any) -> pd.DataFrame:
    """Median times of ``rows`` on each of ``gpus`` (GPU-major) as :func:`time_kernel_rows`
    times them, before the cap (p10/p90 repeat the median)."""
    frame, specs = per_gpu(rows, gpus)
    return override_gemm(frame, specs, per_op.predict_rows(frame, specs, median_only=True), gemm)
