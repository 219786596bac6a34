"""Roofline time per op: max(FLOPs / peak, bytes / bandwidth) + a kernel launch cost.

The first-order model and the fallback for op families without a learned head.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd

from boom_ml.gpus.spec import GpuSpec
from boom_ml.timing.tf32 import Tf32

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


def matrix_peaks(nodes: pd.DataFrame, gpu: GpuSpec, tf32: Tf32 | bool | None) -> np.ndarray:
    """Peak FLOP/s per node: the dtype's (TF32 per the node's family switch) for matrix
    families, the fp32 vector peak for the rest."""
    flags = Tf32.of(tf32)
    families = nodes["family"].astype(str)
    return np.array(
        [
            gpu.peak_flops(compute_dtype(d) if d else "float32", tf32=flags.for_family(f))
            if f in MATRIX_FAMILIES
            else gpu.fp32_tflops * 1e12
            for d, f in zip(nodes["input_dtypes"], families, strict=True)
        ]
    )


def roofline_ms(nodes: pd.DataFrame, gpu: GpuSpec, tf32: Tf32 | bool | None = None) -> np.ndarray:
    """Predicted milliseconds for each node of an OpGraph on ``gpu``."""
    flops = nodes["flops"].to_numpy(dtype=float)
    moved = (nodes["bytes_read"] + nodes["bytes_written"]).to_numpy(dtype=float)
    peaks = matrix_peaks(nodes, gpu, tf32)
    seconds = np.maximum(flops / peaks, moved / gpu.bandwidth_bytes_per_s)
    ms = seconds * 1e3 + LAUNCH_MS
    ms[nodes["family"].isin(NO_GPU_FAMILIES).to_numpy()] = 0.0
    return ms
