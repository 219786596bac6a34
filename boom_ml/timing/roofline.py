"""Roofline time per op: max(FLOPs / peak, bytes / bandwidth) + a kernel launch cost.

The first-order model and the fallback for op families without a learned head.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd

from boom_ml.gpus.spec import GpuSpec

# Per-kernel cost of a launch plus the gap before the next kernel, in eager PyTorch.
# An assumption (a few µs is the usual order of magnitude), replaced by learned models.
LAUNCH_MS = 0.005
MATRIX_FAMILIES = {"gemm", "conv", "attention"}
NO_GPU_FAMILIES = {"host"}


def compute_dtype(row_dtypes: str) -> str:
    """The dtype a matrix op computes in: its first floating input's dtype."""
    for dtype in json.loads(row_dtypes):
        if dtype in ("float16", "bfloat16", "float32", "float64"):
            return dtype
    return "float32"


def roofline_ms(nodes: pd.DataFrame, gpu: GpuSpec, tf32: bool = False) -> np.ndarray:
    """Predicted milliseconds for each node of an OpGraph on ``gpu``."""
    flops = nodes["flops"].to_numpy(dtype=float)
    moved = (nodes["bytes_read"] + nodes["bytes_written"]).to_numpy(dtype=float)
    matrix = nodes["family"].isin(MATRIX_FAMILIES).to_numpy()
    peaks = np.array(
        [
            gpu.peak_flops(compute_dtype(d), tf32=tf32) if m else gpu.fp32_tflops * 1e12
            for d, m in zip(nodes["input_dtypes"], matrix, strict=True)
        ]
    )
    seconds = np.maximum(flops / peaks, moved / gpu.bandwidth_bytes_per_s)
    ms = seconds * 1e3 + LAUNCH_MS
    ms[nodes["family"].isin(NO_GPU_FAMILIES).to_numpy()] = 0.0
    return ms
